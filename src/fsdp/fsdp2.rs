//! The FSDP2-style baseline, in the same runtime so both layouts are measured side by side.
//!
//! PyTorch FSDP2 (`torch/distributed/fsdp/_fully_shard`) shards every parameter on dim 0:
//! `c = ⌈rows/V⌉` rows per rank, padded to `c` rows. The all-gather buffer is rank-major
//! (`[rank 0: p0 | p1 | …][rank 1: …]`, `V·I` elements with `I = Σ c·row`), so after the
//! all-gather every parameter is **copied out** into its own storage, and before the
//! reduce-scatter every gradient is **copied in** to a rank-major padded buffer. Both copies are
//! counted in [`CopyStats::copied`]; the ragged layout has neither. Here the copy-out writes
//! the per-tensor compute storages, and the copy-in reads the parameter-major gradient buffer
//! backward accumulated into.

use crate::comm::{Buf, BufMut, Communicator, ReduceOp};
use crate::dbuffer::{CopyStats, TensorSlot};
use crate::model::Unit;
use crate::optim::{Holding, LocalPiece, LocalShard, ParamMeta};
use crate::{AtomicBlock, Error, Result};

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

/// A unit laid out the FSDP2 way: per-parameter chunks, a rank-major collective buffer.
pub struct Fsdp2Unit {
    world: usize,
    rank: usize,
    params: Vec<Param>,
    /// Elements per rank, `I`.
    shard_len: usize,
    /// Elements of all parameters, unpadded (the parameter-major gradient buffer).
    model_len: usize,
}

impl Fsdp2Unit {
    pub fn new(unit: &Unit<'_>, world: usize, rank: usize) -> Result<Self> {
        let (mut local, mut model) = (0usize, 0usize);
        let mut params = Vec::with_capacity(unit.tensors.len());
        for t in &unit.tensors {
            let rows = t.shape.first().copied().unwrap_or(1);
            let numel = t.numel();
            let row = numel.checked_div(rows).unwrap_or(0);
            let chunk_rows = rows.div_ceil(world);
            params.push(Param {
                name: t.name.clone(),
                shape: t.shape.clone(),
                rows,
                row,
                chunk_rows,
                local_offset: local,
                model_offset: model,
            });
            let overflow = || Error::InvalidShape {
                op: "fsdp2 layout",
                shape: t.shape.clone(),
                reason: "the unit's size overflows usize".into(),
            };
            local = chunk_rows
                .checked_mul(row)
                .and_then(|c| c.checked_add(local))
                .ok_or_else(overflow)?;
            model = model.checked_add(numel).ok_or_else(overflow)?;
        }
        Ok(Fsdp2Unit {
            world,
            rank,
            params,
            shard_len: local,
            model_len: model,
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

    pub(crate) fn slots(&self) -> Vec<TensorSlot> {
        self.params
            .iter()
            .map(|p| TensorSlot {
                name: p.name.clone(),
                shape: p.shape.clone(),
            })
            .collect()
    }

    /// Gradients land parameter-major, unpadded, as in a model's own `.grad` tensors.
    pub(crate) fn grad_slots(&self) -> (Vec<(usize, usize)>, usize) {
        let slots = self
            .params
            .iter()
            .map(|p| (p.model_offset, p.rows * p.row))
            .collect();
        (slots, self.model_len)
    }

    /// All-gather into the rank-major buffer, then copy-out into every tensor's storage.
    pub(crate) fn gather(
        &self,
        comm: &dyn Communicator,
        master: Buf<'_>,
        dsts: &mut [BufMut<'_>],
        stats: &CopyStats,
    ) -> Result<()> {
        let full = self.world * self.shard_len;
        match master {
            Buf::F32(m) => {
                let mut gathered = vec![0f32; full];
                comm.all_gather(Buf::F32(m), BufMut::F32(&mut gathered))?;
                stats.add_collective(4 * full);
                self.copy_out(&gathered, dsts, stats, |d| match d {
                    BufMut::F32(d) => Some(d),
                    _ => None,
                })
            }
            Buf::BF16(m) => {
                let mut gathered = vec![half::bf16::ZERO; full];
                comm.all_gather(Buf::BF16(m), BufMut::BF16(&mut gathered))?;
                stats.add_collective(2 * full);
                self.copy_out(&gathered, dsts, stats, |d| match d {
                    BufMut::BF16(d) => Some(d),
                    _ => None,
                })
            }
            _ => Err(Error::InvalidShard {
                op: "fsdp2 gather",
                reason: "parameters that are not f32 or bf16 host memory".into(),
            }),
        }
    }

    fn copy_out<T: Copy>(
        &self,
        gathered: &[T],
        dsts: &mut [BufMut<'_>],
        stats: &CopyStats,
        as_slice: impl for<'a, 'b> Fn(&'a mut BufMut<'b>) -> Option<&'a mut [T]>,
    ) -> Result<()> {
        for (p, dst) in self.params.iter().zip(dsts.iter_mut()) {
            let dst = as_slice(dst).ok_or_else(|| Error::InvalidShard {
                op: "fsdp2 copy-out",
                reason: format!("{}: destination of another dtype", p.name),
            })?;
            self.for_each_chunk(p, |rank_major, local, len| {
                dst[local..local + len].copy_from_slice(&gathered[rank_major..rank_major + len]);
                stats.add_copied(len * std::mem::size_of::<T>());
            });
        }
        Ok(())
    }

    /// Copy-in of the parameter-major gradients into the rank-major padded buffer, then
    /// reduce-scatter into `local`.
    pub(crate) fn reduce<T: Copy + Default>(
        &self,
        comm: &dyn Communicator,
        grads: &mut [T],
        local: &mut [T],
        op: ReduceOp,
        stats: &CopyStats,
    ) -> Result<()>
    where
        for<'a> BufMut<'a>: From<&'a mut [T]>,
    {
        let full = self.world * self.shard_len;
        if grads.len() != self.model_len || local.len() != self.shard_len {
            return Err(Error::InvalidShard {
                op: "fsdp2 reduce",
                reason: format!("buffers of {} and {} elements", grads.len(), local.len()),
            });
        }
        let size = std::mem::size_of::<T>();
        let mut rank_major = vec![T::default(); full];
        for p in &self.params {
            let src = &grads[p.model_offset..p.model_offset + p.rows * p.row];
            self.for_each_chunk(p, |rm, off, len| {
                rank_major[rm..rm + len].copy_from_slice(&src[off..off + len]);
                stats.add_copied(size * len);
            });
        }
        let staged = comm.reduce_scatter((&mut rank_major[..]).into(), local.into(), op)?;
        stats.add_copied(staged);
        stats.add_collective(size * full);
        Ok(())
    }

    /// Calls `f(rank-major offset, offset inside the parameter, length)` for every rank's chunk
    /// of parameter `p`.
    fn for_each_chunk(&self, p: &Param, mut f: impl FnMut(usize, usize, usize)) {
        for k in 0..self.world {
            let rows = p.rows_on(k);
            let len = rows.len() * p.row;
            if len > 0 {
                f(k * self.shard_len + p.local_offset, rows.start * p.row, len);
            }
        }
    }
}
