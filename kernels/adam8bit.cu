// 8-bit Adam on 256-element scale blocks inside 32-row blocks of the global shape
// (optimizers/src/adam8bit.rs): the same dynamic maps, the same element order and the same
// quantizer as the CPU path (bnb 0.50 CPU-backend order: decay, dequantize, moments, update
// with the fresh f32 moments, new per-block scales rounded to 16 bits, requantize with ties
// going to the upper code, no sign fix-up, and a positive v never on code 0).
//
// Work: one warp per scale block, 8 elements per lane; the block's absmax is a warp
// reduction. A whole block whose arrays are aligned is read and written in vectors (lane l
// holds elements 8l..8l+7: two 16-byte loads of f32 and one 8-byte load of codes per array);
// any other (a partial last block of a row block, an unaligned shard) element by element
// (lane l holds l, l + 32, ..., so each load of the warp reads consecutive bytes). The grid
// strides over the scale blocks, one per warp of a thread block per pass, every thread of a
// block making the same passes (the loop bound is the block's, not the warp's), so every warp
// reduces the same number of times. Grid: (min(blocks needed, the blocks the device holds at
// once), 1, 1); block: 256 or 128 threads, whichever keeps more warps resident (the launcher
// asks the driver; at most 64 registers a thread, so 32 warps either way); static shared
// memory: the quantizer table (TABLE_WORDS words, about 27.5 KiB), loaded once per thread
// block.
//
// Measured on an H200 (docs/benchmarks.md, optim-cuda): the kernel is bound by instruction
// issue, not memory (Nsight Compute: 66 % of issue slots busy at 47 % of DRAM bandwidth).
// So the per-element work is branch-free where it can be (the quantizer, the choice between
// quantize_scaled's forms, made once per block), a quantization is one shared-memory read
// and a few integer operations, and the parameters are stored before the requantization so
// that their registers are free.
//
// Where a scale block lies: `segments` holds runs of equal row blocks (S_WORDS words each,
// ordered by first scale): the run's first element in the local shard, its row blocks'
// length, the scale blocks per row block (256 elements each, the last one possibly shorter),
// the run's first scale index and the decay factor of its parameter. Scale s lies in the last
// run whose first scale is <= s. Built by optimizers/src/cuda/adam8bit.rs (`segments`) from
// the host step's row-block walk; its scale order is the CPU's (`scale_m[s]`, `scale_v[s]`:
// 16-bit codes, bits 30..15 of the f32).
//
// The quantizer: quant.rs `CodeBook::quantize`, its index table read from shared memory. The
// bucket of x is its exponent and top mantissa bits, b = clamp((|x| bits >> shift) - lo, 0,
// last), the sign picks a table half; within a bucket, f32 order is the order of the low
// bits (reversed for negatives, which the xor with the sign mask undoes), and the bucket's
// word holds base << 24 + (2^24 - the low bits of the one threshold inside, or 2^24 - 2^shift
// where there is none), so that adding x's low bits carries into the top byte exactly when
// x is at or above the threshold: the code is bits 24..31 of entry + low bits. The launcher
// transforms CodeBook's words (base << 24 | threshold low bits) into this form (`MapIndex`).
// A map whose negative x all take code 0 (the unsigned map) has no negative half: its x are
// shifted as signed integers, so a negative x falls below bucket 0's clamp into bucket 0.
//
// Compiled with --fmad=false, --prec-div=true, --prec-sqrt=true, --ftz=false: every element
// operation is one IEEE f32 operation as on the CPU, and max is exact in any order, so the
// result is bitwise equal to the CPU step. Launcher: optimizers/src/cuda/adam8bit.rs.

#define WARP 32
#define SCALE_BLOCK 256
#define PER_LANE (SCALE_BLOCK / WARP)
#define SCALE_SHIFT 15
#define FULL_MASK 0xffffffffu

// The quantizer table: m's map, v's map, then both maps' bucket words (offsets in
// `MapIndex`). The size of the two dynamic maps' tables (the launcher checks it): 2 x 256 map
// words, 2 x 1600 signed buckets, 3328 unsigned ones.
#define TABLE_WORDS 7040
#define T_MAP_M 0
#define T_MAP_V 256
// The code's place in a bucket word plus low bits.
#define CODE_SHIFT 24

#define S_OFF_LO 0
#define S_OFF_HI 1
#define S_ROW_BLOCK_LEN 2
#define S_SCALES_PER_ROW_BLOCK 3
#define S_FIRST_SCALE 4
#define S_DECAY 5
#define S_WORDS 6

