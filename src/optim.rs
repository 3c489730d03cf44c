//! The optimizer interface: an optimizer declares the atomic block each parameter needs, lays
//! its state out on the same plan as the parameters, and steps on this rank's local shard.
//!
//! Shaped like optax's init/update pair: the optimizer value holds only hyperparameters;
//! everything that changes lives in its `State`, a plain struct of `pub` fields laid out like
//! the local shard, so checkpointing the state is serialization.
//!
//! # Vocabulary
//! - **local shard**: the `S` elements of a group's buffer this rank owns (`[rank·S,
//!   (rank+1)·S)` of the full buffer). Parameters, gradients and optimizer state of a group all
//!   use the same local shard layout.
//! - **piece**: the part of one parameter inside the local shard ([`LocalPiece`]). Padding
//!   between pieces is zero in every role and must stay zero.

use std::ops::Range;

use crate::comm::Communicator;
use crate::model::Unit;
use crate::plan::{self, Plan, PlanOptions};
use crate::storage::{Placement, View, ViewMut};
use crate::{AtomicBlock, Result, Role};

/// A parameter of a group, as the optimizer sees it (global shape, not the local one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamMeta {
    pub name: String,
    pub shape: Vec<usize>,
    /// The block this parameter was planned with.
    pub block: AtomicBlock,
    /// That block in elements.
    pub block_elems: usize,
    /// Which rank holds which elements of the flattened parameter, ascending and tiling
    /// `0..numel` (one entry for a parameter that is whole on one rank). Every rank knows the
    /// whole plan, so every rank can route a matrix to its root without asking the others.
    pub holdings: Vec<Holding>,
}

/// Elements `range` of a parameter live on `rank`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    pub rank: usize,
    pub range: Range<usize>,
}

impl ParamMeta {
    /// Elements of the whole parameter.
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<usize>().max(1)
    }

    /// The holdings that intersect `elems`, each clipped to it.
    pub fn holders_of(&self, elems: Range<usize>) -> impl Iterator<Item = Holding> + '_ {
        self.holdings.iter().filter_map(move |h| {
            let (a, b) = (h.range.start.max(elems.start), h.range.end.min(elems.end));
            (a < b).then_some(Holding {
                rank: h.rank,
                range: a..b,
            })
        })
    }
}

/// The holdings of a parameter at `offset` in a ragged group buffer of `world` shards of `s`.
fn ragged_holdings(offset: usize, numel: usize, s: usize, world: usize) -> Vec<Holding> {
    if s == 0 || numel == 0 {
        return Vec::new();
    }
    let (first, last) = (offset / s, ((offset + numel - 1) / s).min(world - 1));
    (first..=last)
        .map(|r| Holding {
            rank: r,
            range: offset.max(r * s) - offset..(offset + numel).min((r + 1) * s) - offset,
        })
        .collect()
}

/// The part of parameter `param` held by this rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalPiece {
    /// Index into [`LocalShard::params`].
    pub param: usize,
    /// Elements of the flattened parameter held here (starts on a block edge).
    pub range: Range<usize>,
    /// Where those elements start in the local shard.
    pub offset: usize,
}

/// One rank's view of one group: every parameter's metadata and the pieces this rank holds,
/// in shard order. Built from a [`Plan`]; the optimizer never sees other ranks' data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalShard {
    pub rank: usize,
    pub world: usize,
    /// Elements in the local shard, `S`.
    pub len: usize,
    pub params: Vec<ParamMeta>,
    pub pieces: Vec<LocalPiece>,
}

