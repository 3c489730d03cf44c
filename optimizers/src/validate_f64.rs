//! The independent f64 references `ragged validate` compares the f32 optimizers with: Adam
//! (`torch.optim.AdamW`'s formula) and Muon (lerp momentum, Nesterov, Newton–Schulz, decoupled
//! decay), written from the formulas, not from the f32 code.

use ragged::{Error, Result};

use crate::{AdamWConfig, MuonConfig, NsConfig};

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
