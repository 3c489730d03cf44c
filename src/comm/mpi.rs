//! Multi-process CPU ranks over MPI (feature `mpi`, rsmpi on the system's MPI; tested with
//! Debian's Open MPI under `mpirun` on loopback).
//!
//! # Same results as the thread backend, bit for bit
//! MPI only moves bytes here; every reduction runs locally in rank order with the thread
//! backend's element operations (`comm::protocol`): in a reduce-scatter every rank sends each
//! peer its slice, and each rank folds the slices for it in rank order as they arrive,
//! [`FOLD_CHUNK`] elements of [`FOLD_WINDOW`] peers at a time into an accumulator of one
//! chunk that it then writes out, so it holds a few MiB beyond its buffers whatever `V`;
//! all-reduce splits the buffer into `V` ranges as the thread backend does, reduces range `r`
//! on rank `r` the same way and all-gathers the ranges. So a sharded step over MPI equals the
//! same step on thread ranks, and the unsharded reference, wherever the thread backend does.
//!
//! # Disagreeing ranks get an `Err`, not a hang
//! Before moving data, every call all-gathers a small descriptor of each rank's arguments
//! (collective, element types, lengths, reduce op, root, and for all-to-all-v the counts) and
//! runs the thread backend's `validate` on the table, plus the byte limits of MPI's `int`
//! counts. Every rank reaches the same verdict, so either all move data or all return the same
//! `Err`.
//!
//! # A failing rank ends the job
//! MPI cannot take one process out of a running world, so a rank that fails ends the whole job
//! with a message on stderr and a nonzero status from `mpirun`, instead of leaving the others
//! waiting inside MPI:
//!
//! | the failing rank | how the job ends |
//! |---|---|
//! | panics | the panic hook set by [`MpiComm::init`] prints the panic and `MPI_Abort`s (code 101) |
//! | returns `Err` | the program calls [`MpiComm::abort_job`] with it (as `examples/mpi_check.rs` does), which prints it and `MPI_Abort`s (code 1) |
//! | returns early (`Ok`), dropping its communicator | the drop posts a *leaving* descriptor, which meets the others' next call: each of them returns an `Err` naming the rank that left (every later call fails at once), and the leaving rank, seeing ranks that did not leave, prints their list and `MPI_Abort`s (code 1) |
//! | is alive but never calls, or stops inside a call (a `SIGSTOP`, a debugger) | each other rank waits at most `RAGGED_MPI_TIMEOUT_S` ([`DEFAULT_TIMEOUT`]) for it in its next collective or in the transfers of the current one, then asks the ranks which of them wait too, prints the ranks that did not answer and `MPI_Abort`s (code 1) |
//!
//! A rank waits with a limit because MPI has none: every MPI call inside a collective, the
//! descriptor exchange that starts it and the transfers that follow, is a non-blocking one
//! (`MPI_Iallgather`, `MPI_Ialltoallv`, ...) this rank polls, answering meanwhile the questions
//! of ranks whose limit ran out ("do you wait in a collective?", point-to-point messages of
//! their own tags). A rank whose limit runs out asks every other process of `MPI_COMM_WORLD`
//! (whichever communicator it waits in), waits up to [`ANSWER_GRACE`] for the answers, and
//! names the ranks of the world that gave none: those are not in a collective at all (stuck,
//! stopped, or busy past the limit); ranks blocked on the same rank answer, since they poll
//! too, in a group's collective as in the world's. Each wait has its own limit (the exchange's, each transfer's).
//! Work one rank does alone between collectives counts against the limit, so the default is
//! long (torch's default collective timeout): rank 0 writing a large export while the others
//! wait at the job's end must fit in it. `RAGGED_MPI_TIMEOUT_S=0` waits for ever.
//!
//! The leaving rank aborts rather than finalizes because Open MPI 4.1's `mpirun` can crash
//! (`PMIx_server_finalize`, status 139) or hang for good, deaf to `SIGTERM`, when one process
//! finalizes while the others abort: 2 of 150 runs of `mpi_check --fail-how leave` did (one
//! crash, one hang) before. Once one rank left, the job cannot go on anyway.
//!
//! # Buffers of any size
//! MPI's counts are `int`. A call whose buffers pass 2³¹ − 1 bytes (or
//! `RAGGED_MPI_MESSAGE_BYTES`, the smallest of the ranks' values, which ride with the
//! descriptors) moves its data as point-to-point messages of at most that size instead of MPI
//! collectives; every rank decides alike from the table of descriptors. An all-to-all-v, the
//! reductions and an all-gather into segments always move as messages
//! ([`Communicator::all_gather_segments`] receives straight into the segments).
//!
//! # Groups
//! [`Communicator::split`] makes a communicator of this backend over a group of ranks
//! (`MPI_Comm_split`, after the colors went round as a checked collective): the same descriptor
//! checks, waits within the limit and leaving exchange, on the group only. Its errors and
//! messages name ranks of the world and say which group they speak of (`… (in the group of
//! ranks [1, 2], numbered from 0 there)`, as thread ranks' groups do). Every MPI call of the
//! process, whichever communicator makes it, holds one lock (`MPI_THREAD_SERIALIZED`), and MPI
//! is finalized when the world and every group are dropped.
//!
//! # Start-up
//! [`MpiComm::init`] initializes MPI once per process (`MPI_THREAD_SERIALIZED`: calls come from
//! any thread, one at a time, which the communicator's mutex ensures) and finalizes it when
//! dropped. Run under `mpirun -np V` (as root add `--allow-run-as-root`; more ranks than cores
//! need `--oversubscribe`).

use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::request::{Request, Scope};
use mpi::topology::SimpleCommunicator;
use mpi::traits::{
    Communicator as _, CommunicatorCollectives as _, Destination as _, Root as _, Source as _,
};
use mpi::Count;

