//! RaggedShard: how one tensor is split over the ranks of one mesh dim.
//!
//! A [`RaggedShard`] cuts the row-major flattening of a tensor into *units* of `unit` elements
//! (the last unit may be shorter: the short-tail rule of [`block`](crate::block#rows-and-blocks))
//! and gives rank `k` a contiguous run of `units[k]` whole units, in rank order. Ranks may hold
//! nothing. The
//! planner ([`plan`](crate::plan)) produces one per tensor with
//! [`RaggedShard::from_placement`]; optimizers that need a whole matrix on one rank (Muon) move
//! between layouts with [`redistribute`], which returns a transfer list that one executor runs.
//!
//! # Vocabulary
//! - **unit**: the granularity of a cut, in elements; a multiple of the tensor's atomic block.
//! - **range**: the elements `[lo, hi)` of the flattened tensor held by a rank.
//! - **local piece**: a rank's range stored flat (1-D); offsets in [`Transfer`] are into it.
//! - **prefix form**: veScale's `RaggedShard(dims, local_units)` ([`PrefixForm`]), where the
//!   unit is implied by the shape.
//!
//! Size and offset math is available as free functions of integers ([`placement_units`],
//! [`even_units`], [`chunk_len_and_offset`], [`prefix_dims`], [`unit_for_outer_shard`]), so it
//! can be checked without any tensor.

use std::fmt;
use std::ops::Range;

use crate::block::{self, AtomicBlock};
use crate::{Error, Result};

