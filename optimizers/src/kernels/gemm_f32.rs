//! Row-major `f32` GEMM on the `gemm` crate (0.19, AVX-512 microkernels with `x86-v4`), and
//! the symmetric product Newton–Schulz uses twice per step.
//!
//! `gemm::gemm` computes `dst ← α·dst + β·lhs·rhs` (`α` ignored when `read_dst` is false) on
//! strided views. Every matrix here is row-major: element `(i, j)` of a matrix with leading
//! dimension `ld` sits at `i·ld + j`, i.e. column stride 1 and row stride `ld` (in elements).
//!
//! # Determinism (gemm 0.19, read from `gemm-common/src/gemm.rs` and tested in
//! `tests/ns_kernel_tests.rs`)
//! The blocking (`kc`, `mc`, `nc`) depends on the shape and the cache sizes, not on the thread
//! count; threads split the output into disjoint tiles and never the `k` sum, so for a fixed
//! shape the result does not depend on the number of rayon threads or on `Parallelism::None`
//! versus `Parallelism::Rayon(n)`. It can depend on the CPU (the microkernel is picked by
//! run-time feature detection: AVX-512 or AVX2 widths differ).

use gemm::Parallelism;

use super::transpose_f32::transpose_raw;

/// Symmetric products with a side of at most this many rows are computed as one full GEMM;
/// larger ones split into halves (the off-diagonal block once, then mirrored), so every GEMM
/// keeps a side of at least 128 (smaller products run far from gemm's peak). Not tuned on
/// AVX-512: the shared development host was too noisy to rank 128, 256 and 512 there.
pub const SYM_LEAF: usize = 256;

/// [`SYM_LEAF`] where gemm runs its AVX2/FMA microkernels (16 × 6): their GEMMs keep their
/// rate down to a side of 128, where the symmetric product of a side of 1024 does 56 % of
/// the full product's multiply-adds instead of 62.5 %. Muon on the 28 matrices of the
/// d = 1024 Llama stack, one matrix per thread on 2 threads of a Zen 3 EPYC: 0.96× and
/// 0.975× the step time of leaves of 256 (medians of 8 and 10 alternating steps; leaves of
/// 64: 0.98×).
pub const SYM_LEAF_AVX2: usize = 128;

/// The microkernels gemm picks at run time from what the CPU reports (AVX-512F first, then
/// FMA): the one place that says which ran, for the leaf side and the backend's description.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Microkernels {
    Avx512,
    Avx2Fma,
    Generic,
}

impl Microkernels {
    /// This CPU's (`is_x86_feature_detected!` caches its answer: cheap on every call).
    pub fn detect() -> Microkernels {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Microkernels::Avx512;
            }
            if is_x86_feature_detected!("fma") {
                return Microkernels::Avx2Fma;
            }
        }
        Microkernels::Generic
    }

    /// e.g. `AVX2/FMA`.
    pub fn name(self) -> &'static str {
        match self {
            Microkernels::Avx512 => "AVX-512",
            Microkernels::Avx2Fma => "AVX2/FMA",
            Microkernels::Generic => "generic",
        }
    }
}

/// The leaf side of this CPU's symmetric products: [`SYM_LEAF_AVX2`] where gemm takes its
/// AVX2 microkernels, else [`SYM_LEAF`]. Fixed for the process, so a product's bits do not
/// depend on when it runs.
pub fn sym_leaf() -> usize {
    match Microkernels::detect() {
        Microkernels::Avx2Fma => SYM_LEAF_AVX2,
        Microkernels::Avx512 | Microkernels::Generic => SYM_LEAF,
    }
}

/// The pointers of one symmetric product, moved into the rayon tasks of its blocks.
#[derive(Clone, Copy)]
struct Operands {
    dst: *mut f32,
    lhs: View,
    rhs: View,
}

// SAFETY: the tasks that receive an `Operands` write disjoint blocks of `dst` and only read
// `lhs` and `rhs`, all of which outlive the `rayon::join` that runs them
// ([`sym_gemm_raw`]).
unsafe impl Send for Operands {}