// One map's index (optimizers/src/cuda/adam8bit.rs `MapIndex`, same fields in the same
// order): a kernel argument, so its fields are read from the constant bank.
struct MapIndex {
    unsigned int buckets;   // word offset of its bucket words
    unsigned int abs_mask;  // 0x7fffffff; 0xffffffff: no negative half (x shifted as signed)
    unsigned int shift;     // 23 - the index's mantissa bits
    int lo;                 // bucket 0's top: min_exp << mantissa bits
    int last;               // buckets per half - 1
    unsigned int half;      // words from a bucket to its negative twin (0: none)
    unsigned int low_mask;  // (1 << shift) - 1
};

__device__ __forceinline__ float lerp_elem(float start, float end, float w) {
    if (fabsf(w) < 0.5f) {
        return start + w * (end - start);
    }
    return end - (end - start) * (1.0f - w);
}

// quant.rs `CodeBook::quantize`, bit for bit, for x that is not NaN, as a bucket word plus
// low bits: the code is bits 24..31. (A NaN's bucket is a clamped end one, so its lookup
// stays inside the table.)
__device__ __forceinline__ unsigned int quantize_number(float x, const unsigned int* t,
                                                        MapIndex ix) {
    const unsigned int bits = __float_as_uint(x);
    const unsigned int sign = (unsigned int)((int)bits >> 31);
    const int a = (int)(bits & ix.abs_mask) >> ix.shift;
    const int b = min(max(a, ix.lo) - ix.lo, ix.last);
    const unsigned int word = t[ix.buckets + (unsigned int)b + (sign & ix.half)];
    return word + ((bits ^ sign) & ix.low_mask);
}

// quantize_number of x = m * r for r > 0 and m not NaN, from m's sign and |m| * r, which is
// |x| (round to nearest is symmetric), so its bucket needs no mask.
__device__ __forceinline__ unsigned int quantize_product(float m, float r, const unsigned int* t,
                                                         MapIndex ix) {
    const unsigned int sign = (unsigned int)((int)__float_as_uint(m) >> 31);
    const unsigned int abs_bits = __float_as_uint(fabsf(m) * r);
    const int b = min(max((int)(abs_bits >> ix.shift), ix.lo) - ix.lo, ix.last);
    const unsigned int word = t[ix.buckets + (unsigned int)b + (sign & ix.half)];
    return word + ((abs_bits ^ sign) & ix.low_mask);
}

// quantize_number for x that is +0.0 or above (so never NaN): the positive half, no sign.
__device__ __forceinline__ unsigned int quantize_nonnegative(float x, const unsigned int* t,
                                                             MapIndex ix) {
    const unsigned int bits = __float_as_uint(x);
    const int b = min(max((int)(bits >> ix.shift), ix.lo) - ix.lo, ix.last);
    return t[ix.buckets + (unsigned int)b] + (bits & ix.low_mask);
}

// quant.rs `CodeBook::quantize` for every x: code 0 for NaN.
__device__ __forceinline__ unsigned int quantize(float x, const unsigned int* t, MapIndex ix) {
    return isnan(x) ? 0u : quantize_number(x, t, ix);
}

// Codes from four quantize() results, byte k from the k-th.
__device__ __forceinline__ unsigned int pack_codes(unsigned int a, unsigned int b,
                                                   unsigned int c, unsigned int d) {
    return __byte_perm(__byte_perm(a, b, 0x0073), __byte_perm(c, d, 0x0073), 0x5410);
}

// quant.rs `encode_scale` for a block maximum: +0.0 or above, up to +inf, never NaN (so
// no sign to clear, and the largest rounding is infinity's code, which saturates at the
// largest finite one).
__device__ __forceinline__ unsigned int encode_block_max(float absmax) {
    const unsigned int rounded =
        (__float_as_uint(absmax) + (1u << (SCALE_SHIFT - 1))) >> SCALE_SHIFT;
    return min(rounded, (0x7f800000u >> SCALE_SHIFT) - 1);
}

// quant.rs `decode_scale`.
__device__ __forceinline__ float decode_scale(unsigned int code) {
    return __uint_as_float(code << SCALE_SHIFT);
}

// quant.rs `Unscale`: a block's values times the scale's reciprocal when that is finite, else
// divided by the scale (a scale of 0 gives the zero code: quant.rs `quantize_scaled`).
struct Unscale {
    float scale, r;
    bool reciprocal;
};

