//! The layout planner: packs the tensors of one FSDP unit into one buffer of `V` equal shards
//! so that no shard boundary splits an atomic block (`reference/planner.md`).
//!
//! The planner is data first: [`plan_items`] works on integers ([`Item`]: element count, block
//! size, start alignment) and returns a [`Layout`] (shard size `S`, one offset per tensor);
//! [`plan_one_buffer`] adds a layout built shard by shard where that is smaller;
//! [`plan_unit`] and [`plan_model`] attach names, shapes and blocks and return a [`Plan`]. Nothing
//! is allocated for tensor data, so memory per rank is known before any buffer exists
//! ([`Plan::shard_bytes`]).
//!
//! | piece | file |
//! |---|---|
//! | feasibility of one `S` for one order (greedy earliest fit) | [`fit`] |
//! | search over `S` (prefix lattices, bisection, exact finish) | [`search`] |
//! | exact oracles for small inputs | [`oracle`] |
//! | the exact optimum of a small unit over partitions and orders (gap analysis) | [`exact_partition`] |
//! | a unit as up to `K` buffers, each with its own `S` | [`multi`] |
//! | which tensors share a buffer (search over partitions of block-size classes) | [`partition`] |
//! | moves of tensors between those buffers (local search) | [`refine`] |
//! | identical tensors split across buffers by count | [`split`] |
//! | a layout built shard by shard (a last pass over one buffer and the chosen buffers) | [`shard_fill`] |
//! | the `k`-buffer floor, a lower bound over every partition into `k` buffers | [`floor`] |
//! | its second bound, placing the largest tensors one by one | [`heavy_floor`] |
//! | its third bound, following the tensors of each large shape together | [`class_floor`] |
//! | its fourth bound, the gcd of the forced tensors' lattices (their lcm in one buffer) | [`step_floor`] |
//! | its fifth bound, the parts of tensors inside one shard | [`piece_floor`] |
//! | its sixth bound, the forced tensors' lattices in a coarse and a fine class | [`lattice_floor`] |
//! | its seventh bound (one buffer), the residues of pieces when the shards hold exactly `m` | [`residue_floor`] |
//! | an eighth bound, the padding of the buffer holding a given shape (residues of contents) | [`content_floor`] |
//! | a ninth bound (one buffer), the shards tensors off a step can reach past it | [`excess_floor`] |
//! | a tenth bound (one buffer), the residues of bound seven with a budget of empty pieces | [`waste_floor`] |
//! | an eleventh bound (at most two buffers), every split of a sum, with the padding of segments of shards | [`pair_floor`] |
//! | multi-buffer plans of units and models (each buffer an ordinary [`Plan`]) | [`multi_model`] |
//! | FSDP2, Megatron-FSDP, FSDP1, ZeRO-3 layouts for comparison | [`baselines`] |

pub mod baselines;
pub mod class_floor;
pub mod content_floor;
pub mod exact_partition;
pub mod excess_floor;
pub mod export;
pub mod fit;
pub mod floor;
pub mod heavy_floor;
pub mod lattice_floor;
pub mod multi;
pub mod multi_model;
pub mod oracle;
pub mod pair_floor;
pub mod partition;
pub mod piece_floor;
pub mod refine;
pub mod residue_floor;
pub mod search;
pub mod shard_fill;
pub mod split;
pub mod step_floor;
pub mod waste_floor;

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

use crate::model::{DType, Inventory, TensorSpec, Unit};
use crate::ragged::{placement_units, RaggedShard};
use crate::{AtomicBlock, Context, Error, Result};

pub use search::SearchStats;

/// One tensor as the planner sees it; all sizes in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Item {
    /// Elements in the tensor.
    pub numel: usize,
    /// Atomic block (≤ `numel`; the last block may be shorter, see [`crate::block`]).
    pub block: usize,
    /// The tensor's start offset must be a multiple of this (divides the collective alignment).
    pub align: usize,
}

impl Item {
    /// A validated item; a block larger than the tensor is clamped to it.
    pub fn new(numel: usize, block: usize, align: usize) -> Result<Self> {
        if numel == 0 || block == 0 || align == 0 {
            return Err(Error::InvalidShape {
                op: "Item::new",
                shape: vec![numel],
                reason: format!("numel {numel}, block {block}, align {align}: all must be > 0"),
            });
        }
        Ok(Item {
            numel,
            block: block.min(numel),
            align,
        })
    }
}

