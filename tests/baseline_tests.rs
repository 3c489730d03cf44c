//! Baseline layouts (FSDP2, Megatron-FSDP, FSDP1, ZeRO-3) against `reference/baselines.md`:
//! the hand-computed cases of §5, the golden comm-buffer sizes of §7, and the cut count against
//! a brute force over every boundary.

use std::time::Instant;

use proptest::prelude::*;
use ragged::model::{DType, Inventory, TensorSpec};
use ragged::plan::baselines::{
    cut_blocks, layout, megatron_chunk_size_factor, megatron_place, Baseline, BaselineLayout,
    BaselineOptions, Fsdp1Align, Placement,
};
use ragged::AtomicBlock;

fn inv(tensors: &[(&str, &[usize], DType)]) -> Inventory {
    Inventory {
        model: "test".into(),
        tensors: tensors
            .iter()
            .map(|&(name, shape, dtype)| TensorSpec::new(name, shape, dtype).unwrap())
            .collect(),
    }
}

fn bf16(tensors: &[(&str, &[usize])]) -> Inventory {
    let t: Vec<_> = tensors.iter().map(|&(n, s)| (n, s, DType::BF16)).collect();
    inv(&t)
}

fn lay(b: Baseline, inv: &Inventory, world: usize) -> BaselineLayout {
    layout(b, inv, world, &BaselineOptions::default()).unwrap()
}

fn model(name: &str) -> Inventory {
    let path = format!("{}/models/{name}.json", env!("CARGO_MANIFEST_DIR"));
    Inventory::from_json_file(&path).unwrap()
}

// ---------------------------------------------------------------------------------------------
// §5: hand-computed unit cases.

#[test]
fn fsdp2_pads_5x3_to_two_rows_per_rank() {
    let l = lay(Baseline::Fsdp2, &bf16(&[("w", &[5, 3])]), 4);
    assert_eq!(l.buffer_elems, 24);
    assert_eq!(l.groups[0].shard_elems, 6);
    let t = &l.groups[0].tensors[0];
    assert_eq!(t.rank_pieces(0), vec![(0..6, 0)]);
    assert_eq!(t.rank_pieces(2), vec![(12..15, 0)]);
    assert!(t.rank_pieces(3).is_empty(), "rank 3 holds only padding");
}

#[test]
fn zero3_pads_15_elements_to_16() {
    let l = lay(Baseline::Zero3, &bf16(&[("w", &[5, 3])]), 4);
    assert_eq!(l.buffer_elems, 16);
    let t = &l.groups[0].tensors[0];
    assert_eq!(t.rank_pieces(1), vec![(4..8, 0)]);
    assert_eq!(t.rank_pieces(3), vec![(12..15, 0)]);
}

#[test]
fn fsdp1_aligns_to_16_bytes_then_rounds_to_world() {
    let i = bf16(&[("a", &[3]), ("b", &[5])]);
    let aligned = lay(Baseline::Fsdp1, &i, 4);
    assert_eq!(aligned.buffer_elems, 16, "3 + pad 5 + 5 = 13 -> 16");
    let offsets: Vec<_> = aligned.groups[0]
        .tensors
        .iter()
        .map(|t| t.placement)
        .collect();
    assert_eq!(
        offsets,
        vec![
            Placement::Flat {
                offset: 0,
                shard: 4
            },
            Placement::Flat {
                offset: 8,
                shard: 4
            }
        ]
    );
    let opts = BaselineOptions {
        fsdp1_align: Fsdp1Align::None,
        ..Default::default()
    };
    assert_eq!(
        layout(Baseline::Fsdp1, &i, 4, &opts).unwrap().buffer_elems,
        8
    );
}

#[test]
fn fsdp1_fp32_aligns_to_four_elements() {
    let i = inv(&[("a", &[3], DType::F32), ("b", &[5], DType::F32)]);
    let l = lay(Baseline::Fsdp1, &i, 1);
    assert_eq!(
        l.groups[0].tensors[1].placement,
        Placement::Flat {
            offset: 4,
            shard: 9
        }
    );
    assert_eq!(l.buffer_elems, 9);
}

