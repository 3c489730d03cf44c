//! One unit's gap between the multi-buffer plan and its floor, taken apart: the unit's shapes
//! (elements, block, count, elements per rank), the plan's buffers (`S`, lattice, contents per
//! shape, padding per rank) and every bound the k-buffer floor is the largest of.
//!
//! `cargo run --release --example unit_gap -- models/qwen3_30b_a3b.json layers.0 rows:1 256 3`

use ragged::plan::multi::{floor_shard_sum, MultiOptions};
use ragged::plan::multi_model::plan_multi_unit;
use ragged::plan::{
    class_floor, content_floor, excess_floor, heavy_floor, lattice_floor, pair_floor, piece_floor,
    residue_floor, search, shard_fill, step_floor, waste_floor, PlanOptions,
};
use ragged::Result;
use unit_args::UnitArgs;

#[path = "support/unit_args.rs"]
mod unit_args;

use std::fmt::Debug;

fn main() -> std::process::ExitCode {
    ragged::demo::end_quietly_when_stdout_closes();
    unit_args::exit(run())
}

fn run() -> Result<()> {
    let args = UnitArgs::from_env("unit_gap")?;
    let unit = args.unit("unit_gap")?;
    let (unit_name, block, world, k) = (&args.unit_name, args.block, args.world, args.k);
    let opts = PlanOptions::default();
    let coll = opts.coll_align;
    let mopts = MultiOptions {
        max_buffers: k,
        ..MultiOptions::default()
    };
    let items = args.items(&unit, &opts)?;
    // Shapes: (numel, block) -> (count, first name).
    let mut shapes: Vec<(usize, usize, usize, String)> = Vec::new();
    for (t, it) in unit.tensors.iter().zip(&items) {
        match shapes
            .iter_mut()
            .find(|s| s.0 == it.numel && s.1 == it.block)
        {
            Some(s) => s.2 += 1,
            None => shapes.push((it.numel, it.block, 1, t.name.clone())),
        }
    }
    let total: usize = items.iter().map(|t| t.numel).sum();
    println!(
        "{unit_name} {block} V={world}: {} tensors, {} shapes, E = {total}, E/V = {:.2}",
        items.len(),
        shapes.len(),
        total as f64 / world as f64
    );
    for (e, g, n, name) in &shapes {
        println!(
            "  e {e:>10} g {g:>8} x{n:<4} e/V {:>12.3} e/g {:>6}  {name}",
            *e as f64 / world as f64,
            e / g
        );
    }
    let plan = plan_multi_unit(&unit, &|_| block, world, &opts, &mopts)?;
    let sum: usize = plan.buffers.iter().map(|b| b.shard_size).sum();
    println!(
        "plan: k = {}, sum S = {sum}, padding/rank {:.3} ({:.4} %)",
        plan.k(),
        sum as f64 - total as f64 / world as f64,
        100.0 * (world * sum - total) as f64 / total as f64
    );
    for b in &plan.buffers {
        let c: usize = b.numel();
        let mut counts: Vec<String> = Vec::new();
        for (e, g, _, _) in &shapes {
            let n = b
                .placements
                .iter()
                .filter(|p| p.numel() == *e && p.block_elems == *g)
                .count();
            if n > 0 {
                counts.push(format!("{n}x({e},{g})"));
            }
        }
        println!(
            "  S {:>10} pad/rank {:>10.3} contents/V {:>12.3}: {}",
            b.shard_size,
            b.shard_size as f64 - c as f64 / world as f64,
            c as f64 / world as f64,
            counts.join(" ")
        );
    }
    println!("single buffer: S = {}", plan.single.shard_size);
    println!(
        "floor (k <= {}): {} (padding/rank {:.3})",
        plan.k(),
        plan.floor_shard_sum,
        plan.floor_shard_sum as f64 - total as f64 / world as f64
    );
    let kk = plan.k();
    for j in 1..=k {
        bound(
            &format!("floor_shard_sum k={j}"),
            floor_shard_sum(&items, world, coll, j),
        );
    }
    bound(
        "one buffer any order",
        search::any_order_lower_bound(&items, world, coll),
    );
    bound("heavy", heavy_floor::heavy_floor(&items, world, coll, kk));
    bound("class", class_floor::class_floor(&items, world, coll, kk));
    bound("step_k", step_floor::step_floor_k(&items, world, coll, kk));
    bound("piece", piece_floor::piece_floor(&items, world, coll));
    bound("lattice", lattice_floor::lattice_floor(&items, world, coll));
    if let Some(d) = piece_floor::main_step(&items) {
        bound(
            &format!("residue (d = {d})"),
            residue_floor::residue_floor(&items, world, coll, d),
        );
        let start = std::time::Instant::now();
        let waste = waste_floor::waste_floor(&items, world, coll, d, sum);
        let ms = start.elapsed().as_secs_f64() * 1e3;
        bound(
            &format!("waste (d = {d}, up to the plan, {ms:.1} ms)"),
            waste,
        );
    }
    bound("content", content_floor::content_floor(&items, world, coll));
    // The pair floor from the k-buffer floor up to the plan (at most two buffers).
    let start = std::time::Instant::now();
    let from = floor_shard_sum(&items, world, coll, kk)?;
    let pair = pair_floor::pair_floor(&items, world, coll, kk, from, sum);
    let ms = start.elapsed().as_secs_f64() * 1e3;
    bound(
        &format!("pair (k = {kk}, from {from} up to the plan, {ms:.1} ms)"),
        pair.map(|p| p.map(|p| p.bound)),
    );
    bound(
        "excess (one buffer)",
        excess_floor::excess_floor(&items, world, coll, 0),
    );
    // The whole unit filled shard by shard at the one-buffer floor and a few steps above.
    let one = floor_shard_sum(&items, world, coll, 1)?;
    let step = piece_floor::main_step(&items).unwrap_or(coll).max(coll);
    let mut s = one;
    for _ in 0..4 {
        let found = shard_fill::shard_fill(&items, world, s)?.is_some();
        println!("  shard_fill at S = {s}: {found}");
        s = (s + 1).next_multiple_of(step);
    }
    Ok(())
}

/// One line of the bounds: its name and its value as the bound returns it.
fn bound(name: &str, value: impl Debug) {
    println!("  {name}: {value:?}");
}