impl LocalShard {
    /// This rank's shard of a ragged plan.
    pub fn from_plan(plan: &Plan, rank: usize) -> Result<Self> {
        let s = plan.shard_size;
        let (lo, hi) = (rank * s, (rank + 1) * s);
        let params = plan
            .placements
            .iter()
            .map(|p| ParamMeta {
                name: p.name.clone(),
                shape: p.shape.clone(),
                block: p.block,
                block_elems: p.block_elems,
                holdings: ragged_holdings(p.offset, p.numel(), s, plan.world),
            })
            .collect();
        let mut pieces: Vec<LocalPiece> = plan
            .placements
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let a = p.offset.max(lo);
                let b = (p.offset + p.numel()).min(hi);
                (a < b).then(|| LocalPiece {
                    param: i,
                    range: a - p.offset..b - p.offset,
                    offset: a - lo,
                })
            })
            .collect();
        pieces.sort_by_key(|p| p.offset);
        Ok(LocalShard {
            rank,
            world: plan.world,
            len: s,
            params,
            pieces,
        })
    }

    /// The one-rank shard of an unsharded run: every tensor whole, back to back, no padding;
    /// `block_of` names each tensor's block (recorded in [`ParamMeta`]).
    pub fn unsharded<'a>(
        tensors: impl IntoIterator<Item = (&'a str, &'a [usize])>,
        block_of: &dyn Fn(&str, &[usize]) -> AtomicBlock,
    ) -> Result<Self> {
        let (mut params, mut pieces, mut offset) = (Vec::new(), Vec::new(), 0);
        for (i, (name, shape)) in tensors.into_iter().enumerate() {
            let block = block_of(name, shape);
            let n = shape.iter().product::<usize>().max(1);
            params.push(ParamMeta {
                name: name.to_string(),
                shape: shape.to_vec(),
                block,
                block_elems: block.elems(shape)?,
                holdings: vec![Holding {
                    rank: 0,
                    range: 0..n,
                }],
            });
            pieces.push(LocalPiece {
                param: i,
                range: 0..n,
                offset,
            });
            offset += n;
        }
        Ok(LocalShard {
            rank: 0,
            world: 1,
            len: offset,
            params,
            pieces,
        })
    }

    /// `Err(InvalidShard)` unless every piece names a parameter, lies inside that parameter
    /// and inside the shard, and the pieces are in shard order without overlap (so a loop over
    /// the pieces touches every owned element once and never the padding). The fields are
    /// public, so every function that walks the pieces of a shard it did not build checks it.
    pub fn check(&self, op: &'static str) -> Result<()> {
        let bad = |reason: String| Err(crate::Error::InvalidShard { op, reason });
        let mut end = 0;
        for (k, piece) in self.pieces.iter().enumerate() {
            let Some(meta) = self.params.get(piece.param) else {
                return bad(format!(
                    "piece {k} names parameter {} of {}",
                    piece.param,
                    self.params.len()
                ));
            };
            if piece.range.start > piece.range.end || piece.range.end > meta.numel() {
                return bad(format!(
                    "piece {k} holds elements {:?} of {} ({} elements)",
                    piece.range,
                    meta.name,
                    meta.numel()
                ));
            }
            if piece.offset < end {
                return bad(format!(
                    "piece {k} ({}) starts at {}, before the previous piece ends at {end}",
                    meta.name, piece.offset
                ));
            }
            end = match piece.offset.checked_add(piece.range.len()) {
                Some(e) if e <= self.len => e,
                _ => {
                    return bad(format!(
                        "piece {k} ({}) of {} elements at offset {} ends past the shard of {}",
                        meta.name,
                        piece.range.len(),
                        piece.offset,
                        self.len
                    ))
                }
            };
        }
        Ok(())
    }

    /// `Err` unless every parameter's holdings tile it in ascending order on ranks of this
    /// world, and this rank's pieces are exactly its holdings (what a route between ranks
    /// relies on).
    pub fn check_holdings(&self, op: &'static str) -> Result<()> {
        let bad = |reason: String| Err(crate::Error::InvalidShard { op, reason });
        for (i, meta) in self.params.iter().enumerate() {
            let mut end = 0;
            for h in &meta.holdings {
                if h.range.start != end || h.range.end <= h.range.start || h.rank >= self.world {
                    return bad(format!(
                        "{}: holding {:?} on rank {} does not continue at element {end} of a \
                         {}-rank world",
                        meta.name, h.range, h.rank, self.world
                    ));
                }
                end = h.range.end;
            }
            if end != meta.numel() {
                return bad(format!(
                    "{}: holdings cover {end} of {} elements",
                    meta.name,
                    meta.numel()
                ));
            }
            let mine = meta.holdings.iter().filter(|h| h.rank == self.rank);
            let pieces = self.pieces.iter().filter(|p| p.param == i);
            if !mine.map(|h| &h.range).eq(pieces.map(|p| &p.range)) {
                return bad(format!(
                    "{}: rank {}'s pieces differ from its holdings",
                    meta.name, self.rank
                ));
            }
        }
        Ok(())
    }

    /// This rank's local buffer of the global tensors `global` (one flattened buffer per
    /// parameter, in `params` order): each piece copied to its offset, padding
    /// `T::default()` (zero). `Err` when `global` does not hold one tensor of the right length
    /// per parameter.
    pub fn scatter<T: Copy + Default>(&self, global: &[Vec<T>]) -> Result<Vec<T>> {
        self.check("LocalShard::scatter")?;
        check_globals("LocalShard::scatter", &self.params, global)?;
        let mut local = vec![T::default(); self.len];
        for p in &self.pieces {
            local[p.offset..p.offset + p.range.len()]
                .copy_from_slice(&global[p.param][p.range.clone()]);
        }
        Ok(local)
    }

    /// The global tensors from every rank's local buffer (`shards[r]` and `locals[r]` of one
    /// plan): the inverse of [`LocalShard::scatter`]. `Err` unless the shards describe the
    /// same parameters, each local buffer has its shard's length, and every element of every
    /// parameter is owned by exactly one rank.
    pub fn gather<T: Copy + Default>(
        shards: &[LocalShard],
        locals: &[Vec<T>],
    ) -> Result<Vec<Vec<T>>> {
        const OP: &str = "LocalShard::gather";
        let bad = |reason: String| Err(crate::Error::InvalidShard { op: OP, reason });
        let Some(first) = shards.first() else {
            return bad("no shards".into());
        };
        if locals.len() != shards.len() {
            return bad(format!(
                "{} local buffers for {} shards",
                locals.len(),
                shards.len()
            ));
        }
        let mut global: Vec<Vec<T>> = first
            .params
            .iter()
            .map(|m| vec![T::default(); m.numel()])
            .collect();
        let mut owners: Vec<Vec<u8>> = first.params.iter().map(|m| vec![0; m.numel()]).collect();
        for (shard, local) in shards.iter().zip(locals) {
            shard.check(OP)?;
            let same = shard.params.len() == first.params.len()
                && shard
                    .params
                    .iter()
                    .zip(&first.params)
                    .all(|(a, b)| a.name == b.name && a.shape == b.shape);
            if !same || local.len() != shard.len {
                return bad(format!(
                    "rank {}: {} elements for a shard of {}, or other parameters than rank {}'s",
                    shard.rank,
                    local.len(),
                    shard.len,
                    first.rank
                ));
            }
            for p in &shard.pieces {
                global[p.param][p.range.clone()]
                    .copy_from_slice(&local[p.offset..p.offset + p.range.len()]);
                for o in &mut owners[p.param][p.range.clone()] {
                    *o = o.saturating_add(1);
                }
            }
        }
        for (meta, own) in first.params.iter().zip(&owners) {
            if let Some(e) = own.iter().position(|&o| o != 1) {
                return bad(format!(
                    "{}: element {e} owned by {} ranks",
                    meta.name, own[e]
                ));
            }
        }
        Ok(global)
    }
}

