//! Muon on a local shard: `torch.optim.Muon` (lerp momentum, Nesterov, quintic Newton–Schulz,
//! decoupled weight decay) in `f32`, with AdamW for the parameters Muon does not handle.
//!
//! Muon: Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024);
//! scale rule `match_rms_adamw`: Liu et al., "Muon is Scalable for LLM Training" (Moonlight,
//! arXiv:2502.16982).
//!
//! # Which parameters Muon updates
//! A parameter of two or more dimensions whose role ([`MuonConfig::roles`], [`ragged::roles`])
//! is [`Role::Matrix`] is a *Muon parameter*: its trailing `rows × cols` matrices (each expert
//! of `[E, m, n]`) are orthogonalized one by one, or the whole tensor as one `[d₀, d₁·…]`
//! matrix from four dimensions on, or three for a name with `conv` (a conv filter;
//! [`MuonConfig::flattens`]). Every other
//! parameter (0-D, 1-D, embeddings, output heads: by default) is updated by [`AdamW`] with the
//! `adamw` settings of [`MuonConfig`]; a `Frozen` one is not stepped. Each role's settings scale its learning rate
//! and can replace its weight decay.
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
//! `scale` is [`LrScale`]: `original` `√max(1, rows/cols)` (torch's default),
//! `match_rms_adamw` `0.2·√max(rows, cols)` or `spectral_unclamped` `√(rows/cols)`, all on the
//! *matrix's* shape. Scalars are
//! `f64`, rounded to `f32` once where they meet a tensor; element operations are single `f32`
//! operations without FMA (see [`crate::adamw`] for the precision contract).
//!
//! # Differences from torch
//! - Working dtype `f32` by default, not bf16 (torch casts the NS input to bf16); set
//!   [`NsConfig::precision`] to `Bf16` for torch's dtype (see [`crate::newton_schulz`]).
//! - The Frobenius norm is summed in `f64` (see [`crate::newton_schulz`]).
//! - torch refuses non-2-D parameters; here a 3-D `[…, m, n]` (MoE experts) runs NS per
//!   trailing matrix, and from [`MuonConfig::flatten_min_dims`] (4) dimensions on the tensor is
//!   one matrix `[d₀, d₁·…]`: a conv filter `[out, in, kh, kw]` is orthogonalized as
//!   `[out, in·kh·kw]`, as Keller Jordan's Muon flattens it ([`MuonConfig::matrices_of`]); so is
//!   a 3-D parameter named like a conv (`conv1d.weight` `[out, in, k]`:
//!   [`MuonConfig::flatten_patterns`]). Other parameters fall back to AdamW.
//!
//! # Sharding
//! [`Muon::atomic_block`] is [`AtomicBlock::Matrix`] for Muon parameters
//! ([`AtomicBlock::Whole`] for flattened ones): the block the math needs. How matrices are
//! actually laid out is negotiable, per tensor ([`MuonConfig::layout`], [`Muon::plan_layout`],
//! [`crate::muon_layout`]):
//! - a matrix **whole on one rank** is orthogonalized in place, with no communication (with
//!   bf16 Newton–Schulz on the AMX products, `U` itself is kept in bf16:
//!   the same values in half the bytes);
//! - a matrix **split over ranks** (a row-split plan, or FSDP2's `Shard(0)`) gets a root
//!   chosen by longest-processing-time ([`crate::roots`]); one batched all-to-all gathers
//!   every split matrix's `U` to its root, the root runs Newton–Schulz, one all-to-all sends
//!   each holder its rows of `O` back (both in bf16 when Newton–Schulz runs in bf16, which
//!   rounds its input to bf16 first and returns bf16 values: the same bits in half the
//!   bytes). Element steps 1–2 and 4–5 run where the elements live.
//!
//! Either way Newton–Schulz sees the whole matrix, bit for bit the unsharded one, so a
//! sharded step equals the unsharded step bitwise. A partial matrix is never orthogonalized:
//! if the communicator is not the shard's world, the step returns an error before anything
//! is modified.
//!
//! # State
//! [`MuonState`]: `m` holds Muon's momentum buffer on Muon pieces and Adam's first moment on
//! the others (one element per shard element); `v` holds Adam's second moment of the pieces
//! that are not Muon matrices only, concatenated in shard order ([`Muon::fallback_len`]), so
//! Muon's matrices keep 4 bytes of state per element, not AdamW's 8; `step` counts steps
//! (AdamW's bias correction uses it).

use std::ops::Range;

use half::bf16;
use rayon::prelude::*;

use ragged::comm::Communicator;
use ragged::model::Unit;
use ragged::optim::{LocalPiece, LocalShard, Optimizer, ParamMeta};
use ragged::plan::{Plan, PlanOptions};
use ragged::storage::{Placement, Storage, View, ViewMut};
use ragged::{AtomicBlock, Error, Result, Role, RoleRule};

use crate::adamw::{adamw_update, AdamRun, AdamW, AdamWConfig, PAR_CHUNK, PAR_MIN_ELEMS};
use crate::common::{
    self, check_hyperparameters, check_step_inputs_with_v, decay_elem, f32_state_from_le_bytes,
    f32_state_to_le_bytes, lerp_elem, next_step, BetweenSteps, MomentCoeffs,
};
use crate::muon_layout::{LayoutCache, MatrixLayout};
use crate::newton_schulz::{
    ns_macs, orthogonalize, orthogonalize_many, orthogonalize_many_bf16, resolve_config,
    takes_bf16_input, NsConfig, NsShape,
};
use crate::roots::{RootPlan, RouteElem, Routes};

/// Muon's state on one rank's shard (module doc, "State"), in host or device memory
/// ([`Storage`]); a checkpoint is these three fields ([`MuonState::to_le_bytes`]).
#[derive(Debug, PartialEq)]
pub struct MuonState {
    /// Steps taken (`t`). `0` before the first step.
    pub step: u64,
    /// Muon's momentum buffer on Muon pieces, Adam's first moment on the others:
    /// `shard.len` elements.
    pub m: Storage<f32>,
    /// Adam's second moment of the pieces that are not Muon matrices, concatenated in shard
    /// order: [`Muon::fallback_len`] elements.
    pub v: Storage<f32>,
}

