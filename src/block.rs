//! Atomic blocks: the smallest piece of a tensor that must stay on one rank.
//!
//! An optimizer declares one [`AtomicBlock`] per parameter (8-bit Adam: 32×32 tiles; Muon: a
//! whole matrix; AdamW: single elements). The planner then places every tensor so that no shard
//! boundary falls inside a block.
//!
//! # Rows and blocks
//! A *row* is the last dimension: a tensor of shape `[.., n]` has rows of `n` elements, so a
//! 3-D tensor `[E, m, n]` (fused MoE experts) has `E·m` rows, and a 1-D tensor is one row. A 0-D
//! tensor counts as shape `[1]`. Blocks are measured in the row-major flattening of the tensor,
//! **from its first element**:
//!
//! | block | elements | example `[E=4, m=64, n=96]` |
//! |---|---|---|
//! | `Element` | 1 | 1 |
//! | `Rows(k)` | `k·n` | `Rows(16)` → 1536 |
//! | `Tile { rows: r, cols: c }` | `r·n` (requires `c \| n`) | `Tile{32,32}` → 3072 |
//! | `Matrix` | `m·n` (one trailing matrix; a 1-D tensor is one matrix) | 6144 |
//! | `Whole` | the whole tensor | 24576 |
//!
//! **The short-tail rule.** When the number of rows is not a multiple of `k`, the tensor ends
//! with one shorter block: cuts may fall only at `offset ≡ 0 (mod block)` measured from the
//! tensor's start, never inside the tail. A block larger than the tensor is clamped to the
//! tensor, which then can never be cut. A `Tile` covers `c` columns of `r` rows; since every
//! row holds `n / c` whole tiles, a cut on an `r`-row edge never splits a tile.

use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

/// The atomic unit an optimizer needs kept on one rank. `Copy + Eq + Hash`; see the module doc
/// for the element size of each variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AtomicBlock {
    /// Any element may go anywhere (AdamW, SGD).
    Element,
    /// `k` whole rows (row = last dimension).
    Rows(usize),
    /// A `rows × cols` tile; every row must hold whole tiles (`cols | row length`).
    Tile { rows: usize, cols: usize },
    /// One trailing 2-D matrix (`shape[-2] × shape[-1]`); each expert of `[E, m, n]`.
    Matrix,
    /// The whole tensor on one rank.
    Whole,
}

impl AtomicBlock {
    /// The block size in elements for a tensor of `shape`, clamped to the tensor's size.
    ///
    /// Errors on zero dimensions, a zero block parameter, or a tile whose width does not divide
    /// the row length (a 32×32 tile on a 48-column matrix).
    pub fn elems(&self, shape: &[usize]) -> Result<usize> {
        let numel = numel(shape)?;
        let row = row_len(shape);
        let raw = match *self {
            AtomicBlock::Element => 1,
            AtomicBlock::Rows(k) => {
                if k == 0 {
                    return Err(self.misfit(shape, "a block of zero rows"));
                }
                k.saturating_mul(row)
            }
            AtomicBlock::Tile { rows, cols } => {
                if rows == 0 || cols == 0 {
                    return Err(self.misfit(shape, "a tile with a zero side"));
                }
                if row % cols != 0 {
                    let why =
                        format!("rows of {row} elements do not hold whole {cols}-column tiles");
                    return Err(self.misfit(shape, &why));
                }
                rows.saturating_mul(row)
            }
            AtomicBlock::Matrix => match shape.len() {
                0 | 1 => numel,
                n => shape[n - 2] * shape[n - 1],
            },
            AtomicBlock::Whole => numel,
        };
        Ok(raw.min(numel))
    }

    fn misfit(&self, shape: &[usize], reason: &str) -> Error {
        Error::BlockDoesNotFit {
            op: "AtomicBlock::elems",
            block: self.to_string(),
            shape: shape.to_vec(),
            reason: reason.to_string(),
        }
    }
}

/// Number of elements of `shape` (0-D counts as one); errors on a zero dimension or overflow.
pub fn numel(shape: &[usize]) -> Result<usize> {
    let bad = |reason: &str| Error::InvalidShape {
        op: "numel",
        shape: shape.to_vec(),
        reason: reason.to_string(),
    };
    if shape.contains(&0) {
        return Err(bad("zero-sized dimension"));
    }
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad("element count overflows usize"))
}

/// Length of one row, the last dimension (1 for a 0-D tensor).
pub fn row_len(shape: &[usize]) -> usize {
    shape.last().copied().unwrap_or(1)
}

/// Number of blocks of `block` elements in a tensor of `numel` elements, counting the short tail.
pub fn num_blocks(numel: usize, block: usize) -> usize {
    numel.div_ceil(block.max(1))
}

impl fmt::Display for AtomicBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AtomicBlock::Element => write!(f, "elem"),
            AtomicBlock::Rows(k) => write!(f, "rows:{k}"),
            AtomicBlock::Tile { rows, cols } => write!(f, "tile:{rows}x{cols}"),
            AtomicBlock::Matrix => write!(f, "matrix"),
            AtomicBlock::Whole => write!(f, "whole"),
        }
    }
}

impl FromStr for AtomicBlock {
    type Err = Error;

    /// Parses the CLI form: `elem`, `rows:K`, `tile:RxC`, `matrix`, `whole`.
    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: &str| Error::BadInput {
            op: "AtomicBlock::from_str",
            what: format!("block {s:?}"),
            reason: format!("{reason} (expected elem, rows:K, tile:RxC, matrix or whole)"),
        };
        let positive = |v: &str| match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(bad("sizes must be positive integers")),
        };
        let s_lower = s.trim().to_ascii_lowercase();
        match s_lower.split_once(':') {
            None => match s_lower.as_str() {
                "elem" | "element" => Ok(AtomicBlock::Element),
                "matrix" => Ok(AtomicBlock::Matrix),
                "whole" => Ok(AtomicBlock::Whole),
                _ => Err(bad("unknown block")),
            },
            Some(("rows", k)) => Ok(AtomicBlock::Rows(positive(k)?)),
            Some(("tile", rc)) => {
                let (r, c) = rc.split_once('x').ok_or_else(|| bad("a tile is RxC"))?;
                Ok(AtomicBlock::Tile {
                    rows: positive(r)?,
                    cols: positive(c)?,
                })
            }
            Some(_) => Err(bad("unknown block")),
        }
    }
}
