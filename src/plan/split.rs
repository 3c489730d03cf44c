//! Identical tensors split across buffers by count: the third search of [`super::multi`], for
//! units made of many tensors of one shape (the experts of an MoE layer).
//!
//! **Why.** [`super::partition`] keeps each block size together and [`super::refine`] moves
//! tensors one move at a time, so neither finds layouts where every buffer is filled to its
//! lattice by a chosen number of experts. A Qwen3-235B-A22B layer at `rows:16`, `V = 4096`
//! needs 607,362 elements per rank; `o_proj`'s block (131,072) and `down_proj`'s (24,576)
//! agree only on multiples of 393,216. Buffer 1: the attention, the router and 244 of the 384
//! expert tensors at `S = 393,216` (896 spare per rank); buffer 2: 12 `gate/up` and 116
//! `down_proj` at `S = 196,608` (exactly full); buffer 3: the last 12 `down_proj` at
//! `S = 24,576`. That is 614,400 per rank, 1.2 % padding, where whole classes and moves end at
//! 655,360 (7.9 %).
//!
//! **Model.** A buffer of shard size `S` can hold a tensor of `e` elements and block `g` when
//! `g ≤ S` and either `g | S` or `e < 2S` (a tensor with `e ≥ 2S` contains a whole shard, so
//! its block divides `S`: planner.md §2); it holds at most `V·S` elements. The search takes
//! the sizes of the first `k − 1` buffers from a list of candidates (multiples of `coll` and
//! of the lcm of `coll` with any subset of the largest distinct blocks), fills each buffer in
//! turn as full as its capacity allows, in two orders (`fill_orders`: coarse blocks first,
//! so the last buffer keeps the fine ones; or single tensors first), and gives the rest to the
//! last buffer at the smallest size its forced lattice accepts ([`ForcedLattice`]). The model
//! ignores gaps that start alignment leaves and the block edges that an unforced tensor
//! crossing a boundary needs, which makes big buffers of unforced experts look exact when they
//! are not; so the search also runs a strict model, in which a tensor that crosses a boundary
//! (`e > S`) needs `g | S`, and the [`TOP_CANDIDATES`] best sums of each model are sized for
//! real by the quick search of [`min_shard_below`]; the best of them is planned by
//! [`plan_items`].
//!
//! **Work.** At most [`MAX_SIZES`] candidate sizes per buffer and [`MAX_SPLIT_BUFFERS`]
//! buffers, so at most `2 · 2² · MAX_SIZES²` fills (two models, two orders per buffer), each
//! quadratic in the number of distinct shapes, and `2 · TOP_CANDIDATES` quick searches per
//! buffer: nothing grows with the tensors' sizes or counts beyond grouping them.

use super::fit::lcm;
use super::multi::MultiOptions;
use super::partition::{Partition, QUICK_WORK};
use super::search::{min_shard_below, ForcedLattice};
use super::{plan_items, Item, Layout, PlanOptions};

/// Buffers this search fills (the candidate sizes of `k − 1` of them are enumerated).
pub const MAX_SPLIT_BUFFERS: usize = 3;

/// Distinct block sizes (the largest) whose lcms give candidate lattices (`2^6` subsets).
pub const LATTICE_BLOCKS: usize = 6;

/// Multiples of one lattice taken as candidate sizes.
pub const MULTIPLES: usize = 32;

/// Candidate sizes of one buffer, at most.
pub const MAX_SIZES: usize = 96;

/// Modelled results checked against real layouts, best first.
pub const TOP_CANDIDATES: usize = 8;

/// The tensors of one shape `(elements, block, start alignment)`, in unit order.
pub(super) struct Shape {
    pub item: Item,
    pub members: Vec<usize>,
}

