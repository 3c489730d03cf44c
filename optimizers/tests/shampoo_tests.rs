//! Shampoo: inverse roots and whole steps against an independent f64 reference (Jacobi
//! eigendecomposition written here), sharded ≡ unsharded bitwise over world sizes and uneven
//! shapes, pure grafting before the start step, the root schedule, grafting norms, state round
//! trips, refused configs, states and inputs.

use std::collections::BTreeMap;

use ragged::comm::SingleRank;
use ragged::model::TensorSpec;
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::PlanOptions;
use ragged::storage::Storage;
use ragged::{AtomicBlock, Error};
use ragged_optimizers::common::{ema_sq_elem, lerp_elem};
use ragged_optimizers::shampoo::Block;
use ragged_optimizers::{
    inverse_root, inverse_root_f64, Grafting, Shampoo, ShampooConfig, ShampooState,
};

mod harness;
use harness::{
    bits, data, gather, jacobi, loud_shampoo, numels, padding, planned_shards, planned_shards_by,
    scatter, specs, whole_shard_by, Rng,
};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// The unsharded reference shard, with Shampoo's blocks.
fn whole_shard(opt: &Shampoo, specs: &[TensorSpec]) -> LocalShard {
    whole_shard_by(specs, &|t| opt.atomic_block(&t.name, &t.shape))
}

/// One rank's run of `grads.len()` steps, with a finite non-zero gradient in the padding;
/// asserts padding stays `+0.0` in params, `m` and `v`.
fn run_rank(
    opt: &Shampoo,
    shard: &LocalShard,
    p0: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
) -> (Vec<f32>, ShampooState) {
    let mut params = scatter(shard, p0);
    let mut state = opt.init(shard).unwrap();
    for g in grads {
        let mut local_g = scatter(shard, g);
        for i in padding(shard) {
            local_g[i] = 1.0;
        }
        opt.step_slices(&mut state, shard, &mut params, &local_g, &SingleRank)
            .unwrap();
        for i in padding(shard) {
            assert_eq!(params[i].to_bits(), 0, "padding param {i}");
            assert_eq!(host(&state.m)[i].to_bits(), 0, "padding m {i}");
            if !state.v.is_empty() {
                assert_eq!(host(&state.v)[i].to_bits(), 0, "padding v {i}");
            }
        }
    }
    (params, state)
}

/// Each local block's (factors, roots) bits keyed by (parameter, first element, first column).
type Keyed = BTreeMap<(usize, usize), (Vec<u32>, Vec<u32>)>;

fn keyed_factors(opt: &Shampoo, shard: &LocalShard, state: &ShampooState, out: &mut Keyed) {
    let (blocks, _) = opt.blocks(shard).unwrap();
    for b in blocks {
        let piece = shard
            .pieces
            .iter()
            .find(|p| (p.offset..p.offset + p.range.len()).contains(&b.at))
            .unwrap();
        let elem = piece.range.start + (b.at - piece.offset);
        let s = b.factor_at..b.factor_at + b.factor_len();
        let old = out.insert(
            (piece.param, elem),
            (
                bits(&host(&state.factors)[s.clone()]),
                bits(&host(&state.roots)[s]),
            ),
        );
        assert!(old.is_none(), "block ({}, {elem}) twice", piece.param);
    }
}

/// fb's defaults (β₂ = 1, ε = 1e-12, roots every step from step 1) with AdaGrad grafting and
/// small blocks.
fn adagrad_defaults() -> ShampooConfig {
    ShampooConfig {
        max_preconditioner_dim: 4,
        grafting: Grafting::ADAGRAD,
        ..ShampooConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// 1. An independent f64 reference
// ---------------------------------------------------------------------------------------------

/// `(A + εI)^(−e)` in f64 with fb's shift: `λ ← λ − λ_min + ε` when `λ_min < ε`.
fn root_f64(a: &[f64], n: usize, eps: f64, e: f64) -> Vec<f64> {
    let mut m = a.to_vec();
    for i in 0..n {
        m[i * n + i] += eps;
    }
    let (lambda, v) = jacobi(m, n);
    let lmin = lambda.iter().copied().fold(f64::INFINITY, f64::min);
    let d: Vec<f64> = lambda
        .iter()
        .map(|&l| if lmin < eps { l - lmin + eps } else { l }.powf(-e))
        .collect();
    let mut x = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..n {
            x[i * n + j] = (0..n).map(|k| v[i * n + k] * d[k] * v[j * n + k]).sum();
        }
    }
    x
}

fn max_abs(x: &[f64]) -> f64 {
    x.iter().fold(0.0, |a, &b| a.max(b.abs()))
}

/// Max entry error of the f32 root relative to the largest entry of the f64 root.
fn root_error(got: &[f32], want: &[f64]) -> f64 {
    let err = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (f64::from(g) - w).abs())
        .fold(0.0, f64::max);
    err / max_abs(want)
}

/// `A = B·Bᵀ/k` for a random `n × k` `B`: symmetric positive semi-definite, rank `min(n, k)`.
fn spd(rng: &mut Rng, n: usize, k: usize) -> Vec<f32> {
    let b = rng.units(n * k);
    let mut a = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|q| f64::from(b[i * k + q]) * f64::from(b[j * k + q]))
                .sum();
            a[i * n + j] = (s / k as f64) as f32;
        }
    }
    // Exactly symmetric, as the optimizer's factors are.
    for i in 0..n {
        for j in 0..i {
            a[i * n + j] = a[j * n + i];
        }
    }
    a
}

/// The f32 eigendecomposition has eigenvalue errors of about `n·2⁻²⁴·λ_max`; the root
/// `λ^(−e)` turns a relative error `δ` of `λ` into `e·δ`, largest at `λ_min`, so the entry
/// error relative to the largest entry is about `e·n·6e-8·κ` with `κ = λ_max / λ_min`. The
/// full-rank cases below have `κ ≤ ~10³` (`k = 2n + 4` columns; ε bounds the rank-deficient
/// ones at `κ ≲ 10³`), giving `≲ 1e-4` for `n = 16`; observed worst 3.6e-5 (seed 17; 9e-5 with nalgebra's eigendecomposition before faer's). The
/// tolerance `5e-4` still fails for a wrong exponent, a missing ε or shift, or a transposed
/// `Q` (errors `> 1e-1`).
const ROOT_RTOL: f64 = 5e-4;

