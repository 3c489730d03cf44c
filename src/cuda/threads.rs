//! Thread ranks on one GPU: every rank is a thread of one process with its buffers on the same
//! device, and the collectives are the CPU thread backend's ([`crate::comm::threads`]: the same
//! rendezvous, validation, data phases and reduction order) with the data phases done on the
//! device: device-to-device copies, and the `kernels/reduce_ranks.cu` reduction, which keeps
//! the CPU order (rank 0, 1, …, left to right) and so gives the CPU backend's bits.
//!
//! What it is for: running multi-rank GPU code paths (sharded optimizer steps, DBuffer
//! collectives) and comparing them with the CPU backends on a machine with a single GPU, where
//! NCCL refuses two ranks on one device.
//!
//! Every rank shares one [`Device`] (one context); a rank's copies and reductions are queued on
//! the device stream and waited for before each sync, so no rank returns, or reads another
//! rank's buffer, before the data is there. A world of one rank has no other reader: its
//! collectives return with their copies queued on the rank's stream (as NCCL's do), in order
//! with its later work, and never wait for the device.

use std::sync::{Arc, Mutex};

use cudarc::driver::PushKernelArg;

use super::collective::Span;
use super::{count, elementwise, guarded, Device, Scratch, REDUCE_RANKS};
use crate::comm::threads::{run_ranks, Member, Memory, Region, ThreadComm, ThreadWorld};
use crate::comm::{check_segments, Buf, BufMut, Communicator, ElemType, ReduceOp, Segment};
use crate::Result;

/// Entry points of `kernels/reduce_ranks.cu`, by element type.
pub const REDUCE_RANKS_F32: &str = "reduce_ranks_f32";
pub const REDUCE_RANKS_BF16: &str = "reduce_ranks_bf16";
pub const REDUCE_RANKS_U8: &str = "reduce_ranks_u8";

/// One thread rank on a GPU shared with the other ranks of its world.
#[derive(Debug)]
pub struct ThreadDeviceComm {
    host: ThreadComm,
    dev: Arc<Device>,
    /// The reduction kernel's table of the ranks' source addresses, kept so that a
    /// reduction allocates nothing after the first ([`DeviceMemory::reduce`]).
    table: Mutex<Scratch<u64>>,
}

impl ThreadDeviceComm {
    /// One communicator per rank of an `n`-rank world on `dev`, in rank order; move each into
    /// its own thread.
    pub fn world(dev: Arc<Device>, n: usize) -> Result<Vec<ThreadDeviceComm>> {
        Ok(ThreadWorld::new(n)?
            .into_iter()
            .map(|host| ThreadDeviceComm::new(host, Arc::clone(&dev)))
            .collect())
    }

    /// Runs `f` on every rank of a fresh `n`-rank world on `dev`, one scoped thread per rank,
    /// and returns the results in rank order; a rank whose closure ends leaves the world at
    /// once, and a failure returns the first failing rank's `Err` (as [`ThreadWorld::run`]).
    pub fn run<T: Send>(
        dev: Arc<Device>,
        n: usize,
        f: impl Fn(&ThreadDeviceComm) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        // Work the calling thread queued (candle's host-to-device copies of a model's
        // parameters return before their DMA ends) is on its own stream, which the ranks'
        // streams do not wait for: wait for the whole context before they start.
        dev.sync_context()?;
        let out = run_ranks("ThreadDeviceComm::run", Self::world(dev.clone(), n)?, f);
        // And for the ranks' queued work before returning, failed or not: what they leave
        // (device buffers included) may be dropped on this thread's stream, which does not
        // wait for theirs.
        let synced = dev.sync_context();
        let out = out?;
        synced?;
        Ok(out)
    }

    fn new(host: ThreadComm, dev: Arc<Device>) -> Self {
        let table = Mutex::default();
        ThreadDeviceComm { host, dev, table }
    }

    fn mem(&self) -> DeviceMemory<'_> {
        DeviceMemory {
            dev: &self.dev,
            table: &self.table,
        }
    }

    /// The device this rank's buffers live on.
    pub fn device(&self) -> &Device {
        &self.dev
    }
}

impl Member for ThreadDeviceComm {
    fn thread_comm(&self) -> &ThreadComm {
        &self.host
    }
}

