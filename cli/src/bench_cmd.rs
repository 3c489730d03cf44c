//! `ragged bench plan|comm|optim|train|checkpoint`: benchmark sweeps, each written into its own
//! section of `docs/benchmarks.md` (`--out -`: the table on stdout only).

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use ragged::bench::plan::{baseline_layouts, markdown, plan_row};
use ragged::limits::{
    at_least, at_most, checked_product, even_share, fits_in_memory, folder_of, read_regular,
};
use ragged::model::Inventory;
use ragged::plan::baselines::BaselineLayout;
use ragged::{AtomicBlock, Context, Error, Result};
use ragged_optimizers::bench::OptimKind;

use crate::flags::finite_within;
use crate::print::printable;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Plan time and padding for every model × V × block, next to each baseline layout.
    Plan(PlanBenchArgs),
    /// Thread-rank collectives against memcpy, and a training step ragged vs FSDP2-style.
    Comm(CommBenchArgs),
    /// Optimizer steps (AdamW, 8-bit Adam, Muon f32 / bf16, Shampoo) against the machine
    /// peak, memcpy and GEMM.
    Optim(OptimBenchArgs),
    /// A training step of an MLP stack unit by unit: plain candle, ragged and FSDP2-style
    /// layouts on thread ranks, with phases, bytes copied and peak memory per rank.
    Train(TrainBenchArgs),
    /// A sharded save and load (AdamW state) against the disk's sequential write and read,
    /// with the heap each rank adds meanwhile.
    Checkpoint(CheckpointBenchArgs),
}

impl BenchCommand {
    /// Where the bench writes its table, and the name of its section there.
    fn output(&self) -> (&Output, &'static str) {
        match self {
            BenchCommand::Plan(args) => (&args.output, "plan"),
            BenchCommand::Comm(args) => (&args.output, "comm"),
            BenchCommand::Optim(args) => (&args.output, args.section()),
            BenchCommand::Train(args) => (&args.output, args.section()),
            BenchCommand::Checkpoint(args) => (&args.output, "checkpoint"),
        }
    }
}

/// The largest `--out` file read: a benchmarks file is kilobytes, and a larger one is not the
/// markdown the benches write (it must not fill memory before it is refused).
const MAX_MARKDOWN_BYTES: u64 = 64 << 20;

const OP_OUT: &str = "ragged bench --out";

/// Where a bench writes its table besides stdout: its own section of a markdown file.
#[derive(Args)]
pub struct Output {
    /// Markdown file whose section for this bench is replaced (the file is created if
    /// missing); `-`: the table on stdout only.
    #[arg(long, default_value = "docs/benchmarks.md")]
    out: PathBuf,
    /// Print the table only and leave the markdown file alone (the same as `--out -`).
    #[arg(long)]
    no_write: bool,
}

impl Output {
    /// The markdown file to update; `None` for the table on stdout only.
    fn file(&self) -> Option<&Path> {
        let stdout_only = self.no_write || self.out.as_os_str() == "-";
        (!stdout_only).then_some(self.out.as_path())
    }

    /// Replaces section `name` of the file with `body()` (saying so on stderr), then prints
    /// `table` on stdout. The file first: a reader that stops early (`ragged bench … | head`)
    /// ends this process by SIGPIPE while it prints, and the measurement must be saved by then.
    fn finish(&self, name: &str, table: &str, body: impl FnOnce() -> String) -> Result<()> {
        if let Some(path) = self.file() {
            replace_section(path, name, &body())?;
            eprintln!("updated {}", path.display());
        }
        outln!("{table}")
    }

    /// Before a bench runs (minutes, some of them): the file is a regular file (or new), reads
    /// as the update will read it, has section `name`'s markers in order if at all, is not
    /// read-only, and its folder takes a new file, so that a table is not lost at the end to a
    /// path that cannot be written (the default is relative to the working folder).
    fn check(&self, name: &str) -> Result<()> {
        let Some(path) = self.file() else {
            return Ok(());
        };
        let refuse = |reason: String| Error::BadInput {
            op: "ragged bench",
            what: format!("--out {}", path.display()),
            reason,
        };
        let dir = folder_of(path);
        if !dir.is_dir() {
            return Err(refuse(format!(
                "the folder {} does not exist (the default, docs/benchmarks.md, is relative to \
                 the working folder: run from the repository's root, or give --out FILE, or \
                 --out - for the table on stdout only)",
                dir.display()
            )));
        }
        // Links followed: a device (`/dev/full`, `/dev/zero`) would be read without end, a FIFO
        // would block.
        let meta = std::fs::metadata(path).ok();
        if meta.as_ref().is_some_and(|m| !m.is_file()) {
            return Err(refuse(
                "is not a regular file (a folder, FIFO or device): give a markdown file, or \
                 --out - for the table on stdout only"
                    .into(),
            ));
        }
        section_span(&read_or_new(path)?, name).map_err(refuse)?;
        if meta.is_some_and(|m| m.permissions().readonly()) {
            return Err(refuse("the file is read-only".into()));
        }
        let probe = temporary_beside(path);
        std::fs::write(&probe, b"").map_err(|e| Error::io("write", &probe, e))?;
        std::fs::remove_file(&probe).map_err(|e| Error::io("remove", &probe, e))
    }
}

