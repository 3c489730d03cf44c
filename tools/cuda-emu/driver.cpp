// cuda-emu: the subset of the CUDA driver API (libcuda.so.1) that cudarc's safe layer and
// ragged call, on host memory, so ragged's GPU code runs on a machine without a GPU.
//
// What it checks, as a real driver would: device ordinals, launch limits (block <= 1024
// threads, grid y and z <= 65535), that every copy and memset lies inside one live
// allocation, that a function is looked up in a module whose PTX (compiled by the real NVRTC)
// has that entry, and it fills fresh allocations with 0xFF bytes (NaN as f32) as a stand-in
// for the garbage cuMemAlloc returns, and a block's shared memory the same way before each
// block (cuda_emu.h). What it cannot: every call runs synchronously, in issue
// order, so a missing stream synchronization or event wait, which is a race on a GPU, goes
// unnoticed here; device pointers are host pointers, so a host read of device memory works
// here and faults there; kernels' own accesses are not bounds-checked (but their alignment
// is: build.sh compiles the kernels with -fsanitize=alignment, so a misaligned vector load,
// which faults on a GPU, aborts here).
//
// Environment: CUDA_EMU_DEVICES (default 1) devices of CUDA_EMU_MEM_MIB (default 16384) MiB
// each. Beyond the API: cuda_emu_device_memory, cuda_emu_allocations and cuda_emu_reset_peak
// (at the end) count each device's allocated bytes and allocations, for tests that prove a
// call allocates nothing.
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "cuda_emu.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum : CUresult {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

namespace {

struct Context {
    CUdevice device;
};
struct Stream {
    int id;
};
struct Event {
    unsigned int flags;
    bool recorded;
    std::chrono::steady_clock::time_point at;
};
const unsigned int CU_EVENT_DISABLE_TIMING = 2;
struct Module {
    std::set<std::string> entries;
};

bool initialized = false;
std::mutex lock;  // allocations, handles
struct Allocation {
    size_t bytes;
    CUdevice device;  // the current context's when allocated
};
std::map<unsigned long long, Allocation> allocations;  // by base address
// Per device: bytes live, and the most live since the last cuda_emu_reset_peak (test hooks
// below), so a test can see what a call allocated, even where it freed it before returning.
std::map<CUdevice, size_t> live_bytes, peak_bytes;
// Per device: allocations and their bytes since the last cuda_emu_reset_peak (a buffer freed
// and made again at the same size leaves the peak where it was, not these counts).
std::map<CUdevice, size_t> allocations_made, bytes_allocated;
thread_local Context* current_context = nullptr;

int device_count() {
    const char* s = getenv("CUDA_EMU_DEVICES");
    return s ? atoi(s) : 1;
}

size_t device_bytes() {
    const char* s = getenv("CUDA_EMU_MEM_MIB");
    return (s ? strtoull(s, nullptr, 10) : 16384ull) << 20;
}

Context* contexts() {
    static std::vector<Context> all = [] {
        std::vector<Context> v(device_count());
        for (size_t i = 0; i < v.size(); ++i) v[i].device = (CUdevice)i;
        return v;
    }();
    return all.data();
}

CUresult fail(CUresult code, const char* call, const std::string& why) {
    fprintf(stderr, "cuda-emu: %s: %s\n", call, why.c_str());
    return code;
}

// CUDA_SUCCESS when [ptr, ptr + bytes) lies inside one live allocation.
CUresult check_range(const char* call, CUdeviceptr ptr, size_t bytes) {
    std::lock_guard<std::mutex> g(lock);
    auto it = allocations.upper_bound(ptr);
    if (it != allocations.begin()) {
        --it;
        if (ptr >= it->first && ptr + bytes <= it->first + it->second.bytes) return CUDA_SUCCESS;
    }
    char why[160];
    snprintf(why, sizeof why, "[%#llx, +%zu bytes) is not inside one live device allocation", ptr,
             bytes);
    return fail(CUDA_ERROR_INVALID_VALUE, call, why);
}

CUdevice current_device() { return current_context ? current_context->device : 0; }

// The device of the live allocation holding `ptr` (one past its end included), or -1.
CUdevice device_of(const void* ptr) {
    const auto p = (unsigned long long)ptr;
    std::lock_guard<std::mutex> g(lock);
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return -1;
    --it;
    return p <= it->first + it->second.bytes ? it->second.device : -1;
}

CUresult alloc(const char* call, CUdeviceptr* out, size_t bytes) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    // cuMemAlloc documents CUDA_ERROR_INVALID_VALUE for 0 bytes; cuMemAllocAsync documents
    // nothing, so it is held to the same rule.
    if (bytes == 0) return fail(CUDA_ERROR_INVALID_VALUE, call, "zero bytes");
    std::lock_guard<std::mutex> g(lock);
    const CUdevice d = current_device();
    if (live_bytes[d] + bytes > device_bytes()) return CUDA_ERROR_OUT_OF_MEMORY;
    void* p = aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    memset(p, 0xFF, bytes);
    *out = (CUdeviceptr)p;
    allocations[*out] = {bytes, d};
    live_bytes[d] += bytes;
    peak_bytes[d] = std::max(peak_bytes[d], live_bytes[d]);
    ++allocations_made[d];
    bytes_allocated[d] += bytes;
    return CUDA_SUCCESS;
}

