// Blocked Shampoo's device step (optimizers/src/cuda/shampoo.rs; the step's table is in
// optimizers/src/shampoo.rs). Three kernels: the element-wise moments (steps 3, 5), the
// matrix products of the factors and of the preconditioned gradient (steps 2 and 7), and the
// grafting and the update (steps 6 to 9). The inverse roots (step 4) are computed on the host.
//
// Compiled with --fmad=false, --prec-div=true, --prec-sqrt=true, --ftz=false: every f32 line is
// one correctly rounded IEEE operation in the host's order. The products sum exact f64
// products (an f32 times an f32 needs 48 significant bits) in the host's four lanes (term k in
// lane k mod 4, k ascending, lanes added as (s0 + s1) + (s2 + s3)) and round once; the norms sum
// f64 squares in the host's 32 lanes (element e of the block, row-major, in lane e mod 32)
// combined as the host's tree (lane l += lane l + h for h = 16, 8, 4, 2, 1). So the device step
// equals the host step bit for bit.

#define SHAMPOO_TILE 32
#define SHAMPOO_KTILE 16
#define SHAMPOO_NORM_LANES 32
#define SHAMPOO_TABLE_WORDS 5
#define SHAMPOO_PRODUCT_WORDS 11

__device__ __forceinline__ float lerp_elem(float start, float end, float w) {
    // torch's lerp: small-weight form when |w| < 0.5, large-weight form otherwise.
    if (fabsf(w) < 0.5f) {
        return start + w * (end - start);
    }
    return end - (end - start) * (1.0f - w);
}

// Step 5's bias-corrected gradient of one element from its gradient g and its updated filtered
// gradient m: m / bc1 (bc1 only with `bias1`) with `momentum`, else g.
__device__ __forceinline__ float shampoo_gbar(float g, float m, int momentum, int bias1,
                                              float bc1) {
    if (!momentum) {
        return g;
    }
    return bias1 ? m / bc1 : m;
}

// Step 6's grafting direction of one element from its bias-corrected gradient gb and its
// updated accumulator v: gb / (√(v / bc2) + eps), bc2 only with `bias2`; gb without `graft`.
__device__ __forceinline__ float shampoo_graft_dir(float gb, float v, int graft, int bias2,
                                                   float bc2, float eps) {
    if (!graft) {
        return gb;
    }
    const float vh = bias2 ? v / bc2 : v;
    return gb / (sqrtf(vh) + eps);
}

// Steps 3 and 5 on one piece of n contiguous elements: the filtered gradient m, the grafting
// accumulator v (when `graft`) and the bias-corrected gradient gbar (step 6 is recomputed from
// them where it is needed, by shampoo_apply). Flags are 0 or 1; a scalar whose flag is 0 is
// not read (nor is v without `graft`).
extern "C" __global__ void shampoo_moments(const float* g, float* m, float* v, float* gbar,
                                           unsigned long long n, int momentum, float w1,
                                           int bias1, float bc1, int graft, float beta2,
                                           float one_minus_beta2) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float gi = g[i];
        if (momentum) {
            m[i] = lerp_elem(m[i], gi, w1);
        }
        gbar[i] = shampoo_gbar(gi, m[i], momentum, bias1, bc1);
        if (graft) {
            v[i] = v[i] * beta2 + (one_minus_beta2 * gi) * gi;
        }
    }
}

// Loads rows [r0, r0 + SHAMPOO_TILE) × terms [k0, k0 + SHAMPOO_KTILE) of X(r, k) =
// x[r·row + k·kstep] into t, widened to f64, zeros outside rows × kn: 256 threads, two elements
// each, consecutive threads on consecutive addresses (along k when kstep = 1, else along rows).
__device__ __forceinline__ void shampoo_load_tile(double (*t)[SHAMPOO_KTILE + 1], const float* x,
                                                  unsigned long long row,
                                                  unsigned long long kstep, unsigned int r0,
                                                  unsigned int rows, unsigned int k0,
                                                  unsigned int kn) {
    for (unsigned int q = 0; q < 2; ++q) {
        const unsigned int e = threadIdx.x + 256 * q;
        const unsigned int r = kstep == 1 ? e / SHAMPOO_KTILE : e % SHAMPOO_TILE;
        const unsigned int k = kstep == 1 ? e % SHAMPOO_KTILE : e / SHAMPOO_TILE;
        const unsigned int gr = r0 + r;
        const unsigned int gk = k0 + k;
        t[r][k] = (gr < rows && gk < kn) ? (double)x[gr * row + gk * kstep] : 0.0;
    }
}