/// A temporary file beside `path`, named for it and this process.
fn temporary_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or("out".into(), |n| n.to_string_lossy());
    folder_of(path).join(format!(".{name}.tmp-{}", std::process::id()))
}

/// The markdown file's text, or a new file's heading where there is none yet; `Err` for
/// anything but a regular file of UTF-8 text.
fn read_or_new(path: &Path) -> Result<String> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok("# Benchmarks\n".to_string())
        }
        Err(e) => return Err(Error::io("read", path, e)),
        Ok(_) => {}
    }
    let bytes = read_regular(OP_OUT, path, MAX_MARKDOWN_BYTES)?;
    String::from_utf8(bytes).map_err(|e| Error::BadInput {
        op: OP_OUT,
        what: path.display().to_string(),
        reason: format!("not UTF-8 text: {e}"),
    })
}

/// The opening and closing markers of section `name`.
fn markers(name: &str) -> (String, String) {
    (
        format!("<!-- bench:{name} -->"),
        format!("<!-- /bench:{name} -->"),
    )
}

/// Where section `name` lies in `text`: from its opening marker's start to its closing
/// marker's end; `None` where neither marker is there (the section is then appended). `Err`
/// (the reason, naming the marker) unless there is one of each, opening first: replacing
/// would otherwise append another section on every run, or swallow the text between stray
/// markers.
fn section_span(text: &str, name: &str) -> std::result::Result<Option<(usize, usize)>, String> {
    let (open, close) = markers(name);
    let fix = "leave one of each, the opening one first, or remove both";
    for marker in [&open, &close] {
        let n = text.matches(marker.as_str()).count();
        if n > 1 {
            return Err(format!("the marker {marker} appears {n} times: {fix}"));
        }
    }
    match (text.find(&open), text.find(&close)) {
        (None, None) => Ok(None),
        (Some(a), Some(b)) if a < b => Ok(Some((a, b + close.len()))),
        (Some(_), Some(_)) => Err(format!("the marker {close} comes before {open}: {fix}")),
        (Some(_), None) => Err(format!("the marker {open} has no {close}: {fix}")),
        (None, Some(_)) => Err(format!("the marker {close} has no {open}: {fix}")),
    }
}

#[derive(Args)]
pub struct CheckpointBenchArgs {
    /// World sizes (thread ranks).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    worlds: Vec<usize>,
    /// Blocks of the MLP stack saved.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Width of the stack (in and out of every block).
    #[arg(long, default_value_t = 1024)]
    width: usize,
    /// Hidden width of every block.
    #[arg(long, default_value_t = 4096)]
    hidden: usize,
    /// Scratch folder on the disk to measure: new or empty (nothing else in it is touched);
    /// default a fresh folder under the system's temporary folder (what an interrupted run
    /// left in its own is removed by the next run).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Measurements per world size (rates are medians); at most 10000.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[command(flatten)]
    output: Output,
}

#[derive(Args)]
pub struct TrainBenchArgs {
    /// World sizes (thread ranks).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    worlds: Vec<usize>,
    /// Blocks of the stack.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Width of the stack (in and out of every block).
    #[arg(long, default_value_t = 1024)]
    width: usize,
    /// Hidden width of every block.
    #[arg(long, default_value_t = 4096)]
    hidden: usize,
    /// Global batch rows.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Timed steps per variant (after one warm-up step).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Run only the runtime variants whose name contains this (plain candle always runs).
    #[arg(long)]
    only: Option<String>,
    /// Instead: world 1 only, each ragged variant's steps interleaved with plain candle's
    /// (ratios of neighbouring steps, robust to load that comes and goes); section
    /// `train-paired`.
    #[arg(long, conflicts_with = "worlds")]
    paired: bool,
    /// Where the model and the sharded state live: this machine's cores, or GPU 0 (a build
    /// with `--features candle-cuda`; section `train-cuda`, with MFU against a same-run GEMM).
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    #[command(flatten)]
    output: Output,
}

impl TrainBenchArgs {
    /// The world sizes that run: `--paired` runs world 1 only.
    fn worlds(&self) -> Vec<usize> {
        if self.paired {
            vec![1]
        } else {
            self.worlds.clone()
        }
    }

    /// The section of the markdown file the table goes to.
    fn section(&self) -> &'static str {
        match (self.paired, self.device) {
            (true, _) => "train-paired",
            (false, DeviceKind::Cuda) => "train-cuda",
            (false, DeviceKind::Cpu) => "train",
        }
    }
}

/// Where `bench optim` and `bench train` run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    /// This machine's cores.
    Cpu,
    /// GPU 0: `bench optim` needs a build with `--features cuda`, `bench train` one with
    /// `--features candle-cuda` (candle's own CUDA kernels).
    Cuda,
}

#[derive(Args)]
pub struct OptimBenchArgs {
    /// Where the steps run.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// Add the 4096×4096 point to the square sweep.
    #[arg(long)]
    full: bool,
    /// Timed steps per case (best and median are reported; slow cases run fewer); at most
    /// 10000.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Run one optimizer only: adamw, adam8bit, muon, muon-bf16 or shampoo.
    #[arg(long)]
    only: Option<OptimKind>,
    /// Clock in GHz for the peak (default: measured by an FMA loop on every core); 0.1 to 100
    /// (a value outside is a unit mistake, and would print an MFU far from any real one).
    // Negative numbers reach the check, which says why they are refused.
    #[arg(long, allow_negative_numbers = true)]
    ghz: Option<f64>,
    /// Tiny shapes and buffers (for tests).
    #[arg(long, hide = true)]
    quick: bool,
    #[command(flatten)]
    output: Output,
}

