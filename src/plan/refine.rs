//! Local search after [`super::partition`]: moves tensors between a unit's buffers, or into a
//! new one, while that lowers the cost of [`MultiOptions::cost_s`].
//!
//! **Why.** The partition search keeps every block-size class whole, but tensors with the same
//! block do not always belong together. In a gpt-oss-20b layer at `tile:32x32`, `V = 256`, the
//! attention `q_proj` shares its 92,160-element block with the experts' `down_proj`; together
//! with both expert tensors it pushes their buffer one 184,320-element lattice step up, while
//! in a buffer of its own it needs exactly one block per rank.
//!
//! **Moves.** For each buffer and each shape `(elements, block)` in it, some of its tensors of
//! that shape go to another buffer or to a new one (at most `K` buffers): one, all, as many as
//! fill the room the target's lattice leaves, or the fewest that lower the source's bound by a
//! lattice step (identical experts can be spread over buffers this way); each of those also
//! together with every tensor of the source that never forces a lattice (fewer than two
//! blocks: norms), and those alone, since small tensors that cost the source a lattice step
//! only move as one (`bundles`). A move is
//! ranked by the single-buffer lower bounds of the two changed buffers
//! ([`super::search::any_order_lower_bound`], no layout). The best-ranked move that could lower
//! the cost is tested by the quick search of [`min_shard_below`] (only below the sizes that
//! could still win, bounded work), then planned by [`plan_items`] and kept if it lowers the
//! cost. The search stops when no move can lower the cost or after [`MOVE_PLANS`] tested
//! moves, so its time is bounded.

use super::multi::MultiOptions;
use super::partition::Partition;
use super::search::{any_order_lower_bound, min_shard_below, ForcedLattice};
use super::{plan_items, Item, Layout, PlanOptions};

/// At most this many moves are tested per unit.
pub const MOVE_PLANS: usize = 12;

/// Tensor placements the quick test of one changed buffer may spend in its exact finish
/// ([`min_shard_below`]); a move the test cannot confirm is not taken.
pub const MOVE_WORK: usize = 1 << 18;

/// `start` improved by the moves of the module doc, with at most `mopts.max_buffers` buffers;
/// up to `sideways` of the moves may keep the cost equal ([`SIDEWAYS_MOVES`]).
pub fn refine(
    items: &[Item],
    world: usize,
    opts: &PlanOptions,
    mopts: &MultiOptions,
    start: Partition,
    sideways: usize,
) -> Partition {
    let cost_of = |p: &Partition| mopts.cost_s(p.groups.len(), p.shard_sum, world);
    let mut best = start;
    let mut current = best.clone();
    let mut sideways = sideways;
    let mut tried: Vec<Vec<Vec<usize>>> = Vec::new();
    for _ in 0..MOVE_PLANS {
        let cost = cost_of(&current);
        let draft = Draft::of(&current);
        // A sideways move only pays if a later one lowers the cost: the test admits moves
        // up to the current cost then (equal included), else only lower ones.
        let admit = if sideways > 0 { above(cost) } else { cost };
        let Some(moved) = best_ranked_move(items, world, opts, mopts, &draft, admit, &tried) else {
            break;
        };
        tried.push(moved.clone());
        // The quick test first; only a move it confirms is planned exactly.
        let planned = test_groups(items, world, opts, mopts, &draft, moved, admit)
            .and_then(|next| finish(items, world, opts, next));
        let Some(p) = planned else { continue };
        let c = cost_of(&p);
        if c < cost {
            current = p;
            tried.clear();
            if c < cost_of(&best) {
                best = current.clone();
            }
        } else if c == cost && sideways > 0 && p.groups != current.groups {
            // Equal cost: step to it once (never back: the layout left is tried).
            sideways -= 1;
            tried.push(current.groups.clone());
            current = p;
        }
    }
    best
}

/// Moves that may keep the cost equal (each one step, never back) in the last refinement of
/// [`super::multi`]'s winner, so that two moves can lower it where neither alone does (only
/// there: from every start they cost up to 4× the plan time, DeepSeek-V3 at `tile:32x32`,
/// `V = 1024`). In a Qwen3-30B-A3B layer at `rows:1`,
/// `V = 256`, `o_proj` alone and the rest in one buffer pad 1,007 elements per rank; moving
/// the experts' `gate/up_proj` next to `o_proj` keeps that (both buffers' contents end on the
/// same lattice steps), and then `q_proj` joins them: that buffer is exactly full at 400 steps
/// of 4,096 and the other, no longer forced, pads 239 (the floor).
pub const SIDEWAYS_MOVES: usize = 1;

