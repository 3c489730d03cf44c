//! DBuffer: a unit's parameters and gradients, laid out by its plan, moved by collectives
//! without copies.
//!
//! The geometry (world size `V`, shard size `S`, this rank, every tensor's offset) comes from
//! the plan and never changes. Per unit and rank there are two buffers:
//! - [`ParamBuffer`] (role `Params`): the fp32 **master shard** (`S` elements, what the optimizer
//!   steps on) and, while materialized, the **compute copies**: one storage per tensor, which
//!   the all-gather writes straight into ([`crate::comm::Communicator::all_gather_segments`]) and
//!   which become the model's parameter tensors without a copy (`tap`).
//! - [`GradBuffer`] (role `Grads`): the **full gradient buffer** (`V·S`, each tensor's gradient at
//!   its planned offset, padding zero) that backward accumulates into ([`GradSink`]), and the
//!   reduced **local shard** the reduce-scatter writes (`S`, separate, so the full buffer is
//!   freed right after).
//!
//! # Vocabulary
//! - **full buffer**: `V·S` elements, every rank's data. For parameters it is never one
//!   allocation: each tensor's elements live in their own storage and padding is not stored.
//! - **local shard**: the `S` elements this rank owns, `[rank·S, (rank+1)·S)` of the full buffer.
//! - **materialized**: the compute copies exist (after a gather, until released).
//!
//! Padding is zero in every role: shards start zeroed, the optimizers never write outside their
//! pieces, and the gradient buffer's padding is never written.
//!
//! # What is copied
//! Nothing on the parameter path: the all-gather writes each rank's shard into the tensors'
//! storages, and candle uses those storages. On the gradient path candle always allocates a
//! fresh gradient per parameter; backward writes it once into the full gradient buffer (a copy
//! for a tensor's first gradient, an add for later micro-batches: [`CopyStats::accumulated`]),
//! and the reduce-scatter reads that buffer in place. [`CopyStats::copied`] counts every other
//! byte moved outside collectives (0 on the ragged path; the FSDP2-style baseline's copy-out
//! and copy-in).

mod grads;
mod params;
pub(crate) mod tap;

pub use grads::{GradBuffer, GradPool, GradSink};
pub use params::{anchor, anchor_on, placement_of, Materialized, ParamBuffer, TensorSlot};

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};

use crate::comm::{Buf, BufMut};
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
    /// Bytes copied by explicit copies (copy-in / copy-out, re-layouts, a backend's staging),
    /// excluding collectives.
    pub copied: AtomicU64,
    /// Bytes of gradients added into gradient buffers (one pass per gradient per backward, and
    /// per later micro-batch on the local shard).
    pub accumulated: AtomicU64,
    /// Bytes of activations copied at unit boundaries (a stage's output becomes the next stage's
    /// input variable): not on the parameter or gradient path.
    pub activations: AtomicU64,
    /// Bytes written by dtype casts under mixed precision (the master shard cast to the
    /// compute dtype before a gather, gradients cast to the reduce dtype and back).
    pub converted: AtomicU64,
    /// Bytes read or written by collectives (for reference).
    pub collective: AtomicU64,
}