use super::descriptor::{self, check_same_layout, header, layout_digest, Words, HEADER, NO_LAYOUT};
use super::protocol::{part, validate, widest_buffer_bytes, Op, Post, Region, Running};
use super::{
    in_group, top_rank, Buf, BufMut, Communicator, ElemType, ReduceOp, Segment, SegmentPiece,
};
use crate::{Error, Result};

/// How long a rank waits by default in a collective for ranks that have not called it
/// (`RAGGED_MPI_TIMEOUT_S`; module doc, "A failing rank ends the job"): ten minutes, torch's
/// default collective timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// How long a rank whose wait ran out waits for the other ranks' answers.
pub const ANSWER_GRACE: Duration = Duration::from_secs(2);

/// MPI's world, held by one process.
struct Inner {
    /// Freed (`MPI_Comm_free` for a group) by the drop, under the process's call lock.
    world: ManuallyDrop<SimpleCommunicator>,
    /// A rank that left the world while this one called a collective: every later call fails
    /// at once, and the drop posts nothing more (that rank waits in `MPI_Finalize`).
    left: Option<usize>,
    /// Descriptor exchanges so far (the drop's included): named when a wait runs out.
    calls: u64,
    /// `RAGGED_MPI_TIMEOUT_S`, read once by [`MpiComm::init`]; `None`: no limit.
    timeout: Option<Duration>,
    /// `RAGGED_MPI_MESSAGE_BYTES` ([`Waiting::message_bytes`]), read once by [`MpiComm::init`].
    message_bytes: usize,
    /// Finalizes MPI when the last holder drops it (after `world`): the world's communicator
    /// and the groups split from it ([`Communicator::split`]) share it.
    universe: Option<Arc<Universe>>,
}

/// Every MPI call of the process, whichever communicator makes it, holds this lock:
/// `MPI_THREAD_SERIALIZED` allows one call at a time in the whole process, and a group's
/// communicator has a mutex of its own.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// This process's rank in `MPI_COMM_WORLD` and the world's size (MPI is initialized: an
/// [`MpiComm`] lives).
fn world_place() -> (usize, usize) {
    let world = SimpleCommunicator::world();
    (world.rank() as usize, world.size() as usize)
}

/// The largest message by default: MPI's counts are `int`.
pub const MAX_MESSAGE_BYTES: usize = Count::MAX as usize;

/// `RAGGED_MPI_MESSAGE_BYTES`: the largest message a call moves (default and most
/// [`MAX_MESSAGE_BYTES`]); calls whose buffers are larger move their data as point-to-point
/// messages of that size instead of MPI collectives. Set it lower to run that path on small
/// buffers (`.ci/run` does); `Err` unless it is a whole number from 1 to the default.
fn message_bytes_from_env() -> Result<usize> {
    const VAR: &str = "RAGGED_MPI_MESSAGE_BYTES";
    let Ok(value) = std::env::var(VAR) else {
        return Ok(MAX_MESSAGE_BYTES);
    };
    match value.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_MESSAGE_BYTES).contains(&n) => Ok(n),
        _ => Err(Error::BadInput {
            op: VAR,
            what: value,
            reason: format!("not a number of bytes from 1 to {MAX_MESSAGE_BYTES}"),
        }),
    }
}

/// This process as one rank of `MPI_COMM_WORLD`, or of a group split from it.
pub struct MpiComm {
    inner: Mutex<Inner>,
    rank: usize,
    size: usize,
    /// A group's members as ranks of `MPI_COMM_WORLD` (`None`: the world), for messages.
    group: Option<Arc<[usize]>>,
}

