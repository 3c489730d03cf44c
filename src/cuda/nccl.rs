//! NCCL between GPUs behind the one collective trait ([`Communicator`]): one process per GPU bootstrapped from the
//! environment with a TCP or file rendezvous for NCCL's unique id ([`NcclComm::from_env`]),
//! inside an MPI job with the id broadcast over MPI (`NcclComm::from_mpi`, features `cuda` and
//! `mpi`), from an explicit rank and id ([`NcclComm::from_rank`]), or one process driving
//! several GPUs ([`NcclComm::from_devices`]). Device buffers ([`Buf::Device`]) go to NCCL
//! as they are; host buffers through a device copy per call, so host code runs over NCCL
//! unchanged.
//!
//! # Bootstrapping ([`NcclComm::from_env`])
//! | variable | meaning |
//! |---|---|
//! | `RAGGED_RANK` (else `RANK`) | this process's rank |
//! | `RAGGED_WORLD_SIZE` (else `WORLD_SIZE`) | number of processes |
//! | `RAGGED_RENDEZVOUS_ADDR` or `RAGGED_NCCL_ID_FILE` | where rank 0 hands out NCCL's id: `host:port` it listens on, or a file every rank can read ([`crate::comm::rendezvous`]) |
//! | `RAGGED_RUN_ID` | this launch's identity (else Slurm's job step, else torchrun's run id): ranks take rank 0's id only from a message of the same run, so a file an earlier launch left is skipped, not joined ([`crate::comm::rendezvous::run_id_from_env`]) |
//! | `RAGGED_NCCL_CHECK` | `0`: the ranks do not compare their calls before each collective (default `1`; "Disagreeing ranks" below) |
//! | `RAGGED_NCCL_TIMEOUT_S` | how long ranks wait for each other there and to join the communicator ([`NcclComm::from_rank_within`]), and how long each collective may take before the rank returns `Err` and aborts the communicator (default 120; `0`: collectives do not wait, the rendezvous waits the default) |
//!
//! Each process drives the device it opened ([`Device`]); `CUDA_VISIBLE_DEVICES` or the
//! ordinal chooses which. NCCL refuses two ranks on one GPU: multi-rank code paths on a single
//! GPU use thread ranks ([`super::threads`]) instead.
//!
//! # Collectives
//! In place as NCCL's in-place operations (the send buffer of an all-gather is the rank's own
//! slice of the receive buffer; the receive buffer of a reduce-scatter is the rank's own slice
//! of the send buffer). All-to-all-v is one NCCL group of `ncclSend` / `ncclRecv` pairs, one per
//! peer with a non-zero count, so the uneven exchange of Muon's matrices to their roots is a
//! single launch; so is an all-gather into segments (a unit's parameter storages), whose
//! pieces go straight from each rank's shard into the peers' storages. Each rank checks its
//! own arguments before NCCL sees them.
//!
//! # Disagreeing ranks
//! NCCL does not check that the ranks make the same call (collective, lengths, types, counts,
//! root, segment layout): a mismatch waits until the timeout or moves mismatched bytes. So
//! before each collective the ranks all-gather a small descriptor of their call over NCCL
//! (the words MPI's ranks exchange, `comm::descriptor`) and run the thread backend's
//! validation on the same table: ranks that disagree all get the same `Err` before any data
//! moves, and the communicator stays usable. It costs one all-gather of `11·8·V` bytes and a
//! device-to-host copy per collective (a host wait for the stream, which each collective
//! makes anyway under the timeout; with `RAGGED_NCCL_TIMEOUT_S=0` it is one wait more), not
//! measured on GPUs here (the lent machines have one GPU); `RAGGED_NCCL_CHECK=0` (or
//! [`NcclComm::set_check`]) turns it off, the same on every rank. A world of one skips it.
//! Host buffers of `reduce_scatter` and `all_gather_segments` are compared as the call they
//! are staged through (an in-place reduce-scatter, a plain all-gather), so one rank passing
//! host memory where the others pass device memory is refused there too.
//!
//! Reductions are NCCL's: the order over ranks is NCCL's ring/tree order, not the CPU
//! backends' rank order, and `Avg` is NCCL's `ncclAvg`; results agree with the CPU backends up
//! to summation order (bitwise for data movement: gathers, all-to-all, broadcast).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::CudaSlice;
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys;