#[test]
fn inverse_root_matches_an_f64_jacobi_reference() {
    let mut rng = Rng::new(17);
    let mut worst: f64 = 0.0;
    for n in [1usize, 2, 3, 5, 8, 16] {
        for (k, eps) in [(2 * n + 4, 1e-12), (1, 1e-2), (n.div_ceil(2), 1e-2)] {
            for e in [0.25, 0.5, 1.0 / 3.0] {
                for bc in [None, Some(0.4f32)] {
                    let a = spd(&mut rng, n, k);
                    let got = inverse_root(&a, n, bc, eps, e).unwrap();
                    let a64: Vec<f64> = a
                        .iter()
                        .map(|&x| match bc {
                            Some(bc) => f64::from(x / bc),
                            None => f64::from(x),
                        })
                        .collect();
                    let want = root_f64(&a64, n, eps, e);
                    let err = root_error(&got, &want);
                    worst = worst.max(err);
                    assert!(
                        err < ROOT_RTOL,
                        "n {n}, rank {k}, eps {eps}, e {e}, bc {bc:?}: relative error {err}"
                    );
                    for i in 0..n {
                        for j in 0..n {
                            assert_eq!(got[i * n + j].to_bits(), got[j * n + i].to_bits());
                        }
                    }
                }
            }
        }
    }
    eprintln!("inverse_root: worst relative error {worst:e}");
}

/// The f64 retry path alone: only the final rounding to f32 (relative `2⁻²⁴`) and f64
/// eigenvector errors (`~1e-16·κ`) separate it from the reference, so `1e-6` relative.
#[test]
fn inverse_root_f64_retry_path_matches_the_reference_to_f32_rounding() {
    let mut rng = Rng::new(31);
    for n in [1usize, 2, 5, 16] {
        for (k, eps) in [(2 * n + 4, 1e-12), (1, 1e-2)] {
            for bc in [None, Some(0.4f32)] {
                let a = spd(&mut rng, n, k);
                let got = inverse_root_f64(&a, n, bc, eps, 0.25).unwrap();
                let a64: Vec<f64> = a
                    .iter()
                    .map(|&x| f64::from(bc.map_or(x, |bc| x / bc)))
                    .collect();
                let err = root_error(&got, &root_f64(&a64, n, eps, 0.25));
                assert!(
                    err < 1e-6,
                    "n {n}, rank {k}, bc {bc:?}: relative error {err}"
                );
            }
        }
    }
}

#[test]
fn inverse_root_shifts_an_indefinite_spectrum_up_to_epsilon() {
    // Rounding can make a factor slightly indefinite; fb then shifts every eigenvalue by
    // `ε − λ_min`. A random symmetric matrix exercises the shift at full strength (without
    // it the root of a negative eigenvalue is NaN). ε = 0.1 keeps κ ≲ 10², so the f32
    // tolerance argument of `ROOT_RTOL` holds.
    let mut rng = Rng::new(29);
    for n in [2usize, 3, 6, 12] {
        let mut a = rng.units(n * n);
        for i in 0..n {
            for j in 0..i {
                a[i * n + j] = a[j * n + i];
            }
        }
        a[0] = -2.0; // certainly indefinite
        for e in [0.25, 0.5] {
            let got = inverse_root(&a, n, None, 0.1, e).unwrap();
            let a64: Vec<f64> = a.iter().map(|&x| f64::from(x)).collect();
            let err = root_error(&got, &root_f64(&a64, n, 0.1, e));
            assert!(err < ROOT_RTOL, "n {n}, e {e}: relative error {err}");
        }
    }
}

#[test]
fn inverse_root_of_zero_is_epsilon_to_the_minus_e_and_rejects_non_finite() {
    let n = 5;
    let x = inverse_root(&vec![0.0; n * n], n, None, 1e-4, 0.25).unwrap();
    for i in 0..n {
        for j in 0..n {
            let want = if i == j { 10.0 } else { 0.0 };
            assert!(
                (x[i * n + j] - want).abs() < 1e-4,
                "{i},{j}: {}",
                x[i * n + j]
            );
        }
    }
    let mut a = vec![0.0f32; 4];
    a[3] = f32::NAN;
    assert!(inverse_root(&a, 2, None, 1e-4, 0.25).is_none());
    a[3] = f32::INFINITY;
    assert!(inverse_root(&a, 2, None, 1e-4, 0.25).is_none());
}

/// One parameter's blocks, from the formulas of the module doc: `(first row, rows, first
/// column, cols)`.
fn ref_blocks(total_rows: usize, cols: usize, d: usize) -> Vec<(usize, usize, usize, usize)> {
    let mut out = Vec::new();
    let mut r0 = 0;
    while r0 < total_rows {
        let r = d.min(total_rows - r0);
        let mut c0 = 0;
        while c0 < cols {
            let c = d.min(cols - c0);
            out.push((r0, r, c0, c));
            c0 += c;
        }
        r0 += r;
    }
    out
}

/// The whole Shampoo step in f64 for one parameter (Adam/AdaGrad/SGD/no grafting), written
/// from the formulas, with Jacobi roots.
struct RefShampoo {
    c: ShampooConfig,
    cols: usize,
    blocks: Vec<(usize, usize, usize, usize)>,
    t: u64,
    m: Vec<f64>,
    v: Vec<f64>,
    /// Per block: (L, R, L root, R root); empty when the factor is absent.
    fac: Vec<[Vec<f64>; 4]>,
}

impl RefShampoo {
    fn new(c: ShampooConfig, shape: &[usize]) -> Self {
        let cols = shape.last().copied().unwrap_or(1);
        let numel: usize = shape.iter().product();
        let rows = numel / cols;
        let blocks = ref_blocks(rows, cols, c.max_preconditioner_dim);
        let eye = |n: usize| {
            let mut x = vec![0.0; n * n];
            for i in 0..n {
                x[i * n + i] = 1.0;
            }
            x
        };
        let fac = blocks
            .iter()
            .map(|&(_, r, _, c)| {
                let (l, rr) = (if r > 1 { r } else { 0 }, if c > 1 { c } else { 0 });
                [vec![0.0; l * l], vec![0.0; rr * rr], eye(l), eye(rr)]
            })
            .collect();
        RefShampoo {
            c,
            cols,
            blocks,
            t: 0,
            m: vec![0.0; numel],
            v: vec![0.0; numel],
            fac,
        }
    }