/// The next float above a non-negative finite `x` (`x` itself otherwise).
fn above(x: f64) -> f64 {
    if x.is_finite() && x >= 0.0 {
        f64::from_bits(x.to_bits() + 1)
    } else {
        x
    }
}

/// A partition under test: sizes of changed buffers come from the quick test (feasible, maybe
/// not the smallest), layouts only for the buffers the move left alone.
struct Draft {
    groups: Vec<Vec<usize>>,
    sizes: Vec<usize>,
    layouts: Vec<Option<Layout>>,
}

impl Draft {
    fn of(p: &Partition) -> Self {
        Draft {
            groups: p.groups.clone(),
            sizes: p.layouts.iter().map(|l| l.shard_size).collect(),
            layouts: p.layouts.iter().cloned().map(Some).collect(),
        }
    }
}

/// Plans the buffers the moves changed ([`plan_items`]); `None` when one fails.
fn finish(items: &[Item], world: usize, opts: &PlanOptions, draft: Draft) -> Option<Partition> {
    let layouts = draft
        .groups
        .iter()
        .zip(draft.layouts)
        .map(|(group, known)| match known {
            Some(l) => Some(l),
            None => {
                let sub: Vec<Item> = group.iter().map(|&i| items[i]).collect();
                plan_items(&sub, world, opts).ok()
            }
        })
        .collect::<Option<Vec<Layout>>>()?;
    let shard_sum = layouts
        .iter()
        .try_fold(0usize, |acc, l| acc.checked_add(l.shard_size))?;
    Some(Partition {
        groups: draft.groups,
        layouts,
        shard_sum,
    })
}

/// The groups after the move with the smallest summed lower bound that could still beat `cost`
/// and has not been tried. Moves are ranked on shape counts, so ranking one costs the number
/// of shapes in the two buffers, not their tensors.
fn best_ranked_move(
    items: &[Item],
    world: usize,
    opts: &PlanOptions,
    mopts: &MultiOptions,
    current: &Draft,
    cost: f64,
    tried: &[Vec<Vec<usize>>],
) -> Option<Vec<Vec<usize>>> {
    let shapes: Vec<Vec<Shape>> = current.groups.iter().map(|g| shapes_of(items, g)).collect();
    let sizes = &current.sizes;
    let n = current.groups.len();
    let targets = n + usize::from(n < mopts.max_buffers);
    let no_shapes = Vec::new();
    let mut best: Option<(usize, Vec<Vec<usize>>)> = None;
    for from in 0..n {
        for to in (0..targets).filter(|&t| t != from) {
            let target = shapes.get(to).unwrap_or(&no_shapes);
            for bundle in bundles(&shapes[from], target, world, opts) {
                let bounds = [
                    shapes_bound(&shapes[from], &bundle, -1, world, opts),
                    shapes_bound(target, &bundle, 1, world, opts),
                ];
                let others = (0..n)
                    .filter(|&b| b != from && b != to)
                    .map(|b| Some(sizes[b]));
                let sum = bounds
                    .into_iter()
                    .chain(others)
                    .try_fold(0usize, |acc, x| acc.checked_add(x?));
                let Some(sum) = sum else { continue };
                let moved: usize = bundle.iter().map(|s| s.count).sum();
                let held: usize = shapes[from].iter().map(|s| s.count).sum();
                let k = n + usize::from(to == n) - usize::from(moved == held);
                let worse = best.as_ref().is_some_and(|b| sum >= b.0);
                if worse || mopts.cost_s(k, sum, world) >= cost {
                    continue;
                }
                let groups = apply_move(items, &current.groups, from, to, &bundle);
                if !tried.contains(&groups) {
                    best = Some((sum, groups));
                }
            }
        }
    }
    best.map(|b| b.1)
}

