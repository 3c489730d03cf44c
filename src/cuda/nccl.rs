//! NCCL between GPUs, on device buffers: one process per GPU, bootstrapped from the
//! environment with a file rendezvous for NCCL's unique id, and the DBuffer collectives in
//! place (NCCL's in-place convention: the send buffer of an all-gather is the rank's own slice
//! of the receive buffer; the receive buffer of a reduce-scatter is the rank's own slice of the
//! send buffer).
//!
//! # Bootstrapping ([`NcclComm::from_env`])
//! | variable | meaning |
//! |---|---|
//! | `RAGGED_RANK` (else `RANK`) | this process's rank |
//! | `RAGGED_WORLD_SIZE` (else `WORLD_SIZE`) | number of processes |
//! | `RAGGED_NCCL_ID_FILE` | a path every rank can read; rank 0 writes the 128-byte id there (to a temporary name, then renamed, so readers never see half a file) |
//! | `RAGGED_NCCL_TIMEOUT_S` | how long ranks > 0 wait for the file (default 120) |
//!
//! Each process drives the device it opened ([`Device`]); `CUDA_VISIBLE_DEVICES` or the
//! ordinal chooses which. NCCL refuses two ranks on one GPU, so multi-rank code paths on a
//! single GPU need a copy-based backend (not here yet).
//!
//! Not yet behind the host-slice [`Communicator`](crate::comm::Communicator) trait: that trait
//! moves host slices, these collectives move device memory.
//!
//! Reductions are NCCL's: the order over ranks is NCCL's ring/tree order, not the CPU
//! backends' rank order, and `Avg` is NCCL's `ncclAvg`; results agree with the CPU backends up
//! to summation order.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{
    sys::CUdeviceptr, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use cudarc::nccl::{Comm, Id, ReduceOp as NcclOp};

use super::dbuffer::DeviceDBuffer;
use super::{guarded, Device};
use crate::comm::ReduceOp;
use crate::{Error, Result};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// `Err(CudaUnavailable)` unless the NCCL library loads (cudarc looks for `libnccl.so`, not the
/// `libnccl.so.2` soname: put a `libnccl.so` symlink on the loader path; see
/// `scripts/gpu-check.sh`).
pub fn nccl_available() -> Result<()> {
    match std::panic::catch_unwind(|| unsafe { cudarc::nccl::sys::is_culib_present() }) {
        Ok(true) => Ok(()),
        _ => Err(Error::CudaUnavailable {
            op: "cuda::nccl",
            reason: "the NCCL library (libnccl.so) cannot be loaded: install the nvidia-nccl \
                     wheel (or NCCL) and put a directory holding a libnccl.so symlink to \
                     libnccl.so.2 on LD_LIBRARY_PATH"
                .into(),
        }),
    }
}

/// A fresh NCCL unique id (rank 0 makes it; the others receive it out of band).
pub fn unique_id() -> Result<[u8; ID_BYTES]> {
    nccl_available()?;
    let id = guarded("cuda::nccl::unique_id", Id::new)?;
    Ok(id.internal().map(|c| c as u8))
}

/// One rank of an NCCL communicator, on its device's stream.
pub struct NcclComm {
    comm: Comm,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

fn env_usize(names: &[&str]) -> Result<usize> {
    for n in names {
        if let Ok(v) = std::env::var(n) {
            return v.trim().parse().map_err(|_| Error::BadInput {
                op: "NcclComm::from_env",
                what: format!("{n}={v}"),
                reason: "not a non-negative integer".into(),
            });
        }
    }
    Err(Error::BadInput {
        op: "NcclComm::from_env",
        what: names.join(" / "),
        reason: "not set".into(),
    })
}

impl NcclComm {
    /// Rank `rank` of `world`, joining the communicator named by `id` (every rank passes the
    /// same id). Blocks until every rank has joined.
    pub fn from_rank(dev: &Device, rank: usize, world: usize, id: &[u8; ID_BYTES]) -> Result<Self> {
        const OP: &str = "NcclComm::from_rank";
        nccl_available()?;
        if rank >= world || i32::try_from(world).is_err() {
            return Err(Error::BadInput {
                op: OP,
                what: format!("rank {rank} of {world}"),
                reason: "needs rank < world ≤ i32::MAX".into(),
            });
        }
        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
        let stream = dev.stream().clone();
        let comm = guarded(OP, || Comm::from_rank(stream.clone(), rank, world, id))?;
        Ok(NcclComm {
            comm,
            stream,
            rank,
            world,
        })
    }

    /// One process per GPU, from the environment (module doc): rank 0 writes a fresh id to
    /// `RAGGED_NCCL_ID_FILE`, the others wait for it, then every rank joins.
    pub fn from_env(dev: &Device) -> Result<Self> {
        const OP: &str = "NcclComm::from_env";
        let rank = env_usize(&["RAGGED_RANK", "RANK"])?;
        let world = env_usize(&["RAGGED_WORLD_SIZE", "WORLD_SIZE"])?;
        let file = std::env::var("RAGGED_NCCL_ID_FILE").map_err(|_| Error::BadInput {
            op: OP,
            what: "RAGGED_NCCL_ID_FILE".into(),
            reason: "not set (a path every rank can read)".into(),
        })?;
        let timeout = std::env::var("RAGGED_NCCL_TIMEOUT_S")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(120u64);
        let id = if rank == 0 {
            let id = unique_id()?;
            write_id(Path::new(&file), &id)?;
            id
        } else {
            read_id(Path::new(&file), Duration::from_secs(timeout))?
        };
        Self::from_rank(dev, rank, world, &id)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world
    }

