//! What a stage's graph keeps alive, measured by walking it.
//!
//! candle gives no allocator hook, but its graph is public: [`Tensor::sorted_nodes`] lists every
//! tensor a backward from the stage's output would visit. Their distinct storages, less the
//! unit's parameters (held by the runtime's own buffers) and the variables (the saved input,
//! the anchor), are the activations the graph holds until its backward. The runtime measures
//! this on every step ([`super::ShardedModel::activations`]) and the memory plan adds it
//! ([`super::MemoryPlan::peak_unit_by_unit`]).

use std::collections::HashSet;

use candle_core::{CpuStorage, Storage, Tensor};

use super::UnitParams;

/// Activation bytes of one stage, as measured on the last step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageActivations {
    /// Bytes of the distinct storages the stage's graph holds (its output included; its
    /// parameters and input not): alive from its forward (or recomputation) to its backward.
    pub graph_bytes: usize,
    /// Bytes of the stage's output, which the runtime copies into the next stage's saved input
    /// (alive until the step's backward ends).
    pub output_bytes: usize,
}

/// Address and bytes of a tensor's whole CPU storage (`None` elsewhere).
fn storage_of(t: &Tensor) -> Option<(usize, usize)> {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => Some((v.as_ptr() as usize, 4 * v.len())),
        Storage::Cpu(CpuStorage::BF16(v)) => Some((v.as_ptr() as usize, 2 * v.len())),
        Storage::Cpu(CpuStorage::F16(v)) => Some((v.as_ptr() as usize, 2 * v.len())),
        Storage::Cpu(CpuStorage::F64(v)) => Some((v.as_ptr() as usize, 8 * v.len())),
        _ => None,
    }
}

/// Bytes of the distinct storages `out`'s graph holds, `params`' storages and variables not
/// counted (module doc).
pub(crate) fn graph_bytes(out: &Tensor, params: &UnitParams) -> usize {
    let mut seen: HashSet<usize> = params
        .tensors()
        .filter_map(storage_of)
        .map(|(addr, _)| addr)
        .collect();
    out.sorted_nodes()
        .into_iter()
        .filter(|t| !t.is_variable())
        .filter_map(storage_of)
        .filter(|&(addr, bytes)| bytes > 0 && seen.insert(addr))
        .map(|(_, bytes)| bytes)
        .sum()
}
