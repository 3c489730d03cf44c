//! Device memory in the one collective trait ([`crate::comm::Communicator`]): the device
//! variants of [`Buf`] / [`BufMut`] ([`DevBuf`], [`DevBufMut`]) and two backends that take
//! them.
//!
//! | backend | file | ranks are | host buffers |
//! |---|---|---|---|
//! | NCCL | [`super::nccl`] | processes (one GPU each), or one process driving several GPUs | staged through a device copy ([`on_device_mut`], [`on_device_pair`]) |
//! | thread ranks on one GPU | [`super::threads`] | threads of one process sharing a GPU: device-to-device copies, the CPU thread backend's protocol and reduction order | the CPU thread backend itself |
//!
//! The host backends (threads, one rank, MPI) return a clear `Err` for device buffers
//! ([`crate::comm::host_only`]). The semantics are the trait's ([`crate::comm`], "In-place
//! semantics"). Device collectives are queued on the communicator's device stream, in order
//! with the rest of this crate's device work.
//!
//! The runtime's collectives on device DBuffers go through this trait like host ones
//! (`fsdp::layout`), so every backend serves both.

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use half::bf16;

use super::{guarded, Device};
use crate::comm::{Buf, BufMut, Communicator, ElemType, HeldComm, ReduceOp, Segment};
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
    pub fn len(&self) -> usize {
        match self {
            DevBuf::F32(v) => v.len(),
            DevBuf::BF16(v) => v.len(),
            DevBuf::U8(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn elem_type(&self) -> ElemType {
        match self {
            DevBuf::F32(_) => ElemType::F32,
            DevBuf::BF16(_) => ElemType::BF16,
            DevBuf::U8(_) => ElemType::U8,
        }
    }

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
    pub fn len(&self) -> usize {
        match self {
            DevBufMut::F32(v) => v.len(),
            DevBufMut::BF16(v) => v.len(),
            DevBufMut::U8(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn elem_type(&self) -> ElemType {
        match self {
            DevBufMut::F32(_) => ElemType::F32,
            DevBufMut::BF16(_) => ElemType::BF16,
            DevBufMut::U8(_) => ElemType::U8,
        }
    }
    /// The same buffer, borrowed for a shorter time.
    pub fn reborrow(&mut self) -> DevBufMut<'_> {
        match self {
            DevBufMut::F32(v) => DevBufMut::F32(v.slice_mut(..)),
            DevBufMut::BF16(v) => DevBufMut::BF16(v.slice_mut(..)),
            DevBufMut::U8(v) => DevBufMut::U8(v.slice_mut(..)),
        }
    }
    /// The same buffer, read-only.
    pub fn as_dev_buf(&self) -> DevBuf<'_> {
        match self {
            DevBufMut::F32(v) => DevBuf::F32(v.as_view()),
            DevBufMut::BF16(v) => DevBuf::BF16(v.as_view()),
            DevBufMut::U8(v) => DevBuf::U8(v.as_view()),
        }
    }

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
        impl<'a> From<CudaView<'a, $t>> for Buf<'a> {
            fn from(v: CudaView<'a, $t>) -> Self {
                Buf::Device(DevBuf::$variant(v))
            }
        }
        impl<'a> From<CudaViewMut<'a, $t>> for BufMut<'a> {
            fn from(v: CudaViewMut<'a, $t>) -> Self {
                BufMut::Device(DevBufMut::$variant(v))
            }
        }
    };
}
dev_buf_from!(f32, F32);
dev_buf_from!(bf16, BF16);
dev_buf_from!(u8, U8);

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

/// Copies a host buffer to a fresh device buffer (one element at least: drivers refuse empty
/// allocations; views take exactly `host.len()`).
fn upload<T: DeviceRepr + ValidAsZeroBits>(dev: &Device, host: &[T]) -> Result<CudaSlice<T>> {
    let mut d = dev.zeros::<T>(host.len().max(1))?;
    if !host.is_empty() {
        let mut view = d.slice_mut(..host.len());
        guarded("cuda (staged)", || {
            dev.stream().memcpy_htod(host, &mut view)
        })?;
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
        guarded("cuda (staged)", || dev.stream().memcpy_dtoh(&view, host))?;
    }
    dev.sync()
}

/// A device copy of a host buffer: what a device backend runs on when handed host memory.
enum DevCopy {
    F32(CudaSlice<f32>),
    BF16(CudaSlice<bf16>),
    U8(CudaSlice<u8>),
}

impl DevCopy {
    /// Uploads a host buffer (`Err` for device memory, which needs no copy).
    fn upload(dev: &Device, host: &Buf<'_>) -> Result<DevCopy> {
        Ok(match host {
            Buf::F32(h) => DevCopy::F32(upload(dev, h)?),
            Buf::BF16(h) => DevCopy::BF16(upload(dev, h)?),
            Buf::U8(h) => DevCopy::U8(upload(dev, h)?),
            Buf::Device(_) => return Err(staging("a device buffer needs no staging")),
        })
    }

    fn view(&self, len: usize) -> DevBuf<'_> {
        match self {
            DevCopy::F32(d) => DevBuf::F32(d.slice(..len)),
            DevCopy::BF16(d) => DevBuf::BF16(d.slice(..len)),
            DevCopy::U8(d) => DevBuf::U8(d.slice(..len)),
        }
    }

    fn view_mut(&mut self, len: usize) -> DevBufMut<'_> {
        match self {
            DevCopy::F32(d) => DevBufMut::F32(d.slice_mut(..len)),
            DevCopy::BF16(d) => DevBufMut::BF16(d.slice_mut(..len)),
            DevCopy::U8(d) => DevBufMut::U8(d.slice_mut(..len)),
        }
    }

    /// Copies the result back into the host buffer it was made from.
    fn download(&self, dev: &Device, host: BufMut<'_>) -> Result<()> {
        match (self, host) {
            (DevCopy::F32(d), BufMut::F32(h)) => download_into(dev, d, h),
            (DevCopy::BF16(d), BufMut::BF16(h)) => download_into(dev, d, h),
            (DevCopy::U8(d), BufMut::U8(h)) => download_into(dev, d, h),
            _ => Err(staging(
                "the host buffer is not the one the copy was made from",
            )),
        }
    }
}

