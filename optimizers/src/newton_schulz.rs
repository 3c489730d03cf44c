//! Newton–Schulz orthogonalization in `f32` on plain row-major slices: Muon's "zeroth power"
//! `X ↦ U·Vᵀ` (for `X = U·Σ·Vᵀ`), approximated by an odd matrix polynomial.
//!
//! torch.optim.Muon's `_zeropower_via_newtonschulz` (Jordan et al., "Muon: An optimizer for
//! hidden layers in neural networks", 2024), with `f32` as the working dtype instead of bf16:
//!
//! | # | operation | torch |
//! |---|---|---|
//! | 1 | if `rows > cols`, `X ← Xᵀ` (so the Gram matrix is (short side)²) | `ortho_grad.T` |
//! | 2 | `X ← X / max(‖X‖_F, eps)` | `div_(norm().clamp(min=eps))` |
//! | 3 | per step `k`, with `(a, b, c)` = the `k`-th coefficients: `P = X·Xᵀ`, `Q = b·P + c·(P·P)`, `X ← a·X + Q·X` | non-`addmm` form |
//! | 4 | transpose back if step 1 transposed | `.T` |
//!
//! # Determinism
//! Every product is a plain loop with `f32` accumulation in a fixed order (`k` ascending, no
//! fused multiply-add); rows of a product may be computed on different rayon threads, which
//! changes no bit. The Frobenius norm is summed in `f64` in element order and rounded once.
//! The result is therefore a function of the input bits alone, on every machine and thread
//! count, which is what makes a sharded Muon step bitwise equal to the unsharded one.
//!
//! # Accuracy
//! The quintic coefficients (3.4445, −4.7750, 2.0315) trade exactness for speed: after 5
//! steps the singular values land in roughly `[0.7, 1.2]`, not at 1 (Jordan 2024).

use rayon::prelude::*;

use ragged::{Error, Result};

/// Keller Jordan's quintic coefficients, torch.optim.Muon's default `(a, b, c)`.
pub const QUINTIC: [f32; 3] = [3.4445, -4.7750, 2.0315];

/// Products with at least this many output elements are split over rayon tasks by row.
pub const PAR_MIN_OUT: usize = 1 << 14;

/// Newton–Schulz hyperparameters. Step `k` uses `coeffs[min(k, coeffs.len() − 1)]` (a
/// schedule shorter than `steps` repeats its last triple).
#[derive(Clone, Debug, PartialEq)]
pub struct NsConfig {
    /// Iterations (default 5; torch refuses 100 or more).
    pub steps: usize,
    /// `(a, b, c)` per step (default: [`QUINTIC`] for every step).
    pub coeffs: Vec<[f32; 3]>,
    /// Lower clamp of the Frobenius norm in step 2 (default `1e-7`, torch's).
    pub eps: f32,
}

impl Default for NsConfig {
    fn default() -> Self {
        NsConfig {
            steps: 5,
            coeffs: vec![QUINTIC],
            eps: 1e-7,
        }
    }
}

impl NsConfig {
    /// `Err` unless `1 ≤ steps < 100`, the schedule is non-empty and every value is finite
    /// (`eps > 0`).
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String, reason: &str| {
            Err(Error::BadInput {
                op: "NsConfig::validate",
                what,
                reason: reason.into(),
            })
        };
        if self.steps == 0 || self.steps >= 100 {
            return bad(format!("steps = {}", self.steps), "must lie in [1, 100)");
        }
        if self.coeffs.is_empty() {
            return bad("coeffs = []".into(), "needs at least one (a, b, c)");
        }
        if self.coeffs.iter().flatten().any(|c| !c.is_finite()) {
            return bad(format!("coeffs = {:?}", self.coeffs), "must be finite");
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(format!("eps = {}", self.eps), "must be finite and positive");
        }
        Ok(())
    }

    /// The `(a, b, c)` of step `k`.
    pub fn coeffs_at(&self, k: usize) -> [f32; 3] {
        self.coeffs[k.min(self.coeffs.len() - 1)]
    }
}

