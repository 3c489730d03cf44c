//! Strided `f32` transposes, for Newton–Schulz's tall matrices and the mirrored half of its
//! symmetric products: 8×8 blocks transposed in AVX registers where the CPU has AVX (chosen at
//! run time), a scalar loop elsewhere and on the edges.
//!
//! Why not the plain loop: its column-strided stores touch one cache line per element, and
//! with a leading dimension of 1,024 or 2,048 `f32` (a multiple of 4 KiB) every line of a
//! column falls in the same L1 set, so a 32-line column evicts itself (`perf` on the AVX2
//! EPYC: 4 % of a Muon step in the mirror of `X·Xᵀ` and `P·P`, ~4 ns per element). The
//! register transpose reads 8 rows and writes 8 rows of 32 bytes each per block.
//!
//! A transpose is a copy: every path gives the same bits (NaN payloads included), tested
//! against the scalar loop.

/// Side of the cache tiles the 8×8 blocks are walked in (32×32 `f32`: 4 KiB per operand).
const TILE: usize = 32;
/// Side of a register block.
const REG: usize = 8;

/// `dst[j·ldd + i] = src[i·lds + j]` for `i < rows`, `j < cols`.
///
/// # Safety
/// `src` must be valid for reads at `i·lds + j` and `dst` for writes at `j·ldd + i` for every
/// `i < rows`, `j < cols`, and no element read may be one written.
pub(crate) unsafe fn transpose_raw(
    src: *const f32,
    lds: usize,
    dst: *mut f32,
    ldd: usize,
    rows: usize,
    cols: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is present, and `tiles` passes whole 8×8 blocks inside the operands.
        let block = |s, d| unsafe { avx::block8(s, lds, d, ldd) };
        // SAFETY: the caller's contract is the one `tiles` needs.
        return unsafe { tiles(src, lds, dst, ldd, rows, cols, block) };
    }
    // SAFETY: `tiles` passes whole 8×8 blocks inside the operands.
    let block = |s, d| unsafe { scalar(s, lds, d, ldd, REG, REG) };
    // SAFETY: the caller's contract is the one `tiles` needs.
    unsafe { tiles(src, lds, dst, ldd, rows, cols, block) }
}

/// The scalar transpose of `transpose_raw` (the reference the register blocks are tested
/// against).
///
/// # Safety
/// As [`transpose_raw`].
unsafe fn scalar(src: *const f32, lds: usize, dst: *mut f32, ldd: usize, rows: usize, cols: usize) {
    for i in 0..rows {
        for j in 0..cols {
            // SAFETY: `i < rows`, `j < cols`: inside both operands (caller's contract).
            unsafe { *dst.add(j * ldd + i) = *src.add(i * lds + j) };
        }
    }
}

