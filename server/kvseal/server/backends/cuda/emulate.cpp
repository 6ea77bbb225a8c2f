// SPDX-License-Identifier: Apache-2.0
//
// CPU emulation of the kvseal kernels, built with g++ into a shared library and
// driven from Python (kvseal.server.backends.cuda.emulated) through the C ABI below.
//
// It includes the very headers the GPU kernels use and runs the whole grid on one
// host thread: for every CTA, each phase is run for all its threads before the
// next phase starts, which is what __syncthreads() guarantees on the GPU.
// Shared memory is one KvsShared per CTA, filled with a junk pattern before each
// CTA so that reading shared memory nobody wrote shows up as wrong output rather
// than silently working; per-thread registers carried across barriers are an
// array of KvsThreadState. CTAs can run in a shuffled order to check that the
// result does not depend on the order in which the hardware schedules them.
//
// Not a production CPU implementation (slow, T-table AES): a test vehicle.

#include <stdint.h>
#include <string.h>

#include <memory>
#include <new>
#include <vector>

#include "kernels.cuh"

#define KVSEAL_EMU_ABI_VERSION 1u

namespace {

enum class Kernel { seal, verify, open };

kvs_u64 splitmix64(kvs_u64& s) {
    kvs_u64 z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// CTA execution order: identity for seed 0, else a seeded Fisher-Yates shuffle.
std::vector<kvs_u32> cta_order(kvs_u32 n, kvs_u64 seed) {
    std::vector<kvs_u32> order(n);
    for (kvs_u32 i = 0; i < n; ++i) order[i] = i;
    if (seed != 0) {
        for (kvs_u32 i = n; i > 1; --i) {
            kvs_u32 j = (kvs_u32)(splitmix64(seed) % i);
            kvs_u32 t = order[i - 1];
            order[i - 1] = order[j];
            order[j] = t;
        }
    }
    return order;
}

// After a CTA: no key-derived value may be left in shared memory (round keys, the
// table of H^T, and the `red_nodes` nodes of the reduction tree).
bool secrets_wiped(const KvsShared& sh, kvs_u32 red_nodes) {
    kvs_u32 any = 0;
    for (kvs_u32 w : sh.rk) any |= w;
    for (kvs_u32 w : sh.htab) any |= w;
    for (kvs_u32 i = 0; i < red_nodes; ++i) any |= (kvs_u32)(sh.u.red[i].hi | sh.u.red[i].lo);
    return any == 0;
}

// Mirrors kernels.cu phase by phase; keep the two in step.
int run_grid(const KvsBatch* batch, Kernel kernel, kvs_u64 order_seed) {
    if (!batch) return KVS_E_NULL;
    int rc = kvs_batch_check(batch);
    if (rc != KVS_OK) return rc;
    const KvsBatch& p = *batch;
    const kvs_u32 nthr = p.threads_per_cta;
    const kvs_u32 grid = p.num_blocks * p.ctas_per_block;
    std::unique_ptr<KvsShared> sh(new (std::nothrow) KvsShared);
    if (!sh) return KVS_E_NULL;
    std::vector<KvsThreadState> st(nthr);
    for (kvs_u32 g : cta_order(grid, order_seed)) {
        memset(sh.get(), 0xA5, sizeof(KvsShared));  // uninitialised shared memory
        for (kvs_u32 t = 0; t < nthr; ++t) {
            st[t].acc = kvs_block(0xDEADBEEFull, 0xDEADBEEFull);
            st[t].ej0 = st[t].acc;  // registers hold junk until written
        }
        const bool open = kernel == Kernel::open;
        for (kvs_u32 t = 0; t < nthr; ++t) kvs_phase_setup(p, *sh, g, t, nthr, !open);
        // __syncthreads()
        if (open) {
            for (kvs_u32 t = 0; t < nthr; ++t) kvs_phase_open_gate(p, *sh, t, nthr);
            // __syncthreads()
            for (kvs_u32 t = 0; t < nthr; ++t) kvs_phase_open_main(p, *sh, g, t, nthr);
            // __syncthreads()
            for (kvs_u32 t = 0; t < nthr; ++t) kvs_phase_open_wipe(*sh, t, nthr);
            if (!secrets_wiped(*sh, 0)) return KVS_E_SECRET_LEFT;
            continue;
        }
        for (kvs_u32 t = 0; t < nthr; ++t) {
            if (kernel == Kernel::seal)
                kvs_phase_seal_main(p, *sh, st[t], g, t, nthr);
            else
                kvs_phase_verify_main(p, *sh, st[t], g, t, nthr);
        }
        // __syncthreads()
        for (kvs_u32 t = 0; t < nthr; ++t) kvs_phase_reduce_store(*sh, st[t], t, nthr);
        // __syncthreads()
        for (kvs_u32 w = 1; w < nthr; w *= 2) {
            for (kvs_u32 t = 0; t < nthr; ++t) kvs_phase_reduce_level(p, *sh, t, w);
            // __syncthreads()
        }
        for (kvs_u32 t = 0; t < nthr; ++t)
            kvs_phase_finish(p, *sh, st[t], g, t, kernel == Kernel::verify);
        if (!secrets_wiped(*sh, nthr)) return KVS_E_SECRET_LEFT;
    }
    return KVS_OK;
}

// Single-message AES-256-GCM with any AAD length (for NIST known-answer tests),
// built from the same primitives as the kernels but run serially. Computes the
// keystream XOR of `in` into `out` (either may be null when len == 0) and the tag
// over the ciphertext, which is `out` when sealing and `in` when opening.
void gcm_one(const KvsKeyCtx& ctx, const kvs_u8* nonce, const kvs_u8* aad, kvs_u64 aad_len,
             const kvs_u8* in, kvs_u64 len, kvs_u8* out, bool sealing, kvs_u8 tag[16]) {
    KvsT0Plain t0 = {ctx.t0};
    KvsBlock128 h = kvs_ctx_hpow_entry(&ctx, 0, 1);
    KvsBlock128 y = kvs_block(0, 0);
    for (kvs_u64 off = 0; off < aad_len; off += 16) {
        kvs_u32 n = aad_len - off < 16 ? (kvs_u32)(aad_len - off) : 16u;
        y = kvs_gf_mul(kvs_xor(y, kvs_load_bytes(aad + off, n)), h);
    }
    for (kvs_u64 off = 0; off < len; off += 16) {
        kvs_u32 n = len - off < 16 ? (kvs_u32)(len - off) : 16u;
        KvsBlock128 ks = kvs_aes256_encrypt(ctx.rk, t0, kvs_gcm_counter(nonce, off / 16));
        KvsBlock128 x = kvs_load_bytes(in + off, n);
        KvsBlock128 o = kvs_block_prefix(kvs_xor(x, ks), n);
        if (out) kvs_store_bytes(out + off, o, n);
        y = kvs_gf_mul(kvs_xor(y, sealing ? o : x), h);
    }
    y = kvs_gf_mul(kvs_xor(y, kvs_block(aad_len * 8u, len * 8u)), h);
    kvs_store_block(tag, kvs_xor(y, kvs_aes256_encrypt(ctx.rk, t0, kvs_gcm_j0(nonce))));
}

}  // namespace

extern "C" {

// Bumped whenever a struct below or a function signature changes.
unsigned kvseal_emu_abi_version(void) { return KVSEAL_EMU_ABI_VERSION; }

// sizeof of the descriptor structs, so the Python side can check its ctypes
// mirrors: 0 KvsKeyCtx, 1 KvsSegment, 2 KvsBlockWs, 3 KvsBatch, 4 KvsShared.
unsigned long long kvseal_emu_sizeof(int which) {
    switch (which) {
        case 0: return sizeof(KvsKeyCtx);
        case 1: return sizeof(KvsSegment);
        case 2: return sizeof(KvsBlockWs);
        case 3: return sizeof(KvsBatch);
        case 4: return sizeof(KvsShared);
        default: return 0;
    }
}

// Derive the key context (round keys, T0, powers of H) from a 32-byte key.
// `ctx` is caller-owned memory of sizeof(KvsKeyCtx) bytes.
int kvseal_emu_key_setup(const unsigned char* key, KvsKeyCtx* ctx) {
    if (!key || !ctx) return KVS_E_NULL;
    kvs_key_setup(key, ctx);
    return KVS_OK;
}

// Validate a descriptor the way every kernel entry point below does (0 = valid).
int kvseal_emu_check(const KvsBatch* batch) { return batch ? kvs_batch_check(batch) : KVS_E_NULL; }

// The three kernels over the whole grid. Return 0, or a negative KVS_E_* code
// before touching any memory when the descriptor is malformed. order_seed 0 runs
// CTAs in index order, any other value in a seeded pseudo-random order.
int kvseal_emu_seal(const KvsBatch* batch, unsigned long long order_seed) {
    return run_grid(batch, Kernel::seal, order_seed);
}
int kvseal_emu_verify(const KvsBatch* batch, unsigned long long order_seed) {
    return run_grid(batch, Kernel::verify, order_seed);
}
int kvseal_emu_open(const KvsBatch* batch, unsigned long long order_seed) {
    return run_grid(batch, Kernel::open, order_seed);
}

// Debug entry points for known-answer tests: one message, 12-byte nonce, any AAD
// and plaintext length. seal writes len bytes of ciphertext and a 16-byte tag.
int kvseal_emu_gcm_seal(const unsigned char* key, const unsigned char* nonce,
                        const unsigned char* aad, unsigned long long aad_len,
                        const unsigned char* pt, unsigned long long len, unsigned char* ct,
                        unsigned char* tag) {
    if (!key || !nonce || !tag || (aad_len && !aad) || (len && (!pt || !ct))) return KVS_E_NULL;
    KvsKeyCtx ctx;
    kvs_key_setup(key, &ctx);
    gcm_one(ctx, nonce, aad, aad_len, pt, len, ct, true, tag);
    memset(&ctx, 0, sizeof ctx);
    return KVS_OK;
}

// open: compares the first tag_len (1..16) bytes of the tag in constant time.
// Returns 1 and writes the plaintext when authentic, 0 and writes nothing when not.
int kvseal_emu_gcm_open(const unsigned char* key, const unsigned char* nonce,
                        const unsigned char* aad, unsigned long long aad_len,
                        const unsigned char* ct, unsigned long long len, const unsigned char* tag,
                        unsigned tag_len, unsigned char* pt) {
    if (!key || !nonce || !tag || (aad_len && !aad) || (len && (!pt || !ct))) return KVS_E_NULL;
    if (tag_len == 0 || tag_len > 16) return KVS_E_SIZE;
    KvsKeyCtx ctx;
    kvs_key_setup(key, &ctx);
    kvs_u8 mine[16];
    gcm_one(ctx, nonce, aad, aad_len, ct, len, nullptr, false, mine);
    int ok = (int)kvs_ct_equal(mine, tag, tag_len);
    if (ok) gcm_one(ctx, nonce, aad, aad_len, ct, len, pt, false, mine);
    memset(&ctx, 0, sizeof ctx);
    return ok;
}

}  // extern "C"
