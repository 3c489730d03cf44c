//! Tests of `ragged::ragged`: layouts of one tensor over the ranks of one mesh dim.

use proptest::prelude::*;
use ragged::block::{num_blocks, numel};
use ragged::ragged::{
    apply_transfers, chunk_len_and_offset, even_units, outer_chunk_shape, placement_units,
    prefix_dims, redistribute, unit_for_outer_shard, PrefixForm, RaggedShard, StridedRaggedShard,
    Transfer,
};
use ragged::{AtomicBlock, Error};

fn is_invalid_shard<T: std::fmt::Debug>(r: ragged::Result<T>) -> bool {
    matches!(r, Err(Error::InvalidShard { .. }))
}

// ---------------------------------------------------------------------------------------------
// Unit tests
// ---------------------------------------------------------------------------------------------

#[test]
fn doc_example_rows2_over_three_ranks_matches_the_table() {
    let r = RaggedShard::from_block(&[10, 4], AtomicBlock::Rows(2), vec![2, 0, 3]).unwrap();
    assert_eq!(r.unit(), 8);
    assert_eq!(r.world(), 3);
    assert_eq!(r.numel(), 40);
    assert_eq!(r.ranges(), vec![0..16, 16..16, 16..40]);
    let table = [
        (0, 0..16, vec![4, 4]),
        (1, 16..16, vec![0]),
        (2, 16..40, vec![6, 4]),
    ];
    for (rank, range, local) in table {
        assert_eq!(r.range(rank).unwrap(), range);
        assert_eq!(r.local_numel(rank).unwrap(), range.len());
        assert_eq!(r.local_shape(rank).unwrap(), local);
    }
    assert_eq!(r.to_string(), "R[2,0,3]x8");
    assert_eq!(
        format!("{r:?}"),
        "RaggedShard { shape: [10, 4], unit: 8, units: [2, 0, 3] }"
    );
    let form = r.to_prefix_form();
    assert_eq!(
        form,
        PrefixForm {
            dims: 1,
            local_units: vec![2, 0, 3]
        }
    );
    assert_eq!(
        form.to_string(),
        "RaggedShard(dims=(0,), local_units=(2,0,3))"
    );
    assert_eq!(RaggedShard::from_prefix_form(&[10, 4], &form).unwrap(), r);
}

#[test]
fn new_rejects_units_that_do_not_add_up() {
    assert!(is_invalid_shard(RaggedShard::new(
        &[10, 4],
        8,
        vec![2, 0, 2]
    )));
    assert!(is_invalid_shard(RaggedShard::new(
        &[10, 4],
        8,
        vec![2, 1, 3]
    )));
    assert!(RaggedShard::new(&[10, 4], 8, vec![2, 0, 3]).is_ok());
}

#[test]
fn new_rejects_zero_unit_world_zero_and_zero_dims() {
    assert!(is_invalid_shard(RaggedShard::new(&[10, 4], 0, vec![1])));
    assert!(is_invalid_shard(RaggedShard::new(&[10, 4], 8, vec![])));
    assert!(is_invalid_shard(RaggedShard::one_hot(&[10, 4], 0, 0)));
    assert!(is_invalid_shard(RaggedShard::even(&[10, 4], 8, 0)));
    assert!(is_invalid_shard(RaggedShard::from_placement(
        &[10, 4],
        8,
        0,
        40,
        0
    )));
    assert!(matches!(
        RaggedShard::new(&[10, 0], 8, vec![1]),
        Err(Error::InvalidShape { .. })
    ));
}

#[test]
fn rank_out_of_range_is_an_error() {
    let r = RaggedShard::new(&[10, 4], 8, vec![2, 0, 3]).unwrap();
    assert!(is_invalid_shard(r.range(3)));
    assert!(is_invalid_shard(r.local_numel(3)));
    assert!(is_invalid_shard(r.local_shape(7)));
}

#[test]
fn unit_larger_than_tensor_is_clamped_like_a_block() {
    let r = RaggedShard::new(&[3, 2], 100, vec![0, 1]).unwrap();
    assert_eq!(r.unit(), 6);
    assert_eq!(r, RaggedShard::one_hot(&[3, 2], 2, 1).unwrap());
    assert!(is_invalid_shard(RaggedShard::new(&[3, 2], 100, vec![1, 1])));
}

