//! CPU kernels: the matrix products behind [`crate::newton_schulz`], and 8-bit Adam's AVX-512
//! step.
//!
//! | file | product | precision | threads | availability |
//! |---|---|---|---|---|
//! | [`gemm_f32`] | `gemm` crate 0.19 (AVX-512 microkernels with `x86-v4`) | `f32` | rayon (`gemm::Parallelism`) | always |
//! | [`adam8bit_avx512`] | 8-bit Adam's row-block step (not a matrix product), on [`octave_index`]'s byte-permute quantizer index | `f32` lanes, 8-bit codes | the caller's (`work_share`: the calling thread and rayon's workers claim chunks of row blocks) | x86-64 with AVX-512 F/BW/VBMI, chosen at run time |
//! | `transpose_f32` | not a product: strided `f32` transposes (NS's tall matrices, the mirrored half of a symmetric product) in 8×8 register blocks | `f32` (a copy) | the caller's | AVX chosen at run time, else scalar |
//! | `work_share` | not a kernel: one step's independent items shared by the calling thread and rayon's workers | — | the caller and rayon | always |
//! | [`amx_bf16`] | ragged's own: 32×32 output blocks on the AMX tiles (`TDPBF16PS`), operands packed once per product, symmetric products by lower blocks | bf16 in, `f32` accumulation, bf16 out | rayon, a 128×512 output region per task | x86-64 Linux with AMX-TILE/BF16 and AVX-512 BW, chosen at run time |
//! | [`onednn`] | oneDNN 2.x matmul primitive (`brg:avx512_core_amx_bf16` on AMX) | bf16 in, `f32` accumulation, bf16 out | oneDNN's OpenMP threads | when `libdnnl.so.2` loads at run time |

#[cfg(target_arch = "x86_64")]
pub mod adam8bit_avx512;
pub mod amx_bf16;
pub mod gemm_f32;
#[cfg(target_arch = "x86_64")]
pub mod octave_index;
pub mod onednn;
pub(crate) mod transpose_f32;
pub(crate) mod work_share;

pub use gemm::Parallelism;
