//! A unit's gradients: the full buffer backward accumulates into, and the local shard the
//! reduce-scatter leaves.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::Tensor;

use super::{candle, with_ref, CopyStats};
use crate::comm::Buf;
use crate::storage::{NonFiniteCounts, Placement, Storage, View, ViewMut};
use crate::{Error, Result};

/// Full gradient buffers handed back after their reduce-scatter, for the next unit's backward
/// (what PyTorch's caching allocator does for FSDP): glibc serves a buffer of 32 MiB or more
/// from fresh `mmap` pages, so without reuse every step faults in and zeroes each unit's
/// gradient buffer again. Holds at most [`GradPool::SPARE`] buffers, the most the schedule has
/// in flight, so the peak does not grow.
#[derive(Debug, Default)]
pub struct GradPool {
    spare: Mutex<Vec<Storage<f32>>>,
}

impl GradPool {
    /// Spare buffers kept at most.
    pub const SPARE: usize = 2;

    /// A spare buffer of exactly `len` elements (contents left over), if one is kept.
    fn take(&self, len: usize) -> Option<Storage<f32>> {
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        let i = spare.iter().position(|b| b.len() == len)?;
        Some(spare.swap_remove(i))
    }

    /// Keeps `buf` for a later backward unless enough are kept.
    pub fn give_back(&self, buf: Storage<f32>) {
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        if spare.len() < Self::SPARE {
            spare.push(buf);
        }
    }

    /// Bytes held by spare buffers.
    pub fn spare_bytes(&self) -> usize {
        let spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        spare.iter().map(|b| 4 * b.len()).sum()
    }
}

/// Where backward puts a unit's gradients: one flat buffer, each tensor's gradient at its slot.
/// The buffer is taken (from the pool, or allocated zeroed) by the first gradient that arrives
/// and taken by the reduction, so it exists only between a unit's backward and its
/// reduce-scatter. A tensor's first gradient is copied into its slot and later ones added, so
/// a reused buffer needs no zeroing but of its padding and of slots no gradient reached.
pub struct GradSink {
    /// `(offset, elements)` of every tensor's gradient in the flat buffer, in unit order.
    slots: Vec<(usize, usize)>,
    /// Element ranges of the flat buffer no slot covers (zero in every buffer handed out).
    padding: Vec<std::ops::Range<usize>>,
    len: usize,
    inner: Mutex<SinkState>,
    stats: Arc<CopyStats>,
    pool: Arc<GradPool>,
    /// Where new buffers go (the parameters' device).
    placement: Placement,
}

/// Ranges of `0..len` that no slot covers.
fn gaps(slots: &[(usize, usize)], len: usize) -> Vec<std::ops::Range<usize>> {
    let mut covered: Vec<(usize, usize)> = slots.iter().map(|&(o, n)| (o, o + n)).collect();
    covered.sort_unstable();
    let (mut gaps, mut at) = (Vec::new(), 0);
    for (a, b) in covered {
        if a > at {
            gaps.push(at..a);
        }
        at = at.max(b);
    }
    if at < len {
        gaps.push(at..len);
    }
    gaps
}

#[derive(Default)]
struct SinkState {
    buf: Option<Storage<f32>>,
    /// Which tensors received a gradient since the buffer was last taken.
    touched: Vec<bool>,
}

impl GradSink {
    /// A sink for tensors at `slots` of a flat buffer of `len` elements.
    pub fn new(slots: Vec<(usize, usize)>, len: usize, stats: Arc<CopyStats>) -> Result<Self> {
        if let Some(i) = slots
            .iter()
            .position(|&(o, n)| o.checked_add(n).is_none_or(|e| e > len))
        {
            return Err(Error::InvalidShard {
                op: "GradSink::new",
                reason: format!("slot {i} {:?} outside a buffer of {len}", slots[i]),
            });
        }
        let touched = vec![false; slots.len()];
        Ok(GradSink {
            padding: gaps(&slots, len),
            slots,
            len,
            inner: Mutex::new(SinkState { buf: None, touched }),
            stats,
            pool: Arc::default(),
            placement: Placement::Cpu,
        })
    }

