//! CPU kernels: the matrix products behind [`crate::newton_schulz`], and 8-bit Adam's AVX-512
//! step.
//!
//! | file | product | precision | threads | availability |
//! |---|---|---|---|---|
//! | [`gemm_f32`] | `gemm` crate 0.19 (AVX-512 microkernels with `x86-v4`) | `f32` | rayon (`gemm::Parallelism`) | always |
//! | [`adam8bit_avx512`] | 8-bit Adam's row-block step (not a matrix product), on [`octave_index`]'s byte-permute quantizer index (which the CUDA kernel reads from shared memory too) | `f32` lanes, 8-bit codes | the caller's (`work_share`: the calling thread and rayon's workers claim chunks of row blocks) | x86-64 with AVX-512 F/BW/VBMI, chosen at run time |
//! | `transpose_f32` | not a product: strided `f32` transposes (NS's tall matrices, the mirrored half of a symmetric product) in 8×8 register blocks | `f32` (a copy) | the caller's | AVX chosen at run time, else scalar |
//! | `lane_dot` | Shampoo's products `A·Bᵀ` and `Q·diag(d)·Qᵀ`: dot products summed in `f64` in four fixed lanes (bits independent of CPU and threads) | `f32` or `f64` in, `f64` sums, `f32` out | rayon, 24 output rows per task | AVX-512 6×8 or AVX2 + FMA 3×3 register tiles chosen at run time (`RAGGED_LANE_DOT` caps it), else scalar (same bits) |
//! | `work_share` | not a kernel: one step's independent items shared by the calling thread and rayon's workers | — | the caller and rayon | always |
//! | [`amx_bf16`] | ragged's own: 32×32 output blocks on the AMX tiles (`TDPBF16PS`), operands packed once per product (an aligned left operand read in place), symmetric products by lower blocks (also `aᵀ·a` of a tall `a`) | bf16 in, `f32` accumulation, bf16 out | rayon, a 128×512 output region per task | x86-64 Linux with AMX-TILE/BF16 and AVX-512 BW, chosen at run time |
//! | [`onednn`] | oneDNN 2.x matmul primitive (`brg:avx512_core_amx_bf16` on AMX) | bf16 in, `f32` accumulation, bf16 out | oneDNN's OpenMP threads | when `libdnnl.so.2` loads at run time |

#[cfg(target_arch = "x86_64")]
pub mod adam8bit_avx512;
pub mod amx_bf16;
pub mod gemm_f32;
pub(crate) mod lane_dot;
#[cfg(any(target_arch = "x86_64", feature = "cuda"))]
pub mod octave_index;
pub mod onednn;
pub(crate) mod transpose_f32;
pub(crate) mod work_share;

pub use gemm::Parallelism;

/// Whether `par` asks for more than the calling thread.
pub(crate) fn threaded(par: Parallelism) -> bool {
    matches!(par, Parallelism::Rayon(n) if n != 1)
}

/// Bytes of one working buffer a thread keeps between Newton–Schulz calls, at most. Below
/// it, reuse saves a fresh buffer's page faults (4–7 ms for a 2048² `f32` operand, more than
/// packing it); above it the buffer is freed after the call, so a rank that orthogonalizes one
/// large matrix (a Llama-3-70B MLP weight, 8192×28672: 940 MB in `f32`) does not hold a copy
/// on every rayon thread for the rest of training. At this size the faults cost about 5 ms
/// against at least 0.5 s of products (five steps on 16 M elements with a short side ≥ 256).
pub const RETAIN_BYTES: usize = 64 << 20;

/// `v` to keep for the next call, or an empty vector (its allocation freed) when `v` holds
/// more than [`RETAIN_BYTES`].
pub(crate) fn retained<T>(v: Vec<T>) -> Vec<T> {
    if v.capacity().saturating_mul(std::mem::size_of::<T>()) <= RETAIN_BYTES {
        v
    } else {
        Vec::new()
    }
}

/// Grows `v` to `len` elements of `fill`, asking the kernel for 2 MiB pages for a grown
/// allocation before it is first touched (`madvise(MADV_HUGEPAGE)`; a no-op where
/// transparent huge pages are off or the call fails). The AMX tile loads read 16 rows
/// of a matrix thousands of bytes apart, one 4 KiB page each.
pub(crate) fn grow_huge<T: Clone>(v: &mut Vec<T>, len: usize, fill: T) {
    if v.len() >= len {
        return;
    }
    const HUGE: usize = 2 << 20;
    let bytes = len.saturating_mul(std::mem::size_of::<T>());
    if v.capacity() < len && bytes >= HUGE {
        let mut fresh = Vec::with_capacity(len);
        #[cfg(target_os = "linux")]
        {
            let start = (fresh.as_mut_ptr() as usize).next_multiple_of(HUGE);
            let end = (fresh.as_mut_ptr() as usize + bytes) / HUGE * HUGE;
            if end > start {
                // SAFETY: advice on pages inside this fresh allocation; it changes how the
                // kernel backs them, never their contents or validity.
                unsafe {
                    libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE)
                };
            }
        }
        fresh.extend_from_slice(v);
        *v = fresh;
    }
    v.resize(len, fill);
}

#[cfg(test)]
mod tests {
    use super::grow_huge;

    /// Growing keeps what the vector held and fills the rest, across the move into a fresh
    /// (advised) allocation and without one; it never shrinks.
    #[test]
    fn grow_huge_keeps_the_contents_and_fills_the_rest() {
        let mut v: Vec<u32> = (0..1000).collect();
        let big = 3 << 20; // 12 MiB of u32: a fresh allocation with huge-page advice
        grow_huge(&mut v, big, 7);
        assert_eq!(v.len(), big);
        assert!(v[..1000].iter().copied().eq(0..1000));
        assert!(v[1000..].iter().all(|&x| x == 7));
        v.truncate(10);
        grow_huge(&mut v, 20, 9); // within capacity: no new allocation
        assert_eq!(
            v,
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]
        );
        grow_huge(&mut v, 5, 1);
        assert_eq!(v.len(), 20, "never shrinks");
    }
}
