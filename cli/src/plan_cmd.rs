//! `ragged plan`: one model, one world size, one block.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use ragged::bench::plan::{baseline_layouts, pct};
use ragged::limits::{at_least, at_most, checked_product};
use ragged::model::{presets, Inventory, Unit};
use ragged::plan::baselines;
use ragged::plan::export::{svg_multi, write_multi_json};
use ragged::plan::multi::MultiOptions;
use ragged::plan::multi_model::{
    coarse_wrap, hsdp_group, plan_model_multi, wrap_layers, MultiModelPlan,
};
use ragged::plan::{plan_model, ModelPlan, Order, PlanOptions};
use ragged::{AtomicBlock, Context, Error, Result};
use ragged_optimizers::{LayoutReport, MatrixLayout, Muon, MuonConfig};

use crate::flags::finite_within;
use crate::print::{print_stdout, printable};
use ragged::limits::same_file;

const OP: &str = "ragged plan";

/// The most devices `--full-units` writes a per-rank list for.
const MAX_FULL_UNITS_DEVICES: usize = 1 << 16;

/// `--alpha-us`' range, microseconds: 0 (latency ignored) to one second per collective.
const ALPHA_US_RANGE: (f64, f64) = (0.0, 1e6);

/// `--link-gbs`' range, GB/s: 1 MB/s to 1 PB/s per rank, far past any link either way.
const LINK_GBS_RANGE: (f64, f64) = (1e-3, 1e6);

#[derive(Args, Clone)]
pub struct PlanArgs {
    /// A preset (llama3_8b, llama3_70b, gpt_oss_20b, gpt_oss_120b, deepseek_v3_671b), an
    /// inventory JSON file (format: models/README.md) or a .safetensors file (its header).
    #[arg(long)]
    model: String,
    /// Number of ranks V sharing the model.
    #[arg(long)]
    devices: usize,
    /// Atomic block of every tensor: elem, rows:K, tile:RxC, matrix or whole.
    #[arg(long, default_value = "elem")]
    block: AtomicBlock,
    /// Shard sizes are multiples of this many elements.
    #[arg(long, default_value_t = PlanOptions::default().coll_align)]
    coll_align: usize,
    /// Every tensor starts at a multiple of this many elements (must divide --coll-align).
    #[arg(long, default_value_t = 1)]
    start_align: usize,
    /// Orders to try: module, block-size, shape, or all (only `all` lets the multi-buffer
    /// planner take layouts built shard by shard).
    #[arg(long, default_value = "all")]
    order: String,
    /// At most this many collective buffers per unit, each with its own shard size (1: one
    /// buffer per unit; at most 64: each buffer is one more collective per unit and step, and
    /// planning time grows with the count).
    #[arg(long, default_value_t = MultiOptions::default().max_buffers)]
    max_buffers: usize,
    /// Latency of one collective in microseconds (the price of one more buffer); 0 to 1e6.
    // A negative value is taken as a value (and refused by the planner with a reason), not as
    // an unknown flag.
    #[arg(long, default_value_t = MultiOptions::default().collective_latency_s * 1e6, allow_negative_numbers = true)]
    alpha_us: f64,
    /// Link bandwidth per rank in GB/s (the price of padding moved); 0.001 to 1e6.
    #[arg(long, default_value_t = MultiOptions::default().link_bytes_per_s / 1e9, allow_negative_numbers = true)]
    link_gbs: f64,
    /// Numbered blocks (decoder layers: `layers.N`, `transformer.h.N`, ...) per FSDP unit.
    #[arg(long, default_value_t = 1)]
    layers_per_unit: usize,
    /// Write the full plan as JSON to this file (- for standard output; not the --model
    /// file nor the --svg file).
    #[arg(long)]
    json: Option<PathBuf>,
    /// In the JSON, also write every tensor's V-entry units_per_rank list (large at big V; at
    /// most 65536 devices).
    #[arg(long, requires = "json")]
    full_units: bool,
    /// Draw one unit's layout (every buffer) as SVG to this file (`-`: stdout; not the
    /// --model file nor the --json file).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// The unit to draw with --svg (default: the first decoder layer, else the first unit).
    #[arg(long, requires = "svg")]
    unit: Option<String>,
    /// Skip the baseline comparison.
    #[arg(long)]
    no_baselines: bool,
    /// Also lay out every unit as Muon's default (Auto) layout does, each matrix whole or split
    /// by bytes on the wire, and report it against all-whole and all-split (Muon picks its
    /// own blocks: --block does not apply; units as --layers-per-unit wraps them).
    #[arg(long)]
    muon: bool,
}

