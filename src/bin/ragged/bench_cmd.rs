//! `ragged bench plan`: the planner sweep, written into `docs/benchmarks.md`.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use ragged::bench::plan::{baseline_layouts, markdown, plan_row, BLOCKS, WORLDS};
use ragged::model::Inventory;
use ragged::{AtomicBlock, Error, Result};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Plan time and padding for every model × V × block, next to each baseline layout.
    Plan(PlanBenchArgs),
    /// Thread-rank collectives against memcpy, and a training step ragged vs FSDP2-style.
    Comm(CommBenchArgs),
}

#[derive(Args)]
pub struct CommBenchArgs {
    /// World sizes for the collectives.
    #[arg(long, value_delimiter = ',', default_values_t = [2usize, 4])]
    worlds: Vec<usize>,
    /// f32 elements per rank in the collective benchmark (default 4 Mi = 16 MiB).
    #[arg(long, default_value_t = 4 << 20)]
    shard: usize,
    /// Repeats (the best is kept).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Ranks for the training-step comparison.
    #[arg(long, default_value_t = 4)]
    train_ranks: usize,
    /// Training steps per layout (the first is not timed).
    #[arg(long, default_value_t = 4)]
    train_steps: usize,
    /// Markdown file whose runtime section is replaced; - for stdout only.
    #[arg(long, default_value = "docs/benchmarks.md")]
    out: PathBuf,
}

#[derive(Args)]
pub struct PlanBenchArgs {
    /// Inventory files or presets; default: every *.json in the models/ folder.
    #[arg(long, value_delimiter = ',')]
    models: Vec<String>,
    /// World sizes.
    #[arg(long, value_delimiter = ',', default_values_t = WORLDS)]
    worlds: Vec<usize>,
    /// Blocks.
    #[arg(long, value_delimiter = ',', default_values_t = BLOCKS.map(String::from))]
    blocks: Vec<String>,
    /// Plan each point this many times and keep the fastest.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Markdown file whose planner section is replaced (created if missing); - for stdout only.
    #[arg(long, default_value = "docs/benchmarks.md")]
    out: PathBuf,
}

pub fn run(cmd: &BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Plan(args) => plan(args),
        BenchCommand::Comm(args) => comm(args),
    }
}

fn plan(args: &PlanBenchArgs) -> Result<()> {
    let models = if args.models.is_empty() {
        model_files(Path::new("models"))?
    } else {
        args.models.clone()
    };
    let blocks: Vec<AtomicBlock> = args
        .blocks
        .iter()
        .map(|b| b.parse())
        .collect::<Result<_>>()?;
    let total = (models.len() * args.worlds.len() * blocks.len()) as u64;
    let bar = ProgressBar::new(total).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} {msg} [{elapsed}]")
            .expect("valid template"),
    );
    let mut rows = Vec::new();
    for name in &models {
        let inv = Inventory::load(name)?;
        for &world in &args.worlds {
            let layouts = baseline_layouts(&inv, world)?;
            for &block in &blocks {
                bar.set_message(format!("{} V={world} {block}", inv.model));
                rows.push(plan_row(&inv, &layouts, block, world, args.repeats)?);
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    let table = markdown(&rows);
    println!("{table}");
    if args.out.as_os_str() != "-" {
        replace_section(&args.out, "plan", &section_text(&table))?;
        eprintln!("updated {}", args.out.display());
    }
    Ok(())
}

fn comm(args: &CommBenchArgs) -> Result<()> {
    use ragged::bench::comm::{collectives, markdown, train_step};
    use ragged::demo::TransformerConfig;
    use ragged::fsdp::ShardLayout;
    use ragged::optim::Sgd;

    let total = (args.worlds.len() + 2) as u64;
    let bar = ProgressBar::new(total).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} {msg} [{elapsed}]")
            .expect("valid template"),
    );
    let mut rows = Vec::new();
    for &world in &args.worlds {
        bar.set_message(format!("collectives V={world}"));
        rows.extend(collectives(world, args.shard, args.repeats)?);
        bar.inc(1);
    }
    let cfg = TransformerConfig::SMALL;
    let mut steps = Vec::new();
    for layout in [ShardLayout::Ragged, ShardLayout::Fsdp2] {
        bar.set_message(format!("training step {layout:?}"));
        let sgd = Sgd { lr: 1e-2 };
        steps.push(train_step(
            cfg,
            sgd,
            layout,
            args.train_ranks,
            args.train_steps,
            8,
        )?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let n: usize = cfg
        .param_shapes()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let model = format!(
        "demo transformer, {n} parameters, {} thread ranks, global batch 8 x {} tokens, SGD",
        args.train_ranks, cfg.seq_len
    );
    let table = markdown(&rows, &steps, &model);
    println!("{table}");
    if args.out.as_os_str() != "-" {
        let body = format!(
            "## Runtime: collectives and training step\n\n\
             Command: `cargo run --release -- bench comm`. Collectives: in-place all-gather and \
             reduce-scatter (sum) of {} f32 elements per rank on thread ranks; `bytes` is what \
             all ranks receive together, `V·(V−1)·S·4`; memcpy copies the same bytes in the same \
             run, on one thread and split over all cores (the ranks share those cores; best of \
             {}). Training step: mean wall time of steps after \
             the first; bytes copied outside collectives (copy-in / copy-out). Machine: {}.\n\n{table}",
            args.shard,
            args.repeats,
            machine()
        );
        replace_section(&args.out, "comm", &body)?;
        eprintln!("updated {}", args.out.display());
    }
    Ok(())
}

fn section_text(table: &str) -> String {
    format!(
        "## Planner: padding and plan time\n\n\
         Command: `cargo run --release -- bench plan` (default collective alignment 64 elements; \
         plan time is the best of 3 runs of the whole-model plan, identical units planned once). \
         Padding is `(V·S − N)/N` summed over FSDP units (one per decoder layer plus the root). \
         Cut blocks: atomic blocks of the given size that a baseline's rank boundaries split; \
         ragged never splits one (every plan is validated). `bound` is `V·⌈N/V⌉`. \
         Machine: {}.\n\n{table}",
        machine()
    )
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{cpu}, {threads} threads")
}

/// Every `*.json` inventory in `dir`, sorted.
fn model_files(dir: &Path) -> Result<Vec<String>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("list models", dir, e))?;
    let mut files: Vec<String> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| p.display().to_string())
        .collect();
    files.sort();
    Ok(files)
}

/// Replaces the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in `path`
/// (appending the markers if absent), so each benchmark owns one section of the file.
pub fn replace_section(path: &Path, name: &str, body: &str) -> Result<()> {
    let (open, close) = (
        format!("<!-- bench:{name} -->"),
        format!("<!-- /bench:{name} -->"),
    );
    let old = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "# Benchmarks\n".to_string(),
        Err(e) => return Err(Error::io("read", path, e)),
    };
    let block = format!("{open}\n{body}\n{close}");
    let new = match (old.find(&open), old.find(&close)) {
        (Some(a), Some(b)) if a < b => format!("{}{block}{}", &old[..a], &old[b + close.len()..]),
        _ => format!("{}\n{block}\n", old.trim_end()),
    };
    std::fs::write(path, new).map_err(|e| Error::io("write", path, e))
}
