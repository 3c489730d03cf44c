//! Baseline layouts: how PyTorch FSDP2, Megatron-FSDP, FSDP1 and DeepSpeed ZeRO-3 place and pad
//! a model's parameters, as pure arithmetic over an [`Inventory`].
//!
//! These are the comparison points for the RaggedShard planner (`reference/baselines.md`). Each
//! layout answers, per group: the comm-buffer size (`V ×` per-rank shard) and, per (parameter,
//! rank), which elements of the parameter the rank holds and where they sit in its shard.
//! [`cut_blocks`] counts the atomic blocks that rank boundaries split. Nothing is allocated
//! besides small index vectors.
//!
//! # Vocabulary
//! `V` = world size; `rows = shape[0]` and `row = prod(shape[1:])` (a 0-D tensor counts as
//! `[1]`; note this "row" is **not** [`crate::block`]'s row, which is the last dimension);
//! *buffer* = all-gather output of a group; *shard* = one rank's `buffer / V` elements.
//!
//! # The four layouts
//! | baseline | group | placement | per-tensor cost |
//! |---|---|---|---|
//! | FSDP2 | one per unit | per parameter: rank `r` holds rows `[r·c, (r+1)·c)`, `c = ⌈rows/V⌉` | `V·c·row` |
//! | Megatron-FSDP | unit × dtype × expert | contiguous, chunk-size-factor grid | bucket rounds up to `V·csf` |
//! | FSDP1 | unit × dtype | contiguous flat parameter, `16/itemsize` alignment | unit rounds up to `V` |
//! | ZeRO-3 | unit × dtype | per parameter: rank `r` holds `[r·p, (r+1)·p)`, `p = ⌈numel/V⌉` | `V·p` |
//!
//! Example, one `[5, 3]` tensor at `V = 4`:
//!
//! | rank | FSDP2 rows | FSDP2 elements | ZeRO-3 elements |
//! |---|---|---|---|
//! | 0 | 0..2 | 0..6 | 0..4 |
//! | 1 | 2..4 | 6..12 | 4..8 |
//! | 2 | 4..5 | 12..15 | 8..12 |
//! | 3 | — | — | 12..15 |
//!
//! FSDP2's buffer is `4·6 = 24` elements, ZeRO-3's `4·4 = 16`.
//!
//! # Layout of a per-parameter (chunked) group
//! FSDP2 and ZeRO-3 buffers are **rank-major**: each rank's shard is the concatenation of every
//! parameter's padded chunk, so a tensor is not contiguous in the buffer. Their rank boundaries,
//! seen from one tensor, are the multiples of its chunk size. Megatron-FSDP and FSDP1 place each
//! tensor contiguously at an offset of the group buffer, and rank `r` owns
//! `[r·shard, (r+1)·shard)` of it.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use crate::block::AtomicBlock;
use crate::model::{Inventory, TensorSpec};
use crate::{Context, Error, Result};

/// The comparison systems.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Baseline {
    /// PyTorch `fully_shard` with the default `Shard(0)` placement.
    Fsdp2,
    /// Megatron-FSDP (DP-LCM buckets, `megatron_fsdp/param_and_grad_buffer.py`).
    MegatronFsdp,
    /// PyTorch `FullyShardedDataParallel` (one FlatParameter per unit).
    Fsdp1,
    /// DeepSpeed ZeRO stage 3.
    Zero3,
}

impl Baseline {
    /// Every baseline, in the order of the tables of `baselines.md`.
    pub const ALL: [Baseline; 4] = [
        Baseline::Fsdp2,
        Baseline::MegatronFsdp,
        Baseline::Fsdp1,
        Baseline::Zero3,
    ];
}

impl fmt::Display for Baseline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Baseline::Fsdp2 => "FSDP2",
            Baseline::MegatronFsdp => "Megatron-FSDP",
            Baseline::Fsdp1 => "FSDP1",
            Baseline::Zero3 => "ZeRO-3",
        })
    }
}

