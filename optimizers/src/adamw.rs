//! AdamW on a local shard: `torch.optim.AdamW` (single-tensor, non-fused, non-amsgrad, fp32),
//! composed of the pieces in [`crate::common`].
//!
//! Adam: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015
//! (arXiv:1412.6980). Decoupled weight decay: Loshchilov & Hutter, "Decoupled Weight Decay
//! Regularization", ICLR 2019 (arXiv:1711.05101).
//!
//! # The step, in torch's operation order
//! For every element of every local piece, at step `t` (after the increment):
//!
//! | # | operation | torch | piece |
//! |---|---|---|---|
//! | 1 | `t ← t + 1` | `step_t += 1` | [`AdamState::step`] |
//! | 2 | `p ← p·(1 − lr·wd)` (if `wd ≠ 0` and the rule decays `p`) | `param.mul_(1 - lr * weight_decay)` | [`common::decay`] |
//! | 3 | `m ← m + (g − m)·(1 − β₁)` | `exp_avg.lerp_(grad, 1 - beta1)` | [`common::ema_lerp`] |
//! | 4 | `v ← v·β₂ + ((1 − β₂)·g)·g` | `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)` | [`common::ema_sq`] |
//! | 5 | `bc₁ = 1 − β₁^t`, `bc₂ = 1 − β₂^t`, `step_size = lr / bc₁` | Python floats | [`common::AdamScale`] |
//! | 6 | `denom = √v / √bc₂ + ε` | `(exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` | [`common::adam_denom_elem`] |
//! | 7 | `p ← p + (−step_size·m) / denom` | `param.addcdiv_(exp_avg, denom, value=-step_size)` | [`common::apply_adam`] |
//!
//! Step 3 is torch's `lerp` with weight `w = 1 − β₁`; the form above is its `|w| < 0.5`
//! branch (`β₁ > 0.5`); for `β₁ ≤ 0.5` torch, and this crate, use `g − (g − m)·β₁`
//! ([`common::lerp_elem`]).
//!
//! # Where each constant acts
//! - `lr` scales the update (through `step_size = lr / bc₁`) and the weight decay
//!   (`1 − lr·wd`: decay is proportional to `lr`, as in torch, not to a separate schedule).
//! - `β₁`, `β₂` are the moment decays; the moments start at zero and the bias corrections
//!   `bc₁`, `bc₂` undo that start (`bc₁` folded into `step_size`, `√bc₂` dividing `√v`).
//! - `ε` is added **outside** the square root, after the bias correction: `√(v/bc₂) + ε`,
//!   evaluated as `√v/√bc₂ + ε` (as in the Adam paper and torch; optax's `eps` sits in the
//!   same place, its `eps_root`, which this crate does not offer, would sit inside).
//! - `wd` multiplies the parameter before the moments are updated, never the gradient.
//!
//! # Precision
//! Hyperparameters are `f64` (Python floats in torch). All scalar arithmetic — `1 − lr·wd`,
//! `1 − β₁`, `1 − β₂`, `β^t` (by `powf`, the C `pow` behind Python's `**`), `lr / bc₁`,
//! `√bc₂` — is `f64`, and each scalar is rounded to `f32` once, where it meets a tensor, as
//! torch does when a Python float multiplies an `f32` tensor. Parameters, gradients and both
//! moments are `f32`; every element operation is one IEEE `f32` operation in the order of the
//! table (no fused multiply-add), so the result is the same on every machine, for every
//! vector width and thread count, and for every sharding of the parameters. torch's own CPU
//! `lerp` kernel (AVX2/AVX-512) fuses step 3 into one FMA, and its CUDA division by a scalar
//! multiplies by a reciprocal; those kernels can differ from this one by an ulp.
//!
//! # Sharding
//! The update is element-wise, so a shard only needs its own elements
//! ([`AtomicBlock::Element`]). The step walks the local pieces of the shard — never the
//! padding, which therefore stays zero in parameters and in both moments — and steps each
//! piece at its parameter's role's rates ([`AdamWConfig::roles`]; a frozen one not at all),
//! decayed according to its global shape ([`DecayRule`]). A sharded step is bitwise
//! equal to the unsharded one at every world size and layout.

