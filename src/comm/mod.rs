//! Collectives between ranks: one object-safe [`Communicator`] trait, one file per backend.
//!
//! | backend | file | ranks are |
//! |---|---|---|
//! | threads (default; tests, examples) | [`threads`] | threads of one process, shared memory |
//! | one rank (unsharded references) | [`single`] | the process itself |
//! | MPI (feature `mpi`) | `mpi` | processes under `mpirun`; bitwise the thread backend's results |
//!
//! [`rendezvous`] shares a small secret (NCCL's unique id) between processes before any
//! communicator exists: over TCP or through a file.
//!
//! # In-place semantics (as NCCL's "in-place operations")
//! A group buffer of `V·S` elements is split into `V` equal slices; rank `r` owns
//! `[r·S, (r+1)·S)`.
//! - [`Communicator::all_gather_in_place`]: on entry each rank's own slice holds its data; on
//!   return every slice holds its owner's data. No copy-in, no copy-out.
//! - [`Communicator::reduce_scatter_in_place`]: on entry every rank holds a full buffer of
//!   partial values; on return the rank's own slice holds the reduction over ranks (other slices
//!   are left unspecified).
//!
//! Reductions run in a fixed order (rank 0, 1, …, V−1, accumulated left to right), so results
//! are deterministic and identical on every rank. Average divides the sum by `V` at the end.

pub mod conformance;
#[cfg(any(feature = "mpi", feature = "cuda"))]
pub(crate) mod descriptor;
#[cfg(feature = "mpi")]
pub mod mpi;
pub(crate) mod protocol;
pub mod rendezvous;
pub mod single;
pub mod threads;

pub use single::SingleRank;

use half::bf16;

use crate::Result;

/// How values from different ranks combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the world size.
    Avg,
}

/// Element types the collectives move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElemType {
    F32,
    BF16,
    U8,
}

impl ElemType {
    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            ElemType::F32 => 4,
            ElemType::BF16 => 2,
            ElemType::U8 => 1,
        }
    }
}