impl OptimBenchArgs {
    /// The section of the markdown file the table goes to.
    fn section(&self) -> &'static str {
        match self.device {
            DeviceKind::Cpu => "optim",
            DeviceKind::Cuda => "optim-cuda",
        }
    }
}

#[derive(Args)]
pub struct CommBenchArgs {
    /// World sizes for the collectives.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    worlds: Vec<usize>,
    /// f32 elements per rank in the collective benchmark (default 4 Mi = 16 MiB).
    #[arg(long, default_value_t = 4 << 20)]
    shard: usize,
    /// Repeats (the best is kept); at most 10000.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Ranks for the training-step comparison.
    #[arg(long, default_value_t = 4)]
    train_ranks: usize,
    /// Training steps per layout (the first is not timed); 0 skips the training comparison.
    #[arg(long, default_value_t = 4)]
    train_steps: usize,
    #[command(flatten)]
    output: Output,
}

#[derive(Args)]
pub struct PlanBenchArgs {
    /// Inventory files or presets; default: every *.json in ./models, or, where the working
    /// directory has none, in the models/ folder of the source tree this binary was built from.
    #[arg(long, value_delimiter = ',')]
    models: Vec<String>,
    /// World sizes.
    // Written out (clap shows `default_values_t` space-separated, which the flag refuses); a
    // test checks it is `WORLDS`.
    #[arg(long, value_delimiter = ',', default_value = "8,64,256,1024,4096")]
    worlds: Vec<usize>,
    /// Blocks.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "elem,rows:1,rows:16,rows:128,tile:32x32"
    )]
    blocks: Vec<String>,
    /// Plan each point this many times and keep the fastest; at most 10000.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[command(flatten)]
    output: Output,
}

pub fn run(cmd: &BenchCommand) -> Result<()> {
    check(cmd)?;
    let (output, section) = cmd.output();
    output.check(section)?;
    match cmd {
        BenchCommand::Plan(args) => plan(args),
        BenchCommand::Comm(args) => comm(args),
        BenchCommand::Optim(args) => optim(args),
        BenchCommand::Train(args) => train(args),
        BenchCommand::Checkpoint(args) => checkpoint(args),
    }
}

fn checkpoint(args: &CheckpointBenchArgs) -> Result<()> {
    use ragged::bench::checkpoint::{
        default_scratch, markdown, remove_abandoned_scratch, run, CheckpointBench,
    };
    use ragged::demo::MlpConfig;
    for dir in remove_abandoned_scratch() {
        eprintln!("removed {}, left by an interrupted bench", dir.display());
    }
    let dir = args.dir.clone().unwrap_or_else(default_scratch);
    let cfg = CheckpointBench {
        model: MlpConfig {
            width: args.width,
            hidden: args.hidden,
            layers: args.layers,
        },
        worlds: args.worlds.clone(),
        dir: dir.clone(),
        repeats: args.repeats,
    };
    let adamw = ragged_optimizers::AdamW::new(ragged_optimizers::AdamWConfig::default())?;
    let steps = (args.repeats * args.worlds.len()) as u64;
    let rows = with_progress(steps, |step| run(&cfg, adamw, step))?;
    let table = markdown(&rows);
    args.output.finish("checkpoint", &table, || {
        let n = args.layers * 2 * args.width * args.hidden;
        format!(
            "## Checkpoints: save and load against the disk\n\n\
             Command: `target/release/ragged bench checkpoint`. Model: {} blocks \
             of Linear({w}→{h}) and back ({n} parameters) with AdamW state (one step taken), \
             on V thread ranks writing their rank files in parallel into `{}`. Disk \
             baseline: one file of the checkpoint's size written sequentially in 8 MiB blocks \
             and fsynced, then read back, in the same run. Every file is dropped from the page \
             cache (`posix_fadvise(DONTNEED)`) before it is read, baseline and checkpoint \
             alike. Save and load times are between barriers on rank 0 and include the \
             XXH3-128 checksum of every 4 MiB chunk (computed while writing, verified while reading), \
             the manifest and the rename. Rates are medians of {} runs. Extra MiB/rank: heap peak above what was alive \
             before, all ranks together over V (counting allocator). Machine: {}.\n\n{table}",
            args.layers,
            dir.display(),
            args.repeats,
            machine(),
            w = args.width,
            h = args.hidden,
        )
    })
}

/// glibc gives large freed blocks back to the kernel and faults in fresh zeroed pages on the
/// next allocation. A training step frees and reallocates every unit's gradients (and, unit by
/// unit, its gathered parameters), so without this both plain candle and ragged spend a large
/// share of a step in page faults; with it, freed memory stays in the heap for the next unit
/// (what PyTorch's caching allocator does for FSDP). Returns whether glibc took the settings.
fn keep_freed_memory_in_the_heap() -> bool {
    // The largest mmap threshold glibc accepts (32 MiB on 64-bit), no trimming, and a heap that
    // grows in 64 MiB steps.
    let settings = [
        (libc::M_MMAP_THRESHOLD, 32 << 20),
        (libc::M_TRIM_THRESHOLD, i32::MAX),
        (libc::M_TOP_PAD, 64 << 20),
    ];
    settings.iter().all(|&(param, value)| {
        // SAFETY: mallopt only changes allocator parameters; called before the benchmark
        // allocates, from the main thread.
        unsafe { libc::mallopt(param, value) == 1 }
    })
}

