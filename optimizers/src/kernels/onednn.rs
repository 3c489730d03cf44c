//! bf16 matmul on AMX through oneDNN's matmul *primitive*, with oneDNN opened at run time.
//!
//! oneDNN (the 2.x C API, Debian's `libdnnl-dev` 2.6.3) is loaded with `dlopen`
//! (`libdnnl.so.2`, then `libdnnl.so`) on first use, so this crate builds and runs where it is
//! absent: every entry point then returns [`DnnlError`], never panics, and Newton–Schulz
//! falls back to the portable bf16 path. Only the matmul primitive reaches the AMX tile units
//! (`brg:avx512_core_amx_bf16`); oneDNN's BLAS-like `dnnl_gemm_bf16bf16f32` does not.
//!
//! oneDNN 2.6 has bf16 matmul only on CPUs with AVX-512 (`avx512_core`, faster with
//! AVX512-BF16 and AMX); elsewhere (e.g. AVX2-only AMD EPYC) the library loads, its `f32`
//! matmul works, and bf16 primitive creation returns `dnnl_unimplemented`:
//! [`OneDnn::bf16_impl`] probes this once and reports [`DnnlError::Unsupported`].
//!
//! | object | lifetime | notes |
//! |---|---|---|
//! | library, CPU engine, stream | process (one [`OneDnn`], created once) | engine index 0 |
//! | primitive | one per [`MatmulKey`] (shape, weight layout, `dst` row stride, scales), cached | created on first use |
//! | memory objects | one call | wrap the caller's buffers, no copies |
//!
//! One call at a time executes (a mutex around the cache and the shared stream): oneDNN
//! parallelizes inside the primitive with its own OpenMP threads (`OMP_NUM_THREADS`), so
//! running two primitives at once would only oversubscribe the cores. Those threads wait
//! passively between products unless `OMP_WAIT_POLICY` is set (see
//! [`OneDnn::wait_policy`]): spinning ones starve whatever else shares the cores.
//!
//! The C structs `dnnl_memory_desc_t` (696 bytes) and `dnnl_matmul_desc_t` (2800 bytes in
//! 2.6) are only ever written and read by the library; they are held here as opaque, 8-byte
//! aligned buffers of 1 KiB and 4 KiB, and the library's major version must be 2 (3.x changed
//! both the structs and the entry points).

use std::collections::hash_map::{Entry, HashMap};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::fmt;
use std::sync::{Mutex, OnceLock};

use half::bf16;
use libloading::Library;

/// Library names tried, in order.
pub const LIBRARY_NAMES: [&str; 2] = ["libdnnl.so.2", "libdnnl.so"];

/// The side at which [`OneDnn::sym_nt`] stops splitting where oneDNN's bf16 products run on
/// AMX tiles ([`OneDnn::sym_leaf`]): on 2 AMX cores a 1024-wide product is worth more whole
/// than as three 512-wide ones (Muon on 1024²: 29.6–31.4 ms whole, 40.6–42.9 ms split; on
/// 2048², split once: 276–285 ms against 297–303 ms whole).
pub const SYM_LEAF_AMX: usize = 1024;
/// The side at which [`OneDnn::sym_nt`] stops splitting elsewhere: on 2 AVX512-BF16 cores
/// without AMX (AMD Zen 4) splitting down to 512 is the faster (Muon on the 28-matrix stack
/// 0.91× the time of the 1024 leaf, 0.88–0.93 over 5 alternating rounds; 256 gave 0.99× of
/// 512's).
pub const SYM_LEAF: usize = 512;

/// Copies the lower-left block (rows `h..n`, columns `0..h`) of the `n×n` matrix in `dst`
/// (rows `ldd` apart) transposed into its upper-right block, in 32×32 tiles.
fn mirror_lower_left<T: Copy>(dst: &mut [T], n: usize, h: usize, ldd: usize) {
    const TILE: usize = 32;
    for i0 in (0..h).step_by(TILE) {
        for j0 in (h..n).step_by(TILE) {
            for i in i0..(i0 + TILE).min(h) {
                for j in j0..(j0 + TILE).min(n) {
                    dst[i * ldd + j] = dst[j * ldd + i];
                }
            }
        }
    }
}