pub fn run(args: &PlanArgs) -> Result<()> {
    check_args(args)?;
    let inv = Inventory::load(&args.model)?;
    let opts = PlanOptions {
        coll_align: args.coll_align,
        start_align: args.start_align,
        orders: parse_orders(&args.order)?,
    };
    let mopts = MultiOptions {
        max_buffers: args.max_buffers,
        collective_latency_s: args.alpha_us * 1e-6,
        link_bytes_per_s: args.link_gbs * 1e9,
        ..MultiOptions::default()
    };
    let plan = plan_model(&inv, &|_| args.block, args.devices, &opts)?;
    for unit in &plan.units {
        unit.validate()?;
    }
    let multi = plan_multi(&inv, args, args.layers_per_unit, &opts, &mopts)?;
    let to_stdout = |p: &Option<PathBuf>| matches!(p, Some(p) if p.as_os_str() == "-");
    let quiet = to_stdout(&args.json) || to_stdout(&args.svg);
    if !quiet {
        let mut text = summary(&inv, &plan, args)?;
        text.push_str(&multi_summary(&inv, &multi, args, &opts, &mopts)?);
        print_stdout(&text)?;
        if args.muon {
            print_stdout(&muon_summary(&inv, args, &opts)?)?;
        }
    }
    if let Some(path) = &args.json {
        write_plan_json(&multi, args.full_units, path)?;
    }
    if let Some(path) = &args.svg {
        write_svg(&multi, args.unit.as_deref(), path)?;
    }
    Ok(())
}

/// Refuses bad flags before the model is read or anything is planned.
fn check_args(args: &PlanArgs) -> Result<()> {
    // The smallest buffer a plan can have is V shards of --coll-align elements: refuse a V for
    // which even that overflows, before the planner computes with it.
    checked_product(
        OP,
        "--devices × --coll-align elements",
        &[args.devices, args.coll_align],
    )?;
    if args.full_units {
        // V numbers per tensor in memory and in the file: beyond this the JSON runs to
        // gigabytes; `unit_runs` (always written) says the same in O(1) per tensor.
        at_most(
            OP,
            "--full-units with --devices",
            args.devices,
            MAX_FULL_UNITS_DEVICES,
            "it writes V numbers per tensor; unit_runs holds the same in three",
        )?;
    }
    at_least(OP, "--max-buffers", args.max_buffers, 1)?;
    at_most(
        OP,
        "--max-buffers",
        args.max_buffers,
        ragged::plan::multi::MAX_BUFFERS,
        "each buffer is one more collective per unit and step, and planning time grows with it",
    )?;
    finite_within(OP, "--alpha-us", args.alpha_us, ALPHA_US_RANGE, "µs")?;
    finite_within(OP, "--link-gbs", args.link_gbs, LINK_GBS_RANGE, "GB/s")?;
    check_outputs(args)
}

/// Refuses `--json` and `--svg` naming one file (both `-` included: JSON and SVG on one
/// stdout parse as neither), and either naming the `--model` file: it would be replaced by
/// the plan.
fn check_outputs(args: &PlanArgs) -> Result<()> {
    let refuse = |flag: &str, path: &Path, reason: String| Error::BadInput {
        op: OP,
        what: format!("{flag} {}", path.display()),
        reason,
    };
    if let (Some(json), Some(svg)) = (&args.json, &args.svg) {
        if same_file(json, svg) {
            return Err(refuse(
                "--json",
                json,
                format!(
                    "--svg {} names the same output: give each its own",
                    svg.display()
                ),
            ));
        }
    }
    // A preset is read from no file (a file of the same name is not the model).
    let model_file = Path::new(&args.model);
    if presets::canonical_name(&args.model).is_some() || !model_file.exists() {
        return Ok(());
    }
    for (flag, out) in [("--json", &args.json), ("--svg", &args.svg)] {
        if let Some(out) = out.as_deref().filter(|out| same_file(out, model_file)) {
            return Err(refuse(
                flag,
                out,
                format!(
                    "is the --model file {}: it would be overwritten",
                    args.model
                ),
            ));
        }
    }
    Ok(())
}

