// SPDX-License-Identifier: Apache-2.0
//
// A fake libcuda.so.1 for tests/test_cuda_backend_cpu.py::test_cuda_device_over_fake_driver.
// It lets CudaDevice/CudaBackend run through the REAL cuda-python bindings without a GPU:
// "device" memory is host memory, kernels run on the kvseal CPU emulator
// (FAKE_CUDA_EMULATOR = path of the g++-built library). Every call checks its
// arguments strictly (current context, stream/event/function handles, that copies,
// memsets and kernel descriptors only touch device allocations, flags); a violation
// aborts with "FAKECUDA VIOLATION". What it cannot check: timing, asynchrony,
// real IPC, CC mode. Built by the test with: cc -shared -fPIC -o libcuda.so.1 ... -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char reserved[64]; } CUipcEventHandle;

#define FAIL(...) do { fprintf(stderr, "FAKECUDA VIOLATION: " __VA_ARGS__); fputc('\n', stderr); abort(); } while (0)
#define LOG(...) do { if (getenv("FAKE_CUDA_LOG")) { fprintf(stderr, "fakecuda: " __VA_ARGS__); fputc('\n', stderr);} } while (0)

enum { K_DEV = 1, K_HOST = 2, K_REG = 3, K_IPC = 4 };
struct Alloc { uintptr_t base; size_t size; int kind; unsigned flags; int live; };
static struct Alloc allocs[100000];
static int nallocs;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int ctx_refs;
static __thread void* cur_ctx;
#define FAKE_CTX ((void*)0xC0C0)

static struct Alloc* find(uintptr_t p, size_t n, int kind_mask) {
    for (int i = 0; i < nallocs; i++) {
        struct Alloc* a = &allocs[i];
        if (!a->live) continue;
        if (!((1 << a->kind) & kind_mask)) continue;
        if (p >= a->base && p + n <= a->base + a->size && p + n >= p) return a;
    }
    return NULL;
}
static struct Alloc* add(uintptr_t b, size_t n, int kind, unsigned flags) {
    pthread_mutex_lock(&mu);
    struct Alloc* a = &allocs[nallocs++];
    a->base = b; a->size = n; a->kind = kind; a->flags = flags; a->live = 1;
    pthread_mutex_unlock(&mu);
    return a;
}
static void need_ctx(const char* fn) { if (cur_ctx != FAKE_CTX) FAIL("%s without a current context", fn); }
#define DEVMASK ((1 << K_DEV) | (1 << K_IPC))
static void need_dev(const char* fn, CUdeviceptr p, size_t n) {
    if (!find(p, n, DEVMASK)) FAIL("%s: [%#llx, +%zu) is not device memory", fn, p, n);
}
static void need_stream(const char* fn, void* s);

CUresult cuInit(unsigned flags) { if (flags) FAIL("cuInit flags %u", flags); return 0; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
CUresult cuDeviceGetCount(int* n) { *n = 1; return 0; }
CUresult cuDeviceGet(int* d, int ord) { if (ord != 0) return 101; *d = 0; return 0; }
CUresult cuDeviceGetName(char* name, int len, int dev) {
    if (dev != 0 || len < 16) FAIL("cuDeviceGetName(len=%d, dev=%d)", len, dev);
    snprintf(name, len, "Fake H200"); return 0;
}
CUresult cuDeviceGetAttribute(int* pi, int attrib, int dev) {
    if (dev != 0) FAIL("cuDeviceGetAttribute dev %d", dev);
    *pi = attrib == 75 ? 9 : attrib == 76 ? 0 : 0; return 0;
}
CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) { if (dev) FAIL("retain dev"); ctx_refs++; *ctx = FAKE_CTX; return 0; }
CUresult cuDevicePrimaryCtxRelease(int dev) { if (dev || ctx_refs <= 0) FAIL("release"); ctx_refs--; return 0; }
CUresult cuCtxSetCurrent(void* ctx) { if (ctx != FAKE_CTX) FAIL("cuCtxSetCurrent(%p)", ctx); cur_ctx = ctx; return 0; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = cur_ctx; return 0; }

