//! Shampoo's matrix products: dot products of rows summed in `f64` in four fixed lanes (term
//! `k` in lane `k mod 4`, lanes added as `(s₀ + s₁) + (s₂ + s₃)`), rounded once. A fixed order,
//! so the bits depend only on the inputs: not on threads, tiling, or the CPU.
//!
//! Two paths give the same bits:
//! - the scalar loops ([`dot`], [`dot_scaled`]): the definition, and what runs without AVX2;
//! - on x86-64 with AVX2 and FMA (chosen at run time), register tiles of 3 × 3 dot products,
//!   one `f64` vector of the four lanes each, over operands widened to `f64` and padded with
//!   zeros to a multiple of four. The products of `f32` inputs are exact in `f64` (24 + 24
//!   significant bits ≤ 53), so a fused multiply-add rounds exactly where the scalar loop's
//!   add does. The zero padding adds `+0` to lanes that the scalar loop leaves alone, which
//!   changes nothing: a lane starts at `+0` and a sum that starts at `+0` is never `−0`
//!   (`+0 + −0 = +0`, and exact cancellation gives `+0`), and `x + 0 = x` for every other `x`,
//!   NaN and infinities included.
//!
//! Why not `gemm`: its sums are `f32`, blocked by CPU (the AVX-512 and AVX2 microkernels add in
//! different orders), so ranks on different CPUs would disagree; this keeps Shampoo's factors
//! and preconditioned gradients the same on every CPU given the same roots, at `f64`'s rate
//! (the roots themselves come from faer's eigendecomposition, whose bits follow the CPU's
//! vector instructions).

use rayon::prelude::*;

/// Lanes of the `f64` sums: term `k` goes to lane `k mod 4`.
pub(crate) const LANES: usize = 4;

/// Below this many multiply-adds a product runs on the calling thread.
const PAR_MIN_MACS: usize = 1 << 20;

/// Output rows per rayon task.
const BAND: usize = 24;

/// Bytes of the right operand's rows a task walks at a time (the panel stays in L2 while the
/// band's rows pass over it).
const PANEL_BYTES: usize = 192 << 10;

/// Which path [`mul_abt`] and [`scaled_gram_sym`] take on this CPU.
pub fn kernel_name() -> &'static str {
    if avx2_fma() {
        "f64 lanes, AVX2+FMA 3×3 tiles"
    } else {
        "f64 lanes, scalar"
    }
}

fn avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `Σ_k a_k·b_k` of `f32` rows: exact products summed in `f64` in [`LANES`] fixed lanes.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f64 {
    let b = &b[..a.len()];
    let mut s = [0.0f64; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for ((s, &x), &y) in s.iter_mut().zip(x).zip(y) {
            *s += f64::from(x) * f64::from(y);
        }
    }
    for (l, (&x, &y)) in ar.iter().zip(br).enumerate() {
        s[l] += f64::from(x) * f64::from(y);
    }
    (s[0] + s[1]) + (s[2] + s[3])
}

/// `Σ_k d_k·(a_k·b_k)` in `f64`, in the lanes of [`dot`]; symmetric in `a` and `b`.
#[inline]
pub(crate) fn dot_scaled(d: &[f64], a: &[f64], b: &[f64]) -> f64 {
    let (a, b) = (&a[..d.len()], &b[..d.len()]);
    let mut s = [0.0f64; LANES];
    let (dc, ac, bc) = (
        d.chunks_exact(LANES),
        a.chunks_exact(LANES),
        b.chunks_exact(LANES),
    );
    let (dr, ar, br) = (dc.remainder(), ac.remainder(), bc.remainder());
    for ((d, x), y) in dc.zip(ac).zip(bc) {
        for (((s, &d), &x), &y) in s.iter_mut().zip(d).zip(x).zip(y) {
            *s += d * (x * y);
        }
    }
    for (l, ((&d, &x), &y)) in dr.iter().zip(ar).zip(br).enumerate() {
        s[l] += d * (x * y);
    }
    (s[0] + s[1]) + (s[2] + s[3])
}

