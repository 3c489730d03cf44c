//! Roots for whole-matrix work on sharded state: which rank assembles each matrix that the
//! layout splits, and the routes of the two all-to-alls that carry it there and back.
//!
//! Muon's Newton–Schulz needs a whole matrix. A matrix held by one rank is worked on in
//! place. A matrix whose elements lie on several ranks (a row-split layout, or FSDP2's even
//! `Shard(0)`) gets a **root**: one rank that receives every piece, runs the matrix math, and
//! sends each holder its rows back (veScale-FSDP, Algorithm 2).
//!
//! # Root choice: longest processing time first
//! Each matrix has a cost from the caller (Muon: the multiply-adds of its Newton–Schulz method,
//! [`crate::newton_schulz::ns_macs`], plus its elements; Megatron-FSDP's owner planning). Matrices
//! held by one rank are charged to it first; then the split matrices, by descending cost (ties
//! in parameter order), each go to the least-loaded rank *among those holding part of it*
//! (ties to the lower rank), so a root never receives a matrix it holds none of.
//!
//! Every rank computes the same assignment from the plan's metadata ([`ParamMeta::holdings`]);
//! no metadata crosses ranks.
//!
//! # Routes
//! One batched `all_to_all_v` gathers every split matrix to its root; a second one, with the
//! counts mirrored, scatters the results back ([`Routes`], derived once per step). The host
//! exchanges carry the caller's wire type ([`Exchange::run_host`]): Muon sends bf16 when its
//! Newton–Schulz runs in bf16.

use std::ops::Range;

use half::bf16;
use ragged::comm::{Buf, BufMut, Communicator};
use ragged::optim::{LocalShard, ParamMeta};
use ragged::ragged::{redistribute, RaggedShard};
use ragged::{Error, Result};

/// One trailing matrix of a parameter that takes part in the whole-matrix math.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatrixJob {
    /// Index into [`LocalShard::params`].
    pub param: usize,
    /// The matrix's elements within the flattened parameter.
    pub elems: Range<usize>,
    pub rows: usize,
    pub cols: usize,
    /// The rank that runs the math on it.
    pub root: usize,
    /// Whether more than one rank holds part of it (so it travels to the root and back).
    pub split: bool,
    /// The caller's cost of the matrix's math ([`RootPlan::new`]).
    pub cost: u64,
}

/// Roots of every matrix of a group, identical on every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootPlan {
    pub world: usize,
    /// In parameter order, then matrix order.
    pub jobs: Vec<MatrixJob>,
    /// Summed cost per rank.
    pub load: Vec<u64>,
}

/// A contiguous run of one matrix that travels between this rank and `peer`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Segment {
    peer: usize,
    /// The matrix's index among those rooted here (for runs of matrices rooted here).
    slot: usize,
    /// Where the run sits inside the matrix.
    in_matrix: Range<usize>,
    /// Where it sits in this rank's local shard (for runs this rank holds).
    local: usize,
}

impl RootPlan {
    /// Roots for the matrices `matrix_of` names: `Some((rows, cols))` for a parameter whose
    /// trailing `rows × cols` matrices need whole-matrix math, `None` for the others; each
    /// weighs `cost_of(rows, cols)` in the balance. Both must give every rank the same answer.
    pub fn new(
        shard: &LocalShard,
        matrix_of: &dyn Fn(&ParamMeta) -> Option<(usize, usize)>,
        cost_of: &dyn Fn(usize, usize) -> u64,
    ) -> Self {
        let mut jobs = Vec::new();
        for (i, meta) in shard.params.iter().enumerate() {
            let Some((rows, cols)) = matrix_of(meta) else {
                continue;
            };
            let mn = rows * cols;
            if mn == 0 {
                continue;
            }
            let cost = cost_of(rows, cols);
            for k in 0..meta.numel() / mn {
                let elems = k * mn..(k + 1) * mn;
                let mut holders = meta.holders_of(elems.clone());
                let first = holders.next().map_or(0, |h| h.rank);
                let split = holders.next().is_some();
                jobs.push(MatrixJob {
                    param: i,
                    elems,
                    rows,
                    cols,
                    root: first,
                    split,
                    cost,
                });
            }
        }
        let mut load = vec![0u64; shard.world];
        for job in jobs.iter().filter(|j| !j.split) {
            load[job.root] += job.cost;
        }
        let mut order: Vec<usize> = (0..jobs.len()).filter(|&k| jobs[k].split).collect();
        order.sort_by_key(|&k| std::cmp::Reverse(jobs[k].cost)); // stable: ties keep plan order
        for k in order {
            let meta = &shard.params[jobs[k].param];
            let root = meta
                .holders_of(jobs[k].elems.clone())
                .map(|h| h.rank)
                .min_by_key(|&r| (load[r], r))
                .expect("a split matrix has holders");
            load[root] += jobs[k].cost;
            jobs[k].root = root;
        }
        RootPlan {
            world: shard.world,
            jobs,
            load,
        }
    }

