//! Blocked Shampoo on a local shard, with the numerics of facebookresearch/optimizers'
//! `DistributedShampoo` (default `RootInvShampooPreconditionerConfig` with `EigenConfig`):
//! Kronecker factors per block, inverse roots by symmetric eigendecomposition, learning-rate
//! grafting, a bias-corrected filtered gradient and decoupled weight decay.
//!
//! Shampoo: Gupta, Koren & Singer, "Shampoo: Preconditioned Stochastic Tensor Optimization",
//! ICML 2018 (arXiv:1802.09568). Blocking and grafting: Anil et al., "Scalable Second Order
//! Optimization for Deep Learning" (arXiv:2002.09018); Shi et al., "A Distributed Data-Parallel
//! PyTorch Implementation of the Distributed Shampoo Optimizer" (arXiv:2309.06497). Reference
//! text: `/work/shared/reference/optimizers.md` §5.
//!
//! # Blocks
//! Every parameter is viewed as a matrix of `numel / n` rows and `n = shape[-1]` columns (a
//! 1-D tensor is one row, a 0-D tensor one element), and cut with `d = max_preconditioner_dim`:
//!
//! - **row blocks**: `d` consecutive rows from the first one (the last row block may be
//!   shorter). [`Shampoo::atomic_block`] is [`AtomicBlock::Rows`]`(d)` for every parameter, so
//!   the planner keeps each row block on one rank; `Rows(d)` clamps to the tensor, so a
//!   tensor of at most `d` rows is never cut.
//! - **column chunks**: inside a row block, columns `[0, d)`, `[d, 2d)`, … (the last chunk may
//!   be narrower).
//!
//! Each (row block, column chunk) of `r × c` elements is one Shampoo block `G` with its own
//! factors. Like fb's `squeeze` of size-1 dims, a block dimension of size 1 gets no factor:
//!
//! | block | factors | default exponent | `P_shampoo` |
//! |---|---|---|---|
//! | `r > 1`, `c > 1` (order 2) | `L` (`r×r`), `R` (`c×c`) | `1/4` each | `L^(−1/4)·G·R^(−1/4)` |
//! | `r = 1`, `c > 1` (order 1: 1-D tensors, one-row tails) | `R` | `1/2` | `G·R^(−1/2)` |
//! | `r > 1`, `c = 1` (order 1: `[.., 1]` tensors, one-column chunks) | `L` | `1/2` | `L^(−1/2)·G` |
//! | `r = c = 1` (order 0) | none | — | `G` |
//!
//! fb squeezes the *parameter* before blocking, so there the one-row tail of a 2-D parameter
//! keeps a `1×1` left factor (order 2); here it is order 1, exactly like a 1-D tensor of the
//! same row, so that a block's math depends only on its own shape.
//!
//! # The step, in fb's operation order
//! `t` counts steps (after the increment), `g` is the gradient, `m` the filtered gradient,
//! `v` the grafting accumulator, `w = 1 − β₂` if `β₂ < 1` else `1`:
//!
//! | # | operation | fb (`distributed_shampoo.py`, `*_preconditioner_list.py`) |
//! |---|---|---|
//! | 1 | `t ← t + 1` | `step.add_(1)` |
//! | 2 | per block: `L ← β₂·L + w·(G·Gᵀ)`, `R ← β₂·R + w·(Gᵀ·G)` (raw `g`; `β₂·` skipped when `β₂ = 1`) | `_update_factor_matrices` |
//! | 3 | `v ← v·β₂ᵍ + ((1 − β₂ᵍ)·g)·g` (AdaGrad: `β₂ᵍ = 1`, weight `1`) | `AdagradPreconditionerList.update_preconditioners` |
//! | 4 | if `t = start` or (`t > start` and `t mod f = 0`): every factor's inverse root `X = (F/bc₂ + εI)^(−e)` ([`inverse_root`]) | `_amortized_computation` |
//! | 5 | `m ← lerp(m, g, 1 − β₁)`; `ḡ = m / (1 − β₁^t)` (if `β₁ ≠ 0`; `ḡ = g` else) | `_compute_filtered_grad_list` |
//! | 6 | `P_g = ḡ / (√(v / bc₂ᵍ) + εᵍ)` (SGD: `P_g = ḡ`) | `AdagradPreconditionerList.precondition` |
//! | 7 | `t < start`: `P = P_g`; else per block `P_s` (table above) and `P = (‖P_g‖ / (‖P_s‖ + 1e-16))·P_s` | `_precondition_and_grafting` |
//! | 8 | `P ← P + wd·p` (if `wd ≠ 0`) | `_apply_decoupled_weight_decay` |
//! | 9 | `p ← p + (−lr)·P` | `_foreach_mul_(P, -lr)`, `update_params` |
//!
//! `bc₂ = 1 − β₂^t` divides the factors only when `use_bias_correction` and `β₂ < 1`; the
//! filtered gradient is bias-corrected only when `use_bias_correction` (fb's `β₃ = β₁`
//! form `1 − β₃·β₁^(t−1)`). Grafting bias correction `bc₂ᵍ = 1 − β₂ᵍ^t` is Adam's only
//! (RMSProp and AdaGrad divide by `1`), as in fb. With [`Grafting::None`] steps before `start`
//! use the initial inverse roots, the identity, so `P = ḡ`; after it `P = P_s`. Momentum
//! (fb's `momentum`, default 0) and L2 (coupled) weight decay are not offered.
//!
//! # Inverse roots ([`inverse_root`])
//! `A = F / bc₂` (f32), `A ← A + ε·I` (fb's `perturb_before_computation`), then the symmetric
//! eigendecomposition `A = Q·diag(λ)·Qᵀ` by faer's `self_adjoint_eigen` (sequential; a block's
//! two factors on two rayon tasks) in `f32`, retried in `f64` when it does not converge or
//! returns a non-finite value (fb retries `eigh` in float64; [`inverse_root_f64`] is that path
//! alone). If `λ_min < ε` every eigenvalue is shifted, `λ ← λ − λ_min + ε`; then
//! `X = Q·diag(λ^(−e))·Qᵀ`, with `e = 1/(2·order)` or the override. The power and the
//! product are evaluated in `f64` and rounded to `f32` once; `X` is exactly symmetric (its
//! upper triangle is mirrored). When both precisions fail, or the factor is not finite, the
//! previous root is kept and [`ShampooState::root_failures`] counts it (fb also keeps the
//! previous root, but raises after `num_tolerated_failed_amortized_computations` = 3 failures
//! in a row; this crate never raises: a factor overflows `f32` when gradients near `1e19`
//! square past its range, and training goes on with the last good root, so read the counter:
//! `ShardedModel::optimizer_events` sums it over units and ranks).
//!
//! # Precision
//! Scalars (`1 − β`, `β^t`, `lr`, `wd`) are `f64`, rounded to `f32` once where they meet a
//! tensor. Element operations are single `f32` operations in the order of the table, without
//! fused multiply-add. Differences from fb: matrix products (`G·Gᵀ`, `Gᵀ·G`, `L·G`, `·R`,
//! `Q·diag·Qᵀ`) accumulate in `f64` in a fixed order (term `k` in lane `k mod 4`, lanes added
//! as `(s₀ + s₁) + (s₂ + s₃)`; the products of `f32` factors are exact, and `Q·diag·Qᵀ`'s
//! terms are `(d_k·Q_ik)·Q_jk` by fused multiply-add; `kernels::lane_dot`, in AVX-512 or
//! AVX2 + FMA register tiles where the CPU has them, with the same bits) and round once,
//! and the norms of step 7 are `f64` sums in 32 fixed lanes added as a tree (fb uses `f32`
//! GEMMs and norms); `bc₂` is an `f64` scalar rounded once (fb computes it in an `f32`
//! tensor).
//!
//! # Sharding and determinism
//! A rank holds whole row blocks, hence whole Shampoo blocks, so it steps them with no
//! communication. Blocks are independent and are processed by rayon tasks, each block's
//! arithmetic in a fixed order, so the result depends only on the input bits and the CPU's
//! vector instructions (faer's eigendecomposition runs `gemm`'s AVX-512 or AVX2 kernels, like
//! Muon's Newton–Schulz): a sharded step equals the unsharded step bitwise at every world
//! size, layout and thread count. A piece
//! that starts or ends inside a row block (a plan made with a smaller block) is refused with
//! `Error::InvalidShard` before anything is modified.
//!
//! # Where it runs
//! Where the shard lives: [`Shampoo::init_on`] puts the state in the shard's memory. On a
//! GPU (feature `cuda`, [`crate::cuda::shampoo`]) steps 2, 3 and 5–9 are kernels that keep the
//! host's operation order and `f64` lanes, and step 4 runs on the host: every
//! `precondition_frequency` steps the factors and roots are downloaded, rooted by the same
//! code as here, and the roots uploaded. So a device step is bitwise the host step. The
//! device step keeps two shard-long `f32` buffers (8 bytes per element) between steps.
//!
//! # Non-finite gradients
//! A NaN or ±∞ in the local gradient (padding included) makes `step` return
//! `Error::BadInput` before anything is modified (fb raises on non-finite factor matrices,
//! after the fact). Each rank checks its own shard.
//!
//! # State
//! [`ShampooState`] is laid out per local shard: `m` and `v` like the shard (padding zero;
//! `v` is empty when the grafting has no accumulator), then every local block's factors and
//! inverse roots, concatenated in shard order (row blocks, then column chunks; `L` before `R`,
//! row-major). [`ShampooState::to_le_bytes`] saves it exactly.

