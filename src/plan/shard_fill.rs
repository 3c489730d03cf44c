//! Shard-by-shard filling: a layout built one shard at a time, a last pass of
//! [`super::multi`] over the buffers it chose.
//!
//! **Why.** [`super::search`] is exact for each of its three orders, but for a unit of many
//! tensors that are not forced (`e < 2S`) the best order is often none of them. In a
//! Qwen3-30B-A3B layer at `rows:128`, `V = 8`, every part of an expert inside a shard is a
//! multiple of 32,768 elements (a piece); the three orders need 2,379 pieces per rank, while
//! choosing in each shard which tensors fill it and which one crosses its boundary (and so
//! where that tensor is cut) needs 2,378.
//!
//! **Construction** ([`shard_fill`], for one trial `S`). Tensors are grouped by shape. Shards are
//! filled in turn: with `R` elements left before the boundary of the cursor's shard, a fill is
//! a count of each *rare* shape (at most [`RARE`] tensors left), the *frequent* shapes in
//! proportion to how many of each are left (so every kind of tensor stays available for later
//! boundaries), up to [`REDUCTIONS`] fewer of each, and then one tensor that crosses the
//! boundary at its earliest valid start ([`earliest_start`]); the gap before that start is the
//! fill's *waste*. Fills are ranked by waste, then by fewer rare tensors used (they are the
//! ones that fix later boundaries), and the search backtracks over the [`CANDIDATES`] best
//! fills of each shard while the total waste stays within the spare `V·S − E`. The order found
//! is placed by the greedy ([`greedy`]), exact for a fixed order, so the layout obeys the block
//! rule by the same code as every other layout (and [`super::Plan::validate`] checks it).
//!
//! **Sizes tried** ([`improve_layout`]): the buffer's lower bound, then the multiples of the
//! unit's main piece step (the gcd of `gcd(e, g)` over the shapes holding 99 % of its
//! elements, with the collective alignment) above it, at most [`SIZES`] sizes, all below the
//! size already found; the smallest that fills wins.
//!
//! **Work.** At most [`LEAVES`] fills ranked per shard and [`NODES`] shards visited per trial
//! size, whatever the tensors' sizes; each fill costs the number of shapes. Tensors with a
//! start alignment above one element are not handled (the pass then keeps the layout it has).

use std::collections::HashSet;

use super::fit::{earliest_start, greedy, lcm, total_numel};
use super::search::{any_order_lower_bound, SearchStats};
use super::split::{group_shapes, Shape};
use super::{piece_floor, Item, Layout, Order};
use crate::{Error, Result};

/// A shape with at most this many tensors left is enumerated count by count.
pub const RARE: usize = 4;

/// Fills use up to this many fewer tensors of each frequent shape than the proportional fill.
pub const REDUCTIONS: usize = 2;

/// The best fills of one shard the search backtracks over.
pub const CANDIDATES: usize = 8;

/// Fills ranked per shard, at most.
pub const LEAVES: usize = 4096;

/// Shards visited per trial size, at most (with backtracking).
pub const NODES: usize = 256;

/// Trial sizes per buffer, at most.
pub const SIZES: usize = 4;

/// Units of more distinct shapes than this are not filled (the fills of a shard grow with
/// the product of the shapes' choices).
pub const MAX_SHAPES: usize = 16;

/// One way to fill the shard at the cursor.
#[derive(Clone, Debug, PartialEq)]
struct Fill {
    /// Gap left before the crossing tensor (or before the boundary when none crosses).
    waste: usize,
    /// Tensors of each shape placed whole inside the shard.
    take: Vec<usize>,
    /// The shape of the tensor crossing the boundary, if any.
    cross: Option<usize>,
    /// The cursor after the fill.
    end: usize,
    /// Rare tensors used.
    rare_used: usize,
}

/// `Err` unless there are ranks and a positive shard size to fill.
fn check_fill(op: &'static str, world: usize, shard: usize) -> Result<()> {
    if world == 0 || shard == 0 {
        return Err(Error::BadInput {
            op,
            what: format!("V = {world}, S = {shard}"),
            reason: "needs ranks and a positive shard size".into(),
        });
    }
    Ok(())
}