    /// Whether any matrix travels (then every rank must join the all-to-alls).
    pub fn has_split(&self) -> bool {
        self.jobs.iter().any(|j| j.split)
    }

    /// Elements that travel to roots in one direction (the scatter back moves as many):
    /// every split matrix minus the part its root already holds.
    pub fn moved_elems(&self, shard: &LocalShard) -> usize {
        self.jobs.iter().map(|j| self.moved(shard, j)).sum()
    }

    /// The elements of `job` that travel to its root (0 unless it is split).
    pub fn moved(&self, shard: &LocalShard, job: &MatrixJob) -> usize {
        if !job.split {
            return 0;
        }
        let on_root: usize = shard.params[job.param]
            .holders_of(job.elems.clone())
            .filter(|h| h.rank == job.root)
            .map(|h| h.range.len())
            .sum();
        job.elems.len() - on_root
    }

    /// Split matrices rooted at this rank, in job order.
    pub fn rooted_here<'a>(&'a self, rank: usize) -> impl Iterator<Item = usize> + 'a {
        (0..self.jobs.len()).filter(move |&k| self.jobs[k].split && self.jobs[k].root == rank)
    }

    /// This rank's side of the two all-to-alls (see [`Routes`]): each split matrix's moves
    /// are [`redistribute`]'s transfers from its layout over the holders to the whole matrix on
    /// its root, the one redistribution path (checkpoints reshard through it too).
    pub fn routes(&self, shard: &LocalShard) -> Result<Routes> {
        let me = shard.rank;
        let mine: Vec<usize> = self.rooted_here(me).collect();
        let slot = |k: usize| mine.binary_search(&k).expect("rooted here");
        let (mut outgoing, mut incoming, mut own) = (Vec::new(), Vec::new(), Vec::new());
        for (k, job) in self.jobs.iter().enumerate().filter(|(_, j)| j.split) {
            let (held, rooted) = self.layouts(shard, job)?;
            for t in redistribute(&held, &rooted)? {
                // The root holds the whole matrix, so the destination offset is the position
                // in the matrix.
                let in_matrix = t.dst_offset..t.dst_offset + t.len;
                let local = || local_offset(shard, job.param, job.elems.start + t.dst_offset);
                match (t.src_rank == me, t.dst_rank == me) {
                    (true, false) => outgoing.push(Segment {
                        peer: t.dst_rank,
                        slot: 0,
                        in_matrix,
                        local: local()?,
                    }),
                    (false, true) => incoming.push(Segment {
                        peer: t.src_rank,
                        slot: slot(k),
                        in_matrix,
                        local: 0,
                    }),
                    (true, true) => own.push(Segment {
                        peer: me,
                        slot: slot(k),
                        in_matrix,
                        local: local()?,
                    }),
                    (false, false) => {}
                }
            }
        }
        outgoing.sort_by_key(|s| s.peer); // stable: job order within a peer
        incoming.sort_by_key(|s| s.peer);
        let counts = |segs: &[Segment]| {
            let mut c = vec![0; self.world];
            for s in segs {
                c[s.peer] += s.in_matrix.len();
            }
            c
        };
        Ok(Routes {
            to_roots: counts(&outgoing),
            from_holders: counts(&incoming),
            sizes: mine.iter().map(|&k| self.jobs[k].elems.len()).collect(),
            outgoing,
            incoming,
            own,
        })
    }

    /// `job`'s matrix as a [`RaggedShard`] over its holders (the plan's holdings: ascending,
    /// one contiguous range per rank) and as the whole matrix on its root.
    fn layouts(&self, shard: &LocalShard, job: &MatrixJob) -> Result<(RaggedShard, RaggedShard)> {
        let shape = [job.elems.len()];
        let mut units = vec![0; self.world];
        let (mut next, mut after) = (job.elems.start, 0);
        for h in shard.params[job.param].holders_of(job.elems.clone()) {
            if h.range.start != next || h.rank < after || h.rank >= self.world {
                return Err(Error::InvalidShard {
                    op: "RootPlan::routes",
                    reason: format!(
                        "{}: rank {} holds elements {:?}, not the next range in rank order",
                        shard.params[job.param].name, h.rank, h.range
                    ),
                });
            }
            units[h.rank] = h.range.len();
            (next, after) = (h.range.end, h.rank + 1);
        }
        Ok((
            RaggedShard::new(&shape, 1, units)?,
            RaggedShard::one_hot(&shape, self.world, job.root)?,
        ))
    }
}