impl MuonState {
    /// Zero moments in the memory `place` names: `m_len` elements of `m`, `v_len` of `v`.
    pub fn zeros_on(place: &Placement, m_len: usize, v_len: usize) -> Result<Self> {
        Ok(MuonState {
            step: 0,
            m: place.zeros(m_len)?,
            v: place.zeros(v_len)?,
        })
    }

    /// A copy in the same memory (a device copy for device moments).
    pub fn try_clone(&self) -> Result<Self> {
        Ok(MuonState {
            step: self.step,
            m: self.m.try_clone()?,
            v: self.v.try_clone()?,
        })
    }

    /// Both moments as host slices (`Err` when they live on a device).
    pub fn host_mut(&mut self) -> Result<(&mut [f32], &mut [f32])> {
        Ok((self.m.cpu_mut()?, self.v.cpu_mut()?))
    }

    /// Bytes of optimizer state held (both moments; not the step).
    pub fn state_bytes(&self) -> usize {
        4 * (self.m.len() + self.v.len())
    }

    /// Serializes the state: `step`, `m`'s and `v`'s lengths (u64 each), then `m` and `v` as
    /// `f32`, all little-endian (device moments are downloaded). Exact: loading gives back
    /// the same bits.
    pub fn to_le_bytes(&self) -> Result<Vec<u8>> {
        let (m, v) = (self.m.host()?, self.v.host()?);
        let header = [self.step, m.len() as u64, v.len() as u64];
        Ok(f32_state_to_le_bytes(&header, &[&m, &v]))
    }

    /// Loads a state written by [`MuonState::to_le_bytes`]; `Err` if the length is not the
    /// one the header announces.
    pub fn from_le_bytes(bytes: &[u8]) -> Result<Self> {
        let op = "MuonState::from_le_bytes";
        let ([step, m_len, _], floats) =
            f32_state_from_le_bytes(op, bytes, |&[_, m, v]| m.checked_add(v))?;
        let (m, v) = floats.split_at(m_len as usize);
        Ok(MuonState {
            step,
            m: m.to_vec().into(),
            v: v.to_vec().into(),
        })
    }
}

/// How the learning rate of a `rows × cols` matrix is scaled (torch's `adjust_lr_fn`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LrScale {
    /// `√max(1, rows/cols)` (torch's default, Keller Jordan's).
    #[default]
    Original,
    /// `0.2·√max(rows, cols)`: an update RMS close to AdamW's (Moonlight).
    MatchRmsAdamW,
    /// `√(rows/cols)`, below 1 for wide matrices too (torch's `spectral_unclamped`).
    SpectralUnclamped,
}

impl LrScale {
    /// The factor for a `rows × cols` matrix, in `f64`.
    pub fn factor(self, rows: usize, cols: usize) -> f64 {
        let (a, b) = (rows as f64, cols as f64);
        match self {
            LrScale::Original => (a / b).max(1.0).sqrt(),
            LrScale::MatchRmsAdamW => 0.2 * a.max(b).sqrt(),
            LrScale::SpectralUnclamped => (a / b).sqrt(),
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
    /// Which parameters Muon updates (role `Matrix`, two or more dimensions), which go to the
    /// AdamW fallback, which are frozen, and each role's learning-rate scale and weight decay
    /// (default [`RoleRule::default`]: embeddings and heads to AdamW). It replaces the roles of
    /// `adamw` (the fallback follows this rule).
    pub roles: RoleRule,
    /// Whole or split matrices when planning (default [`MatrixLayout::Auto`], a per-tensor
    /// byte cost model; see [`crate::muon_layout`]).
    pub layout: MatrixLayout,
    /// Muon parameters of at least this many dimensions are one matrix `[d₀, d₁·d₂·…]`, as
    /// Keller Jordan's Muon flattens a conv filter `[out, in, kh, kw]` to `[out, in·kh·kw]`;
    /// those of fewer are batches of trailing matrices `[…, m, n]` (each expert of `[E, m, n]`
    /// on its own). Default 4: conv2d/3d filters flatten, 3-D experts do not (conv1d weights do
    /// by name: [`MuonConfig::flatten_patterns`]); 3 flattens every 3-D parameter,
    /// `usize::MAX` none but those the patterns name. At least 2 ([`MuonConfig::flattens`]).
    pub flatten_min_dims: usize,
    /// Muon parameters of 3 or more dimensions whose name contains one of these are flattened
    /// too, whatever [`MuonConfig::flatten_min_dims`] says: a conv1d weight `[out, in, k]`
    /// cannot be told from an `[E, m, n]` expert by its shape, but Hugging Face names say
    /// `conv` (Whisper's `conv1`, Mamba's `conv1d`, wav2vec2's `conv_layers`). Default
    /// `["conv"]`; `&[]` leaves it to the dimension count.
    pub flatten_patterns: &'static [&'static str],
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
            roles: RoleRule::default(),
            layout: MatrixLayout::Auto,
            flatten_min_dims: 4,
            flatten_patterns: &["conv"],
        }
    }
}

