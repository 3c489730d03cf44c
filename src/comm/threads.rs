//! Thread ranks: every rank is a thread of one process, and collectives read the other ranks'
//! buffers directly through shared memory (no staging buffers, no extra copies).
//!
//! # Protocol
//! Every collective runs in three steps:
//! 1. **Rendezvous.** The rank posts a descriptor (collective, element type, address and length
//!    of its buffers, reduce op, root, counts) and waits, up to the world's timeout, until every
//!    rank has posted. Each rank then checks the whole table with the same pure function, so
//!    either every rank goes on or every rank returns the same `Err` without touching memory.
//! 2. **Data phase.** Each rank reads the regions of the other ranks' buffers it needs and writes
//!    only its own buffers (table below). All-reduce has two data phases with a sync in between.
//! 3. **Exit.** A second sync: nobody returns (and so gets its buffers back) while another rank
//!    may still read them.
//!
//! Who reads and writes what (`buf_j` is rank `j`'s buffer, slice / range `k` as in the trait;
//! rank `r` executes the row; in every data phase the regions written are disjoint from every
//! region any other rank reads or writes):
//!
//! | collective | rank `r` reads | rank `r` writes |
//! |---|---|---|
//! | all-gather in place | slice `j` of `buf_j`, `j ≠ r` | slices `j ≠ r` of `buf_r` |
//! | all-gather | all of `send_j` | slice `j` of `recv_r`, every `j` |
//! | reduce-scatter in place | slice `r` of every `buf_j` | slice `r` of `buf_r` |
//! | all-reduce, phase 1 | range `r` of every `buf_j` | range `r` of `buf_r` |
//! | all-reduce, phase 2 | range `k` of `buf_k`, `k ≠ r` | ranges `k ≠ r` of `buf_r` |
//! | broadcast | all of `buf_root` (`r ≠ root`) | all of `buf_r` (`r ≠ root`) |
//! | all-to-all-v | rank `r`'s segment of every `send_j` | all of `recv_r` |
//!
//! All-reduce splits `L` elements into `V` ranges of `⌊L/V⌋` or `⌈L/V⌉` elements, the longer
//! ones first.
//!
//! # Reductions
//! Always in rank order `0, 1, …, V−1`, accumulated left to right (`((b0 + b1) + b2) + …`), so
//! every rank computes bitwise the same value and all-reduce returns identical buffers.
//!
//! | element | accumulator | `Sum` | `Avg` |
//! |---|---|---|---|
//! | `f32` | `f32` | the fold | `fold / V as f32` |
//! | `bf16` | `f32` | the fold, rounded once to bf16 at the end | `fold / V as f32`, rounded once |
//! | `u8` | integer | saturating add in rank order, which equals `min(Σ, 255)` | `Σ / V` rounded to nearest, ties up: `(Σ + ⌊V/2⌋) / V` |
//!
//! # Failures
//! A disagreement between ranks (collective, element type, lengths, root, reduce op, counts), a
//! rank that leaves the world, a second call on a rank that is already inside a collective, or a
//! rank waiting at a rendezvous for longer than the timeout: each poisons the world. Ranks
//! waiting at a rendezvous wake up and return `Err` at once, and every later call returns `Err`.
//! The reason names the rank that caused it.
//!
//! A rank leaves the world when its [`ThreadComm`] is dropped (also when its thread unwinds) or,
//! under [`ThreadWorld::run`], as soon as its closure returns `Ok`, returns `Err` or panics:
//! `run` owns the communicators and takes each rank out of the world right after its closure
//! ends, so the others fail at once, never at the timeout. `run` then returns the `Err` of the
//! rank that failed first (a panic becomes an [`Error::Comm`] with the panic's message), not a
//! panic; a rank whose closure left a group ([`Communicator::split`]) before it failed counts
//! from that moment, since the group's other members fail at once. The guarantees, per way a
//! rank can fail:
//!
//! | the failing rank | every other rank, in its pending or next collective |
//! |---|---|
//! | panics, returns `Err`, or returns `Ok` early (under `run`), or drops its communicator | `Err` naming that rank, as soon as it is woken (no timeout involved) |
//! | is alive but never calls the collective the others wait in | `Err` after the world's timeout ([`DEFAULT_TIMEOUT`], or [`ThreadWorld::run_with_timeout`] / [`ThreadWorld::with_timeout`]) naming the missing ranks |
//!
//! The timeout covers waiting for the other ranks to *arrive*. Once every rank has arrived and
//! the buffers are shared, the syncs between and after data phases wait without a timeout:
//! returning early would hand a buffer back to its owner while another thread still reads it.
//! Those waits only last as long as the other ranks' copies, since nothing else runs in between.
//!
//! # Groups
//! A split ([`Communicator::split`]) makes each group a thread world of its own
//! ([`ThreadComm::split_world`]): the same protocol and guarantees, the parent's timeout. A
//! group's errors report the rank as a rank of the world it was split from at the top, and say
//! which group they speak of (`… (in the group of ranks [1, 3], numbered from 0 there)`): the
//! ranks the reason itself names are numbered within the group.
//!
//! # Memory
//! The protocol does not care where the buffers are: the data phases go through a `Memory`
//! (copy, reduce, fence). [`ThreadComm`]'s [`Communicator`] uses host memory; thread ranks on
//! one GPU (`crate::cuda::threads`) run the same collectives on device addresses with
//! device-to-device copies and a reduction kernel that keeps the order above, fencing (waiting
//! for their stream) on entry and before every sync.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

