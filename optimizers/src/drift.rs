//! The 8-bit quality measurement: how far an optimizer with quantized state drifts from fp32
//! Adam on one seeded gradient stream, `‖p₈ − p₃₂‖ / ‖p₃₂ − p₀‖` after the stream's steps.
//!
//! The stream ([`DriftStream::standard`]) is four matrices of 65 536 elements each
//! (`256×256`, `512×128`, `128×512`, `1024×64`), fp32 parameters `0.02·N(0, 1)`, and per step
//! gradients `sᵢⱼ·(Sᵢⱼ + Nᵢⱼ)·10⁻³`: a persistent direction `S ~ 0.5·N(0, 1)` (so the first
//! moment carries signal), fresh noise `N ~ N(0, 1)`, and a magnitude `sᵢⱼ` that is 1
//! ([`GradStructure::Iid`]), a log-uniform row scale `rᵢ ∈ [10⁻², 1]`
//! ([`GradStructure::Rows`]) or `rᵢ·cⱼ` ([`GradStructure::RowsAndCols`]), so that scale
//! blocks see values of different magnitudes as real layers do.
//! [`DriftStream::write`] stores it for other implementations (`scripts/adam8bit_vs_bnb.py`
//! runs bitsandbytes' `Adam8bit` on the same numbers), so both sides read the same bits.

use std::path::Path;

use ragged::comm::SingleRank;
use ragged::demo::SplitMix;
use ragged::optim::{LocalShard, Optimizer};
use ragged::{Error, Result};

/// A seeded gradient stream on a few matrices: initial parameters and every step's gradients.
#[derive(Clone, Debug, PartialEq)]
pub struct DriftStream {
    /// `[rows, cols]` of each matrix.
    pub shapes: Vec<[usize; 2]>,
    /// Initial parameters, one row-major buffer per matrix.
    pub p0: Vec<Vec<f32>>,
    /// `grads[step][matrix]`, row-major.
    pub grads: Vec<Vec<Vec<f32>>>,
}

/// The matrices of [`DriftStream::standard`].
pub const STANDARD_SHAPES: [[usize; 2]; 4] = [[256, 256], [512, 128], [128, 512], [1024, 64]];

/// The learning rate of the measurement (the issue's: `1e-3`, other hyperparameters torch's
/// defaults, no weight decay).
pub const DRIFT_LR: f64 = 1e-3;

/// How gradient magnitudes vary across a matrix: not at all, per row, or per row and per
/// column (`gᵢⱼ` scaled by `rᵢ·cⱼ`, as `δᵢ·xⱼ` outer products are); each scale log-uniform in
/// `[10⁻², 1]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradStructure {
    /// Every element `N(0, 1)`-shaped at the same scale.
    Iid,
    /// A log-uniform scale per row.
    Rows,
    /// A log-uniform scale per row times one per column.
    RowsAndCols,
}

impl GradStructure {
    /// All three, in the order of the measurement's table.
    pub const ALL: [GradStructure; 3] = [
        GradStructure::Iid,
        GradStructure::Rows,
        GradStructure::RowsAndCols,
    ];

    /// A short name (`iid`, `rows`, `rows+cols`).
    pub fn name(self) -> &'static str {
        match self {
            GradStructure::Iid => "iid",
            GradStructure::Rows => "rows",
            GradStructure::RowsAndCols => "rows+cols",
        }
    }
}

/// `10^(−2·u)` for `u` uniform in `[0, 1)`.
fn log_uniform(rng: &mut SplitMix) -> f32 {
    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    10f64.powf(-2.0 * u) as f32
}

/// One standard normal from two uniforms (Box–Muller in `f64`, rounded once).
fn normal(rng: &mut SplitMix) -> f32 {
    let u = |rng: &mut SplitMix| ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let (a, b) = (u(rng), u(rng));
    ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
}