CUresult release(const char* call, CUdeviceptr ptr) {
    std::lock_guard<std::mutex> g(lock);
    auto it = allocations.find(ptr);
    if (it == allocations.end()) return fail(CUDA_ERROR_INVALID_VALUE, call, "not an allocation");
    live_bytes[it->second.device] -= it->second.bytes;
    allocations.erase(it);
    free((void*)ptr);
    return CUDA_SUCCESS;
}

CUresult copy(const char* call, void* dst, const void* src, size_t bytes, bool dst_dev,
              bool src_dev) {
    if (bytes == 0) return CUDA_SUCCESS;  // empty slices copy nothing; nothing to check
    if (dst_dev) {
        if (CUresult r = check_range(call, (CUdeviceptr)dst, bytes)) return r;
    }
    if (src_dev) {
        if (CUresult r = check_range(call, (CUdeviceptr)src, bytes)) return r;
    }
    memmove(dst, src, bytes);
    return CUDA_SUCCESS;
}

template <typename T>
CUresult fill(const char* call, CUdeviceptr dst, T value, size_t n) {
    if (dst % sizeof(T)) return fail(CUDA_ERROR_INVALID_VALUE, call, "misaligned destination");
    if (CUresult r = check_range(call, dst, n * sizeof(T))) return r;
    T* p = (T*)dst;
    for (size_t i = 0; i < n; ++i) p[i] = value;
    return CUDA_SUCCESS;
}

}  // namespace

// ---- kernel execution ------------------------------------------------------------------------