pub(crate) use super::protocol::Region;
use super::protocol::{offset, part, reduce_dyn, validate, Op, Post};
use super::{check_segments, Buf, BufMut, Communicator, ElemType, ReduceOp, Segment};
use crate::{Error, Result};

/// How long a rank waits at a rendezvous for the others before the world fails.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The most thread ranks one process runs ([`ThreadWorld::run`]; [`ThreadWorld::new`] makes no
/// more communicators): each is an OS thread with its own stack, and far beyond this the
/// system's limits abort the process rather than refuse a thread.
pub const MAX_THREAD_RANKS: usize = 4096;

/// Constructors of a thread world; holds no state itself.
#[derive(Debug)]
pub struct ThreadWorld {
    _constructors_only: (),
}

impl ThreadWorld {
    /// One communicator per rank of an `n`-rank world, in rank order, with the default timeout
    /// ([`DEFAULT_TIMEOUT`]). Move each into its own thread.
    // A world is its communicators; there is no `ThreadWorld` value to return.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(n: usize) -> Result<Vec<ThreadComm>> {
        Self::with_timeout(n, DEFAULT_TIMEOUT)
    }

    /// Runs `f` on every rank of a fresh `n`-rank world, one scoped thread per rank, and
    /// returns the results in rank order, with the default timeout ([`DEFAULT_TIMEOUT`]).
    ///
    /// A rank whose closure ends (`Ok`, `Err` or a panic) leaves the world at once, so ranks
    /// still waiting for it fail without waiting for the timeout (module doc, "Failures"). If
    /// any rank fails, `run` returns the `Err` of the rank that failed first; a panic becomes
    /// an [`Error::Comm`] carrying the panic's message.
    pub fn run<T: Send>(n: usize, f: impl Fn(&ThreadComm) -> Result<T> + Sync) -> Result<Vec<T>> {
        run_ranks("ThreadWorld::run", Self::new(n)?, f)
    }

    /// As [`ThreadWorld::run`], with the time a rank waits at a rendezvous for a rank that is
    /// alive but does not call (the only failure that needs a timeout to be noticed).
    pub fn run_with_timeout<T: Send>(
        n: usize,
        timeout: Duration,
        f: impl Fn(&ThreadComm) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        run_ranks("ThreadWorld::run", Self::with_timeout(n, timeout)?, f)
    }

    /// As [`ThreadWorld::new`], with the time a rank waits at a rendezvous before the world
    /// fails.
    pub fn with_timeout(n: usize, timeout: Duration) -> Result<Vec<ThreadComm>> {
        if n == 0 {
            return Err(Error::Comm {
                op: "ThreadWorld::new",
                rank: 0,
                reason: "a world needs at least one rank".into(),
            });
        }
        // Before the world's per-rank tables are allocated: `1 << 40` ranks aborted the
        // process (an 8 TB allocation), `usize::MAX` panicked (capacity overflow).
        if n > MAX_THREAD_RANKS {
            return Err(Error::BadInput {
                op: "ThreadWorld::new",
                what: format!("a world of {n} thread ranks"),
                reason: format!(
                    "each rank is an OS thread; at most {MAX_THREAD_RANKS} run in one process"
                ),
            });
        }
        if timeout.is_zero() {
            return Err(Error::BadInput {
                op: "ThreadWorld::with_timeout",
                what: "timeout 0 s".into(),
                reason: "every rendezvous would time out before the others arrive".into(),
            });
        }
        let world = World::new(n, timeout, None);
        Ok((0..n)
            .map(|rank| ThreadComm {
                rank,
                world: Arc::clone(&world),
                peer_wait_ns: AtomicU64::new(0),
            })
            .collect())
    }
}

/// One rank of a thread world. Dropping it marks the rank as gone: the other ranks' pending and
/// later collectives fail.
pub struct ThreadComm {
    rank: usize,
    world: Arc<World>,
    /// Nanoseconds spent at rendezvous waiting for the other ranks to post (load imbalance
    /// before a collective, as opposed to its transfer).
    peer_wait_ns: AtomicU64,
}

impl fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world.size)
            .field("timeout", &self.world.timeout)
            .finish()
    }
}

struct World {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
    /// Worlds being handed out by a split: the group leader (the lowest rank of a group) puts
    /// its group's new world at its own index, and the other members clone it from there.
    splits: Mutex<Vec<Option<Arc<World>>>>,
    /// A group's members as ranks of the world it was split from at the top (`None` there):
    /// errors name this rank by that number and say which group they speak of.
    group: Option<Vec<usize>>,
}

