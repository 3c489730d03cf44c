//! A model nobody here wrote: candle-transformers 0.11.1's Llama (tiny config: 2 layers,
//! hidden 64, 4 heads, vocabulary 128, 16 positions) trained through `fully_shard` on thread
//! ranks, each rank on its own rows of every batch, then unsharded from the same start.
//!
//! `cargo run --release --example llama -- --ranks 3 --optimizer muon`
//!
//! Parameters, names and initialization come from candle-transformers' `Llama::load`; the
//! forward pass is `support/llama.rs` (candle-transformers' kernels are forward only: see
//! there and the README's "A real model").

#[path = "support/llama.rs"]
mod llama;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use clap::{Parser, ValueEnum};
use ragged::comm::threads::ThreadWorld;
use ragged::comm::{BufMut, Communicator, ReduceOp, SingleRank};
use ragged::fsdp::{fully_shard, FsdpOptions};
use ragged::limits::even_share;
use ragged::optim::Optimizer;
use ragged::schedule::Schedule;
use ragged::Result;
use ragged_optimizers::{Adam8bit, Adam8bitConfig, AdamWConfig, Muon, MuonConfig};

use llama::{llama_params, tiny_config, DiffLlama};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Opt {
    Muon,
    Adam8bit,
}

#[derive(Parser, Debug)]
#[command(about = "Train candle-transformers' Llama (tiny) sharded over thread ranks")]
struct Args {
    /// Thread ranks the model is sharded over.
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Optimizer of the sharded and the unsharded run.
    #[arg(long, value_enum, default_value_t = Opt::Muon)]
    optimizer: Opt,
    /// Training steps (each compared with the unsharded run's).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Global batch: sequences of 16 tokens per step, split evenly over the ranks.
    #[arg(long, default_value_t = 12)]
    batch: usize,
}

/// The step's sequences: byte windows of the demo corpus, folded into the 128-token vocabulary.
fn batch(step: usize, first: usize, rows: usize) -> Result<Tensor> {
    let text = ragged::demo::corpus()?;
    let span = text.len() - 16;
    let ids: Vec<u32> = (first..first + rows)
        .flat_map(|r| {
            let at = (step * 7919 + r * 104_729) % span;
            text[at..at + 16].iter().map(|&b| u32::from(b % 128))
        })
        .collect();
    Ok(Tensor::from_vec(ids, (rows, 16), &Device::Cpu)?)
}

/// One rank's run: the start-up table (rank 0), then `steps` steps on its rows; returns the
/// mean loss over ranks per step and the final full parameters.
fn train<O: Optimizer>(
    args: &Args,
    opt: O,
    comm: &dyn Communicator,
    show_table: bool,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let params = llama_params(&tiny_config(), 0)?;
    let mut sharded = fully_shard(&params, opt, comm, FsdpOptions::default())?;
    sharded.set_schedule(Schedule::WarmupCosine {
        warmup: args.steps.min(2),
        total: args.steps,
        min_factor: 0.1,
    })?;
    if show_table && comm.rank() == 0 {
        println!("{}\n", sharded.describe());
    }
    let vb = VarBuilder::from_tensors(sharded.unshard()?, DType::F32, &Device::Cpu);
    let model = DiffLlama::load(vb, &tiny_config())?;
    let rows = args.batch / comm.world_size();
    let mut losses = Vec::new();
    for step in 0..args.steps {
        sharded.unshard()?; // rewrites the model's tensors in place
        let loss = model.loss(&batch(step, comm.rank() * rows, rows)?)?;
        loss.backward()?;
        sharded.reduce_gradients()?;
        sharded.clip_grad_norm(1.0)?;
        sharded.step()?;
        let mut l = [loss.to_scalar::<f32>()?];
        comm.all_reduce(BufMut::F32(&mut l), ReduceOp::Avg)?;
        losses.push(l[0]);
    }
    let mut full: Vec<(String, Vec<f32>)> = sharded.full_params()?.into_iter().collect();
    full.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((losses, full.into_iter().flat_map(|(_, v)| v).collect()))
}

fn run<O: Optimizer>(args: &Args, opt: impl Fn() -> Result<O> + Sync) -> Result<()> {
    let sharded = ThreadWorld::run(args.ranks, |c| train(args, opt()?, c, true))?;
    let (losses, params) = &sharded[0];
    let (ref_losses, ref_params) = train(args, opt()?, &SingleRank, false)?;
    println!(" step   loss (V={})   unsharded", args.ranks);
    for (s, (a, b)) in losses.iter().zip(&ref_losses).enumerate() {
        println!("{s:5} {a:13.6} {b:11.6}");
    }
    let diff = params
        .iter()
        .zip(&ref_params)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, |m, d| if d.is_nan() { f32::NAN } else { m.max(d) });
    println!("max |parameter difference| sharded vs unsharded: {diff:.3e}");
    Ok(())
}

fn main() -> std::process::ExitCode {
    ragged::demo::end_quietly_when_stdout_closes();
    let args = Args::parse();
    let result =
        even_share("llama", "--batch", args.batch, args.ranks).and_then(|_| match args.optimizer {
            Opt::Muon => run(&args, || {
                Muon::new(MuonConfig {
                    lr: 0.02,
                    adamw: AdamWConfig {
                        lr: 3e-3,
                        ..AdamWConfig::default()
                    },
                    ..MuonConfig::default()
                })
            }),
            Opt::Adam8bit => run(&args, || {
                Adam8bit::new(Adam8bitConfig {
                    adam: AdamWConfig {
                        lr: 3e-3,
                        ..AdamWConfig::default()
                    },
                    ..Adam8bitConfig::default()
                })
            }),
        });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