// Constants of the oneDNN 2.6 C API (`dnnl_types.h`).
const DNNL_SUCCESS: c_int = 0;
const DNNL_CPU: c_int = 1;
const DNNL_BF16: c_int = 2;
const DNNL_F32: c_int = 3;
const DNNL_UNIMPLEMENTED: c_int = 3;
const DNNL_TAG_AB: c_int = 3;
const DNNL_TAG_BA: c_int = 22;
const DNNL_STREAM_DEFAULT_FLAGS: c_uint = 1;
const DNNL_QUERY_IMPL_INFO_STR: c_int = 8;
const DNNL_ARG_SRC: c_int = 1;
const DNNL_ARG_DST: c_int = 17;
const DNNL_ARG_WEIGHTS: c_int = 33;

/// What went wrong with oneDNN. Converts into [`ragged::Error`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DnnlError {
    /// No library of [`LIBRARY_NAMES`] could be opened.
    Load { reasons: String },
    /// The library lacks an entry point (not the 2.x API).
    Symbol { name: &'static str, reason: String },
    /// The library is not oneDNN 2.x.
    Version { found: String },
    /// A call returned a status other than `dnnl_success`.
    Call { func: &'static str, status: i32 },
    /// oneDNN has no implementation of this operation on this CPU.
    Unsupported { what: String },
}

impl fmt::Display for DnnlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DnnlError::Load { reasons } => write!(f, "cannot open oneDNN: {reasons}"),
            DnnlError::Symbol { name, reason } => {
                write!(f, "oneDNN lacks {name} (need the 2.x C API): {reason}")
            }
            DnnlError::Version { found } => write!(f, "oneDNN {found} found, 2.x needed"),
            DnnlError::Call { func, status } => {
                write!(f, "oneDNN call {func} failed with status {status}")
            }
            DnnlError::Unsupported { what } => {
                write!(f, "oneDNN has no {what} on this CPU (dnnl_unimplemented)")
            }
        }
    }
}

impl std::error::Error for DnnlError {}

impl From<DnnlError> for ragged::Error {
    fn from(e: DnnlError) -> Self {
        ragged::Error::Msg(e.to_string())
    }
}

/// Element types the matmul runs on: `f32` and bf16.
pub trait Element: Copy + Send + Sync + sealed::Sealed + 'static {
    /// `dnnl_data_type_t`.
    const DNNL_TYPE: c_int;
    /// For messages.
    const NAME: &'static str;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