use rayon::prelude::*;

use ragged::comm::Communicator;
use ragged::optim::{LocalPiece, LocalShard, Optimizer, ParamMeta};
use ragged::storage::{Placement, Storage, View, ViewMut};
use ragged::{AtomicBlock, Result, Role, RoleRule};

use crate::common::{
    self, apply_adam_elem, check_hyperparameters, check_step_inputs, decay_elem, ema_sq_elem,
    f32_state_from_le_bytes, f32_state_to_le_bytes, lerp_large_elem, lerp_small_elem,
    lerp_weight_is_small, next_step, AdamScale, MomentCoeffs, MIN_EPS,
};

/// Which parameters get weight decay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DecayRule {
    /// Every parameter (torch's default for one parameter group).
    #[default]
    All,
    /// Only parameters of two or more dimensions: 1-D and 0-D parameters (biases, norm
    /// gains, scalars) are not decayed (the usual second parameter group with `wd = 0`).
    NoDecayFor1D,
}

impl DecayRule {
    /// Whether a parameter of this global shape is decayed.
    pub fn decays(self, shape: &[usize]) -> bool {
        match self {
            DecayRule::All => true,
            DecayRule::NoDecayFor1D => shape.len() >= 2,
        }
    }
}

/// AdamW hyperparameters; the defaults are `torch.optim.AdamW`'s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (default `1e-3`); also scales the weight decay.
    pub lr: f64,
    /// First-moment decay β₁ (default `0.9`).
    pub beta1: f64,
    /// Second-moment decay β₂ (default `0.999`).
    pub beta2: f64,
    /// Added to `√v̂`, outside the square root (default `1e-8`).
    pub eps: f64,
    /// Decoupled weight decay `wd`: `p ← p·(1 − lr·wd)` each step (default `1e-2`).
    pub weight_decay: f64,
    /// Which parameters `weight_decay` applies to (default: all), by shape, on top of the
    /// roles' weight decays.
    pub decay_rule: DecayRule,
    /// Each parameter's role ([`ragged::roles`]) and each role's learning-rate scale and weight
    /// decay (default: [`RoleRule::default`], every role at this config's rates). `Frozen`
    /// parameters are not stepped.
    pub roles: RoleRule,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            decay_rule: DecayRule::All,
            roles: RoleRule::default(),
        }
    }
}

impl AdamWConfig {
    /// torch's checks (`0 ≤ β₁ < 1`, `0 ≤ β₂ < 1`, `0 ≤ wd`, all finite), but `ε ≥`
    /// [`MIN_EPS`] where torch takes `0 ≤ ε`, each value finite as an `f32` (the kernels'
    /// precision), [`RoleRule::validate`], and the rates of [`AdamWConfig::check_rates`].
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "AdamWConfig::validate";
        check_hyperparameters(
            OP,
            "betas must lie in [0, 1); weight_decay must not be negative; eps must be at least \
             f32::MIN_POSITIVE (1.2e-38), or Adam divides 0 by 0 where a gradient is zero",
            &[
                ("eps", self.eps, self.eps >= MIN_EPS),
                ("beta1", self.beta1, (0.0..1.0).contains(&self.beta1)),
                ("beta2", self.beta2, (0.0..1.0).contains(&self.beta2)),
                ("weight_decay", self.weight_decay, self.weight_decay >= 0.0),
            ],
        )?;
        self.roles.validate()?;
        self.check_rates(OP, self.lr)
    }

    /// `Err(BadInput)` from `op` unless, at learning rate `lr`, the rate and every role's
    /// `lr·lr_scale` and decay pass [`ragged::optim::check_rates`]: the one check of the rates
    /// that [`AdamWConfig::validate`] and [`Optimizer::set_learning_rate`] share.
    pub fn check_rates(&self, op: &'static str, lr: f64) -> Result<()> {
        ragged::optim::check_rates(op, "lr", lr, self.weight_decay)?;
        self.roles.check_rates(op, lr, self.weight_decay)
    }
}