    fn step(&mut self, p: &mut [f64], g: &[f32]) {
        let c = self.c;
        self.t += 1;
        let t = self.t as i32;
        let g: Vec<f64> = g.iter().map(|&x| f64::from(x)).collect();
        let start = c
            .start_preconditioning_step
            .unwrap_or(c.precondition_frequency);
        let roots_now =
            self.t == start || (self.t > start && self.t.is_multiple_of(c.precondition_frequency));
        let mut gbar = vec![0.0; g.len()];
        let mut pg = vec![0.0; g.len()];
        for i in 0..g.len() {
            self.m[i] = c.beta1 * self.m[i] + (1.0 - c.beta1) * g[i];
            gbar[i] = if c.beta1 == 0.0 {
                g[i]
            } else if c.use_bias_correction {
                self.m[i] / (1.0 - c.beta1.powi(t))
            } else {
                self.m[i]
            };
            pg[i] = match c.grafting {
                Grafting::None | Grafting::Sgd => gbar[i],
                Grafting::AdaGrad { eps } => {
                    self.v[i] += g[i] * g[i];
                    gbar[i] / (self.v[i].sqrt() + eps)
                }
                Grafting::RmsProp { beta2, eps } => {
                    self.v[i] = beta2 * self.v[i] + (1.0 - beta2) * g[i] * g[i];
                    gbar[i] / (self.v[i].sqrt() + eps)
                }
                Grafting::Adam { beta2, eps } => {
                    self.v[i] = beta2 * self.v[i] + (1.0 - beta2) * g[i] * g[i];
                    gbar[i] / ((self.v[i] / (1.0 - beta2.powi(t))).sqrt() + eps)
                }
            };
        }
        let cols = self.cols;
        let (b2, w) = if c.beta2 < 1.0 {
            (c.beta2, 1.0 - c.beta2)
        } else {
            (1.0, 1.0)
        };
        let bc2 = if c.use_bias_correction && c.beta2 < 1.0 {
            1.0 - c.beta2.powi(t)
        } else {
            1.0
        };
        let mut dir = vec![0.0; g.len()];
        for (bi, &(r0, r, c0, cc)) in self.blocks.iter().enumerate() {
            let at = |i: usize, j: usize| (r0 + i) * cols + c0 + j;
            let order = usize::from(r > 1) + usize::from(cc > 1);
            let e = c
                .inverse_exponent_override
                .unwrap_or(1.0 / (2 * order.max(1)) as f64);
            let f = &mut self.fac[bi];
            if r > 1 {
                for i in 0..r {
                    for j in 0..r {
                        let s: f64 = (0..cc).map(|k| g[at(i, k)] * g[at(j, k)]).sum();
                        f[0][i * r + j] = b2 * f[0][i * r + j] + w * s;
                    }
                }
            }
            if cc > 1 {
                for i in 0..cc {
                    for j in 0..cc {
                        let s: f64 = (0..r).map(|k| g[at(k, i)] * g[at(k, j)]).sum();
                        f[1][i * cc + j] = b2 * f[1][i * cc + j] + w * s;
                    }
                }
            }
            if roots_now {
                for (k, n) in [(0, r), (1, cc)] {
                    if n > 1 {
                        let a: Vec<f64> = f[k].iter().map(|x| x / bc2).collect();
                        f[k + 2] = root_f64(&a, n, c.epsilon, e);
                    }
                }
            }
            let block_pg: Vec<f64> = (0..r)
                .flat_map(|i| (0..cc).map(move |j| (i, j)))
                .map(|(i, j)| pg[at(i, j)])
                .collect();
            let out: Vec<f64> = if self.t < start && c.grafting != Grafting::None {
                block_pg
            } else {
                // L^(-e)·Ḡ·R^(-e).
                let mut x: Vec<f64> = (0..r)
                    .flat_map(|i| (0..cc).map(move |j| (i, j)))
                    .map(|(i, j)| gbar[at(i, j)])
                    .collect();
                if r > 1 {
                    let l = &f[2];
                    x = (0..r * cc)
                        .map(|ij| {
                            (0..r)
                                .map(|k| l[(ij / cc) * r + k] * x[k * cc + ij % cc])
                                .sum()
                        })
                        .collect();
                }
                if cc > 1 {
                    let rr = &f[3];
                    x = (0..r * cc)
                        .map(|ij| {
                            (0..cc)
                                .map(|k| x[(ij / cc) * cc + k] * rr[k * cc + ij % cc])
                                .sum()
                        })
                        .collect();
                }
                if c.grafting != Grafting::None {
                    let n = |y: &[f64]| y.iter().map(|v| v * v).sum::<f64>().sqrt();
                    let s = n(&block_pg) / (n(&x) + 1e-16);
                    x.iter_mut().for_each(|v| *v *= s);
                }
                x
            };
            for i in 0..r {
                for j in 0..cc {
                    dir[at(i, j)] = out[i * cc + j];
                }
            }
        }
        for i in 0..p.len() {
            p[i] -= c.lr * (dir[i] + c.weight_decay * p[i]);
        }
    }
}

/// Whole steps against the f64 reference. Sources of difference: f32 element arithmetic
/// (relative `~1e-7` per operation), f32 factors and the f32 eigendecomposition (root errors
/// `≲ e·n·6e-8·κ`; with `ε = 1e-3` and unit gradients `κ ≲ 10³`, so `≲ 1e-5`), all of which
/// feed the next steps. The displacement `p − p₀` after 6 steps is compared entry-wise,
/// relative to its largest entry: observed 2e-6–7e-6 with grafting, 2.4e-5 without (no
/// normalisation of the root errors); tolerance `1e-4`, which a wrong operation
/// order, a missing bias correction, grafting or decay term, or a wrong exponent exceed by
/// orders of magnitude (they change the update by `≳ 1e-2` relative).
const STEP_RTOL: f64 = 1e-4;

#[test]
fn shampoo_steps_match_an_independent_f64_reference() {
    let cases: [(&str, ShampooConfig); 4] = [
        ("loud (Adam grafting, β₂ < 1, wd)", loud_shampoo()),
        (
            "AdaGrad grafting, β₂ = 1, roots every step",
            ShampooConfig {
                epsilon: 1e-3,
                lr: 0.05,
                beta2: 1.0,
                grafting: Grafting::ADAGRAD,
                ..loud_shampoo()
            },
        ),
        (
            "no grafting, no bias correction, exponent override, start 3",
            ShampooConfig {
                grafting: Grafting::None,
                use_bias_correction: false,
                inverse_exponent_override: Some(0.5),
                start_preconditioning_step: Some(3),
                lr: 0.001,
                ..loud_shampoo()
            },
        ),
        (
            "RMSProp grafting, β₁ = 0",
            ShampooConfig {
                beta1: 0.0,
                grafting: Grafting::RMSPROP,
                ..loud_shampoo()
            },
        ),
    ];
    let shapes: [&[usize]; 4] = [&[6, 5], &[7], &[9, 1], &[2, 3, 5]];
    for (name, c) in cases {
        let opt = Shampoo::new(c).unwrap();
        for shape in shapes {
            let spec = specs(&[("w", shape)]);
            let (p0, grads) = data(&spec, 6, 23);
            let shard = whole_shard(&opt, &spec);
            let (got, _) = run_rank(&opt, &shard, &p0, &grads);
            let mut reference = RefShampoo::new(c, shape);
            let mut want: Vec<f64> = p0[0].iter().map(|&x| f64::from(x)).collect();
            for g in &grads {
                reference.step(&mut want, &g[0]);
            }
            let d_want: Vec<f64> = want
                .iter()
                .zip(&p0[0])
                .map(|(w, &p)| w - f64::from(p))
                .collect();
            let scale = max_abs(&d_want);
            assert!(scale > 0.0, "{name} {shape:?}: nothing moved");
            let err = got
                .iter()
                .zip(&want)
                .map(|(&g, &w)| (f64::from(g) - w).abs())
                .fold(0.0, f64::max)
                / scale;
            eprintln!("{name} {shape:?}: relative error {err:e}");
            assert!(err < STEP_RTOL, "{name} {shape:?}: relative error {err}");
        }
    }
}

