//! The gated device, the kernel cache and small memory helpers (see the module doc in
//! `cuda/mod.rs`).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

pub use cudarc;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use cudarc::nvrtc::CompileOptions;

use crate::error::panic_text;
use crate::{Error, Result};

/// A CUDA C source under `kernels/`, embedded in the binary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelSource {
    /// File name under `kernels/` (also the cache key).
    pub name: &'static str,
    /// The source text.
    pub src: &'static str,
}

/// `kernels/group_ops.cu`: DBuffer zero / scale / add / copy.
pub const GROUP_OPS: KernelSource = KernelSource {
    name: "group_ops.cu",
    src: include_str!("../../kernels/group_ops.cu"),
};
/// `kernels/adamw.cu`: the fused AdamW update.
pub const ADAMW: KernelSource = KernelSource {
    name: "adamw.cu",
    src: include_str!("../../kernels/adamw.cu"),
};
/// `kernels/adam8bit.cu`: 8-bit Adam on 256-element scale blocks.
pub const ADAM8BIT: KernelSource = KernelSource {
    name: "adam8bit.cu",
    src: include_str!("../../kernels/adam8bit.cu"),
};
/// `kernels/muon.cu`: Muon momentum and apply.
pub const MUON: KernelSource = KernelSource {
    name: "muon.cu",
    src: include_str!("../../kernels/muon.cu"),
};
/// `kernels/newton_schulz.cu`: transpose, Frobenius pre-normalization, bf16 conversion.
pub const NEWTON_SCHULZ: KernelSource = KernelSource {
    name: "newton_schulz.cu",
    src: include_str!("../../kernels/newton_schulz.cu"),
};

/// `kernels/reduce_ranks.cu`: the rank-ordered reduction of thread ranks on one GPU.
pub const REDUCE_RANKS: KernelSource = KernelSource {
    name: "reduce_ranks.cu",
    src: include_str!("../../kernels/reduce_ranks.cu"),
};

/// `kernels/shampoo.cu`: Shampoo's moments, `f64`-lane products, grafting and update.
pub const SHAMPOO: KernelSource = KernelSource {
    name: "shampoo.cu",
    src: include_str!("../../kernels/shampoo.cu"),
};

/// Threads per block of the element-wise kernels.
pub const BLOCK: u32 = 256;

/// Whether cudarc's library `$m` (`driver`, `nvrtc`, `cublas`, `nccl`) can be used, asked
/// without letting cudarc panic (`std::thread::Result<bool>`). With dynamic loading (the `cuda`
/// feature alone) this is cudarc's probe, which tries `dlopen` on every candidate name and
/// returns false on failure: the one cudarc call that never panics on a missing library. When
/// candle's CUDA backend links the libraries instead (`candle-cuda`), a process that started
/// has them.
macro_rules! library_loads {
    ($m:ident) => {{
        #[cfg(not(feature = "candle-cuda"))]
        // SAFETY: the probe only calls dlopen on cudarc's candidate names; it dereferences
        // nothing of ours.
        let loads = std::panic::catch_unwind(|| unsafe { cudarc::$m::sys::is_culib_present() });
        #[cfg(feature = "candle-cuda")]
        let loads: std::thread::Result<bool> = Ok(true);
        loads
    }};
}
pub(crate) use library_loads;

/// Whether the CUDA driver library (`libcuda.so.1`, …) can be loaded, asked without letting
/// cudarc panic: `Err(CudaUnavailable)` with the reason otherwise. Every entry point of the
/// GPU backend calls this first ([`Device::open`]).
pub fn driver_available() -> Result<()> {
    match library_loads!(driver) {
        Ok(true) => Ok(()),
        Ok(false) => Err(Error::CudaUnavailable {
            op: "cuda::driver_available",
            reason: "the CUDA driver library (libcuda.so.1) cannot be loaded: no NVIDIA driver \
                     is installed, or it is not on the loader path (LD_LIBRARY_PATH)"
                .into(),
        }),
        Err(p) => Err(Error::CudaUnavailable {
            op: "cuda::driver_available",
            reason: format!("probing the driver library panicked: {}", panic_text(&*p)),
        }),
    }
}