/// A strided read-only view of a matrix: `ptr[i·rs + j·cs]` is element `(i, j)`.
#[derive(Clone, Copy, Debug)]
struct View {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

impl View {
    /// The view starting at element `(i, j)`.
    ///
    /// # Safety
    /// `(i, j)` must lie inside the viewed allocation.
    unsafe fn at(self, i: usize, j: usize) -> View {
        View {
            ptr: self.ptr.offset(i as isize * self.rs + j as isize * self.cs),
            ..self
        }
    }
}

/// `dst (m×n, leading dim ldd) ← α·dst + β·lhs·rhs` with `lhs: m×k`, `rhs: k×n`.
///
/// # Safety
/// The views must cover `m×k` and `k×n` elements of live allocations, `dst` must cover
/// `m` rows of `ldd ≥ n` elements and must not overlap `lhs` or `rhs`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_raw(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    ldd: usize,
    lhs: View,
    rhs: View,
    read_dst: bool,
    alpha: f32,
    beta: f32,
    par: Parallelism,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        ldd as isize,
        read_dst,
        lhs.ptr,
        lhs.cs,
        lhs.rs,
        rhs.ptr,
        rhs.cs,
        rhs.rs,
        alpha,
        beta,
        false,
        false,
        false,
        par,
    );
}

/// [`gemm_raw`] for a product known to be symmetric (`lhs·rhs = (lhs·rhs)ᵀ`, and `dst`
/// symmetric on entry when `read_dst`): the upper off-diagonal block is computed once and
/// mirrored, the diagonal blocks recursively, down to [`sym_leaf`]. The result is exactly
/// symmetric. For a side of 1024 this does 62.5 % of the full product's multiply-adds with
/// leaves of 256, 56.25 % with leaves of 128.
///
/// With threads (`par` not `None`), the three blocks of each split are rayon tasks, each a
/// single-threaded GEMM: the leaves (128 or 256 wide) are too small for gemm to split among threads
/// without waiting at every block (with 2 threads on the 28-matrix stack: 8.6–9.1 s per Muon
/// step against 9.2–9.9 s splitting every GEMM, three alternating pairs). gemm's result does
/// not depend on its thread count (module doc), so neither does this one.
///
/// # Safety
/// As [`gemm_raw`] with `m = n`.
#[allow(clippy::too_many_arguments)]
unsafe fn sym_gemm_raw(
    n: usize,
    k: usize,
    dst: *mut f32,
    ldd: usize,
    lhs: View,
    rhs: View,
    read_dst: bool,
    alpha: f32,
    beta: f32,
    par: Parallelism,
) {
    if n <= sym_leaf() {
        gemm_raw(n, n, k, dst, ldd, lhs, rhs, read_dst, alpha, beta, par);
        return;
    }
    let h = n / 2;
    let r = n - h;
    let tasks = !matches!(par, Parallelism::None);
    let inner = if tasks { Parallelism::None } else { par };
    let ops = Operands { dst, lhs, rhs };
    // SAFETY (all three): the blocks lie inside the caller's `n×n` destination and `k`-deep
    // operands, and they are disjoint (rows 0..h × columns 0..h, rows h..n × columns h..n,
    // rows 0..h × columns h..n), so running them at once writes no element twice; each reads
    // `dst` (when `read_dst`) only inside its own block.
    let upper_left = move || unsafe {
        let o = ops;
        sym_gemm_raw(h, k, o.dst, ldd, o.lhs, o.rhs, read_dst, alpha, beta, inner)
    };
    let lower_right = move || unsafe {
        let o = ops;
        let d = o.dst.add(h * ldd + h);
        let (l, rt) = (o.lhs.at(h, 0), o.rhs.at(0, h));
        sym_gemm_raw(r, k, d, ldd, l, rt, read_dst, alpha, beta, inner)
    };
    // Upper-right block: rows 0..h, columns h..n.
    let upper_right = move || unsafe {
        let o = ops;
        let (d, rt) = (o.dst.add(h), o.rhs.at(0, h));
        gemm_raw(h, r, k, d, ldd, o.lhs, rt, read_dst, alpha, beta, inner)
    };
    if tasks {
        rayon::join(upper_left, move || rayon::join(lower_right, upper_right));
    } else {
        upper_left();
        lower_right();
        upper_right();
    }
    // Mirror it into the lower-left block (rows h..n, columns 0..h).
    // SAFETY: the upper-right block (h rows of r from `dst + h`) and the lower-left one (r
    // rows of h from `dst + h·ldd`) lie inside the destination and are disjoint.
    unsafe { transpose_raw(dst.add(h), ldd, dst.add(h * ldd), ldd, h, r) };
}