// SAFETY: MPI runs at `MPI_THREAD_SERIALIZED` (checked in `init`) and every MPI call goes
// through the mutex, so calls from different threads never overlap.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl MpiComm {
    /// Initializes MPI and returns this process's rank of the world; `Err` when MPI was
    /// initialized before in this process, cannot serialize calls from several threads, or
    /// `RAGGED_MPI_TIMEOUT_S` is not a number of seconds.
    pub fn init() -> Result<Self> {
        let timeout = crate::limits::env_timeout("RAGGED_MPI_TIMEOUT_S", DEFAULT_TIMEOUT)?;
        let message_bytes = message_bytes_from_env()?;
        // No rank yet: MPI is not initialized.
        let fail = |reason: String| Error::BadInput {
            op: "MpiComm::init",
            what: "the MPI library".into(),
            reason,
        };
        let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| fail("MPI is already initialized in this process".into()))?;
        if !matches!(level, mpi::Threading::Serialized | mpi::Threading::Multiple) {
            return Err(fail(format!(
                "the MPI library offers {level:?}, calls from several threads need Serialized"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        abort_job_on_panic(rank, size);
        Ok(MpiComm {
            inner: Mutex::new(Inner {
                world: ManuallyDrop::new(world),
                left: None,
                calls: 0,
                timeout,
                message_bytes,
                universe: Some(Arc::new(universe)),
            }),
            rank,
            size,
            group: None,
        })
    }

    /// Ends the whole job from this rank: prints `rank r of V failed: {error}; aborting the MPI
    /// job` to stderr and calls `MPI_Abort` with status 1, so every other rank is stopped,
    /// whether or not it waits in a collective, and `mpirun` exits nonzero. Call it with the
    /// `Err` a rank's work returned; returning from `main` instead would leave the other ranks
    /// waiting for this one inside MPI (module doc, "A failing rank ends the job").
    pub fn abort_job(&self, error: &Error) -> ! {
        let (rank, size) = world_place();
        say(format!(
            "rank {rank} of {size} failed: {error}; aborting the MPI job"
        ));
        abort_world(1)
    }

    /// An error of this rank, named as a rank of the world; a group's says which group its
    /// reason speaks of.
    fn err(&self, op: Op, reason: String) -> Error {
        self.error(op.name(), reason)
    }

    /// [`MpiComm::err`] for any operation's name.
    fn error(&self, op: &'static str, reason: String) -> Error {
        Error::Comm {
            op,
            rank: top_rank(self.group.as_deref(), self.rank),
            reason: format!("{reason}{}", in_group(self.group.as_deref())),
        }
    }

    /// Posts `post` with every rank's, validates the table (every rank reaches the same
    /// verdict), and runs `data`, whose transfers wait within the same limit.
    fn collective(&self, post: Post, data: impl FnOnce(&Waiting<'_>) -> Result<()>) -> Result<()> {
        self.collective_laid_out(post, NO_LAYOUT, data)
    }

    /// [`MpiComm::collective`] whose data phase also needs every rank to pass the same
    /// `layout` (a [`layout_digest`] of its segments; [`NO_LAYOUT`] for other calls), checked
    /// with the descriptors.
    fn collective_laid_out(
        &self,
        post: Post,
        layout: u64,
        data: impl FnOnce(&Waiting<'_>) -> Result<()>,
    ) -> Result<()> {
        let op = post.op;
        let _serial = serial();
        let mut inner = self
            .inner
            .lock()
            .map_err(|_| self.err(op, "an earlier call panicked".into()))?;
        if let Some(j) = inner.left {
            return Err(self.err(
                op,
                format!("rank {j} has left the world (see the first error)"),
            ));
        }
        let at = inner.call_site(Some(&post), self.rank, self.size, &self.group);
        let mine = Words {
            layout,
            extra: inner.message_bytes as u64,
        };
        let (posts, words) = match exchange(&inner.world, Some((&post, mine)), &at) {
            Exchanged::Posts { posts, words } => (posts, words),
            Exchanged::Left { first: j, .. } => {
                inner.left = Some(j);
                return Err(self.err(
                    op,
                    format!(
                        "rank {j} left the world (its program returned or dropped its \
                         communicator) while this rank called {}: the ranks' programs do not \
                         call the same collectives",
                        op.name()
                    ),
                ));
            }
        };
        validate(&posts)
            .and_then(|()| check_same_layout(&words, "over MPI"))
            .map_err(|reason| self.err(op, reason))?;
        // Every rank sees the same table, so all pick the same message size and route.
        let message_bytes = words.iter().map(|w| w.extra).min().unwrap_or(1);
        let message_bytes = usize::try_from(message_bytes).unwrap_or(usize::MAX);
        let widest = posts.iter().map(widest_buffer_bytes).max();
        data(&Waiting {
            world: &inner.world,
            at: CallSite {
                transfers: true,
                ..at
            },
            message_bytes,
            point_to_point: widest.unwrap_or(0) > message_bytes,
        })
    }
}

impl Inner {
    /// This rank's next call (`post`; `None`: the drop's leaving), as its waits name it.
    fn call_site(
        &mut self,
        post: Option<&Post>,
        rank: usize,
        size: usize,
        group: &Option<Arc<[usize]>>,
    ) -> CallSite {
        self.calls += 1;
        CallSite {
            rank,
            size,
            group: group.clone(),
            call: self.calls,
            what: post.map_or("the leaving exchange at its program's end", |p| p.op.name()),
            transfers: false,
            timeout: self.timeout,
        }
    }
}

impl Drop for MpiComm {
    /// Posts this rank's leaving descriptor before MPI is finalized. At a normal end it meets
    /// every other rank's; a rank that still calls collectives gets an `Err` naming this one
    /// instead of waiting for it for ever, and this rank ends the job (module doc).
    /// Then frees the communicator and, with the last holder, finalizes MPI: every MPI call
    /// under the process's call lock.
    fn drop(&mut self) {
        let (rank, size) = (self.rank, self.size);
        let _serial = serial();
        let inner = self
            .inner
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if inner.left.is_none() {
            let at = inner.call_site(None, rank, size, &self.group);
            if let Exchanged::Left { staying, .. } = exchange(&inner.world, None, &at) {
                if !staying.is_empty() {
                    let group = self.group.as_deref();
                    let staying: Vec<usize> = staying.iter().map(|&j| top_rank(group, j)).collect();
                    let (rank, size) = world_place();
                    say(format!(
                        "rank {rank} of {size} left {} while ranks {staying:?} still called \
                         collectives; aborting the MPI job",
                        match group {
                            Some(g) => format!("the group of ranks {g:?}"),
                            None => "the world".into(),
                        }
                    ));
                    abort_world(1)
                }
            }
        }
        // SAFETY: `world` is dropped once, here, and not used after: `self` is being dropped.
        unsafe { ManuallyDrop::drop(&mut inner.world) };
        inner.universe.take();
    }
}

/// Makes a panic anywhere in this process abort the whole MPI job (after the usual panic
/// message): the other ranks would otherwise wait inside MPI for this one forever.
fn abort_job_on_panic(rank: usize, size: usize) {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        if mpi::environment::is_finalized() {
            return; // MPI is over here: the process ends on its own
        }
        say(format!(
            "rank {rank} of {size} panicked: aborting the MPI job"
        ));
        abort_world(101)
    }));
}

/// Prints `line` to stderr in one write: the ranks of a job share the terminal, and a line
/// `eprintln!` writes piece by piece interleaves with the other ranks' mid-line.
fn say(line: String) {
    use std::io::Write as _;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// `MPI_Abort`s every process of the job with `code`; MPI must be initialized and not
/// finalized (every caller runs while an [`MpiComm`] lives).
fn abort_world(code: i32) -> ! {
    // SAFETY: MPI is initialized and not finalized (the callers' contract); MPI_Abort takes
    // the predefined world communicator and does not return.
    unsafe {
        mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, code);
    }
    // MPI_Abort is declared as returning; it never does, but should it, do not go on.
    std::process::abort()
}

// --- Descriptors on the wire ([`descriptor`]) -------------------------------------------

/// The header of a rank that leaves the world ([`MpiComm`]'s drop).
const LEAVE: u64 = u64::MAX;

/// What one descriptor exchange found.
enum Exchanged {
    /// Every rank's call and words.
    Posts { posts: Vec<Post>, words: Vec<Words> },
    /// Some ranks left: the first of them, and the ranks that did not.
    Left { first: usize, staying: Vec<usize> },
}

/// Every rank's descriptor and words (`None`: this rank leaves): one all-gather of the
/// headers, and when every rank calls all-to-all-v, one of the counts ([`descriptor::decode`]).
/// Every rank sees the same headers, so all reach the same outcome.
fn exchange(world: &SimpleCommunicator, post: Option<(&Post, Words)>, at: &CallSite) -> Exchanged {
    let v = at.size;
    let mine = post.map_or([LEAVE; HEADER], |(p, words)| header(p, words));
    let mut all = vec![0u64; HEADER * v];
    all_gather_within(world, &mine[..], &mut all[..], at);
    let leaving = |h: &[u64]| h[0] == LEAVE;
    if let Some(first) = all.chunks(HEADER).position(leaving) {
        let staying = (0..v).filter(|&j| !leaving(&all[j * HEADER..])).collect();
        return Exchanged::Left { first, staying };
    }
    let Some((post, _)) = post else {
        unreachable!("this rank's own header is a leaving one");
    };
    let Ok((posts, words)) = descriptor::decode(&all, v, post, |counts| {
        let mut table = vec![0u64; 2 * v * v];
        all_gather_within(world, counts, &mut table[..], at);
        Ok::<_, std::convert::Infallible>(table)
    });
    Exchanged::Posts { posts, words }
}

// --- Waiting with a limit ------------------------------------------------------------------

/// A rank's place in the job while it waits: named when the wait runs out.
struct CallSite {
    /// The rank in the communicator that waits, and its size.
    rank: usize,
    size: usize,
    /// That communicator's members as ranks of `MPI_COMM_WORLD` (`None`: the world).
    group: Option<Arc<[usize]>>,
    /// The rank's descriptor exchanges so far, this one included.
    call: u64,
    /// The collective, or the drop.
    what: &'static str,
    /// Waiting for the collective's transfers, after its descriptor exchange.
    transfers: bool,
    timeout: Option<Duration>,
}

/// Tag of a timed-out rank's question ("do you wait in a collective?"); its answer is tagged
/// [`ANSWER`] and carries the answering rank's call count. Collectives never match
/// point-to-point messages, so these cannot mix with the data.
const ASK: i32 = 0x5247;
const ANSWER: i32 = 0x5248;
/// Tag of the data's point-to-point messages ([`Waiting::move_messages`]): between two ranks
/// they arrive in the order sent, and every call's messages are received before the next call.
const DATA: i32 = 0x5249;
/// Peers whose pieces a reduction receives at once (module doc).
pub const FOLD_WINDOW: usize = 2;
/// Elements of each part a reduction receives and folds at a time (module doc): with
/// [`FOLD_WINDOW`] peers' pieces and an accumulator of as many elements, a reduce-scatter
/// holds at most 12 MiB on top of its buffers (`f32`: 8 MiB of pieces, 4 MiB of accumulator),
/// whatever `V` and the size of the slices, instead of `V` slices
/// (`examples/mpi_check.rs --memory` measures it). Chunks of 4 MiB (`f32`) keep a message's
/// latency small against its transfer; 1 MiB ones trained the demo model at 4 processes in the
/// same time on loopback.
pub const FOLD_CHUNK: usize = 1 << 20;

/// An all-gather of descriptor words, waited for within the limit ([`wait_within`]).
fn all_gather_within(world: &SimpleCommunicator, mine: &[u64], all: &mut [u64], at: &CallSite) {
    mpi::request::scope(|scope| wait_within(world.immediate_all_gather_into(scope, mine, all), at))
}

/// Waits for `request` at most `at.timeout` (module doc): polls it, answering other ranks'
/// questions meanwhile, and ends the job naming the ranks that never came when the limit
/// runs out. Every wait inside a collective goes through here, the data's as the
/// descriptors', so a rank stopped part way through a call is found too.
fn wait_within<'a, D: ?Sized, S: Scope<'a>>(request: Request<'a, D, S>, at: &CallSite) {
    wait_all_within(vec![request], at)
}

/// [`wait_within`] for several requests at once (an all-to-all-v's messages).
fn wait_all_within<'a, D: ?Sized, S: Scope<'a>>(
    mut pending: Vec<Request<'a, D, S>>,
    at: &CallSite,
) {
    let start = Instant::now();
    loop {
        pending = pending.into_iter().filter_map(|r| r.test().err()).collect();
        if pending.is_empty() {
            return;
        }
        answer_questions(at.call);
        let waited = start.elapsed();
        if at.timeout.is_some_and(|limit| waited >= limit) {
            abort_naming_the_absent(at, waited)
        }
        // Spin through a collective's usual skew (as MPI's blocking calls poll), yield while
        // a wait is short, and past 100 ms idle: a rank that waits that long loses nothing by
        // noticing the others a millisecond late.
        if waited < Duration::from_micros(50) {
            std::hint::spin_loop();
        } else if waited < Duration::from_millis(100) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The world during one call's data transfers, each waited for within the call's limit: a
/// non-blocking MPI collective, or point-to-point messages ([`Messages`]) where a collective
/// does not fit (a buffer past MPI's `int` counts, all-to-all-v, segments).
struct Waiting<'w> {
    world: &'w SimpleCommunicator,
    at: CallSite,
    /// The largest message, in bytes: MPI's `int` counts, or less where a rank set
    /// `RAGGED_MPI_MESSAGE_BYTES` (the smallest of the ranks' values, so all agree).
    message_bytes: usize,
    /// This call's buffers pass `message_bytes` on some rank: it moves its data as messages
    /// of at most that size instead of MPI collectives (every rank decides alike, from the
    /// table of descriptors).
    point_to_point: bool,
}

/// One rank's side of a data phase as point-to-point messages: what it sends to which rank
/// and where it receives from which, each list in the order the other side posts its part
/// (between two ranks, messages of one tag match in the order posted).
#[derive(Default)]
struct Messages<'b> {
    sends: Vec<(usize, &'b [u8])>,
    receives: Vec<(usize, &'b mut [u8])>,
}

/// `buf` cut into consecutive pieces of `counts[j]` bytes.
fn cut<'b>(mut buf: &'b mut [u8], counts: &[usize]) -> Vec<&'b mut [u8]> {
    counts
        .iter()
        .map(|&n| {
            let (piece, rest) = std::mem::take(&mut buf).split_at_mut(n);
            buf = rest;
            piece
        })
        .collect()
}

impl Waiting<'_> {
    /// Posts `m`, every message cut into pieces of at most [`Waiting::message_bytes`] (empty
    /// ones post nothing), and waits for all of them within the call's limit.
    fn move_messages(&self, m: Messages<'_>) {
        let (w, most) = (self.world, self.message_bytes);
        mpi::request::scope(|sc| {
            let mut requests = Vec::new();
            for (j, buf) in m.receives {
                let from = w.process_at_rank(j as i32);
                for piece in buf.chunks_mut(most) {
                    requests.push(from.immediate_receive_into_with_tag(sc, piece, DATA));
                }
            }
            for (j, buf) in m.sends {
                let to = w.process_at_rank(j as i32);
                for piece in buf.chunks(most) {
                    requests.push(to.immediate_send_with_tag(sc, piece, DATA));
                }
            }
            wait_all_within(requests, &self.at)
        })
    }

    /// An all-gather's messages: `send` to every other rank, rank `j`'s into `slots[j]`; the
    /// own slot is copied here.
    fn gather_messages<'b>(&self, send: &'b [u8], mut slots: Vec<&'b mut [u8]>) -> Messages<'b> {
        let me = self.at.rank;
        slots[me].copy_from_slice(send);
        let others = (0..self.at.size).filter(|&j| j != me);
        Messages {
            sends: others.map(|j| (j, send)).collect(),
            receives: slots
                .into_iter()
                .enumerate()
                .filter(|&(j, _)| j != me)
                .collect(),
        }
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8]) {
        if self.point_to_point {
            let slots = cut(recv, &vec![send.len(); self.at.size]);
            return self.move_messages(self.gather_messages(send, slots));
        }
        let w = self.world;
        mpi::request::scope(|s| wait_within(w.immediate_all_gather_into(s, send, recv), &self.at))
    }

    /// An all-to-all with uneven counts, as point-to-point messages: `send` holds
    /// `send_counts[j]` bytes for rank `j` and `recv` gets `recv_counts[j]` bytes from rank
    /// `j`, both in rank order, back to back; the own segment is copied here. Not
    /// `MPI_Ialltoallv`: Open MPI 4.1's nonblocking collectives complete a call whose counts
    /// are all zero at once without taking its place in the sequence of the communicator's
    /// nonblocking collectives, and the next one then never completes on any rank (a sharded
    /// Muon step at `-np 4`, where one rank holds no matrix root, hung so in its second
    /// all-to-all). A rank with nothing to send or receive posts nothing here.
    fn all_to_all_v(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) {
        let me = self.at.rank;
        let mut outgoing = Vec::with_capacity(send_counts.len());
        let mut rest = send;
        for &n in send_counts {
            let (piece, tail) = rest.split_at(n);
            outgoing.push(piece);
            rest = tail;
        }
        let mut incoming = cut(recv, recv_counts);
        incoming[me].copy_from_slice(outgoing[me]);
        self.move_messages(Messages {
            sends: outgoing
                .into_iter()
                .enumerate()
                .filter(|m| m.0 != me)
                .collect(),
            receives: incoming
                .into_iter()
                .enumerate()
                .filter(|m| m.0 != me)
                .collect(),
        })
    }

    /// Every rank's part for this rank, reduced in rank order into `dst` as the parts arrive:
    /// `parts[j]` (`n` elements of `elem`) goes to rank `j`, and this rank's own part is read
    /// at `own` (`parts[me]` is not read). The parts move and fold [`FOLD_CHUNK`] elements at
    /// a time: for each chunk the peers' pieces are received [`FOLD_WINDOW`] peers at a time
    /// and folded with the own piece into an accumulator of one chunk, which is then written
    /// to `dst`; so the rank holds that many chunks beyond its buffers, whatever `V` and the
    /// parts' size. The element operations and their order are the thread backend's: the same
    /// bits.
    ///
    /// # Safety
    /// `own` points to `n` readable elements of `elem` and `dst` to `n` writable ones, both
    /// aligned for it, that nobody else accesses during the call (other than reading `own`)
    /// and no part of `parts` overlaps; `dst` may be `own` (a chunk is read before it is
    /// written).
    unsafe fn reduce_parts(
        &self,
        parts: &[&[u8]],
        own: *const u8,
        dst: *mut u8,
        elem: ElemType,
        n: usize,
        op: ReduceOp,
    ) {
        let (w, me, v, most) = (self.world, self.at.rank, self.at.size, self.message_bytes);
        let (es, chunk) = (elem.size(), FOLD_CHUNK.min(n));
        mpi::request::scope(|sc| {
            let mut sends = Vec::new();
            for (j, part) in parts.iter().enumerate().filter(|&(j, _)| j != me) {
                let to = w.process_at_rank(j as i32);
                // Cut as the receiver's chunks (by its part's length, not this rank's `n`: an
                // all-reduce's ranges differ by one), then as its messages (`move_messages`).
                for piece in part.chunks(FOLD_CHUNK * es).flat_map(|c| c.chunks(most)) {
                    sends.push(to.immediate_send_with_tag(sc, piece, DATA));
                }
            }
            // A slot per peer of a round (none in a world of one, whose round is itself).
            let window = FOLD_WINDOW.min(v - 1);
            let mut slots: Vec<Scratch> = (0..window).map(|_| Scratch::new(chunk * es)).collect();
            let mut acc = Running::new(elem, chunk);
            let ranks: Vec<usize> = (0..v).collect();
            for start in (0..n).step_by(chunk.max(1)) {
                let len = chunk.min(n - start);
                acc.restart(len);
                for round in ranks.chunks(window.max(1)) {
                    let peers = round.iter().copied().filter(|&j| j != me);
                    self.receive_parts(&mut slots, peers, len * es);
                    let mut slot = slots.iter();
                    for &j in round {
                        let src = match j == me {
                            // SAFETY: element `start` of `own` (`start < n`), per the contract.
                            true => unsafe { own.add(start * es) },
                            false => slot.next().expect("a slot per peer").bytes().as_ptr(),
                        };
                        // SAFETY: `len` elements of `elem` (the parts' lengths are the validated
                        // ones), in a `Scratch` (aligned for every type) or at `own`.
                        unsafe { acc.fold(src) };
                    }
                }
                // SAFETY: elements `start..start + len` of `dst`, per the contract; every
                // source of this chunk was folded (read) already.
                unsafe { acc.finish(dst.add(start * es), op) };
            }
            wait_all_within(sends, &self.at);
        })
    }

    /// Receives `bytes` from each of `peers` (in order) into the first of `slots`.
    fn receive_parts(
        &self,
        slots: &mut [Scratch],
        peers: impl Iterator<Item = usize>,
        bytes: usize,
    ) {
        let receives = peers
            .zip(slots.iter_mut())
            .map(|(j, s)| (j, &mut s.bytes_mut()[..bytes]));
        self.move_messages(Messages {
            sends: Vec::new(),
            receives: receives.collect(),
        });
    }

    /// An all-gather straight into the storages of a full buffer's segments, as point-to-point
    /// messages: rank `j`'s `send` (`s` bytes) is bytes `j·s..(j+1)·s` of the full buffer, and
    /// `spans` (byte offset in the full buffer, storage; ascending, disjoint) are the parts
    /// this rank keeps. Every rank passes the same layout (checked with the descriptors), so
    /// each sends every other rank exactly the pieces of its range that the spans cover (none
    /// of the padding), in ascending order, and each receives them in that order into the
    /// spans. The own pieces are copied here.
    fn all_gather_into_spans(&self, send: &[u8], spans: &mut [(usize, &mut [u8])]) {
        let me = self.at.rank;
        let pieces: Vec<SegmentPiece> =
            super::segment_pieces(spans.iter().map(|(o, b)| (*o, b.len())), send.len()).collect();
        let mut rests: Vec<&mut [u8]> = spans.iter_mut().map(|(_, b)| &mut **b).collect();
        let mut m = Messages::default();
        let mut own: Vec<&[u8]> = Vec::new();
        for p in pieces {
            // A segment's pieces come in order and tile it.
            let (piece, tail) = std::mem::take(&mut rests[p.segment]).split_at_mut(p.len);
            rests[p.segment] = tail;
            if p.rank == me {
                let mine = &send[p.from..p.from + p.len];
                piece.copy_from_slice(mine);
                own.push(mine);
            } else {
                m.receives.push((p.rank, piece));
            }
        }
        for j in (0..self.at.size).filter(|&j| j != me) {
            m.sends.extend(own.iter().map(|&piece| (j, piece)));
        }
        self.move_messages(m)
    }

    /// An all-gather with uneven counts: rank `j`'s `counts[j]` bytes land back to back in
    /// `recv`, in rank order.
    fn all_gather_v(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) {
        if self.point_to_point {
            return self.move_messages(self.gather_messages(send, cut(recv, counts)));
        }
        // Below `message_bytes` (no route change), so every count and offset fits an `int`.
        let displs: Vec<Count> = counts
            .iter()
            .scan(0, |at, &n| Some(std::mem::replace(at, *at + n) as Count))
            .collect();
        let counts: Vec<Count> = counts.iter().map(|&n| n as Count).collect();
        let mut recv = PartitionMut::new(recv, &counts[..], &displs[..]);
        let w = self.world;
        mpi::request::scope(|s| {
            wait_within(
                w.immediate_all_gather_varcount_into(s, send, &mut recv),
                &self.at,
            )
        })
    }

    fn broadcast(&self, root: usize, bytes: &mut [u8]) {
        if self.point_to_point {
            let mut m = Messages::default();
            if self.at.rank == root {
                let others = (0..self.at.size).filter(|&j| j != root);
                m.sends = others.map(|j| (j, &*bytes)).collect();
            } else {
                m.receives.push((root, bytes));
            }
            return self.move_messages(m);
        }
        let w = self.world;
        let root = w.process_at_rank(root as i32);
        mpi::request::scope(|s| wait_within(root.immediate_broadcast_into(s, bytes), &self.at))
    }
}

