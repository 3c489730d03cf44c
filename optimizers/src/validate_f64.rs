//! The independent f64 references `ragged validate` compares the f32 optimizers with: Adam
//! (`torch.optim.AdamW`'s formula), Muon (lerp momentum, Nesterov, Newton–Schulz, decoupled
//! decay) and blocked Shampoo (factors, eigendecomposition roots, grafting), written from the
//! formulas, not from the f32 code.

use faer::{Mat, Side};
use ragged::{Error, Result};
use rayon::prelude::*;

use crate::{AdamWConfig, Grafting, MuonConfig, NsConfig, ShampooConfig};

/// `Err` unless every gradient has `n` elements.
fn check_grads(op: &'static str, n: usize, grads: &[&[f32]]) -> Result<()> {
    match grads.iter().position(|g| g.len() != n) {
        None => Ok(()),
        Some(s) => Err(Error::BadInput {
            op,
            what: format!("gradient of step {s}: {} elements", grads[s].len()),
            reason: format!("the parameter has {n}"),
        }),
    }
}

/// AdamW in f64 on one tensor: `p0` stepped with every `grads[step]`; `decays` for whether the
/// parameter gets weight decay (applied before the update, as torch does).
pub fn adamw_f64(c: &AdamWConfig, decays: bool, p0: &[f32], grads: &[&[f32]]) -> Result<Vec<f64>> {
    check_grads("adamw_f64", p0.len(), grads)?;
    let mut p: Vec<f64> = p0.iter().map(|&x| f64::from(x)).collect();
    let (mut m, mut v) = (vec![0f64; p.len()], vec![0f64; p.len()]);
    for (step, g) in grads.iter().enumerate() {
        let s = step as i32 + 1;
        let (bc1, bc2) = (1.0 - c.beta1.powi(s), 1.0 - c.beta2.powi(s));
        for i in 0..p.len() {
            let g = f64::from(g[i]);
            if decays {
                p[i] *= 1.0 - c.lr * c.weight_decay;
            }
            m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * g;
            v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * g * g;
            p[i] -= c.lr / bc1 * m[i] / ((v[i] / bc2).sqrt() + c.eps);
        }
    }
    Ok(p)
}

/// Muon in f64 on the parameter `name` of `shape` (≥ 2-D: its matrices one by one, as
/// [`MuonConfig::matrices_of`] cuts them), `p0` stepped with every `grads[step]`. `Err` on a shape of fewer than two dimensions
/// or with a zero side, or buffers of other lengths.
pub fn muon_f64(
    c: &MuonConfig,
    name: &str,
    shape: &[usize],
    p0: &[f32],
    grads: &[&[f32]],
) -> Result<Vec<f64>> {
    const OP: &str = "muon_f64";
    let d = shape.len();
    if d < 2 || shape.contains(&0) || shape.iter().product::<usize>() != p0.len() {
        return Err(Error::InvalidShape {
            op: OP,
            shape: shape.to_vec(),
            reason: format!(
                "needs ≥ 2 non-zero dimensions holding {} elements",
                p0.len()
            ),
        });
    }
    check_grads(OP, p0.len(), grads)?;
    let (_, rows, cols) = c.matrices_of(name, shape)?;
    let scale = c.lr * c.lr_scale.factor(rows, cols);
    let mut p: Vec<f64> = p0.iter().map(|&x| f64::from(x)).collect();
    let mut buf = vec![0f64; p.len()];
    for g in grads {
        let g: Vec<f64> = g.iter().map(|&x| f64::from(x)).collect();
        for i in 0..p.len() {
            buf[i] += (1.0 - c.momentum) * (g[i] - buf[i]);
        }
        let u: Vec<f64> = if c.nesterov {
            (0..p.len())
                .map(|i| g[i] + c.momentum * (buf[i] - g[i]))
                .collect()
        } else {
            buf.clone()
        };
        for (mp, mu) in p.chunks_mut(rows * cols).zip(u.chunks(rows * cols)) {
            let o = newton_schulz_f64(mu, rows, cols, &c.ns)?;
            for (x, o) in mp.iter_mut().zip(o) {
                *x = *x * (1.0 - c.lr * c.weight_decay) - scale * o;
            }
        }
    }
    Ok(p)
}