#[test]
fn from_placement_rejects_a_split_block() {
    // Tensor of 27 elements, unit 3, at offset 2: boundary 16 is 14 elements in, not ≡ 0 mod 3.
    let e = RaggedShard::from_placement(&[9, 3], 3, 2, 16, 6).unwrap_err();
    match e {
        Error::BlockSplit { block, offset, .. } => assert_eq!((block, offset), (3, 14)),
        e => panic!("expected BlockSplit, got {e:?}"),
    }
    // A boundary exactly at the tensor's start or end is not inside it.
    assert!(RaggedShard::from_placement(&[16], 16, 16, 16, 2).is_ok());
    assert!(RaggedShard::from_placement(&[16], 16, 0, 16, 2).is_ok());
    // A short tail cannot be cut: [10] with unit 4 at offset 0, S = 9 cuts the tail at 9.
    assert!(matches!(
        RaggedShard::from_placement(&[10], 4, 0, 9, 2),
        Err(Error::BlockSplit { offset: 9, .. })
    ));
}

#[test]
fn from_placement_rejects_a_tensor_past_the_buffer_end() {
    assert!(is_invalid_shard(RaggedShard::from_placement(
        &[16],
        8,
        81,
        16,
        6
    )));
    assert!(is_invalid_shard(RaggedShard::from_placement(
        &[4],
        1,
        usize::MAX - 1,
        16,
        6
    )));
    assert!(is_invalid_shard(RaggedShard::from_placement(
        &[4],
        1,
        0,
        usize::MAX,
        3
    )));
    assert!(is_invalid_shard(RaggedShard::from_placement(
        &[4],
        1,
        0,
        0,
        3
    )));
    assert!(RaggedShard::from_placement(&[16], 8, 80, 16, 6).is_ok());
}

#[test]
fn from_placement_reproduces_planner_test_vector_tv1() {
    // planner.md §5 TV1: V = 6, S = 16, offsets 1, 28, 52, 80.
    let cases: [(usize, usize, usize, [usize; 6]); 4] = [
        (27, 3, 1, [5, 4, 0, 0, 0, 0]),
        (22, 2, 28, [0, 2, 8, 1, 0, 0]),
        (27, 3, 52, [0, 0, 0, 4, 5, 0]),
        (16, 8, 80, [0, 0, 0, 0, 0, 2]),
    ];
    for (e, g, l, units) in cases {
        let r = RaggedShard::from_placement(&[e], g, l, 16, 6).unwrap();
        assert_eq!(r.units(), units, "tensor ({e},{g}) at {l}");
    }
}

#[test]
fn from_placement_reproduces_planner_test_vector_tv3() {
    // planner.md §5 TV3: V = 16, S = 16; the middle tensor gets 1 block on ranks 2..=10.
    let r = RaggedShard::from_placement(&[9, 16], 16, 32, 16, 16).unwrap();
    let want: Vec<usize> = (0..16)
        .map(|k| usize::from((2..=10).contains(&k)))
        .collect();
    assert_eq!(r.units(), want);
    assert_eq!(
        RaggedShard::from_placement(&[24], 3, 1, 16, 16)
            .unwrap()
            .units()[..2],
        [5, 3]
    );
    assert_eq!(
        RaggedShard::from_placement(&[24], 8, 176, 16, 16)
            .unwrap()
            .units()[11..],
        [2, 1, 0, 0, 0]
    );
}

#[test]
fn one_hot_puts_the_whole_tensor_on_the_owner() {
    let r = RaggedShard::one_hot(&[4, 3, 5], 4, 2).unwrap();
    assert_eq!(r.units(), [0, 0, 1, 0]);
    assert_eq!(r.unit(), 60);
    assert_eq!(r.ranges(), vec![0..0, 0..0, 0..60, 60..60]);
    assert_eq!(r.local_shape(2).unwrap(), vec![4, 3, 5]);
    assert_eq!(r.local_shape(0).unwrap(), vec![0]);
    let form = r.to_prefix_form();
    assert_eq!(form.dims, 0);
    assert_eq!(form.local_units, vec![0, 0, 1, 0]);
    assert_eq!(
        form.to_string(),
        "RaggedShard(dims=(), local_units=(0,0,1,0))"
    );
    assert_eq!(RaggedShard::from_prefix_form(&[4, 3, 5], &form).unwrap(), r);
    assert!(is_invalid_shard(RaggedShard::one_hot(&[4, 3, 5], 4, 4)));
}

