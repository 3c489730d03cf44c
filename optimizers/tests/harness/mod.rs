//! Helpers shared by the optimizer test files: layouts from the planner and moving global
//! tensors in and out of local shards.
#![allow(dead_code)] // each test file uses a different subset

/// The CUDA test binaries' helpers (`device`, the allocation counts), shared with the root
/// crate's tests.
#[cfg(feature = "cuda")]
#[path = "../../../tests/common/cuda.rs"]
pub mod cuda;
#[cfg(feature = "cuda")]
#[allow(unused_imports)] // the files without device tests
pub use cuda::device;

use ragged::demo::SplitMix;
use ragged::fsdp::fsdp2::Fsdp2Unit;
use ragged::model::{DType, TensorSpec, Unit};
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::{plan_unit, PlanOptions};
use ragged::AtomicBlock;
use ragged_optimizers::newton_schulz::{resolve_config, resolve_method};
use ragged_optimizers::{Grafting, Muon, NsConfig, NsMethod, ShampooConfig};

/// Every rank's shard of `specs` on `world` ranks, planned with `block_of`.
pub fn planned_shards_by(
    specs: &[TensorSpec],
    world: usize,
    block_of: &dyn Fn(&TensorSpec) -> AtomicBlock,
    opts: &PlanOptions,
) -> Vec<LocalShard> {
    let unit = Unit {
        name: "unit".into(),
        tensors: specs.iter().collect(),
    };
    let plan = plan_unit(&unit, block_of, world, opts).unwrap();
    plan.validate().unwrap();
    (0..world)
        .map(|r| LocalShard::from_plan(&plan, r).unwrap())
        .collect()
}

/// Every rank's shard of `specs` planned with `opt`'s blocks on `world` ranks.
pub fn planned_shards<O: Optimizer>(
    opt: &O,
    specs: &[TensorSpec],
    world: usize,
    opts: &PlanOptions,
) -> Vec<LocalShard> {
    planned_shards_by(specs, world, &|t| opt.atomic_block(&t.name, &t.shape), opts)
}

pub fn numels(specs: &[TensorSpec]) -> Vec<usize> {
    specs.iter().map(TensorSpec::numel).collect()
}

/// A local buffer holding this shard's pieces of the global tensors; padding zero.
pub fn scatter<T: Copy + Default>(shard: &LocalShard, global: &[Vec<T>]) -> Vec<T> {
    let mut local = vec![T::default(); shard.len];
    for p in &shard.pieces {
        local[p.offset..p.offset + p.range.len()]
            .copy_from_slice(&global[p.param][p.range.clone()]);
    }
    local
}

/// Local positions that no piece covers.
pub fn padding(shard: &LocalShard) -> Vec<usize> {
    let mut covered = vec![false; shard.len];
    for p in &shard.pieces {
        covered[p.offset..p.offset + p.range.len()].fill(true);
    }
    (0..shard.len).filter(|&i| !covered[i]).collect()
}

pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|x| x.to_bits()).collect()
}

/// A seeded generator (the crate's splitmix64), so every test sees the same numbers each run.
pub struct Rng(SplitMix);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(SplitMix(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }
    /// `|x| ∈ [lo, hi)` with a random sign.
    pub fn signed(&mut self, lo: f32, hi: f32) -> f32 {
        let x = self.uniform(lo, hi);
        if self.next_u64() & 1 == 0 {
            x
        } else {
            -x
        }
    }
    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.signed(lo, hi)).collect()
    }
    /// `n` values uniform in `[-1, 1)`.
    pub fn units(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform(-1.0, 1.0)).collect()
    }
}

/// The unsharded reference: one shard holding every tensor back to back, built by hand (no
/// planner involved), with `block_of` as each parameter's block.
pub fn whole_shard_by(
    specs: &[TensorSpec],
    block_of: &dyn Fn(&TensorSpec) -> AtomicBlock,
) -> LocalShard {
    LocalShard::unsharded(
        specs.iter().map(|t| (t.name.as_str(), t.shape.as_slice())),
        &|name, _| block_of(specs.iter().find(|t| t.name == name).unwrap()),
    )
    .unwrap()
}