/// Newton–Schulz in f64 on a row-major `rows × cols` matrix: normalize by
/// `norm_scale·‖X‖_F` (at least `eps`), work on the wide orientation, and iterate
/// `X ← a·X + (b·A + c·A·A)·X` with `A = X·Xᵀ`. `Err` unless `x` holds `rows·cols > 0`
/// elements.
pub fn newton_schulz_f64(x: &[f64], rows: usize, cols: usize, c: &NsConfig) -> Result<Vec<f64>> {
    if rows == 0 || cols == 0 || rows.checked_mul(cols) != Some(x.len()) {
        return Err(Error::InvalidShape {
            op: "newton_schulz_f64",
            shape: vec![rows, cols],
            reason: format!("{} elements", x.len()),
        });
    }
    let tall = rows > cols;
    let (s, l) = if tall { (cols, rows) } else { (rows, cols) };
    let at = |i: usize, j: usize| {
        if tall {
            x[j * cols + i]
        } else {
            x[i * cols + j]
        }
    };
    let mut a: Vec<f64> = (0..s * l).map(|k| at(k / l, k % l)).collect();
    let norm = (f64::from(c.norm_scale) * a.iter().map(|v| v * v).sum::<f64>().sqrt())
        .max(f64::from(c.eps));
    a.iter_mut().for_each(|v| *v /= norm);
    for k in 0..c.steps {
        let [ca, cb, cc] = c.coeffs_at(k).map(f64::from);
        let gram = product(&a, &a, s, l, true);
        let gram2 = product(&gram, &gram, s, s, false);
        let poly: Vec<f64> = gram
            .iter()
            .zip(&gram2)
            .map(|(g, g2)| cb * g + cc * g2)
            .collect();
        let mut next = product(&poly, &a, s, s, false);
        next.iter_mut().zip(&a).for_each(|(n, x)| *n += ca * x);
        a = next;
    }
    Ok((0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            if tall {
                a[j * l + i]
            } else {
                a[i * l + j]
            }
        })
        .collect())
}

/// `x·yᵀ` (`transpose_y`: `x: n×k`, `y: n×k`, result `n×n`) or `x·y` (`x: n×k`, `y: k×?`,
/// with `y.len() / k` columns), row-major, summed with `k` ascending.
fn product(x: &[f64], y: &[f64], n: usize, k: usize, transpose_y: bool) -> Vec<f64> {
    if transpose_y {
        let mut out = vec![0f64; n * n];
        for i in 0..n {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|q| x[i * k + q] * y[j * k + q]).sum();
            }
        }
        out
    } else {
        let m = y.len() / k;
        let mut out = vec![0f64; n * m];
        for i in 0..n {
            for q in 0..k {
                let w = x[i * k + q];
                for j in 0..m {
                    out[i * m + j] += w * y[q * m + j];
                }
            }
        }
        out
    }
}

/// Blocked Shampoo in f64 on one tensor of `shape`, `p0` stepped with every `grads[step]`,
/// from the formulas of `shampoo.rs`' module doc (its blocks, and steps 1–9 in fb's order), not
/// from its `f32` code: the tensor viewed as `numel / shape[-1]` rows, each block's factors
/// `L = Σ β₂·L + w·G·Gᵀ` and `R` likewise, inverse roots `(F / bc₂ + εI)^(−e)` from faer's
/// `f64` eigendecomposition with fb's shift, the filtered gradient, grafting and decoupled
/// decay. `Err` on a config that does not validate, buffers of other lengths, or a root whose
/// eigendecomposition fails.
pub fn shampoo_f64(
    c: &ShampooConfig,
    shape: &[usize],
    p0: &[f32],
    grads: &[&[f32]],
) -> Result<Vec<f64>> {
    const OP: &str = "shampoo_f64";
    c.validate()?;
    if shape.iter().product::<usize>() != p0.len() {
        return Err(Error::InvalidShape {
            op: OP,
            shape: shape.to_vec(),
            reason: format!("{} elements", p0.len()),
        });
    }
    check_grads(OP, p0.len(), grads)?;
    let cols = shape.last().copied().unwrap_or(1);
    let mut blocks = ShampooBlock::cut(p0.len().checked_div(cols).unwrap_or(0), cols, c);
    let mut p: Vec<f64> = p0.iter().map(|&x| f64::from(x)).collect();
    let (mut m, mut v) = (vec![0f64; p.len()], vec![0f64; p.len()]);
    let start = c
        .start_preconditioning_step
        .unwrap_or(c.precondition_frequency);
    for (t, g) in (1u64..).zip(grads) {
        let g: Vec<f64> = g.iter().map(|&x| f64::from(x)).collect();
        let (b2, w) = if c.beta2 < 1.0 {
            (c.beta2, 1.0 - c.beta2)
        } else {
            (1.0, 1.0)
        };
        let bc2 = if c.use_bias_correction && c.beta2 < 1.0 {
            1.0 - c.beta2.powi(t as i32)
        } else {
            1.0
        };
        let roots_due = t == start || (t > start && t.is_multiple_of(c.precondition_frequency));
        blocks.par_iter_mut().try_for_each(|b| {
            b.update_factors(&g, cols, b2, w);
            if roots_due {
                b.update_roots(c, bc2)?;
            }
            Ok::<_, Error>(())
        })?;
        let (gbar, pg) = filtered_and_grafted(c, t, &g, &mut m, &mut v);
        let mut dir = pg.clone();
        if t >= start || c.grafting == Grafting::None {
            let directions: Vec<Vec<f64>> = blocks
                .par_iter()
                .map(|b| b.precondition(&gbar, &pg, cols, c.grafting))
                .collect();
            for (b, x) in blocks.iter().zip(directions) {
                b.scatter(&x, cols, &mut dir);
            }
        }
        for (p, d) in p.iter_mut().zip(&dir) {
            *p -= c.lr * (d + c.weight_decay * *p);
        }
    }
    Ok(p)
}