namespace cuda_emu {

thread_local const ThreadCoords* current = nullptr;

bool device_pointer_ok(const void* p, size_t align) {
    return device_of(p) == current_device() && (uintptr_t)p % align == 0;
}

namespace {

#if !defined(__x86_64__)
#error "cuda-emu's fiber switch (cuda_emu_switch below) is written for x86-64"
#endif

const size_t FIBER_STACK = 64 << 10;

// Switches stacks: saves the callee-saved registers on the current stack and its stack
// pointer in *save, then continues on the stack `load` (saved the same way, or made by
// new_fiber_stack). Hand-written because swapcontext makes a system call per switch (it saves
// the signal mask), which was a third of the emulation's time.
extern "C" void cuda_emu_switch(void** save, void* load);
asm(R"(
    .text
    .globl cuda_emu_switch
    .type cuda_emu_switch, @function
cuda_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuda_emu_switch, .-cuda_emu_switch
)");

// The threads of one block as fibers, for kernels with barriers.
struct Block {
    void* scheduler = nullptr;
    std::vector<void*> fibers;  // each fiber's saved stack pointer
    std::vector<ThreadCoords> coords;
    std::vector<char> done;
    std::vector<unsigned> barriers;  // each thread's count of barriers passed
    std::vector<unsigned> exchange;  // each thread's value in a warp shuffle
    char* stacks = nullptr;
    size_t running = 0;
    const KernelEntry* kernel = nullptr;
    void** params = nullptr;
};

thread_local Block* block_now = nullptr;

[[noreturn]] void fiber_main() {
    Block* b = block_now;
    const size_t me = b->running;
    b->kernel->invoke(b->params);
    b->done[me] = 1;
    cuda_emu_switch(&b->fibers[me], b->scheduler);
    __builtin_unreachable();  // a finished fiber is never resumed
}

// Stacks for `n` fibers, each FIBER_STACK bytes above an inaccessible GUARD page (a kernel
// whose locals outgrow its stack faults instead of writing into its neighbour's); kept per OS
// thread and grown as launches need.
const size_t GUARD = 4096;

char* fiber_stacks(size_t n) {
    thread_local char* base = nullptr;
    thread_local size_t have = 0;
    if (n <= have) return base;
    const size_t each = FIBER_STACK + GUARD;
    void* m = mmap(nullptr, n * each, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        perror("cuda-emu: fiber stacks");
        abort();
    }
    for (size_t t = 0; t < n; ++t) mprotect((char*)m + t * each, GUARD, PROT_NONE);
    if (base) munmap(base, have * each);
    base = (char*)m, have = n;
    return base;
}

// A stack whose first switch "returns" into fiber_main with the alignment of a call.
void* new_fiber_stack(char* base) {
    uintptr_t top = ((uintptr_t)(base + GUARD + FIBER_STACK) & ~(uintptr_t)15) - 16;
    void** sp = (void**)top;
    *sp = (void*)&fiber_main;  // the return address; after `ret`, rsp = top + 8 (a call's)
    for (int r = 0; r < 6; ++r) *--sp = nullptr;  // rbp, rbx, r12-r15
    return sp;
}

void run_block_with_barriers(Block& b, bool start_forward) {
    const size_t n = b.coords.size();
    for (size_t t = 0; t < n; ++t) {
        b.fibers[t] = new_fiber_stack(b.stacks + t * (FIBER_STACK + GUARD));
        b.done[t] = 0;
    }
    // Each round runs every live thread up to its next barrier or its end, so no thread passes
    // barrier k before every thread has reached it. Rounds alternate the order of the threads,
    // so a read of another thread's write with no barrier between them sees the old value in
    // one round or the other whichever thread is lower; and blocks alternate which order comes
    // first, so every round of a kernel runs in both orders somewhere in a grid of two blocks
    // or more (a stretch after a kernel's last barrier, too).
    std::fill(b.barriers.begin(), b.barriers.end(), 0);
    bool forward = start_forward;
    for (bool live = true; live; forward = !forward) {
        live = false;
        for (size_t i = 0; i < n; ++i) {
            const size_t t = forward ? i : n - 1 - i;
            if (b.done[t]) continue;
            b.running = t;
            current = &b.coords[t];
            cuda_emu_switch(&b.scheduler, b.fibers[t]);
            live |= !b.done[t];
        }
    }
    // A barrier that some threads of a block skip is undefined behaviour on a GPU.
    for (size_t t = 1; t < n; ++t) {
        if (b.barriers[t] != b.barriers[0]) {
            fprintf(stderr,
                    "cuda-emu: %s: thread %zu of a block passed %u barriers, thread 0 %u\n",
                    b.kernel->name, t, b.barriers[t], b.barriers[0]);
            abort();
        }
    }
}

}  // namespace

void syncthreads() {
    Block* b = block_now;
    if (!b) {
        fprintf(stderr,
                "cuda-emu: a kernel registered without barriers called __syncthreads "
                "(tools/cuda-emu/kernels.cpp)\n");
        abort();
    }
    ++b->barriers[b->running];
    cuda_emu_switch(&b->fibers[b->running], b->scheduler);
}

unsigned int shfl_xor_bits(unsigned int mask, unsigned int value, int lane_mask) {
    Block* b = block_now;
    if (!b || mask != 0xffffffffu || lane_mask < 0 || lane_mask >= 32 ||
        b->coords.size() % 32 != 0) {
        fprintf(stderr,
                "cuda-emu: __shfl_xor_sync needs a kernel registered with barriers, a block of "
                "whole warps, the full mask and a lane mask below 32\n");
        abort();
    }
    const size_t me = b->running;
    b->exchange[me] = value;
    syncthreads();  // every thread has written
    const unsigned int got = b->exchange[me ^ (size_t)lane_mask];
    syncthreads();  // every thread has read before any writes its next value
    return got;
}

// The bounds of the kernels' shared memory (cuda_emu.h's __shared__; the linker names them).
extern "C" char __start_cuda_emu_shared[] __attribute__((weak));
extern "C" char __stop_cuda_emu_shared[] __attribute__((weak));

void poison_shared_memory() {
    if (__start_cuda_emu_shared)
        memset(__start_cuda_emu_shared, 0xff, __stop_cuda_emu_shared - __start_cuda_emu_shared);
}

// Kernels share one shared-memory section, so one launch runs at a time (threads of several
// OS threads' launches never ran together anyway: each block runs on its caller's thread).
std::mutex launch_lock;

void launch(const KernelEntry* k, dim3 grid, dim3 block, void** params) {
    std::lock_guard<std::mutex> one_at_a_time(launch_lock);
    const size_t threads = (size_t)block.x * block.y * block.z;
    ThreadCoords c;
    c.grid_dim = grid;
    c.block_dim = block;
    Block b;
    if (k->barriers) {
        b.fibers.resize(threads);
        b.coords.assign(threads, c);
        b.done.assign(threads, 0);
        b.barriers.assign(threads, 0);
        b.exchange.assign(threads, 0);
        b.stacks = fiber_stacks(threads);
        b.kernel = k;
        b.params = params;
    }
    Block* outer = block_now;
    block_now = k->barriers ? &b : nullptr;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                size_t t = 0;
                poison_shared_memory();
                for (unsigned tz = 0; tz < block.z; ++tz)
                    for (unsigned ty = 0; ty < block.y; ++ty)
                        for (unsigned tx = 0; tx < block.x; ++tx, ++t) {
                            ThreadCoords& me = k->barriers ? b.coords[t] : c;
                            me.block_idx = {bx, by, bz};
                            me.thread_idx = {tx, ty, tz};
                            if (!k->barriers) {
                                current = &me;
                                k->invoke(params);
                            }
                        }
                if (k->barriers) run_block_with_barriers(b, (bx + by + bz) % 2 == 0);
            }
    block_now = outer;
    current = nullptr;
}

}  // namespace cuda_emu

