//! `ragged validate`: the numerics contract on a model (argument parsing only; the checks are
//! `ragged_optimizers::validate`).

use clap::Args;
use ragged::model::{Inventory, Unit};
use ragged::{Error, Result};
use ragged_optimizers::bench::OptimKind;
use ragged_optimizers::validate::{
    check_config, render, scaled, validate, LayoutKind, ValidateConfig,
};

use crate::print::{print_stdout, printable};

#[derive(Args)]
pub struct ValidateArgs {
    /// A preset (llama3_8b, llama3_70b, gpt_oss_20b, gpt_oss_120b, deepseek_v3_671b), an
    /// inventory JSON file (format: models/README.md) or a .safetensors file (its header).
    #[arg(long)]
    model: String,
    /// adamw, adam8bit, muon, muon-bf16 or shampoo.
    #[arg(long)]
    optimizer: OptimKind,
    /// World sizes, comma-separated.
    #[arg(long, default_value = "1,2,3,4,8", value_delimiter = ',')]
    worlds: Vec<usize>,
    /// Layouts, comma-separated: ragged (the optimizer's own plan), fsdp2.
    #[arg(long, default_value = "ragged,fsdp2", value_delimiter = ',')]
    layouts: Vec<LayoutKind>,
    /// Optimizer steps on seeded gradients.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Divide every dimension by this (rounded up), to validate a large model quickly.
    #[arg(long, default_value_t = 1)]
    scale: usize,
    /// Validate only the first N FSDP units (default: all).
    #[arg(long)]
    units: Option<usize>,
    /// Seed of the parameters and gradients.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also require the same optimizer state bits (every field, in global order) at every
    /// world size and layout as unsharded.
    #[arg(long)]
    mesh_invariance: bool,
}

/// Runs the checks, prints the report, and returns `Err` on any breach (exit status 1).
pub fn run(args: &ValidateArgs) -> Result<()> {
    let cfg = ValidateConfig {
        optimizer: args.optimizer,
        worlds: args.worlds.clone(),
        layouts: args.layouts.clone(),
        steps: args.steps,
        seed: args.seed,
        mesh_invariance: args.mesh_invariance,
    };
    // Before the model is read and scaled: a bad world list is refused without that work.
    check_config(&cfg)?;
    let inv = Inventory::load(&args.model)?;
    let small = Inventory {
        model: inv.model.clone(),
        tensors: scaled(&inv.tensors, args.scale)?,
    };
    let mut units: Vec<Unit> = small.units();
    if let Some(n) = args.units {
        units.truncate(n);
    }
    outln!(
        "validate {} ({} units, dimensions ÷ {}) with {}, {} steps",
        printable(&inv.model),
        units.len(),
        args.scale,
        args.optimizer,
        args.steps
    )?;
    let report = validate(&units, &cfg)?;
    print_stdout(&render(&report))?;
    match report.breaches() {
        0 => Ok(()),
        n => Err(Error::Msg(format!("{n} breaches of the numerics contract"))),
    }
}