/// `A·Bᵀ` for row-major `A` (`n × k`) and `B` (`m × k`): element `(i, j)` is
/// [`dot`]`(A row i, B row j)` rounded to `f32`.
pub(crate) fn mul_abt(a: &[f32], b: &[f32], n: usize, m: usize, k: usize) -> Vec<f32> {
    let (a, b) = (&a[..n * k], &b[..m * k]);
    let mut out = vec![0.0f32; n * m];
    if n == 0 || m == 0 || k == 0 {
        return out; // empty sums: (0 + 0) + (0 + 0) = +0
    }
    let parallel = n * m * k >= PAR_MIN_MACS;
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        let kp = k.next_multiple_of(LANES);
        let ld = row_stride(kp);
        let (wa, wb) = (pad(a, k, ld), pad(b, k, ld));
        tiled(
            &mut out,
            wa.as_slice(),
            wb.as_slice(),
            m,
            [kp, ld],
            Triangle::Full,
            parallel,
        );
        return out;
    }
    let band = |(t, o): (usize, &mut [f32])| {
        for (r, o) in o.chunks_mut(m).enumerate() {
            let i = t * BAND + r;
            for (j, o) in o.iter_mut().enumerate() {
                *o = dot(&a[i * k..(i + 1) * k], &b[j * k..(j + 1) * k]) as f32;
            }
        }
    };
    for_bands(&mut out, m, parallel, band);
    out
}

/// `X = Q·diag(d)·Qᵀ` for the rows of `q` (`n × n`, row-major, `f64`): element `(i, j)` is
/// [`dot_scaled`]`(d, Q row i, Q row j)` rounded to `f32`, computed for `j ≥ i` and mirrored,
/// so `X` is exactly symmetric.
pub(crate) fn scaled_gram_sym(q: &[f64], d: &[f64], n: usize) -> Vec<f32> {
    let q = &q[..n * n];
    let mut x = vec![0.0f32; n * n];
    if n == 0 {
        return x;
    }
    upper_triangle(q, d, n, &mut x, n * n * n >= PAR_MIN_MACS);
    for i in 0..n {
        for j in 0..i {
            x[i * n + j] = x[j * n + i];
        }
    }
    x
}

/// The elements `j ≥ i` of [`scaled_gram_sym`]'s `x`: by the tiles where the CPU has them, else
/// by [`dot_scaled`].
fn upper_triangle(q: &[f64], d: &[f64], n: usize, x: &mut [f32], parallel: bool) {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        let kp = n.next_multiple_of(LANES);
        let ld = row_stride(kp);
        let (wq, wd) = (pad(q, n, ld), pad(d, n, kp));
        let (wq, upper) = (wq.as_slice(), Triangle::Upper(wd.as_slice()));
        return tiled(x, wq, wq, n, [kp, ld], upper, parallel);
    }
    let band = |(t, o): (usize, &mut [f32])| {
        for (r, o) in o.chunks_mut(n).enumerate() {
            let i = t * BAND + r;
            let qi = &q[i * n..(i + 1) * n];
            for (j, o) in o.iter_mut().enumerate().skip(i) {
                *o = dot_scaled(d, qi, &q[j * n..(j + 1) * n]) as f32;
            }
        }
    };
    for_bands(x, n, parallel, band);
}

/// `out` (`a`'s rows × `b`'s rows) by the AVX2 + FMA tiles, [`BAND`] rows of `a` a task; the
/// caller has checked that the CPU has them. `a` and `b` (`m` rows) hold rows of `ld`
/// elements, `kp` of them summed.
#[cfg(target_arch = "x86_64")]
fn tiled(
    out: &mut [f32],
    a: &[f64],
    b: &[f64],
    m: usize,
    [kp, ld]: [usize; 2],
    tri: Triangle,
    parallel: bool,
) {
    let band = |(t, o): (usize, &mut [f32])| {
        let rows = &a[t * BAND * ld..][..o.len() / m * ld];
        // SAFETY: the caller checked AVX2 and FMA; the operands are as `abt_band` needs.
        unsafe { avx2::abt_band(rows, b, m, [kp, ld], o, tri, t * BAND) }
    };
    for_bands(out, m, parallel, band);
}

/// Runs `band` on each [`BAND`] rows of the `cols`-wide `out` with the band's index, on rayon's
/// threads when `parallel`.
fn for_bands<F>(out: &mut [f32], cols: usize, parallel: bool, band: F)
where
    F: Fn((usize, &mut [f32])) + Sync + Send,
{
    if parallel {
        out.par_chunks_mut(BAND * cols).enumerate().for_each(band);
    } else {
        out.chunks_mut(BAND * cols).enumerate().for_each(band);
    }
}