fn invalid(op: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidShard {
        op,
        reason: reason.into(),
    }
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Least common multiple, `None` on overflow. Both arguments must be positive.
fn checked_lcm(a: usize, b: usize) -> Option<usize> {
    (a / gcd(a, b)).checked_mul(b)
}

/// Element ranges of every rank for runs of `units` units of `unit` elements over a tensor of
/// `numel` elements (ends clamped to `numel` for the short tail). Inputs must be validated.
fn unit_ranges(units: &[usize], unit: usize, numel: usize) -> Vec<Range<usize>> {
    let mut done = 0usize;
    units
        .iter()
        .map(|&u| {
            let lo = done.saturating_mul(unit).min(numel);
            done = done.saturating_add(u);
            lo..done.saturating_mul(unit).min(numel)
        })
        .collect()
}

fn check_rank(op: &'static str, rank: usize, world: usize) -> Result<()> {
    if rank >= world {
        return Err(invalid(
            op,
            format!("rank {rank} out of range for world size {world}"),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Size math: free functions of integers.
// ---------------------------------------------------------------------------------------------

/// The `torch.chunk` rule: chunk `idx` of `size` items cut into `num_chunks` chunks of
/// `ceil(size / num_chunks)` items from the front; trailing chunks are shorter or empty.
/// Returns `(len, offset)` in items.
///
/// | size | chunks | lens |
/// |---|---|---|
/// | 10 | 3 | 4, 4, 2 |
/// | 5 | 4 | 2, 2, 1, 0 |
/// | 2 | 4 | 1, 1, 0, 0 |
///
/// Errors when `num_chunks == 0` or `idx >= num_chunks`.
pub fn chunk_len_and_offset(size: usize, num_chunks: usize, idx: usize) -> Result<(usize, usize)> {
    const OP: &str = "chunk_len_and_offset";
    if num_chunks == 0 {
        return Err(invalid(OP, "zero chunks"));
    }
    check_rank(OP, idx, num_chunks)?;
    let per = size.div_ceil(num_chunks);
    let offset = per.saturating_mul(idx).min(size);
    Ok((per.min(size - offset), offset))
}

/// Units per rank when `num_blocks` units are dealt out by the `torch.chunk` rule over `world`
/// ranks ([`chunk_len_and_offset`]): `ceil(num_blocks / world)` units per rank from rank 0.
/// Errors when `world == 0`.
pub fn even_units(num_blocks: usize, world: usize) -> Result<Vec<usize>> {
    (0..world.max(1))
        .map(|k| chunk_len_and_offset(num_blocks, world, k).map(|(len, _)| len))
        .collect()
}

/// Units per rank of a tensor of `numel` elements placed at `offset` in a buffer of
/// `world · shard_size` elements where rank `k` owns `[k·S, (k+1)·S)` (planner.md §6).
///
/// The tensor occupies `[l, r) = [offset, offset + numel)`. Rank `k` holds
/// `[max(l, kS), min(r, (k+1)S))`, that is `ceil(len / unit)` units (only the piece holding the
/// short tail is not a multiple of `unit`). `unit` is clamped to `numel`.
///
/// | numel | unit | offset | S | world | units |
/// |---|---|---|---|---|---|
/// | 27 | 3 | 1 | 16 | 6 | 5, 4, 0, 0, 0, 0 |
/// | 22 | 2 | 28 | 16 | 6 | 0, 2, 8, 1, 0, 0 |
/// | 10 | 4 | 4 | 4 | 4 | 0, 1, 1, 1 |
///
/// Errors: [`Error::BlockSplit`] when a boundary `kS` lies strictly inside the tensor at a
/// distance from `l` that is not a multiple of `unit` (the offset reported is that distance);
/// [`Error::InvalidShard`] when `numel`, `unit` or `world` is zero, or the tensor passes the end
/// of the buffer.
pub fn placement_units(
    numel: usize,
    unit: usize,
    offset: usize,
    shard_size: usize,
    world: usize,
) -> Result<Vec<usize>> {
    const OP: &str = "placement_units";
    if numel == 0 || unit == 0 || world == 0 {
        let why = format!("numel {numel}, unit {unit} and world {world} must all be positive");
        return Err(invalid(OP, why));
    }
    let unit = unit.min(numel);
    let capacity = world.checked_mul(shard_size);
    let end = offset.checked_add(numel);
    let (l, r) = match (capacity, end) {
        (Some(cap), Some(r)) if r <= cap => (offset, r),
        _ => {
            let why = format!(
                "tensor of {numel} elements at offset {offset} passes the end of a buffer of \
                 {world} x {shard_size} elements"
            );
            return Err(invalid(OP, why));
        }
    };
    // shard_size > 0 here: the buffer holds at least one element.
    let s = shard_size;
    let mut units = vec![0usize; world];
    for (k, slot) in units
        .iter_mut()
        .enumerate()
        .take((r - 1) / s + 1)
        .skip(l / s)
    {
        let boundary = k * s;
        if boundary > l && (boundary - l) % unit != 0 {
            return Err(Error::BlockSplit {
                op: OP,
                tensor: format!("of {numel} elements at [{l}, {r})"),
                block: unit,
                offset: boundary - l,
            });
        }
        let lo = l.max(boundary);
        let hi = r.min(boundary + s);
        *slot = (hi - lo).div_ceil(unit);
    }
    Ok(units)
}

/// Number of leading dims of the prefix form: the smallest `k` such that `prod(shape[k..])`
/// divides `unit`, so that cuts on multiples of `unit` never split the trailing dims
/// (`k = shape.len()` always works). `k = 0` means the unit is the whole tensor.
///
/// | shape | unit | k |
/// |---|---|---|
/// | [10, 4] | 8 | 1 |
/// | [10, 4] | 6 | 2 |
/// | [10, 4] | 40 | 0 |
/// | [4, 3, 5] | 30 | 1 |
///
/// Errors on an invalid shape or `unit == 0`.
pub fn prefix_dims(shape: &[usize], unit: usize) -> Result<usize> {
    block::numel(shape)?;
    if unit == 0 {
        return Err(invalid("prefix_dims", "zero unit"));
    }
    Ok(prefix_dims_unchecked(shape, unit))
}

/// [`prefix_dims`] for a validated shape and a positive unit.
fn prefix_dims_unchecked(shape: &[usize], unit: usize) -> usize {
    // prod(shape[k..]) | unit implies prod(shape[k+1..]) | unit, so scan from the back.
    let mut suffix = 1usize;
    let mut k = shape.len();
    while k > 0 {
        suffix *= shape[k - 1]; // no overflow: numel fits in usize
        if unit % suffix != 0 {
            break;
        }
        k -= 1;
    }
    k
}

/// The ragged unit of a tensor that is also `Shard(dim)`-sharded on another mesh dim
/// (planner.md §7 "Granularity with Shard(dim>0)"): `lcm(block_elems, stride(dim))` with
/// `stride(dim) = prod(shape[dim+1..])`, so that no ragged cut of the local chunk splits an
/// index of `dim`. For `dim == 0` it is `block_elems` (every cut lies inside the one chunk).
///
/// | shape | block_elems | dim | unit |
/// |---|---|---|---|
/// | [8, 6, 4] | 8 | 0 | 8 |
/// | [8, 6, 4] | 8 | 1 | 8 |
/// | [8, 6, 4] | 6 | 1 | 12 |
/// | [8, 6, 4] | 6 | 2 | 6 |
///
/// Errors on an invalid shape, `block_elems == 0`, `dim >= shape.len()` or overflow.
pub fn unit_for_outer_shard(shape: &[usize], block_elems: usize, dim: usize) -> Result<usize> {
    const OP: &str = "unit_for_outer_shard";
    block::numel(shape)?;
    if block_elems == 0 {
        return Err(invalid(OP, "zero block"));
    }
    if dim >= shape.len() {
        let why = format!("dim {dim} out of range for shape {shape:?}");
        return Err(invalid(OP, why));
    }
    if dim == 0 {
        return Ok(block_elems);
    }
    let stride: usize = shape[dim + 1..].iter().product();
    checked_lcm(block_elems, stride).ok_or_else(|| invalid(OP, "unit overflows usize"))
}

// ---------------------------------------------------------------------------------------------
// RaggedShard
// ---------------------------------------------------------------------------------------------

/// How one tensor is split over the `world` ranks of one mesh dim: rank `k` holds a contiguous
/// run of `units[k]` units of `unit` elements of the row-major flattening, in rank order.
///
/// Invariants (checked by [`RaggedShard::new`]): the shape has no zero dimension, `unit > 0`
/// (clamped to `numel`, as a block larger than the tensor is), at least one rank, and
/// `Σ units = ceil(numel / unit)` (the last unit may be short).
///
/// # Example
/// Shape `[10, 4]` with `Rows(2)` blocks (`unit` = 8 elements, 5 units) over 3 ranks with
/// `units = [2, 0, 3]`; the prefix form is `dims = (0,)`, so local shapes are whole rows:
///
/// | rank | units | element range | local shape |
/// |---|---|---|---|
/// | 0 | 2 | `[0, 16)` | `[4, 4]` |
/// | 1 | 0 | `[16, 16)` | `[0]` |
/// | 2 | 3 | `[16, 40)` | `[6, 4]` |
///
/// ```
/// use ragged::{ragged::RaggedShard, AtomicBlock};
/// let r = RaggedShard::from_block(&[10, 4], AtomicBlock::Rows(2), vec![2, 0, 3]).unwrap();
/// assert_eq!(r.range(2).unwrap(), 16..40);
/// assert_eq!(r.local_shape(2).unwrap(), vec![6, 4]);
/// assert_eq!(r.to_string(), "R[2,0,3]x8");
/// ```
///
/// `Debug` prints every field; `Display` the short form `R[units]xunit`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RaggedShard {
    shape: Vec<usize>,
    unit: usize,
    units: Vec<usize>,
}

impl RaggedShard {
    /// A layout of `units[k]` units of `unit` elements on rank `k`.
    ///
    /// Errors: [`Error::InvalidShape`] for a zero dimension; [`Error::InvalidShard`] for a zero
    /// unit, an empty `units` (world size 0), or unit counts that do not add up to
    /// `ceil(numel / unit)`.
    pub fn new(shape: &[usize], unit: usize, units: Vec<usize>) -> Result<Self> {
        const OP: &str = "RaggedShard::new";
        let numel = block::numel(shape)?;
        if unit == 0 {
            return Err(invalid(OP, "zero unit"));
        }
        if units.is_empty() {
            return Err(invalid(OP, "no ranks (world size 0)"));
        }
        let unit = unit.min(numel);
        let blocks = block::num_blocks(numel, unit);
        let total = units.iter().try_fold(0usize, |acc, &u| acc.checked_add(u));
        if total != Some(blocks) {
            let why = format!(
                "units {units:?} must add up to {blocks} (a tensor {shape:?} of {numel} elements \
                 in units of {unit})"
            );
            return Err(invalid(OP, why));
        }
        Ok(RaggedShard {
            shape: shape.to_vec(),
            unit,
            units,
        })
    }

    /// [`RaggedShard::new`] with `unit = block.elems(shape)`.
    pub fn from_block(shape: &[usize], block: AtomicBlock, units: Vec<usize>) -> Result<Self> {
        RaggedShard::new(shape, block.elems(shape)?, units)
    }

    /// The layout a planner placement implies: the tensor starts at `offset` in a buffer of
    /// `world · shard_size` elements and rank `k` owns `[k·S, (k+1)·S)`. See
    /// [`placement_units`] for the rule and the errors ([`Error::BlockSplit`] when a boundary
    /// cuts a unit).
    pub fn from_placement(
        shape: &[usize],
        unit: usize,
        offset: usize,
        shard_size: usize,
        world: usize,
    ) -> Result<Self> {
        const OP: &str = "RaggedShard::from_placement";
        let numel = block::numel(shape)?;
        let units =
            placement_units(numel, unit, offset, shard_size, world).map_err(|e| match e {
                Error::BlockSplit { block, offset, .. } => Error::BlockSplit {
                    op: OP,
                    tensor: format!("{shape:?}"),
                    block,
                    offset,
                },
                Error::InvalidShard { reason, .. } => Error::InvalidShard { op: OP, reason },
                e => e,
            })?;
        RaggedShard::new(shape, unit, units)
    }

    /// The whole tensor on `owner` (veScale's `dims=()` form; Muon's root): `unit = numel`,
    /// one unit on `owner`, none elsewhere. Errors when `owner >= world`.
    pub fn one_hot(shape: &[usize], world: usize, owner: usize) -> Result<Self> {
        const OP: &str = "RaggedShard::one_hot";
        let numel = block::numel(shape)?;
        if world == 0 {
            return Err(invalid(OP, "no ranks (world size 0)"));
        }
        check_rank(OP, owner, world)?;
        let mut units = vec![0; world];
        units[owner] = 1;
        RaggedShard::new(shape, numel, units)
    }

    /// The `torch.chunk`-like layout: `ceil(n / world)` units per rank from rank 0 (`n` units
    /// in all), trailing ranks fewer or none ([`even_units`]).
    pub fn even(shape: &[usize], unit: usize, world: usize) -> Result<Self> {
        const OP: &str = "RaggedShard::even";
        let numel = block::numel(shape)?;
        if unit == 0 {
            return Err(invalid(OP, "zero unit"));
        }
        if world == 0 {
            return Err(invalid(OP, "no ranks (world size 0)"));
        }
        let units = even_units(block::num_blocks(numel, unit.min(numel)), world)?;
        RaggedShard::new(shape, unit, units)
    }

    /// The tensor's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The unit in elements (clamped to `numel`).
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// Units per rank.
    pub fn units(&self) -> &[usize] {
        &self.units
    }

    /// Number of ranks of the mesh dim.
    pub fn world(&self) -> usize {
        self.units.len()
    }

    /// Number of elements of the tensor.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Element range `[lo, hi)` of the flattened tensor held by `rank` (its end clamped to
    /// `numel` for the short tail). O(rank). Errors when `rank >= world`.
    pub fn range(&self, rank: usize) -> Result<Range<usize>> {
        check_rank("RaggedShard::range", rank, self.world())?;
        let before: usize = self.units[..rank].iter().sum();
        let numel = self.numel();
        let lo = before.saturating_mul(self.unit).min(numel);
        let hi = (before + self.units[rank])
            .saturating_mul(self.unit)
            .min(numel);
        Ok(lo..hi)
    }

    /// The ranges of all ranks, in rank order. O(world).
    pub fn ranges(&self) -> Vec<Range<usize>> {
        unit_ranges(&self.units, self.unit, self.numel())
    }

    /// Number of elements held by `rank`. Errors when `rank >= world`.
    pub fn local_numel(&self, rank: usize) -> Result<usize> {
        Ok(self.range(rank)?.len())
    }

    /// Shape of `rank`'s piece in the prefix form (veScale): `[len / t, shape[k..]...]` with `k`
    /// the prefix dims of [`RaggedShard::to_prefix_form`] and `t = prod(shape[k..])`; `[0]` for
    /// an empty rank; the original shape for the owner of a one-hot (`k = 0`) layout.
    pub fn local_shape(&self, rank: usize) -> Result<Vec<usize>> {
        let len = self.local_numel(rank)?;
        if len == 0 {
            return Ok(vec![0]);
        }
        let k = prefix_dims_unchecked(&self.shape, self.prefix_unit());
        if k == 0 {
            return Ok(self.shape.clone());
        }
        let trailing = &self.shape[k..];
        let t: usize = trailing.iter().product();
        let mut out = Vec::with_capacity(1 + trailing.len());
        out.push(len / t);
        out.extend_from_slice(trailing);
        Ok(out)
    }

    /// The unit the prefix form is expressed in: `unit` when it divides `numel`, otherwise (short
    /// tail) the gcd of the per-rank element counts, which divides every count and `numel`.
    fn prefix_unit(&self) -> usize {
        let numel = self.numel();
        if numel % self.unit == 0 {
            return self.unit;
        }
        self.ranges().iter().fold(0, |g, r| gcd(g, r.len()))
    }

    /// veScale's `RaggedShard(dims, local_units)` for this layout. When `unit` divides `numel`
    /// the local units are `units`; with a short tail they are counted in the gcd of the
    /// per-rank element counts (same ranges, coarser unit). `dims` is [`prefix_dims`] of that
    /// unit; `dims = 0` exactly when the layout is one-hot with the whole tensor on one rank.
    pub fn to_prefix_form(&self) -> PrefixForm {
        let u = self.prefix_unit();
        let dims = prefix_dims_unchecked(&self.shape, u);
        let local_units = if u == self.unit {
            self.units.clone()
        } else {
            self.ranges().iter().map(|r| r.len() / u).collect()
        };
        PrefixForm { dims, local_units }
    }

    /// The layout of a prefix form on `shape`: the unit is `prod(shape[dims..]) · ratio` with
    /// `ratio = prod(shape[..dims]) / Σ local_units` prefix positions.
    ///
    /// Errors: `dims > ndim`, no ranks, all-zero units, `dims = 0` with units that are not
    /// one-hot, or `Σ local_units` not dividing `prod(shape[..dims])`.
    /// Round trip: `from_prefix_form(shape, &x.to_prefix_form()) == x` when `unit | numel`.
    pub fn from_prefix_form(shape: &[usize], form: &PrefixForm) -> Result<Self> {
        const OP: &str = "RaggedShard::from_prefix_form";
        block::numel(shape)?;
        let PrefixForm { dims, local_units } = form;
        if *dims > shape.len() {
            let why = format!("dims {dims} exceed the rank of shape {shape:?}");
            return Err(invalid(OP, why));
        }
        if local_units.is_empty() {
            return Err(invalid(OP, "no ranks (world size 0)"));
        }
        let total = local_units
            .iter()
            .try_fold(0usize, |acc, &u| acc.checked_add(u))
            .ok_or_else(|| invalid(OP, "local units overflow usize"))?;
        if *dims == 0 && total != 1 {
            let why = format!("dims=() needs one-hot local units, got {local_units:?}");
            return Err(invalid(OP, why));
        }
        let prefix: usize = shape[..*dims].iter().product();
        if total == 0 || prefix % total != 0 {
            let why = format!(
                "local units {local_units:?} (sum {total}) do not divide the {prefix} positions \
                 of dims {dims} of shape {shape:?}"
            );
            return Err(invalid(OP, why));
        }
        let unit = prefix / total * shape[*dims..].iter().product::<usize>();
        RaggedShard::new(shape, unit, local_units.clone())
    }

    /// Reference scatter: cuts a full flattened tensor into the ranks' local pieces.
    /// Errors when `full.len() != numel`.
    pub fn split<T: Clone>(&self, full: &[T]) -> Result<Vec<Vec<T>>> {
        if full.len() != self.numel() {
            let why = format!("{} elements for a tensor of {}", full.len(), self.numel());
            return Err(invalid("RaggedShard::split", why));
        }
        Ok(self
            .ranges()
            .into_iter()
            .map(|r| full[r].to_vec())
            .collect())
    }

    /// Reference gather: concatenates the ranks' local pieces into the flattened tensor.
    /// Errors on a wrong number of pieces or a piece of the wrong length.
    pub fn join<T: Clone>(&self, pieces: &[Vec<T>]) -> Result<Vec<T>> {
        const OP: &str = "RaggedShard::join";
        if pieces.len() != self.world() {
            return Err(Error::WorldSizeMismatch {
                op: OP,
                expected: self.world(),
                got: pieces.len(),
            });
        }
        let mut out = Vec::with_capacity(self.numel());
        for (k, (piece, r)) in pieces.iter().zip(self.ranges()).enumerate() {
            if piece.len() != r.len() {
                let why = format!(
                    "rank {k} piece has {} elements, expected {}",
                    piece.len(),
                    r.len()
                );
                return Err(invalid(OP, why));
            }
            out.extend_from_slice(piece);
        }
        Ok(out)
    }
}

impl fmt::Display for RaggedShard {
    /// `R[2,0,3]x8`: units per rank, then the unit in elements.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_list(f, "R[", &self.units, "]")?;
        write!(f, "x{}", self.unit)
    }
}

fn write_list(f: &mut fmt::Formatter<'_>, open: &str, xs: &[usize], close: &str) -> fmt::Result {
    f.write_str(open)?;
    for (i, x) in xs.iter().enumerate() {
        if i > 0 {
            f.write_str(",")?;
        }
        write!(f, "{x}")?;
    }
    f.write_str(close)
}

/// veScale's `RaggedShard(dims, local_units)`: sharding over the row-major flattening of the
/// leading dims `(0..dims)`, trailing dims never cut, one unit count per rank. The unit is
/// implied: `numel / Σ local_units` elements. `dims = 0` is the one-hot whole-tensor form.
/// Plain data; validated by [`RaggedShard::from_prefix_form`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PrefixForm {
    /// Number of leading dims sharded: `dims = (0, .., dims - 1)`.
    pub dims: usize,
    /// Units per rank.
    pub local_units: Vec<usize>,
}

impl fmt::Display for PrefixForm {
    /// `RaggedShard(dims=(0,), local_units=(2,0,3))`, as veScale writes it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RaggedShard(dims=(")?;
        for d in 0..self.dims {
            write!(f, "{d},")?;
        }
        write_list(f, "), local_units=(", &self.local_units, "))")
    }
}

// ---------------------------------------------------------------------------------------------
// StridedRaggedShard
// ---------------------------------------------------------------------------------------------

/// `(len, offset)` along `dim` of coordinate `coord`'s chunk under an outer `Shard(dim)` over
/// `split_factor` coordinates: the `torch.chunk` rule on dim 0; an exact split otherwise.
fn outer_chunk(
    shape: &[usize],
    dim: usize,
    split_factor: usize,
    coord: usize,
) -> Result<(usize, usize)> {
    const OP: &str = "StridedRaggedShard";
    block::numel(shape)?;
    if dim >= shape.len() {
        let why = format!("dim {dim} out of range for shape {shape:?}");
        return Err(invalid(OP, why));
    }
    if split_factor == 0 {
        return Err(invalid(OP, "split factor 0"));
    }
    check_rank(OP, coord, split_factor)?;
    if dim == 0 {
        return chunk_len_and_offset(shape[0], split_factor, coord);
    }
    if shape[dim] % split_factor != 0 {
        let why = format!(
            "Shard({dim}) of shape {shape:?} over {split_factor} needs dim {dim} divisible by \
             {split_factor}"
        );
        return Err(invalid(OP, why));
    }
    let len = shape[dim] / split_factor;
    Ok((len, len * coord))
}

/// Shape of coordinate `coord`'s local chunk of `shape` under an outer `Shard(dim)` over
/// `split_factor` mesh coordinates, `None` when the chunk is empty (trailing coordinates on
/// dim 0). Dim 0 follows `torch.chunk`; `dim > 0` requires `shape[dim] % split_factor == 0`
/// (as FSDP2 does) and errors otherwise.
pub fn outer_chunk_shape(
    shape: &[usize],
    dim: usize,
    split_factor: usize,
    coord: usize,
) -> Result<Option<Vec<usize>>> {
    let (len, _) = outer_chunk(shape, dim, split_factor, coord)?;
    if len == 0 {
        return Ok(None);
    }
    let mut local = shape.to_vec();
    local[dim] = len;
    Ok(Some(local))
}

/// A tensor sharded first by an outer `Shard(dim)` over `split_factor` mesh coordinates (TP/EP),
/// then by a [`RaggedShard`] of each coordinate's local chunk over the inner mesh dim: veScale's
/// `(StridedRaggedShard, Shard(0))`, generalised to any `dim`.
///
/// `per_coord[c]` is the layout of chunk `c` ([`outer_chunk_shape`]), `None` for an empty
/// chunk; all layouts share one inner world size. Example: shape `[6, 4]`, `Shard(1)` over 2
/// coordinates (chunks `[6, 2]`), each chunk `R[2,1]x4` over 2 ranks (unit = 2 rows):
///
/// | coord | rank | local range | global ranges |
/// |---|---|---|---|
/// | 0 | 0 | `[0, 8)` | `[0,2) [4,6) [8,10) [12,14)` |
/// | 0 | 1 | `[8, 12)` | `[16,18) [20,22)` |
/// | 1 | 0 | `[0, 8)` | `[2,4) [6,8) [10,12) [14,16)` |
/// | 1 | 1 | `[8, 12)` | `[18,20) [22,24)` |
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StridedRaggedShard {
    shape: Vec<usize>,
    dim: usize,
    split_factor: usize,
    per_coord: Vec<Option<RaggedShard>>,
}

impl StridedRaggedShard {
    /// Validates that there is one entry per coordinate, that each has its chunk's shape (and is
    /// `None` exactly for empty chunks), and that all share one inner world size.
    pub fn new(
        shape: &[usize],
        dim: usize,
        split_factor: usize,
        per_coord: Vec<Option<RaggedShard>>,
    ) -> Result<Self> {
        const OP: &str = "StridedRaggedShard::new";
        if split_factor == 0 {
            return Err(invalid(OP, "split factor 0"));
        }
        if per_coord.len() != split_factor {
            return Err(Error::WorldSizeMismatch {
                op: OP,
                expected: split_factor,
                got: per_coord.len(),
            });
        }
        let mut inner_world = None;
        for (c, layout) in per_coord.iter().enumerate() {
            let want = outer_chunk_shape(shape, dim, split_factor, c)?;
            let got = layout.as_ref().map(|r| r.shape());
            if want.as_deref() != got {
                let why =
                    format!("coordinate {c} holds a chunk of shape {want:?}, layout has {got:?}");
                return Err(invalid(OP, why));
            }
            if let Some(r) = layout {
                match inner_world {
                    None => inner_world = Some(r.world()),
                    Some(w) if w != r.world() => {
                        return Err(Error::WorldSizeMismatch {
                            op: OP,
                            expected: w,
                            got: r.world(),
                        })
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(StridedRaggedShard {
            shape: shape.to_vec(),
            dim,
            split_factor,
            per_coord,
        })
    }

    /// Every non-empty chunk laid out by [`RaggedShard::even`] with `unit` over `inner_world`
    /// ranks (take `unit` from [`unit_for_outer_shard`]).
    pub fn even(
        shape: &[usize],
        dim: usize,
        split_factor: usize,
        unit: usize,
        inner_world: usize,
    ) -> Result<Self> {
        let per_coord = (0..split_factor)
            .map(|c| {
                outer_chunk_shape(shape, dim, split_factor, c)?
                    .map(|local| RaggedShard::even(&local, unit, inner_world))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        StridedRaggedShard::new(shape, dim, split_factor, per_coord)
    }

    /// The global shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The dim of the outer `Shard(dim)`.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Number of outer mesh coordinates.
    pub fn split_factor(&self) -> usize {
        self.split_factor
    }

    /// Number of ranks of the inner (ragged) mesh dim.
    pub fn inner_world(&self) -> usize {
        // Chunk 0 is never empty, so per_coord[0] is always Some.
        self.per_coord
            .iter()
            .flatten()
            .map(RaggedShard::world)
            .next()
            .unwrap_or(0)
    }

    /// The ragged layout of each coordinate's chunk (`None` for an empty chunk).
    pub fn per_coord(&self) -> &[Option<RaggedShard>] {
        &self.per_coord
    }

    /// Element ranges of the global flattened tensor held by (outer `coord`, inner `rank`),
    /// ascending and merged where contiguous: at most one range for `dim = 0`, up to
    /// `prod(shape[..dim])` for `dim > 0`. Empty for an empty chunk or rank.
    pub fn global_ranges(&self, coord: usize, rank: usize) -> Result<Vec<Range<usize>>> {
        const OP: &str = "StridedRaggedShard::global_ranges";
        check_rank(OP, coord, self.split_factor)?;
        check_rank(OP, rank, self.inner_world())?;
        let Some(layout) = &self.per_coord[coord] else {
            return Ok(Vec::new());
        };
        let (len, offset) = outer_chunk(&self.shape, self.dim, self.split_factor, coord)?;
        let stride: usize = self.shape[self.dim + 1..].iter().product();
        let local_block = len * stride; // one index of the leading dims, in the chunk
        let global_block = self.shape[self.dim] * stride; // the same, in the full tensor
        let local = layout.range(rank)?;
        let mut out: Vec<Range<usize>> = Vec::new();
        let mut i = local.start;
        while i < local.end {
            let (q, r) = (i / local_block, i % local_block);
            let end = local.end.min((q + 1) * local_block);
            let g = q * global_block + offset * stride + r;
            let piece = g..g + (end - i);
            match out.last_mut() {
                Some(last) if last.end == piece.start => last.end = piece.end,
                _ => out.push(piece),
            }
            i = end;
        }
        Ok(out)
    }
}

impl fmt::Display for StridedRaggedShard {
    /// `S(1)x2:[R[2,1]x4,R[2,1]x4]`, `-` for an empty chunk.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "S({})x{}:[", self.dim, self.split_factor)?;
        for (i, layout) in self.per_coord.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            match layout {
                Some(r) => write!(f, "{r}")?,
                None => f.write_str("-")?,
            }
        }
        f.write_str("]")
    }
}

// ---------------------------------------------------------------------------------------------
// Redistribution
// ---------------------------------------------------------------------------------------------

/// One contiguous copy of a redistribution: `len` elements from offset `src_offset` of rank
/// `src_rank`'s local piece to offset `dst_offset` of rank `dst_rank`'s local piece (offsets
/// and lengths in elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Transfer {
    pub src_rank: usize,
    pub dst_rank: usize,
    pub src_offset: usize,
    pub dst_offset: usize,
    pub len: usize,
}

/// The transfers that turn `src`'s layout of a tensor into `dst`'s: the one redistribution
/// path. Checkpoint resharding runs them from the saved layout to the new one (the world sizes
/// may differ: `checkpoint::read`); Muon's gather to its roots, from a split matrix's layout to
/// [`RaggedShard::one_hot`] on its root, batches them into one all-to-all
/// (`ragged_optimizers::roots`).
///
/// Every non-empty intersection of a source range with a destination range becomes one
/// [`Transfer`], `src_rank == dst_rank` pieces (local copies) included. A two-pointer sweep over
/// both range lists: O(world_src + world_dst) time, at most `world_src + world_dst - 1`
/// transfers, returned sorted by `(src_rank, dst_rank)` (which is also element order). Every
/// element is moved exactly once.
///
/// Errors when the shapes differ.
pub fn redistribute(src: &RaggedShard, dst: &RaggedShard) -> Result<Vec<Transfer>> {
    if src.shape != dst.shape {
        let why = format!(
            "source shape {:?} differs from destination shape {:?}",
            src.shape, dst.shape
        );
        return Err(invalid("redistribute", why));
    }
    let (a, b) = (src.ranges(), dst.ranges());
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (ra, rb) = (&a[i], &b[j]);
        let (lo, hi) = (ra.start.max(rb.start), ra.end.min(rb.end));
        if lo < hi {
            out.push(Transfer {
                src_rank: i,
                dst_rank: j,
                src_offset: lo - ra.start,
                dst_offset: lo - rb.start,
                len: hi - lo,
            });
        }
        if ra.end <= rb.end {
            i += 1;
        } else {
            j += 1;
        }
    }
    Ok(out)
}

/// Reference executor: runs `transfers` on the source ranks' local pieces and returns the
/// destination ranks' pieces for layout `dst` (elements no transfer writes keep
/// `T::default()`). Errors when a transfer names a missing rank or runs past a piece.
pub fn apply_transfers<T: Clone + Default>(
    transfers: &[Transfer],
    src_pieces: &[Vec<T>],
    dst: &RaggedShard,
) -> Result<Vec<Vec<T>>> {
    const OP: &str = "apply_transfers";
    let mut out: Vec<Vec<T>> = dst
        .ranges()
        .into_iter()
        .map(|r| vec![T::default(); r.len()])
        .collect();
    for t in transfers {
        let src = src_pieces.get(t.src_rank);
        let src_end = t.src_offset.checked_add(t.len);
        let dst_end = t.dst_offset.checked_add(t.len);
        let dst_len = out.get(t.dst_rank).map(Vec::len);
        match (src, src_end, dst_end, dst_len) {
            (Some(s), Some(se), Some(de), Some(dl)) if se <= s.len() && de <= dl => {
                out[t.dst_rank][t.dst_offset..de].clone_from_slice(&s[t.src_offset..se]);
            }
            _ => {
                let why = format!("{t:?} does not fit the source or destination pieces");
                return Err(invalid(OP, why));
            }
        }
    }
    Ok(out)
}
