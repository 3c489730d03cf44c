//! Sharing a small secret between the processes of a multi-process world before any
//! communicator exists: NCCL's 128-byte unique id, made by rank 0 and needed by every rank
//! (`crate::cuda::nccl`). Two ways, chosen by the environment ([`Rendezvous::from_env`]):
//!
//! | variable | way |
//! |---|---|
//! | `RAGGED_RENDEZVOUS_ADDR=host:port` | TCP: rank 0 listens there and hands the blob to each of the other `V − 1` ranks as it connects and says which rank it is (a connection that does not, such as a port probe, is closed uncounted); the others retry until rank 0 is up. For nodes without a shared file system. |
//! | `RAGGED_NCCL_ID_FILE=path` | a file every rank can read: rank 0 writes it under a temporary name and renames it (readers never see half a file); the others poll for it. |
//! | `RAGGED_NCCL_TIMEOUT_S` | how long anyone waits (default 120 s, also where it is `0`, which turns off only the collectives' wait) |
//! | `RAGGED_RUN_ID` | this launch's identity ([`run_id_from_env`]; else Slurm's `SLURM_JOB_ID.SLURM_STEP_ID`, else torchrun's `TORCHELASTIC_RUN_ID`) |
//!
//! On the wire: the 4 bytes `RGID`, the blob's length as a little-endian `u32`, the blob, the
//! run id's length as a little-endian `u32` (at most [`MAX_RUN_ID`]), the run id. A reader
//! checks all of it, so a wrong port or a file that is not a rendezvous file is an error that
//! says so, never a garbage id. Every wait here has the timeout: a missing rank is an `Err`,
//! never a hang.
//!
//! The run id tells this launch's message from another's. A file left by an earlier launch is
//! a valid file, and a rank that read it before rank 0 replaced it would join the old NCCL id
//! and wait in NCCL's init until the join's limit (`NcclComm::from_rank_within`), then fail.
//! With a run id, a reader skips a file of
//! another run and keeps polling (and says so if the timeout comes first); over TCP, a
//! message from another launch's rank 0 (a port another job holds) is an error at once.
//! Without one (no variable set), any well-formed file is taken, as before: give each launch
//! its own path, or delete the file before starting.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// How long a rank waits by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

const MAGIC: &[u8; 4] = b"RGID";

/// The longest run id a message may carry, in bytes.
pub const MAX_RUN_ID: usize = 256;

/// This launch's identity for the rendezvous: `RAGGED_RUN_ID`, else Slurm's
/// `SLURM_JOB_ID.SLURM_STEP_ID` (a job step's; `srun` sets both on every rank), else torchrun's
/// `TORCHELASTIC_RUN_ID`, else empty (none: messages are not told apart). Every rank of a
/// launch must see the same value; `Err` for one longer than [`MAX_RUN_ID`] bytes.
pub fn run_id_from_env() -> Result<String> {
    run_id_with(|k| std::env::var(k).ok())
}

/// [`run_id_from_env`] over the variables `var` gives.
fn run_id_with(var: impl Fn(&str) -> Option<String>) -> Result<String> {
    let var = |k: &str| var(k).filter(|v| !v.is_empty());
    let id = var("RAGGED_RUN_ID")
        .or_else(|| {
            Some(format!(
                "{}.{}",
                var("SLURM_JOB_ID")?,
                var("SLURM_STEP_ID")?
            ))
        })
        .or_else(|| var("TORCHELASTIC_RUN_ID"))
        .unwrap_or_default();
    check_run_id(&id)?;
    Ok(id)
}

fn check_run_id(id: &str) -> Result<()> {
    crate::limits::at_most(
        "Rendezvous",
        "run id bytes",
        id.len(),
        MAX_RUN_ID,
        "it travels with the id in a small message",
    )
    .map(drop)
}

/// Where the ranks meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rendezvous {
    /// `host:port` rank 0 listens on and the others connect to.
    Tcp(String),
    /// A file on a file system every rank sees.
    File(PathBuf),
}

