// cuda-emu: the cuBLAS calls ragged's Newton-Schulz makes (cublasGemmStridedBatchedEx,
// cublasSsyrk_v2 and handle set-up), on host memory, column-major as cuBLAS defines them.
// Operands are checked against libcuda's live allocations (driver.cpp), leading dimensions
// and types as cuBLAS checks them; with beta = 0, C is not read (NaN in it does not leak);
// with alpha = 0, the product is not formed (as BLAS defines it: A and B are not read, so NaN
// in them does not reach C, and code must not count on 0 * NaN to spread a NaN); syrk writes
// only the asked triangle. Sums run in f32 in k order: cuBLAS's order differs (and
// varies by algorithm), so results agree with a GPU to f32 rounding, not bit for bit.
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "bf16.h"

typedef int cublasStatus_t;
enum : cublasStatus_t {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum { CUDA_R_32F = 0, CUDA_R_16BF = 14 };
enum { CUBLAS_COMPUTE_32F = 68 };
enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 };

// Whether `op` transposes (OP_C is OP_T for real types); -1 for a value that is no operation.
int transposes(int op) { return op == CUBLAS_OP_N ? 0 : (op == CUBLAS_OP_T || op == CUBLAS_OP_C) ? 1 : -1; }
enum { CUBLAS_FILL_MODE_LOWER = 0, CUBLAS_FILL_MODE_UPPER = 1 };

extern "C" int cuda_emu_check_range(const char* call, unsigned long long ptr, size_t bytes);