/// Offsets (indexed like `items`) of a layout with shard size `shard` on `world` ranks built
/// shard by shard (module doc), or `None` when the bounded search finds none. Errors on zero
/// ranks or a zero shard size.
pub fn shard_fill(items: &[Item], world: usize, shard: usize) -> Result<Option<Vec<usize>>> {
    check_fill("shard_fill", world, shard)?;
    if items.is_empty() || items.iter().any(|t| t.align != 1) {
        return Ok(None);
    }
    let (Some(capacity), Some(total)) = (shard.checked_mul(world), total_numel(items)) else {
        return Ok(None);
    };
    let Some(spare) = capacity.checked_sub(total) else {
        return Ok(None);
    };
    let shapes = group_shapes(items);
    if shapes.len() > MAX_SHAPES {
        return Ok(None);
    }
    let mut walk = Walk {
        shapes: &shapes,
        shard,
        capacity,
        spare,
        nodes: 0,
        order: Vec::new(),
    };
    let mut left: Vec<usize> = shapes.iter().map(|s| s.members.len()).collect();
    if !walk.go(0, 0, &mut left) {
        return Ok(None);
    }
    // Shapes in the found order become tensors: each shape's members in unit order.
    let mut next = vec![0usize; shapes.len()];
    let perm: Vec<usize> = walk
        .order
        .iter()
        .map(|&s| {
            next[s] += 1;
            shapes[s].members[next[s] - 1]
        })
        .collect();
    let arranged: Vec<Item> = perm.iter().map(|&i| items[i]).collect();
    let Some(placed) = greedy(&arranged, shard, world) else {
        return Ok(None);
    };
    let mut offsets = vec![0; items.len()];
    for (k, &i) in perm.iter().enumerate() {
        offsets[i] = placed[k];
    }
    Ok(Some(offsets))
}

/// Offsets (indexed like `items`) of a layout with shard size `shard` built tensor by tensor:
/// next comes the shape whose earliest valid start leaves the least gap behind the cursor,
/// ties to the shape with fewer tensors left (the rare ones fix boundaries), then to the
/// smaller block; `None` when the gaps pass the spare `V·S − E` or the end. [`super::multi`]
/// tries it on the pair floor's witness, where the shard-by-shard search stops at its node
/// budget: a DeepSeek-V3 MoE layer at `rows:1`, `V = 1024`, whose experts' buffer at 1,257 ×
/// 7,168 leaves 110 elements of spare per rank and needs the `down_proj` tensors (block 2,048)
/// cut only at even multiples of 7,168. Errors on zero ranks or a zero shard size.
pub fn least_gap_fill(items: &[Item], world: usize, shard: usize) -> Result<Option<Vec<usize>>> {
    check_fill("least_gap_fill", world, shard)?;
    let (Some(capacity), Some(total)) = (shard.checked_mul(world), total_numel(items)) else {
        return Ok(None);
    };
    let Some(spare) = capacity.checked_sub(total) else {
        return Ok(None);
    };
    let shapes = group_shapes(items);
    let mut left: Vec<usize> = shapes.iter().map(|s| s.members.len()).collect();
    let mut offsets = vec![0usize; items.len()];
    let (mut cursor, mut gaps) = (0usize, 0usize);
    for _ in 0..items.len() {
        let next = (0..shapes.len())
            .filter(|&i| left[i] > 0)
            .filter_map(|i| {
                let start = earliest_start(cursor, &shapes[i].item, shard)?;
                Some(((start - cursor, left[i], shapes[i].item.block), i, start))
            })
            .min();
        let Some(((gap, _, _), i, start)) = next else {
            return Ok(None);
        };
        gaps = gaps.saturating_add(gap);
        let item = shapes[i].item;
        let end = start.checked_add(item.numel);
        if gaps > spare || end.is_none_or(|end| end > capacity) {
            return Ok(None);
        }
        offsets[shapes[i].members[shapes[i].members.len() - left[i]]] = start;
        left[i] -= 1;
        cursor = end.unwrap_or(capacity);
    }
    Ok(Some(offsets))
}

