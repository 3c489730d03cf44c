//! Collectives on device memory: one [`DeviceComm`] trait with two backends, and
//! [`Staged`], which puts any of them behind the host [`Communicator`] trait.
//!
//! | backend | file | ranks are |
//! |---|---|---|
//! | NCCL | [`super::nccl`] | processes (one GPU each), or one process driving several GPUs |
//! | thread ranks on one GPU | [`super::threads`] | threads of one process sharing a GPU: device-to-device copies, the CPU thread backend's protocol and reduction order |
//!
//! The semantics are the host trait's ([`crate::comm`], "In-place semantics"): a buffer of
//! `V·S` elements is split into `V` slices, rank `r` owns `[r·S, (r+1)·S)`; all-to-all-v sends
//! `send_counts[j]` elements to rank `j` in rank order. Every call is queued on the
//! communicator's device stream, in order with the rest of this crate's device work.
//!
//! The DBuffer collectives ([`all_gather_dbuffer`], [`reduce_scatter_dbuffer`]) are written
//! once on the trait, for every backend.

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use half::bf16;

use super::dbuffer::DeviceDBuffer;
use super::{guarded, Device};
use crate::comm::{Buf, BufMut, Communicator, ElemType, ReduceOp};
use crate::{Error, Result};

/// A read-only device buffer of one of the supported element types.
#[derive(Debug)]
pub enum DevBuf<'a> {
    F32(CudaView<'a, f32>),
    BF16(CudaView<'a, bf16>),
    U8(CudaView<'a, u8>),
}

/// A writable device buffer of one of the supported element types.
#[derive(Debug)]
pub enum DevBufMut<'a> {
    F32(CudaViewMut<'a, f32>),
    BF16(CudaViewMut<'a, bf16>),
    U8(CudaViewMut<'a, u8>),
}

/// A device buffer as the backends see it: address, length in elements, element type. The
/// address is valid while the [`DevBuf`] / [`DevBufMut`] it came from is borrowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub ptr: u64,
    pub len: usize,
    pub elem: ElemType,
}

impl DevBuf<'_> {
    /// The buffer's address (after the stream waits for its pending writes), length and type.
    pub fn span(&self, dev: &Device) -> Span {
        let s = dev.stream();
        let (ptr, len, elem) = match self {
            DevBuf::F32(v) => (v.device_ptr(s).0, v.len(), ElemType::F32),
            DevBuf::BF16(v) => (v.device_ptr(s).0, v.len(), ElemType::BF16),
            DevBuf::U8(v) => (v.device_ptr(s).0, v.len(), ElemType::U8),
        };
        Span { ptr, len, elem }
    }
}

impl DevBufMut<'_> {
    /// As [`DevBuf::span`].
    pub fn span(&mut self, dev: &Device) -> Span {
        let s = dev.stream();
        let (len, ptr, elem) = match self {
            DevBufMut::F32(v) => (v.len(), v.device_ptr_mut(s).0, ElemType::F32),
            DevBufMut::BF16(v) => (v.len(), v.device_ptr_mut(s).0, ElemType::BF16),
            DevBufMut::U8(v) => (v.len(), v.device_ptr_mut(s).0, ElemType::U8),
        };
        Span { ptr, len, elem }
    }
}

macro_rules! dev_buf_from {
    ($t:ty, $variant:ident) => {
        impl<'a> From<CudaView<'a, $t>> for DevBuf<'a> {
            fn from(v: CudaView<'a, $t>) -> Self {
                DevBuf::$variant(v)
            }
        }
        impl<'a> From<CudaViewMut<'a, $t>> for DevBufMut<'a> {
            fn from(v: CudaViewMut<'a, $t>) -> Self {
                DevBufMut::$variant(v)
            }
        }
    };
}
dev_buf_from!(f32, F32);
dev_buf_from!(bf16, BF16);
dev_buf_from!(u8, U8);