impl DriftStream {
    /// The stream of the module doc on `shapes`, `steps` steps, from `seed`, with gradient
    /// magnitudes shaped by `structure`.
    pub fn generate(
        shapes: &[[usize; 2]],
        steps: usize,
        seed: u64,
        structure: GradStructure,
    ) -> Result<Self> {
        if shapes.is_empty() || steps == 0 || shapes.iter().any(|&[r, c]| r == 0 || c == 0) {
            return Err(Error::BadInput {
                op: "DriftStream::generate",
                what: format!("{shapes:?}, {steps} steps"),
                reason: "needs at least one non-empty matrix and one step".into(),
            });
        }
        let mut rng = SplitMix(seed);
        let numel = |&[r, c]: &[usize; 2]| r * c;
        let p0 = shapes
            .iter()
            .map(|s| (0..numel(s)).map(|_| 0.02 * normal(&mut rng)).collect())
            .collect();
        let signal: Vec<Vec<f32>> = shapes
            .iter()
            .map(|s| (0..numel(s)).map(|_| 0.5 * normal(&mut rng)).collect())
            .collect();
        let (rows_scaled, cols_scaled) = match structure {
            GradStructure::Iid => (false, false),
            GradStructure::Rows => (true, false),
            GradStructure::RowsAndCols => (true, true),
        };
        let scales = |n: usize, on: bool, rng: &mut SplitMix| -> Vec<f32> {
            (0..n)
                .map(|_| if on { log_uniform(rng) } else { 1.0 })
                .collect()
        };
        let row_scale: Vec<Vec<f32>> = shapes
            .iter()
            .map(|&[r, _]| scales(r, rows_scaled, &mut rng))
            .collect();
        let col_scale: Vec<Vec<f32>> = shapes
            .iter()
            .map(|&[_, c]| scales(c, cols_scaled, &mut rng))
            .collect();
        let grads = (0..steps)
            .map(|_| {
                shapes
                    .iter()
                    .enumerate()
                    .map(|(k, &[_, cols])| {
                        let s = &signal[k];
                        (0..s.len())
                            .map(|i| {
                                let scale = row_scale[k][i / cols] * col_scale[k][i % cols];
                                scale * (s[i] + normal(&mut rng)) * 1e-3
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        Ok(DriftStream {
            shapes: shapes.to_vec(),
            p0,
            grads,
        })
    }

    /// The measurement's stream: [`STANDARD_SHAPES`], 50 steps, seed 2022.
    pub fn standard(structure: GradStructure) -> Result<Self> {
        Self::generate(&STANDARD_SHAPES, 50, 2022, structure)
    }

    /// Writes `stream.bin` (every `p0` matrix, then each step's gradients, matrix by matrix,
    /// row-major little-endian `f32`, no header) and `stream.json` (shapes, steps, the
    /// hyperparameters, the structure's name, and `ragged_drift` when given) into `dir`.
    pub fn write(
        &self,
        dir: &Path,
        structure: GradStructure,
        ragged_drift: Option<f64>,
    ) -> Result<()> {
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |source| Error::Io {
                op: "DriftStream::write",
                path,
                source,
            }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let mut bin = Vec::new();
        for x in self.p0.iter().chain(self.grads.iter().flatten()).flatten() {
            bin.extend_from_slice(&x.to_le_bytes());
        }
        let bin_path = dir.join("stream.bin");
        std::fs::write(&bin_path, bin).map_err(io(&bin_path))?;
        let meta = serde_json::json!({
            "shapes": self.shapes,
            "steps": self.grads.len(),
            "lr": DRIFT_LR,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 0.0,
            "structure": structure.name(),
            "ragged_drift": ragged_drift,
        });
        let json_path = dir.join("stream.json");
        std::fs::write(&json_path, serde_json::to_string_pretty(&meta)?).map_err(io(&json_path))?;
        Ok(())
    }

    /// Runs `opt` over the stream on one unsharded shard and returns the final parameters.
    pub fn run<O: Optimizer>(&self, opt: &O) -> Result<Vec<Vec<f32>>> {
        let names: Vec<String> = (0..self.shapes.len()).map(|k| format!("w{k}")).collect();
        let shard = LocalShard::unsharded(
            names
                .iter()
                .zip(&self.shapes)
                .map(|(n, s)| (n.as_str(), &s[..])),
            &|name, shape| opt.atomic_block(name, shape),
        )?;
        let flat = |xs: &[Vec<f32>]| xs.concat();
        let mut p = flat(&self.p0);
        let mut state = opt.init(&shard)?;
        for g in &self.grads {
            opt.step(
                &mut state,
                &shard,
                (&mut p).into(),
                (&flat(g)).into(),
                &SingleRank,
            )?;
        }
        let mut out = Vec::with_capacity(self.p0.len());
        let mut at = 0;
        for p0 in &self.p0 {
            out.push(p[at..at + p0.len()].to_vec());
            at += p0.len();
        }
        Ok(out)
    }

    /// `‖p − p_ref‖ / ‖p_ref − p₀‖` over all matrices (in `f64`): the drift of final parameters
    /// `p` from the reference's `p_ref`, relative to how far the reference moved.
    pub fn relative_drift(&self, p: &[Vec<f32>], p_ref: &[Vec<f32>]) -> Result<f64> {
        let sq = |a: &[Vec<f32>], b: &[Vec<f32>]| -> f64 {
            a.iter()
                .flatten()
                .zip(b.iter().flatten())
                .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
                .sum()
        };
        let lens = |x: &[Vec<f32>]| x.iter().map(Vec::len).collect::<Vec<_>>();
        if lens(p) != lens(&self.p0) || lens(p_ref) != lens(&self.p0) {
            return Err(Error::BadInput {
                op: "DriftStream::relative_drift",
                what: format!("{:?} and {:?}", lens(p), lens(p_ref)),
                reason: format!("expected matrices of {:?} elements", lens(&self.p0)),
            });
        }
        let moved = sq(p_ref, &self.p0).sqrt();
        if moved == 0.0 {
            return Err(Error::BadInput {
                op: "DriftStream::relative_drift",
                what: "reference".into(),
                reason: "the reference did not move: the drift is undefined".into(),
            });
        }
        Ok(sq(p, p_ref).sqrt() / moved)
    }
}
