//! The FSDP2-style baseline, in the same runtime so both layouts are measured side by side.
//!
//! PyTorch FSDP2 (`torch/distributed/fsdp/_fully_shard`) shards every parameter on dim 0:
//! `c = ⌈rows/V⌉` rows per rank, padded to `c` rows. The all-gather buffer is rank-major
//! (`[rank 0: p0 | p1 | …][rank 1: …]`, `V·I` elements with `I = Σ c·row`), so after the
//! all-gather every parameter is **copied out** into its own storage, and before the
//! reduce-scatter every gradient is **copied in** to a rank-major padded buffer. Both copies are
//! counted in [`CopyStats::copied`]; the ragged layout has neither.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};

use super::copy_between;
use crate::dbuffer::{candle, CopyStats, DBuffer, Geometry, Role};
use crate::model::Unit;
use crate::optim::{Holding, LocalPiece, LocalShard, ParamMeta};
use crate::{AtomicBlock, Result};

/// One parameter's FSDP2 geometry.
#[derive(Clone, Debug)]
struct Param {
    name: String,
    shape: Vec<usize>,
    rows: usize,
    /// Elements per dim-0 row, `prod(shape[1:])`.
    row: usize,
    /// Rows per rank, `⌈rows/V⌉`.
    chunk_rows: usize,
    /// Offset of this parameter's chunk in a rank's shard.
    local_offset: usize,
    /// Offset of this parameter in the (unpadded, parameter-major) model buffer.
    model_offset: usize,
}

impl Param {
    /// Rows of this parameter held by `rank`.
    fn rows_on(&self, rank: usize) -> std::ops::Range<usize> {
        let lo = (rank * self.chunk_rows).min(self.rows);
        lo..((rank + 1) * self.chunk_rows).min(self.rows)
    }
}

/// A unit laid out the FSDP2 way: the collective buffer and the separate model buffer.
pub struct Fsdp2Unit {
    world: usize,
    rank: usize,
    params: Vec<Param>,
    /// Elements per rank, `I`.
    shard_len: usize,
    /// The parameter-major buffer the model's parameters are views of.
    model: Var,
    stats: Arc<CopyStats>,
}

impl Fsdp2Unit {
    pub fn new(unit: &Unit<'_>, world: usize, rank: usize, stats: Arc<CopyStats>) -> Result<Self> {
        let (mut local, mut model) = (0, 0);
        let params = unit
            .tensors
            .iter()
            .map(|t| {
                let rows = t.shape.first().copied().unwrap_or(1);
                let row = t.numel() / rows;
                let chunk_rows = rows.div_ceil(world);
                let p = Param {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    rows,
                    row,
                    chunk_rows,
                    local_offset: local,
                    model_offset: model,
                };
                local += chunk_rows * row;
                model += t.numel();
                p
            })
            .collect();
        let model = Var::zeros(model, DType::F32, &Device::Cpu).map_err(candle("fsdp2"))?;
        Ok(Fsdp2Unit {
            world,
            rank,
            params,
            shard_len: local,
            model,
            stats,
        })
    }

    /// This rank's shard: each parameter's padded chunk, in parameter order.
    pub fn local_shard(&self, unit: &Unit<'_>) -> LocalShard {
        let params = unit
            .tensors
            .iter()
            .zip(&self.params)
            .map(|(t, p)| ParamMeta {
                name: t.name.clone(),
                shape: t.shape.clone(),
                block: AtomicBlock::Element,
                block_elems: 1,
                holdings: (0..self.world)
                    .map(|r| (r, p.rows_on(r)))
                    .filter(|(_, rows)| !rows.is_empty())
                    .map(|(rank, rows)| Holding {
                        rank,
                        range: rows.start * p.row..rows.end * p.row,
                    })
                    .collect(),
            })
            .collect();
        let pieces = self
            .params
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let rows = p.rows_on(self.rank);
                (!rows.is_empty()).then(|| LocalPiece {
                    param: i,
                    range: rows.start * p.row..rows.end * p.row,
                    offset: p.local_offset,
                })
            })
            .collect();
        LocalShard {
            rank: self.rank,
            world: self.world,
            len: self.shard_len,
            params,
            pieces,
        }
    }

    /// The rank-major collective buffer (`V·I`), with a persistent local shard.
    pub fn collective_buffer(&self) -> Result<DBuffer> {
        let geometry = Geometry {
            world: self.world,
            rank: self.rank,
            shard_size: self.shard_len,
            tensors: Vec::new(),
        };
        DBuffer::zeros(Role::Params, Arc::new(geometry), false, self.stats.clone())
    }

    /// The model buffer (gradients of the model's parameters land on it).
    pub fn model_buffer(&self) -> &Var {
        &self.model
    }

    /// Zero-copy views of the model buffer, by name.
    pub fn views(&self) -> Result<Vec<(String, Tensor)>> {
        self.params
            .iter()
            .map(|p| {
                let n = p.rows * p.row;
                let view = self
                    .model
                    .as_tensor()
                    .narrow(0, p.model_offset, n)
                    .and_then(|t| t.reshape(p.shape.as_slice()))
                    .map_err(candle("fsdp2 views"))?;
                Ok((p.name.clone(), view))
            })
            .collect()
    }

    /// Copy-out: every rank's chunk of every parameter from the gathered rank-major buffer
    /// into the model buffer.
    pub fn copy_out(&self, gathered: &DBuffer) -> Result<()> {
        let full = gathered.full()?.as_tensor();
        self.for_each_chunk(|src, dst, len| {
            copy_between(full, src, self.model.as_tensor(), dst, len)
        })
    }

    /// Copy-in: the model buffer's gradient into the rank-major padded reduce-scatter buffer.
    pub fn copy_in(&self, grad: &Tensor, buffer: &DBuffer) -> Result<()> {
        let full = buffer.full()?.as_tensor();
        self.for_each_chunk(|rank_major, model, len| {
            copy_between(grad, model, full, rank_major, len)
        })
    }

    /// Calls `f(rank-major offset, model offset, length)` for every (rank, parameter) chunk and
    /// counts the bytes.
    fn for_each_chunk(&self, mut f: impl FnMut(usize, usize, usize) -> Result<()>) -> Result<()> {
        for k in 0..self.world {
            for p in &self.params {
                let rows = p.rows_on(k);
                let len = rows.len() * p.row;
                if len == 0 {
                    continue;
                }
                let rank_major = k * self.shard_len + p.local_offset;
                f(rank_major, p.model_offset + rows.start * p.row, len)?;
                self.stats.add_copied(4 * len);
            }
        }
        Ok(())
    }
}
