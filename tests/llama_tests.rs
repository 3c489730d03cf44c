//! A model nobody here wrote: candle-transformers 0.11.1's Llama (tiny config), its parameters
//! named and initialized by its own `Llama::load`, trained through `fully_shard` on thread
//! ranks with Muon and 8-bit Adam; and the parameter roles on its names.

#[path = "../examples/support/llama.rs"]
mod llama;

use std::collections::{BTreeSet, HashMap};

use candle_core::{DType, Device, IndexOp, Tensor, Var};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::{Cache, Llama};
use ragged::comm::threads::ThreadWorld;
use ragged::comm::{Communicator, ReduceOp, SingleRank};
use ragged::demo::SplitMix;
use ragged::fsdp::{fully_shard, FsdpOptions, ParamTable};
use ragged::optim::Optimizer;
use ragged::roles::default_role;
use ragged::{Role, RoleRule, RoleSettings};
use ragged_optimizers::{Adam8bit, Adam8bitConfig, AdamWConfig, MatrixLayout, Muon, MuonConfig};

use llama::{llama_params, tiny_config, DiffLlama};

const STEPS: usize = 3;

/// Token ids `[rows, 16]`, seeded.
fn ids(rows: usize, seed: u64) -> Tensor {
    let mut rng = SplitMix(seed);
    let v: Vec<u32> = (0..rows * 16)
        .map(|_| (rng.next_u64() % 128) as u32)
        .collect();
    Tensor::from_vec(v, (rows, 16), &Device::Cpu).unwrap()
}

/// What one rank saw of a training run.
struct Run {
    /// The loss of every step (rank 0's batch), as bits.
    losses: Vec<u32>,
    /// Final full parameters, as bits.
    params: HashMap<String, Vec<u32>>,
    /// Parameters with a nonzero element in this rank's reduced gradient shard, first step.
    nonzero: BTreeSet<String>,
    without_gradient: Option<Vec<String>>,
    table: ParamTable,
}

/// Trains the Llama in whole-model mode. Gradients are summed and only rank 0's loss counts
/// (the others' is scaled by 0, whose gradients are exact zeros), so every world size reduces
/// exactly the unsharded gradients and the contract "same gradients, same step bits" makes the
/// whole run bitwise the unsharded one.
fn train<O: Optimizer>(
    optimizer: O,
    comm: &dyn Communicator,
    params: &[(String, Tensor)],
    batch: &Tensor,
) -> ragged::Result<Run> {
    let opts = FsdpOptions {
        reduce: ReduceOp::Sum,
        ..FsdpOptions::default()
    };
    let mut sharded = fully_shard(params, optimizer, comm, opts)?;
    let table = sharded.describe();
    let vb = VarBuilder::from_tensors(sharded.unshard()?, DType::F32, &Device::Cpu);
    let model = DiffLlama::load(vb, &tiny_config())?;
    let scale = if comm.rank() == 0 { 1.0 } else { 0.0 };
    let (mut losses, mut nonzero) = (Vec::new(), BTreeSet::new());
    for step in 0..STEPS {
        sharded.unshard()?; // rewrites the model's tensors in place
        let loss = model.loss(batch)?;
        (&loss * scale)?.backward()?;
        sharded.reduce_gradients()?;
        if step == 0 {
            sharded.with_local_grads(|local, g| {
                for p in &local.pieces {
                    if g[p.offset..p.offset + p.range.len()]
                        .iter()
                        .any(|&x| x != 0.0)
                    {
                        nonzero.insert(local.params[p.param].name.clone());
                    }
                }
            })?;
        }
        // A norm far above the gradients' clips nothing, so the bits stay; it must still
        // work with frozen buffers (which have no gradient shard).
        let norm = sharded.clip_grad_norm(1e9)?;
        assert!(norm.is_finite() && norm > 0.0, "norm {norm}");
        sharded.step()?;
        losses.push(loss.to_scalar::<f32>()?.to_bits());
    }
    let params = sharded
        .full_params()?
        .into_iter()
        .map(|(n, v)| (n, v.iter().map(|x| x.to_bits()).collect()))
        .collect();
    Ok(Run {
        losses,
        params,
        nonzero,
        without_gradient: sharded.params_without_gradient().map(<[String]>::to_vec),
        table,
    })
}

fn muon(roles: RoleRule) -> Muon {
    Muon::new(MuonConfig {
        lr: 0.02,
        layout: MatrixLayout::Auto,
        adamw: AdamWConfig {
            lr: 3e-3,
            ..AdamWConfig::default()
        },
        roles,
        ..MuonConfig::default()
    })
    .unwrap()
}

fn adam8bit(roles: RoleRule) -> Adam8bit {
    Adam8bit::new(Adam8bitConfig {
        adam: AdamWConfig {
            lr: 3e-3,
            roles,
            ..AdamWConfig::default()
        },
        ..Adam8bitConfig::default()
    })
    .unwrap()
}

