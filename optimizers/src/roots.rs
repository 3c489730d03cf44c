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
//! counts mirrored, scatters the results back. Segments are ordered by peer rank, then matrix
//! order, then element order, on both sides, so send and receive agree without headers.

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
    /// Index into [`RootPlan::jobs`].
    job: usize,
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

    /// The runs of split matrices this rank holds that go to another root (`outgoing`) and
    /// the runs other ranks hold of matrices rooted here (`incoming`), each sorted by peer.
    fn segments(&self, shard: &LocalShard) -> Result<(Vec<Segment>, Vec<Segment>)> {
        let me = shard.rank;
        let (mut outgoing, mut incoming) = (Vec::new(), Vec::new());
        for (k, job) in self.jobs.iter().enumerate().filter(|(_, j)| j.split) {
            let meta = &shard.params[job.param];
            for h in meta.holders_of(job.elems.clone()) {
                let in_matrix = h.range.start - job.elems.start..h.range.end - job.elems.start;
                if h.rank == me && job.root != me {
                    outgoing.push(Segment {
                        peer: job.root,
                        job: k,
                        in_matrix,
                        local: local_offset(shard, job.param, h.range.start)?,
                    });
                } else if h.rank != me && job.root == me {
                    incoming.push(Segment {
                        peer: h.rank,
                        job: k,
                        in_matrix,
                        local: 0,
                    });
                }
            }
        }
        outgoing.sort_by_key(|s| s.peer); // stable: job order within a peer
        incoming.sort_by_key(|s| s.peer);
        Ok((outgoing, incoming))
    }

    /// Gathers the split matrices rooted at this rank from `local` (laid out like the shard);
    /// returns them in [`RootPlan::rooted_here`] order. Every rank must call it.
    pub fn gather(
        &self,
        shard: &LocalShard,
        local: &[f32],
        comm: &dyn Communicator,
    ) -> Result<Vec<Vec<f32>>> {
        let (outgoing, incoming) = self.segments(shard)?;
        let send: Vec<f32> = outgoing
            .iter()
            .flat_map(|s| &local[s.local..s.local + s.in_matrix.len()])
            .copied()
            .collect();
        let mut recv = vec![0.0f32; incoming.iter().map(|s| s.in_matrix.len()).sum()];
        let (sc, rc) = (self.counts(&outgoing), self.counts(&incoming));
        comm.all_to_all_v(send.as_slice().into(), &sc, recv.as_mut_slice().into(), &rc)?;

        let mine: Vec<usize> = self.rooted_here(shard.rank).collect();
        let mut mats: Vec<Vec<f32>> = mine
            .iter()
            .map(|&k| vec![0.0; self.jobs[k].elems.len()])
            .collect();
        let slot = |k: usize| mine.binary_search(&k).expect("rooted here");
        let mut at = 0;
        for s in &incoming {
            let n = s.in_matrix.len();
            mats[slot(s.job)][s.in_matrix.clone()].copy_from_slice(&recv[at..at + n]);
            at += n;
        }
        for (i, &k) in mine.iter().enumerate() {
            for (in_matrix, local_at) in self.own_runs(shard, k)? {
                let n = in_matrix.len();
                mats[i][in_matrix].copy_from_slice(&local[local_at..local_at + n]);
            }
        }
        Ok(mats)
    }

    /// Sends each holder its runs of the matrices rooted here (`mats`, as [`RootPlan::gather`]
    /// returned them) and writes the runs this rank holds into `local`. Every rank must call it.
    pub fn scatter(
        &self,
        shard: &LocalShard,
        mats: &[Vec<f32>],
        local: &mut [f32],
        comm: &dyn Communicator,
    ) -> Result<()> {
        let (outgoing, incoming) = self.segments(shard)?;
        let mine: Vec<usize> = self.rooted_here(shard.rank).collect();
        if mats.len() != mine.len() {
            return Err(Error::InvalidShard {
                op: "RootPlan::scatter",
                reason: format!(
                    "{} matrices for the {} rooted at rank {}",
                    mats.len(),
                    mine.len(),
                    shard.rank
                ),
            });
        }
        let slot = |k: usize| mine.binary_search(&k).expect("rooted here");
        let send: Vec<f32> = incoming
            .iter()
            .flat_map(|s| &mats[slot(s.job)][s.in_matrix.clone()])
            .copied()
            .collect();
        let mut recv = vec![0.0f32; outgoing.iter().map(|s| s.in_matrix.len()).sum()];
        let (sc, rc) = (self.counts(&incoming), self.counts(&outgoing));
        comm.all_to_all_v(send.as_slice().into(), &sc, recv.as_mut_slice().into(), &rc)?;

        let mut at = 0;
        for s in &outgoing {
            let n = s.in_matrix.len();
            local[s.local..s.local + n].copy_from_slice(&recv[at..at + n]);
            at += n;
        }
        for (i, &k) in mine.iter().enumerate() {
            for (in_matrix, local_at) in self.own_runs(shard, k)? {
                let n = in_matrix.len();
                local[local_at..local_at + n].copy_from_slice(&mats[i][in_matrix]);
            }
        }
        Ok(())
    }

    /// Elements per peer of a segment list.
    fn counts(&self, segs: &[Segment]) -> Vec<usize> {
        let mut counts = vec![0; self.world];
        for s in segs {
            counts[s.peer] += s.in_matrix.len();
        }
        counts
    }

    /// The runs of job `k` this rank holds itself: (range in the matrix, local offset).
    fn own_runs(&self, shard: &LocalShard, k: usize) -> Result<Vec<(Range<usize>, usize)>> {
        let job = &self.jobs[k];
        shard.params[job.param]
            .holders_of(job.elems.clone())
            .filter(|h| h.rank == shard.rank)
            .map(|h| {
                let in_matrix = h.range.start - job.elems.start..h.range.end - job.elems.start;
                Ok((in_matrix, local_offset(shard, job.param, h.range.start)?))
            })
            .collect()
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