/// Answers every process that asked whether this one waits in a collective. Questions and
/// answers go over `MPI_COMM_WORLD`, whichever communicator a process waits in, so a rank
/// blocked in a group's collective answers a rank that waits in the world's (HSDP).
fn answer_questions(call: u64) {
    let world = SimpleCommunicator::world();
    while let Some(status) = world.any_process().immediate_probe_with_tag(ASK) {
        let asker = world.process_at_rank(status.source_rank());
        let _question: (u64, _) = asker.receive_with_tag(ASK);
        asker.send_with_tag(&call, ANSWER);
    }
}

/// The wait ran out: asks every other process of the world whether it waits in a collective
/// (of any communicator), gives them [`ANSWER_GRACE`] to say so (answering their own questions
/// meanwhile), and ends the job with a message naming the ranks that did not answer.
fn abort_naming_the_absent(at: &CallSite, waited: Duration) -> ! {
    let world = SimpleCommunicator::world();
    let (me, size) = world_place();
    let question = at.call;
    let mut answered = vec![false; size];
    answered[me] = true;
    mpi::request::scope(|scope| {
        let _asks: Vec<_> = (0..size)
            .filter(|&j| j != me)
            .map(|j| {
                world
                    .process_at_rank(j as i32)
                    .immediate_send_with_tag(scope, &question, ASK)
            })
            .collect();
        let asked = Instant::now();
        while asked.elapsed() < ANSWER_GRACE && answered.contains(&false) {
            while let Some(status) = world.any_process().immediate_probe_with_tag(ANSWER) {
                let from = status.source_rank();
                let _call: (u64, _) = world.process_at_rank(from).receive_with_tag(ANSWER);
                answered[from as usize] = true;
            }
            answer_questions(at.call);
            std::thread::sleep(Duration::from_millis(1));
        }
        // Inside the scope: its requests never complete (a rank that never answers never
        // receives its question), and a scope left with requests pending panics.
        report_absent(at, waited, &answered)
    });
    std::process::abort()
}

