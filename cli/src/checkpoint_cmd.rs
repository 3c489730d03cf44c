//! `ragged checkpoint info|verify|export`: look at, check and convert a checkpoint folder
//! without a training world.

use std::path::PathBuf;

use clap::Subcommand;
use indicatif::{ProgressBar, ProgressStyle};
use ragged::checkpoint::{fs, read, Manifest};
use ragged::Result;

use crate::print::printable;
use ragged::settings;

#[derive(Subcommand)]
pub enum CheckpointCommand {
    /// What a checkpoint holds: step, world, layout, optimizer, tensors, files.
    Info {
        /// A checkpoint folder, or a root holding `step-N` folders (the newest is taken).
        path: PathBuf,
    },
    /// Read every byte of every rank file and check it against the manifest's checksums.
    Verify {
        /// A checkpoint folder, or a root holding `step-N` folders (the newest is taken).
        path: PathBuf,
    },
    /// Write the parameters to one safetensors file (f32, the model's names) that candle and
    /// Hugging Face tools load, one tensor in memory at a time.
    Export {
        /// A checkpoint folder, or a root holding `step-N` folders (the newest is taken).
        path: PathBuf,
        /// The safetensors file to write (an existing one is replaced only if it is a writable
        /// safetensors or empty file; never inside or named as a checkpoint folder).
        out: PathBuf,
    },
}

/// `n` and `noun`, plural unless `n` is 1 ("1 rank", "3 ranks").
fn count(n: usize, noun: &str) -> String {
    match n {
        1 => format!("1 {noun}"),
        _ => format!("{n} {noun}s"),
    }
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let style = format!("{what} {{bar:30}} {{pos}}/{{len}} {{msg}} [{{elapsed}}]");
    ProgressBar::new(len).with_style(ProgressStyle::with_template(&style).expect("valid template"))
}

pub fn run(cmd: &CheckpointCommand) -> Result<()> {
    match cmd {
        CheckpointCommand::Info { path } => info(path),
        CheckpointCommand::Verify { path } => {
            let dir = fs::resolve(path)?;
            let m = Manifest::read(&dir)?;
            let b = bar(m.files.len() as u64, "verify");
            let bytes = read::verify(&dir, |file, _| {
                b.set_message(file.to_string());
                b.inc(1);
            })?;
            b.finish_and_clear();
            outln!(
                "{}: {}, {bytes} bytes, every checksum matches",
                dir.display(),
                count(m.files.len(), "file")
            )?;
            Ok(())
        }
        CheckpointCommand::Export { path, out } => {
            let dir = fs::resolve(path)?;
            let m = Manifest::read(&dir)?;
            let b = bar(m.model.len() as u64, "export");
            read::export(&dir, out, |name| {
                b.set_message(name.to_string());
                b.inc(1);
            })?;
            b.finish_and_clear();
            outln!(
                "wrote {} of {} to {}",
                count(m.model.len(), "tensor"),
                dir.display(),
                out.display()
            )?;
            Ok(())
        }
    }
}

/// Recorded settings (a config's `Debug` text), a field a line.
fn print_settings(text: &str) -> Result<()> {
    match settings::fields(text) {
        Some(fields) => {
            for (path, value) in fields {
                outln!("    {} = {}", printable(&path), printable(&value))?;
            }
        }
        None if text.is_empty() => {}
        None => outln!("    {}", printable(text))?,
    }
    Ok(())
}

fn info(path: &std::path::Path) -> Result<()> {
    let dir = fs::resolve(path)?;
    let m = Manifest::read(&dir)?;
    // Checked: a manifest is input, and a wrapped sum would print a plausible wrong number.
    const OP: &str = "checkpoint info";
    let overflow = |what: &str| ragged::Error::BadInput {
        op: OP,
        what: format!("{} in {}", what, dir.display()),
        reason: "the sum overflows: the manifest is damaged".into(),
    };
    let params = m.model.iter().try_fold(0usize, |sum, t| {
        let n = ragged::limits::checked_product(OP, &t.name, &t.shape)?;
        sum.checked_add(n)
            .ok_or_else(|| overflow("the parameter count"))
    })?;
    let bytes = m
        .files
        .iter()
        .try_fold(0u64, |sum, f| sum.checked_add(f.digest.bytes))
        .ok_or_else(|| overflow("the file sizes"))?;
    let p = &m.progress;
    outln!("{}", dir.display())?;
    outln!("  format {} version {}", m.format, m.version)?;
    outln!(
        "  {}, {} layout, {}",
        count(m.world, "rank"),
        m.layout,
        count(m.units.len(), "unit")
    )?;
    outln!(
        "  model: {}, {}",
        count(m.model.len(), "tensor"),
        count(params, "parameter")
    )?;
    outln!("  optimizer: {}", printable(&m.optimizer.name))?;
    print_settings(&m.optimizer.config)?;
    outln!(
        "  steps {} (skipped {}), optimizer step {}, learning rate {}",
        p.steps,
        p.skipped,
        p.state_step,
        p.learning_rate.map_or("none".into(), |lr| lr.to_string())
    )?;
    if let Some(s) = &p.schedule {
        outln!("  schedule: {s}")?;
    }
    if let Some(t) = &m.training {
        if let Some(run) = &t.run {
            outln!("  run: {}", printable(run))?;
        }
        outln!("  fsdp:")?;
        print_settings(&t.fsdp)?;
        // The caller's strings, escaped: a newline or a terminal control must not print as one.
        for (key, value) in &t.metadata {
            outln!("  {}: {}", printable(key), printable(value))?;
        }
    }
    let mut fields: Vec<&str> = m.fields.iter().map(|f| f.field.as_str()).collect();
    fields.sort_unstable();
    fields.dedup();
    outln!("  arrays per parameter: {}", fields.join(", "))?;
    outln!("  {}, {bytes} bytes", count(m.files.len(), "rank file"))?;
    Ok(())
}
