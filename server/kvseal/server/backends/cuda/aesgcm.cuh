// SPDX-License-Identifier: Apache-2.0
//
// kvseal AES-256-GCM primitives shared by the CUDA kernels (nvcc / NVRTC) and the
// CPU emulation harness (g++). Everything here is per-thread work written as
// KVS_HD (= __host__ __device__ under CUDA, plain inline under g++), so that the
// very same code that runs on the GPU is what the CPU tests exercise.
//
// Written from FIPS-197 (AES) and NIST SP 800-38D (GCM). No tables are copied
// from anywhere: the S-box is derived at key-setup time from its definition
// (multiplicative inverse in GF(2^8) followed by the affine map), and the
// T-table and the GHASH tables are derived from it / from H.
//
// Conventions
//  * A 128-bit GCM block is held as two 64-bit words, `hi` = bytes 0..7 and
//    `lo` = bytes 8..15, each big-endian. In GCM's bit order the most significant
//    bit of byte 0 is the coefficient of x^0, so multiplying by x is a *right*
//    shift of the 128-bit value (SP 800-38D, section 6.3).
//  * AES state words are big-endian columns (word j = bytes 4j..4j+3).
//
// Constant time: no branch and no memory index depends on GHASH data or on tag
// bytes. AES table lookups are indexed by secret state bytes (as every T-table
// AES is); on the GPU the table lives in shared memory, replicated per lane, so
// every lookup of a warp is one conflict-free shared-memory transaction whatever
// the index (no cache-line timing as on a CPU). The CPU harness is a test
// vehicle, not a production CPU implementation.

#ifndef KVSEAL_AESGCM_CUH
#define KVSEAL_AESGCM_CUH

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// nvcc and NVRTC. NVRTC has no standard headers, hence the own integer names.
#define KVS_HD __host__ __device__ __forceinline__
#define KVS_DEVICE_CODE 1
typedef unsigned char kvs_u8;
typedef unsigned int kvs_u32;
typedef unsigned long long kvs_u64;
typedef long long kvs_i64;
#else
// g++ (CPU emulation): CUDA qualifiers vanish.
#include <stdint.h>
#ifndef __host__
#define __host__
#endif
#ifndef __device__
#define __device__
#endif
#define KVS_HD inline
typedef uint8_t kvs_u8;
typedef uint32_t kvs_u32;
typedef uint64_t kvs_u64;
typedef int64_t kvs_i64;
#endif

#define KVS_AES256_ROUNDS 14
#define KVS_AES256_RK_WORDS 60
// hpow table: H^(k * 16^j) for j < KVS_HPOW_DIGITS, k < 16. Any exponent below
// 16^KVS_HPOW_DIGITS = 2^24 then costs at most KVS_HPOW_DIGITS multiplications.
#define KVS_HPOW_DIGITS 6
#define KVS_HPOW_LIMIT (1ull << (4 * KVS_HPOW_DIGITS))

// ---------------------------------------------------------------------------
// 128-bit blocks
// ---------------------------------------------------------------------------

struct KvsBlock128 {
    kvs_u64 hi;
    kvs_u64 lo;
};

KVS_HD KvsBlock128 kvs_block(kvs_u64 hi, kvs_u64 lo) {
    KvsBlock128 r;
    r.hi = hi;
    r.lo = lo;
    return r;
}

KVS_HD KvsBlock128 kvs_xor(KvsBlock128 a, KvsBlock128 b) {
    return kvs_block(a.hi ^ b.hi, a.lo ^ b.lo);
}

KVS_HD kvs_u64 kvs_load_be64(const kvs_u8* p) {
    kvs_u64 v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
    return v;
}

KVS_HD void kvs_store_be64(kvs_u8* p, kvs_u64 v) {
    for (int i = 7; i >= 0; --i) {
        p[i] = (kvs_u8)(v & 0xffu);
        v >>= 8;
    }
}

KVS_HD kvs_u32 kvs_load_be32(const kvs_u8* p) {
    return ((kvs_u32)p[0] << 24) | ((kvs_u32)p[1] << 16) | ((kvs_u32)p[2] << 8) | p[3];
}