/// The tensor orders the planner tries (planner.md §4); it keeps the best.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Order {
    /// Registration order (the default, and the easiest layout to debug).
    Module,
    /// Largest block first (stable).
    BlockSize,
    /// Largest tensor first, smaller block first on ties (keeps the lattice small).
    Shape,
    /// Built shard by shard ([`shard_fill`]): not a rule over the tensors, so it is never in
    /// [`PlanOptions::orders`]; the layout's offsets record it.
    Filled,
}

impl Order {
    /// All orders, in preference order for ties.
    pub const ALL: [Order; 3] = [Order::Module, Order::BlockSize, Order::Shape];

    /// The permutation of `items` this order places: `perm[i]` is the input index placed i-th.
    pub fn arrange(self, items: &[Item]) -> Vec<usize> {
        let mut perm: Vec<usize> = (0..items.len()).collect();
        match self {
            // A filled layout's order is in its offsets; as a rule it is the module order.
            Order::Module | Order::Filled => {}
            Order::BlockSize => perm.sort_by_key(|&i| std::cmp::Reverse(items[i].block)),
            Order::Shape => perm.sort_by(|&a, &b| {
                let (a, b) = (&items[a], &items[b]);
                b.numel.cmp(&a.numel).then(a.block.cmp(&b.block))
            }),
        }
        perm
    }
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Order::Module => "module",
            Order::BlockSize => "block-size",
            Order::Shape => "shape",
            Order::Filled => "shard-fill",
        })
    }
}

/// The largest alignment [`PlanOptions`] accept, in elements: 2^20, a 2 MiB huge page of
/// bf16. Collectives ask for a few hundred bytes (NCCL and Megatron align buffers to 128 or
/// 256 bytes, 64 elements of bf16 by default here); the bound is 4096 times that, and
/// still big enough to align shards to huge pages. Every shard is padded up to the
/// alignment, so a larger one costs up to that many elements per rank and group in every
/// buffer (2^33 made `fully_shard` abort on a 32 GiB allocation; 2^28 took 28 s and GiBs).
pub const MAX_ALIGN: usize = 1 << 20;

/// Planner knobs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PlanOptions {
    /// `S` must be a multiple of this many elements (NCCL prefers aligned chunks); at most
    /// [`MAX_ALIGN`].
    pub coll_align: usize,
    /// Every tensor starts at a multiple of this many elements; must divide `coll_align`.
    pub start_align: usize,
    /// Orders to try; the smallest `S` wins, earlier orders win ties.
    pub orders: Vec<Order>,
}

impl Default for PlanOptions {
    /// 64-element collective alignment (128 bytes of bf16), no start alignment, all orders.
    fn default() -> Self {
        PlanOptions {
            coll_align: 64,
            start_align: 1,
            orders: Order::ALL.to_vec(),
        }
    }
}

impl PlanOptions {
    /// Whether layouts built shard by shard ([`Order::Filled`], the multi-buffer planner's
    /// last pass) may be taken: only when every rule order is allowed, since restricting the
    /// orders (`--order module`) asks for tensors laid out by those rules.
    pub fn fill_allowed(&self) -> bool {
        Order::ALL.iter().all(|o| self.orders.contains(o))
    }

    /// `Err` naming the offending option and its value (not the whole struct, whose `Debug`
    /// text a command line would print back at its user).
    fn validate(&self) -> Result<()> {
        let bad = |what: String, reason: String| Error::BadInput {
            op: "PlanOptions",
            what,
            reason,
        };
        let (coll, start) = (self.coll_align, self.start_align);
        for (name, align) in [("coll_align", coll), ("start_align", start)] {
            if align == 0 {
                return Err(bad(
                    format!("{name} 0"),
                    "alignments must be positive".into(),
                ));
            }
        }
        // `start_align` divides `coll_align` (below), so this bounds both.
        if coll > MAX_ALIGN {
            return Err(bad(
                format!("coll_align {coll}"),
                format!(
                    "collective alignment {coll} is above {MAX_ALIGN} elements (2^20, a 2 MiB \
                     huge page of bf16; collectives need a few hundred bytes): every shard \
                     would be padded up to it"
                ),
            ));
        }
        if coll % start != 0 {
            return Err(bad(
                format!("start_align {start}"),
                format!("start alignment {start} must divide the collective alignment {coll}"),
            ));
        }
        if self.orders.is_empty() {
            return Err(bad("orders []".into(), "no order to try".into()));
        }
        Ok(())
    }
}