/// A sharded optimizer. `step` sees only the local shard: parameters (the fp32 master), the
/// reduced gradients and the state, all laid out like [`LocalShard`].
pub trait Optimizer: Send + Sync {
    /// Per-group state (moments, step count, quantization scales, ...).
    type State: Send;

    /// A short name for reports (`"adamw"`).
    fn name(&self) -> &'static str;

    /// The block this optimizer's math needs kept on one rank for a parameter of this name and
    /// global shape (AdamW: `Element`; 8-bit Adam: 32-row tiles; Muon: the whole matrix).
    fn atomic_block(&self, name: &str, shape: &[usize]) -> AtomicBlock;

    /// The role of a parameter of this name and global shape ([`crate::roles`]): which update
    /// and state it gets, and whether it is frozen ([`Role::Frozen`] parameters are never
    /// stepped, and `fully_shard` gives them no gradient). The default is
    /// [`crate::roles::default_role`]; the optimizers of `ragged-optimizers` ask their
    /// [`crate::RoleRule`].
    fn role(&self, name: &str, shape: &[usize]) -> Role {
        crate::roles::default_role(name, shape)
    }

    /// Plans one unit (an FSDP group) for this optimizer. The default keeps every tensor's
    /// [`Optimizer::atomic_block`] on one rank; an optimizer whose blocks are negotiable
    /// overrides it with its own cost model (Muon chooses whole or split matrices).
    fn plan_unit(&self, unit: &Unit, world: usize, opts: &PlanOptions) -> Result<Plan> {
        plan::plan_unit(unit, &|t| self.atomic_block(&t.name, &t.shape), world, opts)
    }

    /// Fresh state for one rank's shard of a group, in host memory.
    fn init(&self, shard: &LocalShard) -> Result<Self::State>;