/// `out = x·yᵀ` for `x: n×k`, `y: m×k` (row-major), `out: n×m`; `f32` dot products summed
/// with `k` ascending.
fn matmul_nt(x: &[f32], y: &[f32], n: usize, m: usize, k: usize, out: &mut [f32]) {
    let row = |i: usize, o: &mut [f32]| {
        let xi = &x[i * k..(i + 1) * k];
        for (j, o) in o.iter_mut().enumerate() {
            let yj = &y[j * k..(j + 1) * k];
            let mut s = 0.0f32;
            for (a, b) in xi.iter().zip(yj) {
                s += a * b;
            }
            *o = s;
        }
    };
    if n * m >= PAR_MIN_OUT {
        out.par_chunks_mut(m)
            .enumerate()
            .for_each(|(i, o)| row(i, o));
    } else {
        out.chunks_mut(m).enumerate().for_each(|(i, o)| row(i, o));
    }
}

/// `out = x·y` for `x: n×k`, `y: k×m` (row-major), `out: n×m`; each output row accumulates
/// `x[i,l]·y[l,:]` for `l` ascending, in `f32`.
fn matmul_nn(x: &[f32], y: &[f32], n: usize, m: usize, k: usize, out: &mut [f32]) {
    let row = |i: usize, o: &mut [f32]| {
        o.fill(0.0);
        for l in 0..k {
            let a = x[i * k + l];
            for (o, &b) in o.iter_mut().zip(&y[l * m..(l + 1) * m]) {
                *o += a * b;
            }
        }
    };
    if n * m >= PAR_MIN_OUT {
        out.par_chunks_mut(m)
            .enumerate()
            .for_each(|(i, o)| row(i, o));
    } else {
        out.chunks_mut(m).enumerate().for_each(|(i, o)| row(i, o));
    }
}

/// `rows × cols` row-major `x` transposed into `out` (`cols × rows`).
fn transpose(x: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    for i in 0..rows {
        for j in 0..cols {
            out[j * rows + i] = x[i * cols + j];
        }
    }
}

/// Orthogonalizes the `rows × cols` row-major matrix `x` in place by Newton–Schulz (module
/// table). A zero matrix stays zero.
///
/// # Panics
/// If `x.len() != rows·cols` or `cfg.coeffs` is empty.
#[track_caller]
pub fn orthogonalize(x: &mut [f32], rows: usize, cols: usize, cfg: &NsConfig) {
    assert_eq!(
        x.len(),
        rows * cols,
        "orthogonalize: {} elements for a {rows}×{cols} matrix",
        x.len()
    );
    assert!(!cfg.coeffs.is_empty(), "orthogonalize: empty coefficients");
    if x.is_empty() {
        return;
    }
    // Step 1: work on a `short × long` matrix.
    let transposed = rows > cols;
    let (s, l) = if transposed {
        (cols, rows)
    } else {
        (rows, cols)
    };
    let mut xw = vec![0.0f32; s * l];
    if transposed {
        transpose(x, rows, cols, &mut xw);
    } else {
        xw.copy_from_slice(x);
    }
    // Step 2: Frobenius norm (f64 sum in element order, rounded once), clamped below by eps.
    let norm = (xw.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>()).sqrt() as f32;
    let denom = norm.max(cfg.eps);
    for v in &mut xw {
        *v /= denom;
    }
    // Step 3.
    let mut p = vec![0.0f32; s * s];
    let mut pp = vec![0.0f32; s * s];
    let mut qx = vec![0.0f32; s * l];
    for k in 0..cfg.steps {
        let [a, b, c] = cfg.coeffs_at(k);
        matmul_nt(&xw, &xw, s, s, l, &mut p);
        matmul_nn(&p, &p, s, s, s, &mut pp);
        for (q, &p) in pp.iter_mut().zip(&p) {
            *q = b * p + c * *q;
        }
        matmul_nn(&pp, &xw, s, l, s, &mut qx);
        for (x, &q) in xw.iter_mut().zip(&qx) {
            *x = a * *x + q;
        }
    }
    // Step 4.
    if transposed {
        transpose(&xw, s, l, x);
    } else {
        x.copy_from_slice(&xw);
    }
}