/// `validate`'s f64 Shampoo (`validate_f64::shampoo_f64`: faer's `f64` eigendecomposition,
/// block loops of its own) and this file's (Jacobi roots, written separately) are two
/// implementations of the same formulas: they agree to `f64` rounding, amplified at most by
/// the roots' conditioning (`ε = 1e-3`), on every configuration and shape of the test above,
/// and a 0-D tensor. Checked: `shampoo_f64` with its root exponent 5 % off, without the
/// filtered gradient's bias correction, or with its grafting scale 0.1 % off fails this.
#[test]
fn validates_f64_shampoo_equals_this_files_f64_shampoo() {
    use ragged_optimizers::validate_f64::shampoo_f64;
    let configs = [
        loud_shampoo(),
        ShampooConfig {
            epsilon: 1e-3,
            beta2: 1.0,
            grafting: Grafting::ADAGRAD,
            ..loud_shampoo()
        },
        ShampooConfig {
            grafting: Grafting::None,
            use_bias_correction: false,
            inverse_exponent_override: Some(0.5),
            start_preconditioning_step: Some(3),
            ..loud_shampoo()
        },
        ShampooConfig {
            beta1: 0.0,
            grafting: Grafting::RMSPROP,
            ..loud_shampoo()
        },
    ];
    let shapes: [&[usize]; 5] = [&[6, 5], &[7], &[9, 1], &[2, 3, 5], &[]];
    for c in configs {
        for shape in shapes {
            let spec = specs(&[("w", shape)]);
            let (p0, grads) = data(&spec, 6, 29);
            let g: Vec<&[f32]> = grads.iter().map(|g| g[0].as_slice()).collect();
            let got = shampoo_f64(&c, shape, &p0[0], &g).unwrap();
            let mut reference = RefShampoo::new(c, shape);
            let mut want: Vec<f64> = p0[0].iter().map(|&x| f64::from(x)).collect();
            for g in &grads {
                reference.step(&mut want, &g[0]);
            }
            let moved = want
                .iter()
                .zip(&p0[0])
                .map(|(w, &p)| (w - f64::from(p)).abs())
                .fold(0.0, f64::max);
            let err = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs())
                .fold(0.0, f64::max);
            assert!(moved > 0.0, "{c:?} {shape:?}: nothing moved");
            assert!(err <= 1e-9 * moved, "{c:?} {shape:?}: {err:e} of {moved:e}");
        }
    }
    // Bad input is an error, not a panic.
    let c = loud_shampoo();
    let g = [0.5f32; 6];
    assert!(shampoo_f64(&c, &[2, 3], &[1.0; 5], &[&g]).is_err(), "shape");
    assert!(
        shampoo_f64(&c, &[2, 3], &[1.0; 6], &[&g[..5]]).is_err(),
        "gradient"
    );
    let bad = ShampooConfig { lr: -1.0, ..c };
    assert!(
        shampoo_f64(&bad, &[2, 3], &[1.0; 6], &[&g]).is_err(),
        "config"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Blocks and sharding
// ---------------------------------------------------------------------------------------------

#[test]
fn atomic_block_is_max_preconditioner_dim_rows() {
    let opt = Shampoo::new(ShampooConfig::default()).unwrap();
    assert_eq!(opt.atomic_block("w", &[4096, 512]), AtomicBlock::Rows(1024));
    assert_eq!(opt.atomic_block("b", &[31]), AtomicBlock::Rows(1024));
    let small = Shampoo::new(adagrad_defaults()).unwrap();
    assert_eq!(small.atomic_block("w", &[3, 17, 6]), AtomicBlock::Rows(4));
}

#[test]
fn blocks_cut_rows_and_columns_at_d_and_squeeze_size_one_sides() {
    let opt = Shampoo::new(loud_shampoo()).unwrap();
    let spec = specs(&[("w", &[6, 5]), ("b", &[5]), ("one", &[1])]);
    let shard = whole_shard(&opt, &spec);
    let (blocks, len) = opt.blocks(&shard).unwrap();
    let b = |at, stride, rows, cols, factor_at| Block {
        at,
        stride,
        rows,
        cols,
        factor_at,
    };
    let want = vec![
        b(0, 5, 4, 4, 0),   // L 4×4, R 4×4
        b(4, 5, 4, 1, 32),  // L only
        b(20, 5, 2, 4, 48), // L 2×2, R 4×4
        b(24, 5, 2, 1, 68), // L only
        b(30, 5, 1, 4, 72), // 1-D: R only
        b(34, 5, 1, 1, 88), // 1×1: no factor
        b(35, 1, 1, 1, 88), // 0 factors
    ];
    assert_eq!(blocks, want);
    assert_eq!(len, 88);
    assert_eq!(
        blocks.iter().map(Block::order).collect::<Vec<_>>(),
        [2, 1, 2, 1, 1, 0, 0]
    );
}

const TENSORS: [(&str, &[usize]); 5] = [
    ("a", &[13, 7]),
    ("b", &[40, 9]),
    ("bias", &[5]),
    ("experts", &[3, 17, 6]),
    ("col", &[11, 1]),
];
const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];

#[test]
fn sharded_shampoo_step_is_bitwise_equal_to_unsharded() {
    let spec = specs(&TENSORS);
    let n = numels(&spec);
    let (p0, grads) = data(&spec, 5, 42);
    for (ci, c) in [loud_shampoo(), adagrad_defaults()].into_iter().enumerate() {
        let opt = Shampoo::new(c).unwrap();
        let whole = whole_shard(&opt, &spec);
        let (wp, ws) = run_rank(&opt, &whole, &p0, &grads);
        let want_p = gather(std::slice::from_ref(&whole), &[wp], &n);
        let want_m = gather(
            std::slice::from_ref(&whole),
            std::slice::from_ref(&host(&ws.m).to_vec()),
            &n,
        );
        let want_v = gather(
            std::slice::from_ref(&whole),
            std::slice::from_ref(&host(&ws.v).to_vec()),
            &n,
        );
        let mut want_f = Keyed::new();
        keyed_factors(&opt, &whole, &ws, &mut want_f);
        for coll_align in [1, 64] {
            let opts = PlanOptions {
                coll_align,
                ..PlanOptions::default()
            };
            for world in WORLDS {
                let shards = planned_shards(&opt, &spec, world, &opts);
                let runs: Vec<_> = shards
                    .iter()
                    .map(|s| run_rank(&opt, s, &p0, &grads))
                    .collect();
                let ps: Vec<_> = runs.iter().map(|r| r.0.clone()).collect();
                let ms: Vec<_> = runs.iter().map(|r| host(&r.1.m).to_vec()).collect();
                let vs: Vec<_> = runs.iter().map(|r| host(&r.1.v).to_vec()).collect();
                let mut got_f = Keyed::new();
                for (s, r) in shards.iter().zip(&runs) {
                    keyed_factors(&opt, s, &r.1, &mut got_f);
                }
                let ctx = format!("config {ci}, world {world}, coll_align {coll_align}");
                for (role, got, want) in [
                    ("params", gather(&shards, &ps, &n), &want_p),
                    ("m", gather(&shards, &ms, &n), &want_m),
                    ("v", gather(&shards, &vs, &n), &want_v),
                ] {
                    for (i, (g, w)) in got.iter().zip(want).enumerate() {
                        assert_eq!(bits(g), bits(w), "{ctx}: {role} of {}", TENSORS[i].0);
                    }
                }
                assert!(got_f == want_f, "{ctx}: factors or roots differ");
            }
        }
        for (i, (p, q)) in want_p.iter().zip(&p0).enumerate() {
            assert_ne!(bits(p), bits(q), "config {ci}: {} unchanged", TENSORS[i].0);
        }
    }
}

