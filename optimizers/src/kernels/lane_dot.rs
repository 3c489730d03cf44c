//! Shampoo's matrix products: dot products of rows summed in `f64` in four fixed lanes (term
//! `k` in lane `k mod 4`, lanes added as `(s₀ + s₁) + (s₂ + s₃)`), rounded once. A fixed order,
//! so the bits depend only on the inputs: not on threads, tiling, or the CPU.
//!
//! Three paths give the same bits ([`Path`], chosen at run time):
//! - the scalar loops ([`dot`], [`dot_scaled`]): the definition, and what runs without AVX2;
//! - on x86-64 with AVX2 and FMA, register tiles of 3 × 3 dot products, one `f64` vector of
//!   the four lanes each;
//! - on x86-64 with AVX-512 F, register tiles of 6 × 8 dot products, two per 512-bit vector
//!   (the four lanes of columns `2p` and `2p + 1` side by side, the right operand packed so
//!   that one load fetches both), 24 accumulators of the 32 registers: 2.3 bytes loaded per
//!   multiply-add of a lane against the 3 × 3 tile's 5.3, the difference at `k` = 1024, whose
//!   rows stream from L2 (session 54, Zen 4, same runs: 90–97 against 53–68 GFLOP/s at 1024³).
//!
//! The tiles run over operands widened to `f64` and padded with zeros to a multiple of four.
//! The products of `f32` inputs are exact in `f64` (24 + 24 significant bits ≤ 53), so a fused
//! multiply-add rounds exactly where the scalar loop's add does. `Q·diag(d)·Qᵀ`'s terms are
//! `(d_k·q_ik)·q_jk`: the left rows are multiplied by `d` once, as they are widened, and the
//! scalar loop fuses the multiply-add as the tiles do (`f64::mul_add`). The zero padding adds
//! `+0` to lanes that the scalar loop leaves alone, which changes nothing: a lane starts at
//! `+0` and a sum that starts at `+0` is never `−0` (`+0 + −0 = +0`, and exact cancellation
//! gives `+0`), and `x + 0 = x` for every other `x`, NaN and infinities included.
//!
//! `RAGGED_LANE_DOT=avx2` or `scalar` caps the path (to time one against another in the same
//! run, as `ONEDNN_MAX_CPU_ISA` does for oneDNN); unset, unknown, or above what the CPU has, it
//! changes nothing. [`kernel_name`] says which path runs.
//!
//! Why not `gemm`: its sums are `f32`, blocked by CPU (the AVX-512 and AVX2 microkernels add in
//! different orders), so ranks on different CPUs would disagree; this keeps Shampoo's factors
//! and preconditioned gradients the same on every CPU given the same roots, at `f64`'s rate
//! (the roots themselves come from faer's eigendecomposition, whose bits follow the CPU's
//! vector instructions).

use rayon::prelude::*;
use std::sync::OnceLock;

/// Lanes of the `f64` sums: term `k` goes to lane `k mod 4`.
pub(crate) const LANES: usize = 4;

/// Below this many multiply-adds a product runs on the calling thread.
const PAR_MIN_MACS: usize = 1 << 20;

/// Output rows per rayon task (a multiple of both tiles' rows).
const BAND: usize = 24;

/// Bytes of the right operand's rows a task walks at a time (the panel stays in L2 while the
/// band's rows pass over it).
const PANEL_BYTES: usize = 192 << 10;

/// How the products run: every path gives the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Path {
    /// [`dot`] and [`dot_scaled`] per output.
    Scalar,
    /// AVX2 + FMA register tiles of 3 × 3 outputs.
    Avx2,
    /// AVX-512 F register tiles of 6 × 8 outputs, two outputs' lanes per vector.
    Avx512,
}

impl Path {
    /// The best path this CPU has, capped by `RAGGED_LANE_DOT` (read once).
    pub(crate) fn detected() -> Path {
        static PATH: OnceLock<Path> = OnceLock::new();
        *PATH.get_or_init(|| {
            let best = Path::best();
            cap().map_or(best, |c| c.min(best))
        })
    }