impl Rendezvous {
    /// `RAGGED_RENDEZVOUS_ADDR` (TCP) if set, else `RAGGED_NCCL_ID_FILE`; `Err` if neither.
    pub fn from_env() -> Result<Self> {
        if let Ok(addr) = std::env::var("RAGGED_RENDEZVOUS_ADDR") {
            return Ok(Rendezvous::Tcp(addr));
        }
        if let Ok(path) = std::env::var("RAGGED_NCCL_ID_FILE") {
            return Ok(Rendezvous::File(path.into()));
        }
        Err(Error::BadInput {
            op: "Rendezvous::from_env",
            what: "RAGGED_RENDEZVOUS_ADDR / RAGGED_NCCL_ID_FILE".into(),
            reason: "neither is set: give rank 0's host:port, or a file every rank can read".into(),
        })
    }

    /// How long the rendezvous waits: `RAGGED_NCCL_TIMEOUT_S` ([`env_timeout`]); where that
    /// is unset or `0` (the collectives' wait off), [`DEFAULT_TIMEOUT`], since a rendezvous
    /// without a limit would hang on a rank that never starts.
    pub fn timeout_from_env() -> Result<Duration> {
        Ok(env_timeout()?.unwrap_or(DEFAULT_TIMEOUT))
    }

    /// Rank 0 makes the blob (`make`) and hands it out; every other rank of the `world`
    /// receives it. All ranks return the same bytes, or `Err` within `timeout`. The launch is
    /// told apart from others by [`run_id_from_env`] ([`Rendezvous::share_in_run`]).
    pub fn share<const N: usize>(
        &self,
        rank: usize,
        world: usize,
        timeout: Duration,
        make: impl FnOnce() -> Result<[u8; N]>,
    ) -> Result<[u8; N]> {
        self.share_in_run(&run_id_from_env()?, rank, world, timeout, make)
    }

    /// [`Rendezvous::share`] for the launch `run` (empty: none): rank 0's message carries it,
    /// and the other ranks take only a message of the same run (module doc).
    pub fn share_in_run<const N: usize>(
        &self,
        run: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
        make: impl FnOnce() -> Result<[u8; N]>,
    ) -> Result<[u8; N]> {
        if rank >= world {
            return Err(Error::BadInput {
                op: OP,
                what: format!("rank {rank} of {world}"),
                reason: "needs rank < world".into(),
            });
        }
        check_run_id(run)?;
        let deadline = crate::limits::deadline(Instant::now(), timeout);
        if rank == 0 {
            let blob = make()?;
            let msg = encode(&blob, run);
            match self {
                Rendezvous::Tcp(addr) => serve(addr, world, &msg, deadline)?,
                Rendezvous::File(path) => write_file(path, &msg)?,
            }
            Ok(blob)
        } else {
            match self {
                Rendezvous::Tcp(addr) => {
                    let msg = fetch(addr, rank, N, deadline)?;
                    of_run(decode(&msg, self)?, run, self)
                }
                Rendezvous::File(path) => poll_file(path, run, deadline, self),
            }
        }
    }
}

const OP: &str = "Rendezvous::share";

/// `RAGGED_NCCL_TIMEOUT_S`, the one reading of the variable (the rendezvous and every NCCL
/// collective): [`crate::limits::env_timeout`] with default [`DEFAULT_TIMEOUT`]; `Ok(None)` for
/// `0` (turns the collectives' wait off).
pub fn env_timeout() -> Result<Option<Duration>> {
    crate::limits::env_timeout("RAGGED_NCCL_TIMEOUT_S", DEFAULT_TIMEOUT)
}

fn encode(blob: &[u8], run: &str) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&(blob.len() as u32).to_le_bytes());
    out.extend_from_slice(blob);
    out.extend_from_slice(&(run.len() as u32).to_le_bytes());
    out.extend_from_slice(run.as_bytes());
    out
}

/// A decoded message: the blob and the run id it carries.
struct Message<const N: usize> {
    blob: [u8; N],
    run: String,
}

