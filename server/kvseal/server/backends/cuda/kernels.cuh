// SPDX-License-Identifier: Apache-2.0
//
// kvseal batch seal / verify / open: launch descriptors and the per-thread phase
// functions. kernels.cu wraps the phases in __global__ functions separated by
// __syncthreads(); emulate.cpp runs the same phases for every thread of a CTA in
// turn, which is exactly the semantics of a barrier. Anything a thread keeps
// across a barrier lives either in KvsShared (shared memory) or in
// KvsThreadState (registers), never in a local variable of a phase function.
//
// Work decomposition (see docs/gpu-kernels.md for the full derivation)
//  * A sealed block's plaintext is m = ceil(block_bytes / 16) AES blocks. It is cut
//    into slices of `slice_blocks` AES blocks, one CTA per slice: the grid is
//    num_blocks * ctas_per_block CTAs, CTA g handles block g / ctas_per_block,
//    slice g % ctas_per_block. Small batches thus still fill the GPU.
//  * Inside a slice, thread t handles AES blocks t, t + T, t + 2T, ... (T threads).
//    Consecutive lanes touch consecutive 16-byte blocks, so every warp-wide load
//    and store is a contiguous 512-byte transaction (coalesced), and CTR is
//    embarrassingly parallel: block i uses counter 2 + i.
//  * GHASH is parallelised with powers of H. Thread t runs Horner with step H^T
//    over its strided blocks; the CTA combines the T partial sums with a
//    log2(T)-level tree (multipliers H^1, H^2, H^4, ...), multiplies the slice sum
//    by the power of H that positions it in the whole message, and XORs it into a
//    per-block accumulator with 64-bit atomics. The last CTA of a block (atomic
//    ticket counter) turns the accumulator into the tag (seal) or compares it with
//    the expected tag (verify). One launch per stage, whatever the block count.
//  * The last slice of a block may be short. Its missing AES blocks are placed at
//    the *front* of the slice as zeros: zeros before the first term of a Horner sum
//    change nothing, so every slice sum is relative to its real end.

#ifndef KVSEAL_KERNELS_CUH
#define KVSEAL_KERNELS_CUH

#include "aesgcm.cuh"

#define KVS_AAD_BYTES 112  // sealed-block format v1: 7 GHASH blocks
#define KVS_NONCE_BYTES 12
#define KVS_TAG_BYTES 16
#define KVS_MAX_THREADS 1024
#define KVS_MIN_THREADS 32
// Keeps every exponent used by kvs_hpow below 2^24 (needs m + 2 < 2^24).
#define KVS_MAX_BLOCK_BYTES (1ull << 27)

// ---------------------------------------------------------------------------
// Descriptors (plain C layout, no implicit padding: filled by Python ctypes)
// ---------------------------------------------------------------------------

// One contiguous run of a page inside one pool buffer. A block's plaintext is the
// concatenation of all segments, in table order, for that block's page id.
struct KvsSegment {
    kvs_u32 buffer;        // index into KvsBatch::buffers
    kvs_u32 reserved;      // must be 0
    kvs_u64 offset;        // bytes from the buffer base to this segment of page 0
    kvs_u64 page_stride;   // bytes between the same segment of consecutive pages
    kvs_u64 bytes;         // length of the segment (any value >= 1, need not be 16-aligned)
    kvs_u64 block_offset;  // where the segment starts in the block plaintext
                           // (prefix sum of `bytes`; the host fills it)
};

// Per-block scratch for the cross-CTA tag reduction. Must be all zero when a
// seal/verify launch starts; a launch that runs to completion leaves it zero
// again (the last CTA of each block clears it), so one memset at allocation
// suffices. A launcher may also memset it before every launch (cheap, graphable).
struct KvsBlockWs {
    kvs_u64 acc[2];  // XOR of the CTAs' GHASH contributions {hi, lo}
    kvs_u32 count;   // CTAs of this block that have contributed
    kvs_u32 reserved;
};

