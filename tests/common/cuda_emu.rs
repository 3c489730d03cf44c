//! tools/cuda-emu's test hooks, shared by the root crate's and `ragged-optimizers`' CUDA tests
//! (each includes this file by path).

/// Runs `f` and returns what it gave with the most device memory that was live on device
/// `ordinal` while it ran, beyond what was live before, as tools/cuda-emu's driver counts it
/// at every `cuMemAlloc` and `cuMemFree` (its test hooks `cuda_emu_reset_peak` and
/// `cuda_emu_device_memory`): the driver's count, not ragged's. `None` under a real driver,
/// which has no such hooks (the caller says so).
pub fn emulated_peak_growth<R>(ordinal: usize, f: impl FnOnce() -> R) -> (R, Option<usize>) {
    type Reset = unsafe extern "C" fn(i32) -> i32;
    type Memory = unsafe extern "C" fn(i32, *mut usize, *mut usize) -> i32;
    // SAFETY: dlopen of the driver library cudarc has already loaded (the same file, so the
    // same handle) and dlsym of two names; the handle is never closed.
    let (reset, memory) = unsafe {
        let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
        if lib.is_null() {
            return (f(), None);
        }
        let reset = libc::dlsym(lib, c"cuda_emu_reset_peak".as_ptr());
        let memory = libc::dlsym(lib, c"cuda_emu_device_memory".as_ptr());
        if reset.is_null() || memory.is_null() {
            return (f(), None);
        }
        (
            std::mem::transmute::<*mut libc::c_void, Reset>(reset),
            std::mem::transmute::<*mut libc::c_void, Memory>(memory),
        )
    };
    let (mut before, mut live, mut peak) = (0usize, 0usize, 0usize);
    let d = ordinal as i32;
    // SAFETY: the hooks' signatures as tools/cuda-emu/driver.cpp declares them; valid out
    // pointers.
    let ok = unsafe { reset(d) == 0 && memory(d, &mut before, &mut peak) == 0 };
    assert!(ok, "cuda-emu refused device {ordinal}");
    let out = f();
    // SAFETY: as above.
    let ok = unsafe { memory(d, &mut live, &mut peak) == 0 };
    assert!(ok, "cuda-emu refused device {ordinal}");
    (out, Some(peak - before))
}