#[test]
fn step_is_independent_of_the_thread_count() {
    let spec = specs(&[("big", &[70, 70]), ("b", &[40, 9])]);
    let (p0, grads) = data(&spec, 3, 4);
    let c = ShampooConfig {
        max_preconditioner_dim: 64,
        ..loud_shampoo()
    };
    let opt = Shampoo::new(c).unwrap();
    let shard = whole_shard(&opt, &spec);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| run_rank(&opt, &shard, &p0, &grads))
    };
    let (p1, s1) = run(1);
    let (p4, s4) = run(4);
    assert_eq!(bits(&p1), bits(&p4));
    assert_eq!(s1, s4);
}

#[test]
fn a_piece_cutting_a_row_block_is_refused() {
    let spec = specs(&TENSORS);
    let opt = Shampoo::new(loud_shampoo()).unwrap();
    let opts = PlanOptions {
        coll_align: 1,
        ..PlanOptions::default()
    };
    let shards = planned_shards_by(&spec, 3, &|_: &TensorSpec| AtomicBlock::Rows(1), &opts);
    let mut refused = 0;
    for shard in &shards {
        match opt.init(shard) {
            Err(Error::InvalidShard { .. }) => {
                refused += 1;
                // step refuses too, before touching anything.
                let good = opt.init(&whole_shard(&opt, &spec)).unwrap();
                let mut state = ShampooState {
                    m: vec![0.0; shard.len].into(),
                    v: vec![0.0; shard.len].into(),
                    ..good
                };
                let before = state.try_clone().unwrap();
                let mut p = vec![0.5; shard.len];
                let res = opt.step_slices(
                    &mut state,
                    shard,
                    &mut p,
                    &vec![0.1; shard.len],
                    &SingleRank,
                );
                assert!(res.is_err());
                assert_eq!(state, before);
                assert!(p.iter().all(|&x| x == 0.5));
            }
            Err(e) => panic!("unexpected {e}"),
            Ok(_) => {}
        }
    }
    assert!(refused > 0, "the 1-row layout must cut some 4-row block");
}

// ---------------------------------------------------------------------------------------------
// 3. Grafting, start step, root schedule
// ---------------------------------------------------------------------------------------------

/// Steps 3, 5, 6, 8, 9 of the module table in f32 for one element sequence: the pure grafting
/// update (before the start step).
fn pure_grafting(c: &ShampooConfig, p0: &[f32], grads: &[Vec<f32>]) -> Vec<f32> {
    let mut p = p0.to_vec();
    let mut m = vec![0.0f32; p.len()];
    let mut v = vec![0.0f32; p.len()];
    for (k, g) in grads.iter().enumerate() {
        let t = (k + 1) as f64;
        let bc1 = (1.0 - c.beta1.powf(t)) as f32;
        for i in 0..p.len() {
            m[i] = lerp_elem(m[i], g[i], (1.0 - c.beta1) as f32);
            let gb = m[i] / bc1;
            let pg = match c.grafting {
                Grafting::Adam { beta2, eps } => {
                    v[i] = ema_sq_elem(v[i], g[i], beta2 as f32, (1.0 - beta2) as f32);
                    let bc2 = (1.0 - beta2.powf(t)) as f32;
                    gb / ((v[i] / bc2).sqrt() + eps as f32)
                }
                Grafting::AdaGrad { eps } => {
                    v[i] += g[i] * g[i];
                    gb / (v[i].sqrt() + eps as f32)
                }
                Grafting::Sgd | Grafting::None => gb,
                Grafting::RmsProp { .. } => unreachable!(),
            };
            let d = pg + c.weight_decay as f32 * p[i];
            p[i] += (-c.lr) as f32 * d;
        }
    }
    p
}

#[test]
fn before_the_start_step_the_update_is_pure_adam_or_adagrad_grafting() {
    let spec = specs(&[("w", &[9, 6]), ("b", &[5])]);
    let (p0, grads) = data(&spec, 5, 8);
    for grafting in [
        Grafting::ADAM,
        Grafting::ADAGRAD,
        Grafting::Sgd,
        Grafting::None,
    ] {
        let c = ShampooConfig {
            start_preconditioning_step: Some(4),
            precondition_frequency: 2,
            grafting,
            ..loud_shampoo()
        };
        let opt = Shampoo::new(c).unwrap();
        let shard = whole_shard(&opt, &spec);
        for steps in 1..=3 {
            let (got, _) = run_rank(&opt, &shard, &p0, &grads[..steps]);
            for (k, name) in ["w", "b"].iter().enumerate() {
                let g: Vec<Vec<f32>> = grads[..steps].iter().map(|g| g[k].clone()).collect();
                let want = pure_grafting(&c, &p0[k], &g);
                let piece = &shard.pieces[k];
                let got = &got[piece.offset..piece.offset + piece.range.len()];
                assert_eq!(
                    bits(got),
                    bits(&want),
                    "{grafting:?}, {steps} steps: {name}"
                );
            }
        }
        // From the start step on, Shampoo changes the update.
        let (got, _) = run_rank(&opt, &shard, &p0, &grads[..4]);
        let want = pure_grafting(
            &c,
            &p0[0],
            &grads[..4].iter().map(|g| g[0].clone()).collect::<Vec<_>>(),
        );
        assert_ne!(
            bits(&got[..54]),
            bits(&want),
            "{grafting:?}: step 4 is pure grafting"
        );
    }
}

