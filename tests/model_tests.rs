//! Model inventories: the built-in presets against the files in `models/`, FSDP unit grouping,
//! loading, and the inventory file checks.

use std::path::PathBuf;

use ragged::model::presets::{
    self, DeepSeekV3Config, GptOssConfig, LlamaConfig, DEEPSEEK_V3_671B, GPT_OSS_120B, GPT_OSS_20B,
    LLAMA3_70B, LLAMA3_8B,
};
use ragged::model::{layer_of, DType, Inventory};
use ragged::Error;

fn model_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(format!("{name}.json"))
}

fn preset(name: &str) -> Inventory {
    presets::by_name(name).unwrap_or_else(|| panic!("no preset {name}"))
}

/// Panics naming the first tensor where `got` and `want` differ (name, shape, dtype or order).
fn assert_same_inventory(got: &Inventory, want: &Inventory) {
    assert_eq!(got.model, want.model, "model id");
    for (i, (g, w)) in got.tensors.iter().zip(&want.tensors).enumerate() {
        assert!(
            g == w,
            "{}: first difference at tensor #{i}: preset has {} {:?} {}, file has {} {:?} {}",
            want.model,
            g.name,
            g.shape,
            g.dtype,
            w.name,
            w.shape,
            w.dtype
        );
    }
    assert!(
        got.tensors.len() == want.tensors.len(),
        "{}: preset has {} tensors, file has {}; first unmatched: {}",
        want.model,
        got.tensors.len(),
        want.tensors.len(),
        got.tensors
            .get(want.tensors.len())
            .or(want.tensors.get(got.tensors.len()))
            .map_or("?", |t| t.name.as_str())
    );
}

/// The table of models/README.md.
const TABLE: &[(&str, &str, usize, u64)] = &[
    (
        "llama3_8b",
        "meta-llama/Meta-Llama-3-8B",
        291,
        8_030_261_248,
    ),
    (
        "llama3_70b",
        "meta-llama/Meta-Llama-3-70B",
        723,
        70_553_706_496,
    ),
    ("gpt_oss_20b", "openai/gpt-oss-20b", 411, 20_914_757_184),
    ("gpt_oss_120b", "openai/gpt-oss-120b", 615, 116_829_156_672),
    (
        "deepseek_v3_671b",
        "deepseek-ai/DeepSeek-V3",
        45_395,
        671_026_419_200,
    ),
];

fn check_preset_against_file(name: &str) {
    let got = preset(name);
    let want = Inventory::from_json_file(model_file(name)).unwrap();
    assert_same_inventory(&got, &want);
    let &(_, id, n, total) = TABLE.iter().find(|r| r.0 == name).unwrap();
    assert_eq!(got.model, id);
    assert_eq!(got.tensors.len(), n, "{name}: number of tensors");
    assert_eq!(got.total_params(), total, "{name}: total parameters");
}

#[test]
fn llama3_8b_matches_file() {
    check_preset_against_file("llama3_8b");
}

#[test]
fn llama3_70b_matches_file() {
    check_preset_against_file("llama3_70b");
}

#[test]
fn gpt_oss_20b_matches_file() {
    check_preset_against_file("gpt_oss_20b");
}

#[test]
fn gpt_oss_120b_matches_file() {
    check_preset_against_file("gpt_oss_120b");
}

#[test]
fn deepseek_v3_671b_matches_file() {
    check_preset_against_file("deepseek_v3_671b");
}

#[test]
fn deepseek_only_score_correction_bias_is_fp32() {
    let inv = preset("deepseek_v3_671b");
    let fp32: Vec<&str> = inv
        .tensors
        .iter()
        .filter(|t| t.dtype != DType::BF16)
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(fp32.len(), 58, "one per MoE layer (layers 3..=60)");
    assert!(fp32
        .iter()
        .all(|n| n.ends_with(".mlp.gate.e_score_correction_bias")));
    let t = inv
        .tensors
        .iter()
        .find(|t| t.name == "model.layers.3.mlp.gate.e_score_correction_bias")
        .unwrap();
    assert_eq!((t.dtype, t.shape.as_slice()), (DType::F32, &[256][..]));
}

