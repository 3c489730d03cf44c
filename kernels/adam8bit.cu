// 8-bit Adam on 256-element scale blocks inside 32-row blocks of the global shape
// (optimizers/src/adam8bit.rs): one thread block per scale block, the same dynamic maps, the
// same element order and the same quantizer as the CPU path (bnb 0.50 CPU-backend order:
// decay, dequantize, moments, update with the fresh f32 moments, new per-block scales rounded
// to 16 bits, requantize with ties going to the upper code, no sign fix-up, and a positive v
// never on code 0).
//
// Grid: (blocks, 1, 1); block: 256 threads, one element each; static shared memory: 2 x 256
// maps + reductions (about 4 KiB). A scale block is `block_len[b]` (<= 256, a multiple of 32)
// consecutive elements starting at element `block_off[b]` of the local shard; its scales are
// scale_m[b], scale_v[b] (16-bit codes: bits 30..15 of the f32; local order, as on the CPU).
// Compiled with --fmad=false, --prec-div=true, --prec-sqrt=true, --ftz=false: every element
// operation is one IEEE f32 operation as on the CPU, and max is exact, so the result is
// bitwise equal to the CPU step. Launcher: optimizers/src/cuda/adam8bit.rs (`ADAM8BIT_BLOCKS`).

#define BLOCK 256
#define MAP_LEN 256
#define SCALE_SHIFT 15

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

// optimizers/src/quant.rs `quantize_scaled` and `Unscale`: x times the scale's reciprocal when
// that is finite, else x / scale.
__device__ __forceinline__ unsigned char quantize_scaled(float x, float scale, const float* map,
                                                         unsigned char zero_code) {
    if (scale == 0.0f) return zero_code;
    const float r = 1.0f / scale;
    return quantize(isfinite(r) ? x * r : x / scale, map);
}

// optimizers/src/quant.rs `encode_scale` / `decode_scale`.
__device__ __forceinline__ unsigned short encode_scale(float absmax) {
    const unsigned int bits = __float_as_uint(absmax) & 0x7fffffffu;
    const unsigned int rounded = (bits + (1u << (SCALE_SHIFT - 1))) >> SCALE_SHIFT;
    const unsigned int infinity = 0x7f800000u >> SCALE_SHIFT;
    if (rounded == infinity && bits <= 0x7f800000u) return (unsigned short)(infinity - 1);
    return (unsigned short)rounded;
}

__device__ __forceinline__ float decode_scale(unsigned short code) {
    return __uint_as_float(((unsigned int)code) << SCALE_SHIFT);
}

extern "C" __global__ void adam8bit_blocks(
    float* p, const float* g, unsigned char* mc, unsigned char* vc, unsigned short* scale_m,
    unsigned short* scale_v, const float* qmap_m, const float* qmap_v,
    const unsigned long long* block_off, const unsigned int* block_len, const float* block_decay,
    float w, float beta2, float one_minus_beta2, float folded_neg_step_size, float folded_eps,
    unsigned char m_zero_code, unsigned char v_zero_code) {
    __shared__ float smap_m[MAP_LEN];
    __shared__ float smap_v[MAP_LEN];
    __shared__ float red_m[BLOCK];
    __shared__ float red_v[BLOCK];

    const unsigned int b = blockIdx.x;
    const unsigned int tid = threadIdx.x;
    for (unsigned int k = tid; k < MAP_LEN; k += blockDim.x) {
        smap_m[k] = qmap_m[k];
        smap_v[k] = qmap_v[k];
    }
    __syncthreads();

    const unsigned long long i = block_off[b] + tid;
    const bool mine = tid < block_len[b];
    float m1 = 0.0f, v1 = 0.0f;
    if (mine) {
        const float old_sm = decode_scale(scale_m[b]);
        const float old_sv = decode_scale(scale_v[b]);
        const float gi = g[i];
        const float p0 = p[i] * block_decay[b];
        const float m0 = smap_m[mc[i]] * old_sm;
        const float v0 = smap_v[vc[i]] * old_sv;
        m1 = lerp_elem(m0, gi, w);
        v1 = v0 * beta2 + (one_minus_beta2 * gi) * gi;
        // common.rs `apply_folded_adam_elem`: sqrt(bc2) folded into the step size and eps.
        p[i] = p0 + (folded_neg_step_size * m1) / (sqrtf(v1) + folded_eps);
    }
    // fmaxf returns the non-NaN operand, as Rust's f32::max does; every value enters as
    // max(+0.0, x), where the CPU's maxima start (so a NaN never reaches the reduction), and
    // idle threads add +0.0.
    red_m[tid] = fmaxf(0.0f, fabsf(m1));
    red_v[tid] = fmaxf(0.0f, v1);
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s /= 2) {
        if (tid < s) {
            red_m[tid] = fmaxf(red_m[tid], red_m[tid + s]);
            red_v[tid] = fmaxf(red_v[tid], red_v[tid + s]);
        }
        __syncthreads();
    }
    const unsigned short new_m = encode_scale(red_m[0]);
    const unsigned short new_v = encode_scale(red_v[0]);
    if (mine) {
        mc[i] = quantize_scaled(m1, decode_scale(new_m), smap_m, m_zero_code);
        unsigned char cv = quantize_scaled(v1, decode_scale(new_v), smap_v, v_zero_code);
        // The second-moment floor (quant.rs `keep_positive_nonzero`).
        vc[i] = (cv == 0 && v1 > 0.0f) ? 1 : cv;
    }
    if (tid == 0) {
        scale_m[b] = new_m;
        scale_v[b] = new_v;
    }
}