fn train(args: &TrainBenchArgs) -> Result<()> {
    use ragged::bench::train::{markdown, run, TrainBench};
    let heap = keep_freed_memory_in_the_heap();
    use ragged::demo::MlpConfig;
    let cfg = TrainBench {
        model: MlpConfig {
            width: args.width,
            hidden: args.hidden,
            layers: args.layers,
        },
        batch: args.batch,
        worlds: args.worlds(),
        steps: args.steps,
        only: args.only.clone(),
        device: match args.device {
            DeviceKind::Cpu => ragged::bench::train::cpu_device(),
            DeviceKind::Cuda => ragged::bench::train::cuda_device(0)?,
        },
    };
    if args.paired {
        return train_paired(args, &cfg, heap);
    }
    let steps = 1 + (ragged::bench::train::variants().len() * args.worlds.len()) as u64;
    let rows = with_progress(steps, |step| run(&cfg, step))?;
    let table = markdown(&rows);
    if args.device == DeviceKind::Cuda {
        return write_train_cuda(args, &table);
    }
    args.output.finish(args.section(), &table, || {
        let n = args.layers * 2 * args.width * args.hidden;
        format!(
            "## Runtime: a training step unit by unit\n\n\
             Command: `target/release/ragged bench train`. Model: {} blocks of \
             Linear({w}→{h}), GELU, Linear({h}→{w}), no bias ({n} parameters, {} MiB f32), \
             global batch {} rows, MSE loss, SGD (the step measures the runtime; `bench optim` \
             the optimizers). Plain candle: one variable per parameter, candle-nn SGD. \
             Sharded: thread ranks, the unit-by-unit runtime (one unit per block). `reshard, keep \
             graph` (the default, FSDP2's rhythm): each unit's parameter storages freed after its \
             forward while the stage's graph is kept, re-gathered into the same tensors before \
             its backward; `recompute`: each stage run forward without a graph, its unit freed, \
             re-gathered and the stage recomputed in backward; `keep units`: gathered from \
             forward to backward, graphs kept; every variant but `no overlap` runs collectives \
             on a second thread while a stage computes (the next unit's gather, the previous \
             unit's reduce-scatter; `FsdpOptions::overlap`). Means of {} steps after a warm-up; \
             times on rank 0; gather s and reduce s = time the step waited for them (what ran \
             behind compute does not count), sharding % = (gather + reduce) / step; \
             peer wait s (rows without overlap, where every collective runs on the step's own \
             thread) = of that, the time rank 0 waited at the collectives' rendezvous for \
             slower ranks (load imbalance: V ranks share this machine's cores, so they reach \
             a collective at different times), and sharding % less peer wait = the rest (the \
             transfers) over the step. Memory per \
             rank: predicted = master and gradient shards plus the largest set of full \
             parameters and gradients the schedule holds at once (from the plans) plus the \
             activations alive then (saved stage inputs and kept or recomputed graphs, as \
             measured on the warm-up step by walking each stage's graph) and candle's gradient \
             temporaries in backward (5 × the unit's largest parameter, a measured figure); measured = process \
             heap peak above the bytes alive before, by a counting allocator, over V. glibc's \
             trim threshold raised so freed buffers are reused instead of faulted in again, for \
             both \
             sides ({}). Machine: {}.\n\n{table}",
            args.layers,
            (n * 4) >> 20,
            args.batch,
            args.steps,
            if heap { "set" } else { "mallopt refused it" },
            machine(),
            w = args.width,
            h = args.hidden,
        )
    })
}

/// `bench train --device cuda`: the GPU table into section `train-cuda`.
fn write_train_cuda(args: &TrainBenchArgs, table: &str) -> Result<()> {
    args.output.finish(args.section(), table, || {
        format!(
            "## Runtime on the GPU: a training step unit by unit\n\n\
             Command: `ragged bench train --device cuda` (a `--features candle-cuda` build). The \
             model and rows of `bench train`, on candle's CUDA tensors; sharded rows on thread \
             ranks whose collectives run on the GPU, on candle's stream; every step ends with a \
             device synchronization. Predicted MiB/rank: device memory from the plans; no \
             measured column (the counting allocator sees host memory only). MFU: 6 FLOPs per \
             weight and row per step over the step time, against a 4096³ f32 matmul measured in \
             the same run. At V = 1 the overlap variants run without their collectives thread \
             (`ShardedModel::overlaps`: a world of one's collectives are queued on the rank's own \
             stream), so they time the same schedule as `no overlap`. {} steps after a \
             warm-up.\n\n{table}",
            args.steps
        )
    })
}