impl Element for f32 {
    const DNNL_TYPE: c_int = DNNL_F32;
    const NAME: &'static str = "f32";
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for bf16 {
    const DNNL_TYPE: c_int = DNNL_BF16;
    const NAME: &'static str = "bf16";
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

type Handle = *mut c_void;
type Status = c_int;

/// `dnnl_memory_desc_t`, opaque (696 bytes in 2.6).
#[repr(C, align(8))]
struct MemDesc([u8; 1024]);

/// `dnnl_matmul_desc_t`, opaque (2800 bytes in 2.6).
#[repr(C, align(8))]
struct MatmulDesc([u8; 4096]);

/// `dnnl_exec_arg_t`.
#[repr(C)]
struct ExecArg {
    arg: c_int,
    memory: Handle,
}

/// `dnnl_version_t`.
#[repr(C)]
struct Version {
    major: c_int,
    minor: c_int,
    patch: c_int,
    hash: *const c_char,
    cpu_runtime: c_uint,
    gpu_runtime: c_uint,
}

/// The entry points used, resolved once.
struct Api {
    version: unsafe extern "C" fn() -> *const Version,
    engine_create: unsafe extern "C" fn(*mut Handle, c_int, usize) -> Status,
    stream_create: unsafe extern "C" fn(*mut Handle, Handle, c_uint) -> Status,
    stream_wait: unsafe extern "C" fn(Handle) -> Status,
    md_init_by_tag: unsafe extern "C" fn(*mut MemDesc, c_int, *const i64, c_int, c_int) -> Status,
    md_init_by_strides:
        unsafe extern "C" fn(*mut MemDesc, c_int, *const i64, c_int, *const i64) -> Status,
    matmul_desc_init: unsafe extern "C" fn(
        *mut MatmulDesc,
        *const MemDesc,
        *const MemDesc,
        *const MemDesc,
        *const MemDesc,
    ) -> Status,
    attr_create: unsafe extern "C" fn(*mut Handle) -> Status,
    attr_destroy: unsafe extern "C" fn(Handle) -> Status,
    attr_set_output_scales: unsafe extern "C" fn(Handle, i64, c_int, *const f32) -> Status,
    attr_set_post_ops: unsafe extern "C" fn(Handle, Handle) -> Status,
    post_ops_create: unsafe extern "C" fn(*mut Handle) -> Status,
    post_ops_destroy: unsafe extern "C" fn(Handle) -> Status,
    post_ops_append_sum: unsafe extern "C" fn(Handle, f32) -> Status,
    pd_create: unsafe extern "C" fn(*mut Handle, *const c_void, Handle, Handle, Handle) -> Status,
    pd_query: unsafe extern "C" fn(Handle, c_int, c_int, *mut c_void) -> Status,
    pd_destroy: unsafe extern "C" fn(Handle) -> Status,
    primitive_create: unsafe extern "C" fn(*mut Handle, Handle) -> Status,
    primitive_execute: unsafe extern "C" fn(Handle, Handle, c_int, *const ExecArg) -> Status,
    memory_create: unsafe extern "C" fn(*mut Handle, *const MemDesc, Handle, *mut c_void) -> Status,
    memory_destroy: unsafe extern "C" fn(Handle) -> Status,
}

fn check(func: &'static str, status: Status) -> Result<(), DnnlError> {
    if status == DNNL_SUCCESS {
        Ok(())
    } else {
        Err(DnnlError::Call { func, status })
    }
}

impl Api {
    fn load(lib: &Library) -> Result<Api, DnnlError> {
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the symbol is declared with its `dnnl.h` 2.6 signature (the library
                // is checked to be 2.x before any other entry point is called).
                let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) };
                *s.map_err(|e| DnnlError::Symbol {
                    name: $name,
                    reason: e.to_string(),
                })?
            }};
        }
        Ok(Api {
            version: sym!("dnnl_version"),
            engine_create: sym!("dnnl_engine_create"),
            stream_create: sym!("dnnl_stream_create"),
            stream_wait: sym!("dnnl_stream_wait"),
            md_init_by_tag: sym!("dnnl_memory_desc_init_by_tag"),
            md_init_by_strides: sym!("dnnl_memory_desc_init_by_strides"),
            matmul_desc_init: sym!("dnnl_matmul_desc_init"),
            attr_create: sym!("dnnl_primitive_attr_create"),
            attr_destroy: sym!("dnnl_primitive_attr_destroy"),
            attr_set_output_scales: sym!("dnnl_primitive_attr_set_output_scales"),
            attr_set_post_ops: sym!("dnnl_primitive_attr_set_post_ops"),
            post_ops_create: sym!("dnnl_post_ops_create"),
            post_ops_destroy: sym!("dnnl_post_ops_destroy"),
            post_ops_append_sum: sym!("dnnl_post_ops_append_sum"),
            pd_create: sym!("dnnl_primitive_desc_create"),
            pd_query: sym!("dnnl_primitive_desc_query"),
            pd_destroy: sym!("dnnl_primitive_desc_destroy"),
            primitive_create: sym!("dnnl_primitive_create"),
            primitive_execute: sym!("dnnl_primitive_execute"),
            memory_create: sym!("dnnl_memory_create"),
            memory_destroy: sym!("dnnl_memory_destroy"),
        })
    }
}

/// One cached matmul: `dst (m×n) ← scale·src·wei [+ sum·dst]`, all of one element type,
/// `f32` accumulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulKey {
    /// `dnnl_data_type_t` of every operand.
    pub dtype: i32,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// The weights buffer holds `weiᵀ` row-major (`n×k`), i.e. layout `ba` of `wei: k×n`.
    pub wei_transposed: bool,
    /// Elements between the starts of two rows of `dst` (`n`: contiguous; more: `dst` is a
    /// block of a wider matrix).
    pub ldd: usize,
    /// Bits of the output scale (`1.0`: none).
    pub scale_bits: u32,
    /// Bits of the sum post-op scale, if `dst` is read.
    pub sum_bits: Option<u32>,
}