/// A read-only buffer of one of the supported element types, in host memory or (feature
/// `cuda`) device memory. Backends take the storage they support and return a
/// clear `Err` for the other ([`host_only`]).
#[derive(Debug)]
pub enum Buf<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    U8(&'a [u8]),
    /// Device memory (NCCL and GPU thread ranks move it; see [`crate::cuda::collective`]).
    #[cfg(feature = "cuda")]
    Device(crate::cuda::collective::DevBuf<'a>),
}

/// A writable buffer of one of the supported element types (host or device, as [`Buf`]).
#[derive(Debug)]
pub enum BufMut<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    U8(&'a mut [u8]),
    /// Device memory.
    #[cfg(feature = "cuda")]
    Device(crate::cuda::collective::DevBufMut<'a>),
}

/// The error of a backend that moves host memory only, given device memory.
pub fn host_only(op: &'static str) -> crate::Error {
    crate::Error::BadInput {
        op,
        what: "a device buffer".into(),
        reason: "this communicator moves host memory; device memory goes through NCCL \
                 (cuda::nccl::NcclComm) or GPU thread ranks (cuda::threads::ThreadDeviceComm)"
            .into(),
    }
}

/// The error of a collective given host and device buffers at once (every backend takes one
/// kind per call).
pub fn mixed_memory(op: &'static str) -> crate::Error {
    crate::Error::BadInput {
        op,
        what: "host and device buffers in one collective".into(),
        reason: "pass every buffer of a call in host memory or every one in device memory".into(),
    }
}

impl Buf<'_> {
    pub fn len(&self) -> usize {
        match self {
            Buf::F32(b) => b.len(),
            Buf::BF16(b) => b.len(),
            Buf::U8(b) => b.len(),
            #[cfg(feature = "cuda")]
            Buf::Device(b) => b.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn elem_type(&self) -> ElemType {
        match self {
            Buf::F32(_) => ElemType::F32,
            Buf::BF16(_) => ElemType::BF16,
            Buf::U8(_) => ElemType::U8,
            #[cfg(feature = "cuda")]
            Buf::Device(b) => b.elem_type(),
        }
    }
    /// Whether the elements live in device memory.
    pub fn is_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        if let Buf::Device(_) = self {
            return true;
        }
        false
    }
}

impl BufMut<'_> {
    /// The same buffer, borrowed for a shorter time.
    pub fn reborrow(&mut self) -> BufMut<'_> {
        match self {
            BufMut::F32(b) => BufMut::F32(b),
            BufMut::BF16(b) => BufMut::BF16(b),
            BufMut::U8(b) => BufMut::U8(b),
            #[cfg(feature = "cuda")]
            BufMut::Device(b) => BufMut::Device(b.reborrow()),
        }
    }
    /// The same buffer, read-only.
    pub fn as_buf(&self) -> Buf<'_> {
        match self {
            BufMut::F32(b) => Buf::F32(b),
            BufMut::BF16(b) => Buf::BF16(b),
            BufMut::U8(b) => Buf::U8(b),
            #[cfg(feature = "cuda")]
            BufMut::Device(b) => Buf::Device(b.as_dev_buf()),
        }
    }
    pub fn len(&self) -> usize {
        match self {
            BufMut::F32(b) => b.len(),
            BufMut::BF16(b) => b.len(),
            BufMut::U8(b) => b.len(),
            #[cfg(feature = "cuda")]
            BufMut::Device(b) => b.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn elem_type(&self) -> ElemType {
        match self {
            BufMut::F32(_) => ElemType::F32,
            BufMut::BF16(_) => ElemType::BF16,
            BufMut::U8(_) => ElemType::U8,
            #[cfg(feature = "cuda")]
            BufMut::Device(b) => b.elem_type(),
        }
    }
    /// Whether the elements live in device memory.
    pub fn is_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        if let BufMut::Device(_) = self {
            return true;
        }
        false
    }
}

impl<'a> From<&'a [f32]> for Buf<'a> {
    fn from(b: &'a [f32]) -> Self {
        Buf::F32(b)
    }
}
impl<'a> From<&'a [bf16]> for Buf<'a> {
    fn from(b: &'a [bf16]) -> Self {
        Buf::BF16(b)
    }
}
impl<'a> From<&'a [u8]> for Buf<'a> {
    fn from(b: &'a [u8]) -> Self {
        Buf::U8(b)
    }
}
impl<'a> From<&'a mut [f32]> for BufMut<'a> {
    fn from(b: &'a mut [f32]) -> Self {
        BufMut::F32(b)
    }
}
impl<'a> From<&'a mut [bf16]> for BufMut<'a> {
    fn from(b: &'a mut [bf16]) -> Self {
        BufMut::BF16(b)
    }
}
impl<'a> From<&'a mut [u8]> for BufMut<'a> {
    fn from(b: &'a mut [u8]) -> Self {
        BufMut::U8(b)
    }
}
/// A host or device `f32` view as a collective's buffer.
impl<'a> From<crate::storage::View<'a, f32>> for Buf<'a> {
    fn from(v: crate::storage::View<'a, f32>) -> Self {
        match v {
            crate::storage::View::Cpu(v) => Buf::F32(v),
            #[cfg(feature = "cuda")]
            crate::storage::View::Cuda(v) => v.into(),
        }
    }
}
/// A writable host or device view as a collective's buffer.
macro_rules! buf_mut_from_view {
    ($t:ty, $variant:ident) => {
        impl<'a> From<crate::storage::ViewMut<'a, $t>> for BufMut<'a> {
            fn from(v: crate::storage::ViewMut<'a, $t>) -> Self {
                match v {
                    crate::storage::ViewMut::Cpu(v) => BufMut::$variant(v),
                    #[cfg(feature = "cuda")]
                    crate::storage::ViewMut::Cuda(v) => v.into(),
                }
            }
        }
    };
}
buf_mut_from_view!(f32, F32);
buf_mut_from_view!(u8, U8);