use faer::{Mat, Side};
use rayon::prelude::*;

use ragged::comm::Communicator;
use ragged::optim::{LocalShard, Optimizer};
use ragged::storage::{Placement, Storage, View, ViewMut};
use ragged::{AtomicBlock, Error, Result};

use crate::common::{check_hyperparameters, check_len, ema_sq_elem, lerp_elem, next_step, MIN_EPS};
use crate::kernels::lane_dot::{self, mul_abt};

/// The grafting method: the diagonal optimizer whose per-block step norm Shampoo's direction
/// takes, and the whole update before `start_preconditioning_step`. Defaults are fb's
/// (`AdaGradGraftingConfig` and its subclasses, whose `epsilon` is `1e-10`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Grafting {
    /// No grafting: `P = P_s`.
    None,
    /// `P_g = ḡ`.
    Sgd,
    /// `v ← v + g²`, `P_g = ḡ / (√v + eps)`.
    AdaGrad { eps: f64 },
    /// `v ← β₂·v + (1 − β₂)·g²`, `P_g = ḡ / (√v + eps)` (no bias correction).
    RmsProp { beta2: f64, eps: f64 },
    /// `v ← β₂·v + (1 − β₂)·g²`, `P_g = ḡ / (√(v / (1 − β₂^t)) + eps)`.
    Adam { beta2: f64, eps: f64 },
}

impl Grafting {
    /// AdaGrad grafting with fb's `epsilon = 1e-10`.
    pub const ADAGRAD: Grafting = Grafting::AdaGrad { eps: 1e-10 };
    /// RMSProp grafting with fb's `beta2 = 0.99`, `epsilon = 1e-10`.
    pub const RMSPROP: Grafting = Grafting::RmsProp {
        beta2: 0.99,
        eps: 1e-10,
    };
    /// Adam grafting with fb's `beta2 = 0.999`, `epsilon = 1e-10`.
    pub const ADAM: Grafting = Grafting::Adam {
        beta2: 0.999,
        eps: 1e-10,
    };

    /// Whether the grafting keeps a second-moment accumulator `v`.
    pub fn has_accumulator(self) -> bool {
        matches!(
            self,
            Grafting::AdaGrad { .. } | Grafting::RmsProp { .. } | Grafting::Adam { .. }
        )
    }

    /// `(β₂, ε, bias-corrected)` of an accumulating grafting.
    fn params(self) -> Option<(f64, f64, bool)> {
        match self {
            Grafting::AdaGrad { eps } => Some((1.0, eps, false)),
            Grafting::RmsProp { beta2, eps } => Some((beta2, eps, false)),
            Grafting::Adam { beta2, eps } => Some((beta2, eps, true)),
            Grafting::None | Grafting::Sgd => None,
        }
    }
}