impl FromStr for Baseline {
    type Err = Error;

    /// Parses the display name or a short form (`fsdp2`, `megatron`, `fsdp1`, `zero3`),
    /// ignoring case, `-` and `_`.
    fn from_str(s: &str) -> Result<Self> {
        let key: String = s
            .chars()
            .filter(|c| !matches!(c, '-' | '_' | ' '))
            .collect::<String>()
            .to_ascii_lowercase();
        match key.as_str() {
            "fsdp2" => Ok(Baseline::Fsdp2),
            "megatron" | "megatronfsdp" | "mfsdp" => Ok(Baseline::MegatronFsdp),
            "fsdp1" | "fsdp" => Ok(Baseline::Fsdp1),
            "zero3" | "zero" | "deepspeed" => Ok(Baseline::Zero3),
            _ => Err(Error::BadInput {
                op: "Baseline::from_str",
                what: format!("baseline {s:?}"),
                reason: "expected fsdp2, megatron, fsdp1 or zero3".into(),
            }),
        }
    }
}

/// FSDP1's per-parameter address alignment inside a FlatParameter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Fsdp1Align {
    /// `use_orig_params=True`: each parameter starts on a 16-byte boundary, i.e. a multiple of
    /// `16 / itemsize` elements (8 for bf16, 4 for fp32).
    #[default]
    Aligned,
    /// `use_orig_params=False`: parameters are packed back to back.
    None,
}

/// Knobs of the baseline layouts; [`Default`] gives the `baselines.md` defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BaselineOptions {
    /// FSDP1 alignment (default [`Fsdp1Align::Aligned`]).
    pub fsdp1_align: Fsdp1Align,
    /// Megatron-FSDP `ddp_config.bucket_size` in elements: parameters outside any decoder layer
    /// are split into buckets that close once they hold at least this many elements. Default
    /// `None`: no split.
    pub megatron_bucket: Option<u64>,
}

/// Where one tensor's elements sit in its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Contiguous at `offset` of the group buffer (Megatron-FSDP, FSDP1); rank `r` owns buffer
    /// elements `[r·shard, (r+1)·shard)`.
    Flat { offset: u64, shard: u64 },
    /// Per-parameter chunks (FSDP2, ZeRO-3): rank `r` holds tensor elements
    /// `[r·chunk, min((r+1)·chunk, numel))` at `local_offset` of its shard, followed by zero
    /// padding up to `chunk` elements.
    Chunked { chunk: u64, local_offset: u64 },
}

/// One tensor of a group and its placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRange {
    pub name: String,
    pub numel: u64,
    pub placement: Placement,
}

impl TensorRange {
    /// The elements of this tensor held by `rank`, as `(tensor element range, offset in the
    /// rank's shard)`. Every baseline gives a rank at most one piece per tensor; the vector is
    /// empty when the rank holds none of it (including `rank ≥ V`).
    pub fn rank_pieces(&self, rank: usize) -> Vec<(Range<u64>, u64)> {
        let r = rank as u64;
        match self.placement {
            Placement::Flat { offset, shard } => {
                let (lo, hi) = (r.saturating_mul(shard), (r + 1).saturating_mul(shard));
                let start = lo.max(offset);
                let end = hi.min(offset + self.numel);
                if start >= end {
                    return Vec::new();
                }
                vec![(start - offset..end - offset, start - lo)]
            }
            Placement::Chunked {
                chunk,
                local_offset,
            } => {
                let start = r.saturating_mul(chunk);
                let end = (r + 1).saturating_mul(chunk).min(self.numel);
                if start >= end {
                    return Vec::new();
                }
                vec![(start..end, local_offset)]
            }
        }
    }
}

/// One group's layout: buffer elements (`= V ×` per-rank shard) and where each tensor sits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupLayout {
    pub name: String,
    pub buffer_elems: u64,
    pub shard_elems: u64,
    pub tensors: Vec<TensorRange>,
}