struct State {
    /// Sync points each rank has reached; only grows. A sync point is passed when every rank
    /// has reached it.
    reached: Vec<u64>,
    /// Each rank's descriptor for its current collective; stable from the rendezvous until the
    /// exit sync, since a rank posts again only after every rank reached that exit.
    posts: Vec<Post>,
    /// Whether a rank is inside a collective (a second concurrent call is an error).
    in_call: Vec<bool>,
    /// Why the world failed; set once, never cleared.
    poison: Option<String>,
    /// Set when a rank unwound out of a data phase (a bug): the collective's results are invalid.
    aborted: Option<String>,
    /// Data phases that failed on some rank (a device copy or kernel): the sync point that
    /// ends the phase, the rank and why. Every rank reads it after that sync, so all fail
    /// together instead of the others reading a range that was never written; entries of
    /// points every rank is past are dropped.
    phase_failures: Vec<(u64, usize, String)>,
}

impl World {
    fn new(n: usize, timeout: Duration, group: Option<Vec<usize>>) -> Arc<World> {
        Arc::new(World {
            size: n,
            timeout,
            state: Mutex::new(State {
                reached: vec![0; n],
                posts: vec![Post::new(Op::Barrier); n],
                in_call: vec![false; n],
                poison: None,
                aborted: None,
                phase_failures: Vec::new(),
            }),
            cv: Condvar::new(),
            splits: Mutex::new(vec![None; n]),
            group,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent even if a holder panicked: every update is a single store.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, st: MutexGuard<'a, State>, dur: Duration) -> MutexGuard<'a, State> {
        self.cv
            .wait_timeout(st, dur)
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }
}

impl State {
    fn all_reached(&self, point: u64) -> bool {
        self.reached.iter().all(|&p| p >= point)
    }
}

/// A rank of a thread world, as [`run_ranks`] sees it: something that holds a [`ThreadComm`].
pub(crate) trait Member: Send {
    fn thread_comm(&self) -> &ThreadComm;
}

impl Member for ThreadComm {
    fn thread_comm(&self) -> &ThreadComm {
        self
    }
}

/// Runs `f` on every communicator of a world, one scoped thread each (which owns it), and
/// returns the results in rank order. Each rank leaves the world as soon as its closure ends,
/// so nobody waits for it; if any rank fails, returns the `Err` of the rank that failed first
/// (module doc, "Failures").
pub(crate) fn run_ranks<C: Member, T: Send>(
    op: &'static str,
    comms: Vec<C>,
    f: impl Fn(&C) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    // The world's size was checked against MAX_THREAD_RANKS where it was made (`with_timeout`).
    let f = &f;
    // Ranks whose closure failed, with when ([`LEAVES`]): a rank's failure takes its place before
    // it leaves the world or any group, so before any failure that its leaving causes.
    let failed = Mutex::new(Vec::new());
    let failed_ref = &failed;
    let mut not_started = None;
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (rank, c) in comms.into_iter().enumerate() {
            if not_started.is_some() {
                continue; // dropping `c` takes the rank out of the world
            }
            // A thread the system refuses (limits, memory) drops its closure, and with it the
            // communicator: the ranks already running fail at their next collective.
            let thread = std::thread::Builder::new()
                .spawn_scoped(s, move || run_rank(op, rank, c, f, failed_ref));
            match thread {
                Ok(h) => handles.push(h),
                Err(e) => not_started = Some((rank, e)),
            }
        }
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                // `run_rank` catches the closure's panic; only a panic while leaving gets here.
                h.join().unwrap_or_else(|_| {
                    Err(Error::Comm {
                        op,
                        rank,
                        reason: "the rank's thread panicked while leaving the world".into(),
                    })
                })
            })
            .collect()
    });
    if let Some((rank, e)) = not_started {
        return Err(Error::Comm {
            op,
            rank,
            reason: format!("the system refused a thread for this rank: {e}"),
        });
    }
    let first = failed
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .min()
        .map(|&(_, rank)| rank);
    first_failure(results, first)
}

/// One rank's thread: runs `f`, records a failure, then takes the rank out of the world (which
/// wakes every rank waiting for it) and drops its communicator.
fn run_rank<C: Member, T>(
    op: &'static str,
    rank: usize,
    comm: C,
    f: &(impl Fn(&C) -> Result<T> + Sync),
    failed: &Mutex<Vec<(u64, usize)>>,
) -> Result<T> {
    FIRST_LEAVE.with(|first| first.set(None));
    // Unwind-safe in effect: after a panic only `comm` is used again, and the world's state
    // is consistent after any panic (`World::lock`); `f` and its captures are dropped unused.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&comm)))
        .unwrap_or_else(|payload| {
            Err(Error::Comm {
                op,
                rank,
                reason: format!(
                    "the rank panicked: {}",
                    crate::error::panic_text(payload.as_ref())
                ),
            })
        });
    let why = match &result {
        Ok(_) => "its closure returned".to_string(),
        Err(e) => {
            let at = FIRST_LEAVE
                .with(|first| first.get())
                .unwrap_or_else(|| LEAVES.fetch_add(1, Ordering::SeqCst));
            failed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((at, rank));
            format!("its closure failed: {e}")
        }
    };
    comm.thread_comm().leave(&why);
    result
}

/// Every result, or the `Err` of rank `first` (the first to fail), else the lowest rank's.
fn first_failure<T>(results: Vec<Result<T>>, first: Option<usize>) -> Result<Vec<T>> {
    let (mut oks, mut errs) = (Vec::new(), Vec::new());
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Ok(v) => oks.push(v),
            Err(e) => errs.push((rank, e)),
        }
    }
    if errs.is_empty() {
        return Ok(oks);
    }
    let k = errs
        .iter()
        .position(|&(r, _)| Some(r) == first)
        .unwrap_or(0);
    Err(errs.swap_remove(k).1)
}