/// The largest [`ShampooConfig::max_preconditioner_dim`]: a factor of a `65536`-wide block
/// already holds `2³²` elements (16 GiB); the bound keeps every factor's element count, and
/// the device kernels' dimensions, within 32 bits.
pub const MAX_PRECONDITIONER_DIM: usize = 1 << 16;

/// Shampoo hyperparameters; the defaults are fb's `DistributedShampoo` defaults
/// (`use_decoupled_weight_decay = True`, `grafting_config = None`; fb's README recommends
/// grafting from the optimizer being replaced, e.g. [`Grafting::ADAM`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShampooConfig {
    /// Learning rate (default `1e-2`).
    pub lr: f64,
    /// `β₁` of the filtered gradient (default `0.9`; `0` uses the raw gradient).
    pub beta1: f64,
    /// `β₂` of the factors (default `1.0`: plain accumulation, AdaGrad-like).
    pub beta2: f64,
    /// `ε` added to the factors' diagonal before the root (default `1e-12`; at least
    /// `f32::MIN_POSITIVE`, as the factors are `f32`).
    pub epsilon: f64,
    /// Decoupled weight decay, added to the search direction (default `0`).
    pub weight_decay: f64,
    /// Bias-correct the filtered gradient and (when `β₂ < 1`) the factors (default `true`).
    pub use_bias_correction: bool,
    /// Largest side `d` of a Shampoo block (default `1024`; at most
    /// [`MAX_PRECONDITIONER_DIM`]).
    pub max_preconditioner_dim: usize,
    /// Inverse roots are recomputed every `f` steps (default `1`).
    pub precondition_frequency: u64,
    /// First step that uses Shampoo (default `None`: `precondition_frequency`, fb's `-1`).
    /// Must be at least `precondition_frequency`.
    pub start_preconditioning_step: Option<u64>,
    /// Root exponent `e` for every factor (default `None`: `1/(2·order)`).
    pub inverse_exponent_override: Option<f64>,
    /// Grafting method (default [`Grafting::None`], fb's).
    pub grafting: Grafting,
}

impl Default for ShampooConfig {
    fn default() -> Self {
        ShampooConfig {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 1.0,
            epsilon: 1e-12,
            weight_decay: 0.0,
            use_bias_correction: true,
            max_preconditioner_dim: 1024,
            precondition_frequency: 1,
            start_preconditioning_step: None,
            inverse_exponent_override: None,
            grafting: Grafting::None,
        }
    }
}

impl ShampooConfig {
    /// fb's checks: `0 ≤ β₁ < 1`, `0 < β₂ ≤ 1`, `ε > 0`, `wd ≥ 0`, all finite; `d ≥ 1`,
    /// `f ≥ 1`, `start ≥ f`; an exponent override `> 0`; grafting `ε > 0`, `0 < β₂ᵍ ≤ 1`; and
    /// the rates of [`ShampooConfig::check_rates`].
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String, reason: &str| {
            Err(Error::BadInput {
                op: "ShampooConfig::validate",
                what,
                reason: reason.into(),
            })
        };
        check_hyperparameters(
            "ShampooConfig::validate",
            "need 0 ≤ beta1 < 1, 0 < beta2 ≤ 1, weight_decay ≥ 0, and epsilon at least \
             f32::MIN_POSITIVE (1.2e-38): the factors add it in f32, where a smaller one is 0",
            &[
                ("beta1", self.beta1, (0.0..1.0).contains(&self.beta1)),
                ("beta2", self.beta2, self.beta2 > 0.0 && self.beta2 <= 1.0),
                ("epsilon", self.epsilon, self.epsilon >= MIN_EPS),
                ("weight_decay", self.weight_decay, self.weight_decay >= 0.0),
            ],
        )?;
        self.check_rates("ShampooConfig::validate", self.lr)?;
        if self.max_preconditioner_dim == 0 {
            return bad(
                "max_preconditioner_dim = 0".into(),
                "blocks need a positive side",
            );
        }
        if self.max_preconditioner_dim > MAX_PRECONDITIONER_DIM {
            return bad(
                format!("max_preconditioner_dim = {}", self.max_preconditioner_dim),
                "at most 65536: a larger block's factor would hold more than 2³² elements \
                 (16 GiB each)",
            );
        }
        if self.precondition_frequency == 0 {
            return bad(
                "precondition_frequency = 0".into(),
                "roots are recomputed every f ≥ 1 steps",
            );
        }
        if self.start_step() < self.precondition_frequency {
            return bad(
                format!(
                    "start_preconditioning_step = {} with precondition_frequency = {}",
                    self.start_step(),
                    self.precondition_frequency
                ),
                "start_preconditioning_step must be at least precondition_frequency",
            );
        }
        if let Some(e) = self.inverse_exponent_override {
            if !(e > 0.0 && e.is_finite()) {
                return bad(
                    format!("inverse_exponent_override = {e}"),
                    "the root exponent must be positive and finite",
                );
            }
        }
        if let Some((beta2, eps, _)) = self.grafting.params() {
            // The grafting denominator is an f32 `√v + ε`: ε must not round to zero there.
            if !(beta2 > 0.0 && beta2 <= 1.0 && eps >= MIN_EPS && eps.is_finite()) {
                return bad(
                    format!("grafting {:?}", self.grafting),
                    "grafting needs 0 < beta2 ≤ 1 and a finite epsilon ≥ f32::MIN_POSITIVE \
                     (1.2e-38)",
                );
            }
        }
        Ok(())
    }

    /// `Err(BadInput)` from `op` unless the rate `lr` and its decay `lr·weight_decay` pass
    /// [`ragged::optim::check_rates`]: the check [`ShampooConfig::validate`] and
    /// [`Optimizer::set_learning_rate`] share.
    pub fn check_rates(&self, op: &'static str, lr: f64) -> Result<()> {
        ragged::optim::check_rates(op, "lr", lr, self.weight_decay)
    }

    /// The step Shampoo starts at (`start_preconditioning_step`, or `f` when `None`).
    pub fn start_step(&self) -> u64 {
        self.start_preconditioning_step
            .unwrap_or(self.precondition_frequency)
    }

    /// Whether the inverse roots are recomputed at step `t` (fb's `compute_root_inverse`).
    pub fn computes_roots_at(&self, t: u64) -> bool {
        let start = self.start_step();
        t == start || (t > start && t.is_multiple_of(self.precondition_frequency))
    }
}