fn decode<const N: usize>(bytes: &[u8], from: &Rendezvous) -> Result<Message<N>> {
    let bad = |reason: String| Error::Comm {
        op: OP,
        rank: usize::MAX,
        reason: format!("{from:?}: {reason}"),
    };
    let word = |at: usize| {
        let b: [u8; 4] = bytes[at..at + 4].try_into().expect("4 bytes");
        u32::from_le_bytes(b) as usize
    };
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        return Err(bad("not a ragged rendezvous message".into()));
    }
    let len = word(4);
    if len != N {
        return Err(bad(format!("a {len}-byte blob, expected {N}")));
    }
    if bytes.len() < 12 + N {
        return Err(bad(
            "a message without a run id (from an older ragged?)".into()
        ));
    }
    let run_len = word(8 + N);
    let run = &bytes[12 + N..];
    if run_len > MAX_RUN_ID || run.len() != run_len {
        return Err(bad(format!(
            "a run id of {} bytes where the header says {run_len}",
            run.len()
        )));
    }
    Ok(Message {
        blob: bytes[8..8 + N].try_into().expect("N bytes"),
        run: String::from_utf8_lossy(run).into_owned(),
    })
}

/// The blob of `msg` when it belongs to `run` (or `run` is empty: none to compare).
fn of_run<const N: usize>(msg: Message<N>, run: &str, from: &Rendezvous) -> Result<[u8; N]> {
    if of_this_run(&msg.run, run) {
        return Ok(msg.blob);
    }
    Err(Error::Comm {
        op: OP,
        rank: usize::MAX,
        reason: format!("{from:?}: {}", other_run(&msg.run, run)),
    })
}

/// Whether a message of run `found` is this launch's (`run`; empty: none to compare).
fn of_this_run(found: &str, run: &str) -> bool {
    run.is_empty() || found == run
}

fn other_run(found: &str, run: &str) -> String {
    format!(
        "a message of run {found:?}, this launch is run {run:?} (another launch's rank 0, or \
         a file an earlier launch left: delete it or give each launch its own path)"
    )
}

fn timed_out(what: String) -> Error {
    Error::Comm {
        op: OP,
        rank: usize::MAX,
        reason: what,
    }
}

/// What a rank > 0 sends rank 0 over TCP before it reads: these 4 bytes and its rank (a
/// little-endian `u64`), so that a connection that is not a rank's (a port probe, a health
/// check) takes no rank's place.
const HELLO: &[u8; 4] = b"RGHI";

fn hello(rank: usize) -> Vec<u8> {
    [HELLO.as_slice(), &(rank as u64).to_le_bytes()].concat()
}

