//! A unit's parameters: the fp32 master shard this rank owns, and the compute copies the
//! all-gather materializes (one storage per tensor, each a parameter tensor through
//! [`super::tap`]).

use std::sync::Arc;

use candle_core::{CpuStorage, DType, Device, Storage as CandleStorage, Tensor, Var};

use super::grads::GradSink;
use super::{candle, tap};
use crate::comm::{Buf, BufMut};
use crate::storage::{Placement, Storage, View, ViewMut};
use crate::{Error, Result};

/// One tensor of a unit: name and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSlot {
    pub name: String,
    pub shape: Vec<usize>,
}

impl TensorSlot {
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<usize>()
    }
}

/// The state of a unit's compute copies (as FSDP2's `ShardedState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Materialized {
    /// Only the master shard exists: `S` elements per rank.
    Sharded,
    /// Every tensor's full value exists (one storage each), current with the master shard.
    Unsharded,
    /// The full values exist but the master shard changed since (after a step): the next
    /// gather rewrites them in place.
    Stale,
    /// The parameter tensors exist (a kept graph holds them) but their storages were emptied
    /// after forward ([`ParamBuffer::take_storages`]): the next gather moves fresh storages into
    /// the same tensors.
    Freed,
}

/// A unit's parameters on one rank.
pub struct ParamBuffer {
    slots: Vec<TensorSlot>,
    /// The fp32 master shard, `S` elements (the optimizer steps on it), on the host or the
    /// device the compute copies live on.
    master: Storage<f32>,
    /// The compute copies, in slot order, while materialized.
    tensors: Option<Vec<Tensor>>,
    stale: bool,
    /// The tensors' storages are empty ([`Materialized::Freed`]).
    freed: bool,
    /// The dtype of the compute copies (f32, or bf16 under mixed precision).
    dtype: DType,
    sink: Arc<GradSink>,
    anchor: Var,
    /// Frozen: the compute copies are plain tensors outside any graph (no gradient).
    frozen: bool,
}

