// SPDX-License-Identifier: Apache-2.0
//
// The kvseal kernels with real concurrency, on the CPU: every GPU thread of a CTA is
// a std::thread, every __syncthreads() a barrier, and several CTAs run at once, so
// the cross-CTA reduction (64-bit atomic XORs, the ticket, the last CTA's
// read-and-clear) meets real interleavings and real atomics, which the sequential
// emulator (server/kvseal/server/backends/cuda/emulate.cpp) cannot give it. Built and run by
// tests/test_gpu_kernels_threaded.py, also under -fsanitize=thread.
//
// The phase order below must stay in step with kernels.cu, like emulate.cpp's.
// Reference: gcm_one from emulate.cpp, a serial GCM that the NIST tests check.
//
// usage: kernels_threaded SEED THREADS_PER_CTA STEPS_PER_THREAD LAUNCHES CONCURRENT_CTAS
// prints "OK" and exits 0, or prints each mismatch and exits 1.

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "emulate.cpp"

namespace {

// A reusable barrier for a fixed number of threads (C++17 has no std::barrier).
class Barrier {
public:
    explicit Barrier(unsigned n) : n_(n) {}
    void wait() {
        std::unique_lock<std::mutex> lock(mu_);
        const unsigned gen = gen_;
        if (++arrived_ == n_) {
            arrived_ = 0;
            ++gen_;
            cv_.notify_all();
            return;
        }
        cv_.wait(lock, [&] { return gen_ != gen; });
    }

private:
    std::mutex mu_;
    std::condition_variable cv_;
    unsigned n_, arrived_ = 0, gen_ = 0;
};

enum class K { seal, verify, open };

// One CTA, its threads concurrent; shared memory starts as junk, as on a GPU.
void run_cta(const KvsBatch& p, K k, kvs_u32 g, std::atomic<int>& secrets_left) {
    std::unique_ptr<KvsShared> sh(new KvsShared);
    memset(sh.get(), 0xA5, sizeof(KvsShared));
    const kvs_u32 nthr = p.threads_per_cta;
    Barrier bar(nthr);
    auto thread_body = [&](kvs_u32 tid) {
        KvsThreadState st;
        st.acc = st.ej0 = kvs_block(0xDEADBEEFull, 0xDEADBEEFull);
        kvs_phase_setup(p, *sh, g, tid, nthr, k != K::open);
        bar.wait();
        if (k == K::open) {
            kvs_phase_open_gate(p, *sh, tid, nthr);
            bar.wait();
            kvs_phase_open_main(p, *sh, g, tid, nthr);
            bar.wait();
            kvs_phase_open_wipe(*sh, tid, nthr);
            return;
        }
        if (k == K::seal)
            kvs_phase_seal_main(p, *sh, st, g, tid, nthr);
        else
            kvs_phase_verify_main(p, *sh, st, g, tid, nthr);
        bar.wait();
        kvs_phase_reduce_store(*sh, st, tid, nthr);
        bar.wait();
        for (kvs_u32 w = 1; w < nthr; w *= 2) {
            kvs_phase_reduce_level(p, *sh, tid, w);
            bar.wait();
        }
        kvs_phase_finish(p, *sh, st, g, tid, k == K::verify);
    };
    std::vector<std::thread> threads;
    threads.reserve(nthr);
    for (kvs_u32 t = 0; t < nthr; ++t) threads.emplace_back(thread_body, t);
    for (auto& t : threads) t.join();
    if (!secrets_wiped(*sh, k == K::open ? 0 : nthr)) secrets_left.fetch_add(1);
}

// The grid: `concurrent` workers take CTA indices from a shared counter, so CTAs of
// one block finish in varying order and overlap in their atomics.
int launch(const KvsBatch& p, K k, int concurrent) {
    std::atomic<kvs_u32> next{0};
    std::atomic<int> secrets_left{0};
    const kvs_u32 grid = p.num_blocks * p.ctas_per_block;
#if defined(KVS_NO_ATOMICS)
    // kernels.cu's KVS_NO_ATOMICS build (KVSEAL_KERNELS_SAFE=atomics): a block's
    // slices run one after another, their workspace accesses are plain; the
    // threads of each CTA stay concurrent.
    concurrent = 1;
#endif
    std::vector<std::thread> workers;
    for (int c = 0; c < concurrent; ++c)
        workers.emplace_back([&] {
            for (kvs_u32 g; (g = next.fetch_add(1)) < grid;) run_cta(p, k, g, secrets_left);
        });
    for (auto& w : workers) w.join();
    return secrets_left.load();
}

struct Rng {
    kvs_u64 s;
    kvs_u64 next() { return splitmix64(s); }
    kvs_u64 below(kvs_u64 n) { return next() % n; }
};

}  // namespace

