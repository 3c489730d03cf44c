//! Muon steps on demand, for a comparison that interleaves them with another process's steps
//! so that both see the same machine load: the 28 matrices of
//! [`ragged_optimizers::bench::llama_stack`]`(1024, 4)` (the `bench optim` row), one
//! `Optimizer::step` per line `step` read on stdin, its seconds printed on stdout; `quit` or
//! end of input stops. The first (untimed) step runs before `ready` is printed.
//!
//! `cargo run --release -p ragged-optimizers --example muon_steps -- [muon | muon-bf16] [d]`
//! (`scripts/muon_vs_torch.py --interleave` drives it next to `torch.optim.Muon`).

use std::io::{BufRead, Write};
use std::time::Instant;

use ragged_optimizers::bench::{kernel_name, llama_stack, Case, OptimKind};

fn main() -> ragged::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let kind: OptimKind = args.first().map_or(Ok(OptimKind::Muon), |s| s.parse())?;
    let d = match args.get(1) {
        Some(s) => s.parse().map_err(|_| ragged::Error::BadInput {
            op: "muon_steps",
            what: s.clone(),
            reason: "d must be a positive integer".into(),
        })?,
        None => 1024,
    };
    let set = llama_stack(d, 4);
    let mut case = Case::new(kind, &set)?;
    case.step()?;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "ready {kind} {} | {}", set.name, kernel_name(kind));
    let _ = out.flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        match line.trim() {
            "step" => {
                let t = Instant::now();
                case.step()?;
                let _ = writeln!(out, "{}", t.elapsed().as_secs_f64());
                let _ = out.flush();
            }
            "quit" => break,
            _ => {}
        }
    }
    Ok(())
}
