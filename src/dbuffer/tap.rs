//! The candle op that makes a unit's gathered storage a parameter tensor, and routes its gradient
//! into the unit's gradient buffer.
//!
//! candle has no way to hand a preallocated gradient buffer to backward, and a tensor sharing
//! storage with others (a `narrow` view) gets its gradient zero-padded to the whole storage
//! (`reference/rust-stack.md` §3.4). So every parameter gets its own storage, written by the
//! all-gather (no copy), and enters the graph through [`ParamTap`], a custom op on one scalar
//! anchor variable:
//! - **forward** moves the storage into the output tensor (no copy: the all-gather's bytes *are*
//!   the parameter);
//! - **backward** writes the parameter's gradient into the unit's gradient buffer at the
//!   planned offset ([`GradSink`]: copied the first time, added after, so micro-batches
//!   accumulate there), and returns no gradient for the anchor.
//!
//! Between a unit's forward and backward the runtime may empty a parameter tensor's storage and
//! move a re-gathered one in later ([`take_storage`], [`refill_storage`]): the graph keeps the
//! tensor, and every tensor derived from it without a copy shares the storage object.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Storage, Tensor, Var};

use super::grads::GradSink;
use crate::{Error, Result};

/// The custom op behind one parameter tensor (module doc).
pub(crate) struct ParamTap {
    /// The gathered storage until forward moves it into the output.
    storage: Mutex<Option<Storage>>,
    shape: Shape,
    sink: Arc<GradSink>,
    /// Index of the tensor in the sink.
    tensor: usize,
}

impl ParamTap {
    fn take(&self) -> candle_core::Result<Storage> {
        let mut slot = self.storage.lock().unwrap_or_else(|e| e.into_inner());
        slot.take()
            .ok_or_else(|| candle_core::Error::Msg("ragged-param: storage already taken".into()))
    }
}

fn wrong_device() -> candle_core::Error {
    candle_core::Error::Msg("ragged-param: the storage is not on the anchor's device".into())
}

impl CustomOp1 for ParamTap {
    fn name(&self) -> &'static str {
        "ragged-param"
    }

    fn cpu_fwd(
        &self,
        _anchor: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match self.take()? {
            Storage::Cpu(storage) => Ok((storage, self.shape.clone())),
            _ => Err(wrong_device()),
        }
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        _anchor: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        match self.take()? {
            Storage::Cuda(storage) => Ok((storage, self.shape.clone())),
            _ => Err(wrong_device()),
        }
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.sink
            .accumulate(self.tensor, grad)
            .map_err(candle_core::Error::wrap)?;
        // The anchor is a variable, so candle does not ask for its gradient.
        Ok(None)
    }
}

/// Wraps `storage` (a tensor's full elements, in the tensor's shape, on the anchor's device)
/// into a tracked parameter tensor whose gradient goes to `sink`'s tensor `tensor`. The storage
/// is moved, not copied.
pub(crate) fn param_tensor(
    anchor: &Var,
    storage: Storage,
    shape: &[usize],
    sink: Arc<GradSink>,
    tensor: usize,
) -> Result<Tensor> {
    let n = shape.iter().product::<usize>();
    let len = storage_len(&storage);
    if len != Some(n) {
        return Err(Error::InvalidShard {
            op: "param_tensor",
            reason: format!("{len:?} elements for shape {shape:?}"),
        });
    }
    let tap = ParamTap {
        storage: Mutex::new(Some(storage)),
        shape: Shape::from_dims(shape),
        sink,
        tensor,
    };
    anchor
        .as_tensor()
        .apply_op1(tap)
        .map_err(super::candle("param_tensor"))
}

/// Replaces a parameter tensor's storage wholesale, in place (FSDP2's free and re-allocation of
/// the unsharded parameter's storage while autograd keeps the graph): every tensor the graph
/// holds that shares the storage (the tensor itself, its transposes and broadcasts) sees the
/// new elements; none is copied.
struct SwapStorage {
    new: std::cell::Cell<Option<Storage>>,
    old: std::cell::Cell<Option<Storage>>,
}