/// The best layout with `k` buffers that the search of the module doc finds, if one costs
/// less than `to_beat` seconds under `mopts`.
pub fn split_partition(
    items: &[Item],
    world: usize,
    opts: &PlanOptions,
    mopts: &MultiOptions,
    k: usize,
    to_beat: f64,
) -> Option<Partition> {
    if !(2..=MAX_SPLIT_BUFFERS).contains(&k) || world == 0 || opts.coll_align == 0 {
        return None;
    }
    let shapes = shapes_of(items, opts)?;
    let limit = mopts.shard_sum_below_cost(k, world, to_beat)?;
    let sizes = candidate_sizes(&shapes, opts.coll_align, limit);
    let counts: Vec<usize> = shapes.iter().map(|s| s.members.len()).collect();
    let orders = fill_orders(&shapes);
    let mut found = Vec::new();
    for strict in [false, true] {
        let mut walk = Walk {
            shapes: &shapes,
            orders: &orders,
            sizes: &sizes,
            world: world as u128,
            coll: opts.coll_align,
            k,
            limit,
            strict,
            best: Vec::new(),
        };
        walk.go(&counts, &mut Vec::new(), 0);
        found.extend(walk.best);
    }
    found.sort_by_key(|c| c.shard_sum);
    // Both models often find the same counts.
    found.dedup_by(|a, b| a.fills == b.fills);
    // The model ignores alignment gaps and the block edges of tensors that cross a boundary
    // without being forced: the quick search sizes each candidate for real.
    let mut best: Option<(usize, &Candidate)> = None;
    for c in &found {
        let bar = best.map_or(limit, |b| b.0);
        if let Some(sum) = quick_sum(items, &shapes, c, world, opts, bar) {
            best = Some((sum, c));
        }
    }
    let groups = groups_of(&shapes, &best?.1.fills);
    let layouts = groups
        .iter()
        .map(|g| {
            let sub: Vec<Item> = g.iter().map(|&i| items[i]).collect();
            plan_items(&sub, world, opts).ok()
        })
        .collect::<Option<Vec<Layout>>>()?;
    let shard_sum = layouts
        .iter()
        .try_fold(0usize, |acc, l| acc.checked_add(l.shard_size))?;
    (mopts.cost_s(groups.len(), shard_sum, world) < to_beat).then_some(Partition {
        groups,
        layouts,
        shard_sum,
    })
}

/// Items grouped by shape (the start alignment applied, as [`plan_items`] sees them), coarse
/// blocks first, larger tensors first among equal blocks.
fn shapes_of(items: &[Item], opts: &PlanOptions) -> Option<Vec<Shape>> {
    let aligned = items
        .iter()
        .map(|t| Item::new(t.numel, t.block, t.align.max(opts.start_align)).ok())
        .collect::<Option<Vec<_>>>()?;
    Some(group_shapes(&aligned))
}

/// `items` grouped by equal item (members in unit order), coarse blocks first, larger tensors
/// first among equal blocks.
pub(super) fn group_shapes(items: &[Item]) -> Vec<Shape> {
    let mut shapes: Vec<Shape> = Vec::new();
    for (i, &item) in items.iter().enumerate() {
        match shapes.iter_mut().find(|s| s.item == item) {
            Some(s) => s.members.push(i),
            None => shapes.push(Shape {
                item,
                members: vec![i],
            }),
        }
    }
    shapes.sort_by(|a, b| (b.item.block.cmp(&a.item.block)).then(b.item.numel.cmp(&a.item.numel)));
    shapes
}

/// Multiples of `coll` and of the lcm of `coll` with every subset of the [`LATTICE_BLOCKS`]
/// largest blocks, below `limit`: [`MULTIPLES`] of each, coarse lattices first, at most
/// [`MAX_SIZES`], returned in increasing order.
fn candidate_sizes(shapes: &[Shape], coll: usize, limit: usize) -> Vec<usize> {
    let mut blocks: Vec<usize> = shapes.iter().map(|s| s.item.block).collect();
    blocks.sort_unstable_by(|a, b| b.cmp(a));
    blocks.dedup();
    blocks.truncate(LATTICE_BLOCKS);
    let mut lattices: Vec<usize> = (0u32..1 << blocks.len())
        .filter_map(|mask| {
            (0..blocks.len())
                .filter(|b| mask & (1 << b) != 0)
                .try_fold(coll, |acc, b| lcm(acc, blocks[b]))
        })
        .filter(|&l| l < limit)
        .collect();
    lattices.sort_unstable_by(|a, b| b.cmp(a));
    lattices.dedup();
    let mut sizes = Vec::new();
    for l in lattices {
        for j in 1..=MULTIPLES {
            match l.checked_mul(j) {
                Some(s) if s < limit => sizes.push(s),
                _ => break,
            }
        }
    }
    // Coarse lattices came first: they are the sizes a buffer can fill exactly.
    let mut seen = std::collections::HashSet::new();
    sizes.retain(|s| seen.insert(*s));
    sizes.truncate(MAX_SIZES);
    sizes.sort_unstable();
    sizes
}

/// One modelled layout: each buffer's count per shape and its shard size.
#[derive(Clone, Debug, PartialEq)]
struct Candidate {
    shard_sum: usize,
    fills: Vec<Vec<usize>>,
    sizes: Vec<usize>,
}