impl MuonConfig {
    /// torch's checks (`0 ≤ wd`, `0 ≤ μ < 1`, finite), [`NsConfig::validate`],
    /// [`RoleRule::validate`], the rates of [`MuonConfig::check_rates`] and
    /// [`AdamWConfig::validate`].
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "MuonConfig::validate";
        check_hyperparameters(
            OP,
            "momentum must lie in [0, 1); weight_decay must not be negative",
            &[
                ("weight_decay", self.weight_decay, self.weight_decay >= 0.0),
                (
                    "momentum",
                    self.momentum,
                    (0.0..1.0).contains(&self.momentum),
                ),
            ],
        )?;
        self.ns.validate()?;
        self.roles.validate()?;
        if self.flatten_min_dims < 2 {
            return Err(Error::BadInput {
                op: OP,
                what: format!("flatten_min_dims {}", self.flatten_min_dims),
                reason: "must be at least 2 (a matrix has two dimensions; usize::MAX flattens \
                         nothing)"
                    .into(),
            });
        }
        self.check_rates(OP, self.lr)?;
        self.adamw.validate()
    }

    /// Whether the Muon parameter `name` of `shape` is one flattened matrix `[d₀, d₁·…]`: 3
    /// or more dimensions, and [`MuonConfig::flatten_min_dims`] of them or a name matching
    /// [`MuonConfig::flatten_patterns`] (a 2-D parameter is its own matrix either way).
    pub fn flattens(&self, name: &str, shape: &[usize]) -> bool {
        let d = shape.len();
        d >= 3
            && (d >= self.flatten_min_dims
                || self.flatten_patterns.iter().any(|p| name.contains(p)))
    }

    /// How the Muon parameter `name` of `shape` is cut into the matrices Newton–Schulz
    /// orthogonalizes: `(count, rows, cols)`, back to back in row-major order. One
    /// `[d₀, d₁·…]` matrix where [`MuonConfig::flattens`], else the trailing `rows × cols`
    /// matrices. The learning-rate scale is that matrix's. `Err` below two dimensions (no
    /// matrix: such a parameter is never a Muon parameter).
    pub fn matrices_of(&self, name: &str, shape: &[usize]) -> Result<(usize, usize, usize)> {
        if shape.len() < 2 {
            return Err(Error::InvalidShape {
                op: "MuonConfig::matrices_of",
                shape: shape.to_vec(),
                reason: format!("{name} has no matrix: Muon needs two or more dimensions"),
            });
        }
        Ok(self.cut(name, shape))
    }

    /// [`MuonConfig::matrices_of`] of a shape of two or more dimensions.
    fn cut(&self, name: &str, shape: &[usize]) -> (usize, usize, usize) {
        let d = shape.len();
        let numel: usize = shape.iter().product();
        let (rows, cols) = if self.flattens(name, shape) {
            (shape[0], shape[1..].iter().product())
        } else {
            (shape[d - 2], shape[d - 1])
        };
        (numel / (rows * cols).max(1), rows, cols)
    }

    /// `Err(BadInput)` from `op` unless, at learning rate `lr`, Muon's rate and the `Matrix`
    /// role's `lr·lr_scale` and decay pass [`ragged::optim::check_rates`] (the fallback's are
    /// [`AdamWConfig::check_rates`]): the one check of the rates that
    /// [`MuonConfig::validate`] and [`Optimizer::set_learning_rate`] share.
    pub fn check_rates(&self, op: &'static str, lr: f64) -> Result<()> {
        ragged::optim::check_rates(op, "lr", lr, self.weight_decay)?;
        self.roles
            .matrix
            .check_rates(op, Role::Matrix, lr, self.weight_decay)
    }
}

/// `torch.optim.Muon` with an AdamW fallback, on local shards.
#[derive(Clone, Debug, PartialEq)]
pub struct Muon {
    config: MuonConfig,
    pub(crate) adamw: AdamW,
    /// The configured `(lr, adamw.lr)`: the fallback's rate stays `adamw.lr · lr / base lr`
    /// through every change of rate, including a rate of 0 on the way (a warm-up from 0).
    base_rates: (f64, f64),
    /// Unit layouts already planned, shared by clones (identical layers plan once).
    pub(crate) layouts: LayoutCache,
    /// The step's Newton–Schulz input `U` (and on a device its workspace), kept between
    /// steps.
    u: UBuffer,
    /// The most bytes of Newton–Schulz workspace a device step keeps for the next
    /// ([`Muon::keep_device_workspace`]).
    device_keep: usize,
}

/// The host step's Newton–Schulz input `U` (4 bytes per element of the local shard, 2 in
/// bf16), kept between steps rather than allocated fresh each one: faulting in, zeroing and
/// freeing a shard-sized buffer (218 MB on the d = 1024 Llama stack) took ~5 % of a bf16 step
/// on 2 threads (page faults, and the TLB shootdowns of unmapping it). Dropping the [`Muon`]
/// frees it, and so does [`Muon::release_buffers`]. Each clone has its own (thread ranks step
/// clones at once), empty until its first step; a scratch buffer, so it takes no part in
/// equality. Only what a step writes first is ever read (`U` on its Muon pieces), so what an
/// earlier step left is never seen. A device step keeps its `U` and Newton–Schulz's buffers
/// here the same way (`cuda::muon::DeviceWork`).
#[derive(Clone, Debug, Default, PartialEq)]
struct UBuffer(BetweenSteps<Kept>);

/// What a [`UBuffer`] holds: nothing, the host step's `U` or the device step's buffers.
#[derive(Default)]
enum Kept {
    #[default]
    Nothing,
    Host(UWork),
    #[cfg(feature = "cuda")]
    Device(Box<crate::cuda::muon::DeviceWork>),
}

impl Kept {
    /// Its allocation's bytes (host or device).
    fn bytes(&self) -> usize {
        match self {
            Kept::Nothing => 0,
            Kept::Host(u) => u.bytes(),
            #[cfg(feature = "cuda")]
            Kept::Device(w) => w.bytes(),
        }
    }
}

