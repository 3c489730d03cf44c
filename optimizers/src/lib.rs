//! ragged-optimizers: optimizers that step on one rank's local shard of a ragged plan.
//!
//! Each optimizer implements [`ragged::optim::Optimizer`]: it names the atomic block each
//! parameter needs, lays its state out like the local shard, and updates only the pieces the
//! rank owns. Shaped like optax: an optimizer value holds hyperparameters, its state is a
//! struct of `pub` fields, and named optimizers are compositions of the shared numerics
//! pieces in [`common`].
//!
//! | optimizer | file | atomic block | reference numerics |
//! |---|---|---|---|
//! | [`AdamW`] | [`adamw`] | `Element` | `torch.optim.AdamW` (single-tensor, fp32) |
//! | [`Muon`] | [`muon`], [`muon_layout`], [`roots`], [`newton_schulz`] | `Matrix` (`Whole` for a tensor Muon flattens to one matrix: [`MuonConfig::flattens`]), or `Element` where [`muon_layout`]'s cost model splits a matrix (then gathered to a root); AdamW fallback: `Element` | `torch.optim.Muon` (fp32 NS by default; bf16 NS on oneDNN/AMX with `NsPrecision::Bf16`) |
//! | [`Adam8bit`] | [`adam8bit`], [`quant`], [`drift`] | `Tile { 32, 32 }` (32 whole rows; `Matrix` for stacked matrices with `m % 32 ≠ 0`; `Element` for the fp32 fallback) | bitsandbytes 8-bit Adam, CPU-backend order, 256-element scale blocks inside 32-row blocks of the global shape, 16-bit scales, positive-`v` floor |
//! | [`Shampoo`] | [`shampoo`] | `Rows(max_preconditioner_dim)` (blocks of ≤ d rows × ≤ d columns, each local) | facebookresearch/optimizers `DistributedShampoo` (eigh root inverse, grafting, fp32 factors) |
//!
//! Newton–Schulz runs on the kernels in [`kernels`]: `f32` on the `gemm` crate (AVX-512), bf16
//! on ragged's own AMX tile products ([`kernels::amx_bf16`]) where the CPU has AMX, else on
//! oneDNN's matmul primitive when `libdnnl.so.2` loads at run time and has bf16 matmul here,
//! else a portable bf16 path; [`NsConfig`] picks precision and backend, [`ns_backend_info`]
//! reports what runs.
//!
//! Numerics contract: given the same gradients, a sharded step equals the unsharded step
//! bitwise at every world size and layout (`tests/adamw_tests.rs`, `tests/adam8bit_tests.rs`,
//! `tests/muon_tests.rs`, `tests/shampoo_tests.rs`).

pub mod adam8bit;
pub mod adamw;
pub mod bench;
pub mod common;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod drift;
pub mod kernels;
pub mod muon;
pub mod muon_layout;
pub mod newton_schulz;
pub mod peak_probe;
pub mod quant;
pub mod roots;
pub mod shampoo;
pub mod state_io;
pub mod validate;
pub mod validate_f64;

pub use adam8bit::{Adam8bit, Adam8bitConfig, Adam8bitKernel, Adam8bitState, Tiling};
pub use adamw::{AdamState, AdamW, AdamWConfig, DecayRule};
pub use muon::{LrScale, Muon, MuonConfig, MuonState};
pub use muon_layout::{LayoutReport, MatrixLayout, TensorChoice};
pub use newton_schulz::{
    ns_backend_info, orthogonalize, orthogonalize_batch, NsBackend, NsBackendInfo, NsConfig,
    NsMethod, NsPrecision, DION_QUINTIC, POLAR_EXPRESS, QUINTIC,
};
pub use shampoo::{inverse_root, inverse_root_f64, Grafting, Shampoo, ShampooConfig, ShampooState};
