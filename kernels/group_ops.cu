// Element ops on one f32 run (a gradient slot, a local shard): zero, scale, add, axpy, copy.
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
