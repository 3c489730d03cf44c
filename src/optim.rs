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
use crate::plan::Plan;
use crate::{AtomicBlock, Result};

/// A parameter of a group, as the optimizer sees it (global shape, not the local one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamMeta {
    pub name: String,
    pub shape: Vec<usize>,
    /// The block this parameter was planned with.
    pub block: AtomicBlock,
    /// That block in elements.
    pub block_elems: usize,
}

impl ParamMeta {
    /// Elements of the whole parameter.
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<usize>().max(1)
    }
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

    /// Whether this rank holds all of parameter `param`.
    pub fn holds_whole(&self, param: usize) -> bool {
        let n = self.params[param].numel();
        self.pieces
            .iter()
            .any(|p| p.param == param && p.range == (0..n))
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

    /// Fresh state for one rank's shard of a group.
    fn init(&self, shard: &LocalShard) -> Result<Self::State>;

    /// One update of the local shard in place. `params` and `grads` have `shard.len` elements.
    /// `comm` connects the ranks of this group (Muon gathers whole matrices to a root through
    /// it; element-wise optimizers ignore it).
    fn step(
        &self,
        state: &mut Self::State,
        shard: &LocalShard,
        params: &mut [f32],
        grads: &[f32],
        comm: &dyn Communicator,
    ) -> Result<()>;
}

/// Plain gradient descent, `p ← p − lr·g`: the smallest real optimizer, used by `ragged bench
/// comm` to time layouts without optimizer cost dominating (the full optimizers live in the
/// `ragged-optimizers` crate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    pub lr: f32,
}

impl Optimizer for Sgd {
    type State = ();

    fn name(&self) -> &'static str {
        "sgd"
    }

    fn atomic_block(&self, _name: &str, _shape: &[usize]) -> AtomicBlock {
        AtomicBlock::Element
    }

    fn init(&self, _shard: &LocalShard) -> Result<()> {
        Ok(())
    }

    fn step(
        &self,
        _state: &mut (),
        shard: &LocalShard,
        params: &mut [f32],
        grads: &[f32],
        _comm: &dyn Communicator,
    ) -> Result<()> {
        check_shard_lengths(shard, params.len(), grads.len(), "Sgd::step")?;
        for piece in &shard.pieces {
            let span = piece.offset..piece.offset + piece.range.len();
            for (p, g) in params[span.clone()].iter_mut().zip(&grads[span]) {
                *p -= self.lr * g;
            }
        }
        Ok(())
    }
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