/// `U` in `f32`, or in bf16 where Newton–Schulz takes bf16 input ([`takes_bf16_input`]: bf16
/// on the AMX products, which round their input to bf16 first; split matrices then travel
/// to their roots and back in bf16 too). bf16 holds the same values the products read, in half
/// the bytes: the momentum pass writes 2 bytes an element instead of 4, the norm and the
/// products' packing read 2, Newton–Schulz writes its result back in 2 and the update reads
/// 2, so the bits are those of the `f32` path.
enum UWork {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl UWork {
    /// Its allocation's bytes.
    fn bytes(&self) -> usize {
        match self {
            UWork::F32(u) => 4 * u.capacity(),
            UWork::Bf16(u) => 2 * u.capacity(),
        }
    }
}

/// `v`, `len` long (grown with 2 MiB pages where it grows).
fn sized<T: Clone>(mut v: Vec<T>, len: usize, fill: T) -> Vec<T> {
    v.truncate(len);
    crate::kernels::grow_huge(&mut v, len, fill);
    v
}

impl UBuffer {
    /// The buffer, `len` elements of `f32` or (`in_bf16`) bf16, taken out (a step running at
    /// the same time on the same `Muon` finds it empty and grows its own; a kept buffer of
    /// the other type is freed).
    fn take(&self, len: usize, in_bf16: bool) -> UWork {
        match (self.take_kept(), in_bf16) {
            (Kept::Host(UWork::F32(u)), false) => UWork::F32(sized(u, len, 0.0)),
            (Kept::Host(UWork::Bf16(u)), true) => UWork::Bf16(sized(u, len, bf16::ZERO)),
            (_, false) => UWork::F32(sized(Vec::new(), len, 0.0)),
            (_, true) => UWork::Bf16(sized(Vec::new(), len, bf16::ZERO)),
        }
    }

    /// The device step's buffers, taken out as [`UBuffer::take`] takes the host's (a kept
    /// host buffer is freed; device buffers on another device are replaced as they are used).
    #[cfg(feature = "cuda")]
    fn take_device(&self) -> Box<crate::cuda::muon::DeviceWork> {
        match self.take_kept() {
            Kept::Device(w) => w,
            _ => Box::default(),
        }
    }

    fn take_kept(&self) -> Kept {
        self.0.take()
    }

    /// Keeps `kept` for the next step.
    fn put(&self, kept: Kept) {
        self.0.put(kept);
    }