/// `layout` with a smaller shard size found by [`shard_fill`] at the sizes of the module doc,
/// or `None` when none of them fills. `items` are as [`super::plan_items`] sees them.
pub fn improve_layout(
    items: &[Item],
    world: usize,
    coll: usize,
    layout: &Layout,
) -> Result<Option<Layout>> {
    let bound = any_order_lower_bound(items, world, coll)?;
    let bound = piece_floor::piece_floor(items, world, coll).map_or(bound, |p| p.max(bound));
    let step = piece_floor::main_step(items)
        .and_then(|d| lcm(d, coll))
        .unwrap_or(coll)
        .max(1);
    let mut sizes = vec![bound];
    let mut s = bound.checked_next_multiple_of(step);
    while let Some(size) = s.filter(|_| sizes.len() < SIZES) {
        if size != bound {
            sizes.push(size);
        }
        s = size.checked_add(step);
    }
    for (tried, &size) in sizes.iter().enumerate() {
        if size >= layout.shard_size {
            break;
        }
        if let Some(offsets) = shard_fill(items, world, size)? {
            return Ok(Some(Layout {
                world,
                shard_size: size,
                order: Order::Filled,
                offsets,
                stats: SearchStats {
                    checks: layout.stats.checks + tried + 1,
                    bisection_bound: layout.stats.bisection_bound,
                    exact: false,
                },
                lower_bound: layout.lower_bound,
            }));
        }
    }
    Ok(None)
}

/// The backtracking search over the fills of each shard.
struct Walk<'a> {
    shapes: &'a [Shape],
    shard: usize,
    capacity: usize,
    /// `V·S − E`: the waste all shards together may leave.
    spare: usize,
    nodes: usize,
    /// Shape of each placed tensor, in placement order.
    order: Vec<usize>,
}

impl Walk<'_> {
    /// Places everything in `left` from `cursor` on with at most `spare − waste` more waste.
    fn go(&mut self, cursor: usize, waste: usize, left: &mut [usize]) -> bool {
        if left.iter().all(|&n| n == 0) {
            return true;
        }
        self.nodes += 1;
        if self.nodes > NODES {
            return false;
        }
        for fill in self.fills(cursor, left) {
            let Some(total) = waste.checked_add(fill.waste).filter(|&w| w <= self.spare) else {
                continue;
            };
            if fill.end > self.capacity {
                continue;
            }
            let mark = self.order.len();
            for (s, &n) in fill.take.iter().enumerate() {
                left[s] -= n;
                self.order.extend(std::iter::repeat_n(s, n));
            }
            if let Some(c) = fill.cross {
                left[c] -= 1;
                self.order.push(c);
            }
            if self.go(fill.end, total, left) {
                return true;
            }
            self.order.truncate(mark);
            for (s, &n) in fill.take.iter().enumerate() {
                left[s] += n;
            }
            if let Some(c) = fill.cross {
                left[c] += 1;
            }
        }
        false
    }

    /// The [`CANDIDATES`] best fills of the shard at `cursor`.
    fn fills(&self, cursor: usize, left: &[usize]) -> Vec<Fill> {
        let Some(boundary) = (cursor / self.shard + 1).checked_mul(self.shard) else {
            return Vec::new();
        };
        let rare: Vec<usize> = (0..left.len())
            .filter(|&s| (1..=RARE).contains(&left[s]))
            .collect();
        let mut ranker = Ranker {
            walk: self,
            left,
            boundary,
            rare,
            take: vec![0; left.len()],
            leaves: 0,
            found: Vec::new(),
            seen: HashSet::new(),
        };
        ranker.rare_counts(0, boundary - cursor);
        let mut found = ranker.found;
        found.sort_by_key(|f| (f.waste, f.rare_used));
        found.truncate(CANDIDATES);
        found
    }
}

/// Enumerates the fills of one shard.
struct Ranker<'a, 'b> {
    walk: &'a Walk<'b>,
    left: &'a [usize],
    boundary: usize,
    rare: Vec<usize>,
    /// The fill under construction.
    take: Vec<usize>,
    leaves: usize,
    found: Vec<Fill>,
    /// `(waste, crossing, end, rare counts)` of the fills found: others like them are dropped.
    seen: HashSet<(usize, Option<usize>, usize, Vec<usize>)>,
}

impl Ranker<'_, '_> {
    fn numel(&self, s: usize) -> usize {
        self.walk.shapes[s].item.numel
    }

    /// Every count of the rare shapes from `r` on, most first, then the frequent fill.
    fn rare_counts(&mut self, r: usize, room: usize) {
        if self.leaves >= LEAVES {
            return;
        }
        let Some(&s) = self.rare.get(r) else {
            let base = self.proportional(room);
            let frequent: Vec<usize> = (0..self.left.len())
                .filter(|&f| self.left[f] > RARE)
                .collect();
            self.reductions(&frequent, 0, &base, room);
            return;
        };
        let most = self.left[s].min(room / self.numel(s));
        for n in (0..=most).rev() {
            self.take[s] = n;
            self.rare_counts(r + 1, room - n * self.numel(s));
        }
        self.take[s] = 0;
    }

