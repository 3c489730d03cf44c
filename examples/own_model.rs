//! `fully_shard` on a model of your own: the README's "use it on your own model" section is
//! this file (a test checks that the README shows it verbatim). A two-block MLP with its own
//! parameter names, trained unit by unit on 2 thread ranks with AdamW, parameter roles (a
//! learning rate and weight decay per role), a warmup + cosine schedule and gradient clipping.
//!
//! `cargo run --release --example own_model`

use candle_core::{Device, Module, Tensor};
use candle_nn::linear_no_bias;
use ragged::comm::threads::ThreadWorld;
use ragged::comm::Communicator;
use ragged::fsdp::{fully_shard, FsdpOptions, Stages, UnitParams};
use ragged::schedule::Schedule;
use ragged::{RoleRule, RoleSettings};
use ragged_optimizers::{AdamW, AdamWConfig};

// README:begin
/// The model as FSDP sees it: stages in forward order, each computing with one unit's
/// parameters (units: one per numbered block, `blocks.<i>`, plus `root` for the rest).
struct Mlp;

impl Stages for Mlp {
    type Batch = (Tensor, Tensor); // inputs and targets

    fn stage_units(&self) -> Vec<String> {
        vec!["blocks.0".into(), "blocks.1".into(), "root".into()]
    }

    fn forward(
        &self,
        stage: usize,
        params: &UnitParams,
        x: Option<&Tensor>,
        (inputs, targets): &Self::Batch,
    ) -> candle_core::Result<Tensor> {
        let vb = params.vb(); // candle-nn layers over the gathered parameters, no copy
        match stage {
            0 | 1 => {
                let layer = linear_no_bias(64, 64, vb.pp(format!("blocks.{stage}")))?;
                layer.forward(x.unwrap_or(inputs))?.gelu()
            }
            _ => {
                let head = linear_no_bias(64, 8, vb.pp("head"))?;
                candle_nn::loss::mse(&head.forward(x.expect("stage 2 has an input"))?, targets)
            }
        }
    }
}

/// Trains the MLP for 20 steps on 2 thread ranks; returns each rank's loss per step.
fn train() -> ragged::Result<Vec<Vec<f32>>> {
    let dev = Device::Cpu;
    let params: Vec<(String, Tensor)> = vec![
        (
            "blocks.0.weight".into(),
            Tensor::randn(0f32, 0.1, (64, 64), &dev)?,
        ),
        (
            "blocks.1.weight".into(),
            Tensor::randn(0f32, 0.1, (64, 64), &dev)?,
        ),
        (
            "head.weight".into(),
            Tensor::randn(0f32, 0.1, (8, 64), &dev)?,
        ),
    ];
    let inputs = Tensor::randn(0f32, 1.0, (32, 64), &dev)?;
    let targets = Tensor::randn(0f32, 1.0, (32, 8), &dev)?;
    // Parameter groups by role: the head (role ElementWise by its name) at half the rate and
    // without weight decay; the hidden matrices (role Matrix) at the full rate.
    let roles = RoleRule {
        element_wise: RoleSettings {
            lr_scale: 0.5,
            weight_decay: Some(0.0),
        },
        ..RoleRule::default()
    };
    let adamw = AdamW::new(AdamWConfig {
        lr: 1e-2,
        roles,
        ..AdamWConfig::default()
    })?;
    // One thread per rank; every rank passes the same parameters (checked) and its own rows.
    ThreadWorld::run(2, |comm| {
        let mut sharded = fully_shard(&params, adamw, comm, FsdpOptions::default())?;
        if comm.rank() == 0 {
            println!("{}", sharded.describe()); // parameter, shape, role, unit, block, ranks
        }
        let schedule = Schedule::WarmupCosine {
            warmup: 2,
            total: 20,
            min_factor: 0.1,
        };
        sharded.set_schedule(schedule)?; // the learning rate times a factor of the step
        let rows = 32 / comm.world_size();
        let mine = |t: &Tensor| t.narrow(0, comm.rank() * rows, rows);
        let batch = (mine(&inputs)?, mine(&targets)?);
        let mut losses = Vec::new();
        for _ in 0..20 {
            let report = sharded.forward_backward(&Mlp, &batch)?; // gather, compute, reduce
            sharded.clip_grad_norm(1.0)?; // global norm over all ranks
            sharded.step()?; // AdamW on this rank's shard
            losses.push(report.loss);
        }
        Ok(losses)
    })
}
// README:end

const USAGE: &str = "own_model: trains a two-block MLP sharded over 2 thread ranks with AdamW, \
parameter roles, a warmup + cosine schedule and gradient clipping (the README's \
\"use it on your own model\" example); takes no arguments";

fn main() -> ragged::Result<()> {
    match std::env::args().nth(1).as_deref() {
        None => {}
        Some("-h" | "--help") => {
            println!("{USAGE}");
            return Ok(());
        }
        Some(other) => {
            eprintln!("error: unexpected argument {other:?}\n{USAGE}");
            std::process::exit(2);
        }
    }
    let losses = train()?;
    let (first, last) = (losses[0][0], losses[0][19]);
    println!("rank 0 loss: step 0 {first:.4}, step 19 {last:.4}");
    if last.partial_cmp(&first) != Some(std::cmp::Ordering::Less) {
        return Err(ragged::Error::Msg(format!(
            "the loss did not fall: {first} -> {last}"
        )));
    }
    Ok(())
}
