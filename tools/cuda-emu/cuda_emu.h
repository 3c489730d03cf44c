// cuda-emu: the CUDA C subset that kernels/*.cu use, as C++ that runs on the host.
//
// kernels.cpp includes every kernels/*.cu after this header; driver.cpp's cuLaunchKernel runs
// them. Each CUDA thread of a block is one call of the kernel function with its own threadIdx;
// kernels that call __syncthreads run their block's threads as fibers that meet at each
// barrier (every thread of the block reaches it before any goes on), the others run their
// threads one after the other. Shared memory is a thread_local static: blocks of one launch run
// in turn on the launching OS thread, so a block sees only its own.
//
// Numerics: compiled with -ffp-contract=off and without -ffast-math, each f32 expression is
// one correctly rounded IEEE operation, as kernels get with --fmad=false --prec-div=true
// --prec-sqrt=true --ftz=false under NVRTC.
#pragma once

#include <math.h>
#include <type_traits>
#include <utility>
#include <stdint.h>
#include <string.h>

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

namespace cuda_emu {

// The coordinates of the CUDA thread that is running.
struct ThreadCoords {
    dim3 thread_idx, block_idx, block_dim, grid_dim;
};

extern thread_local const ThreadCoords* current;

// The barrier: yields to the block's scheduler (driver.cpp); aborts in a kernel registered
// without barriers.
void syncthreads();

// A full-warp exchange: the value of the thread whose index within the block is this one's
// with the bits of `lane_mask` flipped (driver.cpp). Done as two block barriers around a
// write and a read of every thread's value, so a kernel that shuffles must be registered with
// barriers and every warp of a block must shuffle the same number of times (a GPU needs only
// the warp's lanes to; the emulator's barrier count check catches a kernel that relies on
// less).
unsigned int shfl_xor_bits(unsigned int mask, unsigned int value, int lane_mask);

}  // namespace cuda_emu

#define threadIdx (cuda_emu::current->thread_idx)
#define blockIdx (cuda_emu::current->block_idx)
#define blockDim (cuda_emu::current->block_dim)
#define gridDim (cuda_emu::current->grid_dim)

#define __global__
#define __device__
#define __forceinline__ inline
// A block's shared memory: every __shared__ variable of every kernel lies in one section, which
// launch() fills with 0xff bytes (NaN floats, all-ones integers) before each block, as a GPU
// gives a block memory some other block left behind: a kernel that reads shared memory before
// writing it in the same block reads poison, not the previous block's values. One section
// for the process, so launches run one at a time (driver.cpp).
#define __shared__ static __attribute__((section("cuda_emu_shared"), aligned(16)))
#define __syncthreads() cuda_emu::syncthreads()
// Occupancy hints for the compiler: nothing to do on the host.
#define __launch_bounds__(...)

// The vector types the kernels load and store whole (CUDA aligns each to its size).
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned int x, y;
};
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) {
    return float4{x, y, z, w};
}

inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    return u;
}
inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    memcpy(&i, &f, sizeof i);
    return i;
}
inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

// PTX prmt (default mode): byte i of the result is byte (s >> 4i) & 7 of the pair (x, y),
// x's bytes numbered 0..3 and y's 4..7.
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const unsigned long long pair = (unsigned long long)y << 32 | x;
    unsigned int out = 0;
    for (int i = 0; i < 4; ++i) {
        out |= (unsigned int)((pair >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    }
    return out;
}

// CUDA's integer min and max overloads, signed and unsigned (the unsigned ones compare as
// unsigned: a code word with its top bit set is the larger). A call mixing the two is
// ambiguous here, so a kernel says which comparison it means.
inline int min(int a, int b) {
    return a < b ? a : b;
}
inline int max(int a, int b) {
    return a > b ? a : b;
}
inline unsigned int min(unsigned int a, unsigned int b) {
    return a < b ? a : b;
}
inline unsigned int max(unsigned int a, unsigned int b) {
    return a > b ? a : b;
}

inline float __shfl_xor_sync(unsigned int mask, float value, int lane_mask) {
    return __uint_as_float(cuda_emu::shfl_xor_bits(mask, __float_as_uint(value), lane_mask));
}

// The warp's maximum of `value`, as five exchanges (so a kernel that reduces must be
// registered with barriers, as for __shfl_xor_sync).
inline unsigned int __reduce_max_sync(unsigned int mask, unsigned int value) {
    for (int o = 16; o > 0; o /= 2) {
        const unsigned int other = cuda_emu::shfl_xor_bits(mask, value, o);
        value = value > other ? value : other;
    }
    return value;
}

// Threads of one launch never run at the same time, so a plain add is atomic here.
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long val) {
    const unsigned long long old = *address;
    *address = old + val;
    return old;
}

namespace cuda_emu {

// One emulated kernel: its entry name, a function that calls it with cuLaunchKernel's
// parameter array, one that returns the index of its first pointer argument that is not
// device memory of the current device aligned for its type (-1: none), and whether it calls
// __syncthreads.
struct KernelEntry {
    const char* name;
    void (*invoke)(void** params);
    int (*bad_pointer)(void** params);
    bool barriers;
};

// Whether `p` lies in a live allocation of the current context's device and is a multiple
// of `align` (driver.cpp).
bool device_pointer_ok(const void* p, size_t align);

template <typename T>
bool argument_ok(void* param) {
    if constexpr (std::is_pointer_v<T>) {
        using Pointee = std::remove_cv_t<std::remove_pointer_t<T>>;
        return device_pointer_ok((const void*)*static_cast<T*>(param), alignof(Pointee));
    } else {
        return true;
    }
}

// Unpacks cuLaunchKernel's `void** params` (params[i] points at argument i, as the CUDA
// driver reads them) into a typed call of kernel `f`.
template <typename F, F f>
struct Invoker;

template <typename... A, void (*f)(A...)>
struct Invoker<void (*)(A...), f> {
    template <unsigned long... I>
    static void call(void** params, std::integer_sequence<unsigned long, I...>) {
        f(*static_cast<A*>(params[I])...);
    }
    static void run(void** params) {
        call(params, std::make_integer_sequence<unsigned long, sizeof...(A)>{});
    }
    template <unsigned long... I>
    static int first_bad(void** params, std::integer_sequence<unsigned long, I...>) {
        int bad = -1;
        ((bad < 0 && !argument_ok<A>(params[I]) ? (void)(bad = (int)I) : (void)0), ...);
        return bad;
    }
    static int bad_pointer(void** params) {
        return first_bad(params, std::make_integer_sequence<unsigned long, sizeof...(A)>{});
    }
};

// The kernel named `name`, or null (kernels.cpp).
const KernelEntry* find_kernel(const char* name);

}  // namespace cuda_emu
