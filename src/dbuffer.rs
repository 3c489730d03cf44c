//! DBuffer: one allocation per group and role, whose slices *are* the tensors.
//!
//! The geometry (world size `V`, shard size `S`, this rank, and every tensor's offset) comes
//! from the plan and never changes; the bytes live in one candle tensor. Parameters the model
//! uses are `narrow(..).reshape(..)` views of the full buffer, so the all-gather writes straight
//! into the model's parameters and the reduce-scatter reads straight out of the gradients: no
//! copy-in, no copy-out.
//!
//! # Vocabulary
//! - **full buffer**: `V·S` elements, every rank's data; materialized for compute.
//! - **local shard**: the `S` elements this rank owns, `[rank·S, (rank+1)·S)` of the full buffer.
//!   While the full buffer is kept, the local shard *is* that slice (in-place collectives);
//!   otherwise it is a separate persistent `S`-element tensor and the full buffer is freed.
//! - **view**: a tensor sharing the full buffer's storage (no copy).
//!
//! Padding is zero in every role: buffers start zeroed, collectives move padding like data, and
//! the optimizers never write outside their pieces.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Storage, Tensor, Var};

use crate::comm::{Buf, BufMut, Communicator, ReduceOp};
use crate::{Error, Result};

/// What a buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// fp32 parameters (the master copy's local shard, and the unsharded buffer the model reads).
    Params,
    /// Gradients (full buffer from backward; the local shard after reduce-scatter).
    Grads,
}

/// Byte counters shared by the buffers of one sharded model: what moved outside collectives.
#[derive(Debug, Default)]
pub struct CopyStats {
    /// Bytes copied by explicit copies (copy-in / copy-out, re-layouts), excluding collectives.
    pub copied: AtomicU64,
    /// Bytes read or written by collectives (for reference).
    pub collective: AtomicU64,
}

