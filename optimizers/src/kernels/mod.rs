//! CPU matrix-product kernels behind [`crate::newton_schulz`].
//!
//! | file | product | precision | threads | availability |
//! |---|---|---|---|---|
//! | [`gemm_f32`] | `gemm` crate 0.19 (AVX-512 microkernels with `x86-v4`) | `f32` | rayon (`gemm::Parallelism`) | always |
//! | [`onednn`] | oneDNN 2.x matmul primitive (`brg:avx512_core_amx_bf16` on AMX) | bf16 in, `f32` accumulation, bf16 out | oneDNN's OpenMP threads | when `libdnnl.so.2` loads at run time |

pub mod gemm_f32;
pub mod onednn;

pub use gemm::Parallelism;