    /// Counts of the frequent shapes filling `room` in proportion to how many of each are
    /// left: a share of the room by elements first, then one at a time, always the shape with
    /// the largest fraction still left.
    fn proportional(&self, room: usize) -> Vec<usize> {
        let frequent = |s: usize| self.left[s] > RARE;
        let mass: u128 = (0..self.left.len())
            .filter(|&s| frequent(s))
            .map(|s| self.left[s] as u128 * self.numel(s) as u128)
            .sum();
        let mut take = vec![0usize; self.left.len()];
        if mass == 0 {
            return take;
        }
        let mut room_left = room;
        for s in (0..self.left.len()).filter(|&s| frequent(s)) {
            // At most `left`; the shares' elements sum to at most `room`.
            let share = self.left[s] as u128 * room as u128 / mass;
            let n = share.min(self.left[s] as u128) as usize;
            take[s] = n;
            room_left -= n * self.numel(s);
        }
        // At most one more of each shape fits the rounding; a few passes place them.
        for _ in 0..2 * self.left.len() {
            let next = (0..self.left.len())
                .filter(|&s| frequent(s) && take[s] < self.left[s] && self.numel(s) <= room_left)
                .max_by(|&a, &b| {
                    let fa = (self.left[a] - take[a]) as f64 / self.left[a] as f64;
                    let fb = (self.left[b] - take[b]) as f64 / self.left[b] as f64;
                    fa.total_cmp(&fb).then(b.cmp(&a))
                });
            let Some(s) = next else { break };
            take[s] += 1;
            room_left -= self.numel(s);
        }
        take
    }

    /// Up to [`REDUCTIONS`] fewer of each frequent shape than `base`, then the crossing.
    fn reductions(&mut self, frequent: &[usize], f: usize, base: &[usize], room: usize) {
        if self.leaves >= LEAVES {
            return;
        }
        let Some(&s) = frequent.get(f) else {
            self.leaves += 1;
            self.crossings(room);
            return;
        };
        for fewer in 0..=REDUCTIONS.min(base[s]) {
            let n = base[s] - fewer;
            self.take[s] = n;
            let used = n * self.numel(s);
            if used <= room {
                self.reductions(frequent, f + 1, base, room - used);
            }
        }
        self.take[s] = 0;
    }

    /// The fills that end the shard: each shape with a tensor left crossing the boundary at
    /// its earliest valid start, or nothing crossing.
    fn crossings(&mut self, room: usize) {
        let cursor = self.boundary - room;
        let rest: Vec<usize> = (0..self.left.len())
            .map(|s| self.left[s] - self.take[s])
            .collect();
        let rare_used = self.rare.iter().map(|&s| self.take[s]).sum();
        let mut any = false;
        let crossing: Vec<usize> = (0..rest.len())
            .filter(|&s| rest[s] > 0 && self.numel(s) > room)
            .collect();
        for s in crossing {
            let item = self.walk.shapes[s].item;
            let Some(start) = earliest_start(cursor, &item, self.walk.shard) else {
                continue;
            };
            let Some(end) = start.checked_add(item.numel) else {
                continue;
            };
            any = true;
            self.push(Fill {
                waste: start - cursor,
                take: self.take.clone(),
                cross: Some(s),
                end,
                rare_used,
            });
        }
        if !any {
            // Everything placed: the rest of the shard is not waste; otherwise it is a gap.
            let done = rest.iter().all(|&n| n == 0);
            self.push(Fill {
                waste: if done { 0 } else { room },
                take: self.take.clone(),
                cross: None,
                end: if done { cursor } else { self.boundary },
                rare_used,
            });
        }
    }

    fn push(&mut self, fill: Fill) {
        let rare: Vec<usize> = self.rare.iter().map(|&s| fill.take[s]).collect();
        if self.seen.insert((fill.waste, fill.cross, fill.end, rare)) {
            self.found.push(fill);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_ranks_or_shard_is_an_error() {
        let items = [Item::new(4, 2, 1).unwrap()];
        assert!(shard_fill(&items, 0, 4).is_err());
        assert!(shard_fill(&items, 2, 0).is_err());
    }
}
