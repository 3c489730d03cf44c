//! Sharing a small secret between the processes of a multi-process world before any
//! communicator exists: NCCL's 128-byte unique id, made by rank 0 and needed by every rank
//! (`crate::cuda::nccl`). Two ways, chosen by the environment ([`Rendezvous::from_env`]):
//!
//! | variable | way |
//! |---|---|
//! | `RAGGED_RENDEZVOUS_ADDR=host:port` | TCP: rank 0 listens there and hands the blob to each of the other `V − 1` ranks as it connects; the others retry until rank 0 is up. For nodes without a shared file system. |
//! | `RAGGED_NCCL_ID_FILE=path` | a file every rank can read: rank 0 writes it under a temporary name and renames it (readers never see half a file); the others poll for it. |
//! | `RAGGED_NCCL_TIMEOUT_S` | how long anyone waits (default 120 s, also where it is `0`, which turns off only the collectives' wait) |
//!
//! On the wire: the 4 bytes `RGID`, the blob's length as a little-endian `u32`, the blob. A
//! reader checks both, so a wrong port or a file that is not a rendezvous file is an error
//! that says so, never a garbage id. Every wait here has the timeout: a missing rank is an
//! `Err`, never a hang. A file left by an earlier run, though, is a valid file: a rank that
//! reads it before rank 0 replaces it joins the old id and waits in NCCL's init, which has no
//! timeout. Give each launch its own path, or delete the file before starting.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// How long a rank waits by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

const MAGIC: &[u8; 4] = b"RGID";

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
    /// receives it. All ranks return the same bytes, or `Err` within `timeout`.
    pub fn share<const N: usize>(
        &self,
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
        let deadline = crate::limits::deadline(Instant::now(), timeout);
        if rank == 0 {
            let blob = make()?;
            match self {
                Rendezvous::Tcp(addr) => serve(addr, world - 1, &blob, deadline)?,
                Rendezvous::File(path) => write_file(path, &blob)?,
            }
            Ok(blob)
        } else {
            let bytes = match self {
                Rendezvous::Tcp(addr) => fetch(addr, N, deadline)?,
                Rendezvous::File(path) => poll_file(path, deadline)?,
            };
            decode(&bytes, self)
        }
    }
}

const OP: &str = "Rendezvous::share";

/// `RAGGED_NCCL_TIMEOUT_S`, the one reading of the variable (the rendezvous and every NCCL
/// collective): seconds, fractions allowed, default [`DEFAULT_TIMEOUT`]; `Ok(None)` for `0`
/// (turns the collectives' wait off). `Err` for a value that is not a finite, non-negative
/// number of seconds that a `Duration` can hold.
pub fn env_timeout() -> Result<Option<Duration>> {
    parse_timeout(std::env::var("RAGGED_NCCL_TIMEOUT_S").ok().as_deref())
}

/// [`env_timeout`] of the variable's value (`None`: unset).
pub fn parse_timeout(value: Option<&str>) -> Result<Option<Duration>> {
    let Some(v) = value else {
        return Ok(Some(DEFAULT_TIMEOUT));
    };
    let bad = |reason: &str| Error::BadInput {
        op: "RAGGED_NCCL_TIMEOUT_S",
        what: v.to_string(),
        reason: reason.into(),
    };
    let secs: f64 = v
        .trim()
        .parse()
        .map_err(|_| bad("not a number of seconds"))?;
    if !secs.is_finite() || secs < 0.0 {
        return Err(bad("must be a finite, non-negative number of seconds"));
    }
    if secs == 0.0 {
        return Ok(None);
    }
    Duration::try_from_secs_f64(secs)
        .map(Some)
        .map_err(|_| bad("more seconds than a Duration holds"))
}

fn encode(blob: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&(blob.len() as u32).to_le_bytes());
    out.extend_from_slice(blob);
    out
}

fn decode<const N: usize>(bytes: &[u8], from: &Rendezvous) -> Result<[u8; N]> {
    let bad = |reason: String| Error::Comm {
        op: OP,
        rank: usize::MAX,
        reason: format!("{from:?}: {reason}"),
    };
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        return Err(bad("not a ragged rendezvous message".into()));
    }
    let len = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes")) as usize;
    if len != N || bytes.len() != 8 + N {
        return Err(bad(format!("a {len}-byte blob, expected {N}")));
    }
    Ok(bytes[8..].try_into().expect("N bytes"))
}

fn timed_out(what: String) -> Error {
    Error::Comm {
        op: OP,
        rank: usize::MAX,
        reason: what,
    }
}

/// Rank 0 over TCP: accept `peers` connections and write the message to each.
fn serve(addr: &str, peers: usize, blob: &[u8], deadline: Instant) -> Result<()> {
    let listener = TcpListener::bind(addr).map_err(|e| Error::Comm {
        op: OP,
        rank: 0,
        reason: format!("cannot listen on {addr}: {e}"),
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io(OP, addr, e))?;
    let msg = encode(blob);
    let mut served = 0;
    while served < peers {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream
                    .set_nonblocking(false)
                    .and_then(|()| stream.set_write_timeout(Some(Duration::from_secs(10))))
                    .and_then(|()| stream.write_all(&msg))
                    .map_err(|e| Error::io(OP, addr, e))?;
                served += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(timed_out(format!(
                        "rank 0 on {addr}: {served} of {peers} ranks connected before the timeout"
                    )));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(Error::io(OP, addr, e)),
        }
    }
    Ok(())
}

/// A rank > 0 over TCP: connect (retrying until rank 0 listens) and read the message.
fn fetch(addr: &str, n: usize, deadline: Instant) -> Result<Vec<u8>> {
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
            let mut msg = vec![0u8; 8 + n];
            stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .and_then(|()| stream.read_exact(&mut msg))
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

fn write_file(path: &Path, blob: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, encode(blob)).map_err(|e| Error::io(OP, &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(OP, path, e))
}

fn poll_file(path: &Path, deadline: Instant) -> Result<Vec<u8>> {
    loop {
        if let Ok(bytes) = std::fs::read(path) {
            return Ok(bytes);
        }
        if Instant::now() >= deadline {
            return Err(timed_out(format!(
                "no rendezvous file {} before the timeout (is rank 0 running?)",
                path.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeout_variable_is_seconds_zero_turns_the_wait_off_and_nonsense_is_refused() {
        assert_eq!(parse_timeout(None).unwrap(), Some(DEFAULT_TIMEOUT));
        assert_eq!(
            parse_timeout(Some(" 2.5 ")).unwrap(),
            Some(Duration::from_millis(2500))
        );
        assert_eq!(parse_timeout(Some("0")).unwrap(), None);
        for bad in ["-1", "inf", "NaN", "soon", "1e20"] {
            assert!(parse_timeout(Some(bad)).is_err(), "{bad}");
        }
        // The largest a Duration holds waits "for ever" without overflowing a deadline.
        let far = parse_timeout(Some("1e19")).unwrap().unwrap();
        assert!(crate::limits::deadline(Instant::now(), far) > Instant::now());
    }

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
                    s.spawn(move || via.share(r, world, Duration::from_secs(20), || Ok(blob(3))))
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
        std::fs::write(dir.join("short"), encode(&[1u8; 16])).unwrap();
        let err = Rendezvous::File(dir.join("short"))
            .share(1, 2, short, || none(()))
            .unwrap_err();
        assert!(err.to_string().contains("16-byte blob"), "{err}");
        // A rank outside the world.
        assert!(file.share(2, 2, short, || Ok(blob(0))).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