use super::collective::{
    check_counts, on_device_mut, on_device_pair, slice_len, DevBuf, DevBufMut,
};
use super::watchdog::{self, Progress};
use super::{guarded, Device};
use crate::comm::descriptor::{
    self, check_same_layout, header, layout_digest, Words, HEADER, NO_LAYOUT,
};
use crate::comm::protocol::{validate, Op, Post, Region};
use crate::comm::rendezvous::Rendezvous;
use crate::comm::{
    check_segments, segment_pieces, staged_all_gather, staged_reduce_scatter, Buf, BufMut,
    Communicator, ElemType, ReduceOp, Segment, SegmentPiece,
};
use crate::{Error, Result};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// `Err(CudaUnavailable)` unless the NCCL library loads (cudarc looks for `libnccl.so`, not the
/// `libnccl.so.2` soname: put a `libnccl.so` symlink on the loader path; see
/// `scripts/gpu-check.sh`).
pub fn nccl_available() -> Result<()> {
    match super::imp::library_loads!(nccl) {
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
    let id = guarded("cuda::nccl::unique_id", || named(nccl::get_uniqueid()))?;
    Ok(id.internal.map(|c| c as u8))
}

/// The communicator handle (null once aborted). NCCL calls on one communicator must not run
/// concurrently, so it sits behind [`NcclComm`]'s mutex.
struct Handle(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (the mutex).
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        if self.0.is_null() {
            return; // aborted: NCCL freed it
        }
        // SAFETY: created by ncclCommInitRank / ncclCommInitAll, destroyed once, here.
        let _ = unsafe { nccl::comm_destroy(self.0) };
    }
}