    fn check_world(&self, op: &'static str, buf: &DeviceDBuffer) -> Result<()> {
        let g = buf.geometry();
        if g.world != self.world {
            return Err(Error::WorldSizeMismatch {
                op,
                expected: g.world,
                got: self.world,
            });
        }
        if g.rank != self.rank {
            return Err(Error::InvalidShard {
                op,
                reason: format!(
                    "buffer of rank {}, communicator of rank {}",
                    g.rank, self.rank
                ),
            });
        }
        Ok(())
    }

    /// In-place all-gather of a buffer that holds its full `V·S` elements: every rank's own
    /// slice goes to every rank (no copy-in, no copy-out).
    pub fn all_gather_in_place(&self, buf: &mut DeviceDBuffer) -> Result<()> {
        const OP: &str = "NcclComm::all_gather_in_place";
        self.check_world(OP, buf)?;
        let s = buf.geometry().shard_size;
        let rank = self.rank;
        let full = buf.full_slice_mut(OP)?;
        let (ptr, _guard) = full.device_ptr_mut(&self.stream);
        let send = Raw::new(ptr + (rank * s * 4) as CUdeviceptr, s, &self.stream);
        let mut recv = Raw::new(ptr, s * self.world, &self.stream);
        guarded(OP, || self.comm.all_gather(&send, &mut recv)).map(drop)
    }

    /// In-place reduce-scatter of a full buffer: the rank's own slice ends up holding the
    /// reduction over ranks (other slices unspecified), as the CPU `reduce_scatter_in_place`.
    pub fn reduce_scatter_in_place(&self, buf: &mut DeviceDBuffer, op: ReduceOp) -> Result<()> {
        const OP: &str = "NcclComm::reduce_scatter_in_place";
        self.check_world(OP, buf)?;
        let s = buf.geometry().shard_size;
        let rank = self.rank;
        let full = buf.full_slice_mut(OP)?;
        let (ptr, _guard) = full.device_ptr_mut(&self.stream);
        let send = Raw::new(ptr, s * self.world, &self.stream);
        let mut recv = Raw::new(ptr + (rank * s * 4) as CUdeviceptr, s, &self.stream);
        guarded(OP, || {
            self.comm.reduce_scatter(&send, &mut recv, &nccl_op(op))
        })
        .map(drop)
    }

    /// In-place all-reduce of a whole device buffer.
    pub fn all_reduce_in_place(&self, buf: &mut CudaSlice<f32>, op: ReduceOp) -> Result<()> {
        guarded("NcclComm::all_reduce_in_place", || {
            self.comm.all_reduce_in_place(buf, &nccl_op(op))
        })
        .map(drop)
    }
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Avg => NcclOp::Avg,
    }
}

fn write_id(path: &Path, id: &[u8; ID_BYTES]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, id).map_err(|e| Error::io("NcclComm::from_env", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io("NcclComm::from_env", path, e))
}

fn read_id(path: &Path, timeout: Duration) -> Result<[u8; ID_BYTES]> {
    let start = Instant::now();
    loop {
        if let Ok(bytes) = std::fs::read(path) {
            if let Ok(id) = <[u8; ID_BYTES]>::try_from(bytes.as_slice()) {
                return Ok(id);
            }
        }
        if start.elapsed() > timeout {
            return Err(Error::Comm {
                op: "NcclComm::from_env",
                rank: usize::MAX,
                reason: format!(
                    "no NCCL id in {} after {} s (is rank 0 running?)",
                    path.display(),
                    timeout.as_secs()
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A raw `f32` range of device memory on `stream`, for NCCL's in-place calls, whose send and
/// receive buffers overlap (which two borrows of one `CudaSlice` cannot express). Valid while
/// the `CudaSlice` it points into is borrowed by the caller; the work is ordered by the one
/// stream, so no events are needed.
struct Raw<'s> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'s Arc<CudaStream>,
}

impl<'s> Raw<'s> {
    fn new(ptr: CUdeviceptr, len: usize, stream: &'s Arc<CudaStream>) -> Self {
        Raw { ptr, len, stream }
    }
}

impl DeviceSlice<f32> for Raw<'_> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl DevicePtr<f32> for Raw<'_> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl DevicePtrMut<f32> for Raw<'_> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_file_round_trips_and_a_missing_file_times_out_with_an_error() {
        let dir = std::env::temp_dir().join(format!("ragged-nccl-id-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("id");
        let mut id = [0u8; ID_BYTES];
        for (i, b) in id.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        write_id(&path, &id).unwrap();
        assert_eq!(read_id(&path, Duration::from_secs(1)).unwrap(), id);
        let missing = dir.join("missing");
        let err = read_id(&missing, Duration::from_millis(100)).unwrap_err();
        assert!(err.to_string().contains("no NCCL id"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