fn plan_multi(
    inv: &Inventory,
    args: &PlanArgs,
    layers_per_unit: usize,
    opts: &PlanOptions,
    mopts: &MultiOptions,
) -> Result<MultiModelPlan> {
    let plan = plan_model_multi(
        inv,
        &|_| args.block,
        args.devices,
        layers_per_unit,
        opts,
        mopts,
    )?;
    for unit in &plan.units {
        for buffer in &unit.buffers {
            buffer.validate()?;
        }
    }
    Ok(plan)
}

/// The multi-buffer rows: padding and floor, per-unit buffers, and, where a rank's share of a
/// unit is smaller than one block, the padding of a coarser wrap.
fn multi_summary(
    inv: &Inventory,
    multi: &MultiModelPlan,
    args: &PlanArgs,
    opts: &PlanOptions,
    mopts: &MultiOptions,
) -> Result<String> {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nmulti-buffer (at most {} buffers per unit, alpha {} us, {} GB/s), {} layer(s) per unit, plan time {:.2} ms:",
        mopts.max_buffers,
        args.alpha_us,
        args.link_gbs,
        multi.layers_per_unit,
        multi.elapsed.as_secs_f64() * 1e3
    );
    let _ = writeln!(
        s,
        "{:<14} {:>20} {:>10}\n{:<14} {:>20} {:>10}   (no layout with at most k buffers per unit pads less)",
        format!("ragged k<={}", mopts.max_buffers),
        multi.buffer_elems(),
        pct(multi.padding_frac()),
        "k-buffer floor",
        "",
        pct(multi.floor_padding_frac()),
    );
    let mut i = 0;
    while i < multi.units.len() {
        let u = &multi.units[i];
        let sizes: Vec<usize> = u.buffers.iter().map(|b| b.shard_size).collect();
        // One line for a run of units with the same shard sizes and the same contents' size
        // (so the same padding and floor), as a transformer's identical layers.
        let same = multi.units[i..]
            .iter()
            .take_while(|v| {
                v.numel() == u.numel()
                    && v.floor_elems() == u.floor_elems()
                    && v.buffers
                        .iter()
                        .map(|b| b.shard_size)
                        .eq(sizes.iter().copied())
            })
            .count();
        let name = run_name(&u.unit, &multi.units[i + same - 1].unit, same);
        let pad = u.buffer_elems() - u.numel() as u64;
        let floor_pad = u.floor_elems().saturating_sub(u.numel() as u64);
        let _ = writeln!(
            s,
            "  {name:<32} k={} S={sizes:?} padding {}%  floor {}%{}",
            u.k(),
            pct(pad as f64 / u.numel() as f64),
            pct(floor_pad as f64 / u.numel() as f64),
            if u.share_below_block() {
                "  (share per rank < one block)"
            } else {
                ""
            }
        );
        i += same;
    }
    if multi.layers_per_unit == 1 {
        if let Some(w) = coarse_wrap(multi) {
            let coarse = plan_multi(inv, args, w, opts, mopts)?;
            let _ = writeln!(
                s,
                "a rank's share of some unit is smaller than one of its blocks, so no per-layer layout \
                 avoids that padding; with --layers-per-unit {w}: padding {}% (floor {}%)",
                pct(coarse.padding_frac()),
                pct(coarse.floor_padding_frac())
            );
        }
        if let Some(g) = hsdp_group(multi) {
            let hsdp_args = PlanArgs {
                devices: g,
                ..args.clone()
            };
            let hsdp = plan_multi(inv, &hsdp_args, 1, opts, mopts)?;
            let _ = writeln!(
                s,
                "or HSDP with shard groups of {g} ranks (replicated {}x): padding {}%",
                multi.world / g,
                pct(hsdp.padding_frac())
            );
        }
    }
    Ok(s)
}