/// Steps 3, 5 and 6 of the step: `v`, the filtered gradient `ḡ` and the grafting direction
/// `P_g`, element by element.
fn filtered_and_grafted(
    c: &ShampooConfig,
    t: u64,
    g: &[f64],
    m: &mut [f64],
    v: &mut [f64],
) -> (Vec<f64>, Vec<f64>) {
    let t = t as i32;
    let mut gbar = vec![0f64; g.len()];
    let mut pg = vec![0f64; g.len()];
    for i in 0..g.len() {
        m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * g[i];
        gbar[i] = match (c.beta1 == 0.0, c.use_bias_correction) {
            (true, _) => g[i],
            (false, true) => m[i] / (1.0 - c.beta1.powi(t)),
            (false, false) => m[i],
        };
        // (AdaGrad: v + g²; RMSProp and Adam: β₂ᵍ·v + (1 − β₂ᵍ)·g², Adam bias-corrected.)
        let (beta2, eps, bias) = match c.grafting {
            Grafting::None | Grafting::Sgd => {
                pg[i] = gbar[i];
                continue;
            }
            Grafting::AdaGrad { eps } => {
                v[i] += g[i] * g[i];
                (1.0, eps, false)
            }
            Grafting::RmsProp { beta2, eps } | Grafting::Adam { beta2, eps } => {
                v[i] = beta2 * v[i] + (1.0 - beta2) * g[i] * g[i];
                (beta2, eps, matches!(c.grafting, Grafting::Adam { .. }))
            }
        };
        let bc = if bias { 1.0 - beta2.powi(t) } else { 1.0 };
        pg[i] = gbar[i] / ((v[i] / bc).sqrt() + eps);
    }
    (gbar, pg)
}

/// One Shampoo block of the f64 reference: rows `r0..r0 + r`, columns `c0..c0 + c`, its
/// factors (empty where that side is 1) and their roots (the identity until computed).
struct ShampooBlock {
    r0: usize,
    r: usize,
    c0: usize,
    c: usize,
    left: Vec<f64>,
    right: Vec<f64>,
    left_root: Vec<f64>,
    right_root: Vec<f64>,
}

impl ShampooBlock {
    /// The blocks of a `rows × cols` matrix: `d` rows by `d` columns, the last ones narrower.
    fn cut(rows: usize, cols: usize, c: &ShampooConfig) -> Vec<ShampooBlock> {
        let d = c.max_preconditioner_dim;
        let eye = |n: usize| -> Vec<f64> {
            (0..n * n)
                .map(|k| if k % (n + 1) == 0 { 1.0 } else { 0.0 })
                .collect()
        };
        let side = |n: usize| if n > 1 { n } else { 0 };
        let mut out = Vec::new();
        for r0 in (0..rows).step_by(d) {
            for c0 in (0..cols).step_by(d) {
                let (r, cc) = (d.min(rows - r0), d.min(cols - c0));
                let (l, rr) = (side(r), side(cc));
                out.push(ShampooBlock {
                    r0,
                    r,
                    c0,
                    c: cc,
                    left: vec![0.0; l * l],
                    right: vec![0.0; rr * rr],
                    left_root: eye(l),
                    right_root: eye(rr),
                });
            }
        }
        out
    }

    /// The block's elements of a whole tensor `x` (`cols` wide), row-major.
    fn gather(&self, x: &[f64], cols: usize) -> Vec<f64> {
        (0..self.r)
            .flat_map(|i| {
                let at = (self.r0 + i) * cols + self.c0;
                x[at..at + self.c].iter().copied()
            })
            .collect()
    }

