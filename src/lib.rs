//! ragged: structure-aware optimizers on fully sharded training state.
//!
//! The chain, one module each: [`block`] (what an optimizer needs kept together) →
//! [`ragged`] (how one tensor is split over ranks) → [`plan`] (how a group of tensors is packed
//! into equal shards) → [`dbuffer`] (the unit's collective buffers and the parameter and
//! gradient views into them) → [`comm`] (collectives over threads, MPI or NCCL) → [`fsdp`]
//! (`fully_shard` and the training step) → [`optim`] (the optimizer trait the steps run).
//! [`model`] holds the parameter inventories the planner is run on.

pub mod bench;
pub mod block;
pub mod checkpoint;
pub mod comm;
pub mod cuda;
pub mod dbuffer;
pub mod demo;
pub mod error;
pub mod fsdp;
pub mod limits;
pub mod model;
pub mod optim;
pub mod plan;
pub mod ragged;
pub mod roles;
pub mod schedule;
pub mod settings;
pub mod storage;

pub use block::AtomicBlock;
pub use error::{Context, Error, Result};
pub use roles::{Role, RoleRule, RoleSettings};