impl ParamBuffer {
    /// A zeroed master shard of `shard_len` elements for `slots`, whose gradients go to `sink`,
    /// at `placement`: the host for a CPU `anchor`, the anchor's GPU (feature `candle-cuda`;
    /// [`placement_of`] gives it, made once per model so its buffers share one device handle),
    /// where the compute copies live too.
    pub fn new(
        slots: Vec<TensorSlot>,
        placement: &Placement,
        shard_len: usize,
        dtype: DType,
        sink: Arc<GradSink>,
        anchor: Var,
    ) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(Error::InvalidShard {
                op: "ParamBuffer::new",
                reason: format!("compute dtype {dtype:?} (f32 and bf16 are supported)"),
            });
        }
        if placement.is_cpu() != anchor.device().is_cpu() {
            return Err(Error::InvalidShard {
                op: "ParamBuffer::new",
                reason: format!(
                    "a master shard at {placement:?} for parameters on {:?}",
                    anchor.device()
                ),
            });
        }
        Ok(ParamBuffer {
            slots,
            master: placement.zeros(shard_len)?,
            tensors: None,
            stale: false,
            freed: false,
            dtype,
            sink,
            anchor,
            frozen: false,
        })
    }

    /// Makes the compute copies plain tensors that take no gradient (frozen parameters).
    pub fn freeze(&mut self) {
        self.frozen = true;
    }

    pub fn is_frozen(&self) -> bool {
        self.frozen
    }

    pub fn slots(&self) -> &[TensorSlot] {
        &self.slots
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The master shard in host memory (`Err` on a GPU: see [`Self::master_view`]).
    pub fn master(&self) -> Result<&[f32]> {
        self.master.cpu()
    }

    /// The master shard, mutably, in host memory; marks materialized copies stale.
    pub fn master_mut(&mut self) -> Result<&mut [f32]> {
        self.mark_stale();
        self.master.cpu_mut()
    }

    /// The master shard's storage (host or device memory).
    pub fn master_storage(&self) -> &Storage<f32> {
        &self.master
    }

    /// The master shard's storage, writable; marks materialized copies stale.
    pub fn master_storage_mut(&mut self) -> &mut Storage<f32> {
        self.mark_stale();
        &mut self.master
    }

    /// The master shard rounded to bf16 where it lives (mixed precision's cast before the
    /// all-gather, as FSDP2's): `half::bf16::from_f32` on the host, the same rounding by one
    /// kernel on a device.
    pub fn master_bf16(&self) -> Result<Bf16Shard> {
        match &self.master {
            Storage::Cpu(v) => Ok(Bf16Shard::Host(
                v.iter().map(|&x| half::bf16::from_f32(x)).collect(),
            )),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => {
                let mut out = d.dev.zeros::<half::bf16>(d.data.len())?;
                crate::cuda::ops::f32_to_bf16(&d.dev, &d.data.slice(..), &mut out.slice_mut(..))?;
                Ok(Bf16Shard::Device(out))
            }
        }
    }

    /// The master shard on the host (borrowed; downloaded from a device).
    pub fn master_host(&self) -> Result<std::borrow::Cow<'_, [f32]>> {
        self.master.host()
    }

    /// The master shard where it lives (host or device).
    pub fn master_view(&self) -> View<'_, f32> {
        self.master.view()
    }

    /// The master shard where it lives, writable; marks materialized copies stale.
    pub fn master_view_mut(&mut self) -> ViewMut<'_, f32> {
        self.mark_stale();
        self.master.view_mut()
    }

    /// Replaces the master shard by `host` (`S` elements), moved on the host, uploaded to a
    /// device; marks materialized copies stale.
    pub fn set_master(&mut self, host: Vec<f32>) -> Result<()> {
        if host.len() != self.master.len() {
            return Err(Error::InvalidShard {
                op: "ParamBuffer::set_master",
                reason: format!(
                    "{} elements for a shard of {}",
                    host.len(),
                    self.master.len()
                ),
            });
        }
        self.mark_stale();
        self.master = self.master.placement().put(host)?;
        Ok(())
    }

    /// Where the master shard (and the compute copies) live.
    pub fn placement(&self) -> Placement {
        self.master.placement()
    }

    fn mark_stale(&mut self) {
        if self.tensors.is_some() {
            self.stale = true;
        }
    }

    pub fn state(&self) -> Materialized {
        match (&self.tensors, self.freed, self.stale) {
            (None, _, _) => Materialized::Sharded,
            (Some(_), true, _) => Materialized::Freed,
            (Some(_), false, false) => Materialized::Unsharded,
            (Some(_), false, true) => Materialized::Stale,
        }
    }

    /// Materializes the compute copies unless they are current: `fill(master, dsts)` must write
    /// every element of every tensor (`dsts` in slot order, in the compute dtype). Fresh
    /// storages become parameter tensors without a copy; stale ones are rewritten in place, and
    /// freed ones get fresh storages moved in, so tensors handed out earlier stay valid.
    pub fn gather(
        &mut self,
        fill: impl FnOnce(Buf<'_>, &mut [BufMut<'_>]) -> Result<()>,
    ) -> Result<()> {
        self.gather_into(None, fill)
    }

    /// [`Self::gather`], writing into `spare` storages (another buffer's, from
    /// [`Self::take_storages`]) where they match this buffer's tensors in number, dtype and
    /// length, instead of allocating: their old contents are overwritten by `fill`, so no
    /// zero-fill is paid. Spares are dropped when the copies are current already.
    pub fn gather_into(
        &mut self,
        spare: Option<Vec<CandleStorage>>,
        fill: impl FnOnce(Buf<'_>, &mut [BufMut<'_>]) -> Result<()>,
    ) -> Result<()> {
        match self.state() {
            Materialized::Unsharded => Ok(()),
            Materialized::Stale => {
                // Rewritten in place: the copies' own storages are taken out and refilled as a
                // freed buffer's spares are (the same memory, no allocation), one path for host
                // and device storages.
                let own = self.take_storages()?;
                self.gather_into(Some(own), fill)
            }
            Materialized::Freed => {
                let storages = self.filled_storages(spare, fill)?;
                let tensors = self.tensors.as_ref().expect("freed implies materialized");
                for (t, storage) in tensors.iter().zip(storages) {
                    tap::refill_storage(t, storage)?;
                }
                self.freed = false;
                self.stale = false;
                Ok(())
            }
            Materialized::Sharded => {
                let storages = self.filled_storages(spare, fill)?;
                let tensors = storages
                    .into_iter()
                    .zip(&self.slots)
                    .enumerate()
                    .map(|(i, (storage, slot))| {
                        let t = tap::param_tensor(
                            &self.anchor,
                            storage,
                            &slot.shape,
                            self.sink.clone(),
                            i,
                        )?;
                        // Detached, a frozen parameter shares the storage but leaves the graph.
                        Ok(if self.frozen { t.detach() } else { t })
                    })
                    .collect::<Result<Vec<_>>>()?;
                self.tensors = Some(tensors);
                self.stale = false;
                Ok(())
            }
        }
    }

    /// Storages for every tensor (`spare` where it fits), written by `fill` from the master.
    fn filled_storages(
        &self,
        spare: Option<Vec<CandleStorage>>,
        fill: impl FnOnce(Buf<'_>, &mut [BufMut<'_>]) -> Result<()>,
    ) -> Result<Vec<CandleStorage>> {
        let mut storages = self.storages_for_gather(spare)?;
        let mut dsts = storages
            .iter_mut()
            .map(storage_buf)
            .collect::<Result<Vec<_>>>()?;
        fill(self.master.view().into(), &mut dsts)?;
        drop(dsts);
        Ok(storages)
    }

    /// One storage per tensor for a gather to fill: `spare` if it fits every tensor, else
    /// zeroed ones on the anchor's device (calloc'd on the host: pages are touched only when
    /// written).
    fn storages_for_gather(&self, spare: Option<Vec<CandleStorage>>) -> Result<Vec<CandleStorage>> {
        match spare {
            Some(spare) if self.fits(&spare) => Ok(spare),
            _ => self
                .slots
                .iter()
                .map(|s| zeroed(self.anchor.device(), self.dtype, s.numel()))
                .collect(),
        }
    }

    /// Whether `storages` hold exactly this buffer's tensors, in slot order and compute dtype,
    /// on its device.
    fn fits(&self, storages: &[CandleStorage]) -> bool {
        storages.len() == self.slots.len()
            && storages.iter().zip(&self.slots).all(|(st, slot)| {
                st.dtype() == self.dtype
                    && st.device().same_device(self.anchor.device())
                    && tap::storage_len(st) == Some(slot.numel())
            })
    }

    /// The parameter tensors (tracked: their gradients reach the sink), in slot order.
    pub fn tensors(&self) -> Result<&[Tensor]> {
        match &self.tensors {
            Some(t) if !self.stale && !self.freed => Ok(t),
            _ => Err(Error::InvalidShard {
                op: "ParamBuffer::tensors",
                reason: format!("parameters are {:?}; gather first", self.state()),
            }),
        }
    }

    /// Drops this buffer's compute copies; their memory returns once the model and any graph
    /// holding them are dropped.
    pub fn release(&mut self) {
        self.tensors = None;
        self.stale = false;
        self.freed = false;
    }

    /// Frees the compute copies' elements now but keeps the tensors (FSDP2's
    /// `reshard_after_forward` with autograd's graph kept), handing the storages over (in slot
    /// order; empty when there were none) for another buffer's [`Self::gather_into`]. Every
    /// tensor sharing them, the kept graph's included, is left with a placeholder storage (empty
    /// on the host) until the next [`Self::gather`] moves fresh ones into the same tensors.
    pub fn take_storages(&mut self) -> Result<Vec<CandleStorage>> {
        let Some(tensors) = self.tensors.as_ref().filter(|_| !self.freed) else {
            return Ok(Vec::new());
        };
        let storages = tensors
            .iter()
            .map(tap::take_storage)
            .collect::<Result<Vec<_>>>()?;
        self.freed = true;
        Ok(storages)
    }

    /// Bytes of the compute copies when materialized.
    pub fn full_bytes(&self) -> usize {
        let n: usize = self.slots.iter().map(TensorSlot::numel).sum();
        n * self.dtype.size_in_bytes()
    }
}

