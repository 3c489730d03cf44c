//! Helpers shared by the CUDA test binaries (each includes this file by path): devices, one
//! thread per NCCL rank, seeded values, device segments, and tools/cuda-emu's test hooks.
#![allow(dead_code)] // each binary uses a different subset

use std::sync::Arc;

use ragged::comm::Segment;
use ragged::cuda::cudarc::driver::CudaSlice;
use ragged::cuda::Device;

/// Device 0 (shared, as ranks and optimizer states hold it), or `None` after printing why the
/// test is skipped.
pub fn device() -> Option<Arc<Device>> {
    match Device::open(0) {
        Ok(d) => Some(Arc::new(d)),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

/// `n` seeded values in `[-1, 1)`.
pub fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (i as u32 ^ seed).wrapping_mul(2_654_435_761);
            (h >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

/// The bit patterns of `x`, for bitwise comparisons that NaNs do not spoil.
pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Devices 0, 1 (and 2 if present), or `None` after printing why not (fewer than two).
pub fn two_or_more_devices() -> Option<Vec<Arc<Device>>> {
    let devs: Vec<Arc<Device>> = (0..3)
        .map_while(|i| Device::open(i).ok().map(Arc::new))
        .collect();
    if devs.len() < 2 {
        println!("skipped: {} CUDA device(s), two or more needed", devs.len());
        return None;
    }
    Some(devs)
}

/// `f(i, item)` for every item, each on a thread of its own (an NCCL rank of one process
/// waits in its collectives for the others), in item order.
pub fn on_each_thread<T: Sync, R: Send>(items: &[T], f: impl Fn(usize, &T) -> R + Sync) -> Vec<R> {
    let f = &f;
    std::thread::scope(|scope| {
        let threads: Vec<_> = items
            .iter()
            .enumerate()
            .map(|(i, item)| scope.spawn(move || f(i, item)))
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

/// One NCCL rank per device of two or more, driven from this process, or `None` after printing
/// why not.
pub fn nccl_ranks_of_one_process() -> Option<Vec<ragged::cuda::nccl::NcclComm>> {
    let devs = two_or_more_devices()?;
    ragged::cuda::nccl::NcclComm::from_devices(&devs)
        .map_err(|e| println!("skipped: {e}"))
        .ok()
}

/// A zeroed device buffer per span (of its length): the storages of device segments.
pub fn zeroed_parts(
    dev: &Device,
    spans: &[std::ops::Range<usize>],
) -> ragged::Result<Vec<CudaSlice<f32>>> {
    spans.iter().map(|r| dev.zeros::<f32>(r.len())).collect()
}

/// Segments of the full buffer at `spans`, one in each of `parts`.
pub fn segments_of<'a>(
    spans: &[std::ops::Range<usize>],
    parts: &'a mut [CudaSlice<f32>],
) -> Vec<Segment<'a>> {
    spans
        .iter()
        .zip(parts.iter_mut())
        .map(|(r, p)| Segment {
            offset: r.start,
            buf: p.slice_mut(..).into(),
        })
        .collect()
}

/// Held by a counting test for its whole run: the emulator's counts are the device's, and cargo
/// runs a binary's tests on parallel threads, so the tests of a counting binary take turns.
pub fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ALONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// What `f` allocated on one device, as tools/cuda-emu's driver counts it at every
/// `cuMemAlloc(Async)`, whoever calls it: the driver's count, not ragged's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocated {
    /// Allocations made while `f` ran (freed or not).
    pub calls: usize,
    /// Their bytes.
    pub bytes: usize,
    /// The most bytes live while `f` ran beyond those live before.
    pub peak_growth: usize,
}

impl Allocated {
    /// Nothing allocated.
    pub const NONE: Allocated = Allocated {
        calls: 0,
        bytes: 0,
        peak_growth: 0,
    };
}

/// Runs `f` and returns what it gave with what it allocated on device `ordinal` ([`Allocated`],
/// from the emulator's test hooks `cuda_emu_reset_peak`, `cuda_emu_allocations` and
/// `cuda_emu_device_memory`). `None` under a real driver, which has no such hooks (the caller
/// says so). The count is the device's: nothing else may use the device meanwhile.
pub fn emulated_allocations<R>(ordinal: usize, f: impl FnOnce() -> R) -> (R, Option<Allocated>) {
    type Reset = unsafe extern "C" fn(i32) -> i32;
    type Memory = unsafe extern "C" fn(i32, *mut usize, *mut usize) -> i32;
    // SAFETY: dlopen of the driver library cudarc has already loaded (the same file, so the
    // same handle) and dlsym of three names; the handle is never closed.
    let hooks = unsafe {
        let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
        let find = |name: &std::ffi::CStr| match lib.is_null() {
            true => std::ptr::null_mut(),
            false => libc::dlsym(lib, name.as_ptr()),
        };
        let names = [
            c"cuda_emu_reset_peak",
            c"cuda_emu_device_memory",
            c"cuda_emu_allocations",
        ];
        let [reset, memory, made] = names.map(find);
        if reset.is_null() || memory.is_null() || made.is_null() {
            None
        } else {
            Some((
                std::mem::transmute::<*mut libc::c_void, Reset>(reset),
                std::mem::transmute::<*mut libc::c_void, Memory>(memory),
                std::mem::transmute::<*mut libc::c_void, Memory>(made),
            ))
        }
    };
    let Some((reset, memory, made)) = hooks else {
        return (f(), None);
    };
    let (mut before, mut live, mut peak) = (0usize, 0usize, 0usize);
    let mut count = Allocated::default();
    let d = ordinal as i32;
    // SAFETY: the hooks' signatures as tools/cuda-emu/driver.cpp declares them; valid out
    // pointers.
    let ok = unsafe { reset(d) == 0 && memory(d, &mut before, &mut peak) == 0 };
    assert!(ok, "cuda-emu refused device {ordinal}");
    let out = f();
    // SAFETY: as above.
    let ok = unsafe {
        memory(d, &mut live, &mut peak) == 0 && made(d, &mut count.calls, &mut count.bytes) == 0
    };
    assert!(ok, "cuda-emu refused device {ordinal}");
    count.peak_growth = peak - before;
    (out, Some(count))
}

/// What `f` allocates on `dev` when every rank of `c` runs it at once: after a barrier (every
/// rank's buffers made), the `counting` ranks (one per device: ranks sharing a device would
/// reset each other's count) open the count ([`emulated_allocations`]), and read it after the
/// barrier that follows every rank's `f` and its queued device work. `None` under a real driver
/// and on the other ranks.
pub fn allocated_by_every_rank(
    c: &dyn ragged::comm::Communicator,
    dev: &Device,
    counting: bool,
    mut f: impl FnMut() -> ragged::Result<()>,
) -> ragged::Result<Option<Allocated>> {
    c.barrier()?;
    let mut window = || -> ragged::Result<()> {
        c.barrier()?;
        f()?;
        dev.sync()?;
        c.barrier()
    };
    if !counting {
        return window().map(|()| None);
    }
    let (out, allocated) = emulated_allocations(dev.context().ordinal(), window);
    out.map(|()| allocated)
}
