// Muon element steps (optimizers/src/muon.rs, steps 1-2 and 4-5 of its table) on one run of a
// matrix: momentum (lerp, then Nesterov lerp or a copy) and apply (decay, then the update).
//
// Grid: any (grid-stride loops); block: 256 threads. Compiled with --fmad=false: one IEEE f32
// operation per line, in the CPU order, so both kernels equal the CPU bit for bit (the scalars
// 1 - mu, 1 - lr*wd, -lr*scale are rounded from f64 on the host). Launchers:
// optimizers/src/cuda/muon.rs (`MUON_MOMENTUM`, `MUON_APPLY`).

__device__ __forceinline__ float lerp_elem(float start, float end, float w) {
    if (fabsf(w) < 0.5f) {
        return start + w * (end - start);
    }
    return end - (end - start) * (1.0f - w);
}

// m <- lerp(m, g, w);  u <- lerp(g, m, mu) (nesterov != 0) or m.
extern "C" __global__ void muon_momentum(const float* g, float* m, float* u, unsigned long long n,
                                         float w, float mu, int nesterov) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float gi = g[i];
        const float m1 = lerp_elem(m[i], gi, w);
        m[i] = m1;
        u[i] = nesterov ? lerp_elem(gi, m1, mu) : m1;
    }
}

// p <- p*decay + neg_lr*o  (decay = 1 when not decayed: p*1 = p exactly).
extern "C" __global__ void muon_apply(float* p, const float* o, unsigned long long n, float decay,
                                      float neg_lr) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        p[i] = p[i] * decay + neg_lr * o[i];
    }
}