fn nvrtc_available() -> Result<()> {
    match library_loads!(nvrtc) {
        Ok(true) => Ok(()),
        _ => Err(Error::CudaUnavailable {
            op: "cuda::nvrtc",
            reason: "the NVRTC library (libnvrtc.so.13) cannot be loaded: install the \
                     nvidia-cuda-nvrtc wheel or the CUDA toolkit and put its lib directory on \
                     LD_LIBRARY_PATH"
                .into(),
        }),
    }
}

fn cublas_available() -> Result<()> {
    match library_loads!(cublas) {
        Ok(true) => Ok(()),
        _ => Err(Error::CudaUnavailable {
            op: "cuda::cublas",
            reason: "the cuBLAS library (libcublas.so.13) cannot be loaded: install the \
                     nvidia-cublas wheel or the CUDA toolkit and put its lib directory on \
                     LD_LIBRARY_PATH"
                .into(),
        }),
    }
}

/// Runs a cudarc call, turning its error into [`Error::Cuda`] and a panic (a library that
/// vanished, a missing symbol) into [`Error::CudaUnavailable`].
pub fn guarded<T, E: std::fmt::Debug>(
    op: &'static str,
    f: impl FnOnce() -> std::result::Result<T, E>,
) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(x)) => Ok(x),
        Ok(Err(e)) => Err(Error::Cuda {
            op,
            reason: format!("{e:?}"),
        }),
        Err(p) => Err(Error::CudaUnavailable {
            op,
            reason: panic_text(&*p).to_string(),
        }),
    }
}

/// Every kernel source, in `kernels/`.
pub const ALL_KERNELS: [KernelSource; 7] = [
    GROUP_OPS,
    ADAMW,
    ADAM8BIT,
    MUON,
    NEWTON_SCHULZ,
    REDUCE_RANKS,
    SHAMPOO,
];

/// Compiles `src` to PTX for the virtual architecture `arch` (`compute_90`, …) with NVRTC and
/// the options of the module doc. Needs only the NVRTC library, not a GPU: `Err(CudaUnavailable)`
/// when it cannot be loaded, `Err(Cuda)` with NVRTC's log when the source does not compile.
pub fn compile(src: &KernelSource, arch: &str) -> Result<cudarc::nvrtc::Ptx> {
    const OP: &str = "cuda::compile";
    nvrtc_available()?;
    let text = kernel_text(src)?;
    let opts = CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some(src.name.to_string()),
        ..Default::default()
    };
    match catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(&*text, opts)) {
        Ok(Ok(ptx)) => Ok(ptx),
        Ok(Err(e)) => Err(Error::Cuda {
            op: OP,
            reason: format!("NVRTC failed on kernels/{}: {e:?}", src.name),
        }),
        Err(p) => Err(Error::CudaUnavailable {
            op: OP,
            reason: panic_text(&*p).to_string(),
        }),
    }
}

/// Where [`KERNEL_DIR_VAR`] is set, kernel sources are read from that folder instead of the
/// ones built in: kernel work on a GPU machine that has no Rust toolchain (edit
/// `kernels/*.cu`, carry the folder, run the built binaries' tests and benches against it).
pub const KERNEL_DIR_VAR: &str = "RAGGED_KERNEL_DIR";

/// The text of `src`: `$RAGGED_KERNEL_DIR/<name>` when that variable is set (said on stderr,
/// so no result is taken for the built-in kernel's), else the embedded source.
fn kernel_text(src: &KernelSource) -> Result<std::borrow::Cow<'static, str>> {
    kernel_text_in(src, std::env::var_os(KERNEL_DIR_VAR).as_deref())
}

