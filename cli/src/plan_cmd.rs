//! `ragged plan`: one model, one world size, one block.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use clap::Args;
use ragged::bench::plan::{baseline_layouts, pct};
use ragged::model::Inventory;
use ragged::plan::baselines;
use ragged::plan::export::{svg, write_json};
use ragged::plan::{plan_model, ModelPlan, Order, PlanOptions};
use ragged::{AtomicBlock, Context, Error, Result};

#[derive(Args)]
pub struct PlanArgs {
    /// A preset (llama3_8b, llama3_70b, gpt_oss_20b, gpt_oss_120b, deepseek_v3_671b) or an
    /// inventory JSON file (format: models/README.md).
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
    /// Orders to try: module, block-size, shape, or all.
    #[arg(long, default_value = "all")]
    order: String,
    /// Write the full plan as JSON to this file (- for standard output).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw one unit's layout as SVG to this file.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// The unit to draw with --svg (default: the first decoder layer, else the first unit).
    #[arg(long)]
    unit: Option<String>,
    /// Skip the baseline comparison.
    #[arg(long)]
    no_baselines: bool,
}

pub fn run(args: &PlanArgs) -> Result<()> {
    // The smallest buffer a plan can have is V shards of --coll-align elements: refuse a V for
    // which even that overflows, before the planner computes with it.
    ragged::limits::checked_product(
        "ragged plan",
        "--devices × --coll-align elements",
        &[args.devices, args.coll_align],
    )?;
    let inv = Inventory::load(&args.model)?;
    let opts = PlanOptions {
        coll_align: args.coll_align,
        start_align: args.start_align,
        orders: parse_orders(&args.order)?,
    };
    let plan = plan_model(&inv, &|_| args.block, args.devices, &opts)?;
    for unit in &plan.units {
        unit.validate()?;
    }
    let quiet = matches!(&args.json, Some(p) if p.as_os_str() == "-");
    if !quiet {
        print_stdout(&summary(&inv, &plan, args)?)?;
    }
    if let Some(path) = &args.json {
        write_plan_json(&plan, path)?;
    }
    if let Some(path) = &args.svg {
        write_svg(&plan, args.unit.as_deref(), path)?;
    }
    Ok(())
}

fn parse_orders(s: &str) -> Result<Vec<Order>> {
    s.split(',')
        .map(|o| match o.trim() {
            "all" => Ok(Order::ALL.to_vec()),
            "module" => Ok(vec![Order::Module]),
            "block-size" => Ok(vec![Order::BlockSize]),
            "shape" => Ok(vec![Order::Shape]),
            other => Err(Error::BadInput {
                op: "ragged plan",
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
        inv.model,
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
        let name = if same > 1 {
            format!("{} .. {} ({same})", u.unit, plan.units[i + same - 1].unit)
        } else {
            u.unit.clone()
        };
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

fn write_plan_json(plan: &ModelPlan, path: &PathBuf) -> Result<()> {
    if path.as_os_str() == "-" {
        let stdout = std::io::stdout();
        let mut out = BufWriter::new(stdout.lock());
        write_json(plan, &mut out)?;
        return out
            .flush()
            .map_err(|e| Error::io("write plan json", "-", e));
    }
    let file = File::create(path).map_err(|e| Error::io("create", path, e))?;
    let mut out = BufWriter::new(file);
    write_json(plan, &mut out).with_context(|| path.display())?;
    out.flush()
        .map_err(|e| Error::io("write plan json", path, e))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

fn write_svg(plan: &ModelPlan, unit: Option<&str>, path: &PathBuf) -> Result<()> {
    let chosen = match unit {
        Some(name) => plan.units.iter().find(|u| u.unit == name),
        None => plan
            .units
            .iter()
            .find(|u| u.unit.starts_with("layers."))
            .or(plan.units.first()),
    };
    let chosen = chosen.ok_or_else(|| Error::BadInput {
        op: "ragged plan --svg",
        what: format!("unit {unit:?}"),
        reason: "no such unit".into(),
    })?;
    std::fs::write(path, svg(chosen)).map_err(|e| Error::io("write svg", path, e))?;
    eprintln!("wrote {} (unit {})", path.display(), chosen.unit);
    Ok(())
}

/// Writes to standard output; a closed pipe (`ragged plan … | head`) is not an error.
pub fn print_stdout(text: &str) -> Result<()> {
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::io("print", "-", e)),
        _ => Ok(()),
    }
}