/// Shampoo state of one rank's shard of one group (see the module doc for the layout), in the
/// memory [`Shampoo::init_on`] was given (host or device).
#[derive(Debug, PartialEq)]
pub struct ShampooState {
    /// Steps taken (`t`). `0` before the first step.
    pub step: u64,
    /// Filtered gradient (fb's `filtered_grad`), `f32`, `shard.len` elements.
    pub m: Storage<f32>,
    /// Grafting accumulator, `shard.len` elements; empty for [`Grafting::None`] and
    /// [`Grafting::Sgd`].
    pub v: Storage<f32>,
    /// Every local block's factors (`L` then `R`, row-major), in shard order.
    pub factors: Storage<f32>,
    /// The inverse roots of `factors`, same layout; the identity until first computed.
    pub roots: Storage<f32>,
    /// Inverse roots that could not be computed on this rank (a non-finite factor, or neither
    /// eigendecomposition converged), each of which kept the previous root; cumulative.
    /// A diagnostic of this rank's run: [`ShampooState::to_le_bytes`] keeps it, checkpoints
    /// (which load at any world size, so have no per-rank counters) start it again at 0.
    pub root_failures: u64,
}

const MAGIC: u64 = u64::from_le_bytes(*b"SHAMPOO2");
const HEADER_WORDS: usize = 6;
/// The first format: no `root_failures` word (read as 0).
const MAGIC_V1: u64 = u64::from_le_bytes(*b"SHAMPOO1");

impl ShampooState {
    /// A copy in the same memory.
    pub fn try_clone(&self) -> Result<Self> {
        Ok(ShampooState {
            step: self.step,
            m: self.m.try_clone()?,
            v: self.v.try_clone()?,
            factors: self.factors.try_clone()?,
            roots: self.roots.try_clone()?,
            root_failures: self.root_failures,
        })
    }

    /// The same state in the memory `place` names (a copy of every array).
    pub fn to_placement(&self, place: &Placement) -> Result<Self> {
        Ok(ShampooState {
            step: self.step,
            m: place.put(self.m.to_vec()?)?,
            v: place.put(self.v.to_vec()?)?,
            factors: place.put(self.factors.to_vec()?)?,
            roots: place.put(self.roots.to_vec()?)?,
            root_failures: self.root_failures,
        })
    }

    /// Serializes the state: a magic word, `step`, `len(m)`, `len(v)`, `len(factors)`,
    /// `root_failures` as u64, then `m`, `v`, `factors`, `roots` as `f32`; all little-endian
    /// (device arrays are downloaded). Exact: loading gives back the same bits. (`roots` must
    /// have `factors`' length.)
    pub fn to_le_bytes(&self) -> Result<Vec<u8>> {
        let (m, v) = (self.m.host()?, self.v.host()?);
        let (factors, roots) = (self.factors.host()?, self.roots.host()?);
        let n = m.len() + v.len() + factors.len() + roots.len();
        let mut out = Vec::with_capacity(8 * HEADER_WORDS + 4 * n);
        for w in [
            MAGIC,
            self.step,
            m.len() as u64,
            v.len() as u64,
            factors.len() as u64,
            self.root_failures,
        ] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        for x in m.iter().chain(&*v).chain(&*factors).chain(&*roots) {
            out.extend_from_slice(&x.to_le_bytes());
        }
        Ok(out)
    }

    /// Loads a state written by [`ShampooState::to_le_bytes`] (or by the first format, without
    /// `root_failures`); `Err` on a wrong magic word or a byte count that is not the one the
    /// header announces. (Whether the state fits a shard is checked by [`Shampoo::step`].)
    pub fn from_le_bytes(bytes: &[u8]) -> Result<Self> {
        let bad = |reason: String| Error::BadInput {
            op: "ShampooState::from_le_bytes",
            what: format!("{} bytes", bytes.len()),
            reason,
        };
        let word = |k: usize| {
            let b = bytes.get(8 * k..8 * k + 8)?;
            Some(u64::from_le_bytes(b.try_into().ok()?))
        };
        let header = match word(0) {
            Some(MAGIC) => HEADER_WORDS,
            Some(MAGIC_V1) => HEADER_WORDS - 1,
            Some(_) => return Err(bad("not a Shampoo state (wrong magic word)".into())),
            None => return Err(bad("shorter than the 8-byte magic word".into())),
        };
        if bytes.len() < 8 * header {
            return Err(bad(format!("shorter than the {}-byte header", 8 * header)));
        }
        let word = |k: usize| word(k).unwrap_or(0);
        let (step, m, v, f) = (word(1), word(2), word(3), word(4));
        let root_failures = if header == HEADER_WORDS { word(5) } else { 0 };
        let floats = (|| {
            let m = usize::try_from(m).ok()?;
            let v = usize::try_from(v).ok()?;
            let f = usize::try_from(f).ok()?;
            m.checked_add(v)?.checked_add(f.checked_mul(2)?)
        })();
        let want = floats
            .and_then(|n| n.checked_mul(4))
            .and_then(|n| n.checked_add(8 * header));
        if want != Some(bytes.len()) {
            return Err(bad(format!(
                "header announces {m} + {v} moment and 2 × {f} factor elements"
            )));
        }
        let (m, v, f) = (m as usize, v as usize, f as usize);
        let all: Vec<f32> = bytes[8 * header..]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let (ms, rest) = all.split_at(m);
        let (vs, rest) = rest.split_at(v);
        let (fs, rs) = rest.split_at(f);
        Ok(ShampooState {
            step,
            m: ms.to_vec().into(),
            v: vs.to_vec().into(),
            factors: fs.to_vec().into(),
            roots: rs.to_vec().into(),
            root_failures,
        })
    }
}

