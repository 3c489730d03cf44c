//! Units made of many identical tensors (an MoE layer's experts, shrunk): the k-buffer floor
//! and its common-step part are true lower bounds, and the planner's split by count meets the
//! optimum on most inputs, against exhaustive search over every count of each shape in each
//! buffer and every distinct order of each buffer.

use std::collections::HashMap;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use ragged::plan::multi::{floor_shard_sum, plan_multi_items, MultiOptions};
use ragged::plan::oracle::exact_for_order;
use ragged::plan::step_floor::{step_floor, step_floor_deep, step_floor_k};
use ragged::plan::{Item, PlanOptions};

/// The smallest `S` of one buffer holding `counts[c]` tensors of `shapes[c]`, over every
/// distinct order of that multiset.
fn exact_buffer(shapes: &[Item], counts: &[usize], world: usize, coll: usize) -> usize {
    fn orders(
        left: &mut [usize],
        shapes: &[Item],
        prefix: &mut Vec<Item>,
        out: &mut Vec<Vec<Item>>,
    ) {
        if left.iter().all(|&n| n == 0) {
            out.push(prefix.clone());
            return;
        }
        for c in 0..left.len() {
            if left[c] > 0 {
                left[c] -= 1;
                prefix.push(shapes[c]);
                orders(left, shapes, prefix, out);
                prefix.pop();
                left[c] += 1;
            }
        }
    }
    let mut all = Vec::new();
    orders(&mut counts.to_vec(), shapes, &mut Vec::new(), &mut all);
    all.iter()
        .map(|order| exact_for_order(order, world, coll).unwrap())
        .min()
        .unwrap()
}

/// The `(numel, block, copies)` of an expert-like unit in pieces of `d` elements: `copies` of
/// one `u`-piece shape cut every `b` pieces, one tensor per `(pieces, block)` of `rare`, and a
/// one-element norm outside the pieces when `norm` (blocks capped at their tensor's size).
fn expert_spec(
    d: usize,
    (u, b): (usize, usize),
    copies: usize,
    rare: &[(usize, usize)],
    norm: bool,
) -> Vec<(usize, usize, usize)> {
    let mut spec = vec![(d * u, d * b.min(u), copies)];
    spec.extend(rare.iter().map(|&(w, rb)| (d * w, d * rb.min(w), 1)));
    if norm {
        spec.push((1, 1, 1));
    }
    spec
}

/// A unit from `(numel, block, copies)` per shape: its shapes, their counts, and every tensor
/// (each shape repeated `copies` times), start alignment 1.
fn unit_of(spec: &[(usize, usize, usize)]) -> (Vec<Item>, Vec<usize>, Vec<Item>) {
    let counts: Vec<usize> = spec.iter().map(|s| s.2).collect();
    let shapes: Vec<Item> = spec
        .iter()
        .map(|&(e, g, _)| Item::new(e, g, 1).unwrap())
        .collect();
    let items: Vec<Item> = shapes
        .iter()
        .zip(&counts)
        .flat_map(|(&t, &n)| std::iter::repeat_n(t, n))
        .collect();
    (shapes, counts, items)
}

/// The smallest `Σ S` over every way to give each buffer (at most `k`) a count of each shape.
fn exhaustive(shapes: &[Item], counts: &[usize], world: usize, coll: usize, k: usize) -> usize {
    let mut memo: HashMap<Vec<usize>, usize> = HashMap::new();
    let mut best = usize::MAX;
    // Buffer b's counts: `taken[b]`; the last buffer gets what is left.
    fn go(
        c: usize,
        taken: &mut Vec<Vec<usize>>,
        ctx: (&[Item], &[usize], usize, usize),
        memo: &mut HashMap<Vec<usize>, usize>,
        best: &mut usize,
    ) {
        let (shapes, counts, world, coll) = ctx;
        if c == shapes.len() {
            let mut sum = 0;
            for buffer in taken.iter().filter(|b| b.iter().any(|&n| n > 0)) {
                sum += *memo
                    .entry(buffer.clone())
                    .or_insert_with(|| exact_buffer(shapes, buffer, world, coll));
            }
            *best = (*best).min(sum);
            return;
        }
        // Every split of shape c's count over the buffers.
        fn split(
            b: usize,
            left: usize,
            c: usize,
            taken: &mut Vec<Vec<usize>>,
            ctx: (&[Item], &[usize], usize, usize),
            memo: &mut HashMap<Vec<usize>, usize>,
            best: &mut usize,
        ) {
            if b + 1 == taken.len() {
                taken[b][c] = left;
                go(c + 1, taken, ctx, memo, best);
                return;
            }
            for n in 0..=left {
                taken[b][c] = n;
                split(b + 1, left - n, c, taken, ctx, memo, best);
            }
        }
        split(0, counts[c], c, taken, ctx, memo, best);
    }
    let mut taken = vec![vec![0; shapes.len()]; k];
    go(
        0,
        &mut taken,
        (shapes, counts, world, coll),
        &mut memo,
        &mut best,
    );
    best
}