/// [`whole_shard_by`] with `Element` blocks.
pub fn whole_shard(specs: &[TensorSpec]) -> LocalShard {
    whole_shard_by(specs, &|_| AtomicBlock::Element)
}

/// Global per-element tensors from every rank's local buffer; each element owned once.
pub fn gather<T: Copy + Default>(
    shards: &[LocalShard],
    locals: &[Vec<T>],
    numels: &[usize],
) -> Vec<Vec<T>> {
    let mut global: Vec<Vec<T>> = numels.iter().map(|&n| vec![T::default(); n]).collect();
    let mut owners: Vec<Vec<u8>> = numels.iter().map(|&n| vec![0; n]).collect();
    for (shard, local) in shards.iter().zip(locals) {
        for p in &shard.pieces {
            global[p.param][p.range.clone()]
                .copy_from_slice(&local[p.offset..p.offset + p.range.len()]);
            for o in &mut owners[p.param][p.range.clone()] {
                *o += 1;
            }
        }
    }
    assert!(
        owners.iter().flatten().all(|&o| o == 1),
        "each element owned once"
    );
    global
}

/// The module table of `newton_schulz` in f64 (coefficients and norm scale widened).
pub fn ns_f64(x: &[f32], rows: usize, cols: usize, c: &NsConfig) -> Vec<f64> {
    let t = rows > cols;
    let (s, l) = if t { (cols, rows) } else { (rows, cols) };
    let mut a = vec![0.0f64; s * l];
    for i in 0..rows {
        for j in 0..cols {
            let v = f64::from(x[i * cols + j]);
            if t {
                a[j * rows + i] = v;
            } else {
                a[i * cols + j] = v;
            }
        }
    }
    let norm = (f64::from(c.norm_scale) * a.iter().map(|v| v * v).sum::<f64>().sqrt())
        .max(f64::from(c.eps));
    a.iter_mut().for_each(|v| *v /= norm);
    for k in 0..c.steps {
        let [ca, cb, cc] = c.coeffs_at(k).map(f64::from);
        let mut p = vec![0.0; s * s];
        for i in 0..s {
            for j in 0..s {
                p[i * s + j] = (0..l).map(|q| a[i * l + q] * a[j * l + q]).sum();
            }
        }
        let mut qm = vec![0.0; s * s];
        for i in 0..s {
            for j in 0..s {
                let pp: f64 = (0..s).map(|q| p[i * s + q] * p[q * s + j]).sum();
                qm[i * s + j] = cb * p[i * s + j] + cc * pp;
            }
        }
        let mut next = vec![0.0; s * l];
        for i in 0..s {
            for q in 0..s {
                let w = qm[i * s + q];
                for j in 0..l {
                    next[i * l + j] += w * a[q * l + j];
                }
            }
            for j in 0..l {
                next[i * l + j] += ca * a[i * l + j];
            }
        }
        a = next;
    }
    let mut out = vec![0.0; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            out[i * cols + j] = if t { a[j * rows + i] } else { a[i * cols + j] };
        }
    }
    out
}

/// Eigenpairs of a symmetric `n×n` matrix by cyclic Jacobi (f64): eigenvalues and `V`
/// (row-major, eigenvectors in the columns) with `A = V·diag(λ)·Vᵀ`.
pub fn jacobi(mut a: Vec<f64>, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut v = vec![0.0; n * n];
    for i in 0..n {
        v[i * n + i] = 1.0;
    }
    let scale: f64 = a.iter().map(|x| x * x).sum::<f64>().max(1e-300);
    for _ in 0..100 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * n + j] * a[i * n + j])
            .sum();
        if off <= 1e-30 * scale {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq == 0.0 {
                    continue;
                }
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = if theta == 0.0 {
                    1.0
                } else {
                    theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt())
                };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vkp - s * vkq;
                    v[k * n + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    ((0..n).map(|i| a[i * n + i]).collect(), v)
}

