//! The planner on hostile and extreme inputs: every answer is `Ok` (a valid layout) or `Err`,
//! never a panic, a wrapped integer or a hang. Elapsed time is asserted only as a hang detector
//! with a generous bound; speed itself is measured by `ragged bench plan`.

use std::time::{Duration, Instant};

use proptest::prelude::*;
use ragged::plan::multi::{plan_multi_items, MultiOptions};
use ragged::plan::{plan_items, Item, Layout, PlanOptions, MAX_ALIGN};

/// Far above any real plan (milliseconds); a search scanning element by element takes minutes.
const HANG: Duration = Duration::from_secs(5);

fn timed(items: &[Item], world: usize, opts: &PlanOptions) -> ragged::Result<Layout> {
    let start = Instant::now();
    let out = plan_items(items, world, opts);
    let elapsed = start.elapsed();
    assert!(elapsed < HANG, "{items:?} V={world} {opts:?}: {elapsed:?}");
    out
}

/// Checks a layout in u128 arithmetic, O(1) per tensor, independently of `Plan::validate`.
fn check_layout(items: &[Item], layout: &Layout, coll: usize) {
    let s = layout.shard_size as u128;
    assert!(s > 0 && s % coll as u128 == 0, "S = {s}");
    let capacity = s * layout.world as u128;
    assert!(
        capacity <= usize::MAX as u128,
        "V·S = {capacity} is not addressable"
    );
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| layout.offsets[i]);
    let mut end = 0u128;
    for &i in &order {
        let (t, l) = (&items[i], layout.offsets[i] as u128);
        let (e, g) = (t.numel as u128, t.block as u128);
        assert!(l >= end, "tensor {i} overlaps");
        end = l + e;
        assert!(end <= capacity, "tensor {i} ends past the buffer");
        let first = (l / s + 1) * s;
        if first < end {
            assert_eq!(
                (first - l) % g,
                0,
                "tensor {i}: first boundary splits a block"
            );
            if s % g != 0 {
                assert!(
                    end - first <= s,
                    "tensor {i}: a second boundary splits a block"
                );
            }
        }
    }
}

#[test]
fn a_world_of_two_to_the_64_minus_one_is_an_error() {
    let items = [Item::new(1000, 10, 1).unwrap()];
    let err = timed(&items, usize::MAX, &PlanOptions::default()).unwrap_err();
    assert!(err.to_string().contains("overflow"), "{err}");
}

#[test]
fn a_tensor_of_two_to_the_64_minus_one_elements_is_an_error() {
    let items = [
        Item::new(usize::MAX, 1, 1).unwrap(),
        Item::new(7, 1, 1).unwrap(),
    ];
    assert!(timed(&items, 8, &PlanOptions::default()).is_err());
    let alone = [Item::new(usize::MAX, 3, 1).unwrap()];
    assert!(timed(&alone, 8, &PlanOptions::default()).is_err());
}

#[test]
fn whole_blocks_of_a_trillion_elements_plan_fast() {
    // Three uncuttable 1e12-element tensors: the exact finish used to scan every 64-element
    // step between the lower bound and the bisection's result.
    let e = 1_000_000_000_000usize;
    let items = vec![Item::new(e, e, 1).unwrap(); 3];
    for world in [2, 3, 5, 8] {
        for coll in [1, 64] {
            let opts = PlanOptions {
                coll_align: coll,
                ..PlanOptions::default()
            };
            let layout = timed(&items, world, &opts).unwrap();
            check_layout(&items, &layout, coll);
            // Each shard holds whole tensors only: with V ≥ 3 one per shard, S = e.
            if world >= 3 {
                assert_eq!(layout.shard_size, e.next_multiple_of(coll));
            }
        }
    }
}