/// The depth-first search over the sizes of the first `k − 1` buffers.
struct Walk<'a> {
    shapes: &'a [Shape],
    /// The orders in which a fill takes shapes ([`fill_orders`]).
    orders: &'a [Vec<usize>],
    sizes: &'a [usize],
    world: u128,
    coll: usize,
    k: usize,
    /// Every kept result is below this `Σ S`.
    limit: usize,
    /// The strict model: a tensor that crosses a boundary (`e > S`) needs `g | S`.
    strict: bool,
    /// The [`TOP_CANDIDATES`] smallest modelled `Σ S`.
    best: Vec<Candidate>,
}

impl Walk<'_> {
    /// The largest kept sum once the list is full (a new result must beat it).
    fn bar(&self) -> usize {
        if self.best.len() < TOP_CANDIDATES {
            self.limit
        } else {
            self.best
                .iter()
                .map(|b| b.shard_sum)
                .max()
                .unwrap_or(self.limit)
        }
    }

    fn go(&mut self, left: &[usize], fills: &mut Vec<(Vec<usize>, usize)>, prefix: usize) {
        let mass = mass_of(self.shapes, left);
        if fills.len() + 1 == self.k {
            self.finish(left, fills, prefix);
            return;
        }
        let rest_share = usize::try_from(mass.div_ceil(self.world)).unwrap_or(usize::MAX);
        for &s in self.sizes {
            // The rest needs at least its share; this buffer at least `s`.
            if prefix.saturating_add(s.max(rest_share)) >= self.bar() {
                break;
            }
            let mut tried: Vec<Vec<usize>> = Vec::new();
            for order in self.orders {
                let taken = fill(self.shapes, order, left, s, self.world, self.strict);
                if taken.iter().all(|&n| n == 0) || tried.contains(&taken) {
                    continue;
                }
                let after: Vec<usize> = left.iter().zip(&taken).map(|(l, t)| l - t).collect();
                fills.push((taken.clone(), s));
                self.go(&after, fills, prefix + s);
                fills.pop();
                tried.push(taken);
            }
        }
    }

    /// The tensors as the lattice sees them: in the strict model a tensor is forced from
    /// `e ≥ S` on (it crosses a boundary), which [`ForcedLattice`] sees as twice the elements.
    fn modelled(&self, present: &[Item]) -> Vec<Item> {
        present
            .iter()
            .map(|&t| Item {
                numel: if self.strict {
                    t.numel.saturating_mul(2)
                } else {
                    t.numel
                },
                ..t
            })
            .collect()
    }

    /// The last buffer takes what is left at the smallest size its lattice allows.
    fn finish(&mut self, left: &[usize], fills: &[(Vec<usize>, usize)], prefix: usize) {
        let mut all: Vec<(Vec<usize>, usize)> = fills.to_vec();
        let present: Vec<Item> = self
            .shapes
            .iter()
            .zip(left)
            .filter(|(_, &n)| n > 0)
            .map(|(s, _)| s.item)
            .collect();
        let sum = if present.is_empty() {
            Some(prefix)
        } else {
            let share = usize::try_from(mass_of(self.shapes, left).div_ceil(self.world)).ok();
            let largest = present.iter().map(|t| t.block).max().unwrap_or(1);
            let last = share.and_then(|s| {
                ForcedLattice::new(&self.modelled(&present), self.coll)
                    .next_candidate(s.max(largest))
            });
            last.and_then(|s| {
                all.push((left.to_vec(), s));
                prefix.checked_add(s)
            })
        };
        // One buffer is the single-buffer plan, searched elsewhere.
        let Some(sum) = sum.filter(|&s| s < self.bar() && all.len() >= 2) else {
            return;
        };
        let (fills, sizes) = all.into_iter().unzip();
        let candidate = Candidate {
            shard_sum: sum,
            fills,
            sizes,
        };
        if self.best.contains(&candidate) {
            return;
        }
        if self.best.len() == TOP_CANDIDATES {
            let worst = (0..self.best.len()).max_by_key(|&i| self.best[i].shard_sum);
            if let Some(w) = worst {
                self.best.swap_remove(w);
            }
        }
        self.best.push(candidate);
    }
}

/// `Σ count · elements` of the shapes left.
fn mass_of(shapes: &[Shape], counts: &[usize]) -> u128 {
    shapes
        .iter()
        .zip(counts)
        .map(|(s, &n)| s.item.numel as u128 * n as u128)
        .sum()
}