/// Smallest and largest singular value of the row-major `rows × cols` matrix `x`: square roots
/// of the extreme eigenvalues of its short-side Gram matrix, in f64 ([`jacobi`]).
pub fn singular_range(x: &[f32], rows: usize, cols: usize) -> (f64, f64) {
    let (s, l, t) = (rows.min(cols), rows.max(cols), rows > cols);
    let at = |i: usize, k: usize| f64::from(if t { x[k * cols + i] } else { x[i * cols + k] });
    let mut gram = vec![0.0; s * s];
    for i in 0..s {
        for j in 0..s {
            gram[i * s + j] = (0..l).map(|k| at(i, k) * at(j, k)).sum();
        }
    }
    jacobi(gram, s)
        .0
        .iter()
        .map(|e| e.max(0.0).sqrt())
        .fold((f64::MAX, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)))
}

/// The Newton–Schulz method Muon's default config runs on a `rows × cols` matrix here
/// (`NsMethod::Auto` resolved for this machine's backend).
pub fn default_ns_method(rows: usize, cols: usize) -> NsMethod {
    let ns = NsConfig::default();
    let backend = resolve_config(&ns).unwrap();
    resolve_method(&ns, backend, rows.min(cols), rows.max(cols))
}

/// `f32` tensor specs from `(name, shape)` pairs.
pub fn specs(tensors: &[(&str, &[usize])]) -> Vec<TensorSpec> {
    tensors
        .iter()
        .map(|(n, s)| TensorSpec::new(n.to_string(), s, DType::F32).unwrap())
        .collect()
}

/// Seeded initial values of every tensor and `steps` gradients of each (uniform in ±1).
pub fn data(specs: &[TensorSpec], steps: usize, seed: u64) -> (Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>) {
    let mut rng = Rng::new(seed);
    let p0 = specs.iter().map(|t| rng.units(t.numel())).collect();
    let grads = (0..steps)
        .map(|_| specs.iter().map(|t| rng.units(t.numel())).collect())
        .collect();
    (p0, grads)
}

/// Every rank's shard of `spec` as one unit under PyTorch FSDP2's layout (even `Shard(0)` per
/// parameter).
pub fn fsdp2_shards(spec: &[TensorSpec], world: usize) -> Vec<LocalShard> {
    let unit = Unit {
        name: "unit".into(),
        tensors: spec.iter().collect(),
    };
    (0..world)
        .map(|r| Fsdp2Unit::new(&unit, world, r).unwrap().local_shard(&unit))
        .collect()
}

/// Shampoo hyperparameters under which every term is visible: β₂ < 1 (factor bias
/// correction), weight decay, Adam grafting, roots every 2 steps from step 2.
pub fn loud_shampoo() -> ShampooConfig {
    ShampooConfig {
        lr: 0.05,
        beta1: 0.9,
        beta2: 0.95,
        epsilon: 1e-3,
        weight_decay: 0.01,
        max_preconditioner_dim: 4,
        precondition_frequency: 2,
        start_preconditioning_step: Some(2),
        grafting: Grafting::ADAM,
        ..ShampooConfig::default()
    }
}

/// Random global tensors for `specs`.
pub fn globals(specs: &[TensorSpec], rng: &mut Rng, scale: f32) -> Vec<Vec<f32>> {
    specs
        .iter()
        .map(|t| {
            rng.units(t.numel())
                .into_iter()
                .map(|x| x * scale)
                .collect()
        })
        .collect()
}

/// Row-granular shards of `spec` on `world` ranks, in which some Muon matrix is split.
pub fn split_rows(opt: &Muon, spec: &[TensorSpec], world: usize) -> Vec<LocalShard> {
    let shards = planned_shards_by(
        spec,
        world,
        &|_| ragged::AtomicBlock::Rows(1),
        &PlanOptions::default(),
    );
    assert!(
        shards.iter().any(|s| opt.roots(s).has_split()),
        "a split layout"
    );
    shards
}

/// Three Muon matrices and a vector for the split-layout device tests, with seeded initial
/// parameters and `steps` gradients.
#[allow(clippy::type_complexity)]
pub fn split_case(seed: u64, steps: usize) -> (Vec<TensorSpec>, Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>) {
    let spec = specs(&[
        ("w0", &[48, 32]),
        ("w1", &[48, 32]),
        ("w2", &[40, 24]),
        ("b", &[7]),
    ]);
    let mut rng = Rng::new(seed);
    let p0 = globals(&spec, &mut rng, 1.0);
    let grads = (0..steps).map(|_| globals(&spec, &mut rng, 0.1)).collect();
    (spec, p0, grads)
}