/// AdamW state of one rank's shard of one group. Both moments are laid out like the local
/// shard (`shard.len` elements each; padding stays zero), in host or device memory
/// ([`Storage`]), so a checkpoint is these three fields ([`AdamState::to_le_bytes`]).
#[derive(Debug, PartialEq)]
pub struct AdamState {
    /// Steps taken (`t`; torch's `state["step"]`). `0` before the first step.
    pub step: u64,
    /// First moment `m` (torch's `exp_avg`), `f32`, `shard.len` elements.
    pub m: Storage<f32>,
    /// Second moment `v` (torch's `exp_avg_sq`), `f32`, `shard.len` elements.
    pub v: Storage<f32>,
}

impl AdamState {
    /// Zero moments in host memory for a shard of `len` elements, step 0.
    pub fn zeros(len: usize) -> Self {
        AdamState {
            step: 0,
            m: Storage::Cpu(vec![0.0; len]),
            v: Storage::Cpu(vec![0.0; len]),
        }
    }

    /// Zero moments in the memory `place` names.
    pub fn zeros_on(place: &Placement, len: usize) -> Result<Self> {
        Ok(AdamState {
            step: 0,
            m: place.zeros(len)?,
            v: place.zeros(len)?,
        })
    }

    /// A copy in the same memory (a device copy for device moments).
    pub fn try_clone(&self) -> Result<Self> {
        Ok(AdamState {
            step: self.step,
            m: self.m.try_clone()?,
            v: self.v.try_clone()?,
        })
    }

    /// Both moments as host slices (`Err` when they live on a device).
    pub fn host_mut(&mut self) -> Result<(&mut [f32], &mut [f32])> {
        Ok((self.m.cpu_mut()?, self.v.cpu_mut()?))
    }

    /// Serializes the state: `step` (u64), `len` (u64), then `m` and `v` as `len` `f32` each,
    /// all little-endian; `16 + 8·len` bytes (device moments are downloaded). Exact: loading
    /// gives back the same bits. (`len` is `m`'s length; a state whose moments differ in
    /// length writes bytes that do not load.)
    pub fn to_le_bytes(&self) -> Result<Vec<u8>> {
        let (m, v) = (self.m.host()?, self.v.host()?);
        Ok(f32_state_to_le_bytes(
            &[self.step, m.len() as u64],
            &[&m, &v],
        ))
    }

    /// Loads a state written by [`AdamState::to_le_bytes`]; `Err` if the length is not the
    /// one the header announces or `m` and `v` would differ in length.
    pub fn from_le_bytes(bytes: &[u8]) -> Result<Self> {
        let op = "AdamState::from_le_bytes";
        let ([step, len], floats) =
            f32_state_from_le_bytes(op, bytes, |&[_, len]| len.checked_mul(2))?;
        let (m, v) = floats.split_at(len as usize);
        Ok(AdamState {
            step,
            m: m.to_vec().into(),
            v: v.to_vec().into(),
        })
    }
}

/// Pieces of at least this many elements are updated by rayon tasks of [`PAR_CHUNK`]
/// elements; smaller ones on the calling thread. The update is element-wise, so the split
/// changes no bit of the result.
pub const PAR_MIN_ELEMS: usize = 1 << 16;

/// Elements per rayon task for large pieces.
pub const PAR_CHUNK: usize = 1 << 14;

/// `torch.optim.AdamW` on local shards. Holds only hyperparameters; see the module doc for
/// the formula.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AdamW {
    config: AdamWConfig,
}