/// Whether a buffer of shard size `s` can hold tensors of this shape (the module doc's model;
/// `strict`: a tensor that crosses a boundary without `g | S` is refused).
fn admissible(t: &Item, s: usize, strict: bool) -> bool {
    let free = if strict {
        t.numel <= s
    } else {
        t.numel / 2 < s
    };
    t.block <= s && (s % t.block == 0 || free)
}

/// The orders in which [`fill`] takes shapes: coarse blocks first (the shapes' order), and
/// the shapes of one tensor first, then the others. The first leaves fine lattices to the last
/// buffer; the second places tensors that fit few lattices (a DeepSeek-V3 `q_b_proj`, whose
/// block agrees with neither the experts' nor `o_proj`'s) while there is room.
fn fill_orders(shapes: &[Shape]) -> Vec<Vec<usize>> {
    let coarse: Vec<usize> = (0..shapes.len()).collect();
    let (mut singles, rest): (Vec<usize>, Vec<usize>) =
        coarse.iter().partition(|&&c| shapes[c].members.len() == 1);
    singles.extend(rest);
    if singles == coarse {
        vec![coarse]
    } else {
        vec![coarse, singles]
    }
}

/// How many tensors of each shape a buffer of shard size `s` takes from `left`: as many as
/// fit in `V·s` elements, shapes in `order`, then the fill is improved by taking one or two
/// fewer of one shape and refilling with the shapes after it.
fn fill(
    shapes: &[Shape],
    order: &[usize],
    left: &[usize],
    s: usize,
    world: u128,
    strict: bool,
) -> Vec<usize> {
    let capacity = s as u128 * world;
    let allowed: Vec<bool> = shapes
        .iter()
        .map(|sh| admissible(&sh.item, s, strict))
        .collect();
    let elems = |c: usize| shapes[c].item.numel as u128;
    // Greedy over `order[start..]`; returns the room left.
    let greedy_from = |start: usize, taken: &mut Vec<usize>, mut room: u128| {
        for &c in &order[start..] {
            let n = if allowed[c] {
                (room / elems(c)).min(left[c] as u128) as usize
            } else {
                0
            };
            taken[c] = n;
            room -= n as u128 * elems(c);
        }
        room
    };
    let mut best = vec![0; shapes.len()];
    let mut best_room = greedy_from(0, &mut best, capacity);
    let first = best.clone();
    for (pos, &c) in order.iter().enumerate() {
        for fewer in 1..=2usize {
            let Some(n) = first[c].checked_sub(fewer) else {
                break;
            };
            let mut taken = first.clone();
            taken[c] = n;
            let used: u128 = order[..=pos]
                .iter()
                .map(|&j| taken[j] as u128 * elems(j))
                .sum();
            let room = greedy_from(pos + 1, &mut taken, capacity - used);
            if room < best_room {
                (best, best_room) = (taken, room);
            }
        }
    }
    best
}

/// Each buffer's item indices (unit order) for the counts `fills` (one list per buffer).
fn groups_of(shapes: &[Shape], fills: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let mut next = vec![0usize; shapes.len()];
    let mut groups: Vec<Vec<usize>> = fills
        .iter()
        .map(|counts| {
            let mut g = Vec::new();
            for (c, &n) in counts.iter().enumerate() {
                g.extend_from_slice(&shapes[c].members[next[c]..next[c] + n]);
                next[c] += n;
            }
            g.sort_unstable();
            g
        })
        .collect();
    groups.retain(|g| !g.is_empty());
    groups
}

/// `Σ S` of the candidate's buffers as the quick search of [`min_shard_below`] sizes them,
/// if it finds one below `bar`.
fn quick_sum(
    items: &[Item],
    shapes: &[Shape],
    candidate: &Candidate,
    world: usize,
    opts: &PlanOptions,
    bar: usize,
) -> Option<usize> {
    let mut sum = 0usize;
    for g in groups_of(shapes, &candidate.fills) {
        let sub: Vec<Item> = g.iter().map(|&i| normalized(items[i], opts)).collect();
        let cap = bar.checked_sub(sum)?;
        let size = opts
            .orders
            .iter()
            .filter_map(|order| {
                let arranged: Vec<Item> = order.arrange(&sub).iter().map(|&i| sub[i]).collect();
                min_shard_below(&arranged, world, opts.coll_align, cap, QUICK_WORK)
            })
            .min()?;
        sum = sum.checked_add(size)?;
    }
    (sum < bar).then_some(sum)
}

/// The item as [`plan_items`] sees it (the start alignment applied; `Item`s are valid).
fn normalized(t: Item, opts: &PlanOptions) -> Item {
    Item {
        align: t.align.max(opts.start_align),
        ..t
    }
}
