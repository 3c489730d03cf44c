//! Muon on a local shard: `torch.optim.Muon` (lerp momentum, Nesterov, quintic Newton–Schulz,
//! decoupled weight decay) in `f32`, with AdamW for the parameters Muon does not handle.
//!
//! Muon: Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024);
//! scale rule `match_rms_adamw`: Liu et al., "Muon is Scalable for LLM Training" (Moonlight,
//! arXiv:2502.16982).
//!
//! # Which parameters Muon updates
//! A parameter of two or more dimensions whose name contains none of
//! [`MuonConfig::adamw_patterns`] (default `embed`, `lm_head`) is a *Muon parameter*: its
//! trailing `rows × cols` matrices (each expert of `[E, m, n]`) are orthogonalized one by one.
//! Every other parameter (0-D, 1-D, embeddings, output heads) is updated by
//! [`AdamW`](crate::AdamW) with [`MuonConfig::adamw`].
//!
//! # The step of one matrix, in torch's operation order
//! `μ` = momentum, `g` = gradient, `B` = momentum buffer (state `m`), all `f32`:
//!
//! | # | operation | torch |
//! |---|---|---|
//! | 1 | `B ← lerp(B, g, 1 − μ)` | `buf.lerp_(grad, 1 - momentum)` |
//! | 2 | `U = lerp(g, B, μ)` (Nesterov) or `U = B` (a copy) | `grad.lerp(buf, momentum)` |
//! | 3 | `O = NS(U)` ([`orthogonalize`]) | `_zeropower_via_newtonschulz` |
//! | 4 | `p ← p·(1 − lr·wd)` (unadjusted `lr`) | `param.mul_(1 - lr * weight_decay)` |
//! | 5 | `p ← p + (−lr·scale(rows, cols))·O` | `param.add_(update, alpha=-adjusted_lr)` |
//!
//! `scale` is [`LrScale`]: `original` `√max(1, rows/cols)` (torch's default) or
//! `match_rms_adamw` `0.2·√max(rows, cols)`, both on the *trailing matrix's* shape. Scalars are
//! `f64`, rounded to `f32` once where they meet a tensor; element operations are single `f32`
//! operations without FMA (see [`crate::adamw`] for the precision contract).
//!
//! # Differences from torch
//! - Working dtype `f32` by default, not bf16 (torch casts the NS input to bf16); set
//!   [`NsConfig::precision`] to `Bf16` for torch's dtype (see [`crate::newton_schulz`]).
//! - The Frobenius norm is summed in `f64` (see [`crate::newton_schulz`]).
//! - torch refuses non-2-D parameters; here `[…, m, n]` runs NS per trailing matrix and the
//!   rest falls back to AdamW.
//!
//! # Sharding
//! [`Muon::atomic_block`] is [`AtomicBlock::Matrix`] for Muon parameters, so a plan from
//! `plan_unit` keeps every matrix on one rank: a rank's piece holds whole matrices and the step
//! orthogonalizes them locally, with no communication. A piece that holds part of a matrix
//! (a plan made with a smaller block) is refused with `Error::InvalidShard` before anything
//! is modified: NS of a partial matrix is a different function, so it is never run. (The
//! gather-to-root path for such layouts is not implemented yet.)
//!
//! # State
//! [`MuonState`] is [`AdamState`]: `m` holds Muon's momentum buffer on Muon pieces and Adam's
//! first moment on AdamW pieces; `v` holds Adam's second moment on AdamW pieces and stays zero
//! on Muon pieces; `step` counts steps (AdamW's bias correction uses it).

use ragged::comm::Communicator;
use ragged::optim::{LocalShard, Optimizer, ParamMeta};
use ragged::{AtomicBlock, Error, Result};

use crate::adamw::{adamw_update, AdamState, AdamW, AdamWConfig};
use crate::common::{
    self, check_shard, check_step_inputs, decay_elem, lerp_elem, next_step, AdamScale, MomentCoeffs,
};
use crate::newton_schulz::{orthogonalize, orthogonalize_batch, NsConfig};

