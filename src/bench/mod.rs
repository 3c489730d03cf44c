//! Benchmarks shared by `ragged bench` and `cargo bench`.

pub mod plan;