    /// Frees the kept buffer; its bytes.
    fn release(&self) -> usize {
        self.take_kept().bytes()
    }
}

impl Muon {
    /// A Muon with validated hyperparameters ([`MuonConfig::validate`]).
    pub fn new(config: MuonConfig) -> Result<Self> {
        config.validate()?;
        // The fallback decides by Muon's roles (one rule for both).
        let adamw = AdamW::new(AdamWConfig {
            roles: config.roles,
            ..config.adamw
        })?;
        let base_rates = (config.lr, config.adamw.lr);
        Ok(Muon {
            config,
            adamw,
            base_rates,
            layouts: LayoutCache::default(),
            u: UBuffer::default(),
            device_keep: crate::kernels::RETAIN_BYTES,
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &MuonConfig {
        &self.config
    }

    /// Frees the Newton–Schulz input `U` this `Muon` keeps between host steps (4 bytes per
    /// element of the last shard it stepped), or the device step's `U` and Newton–Schulz
    /// workspace, e.g. while the model evaluates; the next step allocates them afresh, paying
    /// that once. Returns the bytes freed, host or device (0 when none were kept). The step's
    /// results do not depend on it.
    pub fn release_buffers(&self) -> usize {
        self.u.release()
    }

    /// The most bytes of device workspace (Newton–Schulz's buffers, the split matrices'
    /// arena and all-to-all buffers) a device step keeps for the next: up to it the next step
    /// allocates nothing; above it the workspace lives for its step only, so that gigabytes
    /// of it (a Llama-3-70B MLP weight needs ~2.9 GB in `f32`) are not held through forward
    /// and backward. Default [`RETAIN_BYTES`](crate::kernels::RETAIN_BYTES) (64 MiB, the
    /// host's cap for its own buffers). `U` is kept whatever its size, as on the host.
    pub fn keep_device_workspace(&mut self, bytes: usize) {
        self.device_keep = bytes;
    }

    /// Whether Muon (not AdamW) updates a parameter of this name and global shape.
    pub fn uses_muon(&self, name: &str, shape: &[usize]) -> bool {
        shape.len() >= 2 && self.config.roles.role_of(name, shape) == Role::Matrix
    }

    /// The learning rate and weight decay of Muon matrices: the config's, scaled and replaced
    /// by the `Matrix` role's settings.
    fn matrix_rates(&self) -> (f64, f64) {
        let (c, s) = (&self.config, &self.config.roles.matrix);
        (c.lr * s.lr_scale, s.weight_decay.unwrap_or(c.weight_decay))
    }

    pub(crate) fn is_muon(&self, meta: &ParamMeta) -> bool {
        self.uses_muon(&meta.name, &meta.shape)
    }

    /// The `(rows, cols)` of each matrix of a Muon parameter (two or more dimensions:
    /// [`Muon::uses_muon`]; [`MuonConfig::matrices_of`]).
    fn matrix_of(&self, meta: &ParamMeta) -> (usize, usize) {
        let (_, rows, cols) = self.config.cut(&meta.name, &meta.shape);
        (rows, cols)
    }

    /// Elements of [`MuonState::v`] for `shard`: those of its pieces that are not Muon
    /// matrices (AdamW's, frozen ones included), which alone keep a second moment.
    pub fn fallback_len(&self, shard: &LocalShard) -> usize {
        let fallback = |piece: &&LocalPiece| {
            let meta = shard.params.get(piece.param);
            meta.is_some_and(|meta| !self.is_muon(meta))
        };
        shard
            .pieces
            .iter()
            .filter(fallback)
            .map(|p| p.range.len())
            .sum()
    }

    /// The `f32` multiplier `−lr·scale(rows, cols)` of step 5 (`lr` scaled by the `Matrix`
    /// role's setting).
    pub fn neg_adjusted_lr(&self, rows: usize, cols: usize) -> f32 {
        let (lr, _) = self.matrix_rates();
        (-(lr * self.config.lr_scale.factor(rows, cols))) as f32
    }
}

impl Optimizer for Muon {
    type State = MuonState;

    fn name(&self) -> &'static str {
        "muon"
    }

    /// The matrices' rate; the element-wise fallback's follows it in proportion.
    fn learning_rate(&self) -> Option<f64> {
        Some(self.config.lr)
    }

    fn settings(&self) -> String {
        format!("{:?}", self.config)
    }

    fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        self.config.check_rates("set_learning_rate", lr)?;
        // From the configured rates, not the current ones: a rate of 0 would otherwise lose
        // the proportion for good. Configured with lr = 0, the fallback keeps its own rate.
        // The base rate is 0 or normal in f32 (`check_rates`), but the proportion can still
        // carry the fallback past its bounds: the fallback's `set_learning_rate` checks its
        // rates, and refuses without changing anything (nor has anything here changed yet).
        let (base_lr, base_fallback) = self.base_rates;
        let fallback = if base_lr > 0.0 {
            base_fallback * (lr / base_lr)
        } else {
            base_fallback
        };
        self.adamw.set_learning_rate(fallback)?;
        self.config.adamw.lr = fallback;
        self.config.lr = lr;
        Ok(())
    }

    fn role(&self, name: &str, shape: &[usize]) -> Role {
        self.config.roles.role_of(name, shape)
    }

    fn atomic_block(&self, name: &str, shape: &[usize]) -> AtomicBlock {
        match self.uses_muon(name, shape) {
            true if self.config.flattens(name, shape) => AtomicBlock::Whole, // one matrix
            true => AtomicBlock::Matrix,
            false => AtomicBlock::Element,
        }
    }

    /// Plans by [`MuonConfig::layout`] ([`Muon::plan_layout`]).
    fn plan_unit(&self, unit: &Unit, world: usize, opts: &PlanOptions) -> Result<Plan> {
        Ok(self.plan_layout(unit, world, opts)?.0)
    }

    fn init(&self, shard: &LocalShard) -> Result<MuonState> {
        self.init_on(shard, &Placement::Cpu)
    }

    fn init_on(&self, shard: &LocalShard, place: &Placement) -> Result<MuonState> {
        shard.check("Muon::init_on")?;
        MuonState::zeros_on(place, shard.len, self.fallback_len(shard))
    }

    /// The step on host slices, or on device memory (kernels, Newton–Schulz on cuBLAS in
    /// `config.ns.precision`; its host `backend` is ignored there; split matrices travel
    /// through `comm`, which must then take device buffers: NCCL or GPU thread ranks).
    fn step(
        &self,
        state: &mut MuonState,
        shard: &LocalShard,
        params: ViewMut<'_, f32>,
        grads: View<'_, f32>,
        comm: &dyn Communicator,
    ) -> Result<()> {
        const OP: &str = "Muon::step";
        let lens = [params.len(), grads.len(), state.m.len(), state.v.len()];
        let world = Some((comm.world_size(), comm.rank()));
        let (roots, routes) = self.prologue(OP, shard, lens, world)?;
        let t = next_step(OP, state.step)?;
        let plan = StepPlan {
            shard,
            t,
            roots: &roots,
            routes: routes.as_ref(),
            comm: Some(comm),
        };
        match params {
            ViewMut::Cpu(params) => {
                // Fail on an unavailable Newton–Schulz backend or method before anything is
                // modified.
                let backend = resolve_config(&self.config.ns)?;
                let grads = grads.cpu(OP)?;
                let (m, v) = state.host_mut()?;
                let in_bf16 = takes_bf16_input(&self.config.ns, backend);
                let mut host = HostMuon {
                    params,
                    grads,
                    m,
                    v,
                    u: self.u.take(shard.len, in_bf16),
                };
                let stepped = self.run_step(&mut host, &plan);
                self.u.put(Kept::Host(host.u));
                stepped?;
            }
            #[cfg(feature = "cuda")]
            ViewMut::Cuda(mut params) => {
                let mut work = self.u.take_device();
                let stepped =
                    crate::cuda::muon::step(self, state, &mut params, grads, &plan, &mut work);
                work.trim(self.device_keep);
                self.u.put(Kept::Device(work));
                stepped?;
            }
            _ => return Err(ragged::storage::no_backend(OP)),
        }
        state.step = t;
        Ok(())
    }
}

/// What one Muon step works on besides the storage: the shard, the step count, the roots of
/// the split matrices and this rank's routes to them (from [`Muon::prologue`]), and the
/// communicator (`None` when no matrix is split).
pub(crate) struct StepPlan<'a> {
    pub shard: &'a LocalShard,
    pub t: u64,
    pub roots: &'a RootPlan,
    pub routes: Option<&'a Routes>,
    pub comm: Option<&'a dyn Communicator>,
}

/// The operations of a Muon step on one kind of storage: host slices ([`HostMuon`]) or device
/// memory (`cuda::muon`). [`Muon::run_step`] is the one piece walk both run; `r` is always a
/// piece's range in the local shard, and the NS input `U` lives in the backend.
pub(crate) trait MuonKernels {
    /// Steps 1–2 on elements `r`: `m` and `U`.
    fn momentum(&mut self, step: &MatrixStep<'_>, r: Range<usize>) -> Result<()>;
    /// The AdamW fallback on one run, whose second moment is `v` of the state's `v`.
    fn adamw(&mut self, run: &AdamRun, v: Range<usize>, moments: &MomentCoeffs) -> Result<()>;
    /// Step 3: Newton–Schulz on every matrix this rank works on, in `U`: the whole local ones
    /// in place, the split ones gathered to their roots and back along `plan.routes`.
    fn orthogonalize(&mut self, muon: &Muon, plan: &StepPlan<'_>) -> Result<()>;
    /// Steps 4–5 on elements `r`.
    fn update(&mut self, step: &MatrixStep<'_>, r: Range<usize>) -> Result<()>;
}

impl Muon {
    /// The step after its checks, on any storage: steps 1–2 on Muon pieces and AdamW on the
    /// others (frozen ones skipped), step 3, then steps 4–5.
    pub(crate) fn run_step(&self, k: &mut impl MuonKernels, plan: &StepPlan<'_>) -> Result<()> {
        let a = self.adamw.config();
        let moments = MomentCoeffs::new(a.beta1, a.beta2);
        let shard = plan.shard;
        let mut v_at = 0;
        for piece in &shard.pieces {
            let r = piece.offset..piece.offset + piece.range.len();
            if let Some(step) = self.matrix_step(&shard.params[piece.param]) {
                k.momentum(&step, r)?;
                continue;
            }
            let v = v_at..v_at + r.len();
            v_at = v.end;
            if let Some(run) = self.adamw.run_of(shard, piece, plan.t) {
                k.adamw(&run, v, &moments)?;
            }
        }
        k.orthogonalize(self, plan)?;
        for piece in &shard.pieces {
            if let Some(step) = self.matrix_step(&shard.params[piece.param]) {
                k.update(&step, piece.offset..piece.offset + piece.range.len())?;
            }
        }
        Ok(())
    }
}

/// [`MuonKernels`] on host slices: the local shard's parameters, gradients and state, and `U`.
struct HostMuon<'a> {
    params: &'a mut [f32],
    grads: &'a [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
    u: UWork,
}

/// `f` on the elements of a run: on rayon's threads in [`PAR_CHUNK`]s for a run of
/// [`PAR_MIN_ELEMS`] or more (AdamW's split: element by element, so the same bits on any
/// number of threads), else on this one. On one thread Muon's element-wise passes (and
/// `U`'s first-touch page faults) left the other cores idle for ~8 % of a bf16 Muon step of
/// the d = 1024 stack.
fn elementwise<A: Sync, B: Send, C: Send>(
    a: &[A],
    b: &mut [B],
    c: &mut [C],
    f: impl Fn(&[A], &mut [B], &mut [C]) + Sync,
) {
    if a.len() >= PAR_MIN_ELEMS {
        a.par_chunks(PAR_CHUNK)
            .zip(b.par_chunks_mut(PAR_CHUNK))
            .zip(c.par_chunks_mut(PAR_CHUNK))
            .for_each(|((a, b), c)| f(a, b, c));
    } else {
        f(a, b, c);
    }
}

/// [`elementwise`] on two slices.
fn elementwise2<A: Sync, B: Send>(a: &[A], b: &mut [B], f: impl Fn(&[A], &mut [B]) + Sync) {
    if a.len() >= PAR_MIN_ELEMS {
        a.par_chunks(PAR_CHUNK)
            .zip(b.par_chunks_mut(PAR_CHUNK))
            .for_each(|(a, b)| f(a, b));
    } else {
        f(a, b);
    }
}

impl MuonKernels for HostMuon<'_> {
    fn momentum(&mut self, step: &MatrixStep<'_>, r: Range<usize>) -> Result<()> {
        let (g, m) = (&self.grads[r.clone()], &mut self.m[r.clone()]);
        match &mut self.u {
            UWork::F32(u) => elementwise(g, m, &mut u[r], |g, m, u| step.momentum(g, m, u)),
            UWork::Bf16(u) => elementwise(g, m, &mut u[r], |g, m, u| step.momentum_bf16(g, m, u)),
        }
        Ok(())
    }

    fn adamw(&mut self, run: &AdamRun, v: Range<usize>, moments: &MomentCoeffs) -> Result<()> {
        let r = run.range.clone();
        adamw_update(
            &mut self.params[r.clone()],
            &self.grads[r.clone()],
            &mut self.m[r],
            &mut self.v[v],
            run.decay,
            moments,
            &run.scale,
        );
        Ok(())
    }

    fn orthogonalize(&mut self, muon: &Muon, plan: &StepPlan<'_>) -> Result<()> {
        match &mut self.u {
            UWork::F32(u) if muon.route_elem_bytes() == 2 => {
                orthogonalize_routed::<f32, bf16>(muon, plan, u, orthogonalize_many)
            }
            UWork::F32(u) => orthogonalize_routed::<f32, f32>(muon, plan, u, orthogonalize_many),
            UWork::Bf16(u) => {
                orthogonalize_routed::<bf16, bf16>(muon, plan, u, orthogonalize_many_bf16)
            }
        }
    }

    fn update(&mut self, step: &MatrixStep<'_>, r: Range<usize>) -> Result<()> {
        let p = &mut self.params[r.clone()];
        match &self.u {
            UWork::F32(u) => elementwise2(&u[r], p, |o, p| step.update(p, o)),
            UWork::Bf16(u) => elementwise2(&u[r], p, |o, p| step.update_bf16(p, o)),
        }
        Ok(())
    }
}

/// Newton–Schulz on every matrix this rank works on, `u`'s whole ones in place and the split
/// ones gathered to their roots and back, carried as `W`: bf16 whenever Newton–Schulz runs
/// in bf16, whose first operation rounds every element to bf16 and whose results are bf16
/// values, so the wire's rounding changes no bit and the two all-to-alls move half the
/// bytes. `W` depends on the configuration only, so every rank carries the same.
fn orthogonalize_routed<E: RouteElem, W: RouteElem>(
    muon: &Muon,
    plan: &StepPlan<'_>,
    u: &mut [E],
    run: impl FnOnce(Vec<(&mut [E], usize, usize)>, &NsConfig) -> Result<()>,
) -> Result<()> {
    let mut gathered = match (plan.routes, plan.comm) {
        (Some(r), Some(c)) => r.gather::<E, W>(u, c)?,
        _ => Vec::new(),
    };
    let sizes = plan.routes.map_or(&[][..], |r| r.sizes());
    run(
        muon.ns_tasks(plan.shard, plan.roots, u, &mut gathered, sizes),
        &muon.config.ns,
    )?;
    if let (Some(r), Some(c)) = (plan.routes, plan.comm) {
        r.scatter::<E, W>(&gathered, u, c)?;
    }
    Ok(())
}

impl Muon {
    /// What the host and device steps start with, before anything is modified: the inputs
    /// against the shard, the holdings, the roots; and when a matrix is split over ranks, a
    /// communicator of this shard's world (`comm`: its world size and rank, `None` when the
    /// caller has none) and this rank's routes. A split matrix is only ever orthogonalized
    /// whole, on its root: without the ranks holding the rest of it, the step is refused.
    pub(crate) fn prologue(
        &self,
        op: &'static str,
        shard: &LocalShard,
        [params, grads, m, v]: [usize; 4],
        comm: Option<(usize, usize)>,
    ) -> Result<(RootPlan, Option<Routes>)> {
        check_step_inputs_with_v(op, shard, [params, grads, m], v, self.fallback_len(shard))?;
        shard.check_holdings(op)?;
        let roots = self.roots(shard);
        if !roots.has_split() {
            return Ok((roots, None));
        }
        let Some((world, rank)) = comm else {
            return Err(Error::InvalidShard {
                op,
                reason: "a Muon matrix is split over ranks: its gather to a root needs a \
                         communicator of this shard's world, or plan with MatrixLayout::Whole"
                    .into(),
            });
        };
        check_comm(op, shard, world, rank)?;
        let routes = roots.routes(shard)?;
        Ok((roots, Some(routes)))
    }