/// [`kernel_text`] with the variable's value given.
fn kernel_text_in(
    src: &KernelSource,
    dir: Option<&std::ffi::OsStr>,
) -> Result<std::borrow::Cow<'static, str>> {
    let Some(dir) = dir else {
        return Ok(src.src.into());
    };
    let path = std::path::Path::new(dir).join(src.name);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::Cuda {
        op: "cuda::compile",
        reason: format!("{KERNEL_DIR_VAR}: cannot read {}: {e}", path.display()),
    })?;
    eprintln!(
        "ragged: kernels/{} read from {} ({KERNEL_DIR_VAR})",
        src.name,
        path.display()
    );
    Ok(text.into())
}

/// One CUDA device: its context, the stream every operation of this crate is queued on, the
/// compiled kernel modules and a cuBLAS handle (both created at first use).
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    modules: Mutex<HashMap<&'static str, Module>>,
    /// [`Device::memo`]'s values.
    memo: Mutex<HashMap<&'static str, Arc<dyn std::any::Any + Send + Sync>>>,
    /// Tells this device's cuBLAS handles apart in [`BLAS_HANDLES`].
    id: u64,
}

/// A compiled kernel source on a device and the entry points looked up in it so far (a
/// lookup asks the driver; a step launches the same few kernels many times).
struct Module {
    module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}

/// The next [`Device::id`].
static NEXT_DEVICE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

thread_local! {
    /// This thread's cuBLAS handle per device, made at first use and destroyed when the thread
    /// ends. One handle per thread, not per device: candle's stream is the per-thread default
    /// stream, whose handle value is the same on every thread, so thread ranks sharing one
    /// handle would look like one stream to cuBLAS and share its workspace across streams
    /// that run concurrently.
    static BLAS_HANDLES: std::cell::RefCell<HashMap<u64, Arc<CudaBlas>>> =
        std::cell::RefCell::new(HashMap::new());
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ctx.ordinal())
            .field("arch", &self.arch)
            .finish()
    }
}

/// Waits for the whole context before the device's own buffers ([`Device::memo`]'s values)
/// are freed: cudarc frees a buffer on the dropping thread's stream, which does not wait for
/// kernels other threads queued on theirs (thread ranks share one `Device` and its memoized
/// tables, and the last owner to drop it may be another thread). An error here has no caller
/// to go to; the context's next call reports it.
impl Drop for Device {
    fn drop(&mut self) {
        let _ = self.ctx.synchronize();
    }
}

