//! What the multi-rank backends share: the descriptor each rank posts for a collective
//! ([`Post`]), the one check of a world's descriptors that every rank runs identically
//! ([`validate`]: either every rank goes on or every rank returns the same `Err`), the split of
//! a buffer into per-rank ranges, and the CPU reduction in rank order (module doc of
//! [`super::threads`], "Reductions"). Thread ranks ([`super::threads`]) post descriptors
//! through shared memory; MPI ranks (`super::mpi`) exchange them with one all-gather.

use std::fmt;

use half::bf16;

use super::{Buf, BufMut, ElemType, ReduceOp};
use crate::Result;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    AllGatherInPlace,
    AllGather,
    ReduceScatterInPlace,
    ReduceScatter,
    AllReduce,
    AllToAllV,
    Broadcast,
    Barrier,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllGatherInPlace => "all_gather_in_place",
            Op::AllGather => "all_gather",
            Op::ReduceScatterInPlace => "reduce_scatter_in_place",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllReduce => "all_reduce",
            Op::AllToAllV => "all_to_all_v",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
        }
    }

    /// Sync points of one call: rendezvous, one per extra data phase, exit.
    pub(crate) fn points(self) -> u64 {
        match self {
            Op::AllReduce => 3,
            _ => 2,
        }
    }
}

/// A buffer as posted at the rendezvous: start, length in elements, element type. The start
/// is an address in the world's [`Memory`] (host memory, or device memory for
/// `crate::cuda::threads`), never dereferenced outside it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Region {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) elem: ElemType,
}

// SAFETY: a `Region` is an address, not a borrow. It is dereferenced only in data phases, between
// a rendezvous that every rank passed (so every owner is blocked inside the same collective and
// its borrow is alive) and the exit sync (which the owner cannot pass before every reader is
// done), and only on the disjoint regions listed in the module doc.
unsafe impl Send for Region {}

impl Region {
    /// A region of `len` elements of `elem` at address `ptr` of the world's memory.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn new(ptr: *mut u8, len: usize, elem: ElemType) -> Region {
        Region { ptr, len, elem }
    }

    /// A region with only a length and an element type (for backends that exchange
    /// descriptors instead of addresses).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn sized(len: usize, elem: ElemType) -> Region {
        Region {
            ptr: std::ptr::null_mut(),
            len,
            elem,
        }
    }

    pub(crate) const EMPTY: Region = Region {
        ptr: std::ptr::null_mut(),
        len: 0,
        elem: ElemType::U8,
    };

    /// A host buffer's region (`Err` for device memory: the host protocol's memory is the
    /// host's).
    pub(crate) fn of(buf: &Buf<'_>) -> Result<Region> {
        let (ptr, len) = match buf {
            Buf::F32(b) => (b.as_ptr().cast::<u8>(), b.len()),
            Buf::BF16(b) => (b.as_ptr().cast::<u8>(), b.len()),
            Buf::U8(b) => (b.as_ptr(), b.len()),
            #[cfg(feature = "cuda")]
            Buf::Device(_) => return Err(super::host_only("host collective")),
        };
        Ok(Region {
            ptr: ptr.cast_mut(),
            len,
            elem: buf.elem_type(),
        })
    }

    /// Takes the host buffer's borrow: from here on it is only accessed through the pointer.
    pub(crate) fn of_mut(buf: BufMut<'_>) -> Result<Region> {
        let elem = buf.elem_type();
        let (ptr, len) = match buf {
            BufMut::F32(b) => (b.as_mut_ptr().cast::<u8>(), b.len()),
            BufMut::BF16(b) => (b.as_mut_ptr().cast::<u8>(), b.len()),
            BufMut::U8(b) => (b.as_mut_ptr(), b.len()),
            #[cfg(feature = "cuda")]
            BufMut::Device(_) => return Err(super::host_only("host collective")),
        };
        Ok(Region { ptr, len, elem })
    }

    /// Address of element `i`, for `i <= len` (checked by the validation before any call).
    pub(crate) fn at(&self, i: usize) -> *mut u8 {
        self.ptr.wrapping_add(i * self.elem.size())
    }
}

/// What a rank posts at the rendezvous. In-place collectives and broadcast post their buffer as
/// `recv`.
#[derive(Clone, Debug)]
pub(crate) struct Post {
    pub(crate) op: Op,
    pub(crate) send: Region,
    pub(crate) recv: Region,
    pub(crate) reduce: Option<ReduceOp>,
    pub(crate) root: usize,
    pub(crate) send_counts: Vec<usize>,
    pub(crate) recv_counts: Vec<usize>,
}