/// Which outputs a band computes, and of what.
#[derive(Clone, Copy)]
enum Triangle<'a> {
    /// Every element, plain dot products.
    Full,
    /// Elements on and above the diagonal, dot products scaled by these lane weights.
    Upper(&'a [f64]),
}

/// Elements between rows of a widened operand: `kp` and one cache line more, so that rows
/// `kp · 8` bytes apart (a multiple of 4 KiB at `kp` = 512 or 1024) do not all fall in one
/// L1 set: a 3 × 3 tile reads six rows at once.
fn row_stride(kp: usize) -> usize {
    kp + 8
}

/// Four `f64` on a 32-byte boundary.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
struct Quad([f64; LANES]);

/// A zeroed `f64` buffer whose rows (of a multiple of [`LANES`] elements) start on 32-byte
/// boundaries, so that no 256-bit load of a tile straddles two cache lines.
struct Aligned(Vec<Quad>);

impl Aligned {
    fn zeros(len: usize) -> Self {
        Aligned(vec![Quad::default(); len.div_ceil(LANES)])
    }
    fn as_slice(&self) -> &[f64] {
        // SAFETY: `Quad` is `repr(C)` over `[f64; 4]`: the vector's quads are contiguous
        // `f64`s, initialized, and borrowed immutably with `self`.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), self.0.len() * LANES) }
    }
    fn as_mut_slice(&mut self) -> &mut [f64] {
        // SAFETY: as `as_slice`, borrowed mutably with `self`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast(), self.0.len() * LANES) }
    }
}