#[test]
fn megatron_csf_is_lcm_of_rows_for_2x6_and_3x4() {
    assert_eq!(megatron_chunk_size_factor(&[(6, 12), (4, 12)]).unwrap(), 12);
    let i = bf16(&[("model.layers.0.a", &[2, 6]), ("model.layers.0.b", &[3, 4])]);
    let l = lay(Baseline::MegatronFsdp, &i, 2);
    assert_eq!(l.groups.len(), 1);
    assert_eq!(l.buffer_elems, 24);
}

#[test]
fn megatron_places_fragment_in_gap_after_10() {
    assert_eq!(
        megatron_place(&[24, 10, 5], 8).unwrap(),
        (vec![0, 24, 34], 40)
    );
    // The same through `layout`: rows 8, 1, 1 give csf 8.
    let i = bf16(&[
        ("model.layers.0.a", &[3, 8]),
        ("model.layers.0.b", &[10]),
        ("model.layers.0.c", &[5]),
    ]);
    let l = lay(Baseline::MegatronFsdp, &i, 1);
    assert_eq!(l.buffer_elems, 40);
    let offsets: Vec<_> = l.groups[0]
        .tensors
        .iter()
        .map(|t| match t.placement {
            Placement::Flat { offset, .. } => offset,
            p => panic!("Megatron tensor {} is not flat: {p:?}", t.name),
        })
        .collect();
    assert_eq!(offsets, vec![0, 24, 34]);
}

#[test]
fn megatron_pairs_conjugate_remainders() {
    // csf 8: 10 (rem 2) at 0, gap at 10, D -> 16; 14 (rem 6) pairs: at 16 - 6 = 10, D -> 24.
    assert_eq!(megatron_place(&[10, 14], 8).unwrap(), (vec![0, 10], 24));
    // 13 (rem 5) cannot pair with 12 (rem 4): 12 goes on its own after the first gap.
    assert_eq!(megatron_place(&[13, 12], 8).unwrap(), (vec![0, 16], 32));
    // A fragment too big for the gap is appended at the end.
    assert_eq!(megatron_place(&[10, 7], 8).unwrap(), (vec![0, 16], 23));
    assert!(megatron_place(&[1], 0).is_err());
}

#[test]
fn megatron_gpt_oss_120b_experts_round_192_chunks_to_256() {
    let (e, h) = (128, 2880);
    let i = bf16(&[
        ("model.layers.0.mlp.experts.gate_up_proj", &[e, h, 2 * h]),
        ("model.layers.0.mlp.experts.gate_up_proj_bias", &[e, 2 * h]),
        ("model.layers.0.mlp.experts.down_proj", &[e, h, h]),
        ("model.layers.0.mlp.experts.down_proj_bias", &[e, h]),
    ]);
    let csf = (h * 2 * h) as u64;
    let rows_numels: Vec<_> = i
        .tensors
        .iter()
        .map(|t| {
            (
                t.shape[1..].iter().product::<usize>() as u64,
                t.numel() as u64,
            )
        })
        .collect();
    assert_eq!(megatron_chunk_size_factor(&rows_numels).unwrap(), csf);
    let l = lay(Baseline::MegatronFsdp, &i, 64);
    assert_eq!(l.buffer_elems, 256 * csf);
    let fragments: u64 = 128 * (5760 + 2880);
    assert_eq!(fragments, 1_105_920);
    assert_eq!(l.model_elems, 192 * csf + fragments);
}

#[test]
fn megatron_separates_dtype_and_experts_and_splits_root_only_on_request() {
    let i = inv(&[
        ("embed", &[8, 4], DType::BF16),
        ("head", &[8, 4], DType::BF16),
        ("model.layers.0.attn", &[4, 4], DType::BF16),
        ("model.layers.0.mlp.experts.0.w", &[4, 4], DType::BF16),
        ("model.layers.0.bias", &[4], DType::F32),
        ("model.layers.0.mlp.experts.1.w", &[4, 4], DType::BF16),
    ]);
    let l = lay(Baseline::MegatronFsdp, &i, 2);
    let names: Vec<_> = l.groups.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "root/bf16",
            "layers.0/bf16",
            "layers.0/bf16/experts",
            "layers.0/fp32"
        ]
    );
    assert_eq!(l.groups[2].tensors.len(), 2);
    let opts = BaselineOptions {
        megatron_bucket: Some(32),
        ..Default::default()
    };
    let split = layout(Baseline::MegatronFsdp, &i, 2, &opts).unwrap();
    assert_eq!(split.groups.len(), 5, "root splits into two buckets of 32");
    assert_eq!(split.groups[0].tensors.len(), 1);
}

