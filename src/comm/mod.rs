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

/// A read-only buffer of one of the supported element types.
#[derive(Debug)]
pub enum Buf<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    U8(&'a [u8]),
}

/// A writable buffer of one of the supported element types.
#[derive(Debug)]
pub enum BufMut<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    U8(&'a mut [u8]),
}

impl Buf<'_> {
    pub fn len(&self) -> usize {
        match self {
            Buf::F32(b) => b.len(),
            Buf::BF16(b) => b.len(),
            Buf::U8(b) => b.len(),
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
        }
    }
}

impl BufMut<'_> {
    pub fn len(&self) -> usize {
        match self {
            BufMut::F32(b) => b.len(),
            BufMut::BF16(b) => b.len(),
            BufMut::U8(b) => b.len(),
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
        }
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

/// Collectives of one rank. Every rank of a world must call the same collectives in the same
/// order with matching sizes; a mismatch, a rank that left, or a timeout is an `Err` on every
/// rank, never a hang.
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
}