#[test]
fn zero_dim_tensor_is_one_element_held_whole() {
    let r = RaggedShard::one_hot(&[], 2, 1).unwrap();
    assert_eq!(r.numel(), 1);
    assert_eq!(r.range(1).unwrap(), 0..1);
    assert_eq!(r.local_shape(1).unwrap(), Vec::<usize>::new());
    assert_eq!(r.local_shape(0).unwrap(), vec![0]);
    assert_eq!(r.to_prefix_form().dims, 0);
}

#[test]
fn even_follows_the_torch_chunk_rule() {
    assert_eq!(RaggedShard::even(&[10], 1, 3).unwrap().units(), [4, 4, 2]);
    assert_eq!(RaggedShard::even(&[5], 1, 4).unwrap().units(), [2, 2, 1, 0]);
    assert_eq!(
        RaggedShard::even(&[2, 3], 3, 4).unwrap().units(),
        [1, 1, 0, 0]
    );
    let tail = RaggedShard::even(&[10], 4, 2).unwrap();
    assert_eq!(tail.units(), [2, 1]);
    assert_eq!(tail.ranges(), vec![0..8, 8..10]);
    assert_eq!(even_units(7, 3).unwrap(), vec![3, 3, 1]);
    assert!(is_invalid_shard(even_units(7, 0)));
}

#[test]
fn chunk_len_and_offset_matches_its_table() {
    let lens = |size, n| -> Vec<usize> {
        (0..n)
            .map(|i| chunk_len_and_offset(size, n, i).unwrap().0)
            .collect()
    };
    assert_eq!(lens(10, 3), vec![4, 4, 2]);
    assert_eq!(lens(5, 4), vec![2, 2, 1, 0]);
    assert_eq!(lens(2, 4), vec![1, 1, 0, 0]);
    assert_eq!(chunk_len_and_offset(10, 3, 2).unwrap(), (2, 8));
    assert_eq!(chunk_len_and_offset(2, 4, 3).unwrap(), (0, 2));
    assert!(is_invalid_shard(chunk_len_and_offset(10, 0, 0)));
    assert!(is_invalid_shard(chunk_len_and_offset(10, 3, 3)));
}

#[test]
fn prefix_dims_matches_its_table() {
    assert_eq!(prefix_dims(&[10, 4], 8).unwrap(), 1);
    assert_eq!(prefix_dims(&[10, 4], 6).unwrap(), 2);
    assert_eq!(prefix_dims(&[10, 4], 40).unwrap(), 0);
    assert_eq!(prefix_dims(&[4, 3, 5], 30).unwrap(), 1);
    assert_eq!(prefix_dims(&[4, 3, 5], 5).unwrap(), 2);
    assert!(is_invalid_shard(prefix_dims(&[4], 0)));
}

#[test]
fn short_tail_prefix_form_uses_the_gcd_of_rank_counts() {
    // [10, 4] in units of 12: blocks 12, 12, 12, 4; counts 12, 24, 4 -> unit 4 = one row.
    let r = RaggedShard::new(&[10, 4], 12, vec![1, 2, 1]).unwrap();
    assert_eq!(r.ranges(), vec![0..12, 12..36, 36..40]);
    let form = r.to_prefix_form();
    assert_eq!(form.dims, 1);
    assert_eq!(form.local_units, vec![3, 6, 1]);
    assert_eq!(r.local_shape(1).unwrap(), vec![6, 4]);
    assert_eq!(r.local_shape(2).unwrap(), vec![1, 4]);
    let back = RaggedShard::from_prefix_form(&[10, 4], &form).unwrap();
    assert_eq!(back.unit(), 4);
    assert_eq!(back.ranges(), r.ranges());
}