struct Primitive {
    prim: Handle,
    src: Box<MemDesc>,
    wei: Box<MemDesc>,
    dst: Box<MemDesc>,
    impl_info: String,
}

/// The loaded library, its CPU engine and stream, and the primitive cache.
pub struct OneDnn {
    api: Api,
    engine: Handle,
    stream: Handle,
    version: String,
    cache: Mutex<HashMap<MatmulKey, Primitive>>,
    bf16: OnceLock<Result<String, DnnlError>>,
    wait_policy: String,
    // Last field: dropped after everything that points into it (never, in practice: the
    // singleton lives for the process).
    _lib: Library,
}

// SAFETY: oneDNN engines, primitives and primitive descriptors may be used from any thread;
// the stream and every execution are used only under `cache`'s mutex, one call at a time.
unsafe impl Send for OneDnn {}
// SAFETY: as above.
unsafe impl Sync for OneDnn {}

static ONEDNN: OnceLock<Result<OneDnn, DnnlError>> = OnceLock::new();

/// The process-wide oneDNN, loaded on first call; `Err` (the same each time) when the library
/// is missing, not 2.x, or has no CPU engine.
pub fn onednn() -> Result<&'static OneDnn, DnnlError> {
    ONEDNN
        .get_or_init(OneDnn::open)
        .as_ref()
        .map_err(Clone::clone)
}

/// Sets `OMP_WAIT_POLICY=PASSIVE` unless the environment already chooses a policy, before
/// oneDNN (and with it libgomp, which reads the variable once, when it loads) is opened;
/// returns the policy in force and its source.
///
/// Why: libgomp's default is to spin for a while after every parallel region, and oneDNN
/// runs one region per product. When anything else wants the cores (rayon's workers, another
/// process), a spinning thread holds a core the thread it waits for needs: on 2 cores shared
/// with a compiler, a bf16 Muon step on the 28-matrix stack took 5.9–12.4 s with the default
/// and 1.8–3.0 s passive, in alternating runs.
fn default_omp_wait_policy() -> String {
    match std::env::var("OMP_WAIT_POLICY") {
        Ok(v) => format!("OMP_WAIT_POLICY={v} (environment)"),
        Err(_) => {
            // Set once, from the `OnceLock` that opens oneDNN; nothing in this process reads
            // the variable concurrently (libgomp is not loaded yet).
            std::env::set_var("OMP_WAIT_POLICY", "PASSIVE");
            "OMP_WAIT_POLICY=PASSIVE (ragged's default)".into()
        }
    }
}

/// RAII guard calling a oneDNN destroy function.
struct Guard<'a> {
    h: Handle,
    destroy: &'a dyn Fn(Handle) -> Status,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if !self.h.is_null() {
            // A failed destroy leaks at worst; nothing to report it to.
            let _ = (self.destroy)(self.h);
        }
    }
}

impl OneDnn {
    fn open() -> Result<OneDnn, DnnlError> {
        let wait_policy = default_omp_wait_policy();
        let mut reasons = Vec::new();
        let mut lib = None;
        for name in LIBRARY_NAMES {
            // SAFETY: loading oneDNN runs its (trusted) initializers only.
            match unsafe { Library::new(name) } {
                Ok(l) => {
                    lib = Some(l);
                    break;
                }
                Err(e) => reasons.push(format!("{name}: {e}")),
            }
        }
        let lib = lib.ok_or_else(|| DnnlError::Load {
            reasons: reasons.join("; "),
        })?;
        let api = Api::load(&lib)?;
        // SAFETY: `dnnl_version` returns a pointer to a static struct.
        let v = unsafe { &*(api.version)() };
        let version = format!("{}.{}.{}", v.major, v.minor, v.patch);
        if v.major != 2 {
            return Err(DnnlError::Version { found: version });
        }
        let mut engine: Handle = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the signatures match the 2.x header.
        check("dnnl_engine_create", unsafe {
            (api.engine_create)(&mut engine, DNNL_CPU, 0)
        })?;
        let mut stream: Handle = std::ptr::null_mut();
        // SAFETY: as above; `engine` is live.
        check("dnnl_stream_create", unsafe {
            (api.stream_create)(&mut stream, engine, DNNL_STREAM_DEFAULT_FLAGS)
        })?;
        Ok(OneDnn {
            api,
            engine,
            stream,
            version,
            cache: Mutex::new(HashMap::new()),
            bf16: OnceLock::new(),
            wait_policy,
            _lib: lib,
        })
    }

