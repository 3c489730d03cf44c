//! Fuzzing by proptest (cargo-fuzz needs a nightly toolchain, which CI does not have): the
//! model-inventory parser on arbitrary bytes and on arbitrary JSON built from the format's own
//! keys, and the plan JSON (`plan::export::write_json`, read by `tools/check_plan.py`) on
//! arbitrary small inventories. Each must return `Ok` or `Err`, never panic; what parses must
//! round-trip. Case counts are bounded so the file runs in seconds; crash inputs found are kept
//! below as ordinary regression tests.

use proptest::prelude::*;
use ragged::model::{Inventory, TensorSpec};
use ragged::plan::export::write_json;
use ragged::plan::multi::MultiOptions;
use ragged::plan::multi_model::{plan_model_multi, plan_multi_unit};
use ragged::plan::{plan_model, PlanOptions};
use ragged::AtomicBlock;
use serde_json::{json, Map, Value};

/// Arbitrary JSON whose object keys come mostly from the inventory format, so the parser gets
/// past its first checks: nested objects and arrays, big and negative numbers, odd strings.
fn json_value() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        Just("model".to_string()),
        Just("dtype".to_string()),
        Just("num_tensors".to_string()),
        Just("total_params".to_string()),
        Just("params".to_string()),
        Just("name".to_string()),
        Just("shape".to_string()),
        "\\PC{0,6}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (0u64..70).prop_map(Value::from),
        any::<f64>().prop_map(|x| json!(x)),
        prop_oneof![
            Just("bf16".to_string()),
            Just("fp8".to_string()),
            Just("layers.0.w".to_string()),
            "\\PC{0,8}",
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// An inventory of up to 6 tensors, some inside decoder layers, with dimensions from `dim`.
fn inventory_json(dim: impl Strategy<Value = usize>) -> impl Strategy<Value = Value> {
    let tensor = (
        0usize..3,
        "[a-z\"\\\\]{1,5}",
        prop::collection::vec(dim, 0..4),
        prop::option::of(prop_oneof![Just("fp32"), Just("bf16"), Just("fp8")]),
    );
    prop::collection::vec(tensor, 1..7).prop_map(|ts| {
        let params: Vec<Value> = ts
            .into_iter()
            .enumerate()
            .map(|(i, (layer, name, shape, dtype))| {
                let name = match layer {
                    0 => format!("{name}{i}"),
                    l => format!("model.layers.{}.{name}{i}", l - 1),
                };
                let mut p = json!({ "name": name, "shape": shape });
                if let Some(d) = dtype {
                    p["dtype"] = json!(d);
                }
                p
            })
            .collect();
        json!({ "model": "fuzz \"model\"", "params": params })
    })
}

/// A dimension: mostly small, sometimes 0 or huge (products and sums that overflow).
fn dim() -> impl Strategy<Value = usize> + Clone {
    prop_oneof![
        8 => 1usize..40,
        1 => Just(0usize),
        1 => Just(1usize << 31),
        1 => Just(usize::MAX / 2),
    ]
}

fn block() -> impl Strategy<Value = AtomicBlock> {
    prop_oneof![
        Just(AtomicBlock::Element),
        (1usize..9).prop_map(AtomicBlock::Rows),
        (1usize..5, 1usize..5).prop_map(|(rows, cols)| AtomicBlock::Tile { rows, cols }),
        Just(AtomicBlock::Matrix),
    ]
}

/// The plan of `inv` as JSON, parsed back, checked against the plan's own numbers.
fn plan_json_round_trips(inv: &Inventory, block: AtomicBlock, world: usize) {
    let Ok(plan) = plan_model(inv, &|_| block, world, &PlanOptions::default()) else {
        return; // An Err (a block that does not fit a shape) is a fine answer.
    };
    let mut out = Vec::new();
    write_json(&plan, &mut out).expect("writing to memory");
    let v: Value = serde_json::from_slice(&out).expect("write_json writes valid JSON");
    assert_eq!(v["model"], json!(inv.model));
    assert_eq!(v["world"], json!(world));
    let units = v["units"].as_array().expect("units");
    assert_eq!(units.len(), plan.units.len());
    for (u, unit) in units.iter().zip(&plan.units) {
        assert_eq!(u["name"], json!(unit.unit));
        assert_eq!(u["shard_size"], json!(unit.shard_size));
        let tensors = u["tensors"].as_array().expect("tensors");
        assert_eq!(tensors.len(), unit.placements.len());
        for (t, p) in tensors.iter().zip(&unit.placements) {
            assert_eq!(t["name"], json!(p.name));
            assert_eq!(t["shape"], json!(p.shape));
            assert_eq!(t["offset"], json!(p.offset));
            let per_rank = t["units_per_rank"].as_array().expect("units_per_rank");
            assert_eq!(per_rank.len(), world);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn inventory_parser_never_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let text = String::from_utf8_lossy(&bytes);
        let _ = Inventory::from_json_str(&text);
    }

    #[test]
    fn inventory_parser_never_panics_on_arbitrary_json(v in json_value()) {
        let _ = Inventory::from_json_str(&v.to_string());
        // The same value under the top-level keys, so `params` is reached more often.
        let wrapped = json!({ "model": "m", "params": v.clone(), "num_tensors": v });
        let _ = Inventory::from_json_str(&wrapped.to_string());
    }

    #[test]
    fn a_parsed_inventory_keeps_every_tensor_and_its_totals_agree(v in inventory_json(dim())) {
        // Zero and overflowing shapes are refused; everything else parses.
        let Ok(inv) = Inventory::from_json_str(&v.to_string()) else { return Ok(()); };
        prop_assert_eq!(inv.tensors.len(), v["params"].as_array().unwrap().len());
        // Stating the totals it has must parse too; stating others must not.
        let mut stated = v.clone();
        stated["num_tensors"] = json!(inv.tensors.len());
        stated["total_params"] = json!(inv.total_params());
        prop_assert!(Inventory::from_json_str(&stated.to_string()).is_ok());
        // (A total of exactly u64::MAX has no successor to state.)
        if let Some(wrong) = inv.total_params().checked_add(1) {
            stated["total_params"] = json!(wrong);
            prop_assert!(Inventory::from_json_str(&stated.to_string()).is_err());
        }
    }

    #[test]
    fn plan_json_of_arbitrary_small_inventories_round_trips(
        // Small dimensions, so most plans succeed and have JSON to check; huge ones are errors
        // (the regression tests below, and tests/plan_hostile_tests.rs).
        v in inventory_json(1usize..40),
        block in block(),
        world in 1usize..6,
    ) {
        let inv = Inventory::from_json_str(&v.to_string()).expect("a well-formed inventory");
        plan_json_round_trips(&inv, block, world);
    }
}

// Regression inputs (crashes found by the properties above, kept as plain tests).

/// Found by hand, then made a property input (huge dims): three tensors of `2^63 − 1`
/// elements each parsed, and `total_params` then overflowed (`ragged plan` panicked with
/// "attempt to add with overflow"), with or without a stated `total_params`.
#[test]
fn an_inventory_whose_total_overflows_is_an_error_not_a_panic() {
    for stated in ["", r#""total_params": 5,"#] {
        let text = format!(
            r#"{{{stated} "params":[{{"name":"a","shape":[9223372036854775807,1]}},
                                  {{"name":"b","shape":[9223372036854775807,1]}},
                                  {{"name":"c","shape":[9223372036854775807,1]}}]}}"#
        );
        let err = Inventory::from_json_str(&text).unwrap_err().to_string();
        assert!(err.contains("overflow"), "{err}");
    }
}

