//! Compute-copy storages kept from a unit's free to the next gather of a unit of the same tensor
//! sizes, as [`crate::dbuffer::GradPool`] keeps gradient buffers.
//!
//! Under `reshard_after_forward` every unit is gathered twice a step (forward, and backward's
//! re-gather) and freed twice. A fresh allocation costs a zero-fill (or first-touch page faults)
//! of the whole unit before the all-gather overwrites it; a reused storage is only overwritten.
//! A stack of identical blocks frees a block's storages just before the next block is gathered,
//! so at most [`ParamPool::SPARE`] units' storages wait here at any time, and the memory replay
//! (`stages::peak_of_schedule`) counts them.

use candle_core::{DType, Storage};

use crate::dbuffer::{tap, ParamBuffer};

/// Spare storages of whole units, each tagged with the unit's class.
#[derive(Default)]
pub(crate) struct ParamPool {
    /// Per unit: the first unit with the same buffers (dtypes and tensor lengths, in order).
    class: Vec<usize>,
    /// One unit's storages each: per buffer of the unit, per tensor.
    spare: Vec<(usize, Vec<Vec<Storage>>)>,
}

impl ParamPool {
    /// Units whose storages are kept at most.
    pub const SPARE: usize = 2;

    /// A pool for units whose buffers are `buffers[u]`.
    pub fn new(buffers: &[Vec<&ParamBuffer>]) -> Self {
        ParamPool {
            class: classes(&buffers.iter().map(|b| signature(b)).collect::<Vec<_>>()),
            spare: Vec::new(),
        }
    }

    /// The class of unit `u` (units of one class can swap storages).
    pub fn class_of(&self, u: usize) -> usize {
        self.class[u]
    }

    /// Spare storages for unit `u` (per buffer), if a unit of its class left some.
    pub fn take(&mut self, u: usize) -> Option<Vec<Vec<Storage>>> {
        let class = self.class_of(u);
        let i = self.spare.iter().position(|(c, _)| *c == class)?;
        Some(self.spare.swap_remove(i).1)
    }

    /// Keeps unit `u`'s storages unless [`Self::SPARE`] units' are kept already (then they are
    /// dropped, and their memory returns).
    pub fn give_back(&mut self, u: usize, storages: Vec<Vec<Storage>>) {
        let empty = storages.iter().all(Vec::is_empty);
        if !empty && self.spare.len() < Self::SPARE {
            self.spare.push((self.class_of(u), storages));
        }
    }

    /// Bytes the spare storages hold.
    pub fn spare_bytes(&self) -> usize {
        self.spare
            .iter()
            .flat_map(|(_, unit)| unit.iter().flatten())
            .map(|s| tap::storage_len(s).unwrap_or(0) * s.dtype().size_in_bytes())
            .sum()
    }
}

/// What a unit's storages must match to be reused: per buffer, the compute dtype and the
/// tensors' lengths.
fn signature(buffers: &[&ParamBuffer]) -> Vec<(DType, Vec<usize>)> {
    buffers
        .iter()
        .map(|b| (b.dtype(), b.slots().iter().map(|s| s.numel()).collect()))
        .collect()
}

/// For each item, the index of the first item equal to it.
fn classes<T: PartialEq>(items: &[T]) -> Vec<usize> {
    (0..items.len())
        .map(|i| (0..=i).find(|&j| items[j] == items[i]).unwrap_or(i))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::classes;

    #[test]
    fn classes_name_the_first_equal_item() {
        assert_eq!(classes(&[3, 5, 3, 3, 7, 5]), vec![0, 1, 0, 0, 4, 1]);
        assert_eq!(classes::<u8>(&[]), Vec::<usize>::new());
    }
}