#[test]
fn every_group_buffer_is_world_times_shard() {
    let i = model("gpt_oss_20b");
    for b in Baseline::ALL {
        for v in [1, 3, 8, 1000] {
            let l = lay(b, &i, v);
            for g in &l.groups {
                assert_eq!(
                    g.buffer_elems,
                    v as u64 * g.shard_elems,
                    "{b} V={v} {}",
                    g.name
                );
            }
            let n: usize = l.groups.iter().map(|g| g.tensors.len()).sum();
            assert_eq!(n, i.tensors.len(), "{b} V={v}: every tensor placed once");
        }
    }
}

#[test]
fn baseline_names_display_and_parse() {
    let shown: Vec<String> = Baseline::ALL.iter().map(|b| b.to_string()).collect();
    assert_eq!(shown, ["FSDP2", "Megatron-FSDP", "FSDP1", "ZeRO-3"]);
    for b in Baseline::ALL {
        assert_eq!(b.to_string().parse::<Baseline>().unwrap(), b);
    }
    assert!("zero4".parse::<Baseline>().is_err());
}

// ---------------------------------------------------------------------------------------------
// Bad input.

#[test]
fn world_zero_is_an_error_for_every_baseline() {
    let i = bf16(&[("w", &[5, 3])]);
    for b in Baseline::ALL {
        assert!(
            layout(b, &i, 0, &BaselineOptions::default()).is_err(),
            "{b}"
        );
    }
}

#[test]
fn empty_inventory_is_an_error() {
    let i = Inventory {
        model: "empty".into(),
        tensors: vec![],
    };
    assert!(layout(Baseline::Fsdp2, &i, 4, &BaselineOptions::default()).is_err());
}

#[test]
fn cut_blocks_rejects_a_foreign_inventory_and_misfit_tiles() {
    let a = bf16(&[("w", &[5, 3])]);
    let l = lay(Baseline::Zero3, &a, 4);
    assert!(cut_blocks(&l, &bf16(&[("x", &[5, 3])]), AtomicBlock::Element).is_err());
    assert!(cut_blocks(&l, &bf16(&[("w", &[5, 4])]), AtomicBlock::Element).is_err());
    let tile = AtomicBlock::Tile { rows: 1, cols: 2 };
    assert!(
        cut_blocks(&l, &a, tile).is_err(),
        "2-column tiles do not fit 3-column rows"
    );
}

// ---------------------------------------------------------------------------------------------
// §7: golden comm-buffer element counts.