/// One local Shampoo block: `rows × cols` elements of a parameter whose rows are `stride`
/// elements long, starting at shard offset `at`; its factors start at `factor_at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Shard offset of the block's first element.
    pub at: usize,
    /// Row length of the parameter (elements between the block's rows).
    pub stride: usize,
    /// Rows of the block (`≤ d`).
    pub rows: usize,
    /// Columns of the block (`≤ d`).
    pub cols: usize,
    /// Offset of the block's factors (and roots) in [`ShampooState::factors`].
    pub factor_at: usize,
}

impl Block {
    /// Whether the block has a left factor (`rows > 1`).
    pub fn has_left(&self) -> bool {
        self.rows > 1
    }
    /// Whether the block has a right factor (`cols > 1`).
    pub fn has_right(&self) -> bool {
        self.cols > 1
    }
    /// Number of factors (the block's order after squeezing size-1 dims).
    pub fn order(&self) -> usize {
        usize::from(self.has_left()) + usize::from(self.has_right())
    }
    /// Elements of the block's factors (`rows²` if it has `L`, plus `cols²` if it has `R`).
    pub fn factor_len(&self) -> usize {
        let l = if self.has_left() {
            self.rows * self.rows
        } else {
            0
        };
        let r = if self.has_right() {
            self.cols * self.cols
        } else {
            0
        };
        l + r
    }
    /// Shard offset of element `(i, j)` of the block.
    fn idx(&self, i: usize, j: usize) -> usize {
        self.at + i * self.stride + j
    }
    /// The block's elements of `buf` (a shard buffer), row-major.
    fn gather(&self, buf: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for i in 0..self.rows {
            let s = self.idx(i, 0);
            out.extend_from_slice(&buf[s..s + self.cols]);
        }
        out
    }
}

/// Blocked Shampoo on local shards: hyperparameters (and, with the `cuda` feature, the device
/// step's buffers, kept between steps); see the module doc.
#[derive(Clone, Debug, PartialEq)]
pub struct Shampoo {
    config: ShampooConfig,
    /// The device step's buffers ([`crate::cuda::shampoo`]).
    #[cfg(feature = "cuda")]
    pub(crate) device_work: crate::common::BetweenSteps<crate::cuda::shampoo::DeviceWork>,
}

impl Shampoo {
    /// A Shampoo with validated hyperparameters ([`ShampooConfig::validate`]).
    pub fn new(config: ShampooConfig) -> Result<Self> {
        config.validate()?;
        Ok(Shampoo {
            config,
            #[cfg(feature = "cuda")]
            device_work: Default::default(),
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &ShampooConfig {
        &self.config
    }

    /// The local Shampoo blocks of `shard`, in shard order, and their total factor elements.
    /// `Err(InvalidShard)` when a piece starts or ends inside a row block.
    pub fn blocks(&self, shard: &LocalShard) -> Result<(Vec<Block>, usize)> {
        const OP: &str = "Shampoo::blocks";
        shard.check(OP)?;
        let d = self.config.max_preconditioner_dim;
        let mut out = Vec::new();
        let mut factor_at = 0;
        for piece in &shard.pieces {
            let meta = &shard.params[piece.param];
            let numel = meta.numel();
            let cols = meta.shape.last().copied().unwrap_or(1).max(1);
            let block_elems = d.saturating_mul(cols).min(numel);
            let edge = |e: usize| e.is_multiple_of(block_elems) || e == numel;
            if !edge(piece.range.start) || !edge(piece.range.end) {
                let cut = if edge(piece.range.start) {
                    piece.range.end
                } else {
                    piece.range.start
                };
                let rows = numel / cols;
                let lo = (cut / block_elems) * (block_elems / cols);
                let hi = (lo + block_elems / cols).min(rows);
                return Err(Error::InvalidShard {
                    op: OP,
                    reason: format!(
                        "Shampoo cannot hold rank {}'s elements {:?} of {} {:?}: the piece edge \
                         at element {cut} (row {} of {rows} rows of {cols}) falls inside the \
                         Shampoo block of rows {lo}..{hi} (blocks are {d} rows, \
                         max_preconditioner_dim), whose Kronecker factors are built from the \
                         whole block's gradient on one rank. Plan with AtomicBlock::Rows({d}); \
                         a layout that splits dim 0 into ⌈rows/V⌉-row chunks (the FSDP2-style \
                         layout) cuts every tensor of at most {d} rows held by 2 or more ranks",
                        shard.rank,
                        piece.range,
                        meta.name,
                        meta.shape,
                        cut / cols,
                    ),
                });
            }
            let mut row = piece.range.start / cols;
            let end_row = piece.range.end / cols;
            while row < end_row {
                let rows = d.min(end_row - row);
                let mut c0 = 0;
                while c0 < cols {
                    let c = d.min(cols - c0);
                    let b = Block {
                        at: piece.offset + (row * cols - piece.range.start) + c0,
                        stride: cols,
                        rows,
                        cols: c,
                        factor_at,
                    };
                    factor_at += b.factor_len();
                    out.push(b);
                    c0 += c;
                }
                row += rows;
            }
        }
        Ok((out, factor_at))
    }

    /// The root exponent of a factor of a block of this order.
    fn exponent(&self, order: usize) -> f64 {
        self.config
            .inverse_exponent_override
            .unwrap_or(1.0 / (2 * order.max(1)) as f64)
    }
}

/// Each block with its own part of `x`, an array in the factors' layout (factors or roots).
fn per_block<'a>(blocks: &'a [Block], mut x: &'a mut [f32]) -> Vec<(&'a Block, &'a mut [f32])> {
    let mut out = Vec::with_capacity(blocks.len());
    for b in blocks {
        let (part, rest) = std::mem::take(&mut x).split_at_mut(b.factor_len());
        out.push((b, part));
        x = rest;
    }
    out
}

/// Identity matrices in every root slot of `blocks`.
fn identity_roots(blocks: &[Block], len: usize) -> Vec<f32> {
    let mut roots = vec![0.0; len];
    for b in blocks {
        let mut at = b.factor_at;
        for (has, n) in [(b.has_left(), b.rows), (b.has_right(), b.cols)] {
            if has {
                for i in 0..n {
                    roots[at + i * n + i] = 1.0;
                }
                at += n * n;
            }
        }
    }
    roots
}

/// [`Optimizer::events`]' name for [`ShampooState::root_failures`].
pub const ROOT_FAILURES: &str = "Shampoo roots not computed (previous root kept)";

impl Optimizer for Shampoo {
    type State = ShampooState;

    fn name(&self) -> &'static str {
        "shampoo"
    }

    fn events(&self, state: &ShampooState) -> Vec<(&'static str, u64)> {
        vec![(ROOT_FAILURES, state.root_failures)]
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
        AtomicBlock::Rows(self.config.max_preconditioner_dim)
    }

    fn init(&self, shard: &LocalShard) -> Result<ShampooState> {
        self.init_on(shard, &Placement::Cpu)
    }

    /// The state in `place`: zero moments and factors, identity roots.
    fn init_on(&self, shard: &LocalShard, place: &Placement) -> Result<ShampooState> {
        let (blocks, len) = self.blocks(shard)?;
        let vlen = if self.config.grafting.has_accumulator() {
            shard.len
        } else {
            0
        };
        Ok(ShampooState {
            step: 0,
            m: place.zeros(shard.len)?,
            v: place.zeros(vlen)?,
            factors: place.zeros(len)?,
            roots: place.put(identity_roots(&blocks, len))?,
            root_failures: 0,
        })
    }

    /// On the CPU, or on the GPU that holds the shard (module doc, "Where it runs").
    fn step(
        &self,
        state: &mut ShampooState,
        shard: &LocalShard,
        params: ViewMut<'_, f32>,
        grads: View<'_, f32>,
        _comm: &dyn Communicator,
    ) -> Result<()> {
        const OP: &str = "Shampoo::step";
        let blocks = self.checked_blocks(state, shard, params.len(), grads.len())?;
        match params {
            ViewMut::Cpu(params) => {
                let grads = grads.cpu(OP)?;
                self.step_host(state, shard, &blocks, params, grads)
            }
            #[cfg(feature = "cuda")]
            ViewMut::Cuda(mut params) => {
                crate::cuda::shampoo::step(self, state, shard, &blocks, &mut params, grads)
            }
            #[allow(unreachable_patterns)]
            _ => Err(ragged::storage::no_backend(OP)),
        }
    }
}

/// The scalars of step `t` (module doc), as both backends use them: `f64` computations
/// rounded to `f32` once.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepScalars {
    /// `1 − β₁` when the filtered gradient is kept (`β₁ ≠ 0`).
    pub momentum: Option<f32>,
    /// `1 − β₁^t` when the filtered gradient is bias-corrected.
    pub bc1: Option<f32>,
    /// Grafting accumulator: `(β₂ᵍ, w, εᵍ, bc₂ᵍ)`, `w = 1 − β₂ᵍ` (AdaGrad: `β₂ᵍ = w = 1`).
    pub graft: Option<(f32, f32, f32, Option<f32>)>,
    /// The factors' `β₂` (`None` when `β₂ = 1`) and weight `w`.
    pub factor_decay: (Option<f32>, f32),
    /// The factors' bias correction `bc₂`.
    pub factor_bc2: Option<f32>,
    /// Whether step 4 runs.
    pub roots_now: bool,
    /// Step 7's direction: the grafting direction alone, `P_s`, or `P_s` grafted.
    pub direction: Direction,
    /// `−lr`.
    pub neg_lr: f32,
    /// Decoupled weight decay.
    pub wd: Option<f32>,
}