// A group of products, one per blockIdx.z, each described by SHAMPOO_PRODUCT_WORDS words of
// `table`: a_at, a_row, a_k, b_at, b_row, b_k, out_at, ldo, n, m, kn. Product z writes
// out[out_at + i·ldo + j] for i < n, j < m from s = Σ_k A(i, k)·B(j, k), A(i, k) =
// a[a_at + i·a_row + k·a_k], B(j, k) = b[b_at + j·b_row + k·b_k], k < kn: mode 0 stores s, 1
// adds it (out + s), 2 decays (out·beta2 + w·s), s rounded to f32 first. Grid (⌈max m/32⌉,
// ⌈max n/32⌉, products), 256 threads: a 32 × 32 tile of outputs, 2 × 2 per thread (a tile
// outside its product's n × m returns at once), k walked in tiles of 16 through shared memory
// (as f64). Each product of two f32 values is exact in f64, so the fused multiply-add rounds
// exactly where the host's multiply then add does. Terms past kn are zeros, which leave every
// lane's bits alone (a lane starts at +0, and s + ±0 = s for s ≠ 0, +0 + ±0 = +0).
extern "C" __global__ void __launch_bounds__(256) shampoo_mul_abt(
    const float* a, const float* b, float* out, const unsigned long long* table, int mode,
    float beta2, float w) {
    const unsigned long long* d = table + SHAMPOO_PRODUCT_WORDS * blockIdx.z;
    const unsigned int n = (unsigned int)d[8];
    const unsigned int m = (unsigned int)d[9];
    const unsigned int kn = (unsigned int)d[10];
    const unsigned int i0 = blockIdx.y * SHAMPOO_TILE;
    const unsigned int j0 = blockIdx.x * SHAMPOO_TILE;
    if (i0 >= n || j0 >= m) {
        return;  // the whole thread block, before any barrier
    }
    __shared__ double at[SHAMPOO_TILE][SHAMPOO_KTILE + 1];
    __shared__ double bt[SHAMPOO_TILE][SHAMPOO_KTILE + 1];
    const unsigned int half = SHAMPOO_TILE / 2;
    const unsigned int tx = threadIdx.x % half;
    const unsigned int ty = threadIdx.x / half;
    // s[u][v][l]: lane l of output (i0 + ty + 16u, j0 + tx + 16v).
    double s[2][2][4];
    for (int u = 0; u < 2; ++u) {
        for (int v = 0; v < 2; ++v) {
            for (int l = 0; l < 4; ++l) {
                s[u][v][l] = 0.0;
            }
        }
    }
    for (unsigned int k0 = 0; k0 < kn; k0 += SHAMPOO_KTILE) {
        shampoo_load_tile(at, a + d[0], d[1], d[2], i0, n, k0, kn);
        shampoo_load_tile(bt, b + d[3], d[4], d[5], j0, m, k0, kn);
        __syncthreads();
#pragma unroll
        for (unsigned int kk = 0; kk < SHAMPOO_KTILE; ++kk) {
            const double x[2] = {at[ty][kk], at[ty + half][kk]};
            const double y[2] = {bt[tx][kk], bt[tx + half][kk]};
            for (int u = 0; u < 2; ++u) {
                for (int v = 0; v < 2; ++v) {
                    s[u][v][kk & 3] = fma(x[u], y[v], s[u][v][kk & 3]);
                }
            }
        }
        __syncthreads();
    }
    for (unsigned int u = 0; u < 2; ++u) {
        for (unsigned int v = 0; v < 2; ++v) {
            const unsigned int i = i0 + ty + half * u;
            const unsigned int j = j0 + tx + half * v;
            if (i >= n || j >= m) {
                continue;
            }
            const double* l = s[u][v];
            const float o = (float)((l[0] + l[1]) + (l[2] + l[3]));
            float* dst = out + d[6] + i * d[7] + j;
            if (mode == 0) {
                *dst = o;
            } else if (mode == 1) {
                *dst = *dst + o;
            } else {
                *dst = *dst * beta2 + w * o;
            }
        }
    }
}

