//! The world of one rank: every collective is the identity (or a local copy). Unsharded
//! reference runs use it, so they go through exactly the code path of sharded runs.

use super::{check_segments, Buf, BufMut, Communicator, ReduceOp, Segment};
use crate::{Error, Result};

/// A one-rank world.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

fn copy(send: Buf<'_>, recv: BufMut<'_>, op: &'static str) -> Result<()> {
    let mismatch = |got: usize, want: usize| Error::InvalidShard {
        op,
        reason: format!("buffers of {got} and {want} elements on a one-rank world"),
    };
    match (send, recv) {
        (Buf::F32(s), BufMut::F32(r)) if s.len() == r.len() => r.copy_from_slice(s),
        (Buf::BF16(s), BufMut::BF16(r)) if s.len() == r.len() => r.copy_from_slice(s),
        (Buf::U8(s), BufMut::U8(r)) if s.len() == r.len() => r.copy_from_slice(s),
        (s, r) if s.is_device() || r.is_device() => return Err(super::host_only(op)),
        (s, r) if s.elem_type() != r.elem_type() => {
            return Err(Error::InvalidShard {
                op,
                reason: format!("{:?} input, {:?} output", s.elem_type(), r.elem_type()),
            })
        }
        (s, r) => return Err(mismatch(s.len(), r.len())),
    }
    Ok(())
}

fn check_counts(counts: &[usize], len: usize, op: &'static str) -> Result<()> {
    if counts.len() != 1 || counts[0] != len {
        return Err(Error::InvalidShard {
            op,
            reason: format!("counts {counts:?} for a buffer of {len} on a one-rank world"),
        });
    }
    Ok(())
}

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_gather_in_place(&self, _buf: BufMut<'_>) -> Result<()> {
        Ok(())
    }
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        copy(send, recv, "all_gather")
    }
    fn reduce_scatter_in_place(&self, _buf: BufMut<'_>, _op: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn all_reduce(&self, _buf: BufMut<'_>, _op: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn split(&self, _color: usize) -> Result<Box<dyn Communicator + '_>> {
        Ok(Box::new(SingleRank))
    }
    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        check_counts(send_counts, send.len(), "all_to_all_v")?;
        check_counts(recv_counts, recv.len(), "all_to_all_v")?;
        copy(send, recv, "all_to_all_v")
    }
    fn broadcast(&self, _buf: BufMut<'_>, root: usize) -> Result<()> {
        if root != 0 {
            return Err(Error::WorldSizeMismatch {
                op: "broadcast",
                expected: 1,
                got: root + 1,
            });
        }
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    /// One rank's all-gather moves its shard into the segments: that is the collective's data
    /// movement (on more ranks the same bytes cross the wire), not a staging copy.
    fn all_gather_segments(&self, send: Buf<'_>, segments: &mut [Segment<'_>]) -> Result<usize> {
        check_segments(segments, send.elem_type(), send.len())?;
        for seg in segments.iter_mut() {
            let (lo, n) = (seg.offset, seg.buf.len());
            let part = match &send {
                Buf::F32(s) => Buf::F32(&s[lo..lo + n]),
                Buf::BF16(s) => Buf::BF16(&s[lo..lo + n]),
                Buf::U8(s) => Buf::U8(&s[lo..lo + n]),
                #[cfg(feature = "cuda")]
                Buf::Device(_) => return Err(super::host_only("all_gather_segments")),
            };
            copy(part, seg.buf.reborrow(), "all_gather_segments")?;
        }
        Ok(0)
    }
    /// The reduction over one rank is the identity (average divides by 1, exactly).
    fn reduce_scatter(&self, send: BufMut<'_>, recv: BufMut<'_>, _op: ReduceOp) -> Result<usize> {
        let send = match send {
            BufMut::F32(s) => Buf::F32(s),
            BufMut::BF16(s) => Buf::BF16(s),
            BufMut::U8(s) => Buf::U8(s),
            #[cfg(feature = "cuda")]
            BufMut::Device(_) => return Err(super::host_only("reduce_scatter")),
        };
        copy(send, recv, "reduce_scatter")?;
        Ok(0)
    }
}