    /// Every path this CPU can run, slowest first.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Path> {
        [Path::Scalar, Path::Avx2, Path::Avx512]
            .into_iter()
            .filter(|&p| p <= Path::best())
            .collect()
    }

    fn best() -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") {
                return Path::Avx512;
            }
            if has!("avx2") && has!("fma") {
                return Path::Avx2;
            }
        }
        Path::Scalar
    }

    fn name(self) -> &'static str {
        match self {
            Path::Scalar => "f64 lanes, scalar",
            Path::Avx2 => "f64 lanes, AVX2+FMA 3×3 tiles",
            Path::Avx512 => "f64 lanes, AVX-512 6×8 tiles",
        }
    }
}

/// `RAGGED_LANE_DOT`'s cap, when it names a path.
fn cap() -> Option<Path> {
    parse_cap(&std::env::var("RAGGED_LANE_DOT").ok()?)
}

fn parse_cap(value: &str) -> Option<Path> {
    match value {
        "scalar" => Some(Path::Scalar),
        "avx2" => Some(Path::Avx2),
        "avx512" => Some(Path::Avx512),
        _ => None,
    }
}

/// Which path [`mul_abt`] and [`scaled_gram_sym`] take on this CPU, in a few words, and what
/// `RAGGED_LANE_DOT` did to it (a value it does not understand is named, not just ignored).
pub fn kernel_name() -> String {
    let (path, best) = (Path::detected(), Path::best());
    match std::env::var("RAGGED_LANE_DOT") {
        Ok(v) if parse_cap(&v).is_none() => format!(
            "{} (RAGGED_LANE_DOT={v:?} ignored: avx512, avx2 or scalar)",
            path.name()
        ),
        _ if path < best => format!(
            "{} (RAGGED_LANE_DOT; the CPU has {})",
            path.name(),
            best.name()
        ),
        _ => path.name().into(),
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
    lane_total(&s)
}

/// `(s₀ + s₁) + (s₂ + s₃)`: the one order in which every path adds its lanes.
#[inline]
fn lane_total(s: &[f64]) -> f64 {
    (s[0] + s[1]) + (s[2] + s[3])
}

/// `Σ_k (d_k·a_k)·b_k` in `f64`, in the lanes of [`dot`]: `d_k·a_k` rounded, then a fused
/// multiply-add into the lane (one rounding, as the tiles' `vfmadd`).
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
            *s = (d * x).mul_add(y, *s);
        }
    }
    for (l, ((&d, &x), &y)) in dr.iter().zip(ar).zip(br).enumerate() {
        s[l] = (d * x).mul_add(y, s[l]);
    }
    lane_total(&s)
}

/// `A·Bᵀ` for row-major `A` (`n × k`) and `B` (`m × k`): element `(i, j)` is
/// [`dot`]`(A row i, B row j)` rounded to `f32`.
pub(crate) fn mul_abt(a: &[f32], b: &[f32], n: usize, m: usize, k: usize) -> Vec<f32> {
    mul_abt_on(Path::detected(), a, b, n, m, k)
}