/// A master shard rounded to bf16 ([`ParamBuffer::master_bf16`]), where the shard lives.
#[derive(Debug)]
pub enum Bf16Shard {
    Host(Vec<half::bf16>),
    #[cfg(feature = "cuda")]
    Device(cudarc::driver::CudaSlice<half::bf16>),
}

impl Bf16Shard {
    /// The elements as a collective's source.
    pub fn buf(&self) -> Buf<'_> {
        match self {
            Bf16Shard::Host(v) => Buf::BF16(v),
            #[cfg(feature = "cuda")]
            Bf16Shard::Device(d) => d.slice(..).into(),
        }
    }
}

/// `n` zeroed elements of `dtype` on `device`.
fn zeroed(device: &Device, dtype: DType, n: usize) -> Result<CandleStorage> {
    match device {
        Device::Cpu => Ok(CandleStorage::Cpu(match dtype {
            DType::BF16 => CpuStorage::BF16(vec![half::bf16::ZERO; n]),
            _ => CpuStorage::F32(vec![0.0; n]),
        })),
        #[cfg(feature = "candle-cuda")]
        Device::Cuda(dev) => {
            let err = candle("ParamBuffer: device storage");
            Ok(CandleStorage::Cuda(match dtype {
                DType::BF16 => {
                    let data = dev.alloc_zeros::<half::bf16>(n).map_err(err)?;
                    candle_core::CudaStorage::wrap_cuda_slice(data, dev.clone())
                }
                _ => {
                    let data = dev.alloc_zeros::<f32>(n).map_err(err)?;
                    candle_core::CudaStorage::wrap_cuda_slice(data, dev.clone())
                }
            }))
        }
        other => Err(no_device(other)),
    }
}

fn no_device(device: &Device) -> Error {
    Error::InvalidShard {
        op: "ParamBuffer",
        reason: format!(
            "parameters on {device:?}: this build has the CPU backend (and CUDA with the \
             `candle-cuda` feature)"
        ),
    }
}

