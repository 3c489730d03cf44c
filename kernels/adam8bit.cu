// 8-bit Adam on 32x32 tiles of the global shape (optimizers/src/adam8bit.rs): one thread block
// per tile, the same dynamic maps, the same element order and the same quantizer as the CPU
// path (bnb 0.50 CPU-backend order: decay, dequantize, moments, update with the fresh f32
// moments, new per-tile absmax, requantize with ties going to the upper code, no sign fix-up).
//
// Grid: (tiles, 1, 1); block: 256 threads; static shared memory: 2 x 256 maps + 2 x 1024
// staged moments + reductions (about 10 KiB). A tile is `rows` (<= 32) rows of 32 columns,
// starting at element `tile_off[t]` of the local shard, rows `tile_stride[t]` elements apart;
// its scales are absmax_m[t], absmax_v[t] (local tile order, as on the CPU).
// Compiled with --fmad=false, --prec-div=true, --prec-sqrt=true, --ftz=false: every element
// operation is one IEEE f32 operation as on the CPU, and max is exact, so the result is
// bitwise equal to the CPU step. Launcher: optimizers/src/cuda/adam8bit.rs (`ADAM8BIT_TILES`).

#define TILE 32
#define THREADS 256
#define MAP_LEN 256

__device__ __forceinline__ float lerp_elem(float start, float end, float w) {
    if (fabsf(w) < 0.5f) {
        return start + w * (end - start);
    }
    return end - (end - start) * (1.0f - w);
}

// optimizers/src/quant.rs `quantize`: bisection to map[lo] <= x < map[hi], then the nearer,
// ties to the upper code; ends clamp; NaN gives 0.
__device__ __forceinline__ unsigned char quantize(float x, const float* map) {
    if (x <= map[0]) return 0;
    if (x >= map[MAP_LEN - 1]) return (unsigned char)(MAP_LEN - 1);
    int lo = 0, hi = MAP_LEN - 1;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (map[mid] <= x) lo = mid; else hi = mid;
    }
    return (map[hi] - x <= x - map[lo]) ? (unsigned char)hi : (unsigned char)lo;
}

__device__ __forceinline__ unsigned char quantize_scaled(float x, float absmax, const float* map,
                                                         unsigned char zero_code) {
    return absmax == 0.0f ? zero_code : quantize(x / absmax, map);
}

extern "C" __global__ void adam8bit_tiles(
    float* p, const float* g, unsigned char* mc, unsigned char* vc, float* absmax_m,
    float* absmax_v, const float* qmap_m, const float* qmap_v,
    const unsigned long long* tile_off, const unsigned int* tile_rows,
    const unsigned int* tile_stride, const float* tile_decay, float w, float beta2,
    float one_minus_beta2, float neg_step_size, float bc2_sqrt, float eps,
    unsigned char m_zero_code, unsigned char v_zero_code) {
    __shared__ float smap_m[MAP_LEN];
    __shared__ float smap_v[MAP_LEN];
    __shared__ float m_new[TILE * TILE];
    __shared__ float v_new[TILE * TILE];
    __shared__ float red_m[THREADS];
    __shared__ float red_v[THREADS];

    const unsigned int t = blockIdx.x;
    const unsigned int tid = threadIdx.x;
    for (unsigned int k = tid; k < MAP_LEN; k += blockDim.x) {
        smap_m[k] = qmap_m[k];
        smap_v[k] = qmap_v[k];
    }
    __syncthreads();

    const unsigned long long off = tile_off[t];
    const unsigned int rows = tile_rows[t];
    const unsigned long long stride = tile_stride[t];
    const float decay = tile_decay[t];
    const float old_am = absmax_m[t];
    const float old_av = absmax_v[t];
    float my_am = 0.0f, my_av = 0.0f;
    for (unsigned int e = tid; e < rows * TILE; e += blockDim.x) {
        const unsigned long long i = off + (e / TILE) * stride + (e % TILE);
        const float gi = g[i];
        const float p0 = p[i] * decay;
        const float m0 = smap_m[mc[i]] * old_am;
        const float v0 = smap_v[vc[i]] * old_av;
        const float m1 = lerp_elem(m0, gi, w);
        const float v1 = v0 * beta2 + (one_minus_beta2 * gi) * gi;
        p[i] = p0 + (neg_step_size * m1) / (sqrtf(v1) / bc2_sqrt + eps);
        m_new[e] = m1;
        v_new[e] = v1;
        // fmaxf returns the non-NaN operand, as Rust's f32::max does.
        my_am = fmaxf(my_am, fabsf(m1));
        my_av = fmaxf(my_av, v1);
    }
    red_m[tid] = my_am;
    red_v[tid] = my_av;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s /= 2) {
        if (tid < s) {
            red_m[tid] = fmaxf(red_m[tid], red_m[tid + s]);
            red_v[tid] = fmaxf(red_v[tid], red_v[tid + s]);
        }
        __syncthreads();
    }
    const float new_am = red_m[0];
    const float new_av = red_v[0];
    for (unsigned int e = tid; e < rows * TILE; e += blockDim.x) {
        const unsigned long long i = off + (e / TILE) * stride + (e % TILE);
        mc[i] = quantize_scaled(m_new[e], new_am, smap_m, m_zero_code);
        vc[i] = quantize_scaled(v_new[e], new_av, smap_v, v_zero_code);
    }
    if (tid == 0) {
        absmax_m[t] = new_am;
        absmax_v[t] = new_av;
    }
}