/// The integer result of planning one group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Number of ranks `V`.
    pub world: usize,
    /// Elements per rank, `S`.
    pub shard_size: usize,
    /// The order that gave `S`.
    pub order: Order,
    /// Offset of each tensor in the `V·S` buffer, indexed like the input items.
    pub offsets: Vec<usize>,
    /// Work done by the search for the winning order.
    pub stats: SearchStats,
    /// No layout in any order has a smaller `S` ([`search::any_order_lower_bound`]).
    pub lower_bound: usize,
}

/// Plans one group of tensors: the smallest `S` over the orders of `opts`, each exact for its
/// order (see [`search`]).
pub fn plan_items(items: &[Item], world: usize, opts: &PlanOptions) -> Result<Layout> {
    opts.validate()?;
    check_world("plan_items", world)?;
    if items.is_empty() {
        return Err(Error::BadInput {
            op: "plan_items",
            what: "tensor list".into(),
            reason: "nothing to plan".into(),
        });
    }
    let items: Vec<Item> = items
        .iter()
        .map(|t| Item::new(t.numel, t.block, t.align.max(opts.start_align)))
        .collect::<Result<_>>()?;
    if let Some(t) = items.iter().find(|t| opts.coll_align % t.align != 0) {
        return Err(Error::BadInput {
            op: "plan_items",
            what: format!("start alignment {}", t.align),
            reason: format!("must divide the collective alignment {}", opts.coll_align),
        });
    }
    let lower_bound = search::any_order_lower_bound(&items, world, opts.coll_align)?;
    if lower_bound.checked_mul(world).is_none() {
        return Err(Error::BadInput {
            op: "plan_items",
            what: format!("{world} ranks"),
            reason: format!(
                "a buffer of {world} shards of at least {lower_bound} elements overflows a 64-bit \
                 element count"
            ),
        });
    }
    let mut best: Option<Layout> = None;
    let mut seen = Vec::new();
    for &order in &opts.orders {
        let perm = order.arrange(&items);
        if seen.contains(&perm) {
            continue;
        }
        let arranged: Vec<Item> = perm.iter().map(|&i| items[i]).collect();
        let (shard_size, placed, stats) = search::min_shard(&arranged, world, opts.coll_align)?;
        if best.as_ref().is_none_or(|b| shard_size < b.shard_size) {
            let mut offsets = vec![0; items.len()];
            for (k, &i) in perm.iter().enumerate() {
                offsets[i] = placed[k];
            }
            best = Some(Layout {
                world,
                shard_size,
                order,
                offsets,
                stats,
                lower_bound,
            });
        }
        seen.push(perm);
    }
    best.ok_or_else(|| Error::BadInput {
        op: "plan_items",
        what: "orders".into(),
        reason: "no order to try".into(),
    })
}

/// One tensor of a [`Plan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// The block the optimizer asked for.
    pub block: AtomicBlock,
    /// That block in elements for this shape (clamped to the tensor).
    pub block_elems: usize,
    /// Start of the tensor in the group's `V·S` buffer.
    pub offset: usize,
}

impl Placement {
    /// Elements in the tensor.
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<usize>().max(1)
    }
}

/// The plan of one FSDP unit: shard size and where every tensor lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Unit name (`root`, `layers.3`, ...).
    pub unit: String,
    pub world: usize,
    pub shard_size: usize,
    pub coll_align: usize,
    pub order: Order,
    /// Tensors in registration order (not buffer order).
    pub placements: Vec<Placement>,
    pub stats: SearchStats,
    /// No layout of this unit in any order has a smaller shard size.
    pub lower_bound: usize,
}

impl Plan {
    /// Elements of all tensors.
    pub fn numel(&self) -> usize {
        self.placements.iter().map(Placement::numel).sum()
    }

    /// Elements of the full (unsharded) buffer, `V·S`.
    pub fn buffer_elems(&self) -> usize {
        self.world * self.shard_size
    }

    /// Padding elements, `V·S − E`.
    pub fn padding(&self) -> usize {
        self.buffer_elems() - self.numel()
    }

    /// Bytes of one rank's shard for elements of `dtype`: the memory per rank per role, known
    /// before any buffer is allocated.
    pub fn shard_bytes(&self, dtype: DType) -> usize {
        self.shard_size * dtype.size_in_bytes()
    }

