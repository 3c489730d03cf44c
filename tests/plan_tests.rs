//! Planner properties and the test vectors of `reference/planner.md` §5.

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use ragged::plan::fit::greedy;
use ragged::plan::oracle::{exact_any_order, exact_for_order, exhaustive_for_order};
use ragged::plan::search::min_shard;
use ragged::plan::{plan_items, Item, Order, PlanOptions};

fn items(spec: &[(usize, usize)]) -> Vec<Item> {
    spec.iter()
        .map(|&(e, g)| Item::new(e, g, 1).unwrap())
        .collect()
}

fn module_order(coll: usize) -> PlanOptions {
    PlanOptions {
        coll_align: coll,
        start_align: 1,
        orders: vec![Order::Module],
    }
}

/// Units per rank of a tensor at `offset`, straight from the definition (planner.md §6).
fn units(offset: usize, item: &Item, shard: usize, world: usize) -> Vec<usize> {
    (0..world)
        .map(|k| {
            let lo = offset.max(k * shard);
            let hi = (offset + item.numel).min((k + 1) * shard);
            hi.saturating_sub(lo).div_ceil(item.block)
        })
        .collect()
}

const TV1: [(usize, usize); 4] = [(27, 3), (22, 2), (27, 3), (16, 8)];

#[test]
fn tv1_feasibility_is_not_monotone_in_shard_size() {
    let tv1 = items(&TV1);
    assert!(greedy(&tv1, 16, 6).is_some());
    assert!(greedy(&tv1, 17, 6).is_none());
    assert!(greedy(&tv1, 18, 6).is_some());
}

#[test]
fn tv1_planner_finds_the_optimum_past_the_non_monotone_gap() {
    let tv1 = items(&TV1);
    let layout = plan_items(&tv1, 6, &module_order(1)).unwrap();
    assert_eq!(layout.shard_size, 16);
    assert_eq!(layout.offsets, vec![1, 28, 52, 80]);
    assert_eq!(6 * 16 - 92, 4, "padding of the test vector");
    let want = [
        vec![5, 4, 0, 0, 0, 0],
        vec![0, 2, 8, 1, 0, 0],
        vec![0, 0, 0, 4, 5, 0],
        vec![0, 0, 0, 0, 0, 2],
    ];
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&units(layout.offsets[i], &tv1[i], 16, 6), w, "tensor {i}");
    }
}

#[test]
fn tv1_only_two_of_twelve_distinct_orders_reach_sixteen() {
    let mut orders = std::collections::BTreeSet::new();
    let mut perm = [0usize, 1, 2, 3];
    permute(&mut perm, 0, &mut |p| {
        orders.insert(p.iter().map(|&i| TV1[i]).collect::<Vec<_>>());
    });
    assert_eq!(orders.len(), 12);
    let best = orders
        .iter()
        .filter(|o| exact_for_order(&items(o), 6, 1).unwrap() == 16)
        .count();
    assert_eq!(best, 2);
    let mut by_size = TV1.to_vec();
    by_size.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    assert_eq!(exact_for_order(&items(&by_size), 6, 1).unwrap(), 18);
}

fn permute(p: &mut [usize; 4], k: usize, f: &mut impl FnMut(&[usize])) {
    if k == p.len() {
        return f(p);
    }
    for i in k..p.len() {
        p.swap(k, i);
        permute(p, k + 1, f);
        p.swap(k, i);
    }
}

#[test]
fn tv2_forced_case_three_skips_off_lattice_sizes() {
    let tv2 = items(&[(24, 4)]);
    let feasible: Vec<bool> = (8..=12).map(|s| greedy(&tv2, s, 3).is_some()).collect();
    assert_eq!(feasible, vec![true, false, false, false, true]);
    assert_eq!(plan_items(&tv2, 3, &module_order(1)).unwrap().shard_size, 8);
}