/// A whole model laid out by one baseline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaselineLayout {
    pub baseline: Baseline,
    pub world: usize,
    pub groups: Vec<GroupLayout>,
    /// `N`, the model's element count.
    pub model_elems: u64,
    /// Summed buffer size of all groups.
    pub buffer_elems: u64,
}

impl BaselineLayout {
    /// Padding as a fraction of the model: `(buffer − N) / N`.
    pub fn padding_frac(&self) -> f64 {
        (self.buffer_elems - self.model_elems) as f64 / self.model_elems as f64
    }

    /// Padding elements, `buffer − N`.
    pub fn padding_elems(&self) -> u64 {
        self.buffer_elems - self.model_elems
    }
}

/// Lays `inv` out the way `baseline` would on `world` ranks.
///
/// Errors when `world` is 0, the inventory is empty, or a size overflows `u64`.
pub fn layout(
    baseline: Baseline,
    inv: &Inventory,
    world: usize,
    opts: &BaselineOptions,
) -> Result<BaselineLayout> {
    if world == 0 {
        return Err(Error::BadInput {
            op: "baselines::layout",
            what: "world size 0".into(),
            reason: "a layout needs at least one rank".into(),
        });
    }
    if inv.tensors.is_empty() {
        return Err(Error::BadInput {
            op: "baselines::layout",
            what: format!("model {}", inv.model),
            reason: "no parameters".into(),
        });
    }
    let v = world as u64;
    let groups = match baseline {
        Baseline::Fsdp2 => fsdp2(inv, v)?,
        Baseline::MegatronFsdp => megatron(inv, v, opts.megatron_bucket)?,
        Baseline::Fsdp1 => fsdp1(inv, v, opts.fsdp1_align)?,
        Baseline::Zero3 => zero3(inv, v)?,
    };
    let buffer_elems = groups
        .iter()
        .try_fold(0u64, |acc, g| acc.checked_add(g.buffer_elems))
        .ok_or_else(|| overflow("baselines::layout"))?;
    Ok(BaselineLayout {
        baseline,
        world,
        groups,
        model_elems: inv.total_params(),
        buffer_elems,
    })
}

/// Atomic blocks of `block` (per tensor, [`AtomicBlock::elems`]) that rank boundaries split.
///
/// A tensor at `[l, l + e)` of a buffer cut every `s` elements loses one block for every
/// boundary `k·s` with `l < k·s < l + e` and `(k·s − l) mod g ≠ 0`, `g` its block size. For
/// FSDP2 and ZeRO-3 the boundaries are the tensor's own chunk edges (`l = 0`, `s = chunk`).
/// Counted analytically per tensor, without iterating over ranks.
///
/// Errors when a layout tensor is missing from `inv` or differs in size, or when `block` does
/// not fit a tensor's shape.
pub fn cut_blocks(layout: &BaselineLayout, inv: &Inventory, block: AtomicBlock) -> Result<u64> {
    let by_name: HashMap<&str, &TensorSpec> =
        inv.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut cuts = 0u64;
    for group in &layout.groups {
        for t in &group.tensors {
            let spec = by_name
                .get(t.name.as_str())
                .ok_or_else(|| Error::BadInput {
                    op: "baselines::cut_blocks",
                    what: format!("tensor {}", t.name),
                    reason: format!("not in inventory {}", inv.model),
                })?;
            if spec.numel() as u64 != t.numel {
                return Err(Error::BadInput {
                    op: "baselines::cut_blocks",
                    what: format!("tensor {}", t.name),
                    reason: format!(
                        "layout has {} elements, inventory {}",
                        t.numel,
                        spec.numel()
                    ),
                });
            }
            let g = block
                .elems(&spec.shape)
                .with_context(|| format!("cut_blocks: tensor {}", t.name))?
                as u64;
            let (start, step) = match t.placement {
                Placement::Flat { offset, shard } => (offset, shard),
                Placement::Chunked { chunk, .. } => (0, chunk),
            };
            cuts += misaligned_boundaries(start, t.numel, step, g);
        }
    }
    Ok(cuts)
}