/// What one move from a buffer holding `from` to one holding `to` takes, as shapes with the
/// number of their tensors that move: tensors of one shape ([`move_counts`]), each of those
/// together with every tensor of the source that never forces a lattice (fewer than two
/// blocks: norms, biases), and those alone. The second kind moves a tensor with the small
/// ones that would otherwise cost the source a lattice step by themselves: in a Qwen3-235B
/// layer at `rows:1`, `V = 1024`, the router and the norms leave the attention and the
/// experts' `gate/up_proj` exactly 393 steps of 4,096 per rank, and join the `down_proj`
/// buffer, which has room for them; either move alone raises the sum of the bounds.
fn bundles(from: &[Shape], to: &[Shape], world: usize, opts: &PlanOptions) -> Vec<Vec<Shape>> {
    let free = |s: &Shape| s.item.numel / 2 < s.item.block;
    let small: Vec<Shape> = from.iter().copied().filter(free).collect();
    let mut out = Vec::new();
    for shape in from {
        for m in move_counts(from, to, shape, world, opts) {
            let one = Shape { count: m, ..*shape };
            out.push(vec![one]);
            if !small.is_empty() && !free(shape) {
                out.push(std::iter::once(one).chain(small.iter().copied()).collect());
            }
        }
    }
    if small.len() > 1 {
        out.push(small);
    }
    out
}

/// How many tensors of `shape` a move from `from` to `to` takes: one, all, as many as fit in
/// `to` without raising its bound (filling the room its lattice leaves), and the fewest that
/// lower the bound of `from` (one lattice step down).
fn move_counts(
    from: &[Shape],
    to: &[Shape],
    shape: &Shape,
    world: usize,
    opts: &PlanOptions,
) -> Vec<usize> {
    let all = shape.count;
    let mut counts = vec![1, all];
    let with = |m: usize| [Shape { count: m, ..*shape }];
    let to_now = shapes_bound(to, &with(0), 1, world, opts);
    if !to.is_empty() {
        // Bounds only grow with more tensors added: the last m that keeps `to_now`.
        let fits = |m: usize| shapes_bound(to, &with(m), 1, world, opts) <= to_now;
        if let Some(m) = last_true(all, fits) {
            counts.push(m);
        }
    }
    let from_now = shapes_bound(from, &with(0), -1, world, opts);
    // Bounds only shrink with more tensors removed: the first m that lowers `from_now`.
    let keeps = |m: usize| shapes_bound(from, &with(m), -1, world, opts) >= from_now;
    if let Some(m) = last_true(all, keeps).filter(|&m| m < all) {
        counts.push(m + 1);
    }
    counts.sort_unstable();
    counts.dedup();
    counts
}

/// The largest `m` in `1..=n` with `pred(m)`, for a `pred` true up to some `m` and false after.
fn last_true(n: usize, pred: impl Fn(usize) -> bool) -> Option<usize> {
    if n == 0 || !pred(1) {
        return None;
    }
    let (mut lo, mut hi) = (1, n);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if pred(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Some(lo)
}

/// Tensors of one `(elements, block)` in a buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Shape {
    item: Item,
    count: usize,
}

fn same_shape(a: &Item, b: &Item) -> bool {
    a.numel == b.numel && a.block == b.block
}

fn shapes_of(items: &[Item], group: &[usize]) -> Vec<Shape> {
    let mut shapes: Vec<Shape> = Vec::new();
    for &i in group {
        let t = items[i];
        match shapes.iter_mut().find(|s| same_shape(&s.item, &t)) {
            Some(s) => s.count += 1,
            None => shapes.push(Shape { item: t, count: 1 }),
        }
    }
    shapes
}

/// [`super::search::any_order_lower_bound`] of a buffer's shapes with the tensors of `changed`
/// added (`sign` 1) or removed (`sign` -1): only the largest tensor of each block decides
/// whether it is forced, so the shapes suffice. 0 for an emptied buffer, `None` on overflow.
fn shapes_bound(
    shapes: &[Shape],
    changed: &[Shape],
    sign: i8,
    world: usize,
    opts: &PlanOptions,
) -> Option<usize> {
    let mut list: Vec<Shape> = shapes.to_vec();
    for c in changed {
        match list.iter_mut().find(|s| same_shape(&s.item, &c.item)) {
            Some(s) if sign > 0 => s.count = s.count.checked_add(c.count)?,
            Some(s) => s.count = s.count.saturating_sub(c.count),
            None if sign > 0 => list.push(*c),
            None => {}
        }
    }
    list.retain(|s| s.count > 0);
    if list.is_empty() {
        return Some(0);
    }
    let total = list.iter().try_fold(0usize, |acc, s| {
        acc.checked_add(s.item.numel.checked_mul(s.count)?)
    })?;
    let largest = list.iter().map(|s| s.item.block).max().unwrap_or(1);
    let forcing: Vec<Item> = list.iter().map(|s| s.item).collect();
    ForcedLattice::new(&forcing, opts.coll_align)
        .next_candidate(total.div_ceil(world).max(largest).max(1))
}