/// Muon's state: the AdamW state layout (see the module doc for what `m` and `v` hold).
pub type MuonState = AdamState;

/// How the learning rate of a `rows × cols` matrix is scaled (torch's `adjust_lr_fn`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LrScale {
    /// `√max(1, rows/cols)` (torch's default, Keller Jordan's).
    #[default]
    Original,
    /// `0.2·√max(rows, cols)`: an update RMS close to AdamW's (Moonlight).
    MatchRmsAdamW,
}

impl LrScale {
    /// The factor for a `rows × cols` matrix, in `f64`.
    pub fn factor(self, rows: usize, cols: usize) -> f64 {
        let (a, b) = (rows as f64, cols as f64);
        match self {
            LrScale::Original => (a / b).max(1.0).sqrt(),
            LrScale::MatchRmsAdamW => 0.2 * a.max(b).sqrt(),
        }
    }
}

/// Muon hyperparameters; the Muon defaults are `torch.optim.Muon`'s.
#[derive(Clone, Debug, PartialEq)]
pub struct MuonConfig {
    /// Learning rate (default `1e-3`), before [`LrScale`]; also scales the weight decay.
    pub lr: f64,
    /// Decoupled weight decay (default `0.1`): `p ← p·(1 − lr·wd)` with the unadjusted `lr`.
    pub weight_decay: f64,
    /// Momentum `μ` (default `0.95`).
    pub momentum: f64,
    /// Nesterov momentum (default `true`).
    pub nesterov: bool,
    /// Newton–Schulz settings (default 5 quintic steps, eps `1e-7`).
    pub ns: NsConfig,
    /// Learning-rate scale rule (default [`LrScale::Original`]).
    pub lr_scale: LrScale,
    /// Hyperparameters of the AdamW that updates non-Muon parameters.
    pub adamw: AdamWConfig,
    /// Parameters whose name contains one of these go to AdamW whatever their shape
    /// (default `["embed", "lm_head"]`).
    pub adamw_patterns: Vec<String>,
}

impl Default for MuonConfig {
    fn default() -> Self {
        MuonConfig {
            lr: 1e-3,
            weight_decay: 0.1,
            momentum: 0.95,
            nesterov: true,
            ns: NsConfig::default(),
            lr_scale: LrScale::Original,
            adamw: AdamWConfig::default(),
            adamw_patterns: vec!["embed".into(), "lm_head".into()],
        }
    }
}

impl MuonConfig {
    /// torch's checks (`0 ≤ lr`, `0 ≤ wd`, `0 ≤ μ < 1`, finite), [`NsConfig::validate`] and
    /// [`AdamWConfig::validate`].
    pub fn validate(&self) -> Result<()> {
        let checks = [
            ("lr", self.lr, self.lr >= 0.0),
            ("weight_decay", self.weight_decay, self.weight_decay >= 0.0),
            (
                "momentum",
                self.momentum,
                (0.0..1.0).contains(&self.momentum),
            ),
        ];
        for (name, value, ok) in checks {
            if !ok || !value.is_finite() {
                return Err(Error::BadInput {
                    op: "MuonConfig::validate",
                    what: format!("{name} = {value}"),
                    reason: "momentum must lie in [0, 1); lr and weight_decay must be finite \
                             and non-negative"
                        .into(),
                });
            }
        }
        self.ns.validate()?;
        self.adamw.validate()
    }
}

/// `torch.optim.Muon` with an AdamW fallback, on local shards.
#[derive(Clone, Debug, PartialEq)]
pub struct Muon {
    config: MuonConfig,
    adamw: AdamW,
}

/// The trailing matrix of a shape: `(rows, cols)`.
fn trailing(shape: &[usize]) -> (usize, usize) {
    let n = shape.len();
    (shape[n - 2], shape[n - 1])
}

