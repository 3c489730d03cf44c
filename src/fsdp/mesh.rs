//! The ranks a sharded model talks to: the whole world, or under HSDP (hybrid sharding,
//! [`super::FsdpOptions::replicas`]) a 2-D mesh of `replicas × shard` ranks.
//!
//! With `R` replicas of a world of `V` ranks, each unit is sharded over a shard group of
//! `S = V / R` consecutive ranks (`[g·S, (g+1)·S)`, replica `g`: a node's GPUs, in the usual
//! launch order) and replicated over the `R` ranks that hold the same shard (`rank mod S`
//! equal). Gathers, reduce-scatters, the optimizer's own collectives (Muon's matrix gather) and
//! the gradient norm run in the shard group, so their traffic stays inside it; a reduced
//! gradient shard is then all-reduced over its replica group, once per reduction (FSDP2's and
//! Megatron-FSDP's HSDP). Checks that every rank must pass alike (the stage list, non-finite
//! flags, the learning rate) go over the whole world.
//!
//! Replicas stay bitwise identical: they start from the same values (checked), the all-reduce
//! gives every replica the same bits (a rank-order fold), and the optimizer step is a
//! deterministic function of the shard, its state and that gradient.

use crate::comm::{BufMut, Communicator, ReduceOp};
use crate::{Error, Result};

/// `Err` from `op` unless `replicas` (the setting called `name`) divides a world of `world`
/// ranks into equal shard groups: what [`super::fully_shard`] checks, for callers that know
/// the world before they make it (a launcher's flags).
pub fn check_replicas(op: &'static str, name: &str, replicas: usize, world: usize) -> Result<()> {
    if replicas == 0 || world % replicas != 0 {
        return Err(Error::BadInput {
            op,
            what: format!("{name} = {replicas} on a world of {world} ranks"),
            reason: "HSDP shards over groups of world / replicas ranks, so the number of \
                     replicas must divide the world size (1: plain FSDP)"
                .into(),
        });
    }
    Ok(())
}

/// The communicators of one rank of a sharded model.
pub(crate) struct Mesh<'c> {
    world: &'c dyn Communicator,
    groups: Option<Groups<'c>>,
}

/// HSDP's two groups of this rank (split from the world, so they may borrow it).
struct Groups<'c> {
    shard: Box<dyn Communicator + 'c>,
    replicas: Box<dyn Communicator + 'c>,
}

impl<'c> Mesh<'c> {
    /// The mesh of `replicas` replicas over `world` (a collective when `replicas > 1`: two
    /// splits). `Err` unless `replicas` divides the world size.
    pub(crate) fn new(world: &'c dyn Communicator, replicas: usize) -> Result<Mesh<'c>> {
        let v = world.world_size();
        check_replicas("fully_shard", "FsdpOptions::replicas", replicas, v)?;
        if replicas == 1 {
            return Ok(Mesh {
                world,
                groups: None,
            });
        }
        let shard_size = v / replicas;
        let rank = world.rank();
        let shard = world.split(rank / shard_size)?;
        let replicas = world.split(rank % shard_size)?;
        Ok(Mesh {
            world,
            groups: Some(Groups { shard, replicas }),
        })
    }

    /// Every rank of the job.
    pub(crate) fn world(&self) -> &'c dyn Communicator {
        self.world
    }

    /// The ranks a unit is sharded over (the world without HSDP).
    pub(crate) fn shard(&self) -> &dyn Communicator {
        match &self.groups {
            Some(g) => &*g.shard,
            None => self.world,
        }
    }

    /// Rank `j` of this rank's shard group as a rank of the world.
    pub(crate) fn world_rank_of(&self, j: usize) -> usize {
        self.in_replica(self.world.rank() / self.shard().world_size(), j)
    }

    /// The rank that writes the checkpoint file of shard rank `j`, and reads shard rank `j`'s
    /// values back at a load: the replicas hold the same values, so they share the file work,
    /// shard rank `j`'s from replica `j mod R` ([`Mesh::share_loaded`] sends what it read to
    /// the other replicas).
    pub(crate) fn writer_of(&self, j: usize) -> usize {
        self.in_replica(j % self.replicas(), j)
    }

    /// Whether this rank reads its shard's values from files at a load ([`Mesh::writer_of`]).
    pub(crate) fn reads_files(&self) -> bool {
        self.writer_of(self.shard().rank()) == self.world.rank()
    }

    /// Copies a loaded shard from the replica that read it from files ([`Mesh::writer_of`])
    /// to the other replicas, over the replica group (nothing without HSDP): one read of a
    /// checkpoint per shard group, not one per replica.
    pub(crate) fn share_loaded(&self, shard: BufMut<'_>) -> Result<()> {
        match &self.groups {
            // The replica group numbers replica `g` as its rank `g` (split keeps world order).
            Some(g) => g
                .replicas
                .broadcast(shard, self.shard().rank() % self.replicas()),
            None => Ok(()),
        }
    }

    fn replicas(&self) -> usize {
        self.world.world_size() / self.shard().world_size()
    }

    /// Rank `j` of replica `g`'s shard group as a rank of the world (groups are consecutive).
    fn in_replica(&self, g: usize, j: usize) -> usize {
        g * self.shard().world_size() + j
    }

    /// Combines a reduced gradient shard over its replicas (nothing without HSDP): with
    /// [`ReduceOp::Avg`] the shard group's average over `S` ranks, averaged over `R`
    /// replicas, is the average over all `V`.
    pub(crate) fn reduce_over_replicas(&self, shard: BufMut<'_>, op: ReduceOp) -> Result<()> {
        match &self.groups {
            Some(g) => g.replicas.all_reduce(shard, op),
            None => Ok(()),
        }
    }
}