impl Post {
    pub(crate) fn new(op: Op) -> Post {
        Post {
            op,
            send: Region::EMPTY,
            recv: Region::EMPTY,
            reduce: None,
            root: 0,
            send_counts: Vec::new(),
            recv_counts: Vec::new(),
        }
    }

    /// A call on one buffer of `len` elements of `elem`, by size only (in-place collectives,
    /// broadcast: posted as `recv`), for backends that compare descriptors (MPI, NCCL).
    #[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
    pub(crate) fn on(op: Op, len: usize, elem: ElemType) -> Post {
        Post {
            recv: Region::sized(len, elem),
            ..Post::new(op)
        }
    }

    /// A call from `send` into `recv`, by size only.
    #[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
    pub(crate) fn between(op: Op, send: &Buf<'_>, recv: &Buf<'_>) -> Post {
        Post {
            send: Region::sized(send.len(), send.elem_type()),
            recv: Region::sized(recv.len(), recv.elem_type()),
            ..Post::new(op)
        }
    }

    /// This call, reducing by `op`.
    #[cfg_attr(not(any(feature = "mpi", feature = "cuda")), allow(dead_code))]
    pub(crate) fn reducing(self, op: ReduceOp) -> Post {
        Post {
            reduce: Some(op),
            ..self
        }
    }
}

/// Range `k` of `len` elements split into `v` nearly equal ranges, the longer ones first:
/// `(start, end)`.
pub(crate) fn part(len: usize, v: usize, k: usize) -> (usize, usize) {
    let (base, rem) = (len / v, len % v);
    let start = k * base + k.min(rem);
    (start, start + base + usize::from(k < rem))
}

/// The largest buffer of a call, in bytes: its send or its receive buffer (the MPI backend
/// moves a call whose buffers pass MPI's `int` counts as messages).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn widest_buffer_bytes(p: &Post) -> usize {
    [p.send, p.recv]
        .iter()
        .map(|r| r.len.saturating_mul(r.elem.size()))
        .max()
        .unwrap_or(0)
}

/// Element `i`'s running offset in `counts`: `Σ counts[..i]`.
pub(crate) fn offset(counts: &[usize], i: usize) -> usize {
    counts[..i].iter().sum()
}

/// The rendezvous check, a pure function of the posted table, so every rank reaches the same
/// verdict and message. A mismatch most often means the programs diverged (a save or export
/// called on rank 0 only meets the next collective of the others, of another element type or
/// length), which the message says after what differs.
pub(crate) fn validate(posts: &[Post]) -> std::result::Result<(), String> {
    validate_table(posts).map_err(|what| {
        format!(
            "{what} (every rank must make the same collective calls in the same order: one \
             made on some ranks only meets another call on the others)"
        )
    })
}