/// Step 7's direction of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// `P = P_g` (before `start`, with grafting).
    GraftOnly,
    /// `P = P_s` (no grafting).
    Shampoo,
    /// `P = (‖P_g‖ / (‖P_s‖ + 1e-16))·P_s`.
    Grafted,
}

impl Shampoo {
    /// The block layout of `shard` after checking every length against it.
    pub(crate) fn checked_blocks(
        &self,
        state: &ShampooState,
        shard: &LocalShard,
        params: usize,
        grads: usize,
    ) -> Result<Vec<Block>> {
        const OP: &str = "Shampoo::step";
        check_len(OP, "params", params, shard.len)?;
        check_len(OP, "grads", grads, shard.len)?;
        check_len(OP, "state.m", state.m.len(), shard.len)?;
        let vlen = if self.config.grafting.has_accumulator() {
            shard.len
        } else {
            0
        };
        check_len(OP, "state.v", state.v.len(), vlen)?;
        let (blocks, flen) = self.blocks(shard)?;
        check_len(OP, "state.factors", state.factors.len(), flen)?;
        check_len(OP, "state.roots", state.roots.len(), flen)?;
        Ok(blocks)
    }

    /// The scalars of step `t`.
    pub(crate) fn scalars(&self, t: u64) -> StepScalars {
        let c = &self.config;
        let tf = t as f64;
        let graft = c.grafting.params().map(|(b2, eps, bc)| {
            let bc2 = bc.then(|| (1.0 - b2.powf(tf)) as f32);
            let w = if b2 == 1.0 { 1.0 } else { (1.0 - b2) as f32 };
            (b2 as f32, w, eps as f32, bc2)
        });
        let direction = if c.grafting == Grafting::None {
            Direction::Shampoo
        } else if t < c.start_step() {
            Direction::GraftOnly
        } else {
            Direction::Grafted
        };
        StepScalars {
            momentum: (c.beta1 != 0.0).then_some((1.0 - c.beta1) as f32),
            bc1: (c.use_bias_correction && c.beta1 != 0.0).then(|| (1.0 - c.beta1.powf(tf)) as f32),
            graft,
            factor_decay: if c.beta2 < 1.0 {
                (Some(c.beta2 as f32), (1.0 - c.beta2) as f32)
            } else {
                (None, 1.0)
            },
            factor_bc2: (c.use_bias_correction && c.beta2 < 1.0)
                .then(|| (1.0 - c.beta2.powf(tf)) as f32),
            roots_now: c.computes_roots_at(t),
            direction,
            neg_lr: (-c.lr) as f32,
            wd: (c.weight_decay != 0.0).then_some(c.weight_decay as f32),
        }
    }