/// A device span as a region of the thread protocol (the address is never dereferenced on
/// the host: only [`DeviceMemory`] uses it).
fn region(s: Span) -> Region {
    Region::new(s.ptr as usize as *mut u8, s.len, s.elem)
}

/// The device as the thread protocol's [`Memory`].
struct DeviceMemory<'a> {
    dev: &'a Device,
    table: &'a Mutex<Scratch<u64>>,
}

impl Memory for DeviceMemory<'_> {
    unsafe fn copy(&self, src: *const u8, dst: *mut u8, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let (dev, op) = (self.dev, "ThreadDeviceComm::copy");
        guarded(op, || dev.context().bind_to_thread())?;
        // SAFETY: the protocol's contract (both ranges are live device buffers of ranks inside
        // this collective, the destination touched by no one else); queued on the stream.
        guarded(op, || unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst as usize as u64,
                src as usize as u64,
                bytes,
                dev.stream().cu_stream(),
            )
        })
    }

    unsafe fn reduce(
        &self,
        elem: ElemType,
        srcs: &[*const u8],
        dst: *mut u8,
        n: usize,
        op: ReduceOp,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let dev = self.dev;
        let entry = match elem {
            ElemType::F32 => REDUCE_RANKS_F32,
            ElemType::BF16 => REDUCE_RANKS_BF16,
            ElemType::U8 => REDUCE_RANKS_U8,
        };
        let f = dev.function(&REDUCE_RANKS, entry)?;
        let addrs: Vec<u64> = srcs.iter().map(|&p| p as usize as u64).collect();
        // Rewritten whole before each use, so a panic that poisoned the lock left nothing
        // to distrust.
        let mut kept = self.table.lock().unwrap_or_else(|e| e.into_inner());
        // Queued after the previous reduction's kernel on this stream, so it never changes
        // a table a queued kernel still reads.
        let mut table = kept.upload(dev, &addrs)?;
        let v = srcs.len() as i32;
        let dst = dst as usize as u64;
        let (len, avg) = (count(n), i32::from(op == ReduceOp::Avg));
        // SAFETY: the protocol's contract: every source holds `n` elements of `elem`, `dst` is
        // this rank's to write; the address table holds the `v` sources' addresses and is
        // rewritten only by work queued after this kernel.
        guarded("ThreadDeviceComm::reduce", || unsafe {
            dev.stream()
                .launch_builder(&f)
                .arg(&mut table)
                .arg(&v)
                .arg(&dst)
                .arg(&len)
                .arg(&avg)
                .launch(elementwise(n))
        })
        .map(drop)
    }

    fn fence(&self) -> Result<()> {
        self.dev.sync()
    }
}

/// The regions of a call's buffers when all are device memory (`None` when all are host
/// memory: the CPU backend moves those; `Err` for a mix).
fn device_regions(dev: &Device, bufs: &mut [&mut dyn DeviceSide]) -> Result<Option<Vec<Region>>> {
    let on_device = bufs.iter().filter(|b| b.on_device()).count();
    if on_device == 0 {
        return Ok(None);
    }
    if on_device != bufs.len() {
        return Err(crate::Error::BadInput {
            op: "ThreadDeviceComm",
            what: "host and device buffers in one collective".into(),
            reason: "a collective's buffers are all host or all device memory".into(),
        });
    }
    Ok(Some(
        bufs.iter_mut().filter_map(|b| b.region(dev)).collect(),
    ))
}

/// A collective's buffer as [`device_regions`] sees it.
trait DeviceSide {
    fn on_device(&self) -> bool;
    fn region(&mut self, dev: &Device) -> Option<Region>;
}

impl DeviceSide for Buf<'_> {
    fn on_device(&self) -> bool {
        self.is_device()
    }
    fn region(&mut self, dev: &Device) -> Option<Region> {
        match self {
            Buf::Device(d) => Some(region(d.span(dev))),
            _ => None,
        }
    }
}

impl DeviceSide for BufMut<'_> {
    fn on_device(&self) -> bool {
        self.is_device()
    }
    fn region(&mut self, dev: &Device) -> Option<Region> {
        match self {
            BufMut::Device(d) => Some(region(d.span(dev))),
            _ => None,
        }
    }
}