/// `bench train --paired`: world-1 ratios with interleaved steps.
fn train_paired(
    args: &TrainBenchArgs,
    cfg: &ragged::bench::train::TrainBench,
    heap: bool,
) -> Result<()> {
    use ragged::bench::train::{paired, paired_markdown, variants};
    let rows = with_progress(variants().len() as u64, |step| paired(cfg, step))?;
    let table = paired_markdown(&rows);
    args.output.finish(args.section(), &table, || {
        format!(
            "### World 1, steps interleaved with plain candle\n\n\
             Command: `target/release/ragged bench train --paired --steps {}`. Same model and \
             batch; plain candle and the variant alive at once, their steps alternating ({} \
             pairs after a warm-up pair); each ratio is a variant step over the plain step just \
             before it, so load that comes and goes on this shared machine weighs on both \
             alike. glibc trim threshold {}. Machine: {}.\n\n{table}",
            args.steps,
            args.steps,
            if heap {
                "raised"
            } else {
                "not raised (mallopt refused)"
            },
            machine(),
        )
    })
}

/// The progress bar of a benchmark sweep of `len` points.
fn sweep_bar(len: u64) -> ProgressBar {
    let style = ProgressStyle::with_template("{bar:40} {pos}/{len} {msg} [{elapsed}]");
    ProgressBar::new(len).with_style(style.expect("valid template"))
}

/// Runs a sweep of `len` steps under a progress bar: `sweep` gets the callback that names each
/// step as it starts. The bar is cleared however the sweep ends.
fn with_progress<T>(len: u64, sweep: impl FnOnce(&mut dyn FnMut(&str)) -> Result<T>) -> Result<T> {
    let bar = sweep_bar(len);
    let out = sweep(&mut |what: &str| {
        bar.set_message(what.to_string());
        bar.inc(1);
    });
    bar.finish_and_clear();
    out
}

const OP_OPTIM: &str = "ragged bench optim";

/// Refuses a benchmark's bad flags before anything runs or allocates (also what the CLI fuzz
/// test runs on every parsed `bench` command).
pub fn check(cmd: &BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Plan(args) => check_plan(args),
        BenchCommand::Comm(args) => check_comm(args),
        BenchCommand::Optim(args) => check_optim(args),
        BenchCommand::Train(args) => check_train(args),
        BenchCommand::Checkpoint(args) => check_checkpoint(args),
    }
}

/// `Err` unless an MLP stack benchmark has at least one world, every world and size ≥ 1.
fn check_stack(op: &'static str, worlds: &[usize], sizes: [usize; 3]) -> Result<()> {
    at_least(op, "--worlds (how many)", worlds.len(), 1)?;
    for (flag, n) in ["--layers", "--width", "--hidden"].into_iter().zip(sizes) {
        at_least(op, flag, n, 1)?;
    }
    worlds
        .iter()
        .try_for_each(|&world| at_least(op, "--worlds", world, 1).map(drop))
}

fn check_checkpoint(args: &CheckpointBenchArgs) -> Result<()> {
    const OP: &str = "ragged bench checkpoint";
    check_repeats(OP, "--repeats", args.repeats)?;
    check_stack(OP, &args.worlds, [args.layers, args.width, args.hidden])?;
    // The model's initial values, master, gradient and two AdamW moments, f32.
    let bytes = checked_product(
        OP,
        "--layers × --width × --hidden",
        &[2, args.layers, args.width, args.hidden, 4, 5],
    )?;
    fits_in_memory(OP, "the model and its state", bytes).map(drop)
}

fn check_train(args: &TrainBenchArgs) -> Result<()> {
    const OP: &str = "ragged bench train";
    at_least(OP, "--steps", args.steps, 1)?;
    at_least(OP, "--batch", args.batch, 1)?;
    // Only the worlds that run: `--paired` runs world 1, whatever `--worlds`' default.
    let worlds = args.worlds();
    check_stack(OP, &worlds, [args.layers, args.width, args.hidden])?;
    for &world in &worlds {
        even_share(OP, "--batch", args.batch, world)?;
    }
    // Parameters, master and gradient shards, and a unit's full buffers, f32, on every rank.
    let params = checked_product(
        OP,
        "--layers × --width × --hidden",
        &[2, args.layers, args.width, args.hidden, 4],
    )?;
    let ranks: usize = worlds.iter().copied().max().unwrap_or(1);
    fits_in_memory(
        OP,
        "the model on every rank",
        checked_product(OP, "the model on every rank", &[params, 3, ranks])?,
    )?;
    Ok(())
}

fn check_optim(args: &OptimBenchArgs) -> Result<()> {
    if let Some(ghz) = args.ghz {
        finite_within(OP_OPTIM, "--ghz", ghz, GHZ_RANGE, "GHz")?;
    }
    // The baselines time `reps` GEMMs and copies each, uncapped by the per-case time limit.
    check_repeats(OP_OPTIM, "--reps", args.reps)
}

/// The clocks `--ghz` takes: far around any CPU's, narrow enough to catch MHz typed as GHz
/// (or GHz as THz): the peak and MFU scale with it.
const GHZ_RANGE: (f64, f64) = (0.1, 100.0);

/// The most timed repetitions a bench runs per case (`--reps`, `--repeats`): more is a typo
/// that would run for days, silently.
const MAX_REPEATS: usize = 10_000;

/// `Err` unless `n` timed repetitions are 1 to [`MAX_REPEATS`].
fn check_repeats(op: &'static str, flag: &str, n: usize) -> Result<()> {
    at_least(op, flag, n, 1)?;
    at_most(op, flag, n, MAX_REPEATS, "each is a timed run").map(drop)
}