/// Megatron-FSDP's chunk size factor of a bucket, from its parameters' `(row, numel)` in bucket
/// order (`row = prod(shape[1:])`). The bucket is first sorted stably by row, descending; csf
/// starts at the first row and becomes `lcm(csf, row)` for each parameter unless `row == csf`,
/// or `csf % row == 0` and `numel % csf == 0`, or `numel < csf`.
///
/// Errors on an empty list or a zero size.
pub fn megatron_chunk_size_factor(rows_numels: &[(u64, u64)]) -> Result<u64> {
    if rows_numels.iter().any(|&(r, n)| r == 0 || n == 0) {
        return Err(Error::BadInput {
            op: "megatron_chunk_size_factor",
            what: "parameter sizes".into(),
            reason: "a row or element count is zero".into(),
        });
    }
    let mut sorted = rows_numels.to_vec();
    sorted.sort_by_key(|&(row, _)| std::cmp::Reverse(row));
    csf_of_sorted(&sorted).ok_or_else(|| Error::BadInput {
        op: "megatron_chunk_size_factor",
        what: "parameter sizes".into(),
        reason: "empty bucket, or the LCM of its rows overflows u64".into(),
    })
}

/// Megatron-FSDP's placement (`build_data_parallel_buffer_index`) of items of `numels` elements,
/// given in bucket order, on a grid of `csf` elements. Returns each item's offset (same order
/// as `numels`) and the end cursor `D`; the bucket is then `⌈D/(V·csf)⌉·V·csf` elements.
///
/// | step | rule |
/// |---|---|
/// | split | items with `numel < csf` are fragments, the rest regular |
/// | grid item | `numel % csf == 0`: place at `D`, `D += numel` |
/// | other item `x` | place at `D`; gap starts at `D + x`; `D += (x/csf + 1)·csf` |
/// | pairing | first later regular `y` with `y % csf ≠ 0` and `x%csf + y%csf ≤ csf` goes at `D − y%csf`; `D += (y/csf)·csf` |
/// | gap filling | fragments, in order, that fit the remaining gap go at the gap start |
/// | end | leftover fragments appended at `D` |
///
/// Example: `[24, 10, 5]`, csf 8 → offsets `[0, 24, 34]`, `D = 40`.
///
/// Errors when `csf` is 0.
pub fn megatron_place(numels: &[u64], csf: u64) -> Result<(Vec<u64>, u64)> {
    if csf == 0 {
        return Err(Error::BadInput {
            op: "megatron_place",
            what: "chunk size factor 0".into(),
            reason: "the grid needs a positive chunk size".into(),
        });
    }
    Ok(place_on_grid(numels, csf))
}

// ---------------------------------------------------------------------------------------------
// Shared arithmetic.

fn overflow(op: &'static str) -> Error {
    Error::BadInput {
        op,
        what: "sizes".into(),
        reason: "element count overflows u64".into(),
    }
}

fn mul(op: &'static str, a: u64, b: u64) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| overflow(op))
}