/// One tensor's storage inside a full buffer that is not one allocation: elements
/// `offset..offset + buf.len()` of the `V·S`-element full buffer live in `buf`. The parts of the
/// full buffer no segment covers (padding) are never materialized.
#[derive(Debug)]
pub struct Segment<'a> {
    pub offset: usize,
    pub buf: BufMut<'a>,
}

/// One piece of an all-gather into segments: the part of segment `segment` that lies in rank
/// `rank`'s range of the full buffer, `len` elements from element `at` of the segment, which
/// are elements `from..from + len` of that rank's input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentPiece {
    pub segment: usize,
    pub rank: usize,
    pub at: usize,
    pub from: usize,
    pub len: usize,
}

/// The pieces of segments (`(offset, len)` in the full buffer, ascending and disjoint, as
/// [`check_segments`] checks) when rank `j` holds elements `j·s..(j+1)·s`: in ascending order
/// of the full buffer, none empty, each segment tiled by its pieces. Every backend's
/// [`Communicator::all_gather_segments`] moves these, whatever it moves them with (copies
/// from the peers' memory, MPI or NCCL messages); two ranks that agree on the layout list
/// the same pieces, so the pieces a rank sends a peer come in the order the peer receives them.
pub fn segment_pieces(
    segments: impl IntoIterator<Item = (usize, usize)>,
    s: usize,
) -> impl Iterator<Item = SegmentPiece> {
    let segments = segments.into_iter().enumerate();
    segments.flat_map(move |(segment, (offset, len))| {
        let end = offset + len;
        // The ranks whose ranges the segment covers (none when the ranges are empty).
        let ranks = match (s, len) {
            (0, _) | (_, 0) => 0..0,
            (s, _) => offset / s..end.div_ceil(s),
        };
        ranks.map(move |rank| {
            let (lo, hi) = (offset.max(rank * s), end.min((rank + 1) * s));
            SegmentPiece {
                segment,
                rank,
                at: lo - offset,
                from: lo - rank * s,
                len: hi - lo,
            }
        })
    })
}