int main(int argc, char** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s SEED THREADS STEPS LAUNCHES CONCURRENT\n", argv[0]);
        return 2;
    }
    Rng rng{strtoull(argv[1], nullptr, 10)};
    const kvs_u32 nthr = (kvs_u32)atoi(argv[2]), steps = (kvs_u32)atoi(argv[3]);
    const int launches = atoi(argv[4]), concurrent = atoi(argv[5]);
    int bad = 0;
    auto fail = [&](const char* what, kvs_u32 block, int launch_no) {
        printf("MISMATCH %s (block %u, launch %d)\n", what, block, launch_no);
        ++bad;
    };

    // A pool of 3 buffers x 9 pages; segments of odd sizes and offsets, so blocks
    // straddle segments at non-16-byte boundaries.
    const kvs_u32 nseg = 3, npages = 9, nblocks = 5;
    std::vector<KvsSegment> segs(nseg);
    kvs_u64 block_bytes = 0;
    for (kvs_u32 s = 0; s < nseg; ++s) {
        segs[s].buffer = s;
        segs[s].reserved = 0;
        segs[s].bytes = 1 + rng.below(2500);
        segs[s].offset = rng.below(40);
        segs[s].page_stride = segs[s].bytes + rng.below(24);
        segs[s].block_offset = block_bytes;
        block_bytes += segs[s].bytes;
    }
    std::vector<std::vector<kvs_u8>> bufs(nseg);
    std::vector<kvs_u64> bases(nseg);
    for (kvs_u32 s = 0; s < nseg; ++s) {
        bufs[s].resize(segs[s].offset + npages * segs[s].page_stride);
        for (auto& x : bufs[s]) x = (kvs_u8)rng.next();
        bases[s] = (kvs_u64)bufs[s].data();
    }
    KvsKeyCtx ctx;
    kvs_u8 key[32];
    for (auto& x : key) x = (kvs_u8)rng.next();
    kvs_key_setup(key, &ctx);

    std::vector<kvs_i64> pages(nblocks);
    for (kvs_u32 b = 0; b < nblocks; ++b) pages[b] = (kvs_i64)((2 * b + 1) % npages);  // distinct
    std::vector<kvs_u8> nonces(KVS_NONCE_BYTES * nblocks), aads(KVS_AAD_BYTES * nblocks);
    std::vector<kvs_u8> tags(KVS_TAG_BYTES * nblocks), ok(nblocks);
    for (auto& x : aads) x = (kvs_u8)rng.next();
    const kvs_u64 slot = (block_bytes + 255) / 256 * 256;
    std::vector<kvs_u8> staging(slot * nblocks);
    std::vector<kvs_u64> staging_offsets(nblocks);
    for (kvs_u32 b = 0; b < nblocks; ++b) staging_offsets[b] = b * slot;
    std::vector<KvsBlockWs> ws(nblocks);
    memset(ws.data(), 0, ws.size() * sizeof(KvsBlockWs));  // once: launches leave it zero

    KvsBatch p{};
    p.key = &ctx;
    p.buffers = bases.data();
    p.segments = segs.data();
    p.pages = pages.data();
    p.nonces = nonces.data();
    p.aads = aads.data();
    p.staging = staging.data();
    p.staging_offsets = staging_offsets.data();
    p.tags = tags.data();
    p.ok = ok.data();
    p.ws = ws.data();
    p.block_bytes = block_bytes;
    p.num_segments = nseg;
    p.num_blocks = nblocks;
    p.threads_per_cta = nthr;
    p.slice_blocks = nthr * steps;
    p.ctas_per_block = kvs_expected_ctas(block_bytes, nthr * steps);
    p.all_or_nothing = 1;
    if (int rc = kvs_batch_check(&p)) {
        printf("bad launch shape (%d)\n", rc);
        return 2;
    }

    auto page_bytes = [&](kvs_u32 b) {
        std::vector<kvs_u8> out;
        for (const auto& s : segs) {
            const kvs_u8* src = (const kvs_u8*)bases[s.buffer] + s.offset +
                                (kvs_u64)pages[b] * s.page_stride;
            out.insert(out.end(), src, src + s.bytes);
        }
        return out;
    };
    auto poison = [&](kvs_u32 b) {
        for (const auto& s : segs)
            memset((kvs_u8*)bases[s.buffer] + s.offset + (kvs_u64)pages[b] * s.page_stride, 0xEE,
                   s.bytes);
    };
    auto ws_clean = [&] {
        for (const auto& w : ws)
            if (w.acc[0] || w.acc[1] || w.count) return false;
        return true;
    };

    for (int n = 0; n < launches; ++n) {
        for (auto& x : nonces) x = (kvs_u8)rng.next();
        std::vector<std::vector<kvs_u8>> plain(nblocks);
        for (kvs_u32 b = 0; b < nblocks; ++b) plain[b] = page_bytes(b);

        if (launch(p, K::seal, concurrent)) fail("seal left key material", 0, n);
        for (kvs_u32 b = 0; b < nblocks; ++b) {
            std::vector<kvs_u8> ct(block_bytes);
            kvs_u8 tag[KVS_TAG_BYTES];
            gcm_one(ctx, &nonces[KVS_NONCE_BYTES * b], &aads[KVS_AAD_BYTES * b], KVS_AAD_BYTES,
                    plain[b].data(), block_bytes, ct.data(), true, tag);
            if (memcmp(ct.data(), &staging[staging_offsets[b]], block_bytes)) fail("ct", b, n);
            if (memcmp(tag, &tags[KVS_TAG_BYTES * b], KVS_TAG_BYTES)) fail("tag", b, n);
        }
        if (!ws_clean()) fail("workspace not zero after seal", 0, n);

        memset(ok.data(), 0x77, nblocks);
        if (launch(p, K::verify, concurrent)) fail("verify left key material", 0, n);
        for (kvs_u32 b = 0; b < nblocks; ++b)
            if (ok[b] != 1) fail("verify verdict", b, n);
        for (kvs_u32 b = 0; b < nblocks; ++b) poison(b);
        if (launch(p, K::open, concurrent)) fail("open left key material", 0, n);
        for (kvs_u32 b = 0; b < nblocks; ++b)
            if (page_bytes(b) != plain[b]) fail("open", b, n);

        // One flipped ciphertext bit: only that block fails, and the all-or-nothing
        // open writes no page at all.
        const kvs_u32 victim = (kvs_u32)rng.below(nblocks);
        staging[staging_offsets[victim] + rng.below(block_bytes)] ^= 0x10;
        if (launch(p, K::verify, concurrent)) fail("verify left key material", 0, n);
        for (kvs_u32 b = 0; b < nblocks; ++b)
            if (ok[b] != (b == victim ? 0 : 1)) fail("tampered verdict", b, n);
        if (!ws_clean()) fail("workspace not zero after verify", 0, n);
        for (kvs_u32 b = 0; b < nblocks; ++b) poison(b);
        if (launch(p, K::open, concurrent)) fail("open left key material", 0, n);
        for (kvs_u32 b = 0; b < nblocks; ++b)
            if (page_bytes(b) != std::vector<kvs_u8>(block_bytes, 0xEE))
                fail("all-or-nothing open wrote a page", b, n);
        for (kvs_u32 b = 0; b < nblocks; ++b)  // fresh plaintext for the next launch
            for (const auto& s : segs) {
                kvs_u8* dst = (kvs_u8*)bases[s.buffer] + s.offset +
                              (kvs_u64)pages[b] * s.page_stride;
                for (kvs_u64 i = 0; i < s.bytes; ++i) dst[i] = (kvs_u8)rng.next();
            }
    }
    printf(bad ? "FAILED %d\n" : "OK\n", bad);
    return bad ? 1 : 0;
}