/// Prints which ranks of the world did not answer a timed-out rank's question and ends the
/// job.
fn report_absent(at: &CallSite, waited: Duration, answered: &[bool]) -> ! {
    let (me, size) = world_place();
    let absent: Vec<usize> = (0..size).filter(|&j| !answered[j]).collect();
    let limit = at.timeout.map_or(0.0, |t| t.as_secs_f64());
    let who = if absent.is_empty() {
        "ranks that answered only after the grace period".to_string()
    } else {
        format!("ranks {absent:?}, which did not answer")
    };
    let phase = if at.transfers { "'s transfers" } else { "" };
    let group = match &at.group {
        Some(g) => format!(" in the group of ranks {g:?}"),
        None => String::new(),
    };
    say(format!(
        "rank {me} of {size} waited {:.1} s in {}{phase} (its call #{}{group}) for {who}: \
         stopped or stuck (inside a collective or outside any), or busy longer than \
         RAGGED_MPI_TIMEOUT_S = {limit} s; aborting the MPI job",
        waited.as_secs_f64(),
        at.what,
        at.call,
    ));
    abort_world(1)
}

// --- Buffers as bytes ------------------------------------------------------------------------

/// A host buffer as bytes (`Err` for device memory: MPI here moves host memory).
fn bytes_of<'a>(buf: &Buf<'a>) -> Result<&'a [u8]> {
    let (ptr, len) = match *buf {
        Buf::F32(b) => (b.as_ptr().cast::<u8>(), std::mem::size_of_val(b)),
        Buf::BF16(b) => (b.as_ptr().cast::<u8>(), std::mem::size_of_val(b)),
        Buf::U8(b) => (b.as_ptr(), b.len()),
        #[cfg(feature = "cuda")]
        Buf::Device(_) => return Err(super::host_only("MpiComm")),
    };
    // SAFETY: the same memory, read as bytes (every element type is plain old data).
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