/// One rank's side of the gather to roots and the scatter back, derived once from the
/// [`RootPlan`]: `outgoing` runs this rank holds of matrices rooted elsewhere, `incoming` runs
/// other ranks hold of matrices rooted here, `own` runs of matrices rooted here that this
/// rank holds itself. Send and receive lists are ordered by peer, then matrix order, then
/// element order on both sides, so they agree without headers.
///
/// The matrices rooted here live in one *arena*, back to back in [`RootPlan::rooted_here`]
/// order ([`Routes::sizes`]). Each direction is an [`Exchange`] between the local shard and
/// the arena, a list of copies around one all-to-all, which the host
/// ([`Exchange::run_host`]) and the device (`crate::cuda::muon`) both carry out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routes {
    outgoing: Vec<Segment>,
    incoming: Vec<Segment>,
    own: Vec<Segment>,
    /// Elements per peer of `outgoing` and of `incoming`.
    to_roots: Vec<usize>,
    from_holders: Vec<usize>,
    /// Elements of each matrix rooted here, in [`RootPlan::rooted_here`] order.
    sizes: Vec<usize>,
}

/// `len` elements copied from offset `src` to offset `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub src: usize,
    pub dst: usize,
    pub len: usize,
}

/// One direction of the routes, from a buffer `from` to a buffer `to`: copy the `pack` runs
/// from `from` into a send buffer, all-to-all it (`send_counts` / `recv_counts` per peer),
/// copy the `unpack` runs from the receive buffer into `to`, and the `own` runs straight from
/// `from` into `to`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exchange {
    pub pack: Vec<Run>,
    pub send_counts: Vec<usize>,
    pub recv_counts: Vec<usize>,
    pub unpack: Vec<Run>,
    pub own: Vec<Run>,
}

impl Exchange {
    /// Elements of the send buffer.
    pub fn send_len(&self) -> usize {
        self.send_counts.iter().sum()
    }

    /// Elements of the receive buffer.
    pub fn recv_len(&self) -> usize {
        self.recv_counts.iter().sum()
    }

    /// The exchange on host buffers of element type `E`, carried as `W` (a bf16 wire rounds
    /// `f32` elements to the nearest bf16 and carries bf16 ones bit for bit; see
    /// `convert_runs`). Every rank must call it with the same `W`.
    pub fn run_host<E: RouteElem, W: RouteElem>(
        &self,
        from: &[E],
        to: &mut [E],
        comm: &dyn Communicator,
    ) -> Result<()> {
        let mut send = vec![W::default(); self.send_len()];
        convert_runs(&self.pack, from, &mut send);
        let mut recv = vec![W::default(); self.recv_len()];
        comm.all_to_all_v(
            W::buf(&send),
            &self.send_counts,
            W::buf_mut(&mut recv),
            &self.recv_counts,
        )?;
        convert_runs(&self.unpack, &recv, to);
        copy_runs(&self.own, from, to);
        Ok(())
    }
}

/// An element the host exchanges hold or carry: `f32`, or bf16 (Muon's wire when its
/// Newton–Schulz runs in bf16, whose first operation rounds every element to bf16 anyway).
pub trait RouteElem: Copy + Default + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// `v` as this type (bf16: nearest, ties to even).
    fn from_f32(v: f32) -> Self;
    fn buf(v: &[Self]) -> Buf<'_>;
    fn buf_mut(v: &mut [Self]) -> BufMut<'_>;
}

impl RouteElem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> f32 {
        v
    }
    fn buf(v: &[f32]) -> Buf<'_> {
        v.into()
    }
    fn buf_mut(v: &mut [f32]) -> BufMut<'_> {
        v.into()
    }
}

impl RouteElem for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
    fn buf(v: &[bf16]) -> Buf<'_> {
        v.into()
    }
    fn buf_mut(v: &mut [bf16]) -> BufMut<'_> {
        v.into()
    }
}

/// `runs` from `from` into `to`, as they are (the runs that never leave this rank).
fn copy_runs<T: Copy>(runs: &[Run], from: &[T], to: &mut [T]) {
    for r in runs {
        to[r.dst..r.dst + r.len].copy_from_slice(&from[r.src..r.src + r.len]);
    }
}