    /// oneDNN's OpenMP wait policy and where it came from, e.g. `OMP_WAIT_POLICY=PASSIVE
    /// (ragged's default)`.
    pub fn wait_policy(&self) -> &str {
        &self.wait_policy
    }

    /// The library's version, e.g. `2.6.3`.
    pub fn version(&self) -> &str {
        &self.version
    }

    fn md(
        &self,
        rows: usize,
        cols: usize,
        dtype: c_int,
        tag: c_int,
    ) -> Result<Box<MemDesc>, DnnlError> {
        let mut md = Box::new(MemDesc([0; 1024]));
        let dims = [rows as i64, cols as i64];
        // SAFETY: `md` is large enough for `dnnl_memory_desc_t`; `dims` holds `ndims` values.
        check("dnnl_memory_desc_init_by_tag", unsafe {
            (self.api.md_init_by_tag)(&mut *md, 2, dims.as_ptr(), dtype, tag)
        })?;
        Ok(md)
    }

    /// A row-major `rows × cols` descriptor whose rows start `ld` elements apart.
    fn strided_md(
        &self,
        rows: usize,
        cols: usize,
        ld: usize,
        dtype: c_int,
    ) -> Result<Box<MemDesc>, DnnlError> {
        let mut md = Box::new(MemDesc([0; 1024]));
        let dims = [rows as i64, cols as i64];
        let strides = [ld as i64, 1];
        // SAFETY: as in `md`; `strides` holds `ndims` values.
        check("dnnl_memory_desc_init_by_strides", unsafe {
            (self.api.md_init_by_strides)(&mut *md, 2, dims.as_ptr(), dtype, strides.as_ptr())
        })?;
        Ok(md)
    }