// ---- the driver API ----------------------------------------------------------------------------

extern "C" {

CUresult cuInit(unsigned int) {
    initialized = true;
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int* v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 13000;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int* n) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = device_count();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "cuda-emu %d (CPU emulation, not a GPU)", d);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(unsigned char* uuid, CUdevice d) {
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    memset(uuid, 0, 16);
    uuid[0] = (unsigned char)d;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid_v2(unsigned char* uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = device_bytes();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* value, int attribute, CUdevice d) {
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    switch (attribute) {
        case 1: *value = 1024; break;        // MAX_THREADS_PER_BLOCK
        case 2: *value = 1024; break;        // MAX_BLOCK_DIM_X
        case 3: *value = 1024; break;        // MAX_BLOCK_DIM_Y
        case 4: *value = 64; break;          // MAX_BLOCK_DIM_Z
        case 5: *value = 2147483647; break;  // MAX_GRID_DIM_X
        case 6: *value = 65535; break;       // MAX_GRID_DIM_Y
        case 7: *value = 65535; break;       // MAX_GRID_DIM_Z
        case 8: *value = 49152; break;       // MAX_SHARED_MEMORY_PER_BLOCK
        case 10: *value = 32; break;         // WARP_SIZE
        case 16: *value = 132; break;        // MULTIPROCESSOR_COUNT
        case 75: *value = 9; break;          // COMPUTE_CAPABILITY_MAJOR
        case 76: *value = 0; break;          // COMPUTE_CAPABILITY_MINOR
        case 115: *value = 1; break;         // MEMORY_POOLS_SUPPORTED, as on an H100 / H200
        default: *value = 0; break;
    }
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice d) {
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *ctx = &contexts()[d];
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    return d < 0 || d >= device_count() ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(void* ctx) {
    current_context = (Context*)ctx;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = current_context;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(CUdevice* d) {
    if (!current_context) return CUDA_ERROR_INVALID_CONTEXT;
    *d = current_context->device;
    return CUDA_SUCCESS;
}
thread_local std::vector<Context*> pushed_contexts;
CUresult cuCtxPushCurrent_v2(void* ctx) {
    pushed_contexts.push_back(current_context);
    return cuCtxSetCurrent(ctx);
}
CUresult cuCtxPopCurrent_v2(void** ctx) {
    if (pushed_contexts.empty()) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx) *ctx = current_context;
    current_context = pushed_contexts.back();
    pushed_contexts.pop_back();
    return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize() { return CUDA_SUCCESS; }

CUresult cuStreamCreate(void** s, unsigned int) {
    static int next = 1;
    std::lock_guard<std::mutex> g(lock);
    *s = new Stream{next++};
    return CUDA_SUCCESS;
}
CUresult cuStreamCreateWithPriority(void** s, unsigned int flags, int) {
    return cuStreamCreate(s, flags);
}
CUresult cuStreamDestroy_v2(void* s) {
    delete (Stream*)s;
    return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(void*) { return CUDA_SUCCESS; }
CUresult cuStreamQuery(void*) { return CUDA_SUCCESS; }
CUresult cuStreamWaitEvent(void*, void* e, unsigned int) {
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(void** e, unsigned int flags) {
    *e = new Event{flags, false, std::chrono::steady_clock::now()};
    return CUDA_SUCCESS;
}
CUresult cuEventDestroy_v2(void* e) {
    delete (Event*)e;
    return CUDA_SUCCESS;
}
CUresult cuEventRecord(void* e, void*) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    ((Event*)e)->at = std::chrono::steady_clock::now();
    ((Event*)e)->recorded = true;
    return CUDA_SUCCESS;
}
CUresult cuEventRecordWithFlags(void* e, void* s, unsigned int) { return cuEventRecord(e, s); }
CUresult cuEventSynchronize(void* e) { return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }
CUresult cuEventQuery(void* e) { return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }
CUresult cuEventElapsedTime(float* ms, void* start, void* end) {
    if (!ms || !start || !end) return CUDA_ERROR_INVALID_VALUE;
    for (const Event* e : {(const Event*)start, (const Event*)end}) {
        if (!e->recorded || (e->flags & CU_EVENT_DISABLE_TIMING))
            return fail(CUDA_ERROR_INVALID_HANDLE, "cuEventElapsedTime",
                        "an event not recorded, or made with CU_EVENT_DISABLE_TIMING");
    }
    *ms = std::chrono::duration<float, std::milli>(((Event*)end)->at - ((Event*)start)->at).count();
    return CUDA_SUCCESS;
}
CUresult cuEventElapsedTime_v2(float* ms, void* start, void* end) {
    return cuEventElapsedTime(ms, start, end);
}

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) { return alloc("cuMemAlloc", p, bytes); }
CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, void*) {
    return alloc("cuMemAllocAsync", p, bytes);
}
CUresult cuMemFree_v2(CUdeviceptr p) { return release("cuMemFree", p); }
CUresult cuMemFreeAsync(CUdeviceptr p, void*) { return release("cuMemFreeAsync", p); }

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::mutex> g(lock);
    *total = device_bytes();
    *free_bytes = device_bytes() - live_bytes[current_device()];
    return CUDA_SUCCESS;
}

CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return fill("cuMemsetD8", d, v, n); }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void*) {
    return fill("cuMemsetD8Async", d, v, n);
}
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n) { return fill("cuMemsetD32", d, v, n); }
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, void*) {
    return fill("cuMemsetD32Async", d, v, n);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    return copy("cuMemcpyHtoD", (void*)dst, src, n, true, false);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void*) {
    return copy("cuMemcpyHtoDAsync", (void*)dst, src, n, true, false);
}
CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    return copy("cuMemcpyDtoH", dst, (const void*)src, n, false, true);
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void*) {
    return copy("cuMemcpyDtoHAsync", dst, (const void*)src, n, false, true);
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy("cuMemcpyDtoD", (void*)dst, (const void*)src, n, true, true);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void*) {
    return copy("cuMemcpyDtoDAsync", (void*)dst, (const void*)src, n, true, true);
}
CUresult cuMemcpyPeerAsync(CUdeviceptr dst, void*, CUdeviceptr src, void*, size_t n, void*) {
    return copy("cuMemcpyPeerAsync", (void*)dst, (const void*)src, n, true, true);
}