// One descriptor for all three kernels (passed by value as the only parameter).
// All pointers are device pointers on the GPU and host pointers in emulation.
struct KvsBatch {
    const KvsKeyCtx* key;              // from kvseal_key_setup / kvseal_emu_key_setup
    const kvs_u64* buffers;            // [n buffers] base addresses of the engine's KV pool
    const KvsSegment* segments;        // [num_segments]
    const kvs_i64* pages;              // [num_blocks] page id of each block (>= 0)
    const kvs_u8* nonces;              // [num_blocks][12]
    const kvs_u8* aads;                // [num_blocks][112]
    kvs_u8* staging;                   // ciphertext: seal writes, verify/open read
    const kvs_u64* staging_offsets;    // [num_blocks] byte offset of each block in staging
    kvs_u8* tags;                      // [num_blocks][16]: seal writes, verify reads
    kvs_u8* ok;                        // [num_blocks]: verify writes 1/0, open reads
    KvsBlockWs* ws;                    // [num_blocks] seal/verify scratch (see above)
    kvs_u64 block_bytes;               // plaintext bytes per block = sum of segment bytes
    kvs_u32 num_segments;
    kvs_u32 num_blocks;
    kvs_u32 threads_per_cta;           // T: power of two in [32, 1024] == blockDim.x
    kvs_u32 slice_blocks;              // AES blocks per CTA, a multiple of T
    kvs_u32 ctas_per_block;            // max(1, ceil(ceil(block_bytes / 16) / slice_blocks))
    kvs_u32 all_or_nothing;            // open: write nothing unless every ok[] == 1
};

// Shared memory of one CTA: 32 KiB + 8 KiB + 244 B, under the 48 KiB static limit.
struct KvsShared {
    union {
        kvs_u32 t0rep[256 * 32];               // lane-replicated T0 (hot loop)
        KvsBlock128 red[KVS_MAX_THREADS];      // reduction tree (after the hot loop)
    } u;
    kvs_u32 htab[16 * 4 * 32];  // lane-replicated 4-bit table of H^T, 4 words/entry
    kvs_u32 rk[KVS_AES256_RK_WORDS];
    kvs_u32 flag;               // open: may this CTA write?
};

// Per-thread state carried across barriers (registers on the GPU).
struct KvsThreadState {
    KvsBlock128 acc;
    KvsBlock128 ej0;  // E_K(J0): thread 0 of a block's slice-0 CTA only
};

// Error codes of kvs_batch_check (0 = fine).
#define KVS_OK 0
#define KVS_E_NULL -1
#define KVS_E_THREADS -2
#define KVS_E_SLICE -3
#define KVS_E_CTAS -4
#define KVS_E_SIZE -5
#define KVS_E_SEGMENTS -6
#define KVS_E_SECRET_LEFT -7  // emulator only: a CTA left key material in shared memory

KVS_HD kvs_u64 kvs_aes_blocks(kvs_u64 bytes) { return (bytes + 15u) / 16u; }

KVS_HD kvs_u32 kvs_expected_ctas(kvs_u64 block_bytes, kvs_u32 slice_blocks) {
    kvs_u64 c = (kvs_aes_blocks(block_bytes) + slice_blocks - 1u) / slice_blocks;
    return c == 0 ? 1u : (kvs_u32)c;
}

// Shape checks a launcher must pass before launching (pointer ranges against the
// buffers are the caller's job: only it knows the allocation sizes).
KVS_HD int kvs_batch_check(const KvsBatch* p) {
    if (!p->key || !p->buffers || !p->segments || !p->pages || !p->nonces || !p->aads ||
        !p->staging || !p->staging_offsets || !p->tags || !p->ok || !p->ws)
        return KVS_E_NULL;
    kvs_u32 t = p->threads_per_cta;
    if (t < KVS_MIN_THREADS || t > KVS_MAX_THREADS || (t & (t - 1u)) != 0) return KVS_E_THREADS;
    if (p->slice_blocks == 0 || p->slice_blocks % t != 0) return KVS_E_SLICE;
    if (p->block_bytes >= KVS_MAX_BLOCK_BYTES) return KVS_E_SIZE;
    if (p->num_segments == 0) return KVS_E_SEGMENTS;
    if (p->ctas_per_block != kvs_expected_ctas(p->block_bytes, p->slice_blocks)) return KVS_E_CTAS;
    return KVS_OK;
}