__device__ __forceinline__ Unscale unscale_of(float scale) {
    Unscale u;
    u.scale = scale, u.r = 1.0f / scale, u.reciprocal = isfinite(u.r);
    return u;
}

__device__ __forceinline__ unsigned int quantize_scaled(float x, Unscale u, const unsigned int* t,
                                                        MapIndex ix, unsigned int zero_code) {
    if (u.scale == 0.0f) return zero_code << CODE_SHIFT;
    return quantize(u.reciprocal ? x * u.r : x / u.scale, t, ix);
}

// The value in `map` (T_MAP_M or T_MAP_V) of byte k of `codes`, times the scale.
__device__ __forceinline__ float dequantize(unsigned int codes, unsigned int k, float scale,
                                            const unsigned int* t, unsigned int map) {
    return __uint_as_float(t[map + __byte_perm(codes, 0, 0x4440 | k)]) * scale;
}

// The warp's maximum of x, for x that are neither NaN nor -0.0 (the lanes' block maxima: +0.0
// or above), whose bits then order as the values do: one integer reduction, no shuffles.
__device__ __forceinline__ float warp_max(float x) {
    return __uint_as_float(__reduce_max_sync(FULL_MASK, __float_as_uint(x)));
}

// Scale block `s`: its first element in the local shard, its length and its decay factor.
struct Span {
    unsigned long long off;
    unsigned int len;
    float decay;
};

__device__ __forceinline__ Span locate(const unsigned int* seg, unsigned int n_segments,
                                       unsigned int s) {
    unsigned int lo = 0, hi = n_segments;  // seg[lo] starts at or before s
    while (hi - lo > 1) {
        const unsigned int mid = lo + (hi - lo) / 2;
        if (seg[mid * S_WORDS + S_FIRST_SCALE] <= s) lo = mid; else hi = mid;
    }
    const unsigned int* e = seg + lo * S_WORDS;
    const unsigned int k = s - e[S_FIRST_SCALE], per = e[S_SCALES_PER_ROW_BLOCK];
    const unsigned int row_block_len = e[S_ROW_BLOCK_LEN];
    const unsigned int in_row_block = (k % per) * SCALE_BLOCK;
    Span span;
    span.off = ((unsigned long long)e[S_OFF_HI] << 32 | e[S_OFF_LO]) +
               (unsigned long long)(k / per) * row_block_len + in_row_block;
    const unsigned int rest = row_block_len - in_row_block;
    span.len = rest < SCALE_BLOCK ? rest : SCALE_BLOCK;
    span.decay = __uint_as_float(e[S_DECAY]);
    return span;
}