/// Checks that `segments` are of `elem`, ascending, disjoint and inside a buffer of `full`
/// elements.
pub fn check_segments(segments: &[Segment<'_>], elem: ElemType, full: usize) -> Result<()> {
    let mut end = 0usize;
    for (i, s) in segments.iter().enumerate() {
        let bad = |reason: String| crate::Error::InvalidShard {
            op: "all_gather_segments",
            reason: format!("segment {i}: {reason}"),
        };
        if s.buf.elem_type() != elem {
            return Err(bad(format!("{:?} for a {elem:?} input", s.buf.elem_type())));
        }
        if s.offset < end {
            return Err(bad(format!(
                "starts at {} inside the previous one",
                s.offset
            )));
        }
        end = s
            .offset
            .checked_add(s.buf.len())
            .filter(|&e| e <= full)
            .ok_or_else(|| bad(format!("ends past the full buffer of {full} elements")))?;
    }
    Ok(())
}

/// Collectives of one rank. Every rank of a world must call the same collectives in the same
/// order with matching sizes; a mismatch is an `Err` on every rank. What a rank that fails,
/// leaves or stalls does to the others depends on the backend (README, "Failure guarantees"):
/// thread ranks get an `Err` (at once, or after the world's timeout for a stalled rank); under
/// MPI a failing rank ends the job, at once, or for a rank that stalls once the others' wait
/// (`RAGGED_MPI_TIMEOUT_S`) runs out.
pub trait Communicator: Send + Sync {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks `V`.
    fn world_size(&self) -> usize;
    /// In-place all-gather over a buffer of `V·S` elements (see the module doc).
    fn all_gather_in_place(&self, buf: BufMut<'_>) -> Result<()>;
    /// All-gather from a separate `S`-element input into a `V·S`-element output.
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()>;
    /// In-place reduce-scatter over a buffer of `V·S` elements; the result is the own slice.
    fn reduce_scatter_in_place(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// All-reduce of the whole buffer.
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// All-to-all with uneven counts: `send` holds `send_counts[j]` elements for rank `j`, in
    /// rank order; `recv` receives `recv_counts[j]` elements from rank `j`, in rank order.
    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()>;
    /// Copies `root`'s buffer to every rank.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()>;
    /// Waits for every rank.
    fn barrier(&self) -> Result<()>;

    /// Seconds this rank has spent, since it was created, at its collectives' rendezvous
    /// waiting for the other ranks to arrive: load imbalance ahead of a collective, not its
    /// transfer. `None` where the backend cannot tell (it is thread ranks' alone).
    fn peer_wait_seconds(&self) -> Option<f64> {
        None
    }

    /// All-gather from an `S`-element input straight into the segments of a `V·S` full buffer
    /// held in separate storages (one per tensor; see [`Segment`]). Returns the bytes the backend
    /// staged through a contiguous buffer of its own (copies outside the wire, for the caller to
    /// count): 0 for backends that write the segments directly (threads, one rank, MPI, NCCL
    /// on device memory). This default stages: it gathers into a contiguous buffer and copies
    /// the segments out. Pass the same segment offsets and lengths on every rank (the
    /// runtime's gathers do: the plan is agreed): MPI and NCCL send only the covered pieces of
    /// each shard ([`segment_pieces`]), so another layout on some rank is an `Err` on every
    /// rank (over NCCL unless its check is off: then a wait until its timeout's `Err`, or
    /// wrong data).
    fn all_gather_segments(&self, send: Buf<'_>, segments: &mut [Segment<'_>]) -> Result<usize> {
        staged_all_gather(self, send, segments)
    }

    /// Reduce-scatter from a `V·S`-element input into a separate `S`-element output (the input
    /// may be clobbered). Returns the bytes staged (as [`Communicator::all_gather_segments`]):
    /// this default reduces in place and copies the own slice out.
    fn reduce_scatter(&self, send: BufMut<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<usize> {
        staged_reduce_scatter(self, send, recv, op)
    }

    /// Splits the world into groups, as `MPI_Comm_split`: a collective (every rank calls it),
    /// after which the ranks that passed the same `color` form one new world of their own,
    /// ranked in their order here. The new communicator's collectives involve its group only,
    /// with this backend's protocol. HSDP ([`crate::fsdp::FsdpOptions::replicas`])
    /// splits the world into shard groups and replica groups this way. Thread ranks (host and
    /// GPU), MPI (`MPI_Comm_split`), NCCL (`ncclCommSplit`) and one rank implement it; this
    /// default refuses.
    fn split(&self, color: usize) -> Result<Box<dyn Communicator + '_>> {
        let _ = color;
        Err(crate::Error::BadInput {
            op: "Communicator::split",
            what: format!("a world of {} ranks", self.world_size()),
            reason: "this communicator cannot form groups (every backend of ragged's can: a \
                     communicator of another crate implements `split` to)"
                .into(),
        })
    }
}

/// The rank groups a split by `colors` (one per rank, in rank order) makes: for this rank
/// (`rank`), the ranks of its group in rank order, and its index among them.
pub(crate) fn group_of(colors: &[u64], rank: usize) -> (Vec<usize>, usize) {
    let members: Vec<usize> = (0..colors.len())
        .filter(|&j| colors[j] == colors[rank])
        .collect();
    let index = members
        .iter()
        .position(|&j| j == rank)
        .expect("a rank is in its own group");
    (members, index)
}

/// A communicator a wrapper runs on: the one it was made over, or a group split from that one
/// and owned (what a wrapper's own [`Communicator::split`] wraps). Derefs to the communicator.
pub enum HeldComm<'a> {
    Borrowed(&'a dyn Communicator),
    Group(Box<dyn Communicator + 'a>),
}

impl<'a> std::ops::Deref for HeldComm<'a> {
    type Target = dyn Communicator + 'a;

    fn deref(&self) -> &Self::Target {
        match self {
            HeldComm::Borrowed(c) => *c,
            HeldComm::Group(c) => &**c,
        }
    }
}

/// Rank `j` of a group whose members are `group` (ranks of the world it was split from at
/// the top; `None`: that world itself) as a rank of that world: how groups' errors name ranks.
pub(crate) fn top_rank(group: Option<&[usize]>, j: usize) -> usize {
    group.map_or(j, |ranks| ranks[j])
}

/// What a group's error adds to its reason, whose ranks are numbered within the group: which
/// group it speaks of (nothing for the top world).
pub(crate) fn in_group(group: Option<&[usize]>) -> String {
    match group {
        Some(ranks) => format!(" (in the group of ranks {ranks:?}, numbered from 0 there)"),
        None => String::new(),
    }
}

/// Every rank's `color` (one all-gather of eight bytes a rank).
pub(crate) fn all_colors(comm: &dyn Communicator, color: usize) -> Result<Vec<u64>> {
    let mut all = vec![0u8; 8 * comm.world_size()];
    let own = (color as u64).to_le_bytes();
    comm.all_gather(Buf::U8(&own), BufMut::U8(&mut all))?;
    Ok(all
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunks")))
        .collect())
}

/// Every rank's `bytes`, whatever their lengths, in rank order: two all-gathers (the lengths,
/// then the bytes padded to the longest). For small records (checkpoint manifests, errors).
pub fn all_gather_bytes(comm: &dyn Communicator, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let world = comm.world_size();
    let mut lens = vec![0u8; 8 * world];
    let own = (bytes.len() as u64).to_le_bytes();
    comm.all_gather(Buf::U8(&own), BufMut::U8(&mut lens))?;
    let lens: Vec<usize> = lens
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunks")) as usize)
        .collect();
    let longest = lens.iter().copied().max().unwrap_or(0);
    if longest == 0 {
        return Ok(vec![Vec::new(); world]);
    }
    let mut send = bytes.to_vec();
    send.resize(longest, 0);
    let mut recv = vec![0u8; longest * world];
    comm.all_gather(Buf::U8(&send), BufMut::U8(&mut recv))?;
    Ok(recv
        .chunks_exact(longest)
        .zip(lens)
        .map(|(c, n)| c[..n].to_vec())
        .collect())
}

/// [`Communicator::all_gather_segments`] through a contiguous staging buffer (host memory),
/// after checking the segments.
pub(crate) fn staged_all_gather<C: Communicator + ?Sized>(
    comm: &C,
    send: Buf<'_>,
    segments: &mut [Segment<'_>],
) -> Result<usize> {
    fn scatter<T: Copy>(full: &[T], seg: &mut [T], offset: usize) {
        seg.copy_from_slice(&full[offset..offset + seg.len()]);
    }
    let full = send.len() * comm.world_size();
    check_segments(segments, send.elem_type(), full)?;
    #[cfg(feature = "cuda")]
    if segments.iter().any(|s| matches!(s.buf, BufMut::Device(_))) {
        return Err(mixed_memory("all_gather_segments (staged)"));
    }
    let mut copied = 0;
    match send {
        Buf::F32(s) => {
            let mut buf = vec![0f32; full];
            comm.all_gather(Buf::F32(s), BufMut::F32(&mut buf))?;
            for seg in segments.iter_mut() {
                if let BufMut::F32(d) = &mut seg.buf {
                    scatter(&buf, d, seg.offset);
                    copied += 4 * d.len();
                }
            }
        }
        Buf::BF16(s) => {
            let mut buf = vec![bf16::ZERO; full];
            comm.all_gather(Buf::BF16(s), BufMut::BF16(&mut buf))?;
            for seg in segments.iter_mut() {
                if let BufMut::BF16(d) = &mut seg.buf {
                    scatter(&buf, d, seg.offset);
                    copied += 2 * d.len();
                }
            }
        }
        Buf::U8(s) => {
            let mut buf = vec![0u8; full];
            comm.all_gather(Buf::U8(s), BufMut::U8(&mut buf))?;
            for seg in segments.iter_mut() {
                if let BufMut::U8(d) = &mut seg.buf {
                    scatter(&buf, d, seg.offset);
                    copied += d.len();
                }
            }
        }
        #[cfg(feature = "cuda")]
        Buf::Device(_) => return Err(host_only("all_gather_segments (staged)")),
    }
    Ok(copied)
}

/// [`Communicator::reduce_scatter`] as an in-place reduce-scatter plus a copy of the own slice.
pub(crate) fn staged_reduce_scatter<C: Communicator + ?Sized>(
    comm: &C,
    send: BufMut<'_>,
    recv: BufMut<'_>,
    op: ReduceOp,
) -> Result<usize> {
    fn own<T: Copy>(full: &[T], recv: &mut [T], rank: usize) -> usize {
        let s = recv.len();
        recv.copy_from_slice(&full[rank * s..(rank + 1) * s]);
        std::mem::size_of_val(recv)
    }
    let (v, r) = (comm.world_size(), comm.rank());
    if Some(send.len()) != recv.len().checked_mul(v) || send.elem_type() != recv.elem_type() {
        return Err(crate::Error::InvalidShard {
            op: "reduce_scatter",
            reason: format!(
                "{} {:?} elements in, {} {:?} out, on a world of {v}",
                send.len(),
                send.elem_type(),
                recv.len(),
                recv.elem_type()
            ),
        });
    }
    Ok(match (send, recv) {
        (BufMut::F32(s), BufMut::F32(d)) => {
            comm.reduce_scatter_in_place(BufMut::F32(&mut *s), op)?;
            own(s, d, r)
        }
        (BufMut::BF16(s), BufMut::BF16(d)) => {
            comm.reduce_scatter_in_place(BufMut::BF16(&mut *s), op)?;
            own(s, d, r)
        }
        (BufMut::U8(s), BufMut::U8(d)) => {
            comm.reduce_scatter_in_place(BufMut::U8(&mut *s), op)?;
            own(s, d, r)
        }
        #[cfg(feature = "cuda")]
        (BufMut::Device(_), BufMut::Device(_)) => return Err(host_only("reduce_scatter (staged)")),
        _ => return Err(mixed_memory("reduce_scatter (staged)")),
    })
}

#[cfg(test)]
mod tests {
    use super::{segment_pieces, SegmentPiece};

    /// Ranges of 4 elements: a segment inside rank 0's, one across three ranks' ranges, an
    /// empty one (no piece), one ending on a boundary; empty ranges give no piece at all.
    #[test]
    fn segment_pieces_tile_each_segment_by_the_ranges_it_crosses() {
        let piece = |segment, rank, at, from, len| SegmentPiece {
            segment,
            rank,
            at,
            from,
            len,
        };
        let segments = [(1, 2), (3, 6), (9, 0), (10, 2)];
        let pieces: Vec<SegmentPiece> = segment_pieces(segments, 4).collect();
        let want = [
            piece(0, 0, 0, 1, 2),
            piece(1, 0, 0, 3, 1),
            piece(1, 1, 1, 0, 4),
            piece(1, 2, 5, 0, 1),
            piece(3, 2, 0, 2, 2),
        ];
        assert_eq!(pieces, want);
        assert_eq!(segment_pieces([(0, 0)], 0).count(), 0);
    }
}