impl Muon {
    /// A Muon with validated hyperparameters ([`MuonConfig::validate`]).
    pub fn new(config: MuonConfig) -> Result<Self> {
        config.validate()?;
        let adamw = AdamW::new(config.adamw)?;
        Ok(Muon { config, adamw })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &MuonConfig {
        &self.config
    }

    /// Whether Muon (not AdamW) updates a parameter of this name and global shape.
    pub fn uses_muon(&self, name: &str, shape: &[usize]) -> bool {
        shape.len() >= 2
            && !self
                .config
                .adamw_patterns
                .iter()
                .any(|p| name.contains(p.as_str()))
    }

    fn is_muon(&self, meta: &ParamMeta) -> bool {
        self.uses_muon(&meta.name, &meta.shape)
    }

    /// The `f32` multiplier `−lr·scale(rows, cols)` of step 5.
    pub fn neg_adjusted_lr(&self, rows: usize, cols: usize) -> f32 {
        (-(self.config.lr * self.config.lr_scale.factor(rows, cols))) as f32
    }
}

impl Optimizer for Muon {
    type State = MuonState;

    fn name(&self) -> &'static str {
        "muon"
    }

    fn atomic_block(&self, name: &str, shape: &[usize]) -> AtomicBlock {
        if self.uses_muon(name, shape) {
            AtomicBlock::Matrix
        } else {
            AtomicBlock::Element
        }
    }

    fn init(&self, shard: &LocalShard) -> Result<MuonState> {
        check_shard("Muon::init", shard)?;
        Ok(AdamState::zeros(shard.len))
    }

    fn step(
        &self,
        state: &mut MuonState,
        shard: &LocalShard,
        params: &mut [f32],
        grads: &[f32],
        _comm: &dyn Communicator,
    ) -> Result<()> {
        const OP: &str = "Muon::step";
        check_step_inputs(
            OP,
            shard,
            params.len(),
            grads.len(),
            state.m.len(),
            state.v.len(),
        )?;
        // Refuse partial matrices before touching anything.
        for piece in &shard.pieces {
            let meta = &shard.params[piece.param];
            if !self.is_muon(meta) {
                continue;
            }
            let (rows, cols) = trailing(&meta.shape);
            let mn = rows * cols;
            if mn == 0 {
                continue;
            }
            if piece.range.start % mn != 0 || piece.range.end % mn != 0 {
                return Err(Error::InvalidShard {
                    op: OP,
                    reason: format!(
                        "rank {} holds elements {:?} of {} {:?}, which splits a {rows}×{cols} \
                         matrix; Muon orthogonalizes whole matrices only (plan with \
                         AtomicBlock::Matrix; the gather-to-root path is not implemented)",
                        shard.rank, piece.range, meta.name, meta.shape
                    ),
                });
            }
        }
        let t = next_step(OP, state.step)?;
        state.step = t;

        let a = self.adamw.config();
        let moments = MomentCoeffs::new(a.beta1, a.beta2);
        let scale = AdamScale::new(a.lr, a.beta1, a.beta2, a.eps, t);
        let c = &self.config;
        let decay = common::decay_factor(c.lr, c.weight_decay);
        for piece in &shard.pieces {
            let r = piece.offset..piece.offset + piece.range.len();
            let meta = &shard.params[piece.param];
            if self.is_muon(meta) {
                let (rows, cols) = trailing(&meta.shape);
                let step = MatrixStep {
                    rows,
                    cols,
                    momentum: c.momentum,
                    nesterov: c.nesterov,
                    decay: (c.weight_decay != 0.0).then_some(decay),
                    neg_lr: self.neg_adjusted_lr(rows, cols),
                    ns: &c.ns,
                };
                step.apply_all(&mut params[r.clone()], &grads[r.clone()], &mut state.m[r])?;
            } else {
                adamw_update(
                    &mut params[r.clone()],
                    &grads[r.clone()],
                    &mut state.m[r.clone()],
                    &mut state.v[r],
                    self.adamw.decay_for(meta),
                    &moments,
                    &scale,
                );
            }
        }
        Ok(())
    }
}

