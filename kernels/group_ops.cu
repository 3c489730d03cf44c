// Element ops on one f32 run (a gradient slot, a local shard): zero, scale, add, axpy, copy,
// and a count of non-finite elements.
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