/// Device buffers through the device memory (copies and the reduction kernel on the GPU), host
/// buffers through the CPU thread backend: the same protocol, ranks and order either way.
impl Communicator for ThreadDeviceComm {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn world_size(&self) -> usize {
        self.host.world_size()
    }

    fn all_gather_in_place(&self, mut buf: BufMut<'_>) -> Result<()> {
        match device_regions(&self.dev, &mut [&mut buf])?.as_deref() {
            Some(&[me]) => self.host.all_gather_in_place_in(&self.mem(), me),
            _ => self.host.all_gather_in_place(buf),
        }
    }

    fn all_gather(&self, mut send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        match device_regions(&self.dev, &mut [&mut send, &mut recv])?.as_deref() {
            Some(&[s, r]) => self.host.all_gather_in(&self.mem(), s, r),
            _ => self.host.all_gather(send, recv),
        }
    }

    fn reduce_scatter_in_place(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        match device_regions(&self.dev, &mut [&mut buf])?.as_deref() {
            Some(&[me]) => self.host.reduce_scatter_in_place_in(&self.mem(), me, op),
            _ => self.host.reduce_scatter_in_place(buf, op),
        }
    }

    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        match device_regions(&self.dev, &mut [&mut buf])?.as_deref() {
            Some(&[me]) => self.host.all_reduce_in(&self.mem(), me, op),
            _ => self.host.all_reduce(buf, op),
        }
    }

    fn all_to_all_v(
        &self,
        mut send: Buf<'_>,
        send_counts: &[usize],
        mut recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        match device_regions(&self.dev, &mut [&mut send, &mut recv])?.as_deref() {
            Some(&[s, r]) => self
                .host
                .all_to_all_v_in(&self.mem(), s, send_counts, r, recv_counts),
            _ => self.host.all_to_all_v(send, send_counts, recv, recv_counts),
        }
    }

    fn broadcast(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        match device_regions(&self.dev, &mut [&mut buf])?.as_deref() {
            Some(&[me]) => self.host.broadcast_in(&self.mem(), me, root),
            _ => self.host.broadcast(buf, root),
        }
    }

    fn barrier(&self) -> Result<()> {
        self.host.barrier_in(&self.mem())
    }

    fn peer_wait_seconds(&self) -> Option<f64> {
        self.host.peer_wait_seconds()
    }

    /// Device segments straight from every rank's device input (device-to-device copies, no
    /// staging), as the CPU backend does on host memory; host segments through the CPU backend.
    fn all_gather_segments(
        &self,
        mut send: Buf<'_>,
        segments: &mut [Segment<'_>],
    ) -> Result<usize> {
        if !send.is_device() {
            return self.host.all_gather_segments(send, segments);
        }
        const OP: &str = "ThreadDeviceComm::all_gather_segments";
        check_segments(segments, send.elem_type(), send.len() * self.world_size())?;
        let Some(&[me]) = device_regions(&self.dev, &mut [&mut send])?.as_deref() else {
            return Err(crate::comm::mixed_memory(OP));
        };
        let mut regions = Vec::with_capacity(segments.len());
        for seg in segments.iter_mut() {
            let mut buf = seg.buf.reborrow();
            match device_regions(&self.dev, &mut [&mut buf])?.as_deref() {
                Some(&[r]) => regions.push((seg.offset, r)),
                _ => return Err(crate::comm::mixed_memory(OP)),
            }
        }
        self.host
            .all_gather_segments_in(&self.mem(), me, &regions)?;
        Ok(0)
    }

    fn reduce_scatter(
        &self,
        mut send: BufMut<'_>,
        mut recv: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<usize> {
        match device_regions(&self.dev, &mut [&mut send, &mut recv])?.as_deref() {
            Some(&[s, r]) => {
                self.host.reduce_scatter_in(&self.mem(), s, r, op)?;
                Ok(0)
            }
            _ => self.host.reduce_scatter(send, recv, op),
        }
    }

    /// Each group is a thread world of its own on the same device.
    fn split(&self, color: usize) -> Result<Box<dyn Communicator + '_>> {
        let host = self.host.split_world(color)?;
        Ok(Box::new(ThreadDeviceComm::new(host, Arc::clone(&self.dev))))
    }
}