// streams and events: tagged heap objects
struct Obj { uint32_t magic; unsigned flags; int live; };
static int live_objs;  // streams + events not yet destroyed
#define STREAM_MAGIC 0x57524541u
#define EVENT_MAGIC 0x45564e54u
CUresult cuStreamCreate(void** s, unsigned flags) {
    need_ctx("cuStreamCreate");
    if (flags != 1) FAIL("cuStreamCreate flags %u (want CU_STREAM_NON_BLOCKING=1)", flags);
    struct Obj* o = calloc(1, sizeof *o); o->magic = STREAM_MAGIC; o->flags = flags; o->live = 1; live_objs++; *s = o; return 0;
}
static void need_stream(const char* fn, void* s) {
    struct Obj* o = s;
    if (!o || o->magic != STREAM_MAGIC || !o->live) FAIL("%s: bad stream %p", fn, s);
}
static void need_event(const char* fn, void* e) {
    struct Obj* o = e;
    if (!o || o->magic != EVENT_MAGIC || !o->live) FAIL("%s: bad event %p", fn, e);
}
CUresult cuStreamDestroy(void* s) { need_stream("cuStreamDestroy", s); ((struct Obj*)s)->live = 0; live_objs--; return 0; }
CUresult cuStreamSynchronize(void* s) { need_ctx("sync"); need_stream("cuStreamSynchronize", s); return 0; }
// The daemon's periodic device check (CudaBackend.check_device).
CUresult cuCtxSynchronize(void) { need_ctx("cuCtxSynchronize"); return 0; }
CUresult cuEventCreate(void** e, unsigned flags) {
    need_ctx("cuEventCreate");
    struct Obj* o = calloc(1, sizeof *o); o->magic = EVENT_MAGIC; o->flags = flags; o->live = 1; live_objs++; *e = o; return 0;
}
CUresult cuEventDestroy(void* e) { need_event("cuEventDestroy", e); ((struct Obj*)e)->live = 0; live_objs--; return 0; }
CUresult cuEventRecord(void* e, void* s) { need_ctx("rec"); need_event("cuEventRecord", e); need_stream("cuEventRecord", s); return 0; }
CUresult cuEventSynchronize(void* e) { need_event("cuEventSynchronize", e); return 0; }
CUresult cuEventElapsedTime(float* ms, void* a, void* b) {
    need_event("elapsed a", a); need_event("elapsed b", b);
    if (((struct Obj*)a)->flags & 2) return 600; *ms = 1.0f; return 0;
}
CUresult cuStreamWaitEvent(void* s, void* e, unsigned flags) {
    need_ctx("wait"); need_stream("cuStreamWaitEvent", s); need_event("cuStreamWaitEvent", e);
    if (flags) FAIL("cuStreamWaitEvent flags %u", flags); return 0;
}
// An engine's event (opened from an IPC handle, flags 6) reports "not ready" twice
// before it completes, so the polling path runs through the real bindings.
static int ipc_event_polls;
CUresult cuEventQuery(void* e) {
    need_ctx("cuEventQuery"); need_event("cuEventQuery", e);
    if (((struct Obj*)e)->flags == 6 && ipc_event_polls++ % 3 != 2) return 600;
    return 0;
}
CUresult cuIpcOpenEventHandle(void** e, CUipcEventHandle h) {
    need_ctx("cuIpcOpenEventHandle");
    if (memcmp(h.reserved, "FAKEEVT!", 8)) return 1;
    for (int i = 8; i < 64; i++) if (h.reserved[i] != (char)i) FAIL("event handle bytes garbled at %d", i);
    return cuEventCreate(e, 6);
}