/// The groups after moving, for each shape of `bundle`, its `count` last tensors (in unit
/// order) from buffer `from` to buffer `to` (`to == groups.len()`: a new buffer); emptied
/// buffers dropped.
fn apply_move(
    items: &[Item],
    groups: &[Vec<usize>],
    from: usize,
    to: usize,
    bundle: &[Shape],
) -> Vec<Vec<usize>> {
    let mut groups = groups.to_vec();
    if to == groups.len() {
        groups.push(Vec::new());
    }
    for shape in bundle {
        let (staying, moving) = split_last(items, &groups[from], shape);
        groups[from] = staying;
        groups[to].extend_from_slice(&moving);
    }
    groups[to].sort_unstable();
    groups.retain(|g| !g.is_empty());
    groups
}

/// `group` without, and the list of, its last `shape.count` tensors of that shape: one pass,
/// whatever the number of tensors.
fn split_last(items: &[Item], group: &[usize], shape: &Shape) -> (Vec<usize>, Vec<usize>) {
    let matching = group
        .iter()
        .filter(|&&i| same_shape(&items[i], &shape.item))
        .count();
    let keep = matching.saturating_sub(shape.count);
    let (mut seen, mut moving, mut staying) = (0usize, Vec::new(), Vec::new());
    for &i in group {
        if same_shape(&items[i], &shape.item) {
            seen += 1;
            if seen > keep {
                moving.push(i);
                continue;
            }
        }
        staying.push(i);
    }
    (staying, moving)
}

/// The draft after the move to `groups` if the quick test finds sizes for the changed buffers
/// that make the cost lower than `cost`; `None` otherwise. Each changed buffer is searched only
/// below the size that could still win ([`min_shard_below`], [`MOVE_WORK`] placements), so a
/// move that cannot win costs little.
fn test_groups(
    items: &[Item],
    world: usize,
    opts: &PlanOptions,
    mopts: &MultiOptions,
    current: &Draft,
    groups: Vec<Vec<usize>>,
    cost: f64,
) -> Option<Draft> {
    let known: Vec<Option<usize>> = groups
        .iter()
        .map(|g| current.groups.iter().position(|c| c == g))
        .collect();
    let kept = known
        .iter()
        .flatten()
        .try_fold(0usize, |acc, &b| acc.checked_add(current.sizes[b]))?;
    // Σ S must stay below this for the cost to drop.
    let mut budget = mopts
        .shard_sum_below_cost(groups.len(), world, cost)?
        .checked_sub(kept)?;
    let changed: Vec<usize> = (0..groups.len()).filter(|&g| known[g].is_none()).collect();
    let mut sizes: Vec<usize> = known
        .iter()
        .map(|b| b.map_or(0, |b| current.sizes[b]))
        .collect();
    for (n, &g) in changed.iter().enumerate() {
        let sub = normalized(items, &groups[g], opts)?;
        // The buffers after this one need at least their lower bounds.
        let later = changed[n + 1..].iter().try_fold(0usize, |acc, &h| {
            let rest = normalized(items, &groups[h], opts)?;
            acc.checked_add(any_order_lower_bound(&rest, world, opts.coll_align).ok()?)
        })?;
        let cap = budget.checked_sub(later)?;
        let size = opts
            .orders
            .iter()
            .filter_map(|order| {
                let arranged: Vec<Item> = order.arrange(&sub).iter().map(|&i| sub[i]).collect();
                min_shard_below(&arranged, world, opts.coll_align, cap, MOVE_WORK)
            })
            .min()?;
        budget -= size;
        sizes[g] = size;
    }
    let layouts = known
        .iter()
        .map(|b| b.and_then(|b| current.layouts[b].clone()))
        .collect();
    Some(Draft {
        groups,
        sizes,
        layouts,
    })
}

/// The group's items as [`plan_items`] sees them (the start alignment applied).
fn normalized(items: &[Item], group: &[usize], opts: &PlanOptions) -> Option<Vec<Item>> {
    group
        .iter()
        .map(|&i| {
            let t = items[i];
            Item::new(t.numel, t.block, t.align.max(opts.start_align)).ok()
        })
        .collect()
}
