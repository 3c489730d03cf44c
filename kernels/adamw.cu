// Fused AdamW update of one contiguous run (optimizers/src/adamw.rs, steps 2-7 of its table).
//
// Grid: any (grid-stride loop); block: 256 threads. Compiled with --fmad=false, --prec-div=true,
// --prec-sqrt=true, --ftz=false: every line below is one correctly rounded IEEE f32 operation,
// in the order of the CPU element functions (optimizers/src/common.rs), so the result equals
// the CPU step bit for bit. The f64 scalars (1 - lr*wd, step size, sqrt(bc2)) are computed on
// the host, as on the CPU path; `decay` = 1 when the parameter is not decayed (p*1 = p exactly).
// Launcher: optimizers/src/cuda/adamw.rs (`ADAMW_STEP`).

__device__ __forceinline__ float lerp_elem(float start, float end, float w) {
    // torch's lerp: small-weight form when |w| < 0.5, large-weight form otherwise.
    if (fabsf(w) < 0.5f) {
        return start + w * (end - start);
    }
    return end - (end - start) * (1.0f - w);
}

extern "C" __global__ void adamw_step(float* p, const float* g, float* m, float* v,
                                      unsigned long long n, float decay, float w, float beta2,
                                      float one_minus_beta2, float neg_step_size, float bc2_sqrt,
                                      float eps) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float gi = g[i];
        const float p0 = p[i] * decay;
        const float m1 = lerp_elem(m[i], gi, w);
        const float v1 = v[i] * beta2 + (one_minus_beta2 * gi) * gi;
        const float denom = sqrtf(v1) / bc2_sqrt + eps;
        m[i] = m1;
        v[i] = v1;
        p[i] = p0 + (neg_step_size * m1) / denom;
    }
}
