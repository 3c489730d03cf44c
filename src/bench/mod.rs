//! Benchmarks shared by `ragged bench` and `cargo bench`.

pub mod alloc;
pub mod checkpoint;
pub mod comm;
pub mod plan;
pub mod train;