KVS_HD KvsBlock128 kvs_load_block(const kvs_u8* p) {
    return kvs_block(kvs_load_be64(p), kvs_load_be64(p + 8));
}

KVS_HD void kvs_store_block(kvs_u8* p, KvsBlock128 b) {
    kvs_store_be64(p, b.hi);
    kvs_store_be64(p + 8, b.lo);
}

// Byte i (0..15) of a block, as it would sit in memory.
KVS_HD kvs_u32 kvs_block_byte(KvsBlock128 b, int i) {
    kvs_u64 w = i < 8 ? b.hi : b.lo;
    return (kvs_u32)((w >> (56 - 8 * (i & 7))) & 0xffu);
}

// Keep only the first n (0..16) bytes of a block, zeroing the rest: GHASH pads the
// last partial ciphertext block with zeros (SP 800-38D, 7.1 step 5).
KVS_HD KvsBlock128 kvs_block_prefix(KvsBlock128 b, kvs_u32 n) {
    // Shifts by 64 are undefined in C++, so build the masks from two halves.
    kvs_u64 mhi = n >= 8 ? ~0ull : (n == 0 ? 0ull : ~0ull << (64 - 8 * n));
    kvs_u64 mlo = n >= 16 ? ~0ull : (n <= 8 ? 0ull : ~0ull << (64 - 8 * (n - 8)));
    return kvs_block(b.hi & mhi, b.lo & mlo);
}

// ---------------------------------------------------------------------------
// GF(2^128) arithmetic (GHASH field, SP 800-38D 6.3)
// ---------------------------------------------------------------------------

// The multiplicative identity: the polynomial "1" is the MSB of byte 0.
KVS_HD KvsBlock128 kvs_gf_one() { return kvs_block(0x8000000000000000ull, 0); }

// x^128 = x^7 + x^2 + x + 1: the coefficients of degrees 0,1,2,7 are the top
// byte 0xE1 in GCM bit order.
#define KVS_GF_R 0xE100000000000000ull

// Multiply by x (one right shift) with reduction; branch-free.
KVS_HD KvsBlock128 kvs_gf_mulx(KvsBlock128 v) {
    kvs_u64 carry = 0ull - (v.lo & 1u);  // all ones when degree 127 is set
    return kvs_block((v.hi >> 1) ^ (carry & KVS_GF_R), (v.lo >> 1) | (v.hi << 63));
}

// Multiply by x^4 in one step. The four bits shifted out of the bottom of `lo`
// (degrees 124..127) become degrees 128..131; bit p of lo (degree 127 - p) turns
// into x^(3 - p) * x^128 = x^(3 - p) * R, i.e. R shifted right by 3 - p. R only
// spans degrees 0..7, so the shifted copies need no further reduction. Computed
// with masks rather than a 16-entry table: a table indexed by data would be a
// divergent constant-memory access on the GPU.
KVS_HD KvsBlock128 kvs_gf_mulx4(KvsBlock128 v) {
    kvs_u64 rem = v.lo & 0xfu;
    kvs_u64 red = ((0ull - (rem & 1u)) & (KVS_GF_R >> 3)) ^
                  ((0ull - ((rem >> 1) & 1u)) & (KVS_GF_R >> 2)) ^
                  ((0ull - ((rem >> 2) & 1u)) & (KVS_GF_R >> 1)) ^
                  ((0ull - ((rem >> 3) & 1u)) & KVS_GF_R);
    return kvs_block((v.hi >> 4) ^ red, (v.lo >> 4) | (v.hi << 60));
}

// Schoolbook bit-serial product (SP 800-38D Algorithm 1), branch-free. Used for
// key setup, the per-CTA reduction and the finalisation: a handful of calls per
// CTA, never in the per-16-byte hot loop.
KVS_HD KvsBlock128 kvs_gf_mul(KvsBlock128 x, KvsBlock128 y) {
    KvsBlock128 z = kvs_block(0, 0);
    KvsBlock128 v = y;
    for (int i = 0; i < 128; ++i) {
        kvs_u64 word = i < 64 ? x.hi : x.lo;
        kvs_u64 bit = 0ull - ((word >> (63 - (i & 63))) & 1u);
        z.hi ^= v.hi & bit;
        z.lo ^= v.lo & bit;
        v = kvs_gf_mulx(v);
    }
    return z;
}