/// The rows of `k` elements of `x` as `f64` rows of `ld ≥ k` elements, the padding zero.
fn pad<T: Copy + Into<f64>>(x: &[T], k: usize, ld: usize) -> Aligned {
    let mut w = Aligned::zeros(x.len() / k * ld);
    for (w, x) in w.as_mut_slice().chunks_exact_mut(ld).zip(x.chunks_exact(k)) {
        w.iter_mut().zip(x).for_each(|(w, &x)| *w = x.into());
    }
    w
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Triangle, LANES, PANEL_BYTES};
    use std::arch::x86_64::*;

    /// Side of a register tile.
    const T: usize = 3;

    /// One band of output rows: `out[r·m + j]` for the rows of `a` (`ld` apart, `kp` summed)
    /// against the `m` rows of `b`, the right operand walked in panels that fit L2. `first` is
    /// the band's first row index (for the triangle). (Passes over `k` in blocks of 256 with
    /// the lane sums kept between them were no faster at `kp` = 512 and 1024: tried.)
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `a` holds `out.len() / m` rows of `ld ≥ kp` and `b`
    /// `m` rows of `ld`, `kp` a multiple of [`LANES`]; with [`Triangle::Upper`] its weights hold
    /// `kp` elements.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn abt_band(
        a: &[f64],
        b: &[f64],
        m: usize,
        [kp, ld]: [usize; 2],
        out: &mut [f32],
        tri: Triangle,
        first: usize,
    ) {
        let rows = out.len() / m;
        assert!(ld >= kp && kp.is_multiple_of(LANES));
        assert!(a.len() >= rows * ld && b.len() >= m * ld);
        if let Triangle::Upper(d) = tri {
            assert!(d.len() >= kp);
        }
        let panel = (PANEL_BYTES / (8 * ld)).max(T) / T * T;
        for jp in (0..m).step_by(panel) {
            let jn = panel.min(m - jp);
            for i in (0..rows).step_by(T) {
                let ri = T.min(rows - i);
                for j in (jp..jp + jn).step_by(T) {
                    let cj = T.min(jp + jn - j);
                    if let Triangle::Upper(_) = tri {
                        if j + cj <= first + i {
                            continue; // the whole tile is below the diagonal
                        }
                    }
                    let at = Tile {
                        a: a[i * ld..].as_ptr(),
                        b: b[j * ld..].as_ptr(),
                        ld,
                        kp,
                        out: out[i * m + j..].as_mut_ptr(),
                        ldo: m,
                        below: (first + i) as isize - j as isize,
                    };
                    // SAFETY: rows i..i + ri of `a`, j..j + cj of `b` and their outputs are
                    // inside the operands (asserted above); AVX2 and FMA as this function.
                    unsafe { tile_dyn(ri, cj, at, tri) };
                }
            }
        }
    }

    /// Where one register tile reads and writes.
    #[derive(Clone, Copy)]
    struct Tile {
        /// The tile's first row of `a` and of `b`.
        a: *const f64,
        b: *const f64,
        /// Elements between rows of `a` and of `b`, and elements summed.
        ld: usize,
        kp: usize,
        out: *mut f32,
        ldo: usize,
        /// Global row minus global column of the tile's first element: element `(r, c)` is
        /// below the diagonal when `below + r > c`.
        below: isize,
    }

    /// [`tile`] for an edge tile of `ri × cj` (each 1 to [`T`]).
    ///
    /// # Safety
    /// As [`tile`].
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_dyn(ri: usize, cj: usize, at: Tile, tri: Triangle) {
        // SAFETY: the caller's contract, for the tile size it names.
        unsafe {
            match (ri, cj) {
                (3, 3) => tile::<3, 3>(at, tri),
                (3, 2) => tile::<3, 2>(at, tri),
                (3, 1) => tile::<3, 1>(at, tri),
                (2, 3) => tile::<2, 3>(at, tri),
                (2, 2) => tile::<2, 2>(at, tri),
                (2, 1) => tile::<2, 1>(at, tri),
                (1, 3) => tile::<1, 3>(at, tri),
                (1, 2) => tile::<1, 2>(at, tri),
                _ => tile::<1, 1>(at, tri),
            }
        }
    }

    /// `R × C` dot products, each in one vector of the four lanes, the lanes added as
    /// `(s₀ + s₁) + (s₂ + s₃)` and rounded to `f32`.
    /// [`Triangle::Full`]: exact products by fused multiply-adds; [`Triangle::Upper`]:
    /// `s + d·(a·b)`, each operation rounded as in the scalar loop, and only elements on or
    /// above the diagonal written.
    ///
    /// # Safety
    /// AVX2 and FMA; `R` rows of `a` and `C` rows of `b`, `ld` apart, readable for `kp`
    /// elements; `R × C` outputs writable at `out + r·ldo + c`.
    // Index loops over the tile's registers, which the compiler unrolls (both indices pick
    // an accumulator).
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile<const R: usize, const C: usize>(at: Tile, tri: Triangle) {
        let mut acc = [[_mm256_setzero_pd(); C]; R];
        // SAFETY: every load is four elements of a row inside its `kp` (caller's contract).
        unsafe {
            match tri {
                Triangle::Full => {
                    for k in (0..at.kp).step_by(LANES) {
                        let av: [__m256d; R] =
                            std::array::from_fn(|r| _mm256_loadu_pd(at.a.add(r * at.ld + k)));
                        for c in 0..C {
                            let bv = _mm256_loadu_pd(at.b.add(c * at.ld + k));
                            for r in 0..R {
                                acc[r][c] = _mm256_fmadd_pd(av[r], bv, acc[r][c]);
                            }
                        }
                    }
                }
                Triangle::Upper(d) => {
                    let d = d.as_ptr();
                    for k in (0..at.kp).step_by(LANES) {
                        let dv = _mm256_loadu_pd(d.add(k));
                        let av: [__m256d; R] =
                            std::array::from_fn(|r| _mm256_loadu_pd(at.a.add(r * at.ld + k)));
                        for c in 0..C {
                            let bv = _mm256_loadu_pd(at.b.add(c * at.ld + k));
                            for r in 0..R {
                                let p = _mm256_mul_pd(dv, _mm256_mul_pd(av[r], bv));
                                acc[r][c] = _mm256_add_pd(acc[r][c], p);
                            }
                        }
                    }
                }
            }
        }
        let upper = matches!(tri, Triangle::Upper(_));
        for (r, row) in acc.iter().enumerate() {
            for (c, v) in row.iter().enumerate() {
                if !(upper && at.below + r as isize > c as isize) {
                    // SAFETY: output (r, c) of the tile (caller's contract).
                    unsafe { *at.out.add(r * at.ldo + c) = lane_sum(*v) as f32 };
                }
            }
        }
    }

    /// `(s₀ + s₁) + (s₂ + s₃)` of a vector's lanes.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn lane_sum(v: __m256d) -> f64 {
        let h = _mm_hadd_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd::<1>(v));
        _mm_cvtsd_f64(h) + _mm_cvtsd_f64(_mm_unpackhi_pd(h, h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values that stress the lanes: signed zeros, subnormals, powers of two far apart.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                crate::common::lcg(&mut s);
                let u = (s >> 40) as u32;
                let sign = if u & 1 == 0 { 1.0 } else { -1.0 };
                match u % 13 {
                    0 => -0.0,
                    1 => 0.0,
                    2 => f32::from_bits(u % 0x0080_0000), // subnormal
                    // Powers of two far apart: their products cancel exactly or absorb each
                    // other, so any other order of the sums changes the result.
                    3..=8 => sign * [2f32.powi(30), 1.0, 2f32.powi(-30)][(u as usize / 13) % 3],
                    _ => (u as f32 / (1u32 << 24) as f32) - 0.5,
                }
            })
            .collect()
    }

    /// Every tiled product equals the scalar definition bit for bit, at shapes that leave
    /// every edge tile and every lane remainder (`k` up to 601), on one thread and on several.
    #[test]
    fn tiled_products_equal_the_scalar_lanes_bitwise() {
        for &(n, m, k) in &[
            (1, 1, 1),
            (2, 5, 3),
            (7, 4, 9),
            (25, 26, 13),
            (50, 61, 130),
            (3, 200, 1),
            (8, 101, 601),
        ] {
            let (a, b) = (values(n * k, 1 + k as u64), values(m * k, 7 + n as u64));
            let got = mul_abt(&a, &b, n, m, k);
            for i in 0..n {
                for j in 0..m {
                    let want = dot(&a[i * k..(i + 1) * k], &b[j * k..(j + 1) * k]) as f32;
                    let g = got[i * m + j];
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "{n}×{m}×{k} ({i}, {j}): {g} vs {want}"
                    );
                }
            }
        }
        // Large enough for rayon's bands.
        let (n, k) = (130, 67);
        let a = values(n * k, 3);
        let got = mul_abt(&a, &a, n, n, k);
        for i in 0..n {
            for j in 0..n {
                let want = dot(&a[i * k..(i + 1) * k], &a[j * k..(j + 1) * k]) as f32;
                assert_eq!(got[i * n + j].to_bits(), want.to_bits(), "({i}, {j})");
            }
        }
    }

    #[test]
    fn tiled_scaled_gram_equals_the_scalar_lanes_bitwise_and_is_symmetric() {
        for n in [1, 2, 3, 5, 27, 64, 103, 290] {
            let q: Vec<f64> = values(n * n, n as u64)
                .iter()
                .map(|&x| f64::from(x) * 1e-3)
                .collect();
            let d: Vec<f64> = values(n, 99)
                .iter()
                .map(|&x| f64::from(x).abs() + 0.5)
                .collect();
            let got = scaled_gram_sym(&q, &d, n);
            for i in 0..n {
                for j in i..n {
                    let want =
                        dot_scaled(&d, &q[i * n..(i + 1) * n], &q[j * n..(j + 1) * n]) as f32;
                    assert_eq!(got[i * n + j].to_bits(), want.to_bits(), "n {n} ({i}, {j})");
                    assert_eq!(got[j * n + i].to_bits(), want.to_bits(), "n {n} ({j}, {i})");
                }
            }
        }
    }

    #[test]
    fn empty_products_are_empty() {
        assert!(mul_abt(&[], &[1.0; 12], 0, 3, 4).is_empty());
        assert_eq!(mul_abt(&[], &[], 2, 3, 0), vec![0.0; 6]);
        assert!(scaled_gram_sym(&[], &[], 0).is_empty());
    }
}

#[cfg(test)]
mod timing {
    /// The tiled product's rate at Shampoo's block sides (`cargo test --release -p
    /// ragged-optimizers --lib lane_dot::timing -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn time_products() {
        for n in [256usize, 512, 1024] {
            let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 - 3.0).collect();
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let t = std::time::Instant::now();
                std::hint::black_box(super::mul_abt(&a, &a, n, n, n));
                best = best.min(t.elapsed().as_secs_f64());
            }
            let gflops = 2.0 * (n as f64).powi(3) / best / 1e9;
            eprintln!(
                "{n}³: {:.2} ms, {gflops:.1} GFLOP/s ({})",
                best * 1e3,
                super::kernel_name()
            );
        }
    }
}