fn check_comm(args: &CommBenchArgs) -> Result<()> {
    use ragged::bench::comm::check_collectives;
    at_least(OP_COMM, "--worlds (how many)", args.worlds.len(), 1)?;
    check_repeats(OP_COMM, "--repeats", args.repeats)?;
    for &world in &args.worlds {
        check_collectives(world, args.shard, args.repeats)?;
    }
    if args.train_steps > 0 {
        at_least(OP_COMM, "--train-ranks", args.train_ranks, 1)?;
        // Checked before the collectives run, not after.
        even_share(
            OP_COMM,
            "--train-ranks' global batch of",
            TRAIN_BATCH,
            args.train_ranks,
        )?;
    }
    Ok(())
}

/// The global batch of `bench comm`'s training step (rows; the ranks must split it evenly).
const TRAIN_BATCH: usize = 8;

fn check_plan(args: &PlanBenchArgs) -> Result<()> {
    check_repeats(OP_PLAN, "--repeats", args.repeats)?;
    for &world in &args.worlds {
        at_least(OP_PLAN, "--worlds", world, 1)?;
    }
    parse_blocks(&args.blocks).map(drop)
}

/// `--blocks`' specs, each refused with the flag and the spec typed.
fn parse_blocks(specs: &[String]) -> Result<Vec<AtomicBlock>> {
    specs
        .iter()
        .map(|b| {
            b.parse()
                .with_context(|| format!("{OP_PLAN} --blocks {b:?}"))
        })
        .collect()
}

const OP_COMM: &str = "ragged bench comm";
const OP_PLAN: &str = "ragged bench plan";

fn optim(args: &OptimBenchArgs) -> Result<()> {
    if args.device == DeviceKind::Cuda {
        return optim_cuda(args);
    }
    use ragged_optimizers::bench::{baselines, markdown, run_case, BenchConfig, Peak, Report};

    let cfg = BenchConfig {
        full: args.full,
        quick: args.quick,
        reps: args.reps,
        only: args.only,
        ghz: args.ghz,
    };
    let peak = Peak::detect(cfg.ghz)?;
    eprintln!("peak: {}", peak.derivation());
    let base = baselines(cfg.memcpy_bytes(), cfg.gemm_n(), cfg.reps);
    eprintln!(
        "baselines: memcpy {:.1} GB/s (1 thread), {:.1} GB/s ({} threads); GEMM {n}³ {:.1} GFLOP/s",
        base.memcpy_1t_gbps,
        base.memcpy_all_gbps,
        base.threads,
        base.gemm_best_gflops,
        n = base.gemm_n
    );
    let cases = cfg.cases();
    let mut rows = Vec::with_capacity(cases.len());
    for (k, (kind, set)) in cases.iter().enumerate() {
        let row = run_case(*kind, set, cfg.reps, cfg.memcpy_bytes())?;
        eprintln!(
            "[{}/{}] {kind} {}: best {:.3} ms, median {:.3} ms, {:.1} GFLOP/s, {:.1} GB/s",
            k + 1,
            cases.len(),
            set.name,
            1e3 * row.timing.best,
            1e3 * row.timing.median,
            row.gflops(),
            row.gbps()
        );
        rows.push(row);
    }
    let table = markdown(&Report {
        peak,
        baselines: base,
        rows,
    });
    args.output.finish(args.section(), &table, || {
        format!(
            "## Optimizers: step time against peak, memcpy and GEMM\n\n\
             Command: `target/release/ragged bench optim`{}. Each case is one \
             `Optimizer::step` on a one-rank shard holding the whole shape set (default \
             hyperparameters; best and median of the timed steps after one untimed step; `reps` 0: \
             the first step took over 20 s and is the only sample). \
             FLOPs: the optimizer's formula per element; Newton–Schulz `2·s²·l + 2·s³ + 2·s²·l` \
             per iteration (`s` short side, `l` long side) plus element operations. Bytes: \
             compulsory traffic (params and state read and written, grads read; scratch not \
             counted); memcpy GB/s counts read + write bytes too, and `vs memcpy` is against \
             the all-threads copy. MFU against the peak of the row's dtype (below); `vs GEMM` \
             against the same-run GEMM of the row's precision (bf16 Newton–Schulz on oneDNN: \
             oneDNN's bf16 matmul; otherwise the f32 GEMM); the interleaved column times, right \
             after every timed step, a GEMM of the matrices' longest side (256 to 2048) in the \
             same precision for Muon (named in the cell), or the \
             baseline's memcpy (on rayon's threads) for AdamW and 8-bit Adam, and gives the median, \
             range and count of the per-step ratios (GFLOP/s to the GEMM's, GB/s to the copy's), \
             which the machine's load moves far less than the ratios to the baselines measured \
             once at the start; the copy evicts the caches, so those steps start from memory, \
             as they do in training. 8-bit Adam on a CPU \
             with its AVX-512 build also steps the same case on the AVX2 build, alternating step \
             by step, and the kernel column gives that build's times and the speed-up. \
             Newton–Schulz FLOPs are nominal: the gemm backend computes the symmetric \
             products `X·Xᵀ` and `P·P` as half-products (recursive halves down to 128-wide \
             blocks on AVX2, 256-wide elsewhere: the kernel column names the leaf), 69–75 % of \
             the nominal work at 1024–2048, so its MFU can exceed what a \
             plain GEMM reaches. \
             Machine: {}.\n\n{table}",
            if args.full { " --full" } else { "" },
            machine()
        )
    })
}