    /// Allocates its buffers at `placement` (the parameters' device; the host by default).
    pub fn on(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// Takes buffers from, and gives them back to, `pool` (shared by a model's sinks).
    pub fn with_pool(mut self, pool: Arc<GradPool>) -> Self {
        self.pool = pool;
        self
    }

    /// A buffer for the next backward: a spare one with its padding zeroed, or a zeroed one.
    fn fresh_buffer(&self) -> Result<Storage<f32>> {
        match self.pool.take(self.len) {
            Some(mut buf) => {
                for gap in &self.padding {
                    buf.zero_range(gap.clone())?;
                }
                Ok(buf)
            }
            None => self.placement.zeros(self.len),
        }
    }

    /// Gives a reduced buffer back to the pool.
    pub(crate) fn recycle(&self, buf: Storage<f32>) {
        self.pool.give_back(buf);
    }

    fn lock(&self) -> MutexGuard<'_, SinkState> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `grad` (f32 or bf16, the tensor's shape) into tensor `tensor`'s slot: one pass over
    /// the gradient, counted as accumulated bytes. A strided gradient is made contiguous first,
    /// and that copy is counted as copied.
    pub fn accumulate(&self, tensor: usize, grad: &Tensor) -> Result<()> {
        let &(offset, n) = self.slots.get(tensor).ok_or_else(|| Error::InvalidShard {
            op: "GradSink::accumulate",
            reason: format!("no tensor {tensor} in a sink of {}", self.slots.len()),
        })?;
        if grad.elem_count() != n {
            return Err(Error::InvalidShard {
                op: "GradSink::accumulate",
                reason: format!("gradient of {} elements for {n}", grad.elem_count()),
            });
        }
        let grad = if grad.is_contiguous() {
            grad.clone()
        } else {
            self.stats
                .add_copied(grad.elem_count() * grad.dtype().size_in_bytes());
            grad.contiguous().map_err(candle("GradSink::accumulate"))?
        };
        let mut st = self.lock();
        if st.buf.is_none() {
            st.buf = Some(self.fresh_buffer()?);
        }
        let first = !st.touched[tensor];
        let dst = st.buf.as_mut().expect("just set");
        let bytes = with_ref(&grad, |g| {
            match g {
                Buf::F32(g) => dst.write_range(offset..offset + n, View::Cpu(g), !first)?,
                #[cfg(feature = "cuda")]
                Buf::Device(crate::cuda::collective::DevBuf::F32(g)) => {
                    dst.write_range(offset..offset + n, View::Cuda(g), !first)?
                }
                #[cfg(feature = "cuda")]
                Buf::Device(crate::cuda::collective::DevBuf::BF16(g)) => {
                    let Storage::Cuda(d) = dst else {
                        return Err(crate::storage::mixed(
                            "GradSink::accumulate",
                            "a device gradient for a host buffer",
                        ));
                    };
                    let mut slot = d.data.slice_mut(offset..offset + n);
                    crate::cuda::ops::accumulate_bf16(&d.dev, &mut slot, &g, first)?;
                }
                Buf::BF16(g) => {
                    let dst = &mut dst.cpu_mut()?[offset..offset + n];
                    let cast = g.iter().map(|g| g.to_f32());
                    if first {
                        dst.iter_mut().zip(cast).for_each(|(d, g)| *d = g);
                    } else {
                        dst.iter_mut().zip(cast).for_each(|(d, g)| *d += g);
                    }
                }
                _ => {
                    return Err(Error::InvalidShard {
                        op: "GradSink::accumulate",
                        reason: "a gradient that is not f32 or bf16".into(),
                    })
                }
            }
            Ok(n * grad.dtype().size_in_bytes())
        })?;
        st.touched[tensor] = true;
        drop(st);
        self.stats.add_accumulated(bytes);
        Ok(())
    }

    /// Takes the flat buffer (zeros where no gradient arrived) and which tensors got a
    /// gradient, leaving the sink empty for the next backward.
    pub fn take(&self) -> Result<(Storage<f32>, Vec<bool>)> {
        let mut st = self.lock();
        let mut buf = match st.buf.take() {
            Some(buf) => buf,
            None => self.fresh_buffer()?,
        };
        let touched = std::mem::replace(&mut st.touched, vec![false; self.slots.len()]);
        for (&(offset, n), _) in self.slots.iter().zip(&touched).filter(|(_, &t)| !t) {
            buf.zero_range(offset..offset + n)?;
        }
        Ok((buf, touched))
    }

    /// Drops the gradients accumulated since the last [`GradSink::take`] (their buffer goes
    /// back to the pool), as if no backward had run.
    pub fn discard(&self) {
        let mut st = self.lock();
        let buf = st.buf.take();
        st.touched = vec![false; self.slots.len()];
        drop(st);
        if let Some(buf) = buf {
            self.recycle(buf);
        }
    }

    /// Whether a gradient arrived since the last [`GradSink::take`].
    pub fn holds_gradients(&self) -> bool {
        self.lock().buf.is_some()
    }

    /// Address and length of the flat buffer while it exists in host memory (storage identity
    /// checks).
    pub fn buffer_address(&self) -> Option<(usize, usize)> {
        self.lock()
            .buf
            .as_ref()
            .and_then(|b| b.cpu().ok())
            .map(|b| (b.as_ptr() as usize, b.len()))
    }
}

/// A unit's gradients on one rank: the sink backward writes and the reduced local shard.
pub struct GradBuffer {
    pub(crate) sink: Arc<GradSink>,
    /// The reduced local shard, `S` elements (f32 for the optimizer), where the sink's buffers
    /// live.
    local: Storage<f32>,
    /// Micro-batches reduced into `local` since the last [`GradBuffer::consume`].
    reduced: usize,
}