/// `out (m×n) ← α·out + β·a·b` for row-major `a: m×k`, `b: k×n` (`α` unused when `!read_out`).
///
/// # Panics
/// If a slice has the wrong length (an internal invariant).
#[allow(clippy::too_many_arguments)]
#[track_caller]
pub fn matmul(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    b: &[f32],
    out: &mut [f32],
    read_out: bool,
    alpha: f32,
    beta: f32,
    par: Parallelism,
) {
    assert!(
        a.len() == m * k && b.len() == k * n && out.len() == m * n,
        "gemm_f32::matmul: lengths {}, {}, {} for {m}×{k}·{k}×{n}",
        a.len(),
        b.len(),
        out.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: lengths checked above; `out` is a distinct `&mut` borrow, so it overlaps
    // neither input.
    unsafe {
        gemm_raw(
            m,
            n,
            k,
            out.as_mut_ptr(),
            n,
            View {
                ptr: a.as_ptr(),
                rs: k as isize,
                cs: 1,
            },
            View {
                ptr: b.as_ptr(),
                rs: n as isize,
                cs: 1,
            },
            read_out,
            alpha,
            beta,
            par,
        )
    }
}

/// The Gram matrix `p (s×s) ← x·xᵀ` of a row-major `x: s×l`, by `sym_gemm_raw`.
#[track_caller]
pub fn gram(x: &[f32], s: usize, l: usize, p: &mut [f32], par: Parallelism) {
    assert!(
        x.len() == s * l && p.len() == s * s,
        "gemm_f32::gram: lengths {}, {} for s = {s}, l = {l}",
        x.len(),
        p.len()
    );
    if s == 0 {
        return;
    }
    let lhs = View {
        ptr: x.as_ptr(),
        rs: l as isize,
        cs: 1,
    };
    // xᵀ (l×s): element (i, j) = x[j, i].
    let rhs = View {
        ptr: x.as_ptr(),
        rs: 1,
        cs: l as isize,
    };
    // SAFETY: lengths checked; `p` is a distinct `&mut` borrow.
    unsafe { sym_gemm_raw(s, l, p.as_mut_ptr(), s, lhs, rhs, false, 0.0, 1.0, par) }
}

/// `q (s×s) ← b·p + c·p·p` for a symmetric row-major `p` (one fused GEMM with `q = p` on
/// entry, `α = b`, `β = c`), by `sym_gemm_raw`.
#[track_caller]
pub fn poly(p: &[f32], s: usize, b: f32, c: f32, q: &mut [f32], par: Parallelism) {
    assert!(
        p.len() == s * s && q.len() == s * s,
        "gemm_f32::poly: lengths {}, {} for s = {s}",
        p.len(),
        q.len()
    );
    if s == 0 {
        return;
    }
    q.copy_from_slice(p);
    let v = View {
        ptr: p.as_ptr(),
        rs: s as isize,
        cs: 1,
    };
    // SAFETY: lengths checked; `q` is a distinct `&mut` borrow.
    unsafe { sym_gemm_raw(s, s, q.as_mut_ptr(), s, v, v, true, b, c, par) }
}

/// `y (s×l) ← a·x + q·x` (one fused GEMM with `y = x` on entry, `α = a`, `β = 1`).
#[track_caller]
pub fn update(q: &[f32], x: &[f32], s: usize, l: usize, a: f32, y: &mut [f32], par: Parallelism) {
    y.copy_from_slice(x);
    matmul(s, l, s, q, x, y, true, a, 1.0, par);
}

/// `out (s×s) ← a·b` for symmetric row-major `a` and `b` that commute (polynomials of one
/// matrix, as in Gram Newton–Schulz), so that the product is symmetric: by `sym_gemm_raw`.
#[track_caller]
pub fn sym_product(a: &[f32], b: &[f32], s: usize, out: &mut [f32], par: Parallelism) {
    assert!(
        a.len() == s * s && b.len() == s * s && out.len() == s * s,
        "gemm_f32::sym_product: lengths {}, {}, {} for s = {s}",
        a.len(),
        b.len(),
        out.len()
    );
    if s == 0 {
        return;
    }
    let view = |m: &[f32]| View {
        ptr: m.as_ptr(),
        rs: s as isize,
        cs: 1,
    };
    // SAFETY: lengths checked; `out` is a distinct `&mut` borrow.
    unsafe {
        sym_gemm_raw(
            s,
            s,
            out.as_mut_ptr(),
            s,
            view(a),
            view(b),
            false,
            0.0,
            1.0,
            par,
        )
    }
}

/// Multiply-adds of a symmetric product of an `n × n` result with inner dimension `k` split
/// down to leaves of side `leaf` (`sym_gemm_raw` with [`sym_leaf`]).
pub fn sym_macs(n: usize, k: usize, leaf: usize) -> u128 {
    if n <= leaf.max(1) {
        return (n * n) as u128 * k as u128;
    }
    let (h, r) = (n / 2, n - n / 2);
    sym_macs(h, k, leaf) + sym_macs(r, k, leaf) + (h * r) as u128 * k as u128
}