/// [`mul_abt`] on `path` (a panic when the CPU lacks it).
fn mul_abt_on(path: Path, a: &[f32], b: &[f32], n: usize, m: usize, k: usize) -> Vec<f32> {
    let (a, b) = (&a[..n * k], &b[..m * k]);
    let mut out = vec![0.0f32; n * m];
    if n == 0 || m == 0 || k == 0 {
        return out; // empty sums: (0 + 0) + (0 + 0) = +0
    }
    let parallel = n * m * k >= PAR_MIN_MACS;
    #[cfg(target_arch = "x86_64")]
    if path != Path::Scalar {
        let kp = k.next_multiple_of(LANES);
        let left = Widened::rows(a, k, kp);
        let right = Widened::right(path, b, k, kp);
        tiled(
            path,
            &mut out,
            &left,
            &right,
            m,
            kp,
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
/// so `X` is exactly symmetric. (The tiles multiply `Q`'s rows by `d` once, as they widen
/// them, and then run the plain product's fused multiply-adds.)
pub(crate) fn scaled_gram_sym(q: &[f64], d: &[f64], n: usize) -> Vec<f32> {
    scaled_gram_sym_on(Path::detected(), q, d, n)
}

/// [`scaled_gram_sym`] on `path` (a panic when the CPU lacks it).
fn scaled_gram_sym_on(path: Path, q: &[f64], d: &[f64], n: usize) -> Vec<f32> {
    let q = &q[..n * n];
    let mut x = vec![0.0f32; n * n];
    if n == 0 {
        return x;
    }
    upper_triangle(path, q, d, n, &mut x, n * n * n >= PAR_MIN_MACS);
    for i in 0..n {
        for j in 0..i {
            x[i * n + j] = x[j * n + i];
        }
    }
    x
}

/// The elements `j ≥ i` of [`scaled_gram_sym`]'s `x`: by the tiles of `path`, or by
/// [`dot_scaled`].
fn upper_triangle(path: Path, q: &[f64], d: &[f64], n: usize, x: &mut [f32], parallel: bool) {
    #[cfg(target_arch = "x86_64")]
    if path != Path::Scalar {
        let kp = n.next_multiple_of(LANES);
        let left = Widened::scaled_rows(q, d, kp);
        let right = Widened::right(path, q, n, kp);
        return tiled(path, x, &left, &right, n, kp, Triangle::Upper, parallel);
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

/// `out` (`left`'s rows × `m`) by `path`'s register tiles, [`BAND`] rows a task; `right` was
/// widened for `path`. Panics when the CPU lacks `path`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)] // the product's shape, as `abt_band` takes it
fn tiled(
    path: Path,
    out: &mut [f32],
    left: &Widened,
    right: &Widened,
    m: usize,
    kp: usize,
    tri: Triangle,
    parallel: bool,
) {
    // What makes the calls below sound: the CPU runs `path`'s instructions.
    assert!(
        path <= Path::best(),
        "lane_dot: {path:?} on a CPU without it"
    );
    let (lda, b) = (left.stride, right.data.as_slice());
    let band = |(t, o): (usize, &mut [f32])| {
        let a = &left.data.as_slice()[t * BAND * lda..][..o.len() / m * lda];
        let shape = Shape {
            lda,
            ldb: right.stride,
            m,
            kp,
            first: t * BAND,
        };
        // SAFETY: the CPU has `path`'s instructions (asserted above); `abt_band` checks the
        // operands' bounds itself (`band_tiles`).
        match path {
            Path::Avx512 => unsafe { avx512::abt_band(a, b, shape, o, tri) },
            Path::Avx2 => unsafe { avx2::abt_band(a, b, shape, o, tri) },
            Path::Scalar => unreachable!("lane_dot: the scalar path has no tiles"),
        }
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

/// Which outputs a band computes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Triangle {
    /// Every element.
    Full,
    /// The elements on and above the diagonal.
    Upper,
}

/// The shape of one band's product: elements between rows of the left operand and between
/// rows (AVX2) or row pairs (AVX-512) of the right one, the right operand's rows (the output's
/// columns), the elements summed, and the band's first output row.
#[derive(Clone, Copy)]
struct Shape {
    lda: usize,
    ldb: usize,
    m: usize,
    kp: usize,
    first: usize,
}

/// Where one register tile reads and writes (both tile paths).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Tile {
    /// The tile's first row of `a`, and its first row (AVX2) or row pair (AVX-512) of `b`.
    a: *const f64,
    b: *const f64,
    /// Elements between rows of `a`, between rows or pairs of `b`, and elements summed.
    lda: usize,
    ldb: usize,
    kp: usize,
    out: *mut f32,
    ldo: usize,
    /// Columns written (an AVX-512 tile of an odd count leaves its last pair's second half
    /// unwritten).
    cols: usize,
    /// Global row minus global column of the tile's first element: element `(r, c)` is
    /// below the diagonal when `below + r > c`.
    below: isize,
}

/// Calls `tile(ri, cj, at)` for the register tiles of one band (`out`, `out.len() / m` rows
/// of `m`): each the `ri × cj` outputs from `at`, at most `tr × tc`, `b` holding `pack` rows
/// (1 or 2) per `ldb` elements. The columns are walked in panels that fit L2 (a multiple of
/// `tc`), so that the right operand's panel stays there while the band's rows pass over it.
/// Under [`Triangle::Upper`] a tile wholly below the diagonal is skipped. Panics unless `a`
/// and `b` hold every row the tiles read, `kp` elements each: so `tile` may read them all.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)] // the band, its tile size and the right operand's packing
fn band_tiles(
    a: &[f64],
    b: &[f64],
    sh: Shape,
    out: &mut [f32],
    tri: Triangle,
    [tr, tc]: [usize; 2],
    pack: usize,
    mut tile: impl FnMut(usize, usize, Tile),
) {
    let Shape {
        lda,
        ldb,
        m,
        kp,
        first,
    } = sh;
    let rows = out.len() / m;
    assert!(lda >= kp && ldb >= pack * kp && kp.is_multiple_of(LANES));
    assert!(a.len() >= rows * lda && b.len() >= m.div_ceil(pack) * ldb);
    let panel = (PANEL_BYTES / (8 * ldb) * pack).max(tc) / tc * tc;
    for jp in (0..m).step_by(panel) {
        let jn = panel.min(m - jp);
        for i in (0..rows).step_by(tr) {
            let ri = tr.min(rows - i);
            for j in (jp..jp + jn).step_by(tc) {
                let cj = tc.min(jp + jn - j);
                if tri == Triangle::Upper && j + cj <= first + i {
                    continue; // the whole tile is below the diagonal
                }
                // `j` is a multiple of `tc`, which is of `pack`: the tile starts a pair.
                let at = Tile {
                    a: a[i * lda..].as_ptr(),
                    b: b[j / pack * ldb..].as_ptr(),
                    lda,
                    ldb,
                    kp,
                    out: out[i * m + j..].as_mut_ptr(),
                    ldo: m,
                    cols: cj,
                    below: (first + i) as isize - j as isize,
                };
                tile(ri, cj, at);
            }
        }
    }
}

/// Elements between rows of a widened operand: `kp` and one cache line more, so that rows
/// `kp · 8` bytes apart (a multiple of 4 KiB at `kp` = 512 or 1024) do not all fall in one
/// L1 set: a tile reads six to ten rows at once.
fn row_stride(kp: usize) -> usize {
    kp + 8
}

/// Eight `f64` on a 64-byte boundary: one cache line, one 512-bit load.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Line([f64; 8]);

/// A zeroed `f64` buffer on 64-byte boundaries, so that a tile's loads from rows (or row
/// pairs) whose strides are multiples of their width never straddle two cache lines.
struct Aligned(Vec<Line>);

impl Aligned {
    fn zeros(len: usize) -> Self {
        Aligned(vec![Line::default(); len.div_ceil(8)])
    }
    fn as_slice(&self) -> &[f64] {
        // SAFETY: `Line` is `repr(C)` over `[f64; 8]`: the vector's lines are contiguous
        // `f64`s, initialized, and borrowed immutably with `self`.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), self.0.len() * 8) }
    }
    fn as_mut_slice(&mut self) -> &mut [f64] {
        // SAFETY: as `as_slice`, borrowed mutably with `self`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast(), self.0.len() * 8) }
    }
}

/// An operand widened to `f64` for the tiles, zero-padded, and the elements between its rows
/// (or, packed in pairs, between its row pairs).
struct Widened {
    data: Aligned,
    stride: usize,
}

impl Widened {
    /// The rows of `k` elements of `x` as rows of [`row_stride`]`(kp)`, `kp ≥ k`.
    fn rows<T: Copy + Into<f64>>(x: &[T], k: usize, kp: usize) -> Widened {
        let stride = row_stride(kp);
        let mut data = Aligned::zeros(x.len() / k * stride);
        for (w, x) in data
            .as_mut_slice()
            .chunks_exact_mut(stride)
            .zip(x.chunks_exact(k))
        {
            w.iter_mut().zip(x).for_each(|(w, &x)| *w = x.into());
        }
        Widened { data, stride }
    }

    /// The rows of the `n × n` matrix `q` times `d` element by element (`d_k·q_ik`, as
    /// [`dot_scaled`] rounds it), as [`Widened::rows`], `kp ≥ n`.
    fn scaled_rows(q: &[f64], d: &[f64], kp: usize) -> Widened {
        let n = d.len();
        let mut w = Widened::rows(q, n, kp);
        let stride = w.stride;
        for row in w.data.as_mut_slice().chunks_exact_mut(stride) {
            row.iter_mut().zip(d).for_each(|(x, &d)| *x *= d);
        }
        w
    }

    /// The right operand for `path`'s tiles: rows as [`Widened::rows`] for AVX2; for AVX-512,
    /// rows `2p` and `2p + 1` interleaved four elements at a time (lanes 0–3 of each 8 from
    /// row `2p`, 4–7 from `2p + 1`; a missing last row zero), pairs `2·kp + 8` apart (one
    /// cache line more, as [`row_stride`]).
    fn right<T: Copy + Into<f64>>(path: Path, x: &[T], k: usize, kp: usize) -> Widened {
        if path != Path::Avx512 {
            return Widened::rows(x, k, kp);
        }
        let stride = 2 * kp + 8;
        let rows = x.len() / k;
        let mut data = Aligned::zeros(rows.div_ceil(2) * stride);
        let w = data.as_mut_slice();
        for (r, x) in x.chunks_exact(k).enumerate() {
            let pair = &mut w[r / 2 * stride..];
            for (q, x) in x.chunks(LANES).enumerate() {
                let at = q * 2 * LANES + (r % 2) * LANES;
                pair[at..at + x.len()]
                    .iter_mut()
                    .zip(x)
                    .for_each(|(w, &x)| *w = x.into());
            }
        }
        Widened { data, stride }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{band_tiles, Shape, Tile, Triangle, LANES};
    use std::arch::x86_64::*;

    /// Side of a register tile.
    const T: usize = 3;

    /// One band of output rows: `out[r·m + j]` for the rows of `a` (`lda` apart, `kp` summed)
    /// against the `m` rows of `b` (`ldb` apart), by [`band_tiles`]. (Passes over `k` in
    /// blocks of 256 with the lane sums kept between them were no faster at `kp` = 512 and
    /// 1024: tried.)
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn abt_band(a: &[f64], b: &[f64], sh: Shape, out: &mut [f32], tri: Triangle) {
        band_tiles(a, b, sh, out, tri, [T, T], 1, |ri, cj, at| {
            // SAFETY: `band_tiles` checked that the tile's rows and outputs are inside the
            // operands; AVX2 and FMA as this function.
            unsafe { tile_dyn(ri, cj, at, tri) }
        });
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

    /// `R × C` dot products by fused multiply-adds, each in one vector of the four lanes,
    /// the lanes added as `(s₀ + s₁) + (s₂ + s₃)` and rounded to `f32`; under
    /// [`Triangle::Upper`] only the elements on or above the diagonal are written.
    ///
    /// # Safety
    /// AVX2 and FMA; `R` rows of `a` (`lda` apart) and `C` rows of `b` (`ldb` apart),
    /// readable for `kp` elements; `R × C` outputs writable at `out + r·ldo + c`.
    // Index loops over the tile's registers, which the compiler unrolls (both indices pick
    // an accumulator).
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile<const R: usize, const C: usize>(at: Tile, tri: Triangle) {
        let mut acc = [[_mm256_setzero_pd(); C]; R];
        // SAFETY: every load is four elements of a row inside its `kp` (caller's contract).
        unsafe {
            for k in (0..at.kp).step_by(LANES) {
                let av: [__m256d; R] =
                    std::array::from_fn(|r| _mm256_loadu_pd(at.a.add(r * at.lda + k)));
                for c in 0..C {
                    let bv = _mm256_loadu_pd(at.b.add(c * at.ldb + k));
                    for r in 0..R {
                        acc[r][c] = _mm256_fmadd_pd(av[r], bv, acc[r][c]);
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (c, v) in row.iter().enumerate() {
                if !(tri == Triangle::Upper && at.below + r as isize > c as isize) {
                    // SAFETY: output (r, c) of the tile (caller's contract).
                    unsafe { *at.out.add(r * at.ldo + c) = lane_sum(*v) as f32 };
                }
            }
        }
    }

    /// `(s₀ + s₁) + (s₂ + s₃)` of a vector's lanes.
    #[target_feature(enable = "avx")]
    #[inline]
    fn lane_sum(v: __m256d) -> f64 {
        let mut lanes = [0.0f64; LANES];
        // SAFETY: four `f64` into an array of four.
        unsafe { _mm256_storeu_pd(lanes.as_mut_ptr(), v) };
        super::lane_total(&lanes)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{band_tiles, Shape, Tile, Triangle, LANES};
    use std::arch::x86_64::*;

    /// Rows of a register tile.
    const ROWS: usize = 6;
    /// Column pairs of a register tile: the lanes of two columns share one vector.
    const PAIRS: usize = 4;
    /// Columns of a register tile.
    const COLS: usize = 2 * PAIRS;

    /// One band of output rows: `out[r·m + j]` for the rows of `a` (`lda` apart, `kp`
    /// summed) against the `m` rows of `b`, packed in pairs `ldb` apart (`Widened::right`),
    /// by [`band_tiles`].
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn abt_band(a: &[f64], b: &[f64], sh: Shape, out: &mut [f32], tri: Triangle) {
        band_tiles(a, b, sh, out, tri, [ROWS, COLS], 2, |ri, cj, at| {
            // SAFETY: `band_tiles` checked that the tile's rows, pairs and outputs are inside
            // the operands; AVX-512 F as this function.
            unsafe { tile_dyn(ri, cj.div_ceil(2), at, tri) }
        });
    }

    /// [`tile`] for a tile of `ri` rows (1 to [`ROWS`]) and `pairs` column pairs (1 to
    /// [`PAIRS`]).
    ///
    /// # Safety
    /// As [`tile`].
    #[target_feature(enable = "avx512f")]
    unsafe fn tile_dyn(ri: usize, pairs: usize, at: Tile, tri: Triangle) {
        macro_rules! rows {
            ($p:literal) => {
                match ri {
                    1 => tile::<1, $p>(at, tri),
                    2 => tile::<2, $p>(at, tri),
                    3 => tile::<3, $p>(at, tri),
                    4 => tile::<4, $p>(at, tri),
                    5 => tile::<5, $p>(at, tri),
                    _ => tile::<6, $p>(at, tri),
                }
            };
        }
        // SAFETY: the caller's contract, for the tile size it names.
        unsafe {
            match pairs {
                1 => rows!(1),
                2 => rows!(2),
                3 => rows!(3),
                _ => rows!(4),
            }
        }
    }

    /// `R × 2P` dot products by fused multiply-adds, two to a vector (lanes 0–3: column
    /// `2p`, 4–7: `2p + 1`), each dot product's lanes added as `(s₀ + s₁) + (s₂ + s₃)` and
    /// rounded to `f32`; under [`Triangle::Upper`] only the elements on or above the diagonal
    /// are written.
    ///
    /// # Safety
    /// AVX-512 F; `R` rows of `a` (`lda` apart) readable for `kp` elements and `P` pairs of `b`
    /// (`ldb` apart) for `2·kp`; `R × cols` outputs writable at `out + r·ldo + c`.
    // Index loops over the tile's registers, which the compiler unrolls (both indices pick
    // an accumulator).
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tile<const R: usize, const P: usize>(at: Tile, tri: Triangle) {
        let mut acc = [[_mm512_setzero_pd(); P]; R];
        // SAFETY: every load is four elements of a row of `a` inside its `kp`, or eight of a
        // pair of `b` inside its `2·kp` (caller's contract).
        unsafe {
            for k in (0..at.kp).step_by(LANES) {
                let bv: [__m512d; P] =
                    std::array::from_fn(|p| _mm512_loadu_pd(at.b.add(p * at.ldb + 2 * k)));
                for r in 0..R {
                    // Row r's four elements at k, in both halves of a vector.
                    let av = _mm512_broadcast_f64x4(_mm256_loadu_pd(at.a.add(r * at.lda + k)));
                    for p in 0..P {
                        acc[r][p] = _mm512_fmadd_pd(av, bv[p], acc[r][p]);
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            // SAFETY: row r's outputs of the tile (caller's contract).
            unsafe { write_row(row, r, at, tri) };
        }
    }

    /// Writes output row `r` of a tile from its accumulators (`P` ≤ [`PAIRS`] vectors, the
    /// lanes of columns `2p` and `2p + 1`): every column's lanes added as
    /// `(s₀ + s₁) + (s₂ + s₃)`, eight columns at once, rounded to `f32`, and stored under a
    /// mask of the tile's columns (and, under [`Triangle::Upper`], of those on or above the
    /// diagonal). The shuffles only move lanes: each column's sum is the scalar loop's.
    ///
    /// # Safety
    /// AVX-512 F; row `r`'s `cols` outputs writable at `out + r·ldo`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn write_row<const P: usize>(row: &[__m512d; P], r: usize, at: Tile, tri: Triangle) {
        let zero = _mm512_setzero_pd();
        let v = |p: usize| if p < P { row[p] } else { zero };
        // Within each 128-bit lane: [v0₀ + v0₁, v1₀ + v1₁, v0₂ + v0₃, v1₂ + v1₃, ...], that is
        // the lane pairs (s₀ + s₁) and (s₂ + s₃) of columns 0 and 2 (low halves), 1 and 3
        // (high halves); the same for columns 4–7 from v2 and v3.
        let pairs = |a: __m512d, b: __m512d| {
            _mm512_add_pd(_mm512_unpacklo_pd(a, b), _mm512_unpackhi_pd(a, b))
        };
        let (lo, hi) = (pairs(v(0), v(1)), pairs(v(2), v(3)));
        // Column c's (s₀ + s₁) and (s₂ + s₃), in column order (indices ≥ 8 pick `hi`).
        let s01 = _mm512_permutex2var_pd(lo, _mm512_setr_epi64(0, 4, 1, 5, 8, 12, 9, 13), hi);
        let s23 = _mm512_permutex2var_pd(lo, _mm512_setr_epi64(2, 6, 3, 7, 10, 14, 11, 15), hi);
        let sums = _mm512_cvtpd_ps(_mm512_add_pd(s01, s23));
        let mut mask = (1u16 << at.cols) - 1;
        let below = at.below + r as isize; // columns before this are below the diagonal
        if tri == Triangle::Upper && below > 0 {
            mask &= !((1u16 << below.min(8)) - 1);
        }
        // SAFETY: the masked columns are the tile's row r outputs (caller's contract); the
        // others are not touched.
        unsafe {
            let out = at.out.add(r * at.ldo);
            _mm512_mask_storeu_ps(out, mask, _mm512_castps256_ps512(sums));
        }
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

    /// The paths this CPU runs, printed so that a log shows which were compared.
    fn paths() -> Vec<Path> {
        let paths = Path::available();
        eprintln!("lane_dot paths on this CPU: {paths:?}");
        paths
    }

    /// Every tiled product equals the scalar definition bit for bit on every path the CPU
    /// has, at shapes that leave every edge tile of both tile sizes (rows mod 3 and mod 6,
    /// columns mod 3 and mod 8, odd column counts), every lane remainder (`k` up to 601) and
    /// several column panels, on one thread and on several.
    #[test]
    fn tiled_products_equal_the_scalar_lanes_bitwise() {
        for path in paths() {
            for &(n, m, k) in &[
                (1, 1, 1),
                (2, 5, 3),
                (7, 4, 9),
                (6, 8, 4),
                (11, 17, 5),
                (13, 15, 7),
                (25, 26, 13),
                (50, 61, 130),
                (3, 200, 1),
                (8, 101, 601),
            ] {
                let (a, b) = (values(n * k, 1 + k as u64), values(m * k, 7 + n as u64));
                let got = mul_abt_on(path, &a, &b, n, m, k);
                for i in 0..n {
                    for j in 0..m {
                        let want = dot(&a[i * k..(i + 1) * k], &b[j * k..(j + 1) * k]) as f32;
                        let g = got[i * m + j];
                        assert_eq!(
                            g.to_bits(),
                            want.to_bits(),
                            "{path:?} {n}×{m}×{k} ({i}, {j}): {g} vs {want}"
                        );
                    }
                }
            }
            // Large enough for rayon's bands.
            let (n, k) = (130, 67);
            let a = values(n * k, 3);
            let got = mul_abt_on(path, &a, &a, n, n, k);
            for i in 0..n {
                for j in 0..n {
                    let want = dot(&a[i * k..(i + 1) * k], &a[j * k..(j + 1) * k]) as f32;
                    assert_eq!(
                        got[i * n + j].to_bits(),
                        want.to_bits(),
                        "{path:?} ({i}, {j})"
                    );
                }
            }
        }
    }

    #[test]
    fn tiled_scaled_gram_equals_the_scalar_lanes_bitwise_and_is_symmetric() {
        for path in paths() {
            for n in [1, 2, 3, 5, 7, 13, 27, 64, 103, 290] {
                let q: Vec<f64> = values(n * n, n as u64)
                    .iter()
                    .map(|&x| f64::from(x) * 1e-3)
                    .collect();
                let d: Vec<f64> = values(n, 99)
                    .iter()
                    .map(|&x| f64::from(x).abs() + 0.5)
                    .collect();
                let got = scaled_gram_sym_on(path, &q, &d, n);
                for i in 0..n {
                    for j in i..n {
                        let qi = &q[i * n..(i + 1) * n];
                        let want = dot_scaled(&d, qi, &q[j * n..(j + 1) * n]) as f32;
                        let at = |r: usize, c: usize| got[r * n + c].to_bits();
                        assert_eq!(at(i, j), want.to_bits(), "{path:?} n {n} ({i}, {j})");
                        assert_eq!(at(j, i), want.to_bits(), "{path:?} n {n} ({j}, {i})");
                    }
                }
            }
        }
    }

    /// The cap's values name the paths in order; anything else caps nothing.
    #[test]
    fn the_cap_names_each_path_and_nothing_else() {
        assert_eq!(parse_cap("scalar"), Some(Path::Scalar));
        assert_eq!(parse_cap("avx2"), Some(Path::Avx2));
        assert_eq!(parse_cap("avx512"), Some(Path::Avx512));
        for bad in ["", "AVX2", "avx-512", "sse"] {
            assert_eq!(parse_cap(bad), None, "{bad:?}");
        }
        assert!(Path::Scalar < Path::Avx2 && Path::Avx2 < Path::Avx512);
        assert!(Path::available().contains(&Path::detected()));
    }

    #[test]
    fn empty_products_are_empty() {
        for path in paths() {
            assert!(mul_abt_on(path, &[], &[1.0; 12], 0, 3, 4).is_empty());
            assert_eq!(mul_abt_on(path, &[], &[], 2, 3, 0), vec![0.0; 6]);
            assert!(scaled_gram_sym_on(path, &[], &[], 0).is_empty());
        }
    }
}

#[cfg(test)]
mod timing {
    use super::Path;

    /// The tiled products' rates at Shampoo's block sides on every tiled path this CPU has,
    /// the paths alternating: `A·Aᵀ` (`mul_abt`, `2n³` FLOPs) and `Q·diag(d)·Qᵀ`
    /// (`scaled_gram_sym`, its upper triangle: counted as `n³` multiply-add pairs)
    /// (`cargo test --release -p ragged-optimizers --lib lane_dot::timing -- --ignored
    /// --nocapture`).
    #[test]
    #[ignore]
    fn time_products() {
        let paths: Vec<Path> = Path::available().into_iter().skip(1).collect();
        for n in [256usize, 512, 1024] {
            let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 - 3.0).collect();
            let q: Vec<f64> = a.iter().map(|&x| f64::from(x) * 0.1).collect();
            let d: Vec<f64> = (0..n).map(|i| 1.0 + i as f64).collect();
            let mut best = vec![[f64::INFINITY; 2]; paths.len()];
            for _ in 0..5 {
                for (best, &path) in best.iter_mut().zip(&paths) {
                    let t = std::time::Instant::now();
                    std::hint::black_box(super::mul_abt_on(path, &a, &a, n, n, n));
                    best[0] = best[0].min(t.elapsed().as_secs_f64());
                    let t = std::time::Instant::now();
                    std::hint::black_box(super::scaled_gram_sym_on(path, &q, &d, n));
                    best[1] = best[1].min(t.elapsed().as_secs_f64());
                }
            }
            let flops = 2.0 * (n as f64).powi(3);
            for (best, path) in best.iter().zip(&paths) {
                eprintln!(
                    "{n}³ {path:?}: A·Aᵀ {:.2} ms, {:.1} GFLOP/s; Q·diag·Qᵀ {:.2} ms, {:.1} GFLOP/s",
                    best[0] * 1e3,
                    flops / best[0] / 1e9,
                    best[1] * 1e3,
                    flops / 2.0 / best[1] / 1e9,
                );
            }
        }
    }
}