fn bytes_of_mut<'a>(buf: BufMut<'a>) -> Result<&'a mut [u8]> {
    let (ptr, len) = match buf {
        BufMut::F32(b) => (b.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(b)),
        BufMut::BF16(b) => (b.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(b)),
        BufMut::U8(b) => (b.as_mut_ptr(), b.len()),
        #[cfg(feature = "cuda")]
        BufMut::Device(_) => return Err(super::host_only("MpiComm")),
    };
    // SAFETY: the same exclusive borrow, written as bytes (every bit pattern is a valid
    // element of these types).
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
}

/// A zeroed scratch buffer of `n` bytes, aligned for every element type (backed by `u64`s).
struct Scratch {
    words: Vec<u64>,
    len: usize,
}

impl Scratch {
    fn new(len: usize) -> Self {
        Scratch {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the first `len` bytes of the words.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the first `len` bytes of the words, borrowed exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.len) }
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn all_gather_in_place(&self, buf: BufMut<'_>) -> Result<()> {
        let post = Post::on(Op::AllGatherInPlace, buf.len(), buf.elem_type());
        let bytes = bytes_of_mut(buf)?;
        self.collective(post, |world| {
            let s = bytes.len() / self.size;
            let own = bytes[self.rank * s..(self.rank + 1) * s].to_vec();
            world.all_gather(&own[..], bytes);
            Ok(())
        })
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let post = Post {
            send: Region::of(&send)?,
            recv: Region::sized(recv.len(), recv.elem_type()),
            ..Post::new(Op::AllGather)
        };
        let (send, recv) = (bytes_of(&send)?, bytes_of_mut(recv)?);
        self.collective(post, |world| {
            world.all_gather(send, recv);
            Ok(())
        })
    }