/// Free collectives: any split that lowers `Σ S` is taken.
fn free(k: usize) -> MultiOptions {
    MultiOptions {
        max_buffers: k,
        collective_latency_s: 0.0,
        ..MultiOptions::default()
    }
}

#[test]
fn floors_hold_and_the_split_meets_the_optimum_on_many_identical_tensors() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    // 2 or 3 shapes, 1 to 6 copies each (at most 10 tensors).
    let strategy = (
        prop::collection::vec((1..=40usize, 1..=12usize, 1..=6usize), 2..=3),
        1..=8usize,
        prop::sample::select(vec![1usize, 2, 4]),
    );
    let (mut cases, mut plan_optimal, mut floor_tight, mut step_raised) = (0, 0, 0, 0);
    let mut step_k_raised = 0;
    while cases < 360 {
        let (spec, world, coll) = strategy.new_tree(&mut runner).unwrap().current();
        let (shapes, counts, items) = unit_of(&spec);
        if counts.iter().sum::<usize>() > 10 {
            continue;
        }
        let opts = PlanOptions {
            coll_align: coll,
            ..PlanOptions::default()
        };
        let step = step_floor(&items, world, coll).unwrap();
        for k in 1..=3 {
            let best = exhaustive(&shapes, &counts, world, coll, k);
            let floor = floor_shard_sum(&items, world, coll, k).unwrap();
            let ctx = format!("{spec:?} V={world} coll={coll} k={k}");
            assert!(floor <= best, "{ctx}: floor {floor} > optimum {best}");
            // The common-step bound holds for any number of buffers, and for at most k.
            assert!(step <= best, "{ctx}: step floor {step} > optimum {best}");
            let step_k = step_floor_k(&items, world, coll, k).unwrap();
            assert!(
                step_k <= best,
                "{ctx}: k-buffer step floor {step_k} > optimum {best}"
            );
            step_k_raised += usize::from(step_k > step);
            let deep = step_floor_deep(&items, world, coll, k).unwrap();
            assert!(
                deep <= best,
                "{ctx}: deep step floor {deep} > optimum {best}"
            );
            let plan = plan_multi_items(&items, world, &opts, &free(k)).unwrap();
            assert!(
                plan.shard_sum() >= best,
                "{ctx}: planner beat exhaustive search"
            );
            plan_optimal += usize::from(plan.shard_sum() == best);
            floor_tight += usize::from(floor == best);
            let share = items.iter().map(|t| t.numel).sum::<usize>().div_ceil(world);
            step_raised += usize::from(step > share.next_multiple_of(coll));
            cases += 1;
        }
    }
    println!("planner optimal {plan_optimal}, floor tight {floor_tight}, of {cases}");
    // The misses are the single-buffer planner's: its three orders do not always hold the
    // best one (80 % optimal when this was written).
    assert!(
        plan_optimal * 4 >= cases * 3,
        "planner optimal in {plan_optimal} of {cases}"
    );
    assert!(
        floor_tight * 2 > cases,
        "floor tight in only {floor_tight} of {cases}"
    );
    assert!(
        step_raised > 0,
        "the common-step bound never rose above the share"
    );
    // With one or two buffers the forced tensors' lcm (and Q's fewer buffers) counts.
    println!("k-buffer step floor above the any-k one in {step_k_raised} of {cases}");
    assert!(
        step_k_raised > 0,
        "the k-buffer common-step bound never rose above the any-k one"
    );
}