#[test]
fn from_prefix_form_rejects_bad_forms() {
    let form = |dims, local_units: &[usize]| PrefixForm {
        dims,
        local_units: local_units.to_vec(),
    };
    assert!(is_invalid_shard(RaggedShard::from_prefix_form(
        &[10, 4],
        &form(3, &[1])
    )));
    assert!(is_invalid_shard(RaggedShard::from_prefix_form(
        &[10, 4],
        &form(0, &[1, 1])
    )));
    assert!(is_invalid_shard(RaggedShard::from_prefix_form(
        &[10, 4],
        &form(1, &[3, 0])
    )));
    assert!(is_invalid_shard(RaggedShard::from_prefix_form(
        &[10, 4],
        &form(1, &[0, 0])
    )));
    assert!(is_invalid_shard(RaggedShard::from_prefix_form(
        &[10, 4],
        &form(1, &[])
    )));
    // dims = 2 of [10, 4]: 40 positions of 1 element; 8 units of 5 elements.
    let r = RaggedShard::from_prefix_form(&[10, 4], &form(2, &[5, 3])).unwrap();
    assert_eq!((r.unit(), r.ranges()), (5, vec![0..25, 25..40]));
}

#[test]
fn unit_for_outer_shard_matches_its_table() {
    assert_eq!(unit_for_outer_shard(&[8, 6, 4], 8, 0).unwrap(), 8);
    assert_eq!(unit_for_outer_shard(&[8, 6, 4], 8, 1).unwrap(), 8);
    assert_eq!(unit_for_outer_shard(&[8, 6, 4], 6, 1).unwrap(), 12);
    assert_eq!(unit_for_outer_shard(&[8, 6, 4], 6, 2).unwrap(), 6);
    assert_eq!(unit_for_outer_shard(&[8, 6, 4], 1, 0).unwrap(), 1);
    assert!(is_invalid_shard(unit_for_outer_shard(&[8, 6, 4], 6, 3)));
    assert!(is_invalid_shard(unit_for_outer_shard(&[8, 6, 4], 0, 1)));
    assert!(is_invalid_shard(unit_for_outer_shard(&[], 1, 0)));
}

#[test]
fn redistribute_gathers_to_a_root_and_scatters_back() {
    let ragged = RaggedShard::new(&[10, 4], 8, vec![2, 0, 3]).unwrap();
    let root = RaggedShard::one_hot(&[10, 4], 3, 1).unwrap();
    let t = |src_rank, dst_rank, src_offset, dst_offset, len| Transfer {
        src_rank,
        dst_rank,
        src_offset,
        dst_offset,
        len,
    };
    let gather = redistribute(&ragged, &root).unwrap();
    assert_eq!(gather, vec![t(0, 1, 0, 0, 16), t(2, 1, 0, 16, 24)]);
    let scatter = redistribute(&root, &ragged).unwrap();
    assert_eq!(scatter, vec![t(1, 0, 0, 0, 16), t(1, 2, 16, 0, 24)]);
    let same = redistribute(&ragged, &ragged).unwrap();
    assert_eq!(same, vec![t(0, 0, 0, 0, 16), t(2, 2, 0, 0, 24)]);

    let full: Vec<f32> = (0..40).map(|i| i as f32).collect();
    let pieces = ragged.split(&full).unwrap();
    let at_root = apply_transfers(&gather, &pieces, &root).unwrap();
    assert_eq!(at_root[1], full);
    assert!(at_root[0].is_empty() && at_root[2].is_empty());
    let back = apply_transfers(&scatter, &at_root, &ragged).unwrap();
    assert_eq!(back, pieces);
}

#[test]
fn redistribute_rejects_mismatched_shapes() {
    let a = RaggedShard::even(&[10, 4], 4, 2).unwrap();
    let b = RaggedShard::even(&[4, 10], 10, 2).unwrap();
    assert!(is_invalid_shard(redistribute(&a, &b)));
    let c = RaggedShard::even(&[40], 4, 2).unwrap();
    assert!(is_invalid_shard(redistribute(&a, &c)));
}

#[test]
fn apply_transfers_rejects_transfers_that_do_not_fit() {
    let a = RaggedShard::even(&[8], 1, 2).unwrap();
    let pieces = a.split(&[0u32, 1, 2, 3, 4, 5, 6, 7]).unwrap();
    let bad = |src_rank, dst_rank, src_offset, dst_offset, len| {
        let t = Transfer {
            src_rank,
            dst_rank,
            src_offset,
            dst_offset,
            len,
        };
        apply_transfers(&[t], &pieces, &a)
    };
    assert!(bad(0, 0, 0, 0, 4).is_ok());
    assert!(is_invalid_shard(bad(2, 0, 0, 0, 1)));
    assert!(is_invalid_shard(bad(0, 2, 0, 0, 1)));
    assert!(is_invalid_shard(bad(0, 1, 1, 0, 4)));
    assert!(is_invalid_shard(bad(0, 1, 0, 1, 4)));
    assert!(is_invalid_shard(bad(0, 1, usize::MAX, 0, 4)));
}