    /// Step 4 on every block of a host copy of the state's factors and roots (both backends):
    /// returns how many roots failed.
    pub(crate) fn compute_all_roots(
        &self,
        blocks: &[Block],
        factors: &[f32],
        roots: &mut [f32],
        bc2: Option<f32>,
    ) -> u64 {
        per_block(blocks, roots)
            .into_par_iter()
            .map(|(b, r)| {
                let f = &factors[b.factor_at..b.factor_at + b.factor_len()];
                let e = self.exponent(b.order());
                compute_roots(b, f, r, bc2, self.config.epsilon, e)
            })
            .sum()
    }
}

/// `Err(BadInput)` for non-finite gradients, `what` naming them (module doc, "Non-finite
/// gradients"): the host names the first, the device counts them.
pub(crate) fn non_finite(op: &'static str, what: String) -> Error {
    Error::BadInput {
        op,
        what,
        reason: "gradients must be finite; nothing was updated".into(),
    }
}

impl Shampoo {
    /// [`Optimizer::step`] on host memory: the module doc's steps 1–9 (after
    /// [`Shampoo::checked_blocks`]).
    fn step_host(
        &self,
        state: &mut ShampooState,
        shard: &LocalShard,
        blocks: &[Block],
        params: &mut [f32],
        grads: &[f32],
    ) -> Result<()> {
        const OP: &str = "Shampoo::step";
        if let Some(i) = grads.iter().position(|g| !g.is_finite()) {
            return Err(non_finite(OP, format!("grads[{i}] = {}", grads[i])));
        }
        let t = next_step(OP, state.step)?;
        let sc = self.scalars(t);
        let (m, v) = (state.m.cpu_mut()?, state.v.cpu_mut()?);
        let (factors, roots) = (state.factors.cpu_mut()?, state.roots.cpu_mut()?);
        state.step = t;

        // Steps 3, 5, 6: element-wise, over the pieces (padding untouched).
        let mut gbar = vec![0.0f32; shard.len];
        let mut pg = vec![0.0f32; shard.len];
        for piece in &shard.pieces {
            for i in piece.offset..piece.offset + piece.range.len() {
                let g = grads[i];
                let gb = match sc.momentum {
                    Some(w1) => {
                        m[i] = lerp_elem(m[i], g, w1);
                        sc.bc1.map_or(m[i], |bc| m[i] / bc)
                    }
                    None => g,
                };
                gbar[i] = gb;
                pg[i] = match sc.graft {
                    Some((b2, w2, eps, bc2)) => {
                        v[i] = ema_sq_elem(v[i], g, b2, w2);
                        gb / (bc2.map_or(v[i], |bc| v[i] / bc).sqrt() + eps)
                    }
                    None => gb,
                };
            }
        }

        // Step 2 per block (in parallel), step 4, then step 7 per block and steps 8–9.
        let (b2, w2) = sc.factor_decay;
        per_block(blocks, factors)
            .into_par_iter()
            .for_each(|(b, f)| update_factors(b, &b.gather(grads), f, b2, w2));
        if sc.roots_now {
            state.root_failures += self.compute_all_roots(blocks, factors, roots, sc.factor_bc2);
        }
        let dirs: Vec<Vec<f32>> = blocks
            .par_iter()
            .map(|b| {
                let pg_b = b.gather(&pg);
                if sc.direction == Direction::GraftOnly {
                    return pg_b;
                }
                let r = &roots[b.factor_at..b.factor_at + b.factor_len()];
                let ps = precondition(b, &b.gather(&gbar), r);
                if sc.direction == Direction::Shampoo {
                    return ps;
                }
                let scale = norm(&pg_b) / (norm(&ps) + 1e-16f32);
                ps.into_iter().map(|x| x * scale).collect()
            })
            .collect();
        for (b, dir) in blocks.iter().zip(&dirs) {
            for i in 0..b.rows {
                let s = b.idx(i, 0);
                let row = &dir[i * b.cols..(i + 1) * b.cols];
                for (p, &d) in params[s..s + b.cols].iter_mut().zip(row) {
                    let d = match sc.wd {
                        Some(wd) => d + wd * *p,
                        None => d,
                    };
                    *p += sc.neg_lr * d;
                }
            }
        }
        Ok(())
    }
}

/// Lanes of the grafting norms' `f64` sums (element `e` of a block, row-major, in lane
/// `e mod 32`), combined as a tree: lane `l` adds lane `l + h` for `h` = 16, 8, 4, 2, 1. A
/// fixed order, which the device's warp of 32 lanes follows too (`kernels/shampoo.cu`).
pub(crate) const NORM_LANES: usize = 32;

/// `‖x‖₂`: squares of `f32` (exact in `f64`) summed in `f64` in [`NORM_LANES`] lanes, `√` in
/// `f64`, rounded once.
fn norm(x: &[f32]) -> f32 {
    let mut s = [0.0f64; NORM_LANES];
    for (e, &v) in x.iter().enumerate() {
        s[e % NORM_LANES] += f64::from(v) * f64::from(v);
    }
    let mut h = NORM_LANES / 2;
    while h > 0 {
        for l in 0..h {
            s[l] += s[l + h];
        }
        h /= 2;
    }
    s[0].sqrt() as f32
}

/// Rows of a `rows × cols` row-major matrix transposed (`cols × rows`).
fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = x[i * cols + j];
        }
    }
    t
}

/// The Gram matrix `X·Xᵀ` of the `n` rows (length `k`) of `x`, `f64`-accumulated, rounded
/// once. Exactly symmetric: element `(i, j)` and `(j, i)` sum the same exact products in the
/// same order.
fn gram(x: &[f32], n: usize, k: usize) -> Vec<f32> {
    mul_abt(x, x, n, n, k)
}

/// Step 2 on one block: `F ← β₂·F + w·(G·Gᵀ or Gᵀ·G)` (`β₂·F` skipped when `β₂ = 1`).
fn update_factors(b: &Block, g: &[f32], f: &mut [f32], beta2: Option<f32>, w: f32) {
    let mut at = 0;
    let mut acc = |outer: Vec<f32>| {
        for (f, o) in f[at..at + outer.len()].iter_mut().zip(&outer) {
            let f0 = match beta2 {
                Some(b2) => *f * b2,
                None => *f,
            };
            *f = if beta2.is_some() { f0 + w * o } else { f0 + o };
        }
        at += outer.len();
    };
    if b.has_left() {
        acc(gram(g, b.rows, b.cols));
    }
    if b.has_right() {
        acc(gram(&transpose(g, b.rows, b.cols), b.cols, b.rows));
    }
}