#[test]
fn names_and_by_name() {
    assert_eq!(
        presets::NAMES,
        &[
            "llama3_8b",
            "llama3_70b",
            "gpt_oss_20b",
            "gpt_oss_120b",
            "deepseek_v3_671b"
        ]
    );
    for &(name, id, n, _) in TABLE {
        if name == "deepseek_v3_671b" {
            continue; // large; covered by deepseek_v3_671b_matches_file
        }
        let inv = preset(name);
        assert_eq!(inv.model, id);
        assert_eq!(inv.tensors.len(), n);
        assert_eq!(presets::model_id(name), Some(id));
        // Case and '-' for '_' do not matter.
        let upper_dashed = name.to_ascii_uppercase().replace('_', "-");
        assert_eq!(presets::canonical_name(&upper_dashed), Some(name));
        assert_eq!(presets::by_name(&upper_dashed).as_ref(), Some(&inv));
    }
    assert_eq!(presets::canonical_name("Llama3-8b"), Some("llama3_8b"));
    assert_eq!(
        presets::canonical_name("DeepSeek-V3-671B"),
        Some("deepseek_v3_671b")
    );
    for bad in [
        "",
        "llama3",
        "llama3_8b.json",
        "llama3__8b",
        "gpt-oss",
        "mixtral_8x7b",
    ] {
        assert!(presets::by_name(bad).is_none(), "{bad:?} accepted");
        assert!(presets::canonical_name(bad).is_none(), "{bad:?} accepted");
    }
}

#[test]
fn units_llama3_8b() {
    let inv = preset("llama3_8b");
    let units = inv.units();
    assert_eq!(units.len(), 33);
    assert_eq!(units[0].name, "root");
    let root: Vec<&str> = units[0].tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        root,
        [
            "model.embed_tokens.weight",
            "model.norm.weight",
            "lm_head.weight"
        ]
    );
    for (i, u) in units[1..].iter().enumerate() {
        assert_eq!(u.name, format!("layers.{i}"));
        assert_eq!(u.tensors.len(), 9, "{}", u.name);
        let prefix = format!("model.layers.{i}.");
        assert!(
            u.tensors.iter().all(|t| t.name.starts_with(&prefix)),
            "{}",
            u.name
        );
        assert_eq!(
            u.tensors[0].name,
            format!("{prefix}self_attn.q_proj.weight")
        );
        assert_eq!(
            u.tensors[8].name,
            format!("{prefix}post_attention_layernorm.weight")
        );
    }
    let total: u64 = units
        .iter()
        .flat_map(|u| &u.tensors)
        .map(|t| t.numel() as u64)
        .sum();
    assert_eq!(total, 8_030_261_248);
}