namespace {

struct Handle {
    void* stream = nullptr;
};

cublasStatus_t invalid(const char* call, const char* why) {
    fprintf(stderr, "cuda-emu: %s: %s\n", call, why);
    return CUBLAS_STATUS_INVALID_VALUE;
}

float load(const void* base, int type, size_t i) {
    if (type == CUDA_R_32F) return ((const float*)base)[i];
    return bf16_to_f32(((const unsigned short*)base)[i]);
}

void store(void* base, int type, size_t i, float v) {
    if (type == CUDA_R_32F)
        ((float*)base)[i] = v;
    else
        ((unsigned short*)base)[i] = f32_to_bf16(v);
}

size_t type_bytes(int type) { return type == CUDA_R_32F ? 4 : 2; }

// Bytes a column-major rows x cols operand with leading dimension ld spans, times `batch` at
// `stride` elements apart.
size_t span(long long rows, long long cols, long long ld, long long stride, long long batch,
            int type) {
    const long long one = ld * (cols - 1) + rows;
    return (size_t)((batch - 1) * stride + one) * type_bytes(type);
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(void** handle) {
    if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
    *handle = new Handle;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(void* handle) {
    if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete (Handle*)handle;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(void* handle, void* stream) {
    if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
    ((Handle*)handle)->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream_v2(void* handle, void** stream) {
    if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
    *stream = ((Handle*)handle)->stream;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(void* handle, int) {
    return handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
cublasStatus_t cublasSetWorkspace_v2(void* handle, void*, size_t) {
    return handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
const char* cublasGetStatusString(cublasStatus_t s) {
    return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "cuda-emu cuBLAS error";
}
const char* cublasGetStatusName(cublasStatus_t s) { return cublasGetStatusString(s); }

cublasStatus_t cublasGemmStridedBatchedEx(void* handle, int transa, int transb, int m, int n,
                                          int k, const void* alpha, const void* A, int atype,
                                          int lda, long long stride_a, const void* B, int btype,
                                          int ldb, long long stride_b, const void* beta, void* C,
                                          int ctype, int ldc, long long stride_c, int batch,
                                          int compute, int) {
    const char* call = "cublasGemmStridedBatchedEx";
    if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (compute != CUBLAS_COMPUTE_32F) return invalid(call, "compute type other than 32F");
    for (int t : {atype, btype, ctype})
        if (t != CUDA_R_32F && t != CUDA_R_16BF) return invalid(call, "data type not f32/bf16");
    if (atype != btype || atype != ctype)
        return invalid(call, "mixed data types (ragged passes one type)");
    if (m < 0 || n < 0 || k < 0 || batch < 0) return invalid(call, "negative size");
    if (transposes(transa) < 0 || transposes(transb) < 0) return invalid(call, "operation");
    const bool ta = transposes(transa), tb = transposes(transb);
    const int a_rows = ta ? k : m, a_cols = ta ? m : k;
    const int b_rows = tb ? n : k, b_cols = tb ? k : n;
    if (lda < (a_rows > 1 ? a_rows : 1) || ldb < (b_rows > 1 ? b_rows : 1) ||
        ldc < (m > 1 ? m : 1))
        return invalid(call, "leading dimension below the operand's rows");
    if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
    if ((k > 0 && (cuda_emu_check_range(call, (unsigned long long)A,
                                        span(a_rows, a_cols, lda, stride_a, batch, atype)) ||
                   cuda_emu_check_range(call, (unsigned long long)B,
                                        span(b_rows, b_cols, ldb, stride_b, batch, btype)))) ||
        cuda_emu_check_range(call, (unsigned long long)C, span(m, n, ldc, stride_c, batch, ctype)))
        return invalid(call, "an operand outside device memory");
    const float al = *(const float*)alpha, be = *(const float*)beta;
    // Row i of op(A) and column j of op(B), each contiguous in f32, so the k loop is a dot.
    std::vector<float> rows((size_t)m * k), cols((size_t)n * k);
    for (int bi = 0; bi < batch; ++bi) {
        const char* a = (const char*)A + (size_t)bi * stride_a * type_bytes(atype);
        const char* b = (const char*)B + (size_t)bi * stride_b * type_bytes(btype);
        char* c = (char*)C + (size_t)bi * stride_c * type_bytes(ctype);
        for (int i = 0; i < m; ++i)
            for (int l = 0; l < k; ++l)
                rows[(size_t)i * k + l] =
                    load(a, atype, ta ? l + (size_t)i * lda : i + (size_t)l * lda);
        for (int j = 0; j < n; ++j)
            for (int l = 0; l < k; ++l)
                cols[(size_t)j * k + l] =
                    load(b, btype, tb ? j + (size_t)l * ldb : l + (size_t)j * ldb);
        for (int j = 0; j < n; ++j)
            for (int i = 0; i < m; ++i) {
                const float* x = &rows[(size_t)i * k];
                const float* y = &cols[(size_t)j * k];
                float acc = 0.0f;
                for (int l = 0; l < k; ++l) acc += x[l] * y[l];
                const size_t ci = i + (size_t)j * ldc;
                const float prod = al == 0.0f ? 0.0f : al * acc;
                const float out = be == 0.0f ? prod : prod + be * load(c, ctype, ci);
                store(c, ctype, ci, out);
            }
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSsyrk_v2(void* handle, int uplo, int trans, int n, int k, const float* alpha,
                              const float* A, int lda, const float* beta, float* C, int ldc) {
    const char* call = "cublasSsyrk_v2";
    if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (uplo != CUBLAS_FILL_MODE_LOWER && uplo != CUBLAS_FILL_MODE_UPPER)
        return invalid(call, "fill mode");
    if (n < 0 || k < 0) return invalid(call, "negative size");
    if (transposes(trans) < 0) return invalid(call, "operation");
    const bool t = transposes(trans);  // C = alpha*A^T*A + beta*C, A k x n; else A n x k
    const int a_rows = t ? k : n, a_cols = t ? n : k;
    if (lda < (a_rows > 1 ? a_rows : 1) || ldc < (n > 1 ? n : 1))
        return invalid(call, "leading dimension below the operand's rows");
    if (n == 0) return CUBLAS_STATUS_SUCCESS;
    if ((k > 0 && cuda_emu_check_range(call, (unsigned long long)A,
                                       span(a_rows, a_cols, lda, 0, 1, CUDA_R_32F))) ||
        cuda_emu_check_range(call, (unsigned long long)C, span(n, n, ldc, 0, 1, CUDA_R_32F)))
        return invalid(call, "an operand outside device memory");
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < n; ++i) {
            if (uplo == CUBLAS_FILL_MODE_LOWER ? i < j : i > j) continue;
            float acc = 0.0f;
            for (int l = 0; l < k; ++l) {
                const float x = t ? A[l + (size_t)i * lda] : A[i + (size_t)l * lda];
                const float y = t ? A[l + (size_t)j * lda] : A[j + (size_t)l * lda];
                acc += x * y;
            }
            float& c = C[i + (size_t)j * ldc];
            const float prod = *alpha == 0.0f ? 0.0f : *alpha * acc;
            c = *beta == 0.0f ? prod : prod + *beta * c;
        }
    return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
