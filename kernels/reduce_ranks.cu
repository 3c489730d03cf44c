// Reduction over thread ranks on one GPU: dst[i] = reduce(srcs[0][i], ..., srcs[V-1][i]) in rank
// order, accumulated left to right, exactly as the CPU thread backend (src/comm/threads.rs,
// "Reductions"): f32 in f32; bf16 widened to f32, rounded once at the end (round to nearest
// even, NaN kept quiet, as half::bf16::from_f32); u8 in 64-bit integers, Avg rounded
// (sum + V/2) / V, clamped to 255. `srcs` is a device array of V device addresses; `dst` may be
// one of them (each element is read by its thread before that thread writes it).
// Grid: any (grid-stride loops); block: 256 threads. `avg` is 0 (Sum) or 1 (Avg).
// Launcher: src/cuda/threads.rs.

__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((x >> 16) | 0x0040u);
    }
    unsigned int round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0) {
        return (unsigned short)((x >> 16) + 1u);
    }
    return (unsigned short)(x >> 16);
}

extern "C" __global__ void reduce_ranks_f32(const unsigned long long* srcs, int v, float* dst,
                                            unsigned long long n, int avg) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float acc = ((const float*)srcs[0])[i];
        for (int j = 1; j < v; ++j) {
            acc = acc + ((const float*)srcs[j])[i];
        }
        dst[i] = avg ? acc / (float)v : acc;
    }
}

extern "C" __global__ void reduce_ranks_bf16(const unsigned long long* srcs, int v,
                                             unsigned short* dst, unsigned long long n, int avg) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float acc = bf16_to_f32(((const unsigned short*)srcs[0])[i]);
        for (int j = 1; j < v; ++j) {
            acc = acc + bf16_to_f32(((const unsigned short*)srcs[j])[i]);
        }
        dst[i] = f32_to_bf16(avg ? acc / (float)v : acc);
    }
}

extern "C" __global__ void reduce_ranks_u8(const unsigned long long* srcs, int v,
                                           unsigned char* dst, unsigned long long n, int avg) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long acc = 0;
        for (int j = 0; j < v; ++j) {
            acc += ((const unsigned char*)srcs[j])[i];
        }
        if (avg) {
            acc = (acc + (unsigned long long)v / 2) / (unsigned long long)v;
        }
        dst[i] = (unsigned char)(acc < 255ull ? acc : 255ull);
    }
}