    /// Step 2: `L ← β₂·L + w·G·Gᵀ`, `R ← β₂·R + w·Gᵀ·G`.
    fn update_factors(&mut self, g: &[f64], cols: usize, b2: f64, w: f64) {
        let gb = self.gather(g, cols);
        let (r, c) = (self.r, self.c);
        if !self.left.is_empty() {
            let ggt = product(&gb, &gb, r, c, true);
            blend(&mut self.left, &ggt, b2, w);
        }
        if !self.right.is_empty() {
            let gt = transpose(&gb, r, c);
            let gtg = product(&gt, &gt, c, r, true);
            blend(&mut self.right, &gtg, b2, w);
        }
    }

    /// Step 4: both roots, with the exponent of the block's order.
    fn update_roots(&mut self, c: &ShampooConfig, bc2: f64) -> Result<()> {
        let order = usize::from(!self.left.is_empty()) + usize::from(!self.right.is_empty());
        let e = c
            .inverse_exponent_override
            .unwrap_or(1.0 / (2 * order.max(1)) as f64);
        if !self.left.is_empty() {
            self.left_root = root_f64(&self.left, self.r, bc2, c.epsilon, e)?;
        }
        if !self.right.is_empty() {
            self.right_root = root_f64(&self.right, self.c, bc2, c.epsilon, e)?;
        }
        Ok(())
    }

    /// Step 7 for this block: `P_s = L^(−e)·Ḡ·R^(−e)`, grafted to `P_g`'s norm unless there is
    /// no grafting (row-major, the block's shape).
    fn precondition(&self, gbar: &[f64], pg: &[f64], cols: usize, graft: Grafting) -> Vec<f64> {
        let (r, c) = (self.r, self.c);
        let mut x = self.gather(gbar, cols);
        if !self.left.is_empty() {
            x = product(&self.left_root, &x, r, r, false);
        }
        if !self.right.is_empty() {
            x = product(&x, &self.right_root, r, c, false);
        }
        if graft != Grafting::None {
            let norm = |y: &[f64]| y.iter().map(|v| v * v).sum::<f64>().sqrt();
            let scale = norm(&self.gather(pg, cols)) / (norm(&x) + 1e-16);
            x.iter_mut().for_each(|v| *v *= scale);
        }
        x
    }

    /// Writes the block's elements `x` (row-major) into the whole tensor `dir` (`cols` wide).
    fn scatter(&self, x: &[f64], cols: usize, dir: &mut [f64]) {
        for (i, x) in x.chunks_exact(self.c).enumerate() {
            let at = (self.r0 + i) * cols + self.c0;
            dir[at..at + self.c].copy_from_slice(x);
        }
    }
}

/// `f ← b2·f + w·x`.
fn blend(f: &mut [f64], x: &[f64], b2: f64, w: f64) {
    f.iter_mut().zip(x).for_each(|(f, x)| *f = b2 * *f + w * x);
}

/// The `c × r` transpose of a row-major `r × c` matrix.
fn transpose(x: &[f64], r: usize, c: usize) -> Vec<f64> {
    (0..c * r).map(|k| x[(k % r) * c + k / r]).collect()
}

/// `(F / bc₂ + εI)^(−e)` of the symmetric `n × n` factor `f`, from faer's `f64`
/// eigendecomposition `Q·diag(λ)·Qᵀ`, with fb's shift `λ ← λ − λ_min + ε` when `λ_min < ε`.
fn root_f64(f: &[f64], n: usize, bc2: f64, eps: f64, e: f64) -> Result<Vec<f64>> {
    let a = Mat::<f64>::from_fn(n, n, |i, j| {
        f[i * n + j] / bc2 + if i == j { eps } else { 0.0 }
    });
    let evd = a.self_adjoint_eigen(Side::Lower).map_err(|err| {
        Error::Msg(format!(
            "shampoo_f64: the {n}×{n} factor's eigendecomposition failed: {err:?}"
        ))
    })?;
    let (s, u) = (evd.S(), evd.U());
    let lmin = (0..n).map(|k| s[k]).fold(f64::INFINITY, f64::min);
    let shift = if lmin < eps { eps - lmin } else { 0.0 };
    let d: Vec<f64> = (0..n).map(|k| (s[k] + shift).powf(-e)).collect();
    // Q·diag(d) times Qᵀ.
    let qd: Vec<f64> = (0..n * n).map(|k| u[(k / n, k % n)] * d[k % n]).collect();
    let qt: Vec<f64> = (0..n * n).map(|k| u[(k % n, k / n)]).collect();
    Ok(product(&qd, &qt, n, n, false))
}
