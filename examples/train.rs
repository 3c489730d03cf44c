//! The main job: train a small transformer with its state sharded over N ranks, then train the
//! same model unsharded and report how far the two drifted apart.
//!
//! `cargo run --release --example train -- --ranks 4 --steps 30`
//!
//! Checkpoints (README "Checkpoints"): `--checkpoint-dir DIR --save-every N [--keep K]` saves,
//! `--resume DIR` continues (at any `--ranks`; `--steps` stays the total), `--export FILE`
//! writes the final parameters as one safetensors file; every run prints a digest of its final
//! parameters.
//!
//! Ranks and their collectives (`--comm`): thread ranks in this process (default); thread
//! ranks whose collectives run on GPU 0 (`gpu-threads`); or one process per GPU over NCCL
//! (`nccl`: start one process per rank with `RAGGED_RANK`, `RAGGED_WORLD_SIZE`,
//! `RAGGED_RENDEZVOUS_ADDR` or `RAGGED_NCCL_ID_FILE`, and, for the GPU, `LOCAL_RANK`; rank 0
//! reports). The GPU modes need
//! `--features cuda`. `mpi`: one process per rank under `mpirun` (`--features mpi`). The
//! model runs on the CPU (candle) unless `--device cuda` (`--features candle-cuda`, with
//! `gpu-threads` or `nccl`) puts it, its shards and the optimizer state on the GPU; the
//! unsharded reference always trains on the CPU, so the drift column compares the two.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use ragged::checkpoint::CheckpointState;
use ragged::comm::threads::ThreadWorld;
use ragged::comm::{Communicator, SingleRank};
use ragged::demo::{
    train_rank_with, Checkpointing, StepReport, TrainMode, Trained, TransformerConfig,
};
use ragged::fsdp::{check_replicas, fully_shard, inventory_of, FsdpOptions, ShardLayout};
use ragged::limits::{at_least, checked_product, even_share, fits_in_memory, positive_finite};
use ragged::Result;
use ragged_optimizers::{
    Adam8bit, Adam8bitConfig, AdamW, AdamWConfig, DecayRule, Grafting, MatrixLayout, Muon,
    MuonConfig, Shampoo, ShampooConfig,
};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Layout {
    Ragged,
    Fsdp2,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Opt {
    Adamw,
    Muon,
    Adam8bit,
    Shampoo,
}

/// Where the model, its shards and the optimizer state live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Place {
    Cpu,
    /// GPU 0 (`LOCAL_RANK` under NCCL): candle CUDA tensors, device DBuffers; needs
    /// `--features candle-cuda` and `--comm gpu-threads` or `nccl`.
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CommKind {
    Threads,
    GpuThreads,
    Nccl,
    Mpi,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Size {
    Small,
    Tiny,
}

#[derive(Parser, Debug)]
#[command(about = "Sharded training of a small transformer on thread ranks")]
struct Args {
    /// Number of thread ranks sharing the model [default: 4]. Under mpi and nccl the launcher
    /// sets the world size; given there, it must match it.
    #[arg(long)]
    ranks: Option<usize>,
    /// HSDP: shard each unit over groups of ranks / R ranks and replicate it over the R groups
    /// (gradient shards all-reduced between replicas); R must divide the ranks. 1: plain
    /// FSDP.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Where the ranks and their collectives run (module doc).
    #[arg(long, value_enum, default_value_t = CommKind::Threads)]
    comm: CommKind,
    /// Where the model and the sharded state live.
    #[arg(long, value_enum, default_value_t = Place::Cpu)]
    device: Place,
    /// Training steps.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Sequences per global batch (split evenly over ranks).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Parameter layout.
    #[arg(long, value_enum, default_value_t = Layout::Ragged)]
    layout: Layout,
    /// Model size (small: 3.3 M parameters; tiny: a few thousand).
    #[arg(long, value_enum, default_value_t = Size::Small)]
    size: Size,
    /// Optimizer: AdamW; Muon (embedding and head on AdamW); 8-bit Adam (256-element scale
    /// blocks inside 32-row blocks); blocked Shampoo with Adam grafting.
    #[arg(long, value_enum, default_value_t = Opt::Adamw)]
    optimizer: Opt,
    /// Learning rate [default: 0.003]. A resumed run continues at its checkpoint's rate, and
    /// so does its unsharded reference; a different --lr is then ignored.
    #[arg(long, allow_negative_numbers = true)]
    lr: Option<f64>,
    /// Keep every unit gathered from its forward to its backward (more memory). Default: free
    /// each unit's parameters after its forward stage (its graph kept) and re-gather them for
    /// its backward.
    #[arg(long)]
    keep_units: bool,
    /// Run each stage forward without a graph and recompute it in backward (activation
    /// checkpointing: fewer activations, one more forward).
    #[arg(long)]
    recompute: bool,
    /// Gather every unit at once and run one backward over the whole model (models that fit).
    #[arg(long, conflicts_with_all = ["keep_units", "recompute"])]
    whole_model: bool,
    /// Skip the unsharded reference run.
    #[arg(long)]
    no_reference: bool,
    /// Fail (exit status 1) when the largest parameter difference from the unsharded
    /// reference exceeds FRACTION × steps × lr: a step of AdamW, 8-bit Adam or Shampoo with
    /// Adam grafting moves a parameter by about lr at most, so a run that drifts by a good
    /// part of that trained a different model (scripts/gpu-check.sh uses 0.1 for the model on
    /// the GPU against the CPU reference).
    #[arg(long, value_name = "FRACTION", conflicts_with = "no_reference")]
    check_drift: Option<f64>,
    /// Muon only: keep matrices whole, let the planner split them (gather-to-root), or choose
    /// per matrix by the byte cost model (default: auto).
    #[arg(long, value_enum)]
    muon_layout: Option<MuonLayout>,
    /// Save checkpoints under this folder (one `step-N` folder each; see README "Checkpoints").
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Save every N steps, and after the last (needs --checkpoint-dir; 0: after the last only;
    /// a fresh run of --steps 0 saves its initial state).
    #[arg(long, default_value_t = 0)]
    save_every: usize,
    /// Keep only the newest N checkpoints (0: keep all).
    #[arg(long, default_value_t = 0)]
    keep: usize,
    /// With output that is not a terminal (a file, a pipe, mpirun), where the progress bar
    /// cannot show: a line on stderr with the step and loss every SECONDS (0: every step).
    #[arg(long, value_name = "SECONDS", default_value_t = 10)]
    log_every: u64,
    /// Resume from a checkpoint folder, or from the newest checkpoint under a root; any world
    /// size and layout. --steps stays the total.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Start from the parameters of a safetensors file (an --export, or a Hugging Face
    /// checkpoint's model.safetensors or model.safetensors.index.json with this model's
    /// names and shapes); the optimizer starts fresh.
    #[arg(long, conflicts_with = "resume")]
    init_from: Option<PathBuf>,
    /// Write the final parameters to one safetensors file (candle's VarBuilder loads it).
    #[arg(long)]
    export: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum MuonLayout {
    Auto,
    Whole,
    Split,
}

impl From<MuonLayout> for MatrixLayout {
    fn from(l: MuonLayout) -> Self {
        match l {
            MuonLayout::Auto => MatrixLayout::Auto,
            MuonLayout::Whole => MatrixLayout::Whole,
            MuonLayout::Split => MatrixLayout::Split,
        }
    }
}

/// `--lr` when a fresh run does not give it.
const DEFAULT_LR: f64 = 3e-3;

fn adamw(lr: f64) -> Result<AdamW> {
    AdamW::new(AdamWConfig {
        lr,
        decay_rule: DecayRule::NoDecayFor1D,
        ..AdamWConfig::default()
    })
}

fn muon(lr: f64, layout: MuonLayout) -> Result<Muon> {
    Muon::new(MuonConfig {
        lr,
        layout: layout.into(),
        adamw: AdamWConfig {
            lr,
            decay_rule: DecayRule::NoDecayFor1D,
            ..AdamWConfig::default()
        },
        ..MuonConfig::default()
    })
}

fn adam8bit(lr: f64) -> Result<Adam8bit> {
    Adam8bit::new(Adam8bitConfig {
        adam: AdamWConfig {
            lr,
            decay_rule: DecayRule::NoDecayFor1D,
            ..AdamWConfig::default()
        },
        ..Adam8bitConfig::default()
    })
}

/// Shampoo with Adam grafting, 256-row blocks and roots every 10 steps (the demo's matrices
/// are at most 1024 wide; a root of a 256² factor is an eigendecomposition of ~50 ms here).
fn shampoo(lr: f64) -> Result<Shampoo> {
    Shampoo::new(ShampooConfig {
        lr,
        beta2: 0.999,
        epsilon: 1e-8,
        max_preconditioner_dim: 256,
        precondition_frequency: 10,
        grafting: Grafting::Adam {
            beta2: 0.999,
            eps: 1e-8,
        },
        ..ShampooConfig::default()
    })
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match check_args(&args).and_then(|()| train(&args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Refuses arguments that cannot train (a rate that is not a positive number, no ranks, a
/// batch whose activations would not fit in memory) before anything is allocated.
fn check_args(args: &Args) -> Result<()> {
    const OP: &str = "train";
    if let Some(lr) = args.lr {
        positive_finite(OP, "--lr", lr)?;
        ragged::optim::check_rate(OP, "--lr", lr)?;
    }
    if let Some(f) = args.check_drift {
        positive_finite(OP, "--check-drift", f)?;
    }
    at_least(OP, "--ranks", args.thread_ranks(), 1)?;
    at_least(OP, "--batch", args.batch, 1)?;
    at_least(OP, "--replicas", args.replicas, 1)?;
    // Thread ranks are known now (MPI and NCCL worlds only once joined, where train_rank checks).
    if matches!(args.comm, CommKind::Threads | CommKind::GpuThreads) {
        even_share(OP, "--batch", args.batch, args.thread_ranks())?;
        check_replicas(OP, "--replicas", args.replicas, args.thread_ranks())?;
    }
    check_launched_ranks(args, launched_world(args))?;
    for (flag, given) in [
        ("--save-every", args.save_every > 0),
        ("--keep", args.keep > 0),
    ] {
        if given && args.checkpoint_dir.is_none() {
            return Err(ragged::Error::BadInput {
                op: OP,
                what: flag.into(),
                reason: "needs --checkpoint-dir (where to save)".into(),
            });
        }
    }
    // Before the GPU is opened, so that this, not "CUDA unavailable", is what a build without
    // CUDA says.
    if args.device == Place::Cuda && args.comm == CommKind::Mpi {
        return Err(mpi_on_gpu());
    }
    if args.muon_layout.is_some() && !matches!(args.optimizer, Opt::Muon) {
        return Err(ragged::Error::BadInput {
            op: OP,
            what: "--muon-layout".into(),
            reason: "applies to --optimizer muon only".into(),
        });
    }
    let c = model_config(args.size);
    // Per token, about: the layers' kept activations (4·d + 2·d_ff + heads·seq) and the
    // logits with their softmax and gradient (3·vocab), f32.
    let per_token = c.n_layers * (4 * c.d_model + 2 * c.d_ff + c.n_heads * c.seq_len) + 3 * c.vocab;
    let bytes = checked_product(OP, "--batch", &[args.batch, c.seq_len, per_token, 4])?;
    fits_in_memory(OP, "--batch's activations", bytes).map(drop)
}

impl Args {
    /// `--muon-layout`, auto when not given.
    fn muon_layout(&self) -> MuonLayout {
        self.muon_layout.unwrap_or(MuonLayout::Auto)
    }

    /// `--ranks`, 4 when not given: the thread ranks' world (a launcher's sets its own).
    fn thread_ranks(&self) -> usize {
        self.ranks.unwrap_or(4)
    }
}

/// What the checkpoint `--resume` names says about the run it continues, read before anything
/// is printed or allocated.
struct Resumed {
    /// The rate it saved: the sharded run continues at it, so the reference must train at it.
    lr: Option<f64>,
    /// Batches it consumed (steps taken and steps skipped): where the resumed run starts.
    batches: usize,
}

impl Resumed {
    /// `None` for a fresh run.
    fn read(args: &Args) -> Result<Option<Resumed>> {
        let Some(path) = &args.resume else {
            return Ok(None);
        };
        let dir = ragged::checkpoint::fs::resolve(path)?;
        let progress = ragged::checkpoint::Manifest::read(&dir)?.progress;
        let batches = progress
            .steps
            .checked_add(progress.skipped)
            .ok_or_else(|| ragged::Error::Checkpoint {
                path: dir.display().to_string(),
                reason: "steps taken plus steps skipped overflow".into(),
            })?;
        Ok(Some(Resumed {
            lr: progress.learning_rate,
            batches,
        }))
    }

    /// `Err` when the checkpoint has already consumed more than `--steps` batches: refused
    /// here, before the start-up table, as well as by `train_rank_with` after its load.
    fn check_steps(&self, steps: usize) -> Result<()> {
        ragged::demo::check_resumable(self.batches, steps)
    }
}

/// The rate this run trains at, and how the banner names it: a resumed run's is its
/// checkpoint's (an explicit --lr that differs is ignored), a fresh run's --lr or the default.
fn learning_rate(args: &Args, resumed: Option<&Resumed>) -> (f64, String) {
    let given = args.lr;
    match resumed.and_then(|r| r.lr) {
        Some(saved) => {
            let note = match given {
                Some(lr) if lr != saved => format!("the checkpoint's; --lr {lr} is ignored"),
                _ => "the checkpoint's".to_string(),
            };
            (saved, format!("{saved} ({note})"))
        }
        None => {
            let lr = given.unwrap_or(DEFAULT_LR);
            (lr, lr.to_string())
        }
    }
}

/// The world size and this process's rank as the launcher sets them: `--ranks` and 0 for
/// thread ranks; under `mpirun` or an NCCL launcher, its environment (the communicator itself
/// joins later), `None` where it sets none.
fn launched_world(args: &Args) -> Option<(usize, usize)> {
    let env = |names: &[&str]| {
        names
            .iter()
            .find_map(|n| std::env::var(n).ok()?.trim().parse::<usize>().ok())
    };
    match args.comm {
        CommKind::Threads | CommKind::GpuThreads => Some((args.thread_ranks(), 0)),
        CommKind::Mpi | CommKind::Nccl => Some((
            env(&[
                "OMPI_COMM_WORLD_SIZE",
                "PMI_SIZE",
                "RAGGED_WORLD_SIZE",
                "WORLD_SIZE",
            ])?,
            env(&["OMPI_COMM_WORLD_RANK", "PMI_RANK", "RAGGED_RANK", "RANK"])?,
        )),
    }
}

/// An explicit `--ranks` under a launcher that started another number of processes: refused,
/// since the user asked for a world this run would not be (it was ignored before).
/// `launched` is [`launched_world`]'s answer.
fn check_launched_ranks(args: &Args, launched: Option<(usize, usize)>) -> Result<()> {
    let (Some(asked), CommKind::Mpi | CommKind::Nccl) = (args.ranks, args.comm) else {
        return Ok(());
    };
    match launched {
        Some((size, _)) if size != asked => Err(ragged::Error::BadInput {
            op: "train",
            what: format!("--ranks {asked}"),
            reason: format!(
                "the launcher started {size} processes (under --comm {} the world is the \
                 launcher's: leave --ranks out, or start {asked})",
                args.comm
                    .to_possible_value()
                    .map_or("?".into(), |v| v.get_name().to_string())
            ),
        }),
        _ => Ok(()),
    }
}

fn train(args: &Args) -> Result<()> {
    let resumed = Resumed::read(args)?;
    if let Some(r) = &resumed {
        r.check_steps(args.steps)?;
    }
    let lr = learning_rate(args, resumed.as_ref());
    match args.optimizer {
        Opt::Adamw => run(args, lr, adamw),
        Opt::Muon => {
            // Printed once, for the world that runs (the launcher's, not --ranks, under MPI).
            match launched_world(args) {
                Some((ranks, 0)) if matches!(args.layout, Layout::Ragged) => {
                    print_muon_layout(args, ranks, lr.0)?
                }
                _ => {}
            }
            let layout = args.muon_layout();
            run(args, lr, move |lr| muon(lr, layout))
        }
        Opt::Adam8bit => {
            if launched_world(args).is_none_or(|(_, rank)| rank == 0) {
                print_adam8bit_state(args, lr.0)?;
            }
            run(args, lr, adam8bit)
        }
        Opt::Shampoo => run(args, lr, shampoo),
    }
}

/// How many parameters 8-bit Adam quantizes: the others keep `f32` state, AdamW's update bit
/// for bit (bnb's small-tensor fallback), so a model of small matrices (`--size tiny`, none of
/// 4096 elements) trains as AdamW, which the banner should not leave unsaid.
fn print_adam8bit_state(args: &Args, lr: f64) -> Result<()> {
    let params = model_config(args.size).param_shapes();
    let opt = adam8bit(lr)?;
    let (mut quantized, mut elems, mut total_elems) = (0, 0, 0);
    for (name, shape) in &params {
        let n: usize = shape.iter().product();
        total_elems += n;
        if opt.tiling(name, shape).is_some() {
            quantized += 1;
            elems += n;
        }
    }
    let fallback = if quantized == params.len() {
        String::new()
    } else {
        format!(
            "; the other {} keep f32 state and take AdamW's update (1-D, under {} elements, \
             an embedding, or rows not a multiple of 32 wide)",
            params.len() - quantized,
            Adam8bitConfig::default().min_8bit_size
        )
    };
    ragged::outln!(
        "8-bit Adam: 8-bit state for {quantized} of {} parameters ({elems} of {total_elems} \
         elements){fallback}",
        params.len()
    )?;
    Ok(())
}

fn model_config(size: Size) -> TransformerConfig {
    match size {
        Size::Small => TransformerConfig::SMALL,
        Size::Tiny => TransformerConfig::TINY,
    }
}

/// Muon's per-unit choice of whole or split matrices, and what it costs on the wire.
fn print_muon_layout(args: &Args, ranks: usize, lr: f64) -> Result<()> {
    let params = model_config(args.size).init_params(0)?;
    let inventory = inventory_of(&params)?;
    let opt = muon(lr, args.muon_layout())?;
    let (mut split, mut total, mut bytes) = (0, 0, 0);
    let wrap = FsdpOptions::default().wrap;
    for unit in inventory.units_by(&|name| wrap.unit_of(name)) {
        let (_, report) = opt.plan_layout(&unit, ranks, &FsdpOptions::default().plan)?;
        total += report.tensors.len();
        split += report.tensors.iter().filter(|t| t.is_split()).count();
        bytes += report.cost_bytes();
    }
    ragged::outln!(
        "muon layout ({:?}): {split} of {total} matrices split over ranks (gathered to LPT \
         roots); padding + root traffic {:.2} MB per step",
        args.muon_layout(),
        bytes as f64 / 1e6
    )?;
    Ok(())
}

/// Trains sharded, then (unless --no-reference) unsharded at the same rate `lr` (the rate and
/// the banner's words for it, from [`learning_rate`]), and reports how far the two drifted.
fn run<O: CheckpointState>(
    args: &Args,
    (lr, lr_text): (f64, String),
    optimizer: impl Fn(f64) -> Result<O> + Sync,
) -> Result<()> {
    let cfg = model_config(args.size);
    let params = cfg.init_params(0)?;
    let n_params: usize = params.iter().map(|(_, t)| t.elem_count()).sum();
    let opts = FsdpOptions {
        layout: match args.layout {
            Layout::Ragged => ShardLayout::Ragged,
            Layout::Fsdp2 => ShardLayout::Fsdp2,
        },
        reshard_after_forward: !args.keep_units,
        recompute: args.recompute,
        replicas: args.replicas,
        ..FsdpOptions::default()
    };
    let world = launched_world(args);
    let mut ranks = world.map_or("launcher-set".to_string(), |(v, _)| v.to_string());
    if args.replicas > 1 {
        ranks = format!("{ranks} (HSDP: {} replicas)", args.replicas);
    }
    if world.is_none_or(|(_, rank)| rank == 0) {
        ragged::outln!(
            "model: {n_params} parameters; {ranks} ranks, {:?} layout, {:?} lr {lr_text}, \
             global batch {} x {} tokens",
            args.layout,
            args.optimizer,
            args.batch,
            cfg.seq_len
        )?;
        if args.device == Place::Cuda && matches!(args.optimizer, Opt::Shampoo) {
            ragged::outln!(
                "Shampoo steps on the GPU; its inverse roots are computed on the CPU (factors \
                 down, roots up, every precondition_frequency steps)"
            )?;
        }
    }

    let bar = Progress::new("sharded", args);
    let ckpt = Checkpointing {
        dir: args.checkpoint_dir.clone(),
        save_every: args.save_every,
        keep: args.keep,
        resume: args.resume.clone(),
        init_from: args.init_from.clone(),
        export: args.export.clone(),
    };
    let started = Instant::now();
    let mode = if args.whole_model {
        TrainMode::WholeModel
    } else {
        TrainMode::UnitByUnit
    };
    let cpu_params = params;
    let params = match args.device {
        Place::Cpu => cpu_params.clone(),
        Place::Cuda => gpu::to_gpu(&cpu_params)?,
    };
    let rank_run = |comm: &dyn Communicator| {
        // Rank 0 reports; the others keep nothing.
        let mut losses = Table::new(args.steps, None);
        let progress = |step: usize, r: &StepReport| {
            if comm.rank() == 0 {
                bar.step(step, r.loss);
                losses.record(step, r);
            }
        };
        // The start-up table: every parameter's role, unit, block and holding ranks.
        let table = fully_shard(&params, optimizer(lr)?, comm, opts.clone())?.describe();
        if comm.rank() == 0 {
            bar.suspend(|| ragged::outln!("{table}\n"))?;
        }
        let opt = optimizer(lr)?;
        let job = (cfg, mode, args.steps, args.batch);
        let trained = train_rank_with(&params, opt, comm, opts.clone(), job, &ckpt, progress)?;
        Ok((trained, losses))
    };
    let (rank, (trained, sharded)) = match args.comm {
        CommKind::Threads => (
            0,
            first(ThreadWorld::run(args.thread_ranks(), |c| rank_run(c))?),
        ),
        CommKind::GpuThreads => (
            0,
            first(gpu::threads(args.thread_ranks(), args.device, &rank_run)?),
        ),
        CommKind::Nccl => gpu::nccl(args.device, &rank_run)?,
        CommKind::Mpi if args.device == Place::Cpu => mpi_rank(&rank_run)?,
        CommKind::Mpi => return Err(mpi_on_gpu()),
    };
    bar.finish();
    let sharded_time = started.elapsed().as_secs_f64();
    if rank != 0 {
        return Ok(()); // rank 0 reports
    }
    report_checkpoints(args, &trained)?;
    for (what, count) in &trained.optimizer_events {
        ragged::outln!("{what}: {count}")?;
    }
    let Trained {
        params: full,
        first_step,
        ..
    } = trained;

    if args.no_reference {
        sharded.print(None)?;
        return Ok(());
    }
    let bar = Progress::new("unsharded", args);
    let mut reference = Table::new(args.steps, Some(first_step));
    let progress = |step: usize, r: &StepReport| {
        bar.step(step, r.loss);
        reference.record(step, r);
    };
    let reference_opts = FsdpOptions {
        layout: ShardLayout::Ragged,
        ..FsdpOptions::default()
    };
    // At the sharded run's rate (a resumed run's is its checkpoint's), from the same start:
    // the imported values under --init-from (a resumed run's steps are compared from the
    // checkpoint's step on, the reference having run them all).
    let opt = optimizer(lr)?;
    let start = Checkpointing {
        init_from: args.init_from.clone(),
        ..Checkpointing::default()
    };
    let job = (cfg, TrainMode::UnitByUnit, args.steps, args.batch);
    let ref_full = train_rank_with(
        &cpu_params,
        opt,
        &SingleRank,
        reference_opts,
        job,
        &start,
        progress,
    )?
    .params;
    bar.finish();
    sharded.print(Some(&reference))?;
    // NaN stays NaN (f32::max would drop it and report a diverged run as agreeing).
    let max_diff = full
        .iter()
        .flat_map(|(name, v)| v.iter().zip(&ref_full[name]).map(|(a, b)| (a - b).abs()))
        .fold(0f32, |m, d| {
            if m.is_nan() || d.is_nan() {
                f32::NAN
            } else {
                m.max(d)
            }
        });
    ragged::outln!(
        "\nsharded run {sharded_time:.1} s; bytes copied outside collectives: {}",
        sharded.copied_bytes()
    )?;
    ragged::outln!(
        "max |parameter difference| sharded vs unsharded after {} step{}: {max_diff:.3e}",
        args.steps,
        if args.steps == 1 { "" } else { "s" }
    )?;
    match args.check_drift {
        Some(fraction) => check_drift(max_diff, fraction, args.steps, lr),
        None => Ok(()),
    }
}

/// `--check-drift`: `Err` unless `max_diff ≤ fraction · steps · lr` (a NaN difference fails).
fn check_drift(max_diff: f32, fraction: f64, steps: usize, lr: f64) -> Result<()> {
    let bound = fraction * steps as f64 * lr;
    if f64::from(max_diff) <= bound {
        ragged::outln!(
            "drift check: {max_diff:.3e} ≤ {bound:.3e} ({fraction} × {steps} steps × lr {lr}): ok"
        )?;
        return Ok(());
    }
    Err(ragged::Error::BadInput {
        op: "train --check-drift",
        what: format!("max |parameter difference| {max_diff:.3e}"),
        reason: format!(
            "above {bound:.3e} ({fraction} × {steps} steps × lr {lr}): the sharded run did not \
             train the reference's model"
        ),
    })
}

/// `--device cuda --comm mpi`: refused by `check_args`, and where the ranks start.
fn mpi_on_gpu() -> ragged::Error {
    ragged::Error::BadInput {
        op: "train",
        what: "--device cuda --comm mpi".into(),
        reason: "MPI moves host memory; use --comm nccl or gpu-threads".into(),
    }
}

/// Rank 0's result.
fn first<T>(results: Vec<T>) -> T {
    results.into_iter().next().expect("a world has rank 0")
}

/// This process as one MPI rank (feature `mpi`, under `mpirun`).
#[cfg(feature = "mpi")]
fn mpi_rank<T>(f: &dyn Fn(&dyn Communicator) -> Result<T>) -> Result<(usize, T)> {
    let comm = ragged::comm::mpi::MpiComm::init()?;
    // A rank that fails ends the whole job (the others would wait inside MPI forever).
    match f(&comm) {
        Ok(out) => Ok((comm.rank(), out)),
        Err(e) => comm.abort_job(&e),
    }
}

#[cfg(not(feature = "mpi"))]
fn mpi_rank<T>(_: &dyn Fn(&dyn Communicator) -> Result<T>) -> Result<(usize, T)> {
    Err(ragged::Error::Comm {
        op: "train --comm mpi",
        rank: 0,
        reason: "needs a build with --features mpi, run under mpirun".into(),
    })
}

/// The GPU-backed communicators (feature `cuda`), and the model on the GPU (feature
/// `candle-cuda`).
#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;

    use candle_core::Tensor;
    use ragged::comm::Communicator;
    use ragged::cuda::collective::ViaDevice;
    use ragged::cuda::nccl::NcclComm;
    use ragged::cuda::threads::ThreadDeviceComm;
    use ragged::cuda::Device;
    use ragged::Result;

    use super::Place;

    /// The GPU of this process (`LOCAL_RANK`, default 0).
    fn ordinal() -> usize {
        std::env::var("LOCAL_RANK")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// candle's device on this process's GPU and this crate's handle on its stream, made once:
    /// the model, the shards and the collectives then run on one stream.
    #[cfg(feature = "candle-cuda")]
    fn candle_gpu() -> Result<&'static (candle_core::Device, Arc<Device>)> {
        static GPU: std::sync::OnceLock<(candle_core::Device, Arc<Device>)> =
            std::sync::OnceLock::new();
        if let Some(g) = GPU.get() {
            return Ok(g);
        }
        // The gate first: its error says why (no driver, no device), candle's is the driver's.
        Device::open(ordinal())?;
        let cd = candle_core::Device::new_cuda(ordinal())
            .map_err(ragged::dbuffer::candle("train --device cuda"))?;
        let candle_core::Device::Cuda(cuda) = &cd else {
            unreachable!("new_cuda makes a CUDA device")
        };
        let dev = Arc::new(Device::from_candle(cuda)?);
        Ok(GPU.get_or_init(|| (cd, dev)))
    }

    #[cfg(not(feature = "candle-cuda"))]
    fn candle_gpu() -> Result<&'static (candle_core::Device, Arc<Device>)> {
        Err(ragged::Error::CudaUnavailable {
            op: "train --device cuda",
            reason: "the model on the GPU needs a build with --features candle-cuda".into(),
        })
    }

    /// `params` copied to this process's GPU.
    pub fn to_gpu(params: &[(String, Tensor)]) -> Result<Vec<(String, Tensor)>> {
        let (cd, _) = candle_gpu()?;
        params
            .iter()
            .map(|(n, t)| {
                let t = t
                    .to_device(cd)
                    .map_err(ragged::dbuffer::candle("train --device cuda"))?;
                Ok((n.clone(), t))
            })
            .collect()
    }

    /// `n` thread ranks whose collectives run on the GPU: on the model's device buffers
    /// (`--device cuda`), or on device copies of this CPU runtime's host buffers.
    pub fn threads<T: Send>(
        n: usize,
        place: Place,
        f: &(dyn Fn(&dyn Communicator) -> Result<T> + Sync),
    ) -> Result<Vec<T>> {
        match place {
            Place::Cpu => {
                let dev = Arc::new(Device::open(0)?);
                ThreadDeviceComm::run(dev, n, |c| f(&ViaDevice::new(c, c.device())))
            }
            Place::Cuda => ThreadDeviceComm::run(candle_gpu()?.1.clone(), n, |c| f(c)),
        }
    }

    /// This process as one NCCL rank (environment in the module doc), on GPU `LOCAL_RANK`.
    pub fn nccl<T>(place: Place, f: &dyn Fn(&dyn Communicator) -> Result<T>) -> Result<(usize, T)> {
        // Host buffers (`--device cpu`) go through device copies inside NcclComm.
        let dev = match place {
            Place::Cpu => Arc::new(Device::open(ordinal())?),
            Place::Cuda => candle_gpu()?.1.clone(),
        };
        let comm = NcclComm::from_env(dev)?;
        let rank = comm.rank();
        Ok((rank, f(&comm)?))
    }
}

/// Without the `cuda` feature the GPU modes explain how to get them.
#[cfg(not(feature = "cuda"))]
mod gpu {
    use candle_core::Tensor;
    use ragged::comm::Communicator;
    use ragged::{Error, Result};

    use super::Place;

    fn unavailable() -> Error {
        Error::CudaUnavailable {
            op: "train --comm / --device",
            reason: "gpu-threads, nccl and --device cuda need a build with --features cuda \
                     (the model on the GPU: candle-cuda)"
                .into(),
        }
    }

    pub fn to_gpu(_: &[(String, Tensor)]) -> Result<Vec<(String, Tensor)>> {
        Err(unavailable())
    }

    pub fn threads<T: Send>(
        _: usize,
        _: Place,
        _: &(dyn Fn(&dyn Communicator) -> Result<T> + Sync),
    ) -> Result<Vec<T>> {
        Err(unavailable())
    }

    pub fn nccl<T>(_: Place, _: &dyn Fn(&dyn Communicator) -> Result<T>) -> Result<(usize, T)> {
        Err(unavailable())
    }
}

/// Where the run resumed, saved and exported, and the digest of its final parameters.
fn report_checkpoints(args: &Args, trained: &Trained) -> Result<()> {
    if let Some(from) = &args.resume {
        ragged::outln!(
            "resumed from {} at step {}",
            from.display(),
            trained.first_step
        )?;
        if !trained.changed_settings.is_empty() {
            ragged::outln!(
                "settings that differ from the checkpoint's (this run's apply; the learning \
                 rate is the checkpoint's): {}",
                trained.changed_settings.join(", ")
            )?;
        }
    }
    if let Some(moved) = trained.set_aside.first().and_then(|p| p.parent()) {
        ragged::outln!(
            "moved the checkpoints of later steps, of the run this one went back from, to {} \
             (resume from there to continue that run)",
            moved.display()
        )?;
    }
    if let Some(dir) = &args.checkpoint_dir {
        let saved = ragged::checkpoint::fs::list(dir).unwrap_or_default();
        let steps: Vec<usize> = saved.iter().map(|(s, _)| *s).collect();
        ragged::outln!("checkpoints in {}: steps {steps:?}", dir.display())?;
    }
    if let Some(path) = &args.init_from {
        let unused = match trained.unused_tensors.as_slice() {
            [] => String::new(),
            names => {
                let more = names.len().saturating_sub(5);
                let tail = if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                };
                format!(
                    " ({} of its tensors not in the model, unused: {}{tail})",
                    names.len(),
                    names[..names.len().min(5)].join(", ")
                )
            }
        };
        ragged::outln!("started from the parameters in {}{unused}", path.display())?;
    }
    if let Some(path) = &args.export {
        ragged::outln!("exported the parameters to {}", path.display())?;
    }
    ragged::outln!(
        "parameter digest (sha256 of the f32 values by name): {}",
        trained.digest
    )
}

/// A run's progress: a bar on a terminal; elsewhere a line on stderr every `--log-every`
/// (the step, the loss, the time so far), so a long run under `nohup` or `mpirun` shows that
/// it is alive and how its loss goes before the table at the end.
struct Progress {
    bar: ProgressBar,
    label: &'static str,
    /// How often a line is written where the bar is hidden.
    every: Duration,
    /// When the last line was written (the start before the first).
    logged: std::sync::Mutex<Instant>,
}

impl Progress {
    fn new(label: &'static str, args: &Args) -> Progress {
        let template = format!("{label:<9} {{bar:30}} {{pos}}/{{len}} {{msg}} [{{elapsed}}]");
        let style = ProgressStyle::with_template(&template).expect("valid template");
        Progress {
            bar: ProgressBar::new(args.steps as u64).with_style(style),
            label,
            every: Duration::from_secs(args.log_every),
            logged: std::sync::Mutex::new(Instant::now()),
        }
    }

    /// Runs `f` with the bar cleared, so what it prints is not drawn over.
    fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.bar.suspend(f)
    }

    fn finish(&self) {
        self.bar.finish();
    }

    /// Step `step` (from 0) is done with loss `loss`.
    fn step(&self, step: usize, loss: f32) {
        self.bar.set_position(step as u64 + 1);
        self.bar.set_message(format!("loss {loss:.4}"));
        if !self.bar.is_hidden() {
            return;
        }
        let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
        if logged.elapsed() >= self.every {
            *logged = Instant::now();
            let elapsed = self.bar.elapsed().as_secs_f64();
            // A progress line that cannot be written is not worth failing the run for.
            let _ = writeln!(
                std::io::stderr(),
                "{} step {}/{} loss {loss:.4} [{elapsed:.0} s]",
                self.label,
                step + 1,
                self.bar.length().unwrap_or_default()
            );
        }
    }
}

/// Most rows of the loss table; a longer run shows every k-th step (k 1, 2 or 5 × 10ⁿ).
const TABLE_ROWS: usize = 100;

/// The steps a run's loss table shows, kept as they run: every `every`-th step, the first one
/// run, the last, and `also` (the reference keeps the sharded run's first).
struct Table {
    total: usize,
    every: usize,
    also: Option<usize>,
    rows: Vec<(usize, StepReport)>,
}

impl Table {
    fn new(total: usize, also: Option<usize>) -> Table {
        let every = (0..)
            .flat_map(|e| [1, 2, 5].map(|m| m * 10usize.saturating_pow(e)))
            .find(|k| total.div_ceil(*k) <= TABLE_ROWS)
            .unwrap_or(usize::MAX);
        Table {
            total,
            every,
            also,
            rows: Vec::new(),
        }
    }

    fn record(&mut self, step: usize, report: &StepReport) {
        let shown = self.rows.is_empty()
            || (step + 1) % self.every == 0
            || step + 1 == self.total
            || self.also == Some(step);
        if shown {
            self.rows.push((step, *report));
        }
    }

    /// Bytes copied outside collectives by the end of the run.
    fn copied_bytes(&self) -> u64 {
        self.rows.last().map_or(0, |(_, r)| r.copied_bytes)
    }

    fn loss_at(&self, step: usize) -> Option<f32> {
        let i = self.rows.binary_search_by_key(&step, |(s, _)| *s).ok()?;
        Some(self.rows[i].1.loss)
    }

    /// The table, with the reference's loss at each step where there is one.
    fn print(&self, reference: Option<&Table>) -> Result<()> {
        if self.every > 1 {
            ragged::outln!(
                "\n(a row every {} steps of {}, and the first and last run)",
                self.every,
                self.total
            )?;
        }
        ragged::outln!(
            "\n{:>5} {:>12} {:>12} {:>10} {:>9}",
            "step",
            "loss",
            "unsharded",
            "|diff|",
            "step s"
        )?;
        for (step, r) in &self.rows {
            let (u, d) = match reference.and_then(|t| t.loss_at(*step)) {
                Some(u) => (format!("{u:.6}"), format!("{:.2e}", (u - r.loss).abs())),
                None => ("-".into(), "-".into()),
            };
            ragged::outln!(
                "{:>5} {:>12.6} {:>12} {:>10} {:>9.3}",
                step,
                r.loss,
                u,
                d,
                r.seconds
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--check-drift`'s bound is fraction × steps × lr; above it, or NaN, fails.
    #[test]
    fn the_drift_check_bounds_the_difference_by_a_fraction_of_steps_times_lr() {
        assert!(check_drift(1.4e-3, 0.1, 5, 3e-3).is_ok());
        let err = check_drift(1.6e-3, 0.1, 5, 3e-3).unwrap_err().to_string();
        assert!(err.contains("1.500e-3"), "{err}");
        assert!(check_drift(f32::NAN, 0.1, 5, 3e-3).is_err());
        assert!(check_drift(0.0, 0.1, 5, 3e-3).is_ok());
        let bad = Args::try_parse_from(["train", "--check-drift", "0.1", "--no-reference"]);
        assert!(bad.is_err(), "needs the reference run");
        assert!(check_args(&args(&["--check-drift", "0"])).is_err());
    }

    fn args(flags: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("train").chain(flags.iter().copied())).unwrap()
    }

    /// `--ranks` was ignored under a launcher; now it must match the world it started.
    #[test]
    fn an_explicit_ranks_must_match_the_launchers_world() {
        let mpi = args(&["--comm", "mpi", "--ranks", "4"]);
        let err = check_launched_ranks(&mpi, Some((2, 0)))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--ranks 4") && err.contains("started 2 processes"),
            "{err}"
        );
        assert!(err.contains("--comm mpi"), "{err}");
        assert!(check_launched_ranks(&mpi, Some((4, 1))).is_ok());
        // Not given, or thread ranks (where it is the world): nothing to compare.
        assert!(check_launched_ranks(&args(&["--comm", "mpi"]), Some((2, 0))).is_ok());
        assert!(check_launched_ranks(&args(&["--ranks", "4"]), Some((4, 0))).is_ok());
        assert_eq!(args(&[]).thread_ranks(), 4);
    }

    fn report(loss: f32) -> StepReport {
        StepReport {
            loss,
            seconds: 0.0,
            fsdp_seconds: 0.0,
            phases: Default::default(),
            step_seconds: 0.0,
            copied_bytes: 0,
        }
    }

    /// Steps `from..total` through a table; the steps it keeps.
    fn kept(total: usize, also: Option<usize>, from: usize) -> Vec<usize> {
        let mut t = Table::new(total, also);
        (from..total).for_each(|step| t.record(step, &report(step as f32)));
        t.rows.iter().map(|(s, _)| *s).collect()
    }

    /// The loss table kept every step of every run on every rank (a million-step run, a
    /// million rows); now at most about 100 rows, the first and last run among them.
    #[test]
    fn the_loss_table_keeps_a_bounded_number_of_rows() {
        assert_eq!(kept(30, None, 0), (0..30).collect::<Vec<_>>());
        assert_eq!(kept(100, None, 0).len(), 100);
        let every_2: Vec<usize> = std::iter::once(0).chain((1..101).step_by(2)).collect();
        assert_eq!(
            kept(101, None, 0),
            every_2.iter().copied().chain([100]).collect::<Vec<_>>()
        );
        let million = kept(1_000_000, None, 0);
        assert_eq!(million.len(), 101, "{:?}", &million[..3]);
        assert_eq!((million[1], million[100]), (9_999, 999_999));
        // A resumed run keeps its first step; the reference keeps that one too.
        let resumed = kept(1000, None, 7);
        assert_eq!(&resumed[..3], &[7, 9, 19]);
        assert!(kept(1000, Some(7), 0).contains(&7));
        assert!(!kept(1000, None, 0).contains(&7));
    }

    #[test]
    fn the_table_compares_the_steps_both_runs_kept() {
        let mut sharded = Table::new(1000, None);
        let mut reference = Table::new(1000, Some(7));
        for step in 0..1000 {
            reference.record(step, &report(step as f32));
            if step >= 7 {
                sharded.record(step, &report(step as f32 + 0.5));
            }
        }
        for (step, r) in &sharded.rows {
            assert_eq!(reference.loss_at(*step), Some(r.loss - 0.5), "step {step}");
        }
        assert_eq!(reference.loss_at(8), None);
    }

    fn resumed(lr: Option<f64>, batches: usize) -> Resumed {
        Resumed { lr, batches }
    }

    /// `--lr -1` was a parse error about an unexpected argument, `--lr 1e30` an optimizer's
    /// message about its config: both now name --lr and why.
    #[test]
    fn a_rate_out_of_range_is_refused_naming_lr() {
        for (lr, why) in [
            ("-1", "greater than 0"),
            ("1e30", "[1.2e-38, 1.8e19]"),
            ("nan", "finite"),
        ] {
            let err = check_args(&args(&["--lr", lr])).unwrap_err().to_string();
            assert!(err.contains("--lr") && err.contains(why), "{lr}: {err}");
        }
        assert!(check_args(&args(&["--lr", "0.02"])).is_ok());
    }

    #[test]
    fn a_fresh_run_trains_at_lr_or_the_default() {
        assert_eq!(
            learning_rate(&args(&[]), None),
            (DEFAULT_LR, "0.003".into())
        );
        assert_eq!(
            learning_rate(&args(&["--lr", "0.01"]), None),
            (0.01, "0.01".into())
        );
    }

    /// The unsharded reference trains at the returned rate: a resume of a run saved at 0.01
    /// must not compare against one at the default (or at an ignored --lr).
    #[test]
    fn a_resumed_run_trains_at_its_checkpoints_rate_and_says_so() {
        let saved = resumed(Some(0.01), 2);
        let (lr, text) = learning_rate(&args(&[]), Some(&saved));
        assert_eq!((lr, text.as_str()), (0.01, "0.01 (the checkpoint's)"));
        let (lr, text) = learning_rate(&args(&["--lr", "0.1"]), Some(&saved));
        assert_eq!(lr, 0.01);
        assert!(text.contains("--lr 0.1 is ignored"), "{text}");
        let (_, text) = learning_rate(&args(&["--lr", "0.01"]), Some(&saved));
        assert!(!text.contains("ignored"), "{text}");
        // An optimizer that saved no rate: --lr (or the default) applies.
        let (lr, _) = learning_rate(&args(&["--lr", "0.1"]), Some(&resumed(None, 2)));
        assert_eq!(lr, 0.1);
    }

    #[test]
    fn mpi_with_the_model_on_the_gpu_is_refused_before_the_gpu_is_opened() {
        let err = check_args(&args(&["--device", "cuda", "--comm", "mpi"]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("MPI moves host memory"), "{err}");
        assert!(check_args(&args(&["--device", "cuda", "--comm", "nccl"])).is_ok());
    }

    #[test]
    fn a_resume_already_past_the_steps_is_refused_up_front() {
        let saved = resumed(Some(0.01), 20);
        assert!(saved.check_steps(20).is_ok());
        let err = saved.check_steps(10).unwrap_err().to_string();
        assert!(
            err.contains("already past them (20 batches consumed)"),
            "{err}"
        );
    }
}