    /// Straight into the segments, nothing staged: each rank sends the covered pieces of its
    /// shard as messages of their own (`Waiting::all_gather_into_spans`), which needs every
    /// rank to pass the same segment layout (its digest rides with the descriptors; a rank
    /// with another layout is an `Err` on every rank). The runtime's gathers all do: the plan
    /// is agreed when a model is sharded.
    fn all_gather_segments(&self, send: Buf<'_>, segments: &mut [Segment<'_>]) -> Result<usize> {
        let elem = send.elem_type();
        let full = send.len() * self.size;
        super::check_segments(segments, elem, full)?;
        let post = Post {
            send: Region::of(&send)?,
            recv: Region::sized(full, elem),
            ..Post::new(Op::AllGather)
        };
        let layout = layout_digest(segments);
        let send = bytes_of(&send)?;
        let mut spans = segments
            .iter_mut()
            .map(|s| Ok((s.offset * elem.size(), bytes_of_mut(s.buf.reborrow())?)))
            .collect::<Result<Vec<_>>>()?;
        self.collective_laid_out(post, layout, |world| {
            world.all_gather_into_spans(send, &mut spans);
            Ok(())
        })?;
        Ok(0)
    }

    fn reduce_scatter_in_place(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let post = Post::on(Op::ReduceScatterInPlace, buf.len(), buf.elem_type()).reducing(op);
        let me = post.recv;
        let bytes = bytes_of_mut(buf)?;
        self.collective(post, |world| {
            let (v, r, s) = (self.size, self.rank, me.len / self.size);
            let mut parts = cut(bytes, &vec![s * me.elem.size(); v]);
            let own = std::mem::take(&mut parts[r]).as_mut_ptr();
            // (The own part is read at `own`, not from the parts, which are only sent.)
            let sources: Vec<&[u8]> = parts.iter().map(|p| &**p).collect();
            // SAFETY: the own slice, `s` elements of the caller's typed buffer, borrowed
            // exclusively and apart from the other slices, read and written in place.
            unsafe { world.reduce_parts(&sources, own, own, me.elem, s, op) };
            Ok(())
        })
    }

    /// MPI moves the slices into a scratch buffer and the reduction runs locally into the
    /// separate output (as the in-place form), so nothing is staged beyond what MPI receives.
    fn reduce_scatter(&self, send: BufMut<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<usize> {
        let post = Post::between(Op::ReduceScatter, &send.as_buf(), &recv.as_buf()).reducing(op);
        let elem = recv.elem_type();
        let (send, recv) = (bytes_of_mut(send)?, bytes_of_mut(recv)?);
        self.collective(post, |world| {
            let s = recv.len() / elem.size();
            let parts: Vec<&[u8]> = (0..self.size)
                .map(|j| &send[j * recv.len()..][..recv.len()])
                .collect();
            let own = parts[self.rank].as_ptr();
            // SAFETY: `s` elements of the caller's typed input (this rank's part) and output
            // buffers, the output borrowed exclusively and apart from the input.
            unsafe { world.reduce_parts(&parts, own, recv.as_mut_ptr(), elem, s, op) };
            Ok(())
        })?;
        Ok(0)
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let post = Post::on(Op::AllReduce, buf.len(), buf.elem_type()).reducing(op);
        let me = post.recv;
        let bytes = bytes_of_mut(buf)?;
        self.collective(post, |world| {
            let (v, r, es) = (self.size, self.rank, me.elem.size());
            let ranges: Vec<(usize, usize)> = (0..v).map(|k| part(me.len, v, k)).collect();
            // Phase 1: range r of every rank to rank r, reduced there in rank order.
            let range_bytes: Vec<usize> = ranges.iter().map(|&(lo, hi)| (hi - lo) * es).collect();
            let n = ranges[r].1 - ranges[r].0;
            let parts: Vec<&[u8]> = ranges
                .iter()
                .map(|&(lo, hi)| &bytes[lo * es..hi * es])
                .collect();
            let mut reduced = Scratch::new(n * es);
            let (own, out) = (parts[r].as_ptr(), reduced.bytes_mut().as_mut_ptr());
            // SAFETY: `n` elements of the caller's typed buffer (range `r`) and of a `Scratch`
            // of as many (aligned for every element type), apart from the caller's buffer.
            unsafe { world.reduce_parts(&parts, own, out, me.elem, n, op) };
            // Phase 2: every range to every rank (the ranges are consecutive).
            world.all_gather_v(reduced.bytes(), bytes, &range_bytes);
            Ok(())
        })
    }

    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let post = Post {
            send: Region::of(&send)?,
            recv: Region::sized(recv.len(), recv.elem_type()),
            send_counts: send_counts.to_vec(),
            recv_counts: recv_counts.to_vec(),
            ..Post::new(Op::AllToAllV)
        };
        let es = post.send.elem.size();
        let (send, recv) = (bytes_of(&send)?, bytes_of_mut(recv)?);
        self.collective(post, |world| {
            let bytes = |c: &[usize]| -> Vec<usize> { c.iter().map(|&n| n * es).collect() };
            world.all_to_all_v(send, &bytes(send_counts), recv, &bytes(recv_counts));
            Ok(())
        })
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let post = Post {
            root,
            ..Post::on(Op::Broadcast, buf.len(), buf.elem_type())
        };
        let bytes = bytes_of_mut(buf)?;
        self.collective(post, |world| {
            world.broadcast(root, bytes);
            Ok(())
        })
    }

    fn barrier(&self) -> Result<()> {
        // The descriptor exchange is itself a barrier (an all-gather every rank must join).
        self.collective(Post::new(Op::Barrier), |_| Ok(()))
    }

    /// `MPI_Comm_split`, after the colors went round as a checked collective (so a rank that
    /// does not split is an `Err` or a named timeout, not a hang inside MPI). The group is a
    /// communicator of this backend in every way (descriptor checks, waits within the limit,
    /// the leaving exchange when dropped); MPI stays initialized until it and the world are
    /// both dropped. A rank whose wait runs out asks every process of the world who else waits
    /// (module doc); errors and messages name ranks of the world.
    fn split(&self, color: usize) -> Result<Box<dyn Communicator + '_>> {
        let colors = super::all_colors(self, color)?;
        let (members, rank) = super::group_of(&colors, self.rank);
        // The group's lowest rank names it: a valid MPI color (non-negative, an `int`).
        let leader = mpi::topology::Color::with_value(members[0] as i32);
        let _serial = serial();
        let inner = self
            .inner
            .lock()
            .map_err(|_| self.error("split", "an earlier call panicked".into()))?;
        let group = inner.world.split_by_color(leader).ok_or_else(|| {
            let reason = "MPI_Comm_split gave no communicator for this rank's color";
            self.error("split", reason.into())
        })?;
        let top: Vec<usize> = members
            .iter()
            .map(|&j| top_rank(self.group.as_deref(), j))
            .collect();
        Ok(Box::new(MpiComm {
            inner: Mutex::new(Inner {
                world: ManuallyDrop::new(group),
                left: None,
                calls: 0,
                timeout: inner.timeout,
                message_bytes: inner.message_bytes,
                universe: inner.universe.clone(),
            }),
            rank,
            size: members.len(),
            group: Some(top.into()),
        }))
    }
}