#[test]
fn after_the_start_each_block_step_has_the_grafting_norm() {
    // wd = 0, so Δp = −lr·P per block, and ‖P‖ = ‖P_g‖ (f32 scale, 1e-16 guard).
    for grafting in [Grafting::ADAM, Grafting::ADAGRAD] {
        let c = ShampooConfig {
            weight_decay: 0.0,
            grafting,
            ..loud_shampoo()
        };
        let opt = Shampoo::new(c).unwrap();
        let spec = specs(&[("w", &[10, 7])]);
        let (p0, grads) = data(&spec, 3, 12);
        let shard = whole_shard(&opt, &spec);
        let (p2, s2) = run_rank(&opt, &shard, &p0, &grads[..2]);
        let mut p3 = p2.clone();
        let mut s3 = s2.try_clone().unwrap();
        opt.step_slices(&mut s3, &shard, &mut p3, &grads[2][0], &SingleRank)
            .unwrap();
        // The grafting direction at step 3, from the element formulas.
        let t = 3.0f64;
        let (blocks, _) = opt.blocks(&shard).unwrap();
        let mut shampoo_differs = false;
        for b in blocks {
            let (mut dn, mut gn) = (0.0f64, 0.0f64);
            for i in 0..b.rows {
                for j in 0..b.cols {
                    let k = b.at + i * b.stride + j;
                    let gb = f64::from(host(&s3.m)[k]) / (1.0 - 0.9f64.powf(t));
                    let denom = match grafting {
                        Grafting::Adam { eps, beta2 } => {
                            (f64::from(host(&s3.v)[k]) / (1.0 - beta2.powf(t))).sqrt() + eps
                        }
                        Grafting::AdaGrad { eps } => f64::from(host(&s3.v)[k]).sqrt() + eps,
                        _ => unreachable!(),
                    };
                    let d = (f64::from(p3[k]) - f64::from(p2[k])) / -c.lr;
                    dn += d * d;
                    gn += (gb / denom).powi(2);
                    shampoo_differs |= (d - gb / denom).abs() > 1e-3 * (gb / denom).abs();
                }
            }
            let (dn, gn) = (dn.sqrt(), gn.sqrt());
            assert!(
                (dn - gn).abs() <= 1e-4 * gn,
                "{grafting:?} block {b:?}: ‖P‖ = {dn}, ‖P_g‖ = {gn}"
            );
        }
        assert!(
            shampoo_differs,
            "{grafting:?}: direction is the grafting direction"
        );
    }
}

/// A block whose gradient is zero at every step has a zero Shampoo direction and a zero
/// grafting direction; its grafting scale is 0 / (0 + 1e-16) = 0, so (without weight decay)
/// its parameters stay bitwise as they were, while the other block moves. A scale of
/// ‖P_g‖ / ‖P‖ alone would be 0 / 0 = NaN and turn the block's parameters into NaN.
#[test]
fn a_block_whose_gradient_is_always_zero_keeps_its_parameters_under_grafting() {
    for grafting in [Grafting::ADAM, Grafting::ADAGRAD, Grafting::Sgd] {
        let c = ShampooConfig {
            weight_decay: 0.0,
            grafting,
            ..loud_shampoo()
        };
        let opt = Shampoo::new(c).unwrap();
        // Rows 0..4 and 4..8 are two blocks of max_preconditioner_dim = 4 rows.
        let spec = specs(&[("w", &[8, 3])]);
        let (p0, mut grads) = data(&spec, 4, 21);
        for g in &mut grads {
            g[0][..12].iter_mut().for_each(|x| *x = 0.0);
        }
        let shard = whole_shard(&opt, &spec);
        let (got, _) = run_rank(&opt, &shard, &p0, &grads);
        let piece = &shard.pieces[0];
        let got = &got[piece.offset..piece.offset + piece.range.len()];
        assert_eq!(
            bits(&got[..12]),
            bits(&p0[0][..12]),
            "{grafting:?}: the zero-gradient block moved"
        );
        assert!(
            got[12..]
                .iter()
                .zip(&p0[0][12..])
                .all(|(a, b)| a.is_finite() && a != b),
            "{grafting:?}: the other block did not step: {got:?}"
        );
    }
}

#[test]
fn roots_are_recomputed_at_the_start_step_and_every_frequency_steps_after() {
    let c = ShampooConfig {
        start_preconditioning_step: Some(4),
        precondition_frequency: 3,
        ..loud_shampoo()
    };
    assert!(!c.computes_roots_at(3));
    assert!(c.computes_roots_at(4));
    assert!(!c.computes_roots_at(5));
    assert!(c.computes_roots_at(6));
    let opt = Shampoo::new(c).unwrap();
    let spec = specs(&[("w", &[6, 5]), ("b", &[7])]);
    let (p0, grads) = data(&spec, 9, 3);
    let shard = whole_shard(&opt, &spec);
    let mut state = opt.init(&shard).unwrap();
    let mut params = scatter(&shard, &p0);
    let mut roots = vec![bits(host(&state.roots))];
    for g in &grads {
        opt.step_slices(
            &mut state,
            &shard,
            &mut params,
            &scatter(&shard, g),
            &SingleRank,
        )
        .unwrap();
        roots.push(bits(host(&state.roots)));
    }
    let changed: Vec<usize> = (1..roots.len())
        .filter(|&t| roots[t] != roots[t - 1])
        .collect();
    assert_eq!(changed, [4, 6, 9]);
    // Until the start step the roots are the initial identities.
    let identity = bits(host(&opt.init(&shard).unwrap().roots));
    assert_eq!(roots[3], identity);
    assert_ne!(roots[4], identity);
}

#[test]
fn defaults_are_fb_distributed_shampoo_defaults() {
    let d = ShampooConfig::default();
    assert_eq!((d.lr, d.beta1, d.beta2), (1e-2, 0.9, 1.0));
    assert_eq!((d.epsilon, d.weight_decay), (1e-12, 0.0));
    assert!(d.use_bias_correction);
    assert_eq!(d.max_preconditioner_dim, 1024);
    assert_eq!((d.precondition_frequency, d.start_step()), (1, 1));
    assert_eq!(d.inverse_exponent_override, None);
    assert_eq!(d.grafting, Grafting::None);
    assert_eq!(Grafting::ADAGRAD, Grafting::AdaGrad { eps: 1e-10 });
    assert_eq!(
        Grafting::RMSPROP,
        Grafting::RmsProp {
            beta2: 0.99,
            eps: 1e-10
        }
    );
    assert_eq!(
        Grafting::ADAM,
        Grafting::Adam {
            beta2: 0.999,
            eps: 1e-10
        }
    );
}

#[test]
fn default_start_is_the_frequency_and_a_smaller_start_is_refused() {
    let c = ShampooConfig {
        precondition_frequency: 5,
        ..ShampooConfig::default()
    };
    assert_eq!(c.start_step(), 5);
    assert!(Shampoo::new(c).is_ok());
    let bad = ShampooConfig {
        start_preconditioning_step: Some(4),
        ..c
    };
    assert!(Shampoo::new(bad).is_err());
}