/// `runs` from `from` into `to`, each element converted through `f32` (onto or off the wire);
/// copied as they are when the two types are one, so that a bf16 wire carries bf16
/// elements bit for bit (the round trip through `f32` would quiet a signaling NaN; in time
/// it costs about the same, 1.1× a copy once vectorized).
fn convert_runs<S: RouteElem, D: RouteElem>(runs: &[Run], from: &[S], to: &mut [D]) {
    if std::any::TypeId::of::<S>() == std::any::TypeId::of::<D>() {
        // SAFETY: `S` and `D` are the same type (equal `TypeId`s), so `from` is a `[D]`.
        let from = unsafe { std::slice::from_raw_parts(from.as_ptr().cast::<D>(), from.len()) };
        return copy_runs(runs, from, to);
    }
    for r in runs {
        let (from, to) = (&from[r.src..r.src + r.len], &mut to[r.dst..r.dst + r.len]);
        for (d, &s) in to.iter_mut().zip(from) {
            *d = D::from_f32(s.to_f32());
        }
    }
}

/// Runs of `segs` laid back to back on one side (from 0, in list order) and at `place(seg)`
/// on the other; `packed_is_src` says which side is the source.
fn runs(segs: &[Segment], place: impl Fn(&Segment) -> usize, packed_is_src: bool) -> Vec<Run> {
    let mut at = 0;
    segs.iter()
        .map(|s| {
            let (len, placed) = (s.in_matrix.len(), place(s));
            let run = if packed_is_src {
                Run {
                    src: at,
                    dst: placed,
                    len,
                }
            } else {
                Run {
                    src: placed,
                    dst: at,
                    len,
                }
            };
            at += len;
            run
        })
        .collect()
}

impl Routes {
    /// Elements of each matrix rooted here, in [`RootPlan::rooted_here`] order (the arena).
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Elements of the arena.
    pub fn arena_len(&self) -> usize {
        self.sizes.iter().sum()
    }

    /// Where segment `s`'s run sits in the arena.
    fn arena_pos(&self, s: &Segment) -> usize {
        self.sizes[..s.slot].iter().sum::<usize>() + s.in_matrix.start
    }

    /// Local shard → arena: every split matrix to its root.
    pub fn gather_exchange(&self) -> Exchange {
        let own = self.own.iter().map(|s| Run {
            src: s.local,
            dst: self.arena_pos(s),
            len: s.in_matrix.len(),
        });
        Exchange {
            pack: runs(&self.outgoing, |s| s.local, false),
            send_counts: self.to_roots.clone(),
            recv_counts: self.from_holders.clone(),
            unpack: runs(&self.incoming, |s| self.arena_pos(s), true),
            own: own.collect(),
        }
    }

    /// Arena → local shard: each holder gets its runs back.
    pub fn scatter_exchange(&self) -> Exchange {
        let own = self.own.iter().map(|s| Run {
            src: self.arena_pos(s),
            dst: s.local,
            len: s.in_matrix.len(),
        });
        Exchange {
            pack: runs(&self.incoming, |s| self.arena_pos(s), false),
            send_counts: self.from_holders.clone(),
            recv_counts: self.to_roots.clone(),
            unpack: runs(&self.outgoing, |s| s.local, true),
            own: own.collect(),
        }
    }

    /// Gathers the split matrices rooted at this rank from `local` (laid out like the shard)
    /// into a fresh arena, carried as `W` ([`Exchange::run_host`]). Every rank must call it.
    pub fn gather<E: RouteElem, W: RouteElem>(
        &self,
        local: &[E],
        comm: &dyn Communicator,
    ) -> Result<Vec<E>> {
        let mut arena = vec![E::default(); self.arena_len()];
        self.gather_exchange()
            .run_host::<E, W>(local, &mut arena, comm)?;
        Ok(arena)
    }

    /// Sends each holder its runs of the matrices rooted here (`arena`, as
    /// [`Routes::gather`] returned it), carried as `W`, and writes the runs this rank holds
    /// into `local`. Every rank must call it.
    pub fn scatter<E: RouteElem, W: RouteElem>(
        &self,
        arena: &[E],
        local: &mut [E],
        comm: &dyn Communicator,
    ) -> Result<()> {
        if arena.len() != self.arena_len() {
            return Err(Error::InvalidShard {
                op: "Routes::scatter",
                reason: format!(
                    "an arena of {} elements for the {} of the matrices rooted at this rank",
                    arena.len(),
                    self.arena_len()
                ),
            });
        }
        self.scatter_exchange().run_host::<E, W>(arena, local, comm)
    }
}

/// Where element `elem` of parameter `param` sits in this rank's local shard.
fn local_offset(shard: &LocalShard, param: usize, elem: usize) -> Result<usize> {
    shard
        .pieces
        .iter()
        .find(|p| p.param == param && p.range.contains(&elem))
        .map(|p| p.offset + (elem - p.range.start))
        .ok_or_else(|| Error::InvalidShard {
            op: "RootPlan",
            reason: format!(
                "rank {} holds element {elem} of {} by the plan but no piece has it",
                shard.rank, shard.params[param].name
            ),
        })
}