    fn create(&self, key: &MatmulKey) -> Result<Primitive, DnnlError> {
        let api = &self.api;
        let src = self.md(key.m, key.k, key.dtype, DNNL_TAG_AB)?;
        let wei = self.md(
            key.k,
            key.n,
            key.dtype,
            if key.wei_transposed {
                DNNL_TAG_BA
            } else {
                DNNL_TAG_AB
            },
        )?;
        let dst = self.strided_md(key.m, key.n, key.ldd, key.dtype)?;
        let mut desc = Box::new(MatmulDesc([0; 4096]));
        // SAFETY: all descriptors are initialized; a null bias disables the bias term.
        check("dnnl_matmul_desc_init", unsafe {
            (api.matmul_desc_init)(&mut *desc, &*src, &*wei, std::ptr::null(), &*dst)
        })?;
        let destroy_attr = |h| unsafe { (api.attr_destroy)(h) };
        let destroy_ops = |h| unsafe { (api.post_ops_destroy)(h) };
        let destroy_pd = |h| unsafe { (api.pd_destroy)(h) };
        let mut attr = Guard {
            h: std::ptr::null_mut(),
            destroy: &destroy_attr,
        };
        // SAFETY: out-pointer; the guard destroys it.
        check("dnnl_primitive_attr_create", unsafe {
            (api.attr_create)(&mut attr.h)
        })?;
        let scale = f32::from_bits(key.scale_bits);
        if scale != 1.0 {
            // SAFETY: one scale, mask 0 (a common scale); `attr` is live.
            check("dnnl_primitive_attr_set_output_scales", unsafe {
                (api.attr_set_output_scales)(attr.h, 1, 0, &scale)
            })?;
        }
        if let Some(bits) = key.sum_bits {
            let mut ops = Guard {
                h: std::ptr::null_mut(),
                destroy: &destroy_ops,
            };
            // SAFETY: out-pointer; the guard destroys it (the attribute keeps a copy).
            check("dnnl_post_ops_create", unsafe {
                (api.post_ops_create)(&mut ops.h)
            })?;
            // SAFETY: `ops` is live.
            check("dnnl_post_ops_append_sum", unsafe {
                (api.post_ops_append_sum)(ops.h, f32::from_bits(bits))
            })?;
            // SAFETY: both live.
            check("dnnl_primitive_attr_set_post_ops", unsafe {
                (api.attr_set_post_ops)(attr.h, ops.h)
            })?;
        }
        let mut pd = Guard {
            h: std::ptr::null_mut(),
            destroy: &destroy_pd,
        };
        // SAFETY: `desc` is an initialized matmul descriptor; no forward hint.
        let status = unsafe {
            (api.pd_create)(
                &mut pd.h,
                (&*desc as *const MatmulDesc).cast(),
                attr.h,
                self.engine,
                std::ptr::null_mut(),
            )
        };
        if status == DNNL_UNIMPLEMENTED {
            return Err(DnnlError::Unsupported {
                what: format!(
                    "{} matmul{}",
                    if key.dtype == DNNL_BF16 {
                        "bf16"
                    } else {
                        "f32"
                    },
                    if scale != 1.0 || key.sum_bits.is_some() {
                        " with output scale / sum post-op"
                    } else {
                        ""
                    }
                ),
            });
        }
        check("dnnl_primitive_desc_create", status)?;
        let mut info: *const c_char = std::ptr::null();
        // SAFETY: `impl_info_str` writes a `const char*` owned by the descriptor.
        check("dnnl_primitive_desc_query(impl_info_str)", unsafe {
            (api.pd_query)(
                pd.h,
                DNNL_QUERY_IMPL_INFO_STR,
                0,
                (&mut info as *mut *const c_char).cast(),
            )
        })?;
        let impl_info = if info.is_null() {
            String::from("?")
        } else {
            // SAFETY: a NUL-terminated string that lives as long as `pd`; copied now.
            unsafe { CStr::from_ptr(info) }
                .to_string_lossy()
                .into_owned()
        };
        let mut prim: Handle = std::ptr::null_mut();
        // SAFETY: `pd` is live; the primitive keeps its own copy of it.
        check("dnnl_primitive_create", unsafe {
            (api.primitive_create)(&mut prim, pd.h)
        })?;
        Ok(Primitive {
            prim,
            src,
            wei,
            dst,
            impl_info,
        })
    }

    /// `dst (m×n) ← scale·src·wei + sum·dst` (the sum term only with `Some(sum)`) in `T`
    /// (bf16: `f32` accumulation and one rounding to bf16 per output element). `src: m×k`
    /// row-major; `wei: k×n` row-major, or its transpose `n×k` row-major when
    /// `wei_transposed`. Returns the implementation oneDNN picked (e.g.
    /// `brg:avx512_core_amx_bf16`).
    ///
    /// # Panics
    /// If a slice's length does not match the shape (an internal invariant).
    #[allow(clippy::too_many_arguments)]
    #[track_caller]
    pub fn matmul<T: Element>(
        &self,
        m: usize,
        n: usize,
        k: usize,
        src: &[T],
        wei: &[T],
        wei_transposed: bool,
        dst: &mut [T],
        scale: f32,
        sum: Option<f32>,
    ) -> Result<String, DnnlError> {
        assert_eq!(dst.len(), m * n, "OneDnn::matmul: dst length for {m}×{n}");
        self.matmul_strided(m, n, k, src, wei, wei_transposed, dst, n, scale, sum)
    }