    /// Fresh state in the memory `place` names: the host ([`Optimizer::init`]) or a device,
    /// for an optimizer with a device backend (AdamW, Muon, 8-bit Adam, Shampoo); the default
    /// refuses devices.
    fn init_on(&self, shard: &LocalShard, place: &Placement) -> Result<Self::State> {
        if place.is_cpu() {
            return self.init(shard);
        }
        Err(crate::Error::BadInput {
            op: "Optimizer::init_on",
            what: self.name().into(),
            reason: "this optimizer runs on the host only".into(),
        })
    }

    /// The learning rate of the main update (candle-nn's `Optimizer::learning_rate`); `None`
    /// for an optimizer without one.
    fn learning_rate(&self) -> Option<f64> {
        None
    }

    /// Sets the learning rate of the main update; an optimizer with several rates (Muon's
    /// element-wise fallback) scales the others by the same ratio. `Err`, the rate unchanged,
    /// for a rate [`check_rates`] refuses at the optimizer's weight decays and role scales (as
    /// its constructor would), or an optimizer that does not support it (the default).
    fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        let _ = lr;
        Err(crate::Error::BadInput {
            op: "set_learning_rate",
            what: self.name().into(),
            reason: "this optimizer does not support changing its learning rate".into(),
        })
    }

    /// What this rank's steps have counted in `state` that changed the math without failing
    /// the step, as `(what, count)` (Shampoo: roots it could not compute, the previous one
    /// kept); none by default. Every rank gives the same list of `what` for its states.
    /// [`crate::fsdp::ShardedModel::optimizer_events`] sums them over units and ranks.
    fn events(&self, state: &Self::State) -> Vec<(&'static str, u64)> {
        let _ = state;
        Vec::new()
    }

    /// Every setting that changes the update, as text that reads the same in every process
    /// for the same settings (no addresses): the optimizers of `ragged-optimizers` give their
    /// config's `Debug`. `fully_shard` compares it across ranks and names the first setting
    /// that differs; checkpoints record it in their manifest. The default, empty, compares
    /// nothing beyond the name and learning rate.
    fn settings(&self) -> String {
        String::new()
    }

    /// One update of the local shard in place. `params` and `grads` have `shard.len` elements,
    /// in host or device memory ([`crate::storage`]), where the state lives too (a mix is
    /// `Err`); the step runs that storage's backend. `comm` connects the ranks of this group
    /// (Muon gathers whole matrices to a root through it; element-wise optimizers ignore it).
    fn step(
        &self,
        state: &mut Self::State,
        shard: &LocalShard,
        params: ViewMut<'_, f32>,
        grads: View<'_, f32>,
        comm: &dyn Communicator,
    ) -> Result<()>;

    /// [`Optimizer::step`] on host slices (the state in host memory).
    fn step_slices(
        &self,
        state: &mut Self::State,
        shard: &LocalShard,
        params: &mut [f32],
        grads: &[f32],
        comm: &dyn Communicator,
    ) -> Result<()> {
        self.step(state, shard, params.into(), grads.into(), comm)
    }
}

/// Plain gradient descent, `p ← p − lr·g`: the smallest real optimizer, used by `ragged bench
/// comm` to time layouts without optimizer cost dominating (the full optimizers live in the
/// `ragged-optimizers` crate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    /// Checked by [`check_rate`] in `init`, `init_on` and `step` (a public field, so it may
    /// change between them): NaN, negative (gradient ascent) and infinite rates are `Err`.
    pub lr: f32,
}

impl Sgd {
    /// `Err(BadInput)` from `op` unless `lr` passes [`check_rate`].
    fn check(&self, op: &'static str) -> Result<()> {
        check_rate(op, "Sgd lr", f64::from(self.lr)).map(drop)
    }
}

impl Optimizer for Sgd {
    /// Where the shard lives (its device's kernels step it).
    type State = Placement;

