//! The `ragged` command-line tool: `ragged plan`, `ragged bench`, `ragged validate` and
//! `ragged checkpoint`.

// First: the `outln!` macro is used by the modules below.
#[macro_use]
extern crate ragged; // outln!
mod print;

mod bench_cmd;
mod checkpoint_cmd;
mod flags;
#[cfg(test)]
mod fuzz_tests;
mod plan_cmd;
mod validate_cmd;

use clap::{Parser, Subcommand};

/// Heap bytes counted, so `bench train` measures memory per rank.
#[global_allocator]
static ALLOC: ragged::bench::alloc::Counting = ragged::bench::alloc::Counting;

#[derive(Parser)]
#[command(
    name = "ragged",
    version,
    about = "RaggedShard layouts and sharded optimizers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Plan a model's FSDP layout and compare it with FSDP2, Megatron-FSDP, FSDP1 and ZeRO-3.
    Plan(plan_cmd::PlanArgs),
    /// Run a benchmark and write its table.
    #[command(subcommand)]
    Bench(bench_cmd::BenchCommand),
    /// Check the numerics contract on a model: sharded vs unsharded, f64 reference.
    Validate(validate_cmd::ValidateArgs),
    /// Inspect, verify or export a checkpoint folder (no training world needed).
    #[command(subcommand)]
    Checkpoint(checkpoint_cmd::CheckpointCommand),
}

fn main() {
    // `ragged checkpoint info | head -1` ends quietly.
    ragged::demo::end_quietly_when_stdout_closes();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(args) => plan_cmd::run(&args),
        Command::Bench(cmd) => bench_cmd::run(&cmd),
        Command::Validate(args) => validate_cmd::run(&args),
        Command::Checkpoint(cmd) => checkpoint_cmd::run(&cmd),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