    /// Whole blocks of tensor `i` held by each rank (`V` entries; a short tail counts as one).
    pub fn units_per_rank(&self, i: usize) -> Result<Vec<usize>> {
        let p = &self.placements[i];
        placement_units(
            p.numel(),
            p.block_elems,
            p.offset,
            self.shard_size,
            self.world,
        )
    }

    /// The [`RaggedShard`] of tensor `i` under this plan.
    pub fn shard(&self, i: usize) -> Result<RaggedShard> {
        let p = &self.placements[i];
        RaggedShard::from_placement(
            &p.shape,
            p.block_elems,
            p.offset,
            self.shard_size,
            self.world,
        )
    }

    /// Checks the plan's invariants independently of how it was built: equal shards, `S` a
    /// multiple of the collective alignment, tensors disjoint and inside the buffer, no block
    /// split by a shard boundary.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Error::Infeasible {
            op: "Plan::validate",
            reason: format!("unit {}: {reason}", self.unit),
        };
        if self.shard_size == 0 || self.coll_align == 0 || self.shard_size % self.coll_align != 0 {
            return Err(bad(format!(
                "shard size {} is not a positive multiple of {}",
                self.shard_size, self.coll_align
            )));
        }
        let mut by_offset: Vec<&Placement> = self.placements.iter().collect();
        by_offset.sort_by_key(|p| p.offset);
        let capacity = self
            .world
            .checked_mul(self.shard_size)
            .ok_or_else(|| bad(format!("{} x {} overflows", self.world, self.shard_size)))?;
        let mut end = 0;
        for p in by_offset {
            if p.offset < end {
                return Err(bad(format!("{} overlaps the previous tensor", p.name)));
            }
            end = match p.offset.checked_add(p.numel()) {
                Some(e) if e <= capacity => e,
                _ => return Err(bad(format!("{} ends past the buffer", p.name))),
            };
            if p.block_elems == 0 {
                return Err(bad(format!("{} has a block of 0 elements", p.name)));
            }
            check_cuts(p, self.shard_size, end)?;
        }
        Ok(())
    }
}

/// No shard boundary strictly inside `[offset, end)` splits a block of `p`. If the block divides
/// `S`, the first boundary decides for all; otherwise two boundaries `S` apart cannot both be
/// block edges, so a valid tensor has at most one inside. Either way O(1), however many shards
/// the tensor spans.
fn check_cuts(p: &Placement, shard: usize, end: usize) -> Result<()> {
    let split = |cut: usize| Error::BlockSplit {
        op: "Plan::validate",
        tensor: p.name.clone(),
        block: p.block_elems,
        offset: cut - p.offset,
    };
    // offset < end ≤ V·S, so the next boundary after the offset is addressable.
    let first = (p.offset / shard + 1) * shard;
    if first >= end {
        return Ok(());
    }
    if (first - p.offset) % p.block_elems != 0 {
        return Err(split(first));
    }
    if shard % p.block_elems != 0 && end - first > shard {
        return Err(split(first + shard));
    }
    Ok(())
}

/// Plans one unit: `block_of` names the atomic block of each tensor (the optimizer's choice).
pub fn plan_unit(
    unit: &Unit,
    block_of: &dyn Fn(&TensorSpec) -> AtomicBlock,
    world: usize,
    opts: &PlanOptions,
) -> Result<Plan> {
    let (items, blocks) = unit_items(unit, block_of, opts)?;
    let layout =
        plan_one_buffer(&items, world, opts).with_context(|| format!("unit {}", unit.name))?;
    Ok(assemble(unit, &items, &blocks, &layout, opts))
}

/// One buffer's layout: [`plan_items`]'s, or a smaller one built shard by shard
/// ([`shard_fill::improve_layout`]) where the options allow it ([`PlanOptions::fill_allowed`]).
pub fn plan_one_buffer(items: &[Item], world: usize, opts: &PlanOptions) -> Result<Layout> {
    let layout = plan_items(items, world, opts)?;
    if !opts.fill_allowed() {
        return Ok(layout);
    }
    Ok(shard_fill::improve_layout(items, world, opts.coll_align, &layout)?.unwrap_or(layout))
}

/// `Err` naming the number of devices unless there is at least one.
fn check_world(op: &'static str, world: usize) -> Result<()> {
    if world == 0 {
        return Err(Error::BadInput {
            op,
            what: "a world of 0 devices (--devices 0)".into(),
            reason: "a plan needs at least one device".into(),
        });
    }
    Ok(())
}

