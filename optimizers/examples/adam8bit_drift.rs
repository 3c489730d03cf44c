//! 8-bit Adam's drift from fp32 Adam (AdamW at weight decay 0) on the three standard seeded
//! streams ([`ragged_optimizers::drift`]), and optionally the streams themselves for another
//! implementation.
//!
//! `cargo run --release -p ragged-optimizers --example adam8bit_drift [-- OUT_DIR]`
//! prints the drifts; with `OUT_DIR` it also writes `OUT_DIR/<structure>/stream.bin` and
//! `stream.json` (what `scripts/adam8bit_vs_bnb.py` reads).

use ragged_optimizers::drift::{DriftStream, GradStructure, DRIFT_LR};
use ragged_optimizers::{Adam8bit, Adam8bitConfig, AdamW, AdamWConfig};

fn main() -> ragged::Result<()> {
    let adam = AdamWConfig {
        lr: DRIFT_LR,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let fp32 = AdamW::new(adam)?;
    let eight_bit = Adam8bit::new(Adam8bitConfig {
        adam,
        ..Adam8bitConfig::default()
    })?;
    let out = std::env::args().nth(1);
    for structure in GradStructure::ALL {
        let stream = DriftStream::standard(structure)?;
        let drift = stream.relative_drift(&stream.run(&eight_bit)?, &stream.run(&fp32)?)?;
        println!(
            "stream {:<9}: ragged Adam8bit drift from fp32 Adam {drift:.5}",
            structure.name()
        );
        if let Some(dir) = &out {
            let dir = std::path::Path::new(dir).join(structure.name());
            stream.write(&dir, structure, Some(drift))?;
        }
    }
    if let Some(dir) = out {
        println!("wrote {dir}/<structure>/stream.bin and stream.json");
    }
    Ok(())
}