// Entry v (0..15) of the 4-bit ("Shoup") multiplication table of M: the product of
// M with the 4-bit polynomial whose bits, MSB first, are the coefficients of
// x^0..x^3 (GCM order inside a nibble). Each caller computes the basis itself so
// that table slots can be filled by independent threads.
KVS_HD KvsBlock128 kvs_gf_shoup_entry(KvsBlock128 m, kvs_u32 v) {
    KvsBlock128 b0 = m;                 // M * x^0  <- nibble bit 3
    KvsBlock128 b1 = kvs_gf_mulx(b0);   // M * x^1  <- nibble bit 2
    KvsBlock128 b2 = kvs_gf_mulx(b1);   // M * x^2  <- nibble bit 1
    KvsBlock128 b3 = kvs_gf_mulx(b2);   // M * x^3  <- nibble bit 0
    kvs_u64 s3 = 0ull - ((v >> 3) & 1u), s2 = 0ull - ((v >> 2) & 1u);
    kvs_u64 s1 = 0ull - ((v >> 1) & 1u), s0 = 0ull - (v & 1u);
    return kvs_block((b0.hi & s3) ^ (b1.hi & s2) ^ (b2.hi & s1) ^ (b3.hi & s0),
                     (b0.lo & s3) ^ (b1.lo & s2) ^ (b2.lo & s1) ^ (b3.lo & s0));
}

// X * M with a 4-bit table of M: Horner over the 32 nibbles of X from the highest
// degree (low nibble of byte 15) down to the lowest (high nibble of byte 0):
// Z <- Z * x^4 + nibble * M. 32 table lookups and 32 cheap shifts instead of the
// 128 iterations of kvs_gf_mul. `Tab` is any accessor with
// `KvsBlock128 get(kvs_u32 v) const`, so the GPU can read a lane-replicated
// shared-memory table and the setup code a plain array.
template <class Tab>
KVS_HD KvsBlock128 kvs_gf_mul_tab(KvsBlock128 x, const Tab& tab) {
    KvsBlock128 z = kvs_block(0, 0);
    for (int i = 15; i >= 0; --i) {
        kvs_u32 byte = kvs_block_byte(x, i);
        z = kvs_xor(kvs_gf_mulx4(z), tab.get(byte & 0xfu));
        z = kvs_xor(kvs_gf_mulx4(z), tab.get(byte >> 4));
    }
    return z;
}

// ---------------------------------------------------------------------------
// AES-256 (FIPS-197)
// ---------------------------------------------------------------------------

KVS_HD kvs_u32 kvs_gf8_mul(kvs_u32 a, kvs_u32 b) {
    kvs_u32 p = 0;
    for (int i = 0; i < 8; ++i) {
        p ^= a & (0u - (b & 1u));
        kvs_u32 hi = 0u - ((a >> 7) & 1u);
        a = ((a << 1) ^ (hi & 0x1bu)) & 0xffu;  // x^8 = x^4 + x^3 + x + 1
        b >>= 1;
    }
    return p;
}

// S-box from its definition: inverse in GF(2^8) (0 -> 0) as x^254, then the affine
// map b ^ rotl(b,1) ^ rotl(b,2) ^ rotl(b,3) ^ rotl(b,4) ^ 0x63 (FIPS-197 5.1.1).
KVS_HD kvs_u32 kvs_aes_sbox(kvs_u32 x) {
    kvs_u32 x2 = kvs_gf8_mul(x, x);
    kvs_u32 x3 = kvs_gf8_mul(x2, x);
    kvs_u32 x6 = kvs_gf8_mul(x3, x3);
    kvs_u32 x12 = kvs_gf8_mul(x6, x6);
    kvs_u32 x15 = kvs_gf8_mul(x12, x3);
    kvs_u32 x30 = kvs_gf8_mul(x15, x15);
    kvs_u32 x60 = kvs_gf8_mul(x30, x30);
    kvs_u32 x120 = kvs_gf8_mul(x60, x60);
    kvs_u32 x126 = kvs_gf8_mul(x120, x6);
    kvs_u32 x127 = kvs_gf8_mul(x126, x);
    kvs_u32 inv = kvs_gf8_mul(x127, x127);  // x^254 = x^-1
    kvs_u32 r = inv;
    for (int i = 1; i <= 4; ++i) r ^= ((inv << i) | (inv >> (8 - i))) & 0xffu;
    return (r ^ 0x63u) & 0xffu;
}