// The module's entries are the `.entry` names of the PTX NVRTC made.
CUresult cuModuleLoadData(void** module, const void* image) {
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    const std::string ptx((const char*)image);
    if (ptx.find(".version") == std::string::npos)
        return fail(CUDA_ERROR_INVALID_IMAGE, "cuModuleLoadData", "not PTX text");
    Module* m = new Module;
    for (size_t at = ptx.find(".entry "); at != std::string::npos; at = ptx.find(".entry ", at + 1)) {
        size_t start = at + 7;
        size_t end = ptx.find_first_of("( \n", start);
        m->entries.insert(ptx.substr(start, end - start));
    }
    *module = m;
    return CUDA_SUCCESS;
}
CUresult cuModuleUnload(void* module) {
    delete (Module*)module;
    return CUDA_SUCCESS;
}
CUresult cuModuleGetFunction(void** f, void* module, const char* name) {
    if (!f || !module || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!((Module*)module)->entries.count(name))
        return fail(CUDA_ERROR_NOT_FOUND, "cuModuleGetFunction",
                    std::string("the module's PTX has no entry ") + name);
    const cuda_emu::KernelEntry* k = cuda_emu::find_kernel(name);
    if (!k)
        return fail(CUDA_ERROR_NOT_FOUND, "cuModuleGetFunction",
                    std::string("no emulation of ") + name + " (tools/cuda-emu/kernels.cpp)");
    *f = (void*)k;
    return CUDA_SUCCESS;
}
// As an H100 / H200 multiprocessor would hold them by threads alone (2048 per
// multiprocessor, at most 32 blocks); registers and shared memory are not modelled.
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, void*, int block_size,
                                                              size_t, unsigned int) {
    if (!n || block_size <= 0 || block_size > 1024) return CUDA_ERROR_INVALID_VALUE;
    *n = std::min(2048 / block_size, 32);
    return CUDA_SUCCESS;
}