#[test]
fn tv3_collective_alignment_and_a_case_three_tensor() {
    let tv3 = items(&[(24, 3), (144, 16), (24, 8)]);
    for s in [20, 24, 28] {
        assert!(greedy(&tv3, s, 16).is_none(), "S={s} must be infeasible");
    }
    let layout = plan_items(&tv3, 16, &module_order(4)).unwrap();
    assert_eq!(layout.shard_size, 16);
    assert_eq!(layout.offsets, vec![1, 32, 176]);
    let mid = units(32, &tv3[1], 16, 16);
    let want: Vec<usize> = (0..16)
        .map(|k| usize::from((2..=10).contains(&k)))
        .collect();
    assert_eq!(mid, want);
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let one = items(&[(10, 2)]);
    assert!(plan_items(&one, 0, &PlanOptions::default()).is_err());
    assert!(plan_items(&[], 4, &PlanOptions::default()).is_err());
    assert!(Item::new(0, 1, 1).is_err());
    assert!(Item::new(5, 0, 1).is_err());
    let bad_align = PlanOptions {
        coll_align: 6,
        start_align: 4,
        ..PlanOptions::default()
    };
    // The error names the option and its value, not the struct's Debug text.
    let err = plan_items(&one, 2, &bad_align).unwrap_err().to_string();
    assert!(
        err.contains("bad input start_align 4: start alignment 4 must divide")
            && !err.contains('{'),
        "{err}"
    );
    let no_orders = PlanOptions {
        orders: vec![],
        ..PlanOptions::default()
    };
    assert!(plan_items(&one, 2, &no_orders).is_err());
}

fn arb_items(max_n: usize, max_e: usize) -> impl Strategy<Value = Vec<Item>> {
    prop::collection::vec((1..=max_e, 1..=12usize), 1..=max_n).prop_map(|v| {
        v.into_iter()
            .map(|(e, g)| Item::new(e, g, 1).unwrap())
            .collect()
    })
}

fn check_layout(items: &[Item], offsets: &[usize], shard: usize, world: usize) {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| offsets[i]);
    let mut end = 0;
    for &i in &order {
        let (t, l) = (&items[i], offsets[i]);
        assert!(l >= end, "tensor {i} overlaps");
        end = l + t.numel;
        assert!(end <= world * shard, "tensor {i} past the buffer");
        assert_eq!(l % t.align, 0);
        let mut b = (l / shard + 1) * shard;
        while b < end {
            assert_eq!(
                (b - l) % t.block,
                0,
                "tensor {i}: boundary {b} splits a block"
            );
            b += shard;
        }
        let u = units(l, t, shard, world);
        assert_eq!(u.iter().sum::<usize>(), t.numel.div_ceil(t.block));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn search_equals_linear_scan_for_its_order(
        items in arb_items(8, 60), world in 1..=9usize, coll in prop::sample::select(vec![1usize, 2, 4])
    ) {
        let (s, offsets, _) = min_shard(&items, world, coll).unwrap();
        prop_assert_eq!(s, exact_for_order(&items, world, coll).unwrap());
        check_layout(&items, &offsets, s, world);
    }

    #[test]
    fn plans_never_split_a_block_and_shards_are_equal(
        items in arb_items(12, 400), world in 1..=16usize, coll in prop::sample::select(vec![1usize, 4, 8])
    ) {
        let opts = PlanOptions { coll_align: coll, ..PlanOptions::default() };
        let layout = plan_items(&items, world, &opts).unwrap();
        prop_assert_eq!(layout.shard_size % coll, 0);
        check_layout(&items, &layout.offsets, layout.shard_size, world);
        // The winning order is exact: no smaller S exists for that order.
        let perm = layout.order.arrange(&items);
        let arranged: Vec<Item> = perm.iter().map(|&i| items[i]).collect();
        prop_assert_eq!(layout.shard_size, exact_for_order(&arranged, world, coll).unwrap());
    }

    #[test]
    fn start_alignment_is_respected(
        items in arb_items(6, 80), world in 1..=6usize, align in prop::sample::select(vec![2usize, 4])
    ) {
        let opts = PlanOptions { coll_align: 8, start_align: align, ..PlanOptions::default() };
        let layout = plan_items(&items, world, &opts).unwrap();
        for &o in &layout.offsets {
            prop_assert_eq!(o % align, 0);
        }
        let aligned: Vec<Item> = items.iter().map(|t| Item::new(t.numel, t.block, align).unwrap()).collect();
        check_layout(&aligned, &layout.offsets, layout.shard_size, world);
    }

    #[test]
    fn greedy_agrees_with_exhaustive_search(items in arb_items(4, 16), world in 1..=4usize) {
        prop_assert_eq!(exact_for_order(&items, world, 1).unwrap(), exhaustive_for_order(&items, world, 1).unwrap());
    }
}