// T0[x] = (2*S[x], S[x], S[x], 3*S[x]) as a big-endian word: the contribution of a
// row-0 byte to one column after SubBytes+MixColumns. Rows 1..3 use T0 rotated
// right by 8/16/24 bits, so one 1 KiB table serves all four (see kvs_aes_round).
KVS_HD kvs_u32 kvs_aes_t0_entry(kvs_u32 x) {
    kvs_u32 s = kvs_aes_sbox(x);
    kvs_u32 s2 = kvs_gf8_mul(s, 2);
    kvs_u32 s3 = s2 ^ s;
    return (s2 << 24) | (s << 16) | (s << 8) | s3;
}

KVS_HD kvs_u32 kvs_ror32(kvs_u32 v, int n) { return (v >> n) | (v << (32 - n)); }

// Plain table accessor (global memory or a host array).
struct KvsT0Plain {
    const kvs_u32* t0;
    KVS_HD kvs_u32 get(kvs_u32 x) const { return t0[x]; }
};

// Lane-replicated shared-memory table: entry x of lane l at t0rep[x * 32 + l].
// Word address x*32+l sits in bank l, so the 32 lanes of a warp always hit 32
// distinct banks whatever x they look up: no bank conflicts, and the timing of a
// lookup does not depend on the (secret) index. Costs 32 KiB of shared memory.
struct KvsT0Lanes {
    const kvs_u32* t0rep;
    kvs_u32 lane;
    KVS_HD kvs_u32 get(kvs_u32 x) const { return t0rep[x * 32u + lane]; }
};

// S[x] is the second byte of T0[x].
template <class T0>
KVS_HD kvs_u32 kvs_aes_sub(const T0& t0, kvs_u32 x) {
    return (t0.get(x) >> 16) & 0xffu;
}

// AES-256 key expansion (FIPS-197 5.2, Nk = 8). Single-threaded; done once per key.
template <class T0>
KVS_HD void kvs_aes256_expand(const kvs_u8 key[32], const T0& t0, kvs_u32 rk[KVS_AES256_RK_WORDS]) {
    for (int i = 0; i < 8; ++i) rk[i] = kvs_load_be32(key + 4 * i);
    kvs_u32 rcon = 0x01;
    for (int i = 8; i < KVS_AES256_RK_WORDS; ++i) {
        kvs_u32 t = rk[i - 1];
        if ((i & 7) == 0) {
            t = (t << 8) | (t >> 24);  // RotWord
            t = (kvs_aes_sub(t0, t >> 24) << 24) | (kvs_aes_sub(t0, (t >> 16) & 0xffu) << 16) |
                (kvs_aes_sub(t0, (t >> 8) & 0xffu) << 8) | kvs_aes_sub(t0, t & 0xffu);
            t ^= rcon << 24;
            rcon = kvs_gf8_mul(rcon, 2);
        } else if ((i & 7) == 4) {
            t = (kvs_aes_sub(t0, t >> 24) << 24) | (kvs_aes_sub(t0, (t >> 16) & 0xffu) << 16) |
                (kvs_aes_sub(t0, (t >> 8) & 0xffu) << 8) | kvs_aes_sub(t0, t & 0xffu);
        }
        rk[i] = rk[i - 8] ^ t;
    }
}