impl CopyStats {
    pub fn copied(&self) -> u64 {
        self.copied.load(Ordering::Relaxed)
    }
    pub fn collective(&self) -> u64 {
        self.collective.load(Ordering::Relaxed)
    }
    pub fn add_copied(&self, bytes: usize) {
        self.copied.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub fn add_collective(&self, bytes: usize) {
        self.collective.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// Where each tensor lives in a group's full buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub world: usize,
    pub rank: usize,
    /// Elements per rank, `S`.
    pub shard_size: usize,
    /// `(name, shape, offset)` of every tensor in the full buffer.
    pub tensors: Vec<(String, Vec<usize>, usize)>,
}

impl Geometry {
    /// `V·S`.
    pub fn full_len(&self) -> usize {
        self.world * self.shard_size
    }
    /// This rank's slice of the full buffer.
    pub fn local_range(&self) -> std::ops::Range<usize> {
        self.rank * self.shard_size..(self.rank + 1) * self.shard_size
    }
}

/// One group's buffer for one role.
pub struct DBuffer {
    role: Role,
    geometry: Arc<Geometry>,
    /// The full buffer, a `Var` so that backward reaches it through the views.
    full: Option<Var>,
    /// The persistent local shard when the full buffer is not kept.
    shard: Option<Tensor>,
    stats: Arc<CopyStats>,
}

impl DBuffer {
    /// A zeroed buffer. With `keep_full`, the full buffer is allocated now and kept; the local
    /// shard is its own slice. Otherwise only the `S`-element shard is allocated.
    pub fn zeros(
        role: Role,
        geometry: Arc<Geometry>,
        keep_full: bool,
        stats: Arc<CopyStats>,
    ) -> Result<Self> {
        let cpu = Device::Cpu;
        let (full, shard) = if keep_full {
            let v = Var::zeros(geometry.full_len(), DType::F32, &cpu).map_err(candle("zeros"))?;
            (Some(v), None)
        } else {
            let t =
                Tensor::zeros(geometry.shard_size, DType::F32, &cpu).map_err(candle("zeros"))?;
            (None, Some(t))
        };
        Ok(DBuffer {
            role,
            geometry,
            full,
            shard,
            stats,
        })
    }

    pub fn role(&self) -> Role {
        self.role
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Whether the full buffer is materialized.
    pub fn is_unsharded(&self) -> bool {
        self.full.is_some()
    }

    /// The full buffer as a tensor (its storage is shared with every view).
    pub fn full(&self) -> Result<&Var> {
        self.full.as_ref().ok_or_else(|| Error::InvalidShard {
            op: "DBuffer::full",
            reason: format!("{:?} buffer is sharded; call unshard first", self.role),
        })
    }

    /// Zero-copy views of every tensor, by name: `narrow(0, offset, numel).reshape(shape)` of
    /// the full buffer.
    pub fn views(&self) -> Result<Vec<(String, Tensor)>> {
        let full = self.full()?.as_tensor();
        self.geometry
            .tensors
            .iter()
            .map(|(name, shape, offset)| {
                let n = shape.iter().product::<usize>().max(1);
                let view = full
                    .narrow(0, *offset, n)
                    .and_then(|t| t.reshape(shape.as_slice()))
                    .map_err(candle("DBuffer::views"))?;
                Ok((name.clone(), view))
            })
            .collect()
    }

    /// Materializes the full buffer and all-gathers every rank's shard into it. With a kept full
    /// buffer this is one in-place all-gather; otherwise a fresh buffer is allocated and
    /// gathered into from the persistent shard (the collective reads the shard directly).
    pub fn unshard(&mut self, comm: &dyn Communicator) -> Result<()> {
        let bytes = self.geometry.full_len() * 4;
        match (&self.full, &self.shard) {
            (Some(full), None) => with_mut(full.as_tensor(), |b| comm.all_gather_in_place(b))?,
            (_, Some(shard)) => {
                let fresh = Var::zeros(self.geometry.full_len(), DType::F32, &Device::Cpu)
                    .map_err(candle("unshard"))?;
                with_ref(shard, |s| {
                    with_mut(fresh.as_tensor(), |f| comm.all_gather(s, f))
                })?;
                self.full = Some(fresh);
            }
            (None, None) => unreachable!("a buffer always has a full buffer or a shard"),
        }
        self.stats.add_collective(bytes);
        Ok(())
    }

    /// Frees the full buffer when a separate shard is kept (the memory returns once the model
    /// and autograd graph holding views of it are dropped). A no-op for kept buffers.
    pub fn reshard(&mut self) {
        if self.shard.is_some() {
            self.full = None;
        }
    }

    /// A buffer whose full buffer is `full` (a `V·S` tensor, e.g. the gradient candle computed
    /// for a params buffer), adopted without copying.
    pub fn from_full(
        role: Role,
        geometry: Arc<Geometry>,
        full: Tensor,
        stats: Arc<CopyStats>,
    ) -> Result<Self> {
        if full.elem_count() != geometry.full_len() {
            return Err(Error::InvalidShard {
                op: "DBuffer::from_full",
                reason: format!(
                    "tensor of {} elements for a buffer of {}",
                    full.elem_count(),
                    geometry.full_len()
                ),
            });
        }
        let full = Var::from_tensor(&full).map_err(candle("from_full"))?;
        Ok(DBuffer {
            role,
            geometry,
            full: Some(full),
            shard: None,
            stats,
        })
    }

    /// Reduce-scatters the full buffer in place; its own slice (what [`DBuffer::with_local`]
    /// reads for gradients) then holds the reduction.
    pub fn reduce_scatter(&mut self, comm: &dyn Communicator, op: ReduceOp) -> Result<()> {
        let full = self.full()?.as_tensor().clone();
        with_mut(&full, |b| comm.reduce_scatter_in_place(b, op))?;
        self.stats.add_collective(self.geometry.full_len() * 4);
        Ok(())
    }

    /// Runs `f` on the local shard, mutably (the own slice of the kept full buffer, or the
    /// separate shard).
    pub fn with_local_mut<R>(&self, f: impl FnOnce(&mut [f32]) -> Result<R>) -> Result<R> {
        let range = self.geometry.local_range();
        match (&self.shard, &self.full) {
            (Some(shard), _) => with_mut(shard, |b| f(f32_mut(b)?)),
            (None, Some(full)) => with_mut(full.as_tensor(), |b| f(&mut f32_mut(b)?[range])),
            (None, None) => unreachable!("a buffer always has a full buffer or a shard"),
        }
    }

    /// Runs `f` on the local shard, read-only. For gradients this is the own slice of the full
    /// buffer after [`DBuffer::reduce_scatter`].
    pub fn with_local<R>(&self, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
        let range = self.geometry.local_range();
        match (&self.full, &self.shard) {
            (Some(full), _) if self.role == Role::Grads || self.shard.is_none() => {
                with_ref(full.as_tensor(), |b| f(&f32_ref(b)?[range]))
            }
            (_, Some(shard)) => with_ref(shard, |b| f(f32_ref(b)?)),
            _ => Err(Error::InvalidShard {
                op: "DBuffer::with_local",
                reason: format!("{:?} buffer holds no data", self.role),
            }),
        }
    }

    /// Fused group op: `x ← 0` over the local shard (one pass).
    pub fn zero_local(&self) -> Result<()> {
        self.with_local_mut(|x| {
            x.fill(0.0);
            Ok(())
        })
    }

    /// Fused group op: `x ← a·x` over the local shard (one pass).
    pub fn scale_local(&self, a: f32) -> Result<()> {
        self.with_local_mut(|x| {
            x.iter_mut().for_each(|v| *v *= a);
            Ok(())
        })
    }

    /// Fused group op: `x ← x + y` over the local shard (one pass; `y` has the same geometry).
    pub fn add_local(&self, y: &DBuffer) -> Result<()> {
        y.with_local(|ys| {
            self.with_local_mut(|xs| {
                check_len(xs.len(), ys.len(), "DBuffer::add_local")?;
                xs.iter_mut().zip(ys).for_each(|(x, y)| *x += y);
                Ok(())
            })
        })
    }

    /// Fused group op: `x ← y` over the local shard (one pass, counted as copied bytes).
    pub fn copy_local_from(&self, y: &DBuffer) -> Result<()> {
        y.with_local(|ys| {
            self.with_local_mut(|xs| {
                check_len(xs.len(), ys.len(), "DBuffer::copy_local_from")?;
                xs.copy_from_slice(ys);
                self.stats.add_copied(4 * ys.len());
                Ok(())
            })
        })
    }
}

fn check_len(a: usize, b: usize, op: &'static str) -> Result<()> {
    if a != b {
        return Err(Error::InvalidShard {
            op,
            reason: format!("local shards of {a} and {b} elements"),
        });
    }
    Ok(())
}

/// Maps a candle error to ours, naming the operation.
pub fn candle(op: &'static str) -> impl Fn(candle_core::Error) -> Error {
    move |source| Error::Candle { op, source }
}

/// The f32 slice of a buffer, or an error naming its element type.
pub(crate) fn f32_mut<'a>(b: BufMut<'a>) -> Result<&'a mut [f32]> {
    match b {
        BufMut::F32(x) => Ok(x),
        other => Err(Error::InvalidShard {
            op: "f32 buffer",
            reason: format!("{:?} storage", other.elem_type()),
        }),
    }
}

/// The f32 slice of a buffer, or an error naming its element type.
pub(crate) fn f32_ref<'a>(b: Buf<'a>) -> Result<&'a [f32]> {
    match b {
        Buf::F32(x) => Ok(x),
        other => Err(Error::InvalidShard {
            op: "f32 buffer",
            reason: format!("{:?} storage", other.elem_type()),
        }),
    }
}