/// The planner's units are the runtime's default wrap (`WrapPolicy::NumberedBlocks`, one unit
/// per numbered block under any prefix): GPT-2's `transformer.h.N` blocks are units, not root,
/// and an encoder's and a decoder's `layers.0` are two units, named by their whole block;
/// where `layers.N` names one block, that is the unit's name.
#[test]
fn units_are_the_runtimes_numbered_blocks() {
    let inv = Inventory::from_json_str(
        r#"{"params": [
            {"name": "wte.weight", "shape": [8, 4]},
            {"name": "transformer.h.0.attn.c_attn.weight", "shape": [4, 12]},
            {"name": "transformer.h.1.attn.c_attn.weight", "shape": [4, 12]},
            {"name": "model.encoder.layers.0.fc1.weight", "shape": [4, 4]},
            {"name": "model.decoder.layers.0.fc1.weight", "shape": [4, 4]},
            {"name": "model.decoder.layers.0.fc2.weight", "shape": [4, 4]},
            {"name": "model.layers.3.mlp.experts.7.w1", "shape": [4, 4]},
            {"name": "model.layers.3.mlp.gate.weight", "shape": [4, 4]}
        ]}"#,
    )
    .unwrap();
    let units: Vec<(String, Vec<&str>)> = inv
        .units()
        .iter()
        .map(|u| {
            let names = u.tensors.iter().map(|t| t.name.as_str()).collect();
            (u.name.clone(), names)
        })
        .collect();
    let want = [
        ("root", vec!["wte.weight"]),
        (
            "transformer.h.0",
            vec!["transformer.h.0.attn.c_attn.weight"],
        ),
        (
            "transformer.h.1",
            vec!["transformer.h.1.attn.c_attn.weight"],
        ),
        (
            "model.encoder.layers.0",
            vec!["model.encoder.layers.0.fc1.weight"],
        ),
        (
            "model.decoder.layers.0",
            vec![
                "model.decoder.layers.0.fc1.weight",
                "model.decoder.layers.0.fc2.weight",
            ],
        ),
        (
            "layers.3",
            vec![
                "model.layers.3.mlp.experts.7.w1",
                "model.layers.3.mlp.gate.weight",
            ],
        ),
    ];
    assert_eq!(units.len(), want.len(), "{units:?}");
    for ((name, tensors), (want_name, want_tensors)) in units.iter().zip(want) {
        assert_eq!((name.as_str(), tensors), (want_name, &want_tensors));
    }
    // The same grouping as the runtime's wrap rule.
    for t in &inv.tensors {
        let unit = units
            .iter()
            .find(|u| u.1.contains(&t.name.as_str()))
            .unwrap();
        let runtime = ragged::model::numbered_block_of(&t.name).unwrap_or("root");
        let together: Vec<&str> = inv
            .tensors
            .iter()
            .filter(|o| ragged::model::numbered_block_of(&o.name).unwrap_or("root") == runtime)
            .map(|o| o.name.as_str())
            .collect();
        assert_eq!(unit.1, together, "{}", t.name);
    }
}

#[test]
fn units_deepseek_v3() {
    let inv = preset("deepseek_v3_671b");
    let units = inv.units();
    assert_eq!(units.len(), 62);
    assert_eq!(units[0].name, "root");
    assert_eq!(units[0].tensors.len(), 3);
    for (i, u) in units[1..].iter().enumerate() {
        assert_eq!(u.name, format!("layers.{i}"));
        // Dense: 7 attention + 3 MLP + 2 norms; MoE: 7 + 256*3 + gate (2) + shared (3) + 2.
        let want = if i < 3 { 12 } else { 782 };
        assert_eq!(u.tensors.len(), want, "{}", u.name);
    }
    let n: usize = units.iter().map(|u| u.tensors.len()).sum();
    assert_eq!(n, 45_395);
}

#[test]
fn load_preset_and_path() {
    let by_preset = Inventory::load("llama3_8b").unwrap();
    let by_alias = Inventory::load("LLAMA3-8B").unwrap();
    let path = model_file("llama3_8b");
    let by_path = Inventory::load(path.to_str().unwrap()).unwrap();
    assert_eq!(by_preset, by_path);
    assert_eq!(by_alias, by_path);
    assert_eq!(by_path.model, "meta-llama/Meta-Llama-3-8B");
}