// One full round for output column j: ShiftRows picks byte r of column j+r,
// SubBytes+MixColumns is the rotated T0 lookup, AddRoundKey the final XOR.
template <class T0>
KVS_HD kvs_u32 kvs_aes_round_col(const T0& t0, kvs_u32 a, kvs_u32 b, kvs_u32 c, kvs_u32 d,
                                 kvs_u32 k) {
    return t0.get(a >> 24) ^ kvs_ror32(t0.get((b >> 16) & 0xffu), 8) ^
           kvs_ror32(t0.get((c >> 8) & 0xffu), 16) ^ kvs_ror32(t0.get(d & 0xffu), 24) ^ k;
}

template <class T0>
KVS_HD kvs_u32 kvs_aes_final_col(const T0& t0, kvs_u32 a, kvs_u32 b, kvs_u32 c, kvs_u32 d,
                                 kvs_u32 k) {
    return ((kvs_aes_sub(t0, a >> 24) << 24) | (kvs_aes_sub(t0, (b >> 16) & 0xffu) << 16) |
            (kvs_aes_sub(t0, (c >> 8) & 0xffu) << 8) | kvs_aes_sub(t0, d & 0xffu)) ^
           k;
}

// T0 computed on demand, branch-free: for the one-thread key setup, whose lookups
// are indexed by key bytes and would otherwise hit a table in global memory.
struct KvsT0Arith {
    KVS_HD kvs_u32 get(kvs_u32 x) const { return kvs_aes_t0_entry(x); }
};

// Encrypt one block given as a KvsBlock128 (big-endian words), `rk` the expanded key.
template <class T0>
KVS_HD KvsBlock128 kvs_aes256_encrypt(const kvs_u32* rk, const T0& t0, KvsBlock128 in) {
    kvs_u32 s0 = (kvs_u32)(in.hi >> 32) ^ rk[0];
    kvs_u32 s1 = (kvs_u32)in.hi ^ rk[1];
    kvs_u32 s2 = (kvs_u32)(in.lo >> 32) ^ rk[2];
    kvs_u32 s3 = (kvs_u32)in.lo ^ rk[3];
    for (int r = 1; r < KVS_AES256_ROUNDS; ++r) {
        const kvs_u32* k = rk + 4 * r;
        kvs_u32 t0v = kvs_aes_round_col(t0, s0, s1, s2, s3, k[0]);
        kvs_u32 t1v = kvs_aes_round_col(t0, s1, s2, s3, s0, k[1]);
        kvs_u32 t2v = kvs_aes_round_col(t0, s2, s3, s0, s1, k[2]);
        kvs_u32 t3v = kvs_aes_round_col(t0, s3, s0, s1, s2, k[3]);
        s0 = t0v;
        s1 = t1v;
        s2 = t2v;
        s3 = t3v;
    }
    const kvs_u32* k = rk + 4 * KVS_AES256_ROUNDS;
    kvs_u32 o0 = kvs_aes_final_col(t0, s0, s1, s2, s3, k[0]);
    kvs_u32 o1 = kvs_aes_final_col(t0, s1, s2, s3, s0, k[1]);
    kvs_u32 o2 = kvs_aes_final_col(t0, s2, s3, s0, s1, k[2]);
    kvs_u32 o3 = kvs_aes_final_col(t0, s3, s0, s1, s2, k[3]);
    return kvs_block(((kvs_u64)o0 << 32) | o1, ((kvs_u64)o2 << 32) | o3);
}

// ---------------------------------------------------------------------------
// Key context: everything derived from the key, computed once per key
// ---------------------------------------------------------------------------

// Lives in device memory (GPU) or host memory (emulation); sensitive: it contains
// the round keys and H. Whoever allocates it wipes it when the key is retired.
// Layout is fixed (no padding): 240 + 1024 + 1536 = 2800 bytes.
struct KvsKeyCtx {
    kvs_u32 rk[KVS_AES256_RK_WORDS];  // AES-256 round keys
    kvs_u32 t0[256];                   // T0 table (key independent; kept here so that
                                       // CTAs copy it instead of deriving it)
    kvs_u64 hpow[KVS_HPOW_DIGITS][16][2];  // H^(k * 16^j) as {hi, lo}
};

KVS_HD KvsBlock128 kvs_ctx_hpow_entry(const KvsKeyCtx* ctx, int j, kvs_u32 k) {
    return kvs_block(ctx->hpow[j][k][0], ctx->hpow[j][k][1]);
}