/// `bench optim --device cuda`: the GPU table (`ragged_optimizers::cuda::bench`) into the
/// `optim-cuda` section.
#[cfg(feature = "cuda")]
fn optim_cuda(args: &OptimBenchArgs) -> Result<()> {
    let dev = std::sync::Arc::new(ragged::cuda::Device::open(0)?);
    eprintln!("device: {}", dev.name()?);
    let report = ragged_optimizers::cuda::bench::bench_gpu(&dev, args.quick)?;
    let table = report.markdown();
    args.output.finish(args.section(), &table, || {
        format!(
            "## Optimizers on the GPU: against cuBLAS GEMM and device memcpy\n\n\
             Command: `ragged bench optim --device cuda` (a `--features cuda` build; \
             `scripts/gpu-check.sh` runs it). Newton–Schulz: TFLOP/s of `steps · 3` GEMMs of \
             `2n³` against one plain cuBLAS GEMM of the same precision on random data (the \
             Newton–Schulz workspace kept between calls, as Muon's step keeps it); AdamW \
             (28 B per element) and 8-bit Adam (16 B per element, 28 B on its f32 fallback) \
             GB/s, on one matrix and on a Llama-3-8B decoder layer (seven matrices, two norms), \
             against a device-to-device memcpy counting read + write bytes; Shampoo: TFLOP/s \
             of the four `f64`-lane products of each `d × d` block (`8d³`) in a step whose \
             roots are not due, against one cuBLAS f32 GEMM `d³`. Mean of the timed runs \
             after one warm-up, the device synchronized around each timing.\n\n{table}"
        )
    })
}

#[cfg(not(feature = "cuda"))]
fn optim_cuda(_: &OptimBenchArgs) -> Result<()> {
    Err(Error::CudaUnavailable {
        op: "ragged bench optim --device cuda",
        reason: "this ragged binary was built without the `cuda` feature \
                 (cargo build --release -p ragged-cli --features cuda)"
            .into(),
    })
}