impl GradBuffer {
    pub fn new(sink: GradSink, shard_len: usize) -> Result<Self> {
        Ok(GradBuffer {
            local: sink.placement.zeros(shard_len)?,
            sink: Arc::new(sink),
            reduced: 0,
        })
    }

    pub fn sink(&self) -> &Arc<GradSink> {
        &self.sink
    }

    /// Runs the reduction `reduce(full, out)` of the sink's buffer into the local shard: the
    /// first micro-batch writes it directly, later ones into a scratch shard that is then added
    /// (counted as accumulated). Returns which tensors got a gradient.
    pub fn reduce_with(
        &mut self,
        stats: &CopyStats,
        reduce: impl FnOnce(ViewMut<'_, f32>, ViewMut<'_, f32>) -> Result<()>,
    ) -> Result<Vec<bool>> {
        let (mut full, touched) = self.sink.take()?;
        if self.reduced == 0 {
            reduce(full.view_mut(), self.local.view_mut())?;
        } else {
            let mut scratch = self.local.placement().zeros(self.local.len())?;
            reduce(full.view_mut(), scratch.view_mut())?;
            let len = self.local.len();
            self.local.write_range(0..len, scratch.view(), true)?;
            stats.add_accumulated(4 * len);
        }
        // The reduction may still be queued on this thread's stream (NCCL with its wait turned
        // off), and the pool hands buffers to other threads' streams: on a device, wait for it
        // before the buffer can be reused (nothing to wait for on the host).
        full.placement().synchronize()?;
        self.sink.recycle(full);
        self.reduced += 1;
        Ok(touched)
    }

    /// At world 1 a reduce-scatter is the identity: the first micro-batch's full buffer becomes
    /// the local shard (moved, no pass over it; the old shard goes to the pool), later ones are
    /// added in. Returns which tensors got a gradient.
    pub fn adopt_as_local(&mut self, stats: &CopyStats) -> Result<Vec<bool>> {
        let (full, touched) = self.sink.take()?;
        if full.len() != self.local.len() {
            return Err(Error::InvalidShard {
                op: "GradBuffer::adopt_as_local",
                reason: format!(
                    "a full buffer of {} for a shard of {}",
                    full.len(),
                    self.local.len()
                ),
            });
        }
        if self.reduced == 0 {
            let old = std::mem::replace(&mut self.local, full);
            self.sink.recycle(old);
        } else {
            let len = full.len();
            self.local.write_range(0..len, full.view(), true)?;
            stats.add_accumulated(4 * len);
            self.sink.recycle(full);
        }
        self.reduced += 1;
        Ok(touched)
    }

    /// The reduced local shard for the optimizer, where it lives; `Err` if nothing was reduced
    /// since the last step.
    pub fn local(&self, op: &'static str) -> Result<View<'_, f32>> {
        self.check_reduced(op)?;
        Ok(self.local.view())
    }

    /// Adds the reduced local shard's NaN and infinite elements to slot `slot` of `counts`
    /// (queued on a device: [`NonFiniteCounts`] reads every unit's count with one wait).
    pub fn add_non_finite_to(
        &self,
        counts: &mut NonFiniteCounts,
        slot: usize,
        op: &'static str,
    ) -> Result<()> {
        self.check_reduced(op)?;
        counts.add(slot, &self.local)
    }

    /// The reduced local shard where it lives (host or device memory).
    pub fn local_storage(&self, op: &'static str) -> Result<&Storage<f32>> {
        self.check_reduced(op)?;
        Ok(&self.local)
    }

    /// The reduced local shard on the host (borrowed; downloaded from a device).
    pub fn local_host(&self, op: &'static str) -> Result<std::borrow::Cow<'_, [f32]>> {
        self.check_reduced(op)?;
        self.local.host()
    }

    fn check_reduced(&self, op: &'static str) -> Result<()> {
        if self.reduced == 0 {
            return Err(Error::BadInput {
                op,
                what: "the call order".into(),
                reason: "no reduced gradients since the last step (a step that failed on a \
                         non-finite value drops them too): run forward_backward, or backward \
                         and reduce_gradients, first"
                    .into(),
            });
        }
        Ok(())
    }

    /// `local ← a·local` (clipping).
    pub fn scale_local(&mut self, a: f32) -> Result<()> {
        self.local.scale(a)
    }

    /// Marks the gradients used by a step: the next reduction overwrites the shard.
    pub fn consume(&mut self) {
        self.reduced = 0;
    }

    /// Drops every pending gradient: the reduced shard's and the sink's (a backward not yet
    /// reduced), as loading new values must.
    pub fn discard(&mut self) {
        self.sink.discard();
        self.consume();
    }
}