/// One rank inside a collective, between a successful rendezvous and the exit sync.
struct Call<'a> {
    comm: &'a ThreadComm,
    op: Op,
    /// The last sync point this rank reached.
    point: u64,
    /// The exit sync point of this call.
    exit: u64,
    done: bool,
}

impl Call<'_> {
    /// Waits until every rank finished the current data phase, whose outcome on this rank is
    /// `done`. No timeout (module doc). This rank's error if it failed, else another rank's:
    /// every rank leaves a failed phase with `Err`.
    fn sync(&mut self, done: Result<()>) -> Result<()> {
        let w = &*self.comm.world;
        let mut st = w.lock();
        self.point += 1;
        if let Err(e) = &done {
            // A rank reads an entry right after its sync point, before it reaches the next
            // one: once every rank is past a point, its entries are read.
            let slowest = st.reached.iter().copied().min().unwrap_or(0);
            st.phase_failures.retain(|f| f.0 >= slowest);
            st.phase_failures
                .push((self.point, self.comm.rank, e.to_string()));
        }
        st.reached[self.comm.rank] = self.point;
        w.cv.notify_all();
        while !st.all_reached(self.point) {
            st = w.wait(st, w.timeout);
        }
        done?;
        match st.phase_failures.iter().find(|f| f.0 == self.point) {
            Some((_, rank, why)) => Err(self.comm.err(
                self.op,
                format!("rank {rank} failed its part of the collective: {why}"),
            )),
            None => Ok(()),
        }
    }

    /// Ends a data phase whose outcome is `phase`: completes this rank's queued work (where
    /// other ranks read it: see [`ThreadComm::fence_for_peers`]), then syncs (always, so no
    /// rank is left waiting); the phase's or the fence's error on any rank.
    fn end_phase(&mut self, mem: &dyn Memory, phase: Result<()>) -> Result<()> {
        let done = phase.and_then(|()| self.comm.fence_for_peers(mem));
        self.sync(done)
    }

    /// Ends the last data phase and exits (as [`Call::end_phase`] then [`Call::finish`]).
    fn finish_phase(self, mem: &dyn Memory, phase: Result<()>) -> Result<()> {
        let done = phase.and_then(|()| self.comm.fence_for_peers(mem));
        self.finish_with(done)
    }

    /// The exit sync; `Err` if a rank unwound out of this collective.
    fn finish(self) -> Result<()> {
        self.finish_with(Ok(()))
    }

    /// The exit sync after a last phase whose outcome here is `done`; `Err` if it failed on any
    /// rank or a rank unwound out of this collective.
    fn finish_with(mut self, done: Result<()>) -> Result<()> {
        let synced = self.sync(done);
        self.done = true;
        let mut st = self.comm.world.lock();
        st.in_call[self.comm.rank] = false;
        match &st.aborted {
            Some(reason) => Err(self.comm.err(self.op, reason.clone())),
            None => synced,
        }
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Unwinding out of a data phase (only a bug can get here: data phases touch validated
        // ranges only). Other ranks may still read this rank's buffers, whose borrows end with
        // this frame, so wait for them at the exit before letting the unwinding go on.
        let w = &*self.comm.world;
        let mut st = w.lock();
        let reason = format!("rank {} panicked during {}", self.comm.rank, self.op.name());
        st.aborted.get_or_insert_with(|| reason.clone());
        st.poison.get_or_insert(reason);
        st.reached[self.comm.rank] = self.exit;
        w.cv.notify_all();
        while !st.all_reached(self.exit) {
            st = w.wait(st, w.timeout);
        }
        st.in_call[self.comm.rank] = false;
    }
}

impl ThreadComm {
    fn err(&self, op: Op, reason: String) -> Error {
        let group = self.world.group.as_deref();
        Error::Comm {
            op: op.name(),
            rank: super::top_rank(group, self.rank),
            reason: format!("{reason}{}", super::in_group(group)),
        }
    }

    /// Poisons the world (keeping the first reason), wakes every waiter, and returns the error.
    fn fail(&self, st: &mut State, op: Op, reason: String) -> Error {
        st.poison.get_or_insert_with(|| reason.clone());
        self.world.cv.notify_all();
        self.err(op, reason)
    }