/// The contiguous element range of a tensor's layout in its storage.
fn span(layout: &Layout, op: &'static str) -> Result<std::ops::Range<usize>> {
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| Error::InvalidShard {
            op,
            reason: "tensor is not contiguous".into(),
        })?;
    Ok(a..b)
}

/// Runs `f` on a contiguous CPU tensor's elements, read-only, without copying.
pub fn with_ref<R>(t: &Tensor, f: impl FnOnce(Buf<'_>) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let range = span(layout, "with_ref")?;
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => f(Buf::F32(&v[range])),
        Storage::Cpu(CpuStorage::BF16(v)) => f(Buf::BF16(&v[range])),
        Storage::Cpu(CpuStorage::U8(v)) => f(Buf::U8(&v[range])),
        _ => Err(Error::InvalidShard {
            op: "with_ref",
            reason: format!("unsupported storage {:?} on {:?}", t.dtype(), t.device()),
        }),
    }
}

/// Runs `f` on a contiguous CPU tensor's elements, mutably, without copying (through candle's
/// in-place op hook, which holds the storage's write lock while `f` runs).
pub fn with_mut<R>(t: &Tensor, f: impl FnOnce(BufMut<'_>) -> Result<R>) -> Result<R> {
    let op = WithMut {
        f: Cell::new(Some(f)),
        out: Cell::new(None),
    };
    t.inplace_op1(&op).map_err(candle("with_mut"))?;
    op.out.into_inner().unwrap_or_else(|| {
        Err(Error::InvalidShard {
            op: "with_mut",
            reason: "tensor is not on the CPU".into(),
        })
    })
}

struct WithMut<F, R> {
    f: Cell<Option<F>>,
    out: Cell<Option<Result<R>>>,
}

impl<F: FnOnce(BufMut<'_>) -> Result<R>, R> InplaceOp1 for WithMut<F, R> {
    fn name(&self) -> &'static str {
        "ragged-with-mut"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some(f) = self.f.take() else {
            return Ok(());
        };
        let range = match span(layout, "with_mut") {
            Ok(r) => r,
            Err(e) => {
                self.out.set(Some(Err(e)));
                return Ok(());
            }
        };
        let out = match storage {
            CpuStorage::F32(v) => f(BufMut::F32(&mut v[range])),
            CpuStorage::BF16(v) => f(BufMut::BF16(&mut v[range])),
            CpuStorage::U8(v) => f(BufMut::U8(&mut v[range])),
            _ => Err(Error::InvalidShard {
                op: "with_mut",
                reason: "unsupported dtype (f32, bf16 and u8 are)".into(),
            }),
        };
        self.out.set(Some(out));
        Ok(())
    }
}