// One warp's scale block `s` (lanes 0..31 of the warp, all of them: the absmax is a warp
// reduction). VECTOR: a whole block whose arrays are aligned for vectors; lane l holds
// elements 8l..8l+7, read and written as two 16-byte f32 vectors and one 8-byte code vector
// per array. Else lane l holds elements l, l + 32, ... (each load of the warp reads
// consecutive bytes), bounds-checked against the span: a partial block, an unaligned one, or
// none (a warp past the last block, which only joins the reduction). Codes travel packed
// four to a word, element k in byte k % 4 of word k / 4.
template <bool VECTOR>
__device__ __forceinline__ void scale_block(
    float* __restrict__ p, const float* __restrict__ g, unsigned char* __restrict__ mc,
    unsigned char* __restrict__ vc, unsigned short* __restrict__ scale_m,
    unsigned short* __restrict__ scale_v, const unsigned int* t, MapIndex im, MapIndex iv,
    Span span, bool live, unsigned long long s, unsigned int lane, float w, float beta2,
    float one_minus_beta2, float folded_neg_step_size, float folded_eps,
    unsigned int m_zero_code, unsigned int v_zero_code) {
    // Loads first, all independent, then the arithmetic.
    float pi[PER_LANE], gi[PER_LANE];
    unsigned int m8[2] = {0, 0}, v8[2] = {0, 0};
    if (VECTOR) {
        const float4* p4 = (const float4*)(p + span.off) + 2 * lane;
        const float4* g4 = (const float4*)(g + span.off) + 2 * lane;
        const float4 pa = p4[0], pb = p4[1], ga = g4[0], gb = g4[1];
        const uint2 mv = ((const uint2*)(mc + span.off))[lane];
        const uint2 vv = ((const uint2*)(vc + span.off))[lane];
        pi[0] = pa.x, pi[1] = pa.y, pi[2] = pa.z, pi[3] = pa.w;
        pi[4] = pb.x, pi[5] = pb.y, pi[6] = pb.z, pi[7] = pb.w;
        gi[0] = ga.x, gi[1] = ga.y, gi[2] = ga.z, gi[3] = ga.w;
        gi[4] = gb.x, gi[5] = gb.y, gi[6] = gb.z, gi[7] = gb.w;
        m8[0] = mv.x, m8[1] = mv.y, v8[0] = vv.x, v8[1] = vv.y;
    } else {
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            const unsigned int j = lane + k * WARP;
            pi[k] = 0.0f, gi[k] = 0.0f;
            if (j < span.len) {
                const unsigned long long i = span.off + j;
                pi[k] = p[i], gi[k] = g[i];
                m8[k / 4] |= (unsigned int)mc[i] << (8 * (k % 4));
                v8[k / 4] |= (unsigned int)vc[i] << (8 * (k % 4));
            }
        }
    }
    const float old_sm = live ? decode_scale(scale_m[s]) : 0.0f;
    const float old_sv = live ? decode_scale(scale_v[s]) : 0.0f;

    float m1[PER_LANE], v1[PER_LANE];
    // fmaxf returns the non-NaN operand, as Rust's f32::max does; the maxima start at +0.0, as
    // the CPU's do (so a NaN never reaches them), and idle lanes keep +0.0.
    float amax_m = 0.0f, amax_v = 0.0f;
    bool nan_m = false;  // a NaN among this lane's m1
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
        m1[k] = 0.0f, v1[k] = 0.0f;
        if (VECTOR || lane + k * WARP < span.len) {
            const float p0 = pi[k] * span.decay;
            const float m0 = dequantize(m8[k / 4], k % 4, old_sm, t, T_MAP_M);
            const float v0 = dequantize(v8[k / 4], k % 4, old_sv, t, T_MAP_V);
            m1[k] = lerp_elem(m0, gi[k], w);
            v1[k] = v0 * beta2 + (one_minus_beta2 * gi[k]) * gi[k];
            // common.rs `apply_folded_adam_elem`: sqrt(bc2) folded into the step and eps.
            pi[k] = p0 + (folded_neg_step_size * m1[k]) / (sqrtf(v1[k]) + folded_eps);
            amax_m = fmaxf(amax_m, fabsf(m1[k]));
            amax_v = fmaxf(amax_v, v1[k]);
            nan_m |= isnan(m1[k]);
        }
    }
    // The parameters now, so that their registers are free for the requantization.
    if (VECTOR) {
        float4* p4 = (float4*)(p + span.off) + 2 * lane;
        p4[0] = make_float4(pi[0], pi[1], pi[2], pi[3]);
        p4[1] = make_float4(pi[4], pi[5], pi[6], pi[7]);
    } else {
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            if (lane + k * WARP < span.len) p[span.off + lane + k * WARP] = pi[k];
        }
    }
    amax_m = warp_max(amax_m), amax_v = warp_max(amax_v);
    const unsigned int new_m = encode_block_max(amax_m), new_v = encode_block_max(amax_v);
    const Unscale um = unscale_of(decode_scale(new_m)), uv = unscale_of(decode_scale(new_v));
    unsigned int mq[PER_LANE], vq[PER_LANE];
    // The common case, without the per-element choices: both scales normal (so neither 0:
    // quantize_scaled's first form) and no NaN to quantize in the lane. A NaN v1 needs a NaN
    // gradient (then m1 is NaN too) or a non-finite old v scale (a stored state's: the step
    // writes finite ones), since v0 = map value * scale is otherwise finite and non-negative
    // and v0 * beta2 + (1 - beta2) * g * g then at worst +inf; and a finite reciprocal times
    // a number is a number.
    // Both loops end with the second-moment floor (quant.rs `keep_positive_nonzero`): a
    // positive v1's code 0 becomes 1. In the first, as a max (v1 is a number), which the
    // compiler fuses with the quantizer's last addition.
    const unsigned int one = 1u << CODE_SHIFT;
    if (um.reciprocal && uv.reciprocal && !nan_m && isfinite(old_sv)) {
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            mq[k] = quantize_product(m1[k], um.r, t, im);
            // v1 >= +0.0: v0 and (1 - beta2) * g * g are (see above).
            vq[k] = max(quantize_nonnegative(v1[k] * uv.r, t, iv), v1[k] > 0.0f ? one : 0u);
        }
    } else {
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            mq[k] = quantize_scaled(m1[k], um, t, im, m_zero_code);
            vq[k] = quantize_scaled(v1[k], uv, t, iv, v_zero_code);
            vq[k] = (vq[k] < one && v1[k] > 0.0f) ? one : vq[k];
        }
    }
    if (VECTOR) {
        uint2 mv, vv;
        mv.x = pack_codes(mq[0], mq[1], mq[2], mq[3]);
        mv.y = pack_codes(mq[4], mq[5], mq[6], mq[7]);
        vv.x = pack_codes(vq[0], vq[1], vq[2], vq[3]);
        vv.y = pack_codes(vq[4], vq[5], vq[6], vq[7]);
        ((uint2*)(mc + span.off))[lane] = mv;
        ((uint2*)(vc + span.off))[lane] = vv;
    } else {
#pragma unroll
        for (int k = 0; k < PER_LANE; ++k) {
            const unsigned int j = lane + k * WARP;
            if (j < span.len) {
                const unsigned long long i = span.off + j;
                mc[i] = (unsigned char)(mq[k] >> CODE_SHIFT);
                vc[i] = (unsigned char)(vq[k] >> CODE_SHIFT);
            }
        }
    }
    if (live && lane == 0) {
        scale_m[s] = (unsigned short)new_m;
        scale_v[s] = (unsigned short)new_v;
    }
}