    /// Posts this rank's descriptor, waits until every rank has posted, and checks the table.
    /// On success the buffers of every rank are shared until the returned call finishes.
    fn enter(&self, post: Post) -> Result<(Call<'_>, Vec<Post>)> {
        let (w, r, op) = (&*self.world, self.rank, post.op);
        let mut st = w.lock();
        if let Some(p) = &st.poison {
            let reason = format!("the world failed earlier: {p}");
            return Err(self.err(op, reason));
        }
        if st.in_call[r] {
            let reason = format!("rank {r} called {} during another collective", op.name());
            return Err(self.fail(&mut st, op, reason));
        }
        let point = st.reached[r] + 1;
        st.in_call[r] = true;
        st.posts[r] = post;
        st.reached[r] = point;
        w.cv.notify_all();
        let posted = Instant::now();
        let deadline = crate::limits::deadline(posted, w.timeout);
        // Arrival first: once every rank has posted, the rendezvous has happened, whatever
        // poisons the world afterwards. A rank that fails the world first makes the next arrival
        // stop at the poison check above, so the rendezvous can no longer complete.
        while !st.all_reached(point) {
            if let Some(p) = &st.poison {
                let reason = p.clone();
                st.in_call[r] = false;
                return Err(self.err(op, reason));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..w.size).filter(|&j| st.reached[j] < point).collect();
                // Named: the poison reaches the late ranks too ("the world failed earlier").
                let reason = format!(
                    "rank {r} timed out after {:?} waiting for ranks {missing:?}",
                    w.timeout
                );
                st.in_call[r] = false;
                return Err(self.fail(&mut st, op, reason));
            }
            st = w.wait(st, deadline - now);
        }
        let waited = u64::try_from(posted.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.peer_wait_ns.fetch_add(waited, Ordering::Relaxed);
        let posts = st.posts.clone();
        if let Err(reason) = validate(&posts) {
            st.in_call[r] = false;
            return Err(self.fail(&mut st, op, reason));
        }
        // Every rank came: a group this thread left before harmed nobody (`FIRST_LEAVE`).
        FIRST_LEAVE.with(|first| first.set(None));
        let call = Call {
            comm: self,
            op,
            point,
            exit: point + op.points() - 1,
            done: false,
        };
        Ok((call, posts))
    }
}

impl ThreadComm {
    /// Takes this rank out of the world: its pending and later collectives can no longer
    /// complete, so the world is poisoned (keeping an earlier reason) with `why`, naming this
    /// rank, and every waiting rank is woken.
    pub(crate) fn leave(&self, why: &str) {
        let w = &*self.world;
        let mut st = w.lock();
        let rank = self.rank;
        st.poison
            .get_or_insert_with(|| format!("rank {rank} left the world ({why})"));
        w.cv.notify_all();
    }
}

impl ThreadComm {
    /// [`Communicator::split`] for thread ranks: each group is a new thread world (the same
    /// protocol, this world's timeout), made by its leader and handed to the
    /// others through this world's `splits` table between two barriers.
    pub fn split_world(&self, color: usize) -> Result<ThreadComm> {
        let colors = super::all_colors(self, color)?;
        let (members, rank) = super::group_of(&colors, self.rank);
        let leader = members[0];
        let splits = || {
            self.world
                .splits
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        if self.rank == leader {
            let group = self.world.group.as_deref();
            let top = members.iter().map(|&j| super::top_rank(group, j)).collect();
            splits()[leader] = Some(World::new(members.len(), self.world.timeout, Some(top)));
        }
        self.barrier()?;
        let world = splits()[leader].clone();
        self.barrier()?;
        if self.rank == leader {
            splits()[leader] = None;
        }
        let world = world.expect("the leader made its group's world before the barrier");
        Ok(ThreadComm {
            rank,
            world,
            peer_wait_ns: AtomicU64::new(0),
        })
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        let how = if std::thread::panicking() {
            "its thread panicked"
        } else {
            "dropped its communicator"
        };
        if self.world.group.is_some() {
            // Before the group learns of it: see `FIRST_LEAVE`.
            FIRST_LEAVE.with(|first| {
                if first.get().is_none() {
                    first.set(Some(LEAVES.fetch_add(1, Ordering::SeqCst)));
                }
            });
        }
        self.leave(how);
    }
}

/// Orders failures under [`ThreadWorld::run`] by cause: a rank's closure may drop groups split
/// from its communicator (a sharded model's HSDP groups) before it returns `Err`, and the
/// group's other members fail at once, possibly returning before it. So a rank's failure takes
/// its place in the order at the first group it left since its last collective that every rank
/// came to (a model dropped and another built does not count), not when its closure returned.
static LEAVES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// When this thread first left a group since its rank's closure started ([`LEAVES`]).
    static FIRST_LEAVE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// Where a world's buffers live, and how its data phases move and reduce them: host memory
/// here ([`HostMemory`]), device memory for thread ranks on one GPU (`crate::cuda::threads`).
/// The rendezvous, validation, phases and syncs are the same for both.
pub(crate) trait Memory {
    /// Copies `bytes` bytes from `src` to `dst` (may only be queued until [`Memory::fence`]).
    ///
    /// # Safety
    /// As [`copy_bytes`], for addresses of this memory.
    unsafe fn copy(&self, src: *const u8, dst: *mut u8, bytes: usize) -> Result<()>;

    /// Writes to `dst[..n]` the reduction of `srcs[j][..n]` in rank order (module doc,
    /// "Reductions"); may only be queued until [`Memory::fence`].
    ///
    /// # Safety
    /// As [`reduce`], for addresses of this memory.
    unsafe fn reduce(
        &self,
        elem: ElemType,
        srcs: &[*const u8],
        dst: *mut u8,
        n: usize,
        op: ReduceOp,
    ) -> Result<()>;

    /// Completes this rank's queued copies and reductions, and its earlier writes to the
    /// buffers it posts. Called on entry and before every sync.
    fn fence(&self) -> Result<()>;
}

/// Host memory: plain copies and the CPU reduction, nothing queued.
pub(crate) struct HostMemory;

impl Memory for HostMemory {
    unsafe fn copy(&self, src: *const u8, dst: *mut u8, bytes: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { copy_bytes(src, dst, bytes) };
        Ok(())
    }