/// Unforced experts, shrunk: tensors of one size `D·u` with two blocks that are multiples of
/// `D` (a Qwen3 layer's gate/up and down experts), and sometimes a norm-like tensor that is
/// not. Each part of an expert inside a shard is a multiple of `D`, which the piece floor
/// sees and the share does not. It holds against exhaustive search for any number of buffers
/// and raises the floor above the share on some inputs.
#[test]
fn piece_floor_holds_on_unforced_experts() {
    use ragged::plan::piece_floor::piece_floor;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    // (D, u, two blocks in units of D, copies of each, norm elements, V).
    let strategy = (
        2..=4usize,
        3..=8usize,
        (1..=4usize, 1..=4usize),
        (1..=4usize, 1..=4usize),
        0..=3usize,
        2..=8usize,
    );
    let (mut cases, mut raised, mut tight) = (0, 0, 0);
    while cases < 240 {
        let (d, u, (b1, b2), (n1, n2), norm, world) =
            strategy.new_tree(&mut runner).unwrap().current();
        let mut spec = vec![(d * u, d * b1, n1), (d * u, d * b2, n2)];
        if b1 == b2 {
            spec.pop();
            spec[0].2 += n2;
        }
        if norm > 0 {
            spec.push((norm, norm, 1));
        }
        let (shapes, counts, items) = unit_of(&spec);
        let piece = piece_floor(&items, world, 1).unwrap();
        let share = items.iter().map(|t| t.numel).sum::<usize>().div_ceil(world);
        for k in 1..=3 {
            let best = exhaustive(&shapes, &counts, world, 1, k);
            let ctx = format!("{spec:?} V={world} k={k}");
            assert!(piece <= best, "{ctx}: piece floor {piece} > optimum {best}");
            let floor = floor_shard_sum(&items, world, 1, k).unwrap();
            assert!(
                floor >= piece,
                "{ctx}: the k-buffer floor drops the piece floor"
            );
            raised += usize::from(piece > share);
            tight += usize::from(floor == best);
            cases += 1;
        }
    }
    println!(
        "piece floor above the share in {raised}, k-buffer floor tight in {tight}, of {cases}"
    );
    assert!(
        raised * 10 > cases,
        "the piece floor rose above the share in {raised} of {cases}"
    );
    assert!(tight * 2 > cases, "floor tight in only {tight} of {cases}");
}

/// Forced tensors with coarse and fine lattices, shrunk (a DeepSeek-V3 layer's experts next to
/// `kv_b_proj`, a Mixtral layer's `w1` next to `w2`): tensors long enough to be forced at the
/// share, blocks that are multiples of 2 or 4, one shape with an odd block, and sometimes small
/// tensors (a router, norms) that are never forced. The two-lattice floor holds against
/// exhaustive search for any number of buffers, and rises above the common-step floor on some
/// inputs.
#[test]
fn lattice_floor_holds_on_coarse_and_fine_forced_tensors() {
    use ragged::plan::lattice_floor::lattice_floor;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    // (elements and even block of the coarse shape, copies; elements and odd block of the
    // fine shape, copies; elements, block and copies of the small shape; V).
    let strategy = (
        (8..=40usize, prop::sample::select(vec![2usize, 4, 6, 8])),
        1..=4usize,
        (4..=30usize, prop::sample::select(vec![1usize, 3, 5])),
        1..=3usize,
        (1..=4usize, 1..=4usize, 0..=2usize),
        4..=12usize,
    );
    let (mut cases, mut raised) = (0, 0);
    while cases < 240 {
        let ((e1, g1), n1, (e2, g2), n2, (e3, g3, n3), world) =
            strategy.new_tree(&mut runner).unwrap().current();
        let mut spec = vec![(e1, g1, n1), (e2, g2, n2)];
        if n3 > 0 {
            spec.push((e3, g3.min(e3), n3));
        }
        let (shapes, counts, items) = unit_of(&spec);
        let lattice = lattice_floor(&items, world, 1).unwrap();
        let step = step_floor(&items, world, 1).unwrap();
        for k in 1..=3 {
            let best = exhaustive(&shapes, &counts, world, 1, k);
            let ctx = format!("{spec:?} V={world} k={k}");
            assert!(
                lattice <= best,
                "{ctx}: lattice floor {lattice} > optimum {best}"
            );
            assert!(
                floor_shard_sum(&items, world, 1, k).unwrap() >= lattice,
                "{ctx}"
            );
            raised += usize::from(lattice > step);
            cases += 1;
        }
    }
    println!("two-lattice floor above the common-step floor in {raised} of {cases}");
    assert!(
        raised > 0,
        "the two-lattice floor never rose above the common-step floor"
    );
}

/// Units whose piece tensors fill exactly `m` pieces per rank (a Qwen3 MoE layer at V = 8,
/// shrunk): five or six copies of one expert-like shape and one or two rare tensors, in pieces
/// of `D` elements, sometimes with a norm-like tensor outside the pieces. Where the residue
/// floor applies it holds against exhaustive search over every order of one buffer, and it
/// rises above the piece floor on some inputs.
#[test]
fn residue_floor_holds_when_the_shards_hold_exactly_m_pieces() {
    use ragged::plan::piece_floor::piece_floor;
    use ragged::plan::residue_floor::residue_floor;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    // (D, expert pieces and block, copies, rare tensors (pieces, block), norm, V).
    let strategy = (
        1..=2usize,
        (3..=6usize, 1..=3usize),
        5..=6usize,
        prop::collection::vec((1..=6usize, 1..=3usize), 1..=2),
        0..=1usize,
        2..=4usize,
    );
    let (mut applied, mut raised, mut tried) = (0, 0, 0);
    while tried < 3000 && applied < 60 {
        tried += 1;
        let (d, (u, b), copies, rare, norm, world) =
            strategy.new_tree(&mut runner).unwrap().current();
        let spec = expert_spec(d, (u, b), copies, &rare, norm > 0);
        let (shapes, counts, items) = unit_of(&spec);
        let Some(bound) = residue_floor(&items, world, 1, d) else {
            continue;
        };
        let best = exhaustive(&shapes, &counts, world, 1, 1);
        assert!(
            bound <= best,
            "{spec:?} V={world}: residue floor {bound} > optimum {best}"
        );
        let floor = floor_shard_sum(&items, world, 1, 1).unwrap();
        assert!(floor <= best, "{spec:?} V={world}: floor {floor} > {best}");
        applied += 1;
        raised += usize::from(bound > piece_floor(&items, world, 1).unwrap());
    }
    println!("residue floor applied in {applied} of {tried}, above the piece floor in {raised}");
    assert!(
        applied >= 20 && raised > 0,
        "applied {applied}, raised {raised}"
    );
}