// ---------------------------------------------------------------------------------------------
// 4. State
// ---------------------------------------------------------------------------------------------

#[test]
fn state_round_trip_through_bytes_continues_bitwise() {
    let spec = specs(&TENSORS);
    let (p0, grads) = data(&spec, 6, 5);
    for c in [loud_shampoo(), adagrad_defaults()] {
        let opt = Shampoo::new(c).unwrap();
        let shards = planned_shards(&opt, &spec, 3, &PlanOptions::default());
        for shard in &shards {
            let (p_all, s_all) = run_rank(&opt, shard, &p0, &grads);
            let (mut p, s_half) = run_rank(&opt, shard, &p0, &grads[..3]);
            let bytes = s_half.to_le_bytes().unwrap();
            let mut s = ShampooState::from_le_bytes(&bytes).unwrap();
            assert_eq!(s, s_half);
            assert_eq!(s.to_le_bytes().unwrap(), bytes);
            for g in &grads[3..] {
                opt.step_slices(&mut s, shard, &mut p, &scatter(shard, g), &SingleRank)
                    .unwrap();
            }
            assert_eq!(bits(&p), bits(&p_all), "rank {}: params", shard.rank);
            assert_eq!(s.step, 6);
            assert_eq!(
                s.to_le_bytes().unwrap(),
                s_all.to_le_bytes().unwrap(),
                "rank {}: state",
                shard.rank
            );
        }
    }
}

#[test]
fn corrupted_or_mismatched_state_bytes_are_refused() {
    let opt = Shampoo::new(loud_shampoo()).unwrap();
    let spec = specs(&[("w", &[6, 5])]);
    let shard = whole_shard(&opt, &spec);
    let state = opt.init(&shard).unwrap();
    let bytes = state.to_le_bytes().unwrap();
    assert!(ShampooState::from_le_bytes(&bytes).is_ok());
    assert!(ShampooState::from_le_bytes(&bytes[..bytes.len() - 1]).is_err());
    assert!(ShampooState::from_le_bytes(&bytes[..39]).is_err());
    assert!(ShampooState::from_le_bytes(&[]).is_err());
    let mut longer = bytes.clone();
    longer.extend_from_slice(&[0; 4]);
    assert!(ShampooState::from_le_bytes(&longer).is_err());
    let mut magic = bytes.clone();
    magic[0] ^= 1;
    assert!(ShampooState::from_le_bytes(&magic).is_err());
    let mut huge = bytes.clone();
    huge[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(ShampooState::from_le_bytes(&huge).is_err());
    let mut shifted = bytes.clone();
    // Move one element from m's count to v's: the total matches but the step refuses it.
    let m = u64::from_le_bytes(shifted[16..24].try_into().unwrap());
    let v = u64::from_le_bytes(shifted[24..32].try_into().unwrap());
    shifted[16..24].copy_from_slice(&(m - 1).to_le_bytes());
    shifted[24..32].copy_from_slice(&(v + 1).to_le_bytes());
    let mut s = ShampooState::from_le_bytes(&shifted).unwrap();
    let mut p = vec![0.0; shard.len];
    assert!(opt
        .step_slices(&mut s, &shard, &mut p, &vec![0.1; shard.len], &SingleRank)
        .is_err());
    // A state of another shard is refused.
    let other = whole_shard(&opt, &specs(&[("w", &[3, 10])]));
    let mut s = opt.init(&other).unwrap();
    assert!(opt
        .step_slices(&mut s, &shard, &mut p, &vec![0.1; shard.len], &SingleRank)
        .is_err());
}

// ---------------------------------------------------------------------------------------------
// 5. Validation and bad input
// ---------------------------------------------------------------------------------------------

#[test]
fn invalid_configs_are_refused() {
    let d = ShampooConfig::default();
    let bad = [
        ShampooConfig { lr: -1.0, ..d },
        ShampooConfig { lr: f64::NAN, ..d },
        ShampooConfig { beta1: 1.0, ..d },
        ShampooConfig { beta2: 0.0, ..d },
        ShampooConfig { beta2: 1.5, ..d },
        ShampooConfig { epsilon: 0.0, ..d },
        // 0 in the f32 factors: every root of a singular factor then failed.
        ShampooConfig {
            epsilon: 1e-300,
            ..d
        },
        ShampooConfig {
            weight_decay: -0.1,
            ..d
        },
        ShampooConfig {
            max_preconditioner_dim: 0,
            ..d
        },
        ShampooConfig {
            max_preconditioner_dim: (1 << 16) + 1,
            ..d
        },
        ShampooConfig {
            precondition_frequency: 0,
            ..d
        },
        ShampooConfig {
            precondition_frequency: 10,
            start_preconditioning_step: Some(3),
            ..d
        },
        ShampooConfig {
            inverse_exponent_override: Some(0.0),
            ..d
        },
        ShampooConfig {
            inverse_exponent_override: Some(f64::INFINITY),
            ..d
        },
        ShampooConfig {
            grafting: Grafting::AdaGrad { eps: 0.0 },
            ..d
        },
        ShampooConfig {
            grafting: Grafting::Adam {
                beta2: 0.0,
                eps: 1e-8,
            },
            ..d
        },
        ShampooConfig {
            grafting: Grafting::RmsProp {
                beta2: 1.1,
                eps: 1e-8,
            },
            ..d
        },
    ];
    for c in bad {
        assert!(Shampoo::new(c).is_err(), "{c:?} accepted");
    }
    assert!(Shampoo::new(d).is_ok());
    let widest = ShampooConfig {
        max_preconditioner_dim: 1 << 16,
        ..d
    };
    assert!(Shampoo::new(widest).is_ok(), "the largest block side");
    for grafting in [
        Grafting::Sgd,
        Grafting::ADAGRAD,
        Grafting::RMSPROP,
        Grafting::ADAM,
    ] {
        assert!(Shampoo::new(ShampooConfig { grafting, ..d }).is_ok());
    }
}

/// Shampoo's rate is bounded as every optimizer's (`lr = 1e38` was accepted and its first
/// step's parameters overflowed), and `set_learning_rate` re-checks the decay `lr·wd`.
#[test]
fn rates_whose_updates_overflow_are_refused_at_construction_and_on_change() {
    let d = ShampooConfig::default();
    for lr in [1e38, 1e-40] {
        assert!(Shampoo::new(ShampooConfig { lr, ..d }).is_err(), "{lr}");
    }
    let mut opt = Shampoo::new(ShampooConfig {
        weight_decay: 1e15,
        ..d
    })
    .unwrap();
    let err = opt.set_learning_rate(1e5).unwrap_err().to_string();
    assert!(err.contains("lr·weight_decay"), "{err}");
    assert_eq!(opt.learning_rate(), Some(d.lr));
}

#[test]
fn non_finite_gradients_are_refused_before_anything_changes() {
    let opt = Shampoo::new(loud_shampoo()).unwrap();
    let spec = specs(&[("w", &[6, 5]), ("b", &[3])]);
    let (p0, grads) = data(&spec, 2, 1);
    let shard = whole_shard(&opt, &spec);
    let (params, state) = run_rank(&opt, &shard, &p0, &grads);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for at in [0, 17, shard.len - 1] {
            let mut g = scatter(&shard, &grads[0]);
            g[at] = bad;
            let (mut p, mut s) = (params.clone(), state.try_clone().unwrap());
            let res = opt.step_slices(&mut s, &shard, &mut p, &g, &SingleRank);
            assert!(
                matches!(res, Err(Error::BadInput { .. })),
                "{bad} at {at}: {res:?}"
            );
            assert_eq!(bits(&p), bits(&params));
            assert_eq!(s, state);
        }
    }
}