/// The heuristic (three orders, each exact) against the optimum over all orders: the paper
/// claims a 2-approximation; the test requires it and prints the worst gap seen.
#[test]
fn heuristic_is_within_twice_the_global_optimum() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (arb_items(6, 120), 1..=8usize);
    let mut worst: f64 = 1.0;
    for _ in 0..400 {
        let (items, world) = strategy.new_tree(&mut runner).unwrap().current();
        let layout = plan_items(&items, world, &module_order_all(1)).unwrap();
        let (best, _) = exact_any_order(&items, world, 1).unwrap();
        assert!(
            layout.shard_size >= best,
            "heuristic beat the exact optimum"
        );
        assert!(layout.shard_size <= 2 * best, "{items:?} V={world}");
        worst = worst.max(layout.shard_size as f64 / best as f64);
    }
    println!("worst heuristic / optimum shard-size ratio over 400 inputs: {worst:.3}");
}

fn module_order_all(coll: usize) -> PlanOptions {
    PlanOptions {
        coll_align: coll,
        ..PlanOptions::default()
    }
}

mod unit_plans {
    use super::*;
    use ragged::block::num_blocks;
    use ragged::model::{DType, TensorSpec, Unit};
    use ragged::plan::plan_unit;
    use ragged::AtomicBlock;

    fn arb_tensor() -> impl Strategy<Value = (Vec<usize>, AtomicBlock)> {
        let shape = prop::collection::vec(1..=12usize, 1..=3);
        let block = prop_oneof![
            Just(AtomicBlock::Element),
            (1..=5usize).prop_map(AtomicBlock::Rows),
            Just(AtomicBlock::Matrix),
            Just(AtomicBlock::Whole),
        ];
        (shape, block)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Every tensor's RaggedShard, derived from its offset, agrees with the plan: ranks hold
        /// contiguous runs in rank order at exactly the plan's element positions.
        #[test]
        fn ragged_shards_agree_with_offsets(
            tensors in prop::collection::vec(arb_tensor(), 1..=10), world in 1..=9usize
        ) {
            let specs: Vec<TensorSpec> = tensors
                .iter()
                .enumerate()
                .map(|(i, (shape, _))| TensorSpec::new(format!("t{i}"), shape, DType::BF16).unwrap())
                .collect();
            let unit = Unit { name: "u".into(), tensors: specs.iter().collect() };
            let blocks: std::collections::HashMap<String, AtomicBlock> = tensors
                .iter()
                .enumerate()
                .map(|(i, (_, b))| (format!("t{i}"), *b))
                .collect();
            let opts = PlanOptions { coll_align: 1, ..PlanOptions::default() };
            let plan = plan_unit(&unit, &|t| blocks[&t.name], world, &opts).unwrap();
            plan.validate().unwrap();
            for (i, p) in plan.placements.iter().enumerate() {
                let shard = plan.shard(i).unwrap();
                let units = plan.units_per_rank(i).unwrap();
                prop_assert_eq!(shard.units(), &units[..]);
                prop_assert_eq!(units.iter().sum::<usize>(), num_blocks(p.numel(), p.block_elems));
                for k in 0..world {
                    let r = shard.range(k).unwrap();
                    let lo = p.offset.max(k * plan.shard_size).min(p.offset + p.numel());
                    let hi = (p.offset + p.numel()).min((k + 1) * plan.shard_size).max(lo);
                    if r.is_empty() {
                        prop_assert!(hi <= lo);
                    } else {
                        prop_assert_eq!(r, lo - p.offset..hi - p.offset);
                    }
                }
            }
        }
    }

    #[test]
    fn a_block_that_does_not_fit_names_the_tensor() {
        let w = TensorSpec::new("w", &[4, 48], DType::BF16).unwrap();
        let unit = Unit {
            name: "u".into(),
            tensors: vec![&w],
        };
        let tile = AtomicBlock::Tile { rows: 32, cols: 32 };
        let err = plan_unit(&unit, &|_| tile, 4, &PlanOptions::default()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("tensor w") && msg.contains("48"), "{msg}");
    }
}