    /// The roots of this group's Muon matrices ([`RootPlan`]; identical on every rank).
    pub fn roots(&self, shard: &LocalShard) -> RootPlan {
        let matrix_of = |meta: &ParamMeta| self.is_muon(meta).then(|| self.matrix_of(meta));
        // Newton–Schulz's multiply-adds plus the element work, the same on every rank.
        let cost_of = |rows: usize, cols: usize| {
            let macs = ns_macs(rows, cols, &self.config.ns).saturating_add((rows * cols) as u128);
            u64::try_from(macs).unwrap_or(u64::MAX)
        };
        RootPlan::new(shard, &matrix_of, &cost_of)
    }

    /// The matrix update of a Muon parameter; `None` for AdamW parameters.
    pub(crate) fn matrix_step(&self, meta: &ParamMeta) -> Option<MatrixStep<'_>> {
        if !self.is_muon(meta) {
            return None;
        }
        let c = &self.config;
        let (rows, cols) = self.matrix_of(meta);
        let (lr, wd) = self.matrix_rates();
        Some(MatrixStep {
            rows,
            cols,
            momentum: c.momentum,
            nesterov: c.nesterov,
            decay: (wd != 0.0).then(|| common::decay_factor(lr, wd)),
            neg_lr: self.neg_adjusted_lr(rows, cols),
            ns: &c.ns,
        })
    }