/// Collectives of one rank on device buffers (module doc). Every rank of a world must call the
/// same collectives in the same order with matching sizes; the thread backend checks that and
/// returns `Err` on every rank, NCCL documents it as the caller's duty.
pub trait DeviceComm: Send + Sync {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks `V`.
    fn world_size(&self) -> usize;
    /// The device this rank's buffers live on (its stream orders the collectives).
    fn device(&self) -> &Device;
    /// In-place all-gather over a buffer of `V·S` elements.
    fn all_gather_in_place(&self, buf: DevBufMut<'_>) -> Result<()>;
    /// All-gather from an `S`-element input into a `V·S`-element output.
    fn all_gather(&self, send: DevBuf<'_>, recv: DevBufMut<'_>) -> Result<()>;
    /// In-place reduce-scatter over `V·S` elements; the result is the rank's own slice.
    fn reduce_scatter_in_place(&self, buf: DevBufMut<'_>, op: ReduceOp) -> Result<()>;
    /// In-place all-reduce of the whole buffer.
    fn all_reduce_in_place(&self, buf: DevBufMut<'_>, op: ReduceOp) -> Result<()>;
    /// All-to-all with uneven counts, as [`Communicator::all_to_all_v`].
    fn all_to_all_v(
        &self,
        send: DevBuf<'_>,
        send_counts: &[usize],
        recv: DevBufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()>;
    /// Copies `root`'s buffer to every rank.
    fn broadcast_in_place(&self, buf: DevBufMut<'_>, root: usize) -> Result<()>;
    /// Waits for every rank (and for this rank's queued work).
    fn barrier(&self) -> Result<()>;
}

/// A borrowed communicator is one too (so [`Staged`] can wrap `&C` in scoped threads).
impl<C: DeviceComm + ?Sized> DeviceComm for &C {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn device(&self) -> &Device {
        (**self).device()
    }
    fn all_gather_in_place(&self, buf: DevBufMut<'_>) -> Result<()> {
        (**self).all_gather_in_place(buf)
    }
    fn all_gather(&self, send: DevBuf<'_>, recv: DevBufMut<'_>) -> Result<()> {
        (**self).all_gather(send, recv)
    }
    fn reduce_scatter_in_place(&self, buf: DevBufMut<'_>, op: ReduceOp) -> Result<()> {
        (**self).reduce_scatter_in_place(buf, op)
    }
    fn all_reduce_in_place(&self, buf: DevBufMut<'_>, op: ReduceOp) -> Result<()> {
        (**self).all_reduce_in_place(buf, op)
    }
    fn all_to_all_v(
        &self,
        send: DevBuf<'_>,
        send_counts: &[usize],
        recv: DevBufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        (**self).all_to_all_v(send, send_counts, recv, recv_counts)
    }
    fn broadcast_in_place(&self, buf: DevBufMut<'_>, root: usize) -> Result<()> {
        (**self).broadcast_in_place(buf, root)
    }
    fn barrier(&self) -> Result<()> {
        (**self).barrier()
    }
}

/// The checks a rank can make alone before any collective (both backends): one element type,
/// and, for all-to-all-v, `V` counts on each side that add up to the buffer lengths.
pub fn check_counts(
    op: &'static str,
    world: usize,
    send: Span,
    send_counts: &[usize],
    recv: Span,
    recv_counts: &[usize],
) -> Result<()> {
    if send.elem != recv.elem {
        return Err(Error::BadInput {
            op,
            what: format!("{:?} send, {:?} recv", send.elem, recv.elem),
            reason: "one element type per collective".into(),
        });
    }
    for (what, counts, len) in [
        ("send", send_counts, send.len),
        ("recv", recv_counts, recv.len),
    ] {
        let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
        if counts.len() != world || total != Some(len) {
            return Err(Error::BadInput {
                op,
                what: format!("{what} counts {counts:?}"),
                reason: format!("need {world} counts adding up to the {len}-element buffer"),
            });
        }
    }
    Ok(())
}

/// `len / V` when a `len`-element buffer splits into `V` slices, else `Err`.
pub fn slice_len(op: &'static str, len: usize, world: usize) -> Result<usize> {
    if world == 0 || len % world != 0 {
        return Err(Error::BadInput {
            op,
            what: format!("buffer of {len} elements"),
            reason: format!("not divisible into {world} slices"),
        });
    }
    Ok(len / world)
}

/// Checks that `buf` belongs to `comm`'s world and rank, and keeps its full buffer.
fn dbuffer_view<'a>(
    op: &'static str,
    comm: &dyn DeviceComm,
    buf: &'a mut DeviceDBuffer,
) -> Result<CudaViewMut<'a, f32>> {
    let g = buf.geometry();
    if g.world != comm.world_size() {
        return Err(Error::WorldSizeMismatch {
            op,
            expected: g.world,
            got: comm.world_size(),
        });
    }
    if g.rank != comm.rank() {
        return Err(Error::InvalidShard {
            op,
            reason: format!(
                "buffer of rank {}, communicator of rank {}",
                g.rank,
                comm.rank()
            ),
        });
    }
    Ok(buf.full_slice_mut(op)?.slice_mut(..))
}

/// In-place all-gather of a DBuffer that keeps its full `V·S` elements: every rank's local
/// shard goes to every rank (no copy-in, no copy-out).
pub fn all_gather_dbuffer(comm: &dyn DeviceComm, buf: &mut DeviceDBuffer) -> Result<()> {
    let view = dbuffer_view("cuda::all_gather_dbuffer", comm, buf)?;
    comm.all_gather_in_place(view.into())
}

/// In-place reduce-scatter of a full DBuffer: the local shard ends up holding the reduction
/// over ranks (other slices unspecified), as the CPU `reduce_scatter_in_place`.
pub fn reduce_scatter_dbuffer(
    comm: &dyn DeviceComm,
    buf: &mut DeviceDBuffer,
    op: ReduceOp,
) -> Result<()> {
    let view = dbuffer_view("cuda::reduce_scatter_dbuffer", comm, buf)?;
    comm.reduce_scatter_in_place(view.into(), op)
}

/// A device communicator behind the host [`Communicator`] trait: each call copies the host
/// buffers to the device, runs the device collective, and copies the results back. So every
/// host-side user of the trait (the FSDP runtime, Muon's all-to-alls, the benchmarks) runs over
/// NCCL or GPU thread ranks unchanged. Device-resident code should call the [`DeviceComm`]
/// directly and skip the copies.
#[derive(Debug)]
pub struct Staged<C> {
    inner: C,
}

impl<C: DeviceComm> Staged<C> {
    pub fn new(inner: C) -> Self {
        Staged { inner }
    }

    /// The device communicator.
    pub fn inner(&self) -> &C {
        &self.inner
    }
}

/// Copies a host buffer to a fresh device buffer (one element at least: drivers refuse empty
/// allocations; views take exactly `host.len()`).
fn upload<T: DeviceRepr + ValidAsZeroBits>(dev: &Device, host: &[T]) -> Result<CudaSlice<T>> {
    let mut d = dev.zeros::<T>(host.len().max(1))?;
    if !host.is_empty() {
        let mut view = d.slice_mut(..host.len());
        guarded("cuda::Staged", || dev.stream().memcpy_htod(host, &mut view))?;
    }
    Ok(d)
}

/// Copies the first `host.len()` elements of `dev_buf` back into `host` and waits.
fn download_into<T: DeviceRepr>(
    dev: &Device,
    dev_buf: &CudaSlice<T>,
    host: &mut [T],
) -> Result<()> {
    if !host.is_empty() {
        let view = dev_buf.slice(..host.len());
        guarded("cuda::Staged", || dev.stream().memcpy_dtoh(&view, host))?;
    }
    dev.sync()
}

/// Runs `f` on a device copy of `host`, then copies the result back into `host`.
fn staged_mut(
    dev: &Device,
    host: BufMut<'_>,
    f: impl FnOnce(DevBufMut<'_>) -> Result<()>,
) -> Result<()> {
    fn run<T: DeviceRepr + ValidAsZeroBits>(
        dev: &Device,
        host: &mut [T],
        f: impl FnOnce(CudaViewMut<'_, T>) -> Result<()>,
    ) -> Result<()> {
        let mut d = upload(dev, host)?;
        f(d.slice_mut(..host.len()))?;
        download_into(dev, &d, host)
    }
    match host {
        BufMut::F32(h) => run(dev, h, |v| f(v.into())),
        BufMut::BF16(h) => run(dev, h, |v| f(v.into())),
        BufMut::U8(h) => run(dev, h, |v| f(v.into())),
    }
}

/// Runs `f` on a device copy of `send` and a device buffer for `recv` (uploaded too, so the
/// parts `f` leaves alone come back unchanged), then copies the result into `recv`.
fn staged_pair(
    dev: &Device,
    send: Buf<'_>,
    recv: BufMut<'_>,
    f: impl FnOnce(DevBuf<'_>, DevBufMut<'_>) -> Result<()>,
) -> Result<()> {
    fn run<T: DeviceRepr + ValidAsZeroBits>(
        dev: &Device,
        send: &[T],
        recv: &mut [T],
        f: impl FnOnce(CudaView<'_, T>, CudaViewMut<'_, T>) -> Result<()>,
    ) -> Result<()> {
        let s = upload(dev, send)?;
        let mut r = upload(dev, recv)?;
        f(s.slice(..send.len()), r.slice_mut(..recv.len()))?;
        download_into(dev, &r, recv)
    }
    let op = "cuda::Staged";
    let mismatch = |a: ElemType, b: ElemType| Error::BadInput {
        op,
        what: format!("{a:?} send, {b:?} recv"),
        reason: "one element type per collective".into(),
    };
    match (send, recv) {
        (Buf::F32(s), BufMut::F32(r)) => run(dev, s, r, |a, b| f(a.into(), b.into())),
        (Buf::BF16(s), BufMut::BF16(r)) => run(dev, s, r, |a, b| f(a.into(), b.into())),
        (Buf::U8(s), BufMut::U8(r)) => run(dev, s, r, |a, b| f(a.into(), b.into())),
        (s, r) => Err(mismatch(s.elem_type(), r.elem_type())),
    }
}

impl<C: DeviceComm> Communicator for Staged<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_gather_in_place(&self, buf: BufMut<'_>) -> Result<()> {
        staged_mut(self.inner.device(), buf, |d| {
            self.inner.all_gather_in_place(d)
        })
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        staged_pair(self.inner.device(), send, recv, |s, r| {
            self.inner.all_gather(s, r)
        })
    }

    fn reduce_scatter_in_place(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        staged_mut(self.inner.device(), buf, |d| {
            self.inner.reduce_scatter_in_place(d, op)
        })
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        staged_mut(self.inner.device(), buf, |d| {
            self.inner.all_reduce_in_place(d, op)
        })
    }

    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        staged_pair(self.inner.device(), send, recv, |s, r| {
            self.inner.all_to_all_v(s, send_counts, r, recv_counts)
        })
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        staged_mut(self.inner.device(), buf, |d| {
            self.inner.broadcast_in_place(d, root)
        })
    }

    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }
}