/// Where a model whose parameters live on `device` keeps its shards (one device handle per
/// call: make it once per model).
pub fn placement_of(device: &Device) -> Result<Placement> {
    match device {
        Device::Cpu => Ok(Placement::Cpu),
        #[cfg(feature = "candle-cuda")]
        Device::Cuda(dev) => Ok(Placement::Cuda(Arc::new(crate::cuda::Device::from_candle(
            dev,
        )?))),
        other => Err(no_device(other)),
    }
}

/// A gather's destination for one tensor's storage.
fn storage_buf(s: &mut CandleStorage) -> Result<BufMut<'_>> {
    match s {
        CandleStorage::Cpu(CpuStorage::BF16(v)) => Ok(BufMut::BF16(v)),
        CandleStorage::Cpu(CpuStorage::F32(v)) => Ok(BufMut::F32(v)),
        #[cfg(feature = "candle-cuda")]
        CandleStorage::Cuda(cs) => {
            let err = candle("ParamBuffer: device storage");
            if candle_core::backend::BackendStorage::dtype(cs) == DType::BF16 {
                let slice = cs.as_cuda_slice_mut::<half::bf16>().map_err(err)?;
                Ok(slice.slice_mut(..).into())
            } else {
                let slice = cs.as_cuda_slice_mut::<f32>().map_err(err)?;
                Ok(slice.slice_mut(..).into())
            }
        }
        _ => Err(Error::InvalidShard {
            op: "ParamBuffer::gather",
            reason: "a storage that is not f32 or bf16".into(),
        }),
    }
}

/// The one-element f32 variable every parameter tensor of a model hangs off (see
/// `tap`), on the CPU.
pub fn anchor() -> Result<Var> {
    anchor_on(&Device::Cpu)
}

/// [`anchor`] on `device`: the parameter tensors hanging off it live there.
pub fn anchor_on(device: &Device) -> Result<Var> {
    Var::zeros((), DType::F32, device).map_err(candle("anchor"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dbuffer::CopyStats;

    fn buffer(shapes: &[&[usize]], master: &[f32]) -> ParamBuffer {
        let slots: Vec<TensorSlot> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| TensorSlot {
                name: format!("t{i}"),
                shape: s.to_vec(),
            })
            .collect();
        let sink = GradSink::new(Vec::new(), 0, Arc::new(CopyStats::default())).unwrap();
        let mut b = ParamBuffer::new(
            slots,
            &Placement::Cpu,
            master.len(),
            DType::F32,
            Arc::new(sink),
            anchor().unwrap(),
        )
        .unwrap();
        b.master_mut().unwrap().copy_from_slice(master);
        b
    }

    /// Fills the tensors with the master's elements, in order (a one-rank gather).
    fn fill(master: Buf<'_>, dsts: &mut [BufMut<'_>]) -> Result<()> {
        let Buf::F32(master) = master else {
            unreachable!()
        };
        let mut at = 0;
        for d in dsts {
            let BufMut::F32(d) = d else { unreachable!() };
            d.copy_from_slice(&master[at..at + d.len()]);
            at += d.len();
        }
        Ok(())
    }

    /// Every tensor's elements, in slot order.
    fn elements(b: &ParamBuffer) -> Vec<f32> {
        b.tensors()
            .unwrap()
            .iter()
            .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect()
    }

    fn data_ptrs(b: &ParamBuffer) -> Vec<usize> {
        b.tensors()
            .unwrap()
            .iter()
            .map(|t| match &*t.storage_and_layout().0 {
                candle_core::Storage::Cpu(CpuStorage::F32(v)) => v.as_ptr() as usize,
                _ => unreachable!(),
            })
            .collect()
    }

    /// Storages taken from one buffer become another's parameters: the very allocations (they
    /// are moved, never freed in between, so equal addresses are the same memory), their old
    /// values overwritten by the gather. Storages of other sizes are not used.
    #[test]
    fn gather_into_reuses_spare_storages_of_the_same_sizes() {
        let shapes: [&[usize]; 2] = [&[2, 3], &[4]];
        let mut a = buffer(&shapes, &[1.0; 10]);
        a.gather(fill).unwrap();
        let before = data_ptrs(&a);
        let spare = a.take_storages().unwrap();
        assert_eq!(a.state(), Materialized::Freed);
        assert!(a.tensors().is_err());

        let values: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let mut b = buffer(&shapes, &values);
        b.gather_into(Some(spare), fill).unwrap();
        assert_eq!(data_ptrs(&b), before);
        assert_eq!(elements(&b), values);

        // Another buffer's sizes: fresh storages (the spares do not fit), right values.
        let spare = b.take_storages().unwrap();
        let mut c = buffer(&[&[5], &[5]], &values);
        c.gather_into(Some(spare), fill).unwrap();
        assert_eq!(elements(&c), values);
    }
}