fn validate_table(posts: &[Post]) -> std::result::Result<(), String> {
    let v = posts.len();
    let op = posts[0].op;
    if let Some((j, p)) = posts.iter().enumerate().find(|(_, p)| p.op != op) {
        return Err(format!(
            "ranks called different collectives: rank 0 {}, rank {j} {}",
            op.name(),
            p.op.name()
        ));
    }
    match op {
        Op::Barrier => {}
        Op::AllGatherInPlace | Op::ReduceScatterInPlace => {
            agree(posts, "element type", |p| p.recv.elem)?;
            let len = agree(posts, "buffer length", |p| p.recv.len)?;
            if len % v != 0 {
                return Err(format!(
                    "buffer of {len} elements is not divisible by the world size {v}"
                ));
            }
            if op == Op::ReduceScatterInPlace {
                agree(posts, "reduce op", |p| p.reduce)?;
            }
        }
        Op::AllGather => {
            same_types(posts)?;
            let len = agree(posts, "send length", |p| p.send.len)?;
            for (j, p) in posts.iter().enumerate() {
                if Some(p.recv.len) != len.checked_mul(v) {
                    return Err(format!(
                        "rank {j}: recv has {} elements, expected {v} × {len}",
                        p.recv.len
                    ));
                }
            }
        }
        Op::ReduceScatter => {
            same_types(posts)?;
            agree(posts, "reduce op", |p| p.reduce)?;
            let len = agree(posts, "recv length", |p| p.recv.len)?;
            for (j, p) in posts.iter().enumerate() {
                if Some(p.send.len) != len.checked_mul(v) {
                    return Err(format!(
                        "rank {j}: send has {} elements, expected {v} × {len}",
                        p.send.len
                    ));
                }
            }
        }
        Op::AllReduce => {
            agree(posts, "element type", |p| p.recv.elem)?;
            agree(posts, "buffer length", |p| p.recv.len)?;
            agree(posts, "reduce op", |p| p.reduce)?;
        }
        Op::Broadcast => {
            agree(posts, "element type", |p| p.recv.elem)?;
            agree(posts, "buffer length", |p| p.recv.len)?;
            let root = agree(posts, "root", |p| p.root)?;
            if root >= v {
                return Err(format!("root {root} is not a rank of a world of {v}"));
            }
        }
        Op::AllToAllV => {
            same_types(posts)?;
            for (j, p) in posts.iter().enumerate() {
                for (what, counts, buf) in [
                    ("send", &p.send_counts, p.send),
                    ("recv", &p.recv_counts, p.recv),
                ] {
                    if counts.len() != v {
                        return Err(format!(
                            "rank {j}: {} {what} counts for a world of {v}",
                            counts.len()
                        ));
                    }
                    let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
                    if total != Some(buf.len) {
                        return Err(format!(
                            "rank {j}: {what} counts {counts:?} do not add up to its {what} \
                             buffer of {} elements",
                            buf.len
                        ));
                    }
                }
            }
            for (i, p) in posts.iter().enumerate() {
                for (j, q) in posts.iter().enumerate() {
                    if p.send_counts[j] != q.recv_counts[i] {
                        return Err(format!(
                            "rank {i} sends {} elements to rank {j}, which expects {}",
                            p.send_counts[j], q.recv_counts[i]
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// The value `f` gives on every rank, or a message naming the first rank that differs from
/// rank 0.
fn agree<T: PartialEq + fmt::Debug>(
    posts: &[Post],
    what: &str,
    f: impl Fn(&Post) -> T,
) -> std::result::Result<T, String> {
    let first = f(&posts[0]);
    for (j, p) in posts.iter().enumerate().skip(1) {
        let got = f(p);
        if got != first {
            return Err(format!(
                "ranks disagree on the {what}: rank 0 has {first:?}, rank {j} has {got:?}"
            ));
        }
    }
    Ok(first)
}

/// Send and receive buffers of one element type, the same on every rank.
fn same_types(posts: &[Post]) -> std::result::Result<(), String> {
    if let Some((j, p)) = posts
        .iter()
        .enumerate()
        .find(|(_, p)| p.send.elem != p.recv.elem)
    {
        return Err(format!(
            "rank {j}: {:?} send buffer, {:?} recv buffer",
            p.send.elem, p.recv.elem
        ));
    }
    agree(posts, "element type", |p| p.send.elem).map(|_| ())
}

/// An element type the reductions accumulate (module doc, "Reductions").
pub(crate) trait Elem: Copy {
    type Acc: Copy + Default;
    fn widen(self) -> Self::Acc;
    fn add(acc: Self::Acc, x: Self) -> Self::Acc;
    fn finish(acc: Self::Acc, op: ReduceOp, v: usize) -> Self;
}

impl Elem for f32 {
    type Acc = f32;
    fn widen(self) -> f32 {
        self
    }
    fn add(acc: f32, x: f32) -> f32 {
        acc + x
    }
    fn finish(acc: f32, op: ReduceOp, v: usize) -> f32 {
        match op {
            ReduceOp::Sum => acc,
            ReduceOp::Avg => acc / v as f32,
        }
    }
}

impl Elem for bf16 {
    type Acc = f32;
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn add(acc: f32, x: bf16) -> f32 {
        acc + x.to_f32()
    }
    fn finish(acc: f32, op: ReduceOp, v: usize) -> bf16 {
        bf16::from_f32(f32::finish(acc, op, v))
    }
}

impl Elem for u8 {
    /// Wide enough for any world size (255 · V < 2⁶⁴).
    type Acc = u64;
    fn widen(self) -> u64 {
        u64::from(self)
    }
    fn add(acc: u64, x: u8) -> u64 {
        acc + u64::from(x)
    }
    fn finish(acc: u64, op: ReduceOp, v: usize) -> u8 {
        let v = v as u64;
        let value = match op {
            ReduceOp::Sum => acc,
            ReduceOp::Avg => (acc + v / 2) / v,
        };
        value.min(255) as u8
    }
}

/// Elements reduced per pass over the sources: the accumulator stays in L1.
const CHUNK: usize = 2048;

/// Writes to `dst[..n]` the reduction of `srcs[j][..n]` over `j` in order.
///
/// # Safety
/// Every `srcs[j]` points to `n` readable `E` that nobody writes during the call, except that
/// `dst` may be one of them (the reduction reads a chunk fully before writing it); `dst` points
/// to `n` writable `E` that no other thread accesses during the call. All are aligned for `E`.
pub(crate) unsafe fn reduce<E: Elem>(srcs: &[*const u8], dst: *mut u8, n: usize, op: ReduceOp) {
    let (v, dst) = (srcs.len(), dst.cast::<E>());
    let mut acc = [E::Acc::default(); CHUNK];
    for start in (0..n).step_by(CHUNK) {
        let len = CHUNK.min(n - start);
        let acc = &mut acc[..len];
        for (j, &src) in srcs.iter().enumerate() {
            // SAFETY: in bounds and unwritten per the contract; this shared slice is dead before
            // `out` below is created, so the aliasing `dst == srcs[j]` is never live at once.
            let b = unsafe { std::slice::from_raw_parts(src.cast::<E>().add(start), len) };
            fold_into(acc, b, j);
        }
        // SAFETY: in bounds and exclusively this thread's per the contract.
        let out = unsafe { std::slice::from_raw_parts_mut(dst.add(start), len) };
        finish_into(acc, out, op, v);
    }
}

/// Folds `b`, the `k`-th source in rank order, into `acc`: what [`reduce`] and [`Fold`] do
/// to each source.
fn fold_into<E: Elem>(acc: &mut [E::Acc], b: &[E], k: usize) {
    let pairs = acc.iter_mut().zip(b);
    match k {
        0 => pairs.for_each(|(a, &x)| *a = x.widen()),
        _ => pairs.for_each(|(a, &x)| *a = E::add(*a, x)),
    }
}

/// Writes the reduction of `v` sources folded into `acc` ([`fold_into`]).
fn finish_into<E: Elem>(acc: &[E::Acc], out: &mut [E], op: ReduceOp, v: usize) {
    out.iter_mut()
        .zip(acc)
        .for_each(|(o, &a)| *o = E::finish(a, op, v));
}

/// [`reduce`] over sources that arrive a few at a time, in rank order: the same element
/// operations in the same order, so the same bits, holding one accumulator of `n` elements
/// instead of every source at once (MPI's reductions fold their peers' parts as they arrive).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) struct Fold<E: Elem> {
    acc: Vec<E::Acc>,
    folded: usize,
}

#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
impl<E: Elem> Fold<E> {
    fn new(n: usize) -> Self {
        Fold {
            acc: vec![E::Acc::default(); n],
            folded: 0,
        }
    }

    /// Starts a fold of `n` elements over (the accumulator's room is kept).
    fn restart(&mut self, n: usize) {
        self.acc.resize(n, E::Acc::default());
        self.folded = 0;
    }

    /// # Safety
    /// `src` points to `n` readable `E`, aligned, that nobody writes during the call.
    unsafe fn fold(&mut self, src: *const u8) {
        // SAFETY: per the contract.
        let b = unsafe { std::slice::from_raw_parts(src.cast::<E>(), self.acc.len()) };
        fold_into(&mut self.acc, b, self.folded);
        self.folded += 1;
    }

    /// # Safety
    /// `dst` points to `n` writable `E`, aligned, that no other thread accesses.
    unsafe fn finish(&self, dst: *mut u8, op: ReduceOp) {
        // SAFETY: per the contract.
        let out = unsafe { std::slice::from_raw_parts_mut(dst.cast::<E>(), self.acc.len()) };
        finish_into(&self.acc, out, op, self.folded);
    }
}

/// A [`Fold`] of an element type known at run time.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) enum Running {
    F32(Fold<f32>),
    BF16(Fold<bf16>),
    U8(Fold<u8>),
}

#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
impl Running {
    pub(crate) fn new(elem: ElemType, n: usize) -> Running {
        match elem {
            ElemType::F32 => Running::F32(Fold::new(n)),
            ElemType::BF16 => Running::BF16(Fold::new(n)),
            ElemType::U8 => Running::U8(Fold::new(n)),
        }
    }

    /// Starts a fold of `n` elements over, keeping the accumulator's room (MPI's reductions
    /// fold their parts a chunk at a time through one accumulator).
    pub(crate) fn restart(&mut self, n: usize) {
        match self {
            Running::F32(f) => f.restart(n),
            Running::BF16(f) => f.restart(n),
            Running::U8(f) => f.restart(n),
        }
    }

    /// Folds in the next source in rank order.
    ///
    /// # Safety
    /// As [`Fold::fold`], for this fold's element type and length.
    pub(crate) unsafe fn fold(&mut self, src: *const u8) {
        // SAFETY: forwarded contract.
        unsafe {
            match self {
                Running::F32(f) => f.fold(src),
                Running::BF16(f) => f.fold(src),
                Running::U8(f) => f.fold(src),
            }
        }
    }

    /// Writes the reduction of the sources folded so far.
    ///
    /// # Safety
    /// As [`Fold::finish`], for this fold's element type and length.
    pub(crate) unsafe fn finish(&self, dst: *mut u8, op: ReduceOp) {
        // SAFETY: forwarded contract.
        unsafe {
            match self {
                Running::F32(f) => f.finish(dst, op),
                Running::BF16(f) => f.finish(dst, op),
                Running::U8(f) => f.finish(dst, op),
            }
        }
    }
}

/// [`reduce`] for an element type known at run time.
///
/// # Safety
/// As [`reduce`], for the element type `elem`.
pub(crate) unsafe fn reduce_dyn(
    elem: ElemType,
    srcs: &[*const u8],
    dst: *mut u8,
    n: usize,
    op: ReduceOp,
) {
    // SAFETY: forwarded contract.
    unsafe {
        match elem {
            ElemType::F32 => reduce::<f32>(srcs, dst, n, op),
            ElemType::BF16 => reduce::<bf16>(srcs, dst, n, op),
            ElemType::U8 => reduce::<u8>(srcs, dst, n, op),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fold of the sources one at a time is bitwise the reduction of all at once, for every
    /// element type and operation (sums that round differently in another order, bf16 ties,
    /// u8 averages that round), so MPI's folded reduce-scatter keeps the thread backend's bits.
    #[test]
    fn a_running_fold_is_bitwise_the_reduction_of_all_sources() {
        let (v, n) = (5, 300);
        let f = |j: usize, i: usize| ((i * 7919 + j * 104729) % 1000) as f32 * 1.37e-3 - 0.6;
        let f32s: Vec<Vec<f32>> = (0..v).map(|j| (0..n).map(|i| f(j, i)).collect()).collect();
        let bf16s: Vec<Vec<bf16>> = f32s
            .iter()
            .map(|x| x.iter().map(|&y| bf16::from_f32(y)).collect())
            .collect();
        let u8s: Vec<Vec<u8>> = (0..v)
            .map(|j| (0..n).map(|i| ((i * 31 + j * 17) % 256) as u8).collect())
            .collect();
        fn bytes<T>(x: &[T]) -> &[u8] {
            // SAFETY: plain old data read as bytes.
            unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
        }
        let cases: [(ElemType, Vec<&[u8]>); 3] = [
            (ElemType::F32, f32s.iter().map(|x| bytes(x)).collect()),
            (ElemType::BF16, bf16s.iter().map(|x| bytes(x)).collect()),
            (ElemType::U8, u8s.iter().map(|x| bytes(x)).collect()),
        ];
        for (elem, srcs) in cases {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let (mut all, mut folded) = (vec![0u64; n], vec![0u64; n]);
                let ptrs: Vec<*const u8> = srcs.iter().map(|s| s.as_ptr()).collect();
                let mut running = Running::new(elem, n);
                // SAFETY: `n` elements of `elem` in each source and in each `u64` output.
                unsafe {
                    reduce_dyn(elem, &ptrs, all.as_mut_ptr().cast(), n, op);
                    ptrs.iter().for_each(|&p| running.fold(p));
                    running.finish(folded.as_mut_ptr().cast(), op);
                }
                assert_eq!(all, folded, "{elem:?} {op:?}");
                // Restarted over two chunks (as MPI folds), the same bits: a longer first chunk
                // leaves no stale element behind in the shorter second.
                let (mut chunked, es, cut) = (vec![0u64; n], elem.size(), n / 2 + 7);
                let out: *mut u8 = chunked.as_mut_ptr().cast();
                for (start, len) in [(0, cut), (cut, n - cut)] {
                    running.restart(len);
                    // SAFETY: `len` elements from `start` in every source and in the output.
                    unsafe {
                        ptrs.iter().for_each(|&p| running.fold(p.add(start * es)));
                        running.finish(out.add(start * es), op);
                    }
                }
                assert_eq!(all, chunked, "{elem:?} {op:?} in two chunks");
            }
        }
    }
}