// memory
CUresult cuMemAlloc(CUdeviceptr* p, size_t n) {
    need_ctx("cuMemAlloc");
    if (n == 0) return 1;
    void* m = aligned_alloc(256, (n + 255) / 256 * 256); memset(m, 0xCD, n);
    add((uintptr_t)m, n, K_DEV, 0); *p = (uintptr_t)m; return 0;
}
CUresult cuMemFree(CUdeviceptr p) {
    need_ctx("cuMemFree");
    struct Alloc* a = find(p, 1, 1 << K_DEV);
    if (!a || a->base != p) FAIL("cuMemFree(%#llx): not an allocation base", p);
    a->live = 0; free((void*)p); return 0;
}
CUresult cuMemHostAlloc(void** p, size_t n, unsigned flags) {
    need_ctx("cuMemHostAlloc");
    if (n == 0 || (flags & ~7u)) FAIL("cuMemHostAlloc(%zu, %#x)", n, flags);
    void* m = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    add((uintptr_t)m, n, K_HOST, flags); *p = m; return 0;
}
CUresult cuMemFreeHost(void* p) {
    struct Alloc* a = find((uintptr_t)p, 1, 1 << K_HOST);
    if (!a || a->base != (uintptr_t)p) FAIL("cuMemFreeHost(%p)", p);
    a->live = 0; free(p); return 0;
}
CUresult cuMemHostRegister(void* p, size_t n, unsigned flags) {
    need_ctx("cuMemHostRegister");
    if (getenv("FAKE_CUDA_REFUSE_REGISTER")) return 801;
    if (flags & ~0xfu) FAIL("cuMemHostRegister flags %#x", flags);
    if ((uintptr_t)p % 4096) FAIL("cuMemHostRegister: unaligned %p", p);
    add((uintptr_t)p, n, K_REG, flags); return 0;
}
CUresult cuMemHostUnregister(void* p) {
    struct Alloc* a = find((uintptr_t)p, 1, 1 << K_REG);
    if (!a || a->base != (uintptr_t)p) FAIL("cuMemHostUnregister(%p)", p);
    a->live = 0; return 0;
}
CUresult cuMemHostGetDevicePointer(CUdeviceptr* d, void* p, unsigned flags) {
    if (flags) FAIL("cuMemHostGetDevicePointer flags %u", flags);
    struct Alloc* a = find((uintptr_t)p, 1, (1 << K_HOST) | (1 << K_REG));
    if (!a) FAIL("cuMemHostGetDevicePointer(%p): not pinned", p);
    if (!(a->flags & 2)) return 1;  // not DEVICEMAP
    *d = (uintptr_t)p; return 0;
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void* s) {
    need_ctx("memset"); need_stream("cuMemsetD8Async", s); need_dev("cuMemsetD8Async", d, n);
    memset((void*)d, v, n); return 0;
}
CUresult cuMemcpyHtoDAsync(CUdeviceptr d, const void* h, size_t n, void* s) {
    need_ctx("htod"); need_stream("cuMemcpyHtoDAsync", s); need_dev("cuMemcpyHtoDAsync", d, n);
    if (find((uintptr_t)h, 1, DEVMASK)) FAIL("cuMemcpyHtoDAsync: source %p is device memory", h);
    memcpy((void*)d, h, n); return 0;
}
CUresult cuMemcpyDtoHAsync(void* h, CUdeviceptr d, size_t n, void* s) {
    need_ctx("dtoh"); need_stream("cuMemcpyDtoHAsync", s); need_dev("cuMemcpyDtoHAsync", d, n);
    if (find((uintptr_t)h, 1, DEVMASK)) FAIL("cuMemcpyDtoHAsync: dest %p is device memory", h);
    memcpy(h, (void*)d, n); return 0;
}
CUresult cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
    struct Alloc* a = find(p, 1, DEVMASK);
    if (!a) return 1;
    if (base) *base = a->base; if (size) *size = a->size; return 0;
}
// IPC handle: "FAKEIPC!" + u64 base of an allocation made with cuMemAlloc
CUresult cuIpcOpenMemHandle(CUdeviceptr* p, CUipcMemHandle h, unsigned flags) {
    need_ctx("cuIpcOpenMemHandle");
    if (flags != 1) FAIL("cuIpcOpenMemHandle flags %u", flags);
    if (memcmp(h.reserved, "FAKEIPC!", 8)) return 1;
    uint64_t b; memcpy(&b, h.reserved + 8, 8);
    for (int i = 16; i < 64; i++) if ((unsigned char)h.reserved[i] != (unsigned char)(0x80 + i)) FAIL("mem handle bytes garbled at %d", i);
    struct Alloc* a = find(b, 1, 1 << K_DEV);
    if (!a || a->base != b) return 1;
    for (int i = 0; i < nallocs; i++) if (allocs[i].live && allocs[i].kind == K_IPC && allocs[i].base == b) return 208;
    add(b, a->size, K_IPC, 0); *p = b; return 0;
}
// Only the attribute kvseal asks for: which GPU holds an IPC mapping (always 0 here).
CUresult cuPointerGetAttribute(void* data, int attribute, CUdeviceptr p) {
    need_ctx("cuPointerGetAttribute");
    if (attribute != 9) FAIL("cuPointerGetAttribute attribute %d", attribute);
    if (!find(p, 1, DEVMASK)) return 1;
    *(int*)data = 0; return 0;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    struct Alloc* a = find(p, 1, 1 << K_IPC);
    if (!a || a->base != p) FAIL("cuIpcCloseMemHandle(%#llx)", p);
    a->live = 0; return 0;
}