impl CopyStats {
    pub fn copied(&self) -> u64 {
        self.copied.load(Ordering::Relaxed)
    }
    pub fn accumulated(&self) -> u64 {
        self.accumulated.load(Ordering::Relaxed)
    }
    pub fn activations(&self) -> u64 {
        self.activations.load(Ordering::Relaxed)
    }
    pub fn converted(&self) -> u64 {
        self.converted.load(Ordering::Relaxed)
    }
    pub fn collective(&self) -> u64 {
        self.collective.load(Ordering::Relaxed)
    }
    pub fn add_converted(&self, bytes: usize) {
        self.converted.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub fn add_copied(&self, bytes: usize) {
        self.copied.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub fn add_accumulated(&self, bytes: usize) {
        self.accumulated.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub fn add_activations(&self, bytes: usize) {
        self.activations.fetch_add(bytes as u64, Ordering::Relaxed);
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

/// Maps a candle error to ours, naming the operation.
pub fn candle(op: &'static str) -> impl Fn(candle_core::Error) -> Error {
    move |source| Error::Candle { op, source }
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

/// Runs `f` on a contiguous tensor's elements, read-only, without copying: host memory for a
/// CPU tensor, device memory (`Buf::Device`) for a CUDA tensor (feature `candle-cuda`).
pub fn with_ref<R>(t: &Tensor, f: impl FnOnce(Buf<'_>) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let range = span(layout, "with_ref")?;
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => f(Buf::F32(&v[range])),
        Storage::Cpu(CpuStorage::BF16(v)) => f(Buf::BF16(&v[range])),
        Storage::Cpu(CpuStorage::U8(v)) => f(Buf::U8(&v[range])),
        #[cfg(feature = "candle-cuda")]
        Storage::Cuda(cs) => f(Buf::Device(cuda_view(cs, t.dtype(), range)?)),
        _ => Err(Error::InvalidShard {
            op: "with_ref",
            reason: format!("unsupported storage {:?} on {:?}", t.dtype(), t.device()),
        }),
    }
}

/// Runs `f` on a contiguous tensor's elements, mutably, without copying (through candle's
/// in-place op hook, which holds the storage's write lock while `f` runs): host memory for a
/// CPU tensor, device memory for a CUDA tensor (feature `candle-cuda`).
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

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<()> {
        let Some(f) = self.f.take() else {
            return Ok(());
        };
        let out = span(layout, "with_mut")
            .and_then(|range| cuda_view_mut(storage, range))
            .and_then(|buf| f(BufMut::Device(buf)));
        self.out.set(Some(out));
        Ok(())
    }
}

/// Elements `range` of a CUDA tensor's storage, as a device buffer.
#[cfg(feature = "candle-cuda")]
fn cuda_view(
    cs: &candle_core::CudaStorage,
    dtype: candle_core::DType,
    range: std::ops::Range<usize>,
) -> Result<crate::cuda::collective::DevBuf<'_>> {
    use crate::cuda::collective::DevBuf;
    use candle_core::DType;
    let op = candle("with_ref (cuda)");
    Ok(match dtype {
        DType::F32 => DevBuf::F32(cs.as_cuda_slice::<f32>().map_err(&op)?.slice(range)),
        DType::BF16 => DevBuf::BF16(cs.as_cuda_slice::<half::bf16>().map_err(&op)?.slice(range)),
        DType::U8 => DevBuf::U8(cs.as_cuda_slice::<u8>().map_err(&op)?.slice(range)),
        other => {
            return Err(Error::InvalidShard {
                op: "with_ref",
                reason: format!("unsupported dtype {other:?} on a CUDA tensor"),
            })
        }
    })
}

/// Elements `range` of a CUDA tensor's storage, writable.
#[cfg(feature = "candle-cuda")]
fn cuda_view_mut(
    cs: &mut candle_core::CudaStorage,
    range: std::ops::Range<usize>,
) -> Result<crate::cuda::collective::DevBufMut<'_>> {
    use crate::cuda::collective::DevBufMut;
    use candle_core::DType;
    let op = candle("with_mut (cuda)");
    Ok(match candle_core::backend::BackendStorage::dtype(&*cs) {
        DType::F32 => DevBufMut::F32(cs.as_cuda_slice_mut::<f32>().map_err(&op)?.slice_mut(range)),
        DType::BF16 => DevBufMut::BF16(
            cs.as_cuda_slice_mut::<half::bf16>()
                .map_err(&op)?
                .slice_mut(range),
        ),
        DType::U8 => DevBufMut::U8(cs.as_cuda_slice_mut::<u8>().map_err(&op)?.slice_mut(range)),
        other => {
            return Err(Error::InvalidShard {
                op: "with_mut",
                reason: format!("unsupported dtype {other:?} on a CUDA tensor"),
            })
        }
    })
}