/// Rank 0 over TCP: answer connections until every other rank of `world` has had the message.
fn serve(addr: &str, world: usize, msg: &[u8], deadline: Instant) -> Result<()> {
    let listener = TcpListener::bind(addr).map_err(|e| Error::Comm {
        op: OP,
        rank: 0,
        reason: format!("cannot listen on {addr}: {e}"),
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io(OP, addr, e))?;
    // Ranks, not connections: a rank that connects twice counts once.
    let mut served = std::collections::HashSet::new();
    while served.len() < world - 1 {
        // Checked on every pass: connections that keep coming, none a rank's, must not hold
        // rank 0 past its deadline.
        if Instant::now() >= deadline {
            return Err(timed_out(format!(
                "rank 0 on {addr}: {} of {} ranks connected before the timeout",
                served.len(),
                world - 1
            )));
        }
        match listener.accept() {
            Ok((stream, _)) => {
                served.extend(answer(stream, world, msg));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(Error::io(OP, addr, e)),
        }
    }
    Ok(())
}

/// The rank a connection's peer says it is ([`hello`]), once the message went to it; `None`
/// for a connection that is not a rank's of `world` (no hello within a second, another
/// greeting, a rank outside the world), which is closed uncounted.
fn answer(mut stream: TcpStream, world: usize, msg: &[u8]) -> Option<usize> {
    let mut greeting = [0u8; 12];
    stream.set_nonblocking(false).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    stream
        .set_write_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    stream.read_exact(&mut greeting).ok()?;
    let rank = u64::from_le_bytes(greeting[4..].try_into().ok()?);
    let rank = usize::try_from(rank).ok()?;
    if &greeting[..4] != HELLO || !(1..world).contains(&rank) {
        return None;
    }
    stream.write_all(msg).ok()?;
    Some(rank)
}

/// Rank `rank` > 0 over TCP: connect (retrying until rank 0 listens), say which rank it is
/// ([`hello`]) and read the message.
fn fetch(addr: &str, rank: usize, n: usize, deadline: Instant) -> Result<Vec<u8>> {
    let targets: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| Error::io(OP, addr, e))?
        .collect();
    loop {
        for target in &targets {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(mut stream) = TcpStream::connect_timeout(
                target,
                left.min(Duration::from_secs(1))
                    .max(Duration::from_millis(1)),
            ) else {
                continue;
            };
            // Rank 0 writes one message and closes: read to the end, at most the longest one.
            let mut msg = Vec::new();
            stream
                .write_all(&hello(rank))
                .and_then(|()| stream.set_read_timeout(Some(left.max(Duration::from_millis(1)))))
                .and_then(|()| {
                    let most = (12 + n + MAX_RUN_ID) as u64;
                    (&mut stream).take(most).read_to_end(&mut msg)
                })
                .map_err(|e| Error::io(OP, addr, e))?;
            return Ok(msg);
        }
        if Instant::now() >= deadline {
            return Err(timed_out(format!(
                "no rendezvous at {addr} before the timeout (is rank 0 running?)"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn write_file(path: &Path, msg: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, msg).map_err(|e| Error::io(OP, &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(OP, path, e))
}

/// A rank > 0 through a file: poll until a message of `run` is there. A well-formed message
/// of another run is a file an earlier launch left, which rank 0 will replace: skipped, and
/// named in the error if the timeout comes first.
fn poll_file<const N: usize>(
    path: &Path,
    run: &str,
    deadline: Instant,
    from: &Rendezvous,
) -> Result<[u8; N]> {
    let mut stale = None;
    loop {
        if let Ok(bytes) = std::fs::read(path) {
            let msg = decode::<N>(&bytes, from)?;
            if of_this_run(&msg.run, run) {
                return Ok(msg.blob);
            }
            stale = Some(msg.run);
        }
        if Instant::now() >= deadline {
            let why = match &stale {
                Some(found) => other_run(found, run),
                None => "is rank 0 running?".into(),
            };
            return Err(timed_out(format!(
                "no rendezvous file {} of this launch before the timeout ({why})",
                path.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(seed: u8) -> [u8; 128] {
        std::array::from_fn(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn world_shares(via: &Rendezvous, world: usize) -> Vec<Result<[u8; 128]>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|r| {
                    s.spawn(move || {
                        via.share_in_run("job-1", r, world, Duration::from_secs(20), || Ok(blob(3)))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_rank_gets_rank_0s_blob_over_tcp_and_through_a_file() {
        let dir = std::env::temp_dir().join(format!("ragged-rdv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for via in [
            Rendezvous::Tcp(format!("127.0.0.1:{}", free_port())),
            Rendezvous::File(dir.join("id")),
        ] {
            for r in world_shares(&via, 4) {
                assert_eq!(r.unwrap(), blob(3), "{via:?}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_rank_0_or_peer_is_an_error_within_the_timeout_and_garbage_is_refused() {
        let short = Duration::from_millis(300);
        let none = |_: ()| -> Result<[u8; 128]> { unreachable!("only rank 0 makes the blob") };
        // Nobody listens: the client gives up.
        let tcp = Rendezvous::Tcp(format!("127.0.0.1:{}", free_port()));
        let err = tcp.share(1, 2, short, || none(())).unwrap_err();
        assert!(err.to_string().contains("is rank 0 running"), "{err}");
        // Nobody connects: rank 0 gives up and says how many came.
        let err = tcp.share(0, 3, short, || Ok(blob(1))).unwrap_err();
        assert!(err.to_string().contains("0 of 2 ranks"), "{err}");
        // No file appears.
        let dir = std::env::temp_dir().join(format!("ragged-rdv-e-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = Rendezvous::File(dir.join("missing"));
        let err = file.share(1, 2, short, || none(())).unwrap_err();
        assert!(err.to_string().contains("is rank 0 running"), "{err}");
        // A file that is not a rendezvous message, and one with another blob size.
        std::fs::write(dir.join("garbage"), b"hello").unwrap();
        let err = Rendezvous::File(dir.join("garbage"))
            .share(1, 2, short, || none(()))
            .unwrap_err();
        assert!(err.to_string().contains("not a ragged rendezvous"), "{err}");
        std::fs::write(dir.join("short"), encode(&[1u8; 16], "")).unwrap();
        let err = Rendezvous::File(dir.join("short"))
            .share(1, 2, short, || none(()))
            .unwrap_err();
        assert!(err.to_string().contains("16-byte blob"), "{err}");
        // A run id longer than any launch may have, though the header gives its true length:
        // refused even by a reader without a run id (which compares none).
        let long = "r".repeat(MAX_RUN_ID + 1);
        std::fs::write(dir.join("long"), encode(&blob(0), &long)).unwrap();
        let err = Rendezvous::File(dir.join("long"))
            .share_in_run("", 1, 2, short, || none(()))
            .unwrap_err();
        assert!(err.to_string().contains("run id of"), "{err}");
        // A rank outside the world.
        assert!(file.share(2, 2, short, || Ok(blob(0))).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Connections in rank 0's backlog before any rank (a probe speaking another protocol,
    /// one that says nothing, one claiming a rank outside the world) are answered with nothing
    /// and take no rank's place: every rank gets the blob. Before, each took a place, and the
    /// ranks left over waited out their timeout.
    #[test]
    fn a_connection_that_is_not_a_rank_takes_no_ranks_place() {
        let addr = format!("127.0.0.1:{}", free_port());
        let via = &Rendezvous::Tcp(addr.clone());
        let world = 3;
        let share = move |r: usize| {
            via.share_in_run("job-1", r, world, Duration::from_secs(20), || Ok(blob(5)))
        };
        std::thread::scope(|s| {
            let root = s.spawn(move || share(0));
            let connect = || loop {
                if let Ok(c) = TcpStream::connect(&addr) {
                    break c;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let mut probe = connect();
            probe.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
            let silent = connect();
            let mut outside = connect();
            outside.write_all(&hello(world)).unwrap();
            // Rank 0 is the one serving: a greeting that claims it is no receiving rank's.
            let mut claims_root = connect();
            claims_root.write_all(&hello(0)).unwrap();
            let peers: Vec<_> = (1..world).map(|r| s.spawn(move || share(r))).collect();
            for p in peers {
                assert_eq!(p.join().unwrap().unwrap(), blob(5));
            }
            assert_eq!(root.join().unwrap().unwrap(), blob(5));
            for mut stray in [probe, silent, outside, claims_root] {
                let mut got = Vec::new();
                stray
                    .set_read_timeout(Some(Duration::from_secs(5)))
                    .unwrap();
                let _ = stray.read_to_end(&mut got);
                assert!(got.is_empty(), "a stray connection got {} bytes", got.len());
            }
        });
    }

    /// A rank that connects twice (a retry) gets the message each time but counts once: rank 0
    /// keeps serving until every other rank had it, so the rank that comes last is not left to
    /// its timeout.
    #[test]
    fn a_rank_that_connects_twice_counts_once() {
        let via = &Rendezvous::Tcp(format!("127.0.0.1:{}", free_port()));
        let share = move |r: usize, secs: u64| {
            via.share_in_run("job-1", r, 3, Duration::from_secs(secs), || Ok(blob(6)))
        };
        std::thread::scope(|s| {
            let root = s.spawn(move || share(0, 20));
            assert_eq!(share(1, 20).unwrap(), blob(6));
            assert_eq!(share(1, 20).unwrap(), blob(6));
            assert_eq!(
                share(2, 3).unwrap(),
                blob(6),
                "the last rank was not served"
            );
            assert_eq!(root.join().unwrap().unwrap(), blob(6));
        });
    }

    #[test]
    fn the_run_id_comes_from_ragged_then_slurm_then_torchrun_and_is_bounded() {
        let run_id = |pairs: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            run_id_with(move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
        };
        let (job, step) = (("SLURM_JOB_ID", "77"), ("SLURM_STEP_ID", "3"));
        let torchrun = ("TORCHELASTIC_RUN_ID", "t");
        assert_eq!(run_id(&[]).unwrap(), "");
        let all = [("RAGGED_RUN_ID", "mine"), job, step, torchrun];
        assert_eq!(run_id(&all).unwrap(), "mine");
        assert_eq!(run_id(&[job, step, torchrun]).unwrap(), "77.3");
        // A job id without a step id is not a step's identity: torchrun's, else none.
        assert_eq!(run_id(&[job, torchrun]).unwrap(), "t");
        assert_eq!(run_id(&[job]).unwrap(), "");
        assert_eq!(run_id(&[("RAGGED_RUN_ID", ""), torchrun]).unwrap(), "t");
        let long = "x".repeat(MAX_RUN_ID + 1);
        assert!(run_id(&[("RAGGED_RUN_ID", &long)]).is_err());
        assert!(run_id(&[("RAGGED_RUN_ID", &long[1..])]).is_ok());
    }

    /// A file an earlier launch left is skipped until rank 0 replaces it, and named in the
    /// error when it never does; a launch without a run id takes any file; over TCP, another
    /// launch's message is an error at once.
    #[test]
    fn a_message_of_another_run_is_never_taken() {
        let dir = std::env::temp_dir().join(format!("ragged-rdv-s-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("id");
        let file = Rendezvous::File(path.clone());
        let short = Duration::from_millis(300);
        let none = || -> Result<[u8; 128]> { unreachable!("only rank 0 makes the blob") };
        write_file(&path, &encode(&blob(1), "old")).unwrap();
        // Alone with the old file: a timeout that names both runs.
        let err = file.share_in_run("new", 1, 2, short, none).unwrap_err();
        assert!(
            err.to_string()
                .contains("run \"old\", this launch is run \"new\""),
            "{err}"
        );
        // Rank 0 replaces it late: the reader waits for it and gets the new blob.
        let got = std::thread::scope(|s| {
            let reader = s.spawn(|| file.share_in_run("new", 1, 2, Duration::from_secs(20), none));
            std::thread::sleep(Duration::from_millis(200));
            file.share_in_run("new", 0, 2, short, || Ok(blob(2)))
                .unwrap();
            reader.join().unwrap()
        });
        assert_eq!(got.unwrap(), blob(2));
        // Without a run id, the file there is taken (the behaviour before run ids).
        write_file(&path, &encode(&blob(1), "old")).unwrap();
        assert_eq!(file.share_in_run("", 1, 2, short, none).unwrap(), blob(1));
        // TCP: a client of another run refuses rank 0's message.
        let tcp = Rendezvous::Tcp(format!("127.0.0.1:{}", free_port()));
        let (served, fetched) = std::thread::scope(|s| {
            let server =
                s.spawn(|| tcp.share_in_run("a", 0, 2, Duration::from_secs(20), || Ok(blob(4))));
            let fetched = tcp.share_in_run("b", 1, 2, Duration::from_secs(20), none);
            (server.join().unwrap(), fetched)
        });
        assert_eq!(served.unwrap(), blob(4));
        let err = fetched.unwrap_err();
        assert!(
            err.to_string()
                .contains("run \"a\", this launch is run \"b\""),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