// modules
struct Module { uint32_t magic; char* image; size_t size; int live; };
struct Func { uint32_t magic; struct Module* m; char name[64]; };
CUresult cuModuleLoadData(void** mod, const void* image) {
    need_ctx("cuModuleLoadData");
    const unsigned char* im = image;
    struct Module* m = calloc(1, sizeof *m); m->magic = 0x4d4f44u; m->live = 1;
    if (!memcmp(im, "\x7f" "ELF", 4)) {
        uint64_t shoff; uint16_t shentsize, shnum;
        memcpy(&shoff, im + 0x28, 8); memcpy(&shentsize, im + 0x3a, 2); memcpy(&shnum, im + 0x3c, 2);
        m->size = shoff + (size_t)shentsize * shnum;
        if (im[4] != 2) FAIL("cubin is not ELF64");
        LOG("cubin of %zu bytes", m->size);
    } else {
        if (!strstr((const char*)im, ".version") || !strstr((const char*)im, ".target")) FAIL("image is neither a cubin nor PTX");
        m->size = strlen((const char*)im) + 1;
        LOG("PTX of %zu bytes", m->size);
    }
    m->image = malloc(m->size); memcpy(m->image, im, m->size); *mod = m; return 0;
}
CUresult cuModuleUnload(void* mod) { struct Module* m = mod; if (!m || m->magic != 0x4d4f44u || !m->live) FAIL("unload"); m->live = 0; return 0; }
CUresult cuModuleGetFunction(void** f, void* mod, const char* name) {
    struct Module* m = mod;
    if (!m || m->magic != 0x4d4f44u || !m->live) FAIL("cuModuleGetFunction: bad module");
    int found = 0;
    if (!memcmp(m->image, "\x7f" "ELF", 4)) {  // exact symbol name in the ELF string tables
        size_t n = strlen(name);
        for (size_t i = 1; i + n < m->size; i++)
            if (m->image[i - 1] == 0 && !memcmp(m->image + i, name, n) && m->image[i + n] == 0) { found = 1; break; }
    } else {
        char pat[128]; snprintf(pat, sizeof pat, ".entry %s(", name);
        found = strstr(m->image, pat) != NULL;
    }
    if (!found) return 500;
    struct Func* fn = calloc(1, sizeof *fn); fn->magic = 0x46554e43u; fn->m = m; snprintf(fn->name, 64, "%s", name);
    *f = fn; return 0;
}

// launches run the emulator
typedef struct {
    uint64_t key, buffers, segments, pages, nonces, aads, staging, staging_offsets, tags, ok, ws, block_bytes;
    uint32_t num_segments, num_blocks, threads_per_cta, slice_blocks, ctas_per_block, all_or_nothing;
} KvsBatch;
static void* emu;
static void* emu_sym(const char* s) {
    if (!emu) { const char* p = getenv("FAKE_CUDA_EMULATOR"); emu = p ? dlopen(p, RTLD_NOW) : NULL; if (!emu) FAIL("cannot load the emulator (FAKE_CUDA_EMULATOR)"); }
    void* f = dlsym(emu, s); if (!f) FAIL("emulator lacks %s", s); return f;
}
static int launches;
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void* s, void** params, void** extra) {
    need_ctx("cuLaunchKernel"); need_stream("cuLaunchKernel", s);
    struct Func* fn = f;
    if (!fn || fn->magic != 0x46554e43u) FAIL("cuLaunchKernel: bad function handle %p", f);
    if (gy != 1 || gz != 1 || by != 1 || bz != 1 || shmem != 0 || extra) FAIL("cuLaunchKernel shape/extra");
    if (!params) FAIL("cuLaunchKernel: kernelParams is NULL");
    launches++;
    LOG("launch %s grid %u block %u", fn->name, gx, bx);
    if (!strcmp(fn->name, "kvseal_key_setup")) {
        uint64_t key = *(uint64_t*)params[0], ctx = *(uint64_t*)params[1];
        need_dev("key_setup key", key, 32); need_dev("key_setup ctx", ctx, 2800);
        if (gx != 1 || bx < 1) FAIL("key_setup shape");
        int (*k)(const void*, void*) = emu_sym("kvseal_emu_key_setup");
        return k((void*)key, (void*)ctx) < 0 ? 719 : 0;
    }
    KvsBatch b = *(KvsBatch*)params[0];  // the driver copies the by-value struct
    if (gx != b.num_blocks * b.ctas_per_block || bx != b.threads_per_cta) FAIL("%s: launch shape %u x %u vs descriptor", fn->name, gx, bx);
    uint64_t n = b.num_blocks;
    need_dev("batch.key", b.key, 2800);
    need_dev("batch.segments", b.segments, 40 * (uint64_t)b.num_segments);
    need_dev("batch.pages", b.pages, 8 * n); need_dev("batch.nonces", b.nonces, 12 * n);
    need_dev("batch.aads", b.aads, 112 * n); need_dev("batch.staging_offsets", b.staging_offsets, 8 * n);
    need_dev("batch.tags", b.tags, 16 * n); need_dev("batch.ok", b.ok, n); need_dev("batch.ws", b.ws, 24 * n);
    if (!find(b.buffers, 8, DEVMASK)) FAIL("batch.buffers");
    // staging: device memory, or mapped pinned memory (seal_mode=mapped)
    const uint64_t* so = (const uint64_t*)b.staging_offsets;
    for (uint64_t i = 0; i < n; i++)
        if (!find(b.staging + so[i], b.block_bytes, DEVMASK) &&
            !find(b.staging + so[i], b.block_bytes, (1 << K_HOST) | (1 << K_REG)))
            FAIL("%s: staging slot %llu outside device/mapped memory", fn->name, (unsigned long long)i);
    const char* e = !strcmp(fn->name, "kvseal_seal") ? "kvseal_emu_seal" : !strcmp(fn->name, "kvseal_verify") ? "kvseal_emu_verify" : "kvseal_emu_open";
    int (*k)(const KvsBatch*, unsigned long long) = emu_sym(e);
    return k(&b, 0) < 0 ? 719 : 0;
}