    /// [`OneDnn::matmul`] into a block of a wider row-major matrix: row `i` of the `m×n`
    /// result starts at `dst[i·ldd]` (`ldd ≥ n`); elements between the block's rows are
    /// neither read nor written.
    ///
    /// # Panics
    /// If a slice is too short for the shape, or `ldd < n` (an internal invariant).
    #[allow(clippy::too_many_arguments)]
    #[track_caller]
    pub fn matmul_strided<T: Element>(
        &self,
        m: usize,
        n: usize,
        k: usize,
        src: &[T],
        wei: &[T],
        wei_transposed: bool,
        dst: &mut [T],
        ldd: usize,
        scale: f32,
        sum: Option<f32>,
    ) -> Result<String, DnnlError> {
        let dst_span = if m == 0 { 0 } else { (m - 1) * ldd + n };
        assert!(
            src.len() == m * k && wei.len() == k * n && dst.len() >= dst_span && ldd >= n,
            "OneDnn::matmul_strided: lengths {}, {}, {} (ldd {ldd}) for {m}×{k}·{k}×{n}",
            src.len(),
            wei.len(),
            dst.len()
        );
        let key = MatmulKey {
            dtype: T::DNNL_TYPE,
            m,
            n,
            k,
            wei_transposed,
            ldd,
            scale_bits: scale.to_bits(),
            sum_bits: sum.map(f32::to_bits),
        };
        // A poisoned lock only means another call panicked mid-way; the cache stays valid.
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let p = match cache.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(self.create(&key)?),
        };
        let api = &self.api;
        let destroy_mem = |h| unsafe { (api.memory_destroy)(h) };
        let mut mems = Vec::with_capacity(3);
        for (md, ptr) in [
            (&p.src, src.as_ptr() as *mut c_void),
            (&p.wei, wei.as_ptr() as *mut c_void),
            (&p.dst, dst.as_mut_ptr() as *mut c_void),
        ] {
            let mut g = Guard {
                h: std::ptr::null_mut(),
                destroy: &destroy_mem,
            };
            // SAFETY: the buffer holds exactly the described bf16 elements (checked above)
            // and outlives the memory object (destroyed at the end of this call).
            check("dnnl_memory_create", unsafe {
                (api.memory_create)(&mut g.h, &**md, self.engine, ptr)
            })?;
            mems.push(g);
        }
        let args = [
            ExecArg {
                arg: DNNL_ARG_SRC,
                memory: mems[0].h,
            },
            ExecArg {
                arg: DNNL_ARG_WEIGHTS,
                memory: mems[1].h,
            },
            ExecArg {
                arg: DNNL_ARG_DST,
                memory: mems[2].h,
            },
        ];
        // SAFETY: primitive, stream and memories are live; the stream is used under the lock.
        check("dnnl_primitive_execute", unsafe {
            (api.primitive_execute)(p.prim, self.stream, 3, args.as_ptr())
        })?;
        // SAFETY: as above.
        check("dnnl_stream_wait", unsafe {
            (api.stream_wait)(self.stream)
        })?;
        Ok(p.impl_info.clone())
    }

    /// `dst (n×n, rows `ldd` apart) ← scale·a·aᵀ + sum·dst` for a row-major `a: n×k`, a
    /// symmetric result (and `dst` symmetric on entry with `Some(sum)`): the lower
    /// off-diagonal block is one product, mirrored into the upper one, and the diagonal
    /// blocks recurse down to [`OneDnn::sym_leaf`]. Every block's operands are whole rows of
    /// `a`, so only `dst` is strided. Split once, a side does 75 % of the full product's
    /// multiply-adds in 3 primitive calls. The mirrored blocks are exactly symmetric; a leaf
    /// is as symmetric as oneDNN's product of it.
    ///
    /// # Panics
    /// As [`OneDnn::matmul_strided`].
    #[allow(clippy::too_many_arguments)]
    #[track_caller]
    pub fn sym_nt<T: Element>(
        &self,
        n: usize,
        k: usize,
        a: &[T],
        dst: &mut [T],
        ldd: usize,
        scale: f32,
        sum: Option<f32>,
    ) -> Result<(), DnnlError> {
        self.sym_abt(n, k, (a, a), dst, ldd, scale, sum)
    }

    /// `dst (n×n, dense) ← u·v` for symmetric row-major `n × n` matrices `u`, `v` that
    /// commute (polynomials of one matrix, as in Gram Newton–Schulz), so that the product is
    /// symmetric: as `u·vᵀ` by [`OneDnn::sym_nt`]'s halves. Where `v` is symmetric only to
    /// rounding (inside the leaves of oneDNN's products), the result is `u·vᵀ` computed
    /// exactly as that.
    ///
    /// # Panics
    /// As [`OneDnn::matmul_strided`].
    #[track_caller]
    pub fn sym_product<T: Element>(
        &self,
        n: usize,
        u: &[T],
        v: &[T],
        dst: &mut [T],
    ) -> Result<(), DnnlError> {
        self.sym_abt(n, n, (u, v), dst, n, 1.0, None)
    }

    /// `dst ← scale·a·bᵀ + sum·dst` for row-major `a`, `b: n×k` whose product is symmetric:
    /// [`OneDnn::sym_nt`]'s recursion, the lower-left block mirrored.
    #[allow(clippy::too_many_arguments)]
    #[track_caller]
    fn sym_abt<T: Element>(
        &self,
        n: usize,
        k: usize,
        (a, b): (&[T], &[T]),
        dst: &mut [T],
        ldd: usize,
        scale: f32,
        sum: Option<f32>,
    ) -> Result<(), DnnlError> {
        if n <= self.sym_leaf() {
            self.matmul_strided(n, n, k, a, b, true, dst, ldd, scale, sum)?;
            return Ok(());
        }
        let h = n / 2;
        let ((a_top, a_bottom), (b_top, b_bottom)) = (a.split_at(h * k), b.split_at(h * k));
        self.sym_abt(h, k, (a_top, b_top), dst, ldd, scale, sum)?;
        let lower_right = &mut dst[h * ldd + h..];
        self.sym_abt(n - h, k, (a_bottom, b_bottom), lower_right, ldd, scale, sum)?;
        // Lower-left block: rows h..n, columns 0..h.
        self.matmul_strided(
            n - h,
            h,
            k,
            a_bottom,
            b_top,
            true,
            &mut dst[h * ldd..],
            ldd,
            scale,
            sum,
        )?;
        mirror_lower_left(dst, n, h, ldd);
        Ok(())
    }

    /// The side at which [`OneDnn::sym_nt`] stops splitting: [`SYM_LEAF_AMX`] where oneDNN's
    /// bf16 products run on AMX tiles, else [`SYM_LEAF`].
    pub fn sym_leaf(&self) -> usize {
        match self.bf16_probe() {
            Ok(isa) if isa.contains("amx") => SYM_LEAF_AMX,
            _ => SYM_LEAF,
        }
    }

    /// Whether this CPU has oneDNN bf16 matmuls of the kinds Newton–Schulz uses (probed once
    /// with a 64³ product, a transposed one, one with an output scale and a sum post-op, and
    /// a transposed one with both into a block of a wider matrix); `Ok` holds the implementation picked for a 1024³ product (e.g.
    /// `brg:avx512_core_amx_bf16`).
    pub fn bf16_impl(&self) -> Result<String, DnnlError> {
        self.bf16_probe().clone()
    }

    /// [`OneDnn::bf16_impl`]'s probe, made once.
    fn bf16_probe(&self) -> &Result<String, DnnlError> {
        self.bf16.get_or_init(|| {
            let probe = |wei_transposed: bool, ldd: usize, scale: f32, sum: Option<f32>| {
                let key = MatmulKey {
                    dtype: DNNL_BF16,
                    m: 64,
                    n: 64,
                    k: 64,
                    wei_transposed,
                    ldd,
                    scale_bits: scale.to_bits(),
                    sum_bits: sum.map(f32::to_bits),
                };
                self.cached_impl(&key).map(|_| ())
            };
            probe(false, 64, 1.0, None)?;
            probe(true, 64, 1.0, None)?;
            probe(false, 64, 2.0, Some(0.5))?;
            // The symmetric products' blocks: transposed weights into a wider `dst`.
            probe(true, 128, 2.0, Some(0.5))?;
            self.impl_for::<bf16>(1024)
        })
    }

    /// The implementation oneDNN picks for a `side³` matmul of `T` (e.g.
    /// `brg:avx512_core_amx_bf16`), from a primitive descriptor.
    pub fn impl_for<T: Element>(&self, side: usize) -> Result<String, DnnlError> {
        self.cached_impl(&MatmulKey {
            dtype: T::DNNL_TYPE,
            m: side,
            n: side,
            k: side,
            wei_transposed: false,
            ldd: side,
            scale_bits: 1f32.to_bits(),
            sum_bits: None,
        })
    }

    /// Creates (once) and caches the primitive of `key`; returns its implementation name.
    /// Cached primitives live as long as the process.
    fn cached_impl(&self, key: &MatmulKey) -> Result<String, DnnlError> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let p = match cache.entry(*key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(self.create(key)?),
        };
        Ok(p.impl_info.clone())
    }
}