// Which block and which slice CTA g works on.
struct KvsCta {
    kvs_u32 block;
    kvs_u32 slice;
    kvs_u64 m;    // AES blocks in the message
    kvs_u64 s0;   // first AES block of the slice
    kvs_u64 s1;   // one past the last
    kvs_u64 pad;  // virtual zero blocks in front of the slice (slice_blocks - (s1 - s0))
};

KVS_HD KvsCta kvs_cta(const KvsBatch& p, kvs_u32 g) {
    KvsCta c;
    c.block = g / p.ctas_per_block;
    c.slice = g % p.ctas_per_block;
    c.m = kvs_aes_blocks(p.block_bytes);
    kvs_u64 s0 = (kvs_u64)c.slice * p.slice_blocks;
    c.s0 = s0 < c.m ? s0 : c.m;
    c.s1 = c.s0 + p.slice_blocks < c.m ? c.s0 + p.slice_blocks : c.m;
    c.pad = p.slice_blocks - (c.s1 - c.s0);
    return c;
}

// ---------------------------------------------------------------------------
// Device-portable helpers: atomics, fences, 16-byte memory access
// ---------------------------------------------------------------------------

// KVS_NO_ATOMICS (KVSEAL_KERNELS_SAFE=atomics, a diagnostic build): one CTA runs
// every slice of a block in turn (kernels.cu), so a block's workspace is touched by
// one thread only, in program order: plain reads and writes, no fence. The
// sequential emulator runs such a build as is (its CTAs never overlap); the
// threaded harness (tests/kernels_threaded.cpp) refuses it.
#if defined(KVS_NO_ATOMICS)
KVS_HD void kvs_atomic_xor64(kvs_u64* p, kvs_u64 v) { *p ^= v; }
KVS_HD kvs_u32 kvs_atomic_add32(kvs_u32* p, kvs_u32 v) {
    kvs_u32 old = *p;
    *p = old + v;
    return old;
}
KVS_HD kvs_u64 kvs_atomic_exch64(kvs_u64* p, kvs_u64 v) {
    kvs_u64 old = *p;
    *p = v;
    return old;
}
KVS_HD kvs_u32 kvs_atomic_exch32(kvs_u32* p, kvs_u32 v) {
    kvs_u32 old = *p;
    *p = v;
    return old;
}
KVS_HD void kvs_threadfence() {}
#elif defined(__CUDA_ARCH__)
KVS_HD void kvs_atomic_xor64(kvs_u64* p, kvs_u64 v) { atomicXor(p, v); }
KVS_HD kvs_u32 kvs_atomic_add32(kvs_u32* p, kvs_u32 v) { return atomicAdd(p, v); }
KVS_HD kvs_u64 kvs_atomic_exch64(kvs_u64* p, kvs_u64 v) { return atomicExch(p, v); }
KVS_HD kvs_u32 kvs_atomic_exch32(kvs_u32* p, kvs_u32 v) { return atomicExch(p, v); }
KVS_HD void kvs_threadfence() { __threadfence(); }
#else
// Host builds: real atomics with the orderings the GPU code gets (PTX atom.* is
// relaxed at gpu scope; __threadfence is a full fence). The sequential emulator
// does not need them, the threaded harness (tests/kernels_threaded.cpp, which runs
// CTAs concurrently, also under ThreadSanitizer) does.
KVS_HD void kvs_atomic_xor64(kvs_u64* p, kvs_u64 v) { __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); }
KVS_HD kvs_u32 kvs_atomic_add32(kvs_u32* p, kvs_u32 v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
KVS_HD kvs_u64 kvs_atomic_exch64(kvs_u64* p, kvs_u64 v) {
    return __atomic_exchange_n(p, v, __ATOMIC_RELAXED);
}
KVS_HD kvs_u32 kvs_atomic_exch32(kvs_u32* p, kvs_u32 v) {
    return __atomic_exchange_n(p, v, __ATOMIC_RELAXED);
}
KVS_HD void kvs_threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#endif

KVS_HD kvs_u32 kvs_bswap32(kvs_u32 v) {
    return (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
}

KVS_HD void kvs_put_byte(KvsBlock128& b, kvs_u32 i, kvs_u64 byte) {
    if (i < 8)
        b.hi |= byte << (56 - 8 * i);
    else
        b.lo |= byte << (56 - 8 * (i - 8));
}

// Load n (<= 16) contiguous bytes, zero-filling the rest. On the GPU a full,
// 16-byte-aligned block is one 128-bit load (the common case: segment sizes and
// page strides of real KV pools are multiples of 16), unless KVS_NO_VECTOR_IO
// (KVSEAL_KERNELS_SAFE=vector, a diagnostic build) asks for byte accesses only,
// the path the host builds always take.
#if defined(__CUDA_ARCH__) && !defined(KVS_NO_VECTOR_IO)
#define KVS_VECTOR_IO 1
#endif

KVS_HD KvsBlock128 kvs_load_bytes(const kvs_u8* src, kvs_u32 n) {
#if defined(KVS_VECTOR_IO)
    if (n == 16 && ((kvs_u64)src & 15u) == 0) {
        uint4 v = *reinterpret_cast<const uint4*>(src);
        return kvs_block(((kvs_u64)kvs_bswap32(v.x) << 32) | kvs_bswap32(v.y),
                         ((kvs_u64)kvs_bswap32(v.z) << 32) | kvs_bswap32(v.w));
    }
#endif
    KvsBlock128 b = kvs_block(0, 0);
    for (kvs_u32 i = 0; i < n; ++i) kvs_put_byte(b, i, src[i]);
    return b;
}

KVS_HD void kvs_store_bytes(kvs_u8* dst, KvsBlock128 b, kvs_u32 n) {
#if defined(KVS_VECTOR_IO)
    if (n == 16 && ((kvs_u64)dst & 15u) == 0) {
        uint4 v;
        v.x = kvs_bswap32((kvs_u32)(b.hi >> 32));
        v.y = kvs_bswap32((kvs_u32)b.hi);
        v.z = kvs_bswap32((kvs_u32)(b.lo >> 32));
        v.w = kvs_bswap32((kvs_u32)b.lo);
        *reinterpret_cast<uint4*>(dst) = v;
        return;
    }
#endif
    for (kvs_u32 i = 0; i < n; ++i) dst[i] = (kvs_u8)kvs_block_byte(b, (int)i);
}

// ---------------------------------------------------------------------------
// Gather / scatter addressing
// ---------------------------------------------------------------------------

// Largest segment index s with block_offset <= off (binary search; segments are
// sorted by block_offset because it is a prefix sum).
KVS_HD kvs_u32 kvs_find_segment(const KvsSegment* segs, kvs_u32 n, kvs_u64 off) {
    kvs_u32 lo = 0, hi = n;  // invariant: segs[lo].block_offset <= off, answer in [lo, hi)
    while (hi - lo > 1) {
        kvs_u32 mid = lo + (hi - lo) / 2;
        if (segs[mid].block_offset <= off)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

// Move the cursor forward until its segment contains `off`. Threads walk their
// blocks in increasing order, so the cursor only ever moves forward (amortised
// O(1) per block; skips any empty segment too).
KVS_HD void kvs_cursor_seek(const KvsSegment* segs, kvs_u32 n, kvs_u32& s, kvs_u64 off) {
    while (s + 1 < n && segs[s].block_offset + segs[s].bytes <= off) ++s;
}

KVS_HD kvs_u8* kvs_segment_ptr(const KvsBatch& p, const KvsSegment& sg, kvs_u64 page,
                               kvs_u64 within) {
    return reinterpret_cast<kvs_u8*>(p.buffers[sg.buffer] + sg.offset + page * sg.page_stride +
                                     within);
}

// Plaintext bytes [off, off + n) of the block on `page`; zero-filled to 16 bytes.
// A 16-byte block may straddle any number of (small, unaligned) segments.
KVS_HD KvsBlock128 kvs_gather(const KvsBatch& p, kvs_u64 page, kvs_u32& cursor, kvs_u64 off,
                              kvs_u32 n) {
    kvs_cursor_seek(p.segments, p.num_segments, cursor, off);
    const KvsSegment& sg = p.segments[cursor];
    kvs_u64 within = off - sg.block_offset;
    if (within + n <= sg.bytes) return kvs_load_bytes(kvs_segment_ptr(p, sg, page, within), n);
    KvsBlock128 b = kvs_block(0, 0);
    kvs_u32 s = cursor;
    for (kvs_u32 i = 0; i < n; ++i) {
        kvs_cursor_seek(p.segments, p.num_segments, s, off + i);
        const KvsSegment& si = p.segments[s];
        kvs_put_byte(b, i, *kvs_segment_ptr(p, si, page, off + i - si.block_offset));
    }
    return b;
}

// Write the first n bytes of `b` as plaintext bytes [off, off + n) of `page`.
KVS_HD void kvs_scatter(const KvsBatch& p, kvs_u64 page, kvs_u32& cursor, kvs_u64 off,
                        KvsBlock128 b, kvs_u32 n) {
    kvs_cursor_seek(p.segments, p.num_segments, cursor, off);
    const KvsSegment& sg = p.segments[cursor];
    kvs_u64 within = off - sg.block_offset;
    if (within + n <= sg.bytes) {
        kvs_store_bytes(kvs_segment_ptr(p, sg, page, within), b, n);
        return;
    }
    kvs_u32 s = cursor;
    for (kvs_u32 i = 0; i < n; ++i) {
        kvs_cursor_seek(p.segments, p.num_segments, s, off + i);
        const KvsSegment& si = p.segments[s];
        *kvs_segment_ptr(p, si, page, off + i - si.block_offset) = (kvs_u8)kvs_block_byte(b, (int)i);
    }
}

// ---------------------------------------------------------------------------
// Shared-memory table accessors
// ---------------------------------------------------------------------------

// 4-bit GHASH table of H^T, replicated per lane like T0: word w of entry v for
// lane l at htab[(4v + w) * 32 + l], i.e. always in bank l.
struct KvsHtabLanes {
    const kvs_u32* htab;
    kvs_u32 lane;
    KVS_HD KvsBlock128 get(kvs_u32 v) const {
        const kvs_u32* e = htab + v * 128u + lane;
        return kvs_block(((kvs_u64)e[0] << 32) | e[32], ((kvs_u64)e[64] << 32) | e[96]);
    }
};

// ---------------------------------------------------------------------------
// Phases. Signature convention: (batch, shared, [thread state], cta index g,
// thread index, threads per CTA). Each is called once per thread between barriers.
// ---------------------------------------------------------------------------

// Phase "setup": stage round keys, the replicated T0 and (seal/verify) the table
// of the Horner step H^T into shared memory. Every thread fills a strided part.
KVS_HD void kvs_phase_setup(const KvsBatch& p, KvsShared& sh, kvs_u32 g, kvs_u32 tid,
                            kvs_u32 nthr, bool need_htab) {
    const KvsKeyCtx* ctx = p.key;
    for (kvs_u32 i = tid; i < KVS_AES256_RK_WORDS; i += nthr) sh.rk[i] = ctx->rk[i];
    for (kvs_u32 i = tid; i < 256u * 32u; i += nthr) sh.u.t0rep[i] = ctx->t0[i >> 5];
    if (need_htab) {
        KvsBlock128 step = kvs_hpow(ctx, nthr);  // T is a power of two: one table entry
        for (kvs_u32 i = tid; i < 16u * 32u; i += nthr) {
            kvs_u32 v = i >> 5, lane = i & 31u;
            KvsBlock128 e = kvs_gf_shoup_entry(step, v);
            kvs_u32* w = sh.htab + v * 128u + lane;
            w[0] = (kvs_u32)(e.hi >> 32);
            w[32] = (kvs_u32)e.hi;
            w[64] = (kvs_u32)(e.lo >> 32);
            w[96] = (kvs_u32)e.lo;
        }
    }
    if (tid == 0 && !need_htab) {
        // open: this block's verdict; the all-or-nothing gate may clear it later.
        KvsCta c = kvs_cta(p, g);
        sh.flag = p.ok[c.block] == 1 ? 1u : 0u;
    }
}

// First j for which thread tid's virtual block tid + j*T is a real block.
KVS_HD kvs_u32 kvs_first_step(const KvsCta& c, kvs_u32 tid, kvs_u32 nthr) {
    return tid >= c.pad ? 0u : (kvs_u32)((c.pad - tid + nthr - 1u) / nthr);
}

// E_K(J0), the tag mask, while the round keys and the lane-replicated T0 are still in
// shared memory (after the hot loop the T0 area is reused and the keys are wiped):
// no lookup with secret indices ever goes to global memory.
KVS_HD void kvs_tag_mask(const KvsCta& c, const KvsShared& sh, KvsThreadState& st, kvs_u32 tid,
                         const kvs_u8* nonce) {
    if (c.slice != 0 || tid != 0) return;
    KvsT0Lanes t0 = {sh.u.t0rep, 0u};
    st.ej0 = kvs_aes256_encrypt(sh.rk, t0, kvs_gcm_j0(nonce));
}

// Phase "seal main": CTR-encrypt this thread's strided blocks of the slice while
// gathering the plaintext from the pool, write the ciphertext to staging, and
// fold it into the thread's Horner sum (step H^T).
KVS_HD void kvs_phase_seal_main(const KvsBatch& p, KvsShared& sh, KvsThreadState& st, kvs_u32 g,
                                kvs_u32 tid, kvs_u32 nthr) {
    KvsCta c = kvs_cta(p, g);
    KvsT0Lanes t0 = {sh.u.t0rep, tid & 31u};
    KvsHtabLanes ht = {sh.htab, tid & 31u};
    const kvs_u8* nonce = p.nonces + (kvs_u64)c.block * KVS_NONCE_BYTES;
    kvs_u64 page = (kvs_u64)p.pages[c.block];
    kvs_u8* out = p.staging + p.staging_offsets[c.block];
    const KvsBlock128 ctr = kvs_gcm_counter_base(nonce);
    KvsBlock128 acc = kvs_block(0, 0);
    kvs_u32 steps = p.slice_blocks / nthr;
    kvs_u32 j = kvs_first_step(c, tid, nthr);
    kvs_u32 cursor = 0;
    if (j < steps) cursor = kvs_find_segment(p.segments, p.num_segments,
                                             16u * (c.s0 + tid + (kvs_u64)j * nthr - c.pad));
    for (; j < steps; ++j) {
        kvs_u64 i = c.s0 + tid + (kvs_u64)j * nthr - c.pad;  // AES block index in the message
        kvs_u64 off = 16u * i;
        kvs_u32 n = p.block_bytes - off < 16u ? (kvs_u32)(p.block_bytes - off) : 16u;
        KvsBlock128 ks = kvs_aes256_encrypt(sh.rk, t0, kvs_gcm_counter_at(ctr, i));
        KvsBlock128 pt = kvs_gather(p, page, cursor, off, n);
        KvsBlock128 ct = kvs_block_prefix(kvs_xor(pt, ks), n);
        kvs_store_bytes(out + off, ct, n);
        acc = kvs_xor(kvs_gf_mul_tab(acc, ht), ct);
    }
    st.acc = acc;
    kvs_tag_mask(c, sh, st, tid, nonce);
}

// Phase "verify main": the GHASH half of seal_main, over the staged ciphertext.
KVS_HD void kvs_phase_verify_main(const KvsBatch& p, KvsShared& sh, KvsThreadState& st,
                                  kvs_u32 g, kvs_u32 tid, kvs_u32 nthr) {
    KvsCta c = kvs_cta(p, g);
    KvsHtabLanes ht = {sh.htab, tid & 31u};
    const kvs_u8* in = p.staging + p.staging_offsets[c.block];
    KvsBlock128 acc = kvs_block(0, 0);
    kvs_u32 steps = p.slice_blocks / nthr;
    for (kvs_u32 j = kvs_first_step(c, tid, nthr); j < steps; ++j) {
        kvs_u64 off = 16u * (c.s0 + tid + (kvs_u64)j * nthr - c.pad);
        kvs_u32 n = p.block_bytes - off < 16u ? (kvs_u32)(p.block_bytes - off) : 16u;
        acc = kvs_xor(kvs_gf_mul_tab(acc, ht), kvs_load_bytes(in + off, n));
    }
    st.acc = acc;
    kvs_tag_mask(c, sh, st, tid, p.nonces + (kvs_u64)c.block * KVS_NONCE_BYTES);
}

// Zero the key-derived tables in shared memory (round keys, the table of H^T, from
// which H follows): shared memory is not cleared between CTAs or kernels, and the
// next occupant of this SM may be another kernel of another process.
KVS_HD void kvs_wipe_key_tables(KvsShared& sh, kvs_u32 tid, kvs_u32 nthr) {
    for (kvs_u32 i = tid; i < KVS_AES256_RK_WORDS; i += nthr) sh.rk[i] = 0;
    for (kvs_u32 i = tid; i < 16u * 4u * 32u; i += nthr) sh.htab[i] = 0;
}

// Reduction: registers -> shared (after the barrier that ends the hot loop, the
// T0 area is free and is reused; nothing reads the key tables any more).
KVS_HD void kvs_phase_reduce_store(KvsShared& sh, const KvsThreadState& st, kvs_u32 tid,
                                   kvs_u32 nthr) {
    sh.u.red[tid] = st.acc;
    kvs_wipe_key_tables(sh, tid, nthr);
}

// One tree level: node [a, a + 2w) = node [a, a + w) * H^w + node [a + w, a + 2w),
// every node value being relative to its last thread. After log2(T) levels,
// red[0] = sum_t acc_t * H^(T - 1 - t).
KVS_HD void kvs_phase_reduce_level(const KvsBatch& p, KvsShared& sh, kvs_u32 tid, kvs_u32 w) {
    if ((tid & (2u * w - 1u)) == 0)
        sh.u.red[tid] = kvs_xor(kvs_gf_mul(sh.u.red[tid], kvs_hpow(p.key, w)), sh.u.red[tid + w]);
}

// The terms of the tag that do not depend on the ciphertext: E_K(J0) (computed in
// the main phase, see kvs_tag_mask), the AAD (GHASH positions 1..7, weight H^(m + 1)
// after a 7-step Horner) and the length block (weight H^1). Added once per block,
// by its slice-0 CTA.
KVS_HD KvsBlock128 kvs_gcm_fixed_terms(const KvsKeyCtx* ctx, KvsBlock128 ej0, const kvs_u8* aad,
                                       kvs_u64 m, kvs_u64 ct_bytes) {
    KvsBlock128 h = kvs_ctx_hpow_entry(ctx, 0, 1);
    KvsBlock128 a = kvs_block(0, 0);
    for (int i = 0; i < KVS_AAD_BYTES / 16; ++i)
        a = kvs_gf_mul(kvs_xor(a, kvs_load_block(aad + 16 * i)), h);
    KvsBlock128 r = kvs_gf_mul(a, kvs_hpow(ctx, m + 1));
    KvsBlock128 len = kvs_block((kvs_u64)KVS_AAD_BYTES * 8u, ct_bytes * 8u);
    r = kvs_xor(r, kvs_gf_mul(len, h));
    return kvs_xor(r, ej0);
}

// Phase "finish": every thread zeroes its node of the reduction tree (partial GHASH
// sums: polynomials in H with known coefficients, so they would reveal H). Thread
// 0 weights the slice sum by its position and adds it to the block accumulator;
// the last CTA of the block produces the tag (seal) or the constant-time verdict
// (verify) and returns the workspace to zero.
KVS_HD void kvs_phase_finish(const KvsBatch& p, KvsShared& sh, const KvsThreadState& st,
                             kvs_u32 g, kvs_u32 tid, bool verify) {
    if (tid != 0) {
        sh.u.red[tid] = kvs_block(0, 0);  // the last level read it before the barrier
        return;
    }
    KvsCta c = kvs_cta(p, g);
    // Slice sum S = red[0] * H has weight H^(s1 - i) for block i; in the message
    // block i has weight H^(m - i + 1) (the length block follows), hence the
    // factor H^(m - s1 + 1) * H = H^(m - s1 + 2).
    KvsBlock128 contrib = kvs_gf_mul(sh.u.red[0], kvs_hpow(p.key, c.m - c.s1 + 2u));
    sh.u.red[0] = kvs_block(0, 0);
    if (c.slice == 0)
        contrib = kvs_xor(contrib, kvs_gcm_fixed_terms(p.key, st.ej0,
                                                       p.aads + (kvs_u64)c.block * KVS_AAD_BYTES,
                                                       c.m, p.block_bytes));
    KvsBlockWs* ws = p.ws + c.block;
    kvs_atomic_xor64(&ws->acc[0], contrib.hi);
    kvs_atomic_xor64(&ws->acc[1], contrib.lo);
    kvs_threadfence();  // our XORs are visible before our ticket is
    kvs_u32 ticket = kvs_atomic_add32(&ws->count, 1u);
    if (ticket + 1u != p.ctas_per_block) return;
    kvs_threadfence();
    KvsBlock128 tag;
    tag.hi = kvs_atomic_exch64(&ws->acc[0], 0);  // read and clear in one go
    tag.lo = kvs_atomic_exch64(&ws->acc[1], 0);
    kvs_atomic_exch32(&ws->count, 0);
    kvs_u8* slot = p.tags + (kvs_u64)c.block * KVS_TAG_BYTES;
    if (verify) {
        kvs_u8 mine[KVS_TAG_BYTES];
        kvs_store_block(mine, tag);
        p.ok[c.block] = (kvs_u8)kvs_ct_equal(mine, slot, KVS_TAG_BYTES);
    } else {
        kvs_store_block(slot, tag);
    }
}

// Several threads may clear the flag at once; all store 0, so on the GPU a plain
// store is enough. On the host it is an atomic store (no C++ data race for TSan).
KVS_HD void kvs_clear_flag(kvs_u32* flag) {
#if defined(__CUDA_ARCH__)
    *flag = 0u;
#else
    __atomic_store_n(flag, 0u, __ATOMIC_RELAXED);
#endif
}

// Phase "open gate" (all-or-nothing only): any failed block clears every CTA's flag.
KVS_HD void kvs_phase_open_gate(const KvsBatch& p, KvsShared& sh, kvs_u32 tid, kvs_u32 nthr) {
    if (!p.all_or_nothing) return;
    for (kvs_u32 i = tid; i < p.num_blocks; i += nthr)
        if (p.ok[i] != 1) kvs_clear_flag(&sh.flag);
}

// Phase "open main": CTR-decrypt the staged ciphertext and scatter it into the
// block's pages, only if the gate let this CTA through (flag is CTA-uniform).
KVS_HD void kvs_phase_open_main(const KvsBatch& p, KvsShared& sh, kvs_u32 g, kvs_u32 tid,
                                kvs_u32 nthr) {
    if (sh.flag != 1u) return;
    KvsCta c = kvs_cta(p, g);
    KvsT0Lanes t0 = {sh.u.t0rep, tid & 31u};
    const kvs_u8* nonce = p.nonces + (kvs_u64)c.block * KVS_NONCE_BYTES;
    kvs_u64 page = (kvs_u64)p.pages[c.block];
    const kvs_u8* in = p.staging + p.staging_offsets[c.block];
    const KvsBlock128 ctr = kvs_gcm_counter_base(nonce);
    kvs_u32 steps = p.slice_blocks / nthr;
    kvs_u32 j = kvs_first_step(c, tid, nthr);
    kvs_u32 cursor = 0;
    if (j < steps) cursor = kvs_find_segment(p.segments, p.num_segments,
                                             16u * (c.s0 + tid + (kvs_u64)j * nthr - c.pad));
    for (; j < steps; ++j) {
        kvs_u64 i = c.s0 + tid + (kvs_u64)j * nthr - c.pad;
        kvs_u64 off = 16u * i;
        kvs_u32 n = p.block_bytes - off < 16u ? (kvs_u32)(p.block_bytes - off) : 16u;
        KvsBlock128 ks = kvs_aes256_encrypt(sh.rk, t0, kvs_gcm_counter_at(ctr, i));
        KvsBlock128 pt = kvs_xor(kvs_load_bytes(in + off, n), ks);
        kvs_scatter(p, page, cursor, off, pt, n);  // writes only n bytes
    }
}

// Phase "open wipe" (after a barrier that follows open main): zero the round keys.
KVS_HD void kvs_phase_open_wipe(KvsShared& sh, kvs_u32 tid, kvs_u32 nthr) {
    kvs_wipe_key_tables(sh, tid, nthr);
}

#endif  // KVSEAL_KERNELS_CUH
