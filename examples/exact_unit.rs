//! The exact optimum of one small unit against the planner and the floor: every partition of the
//! unit's tensors into at most `k` buffers and every order inside each buffer
//! ([`ragged::plan::exact_partition`]), capped at the planner's `Σ S`. It tells whether a gap
//! between plan and floor is the plan's (the exact search finds less) or the floor's (it does
//! not). Exponential in the tensor count: units of at most 16 tensors.
//!
//! `cargo run --release --example exact_unit -- deepseek_v3_671b layers.0 rows:128 8 3`

use std::time::Instant;

use ragged::plan::exact_partition::exact_partition;
use ragged::plan::multi::MultiOptions;
use ragged::plan::multi_model::plan_multi_unit;
use ragged::plan::{plan_items, Item, PlanOptions};
use ragged::{Error, Result};
use unit_args::UnitArgs;

#[path = "support/unit_args.rs"]
mod unit_args;

fn main() -> std::process::ExitCode {
    ragged::demo::end_quietly_when_stdout_closes();
    unit_args::exit(run())
}

fn run() -> Result<()> {
    let args = UnitArgs::from_env("exact_unit")?;
    let unit = args.unit("exact_unit")?;
    let (model, unit_name, block) = (&args.model, &args.unit_name, args.block);
    let (world, k) = (args.world, args.k);
    let opts = PlanOptions::default();
    let mopts = MultiOptions {
        max_buffers: k,
        ..MultiOptions::default()
    };
    let plan = plan_multi_unit(&unit, &|_| block, world, &opts, &mopts)?;
    let planned: usize = plan.buffers.iter().map(|b| b.shard_size).sum();
    println!(
        "{model} {unit_name} {block} V={world}: {} tensors",
        unit.tensors.len()
    );
    println!(
        "planner: k = {}, S = {:?}, sum {planned}",
        plan.k(),
        plan.buffers
            .iter()
            .map(|b| b.shard_size)
            .collect::<Vec<_>>()
    );
    println!("floor (k <= {k}): {}", plan.floor_shard_sum);
    let items = args.items(&unit, &opts)?;
    let start = Instant::now();
    let exact = exact_partition(&items, world, opts.coll_align, k, planned)?;
    println!("exact search: {:?}", start.elapsed());
    let Some(exact) = exact else {
        return Err(Error::BadInput {
            op: "exact_unit",
            what: format!("cap {planned}"),
            reason: "the exact search found nothing at or below the planner's sum".into(),
        });
    };
    for (group, s) in exact.groups.iter().zip(&exact.shards) {
        let names: Vec<&str> = group
            .iter()
            .map(|&i| short_name(&unit.tensors[i].name))
            .collect();
        // An independent check that S is reachable: the planner's own (validated) layout of
        // this group alone.
        let sub: Vec<Item> = group.iter().map(|&i| items[i]).collect();
        let alone = plan_items(&sub, world, &opts)?.shard_size;
        println!("  S = {s} (planner on this group alone: {alone}): {names:?}");
    }
    let best = exact.shard_sum();
    let share = unit.tensors.iter().map(|t| t.numel()).sum::<usize>() as f64 / world as f64;
    let pad = |s: usize| 100.0 * (1.0 - share / s as f64);
    println!(
        "exact optimum: sum {best} ({:.4} % padding); planner {planned} ({:.4} %); floor {} ({:.4} %)",
        pad(best),
        pad(planned),
        plan.floor_shard_sum,
        pad(plan.floor_shard_sum)
    );
    println!(
        "{}",
        if best < planned {
            "the plan is loose"
        } else {
            "the plan is optimal: the floor is loose"
        }
    );
    Ok(())
}

/// The tensor's name after the unit prefix (`self_attn.q_b_proj.weight`).
fn short_name(name: &str) -> &str {
    name.split_once(".layers.")
        .and_then(|(_, rest)| rest.split_once('.'))
        .map_or(name, |(_, tail)| tail)
}