/// The scalars of one Muon matrix update (steps 1–5 of the module table).
#[derive(Clone, Copy, Debug)]
pub struct MatrixStep<'a> {
    pub rows: usize,
    pub cols: usize,
    /// `μ`.
    pub momentum: f64,
    pub nesterov: bool,
    /// `1 − lr·wd`, or `None` for no decay.
    pub decay: Option<f32>,
    /// `−lr·scale(rows, cols)`.
    pub neg_lr: f32,
    pub ns: &'a NsConfig,
}

impl MatrixStep<'_> {
    /// Steps 1–5 on one `rows × cols` matrix: parameters `p`, gradient `g`, momentum buffer `m`.
    ///
    /// # Errors
    /// Those of [`orthogonalize`] (after step 1 has updated `m`; `p` is then unchanged).
    ///
    /// # Panics
    /// If a slice does not hold `rows·cols` elements.
    #[track_caller]
    pub fn apply(&self, p: &mut [f32], g: &[f32], m: &mut [f32]) -> Result<()> {
        let mn = self.rows * self.cols;
        assert!(
            p.len() == mn && g.len() == mn && m.len() == mn,
            "MatrixStep::apply: slices of {}, {}, {} elements for a {}×{} matrix",
            p.len(),
            g.len(),
            m.len(),
            self.rows,
            self.cols
        );
        let mut u = self.momentum_and_input(g, m);
        orthogonalize(&mut u, self.rows, self.cols, self.ns)?;
        self.update_params(p, &u);
        Ok(())
    }

    /// Steps 1–2 (element-wise): updates `m`, returns the Newton–Schulz input.
    fn momentum_and_input(&self, g: &[f32], m: &mut [f32]) -> Vec<f32> {
        let w = (1.0 - self.momentum) as f32;
        let mu = self.momentum as f32;
        for (m, &g) in m.iter_mut().zip(g) {
            *m = lerp_elem(*m, g, w);
        }
        if self.nesterov {
            g.iter()
                .zip(m.iter())
                .map(|(&g, &m)| lerp_elem(g, m, mu))
                .collect()
        } else {
            m.to_vec()
        }
    }

    /// Steps 4–5 (element-wise).
    fn update_params(&self, p: &mut [f32], o: &[f32]) {
        for (p, &o) in p.iter_mut().zip(o) {
            let p0 = match self.decay {
                Some(d) => decay_elem(*p, d),
                None => *p,
            };
            *p = p0 + self.neg_lr * o;
        }
    }

    /// [`MatrixStep::apply`] on each of the whole matrices in `p`, `g`, `m`: the element-wise
    /// steps over the whole slices, Newton–Schulz by [`orthogonalize_batch`] (which decides by
    /// shape whether threads split the matrices or each product; the bits are the same).
    ///
    /// # Errors
    /// As [`MatrixStep::apply`].
    ///
    /// # Panics
    /// If the slices differ in length or do not hold whole matrices.
    #[track_caller]
    pub fn apply_all(&self, p: &mut [f32], g: &[f32], m: &mut [f32]) -> Result<()> {
        let mn = self.rows * self.cols;
        assert!(
            p.len() == g.len() && p.len() == m.len() && (mn == 0 || p.len() % mn == 0),
            "MatrixStep::apply_all: {} elements is not whole {}×{} matrices",
            p.len(),
            self.rows,
            self.cols
        );
        if mn == 0 {
            return Ok(());
        }
        let mut u = self.momentum_and_input(g, m);
        orthogonalize_batch(&mut u, self.rows, self.cols, self.ns)?;
        self.update_params(p, &u);
        Ok(())
    }
}