// Whether scale block `span` is a whole one whose four arrays are aligned for vectors (16
// bytes for f32, 8 for codes): scale_block<true>.
__device__ __forceinline__ bool vector_span(const Span& span, const float* p, const float* g,
                                            const unsigned char* mc, const unsigned char* vc) {
    if (span.len != SCALE_BLOCK) return false;
    const unsigned long long f = (unsigned long long)(p + span.off) |
                                 (unsigned long long)(g + span.off);
    const unsigned long long c = (unsigned long long)(mc + span.off) |
                                 (unsigned long long)(vc + span.off);
    return (f & 15) == 0 && (c & 7) == 0;
}

// At most 64 registers (4 blocks of 256 threads resident): on an H200 the kernel ran fastest
// at 64 of the register counts tried (docs/benchmarks.md, session 23), and the compiler
// spills nothing at that bound.
extern "C" __global__ void __launch_bounds__(256, 4) adam8bit_blocks(
    float* __restrict__ p, const float* __restrict__ g, unsigned char* __restrict__ mc,
    unsigned char* __restrict__ vc, unsigned short* __restrict__ scale_m,
    unsigned short* __restrict__ scale_v, const uint4* __restrict__ table, MapIndex im,
    MapIndex iv, const unsigned int* __restrict__ segments, unsigned int n_segments,
    unsigned int n_scales, float w, float beta2, float one_minus_beta2,
    float folded_neg_step_size, float folded_eps, unsigned int m_zero_code,
    unsigned int v_zero_code) {
    __shared__ uint4 st[TABLE_WORDS / 4];
    for (unsigned int k = threadIdx.x; k < TABLE_WORDS / 4; k += blockDim.x) st[k] = table[k];
    __syncthreads();
    const unsigned int* t = (const unsigned int*)st;
    const unsigned int lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    const unsigned long long stride = (unsigned long long)gridDim.x * warps;
    for (unsigned long long pass = (unsigned long long)blockIdx.x * warps; pass < n_scales;
         pass += stride) {
        const unsigned long long s = pass + threadIdx.x / WARP;
        const bool live = s < n_scales;
        Span span;
        span.off = 0, span.len = 0, span.decay = 1.0f;
        if (live) span = locate(segments, n_segments, (unsigned int)s);
        if (vector_span(span, p, g, mc, vc)) {
            scale_block<true>(p, g, mc, vc, scale_m, scale_v, t, im, iv, span, live, s, lane, w,
                              beta2, one_minus_beta2, folded_neg_step_size, folded_eps,
                              m_zero_code, v_zero_code);
        } else {
            scale_block<false>(p, g, mc, vc, scale_m, scale_v, t, im, iv, span, live, s, lane, w,
                               beta2, one_minus_beta2, folded_neg_step_size, folded_eps,
                               m_zero_code, v_zero_code);
        }
    }
}