/// Walks `rows × cols` in [`TILE`]-square tiles, each in 8×8 blocks: `full` on whole blocks,
/// the scalar loop on the ragged edges.
///
/// # Safety
/// As [`transpose_raw`]; `full(s, d)` must transpose the 8×8 block at `s` into `d`.
unsafe fn tiles(
    src: *const f32,
    lds: usize,
    dst: *mut f32,
    ldd: usize,
    rows: usize,
    cols: usize,
    full: impl Fn(*const f32, *mut f32),
) {
    for i0 in (0..rows).step_by(TILE) {
        for j0 in (0..cols).step_by(TILE) {
            for i in (i0..(i0 + TILE).min(rows)).step_by(REG) {
                for j in (j0..(j0 + TILE).min(cols)).step_by(REG) {
                    let (h, w) = ((rows - i).min(REG), (cols - j).min(REG));
                    // SAFETY: the block's rows `i..i + h` and columns `j..j + w` lie inside
                    // both operands (caller's contract).
                    unsafe {
                        let (s, d) = (src.add(i * lds + j), dst.add(j * ldd + i));
                        if h == REG && w == REG {
                            full(s, d);
                        } else {
                            scalar(s, lds, d, ldd, h, w);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::*;

    /// Transposes the 8×8 block at `src` (rows `lds` apart) into `dst` (rows `ldd` apart):
    /// pairs of rows interleaved, then pairs of pairs, then the 128-bit halves swapped.
    ///
    /// # Safety
    /// AVX must be present; `src` readable and `dst` writable for 8 rows of 8 `f32`, apart.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn block8(src: *const f32, lds: usize, dst: *mut f32, ldd: usize) {
        // SAFETY: the eight rows of 8 `f32` lie inside `src` and `dst` (caller's contract);
        // the loads and stores are unaligned.
        unsafe {
            let r = |i: usize| _mm256_loadu_ps(src.add(i * lds));
            let (r0, r1, r2, r3) = (r(0), r(1), r(2), r(3));
            let (r4, r5, r6, r7) = (r(4), r(5), r(6), r(7));
            // Rows (0,1), (2,3), …: element k of the pair's rows side by side.
            let t0 = _mm256_unpacklo_ps(r0, r1);
            let t1 = _mm256_unpackhi_ps(r0, r1);
            let t2 = _mm256_unpacklo_ps(r2, r3);
            let t3 = _mm256_unpackhi_ps(r2, r3);
            let t4 = _mm256_unpacklo_ps(r4, r5);
            let t5 = _mm256_unpackhi_ps(r4, r5);
            let t6 = _mm256_unpacklo_ps(r6, r7);
            let t7 = _mm256_unpackhi_ps(r6, r7);
            // Four rows' element k in each 128-bit lane: columns k (low) and k + 4 (high).
            let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            let w = |j: usize, v: __m256| _mm256_storeu_ps(dst.add(j * ldd), v);
            w(0, _mm256_permute2f128_ps::<0x20>(s0, s4));
            w(1, _mm256_permute2f128_ps::<0x20>(s1, s5));
            w(2, _mm256_permute2f128_ps::<0x20>(s2, s6));
            w(3, _mm256_permute2f128_ps::<0x20>(s3, s7));
            w(4, _mm256_permute2f128_ps::<0x31>(s0, s4));
            w(5, _mm256_permute2f128_ps::<0x31>(s1, s5));
            w(6, _mm256_permute2f128_ps::<0x31>(s2, s6));
            w(7, _mm256_permute2f128_ps::<0x31>(s3, s7));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bit patterns that a float copy could change if it went through arithmetic: NaNs with
    /// payloads and both signs, infinities, subnormals, −0.
    fn pattern(n: usize) -> Vec<f32> {
        let special = [
            0x7fc0_1234u32,
            0xffa0_0001,
            0x7f80_0000,
            0x0000_0001,
            0x8000_0000,
        ];
        (0..n)
            .map(|k| {
                let bits = special
                    .get(k % 97)
                    .copied()
                    .unwrap_or((k as u32).wrapping_mul(2_654_435_761));
                f32::from_bits(bits)
            })
            .collect()
    }

    #[test]
    fn transpose_raw_is_the_scalar_copy_bit_for_bit_at_every_edge() {
        for &(rows, cols) in &[
            (1, 1),
            (8, 8),
            (7, 9),
            (33, 17),
            (64, 40),
            (100, 257),
            (256, 3),
        ] {
            // Leading dimensions wider than the matrix, as in the mirror of a sub-block.
            let (lds, ldd) = (cols + 5, rows + 3);
            let src = pattern(rows * lds);
            let mut got = vec![0.0f32; cols * ldd];
            let mut want = vec![0.0f32; cols * ldd];
            // SAFETY: `src` holds `rows` rows of `lds ≥ cols`, both outputs `cols` rows of
            // `ldd ≥ rows`; distinct allocations.
            unsafe {
                transpose_raw(src.as_ptr(), lds, got.as_mut_ptr(), ldd, rows, cols);
                scalar(src.as_ptr(), lds, want.as_mut_ptr(), ldd, rows, cols);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(&got), bits(&want), "{rows}×{cols}");
            for i in 0..rows {
                for j in 0..cols {
                    assert_eq!(got[j * ldd + i].to_bits(), src[i * lds + j].to_bits());
                }
            }
        }
    }
}