/// Runs `optimizer` unsharded and on 2 and 3 thread ranks; every rank of every world must end
/// bitwise where the unsharded run ends, with the same losses. Returns the unsharded run.
fn sharded_equals_unsharded<O: Optimizer + Clone>(
    optimizer: O,
    params: &[(String, Tensor)],
) -> Run {
    let batch = ids(4, 11);
    let reference = train(optimizer.clone(), &SingleRank, params, &batch).unwrap();
    for world in [2, 3] {
        let runs =
            ThreadWorld::run(world, |c| train(optimizer.clone(), c, params, &batch)).unwrap();
        for (r, run) in runs.iter().enumerate() {
            let name = optimizer.name();
            assert_eq!(
                run.losses, reference.losses,
                "{name} V={world} rank {r}: losses"
            );
            assert!(
                run.params == reference.params,
                "{name} V={world} rank {r}: parameters"
            );
            assert_eq!(
                run.table, runs[0].table,
                "{name} V={world}: ranks describe alike"
            );
        }
        // The table: every parameter once, with the optimizer's role, held by ranks of this world.
        let table = &runs[0].table;
        let names: BTreeSet<&str> = table.rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names.len(), params.len());
        for row in &table.rows {
            assert_eq!(
                row.role,
                optimizer.role(&row.name, &row.shape),
                "{}",
                row.name
            );
            assert!(!row.ranks.is_empty() && row.ranks.iter().all(|&k| k < world));
        }
        // Rank 0 holds the gradients; across ranks every parameter got a nonzero one.
        let nonzero: BTreeSet<&String> = runs.iter().flat_map(|r| &r.nonzero).collect();
        let trained = table.rows.iter().filter(|r| r.role != Role::Frozen).count();
        assert_eq!(
            nonzero.len(),
            trained,
            "{} V={world}: nonzero gradients",
            optimizer.name()
        );
    }
    reference
}

/// The largest |element| of `t` (f32).
fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .and_then(|a| a.max_all())
        .and_then(|m| m.to_scalar::<f32>())
        .unwrap()
}

/// The default rule on candle-transformers' Llama names, Meta's names, GPT-2's and BERT's, an
/// MoE expert batch; and the two ways to override it.
#[test]
fn the_default_role_rule_is_right_for_hugging_face_names() {
    let params = llama_params(&tiny_config(), 1).unwrap();
    assert_eq!(
        params.len(),
        2 * 9 + 3,
        "2 layers of 9 tensors, embedding, norm, head"
    );
    for (name, t) in &params {
        let want = if name.contains("embed_tokens") {
            Role::Fp32State
        } else if name.contains("norm") || name == "lm_head.weight" {
            Role::ElementWise
        } else {
            assert!(name.ends_with("_proj.weight"), "{name}");
            Role::Matrix
        };
        assert_eq!(default_role(name, t.dims()), want, "{name}");
    }
    let cases: [(&str, &[usize], Role); 10] = [
        ("tok_embeddings.weight", &[32000, 4096], Role::Fp32State),
        ("output.weight", &[32000, 4096], Role::ElementWise),
        ("layers.0.attention.wq.weight", &[4096, 4096], Role::Matrix),
        ("transformer.wte.weight", &[50257, 768], Role::Fp32State),
        ("transformer.wpe.weight", &[1024, 768], Role::Fp32State),
        ("transformer.h.0.ln_1.weight", &[768], Role::ElementWise),
        (
            "transformer.h.0.attn.c_attn.bias",
            &[2304],
            Role::ElementWise,
        ),
        (
            "bert.encoder.layer.0.attention.output.dense.weight",
            &[768, 768],
            Role::Matrix,
        ),
        (
            "model.layers.0.mlp.experts.gate_up_proj",
            &[8, 64, 256],
            Role::Matrix,
        ),
        (
            "model.layers.0.self_attn.q_norm.weight",
            &[128],
            Role::ElementWise,
        ),
    ];
    for (name, shape, want) in cases {
        assert_eq!(default_role(name, shape), want, "{name}");
    }
    let patterns = RoleRule::with_patterns(&[("lm_head", Role::Matrix), ("embed", Role::Frozen)]);
    assert_eq!(patterns.role_of("lm_head.weight", &[128, 64]), Role::Matrix);
    assert_eq!(
        patterns.role_of("model.embed_tokens.weight", &[128, 64]),
        Role::Frozen
    );
    let custom = RoleRule::with_fn(|name, _| name.contains("down_proj").then_some(Role::Frozen));
    assert_eq!(
        custom.role_of("model.layers.1.mlp.down_proj.weight", &[64, 128]),
        Role::Frozen
    );
    assert_eq!(
        custom.role_of("model.layers.1.mlp.up_proj.weight", &[128, 64]),
        Role::Matrix
    );
    let bad = RoleRule {
        matrix: RoleSettings {
            lr_scale: f64::NAN,
            weight_decay: None,
        },
        ..RoleRule::default()
    };
    assert!(Muon::new(MuonConfig {
        roles: bad,
        ..MuonConfig::default()
    })
    .is_err());
}