CUresult cuFuncGetAttribute(int* v, int, void*) {
    *v = 0;
    return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(void*, int, int) { return CUDA_SUCCESS; }
CUresult cuFuncSetCacheConfig(void*, int) { return CUDA_SUCCESS; }

CUresult cuLaunchKernel(void* f, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                        void*, void** params, void** extra) {
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    const auto* k = (const cuda_emu::KernelEntry*)f;
    char why[200];
    snprintf(why, sizeof why, "%s: grid (%u, %u, %u), block (%u, %u, %u), %u B dynamic shared",
             k->name, gx, gy, gz, bx, by, bz, shared);
    const unsigned long long threads = (unsigned long long)bx * by * bz;
    if (!gx || !gy || !gz || !bx || !by || !bz || gx > 2147483647u || gy > 65535 || gz > 65535 ||
        bx > 1024 || by > 1024 || bz > 64 || threads > 1024 || shared > 49152)
        return fail(CUDA_ERROR_INVALID_VALUE, "cuLaunchKernel", why);
    if (extra) return fail(CUDA_ERROR_NOT_SUPPORTED, "cuLaunchKernel", "`extra` parameters");
    const int bad = k->bad_pointer(params);
    if (bad >= 0) {
        // On a GPU the kernel would fault (CUDA_ERROR_ILLEGAL_ADDRESS, reported at the next
        // synchronization) or read another device's memory.
        return fail(CUDA_ERROR_ILLEGAL_ADDRESS, "cuLaunchKernel",
                    std::string(why) + ": argument " + std::to_string(bad) +
                        " is not device memory of the current device, aligned for its type");
    }
    dim3 grid, block;
    grid.x = gx, grid.y = gy, grid.z = gz;
    block.x = bx, block.y = by, block.z = bz;
    cuda_emu::launch(k, grid, block, params);
    return CUDA_SUCCESS;
}

// For libcublas.so.13 (cublas.cpp): 0 when [ptr, ptr + bytes) is device memory.
int cuda_emu_check_range(const char* call, unsigned long long ptr, size_t bytes) {
    return check_range(call, ptr, bytes);
}

// For libnccl.so.2 (nccl.cpp): the device of the allocation holding `ptr` (-1: none), and the
// current context's device.
int cuda_emu_device_of(const void* ptr) { return device_of(ptr); }
int cuda_emu_current_device() { return current_device(); }

// Test hooks, no CUDA API (a test finds them with dlsym and knows it runs here): the bytes
// live on device `d` and the most that were live since the last reset, counted at every
// cuMemAlloc(Async) and cuMemFree(Async) whoever calls it; the allocations made since the
// reset and their bytes; and that reset (peak = live, no allocations).
int cuda_emu_device_memory(int d, size_t* live, size_t* peak) {
    if (d < 0 || d >= device_count() || !live || !peak) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> g(lock);
    *live = live_bytes[d];
    *peak = peak_bytes[d];
    return CUDA_SUCCESS;
}
int cuda_emu_allocations(int d, size_t* made, size_t* bytes) {
    if (d < 0 || d >= device_count() || !made || !bytes) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> g(lock);
    *made = allocations_made[d];
    *bytes = bytes_allocated[d];
    return CUDA_SUCCESS;
}
int cuda_emu_reset_peak(int d) {
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> g(lock);
    peak_bytes[d] = live_bytes[d];
    allocations_made[d] = bytes_allocated[d] = 0;
    return CUDA_SUCCESS;
}

// NVRTC opens libcuda.so.1 and asks for an internal table; without one it compiles anyway.
CUresult cuGetExportTable(const void** table, const void*) {
    if (table) *table = nullptr;
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cuGetErrorString(CUresult e, const char** s) {
    static thread_local char text[64];
    snprintf(text, sizeof text, "cuda-emu error %d", e);
    *s = text;
    return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult e, const char** s) { return cuGetErrorString(e, s); }

}  // extern "C"