/// The `--muon` section: Muon's Auto layout of every unit (a run of units with the same
/// outcome on one line), its planning time, and the bytes on the wire per step of Auto,
/// all-whole and all-split over the model (`LayoutReport::cost_bytes`).
fn muon_summary(inv: &Inventory, args: &PlanArgs, opts: &PlanOptions) -> Result<String> {
    let world = args.devices;
    let auto = Muon::new(MuonConfig::default())?;
    let units = wrap_layers(inv.units(), args.layers_per_unit)?;
    let progress = ProgressBar::new(units.len() as u64).with_style(
        ProgressStyle::with_template("muon layout {bar:30} {pos}/{len} units [{elapsed}]")
            .expect("valid template"),
    );
    let start = Instant::now();
    let mut reports = Vec::with_capacity(units.len());
    for unit in &units {
        reports.push(auto.plan_layout(unit, world, opts)?.1);
        progress.inc(1);
    }
    let elapsed = start.elapsed();
    progress.finish_and_clear();
    let (whole_bytes, split_bytes) = muon_ends_bytes(&auto, &units, world, opts)?;
    let split_of = |r: &LayoutReport| r.tensors.iter().filter(|t| t.is_split()).count();
    let matrices: usize = reports.iter().map(|r| r.tensors.len()).sum();
    let splits: usize = reports.iter().map(split_of).sum();
    let auto_bytes: u64 = reports.iter().map(LayoutReport::cost_bytes).sum();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "
muon (Auto layout, V = {world}, plan time {:.2} s): {splits} of {matrices} matrices split; \
         {} on the wire per step (all whole {}, all split {})",
        elapsed.as_secs_f64(),
        gb(auto_bytes),
        gb(whole_bytes),
        gb(split_bytes)
    );
    let mut i = 0;
    while i < reports.len() {
        let r = &reports[i];
        let outcome = |q: &LayoutReport| (split_of(q), q.tensors.len(), q.padding, q.moved);
        let same = reports[i..]
            .iter()
            .take_while(|q| outcome(q) == outcome(r))
            .count();
        let name = run_name(&r.unit, &reports[i + same - 1].unit, same);
        let numel: usize = units[i].tensors.iter().map(|t| t.numel()).sum();
        let _ = writeln!(
            s,
            "  {name:<32} {} of {} split; padding {}%; {} elements to roots per step; {} per step",
            split_of(r),
            r.tensors.len(),
            pct(r.padding as f64 / numel.max(1) as f64),
            r.moved,
            gb(r.cost_bytes())
        );
        i += same;
    }
    Ok(s)
}

/// Bytes on the wire per step over `units` with every Muon matrix whole and with every one
/// split (`auto`'s config otherwise; each `Muon` plans a unit shape once).
fn muon_ends_bytes(
    auto: &Muon,
    units: &[Unit],
    world: usize,
    opts: &PlanOptions,
) -> Result<(u64, u64)> {
    let muon = |layout| {
        Muon::new(MuonConfig {
            layout,
            ..auto.config().clone()
        })
    };
    let (whole, split) = (muon(MatrixLayout::Whole)?, muon(MatrixLayout::Split)?);
    let (mut whole_bytes, mut split_bytes) = (0u64, 0u64);
    for unit in units {
        whole_bytes += whole.plan_layout(unit, world, opts)?.1.cost_bytes();
        split_bytes += split.plan_layout(unit, world, opts)?.1.cost_bytes();
    }
    Ok((whole_bytes, split_bytes))
}

/// The name of a run of `count` equal units from `first` to `last` (the unit's own name for a
/// run of one), escaped: unit names come from the model file.
fn run_name(first: &str, last: &str, count: usize) -> String {
    if count > 1 {
        format!("{} .. {} ({count})", printable(first), printable(last))
    } else {
        printable(first)
    }
}

/// Bytes as GB (or MB below 1 GB), two decimals.
fn gb(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else {
        format!("{:.2} MB", b / 1e6)
    }
}

fn parse_orders(s: &str) -> Result<Vec<Order>> {
    s.split(',')
        .map(|o| match o.trim() {
            "all" => Ok(Order::ALL.to_vec()),
            "module" => Ok(vec![Order::Module]),
            "block-size" => Ok(vec![Order::BlockSize]),
            "shape" => Ok(vec![Order::Shape]),
            other => Err(Error::BadInput {
                op: OP,
                what: format!("order {other:?}"),
                reason: "expected module, block-size, shape or all".into(),
            }),
        })
        .collect::<Result<Vec<_>>>()
        .map(|v| v.concat())
}