    /// Newton–Schulz's calls on this rank, host and device alike: the whole matrices inside
    /// each of its pieces (a range of the local shard: `batch` matrices back to back) and the
    /// split ones gathered to it (ranges of the arena, matrices of `sizes` back to back, one
    /// each). Both lists are in increasing, disjoint ranges; the matrices are independent,
    /// so running them in any order or in parallel changes no bit.
    pub(crate) fn ns_calls(
        &self,
        shard: &LocalShard,
        roots: &RootPlan,
        sizes: &[usize],
    ) -> [Vec<(Range<usize>, NsShape)>; 2] {
        let whole = shard
            .pieces
            .iter()
            .filter_map(|piece| {
                let meta = &shard.params[piece.param];
                if !self.is_muon(meta) {
                    return None;
                }
                let (rows, cols) = self.matrix_of(meta);
                let range = whole_matrices(piece, rows * cols)?;
                let batch = range.len() / (rows * cols);
                Some((range, NsShape::new(batch, rows, cols)))
            })
            .collect();
        let mut at = 0;
        let rooted = sizes
            .iter()
            .zip(roots.rooted_here(shard.rank))
            .map(|(&n, k)| {
                let job = &roots.jobs[k];
                at += n;
                (at - n..at, NsShape::new(1, job.rows, job.cols))
            })
            .collect();
        [whole, rooted]
    }

    /// [`Muon::ns_calls`] as host tasks, `(data, rows, cols)` per matrix: the whole ones in
    /// place in `u`, the split ones in `arena`.
    fn ns_tasks<'u, S>(
        &self,
        shard: &LocalShard,
        roots: &RootPlan,
        u: &'u mut [S],
        arena: &'u mut [S],
        sizes: &[usize],
    ) -> Vec<(&'u mut [S], usize, usize)> {
        let [whole, rooted] = self.ns_calls(shard, roots, sizes);
        let mut tasks = Vec::new();
        for (data, calls) in [(u, whole), (arena, rooted)] {
            let mut rest = data;
            let mut consumed = 0;
            for (Range { start, end }, shape) in calls {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - consumed);
                let (these, tail) = tail.split_at_mut(end - start);
                rest = tail;
                consumed = end;
                let (rows, cols) = (shape.rows, shape.cols);
                tasks.extend(these.chunks_mut(rows * cols).map(|x| (x, rows, cols)));
            }
        }
        tasks
    }
}

/// The local elements of the whole `mn`-element matrices inside `piece` (a piece of a split
/// layout can start or end inside a matrix that other ranks share), or `None` when it holds
/// no whole matrix. Host and device steps orthogonalize these in place.
pub(crate) fn whole_matrices(piece: &LocalPiece, mn: usize) -> Option<Range<usize>> {
    let (a, b) = (piece.range.start, piece.range.end);
    let (first, last) = (a.div_ceil(mn.max(1)), b / mn.max(1));
    if mn == 0 || first >= last {
        return None;
    }
    let lo = piece.offset + (first * mn - a);
    Some(lo..lo + (last - first) * mn)
}