fn plan(args: &PlanBenchArgs) -> Result<()> {
    let models = if args.models.is_empty() {
        model_files(&default_models_dir())?
    } else {
        args.models.clone()
    };
    let blocks = parse_blocks(&args.blocks)?;
    let sweep = plan_sweep(&models, &args.worlds)?;
    let total = (models.len() * args.worlds.len() * blocks.len()) as u64;
    let bar = sweep_bar(total);
    let mut rows = Vec::new();
    for (inv, points) in &sweep {
        for (world, layouts) in points {
            let world = *world;
            for &block in &blocks {
                bar.set_message(format!("{} V={world} {block}", printable(&inv.model)));
                let row = plan_row(inv, layouts, block, world, args.repeats)
                    .with_context(|| format!("{OP_PLAN} --worlds {world} --blocks {block}"))?;
                rows.push(row);
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    let table = markdown(&rows);
    args.output
        .finish("plan", &table, || section_text(&table, args.repeats))
}

/// Every model's inventory with each world's baseline layouts: read and laid out before the
/// sweep (milliseconds each), so that a model or world the sweep cannot take is refused,
/// naming it, before minutes of planning.
type PlanSweep = Vec<(Inventory, Vec<(usize, Vec<BaselineLayout>)>)>;

fn plan_sweep(models: &[String], worlds: &[usize]) -> Result<PlanSweep> {
    models
        .iter()
        .map(|name| {
            let inv = Inventory::load(name)?;
            let points = worlds
                .iter()
                .map(|&world| {
                    let layouts = baseline_layouts(&inv, world)
                        .with_context(|| format!("{OP_PLAN} --worlds {world} with model {name}"))?;
                    Ok((world, layouts))
                })
                .collect::<Result<Vec<_>>>()?;
            Ok((inv, points))
        })
        .collect()
}

fn comm(args: &CommBenchArgs) -> Result<()> {
    use ragged::bench::comm::{collectives, markdown, train_step};
    use ragged::demo::TransformerConfig;
    use ragged::fsdp::ShardLayout;
    use ragged::optim::Sgd;

    // `check` has refused bad flags before the first measurement.
    let layouts: &[ShardLayout] = if args.train_steps == 0 {
        &[]
    } else {
        &[ShardLayout::Ragged, ShardLayout::Fsdp2]
    };
    let total = (args.worlds.len() + layouts.len()) as u64;
    let bar = sweep_bar(total);
    let mut rows = Vec::new();
    for &world in &args.worlds {
        bar.set_message(format!("collectives V={world}"));
        rows.extend(collectives(world, args.shard, args.repeats)?);
        bar.inc(1);
    }
    let cfg = TransformerConfig::SMALL;
    let mut steps = Vec::new();
    for &layout in layouts {
        bar.set_message(format!("training step {layout:?}"));
        let sgd = Sgd { lr: 1e-2 };
        steps.push(train_step(
            cfg,
            sgd,
            layout,
            args.train_ranks,
            args.train_steps,
            TRAIN_BATCH,
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
        "demo transformer, {n} parameters, {} thread ranks, global batch {TRAIN_BATCH} x {} \
         tokens, SGD",
        args.train_ranks, cfg.seq_len
    );
    let table = markdown(&rows, &steps, &model);
    args.output.finish("comm", &table, || {
        format!(
            "## Runtime: collectives and training step\n\n\
             Command: `target/release/ragged bench comm`. Collectives: in-place all-gather and \
             reduce-scatter (sum) of {} f32 elements per rank on thread ranks; `bytes` is what \
             all ranks receive together, `V·(V−1)·S·4`; memcpy copies the same bytes in the same \
             run, on one thread and split over all cores (the ranks share those cores; best of \
             {}). Training step: mean wall time of steps after \
             the first; bytes copied outside collectives (copy-in / copy-out). Machine: {}.\n\n{table}",
            args.shard,
            args.repeats,
            machine()
        )
    })
}

fn section_text(table: &str, repeats: usize) -> String {
    format!(
        "## Planner: padding and plan time\n\n\
         Command: `target/release/ragged bench plan` (default collective alignment 64 elements; \
         plan time is the best of {repeats} runs of the whole-model plan, identical units planned \
         once). \
         Padding is `(V·S − N)/N` summed over FSDP units (one per decoder layer plus the root). \
         Cut blocks: atomic blocks of the given size that a baseline's rank boundaries split; \
         ragged never splits one (every plan is validated). `bound` is `V·⌈N/V⌉`. \
         `k≤3`: the multi-buffer planner (at most 3 collective buffers per unit, each with its own \
         `S`; cost model α = 20 µs per collective, 50 GB/s per rank, bf16), its padding, the \
         padding no layout with at most that many buffers per unit can avoid (`k≤3 floor`, a \
         provable lower bound), the most buffers any unit uses, and its plan time (best of \
         {repeats}). \
         `share < block`: where one rank's share of a decoder layer is smaller than one of the \
         layer's blocks, no per-layer layout avoids that padding; the column gives the fewest \
         layers per unit (a power of two) that fixes it and the multi-buffer padding with that wrap, \
         then the largest HSDP shard group (`V/r` ranks, `r` replicas) that fixes it and the \
         multi-buffer padding at that group size. \
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
    format!("{cpu}, {threads} threads{}", load_average())
}

/// The load averages when the table is written (this run's own threads count in the 1-minute
/// one): other work on the machine is what makes a shared machine's timings wander.
fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let loads: Vec<&str> = text.split_whitespace().take(3).collect();
    match loads[..] {
        [one, five, fifteen] => {
            format!("; load average when written {one} / {five} / {fifteen} (1 / 5 / 15 min)")
        }
        _ => String::new(),
    }
}

/// Where `bench plan` finds its models when `--models` names none: `models/` in the working
/// directory (the repository root, as the README runs it), else the repository's own, found
/// from where this crate was built, so that the command works from any directory.
fn default_models_dir() -> PathBuf {
    let here = Path::new("models");
    if here.is_dir() {
        return here.to_path_buf();
    }
    let cli_crate = Path::new(env!("CARGO_MANIFEST_DIR"));
    cli_crate.parent().unwrap_or(cli_crate).join("models")
}

/// Every `*.json` inventory in `dir`, sorted.
fn model_files(dir: &Path) -> Result<Vec<String>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::BadInput {
        op: OP_PLAN,
        what: format!("models folder {}", dir.display()),
        reason: format!(
            "cannot be listed ({e}): name the inventories with --models, or run from the \
             repository root"
        ),
    })?;
    let mut files: Vec<String> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| p.display().to_string())
        .collect();
    files.sort();
    if files.is_empty() {
        // An empty table would replace the planner section of the benchmarks file.
        return Err(Error::BadInput {
            op: OP_PLAN,
            what: format!("{}", dir.display()),
            reason: "holds no *.json inventory: name models with --models".into(),
        });
    }
    Ok(files)
}

/// Replaces the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in `path`
/// (appending the markers if absent), so each benchmark owns one section of the file.
pub fn replace_section(path: &Path, name: &str, body: &str) -> Result<()> {
    let (open, close) = markers(name);
    let old = read_or_new(path)?;
    let block = format!("{open}\n{body}\n{close}");
    // `Output::check` refused bad markers before the bench; the file may have changed since.
    let span = section_span(&old, name).map_err(|reason| Error::BadInput {
        op: OP_OUT,
        what: path.display().to_string(),
        reason,
    })?;
    let new = match span {
        Some((a, b)) => format!("{}{block}{}", &old[..a], &old[b..]),
        None => format!("{}\n{block}\n", old.trim_end()),
    };
    // Written beside and renamed over it (into a link's target), so that an interrupted
    // write leaves the old file whole.
    let target = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let tmp = temporary_beside(&target);
    std::fs::write(&tmp, new).map_err(|e| Error::io("write", &tmp, e))?;
    std::fs::rename(&tmp, &target).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io("rename", &tmp, e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use ragged::bench::plan::{BLOCKS, WORLDS};

    /// `bench plan`'s written-out defaults are the library's sweep, and every `--worlds`
    /// default parses back from what `--help` shows.
    #[test]
    fn written_out_defaults_match_the_sweep() {
        let cli = crate::Cli::try_parse_from(["ragged", "bench", "plan"]).unwrap();
        let crate::Command::Bench(BenchCommand::Plan(args)) = cli.command else {
            panic!("not bench plan");
        };
        assert_eq!(args.worlds, WORLDS);
        assert_eq!(args.blocks, BLOCKS.map(String::from));
    }
}