/// (model, V, [FSDP2, Megatron-FSDP, FSDP1, ZeRO-3]) from `baselines.md` §7.
const GOLDEN: &[(&str, usize, [u64; 4])] = &[
    (
        "llama3_8b",
        8,
        [8_030_261_248, 8_031_076_352, 8_030_261_248, 8_030_261_248],
    ),
    (
        "llama3_8b",
        64,
        [8_030_261_248, 8_038_645_760, 8_030_261_248, 8_030_261_248],
    ),
    (
        "llama3_8b",
        256,
        [8_030_261_248, 8_098_152_448, 8_030_261_248, 8_030_261_248],
    ),
    (
        "llama3_8b",
        1024,
        [8_036_552_704, 8_568_963_072, 8_030_261_248, 8_030_261_248],
    ),
    (
        "llama3_70b",
        8,
        [
            70_553_706_496,
            70_583_910_400,
            70_553_706_496,
            70_553_706_496,
        ],
    ),
    (
        "llama3_70b",
        64,
        [
            70_553_706_496,
            70_804_570_112,
            70_553_706_496,
            70_553_706_496,
        ],
    ),
    (
        "llama3_70b",
        256,
        [
            70_553_706_496,
            71_393_345_536,
            70_553_706_496,
            70_553_706_496,
        ],
    ),
    (
        "llama3_70b",
        1024,
        [
            70_566_289_408,
            72_569_847_808,
            70_553_706_496,
            70_553_706_496,
        ],
    ),
    (
        "gpt_oss_20b",
        8,
        [
            20_914_757_184,
            24_126_036_480,
            20_914_757_184,
            20_914_757_184,
        ],
    ),
    (
        "gpt_oss_20b",
        64,
        [
            40_033_902_912,
            27_488_194_560,
            20_914_757_952,
            20_914_757_952,
        ],
    ),
    (
        "gpt_oss_20b",
        256,
        [
            154_768_407_552,
            104_213_053_440,
            20_914_762_752,
            20_914_781_184,
        ],
    ),
    (
        "gpt_oss_20b",
        1024,
        [
            613_701_676_032,
            413_375_201_280,
            20_914_768_896,
            20_914_842_624,
        ],
    ),
    (
        "gpt_oss_120b",
        8,
        [
            116_829_156_672,
            121_606_248_960,
            116_829_156_672,
            116_829_156_672,
        ],
    ),
    (
        "gpt_oss_120b",
        64,
        [
            116_829_156_672,
            155_314_851_840,
            116_829_156_672,
            116_829_156_672,
        ],
    ),
    (
        "gpt_oss_120b",
        256,
        [
            231_573_107_712,
            155_740_078_080,
            116_829_161_472,
            116_829_189_120,
        ],
    ),
    (
        "gpt_oss_120b",
        1024,
        [
            919_971_535_872,
            619_483_299_840,
            116_829_170_688,
            116_829_281_280,
        ],
    ),
    (
        "deepseek_v3_671b",
        8,
        [
            671_026_419_200,
            671_090_940_416,
            671_026_419_200,
            671_026_419_200,
        ],
    ),
    (
        "deepseek_v3_671b",
        64,
        [
            671_026_419_200,
            671_595_051_520,
            671_026_419_200,
            671_026_419_200,
        ],
    ),
    (
        "deepseek_v3_671b",
        256,
        [
            671_110_370_816,
            673_468_135_936,
            671_026_419_200,
            671_026_419_200,
        ],
    ),
    (
        "deepseek_v3_671b",
        1024,
        [
            671_776_585_728,
            679_371_401_216,
            671_026_463_744,
            671_026_526_208,
        ],
    ),
];

#[test]
fn comm_buffers_match_golden_table_for_five_models() {
    let mut mismatches = Vec::new();
    let mut name = "";
    let mut inventory = None;
    for &(m, v, expected) in GOLDEN {
        if m != name {
            name = m;
            inventory = Some(model(m));
        }
        let i = inventory.as_ref().unwrap();
        for (b, want) in Baseline::ALL.into_iter().zip(expected) {
            let got = lay(b, i, v).buffer_elems;
            if got != want {
                mismatches.push(format!("{m} V={v} {b}: got {got}, golden {want}"));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "golden mismatches:\n{}",
        mismatches.join("\n")
    );
}

#[test]
fn deepseek_v3_layout_and_cut_count_at_4096_ranks() {
    // Prints the time; no timing assertion (machines differ).
    let i = model("deepseek_v3_671b");
    for b in Baseline::ALL {
        let t = Instant::now();
        let l = lay(b, &i, 4096);
        let t_layout = t.elapsed();
        let cuts = cut_blocks(&l, &i, AtomicBlock::Rows(1)).unwrap();
        let t_all = t.elapsed();
        println!(
            "deepseek V=4096 {b}: layout {t_layout:?}, layout+cut_blocks {t_all:?}, \
             padding {:.3} %, Rows(1) cuts {cuts}",
            100.0 * l.padding_frac()
        );
        assert!(l.buffer_elems >= l.model_elems, "{b}");
        assert_eq!(cut_blocks(&l, &i, AtomicBlock::Element).unwrap(), 0, "{b}");
    }
}

// ---------------------------------------------------------------------------------------------
// cut_blocks: hand cases.

#[test]
fn zero3_cuts_two_rows_of_5x3_at_four_ranks() {
    // chunk 4: boundaries 4, 8, 12; 4 % 3 and 8 % 3 are not 0, 12 % 3 is.
    let i = bf16(&[("w", &[5, 3])]);
    let l = lay(Baseline::Zero3, &i, 4);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Rows(1)).unwrap(), 2);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Element).unwrap(), 0);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Whole).unwrap(), 3);
}