/// An alignment above `MAX_ALIGN` (2^20 elements) is refused by the options check, before
/// anything is planned or allocated: `fully_shard` with `coll_align = 2^33` aborted the
/// process on a 32 GiB allocation, `2^62` panicked ("capacity overflow"), and
/// `start_align = coll_align = 2^28` took 28 s. `MAX_ALIGN` itself plans.
#[test]
fn alignments_above_two_to_the_20_are_refused_before_planning() {
    let items = vec![Item::new(1000, 1, 1).unwrap(); 3];
    for (coll_align, start_align) in [
        (MAX_ALIGN + 1, 1),
        (1 << 28, 1 << 28),
        (1 << 33, 1),
        (1 << 62, 1),
        (usize::MAX, 1),
    ] {
        let opts = PlanOptions {
            coll_align,
            start_align,
            ..PlanOptions::default()
        };
        let err = timed(&items, 2, &opts).unwrap_err().to_string();
        assert!(err.contains("is above 1048576 elements"), "{err}");
    }
    let opts = PlanOptions {
        coll_align: MAX_ALIGN,
        start_align: MAX_ALIGN,
        ..PlanOptions::default()
    };
    let layout = timed(&items, 2, &opts).unwrap();
    check_layout(&items, &layout, MAX_ALIGN);
}

/// Sizes from tiny to 2^64 − 1, mixed so that sums and products overflow in every way.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        1..=64usize,
        (1usize << 20)..=(1usize << 44),
        (1usize << 60)..=usize::MAX,
        Just(usize::MAX),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn any_sizes_give_a_valid_layout_or_an_error_in_bounded_time(
        tensors in prop::collection::vec((size(), size()), 1..=6),
        world in size(),
        coll in prop_oneof![Just(1usize), Just(64), 1..=MAX_ALIGN, size()],
    ) {
        let items: Vec<Item> = tensors
            .iter()
            .map(|&(e, g)| Item::new(e, g, 1).unwrap())
            .collect();
        let opts = PlanOptions { coll_align: coll, ..PlanOptions::default() };
        if let Ok(layout) = timed(&items, world, &opts) {
            prop_assert_eq!(layout.world, world);
            check_layout(&items, &layout, coll);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(150))]

    /// The multi-buffer planner on the same inputs, with up to 16 buffers: every buffer is a
    /// valid layout of its tensors, or the answer is an error, in bounded time.
    #[test]
    fn multi_buffer_plans_are_valid_or_errors_in_bounded_time(
        tensors in prop::collection::vec((size(), size()), 1..=8),
        world in size(),
        coll in prop_oneof![Just(1usize), Just(64), 1..=MAX_ALIGN, size()],
        max_buffers in 1..=16usize,
    ) {
        let items: Vec<Item> = tensors
            .iter()
            .map(|&(e, g)| Item::new(e, g, 1).unwrap())
            .collect();
        let opts = PlanOptions { coll_align: coll, ..PlanOptions::default() };
        let mopts = MultiOptions { max_buffers, collective_latency_s: 0.0, ..MultiOptions::default() };
        let start = Instant::now();
        let out = plan_multi_items(&items, world, &opts, &mopts);
        prop_assert!(start.elapsed() < HANG, "{:?}", start.elapsed());
        if let Ok(plan) = out {
            prop_assert!(plan.layouts.len() <= max_buffers);
            prop_assert!(plan.floor <= plan.shard_sum());
            for (group, layout) in plan.groups.iter().zip(&plan.layouts) {
                let sub: Vec<Item> = group.iter().map(|&i| items[i]).collect();
                check_layout(&sub, layout, coll);
            }
        }
    }
}

/// A model file the planner would wait on for ever or read without end is refused before it
/// is read: a FIFO (as an inventory or as a `.safetensors` header) and an inventory over
/// 100 MB (here sparse).
#[test]
fn a_model_file_that_is_a_fifo_or_too_large_is_refused_unread() {
    use ragged::model::Inventory;
    let dir = std::env::temp_dir().join(format!("ragged-hostile-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["pipe.json", "pipe.safetensors"] {
        let path = dir.join(name);
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        assert!(made.unwrap().success(), "mkfifo {name}");
        let err = Inventory::load(path.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a regular file"), "{name}: {err}");
    }
    let big = dir.join("big.json");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(100_000_001)
        .unwrap();
    let err = Inventory::load(big.to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("100000001 bytes, over the"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