/// Step 4 on one block: every factor's inverse root into `r` (kept when it fails). Returns
/// how many failed.
fn compute_roots(b: &Block, f: &[f32], r: &mut [f32], bc2: Option<f32>, eps: f64, e: f64) -> u64 {
    let left = if b.has_left() { b.rows * b.rows } else { 0 };
    let (f_left, f_right) = f.split_at(left);
    let (r_left, r_right) = r.split_at_mut(left);
    // The two factors' roots are independent: on two threads when rayon has them (a rank
    // holding a single block would otherwise leave the others idle), the same bits.
    let one = |has: bool, n: usize, f: &[f32], r: &mut [f32]| -> u64 {
        if !has {
            return 0;
        }
        match inverse_root(f, n, bc2, eps, e) {
            Some(x) => {
                r.copy_from_slice(&x);
                0
            }
            None => 1,
        }
    };
    let (l, rr) = rayon::join(
        || one(b.has_left(), b.rows, f_left, r_left),
        || one(b.has_right(), b.cols, f_right, r_right),
    );
    l + rr
}

/// Step 7's `P_s` on one block: `L^(−e)·Ḡ·R^(−e)` (only the factors the block has).
fn precondition(b: &Block, gbar: &[f32], r: &[f32]) -> Vec<f32> {
    let (n, c) = (b.rows, b.cols);
    let mut x = gbar.to_vec();
    let mut at = 0;
    if b.has_left() {
        // (L·X)[i][j] = Σ_k L[i][k]·X[k][j] = L row i · (Xᵀ) row j.
        let xt = transpose(&x, n, c);
        x = mul_abt(&r[at..at + n * n], &xt, n, c, n);
        at += n * n;
    }
    if b.has_right() {
        // (X·R)[i][j] = Σ_k X[i][k]·R[k][j] = X row i · R row j (R symmetric).
        x = mul_abt(&x, &r[at..at + c * c], n, c, c);
    }
    x
}

/// The inverse root `(A/bc + εI)^(−e)` of a symmetric `n × n` row-major matrix `a` (see the
/// module doc): `f32` eigendecomposition, retried in `f64`; `λ ← λ − λ_min + ε` when
/// `λ_min < ε`; `Q·diag(λ^(−e))·Qᵀ` in `f64`, rounded once and exactly symmetric. `None` when
/// `a` is not finite or both eigendecompositions fail.
///
/// # Panics
/// If `a` does not hold `n²` elements.
#[track_caller]
pub fn inverse_root(a: &[f32], n: usize, bc: Option<f32>, eps: f64, e: f64) -> Option<Vec<f32>> {
    inverse_root_with(a, n, bc, eps, e, Precision::F32ThenF64)
}

/// [`inverse_root`] with the `f64` eigendecomposition only: the retry path, public so that it
/// can be tested on its own (an `f32` failure is hard to provoke on purpose).
///
/// # Panics
/// If `a` does not hold `n²` elements.
#[track_caller]
pub fn inverse_root_f64(
    a: &[f32],
    n: usize,
    bc: Option<f32>,
    eps: f64,
    e: f64,
) -> Option<Vec<f32>> {
    inverse_root_with(a, n, bc, eps, e, Precision::F64)
}

/// Which eigendecompositions [`inverse_root_with`] tries.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Precision {
    F32ThenF64,
    F64,
}

#[track_caller]
fn inverse_root_with(
    a: &[f32],
    n: usize,
    bc: Option<f32>,
    eps: f64,
    e: f64,
    precision: Precision,
) -> Option<Vec<f32>> {
    assert_eq!(
        a.len(),
        n * n,
        "inverse_root: {} elements for {n}×{n}",
        a.len()
    );
    if a.iter().any(|x| !x.is_finite()) {
        return None;
    }
    let eps32 = eps as f32;
    let mut m = a.to_vec();
    if let Some(bc) = bc {
        m.iter_mut().for_each(|x| *x /= bc);
    }
    for i in 0..n {
        m[i * n + i] += eps32;
    }
    let f32_try = (precision == Precision::F32ThenF64)
        .then(|| eigh(n, |i, j| m[i * n + j]))
        .flatten();
    let (lambda, qr) = match f32_try {
        Some(x) => x,
        None => eigh(n, |i, j| f64::from(m[i * n + j]))?,
    };
    let lmin = lambda.iter().copied().fold(f64::INFINITY, f64::min);
    let shift = if lmin < eps { eps - lmin } else { 0.0 };
    let d: Vec<f64> = lambda.iter().map(|&l| (l + shift).powf(-e)).collect();
    // X_ij = Σ_k (d_k·Q_ik)·Q_jk, over the rows of Q.
    let x = lane_dot::scaled_gram_sym(&qr, &d, n);
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// The eigendecomposition of the symmetric `n × n` matrix whose element `(i, j)` is `a(i, j)`
/// (its lower triangle is read) by faer, in the precision of `T`: the eigenvalues and the rows
/// of `Q` (`Q[i][k]` at `i·n + k`), widened to `f64`; `None` when it does not converge or a
/// value is not finite.
fn eigh<T>(n: usize, a: impl Fn(usize, usize) -> T) -> Option<(Vec<f64>, Vec<f64>)>
where
    T: faer::traits::RealField + Copy + Into<f64>,
{
    let evd = Mat::<T>::from_fn(n, n, a)
        .self_adjoint_eigen(Side::Lower)
        .ok()?;
    let (s, u) = (evd.S(), evd.U());
    let lambda: Vec<f64> = (0..n).map(|k| s[k].into()).collect();
    let mut rows = vec![0.0f64; n * n];
    for i in 0..n {
        for k in 0..n {
            rows[i * n + k] = u[(i, k)].into();
        }
    }
    let finite = lambda.iter().chain(&rows).all(|x| x.is_finite());
    finite.then_some((lambda, rows))
}
