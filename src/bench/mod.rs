//! Benchmarks shared by `ragged bench` and `cargo bench`.

pub mod comm;
pub mod plan;
