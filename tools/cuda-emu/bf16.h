// cuda-emu: bf16 as the GPU code's kernels round it (round to nearest even; a NaN stays a
// quiet NaN) and widen it (exactly), for cublas.cpp and nccl.cpp.
#pragma once

#include <string.h>

inline float bf16_to_f32(unsigned short h) {
    const unsigned int u = (unsigned int)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

inline unsigned short f32_to_bf16(float f) {
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
