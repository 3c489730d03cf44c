//! The GPU backend (feature `cuda`): a gated CUDA device, NVRTC kernels from `kernels/*.cu`
//! compiled at first use and cached per device, cuBLAS, element ops on device runs (`ops`), and
//! device memory in the one collective trait (`collective`) with two backends: NCCL (`nccl`)
//! and thread ranks on one GPU (`threads`); these modules exist in `cuda` builds.
//!
//! # The gate
//! cudarc loads the driver, NVRTC and cuBLAS libraries at run time (so the crate builds and
//! starts on machines without CUDA), but a missing library makes its first call **panic**
//! instead of returning an error (`reference/rust-stack.md` §1.2). Every entry point of this
//! module therefore goes through [`Device::open`], which first asks cudarc whether the
//! library can be loaded (`is_culib_present`, which only tries `dlopen` and never panics), and
//! wraps each later first use of a library (driver, NVRTC, cuBLAS) the same way, with
//! `catch_unwind` as a second line of defence. So users get
//! [`Error::CudaUnavailable`](crate::Error::CudaUnavailable), never a panic.
//!
//! # Kernels
//! One `.cu` file per operation under `kernels/` (`KernelSource` constants), embedded
//! with `include_str!`, compiled by NVRTC for the device's own architecture the first time one
//! of its entry points is asked for (`Device::function`), and kept for the device's
//! lifetime. Options: `--fmad=false` (no contraction of `a*b + c` into an FMA, which would
//! round once instead of twice), `--prec-div=true`, `--prec-sqrt=true` (IEEE-exact `/` and
//! `sqrtf`, NVRTC's defaults, stated anyway) and `--ftz=false` (subnormals kept, as on the CPU).
//! With these, a kernel that performs the same `f32` operations in the same order as the CPU
//! path gives the same bits. `powf`, `expf` and the like are not correctly rounded on CUDA: no
//! kernel uses them; such scalars are computed on the host in `f64`, as the CPU path does.
//! `RAGGED_KERNEL_DIR=<folder>` makes every kernel's source be read from that folder instead
//! (said on stderr): kernel work on a GPU machine without a Rust toolchain.
//!
//! Without the `cuda` feature this module is a stub whose [`Device::open`] returns
//! `Err(CudaUnavailable)`, so generic code needs no `#[cfg]`.

#[cfg(feature = "cuda")]
mod imp;
#[cfg(feature = "cuda")]
pub use imp::*;

#[cfg(feature = "cuda")]
pub mod collective;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod ops;
#[cfg(feature = "cuda")]
pub mod scratch;
#[cfg(feature = "cuda")]
pub use scratch::Scratch;
#[cfg(feature = "cuda")]
pub mod threads;
#[cfg(feature = "cuda")]
pub mod watchdog;

#[cfg(not(feature = "cuda"))]
mod stub {
    use crate::{Error, Result};

    /// Placeholder for the CUDA device of a build without the `cuda` feature.
    #[derive(Debug)]
    pub struct Device {
        _private: (),
    }

    impl Device {
        /// Always `Err(CudaUnavailable)`: this build has no GPU backend.
        pub fn open(_ordinal: usize) -> Result<Device> {
            Err(Error::CudaUnavailable {
                op: "cuda::Device::open",
                reason: "ragged was built without the `cuda` feature (cargo build --features cuda)"
                    .into(),
            })
        }
    }
}
#[cfg(not(feature = "cuda"))]
pub use stub::Device;