/// candle-transformers' own forward gives a gradient to `lm_head` only (its kernels are forward
/// only); the glue's forward computes the same logits (to 1e-5: the fused and the composed
/// kernels round differently) and gives every parameter a nonzero gradient.
#[test]
fn the_differentiable_llama_computes_candle_transformers_logits_and_trains_every_parameter() {
    let cfg = tiny_config();
    let params = llama_params(&cfg, 2).unwrap();
    let vars: Vec<(String, Var)> = params
        .iter()
        .map(|(n, t)| (n.clone(), Var::from_tensor(t).unwrap()))
        .collect();
    let map: HashMap<String, Tensor> = vars
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    let vb = VarBuilder::from_tensors(map, DType::F32, &Device::Cpu);
    let batch = ids(2, 5);
    let theirs = Llama::load(vb.clone(), &cfg).unwrap();
    let mut cache = Cache::new(false, DType::F32, &cfg, &Device::Cpu).unwrap();
    let last = theirs.forward(&batch, 0, &mut cache).unwrap();
    let ours = DiffLlama::load(vb, &cfg).unwrap();
    let logits = ours.forward(&batch).unwrap();
    let ours_last = logits.i((.., 15, ..)).unwrap();
    let diff = max_abs(&(ours_last - &last).unwrap());
    let scale = max_abs(&last);
    assert!(
        diff <= 1e-5 * scale.max(1.0),
        "logits differ by {diff} (scale {scale})"
    );

    let reached = |loss: Tensor| -> Vec<String> {
        let grads = loss.backward().unwrap();
        vars.iter()
            .filter(|(_, v)| grads.get(v).is_some_and(|g| max_abs(g) > 0.0))
            .map(|(n, _)| n.clone())
            .collect()
    };
    assert_eq!(
        reached(last.sum_all().unwrap()),
        vec!["lm_head.weight".to_string()]
    );
    assert_eq!(reached(ours.loss(&batch).unwrap()).len(), params.len());
}

/// Muon (whole and split matrices, LPT roots) and 8-bit Adam (8-bit and f32 state) train the
/// Llama bitwise like unsharded on 2 and 3 ranks, every parameter gets a nonzero gradient, none
/// is reported gradient-less, and the loss falls.
#[test]
fn llama_trains_sharded_bitwise_like_unsharded_with_muon_and_8bit_adam() {
    let params = llama_params(&tiny_config(), 3).unwrap();
    for reference in [
        sharded_equals_unsharded(muon(RoleRule::default()), &params),
        sharded_equals_unsharded(adam8bit(RoleRule::default()), &params),
    ] {
        assert_eq!(reference.without_gradient, Some(Vec::new()));
        let loss = |k: usize| f32::from_bits(reference.losses[k]);
        assert!(
            loss(STEPS - 1) < loss(0),
            "{} -> {}",
            loss(0),
            loss(STEPS - 1)
        );
    }
}

/// Per-role learning rates: a role at lr_scale 0 stays bitwise at its initial values while the
/// others move (Muon: the fallback roles at 0, the embedding frozen by a custom rule; 8-bit
/// Adam: the matrices at 0), sharded still bitwise the unsharded run, and frozen parameters
/// are reported as such in the start-up table.
#[test]
fn a_role_learning_rate_of_zero_leaves_that_role_unchanged_while_others_move() {
    let params = llama_params(&tiny_config(), 4).unwrap();
    let still = RoleSettings {
        lr_scale: 0.0,
        weight_decay: None,
    };
    let muon_roles = RoleRule {
        custom: Some(|name, _| name.contains("embed").then_some(Role::Frozen)),
        element_wise: still,
        fp32_state: still,
        ..RoleRule::default()
    };
    let eight_roles = RoleRule {
        matrix: still,
        ..RoleRule::default()
    };
    // Which roles each run holds still.
    let muon_still = |r: Role| r != Role::Matrix;
    let eight_still = |r: Role| r == Role::Matrix;
    let runs: [(&dyn Fn(Role) -> bool, Run); 2] = [
        (
            &muon_still,
            sharded_equals_unsharded(muon(muon_roles), &params),
        ),
        (
            &eight_still,
            sharded_equals_unsharded(adam8bit(eight_roles), &params),
        ),
    ];
    for (k, (still, run)) in runs.iter().enumerate() {
        let mut moved = 0;
        for (name, t) in &params {
            let init: Vec<u32> = t
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            let role = run
                .table
                .rows
                .iter()
                .find(|r| &r.name == name)
                .unwrap()
                .role;
            assert_eq!(
                run.params[name] == init,
                still(role),
                "run {k}: {name} ({role})"
            );
            moved += usize::from(!still(role));
        }
        assert!(moved > 0, "run {k}: something must move");
    }
    assert_eq!(runs[0].1.table.count(Role::Frozen), 1, "the embedding");
    assert_eq!(runs[0].1.without_gradient, Some(Vec::new()));
}