    unsafe fn reduce(
        &self,
        elem: ElemType,
        srcs: &[*const u8],
        dst: *mut u8,
        n: usize,
        op: ReduceOp,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { reduce_dyn(elem, srcs, dst, n, op) };
        Ok(())
    }

    fn fence(&self) -> Result<()> {
        Ok(())
    }
}

/// Copies `bytes` bytes from `src` to `dst`; large copies in halves on rayon's threads (one
/// core's memcpy reaches about half of this machine's copy bandwidth: `bench comm` and `bench
/// optim` measure both), which matters where one rank copies alone (a world of one gathering
/// a unit).
///
/// # Safety
/// `src..src + bytes` must be readable and not written by anyone during the call;
/// `dst..dst + bytes` must be writable and not accessed by anyone else during the call.
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, bytes: usize) {
    if bytes >= crate::storage::PARALLEL_BYTES {
        let half = (bytes / 2).next_multiple_of(64);
        // Addresses cross threads as integers: the halves are disjoint parts of the caller's
        // ranges, and `join` returns only after both copies.
        let (s, d) = (src as usize, dst as usize);
        rayon::join(
            // SAFETY: the first `half` bytes of both ranges (the caller's contract).
            || unsafe { copy_bytes(s as *const u8, d as *mut u8, half) },
            // SAFETY: the remaining `bytes − half` bytes of both ranges.
            || unsafe { copy_bytes((s + half) as *const u8, (d + half) as *mut u8, bytes - half) },
        );
    } else if bytes > 0 {
        // SAFETY: the caller's contract; the two ranges are disjoint because no other thread may
        // access `dst` while `src` is being read.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) };
    }
}

/// The collectives on regions of any [`Memory`]: the one implementation behind the host
/// [`Communicator`] below and the device thread ranks of `crate::cuda::threads`.
impl ThreadComm {
    /// Fences, then enters: the posted buffers hold their data before anyone reads them.
    fn enter_in(&self, mem: &dyn Memory, post: Post) -> Result<(Call<'_>, Vec<Post>)> {
        self.fence_for_peers(mem)?;
        self.enter(post)
    }

    /// Completes this rank's queued work, which other ranks' threads are about to read or
    /// have just written. A world of one rank has no other reader: its copies stay queued in
    /// order on its own stream (as an NCCL call's do), and it never waits for the device,
    /// which would stall every later launch of the step behind this call.
    fn fence_for_peers(&self, mem: &dyn Memory) -> Result<()> {
        if self.world.size == 1 {
            return Ok(());
        }
        mem.fence()
    }

