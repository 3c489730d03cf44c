// Element ops on one f32 run (a gradient slot, a local shard): zero, scale, add, axpy, copy,
// a count of non-finite elements, the exact sum of squares of gradient clipping, and the bf16
// conversions (mixed precision's compute copies and gradients, Newton-Schulz in bf16).
//
// Grid: any (grid-stride loops); block: 256 threads. One IEEE f32 operation per element, so
// the results equal the host loops (src/storage.rs, ragged::optim::Sgd) bit for bit.
// Launchers: src/cuda/ops.rs (entry names `GROUP_*` there).

extern "C" __global__ void group_zero(float* x, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        x[i] = 0.0f;
    }
}

// x <- a*x
extern "C" __global__ void group_scale(float* x, float a, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        x[i] = x[i] * a;
    }
}

// x <- x + y
extern "C" __global__ void group_add(float* x, const float* y, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        x[i] = x[i] + y[i];
    }
}

// x <- x + a*y (the product rounded, then the sum: two operations, as the CPU's `x -= lr * y`
// with a = -lr; needs --fmad=false)
extern "C" __global__ void group_axpy(float* x, const float* y, float a, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        x[i] = x[i] + a * y[i];
    }
}

// x <- y
extern "C" __global__ void group_copy(float* x, const float* y, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        x[i] = y[i];
    }
}

// *count += the elements of x that are NaN or infinite (exponent bits all ones: a bit test, so
// no compiler flag can turn it into an approximation). One atomic per thread that found any.
extern "C" __global__ void group_count_non_finite(const float* x, unsigned long long n,
                                                  unsigned long long* count) {
    unsigned long long mine = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        mine += (__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u;
    }
    if (mine != 0) {
        atomicAdd(count, mine);
    }
}

// out <- x rounded to bf16 (its bits), to nearest even; a NaN stays a quiet NaN:
// half::bf16::from_f32's rounding.
__device__ __forceinline__ unsigned short to_bf16(float x) {
    const unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

extern "C" __global__ void group_f32_to_bf16(const float* x, unsigned short* out,
                                             unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = to_bf16(x[i]);
    }
}

// out <- x widened (exact).
extern "C" __global__ void group_bf16_to_f32(const unsigned short* x, float* out,
                                             unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = __uint_as_float(((unsigned int)x[i]) << 16);
    }
}

// x <- g widened (first != 0), else x + g widened: a bf16 gradient into its f32 slot (the
// host loop's operations: an exact widening, one f32 addition).
extern "C" __global__ void group_accumulate_bf16(float* x, const unsigned short* g,
                                                 unsigned long long n, unsigned int first) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float w = __uint_as_float(((unsigned int)g[i]) << 16);
        x[i] = first ? w : x[i] + w;
    }
}

// Gradient clipping's exact sum of squares (src/fsdp/clip.rs `ExactSquares`, whose bins this
// adds to): a finite x = m * 2^e (m the 24-bit significand, e = max(exponent field, 1) - 150)
// has the exact square (m^2 << 5) * 2^(2e - 5), a 53-bit integer in bin 2e - 5 - SQ_K_MIN
// (the f32 extremes give bins 49 to 555). out[0] counts the NaN and infinite elements; bin k
// is the 128-bit integer out[1 + 2k] + out[2 + 2k] * 2^64. Integer additions only, so the
// order of the threads changes no bit. Each thread block sums into shared bins first (a
// carry out of the low word goes to the high one: the adder that wraps it sees it), then
// adds its nonzero bins to out. Block: any size; static shared memory 2 x 560 words.
#define SQ_BINS 560
#define SQ_K_MIN (-352)

__device__ __forceinline__ void add_u128(unsigned long long* lo, unsigned long long* hi,
                                         unsigned long long v) {
    const unsigned long long old = atomicAdd(lo, v);
    if (old + v < old) atomicAdd(hi, 1ull);
}

extern "C" __global__ void group_exact_squares(const float* x, unsigned long long n,
                                               unsigned long long* out) {
    __shared__ unsigned long long lo[SQ_BINS], hi[SQ_BINS];
    for (unsigned int k = threadIdx.x; k < SQ_BINS; k += blockDim.x) lo[k] = 0, hi[k] = 0;
    __syncthreads();
    unsigned long long non_finite = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned int bits = __float_as_uint(x[i]) & 0x7fffffffu;
        const unsigned int field = bits >> 23;
        if (field == 0xffu) {
            ++non_finite;
        } else if (bits != 0) {
            const unsigned long long m = field != 0 ? (bits & 0x7fffffu) | 0x800000u : bits;
            const int e = (int)(field != 0 ? field : 1u) - 150;
            const int k = 2 * e - 5 - SQ_K_MIN;
            add_u128(&lo[k], &hi[k], (m * m) << 5);
        }
    }
    __syncthreads();
    for (unsigned int k = threadIdx.x; k < SQ_BINS; k += blockDim.x) {
        if (lo[k] != 0) add_u128(&out[1 + 2 * k], &out[2 + 2 * k], lo[k]);
        if (hi[k] != 0) atomicAdd(&out[2 + 2 * k], hi[k]);
    }
    if (non_finite != 0) atomicAdd(&out[0], non_finite);
}
