//! Bounded waits for NCCL collectives: NCCL queues a collective and returns; if a peer died or
//! stopped calling, the kernel spins forever and every later call on the stream waits behind
//! it. [`wait`] polls a collective's completion and NCCL's asynchronous error until a deadline,
//! so a rank returns `Err` instead of hanging; the caller then aborts the communicator
//! (`ncclCommAbort`, which stops the spinning kernel), as PyTorch's blocking wait does.
//!
//! The policy is plain logic over a [`Progress`] probe, so it is tested on machines without a
//! GPU; `super::nccl` supplies the probe (`cuStreamQuery` and `ncclCommGetAsyncError`).

use std::time::{Duration, Instant};

use crate::{Error, Result};

/// What one look at a queued collective finds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Progress {
    /// The stream has finished the collective.
    Done,
    /// Still running, no error reported.
    Pending,
    /// NCCL or the driver reported an error (a peer failed, a network error, ...).
    Failed(String),
}

/// The longest pause between two looks: short enough that a finished collective is noticed
/// within about a millisecond, long enough not to busy-spin a core.
const MAX_PAUSE: Duration = Duration::from_millis(1);

/// Polls `probe` until it reports `Done` (`Ok`), `Failed` or `timeout` passes (`Err` naming
/// `op`, this `rank` and what happened). The first look is immediate; the pause between looks
/// grows from a few microseconds to `MAX_PAUSE`, so short collectives cost little.
pub fn wait(
    op: &'static str,
    rank: usize,
    timeout: Duration,
    mut probe: impl FnMut() -> Progress,
) -> Result<()> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(2);
    loop {
        match probe() {
            Progress::Done => return Ok(()),
            Progress::Failed(why) => {
                return Err(Error::Comm {
                    op,
                    rank,
                    reason: format!("NCCL reported an error while the collective ran: {why}"),
                })
            }
            Progress::Pending => {}
        }
        if start.elapsed() >= timeout {
            return Err(Error::Comm {
                op,
                rank,
                reason: format!(
                    "the collective did not finish within {:.1} s: another rank failed or \
                     stopped calling collectives (RAGGED_NCCL_TIMEOUT_S sets the limit); the \
                     communicator is aborted",
                    timeout.as_secs_f64()
                ),
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finished_collective_returns_at_the_first_done() {
        let mut looks = 0;
        let out = wait("t", 0, Duration::from_secs(5), || {
            looks += 1;
            if looks < 4 {
                Progress::Pending
            } else {
                Progress::Done
            }
        });
        assert!(out.is_ok());
        assert_eq!(looks, 4);
    }

    #[test]
    fn a_reported_error_ends_the_wait_at_once_naming_the_rank() {
        let start = Instant::now();
        let err = wait("all_gather", 3, Duration::from_secs(60), || {
            Progress::Failed("ncclRemoteError".into())
        })
        .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(1));
        let msg = err.to_string();
        assert!(
            msg.contains("ncclRemoteError") && msg.contains('3'),
            "{msg}"
        );
    }

    #[test]
    fn a_collective_that_never_finishes_times_out_within_the_bound() {
        let start = Instant::now();
        let err = wait("reduce_scatter", 1, Duration::from_millis(50), || {
            Progress::Pending
        })
        .unwrap_err();
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(50) && took < Duration::from_millis(500));
        assert!(err.to_string().contains("did not finish"), "{err}");
    }
}
