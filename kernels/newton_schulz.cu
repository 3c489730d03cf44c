// Newton-Schulz helpers around the cuBLAS products (optimizers/src/cuda/newton_schulz.rs):
// batched transpose, the Frobenius pre-normalization, filling the upper triangle of a syrk
// result and adding a scalar to a stack's diagonals (the f32 <-> bf16 conversions are
// group_ops.cu's).
//
// ns_transpose: grid (ceil(cols/32), ceil(rows/32), batch), block (32, 8); a 32x33 shared tile.
// ns_sumsq_partial: grid (blocks, batch), block 256: per block, the f64 sum of squares of a
//   grid-stride share of one matrix, written to partial[batch * blocks + block].
// ns_normalize: grid (any, batch), block 256: thread 0 of each block sums the matrix's
//   partials in index order (f64), takes the f64 sqrt, rounds to f32, scales and clamps
//   (as the CPU: norm = (sum as f64).sqrt() as f32; denom = (norm_scale * norm).max(eps));
//   then x <- x / denom in f32. A non-finite f64 norm makes every element NaN (the CPU's rule);
//   a finite f64 norm that overflows f32 divides in f64 instead (the CPU's rule too).
//   Products of two f32 are exact in f64, so only the summation order differs from the CPU's
//   eight-lane sum: the f64 sums differ in the last bits at most, and the rounded f32 norm
//   almost always agrees (a different f32 denom is possible only when the f64 sum sits on an
//   f32 rounding boundary). The division is IEEE (--prec-div=true).

extern "C" __global__ void ns_transpose(const float* x, float* out, unsigned int rows,
                                        unsigned int cols) {
    __shared__ float tile[32][33];
    const unsigned long long mat = (unsigned long long)rows * cols * blockIdx.z;
    const unsigned int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    for (unsigned int k = threadIdx.y; k < 32; k += blockDim.y) {
        const unsigned int r = r0 + k, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[k][threadIdx.x] = x[mat + (unsigned long long)r * cols + c];
    }
    __syncthreads();
    for (unsigned int k = threadIdx.y; k < 32; k += blockDim.y) {
        const unsigned int c = c0 + k, r = r0 + threadIdx.x;  // out is cols x rows
        if (r < rows && c < cols) out[mat + (unsigned long long)c * rows + r] = tile[threadIdx.x][k];
    }
}

extern "C" __global__ void ns_sumsq_partial(const float* x, unsigned long long len,
                                            double* partial) {
    __shared__ double red[256];
    const float* xm = x + len * blockIdx.y;
    double s = 0.0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < len;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const double v = (double)xm[i];
        s += v * v;
    }
    red[threadIdx.x] = s;
    __syncthreads();
    for (unsigned int k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) red[threadIdx.x] += red[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[(unsigned long long)gridDim.x * blockIdx.y + blockIdx.x] = red[0];
}

extern "C" __global__ void ns_normalize(float* x, unsigned long long len, const double* partial,
                                        unsigned int nparts, float norm_scale, float eps) {
    __shared__ float denom;
    __shared__ double denom64;
    __shared__ int mode;  // 0: NaN (a non-finite element), 1: f32 division, 2: f64 division
    if (threadIdx.x == 0) {
        double s = 0.0;
        for (unsigned int k = 0; k < nparts; ++k) s += partial[(unsigned long long)nparts * blockIdx.y + k];
        const double norm64 = sqrt(s);
        const float norm = (float)norm64;
        mode = !isfinite(norm64) ? 0 : (isfinite(norm) ? 1 : 2);
        denom = fmaxf(norm_scale * norm, eps);
        denom64 = (double)norm_scale * norm64;
    }
    __syncthreads();
    float* xm = x + len * blockIdx.y;
    const float d = denom;
    const double d64 = denom64;
    const int m = mode;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < len;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        xm[i] = m == 1 ? xm[i] / d : (m == 2 ? (float)((double)xm[i] / d64) : __int_as_float(0x7fc00000));
    }
}

// ns_symmetrize_lower: grid (any, batch), block 256. c holds batch column-major n x n matrices
// whose lower triangle (row >= col) cuBLAS syrk wrote; copies it onto the upper triangle, so the
// matrix is whole for the next GEMM. Reads only the lower triangle, writes only the upper one.
extern "C" __global__ void ns_symmetrize_lower(float* c, unsigned int n) {
    const unsigned long long nn = (unsigned long long)n * n;
    float* cm = c + nn * blockIdx.y;
    for (unsigned long long idx = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; idx < nn;
         idx += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long i = idx % n, j = idx / n;  // element (row i, column j)
        if (i < j) cm[idx] = cm[j + i * n];
    }
}

// ns_add_diagonal_f32 / ns_add_diagonal_bf16: grid (any, batch), block 256. q holds batch
// n x n matrices; q[i][i] <- q[i][i] + a: Gram Newton-Schulz's Q = a + b*R + c*R*R after the
// GEMM of b*R + c*R*R. bf16: the element widened, a added in f32, rounded to nearest even (a
// NaN stays a quiet NaN), as the CPU's bf16 Gram iteration and group_ops.cu's to_bf16.
extern "C" __global__ void ns_add_diagonal_f32(float* q, unsigned int n, float a) {
    float* qm = q + (unsigned long long)n * n * blockIdx.y;
    const unsigned int stride = gridDim.x * blockDim.x;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        qm[(unsigned long long)i * n + i] += a;
    }
}

extern "C" __global__ void ns_add_diagonal_bf16(unsigned short* q, unsigned int n, float a) {
    unsigned short* qm = q + (unsigned long long)n * n * blockIdx.y;
    const unsigned int stride = gridDim.x * blockDim.x;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned long long d = (unsigned long long)i * n + i;
        const unsigned int u = __float_as_uint(__uint_as_float((unsigned int)qm[d] << 16) + a);
        const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
        qm[d] = nan ? (unsigned short)((u >> 16) | 0x0040u)
                    : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}