#[test]
fn step_refuses_buffers_of_the_wrong_length() {
    let opt = Shampoo::new(loud_shampoo()).unwrap();
    let shard = whole_shard(&opt, &specs(&[("w", &[4, 3])]));
    let good = opt.init(&shard).unwrap();
    let g = vec![0.1; 12];
    let mut p = vec![0.0; 12];
    let mut s = good.try_clone().unwrap();
    assert!(opt
        .step_slices(&mut s, &shard, &mut [0.0; 11], &g, &SingleRank)
        .is_err());
    assert!(opt
        .step_slices(&mut s, &shard, &mut p, &g[..11], &SingleRank)
        .is_err());
    for k in 0..4 {
        let mut s = good.try_clone().unwrap();
        let field = match k {
            0 => &mut s.m,
            1 => &mut s.v,
            2 => &mut s.factors,
            _ => &mut s.roots,
        };
        let mut shorter = field.to_vec().unwrap();
        shorter.pop();
        *field = shorter.into();
        let before = s.try_clone().unwrap();
        assert!(
            opt.step_slices(&mut s, &shard, &mut p, &g, &SingleRank)
                .is_err(),
            "case {k}"
        );
        assert_eq!(s, before);
    }
    // Grafting without an accumulator keeps no v.
    let sgd = Shampoo::new(ShampooConfig {
        grafting: Grafting::Sgd,
        ..loud_shampoo()
    })
    .unwrap();
    assert!(sgd.init(&shard).unwrap().v.is_empty());
    let mut s = good;
    assert!(sgd
        .step_slices(&mut s, &shard, &mut p, &g, &SingleRank)
        .is_err());
}

/// Step time of one 1024×1024 parameter at d = 1024 (one block; roots every step). Run with
/// `cargo test --release -p ragged-optimizers --test shampoo_tests -- --ignored --nocapture`.
#[test]
#[ignore]
fn time_a_1024_square_step() {
    let spec = specs(&[("w", &[1024, 1024])]);
    let (p0, grads) = data(&spec, 3, 1);
    let a = spd(&mut Rng::new(2), 1024, 1024);
    let t0 = std::time::Instant::now();
    inverse_root(&a, 1024, None, 1e-12, 0.25).unwrap();
    eprintln!(
        "one 1024×1024 inverse root: {:.3} s",
        t0.elapsed().as_secs_f64()
    );
    // Roots every step (fb's defaults), then no roots (frequency 100: factor updates and
    // products only).
    for (what, c) in [
        ("roots every step", ShampooConfig::default()),
        (
            "no roots",
            ShampooConfig {
                precondition_frequency: 100,
                ..ShampooConfig::default()
            },
        ),
    ] {
        let opt = Shampoo::new(c).unwrap();
        let shard = whole_shard(&opt, &spec);
        let mut state = opt.init(&shard).unwrap();
        let mut params = scatter(&shard, &p0);
        for (k, g) in grads.iter().enumerate() {
            let g = scatter(&shard, g);
            let t0 = std::time::Instant::now();
            opt.step_slices(&mut state, &shard, &mut params, &g, &SingleRank)
                .unwrap();
            eprintln!(
                "{what}, step {}: {:.3} s ({} rayon threads)",
                k + 1,
                t0.elapsed().as_secs_f64(),
                rayon::current_num_threads()
            );
        }
    }
}

/// A factor that overflows `f32` (gradients near `1e21` square past its range) has no inverse
/// root: the previous root stays, the failure is counted in `root_failures`, the counter
/// survives the byte round trip, and a state written in the first format (no counter) still
/// loads, with 0 failures.
#[test]
fn a_root_that_cannot_be_computed_keeps_the_previous_one_and_is_counted() {
    let c = ShampooConfig {
        precondition_frequency: 1,
        start_preconditioning_step: Some(1),
        ..loud_shampoo()
    };
    let opt = Shampoo::new(c).unwrap();
    let spec = specs(&[("w", &[4, 4])]);
    let shard = whole_shard(&opt, &spec);
    let mut state = opt.init(&shard).unwrap();
    let g: Vec<f32> = (0..16).map(|i| 0.1 + i as f32 * 0.01).collect();
    let mut params = scatter(&shard, &[vec![0.5; 16]]);
    let mut step = |state: &mut ShampooState, g: &[f32]| {
        let grads = scatter(&shard, &[g.to_vec()]);
        opt.step_slices(state, &shard, &mut params, &grads, &SingleRank)
            .unwrap();
    };
    step(&mut state, &g);
    assert_eq!(state.root_failures, 0);
    let good_roots = bits(host(&state.roots));
    assert_ne!(good_roots, bits(host(&opt.init(&shard).unwrap().roots)));
    let huge: Vec<f32> = g.iter().map(|x| x * 1e21).collect();
    step(&mut state, &huge);
    assert!(host(&state.factors).iter().any(|f| !f.is_finite()));
    assert_eq!(
        bits(host(&state.roots)),
        good_roots,
        "the last good roots stay"
    );
    assert_eq!(
        state.root_failures, 2,
        "both factors of the one block failed"
    );
    let bytes = state.to_le_bytes().unwrap();
    assert_eq!(ShampooState::from_le_bytes(&bytes).unwrap(), state);
    // The first format: magic "SHAMPOO1" and a five-word header without the counter.
    let mut v1 = b"SHAMPOO1".to_vec();
    v1.extend_from_slice(&bytes[8..40]);
    v1.extend_from_slice(&bytes[48..]);
    let old = ShampooState::from_le_bytes(&v1).unwrap();
    assert_eq!(
        old,
        ShampooState {
            root_failures: 0,
            ..state.try_clone().unwrap()
        }
    );
    assert!(ShampooState::from_le_bytes(&v1[..v1.len() - 4]).is_err());
}

/// A host state array's elements.
fn host(s: &Storage<f32>) -> &[f32] {
    s.cpu().unwrap()
}