fn summary(inv: &Inventory, plan: &ModelPlan, args: &PlanArgs) -> Result<String> {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{}: {} tensors, {} parameters, {} units ({} distinct), V={}, block {}",
        printable(&inv.model),
        inv.tensors.len(),
        inv.total_params(),
        plan.units.len(),
        plan.distinct_units,
        plan.world,
        args.block
    );
    let _ = writeln!(
        s,
        "plan time {:.2} ms, coll align {}\n",
        plan.elapsed.as_secs_f64() * 1e3,
        args.coll_align
    );
    let _ = writeln!(
        s,
        "{:<14} {:>20} {:>10} {:>12}",
        "layout", "buffer elements", "padding %", "cut blocks"
    );
    let _ = writeln!(
        s,
        "{:<14} {:>20} {:>10} {:>12}",
        "ragged",
        plan.buffer_elems(),
        pct(plan.padding_frac()),
        0
    );
    let _ = writeln!(
        s,
        "{:<14} {:>20} {:>10}   (padding these blocks force on any layout)",
        "block floor",
        "",
        pct(plan.lower_bound_padding_frac()),
    );
    if !args.no_baselines {
        for layout in baseline_layouts(inv, plan.world)? {
            let cuts = baselines::cut_blocks(&layout, inv, args.block)?;
            let _ = writeln!(
                s,
                "{:<14} {:>20} {:>10} {:>12}",
                layout.baseline.to_string(),
                layout.buffer_elems,
                pct(layout.padding_frac()),
                cuts
            );
        }
    }
    let _ = writeln!(s, "\nper unit (runs of equal units merged):");
    let mut i = 0;
    while i < plan.units.len() {
        let u = &plan.units[i];
        let same = plan.units[i..]
            .iter()
            .take_while(|v| v.shard_size == u.shard_size && v.padding() == u.padding())
            .count();
        let name = run_name(&u.unit, &plan.units[i + same - 1].unit, same);
        let _ = writeln!(
            s,
            "  {name:<32} S={:<12} padding {:>8}%  order {}  checks {}",
            u.shard_size,
            pct(u.padding() as f64 / u.numel() as f64),
            u.order,
            u.stats.checks
        );
        i += same;
    }
    Ok(s)
}

fn write_plan_json(plan: &MultiModelPlan, full_units: bool, path: &PathBuf) -> Result<()> {
    if path.as_os_str() == "-" {
        // Streamed (a --full-units plan can be large); its errors read as every other print's.
        let as_print = |e: Error| match e {
            Error::Io { source, .. } => Error::io("print", "-", source),
            e => e,
        };
        let mut out = BufWriter::new(std::io::stdout().lock());
        write_multi_json(plan, full_units, &mut out).map_err(as_print)?;
        return out.flush().map_err(|e| Error::io("print", "-", e));
    }
    let file = File::create(path).map_err(|e| Error::io("create", path, e))?;
    let mut out = BufWriter::new(file);
    write_multi_json(plan, full_units, &mut out).with_context(|| path.display())?;
    out.flush()
        .map_err(|e| Error::io("write plan json", path, e))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn write_svg(plan: &MultiModelPlan, unit: Option<&str>, path: &PathBuf) -> Result<()> {
    let chosen = match unit {
        Some(name) => plan.units.iter().find(|u| u.unit == name),
        None => plan
            .units
            .iter()
            .find(|u| u.is_block())
            .or(plan.units.first()),
    };
    let chosen = chosen.ok_or_else(|| Error::BadInput {
        op: "ragged plan --svg",
        what: format!("--unit {}", unit.unwrap_or("")),
        reason: format!(
            "no such unit; the units are {}",
            plan.units
                .iter()
                .map(|u| printable(&u.unit))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })?;
    if path.as_os_str() == "-" {
        // As `--json -`: the drawing on stdout.
        return outln!("{}", svg_multi(chosen));
    }
    std::fs::write(path, svg_multi(chosen)).map_err(|e| Error::io("write svg", path, e))?;
    eprintln!(
        "wrote {} (unit {}, {} buffer(s))",
        path.display(),
        printable(&chosen.unit),
        chosen.k()
    );
    Ok(())
}