// Element e (row-major) of the block described by `t` (at, stride, rows, cols): its offset.
__device__ __forceinline__ unsigned long long shampoo_elem(const unsigned long long* t,
                                                           unsigned long long e) {
    return t[0] + (e / t[3]) * t[1] + e % t[3];
}

// Steps 6-9 for every block of the shard, one thread block each (256 threads). `table` holds
// SHAMPOO_TABLE_WORDS words per block: at, stride, rows, cols, and where the block's P_s is (0:
// ps; 1: pp, which holds it for a block with both factors and is Ḡ itself for a block with
// none). The grafting direction pg is shampoo_graft_dir of Ḡ, recomputed from g and m as
// shampoo_moments computed it, and v. mode 0: the direction is pg (grafting only); 1: P_s; 2:
// P_s·(‖pg‖ / (‖P_s‖ + 1e-16)), the norms of the block's elements. Then d + wd·p when `decay`,
// and p + neg_lr·d.
extern "C" __global__ void __launch_bounds__(256) shampoo_apply(
    float* p, const float* g, const float* m, const float* v, const float* ps, const float* pp,
    const unsigned long long* table, int mode, int momentum, int bias1, float bc1, int graft,
    int bias2, float bc2, float eps, float neg_lr, int decay, float wd) {
    __shared__ double lanes[2][SHAMPOO_NORM_LANES];
    __shared__ float scale;
    const unsigned long long* t = table + SHAMPOO_TABLE_WORDS * blockIdx.x;
    const unsigned long long n = t[2] * t[3];
    const float* dir = t[4] ? pp : ps;
    if (mode == 2) {
        if (threadIdx.x < SHAMPOO_NORM_LANES) {
            double sg = 0.0;
            double ss = 0.0;
            for (unsigned long long e = threadIdx.x; e < n; e += SHAMPOO_NORM_LANES) {
                const unsigned long long at = shampoo_elem(t, e);
                const float gb = shampoo_gbar(g[at], m[at], momentum, bias1, bc1);
                const double x = (double)shampoo_graft_dir(gb, v[at], graft, bias2, bc2, eps);
                const double y = (double)dir[at];
                sg += x * x;
                ss += y * y;
            }
            lanes[0][threadIdx.x] = sg;
            lanes[1][threadIdx.x] = ss;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int h = SHAMPOO_NORM_LANES / 2; h > 0; h /= 2) {
                for (int l = 0; l < h; ++l) {
                    lanes[0][l] += lanes[0][l + h];
                    lanes[1][l] += lanes[1][l + h];
                }
            }
            const float norm_g = (float)sqrt(lanes[0][0]);
            const float norm_s = (float)sqrt(lanes[1][0]);
            scale = norm_g / (norm_s + 1e-16f);
        }
        __syncthreads();
    }
    for (unsigned long long e = threadIdx.x; e < n; e += blockDim.x) {
        const unsigned long long at = shampoo_elem(t, e);
        float d;
        if (mode == 0) {
            const float gb = shampoo_gbar(g[at], m[at], momentum, bias1, bc1);
            d = shampoo_graft_dir(gb, v[at], graft, bias2, bc2, eps);
        } else if (mode == 1) {
            d = dir[at];
        } else {
            d = dir[at] * scale;
        }
        const float p0 = p[at];
        if (decay) {
            d = d + wd * p0;
        }
        p[at] = p0 + neg_lr * d;
    }
}
