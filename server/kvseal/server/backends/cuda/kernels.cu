// SPDX-License-Identifier: Apache-2.0
//
// kvseal GPU kernels: thin __global__ wrappers around the phase functions of
// kernels.cuh, one barrier between phases. Compiles with nvcc and with NVRTC (no
// host headers). Entry points are extern "C" so that a launcher finds them by
// name (cuModuleGetFunction / cuda.core) without C++ mangling.
//
// Launch shape (seal, verify, open):
//   grid  = batch.num_blocks * batch.ctas_per_block CTAs (1-D)
//   block = batch.threads_per_cta threads (power of two, 32..1024)
//   dynamic shared memory: none (KvsShared is static, ~40.2 KiB)
// kvseal_key_setup runs once per key with a single thread.
//
// Stream order is the only cross-kernel synchronisation: verify must complete
// before open reads ok[] (same stream, or an event).

#include "kernels.cuh"

extern "C" __global__ void kvseal_key_setup(const kvs_u8* key, KvsKeyCtx* ctx) {
    if (blockIdx.x == 0 && threadIdx.x == 0) kvs_key_setup(key, ctx);
}

// A mismatch between the descriptor and the launch shape would make CTAs read the
// wrong slices; fail the launch loudly instead.
__device__ __forceinline__ bool kvs_launch_ok(const KvsBatch& p) {
    if (blockDim.x != p.threads_per_cta || blockDim.y != 1 || blockDim.z != 1) __trap();
    return blockIdx.x < p.num_blocks * p.ctas_per_block;
}

// Seal or verify slice g (a CTA index of the grid): every phase, barrier between.
__device__ __forceinline__ void kvs_seal_or_verify_slice(const KvsBatch& p, KvsShared& sh,
                                                         kvs_u32 g, bool verify) {
    const kvs_u32 tid = threadIdx.x, nthr = blockDim.x;
    KvsThreadState st;
    kvs_phase_setup(p, sh, g, tid, nthr, true);
    __syncthreads();
    if (verify)
        kvs_phase_verify_main(p, sh, st, g, tid, nthr);
    else
        kvs_phase_seal_main(p, sh, st, g, tid, nthr);
    __syncthreads();  // hot loop done: T0 area may be reused, key tables wiped
    kvs_phase_reduce_store(sh, st, tid, nthr);
    __syncthreads();
    for (kvs_u32 w = 1; w < nthr; w *= 2) {
        kvs_phase_reduce_level(p, sh, tid, w);
        __syncthreads();
    }
    kvs_phase_finish(p, sh, st, g, tid, verify);
}

// Shared by seal and verify. Normally CTA g does slice g and the block's CTAs
// meet in its workspace through atomics. Built with KVS_NO_ATOMICS
// (KVSEAL_KERNELS_SAFE=atomics), the first CTA of each block does all of its
// slices in turn and the others return: nothing is shared between CTAs (slower;
// for telling a reduction bug from an arithmetic one).
__device__ __forceinline__ void kvs_seal_or_verify(const KvsBatch& p, KvsShared& sh, bool verify) {
#if defined(KVS_NO_ATOMICS)
    if (blockIdx.x % p.ctas_per_block != 0) return;  // CTA-uniform
    for (kvs_u32 s = 0; s < p.ctas_per_block; ++s) {
        kvs_seal_or_verify_slice(p, sh, blockIdx.x + s, verify);
        __syncthreads();  // thread 0's finish is done with shared memory
    }
#else
    kvs_seal_or_verify_slice(p, sh, blockIdx.x, verify);
#endif
}

extern "C" __global__ void __launch_bounds__(KVS_MAX_THREADS) kvseal_seal(KvsBatch p) {
    __shared__ KvsShared sh;
    if (!kvs_launch_ok(p)) return;  // CTA-uniform
    kvs_seal_or_verify(p, sh, false);
}

extern "C" __global__ void __launch_bounds__(KVS_MAX_THREADS) kvseal_verify(KvsBatch p) {
    __shared__ KvsShared sh;
    if (!kvs_launch_ok(p)) return;
    kvs_seal_or_verify(p, sh, true);
}

extern "C" __global__ void __launch_bounds__(KVS_MAX_THREADS) kvseal_open(KvsBatch p) {
    __shared__ KvsShared sh;
    if (!kvs_launch_ok(p)) return;
    kvs_phase_setup(p, sh, blockIdx.x, threadIdx.x, blockDim.x, false);
    __syncthreads();
    kvs_phase_open_gate(p, sh, threadIdx.x, blockDim.x);
    __syncthreads();
    kvs_phase_open_main(p, sh, blockIdx.x, threadIdx.x, blockDim.x);
    __syncthreads();  // every thread is done with the round keys
    kvs_phase_open_wipe(sh, threadIdx.x, blockDim.x);
}