impl AdamW {
    /// An AdamW with validated hyperparameters ([`AdamWConfig::validate`]).
    pub fn new(config: AdamWConfig) -> Result<Self> {
        config.validate()?;
        Ok(AdamW { config })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// The role of parameter `meta` ([`AdamWConfig::roles`]).
    pub fn role_of(&self, meta: &ParamMeta) -> Role {
        self.config.roles.role_of(&meta.name, &meta.shape)
    }

    /// The learning rate and weight decay of parameter `meta`: the config's, scaled and
    /// replaced by its role's settings; `None` for a frozen parameter (not stepped).
    pub fn rates_for(&self, meta: &ParamMeta) -> Option<(f64, f64)> {
        let c = &self.config;
        let s = c.roles.settings(self.role_of(meta))?;
        Some((c.lr * s.lr_scale, s.weight_decay.unwrap_or(c.weight_decay)))
    }

    /// The decay factor `1 − lr·wd` applied to parameter `meta` (its role's rates), or `None`
    /// when it is not decayed (`wd = 0`, as torch skips the multiplication, excluded by the
    /// rule, or frozen).
    pub fn decay_for(&self, meta: &ParamMeta) -> Option<f32> {
        let (lr, wd) = self.rates_for(meta)?;
        (wd != 0.0 && self.config.decay_rule.decays(&meta.shape))
            .then(|| common::decay_factor(lr, wd))
    }

    /// The Adam scalars of step `t` for parameter `meta` at its role's learning rate; `None`
    /// for a frozen parameter.
    pub fn scale_for(&self, meta: &ParamMeta, t: u64) -> Option<AdamScale> {
        let c = &self.config;
        let (lr, _) = self.rates_for(meta)?;
        Some(AdamScale::new(lr, c.beta1, c.beta2, c.eps, t))
    }

    /// The AdamW update of local piece `piece` at step `t` (`None` when its parameter is
    /// frozen): what the host and device steps of AdamW and of Muon's and 8-bit Adam's
    /// fallbacks apply, each on its own storage.
    pub fn run_of(&self, shard: &LocalShard, piece: &LocalPiece, t: u64) -> Option<AdamRun> {
        let meta = &shard.params[piece.param];
        Some(AdamRun {
            range: piece.offset..piece.offset + piece.range.len(),
            decay: self.decay_for(meta),
            scale: self.scale_for(meta, t)?,
        })
    }
}

/// One AdamW update of a run of the local shard ([`AdamW::run_of`]).
#[derive(Clone, Debug)]
pub struct AdamRun {
    /// The elements, in the local shard.
    pub range: std::ops::Range<usize>,
    /// `1 − lr·wd`, or `None` for no decay.
    pub decay: Option<f32>,
    pub scale: AdamScale,
}

impl Optimizer for AdamW {
    type State = AdamState;

    fn name(&self) -> &'static str {
        "adamw"
    }

    fn learning_rate(&self) -> Option<f64> {
        Some(self.config.lr)
    }

    fn settings(&self) -> String {
        format!("{:?}", self.config)
    }

    fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        self.config.check_rates("set_learning_rate", lr)?;
        self.config.lr = lr;
        Ok(())
    }

    fn atomic_block(&self, _name: &str, _shape: &[usize]) -> AtomicBlock {
        AtomicBlock::Element
    }

    fn role(&self, name: &str, shape: &[usize]) -> Role {
        self.config.roles.role_of(name, shape)
    }

    fn init(&self, shard: &LocalShard) -> Result<AdamState> {
        shard.check("AdamW::init")?;
        Ok(AdamState::zeros(shard.len))
    }

    fn init_on(&self, shard: &LocalShard, place: &Placement) -> Result<AdamState> {
        shard.check("AdamW::init_on")?;
        AdamState::zeros_on(place, shard.len)
    }

    /// One fused update per local piece (frozen pieces skipped), on the host or, for device
    /// memory, one launch of `kernels/adamw.cu` per piece (bitwise the host step; queued on the
    /// device's stream).
    fn step(
        &self,
        state: &mut AdamState,
        shard: &LocalShard,
        params: ViewMut<'_, f32>,
        grads: View<'_, f32>,
        _comm: &dyn Communicator,
    ) -> Result<()> {
        const OP: &str = "AdamW::step";
        check_step_inputs(
            OP,
            shard,
            params.len(),
            grads.len(),
            state.m.len(),
            state.v.len(),
        )?;
        let t = next_step(OP, state.step)?;
        let c = &self.config;
        let moments = MomentCoeffs::new(c.beta1, c.beta2);
        // Frozen pieces have no run.
        let runs = shard.pieces.iter().filter_map(|p| self.run_of(shard, p, t));
        match params {
            ViewMut::Cpu(params) => {
                let grads = grads.cpu(OP)?;
                let (m, v) = state.host_mut()?;
                for run in runs {
                    let r = run.range;
                    adamw_update(
                        &mut params[r.clone()],
                        &grads[r.clone()],
                        &mut m[r.clone()],
                        &mut v[r],
                        run.decay,
                        &moments,
                        &run.scale,
                    );
                }
            }
            #[cfg(feature = "cuda")]
            ViewMut::Cuda(mut params) => {
                let grads = crate::cuda::device_view(OP, grads)?;
                let (dev, m, v) = crate::cuda::device_moments(OP, &mut state.m, &mut state.v)?;
                crate::cuda::adamw_runs(&dev, runs, &mut params, &grads, m, v, &moments)?;
            }
            _ => return Err(ragged::storage::no_backend(OP)),
        }
        state.step = t;
        Ok(())
    }
}