    pub(crate) fn all_gather_in_place_in(&self, mem: &dyn Memory, me: Region) -> Result<()> {
        let post = Post {
            recv: me,
            ..Post::new(Op::AllGatherInPlace)
        };
        let (call, posts) = self.enter_in(mem, post)?;
        let s = me.len / self.world.size;
        let bytes = s * me.elem.size();
        let phase = posts
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != self.rank)
            // SAFETY: slice j of buf_j is only read in this phase (its owner writes the other
            // slices of its buffer), slice j of our buffer only written by us (other ranks read
            // only slice r of it); all buffers hold V·s elements (validated).
            .try_for_each(|(j, p)| unsafe { mem.copy(p.recv.at(j * s), me.at(j * s), bytes) });
        call.finish_phase(mem, phase)
    }

    pub(crate) fn all_gather_in(&self, mem: &dyn Memory, send: Region, me: Region) -> Result<()> {
        let post = Post {
            send,
            recv: me,
            ..Post::new(Op::AllGather)
        };
        let (call, posts) = self.enter_in(mem, post)?;
        let s = posts[0].send.len;
        let bytes = s * me.elem.size();
        let phase = posts
            .iter()
            .enumerate()
            // SAFETY: send buffers are shared borrows, never written; slice j of our recv
            // buffer is only ours (other ranks write their own recv); lengths validated (s and
            // V·s).
            .try_for_each(|(j, p)| unsafe { mem.copy(p.send.ptr, me.at(j * s), bytes) });
        call.finish_phase(mem, phase)
    }

    /// All-gather into segments of the full buffer (`(offset, region)` pairs, ascending and
    /// disjoint, checked by the caller): each segment receives the parts of every rank's shard
    /// that it covers, straight from that rank's input, so nothing is staged.
    pub(crate) fn all_gather_segments_in(
        &self,
        mem: &dyn Memory,
        send: Region,
        segments: &[(usize, Region)],
    ) -> Result<()> {
        let full = send
            .len
            .checked_mul(self.world.size)
            .ok_or_else(|| self.err(Op::AllGather, "the full buffer overflows usize".into()))?;
        let post = Post {
            send,
            // Only the length: no other rank reads or writes our segments.
            recv: Region::sized(full, send.elem),
            ..Post::new(Op::AllGather)
        };
        let (call, posts) = self.enter_in(mem, post)?;
        let es = send.elem.size();
        let spans = segments.iter().map(|&(offset, seg)| (offset, seg.len));
        let phase = super::segment_pieces(spans, send.len).try_for_each(|p| {
            // SAFETY: send buffers are shared borrows, never written during the call, and
            // hold `send.len` elements (validated), of which the piece reads
            // [from, from + len); the segment is ours alone and holds its elements, of which
            // the piece writes [at, at + len).
            unsafe {
                let src = posts[p.rank].send.at(p.from);
                mem.copy(src, segments[p.segment].1.at(p.at), p.len * es)
            }
        });
        call.finish_phase(mem, phase)
    }

    /// Reduce-scatter from a `V·S` input into a separate `S`-element output.
    pub(crate) fn reduce_scatter_in(
        &self,
        mem: &dyn Memory,
        send: Region,
        recv: Region,
        op: ReduceOp,
    ) -> Result<()> {
        let post = Post {
            send,
            recv,
            reduce: Some(op),
            ..Post::new(Op::ReduceScatter)
        };
        let (call, posts) = self.enter_in(mem, post)?;
        let lo = self.rank * recv.len;
        let srcs: Vec<*const u8> = posts.iter().map(|p| p.send.at(lo).cast_const()).collect();
        // SAFETY: send buffers are shared borrows, never written during the call, each of
        // V·len elements (validated), so slice r exists in every one; the output is ours alone.
        let phase = unsafe { mem.reduce(recv.elem, &srcs, recv.ptr, recv.len, op) };
        call.finish_phase(mem, phase)
    }

    pub(crate) fn reduce_scatter_in_place_in(
        &self,
        mem: &dyn Memory,
        me: Region,
        op: ReduceOp,
    ) -> Result<()> {
        let post = Post {
            recv: me,
            reduce: Some(op),
            ..Post::new(Op::ReduceScatterInPlace)
        };
        let (call, posts) = self.enter_in(mem, post)?;
        let s = me.len / self.world.size;
        let lo = self.rank * s;
        let srcs: Vec<*const u8> = posts.iter().map(|p| p.recv.at(lo).cast_const()).collect();
        // SAFETY: slice r of every buffer is read only by this rank, and written only by this
        // rank in its own buffer (one of the sources, read chunk by chunk before the write);
        // every buffer holds V·s elements of `me.elem` (validated).
        let phase = unsafe { mem.reduce(me.elem, &srcs, me.at(lo), s, op) };
        call.finish_phase(mem, phase)
    }

    pub(crate) fn all_reduce_in(&self, mem: &dyn Memory, me: Region, op: ReduceOp) -> Result<()> {
        let post = Post {
            recv: me,
            reduce: Some(op),
            ..Post::new(Op::AllReduce)
        };
        let (mut call, posts) = self.enter_in(mem, post)?;
        let (v, r) = (self.world.size, self.rank);
        let (lo, hi) = part(me.len, v, r);
        let srcs: Vec<*const u8> = posts.iter().map(|p| p.recv.at(lo).cast_const()).collect();
        // SAFETY: phase 1 reads and writes only range r of every buffer, and only this rank
        // touches range r (as in reduce-scatter); equal lengths validated.
        let phase = unsafe { mem.reduce(me.elem, &srcs, me.at(lo), hi - lo, op) };
        // After a failed phase 1 (on any rank) phase 2 would copy ranges never reduced: skip it.
        let phase = call.end_phase(mem, phase).and_then(|()| {
            posts
                .iter()
                .enumerate()
                .filter(|&(k, _)| k != r)
                .try_for_each(|(k, p)| {
                    let (lo, hi) = part(me.len, v, k);
                    // SAFETY: phase 2 reads only range k of buf_k, which rank k does not write (it
                    // writes its ranges ≠ k), and writes range k ≠ r of our buffer, which nobody
                    // else reads.
                    unsafe { mem.copy(p.recv.at(lo), me.at(lo), (hi - lo) * me.elem.size()) }
                })
        });
        call.finish_phase(mem, phase)
    }

    pub(crate) fn all_to_all_v_in(
        &self,
        mem: &dyn Memory,
        send: Region,
        send_counts: &[usize],
        me: Region,
        recv_counts: &[usize],
    ) -> Result<()> {
        let post = Post {
            send,
            recv: me,
            send_counts: send_counts.to_vec(),
            recv_counts: recv_counts.to_vec(),
            ..Post::new(Op::AllToAllV)
        };
        let (call, posts) = self.enter_in(mem, post)?;
        let r = self.rank;
        let phase = posts.iter().enumerate().try_for_each(|(j, p)| {
            let src = p.send.at(offset(&p.send_counts, r));
            let dst = me.at(offset(recv_counts, j));
            // SAFETY: send buffers are shared borrows, never written; segment j of our recv
            // buffer is only ours; counts validated against every buffer length and against
            // each other (send_counts_j[r] == recv_counts_r[j]).
            unsafe { mem.copy(src, dst, p.send_counts[r] * me.elem.size()) }
        });
        call.finish_phase(mem, phase)
    }

    pub(crate) fn broadcast_in(&self, mem: &dyn Memory, me: Region, root: usize) -> Result<()> {
        let post = Post {
            recv: me,
            root,
            ..Post::new(Op::Broadcast)
        };
        let (call, posts) = self.enter_in(mem, post)?;
        let phase = if self.rank != root {
            // SAFETY: the root only waits in this collective, so its buffer is not written;
            // ours is only ours; equal lengths validated.
            unsafe { mem.copy(posts[root].recv.ptr, me.ptr, me.len * me.elem.size()) }
        } else {
            Ok(())
        };
        call.finish_phase(mem, phase)
    }

    pub(crate) fn barrier_in(&self, mem: &dyn Memory) -> Result<()> {
        let (call, _) = self.enter_in(mem, Post::new(Op::Barrier))?;
        call.finish()
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world.size
    }

    fn all_gather_in_place(&self, buf: BufMut<'_>) -> Result<()> {
        self.all_gather_in_place_in(&HostMemory, Region::of_mut(buf)?)
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.all_gather_in(&HostMemory, Region::of(&send)?, Region::of_mut(recv)?)
    }

    fn reduce_scatter_in_place(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.reduce_scatter_in_place_in(&HostMemory, Region::of_mut(buf)?, op)
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.all_reduce_in(&HostMemory, Region::of_mut(buf)?, op)
    }

    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let (send, recv) = (Region::of(&send)?, Region::of_mut(recv)?);
        self.all_to_all_v_in(&HostMemory, send, send_counts, recv, recv_counts)
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.broadcast_in(&HostMemory, Region::of_mut(buf)?, root)
    }

    fn barrier(&self) -> Result<()> {
        self.barrier_in(&HostMemory)
    }

    fn peer_wait_seconds(&self) -> Option<f64> {
        Some(self.peer_wait_ns.load(Ordering::Relaxed) as f64 * 1e-9)
    }

    fn split(&self, color: usize) -> Result<Box<dyn Communicator + '_>> {
        Ok(Box::new(self.split_world(color)?))
    }

    fn all_gather_segments(&self, send: Buf<'_>, segments: &mut [Segment<'_>]) -> Result<usize> {
        check_segments(segments, send.elem_type(), send.len() * self.world.size)?;
        let regions: Vec<(usize, Region)> = segments
            .iter_mut()
            .map(|s| Ok((s.offset, Region::of_mut(s.buf.reborrow())?)))
            .collect::<Result<_>>()?;
        self.all_gather_segments_in(&HostMemory, Region::of(&send)?, &regions)?;
        Ok(0)
    }

    fn reduce_scatter(&self, send: BufMut<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<usize> {
        let (send, recv) = (Region::of_mut(send)?, Region::of_mut(recv)?);
        self.reduce_scatter_in(&HostMemory, send, recv, op)?;
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory whose reductions fail, as a device kernel or copy can (out of memory, a launch
    /// error); its copies are the host's.
    struct FailingReduce;

    impl Memory for FailingReduce {
        unsafe fn copy(&self, src: *const u8, dst: *mut u8, bytes: usize) -> Result<()> {
            // SAFETY: forwarded contract.
            unsafe { HostMemory.copy(src, dst, bytes) }
        }
        unsafe fn reduce(
            &self,
            _: ElemType,
            _: &[*const u8],
            _: *mut u8,
            _: usize,
            _: ReduceOp,
        ) -> Result<()> {
            Err(Error::Msg("injected reduction failure".into()))
        }
        fn fence(&self) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_data_phase_that_fails_on_one_rank_fails_the_collective_on_every_rank() {
        // Rank 1's reduction fails. Before, the others returned Ok: all-reduce with rank 1's
        // range never reduced, reduce-scatter with an outcome that differed between ranks.
        for all_reduce in [true, false] {
            let outcomes = ThreadWorld::run(3, |c| {
                let mut x = [1.0f32; 12];
                let mem: &dyn Memory = if c.rank() == 1 {
                    &FailingReduce
                } else {
                    &HostMemory
                };
                let region = Region::of_mut((&mut x[..]).into())?;
                let outcome = if all_reduce {
                    c.all_reduce_in(mem, region, ReduceOp::Sum)
                } else {
                    c.reduce_scatter_in_place_in(mem, region, ReduceOp::Sum)
                };
                // The world stays usable.
                let mut y = vec![1.0f32; 3];
                c.all_reduce((&mut y[..]).into(), ReduceOp::Sum)?;
                assert_eq!(y, [3.0; 3]);
                Ok(outcome.map_err(|e| e.to_string()))
            })
            .unwrap();
            for (rank, o) in outcomes.iter().enumerate() {
                let e = o.as_ref().expect_err("every rank fails");
                let named = if rank == 1 {
                    "injected"
                } else {
                    "rank 1 failed"
                };
                assert!(
                    e.contains(named),
                    "all_reduce {all_reduce}, rank {rank}: {e}"
                );
            }
        }
    }

    #[test]
    fn parts_tile_the_buffer_longer_ones_first() {
        for len in [0, 1, 5, 7, 64, 1001] {
            for v in 1..=9 {
                let mut next = 0;
                for k in 0..v {
                    let (lo, hi) = part(len, v, k);
                    assert_eq!(lo, next);
                    assert!(hi - lo == len / v || hi - lo == len / v + 1);
                    if k > 0 {
                        assert!(hi - lo <= part(len, v, k - 1).1 - part(len, v, k - 1).0);
                    }
                    next = hi;
                }
                assert_eq!(next, len);
            }
        }
    }
}