impl Device {
    /// Opens device `ordinal`: `Err(CudaUnavailable)` when the driver library cannot be loaded,
    /// there is no CUDA device or fewer than `ordinal + 1`; never panics.
    pub fn open(ordinal: usize) -> Result<Device> {
        const OP: &str = "cuda::Device::open";
        driver_available()?;
        let count = guarded(OP, CudaContext::device_count).map_err(|e| Error::CudaUnavailable {
            op: OP,
            reason: format!("cuInit / cuDeviceGetCount failed ({e}): no usable CUDA device"),
        })?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::CudaUnavailable {
                op: OP,
                reason: format!("device {ordinal} asked for, {count} CUDA device(s) present"),
            });
        }
        let ctx = guarded(OP, || CudaContext::new(ordinal))?;
        let (major, minor) = guarded(OP, || ctx.compute_capability())?;
        let stream = ctx.default_stream();
        Ok(Device {
            ctx,
            stream,
            arch: format!("compute_{major}{minor}"),
            modules: Mutex::new(HashMap::new()),
            memo: Mutex::new(HashMap::new()),
            id: NEXT_DEVICE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// The device of a candle CUDA device, on candle's own stream (feature `candle-cuda`), so
    /// this crate's kernels, copies and collectives are ordered with candle's work on the same
    /// tensors without events. That stream is CUDA's per-thread default stream (candle's
    /// `CudaDevice::new`): the order holds among the work one thread issues; work another thread
    /// issues through the same handle goes to that thread's stream, so the threads must
    /// synchronize ([`Device::sync`] waits for the calling thread's).
    #[cfg(feature = "candle-cuda")]
    pub fn from_candle(dev: &candle_core::CudaDevice) -> Result<Device> {
        const OP: &str = "cuda::Device::from_candle";
        let stream = dev.cuda_stream();
        let ctx = stream.context().clone();
        let (major, minor) = guarded(OP, || ctx.compute_capability())?;
        Ok(Device {
            ctx,
            stream,
            arch: format!("compute_{major}{minor}"),
            modules: Mutex::new(HashMap::new()),
            memo: Mutex::new(HashMap::new()),
            id: NEXT_DEVICE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// The device's name (e.g. "NVIDIA H200").
    pub fn name(&self) -> Result<String> {
        guarded("cuda::Device::name", || self.ctx.name())
    }

    /// The device's streaming multiprocessors (132 on an H200), which kernels size their grids
    /// by.
    pub fn multiprocessors(&self) -> Result<usize> {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        // Asked of the driver once: launchers size their grids by it at every step.
        let n = self.memo("multiprocessors", |d| {
            let n = guarded("cuda::Device::multiprocessors", || {
                d.ctx.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            })?;
            Ok(n.max(1) as usize)
        })?;
        Ok(*n)
    }

    /// The virtual architecture kernels are compiled for (`compute_90` on an H100/H200).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The driver context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every operation of this crate is queued on (in order).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for everything queued on [`Device::stream`].
    pub fn sync(&self) -> Result<()> {
        guarded("cuda::Device::sync", || self.stream.synchronize())
    }

    /// Waits for everything queued on the device's context, by any thread on any stream
    /// (`cuCtxSynchronize`).
    pub fn sync_context(&self) -> Result<()> {
        guarded("cuda::Device::sync_context", || self.ctx.synchronize())
    }

    /// Entry point `entry` of `src`, compiling the source with NVRTC at first use (options in
    /// the module doc) and caching the module and the entry points looked up.
    pub fn function(&self, src: &KernelSource, entry: &str) -> Result<CudaFunction> {
        const OP: &str = "cuda::Device::function";
        let mut modules = self.modules.lock().map_err(|_| Error::Cuda {
            op: OP,
            reason: "kernel cache lock poisoned".into(),
        })?;
        let loaded = match modules.entry(src.name) {
            std::collections::hash_map::Entry::Occupied(m) => m.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => {
                let ptx = compile(src, &self.arch)?;
                let module = guarded(OP, || self.ctx.load_module(ptx))?;
                slot.insert(Module {
                    module,
                    functions: HashMap::new(),
                })
            }
        };
        if let Some(f) = loaded.functions.get(entry) {
            return Ok(f.clone());
        }
        let f = guarded(OP, || loaded.module.load_function(entry))?;
        loaded.functions.insert(entry.to_string(), f.clone());
        Ok(f)
    }

    /// `make`'s value for `key`, made at the first call on this device and kept while the
    /// device lives: what is the same at every step (a kernel's constant table, its launch
    /// shape), so that a step neither uploads it nor asks the driver again. A key holds one
    /// type: asking for another is an `Err`.
    pub fn memo<T: Send + Sync + 'static>(
        &self,
        key: &'static str,
        make: impl FnOnce(&Device) -> Result<T>,
    ) -> Result<Arc<T>> {
        const OP: &str = "cuda::Device::memo";
        let lock = || {
            self.memo.lock().map_err(|_| Error::Cuda {
                op: OP,
                reason: "memo lock poisoned".into(),
            })
        };
        let kept = lock()?.get(key).cloned();
        let value = match kept {
            Some(v) => v,
            None => {
                // Made without the lock held (a `make` may ask for another memo); of two
                // threads making one key at once, the first to store it wins.
                let made: Arc<dyn std::any::Any + Send + Sync> = Arc::new(make(self)?);
                lock()?.entry(key).or_insert(made).clone()
            }
        };
        value.downcast::<T>().map_err(|_| Error::Cuda {
            op: OP,
            reason: format!("`{key}` holds a value of another type"),
        })
    }

    /// The calling thread's cuBLAS handle on [`Device::stream`], created at its first use
    /// (one per thread: see `BLAS_HANDLES`).
    pub fn blas(&self) -> Result<Arc<CudaBlas>> {
        const OP: &str = "cuda::Device::blas";
        if let Some(b) = BLAS_HANDLES.with(|h| h.borrow().get(&self.id).cloned()) {
            return Ok(b);
        }
        cublas_available()?;
        let b = Arc::new(guarded(OP, || CudaBlas::new(self.stream.clone()))?);
        BLAS_HANDLES.with(|h| h.borrow_mut().insert(self.id, b.clone()));
        Ok(b)
    }

    /// A zeroed device buffer of `len` elements (`len` may be 0; see `Device::empty`).
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        if len == 0 {
            return self.empty();
        }
        guarded("cuda::Device::zeros", || self.stream.alloc_zeros::<T>(len))
    }

    /// A device copy of `host` (which may be empty; see `Device::empty`).
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            return self.empty();
        }
        guarded("cuda::Device::upload", || self.stream.clone_htod(host))
    }

    /// A buffer of no elements. `cuMemAlloc` refuses 0 bytes (`CUDA_ERROR_INVALID_VALUE`, as
    /// documented) and cudarc passes a length of 0 through, while a rank's share of a unit is
    /// often empty: so it owns a one-element allocation and says it holds none.
    fn empty<T: DeviceRepr>(&self) -> Result<CudaSlice<T>> {
        const OP: &str = "cuda::Device::empty";
        // SAFETY: the element is never read (the slice below has length 0).
        let one = guarded(OP, || unsafe { self.stream.alloc::<T>(1) })?;
        let ptr = one.leak();
        // SAFETY: `ptr` is the live allocation `leak` released from `one`, on this stream;
        // the slice that takes it over frees it once, and with length 0 nothing reads it.
        guarded(OP, || {
            Ok::<_, std::convert::Infallible>(unsafe { self.stream.upgrade_device_ptr(ptr, 0) })
        })
    }

    /// Copies `host` into `dst` (a slice or a view of one; same length, else `Err`).
    pub fn upload_into<T: DeviceRepr, D: DevicePtrMut<T>>(
        &self,
        host: &[T],
        dst: &mut D,
    ) -> Result<()> {
        check_len("cuda::Device::upload_into", host.len(), dst.len())?;
        guarded("cuda::Device::upload_into", || {
            self.stream.memcpy_htod(host, dst)
        })
    }

    /// A host copy of `src` (waits for the stream).
    pub fn download<T: DeviceRepr, S: DevicePtr<T>>(&self, src: &S) -> Result<Vec<T>> {
        guarded("cuda::Device::download", || self.stream.clone_dtoh(src))
    }
}

/// `Err(BadInput)` unless `got == want` (cudarc asserts on mismatched copies: check first).
pub fn check_len(op: &'static str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::BadInput {
            op,
            what: format!("{got} elements"),
            reason: format!("the device buffer holds {want}"),
        })
    }
}

/// Launch shape of a grid-stride element kernel over `n` elements: [`BLOCK`] threads, at most
/// 65 535 blocks (any count is correct; the cap only bounds the grid).
pub fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The `u64` element count a kernel takes.
pub fn count(n: usize) -> u64 {
    n as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_folder_replaces_the_built_in_source_and_a_missing_file_is_an_error() {
        assert_eq!(kernel_text_in(&ADAM8BIT, None).unwrap(), ADAM8BIT.src);
        let dir = std::env::temp_dir().join(format!("ragged-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("adam8bit.cu"), "// edited").unwrap();
        let edited = kernel_text_in(&ADAM8BIT, Some(dir.as_os_str())).unwrap();
        assert_eq!(edited, "// edited");
        let missing = kernel_text_in(&MUON, Some(dir.as_os_str())).unwrap_err();
        let text = missing.to_string();
        assert!(
            text.contains(KERNEL_DIR_VAR) && text.contains("muon.cu"),
            "{text}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