/// The fused AdamW update of one contiguous run of elements (steps 2–7 of the module table;
/// the caller increments `t` and builds the scalars for it): per element
/// `p ← p·decay` (if `Some`), `m ← lerp(m, g, 1 − β₁)`, `v ← v·β₂ + ((1 − β₂)·g)·g`,
/// `p ← p + (−step_size·m) / (√v/√bc₂ + ε)`.
///
/// Bitwise equal to calling [`common::decay`], [`common::update_moments`] and
/// [`common::apply_adam`] in turn (it calls their element functions), in one pass over memory.
/// Runs of [`PAR_MIN_ELEMS`] or more are split over rayon tasks; the result does not depend
/// on the split.
///
/// # Panics
/// If the four slices differ in length.
#[track_caller]
pub fn adamw_update(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    decay: Option<f32>,
    moments: &MomentCoeffs,
    scale: &AdamScale,
) {
    let n = params.len();
    assert!(
        grads.len() == n && m.len() == n && v.len() == n,
        "adamw_update: params, grads, m and v differ in length ({n}, {}, {}, {})",
        grads.len(),
        m.len(),
        v.len()
    );
    if n >= PAR_MIN_ELEMS {
        params
            .par_chunks_mut(PAR_CHUNK)
            .zip(grads.par_chunks(PAR_CHUNK))
            .zip(m.par_chunks_mut(PAR_CHUNK))
            .zip(v.par_chunks_mut(PAR_CHUNK))
            .for_each(|(((p, g), m), v)| dispatch(p, g, m, v, decay, moments, scale));
    } else {
        dispatch(params, grads, m, v, decay, moments, scale);
    }
}

/// Picks the monomorphized loop: the decay and `lerp` branches are loop-invariant, so they
/// are decided once here and the loop body is branch-free (and vectorizes).
fn dispatch(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    decay: Option<f32>,
    mc: &MomentCoeffs,
    s: &AdamScale,
) {
    let small = lerp_weight_is_small(mc.lerp_weight);
    match (decay, small) {
        (Some(d), true) => kernel::<true, true>(p, g, m, v, d, mc, s),
        (Some(d), false) => kernel::<true, false>(p, g, m, v, d, mc, s),
        (None, true) => kernel::<false, true>(p, g, m, v, 1.0, mc, s),
        (None, false) => kernel::<false, false>(p, g, m, v, 1.0, mc, s),
    }
}

/// The element loop: plain zipped slices, no bounds checks, no branches in the body.
#[inline(always)]
fn kernel<const DECAY: bool, const SMALL: bool>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    decay: f32,
    mc: &MomentCoeffs,
    s: &AdamScale,
) {
    let (w, b2, c2) = (mc.lerp_weight, mc.beta2, mc.one_minus_beta2);
    let s = *s;
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let p0 = if DECAY { decay_elem(*p, decay) } else { *p };
        let m1 = if SMALL {
            lerp_small_elem(*m, g, w)
        } else {
            lerp_large_elem(*m, g, w)
        };
        let v1 = ema_sq_elem(*v, g, b2, c2);
        *m = m1;
        *v = v1;
        *p = apply_adam_elem(p0, m1, v1, &s);
    }
}