/// `Err` unless a communicator of `world` ranks seen from `rank` is this shard's world, seen
/// from this shard's rank.
fn check_comm(op: &'static str, shard: &LocalShard, world: usize, rank: usize) -> Result<()> {
    if world != shard.world {
        return Err(Error::WorldSizeMismatch {
            op,
            expected: shard.world,
            got: world,
        });
    }
    if rank != shard.rank {
        return Err(Error::InvalidShard {
            op,
            reason: format!(
                "the shard is rank {}'s but the communicator is rank {rank}'s",
                shard.rank
            ),
        });
    }
    Ok(())
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
    /// # Panics
    /// If a slice does not hold `rows·cols` elements.
    ///
    /// # Errors
    /// Those of [`orthogonalize`] (after step 1 has updated `m`; `p` is then unchanged).
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
        let mut u = vec![0.0f32; mn];
        self.momentum(g, m, &mut u);
        orthogonalize(&mut u, self.rows, self.cols, self.ns)?;
        self.update(p, &u);
        Ok(())
    }

    /// Steps 1–2, element-wise on any run of the matrix: `m ← lerp(m, g, 1 − μ)`, and the
    /// Newton–Schulz input `u = lerp(g, m, μ)` (Nesterov) or `u = m`.
    ///
    /// # Panics
    /// If the slices differ in length.
    #[track_caller]
    pub fn momentum(&self, g: &[f32], m: &mut [f32], u: &mut [f32]) {
        assert!(
            g.len() == m.len() && g.len() == u.len(),
            "MatrixStep::momentum: lengths"
        );
        self.momentum_into(g, m, u, |u| u);
    }

    /// [`MatrixStep::momentum`] with `u` rounded to the nearest bf16 (ties to even), as bf16
    /// Newton–Schulz reads it; `m`'s bits are the same.
    ///
    /// # Panics
    /// If the slices differ in length.
    #[track_caller]
    pub(crate) fn momentum_bf16(&self, g: &[f32], m: &mut [f32], u: &mut [bf16]) {
        assert!(
            g.len() == m.len() && g.len() == u.len(),
            "MatrixStep::momentum_bf16: lengths"
        );
        #[cfg(target_arch = "x86_64")]
        if wide::available() {
            // SAFETY: the CPU has AVX-512 F and BW (just checked).
            return unsafe { wide::momentum_bf16(self, g, m, u) };
        }
        self.momentum_into(g, m, u, bf16::from_f32);
    }

    #[inline(always)]
    fn momentum_into<U>(&self, g: &[f32], m: &mut [f32], u: &mut [U], to: impl Fn(f32) -> U) {
        let w = (1.0 - self.momentum) as f32;
        let mu = self.momentum as f32;
        for ((m, &g), u) in m.iter_mut().zip(g).zip(u.iter_mut()) {
            *m = lerp_elem(*m, g, w);
            *u = to(if self.nesterov {
                lerp_elem(g, *m, mu)
            } else {
                *m
            });
        }
    }

    /// Steps 4–5, element-wise on any run of the matrix: `p ← p·(1 − lr·wd) + (−lr·scale)·o`.
    ///
    /// # Panics
    /// If the slices differ in length.
    #[track_caller]
    pub fn update(&self, p: &mut [f32], o: &[f32]) {
        assert_eq!(p.len(), o.len(), "MatrixStep::update: lengths");
        self.update_from(p, o, |o| o);
    }

    /// [`MatrixStep::update`] from bf16 `o` (widened exactly).
    ///
    /// # Panics
    /// If the slices differ in length.
    #[track_caller]
    pub(crate) fn update_bf16(&self, p: &mut [f32], o: &[bf16]) {
        assert_eq!(p.len(), o.len(), "MatrixStep::update_bf16: lengths");
        #[cfg(target_arch = "x86_64")]
        if wide::available() {
            // SAFETY: as in `momentum_bf16`.
            return unsafe { wide::update_bf16(self, p, o) };
        }
        self.update_from(p, o, bf16::to_f32);
    }

    #[inline(always)]
    fn update_from<O: Copy>(&self, p: &mut [f32], o: &[O], widen: impl Fn(O) -> f32) {
        for (p, &o) in p.iter_mut().zip(o) {
            let p0 = match self.decay {
                Some(d) => decay_elem(*p, d),
                None => *p,
            };
            *p = p0 + self.neg_lr * widen(o);
        }
    }
}

/// [`MatrixStep`]'s bf16 passes compiled for AVX-512 F and BW (16 lanes where the default
/// x86-64 build has SSE2's 4): the same scalar code, so the same bits.
#[cfg(target_arch = "x86_64")]
mod wide {
    use super::MatrixStep;
    use half::bf16;

    /// Whether this CPU has AVX-512 F and BW.
    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn momentum_bf16(
        s: &MatrixStep<'_>,
        g: &[f32],
        m: &mut [f32],
        u: &mut [bf16],
    ) {
        s.momentum_into(g, m, u, bf16::from_f32)
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn update_bf16(s: &MatrixStep<'_>, p: &mut [f32], o: &[bf16]) {
        s.update_from(p, o, bf16::to_f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bf16 passes give `U` rounded to the nearest bf16 (ties to even) and `m` as the
    /// `f32` pass does, and the update from bf16 `o` what the `f32` update gives on `o`
    /// widened; on an AVX-512 CPU through their wide builds, on odd lengths (vector tails),
    /// ties, subnormals, infinities and NaN.
    #[test]
    fn bf16_passes_round_u_and_widen_o_exactly() {
        let ns = NsConfig::default();
        let special = [
            f32::from_bits(0x3f80_8000), // a tie, rounds to even (down)
            f32::from_bits(0x3f81_8000), // a tie, rounds up
            f32::from_bits(0x0000_8001), // subnormal
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -0.0,
            f32::MAX,
        ];
        let n = 1000 + 37;
        let g: Vec<f32> = (0..n)
            .map(|i| {
                special
                    .get(i % 97)
                    .copied()
                    .unwrap_or((i as f32 * 0.37).sin() * 3.0)
            })
            .collect();
        let m0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        for nesterov in [true, false] {
            let step = MatrixStep {
                rows: 1,
                cols: n,
                momentum: 0.95,
                nesterov,
                decay: Some(0.999),
                neg_lr: -0.02,
                ns: &ns,
            };
            let (mut m32, mut u32) = (m0.clone(), vec![0.0f32; n]);
            step.momentum(&g, &mut m32, &mut u32);
            let (mut m16, mut u16) = (m0.clone(), vec![bf16::ZERO; n]);
            step.momentum_bf16(&g, &mut m16, &mut u16);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&m16), bits(&m32));
            for (a, b) in u16.iter().zip(&u32) {
                assert_eq!(a.to_bits(), bf16::from_f32(*b).to_bits(), "{b:e}");
            }
            let (mut p32, mut p16) = (m0.clone(), m0.clone());
            let widened: Vec<f32> = u16.iter().map(|v| v.to_f32()).collect();
            step.update(&mut p32, &widened);
            step.update_bf16(&mut p16, &u16);
            assert_eq!(bits(&p16), bits(&p32));
        }
    }
}