static const char* errname(CUresult r) { return r == 0 ? "CUDA_SUCCESS" : "CUDA_ERROR_FAKE"; }
CUresult cuGetErrorString(CUresult r, const char** s) { *s = errname(r); return 0; }
CUresult cuGetErrorName(CUresult r, const char** s) { *s = errname(r); return 0; }

struct Entry { const char* name; void* fn; };
#define E(n) { #n, (void*)n }
static struct Entry table[] = {
    E(cuInit), E(cuDriverGetVersion), E(cuDeviceGetCount), E(cuDeviceGet), E(cuDeviceGetName), E(cuDeviceGetAttribute),
    E(cuDevicePrimaryCtxRetain), E(cuDevicePrimaryCtxRelease), E(cuCtxSetCurrent), E(cuCtxGetCurrent),
    E(cuStreamCreate), E(cuStreamDestroy), E(cuStreamSynchronize), E(cuCtxSynchronize), E(cuEventCreate), E(cuEventDestroy),
    E(cuEventRecord), E(cuEventSynchronize), E(cuEventQuery), E(cuPointerGetAttribute), E(cuEventElapsedTime), E(cuStreamWaitEvent), E(cuIpcOpenEventHandle),
    E(cuMemAlloc), E(cuMemFree), E(cuMemHostAlloc), E(cuMemFreeHost), E(cuMemHostRegister), E(cuMemHostUnregister),
    E(cuMemHostGetDevicePointer), E(cuMemsetD8Async), E(cuMemcpyHtoDAsync), E(cuMemcpyDtoHAsync),
    E(cuMemGetAddressRange), E(cuIpcOpenMemHandle), E(cuIpcCloseMemHandle), E(cuModuleLoadData), E(cuModuleUnload),
    E(cuModuleGetFunction), E(cuLaunchKernel), E(cuGetErrorString), E(cuGetErrorName), {0, 0}};

CUresult cuGetProcAddress_v2(const char* sym, void** pfn, int ver, uint64_t flags, int* status) {
    for (struct Entry* e = table; e->name; e++)
        if (!strcmp(e->name, sym)) { *pfn = e->fn; if (status) *status = 0; return 0; }
    *pfn = NULL; if (status) *status = 1; return 500;
}
CUresult cuGetExportTable(const void** table, const void* id) { *table = NULL; return 500; }

// For the test: what is still alive (allocations, mappings, registrations, streams,
// events, modules are not counted) and the primary-context references.
int fake_cuda_live(void) {
    int n = live_objs;
    for (int i = 0; i < nallocs; i++) n += allocs[i].live;
    return n;
}
int fake_cuda_ctx_refs(void) { return ctx_refs; }
int fake_cuda_launches(void) { return launches; }

// Older cuda-python: cuGetProcAddress (v1), or dlsym of the versioned names.
CUresult cuGetProcAddress(const char* sym, void** pfn, int ver, uint64_t flags) {
    return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL);
}
#define ALIAS(n) __typeof__(n) n##_v2 __attribute__((alias(#n)));
ALIAS(cuMemAlloc) ALIAS(cuMemFree) ALIAS(cuMemGetAddressRange) ALIAS(cuMemHostGetDevicePointer)
ALIAS(cuIpcOpenMemHandle) ALIAS(cuMemHostRegister) ALIAS(cuStreamDestroy) ALIAS(cuEventDestroy)
ALIAS(cuDevicePrimaryCtxRelease) ALIAS(cuMemcpyHtoDAsync) ALIAS(cuMemcpyDtoHAsync)
ALIAS(cuEventElapsedTime)
