//! The main job: train a small transformer with its state sharded over N thread ranks, then
//! train the same model unsharded and report how far the two drifted apart.
//!
//! `cargo run --release --example train -- --ranks 4 --steps 30`

use std::time::Instant;

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use ragged::comm::threads::ThreadWorld;
use ragged::comm::{Communicator, SingleRank};
use ragged::demo::{train_rank, StepReport, TransformerConfig};
use ragged::fsdp::{inventory_of, FsdpOptions, ShardLayout};
use ragged::optim::Optimizer;
use ragged::{AtomicBlock, Result};
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

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Size {
    Small,
    Tiny,
}

#[derive(Parser, Debug)]
#[command(about = "Sharded training of a small transformer on thread ranks")]
struct Args {
    /// Number of thread ranks sharing the model.
    #[arg(long, default_value_t = 4)]
    ranks: usize,
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
    /// Optimizer: AdamW; Muon (embedding and head on AdamW); 8-bit Adam on 32x32 tiles;
    /// blocked Shampoo with Adam grafting.
    #[arg(long, value_enum, default_value_t = Opt::Adamw)]
    optimizer: Opt,
    /// Learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Free the unsharded buffers between steps (keep only local shards).
    #[arg(long)]
    reshard_after_forward: bool,
    /// Skip the unsharded reference run.
    #[arg(long)]
    no_reference: bool,
    /// Muon only: keep matrices whole, let the planner split them (gather-to-root), or choose
    /// per matrix by the byte cost model.
    #[arg(long, value_enum, default_value_t = MuonLayout::Auto)]
    muon_layout: MuonLayout,
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
        adamw_patterns: vec!["embed".into(), "head".into()],
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

fn main() -> Result<()> {
    let args = Args::parse();
    match args.optimizer {
        Opt::Adamw => run(&args, adamw),
        Opt::Muon => {
            if matches!(args.layout, Layout::Ragged) {
                print_muon_layout(&args)?;
            }
            let layout = args.muon_layout;
            run(&args, move |lr| muon(lr, layout))
        }
        Opt::Adam8bit => run(&args, adam8bit),
        Opt::Shampoo => run(&args, shampoo),
    }
}

fn model_config(size: Size) -> TransformerConfig {
    match size {
        Size::Small => TransformerConfig::SMALL,
        Size::Tiny => TransformerConfig::TINY,
    }
}

/// Muon's per-unit choice of whole or split matrices, and what it costs on the wire.
fn print_muon_layout(args: &Args) -> Result<()> {
    let params = model_config(args.size).init_params(0)?;
    let inventory = inventory_of(&params)?;
    let opt = muon(args.lr, args.muon_layout)?;
    let (mut split, mut total, mut bytes) = (0, 0, 0);
    for unit in inventory.units() {
        let (_, report) = opt.plan_layout(&unit, args.ranks, &FsdpOptions::default().plan)?;
        total += report.tensors.len();
        split += report
            .tensors
            .iter()
            .filter(|t| t.block != AtomicBlock::Matrix)
            .count();
        bytes += report.cost_bytes();
    }
    println!(
        "muon layout ({:?}): {split} of {total} matrices split over ranks (gathered to LPT \
         roots); padding + root traffic {:.2} MB per step",
        args.muon_layout,
        bytes as f64 / 1e6
    );
    Ok(())
}

fn run<O: Optimizer>(args: &Args, optimizer: impl Fn(f64) -> Result<O> + Sync) -> Result<()> {
    let cfg = model_config(args.size);
    let params = cfg.init_params(0)?;
    let n_params: usize = params.iter().map(|(_, t)| t.elem_count()).sum();
    let opts = FsdpOptions {
        layout: match args.layout {
            Layout::Ragged => ShardLayout::Ragged,
            Layout::Fsdp2 => ShardLayout::Fsdp2,
        },
        reshard_after_forward: args.reshard_after_forward,
        ..FsdpOptions::default()
    };
    println!(
        "model: {n_params} parameters; {} ranks, {:?} layout, {:?} lr {}, global batch {} x {} tokens",
        args.ranks, args.layout, args.optimizer, args.lr, args.batch, cfg.seq_len
    );

    let bar = ProgressBar::new(args.steps as u64).with_style(
        ProgressStyle::with_template("sharded   {bar:30} {pos}/{len} {msg} [{elapsed}]")
            .expect("valid template"),
    );
    let started = Instant::now();
    let results = ThreadWorld::run(args.ranks, |comm| {
        let progress = |step: usize, r: &StepReport| {
            if comm.rank() == 0 {
                bar.set_position(step as u64 + 1);
                bar.set_message(format!("loss {:.4}", r.loss));
            }
        };
        let opt = optimizer(args.lr)?;
        train_rank(
            cfg,
            &params,
            opt,
            comm,
            opts.clone(),
            args.steps,
            args.batch,
            progress,
        )
    })?;
    bar.finish();
    let sharded_time = started.elapsed().as_secs_f64();
    let (sharded, full) = results.into_iter().next().expect("rank 0");

    if args.no_reference {
        print_table(&sharded, None);
        return Ok(());
    }
    let bar = ProgressBar::new(args.steps as u64).with_style(
        ProgressStyle::with_template("unsharded {bar:30} {pos}/{len} {msg} [{elapsed}]")
            .expect("valid template"),
    );
    let progress = |step: usize, r: &StepReport| {
        bar.set_position(step as u64 + 1);
        bar.set_message(format!("loss {:.4}", r.loss));
    };
    let reference_opts = FsdpOptions {
        layout: ShardLayout::Ragged,
        ..FsdpOptions::default()
    };
    let opt = optimizer(args.lr)?;
    let (reference, ref_full) = train_rank(
        cfg,
        &params,
        opt,
        &SingleRank,
        reference_opts,
        args.steps,
        args.batch,
        progress,
    )?;
    bar.finish();
    print_table(&sharded, Some(&reference));
    let max_diff = full
        .iter()
        .flat_map(|(name, v)| v.iter().zip(&ref_full[name]).map(|(a, b)| (a - b).abs()))
        .fold(0f32, f32::max);
    println!(
        "\nsharded run {sharded_time:.1} s; bytes copied outside collectives: {}",
        sharded.last().map_or(0, |r| r.copied_bytes)
    );
    println!(
        "max |parameter difference| sharded vs unsharded after {} steps: {max_diff:.3e}",
        args.steps
    );
    Ok(())
}

fn print_table(sharded: &[StepReport], reference: Option<&Vec<StepReport>>) {
    println!(
        "\n{:>5} {:>12} {:>12} {:>10} {:>9}",
        "step", "loss", "unsharded", "|diff|", "step s"
    );
    for (i, r) in sharded.iter().enumerate() {
        let (u, d) = match reference {
            Some(rf) => (
                format!("{:.6}", rf[i].loss),
                format!("{:.2e}", (rf[i].loss - r.loss).abs()),
            ),
            None => ("-".into(), "-".into()),
        };
        println!(
            "{:>5} {:>12.6} {:>12} {:>10} {:>9.3}",
            i, r.loss, u, d, r.seconds
        );
    }
}
