//! Roots for whole-matrix work on sharded state: which rank assembles each matrix that the
//! layout splits, and the routes of the two all-to-alls that carry it there and back.
//!
//! Muon's Newton–Schulz needs a whole matrix. A matrix held by one rank is worked on in
//! place. A matrix whose elements lie on several ranks (a row-split layout, or FSDP2's even
//! `Shard(0)`) gets a **root**: one rank that receives every piece, runs the matrix math, and
//! sends each holder its rows back (veScale-FSDP, Algorithm 2).
//!
//! # Root choice: longest processing time first
//! Cost of a `rows × cols` matrix = `numel·(min(rows, cols)·steps + 1)` (the Newton–Schulz
//! FLOPs up to a constant, plus the element work; Megatron-FSDP's owner planning). Matrices
//! held by one rank are charged to it first; then the split matrices, by descending cost (ties
//! in parameter order), each go to the least-loaded rank *among those holding part of it*
//! (ties to the lower rank), so a root never receives a matrix it holds none of.
//!
//! Every rank computes the same assignment from the plan's metadata ([`ParamMeta::holdings`]);
//! no metadata crosses ranks.
//!
//! # Routes
//! One batched `all_to_all_v` gathers every split matrix to its root; a second one, with the
//! counts mirrored, scatters the results back ([`Routes`], derived once per step).

use std::ops::Range;

use ragged::comm::Communicator;
use ragged::optim::{LocalShard, ParamMeta};
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
    /// `numel·(min(rows, cols)·steps + 1)`.
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
    /// trailing `rows × cols` matrices need whole-matrix math, `None` for the others.
    pub fn new(
        shard: &LocalShard,
        matrix_of: &dyn Fn(&ParamMeta) -> Option<(usize, usize)>,
        steps: usize,
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
            let cost = (mn as u64).saturating_mul((rows.min(cols) * steps + 1) as u64);
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

    /// This rank's side of the two all-to-alls (see [`Routes`]).
    pub fn routes(&self, shard: &LocalShard) -> Result<Routes> {
        let me = shard.rank;
        let mine: Vec<usize> = self.rooted_here(me).collect();
        let slot = |k: usize| mine.binary_search(&k).expect("rooted here");
        let (mut outgoing, mut incoming, mut own) = (Vec::new(), Vec::new(), Vec::new());
        for (k, job) in self.jobs.iter().enumerate().filter(|(_, j)| j.split) {
            let meta = &shard.params[job.param];
            for h in meta.holders_of(job.elems.clone()) {
                let in_matrix = h.range.start - job.elems.start..h.range.end - job.elems.start;
                let local = || local_offset(shard, job.param, h.range.start);
                match (h.rank == me, job.root == me) {
                    (true, false) => outgoing.push(Segment {
                        peer: job.root,
                        slot: 0,
                        in_matrix,
                        local: local()?,
                    }),
                    (false, true) => incoming.push(Segment {
                        peer: h.rank,
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
}

/// One rank's side of the gather to roots and the scatter back, derived once from the
/// [`RootPlan`]: `outgoing` runs this rank holds of matrices rooted elsewhere, `incoming` runs
/// other ranks hold of matrices rooted here, `own` runs of matrices rooted here that this
/// rank holds itself. Send and receive lists are ordered by peer, then matrix order, then
/// element order on both sides, so they agree without headers.
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

impl Routes {
    /// Gathers the split matrices rooted at this rank from `local` (laid out like the shard);
    /// returns them in [`RootPlan::rooted_here`] order. Every rank must call it.
    pub fn gather(&self, local: &[f32], comm: &dyn Communicator) -> Result<Vec<Vec<f32>>> {
        let send: Vec<f32> = self
            .outgoing
            .iter()
            .flat_map(|s| &local[s.local..s.local + s.in_matrix.len()])
            .copied()
            .collect();
        let mut recv = vec![0.0f32; self.from_holders.iter().sum()];
        comm.all_to_all_v(
            send.as_slice().into(),
            &self.to_roots,
            recv.as_mut_slice().into(),
            &self.from_holders,
        )?;
        let mut mats: Vec<Vec<f32>> = self.sizes.iter().map(|&n| vec![0.0; n]).collect();
        let mut at = 0;
        for s in &self.incoming {
            let n = s.in_matrix.len();
            mats[s.slot][s.in_matrix.clone()].copy_from_slice(&recv[at..at + n]);
            at += n;
        }
        for s in &self.own {
            let n = s.in_matrix.len();
            mats[s.slot][s.in_matrix.clone()].copy_from_slice(&local[s.local..s.local + n]);
        }
        Ok(mats)
    }

    /// Sends each holder its runs of the matrices rooted here (`mats`, as
    /// [`Routes::gather`] returned them) and writes the runs this rank holds into `local`.
    /// Every rank must call it.
    pub fn scatter(
        &self,
        mats: &[Vec<f32>],
        local: &mut [f32],
        comm: &dyn Communicator,
    ) -> Result<()> {
        if mats.len() != self.sizes.len() {
            return Err(Error::InvalidShard {
                op: "Routes::scatter",
                reason: format!(
                    "{} matrices for the {} rooted at this rank",
                    mats.len(),
                    self.sizes.len()
                ),
            });
        }
        let send: Vec<f32> = self
            .incoming
            .iter()
            .flat_map(|s| &mats[s.slot][s.in_matrix.clone()])
            .copied()
            .collect();
        let mut recv = vec![0.0f32; self.to_roots.iter().sum()];
        comm.all_to_all_v(
            send.as_slice().into(),
            &self.from_holders,
            recv.as_mut_slice().into(),
            &self.to_roots,
        )?;
        let mut at = 0;
        for s in &self.outgoing {
            let n = s.in_matrix.len();
            local[s.local..s.local + n].copy_from_slice(&recv[at..at + n]);
            at += n;
        }
        for s in &self.own {
            let n = s.in_matrix.len();
            local[s.local..s.local + n].copy_from_slice(&mats[s.slot][s.in_matrix.clone()]);
        }
        Ok(())
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