/// One look at the collective just queued on `stream` ([`watchdog::Progress`]): the stream's
/// state, and NCCL's asynchronous error while it runs.
fn progress(comm: sys::ncclComm_t, stream: sys::cudaStream_t) -> Progress {
    use cudarc::driver::sys::{cuStreamQuery, CUresult};
    // SAFETY: the stream belongs to this communicator's device context, current on this thread.
    match unsafe { cuStreamQuery(stream as _) } {
        CUresult::CUDA_SUCCESS => return Progress::Done,
        CUresult::CUDA_ERROR_NOT_READY => {}
        other => return Progress::Failed(format!("cuStreamQuery: {other:?}")),
    }
    let mut state = sys::ncclResult_t::ncclSuccess;
    // SAFETY: a live communicator handle (the caller holds its lock) and a valid out pointer.
    let asked = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
    match (asked, state) {
        (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess)
        | (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => Progress::Pending,
        (sys::ncclResult_t::ncclSuccess, err) => Progress::Failed(format!("{err:?}")),
        (err, _) => Progress::Failed(format!("ncclCommGetAsyncError: {err:?}")),
    }
}

/// One rank of an NCCL communicator, on its device's stream.
///
/// # Failures
/// Each collective waits for its own completion, at most the timeout
/// ([`NcclComm::set_timeout`]; default `RAGGED_NCCL_TIMEOUT_S`, 120 s), watching NCCL's
/// asynchronous error meanwhile ([`super::watchdog`]). A peer that failed or stopped calling
/// makes this rank return `Err` within that bound, and the communicator is aborted
/// (`ncclCommAbort`): every later call returns `Err` too. With the timeout off, collectives
/// return once queued (faster; a dead peer then hangs the stream, NCCL's own behaviour).
pub struct NcclComm {
    handle: Mutex<Handle>,
    dev: Arc<Device>,
    rank: usize,
    world: usize,
    timeout: Option<Duration>,
    /// Ranks compare their calls before each collective (module doc, "Disagreeing ranks").
    check: bool,
    /// The device buffers those comparisons gather through and the barrier's flag, made at
    /// the first call that needs them.
    kept: Mutex<Option<KeptBufs>>,
}

/// Device buffers kept for a communicator's own bookkeeping, so that no call allocates after
/// the first: room for one descriptor exchange (this rank's words and every rank's, as bytes,
/// for the larger of a header and an all-to-all-v's counts) and the barrier's one-byte flag.
struct KeptBufs {
    mine: CudaSlice<u8>,
    all: CudaSlice<u8>,
    flag: CudaSlice<u8>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

/// `RAGGED_NCCL_CHECK` ([`parse_check`]).
fn check_from_env() -> Result<bool> {
    parse_check(std::env::var("RAGGED_NCCL_CHECK").ok().as_deref())
}

/// A `RAGGED_NCCL_CHECK` value: `1` (or unset) compares the ranks' calls before each
/// collective, `0` does not (module doc, "Disagreeing ranks"); anything else is an `Err`.
fn parse_check(value: Option<&str>) -> Result<bool> {
    match value.map(str::trim) {
        None | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(v) => Err(Error::BadInput {
            op: "NcclComm",
            what: format!("RAGGED_NCCL_CHECK={v}"),
            reason: "0 (do not compare the ranks' calls) or 1 (compare them, the default)".into(),
        }),
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

fn world_i32(op: &'static str, world: usize) -> Result<i32> {
    i32::try_from(world)
        .ok()
        .filter(|&w| w > 0)
        .ok_or_else(|| Error::BadInput {
            op,
            what: format!("world of {world}"),
            reason: "needs 1 ≤ world ≤ i32::MAX".into(),
        })
}

/// NCCL's result code by name in errors (cudarc's `NcclError` prints only "NcclError").
fn named<T>(
    r: std::result::Result<T, nccl::NcclError>,
) -> std::result::Result<T, sys::ncclResult_t> {
    r.map_err(|e| e.0)
}

fn nccl_type(elem: ElemType) -> sys::ncclDataType_t {
    match elem {
        ElemType::F32 => sys::ncclDataType_t::ncclFloat32,
        ElemType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        ElemType::U8 => sys::ncclDataType_t::ncclUint8,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
    }
}

/// `ncclCommInitRank` on a thread of its own, awaited at most `limit`
/// ([`NcclComm::from_rank_within`]).
fn join(
    dev: &Arc<Device>,
    world: i32,
    id: sys::ncclUniqueId,
    rank: i32,
    limit: Duration,
) -> Result<Handle> {
    const OP: &str = "NcclComm::from_rank";
    let failed = |reason: String| Error::Comm {
        op: OP,
        rank: rank as usize,
        reason,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let dev = Arc::clone(dev);
    std::thread::Builder::new()
        .name(format!("ragged-nccl-join-{rank}"))
        .spawn(move || {
            let joined = guarded(OP, || dev.context().bind_to_thread()).and_then(|()| {
                let mut comm = std::mem::MaybeUninit::uninit();
                // SAFETY: NCCL writes the handle on success; it is read only then.
                guarded(OP, || {
                    named(unsafe { nccl::comm_init_rank(comm.as_mut_ptr(), world, id, rank) })
                })?;
                // SAFETY: initialized by the successful call above.
                Ok(Handle(unsafe { comm.assume_init() }))
            });
            if let Err(std::sync::mpsc::SendError(Ok(late))) = tx.send(joined) {
                // The caller gave up before the join completed: nobody will use it.
                // SAFETY: a live handle no one else holds, aborted once; the null stops its
                // Drop from destroying it again.
                let mut late = late;
                let _ = unsafe { nccl::comm_abort(late.0) };
                late.0 = std::ptr::null_mut();
            }
        })
        .map_err(|e| {
            failed(format!(
                "cannot start the thread that joins the communicator: {e}"
            ))
        })?;
    match rx.recv_timeout(limit) {
        Ok(joined) => joined,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(failed(format!(
            "not every rank of the {world} joined the NCCL communicator within {:.1} s: a rank \
             failed or never started (RAGGED_NCCL_TIMEOUT_S sets the limit)",
            limit.as_secs_f64()
        ))),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(failed(
            "the thread joining the communicator ended without a result".into(),
        )),
    }
}

fn bytes_of(elem: ElemType) -> u64 {
    elem.size() as u64
}

impl NcclComm {
    /// Rank `rank` of `world`, joining the communicator named by `id` (every rank passes the
    /// same id). Waits for every rank to join, at most the rendezvous timeout
    /// (`RAGGED_NCCL_TIMEOUT_S`, default 120 s; [`NcclComm::from_rank_within`]).
    pub fn from_rank(
        dev: Arc<Device>,
        rank: usize,
        world: usize,
        id: &[u8; ID_BYTES],
    ) -> Result<Self> {
        let join_limit = Rendezvous::timeout_from_env()?;
        Self::from_rank_within(dev, rank, world, id, join_limit)
    }

    /// [`NcclComm::from_rank`], waiting at most `join_limit` for the other ranks to join.
    ///
    /// `ncclCommInitRank` waits for every rank without a limit: a rank that failed before
    /// joining, or never started (a file rendezvous hands out the id without knowing who will
    /// come), would hang the others for ever. So the join runs on its own thread, and past the
    /// limit this rank returns `Err`; the abandoned join is left waiting (NCCL has no way to
    /// cancel it), and should it complete after all, its communicator is aborted. End the
    /// process after this error: the waiting thread holds NCCL's bootstrap socket.
    pub fn from_rank_within(
        dev: Arc<Device>,
        rank: usize,
        world: usize,
        id: &[u8; ID_BYTES],
        join_limit: Duration,
    ) -> Result<Self> {
        const OP: &str = "NcclComm::from_rank";
        nccl_available()?;
        let n = world_i32(OP, world)?;
        if rank >= world {
            return Err(Error::BadInput {
                op: OP,
                what: format!("rank {rank} of {world}"),
                reason: "needs rank < world".into(),
            });
        }
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        // The settings are read first: a bad value is an `Err` before this rank joins, not
        // after (when the others would wait for its first collective).
        let (timeout, check) = (crate::comm::rendezvous::env_timeout()?, check_from_env()?);
        let handle = join(&dev, n, id, rank as i32, join_limit)?;
        Ok(NcclComm {
            handle: Mutex::new(handle),
            dev,
            rank,
            world,
            timeout,
            check,
            kept: Mutex::new(None),
        })
    }

    /// One process driving several GPUs: one communicator per device, rank `i` on `devs[i]`
    /// (`ncclCommInitAll`). Drive each rank from its own thread: an NCCL collective returns once
    /// queued, and completes when every rank has queued it.
    pub fn from_devices(devs: &[Arc<Device>]) -> Result<Vec<NcclComm>> {
        const OP: &str = "NcclComm::from_devices";
        nccl_available()?;
        let n = world_i32(OP, devs.len())?;
        let ordinals: Vec<i32> = devs.iter().map(|d| d.context().ordinal() as i32).collect();
        // Read first, so that a bad value leaves no communicator behind.
        let (timeout, check) = (crate::comm::rendezvous::env_timeout()?, check_from_env()?);
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); devs.len()];
        // SAFETY: `comms` has room for one handle per device in `ordinals`.
        guarded(OP, || {
            named(unsafe { nccl::comm_init_all(comms.as_mut_ptr(), n, ordinals.as_ptr()) })
        })?;
        Ok(comms
            .into_iter()
            .zip(devs)
            .enumerate()
            .map(|(rank, (c, dev))| NcclComm {
                handle: Mutex::new(Handle(c)),
                dev: Arc::clone(dev),
                rank,
                world: devs.len(),
                timeout,
                check,
                kept: Mutex::new(None),
            })
            .collect())
    }

    /// One process per GPU, from the environment (module doc): rank 0 makes a fresh id and
    /// hands it out at the rendezvous, the others fetch it, then every rank joins.
    pub fn from_env(dev: Arc<Device>) -> Result<Self> {
        let rank = env_usize(&["RAGGED_RANK", "RANK"])?;
        let world = env_usize(&["RAGGED_WORLD_SIZE", "WORLD_SIZE"])?;
        let via = Rendezvous::from_env()?;
        let id = via.share(rank, world, Rendezvous::timeout_from_env()?, unique_id)?;
        Self::from_rank(dev, rank, world, &id)
    }

    /// One process per GPU inside an MPI job (features `cuda` and `mpi`): rank and world are
    /// MPI's, and rank 0's fresh NCCL id reaches the others by an MPI broadcast.
    #[cfg(feature = "mpi")]
    pub fn from_mpi(dev: Arc<Device>, mpi: &crate::comm::mpi::MpiComm) -> Result<Self> {
        let (rank, world) = (mpi.rank(), mpi.world_size());
        let mut id = if rank == 0 {
            unique_id()?
        } else {
            [0u8; ID_BYTES]
        };
        mpi.broadcast((&mut id[..]).into(), 0)?;
        Self::from_rank(dev, rank, world, &id)
    }

    /// How long each collective may take before this rank gives up and aborts the
    /// communicator (`None`: no wait, collectives return once queued).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// Whether the ranks compare their calls before each collective (module doc,
    /// "Disagreeing ranks"; default `RAGGED_NCCL_CHECK`, on). Every rank must set the same.
    pub fn set_check(&mut self, on: bool) {
        self.check = on;
    }

    /// The communicator, locked, with this rank's device bound to the calling thread; `Err`
    /// once it was aborted.
    fn live_handle(&self, op: &'static str) -> Result<std::sync::MutexGuard<'_, Handle>> {
        let handle = self.handle.lock().map_err(|_| Error::Comm {
            op,
            rank: self.rank,
            reason: "an earlier NCCL call panicked".into(),
        })?;
        if handle.0.is_null() {
            return Err(Error::Comm {
                op,
                rank: self.rank,
                reason: "the communicator was aborted after an earlier failure".into(),
            });
        }
        guarded(op, || self.dev.context().bind_to_thread())?;
        Ok(handle)
    }

    /// Runs `f` with the communicator handle and the stream, the device's context current,
    /// then waits for it within the timeout (aborting the communicator when that fails).
    fn call(
        &self,
        op: &'static str,
        f: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> std::result::Result<(), nccl::NcclError>,
    ) -> Result<()> {
        let mut handle = self.live_handle(op)?;
        let stream = self.dev.stream().cu_stream() as sys::cudaStream_t;
        guarded(op, || named(f(handle.0, stream)))?;
        let Some(limit) = self.timeout else {
            return Ok(());
        };
        let comm = handle.0;
        watchdog::wait(op, self.rank, limit, || progress(comm, stream)).inspect_err(|_| {
            // SAFETY: a live handle, aborted once: NCCL stops its kernels and frees it; the
            // null marks it so that nothing uses or destroys it again.
            let _ = unsafe { nccl::comm_abort(comm) };
            handle.0 = std::ptr::null_mut();
        })
    }
}

impl NcclComm {
    /// [`Communicator::split`] over NCCL (`ncclCommSplit`, NCCL 2.18 or later): the colors
    /// go round first as a collective of this communicator, waited for within its timeout,
    /// so a rank that does not split is an `Err` there rather than a wait without limit in
    /// NCCL's split. The group's ranks keep their order, device and timeout.
    fn split_comm(&self, color: usize) -> Result<NcclComm> {
        const OP: &str = "NcclComm::split";
        let colors = crate::comm::all_colors(self, color)?;
        let (members, rank) = crate::comm::group_of(&colors, self.rank);
        let handle = self.live_handle(OP)?;
        // The group's lowest rank names it; this rank's order in the parent keeps its place.
        let int = |x: usize| {
            i32::try_from(x).map_err(|_| Error::BadInput {
                op: OP,
                what: format!("rank {x}"),
                reason: "past NCCL's int ranks".into(),
            })
        };
        let (leader, key) = (int(members[0])?, int(self.rank)?);
        let mut group: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: a live communicator (its lock held), a valid out pointer written on success,
        // and a null config (NCCL's defaults, the parent's settings).
        guarded(OP, || {
            named(unsafe {
                sys::ncclCommSplit(handle.0, leader, key, &mut group, std::ptr::null_mut()).result()
            })
        })?;
        Ok(NcclComm {
            handle: Mutex::new(Handle(group)),
            dev: Arc::clone(&self.dev),
            rank,
            world: members.len(),
            timeout: self.timeout,
            check: self.check,
            kept: Mutex::new(None),
        })
    }
}

/// The device collectives (the trait's methods below stage host buffers into these).
impl NcclComm {
    /// The ranks' calls compared before a collective (module doc, "Disagreeing ranks"): every
    /// rank's descriptor all-gathered over NCCL, then the thread backend's validation and the
    /// segment layouts checked on the same table, so all ranks return the same `Err` or all
    /// go on. A world of one has no one to disagree with.
    fn agree(&self, post: Post, layout: u64) -> Result<()> {
        if !self.check || self.world == 1 {
            return Ok(());
        }
        let mine = header(&post, Words { layout, extra: 0 });
        let all = self.gather_words(&mine)?;
        let (posts, words) =
            descriptor::decode(&all, self.world, &post, |counts| self.gather_words(counts))?;
        validate(&posts)
            .and_then(|()| check_same_layout(&words, "over NCCL"))
            .map_err(|reason| Error::Comm {
                op: post.op.name(),
                rank: self.rank,
                reason,
            })
    }

    /// `mine` of every rank, in rank order: one all-gather of their bytes on the device,
    /// through buffers kept for it (no allocation per call after the first).
    fn gather_words(&self, mine: &[u64]) -> Result<Vec<u64>> {
        const OP: &str = "NcclComm::gather_words";
        let bytes: Vec<u8> = mine.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.with_kept(OP, |bufs| {
            let (n, all_n) = (bytes.len(), bytes.len() * self.world);
            self.dev
                .upload_into(&bytes, &mut bufs.mine.slice_mut(..n))?;
            let (send, recv) = (bufs.mine.slice(..n), bufs.all.slice_mut(..all_n));
            self.all_gather_dev(DevBuf::U8(send), DevBufMut::U8(recv))?;
            let all = self.dev.download(&bufs.all.slice(..all_n))?;
            let word = |c: &[u8]| u64::from_le_bytes(c.try_into().expect("chunks of 8"));
            Ok(all.chunks_exact(8).map(word).collect())
        })
    }

    /// `f` on the kept buffers ([`KeptBufs`]), made first if this is the first call.
    fn with_kept<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut KeptBufs) -> Result<T>,
    ) -> Result<T> {
        let mut kept = self.kept.lock().map_err(|_| Error::Comm {
            op,
            rank: self.rank,
            reason: "an earlier call panicked".into(),
        })?;
        let bufs = match &mut *kept {
            Some(b) => b,
            empty => {
                let most = 8 * HEADER.max(2 * self.world);
                empty.insert(KeptBufs {
                    mine: self.dev.zeros::<u8>(most)?,
                    all: self.dev.zeros::<u8>(most * self.world)?,
                    flag: self.dev.zeros::<u8>(1)?,
                })
            }
        };
        f(bufs)
    }

    /// The device this rank's buffers live on (its stream orders the collectives).
    pub fn device(&self) -> &Device {
        &self.dev
    }

    fn all_gather_in_place_dev(&self, mut buf: DevBufMut<'_>) -> Result<()> {
        const OP: &str = "NcclComm::all_gather_in_place";
        let b = buf.span(&self.dev);
        let s = slice_len(OP, b.len, self.world)?;
        let own = b.ptr + (self.rank * s) as u64 * bytes_of(b.elem);
        // SAFETY: `own` is the rank's slice of `b` (NCCL's in-place all-gather); lengths
        // checked; the view stays borrowed for the call.
        self.call(OP, |comm, stream| unsafe {
            nccl::all_gather(own as _, b.ptr as _, s, nccl_type(b.elem), comm, stream).map(drop)
        })
    }

    fn all_gather_dev(&self, send: DevBuf<'_>, mut recv: DevBufMut<'_>) -> Result<()> {
        const OP: &str = "NcclComm::all_gather";
        let (s, r) = (send.span(&self.dev), recv.span(&self.dev));
        if s.elem != r.elem || Some(r.len) != s.len.checked_mul(self.world) {
            return Err(Error::BadInput {
                op: OP,
                what: format!(
                    "{} {:?} to send, {} {:?} to receive",
                    s.len, s.elem, r.len, r.elem
                ),
                reason: format!(
                    "an all-gather receives {} × the send, of one type",
                    self.world
                ),
            });
        }
        // SAFETY: `s.len` elements to send, `V·s.len` to receive, both borrowed for the call.
        self.call(OP, |comm, stream| unsafe {
            nccl::all_gather(
                s.ptr as _,
                r.ptr as _,
                s.len,
                nccl_type(s.elem),
                comm,
                stream,
            )
            .map(drop)
        })
    }

    fn reduce_scatter_in_place_dev(&self, mut buf: DevBufMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "NcclComm::reduce_scatter_in_place";
        let b = buf.span(&self.dev);
        let s = slice_len(OP, b.len, self.world)?;
        let own = b.ptr + (self.rank * s) as u64 * bytes_of(b.elem);
        let (t, o) = (nccl_type(b.elem), nccl_op(op));
        // SAFETY: NCCL's in-place reduce-scatter (receive buffer = own slice of the send buffer).
        self.call(OP, |comm, stream| unsafe {
            nccl::reduce_scatter(b.ptr as _, own as _, s, t, o, comm, stream).map(drop)
        })
    }

    fn reduce_scatter_dev(
        &self,
        mut send: DevBufMut<'_>,
        mut recv: DevBufMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "NcclComm::reduce_scatter";
        let (a, b) = (send.span(&self.dev), recv.span(&self.dev));
        if a.elem != b.elem || Some(a.len) != b.len.checked_mul(self.world) {
            return Err(Error::InvalidShard {
                op: OP,
                reason: format!(
                    "{} {:?} elements in, {} {:?} out, on a world of {}",
                    a.len, a.elem, b.len, b.elem, self.world
                ),
            });
        }
        let (t, o) = (nccl_type(a.elem), nccl_op(op));
        // SAFETY: NCCL's out-of-place reduce-scatter: `V·n` elements read from `a`, `n` written
        // to `b`; two distinct device buffers (both borrowed mutably) of this communicator's
        // device, of the checked lengths and one element type.
        self.call(OP, |comm, stream| unsafe {
            nccl::reduce_scatter(a.ptr as _, b.ptr as _, b.len, t, o, comm, stream).map(drop)
        })
    }

    fn all_reduce_in_place_dev(&self, mut buf: DevBufMut<'_>, op: ReduceOp) -> Result<()> {
        const OP: &str = "NcclComm::all_reduce_in_place";
        let b = buf.span(&self.dev);
        let (t, o) = (nccl_type(b.elem), nccl_op(op));
        // SAFETY: the whole borrowed buffer, in place.
        self.call(OP, |comm, stream| unsafe {
            nccl::all_reduce(b.ptr as _, b.ptr as _, b.len, t, o, comm, stream).map(drop)
        })
    }

    fn all_to_all_v_dev(
        &self,
        send: DevBuf<'_>,
        send_counts: &[usize],
        mut recv: DevBufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        const OP: &str = "NcclComm::all_to_all_v";
        let (s, r) = (send.span(&self.dev), recv.span(&self.dev));
        check_counts(OP, self.world, s, send_counts, r, recv_counts)?;
        let (t, es) = (nccl_type(s.elem), bytes_of(s.elem));
        self.call(OP, |comm, stream| {
            nccl::group_start()?;
            let (mut at_s, mut at_r) = (0u64, 0u64);
            let mut queued = Ok(());
            for peer in 0..self.world {
                let (cs, cr) = (send_counts[peer], recv_counts[peer]);
                // SAFETY: segment `peer` of each borrowed buffer (counts checked against the
                // lengths above).
                queued = queued.and_then(|()| unsafe {
                    if cs > 0 {
                        nccl::send((s.ptr + at_s) as _, cs, t, peer as i32, comm, stream)?;
                    }
                    if cr > 0 {
                        nccl::recv((r.ptr + at_r) as _, cr, t, peer as i32, comm, stream)?;
                    }
                    Ok(())
                });
                at_s += cs as u64 * es;
                at_r += cr as u64 * es;
            }
            // The group is closed even when a call in it failed.
            let closed = nccl::group_end().map(drop);
            queued.and(closed)
        })
    }

    fn broadcast_in_place_dev(&self, mut buf: DevBufMut<'_>, root: usize) -> Result<()> {
        const OP: &str = "NcclComm::broadcast_in_place";
        if root >= self.world {
            return Err(Error::BadInput {
                op: OP,
                what: format!("root {root}"),
                reason: format!("not a rank of a world of {}", self.world),
            });
        }
        let b = buf.span(&self.dev);
        // SAFETY: the whole borrowed buffer, in place.
        self.call(OP, |comm, stream| unsafe {
            nccl::broadcast(
                b.ptr as _,
                b.ptr as _,
                b.len,
                nccl_type(b.elem),
                root as i32,
                comm,
                stream,
            )
            .map(drop)
        })
    }

    /// NCCL reduces `u8` in `u8`: sums wrap modulo 256 and averages truncate, where every other
    /// backend sums in 64 bits, rounds averages and saturates at 255. Rather than give other
    /// bits than the rest of the trait, a reduction of `u8` over more than one rank is refused
    /// (with one rank it is the identity, as everywhere; the barrier's sum of zeros is exact).
    fn check_reducible(&self, op: &'static str, elem: ElemType) -> Result<()> {
        if elem == ElemType::U8 && self.world > 1 {
            return Err(Error::BadInput {
                op,
                what: format!("a u8 reduction over {} ranks", self.world),
                reason: "NCCL sums u8 modulo 256 (the other backends saturate at 255); \
                         reduce a wider type"
                    .into(),
            });
        }
        Ok(())
    }

    fn barrier_dev(&self) -> Result<()> {
        // An all-reduce of one byte, then the stream: every rank has reached this point.
        self.with_kept("NcclComm::barrier", |bufs| {
            let flag = DevBufMut::U8(bufs.flag.slice_mut(..));
            self.all_reduce_in_place_dev(flag, ReduceOp::Sum)
        })?;
        self.dev.sync()
    }
}

/// Device buffers go to NCCL as they are; host buffers through a device copy each call
/// ([`on_device_mut`]: what lets the host runtime and optimizers run over NCCL unchanged).
impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_gather_in_place(&self, buf: BufMut<'_>) -> Result<()> {
        self.agree(
            Post::on(Op::AllGatherInPlace, buf.len(), buf.elem_type()),
            NO_LAYOUT,
        )?;
        on_device_mut(&self.dev, buf, |d| self.all_gather_in_place_dev(d))
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.agree(
            Post::between(Op::AllGather, &send, &recv.as_buf()),
            NO_LAYOUT,
        )?;
        on_device_pair(&self.dev, send, recv, |s, r| self.all_gather_dev(s, r))
    }

    fn reduce_scatter_in_place(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.check_reducible("NcclComm::reduce_scatter_in_place", buf.elem_type())?;
        self.agree(
            Post::on(Op::ReduceScatterInPlace, buf.len(), buf.elem_type()).reducing(op),
            NO_LAYOUT,
        )?;
        on_device_mut(&self.dev, buf, |d| self.reduce_scatter_in_place_dev(d, op))
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.check_reducible("NcclComm::all_reduce", buf.elem_type())?;
        self.agree(
            Post::on(Op::AllReduce, buf.len(), buf.elem_type()).reducing(op),
            NO_LAYOUT,
        )?;
        on_device_mut(&self.dev, buf, |d| self.all_reduce_in_place_dev(d, op))
    }

    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let post = Post {
            send_counts: send_counts.to_vec(),
            recv_counts: recv_counts.to_vec(),
            ..Post::between(Op::AllToAllV, &send, &recv.as_buf())
        };
        self.agree(post, NO_LAYOUT)?;
        on_device_pair(&self.dev, send, recv, |s, r| {
            self.all_to_all_v_dev(s, send_counts, r, recv_counts)
        })
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let post = Post::on(Op::Broadcast, buf.len(), buf.elem_type());
        self.agree(Post { root, ..post }, NO_LAYOUT)?;
        on_device_mut(&self.dev, buf, |d| self.broadcast_in_place_dev(d, root))
    }

    fn barrier(&self) -> Result<()> {
        self.agree(Post::new(Op::Barrier), NO_LAYOUT)?;
        self.barrier_dev()
    }

    fn split(&self, color: usize) -> Result<Box<dyn Communicator + '_>> {
        Ok(Box::new(self.split_comm(color)?))
    }

    /// Device buffers: one out-of-place `ncclReduceScatter`, nothing staged; host buffers as
    /// the trait's default (in place on a device copy, then the own slice copied out).
    fn reduce_scatter(&self, send: BufMut<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<usize> {
        self.check_reducible("NcclComm::reduce_scatter", send.elem_type())?;
        if let (BufMut::Device(_), BufMut::Device(_)) = (&send, &recv) {
            // (Host buffers are checked as the in-place call they are staged into.)
            let post = Post::between(Op::ReduceScatter, &send.as_buf(), &recv.as_buf());
            self.agree(post.reducing(op), NO_LAYOUT)?;
        }
        match (send, recv) {
            (BufMut::Device(s), BufMut::Device(r)) => self.reduce_scatter_dev(s, r, op).map(|()| 0),
            (s, r) => staged_reduce_scatter(self, s, r, op),
        }
    }

    /// Device segments straight into their storages, nothing staged (as MPI's): one NCCL
    /// group in which each rank sends every other rank the pieces of its input the segments
    /// cover ([`segment_pieces`], ascending; none of the padding) and receives theirs into
    /// the segments, its own pieces copied on the stream. Every rank must pass the same
    /// segment layout, which the descriptors compared first check (module doc, "Disagreeing
    /// ranks"; the runtime's gathers all agree: the plan is agreed when a model is sharded).
    /// Host segments go through a host staging buffer, as the trait's default.
    fn all_gather_segments(&self, send: Buf<'_>, segments: &mut [Segment<'_>]) -> Result<usize> {
        const OP: &str = "NcclComm::all_gather_segments";
        let Buf::Device(input) = send else {
            return staged_all_gather(self, send, segments);
        };
        check_segments(segments, input.elem_type(), input.len() * self.world)?;
        let full = Post::on(Op::AllGather, input.len() * self.world, input.elem_type());
        let post = Post {
            send: Region::sized(input.len(), input.elem_type()),
            ..full
        };
        self.agree(post, layout_digest(segments))?;
        let src = input.span(&self.dev);
        let mut spans = Vec::with_capacity(segments.len());
        for seg in segments.iter_mut() {
            let BufMut::Device(d) = &mut seg.buf else {
                return Err(crate::comm::mixed_memory(OP));
            };
            spans.push((seg.offset, d.span(&self.dev)));
        }
        let pieces: Vec<SegmentPiece> =
            segment_pieces(spans.iter().map(|(o, s)| (*o, s.len)), src.len).collect();
        let (me, t, es) = (self.rank, nccl_type(src.elem), bytes_of(src.elem));
        let at = |p: &SegmentPiece| {
            (
                src.ptr + p.from as u64 * es,
                spans[p.segment].1.ptr + p.at as u64 * es,
            )
        };
        guarded(OP, || self.dev.context().bind_to_thread())?;
        for p in pieces.iter().filter(|p| p.rank == me) {
            let (from, to) = at(p);
            // SAFETY: `p.len` elements inside the borrowed input and inside the borrowed
            // segment (the pieces lie within both), distinct buffers; queued on the stream
            // NCCL's calls below run on.
            guarded(OP, || unsafe {
                let stream = self.dev.stream().cu_stream();
                cudarc::driver::result::memcpy_dtod_async(to, from, p.len * es as usize, stream)
            })?;
        }
        if self.world == 1 {
            return Ok(0); // every piece was the rank's own
        }
        self.call(OP, |comm, stream| {
            nccl::group_start()?;
            let mut queued = Ok(());
            for p in &pieces {
                let (from, to) = at(p);
                // SAFETY: as the copies above; each piece is sent or received once per peer
                // inside the group, which NCCL runs as one operation.
                queued = queued.and_then(|()| unsafe {
                    if p.rank != me {
                        nccl::recv(to as _, p.len, t, p.rank as i32, comm, stream)?;
                        return Ok(());
                    }
                    for j in (0..self.world).filter(|&j| j != me) {
                        nccl::send(from as _, p.len, t, j as i32, comm, stream)?;
                    }
                    Ok(())
                });
            }
            // The group is closed even when a call in it failed.
            let closed = nccl::group_end().map(drop);
            queued.and(closed)
        })?;
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::parse_check;

    #[test]
    fn the_check_setting_takes_0_or_1_and_names_a_bad_value() {
        assert!(parse_check(None).unwrap(), "on by default");
        assert!(parse_check(Some(" 1")).unwrap());
        assert!(!parse_check(Some("0 ")).unwrap());
        let bad = parse_check(Some("yes")).unwrap_err().to_string();
        assert!(bad.contains("RAGGED_NCCL_CHECK=yes"), "{bad}");
    }
}