    fn name(&self) -> &'static str {
        "sgd"
    }

    fn atomic_block(&self, _name: &str, _shape: &[usize]) -> AtomicBlock {
        AtomicBlock::Element
    }

    fn init(&self, _shard: &LocalShard) -> Result<Placement> {
        self.check("Sgd::init")?;
        Ok(Placement::Cpu)
    }

    fn init_on(&self, _shard: &LocalShard, place: &Placement) -> Result<Placement> {
        self.check("Sgd::init_on")?;
        Ok(place.clone())
    }

    fn learning_rate(&self) -> Option<f64> {
        Some(f64::from(self.lr))
    }

    fn settings(&self) -> String {
        format!("{self:?}")
    }

    fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        self.lr = check_learning_rate(lr)? as f32;
        Ok(())
    }

    /// `p ← p − lr·g` on every piece: a host loop, or one `axpy` kernel per piece with
    /// `a = −lr` (the same two roundings, so the same bits).
    fn step(
        &self,
        place: &mut Placement,
        shard: &LocalShard,
        params: ViewMut<'_, f32>,
        grads: View<'_, f32>,
        _comm: &dyn Communicator,
    ) -> Result<()> {
        const OP: &str = "Sgd::step";
        self.check(OP)?;
        check_shard_lengths(shard, params.len(), grads.len(), OP)?;
        shard.check(OP)?;
        let spans = shard
            .pieces
            .iter()
            .map(|piece| piece.offset..piece.offset + piece.range.len());
        match (params, grads, &*place) {
            (ViewMut::Cpu(params), View::Cpu(grads), Placement::Cpu) => {
                for span in spans {
                    for (p, g) in params[span.clone()].iter_mut().zip(&grads[span]) {
                        *p -= self.lr * g;
                    }
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (ViewMut::Cuda(mut params), View::Cuda(grads), Placement::Cuda(dev)) => {
                for span in spans {
                    let mut p = params.slice_mut(span.clone());
                    crate::cuda::ops::axpy(dev, &mut p, &grads.slice(span), -self.lr)?;
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            _ => Err(crate::storage::mixed(OP, "parameters, gradients and state")),
        }
    }
}

/// `Err` unless `global` holds one tensor per parameter of `params`, each of its `numel`.
fn check_globals<T>(op: &'static str, params: &[ParamMeta], global: &[Vec<T>]) -> Result<()> {
    let want: Vec<usize> = params.iter().map(ParamMeta::numel).collect();
    let got: Vec<usize> = global.iter().map(Vec::len).collect();
    if want != got {
        return Err(crate::Error::BadInput {
            op,
            what: format!("global tensors of {got:?} elements"),
            reason: format!("the shard's parameters have {want:?}"),
        });
    }
    Ok(())
}

/// The largest learning rate an optimizer accepts, role scales included, and the largest
/// decay `lr·weight_decay`: 2^64 (1.8e19), the square root of f32's range (f32::MAX < 2^128).
/// A step multiplies the rate by a normalized update: Adam's `m̂/(√v̂ + ε)` (about 1; for
/// `β₁² < β₂` at most `(1 − β₁)/√((1 − β₂)(1 − β₁²/β₂))` by Cauchy–Schwarz over the moments'
/// sums, 7.3 at torch's betas), Muon's orthogonalized matrix
/// (entries at most about 1) times its shape scale (`√(rows/cols)` or `0.2·√max(rows, cols)`),
/// SGD's gradient; and the decay factor `1 − lr·wd` multiplies a parameter. Splitting f32's
/// range evenly between the two factors, a product stays finite for every update (or
/// parameter) below `f32::MAX / 2^64` (1.8e19), far above any of these, while the bound
/// refuses only rates no one trains with (torch's default is 1e-3; rates above 10 are rare).
pub const MAX_LEARNING_RATE: f64 = 18_446_744_073_709_551_616.0;

/// `rate` if it is 0 or a normal f32 at most [`MAX_LEARNING_RATE`], else `Err(BadInput)` from
/// `op` naming `what`: the one check of every learning rate an optimizer multiplies an update
/// by (its own, [`Optimizer::set_learning_rate`]'s, each role's `lr·lr_scale`).
pub fn check_rate(op: &'static str, what: &str, rate: f64) -> Result<f64> {
    // 0 is a rate (a warm-up starts there). A positive rate below f32::MIN_POSITIVE is
    // subnormal, or 0, where it meets the f32 update, and a rate kept in proportion to it
    // (Muon's fallback follows `lr / base lr`) would be scaled by up to 1e45.
    let normal = (f64::from(f32::MIN_POSITIVE)..=MAX_LEARNING_RATE).contains(&rate);
    if rate == 0.0 || normal {
        return Ok(rate);
    }
    Err(crate::Error::BadInput {
        op,
        what: format!("{what} = {rate:?}"),
        reason: "a learning rate must be 0 or lie in [f32::MIN_POSITIVE, 2^64] = [1.2e-38, \
                 1.8e19]: smaller rates are subnormal in the f32 update, larger ones let it \
                 overflow"
            .into(),
    })
}

/// `Err(BadInput)` from `op` unless `lr` passes [`check_rate`] and its decay `lr·weight_decay`
/// is at most [`MAX_LEARNING_RATE`] (so the factor `1 − lr·wd` times a parameter stays finite).
/// `what` names the rate (`lr`, `matrix lr·lr_scale`). Construction and
/// [`Optimizer::set_learning_rate`] both call it: a decay finite at one rate may not be at
/// the next.
pub fn check_rates(op: &'static str, what: &str, lr: f64, weight_decay: f64) -> Result<()> {
    check_rate(op, what, lr)?;
    let decay = lr * weight_decay;
    // Also refuses NaN (an infinite decay at a rate of 0).
    if decay <= MAX_LEARNING_RATE {
        return Ok(());
    }
    Err(crate::Error::BadInput {
        op,
        what: format!("{what}·weight_decay = {lr:?}·{weight_decay:?} = {decay:?}"),
        reason: "the decay lr·weight_decay must be at most 2^64 (1.8e19), or the factor \
                 1 − lr·wd times a parameter overflows f32"
            .into(),
    })
}

/// `lr` if [`check_rate`] accepts it as [`Optimizer::set_learning_rate`]'s argument.
pub fn check_learning_rate(lr: f64) -> Result<f64> {
    check_rate("set_learning_rate", "learning rate", lr)
}

/// Checks that `params` and `grads` cover exactly the local shard.
pub fn check_shard_lengths(
    shard: &LocalShard,
    params: usize,
    grads: usize,
    op: &'static str,
) -> Result<()> {
    if params != shard.len || grads != shard.len {
        return Err(crate::Error::InvalidShard {
            op,
            reason: format!(
                "params {params} and grads {grads} elements for a shard of {}",
                shard.len
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::SingleRank;

    #[test]
    fn learning_rates_are_zero_or_normal_f32_up_to_two_to_the_64() {
        let min = f64::from(f32::MIN_POSITIVE);
        for ok in [0.0, min, 1e-6, 1.0, 10.0, MAX_LEARNING_RATE] {
            assert_eq!(check_learning_rate(ok).unwrap(), ok);
        }
        for bad in [
            -1.0,
            min / 2.0,
            1e-45,
            MAX_LEARNING_RATE * 1.01,
            3e38,
            f64::NAN,
        ] {
            let err = check_learning_rate(bad).unwrap_err().to_string();
            assert!(err.contains("must be 0 or lie in"), "{bad}: {err}");
        }
        // The decay is a product of two accepted values: each passing alone is not enough.
        check_rates("t", "lr", 1e-3, 1e20).unwrap();
        let err = check_rates("t", "lr", 1.0, 1e20).unwrap_err().to_string();
        assert!(err.contains("lr·weight_decay"), "{err}");
        assert!(
            check_rates("t", "lr", 0.0, f64::INFINITY).is_err(),
            "0·∞ is NaN"
        );
    }

    /// `Sgd`'s rate is a public field nothing constructs through: `init` and `step` check it
    /// (NaN wrote NaN into every parameter, −1 ascended the gradient, both `Ok`).
    #[test]
    fn sgd_refuses_a_nan_negative_or_infinite_rate_at_init_and_step() {
        let shard =
            LocalShard::unsharded([("w", &[4usize][..])], &|_, _| AtomicBlock::Element).unwrap();
        let (mut p, g) = (vec![1.0f32; 4], vec![0.5f32; 4]);
        for lr in [f32::NAN, -1.0, f32::INFINITY, 1e-40] {
            let sgd = Sgd { lr };
            let err = sgd.init(&shard).unwrap_err().to_string();
            assert!(err.contains("Sgd::init") && err.contains("Sgd lr"), "{err}");
            assert!(sgd.init_on(&shard, &Placement::Cpu).is_err());
            let mut place = Placement::Cpu;
            let step = sgd.step_slices(&mut place, &shard, &mut p, &g, &SingleRank);
            assert!(step.is_err(), "{lr}");
        }
        assert_eq!(p, [1.0; 4], "nothing stepped");
        let sgd = Sgd { lr: 0.5 };
        let mut place = sgd.init(&shard).unwrap();
        sgd.step_slices(&mut place, &shard, &mut p, &g, &SingleRank)
            .unwrap();
        assert_eq!(p, [0.75; 4]);
    }
}