// Single-threaded key setup (the GPU runs it as a one-thread kernel, once per key).
KVS_HD void kvs_key_setup(const kvs_u8 key[32], KvsKeyCtx* ctx) {
    for (kvs_u32 x = 0; x < 256; ++x) ctx->t0[x] = kvs_aes_t0_entry(x);
    KvsT0Arith t0;  // secret indices: no memory lookups (constant time, no cache trace)
    kvs_aes256_expand(key, t0, ctx->rk);
    KvsBlock128 h = kvs_aes256_encrypt(ctx->rk, t0, kvs_block(0, 0));  // H = E_K(0^128)
    KvsBlock128 base = h;                                              // H^(16^j)
    for (int j = 0; j < KVS_HPOW_DIGITS; ++j) {
        KvsBlock128 p = kvs_gf_one();
        for (kvs_u32 k = 0; k < 16; ++k) {
            ctx->hpow[j][k][0] = p.hi;
            ctx->hpow[j][k][1] = p.lo;
            p = kvs_gf_mul(p, base);
        }
        base = p;  // H^(16 * 16^j)
    }
}

// H^e for 0 <= e < KVS_HPOW_LIMIT: one table entry per non-zero hex digit of e.
// The exponent is public (derived from sizes and thread indices), so branching on
// its digits leaks nothing.
KVS_HD KvsBlock128 kvs_hpow(const KvsKeyCtx* ctx, kvs_u64 e) {
    KvsBlock128 r = kvs_gf_one();
    bool first = true;
    for (int j = 0; j < KVS_HPOW_DIGITS; ++j) {
        kvs_u32 d = (kvs_u32)((e >> (4 * j)) & 0xfu);
        if (d == 0) continue;
        KvsBlock128 f = kvs_ctx_hpow_entry(ctx, j, d);
        r = first ? f : kvs_gf_mul(r, f);
        first = false;
    }
    return r;
}

// GCM counter block i (0-based block index of the message): nonce || BE32(2 + i).
// J0 = nonce || 1 is reserved for the tag mask; inc32 wraps modulo 2^32.
KVS_HD KvsBlock128 kvs_gcm_counter(const kvs_u8 nonce[12], kvs_u64 i) {
    kvs_u32 ctr = (kvs_u32)(2u + (kvs_u32)i);
    return kvs_block(kvs_load_be64(nonce), ((kvs_u64)kvs_load_be32(nonce + 8) << 32) | ctr);
}

KVS_HD KvsBlock128 kvs_gcm_j0(const kvs_u8 nonce[12]) {
    return kvs_block(kvs_load_be64(nonce), ((kvs_u64)kvs_load_be32(nonce + 8) << 32) | 1u);
}

// The nonce part of every counter block (low 32 bits zero), loaded once per thread:
// byte stores through kvs_u8* may alias the nonce, so the compiler cannot hoist the
// 12 byte loads of kvs_gcm_counter out of a hot loop by itself.
KVS_HD KvsBlock128 kvs_gcm_counter_base(const kvs_u8 nonce[12]) {
    return kvs_block(kvs_load_be64(nonce), (kvs_u64)kvs_load_be32(nonce + 8) << 32);
}

// Counter block i from kvs_gcm_counter_base: equals kvs_gcm_counter(nonce, i).
KVS_HD KvsBlock128 kvs_gcm_counter_at(KvsBlock128 base, kvs_u64 i) {
    return kvs_block(base.hi, base.lo | (kvs_u32)(2u + (kvs_u32)i));
}

// Constant-time equality of the first n (<= 16) bytes: OR of XORs, no early exit.
KVS_HD kvs_u32 kvs_ct_equal(const kvs_u8* a, const kvs_u8* b, kvs_u32 n) {
    kvs_u32 d = 0;
    for (kvs_u32 i = 0; i < n; ++i) d |= (kvs_u32)(a[i] ^ b[i]);
    return 1u & ((d - 1u) >> 8);  // 1 iff d == 0 (d < 256)
}

#endif  // KVSEAL_AESGCM_CUH