/// Found by `plan_json_of_arbitrary_small_inventories_round_trips` with huge dimensions: one
/// 1-D tensor of `2^63 − 1` elements, `Rows(1)` (one row, so one block of the whole tensor),
/// used to panic on an overflow in the search. On one rank its buffer is addressable
/// (`S = 2^63`, rounded to the collective alignment): one buffer and at most 3 buffers both
/// return that valid plan. On two or more ranks each shard still needs the whole block, and
/// `V·2^63` overflows: an error naming it, from every entry point; never a panic.
#[test]
fn planning_a_tensor_near_usize_max_is_exact_or_an_error_not_a_panic() {
    let text = r#"{"params":[{"name":"a0","shape":[9223372036854775807]}]}"#;
    let inv = Inventory::from_json_str(text).expect("parses: its count fits usize");
    let block = |_: &TensorSpec| AtomicBlock::Rows(1);
    let opts = PlanOptions::default();
    let three = MultiOptions {
        max_buffers: 3,
        ..MultiOptions::default()
    };
    let overflow = |r: ragged::Result<()>| {
        let err = r.unwrap_err().to_string();
        assert!(err.contains("overflow"), "{err}");
    };
    let plan = plan_model(&inv, &block, 1, &opts).unwrap();
    plan.units[0].validate().unwrap();
    assert_eq!(plan.units[0].shard_size, 1 << 63);
    let unit = &inv.units()[0];
    let multi = plan_multi_unit(unit, &block, 1, &opts, &three).unwrap();
    assert_eq!(multi.k(), 1);
    multi.buffers[0].validate().unwrap();
    assert_eq!(multi.buffers[0].shard_size, 1 << 63);
    // The model-wide totals add the single-buffer plan to the chosen one: 2 · 2^63 elements
    // overflow their 64-bit count, an error too.
    overflow(plan_model_multi(&inv, &block, 1, 1, &opts, &three).map(drop));
    for world in [2, 8, usize::MAX] {
        overflow(plan_model(&inv, &block, world, &opts).map(drop));
        overflow(plan_multi_unit(unit, &block, world, &opts, &three).map(drop));
        overflow(plan_model_multi(&inv, &block, world, 1, &opts, &three).map(drop));
    }
}

/// A world of `2^64 − 1` ranks on a real model: no shard size gives an addressable buffer, so
/// the single- and multi-buffer model planners both return an error naming the overflow.
#[test]
fn a_world_of_usize_max_is_an_error_for_every_model_planner() {
    let inv = Inventory::load("llama3_8b").expect("a preset");
    let block = |_: &TensorSpec| AtomicBlock::Rows(16);
    let opts = PlanOptions::default();
    let err = plan_model(&inv, &block, usize::MAX, &opts).unwrap_err();
    assert!(err.to_string().contains("overflow"), "{err}");
    let three = MultiOptions::default();
    let err = plan_model_multi(&inv, &block, usize::MAX, 1, &opts, &three).unwrap_err();
    assert!(err.to_string().contains("overflow"), "{err}");
}