/// `rows = shape[0]`, `row = prod(shape[1:])`, with 0-D as `[1]`.
fn rows_and_row(shape: &[usize]) -> (u64, u64) {
    match shape.split_first() {
        None => (1, 1),
        Some((&rows, rest)) => (rows as u64, rest.iter().map(|&d| d as u64).product()),
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn lcm(a: u64, b: u64) -> Option<u64> {
    (a / gcd(a, b)).checked_mul(b)
}

/// Inverse of `a` modulo `m` (`gcd(a, m) = 1`, `m > 1`), by the extended Euclidean algorithm.
fn mod_inverse(a: u64, m: u64) -> u64 {
    let (mut r0, mut r1) = (m as i128, (a % m) as i128);
    let (mut t0, mut t1) = (0i128, 1i128);
    while r1 != 0 {
        let q = r0 / r1;
        (r0, r1) = (r1, r0 - q * r1);
        (t0, t1) = (t1, t0 - q * t1);
    }
    debug_assert_eq!(r0, 1, "mod_inverse: {a} is not invertible modulo {m}");
    t0.rem_euclid(m as i128) as u64
}

/// Number of boundaries `k·s` strictly inside `[l, l + e)` with `(k·s − l) mod g ≠ 0`: the
/// blocks of `g` elements (measured from `l`) that a grid of step `s` splits. O(log) time.
fn misaligned_boundaries(l: u64, e: u64, s: u64, g: u64) -> u64 {
    if s == 0 || e <= 1 || g <= 1 {
        return 0;
    }
    let k_lo = l / s + 1; // first k with k·s > l
    let k_hi = (l + e - 1) / s; // last k with k·s < l + e
    if k_hi < k_lo {
        return 0;
    }
    let inside = k_hi - k_lo + 1;
    // Aligned boundaries solve k·s ≡ l (mod g).
    let (s_mod, l_mod) = (s % g, l % g);
    let d = gcd(s_mod, g);
    if l_mod % d != 0 {
        return inside;
    }
    let m = g / d;
    let k0 = if m == 1 {
        0
    } else {
        ((l_mod / d) as u128 * mod_inverse(s_mod / d, m) as u128 % m as u128) as u64
    };
    // Count of k ≡ k0 (mod m) in [0, x].
    let upto = |x: u64| if x < k0 { 0 } else { (x - k0) / m + 1 };
    inside - (upto(k_hi) - upto(k_lo - 1))
}

/// A group of per-parameter chunks laid out rank-major; `chunk_of(t)` is a tensor's chunk.
fn chunked_group(
    name: String,
    tensors: &[&TensorSpec],
    v: u64,
    chunk_of: impl Fn(&TensorSpec) -> u64,
) -> Result<GroupLayout> {
    let mut shard = 0u64;
    let mut ranges = Vec::with_capacity(tensors.len());
    for t in tensors {
        let chunk = chunk_of(t);
        ranges.push(TensorRange {
            name: t.name.clone(),
            numel: t.numel() as u64,
            placement: Placement::Chunked {
                chunk,
                local_offset: shard,
            },
        });
        shard = shard
            .checked_add(chunk)
            .ok_or_else(|| overflow("baselines::layout"))?;
    }
    Ok(GroupLayout {
        name,
        buffer_elems: mul("baselines::layout", v, shard)?,
        shard_elems: shard,
        tensors: ranges,
    })
}

/// A group of tensors placed contiguously at `offsets` in a buffer of `buffer` elements.
fn flat_group(
    name: String,
    tensors: &[&TensorSpec],
    offsets: &[u64],
    buffer: u64,
    v: u64,
) -> GroupLayout {
    let shard = buffer / v;
    GroupLayout {
        name,
        buffer_elems: buffer,
        shard_elems: shard,
        tensors: tensors
            .iter()
            .zip(offsets)
            .map(|(t, &offset)| TensorRange {
                name: t.name.clone(),
                numel: t.numel() as u64,
                placement: Placement::Flat { offset, shard },
            })
            .collect(),
    }
}

/// Splits a unit's tensors by `key`, keeping the order of first appearance.
fn split_by<'a, K: PartialEq>(
    tensors: &[&'a TensorSpec],
    key: impl Fn(&TensorSpec) -> K,
) -> Vec<(K, Vec<&'a TensorSpec>)> {
    let mut out: Vec<(K, Vec<&TensorSpec>)> = Vec::new();
    for &t in tensors {
        let k = key(t);
        match out.iter_mut().find(|(key, _)| *key == k) {
            Some((_, list)) => list.push(t),
            None => out.push((k, vec![t])),
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The four baselines.

/// FSDP2: one group per unit; each parameter padded to `V·⌈rows/V⌉` rows.
fn fsdp2(inv: &Inventory, v: u64) -> Result<Vec<GroupLayout>> {
    inv.units()
        .iter()
        .map(|unit| {
            chunked_group(unit.name.clone(), &unit.tensors, v, |t| {
                let (rows, row) = rows_and_row(&t.shape);
                rows.div_ceil(v) * row
            })
        })
        .collect()
}

/// ZeRO-3: one group per unit and dtype (the coalesced all-gather runs per dtype); each
/// parameter padded to `V·⌈numel/V⌉` elements.
fn zero3(inv: &Inventory, v: u64) -> Result<Vec<GroupLayout>> {
    let mut groups = Vec::new();
    for unit in inv.units() {
        for (dtype, tensors) in split_by(&unit.tensors, |t| t.dtype) {
            let name = format!("{}/{dtype}", unit.name);
            groups.push(chunked_group(name, &tensors, v, |t| {
                (t.numel() as u64).div_ceil(v)
            })?);
        }
    }
    Ok(groups)
}

/// FSDP1: one FlatParameter per unit and dtype, each parameter aligned to `16/itemsize`
/// elements (never padded before the first), the total rounded up to a multiple of `V`.
fn fsdp1(inv: &Inventory, v: u64, align: Fsdp1Align) -> Result<Vec<GroupLayout>> {
    let mut groups = Vec::new();
    for unit in inv.units() {
        for (dtype, tensors) in split_by(&unit.tensors, |t| t.dtype) {
            let a = match align {
                Fsdp1Align::Aligned => (16 / dtype.size_in_bytes()).max(1) as u64,
                Fsdp1Align::None => 1,
            };
            let mut total = 0u64;
            let mut offsets = Vec::with_capacity(tensors.len());
            for t in &tensors {
                total += (a - total % a) % a;
                offsets.push(total);
                total = total
                    .checked_add(t.numel() as u64)
                    .ok_or_else(|| overflow("baselines::layout"))?;
            }
            let buffer = mul("baselines::layout", total.div_ceil(v), v)?;
            let name = format!("{}/{dtype}", unit.name);
            groups.push(flat_group(name, &tensors, &offsets, buffer, v));
        }
    }
    Ok(groups)
}

/// Megatron-FSDP: buckets by (unit, dtype, expert), the root optionally split by size; each
/// bucket sorted by row, placed on its csf grid and rounded up to `V·csf`.
fn megatron(inv: &Inventory, v: u64, bucket: Option<u64>) -> Result<Vec<GroupLayout>> {
    let mut groups = Vec::new();
    let units = inv.units();
    for unit in &units {
        let is_root = unit.name == "root";
        let split = split_by(&unit.tensors, |t| (t.dtype, t.name.contains(".experts.")));
        for ((dtype, expert), tensors) in split {
            let base = format!(
                "{}/{dtype}{}",
                unit.name,
                if expert { "/experts" } else { "" }
            );
            let buckets = match bucket.filter(|_| is_root) {
                Some(size) => split_by_size(tensors, size),
                None => vec![tensors],
            };
            let many = buckets.len() > 1;
            for (i, b) in buckets.into_iter().enumerate() {
                let name = if many {
                    format!("{base}#{i}")
                } else {
                    base.clone()
                };
                groups.push(megatron_bucket(name, b, v)?);
            }
        }
    }
    Ok(groups)
}

/// Consecutive buckets, each closed once it holds at least `size` elements.
fn split_by_size(tensors: Vec<&TensorSpec>, size: u64) -> Vec<Vec<&TensorSpec>> {
    let mut out = Vec::new();
    let mut cur = Vec::new();
    let mut elems = 0u64;
    for t in tensors {
        cur.push(t);
        elems += t.numel() as u64;
        if elems >= size {
            out.push(std::mem::take(&mut cur));
            elems = 0;
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn megatron_bucket(name: String, mut tensors: Vec<&TensorSpec>, v: u64) -> Result<GroupLayout> {
    tensors.sort_by_key(|t| std::cmp::Reverse(rows_and_row(&t.shape).1));
    let rows_numels: Vec<(u64, u64)> = tensors
        .iter()
        .map(|t| (rows_and_row(&t.shape).1, t.numel() as u64))
        .collect();
    let csf = csf_of_sorted(&rows_numels).ok_or_else(|| overflow("baselines::layout"))?;
    let numels: Vec<u64> = rows_numels.iter().map(|&(_, n)| n).collect();
    let (offsets, end) = place_on_grid(&numels, csf);
    let unit = mul("baselines::layout", v, csf)?;
    let buffer = mul("baselines::layout", end.div_ceil(unit), unit)?;
    Ok(flat_group(name, &tensors, &offsets, buffer, v))
}

/// csf of a bucket already sorted by row, descending; `None` if empty or on overflow.
fn csf_of_sorted(rows_numels: &[(u64, u64)]) -> Option<u64> {
    let mut csf = rows_numels.first()?.0;
    for &(row, numel) in rows_numels {
        let keep = row == csf || (csf % row == 0 && numel % csf == 0) || numel < csf;
        if !keep {
            csf = lcm(csf, row)?;
        }
    }
    Some(csf)
}

/// The placement of [`megatron_place`]; `csf > 0`.
fn place_on_grid(numels: &[u64], csf: u64) -> (Vec<u64>, u64) {
    let mut offsets = vec![0u64; numels.len()];
    let (regular, mut fragments): (Vec<usize>, Vec<usize>) =
        (0..numels.len()).partition(|&i| numels[i] >= csf);
    let mut taken = vec![false; regular.len()];
    let mut d = 0u64;
    for next in 0..regular.len() {
        if taken[next] {
            continue;
        }
        taken[next] = true;
        let x = numels[regular[next]];
        offsets[regular[next]] = d;
        let rem = x % csf;
        if rem == 0 {
            d += x;
            continue;
        }
        let mut gap = d + x;
        d += (x / csf + 1) * csf;
        let mut space = csf - rem;
        let partner = (next + 1..regular.len()).find(|&j| {
            let r = numels[regular[j]] % csf;
            !taken[j] && r != 0 && rem + r <= csf
        });
        if let Some(j) = partner {
            taken[j] = true;
            let y = numels[regular[j]];
            offsets[regular[j]] = d - y % csf;
            space -= y % csf;
            d += (y / csf) * csf;
        }
        fragments.retain(|&f| {
            if numels[f] > space {
                return true;
            }
            offsets[f] = gap;
            gap += numels[f];
            space -= numels[f];
            false
        });
    }
    for f in fragments {
        offsets[f] = d;
        d += numels[f];
    }
    (offsets, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force of [`misaligned_boundaries`].
    fn brute(l: u64, e: u64, s: u64, g: u64) -> u64 {
        (1..=(l + e) / s.max(1))
            .map(|k| k * s)
            .filter(|&b| b > l && b < l + e && (b - l) % g != 0)
            .count() as u64
    }

    #[test]
    fn misaligned_boundaries_matches_brute_force() {
        for l in 0..40 {
            for e in 1..40 {
                for s in 1..13 {
                    for g in 1..11 {
                        assert_eq!(
                            misaligned_boundaries(l, e, s, g),
                            brute(l, e, s, g),
                            "l={l} e={e} s={s} g={g}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn mod_inverse_inverts() {
        for m in 2..50u64 {
            for a in 1..m {
                if gcd(a, m) == 1 {
                    assert_eq!(a * mod_inverse(a, m) % m, 1, "a={a} m={m}");
                }
            }
        }
    }
}