#[test]
fn fsdp2_cuts_only_blocks_larger_than_its_row_chunks() {
    // chunk 2 rows = 6 elements: boundaries 6 and 12.
    let i = bf16(&[("w", &[5, 3])]);
    let l = lay(Baseline::Fsdp2, &i, 4);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Rows(1)).unwrap(), 0);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Rows(2)).unwrap(), 0);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Rows(3)).unwrap(), 2);
    assert_eq!(
        cut_blocks(&l, &i, AtomicBlock::Rows(4)).unwrap(),
        1,
        "12 is a multiple of 12"
    );
}

#[test]
fn fsdp1_cuts_flat_parameters_at_shard_edges() {
    let i = bf16(&[("a", &[3]), ("b", &[5])]);
    // Aligned: shard 4, a at [0,3), b at [8,13): boundary 12 is 4 into b.
    let l = lay(Baseline::Fsdp1, &i, 4);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Whole).unwrap(), 1);
    // Unaligned: shard 2, a at [0,3) cut at 2; b at [3,8) cut at 4 and 6.
    let opts = BaselineOptions {
        fsdp1_align: Fsdp1Align::None,
        ..Default::default()
    };
    let l = layout(Baseline::Fsdp1, &i, 4, &opts).unwrap();
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Whole).unwrap(), 3);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Element).unwrap(), 0);
}

#[test]
fn megatron_cuts_only_blocks_larger_than_its_grid() {
    // csf 12, V = 2: shard 12, the only boundary falls between the two tensors.
    let i = bf16(&[("model.layers.0.a", &[2, 6]), ("model.layers.0.b", &[3, 4])]);
    let l = lay(Baseline::MegatronFsdp, &i, 2);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Rows(1)).unwrap(), 0);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Whole).unwrap(), 0);
    // csf 6, V = 2: shard 12 cuts [4, 6] after two rows.
    let i = bf16(&[("model.layers.0.a", &[4, 6])]);
    let l = lay(Baseline::MegatronFsdp, &i, 2);
    assert_eq!(l.buffer_elems, 24);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Rows(1)).unwrap(), 0);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Rows(2)).unwrap(), 0);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Rows(3)).unwrap(), 1);
    assert_eq!(cut_blocks(&l, &i, AtomicBlock::Whole).unwrap(), 1);
}

// ---------------------------------------------------------------------------------------------
// cut_blocks against brute force, and the rank pieces as a partition.

/// Cuts by enumerating every element boundary of every tensor.
fn brute_cuts(l: &BaselineLayout, inv: &Inventory, block: AtomicBlock) -> u64 {
    let mut cuts = 0;
    for g in &l.groups {
        for t in &g.tensors {
            let spec = inv.tensors.iter().find(|s| s.name == t.name).unwrap();
            let b = block.elems(&spec.shape).unwrap() as u64;
            for i in 1..t.numel {
                let edge = match t.placement {
                    Placement::Flat { offset, shard } => (offset + i) % shard == 0,
                    Placement::Chunked { chunk, .. } => i % chunk == 0,
                };
                if edge && i % b != 0 {
                    cuts += 1;
                }
            }
        }
    }
    cuts
}