fn staging(reason: &str) -> Error {
    Error::BadInput {
        op: "cuda collective (staged)",
        what: "a staged buffer".into(),
        reason: reason.into(),
    }
}

/// Runs a device collective `f` on `buf`: device memory as it is, host memory through a
/// device copy (uploaded, run on, downloaded back: staged, so host code runs over NCCL).
pub fn on_device_mut(
    dev: &Device,
    buf: BufMut<'_>,
    f: impl FnOnce(DevBufMut<'_>) -> Result<()>,
) -> Result<()> {
    match buf {
        BufMut::Device(d) => f(d),
        host => {
            let len = host.len();
            let mut copy = DevCopy::upload(dev, &host.as_buf())?;
            f(copy.view_mut(len))?;
            copy.download(dev, host)
        }
    }
}

/// As [`on_device_mut`] for a send and a receive buffer, each staged when it is host memory
/// (a host receive buffer is uploaded too, so the parts `f` leaves alone come back unchanged).
pub fn on_device_pair(
    dev: &Device,
    send: Buf<'_>,
    recv: BufMut<'_>,
    f: impl FnOnce(DevBuf<'_>, DevBufMut<'_>) -> Result<()>,
) -> Result<()> {
    if send.elem_type() != recv.elem_type() {
        return Err(Error::BadInput {
            op: "cuda collective",
            what: format!("{:?} send, {:?} recv", send.elem_type(), recv.elem_type()),
            reason: "one element type per collective".into(),
        });
    }
    match send {
        Buf::Device(s) => on_device_mut(dev, recv, |r| f(s, r)),
        host => {
            let copy = DevCopy::upload(dev, &host)?;
            on_device_mut(dev, recv, |r| f(copy.view(host.len()), r))
        }
    }
}

/// A communicator that runs every collective of `inner` on device copies of the host buffers
/// it is given: the device data path of a backend under host code (the conformance suite,
/// host optimizer steps), for tests and benchmarks. Device buffers pass through.
pub struct ViaDevice<'a> {
    inner: HeldComm<'a>,
    dev: &'a Device,
}

impl<'a> ViaDevice<'a> {
    pub fn new(inner: &'a dyn Communicator, dev: &'a Device) -> Self {
        ViaDevice {
            inner: HeldComm::Borrowed(inner),
            dev,
        }
    }
}

impl std::fmt::Debug for ViaDevice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ViaDevice")
            .field("rank", &self.inner.rank())
            .finish()
    }
}

impl Communicator for ViaDevice<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather_in_place(&self, buf: BufMut<'_>) -> Result<()> {
        on_device_mut(self.dev, buf, |d| {
            self.inner.all_gather_in_place(BufMut::Device(d))
        })
    }
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        on_device_pair(self.dev, send, recv, |s, r| {
            self.inner.all_gather(Buf::Device(s), BufMut::Device(r))
        })
    }
    fn reduce_scatter_in_place(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        on_device_mut(self.dev, buf, |d| {
            self.inner.reduce_scatter_in_place(BufMut::Device(d), op)
        })
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        on_device_mut(self.dev, buf, |d| {
            self.inner.all_reduce(BufMut::Device(d), op)
        })
    }
    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        on_device_pair(self.dev, send, recv, |s, r| {
            let (s, r) = (Buf::Device(s), BufMut::Device(r));
            self.inner.all_to_all_v(s, send_counts, r, recv_counts)
        })
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        on_device_mut(self.dev, buf, |d| {
            self.inner.broadcast(BufMut::Device(d), root)
        })
    }
    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }

    /// Host segments become device segments (and come back): the inner backend's device
    /// segment path.
    fn all_gather_segments(&self, send: Buf<'_>, segments: &mut [Segment<'_>]) -> Result<usize> {
        if send.is_device() {
            return self.inner.all_gather_segments(send, segments);
        }
        let send_copy = DevCopy::upload(self.dev, &send)?;
        let mut copies = segments
            .iter()
            .map(|seg| DevCopy::upload(self.dev, &seg.buf.as_buf()))
            .collect::<Result<Vec<_>>>()?;
        let mut device_segments: Vec<Segment<'_>> = copies
            .iter_mut()
            .zip(segments.iter())
            .map(|(c, seg)| Segment {
                offset: seg.offset,
                buf: BufMut::Device(c.view_mut(seg.buf.len())),
            })
            .collect();
        let send_view = Buf::Device(send_copy.view(send.len()));
        let staged = self
            .inner
            .all_gather_segments(send_view, &mut device_segments)?;
        drop(device_segments);
        for (c, seg) in copies.iter().zip(segments.iter_mut()) {
            c.download(self.dev, seg.buf.reborrow())?;
        }
        Ok(staged)
    }

    /// The inner communicator's group, its collectives again on device copies.
    fn split(&self, color: usize) -> Result<Box<dyn Communicator + '_>> {
        Ok(Box::new(ViaDevice {
            inner: HeldComm::Group(self.inner.split(color)?),
            dev: self.dev,
        }))
    }
}