impl candle_core::InplaceOp1 for SwapStorage {
    fn name(&self) -> &'static str {
        "ragged-swap-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        match self.new.take() {
            Some(Storage::Cpu(new)) => {
                self.old
                    .set(Some(Storage::Cpu(std::mem::replace(storage, new))));
                Ok(())
            }
            _ => Err(wrong_device()),
        }
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        match self.new.take() {
            Some(Storage::Cuda(new)) => {
                self.old
                    .set(Some(Storage::Cuda(std::mem::replace(storage, new))));
                Ok(())
            }
            _ => Err(wrong_device()),
        }
    }
}

/// Elements of an f32 or bf16 storage (`None` for other dtypes).
pub(crate) fn storage_len(s: &Storage) -> Option<usize> {
    match s {
        Storage::Cpu(CpuStorage::F32(v)) => Some(v.len()),
        Storage::Cpu(CpuStorage::BF16(v)) => Some(v.len()),
        #[cfg(feature = "candle-cuda")]
        Storage::Cuda(cs) => match &cs.slice {
            candle_core::cuda_backend::CudaStorageSlice::F32(v) => Some(v.len()),
            candle_core::cuda_backend::CudaStorageSlice::BF16(v) => Some(v.len()),
            _ => None,
        },
        _ => None,
    }
}

/// Moves `storage` into `t`'s storage object and returns what it held.
fn replace_storage(t: &Tensor, storage: Storage) -> Result<Storage> {
    let op = SwapStorage {
        new: std::cell::Cell::new(Some(storage)),
        old: std::cell::Cell::new(None),
    };
    t.inplace_op1(&op).map_err(super::candle("swap storage"))?;
    op.old.take().ok_or_else(|| Error::InvalidShard {
        op: "swap storage",
        reason: "the tensor is on a device this build has no backend for".into(),
    })
}

/// What a freed parameter holds on `t`'s device: the smallest storage of **bytes** (empty on
/// the host; one byte on a GPU, whose driver refuses empty allocations). Not of `t`'s dtype on
/// purpose: a stage that computes with a freed parameter (a clone kept from an earlier stage,
/// against the runtime's contract) then meets a storage whose dtype is not the tensor's, and
/// candle's ops refuse it (a dtype mismatch, or an index past its end) instead of its kernels
/// reading past an empty `f32` buffer, which crashed the process.
fn placeholder(t: &Tensor) -> Result<Storage> {
    match t.device() {
        candle_core::Device::Cpu => Ok(Storage::Cpu(CpuStorage::U8(Vec::new()))),
        #[cfg(feature = "candle-cuda")]
        candle_core::Device::Cuda(dev) => {
            let op = super::candle("free a parameter's storage");
            let bytes = dev.alloc_zeros::<u8>(1).map_err(&op)?;
            Ok(Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(
                bytes,
                dev.clone(),
            )))
        }
        other => Err(Error::InvalidShard {
            op: "free a parameter's storage",
            reason: format!("parameters on {other:?}"),
        }),
    }
}

/// Takes parameter tensor `t`'s elements out: its storage object (shared with every tensor of a
/// kept graph derived from it without a copy) is left with a placeholder. Returns what it held.
pub(crate) fn take_storage(t: &Tensor) -> Result<Storage> {
    replace_storage(t, placeholder(t)?)
}

/// Moves `storage` (exactly `t`'s elements) into parameter tensor `t`'s storage object, so every
/// tensor of a kept graph sharing it reads the new elements; nothing is copied.
pub(crate) fn refill_storage(t: &Tensor, storage: Storage) -> Result<()> {
    let len = storage_len(&storage);
    if t.layout().start_offset() != 0 || len != Some(t.elem_count()) {
        return Err(Error::InvalidShard {
            op: "refill_storage",
            reason: format!(
                "a storage of {len:?} elements for a tensor of {} at offset {}",
                t.elem_count(),
                t.layout().start_offset()
            ),
        });
    }
    replace_storage(t, storage).map(drop)
}