pub(crate) fn unit_items(
    unit: &Unit,
    block_of: &dyn Fn(&TensorSpec) -> AtomicBlock,
    opts: &PlanOptions,
) -> Result<(Vec<Item>, Vec<AtomicBlock>)> {
    // The options first: an alignment of 0 is the option's fault, not the first tensor's.
    opts.validate()?;
    let mut items = Vec::with_capacity(unit.tensors.len());
    let mut blocks = Vec::with_capacity(unit.tensors.len());
    for t in &unit.tensors {
        let block = block_of(t);
        let elems = block
            .elems(&t.shape)
            .with_context(|| format!("tensor {}", t.name))?;
        items.push(Item::new(t.numel(), elems, opts.start_align)?);
        blocks.push(block);
    }
    Ok((items, blocks))
}

pub(crate) fn assemble(
    unit: &Unit,
    items: &[Item],
    blocks: &[AtomicBlock],
    layout: &Layout,
    opts: &PlanOptions,
) -> Plan {
    let placements = unit
        .tensors
        .iter()
        .zip(items.iter().zip(blocks))
        .zip(&layout.offsets)
        .map(|((t, (item, &block)), &offset)| Placement {
            name: t.name.clone(),
            shape: t.shape.clone(),
            dtype: t.dtype,
            block,
            block_elems: item.block,
            offset,
        })
        .collect();
    Plan {
        unit: unit.name.clone(),
        world: layout.world,
        shard_size: layout.shard_size,
        coll_align: opts.coll_align,
        order: layout.order,
        placements,
        stats: layout.stats,
        lower_bound: layout.lower_bound,
    }
}

/// Plans of every unit of a model.
#[derive(Clone, Debug)]
pub struct ModelPlan {
    pub model: String,
    pub world: usize,
    pub units: Vec<Plan>,
    /// Wall time of planning (layouts only; units with identical tensor lists are planned once).
    pub elapsed: Duration,
    /// Distinct unit signatures actually searched.
    pub distinct_units: usize,
}

impl ModelPlan {
    /// Elements of all tensors.
    pub fn numel(&self) -> u64 {
        self.units.iter().map(|p| p.numel() as u64).sum()
    }

    /// Elements of all full buffers.
    pub fn buffer_elems(&self) -> u64 {
        self.units.iter().map(|p| p.buffer_elems() as u64).sum()
    }

    /// Padding as a fraction of the model's elements.
    pub fn padding_frac(&self) -> f64 {
        (self.buffer_elems() - self.numel()) as f64 / self.numel() as f64
    }

    /// The padding fraction no layout can avoid with these blocks (from each unit's
    /// [`Plan::lower_bound`]).
    pub fn lower_bound_padding_frac(&self) -> f64 {
        let floor: u64 = self
            .units
            .iter()
            .map(|p| (p.world * p.lower_bound) as u64)
            .sum();
        (floor - self.numel()) as f64 / self.numel() as f64
    }
}

/// Plans every FSDP unit of `inv` ([`Inventory::units`]). Units whose (size, block) lists are
/// equal, such as the identical decoder layers of a transformer, share one search.
pub fn plan_model(
    inv: &Inventory,
    block_of: &dyn Fn(&TensorSpec) -> AtomicBlock,
    world: usize,
    opts: &PlanOptions,
) -> Result<ModelPlan> {
    let start = Instant::now();
    let mut cache: HashMap<Vec<Item>, Layout> = HashMap::new();
    let mut units = Vec::new();
    for unit in inv.units() {
        let (items, blocks) = unit_items(&unit, block_of, opts)?;
        let layout = match cache.get(&items) {
            Some(l) => l.clone(),
            None => {
                let l = plan_one_buffer(&items, world, opts)
                    .with_context(|| format!("unit {}", unit.name))?;
                cache.insert(items.clone(), l.clone());
                l
            }
        };
        units.push(assemble(&unit, &items, &blocks, &layout, opts));
    }
    // The model-wide sums of `ModelPlan` are u64: make sure they cannot wrap.
    units
        .iter()
        .try_fold(0u64, |acc, p| acc.checked_add(p.buffer_elems() as u64))
        .ok_or_else(|| Error::BadInput {
            op: "plan_model",
            what: format!("model {}", inv.model),
            reason: format!(
                "the buffers of all units together, at {world} shards each, overflow a 64-bit \
                 element count"
            ),
        })?;
    Ok(ModelPlan {
        model: inv.model.clone(),
        world,
        units,
        elapsed: start.elapsed(),
        distinct_units: cache.len(),
    })
}