/// Units of one expert-like shape in five to seven copies (frequent), one to three rare
/// tensors and sometimes a norm-like tensor outside the pieces of `D` elements, so that the
/// shards may leave some pieces empty (the residue floor's exact fill does not apply). Where
/// the waste floor proves a level empty it holds against exhaustive search over every order of
/// one buffer, and it rises above the one-buffer floor on some inputs; likewise with two
/// frequent shapes of one size and different blocks (an expert's `gate/up_proj` and
/// `down_proj`).
#[test]
fn waste_floor_is_a_true_lower_bound_against_exhaustive_search() {
    use ragged::plan::waste_floor::waste_floor;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    // (D, expert pieces and block, copies, rare tensors (pieces, block), norm, V, coll).
    let strategy = (
        1..=2usize,
        (2..=7usize, 1..=4usize),
        5..=7usize,
        prop::collection::vec((1..=8usize, 1..=4usize), 1..=3),
        0..=1usize,
        2..=5usize,
        prop::sample::select(vec![1usize, 2]),
    );
    let (mut applied, mut raised, mut tried) = (0, 0, 0);
    while tried < 10000 && applied < 400 {
        tried += 1;
        let (d, (u, b), copies, rare, norm, world, coll) =
            strategy.new_tree(&mut runner).unwrap().current();
        let spec = expert_spec(d, (u, b), copies, &rare, norm > 0);
        let (shapes, counts, items) = unit_of(&spec);
        let Some(bound) = waste_floor(&items, world, coll, d, usize::MAX) else {
            continue;
        };
        let best = exact_buffer(&shapes, &counts, world, coll);
        assert!(
            bound <= best,
            "{spec:?} V={world} coll={coll}: waste floor {bound} > optimum {best}"
        );
        // Capped below the optimum it never passes the cap.
        if let Some(capped) = waste_floor(&items, world, coll, d, best) {
            assert!(capped <= best, "{spec:?} V={world}: {capped} > cap {best}");
        }
        applied += 1;
        raised += usize::from(bound > floor_shard_sum(&items, world, coll, 1).unwrap());
    }
    println!("waste floor applied in {applied} of {tried}, above the one-buffer floor in {raised}");
    assert!(
        applied >= 50 && raised > 0,
        "applied {applied}, raised {raised}"
    );
    // Two frequent shapes of equal size and different blocks (`gate/up_proj` and `down_proj`),
    // five copies each, and one rare tensor.
    let strategy = (
        1..=2usize,
        (3..=8usize, 1..=4usize, 1..=4usize),
        (1..=8usize, 1..=4usize),
        2..=5usize,
        prop::sample::select(vec![1usize, 2]),
    );
    let (mut applied, mut raised, mut tried) = (0, 0, 0);
    while tried < 3000 && applied < 100 {
        tried += 1;
        let (d, (u, b1, b2), (w, rb), world, coll) =
            strategy.new_tree(&mut runner).unwrap().current();
        let spec = [
            (d * u, d * b1.min(u), 5),
            (d * u, d * b2.min(u), 5),
            (d * w, d * rb.min(w), 1),
        ];
        let (shapes, counts, items) = unit_of(&spec);
        let Some(bound) = waste_floor(&items, world, coll, d, usize::MAX) else {
            continue;
        };
        let best = exact_buffer(&shapes, &counts, world, coll);
        assert!(
            bound <= best,
            "{spec:?} V={world} coll={coll}: waste floor {bound} > optimum {best}"
        );
        applied += 1;
        raised += usize::from(bound > floor_shard_sum(&items, world, coll, 1).unwrap());
    }
    println!("two frequent shapes: applied in {applied} of {tried}, above the floor in {raised}");
    assert!(applied >= 30, "applied {applied}");
}
