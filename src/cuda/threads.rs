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
//! rank's buffer, before the data is there.

use std::sync::Arc;

use cudarc::driver::PushKernelArg;

use super::collective::{DevBuf, DevBufMut, DeviceComm, Span};
use super::{count, elementwise, guarded, Device, REDUCE_RANKS};
use crate::comm::threads::{run_ranks, Member, Memory, Region, ThreadComm, ThreadWorld};
use crate::comm::{Communicator, ElemType, ReduceOp};
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
}

impl ThreadDeviceComm {
    /// One communicator per rank of an `n`-rank world on `dev`, in rank order; move each into
    /// its own thread.
    pub fn world(dev: Arc<Device>, n: usize) -> Result<Vec<ThreadDeviceComm>> {
        Ok(ThreadWorld::new(n)?
            .into_iter()
            .map(|host| ThreadDeviceComm {
                host,
                dev: Arc::clone(&dev),
            })
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
        run_ranks("ThreadDeviceComm::run", Self::world(dev, n)?, f)
    }

    fn mem(&self) -> DeviceMemory<'_> {
        DeviceMemory { dev: &self.dev }
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
        let addrs = dev.upload(&addrs)?;
        let v = srcs.len() as i32;
        let dst = dst as usize as u64;
        let (len, avg) = (count(n), i32::from(op == ReduceOp::Avg));
        // SAFETY: the protocol's contract: every source holds `n` elements of `elem`, `dst` is
        // this rank's to write; the address table lives until the stream frees it after the
        // kernel (stream-ordered free).
        guarded("ThreadDeviceComm::reduce", || unsafe {
            dev.stream()
                .launch_builder(&f)
                .arg(&addrs)
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

impl DeviceComm for ThreadDeviceComm {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn world_size(&self) -> usize {
        self.host.world_size()
    }

    fn device(&self) -> &Device {
        &self.dev
    }

    fn all_gather_in_place(&self, mut buf: DevBufMut<'_>) -> Result<()> {
        let me = buf.span(&self.dev);
        self.host.all_gather_in_place_in(&self.mem(), region(me))
    }

    fn all_gather(&self, send: DevBuf<'_>, mut recv: DevBufMut<'_>) -> Result<()> {
        let (s, r) = (send.span(&self.dev), recv.span(&self.dev));
        self.host.all_gather_in(&self.mem(), region(s), region(r))
    }

    fn reduce_scatter_in_place(&self, mut buf: DevBufMut<'_>, op: ReduceOp) -> Result<()> {
        let me = buf.span(&self.dev);
        self.host
            .reduce_scatter_in_place_in(&self.mem(), region(me), op)
    }

    fn all_reduce_in_place(&self, mut buf: DevBufMut<'_>, op: ReduceOp) -> Result<()> {
        let me = buf.span(&self.dev);
        self.host.all_reduce_in(&self.mem(), region(me), op)
    }

    fn all_to_all_v(
        &self,
        send: DevBuf<'_>,
        send_counts: &[usize],
        mut recv: DevBufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let (s, r) = (send.span(&self.dev), recv.span(&self.dev));
        let mem = self.mem();
        self.host
            .all_to_all_v_in(&mem, region(s), send_counts, region(r), recv_counts)
    }

    fn broadcast_in_place(&self, mut buf: DevBufMut<'_>, root: usize) -> Result<()> {
        let me = buf.span(&self.dev);
        self.host.broadcast_in(&self.mem(), region(me), root)
    }

    fn barrier(&self) -> Result<()> {
        self.host.barrier_in(&self.mem())
    }
}