/// Cuts read off `rank_pieces`: every piece that starts inside a tensor off a block edge.
/// Also checks the pieces partition each tensor, in rank order, and fit the rank's shard.
fn piece_cuts(l: &BaselineLayout, inv: &Inventory, block: AtomicBlock) -> u64 {
    let mut cuts = 0;
    for g in &l.groups {
        let mut used: Vec<Vec<(u64, u64)>> = vec![Vec::new(); l.world];
        for t in &g.tensors {
            let spec = inv.tensors.iter().find(|s| s.name == t.name).unwrap();
            let b = block.elems(&spec.shape).unwrap() as u64;
            let mut next = 0;
            for (r, rank_used) in used.iter_mut().enumerate() {
                for (range, at) in t.rank_pieces(r) {
                    assert_eq!(
                        range.start, next,
                        "{} rank {r}: pieces must be contiguous",
                        t.name
                    );
                    assert!(
                        at + (range.end - range.start) <= g.shard_elems,
                        "{} rank {r}",
                        t.name
                    );
                    rank_used.push((at, at + range.end - range.start));
                    next = range.end;
                    if range.start > 0 && range.start % b != 0 {
                        cuts += 1;
                    }
                }
            }
            assert_eq!(next, t.numel, "{}: pieces cover the tensor", t.name);
            assert!(t.rank_pieces(l.world).is_empty());
        }
        for (r, mut spans) in used.into_iter().enumerate() {
            spans.sort();
            for w in spans.windows(2) {
                assert!(
                    w[0].1 <= w[1].0,
                    "group {} rank {r}: pieces overlap",
                    g.name
                );
            }
        }
    }
    cuts
}

fn arb_block() -> impl Strategy<Value = AtomicBlock> {
    prop_oneof![
        Just(AtomicBlock::Element),
        (1usize..5).prop_map(AtomicBlock::Rows),
        (1usize..4).prop_map(|rows| AtomicBlock::Tile { rows, cols: 1 }),
        Just(AtomicBlock::Matrix),
        Just(AtomicBlock::Whole),
    ]
}

fn arb_inventory() -> impl Strategy<Value = Inventory> {
    let tensor = (
        prop::collection::vec(1usize..7, 0..4),
        0usize..4,     // unit: 0 = root, else layer
        any::<bool>(), // expert
        any::<bool>(), // fp32
    );
    prop::collection::vec(tensor, 1..9).prop_map(|ts| Inventory {
        model: "random".into(),
        tensors: ts
            .into_iter()
            .enumerate()
            .map(|(i, (shape, unit, expert, fp32))| {
                let prefix = if unit == 0 {
                    String::new()
                } else {
                    format!("model.layers.{unit}.")
                };
                let mid = if expert { "mlp.experts." } else { "" };
                let dtype = if fp32 { DType::F32 } else { DType::BF16 };
                TensorSpec::new(format!("{prefix}{mid}t{i}"), &shape, dtype).unwrap()
            })
            .collect(),
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn cut_blocks_matches_brute_force(i in arb_inventory(), v in 1usize..10, block in arb_block()) {
        for b in Baseline::ALL {
            for align in [Fsdp1Align::Aligned, Fsdp1Align::None] {
                let opts = BaselineOptions { fsdp1_align: align, megatron_bucket: Some(20) };
                let l = layout(b, &i, v, &opts).unwrap();
                let fast = cut_blocks(&l, &i, block).unwrap();
                prop_assert_eq!(fast, brute_cuts(&l, &i, block), "{} V={} {}", b, v, block);
                prop_assert_eq!(fast, piece_cuts(&l, &i, block), "{} V={} {}", b, v, block);
                prop_assert!(l.buffer_elems >= l.model_elems);
            }
        }
    }

    #[test]
    fn megatron_items_never_overlap_and_regular_items_stay_on_grid(
        numels in prop::collection::vec(1u64..40, 1..12),
        csf in 1u64..16,
    ) {
        let (offsets, end) = megatron_place(&numels, csf).unwrap();
        let mut spans: Vec<_> = offsets.iter().zip(&numels).map(|(&o, &n)| (o, o + n)).collect();
        spans.sort();
        for w in spans.windows(2) {
            prop_assert!(w[0].1 <= w[1].0, "overlap {:?}", spans);
        }
        prop_assert!(spans.iter().all(|s| s.1 <= end));
        for (&o, &n) in offsets.iter().zip(&numels) {
            // A regular item starts on the grid or ends on it (a conjugate partner).
            if n >= csf {
                prop_assert!(o % csf == 0 || (o + n) % csf == 0, "item {} at {}", n, o);
            }
        }
    }
}