#[test]
fn split_and_join_check_lengths() {
    let a = RaggedShard::even(&[8], 3, 2).unwrap();
    assert!(is_invalid_shard(a.split(&[0u8; 7])));
    let pieces = a.split(&[1u8, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    assert_eq!(pieces, vec![vec![1, 2, 3, 4, 5, 6], vec![7, 8]]);
    assert_eq!(a.join(&pieces).unwrap(), vec![1, 2, 3, 4, 5, 6, 7, 8]);
    assert!(matches!(
        a.join(&pieces[..1]),
        Err(Error::WorldSizeMismatch {
            expected: 2,
            got: 1,
            ..
        })
    ));
    assert!(is_invalid_shard(a.join(&[vec![1u8], vec![2]])));
}

#[test]
fn strided_doc_example_matches_the_table() {
    let chunk = RaggedShard::new(&[6, 2], 4, vec![2, 1]).unwrap();
    let s = StridedRaggedShard::new(&[6, 4], 1, 2, vec![Some(chunk.clone()), Some(chunk)]).unwrap();
    assert_eq!(s.inner_world(), 2);
    assert_eq!(
        s.global_ranges(0, 0).unwrap(),
        vec![0..2, 4..6, 8..10, 12..14]
    );
    assert_eq!(s.global_ranges(0, 1).unwrap(), vec![16..18, 20..22]);
    assert_eq!(
        s.global_ranges(1, 0).unwrap(),
        vec![2..4, 6..8, 10..12, 14..16]
    );
    assert_eq!(s.global_ranges(1, 1).unwrap(), vec![18..20, 22..24]);
    assert_eq!(s.to_string(), "S(1)x2:[R[2,1]x4,R[2,1]x4]");
    assert!(is_invalid_shard(s.global_ranges(2, 0)));
    assert!(is_invalid_shard(s.global_ranges(0, 2)));
}

#[test]
fn strided_dim0_follows_torch_chunk_with_empty_trailing_coords() {
    // [5, 2] over 4 coordinates: chunks of 2, 2, 1, 0 rows.
    let s = StridedRaggedShard::even(&[5, 2], 0, 4, 2, 2).unwrap();
    assert!(s.per_coord()[3].is_none());
    assert_eq!(s.global_ranges(1, 0).unwrap(), vec![4..6]);
    assert_eq!(s.global_ranges(1, 1).unwrap(), vec![6..8]);
    assert_eq!(s.global_ranges(2, 0).unwrap(), vec![8..10]);
    assert!(s.global_ranges(2, 1).unwrap().is_empty());
    assert!(s.global_ranges(3, 0).unwrap().is_empty());
    assert_eq!(s.to_string(), "S(0)x4:[R[1,1]x2,R[1,1]x2,R[1,0]x2,-]");
    assert_eq!(
        outer_chunk_shape(&[5, 2], 0, 4, 2).unwrap(),
        Some(vec![1, 2])
    );
    assert_eq!(outer_chunk_shape(&[5, 2], 0, 4, 3).unwrap(), None);
}

#[test]
fn strided_constructor_validates_chunks_and_worlds() {
    // dim > 0 must divide evenly.
    assert!(is_invalid_shard(StridedRaggedShard::even(
        &[4, 6],
        1,
        4,
        1,
        2
    )));
    assert!(is_invalid_shard(outer_chunk_shape(&[4, 6], 2, 2, 0)));
    let a = RaggedShard::even(&[2, 3], 3, 2).unwrap();
    let b = RaggedShard::even(&[2, 3], 3, 3).unwrap();
    let wrong_shape = RaggedShard::even(&[3, 2], 3, 2).unwrap();
    let new = |v: Vec<Option<RaggedShard>>| StridedRaggedShard::new(&[4, 3], 0, 2, v);
    assert!(new(vec![Some(a.clone()), Some(a.clone())]).is_ok());
    assert!(matches!(
        new(vec![Some(a.clone()), Some(b)]),
        Err(Error::WorldSizeMismatch {
            expected: 2,
            got: 3,
            ..
        })
    ));
    assert!(is_invalid_shard(new(vec![
        Some(a.clone()),
        Some(wrong_shape)
    ])));
    assert!(is_invalid_shard(new(vec![Some(a.clone()), None])));
    assert!(matches!(
        new(vec![Some(a)]),
        Err(Error::WorldSizeMismatch { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// Brute force: placement
// ---------------------------------------------------------------------------------------------

/// Units per rank by assigning every block to the rank of its first element, or `None` when a
/// block's first and last elements lie on different ranks; `Err(())` when past the buffer.
fn brute_force_units(
    numel: usize,
    unit: usize,
    offset: usize,
    s: usize,
    world: usize,
) -> Result<Option<Vec<usize>>, ()> {
    if offset + numel > world * s {
        return Err(());
    }
    let unit = unit.min(numel);
    let mut units = vec![0; world];
    for b in 0..num_blocks(numel, unit) {
        let first = offset + b * unit;
        let last = offset + ((b + 1) * unit).min(numel) - 1;
        if first / s != last / s {
            return Ok(None);
        }
        units[first / s] += 1;
    }
    Ok(Some(units))
}

#[test]
fn placement_units_agrees_with_brute_force_on_a_full_sweep() {
    let (mut ok, mut split) = (0, 0);
    for numel in 1..=12 {
        for unit in 1..=7 {
            for world in 1..=4 {
                for s in 1..=8 {
                    for offset in 0..=world * s {
                        let got = placement_units(numel, unit, offset, s, world);
                        match brute_force_units(numel, unit, offset, s, world) {
                            Err(()) => assert!(is_invalid_shard(got)),
                            Ok(None) => {
                                split += 1;
                                assert!(matches!(got, Err(Error::BlockSplit { .. })))
                            }
                            Ok(Some(units)) => {
                                ok += 1;
                                assert_eq!(got.unwrap(), units);
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(
        ok > 1000 && split > 1000,
        "sweep reached {ok} valid and {split} split cases"
    );
}

// ---------------------------------------------------------------------------------------------
// Property tests
// ---------------------------------------------------------------------------------------------

fn arb_shape() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..=6, 1..=3)
}

fn arb_block() -> impl Strategy<Value = AtomicBlock> {
    prop_oneof![
        Just(AtomicBlock::Element),
        (1usize..=4).prop_map(AtomicBlock::Rows),
        Just(AtomicBlock::Matrix),
        Just(AtomicBlock::Whole),
    ]
}

/// `n` units dealt over `world` ranks at random cut points (ranks may get 0).
fn arb_units(n: usize, world: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0..=n, world - 1).prop_map(move |mut cuts| {
        cuts.push(0);
        cuts.push(n);
        cuts.sort_unstable();
        cuts.windows(2).map(|w| w[1] - w[0]).collect()
    })
}

/// A random layout of `shape`: a block's unit or an arbitrary one (short tails), 1..9 ranks.
fn arb_layout_of(shape: Vec<usize>) -> impl Strategy<Value = RaggedShard> {
    let n = numel(&shape).unwrap();
    let unit = prop_oneof![
        arb_block().prop_map({
            let shape = shape.clone();
            move |b| b.elems(&shape).unwrap()
        }),
        1..=n + 2,
    ];
    (unit, 1usize..9).prop_flat_map(move |(unit, world)| {
        let shape = shape.clone();
        arb_units(num_blocks(n, unit.min(n)), world)
            .prop_map(move |units| RaggedShard::new(&shape, unit, units).unwrap())
    })
}

fn arb_layout() -> impl Strategy<Value = RaggedShard> {
    arb_shape().prop_flat_map(arb_layout_of)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn ranges_tile_the_tensor_in_rank_order(r in arb_layout()) {
        let n = r.numel();
        let ranges = r.ranges();
        prop_assert_eq!(ranges.len(), r.world());
        prop_assert_eq!(ranges[0].start, 0);
        prop_assert_eq!(ranges[ranges.len() - 1].end, n);
        let mut hits = vec![0u8; n];
        let mut total = 0;
        for (k, range) in ranges.iter().enumerate() {
            prop_assert_eq!(r.range(k).unwrap(), range.clone());
            prop_assert!(range.start <= range.end);
            if k > 0 {
                prop_assert_eq!(ranges[k - 1].end, range.start);
            }
            if !range.is_empty() {
                prop_assert_eq!(range.start % r.unit(), 0);
            }
            // Whole units except for the short tail at the end of the tensor.
            prop_assert!(range.len() % r.unit() == 0 || range.end == n);
            let want = r.units()[k].saturating_mul(r.unit()).min(n - range.start);
            prop_assert_eq!(range.len(), want);
            for h in &mut hits[range.clone()] {
                *h += 1;
            }
            let local = r.local_numel(k).unwrap();
            total += local;
            prop_assert_eq!(r.local_shape(k).unwrap().iter().product::<usize>(), local);
        }
        prop_assert!(hits.iter().all(|&h| h == 1));
        prop_assert_eq!(total, n);
    }

    #[test]
    fn prefix_form_round_trips(r in arb_layout()) {
        let form = r.to_prefix_form();
        let back = RaggedShard::from_prefix_form(r.shape(), &form).unwrap();
        if r.numel() % r.unit() == 0 {
            prop_assert_eq!(&back, &r);
        }
        prop_assert_eq!(back.ranges(), r.ranges());
        prop_assert_eq!(back.to_prefix_form(), form.clone());
        // dims = 0 exactly for the one-hot whole-tensor form.
        let one_hot = form.local_units.iter().sum::<usize>() == 1;
        prop_assert_eq!(form.dims == 0, one_hot);
        // Trailing dims are never cut: every local shape ends with shape[dims..].
        for k in 0..r.world() {
            let local = r.local_shape(k).unwrap();
            if r.local_numel(k).unwrap() > 0 && form.dims > 0 {
                prop_assert_eq!(&local[1..], &r.shape()[form.dims..]);
            }
        }
    }

    #[test]
    fn redistribute_moves_every_element_exactly_once(
        (src, dst) in arb_shape().prop_flat_map(|s| (arb_layout_of(s.clone()), arb_layout_of(s)))
    ) {
        let n = src.numel();
        // Index + 1, so an element no transfer writes (left at 0.0) is caught.
        let full: Vec<f32> = (0..n).map(|i| (i + 1) as f32).collect();
        let transfers = redistribute(&src, &dst).unwrap();
        prop_assert!(transfers.len() < src.world() + dst.world());
        let sorted = transfers
            .windows(2)
            .all(|w| (w[0].src_rank, w[0].dst_rank) < (w[1].src_rank, w[1].dst_rank));
        prop_assert!(sorted, "transfers not sorted: {:?}", transfers);
        prop_assert_eq!(transfers.iter().map(|t| t.len).sum::<usize>(), n);
        let mut hits = vec![0u8; n];
        let (src_ranges, dst_ranges) = (src.ranges(), dst.ranges());
        for t in &transfers {
            prop_assert!(t.len > 0);
            let g = src_ranges[t.src_rank].start + t.src_offset;
            prop_assert_eq!(g, dst_ranges[t.dst_rank].start + t.dst_offset);
            for h in &mut hits[g..g + t.len] {
                *h += 1;
            }
        }
        prop_assert!(hits.iter().all(|&h| h == 1));
        let out = apply_transfers(&transfers, &src.split(&full).unwrap(), &dst).unwrap();
        prop_assert_eq!(&out, &dst.split(&full).unwrap());
        prop_assert_eq!(dst.join(&out).unwrap(), full);
    }

    #[test]
    fn from_placement_agrees_with_brute_force(
        shape in arb_shape(),
        unit in 1usize..=20,
        world in 1usize..=6,
        s in 1usize..=24,
        offset_frac in 0.0f64..=1.0,
    ) {
        let n = numel(&shape).unwrap();
        let offset = ((world * s) as f64 * offset_frac) as usize;
        let got = RaggedShard::from_placement(&shape, unit, offset, s, world);
        match brute_force_units(n, unit, offset, s, world) {
            Err(()) => prop_assert!(is_invalid_shard(got)),
            Ok(None) => {
                let split = matches!(got, Err(Error::BlockSplit { .. }));
                prop_assert!(split, "expected BlockSplit, got {:?}", got);
            }
            Ok(Some(units)) => {
                let r = got.unwrap();
                prop_assert_eq!(r.units(), &units[..]);
                // Each rank's piece sits at its slice of the buffer.
                for (k, range) in r.ranges().into_iter().enumerate() {
                    if !range.is_empty() {
                        prop_assert_eq!((offset + range.start) / s, k);
                        prop_assert_eq!((offset + range.end - 1) / s, k);
                    }
                }
            }
        }
    }

    #[test]
    fn strided_global_ranges_cover_every_element_once(
        mut shape in prop::collection::vec(1usize..=5, 2..=3),
        dim in 0usize..=1,
        split in 1usize..=4,
        block in arb_block(),
        inner_world in 1usize..=4,
        seeds in prop::collection::vec(any::<u64>(), 4 * 4),
    ) {
        if dim > 0 {
            shape[dim] *= split;
        }
        let n = numel(&shape).unwrap();
        let stride: usize = shape[dim + 1..].iter().product();
        let mut per_coord = Vec::new();
        for c in 0..split {
            per_coord.push(match outer_chunk_shape(&shape, dim, split, c).unwrap() {
                None => None,
                Some(local) => {
                    let local_numel = numel(&local).unwrap();
                    let block_elems = block.elems(&local).unwrap();
                    let unit = unit_for_outer_shard(&local, block_elems, dim).unwrap();
                    let blocks = num_blocks(local_numel, unit.min(local_numel));
                    let mut cuts: Vec<usize> = (0..inner_world - 1)
                        .map(|i| (seeds[c * 4 + i] % (blocks as u64 + 1)) as usize)
                        .collect();
                    cuts.extend([0, blocks]);
                    cuts.sort_unstable();
                    let units = cuts.windows(2).map(|w| w[1] - w[0]).collect();
                    Some(RaggedShard::new(&local, unit, units).unwrap())
                }
            });
        }
        let s = StridedRaggedShard::new(&shape, dim, split, per_coord).unwrap();

        // Brute-force owner of every global element: its chunk along `dim`, then its rank.
        let chunks: Vec<(usize, usize)> = (0..split)
            .map(|c| {
                if dim == 0 {
                    chunk_len_and_offset(shape[0], split, c).unwrap()
                } else {
                    (shape[dim] / split, shape[dim] / split * c)
                }
            })
            .collect();
        let mut owner = vec![(usize::MAX, usize::MAX); n];
        for (g, slot) in owner.iter_mut().enumerate() {
            let outer = g / (shape[dim] * stride);
            let (i, inner) = ((g / stride) % shape[dim], g % stride);
            let c = chunks.iter().position(|&(len, off)| (off..off + len).contains(&i)).unwrap();
            let (len, off) = chunks[c];
            let local = outer * len * stride + (i - off) * stride + inner;
            let layout = s.per_coord()[c].as_ref().unwrap();
            let rank = layout.ranges().iter().position(|r| r.contains(&local)).unwrap();
            *slot = (c, rank);
        }

        let mut hits = vec![0u8; n];
        for c in 0..split {
            for k in 0..inner_world {
                let ranges = s.global_ranges(c, k).unwrap();
                let want_len = s.per_coord()[c].as_ref().map_or(0, |r| r.local_numel(k).unwrap());
                prop_assert_eq!(ranges.iter().map(|r| r.len()).sum::<usize>(), want_len);
                if dim == 0 {
                    prop_assert!(ranges.len() <= 1);
                }
                for w in ranges.windows(2) {
                    prop_assert!(w[0].end < w[1].start, "unmerged or unsorted {:?}", ranges);
                }
                for r in &ranges {
                    prop_assert!(!r.is_empty());
                    if dim > 0 {
                        // No cut splits an index of `dim`.
                        prop_assert_eq!(r.start % stride, 0);
                        prop_assert_eq!(r.end % stride, 0);
                    }
                    for g in r.clone() {
                        hits[g] += 1;
                        prop_assert_eq!(owner[g], (c, k));
                    }
                }
            }
        }
        prop_assert!(hits.iter().all(|&h| h == 1));
    }
}