#[test]
fn load_unknown_name_errors_clearly() {
    let err = Inventory::load("llama4_8b").unwrap_err();
    assert!(
        matches!(
            err,
            Error::BadInput {
                op: "Inventory::load",
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("\"llama4_8b\""), "{msg}");
    for name in presets::NAMES {
        assert!(msg.contains(name), "{msg} does not list {name}");
    }
    // A missing file path is reported the same way (not a panic, not an I/O error).
    let err = Inventory::load("models/no_such_model.json").unwrap_err();
    assert!(err.to_string().contains("no_such_model"), "{err}");
}

/// A small valid inventory file; the error cases below each change one thing.
fn small_json(params: &str, extra: &str) -> String {
    format!(r#"{{"model": "tiny", "dtype": "bf16"{extra}, "params": [{params}]}}"#)
}

const SMALL_PARAMS: &str = r#"{"name": "a.weight", "shape": [4, 8]},
    {"name": "model.layers.0.w", "shape": [8]},
    {"name": "b", "shape": [3], "dtype": "fp32"}"#;

#[test]
fn from_json_str_accepts_valid_file() {
    let inv = Inventory::from_json_str(&small_json(
        SMALL_PARAMS,
        r#", "num_tensors": 3, "total_params": 43"#,
    ))
    .unwrap();
    assert_eq!(inv.model, "tiny");
    assert_eq!(inv.tensors.len(), 3);
    assert_eq!(inv.total_params(), 43);
    assert_eq!(inv.tensors[0].dtype, DType::BF16);
    assert_eq!(inv.tensors[2].dtype, DType::F32);
    assert_eq!(inv.units().len(), 2);
    // Without model and default dtype.
    let inv = Inventory::from_json_str(r#"{"params": [{"name": "x", "shape": [2]}]}"#).unwrap();
    assert_eq!(
        (inv.model.as_str(), inv.tensors[0].dtype),
        ("unnamed", DType::BF16)
    );
}

#[test]
fn from_json_str_rejects_malformed_json() {
    let good = small_json(SMALL_PARAMS, "");
    let truncated = &good[..good.len() - 2];
    let err = Inventory::from_json_str(truncated).unwrap_err();
    assert!(matches!(err, Error::Json(_)), "{err:?}");
    let err = Inventory::from_json_str(r#"{"model": "m", "params": [{"name": "x"}]}"#).unwrap_err();
    assert!(matches!(err, Error::Json(_)), "missing shape: {err:?}");
    // The parameter list alone, without the object around it.
    let err = Inventory::from_json_str(r#" [{"name": "x", "shape": [2]}]"#).unwrap_err();
    assert!(
        err.to_string().contains("an inventory is an object"),
        "{err}"
    );
}

#[test]
fn from_json_str_rejects_zero_dim() {
    let params = SMALL_PARAMS.replace("[4, 8]", "[4, 0]");
    let err = Inventory::from_json_str(&small_json(&params, "")).unwrap_err();
    assert!(matches!(err, Error::InvalidShape { .. }), "{err:?}");
    assert!(err.to_string().contains("[4, 0]"), "{err}");
    assert!(
        err.to_string().contains("tensor a.weight"),
        "names the tensor: {err}"
    );
}

#[test]
fn from_json_str_rejects_duplicate_name() {
    let params = SMALL_PARAMS.replace("\"b\"", "\"a.weight\"");
    let err = Inventory::from_json_str(&small_json(&params, "")).unwrap_err();
    assert!(matches!(err, Error::BadInput { .. }), "{err:?}");
    assert!(err.to_string().contains("a.weight listed twice"), "{err}");
}

#[test]
fn from_json_str_rejects_num_tensors_mismatch() {
    let err =
        Inventory::from_json_str(&small_json(SMALL_PARAMS, r#", "num_tensors": 4"#)).unwrap_err();
    assert!(matches!(err, Error::BadInput { .. }), "{err:?}");
    assert!(err.to_string().contains("num_tensors says 4"), "{err}");
}

#[test]
fn from_json_str_rejects_total_params_mismatch() {
    let err =
        Inventory::from_json_str(&small_json(SMALL_PARAMS, r#", "total_params": 42"#)).unwrap_err();
    assert!(matches!(err, Error::BadInput { .. }), "{err:?}");
    assert!(err.to_string().contains("total_params says 42"), "{err}");
    assert!(err.to_string().contains("sum to 43"), "{err}");
}

#[test]
fn from_json_str_rejects_unknown_dtype() {
    // In a tensor's override ...
    let params = SMALL_PARAMS.replace("\"fp32\"", "\"int4\"");
    let err = Inventory::from_json_str(&small_json(&params, "")).unwrap_err();
    assert!(
        matches!(
            err,
            Error::BadInput {
                op: "DType::from_str",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("int4"), "{err}");
    // ... and as the file default.
    let text = small_json(SMALL_PARAMS, "").replace("\"bf16\"", "\"bf17\"");
    let err = Inventory::from_json_str(&text).unwrap_err();
    assert!(err.to_string().contains("bf17"), "{err}");
}

#[test]
fn from_json_file_names_the_file() {
    let err = Inventory::from_json_file("models/no_such_model.json").unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("no_such_model.json"), "{err}");
}

#[test]
fn layer_of_examples() {
    let cases = [
        ("model.layers.0.self_attn.q_proj.weight", Some("layers.0")),
        (
            "model.layers.60.mlp.experts.255.down_proj.weight",
            Some("layers.60"),
        ),
        ("layers.7.w", Some("layers.7")),
        ("decoder.layers.12.fc1.bias", Some("layers.12")),
        ("model.embed_tokens.weight", None),
        ("model.norm.weight", None),
        ("lm_head.weight", None),
        ("model.layers.x.w", None),  // no index
        ("model.layers.3", None),    // no '.' after the index
        ("model.layers.3a.w", None), // index not followed by '.'
        ("model.layers..w", None),   // empty index
        ("model.layers", None),
        ("model.sublayers.2.w", None), // "layers." must start a name component
        ("encoder.sublayers.1.layers.4.w", Some("layers.4")),
    ];
    for (name, want) in cases {
        assert_eq!(layer_of(name), want, "layer_of({name:?})");
    }
}

// ---- The builders are general, not tied to the five presets. ----

fn names(inv: &Inventory) -> Vec<&str> {
    inv.tensors.iter().map(|t| t.name.as_str()).collect()
}

fn shape_of<'a>(inv: &'a Inventory, name: &str) -> &'a [usize] {
    &inv.tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
        .shape
}

#[test]
fn llama_tied_embeddings_omit_lm_head() {
    let tied = LlamaConfig {
        tie_embeddings: true,
        layers: 2,
        ..LLAMA3_8B
    };
    let inv = tied.inventory("tied").unwrap();
    assert_eq!(inv.tensors.len(), 1 + 2 * 9 + 1);
    assert_eq!(names(&inv).last(), Some(&"model.norm.weight"));
    assert!(!names(&inv).contains(&"lm_head.weight"));
    let untied = LlamaConfig {
        layers: 2,
        ..LLAMA3_8B
    }
    .inventory("untied")
    .unwrap();
    assert_eq!(names(&untied).last(), Some(&"lm_head.weight"));
    assert_eq!(inv.model, "tied");
}

#[test]
fn llama_shapes_follow_config() {
    let c = LlamaConfig {
        hidden: 64,
        intermediate: 96,
        layers: 3,
        heads: 4,
        kv_heads: 2,
        head_dim: 24, // heads * head_dim != hidden
        vocab: 100,
        tie_embeddings: false,
    };
    let inv = c.inventory("toy").unwrap();
    assert_eq!(inv.tensors.len(), 1 + 3 * 9 + 2);
    assert_eq!(
        shape_of(&inv, "model.layers.2.self_attn.q_proj.weight"),
        [96, 64]
    );
    assert_eq!(
        shape_of(&inv, "model.layers.2.self_attn.k_proj.weight"),
        [48, 64]
    );
    assert_eq!(
        shape_of(&inv, "model.layers.2.self_attn.o_proj.weight"),
        [64, 96]
    );
    assert_eq!(
        shape_of(&inv, "model.layers.0.mlp.down_proj.weight"),
        [64, 96]
    );
    assert_eq!(shape_of(&inv, "lm_head.weight"), [100, 64]);
}

#[test]
fn gpt_oss_without_attention_bias() {
    let c = GptOssConfig {
        attention_bias: false,
        layers: 1,
        ..GPT_OSS_20B
    };
    let inv = c.inventory("nobias").unwrap();
    assert_eq!(inv.tensors.len(), 1 + 13 + 2);
    assert!(!names(&inv).iter().any(|n| n.contains("_proj.bias")));
    // The router keeps its bias; expert biases are separate parameters.
    assert_eq!(shape_of(&inv, "model.layers.0.mlp.router.bias"), [32]);
    assert_eq!(
        shape_of(&inv, "model.layers.0.mlp.experts.down_proj_bias"),
        [32, 2880]
    );
}

#[test]
fn gpt_oss_expert_shapes_distinguish_hidden_and_intermediate() {
    let c = GptOssConfig {
        hidden: 16,
        intermediate: 24,
        layers: 1,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        experts: 3,
        vocab: 50,
        attention_bias: true,
        tie_embeddings: true,
    };
    let inv = c.inventory("toy").unwrap();
    let e = "model.layers.0.mlp.experts";
    assert_eq!(shape_of(&inv, &format!("{e}.gate_up_proj")), [3, 16, 48]);
    assert_eq!(shape_of(&inv, &format!("{e}.gate_up_proj_bias")), [3, 48]);
    assert_eq!(shape_of(&inv, &format!("{e}.down_proj")), [3, 24, 16]);
    assert_eq!(shape_of(&inv, &format!("{e}.down_proj_bias")), [3, 16]);
    assert_eq!(shape_of(&inv, "model.layers.0.self_attn.sinks"), [4]);
    assert_eq!(
        shape_of(&inv, "model.layers.0.self_attn.o_proj.weight"),
        [16, 32]
    );
    assert!(!names(&inv).contains(&"lm_head.weight"));
    assert_eq!(inv.tensors.len(), 1 + 17 + 1);
}

fn small_deepseek() -> DeepSeekV3Config {
    DeepSeekV3Config {
        hidden: 32,
        intermediate: 80,
        moe_intermediate: 8,
        layers: 7,
        first_k_dense_replace: 2,
        moe_layer_freq: 2,
        heads: 4,
        q_lora_rank: Some(16),
        kv_lora_rank: 12,
        qk_nope_head_dim: 6,
        qk_rope_head_dim: 2,
        v_head_dim: 5,
        n_routed_experts: 4,
        n_shared_experts: 2,
        vocab: 50,
        attention_bias: false,
        tie_embeddings: false,
    }
}

#[test]
fn deepseek_dense_moe_split_follows_config() {
    let c = small_deepseek();
    let moe: Vec<usize> = (0..c.layers).filter(|&i| c.is_moe_layer(i)).collect();
    assert_eq!(moe, [2, 4, 6]);
    let inv = c.inventory("toy").unwrap();
    let units = inv.units();
    assert_eq!(units.len(), 8);
    let per_layer: Vec<usize> = units[1..].iter().map(|u| u.tensors.len()).collect();
    // Dense: 7 + 3 + 2 = 12; MoE: 7 + 4*3 + 2 + 3 + 2 = 26.
    assert_eq!(per_layer, [12, 12, 26, 12, 26, 12, 26]);
    assert_eq!(
        shape_of(&inv, "model.layers.3.mlp.gate_proj.weight"),
        [80, 32]
    );
    assert_eq!(
        shape_of(&inv, "model.layers.4.mlp.experts.3.up_proj.weight"),
        [8, 32]
    );
    assert_eq!(shape_of(&inv, "model.layers.4.mlp.gate.weight"), [4, 32]);
    // The shared-expert MLP is n_shared_experts * moe_intermediate wide.
    assert_eq!(
        shape_of(&inv, "model.layers.6.mlp.shared_experts.gate_proj.weight"),
        [16, 32]
    );
    assert_eq!(
        shape_of(&inv, "model.layers.6.mlp.shared_experts.down_proj.weight"),
        [32, 16]
    );
    // MLA shapes.
    let a = "model.layers.0.self_attn";
    assert_eq!(shape_of(&inv, &format!("{a}.q_a_proj.weight")), [16, 32]);
    assert_eq!(shape_of(&inv, &format!("{a}.q_b_proj.weight")), [32, 16]);
    assert_eq!(
        shape_of(&inv, &format!("{a}.kv_a_proj_with_mqa.weight")),
        [14, 32]
    );
    assert_eq!(shape_of(&inv, &format!("{a}.kv_a_layernorm.weight")), [12]);
    assert_eq!(shape_of(&inv, &format!("{a}.kv_b_proj.weight")), [44, 12]);
    assert_eq!(shape_of(&inv, &format!("{a}.o_proj.weight")), [32, 20]);
    // Order inside an MoE layer: experts, gate, correction bias, shared experts, norms.
    let l4: Vec<&str> = units[5].tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(l4[7], "model.layers.4.mlp.experts.0.gate_proj.weight");
    assert_eq!(
        l4[19..22],
        [
            "model.layers.4.mlp.gate.weight",
            "model.layers.4.mlp.gate.e_score_correction_bias",
            "model.layers.4.mlp.shared_experts.gate_proj.weight",
        ]
    );
}

#[test]
fn deepseek_variants() {
    // No q LoRA: a single q_proj.
    let c = DeepSeekV3Config {
        q_lora_rank: None,
        n_shared_experts: 0,
        attention_bias: true,
        ..small_deepseek()
    };
    let inv = c.inventory("toy").unwrap();
    let n = names(&inv);
    assert_eq!(
        shape_of(&inv, "model.layers.0.self_attn.q_proj.weight"),
        [32, 32]
    );
    assert!(!n.iter().any(|n| n.contains("q_a_") || n.contains("q_b_")));
    assert!(!n.iter().any(|n| n.contains("shared_experts")));
    // attention_bias adds biases to kv_a_proj_with_mqa and o_proj only (q_a_proj absent here).
    assert_eq!(
        shape_of(&inv, "model.layers.0.self_attn.kv_a_proj_with_mqa.bias"),
        [14]
    );
    assert_eq!(shape_of(&inv, "model.layers.0.self_attn.o_proj.bias"), [32]);
    assert!(!n.iter().any(|n| n.contains("kv_b_proj.bias")));
    // No routed experts: every layer dense.
    let dense = DeepSeekV3Config {
        n_routed_experts: 0,
        ..small_deepseek()
    };
    assert!((0..dense.layers).all(|i| !dense.is_moe_layer(i)));
    let inv = dense.inventory("dense").unwrap();
    assert!(inv.tensors.iter().all(|t| t.dtype == DType::BF16));
    assert_eq!(inv.tensors.len(), 1 + 7 * 12 + 2);
    // The 671B config itself: 3 dense layers, then all MoE.
    let c = DEEPSEEK_V3_671B;
    assert!((0..3).all(|i| !c.is_moe_layer(i)));
    assert!((3..61).all(|i| c.is_moe_layer(i)));
}

#[test]
fn zero_sized_config_is_an_error() {
    let c = LlamaConfig {
        kv_heads: 0,
        ..LLAMA3_70B
    };
    let err = c.inventory("broken").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("broken") && msg.contains("zero"), "{msg}");
    assert!(
        msg.contains("model.layers.0.self_attn.k_proj.weight"),
        "{msg}"
    );
    assert!(GptOssConfig {
        experts: 0,
        ..GPT_OSS_120B
    }
    .inventory("x")
    .is_err());
    assert!(DeepSeekV3Config {
        v_head_dim: 0,
        ..small_deepseek()
    }
    .inventory("x")
    .is_err());
}
