//! A counting global allocator, so benchmarks measure heap bytes instead of trusting what the
//! runtime says it holds. A binary opts in with
//! `#[global_allocator] static A: ragged::bench::alloc::Counting = ragged::bench::alloc::Counting;`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting live bytes and their peak.
pub struct Counting;

// SAFETY: every call forwards to the system allocator with the caller's arguments; the
// counters are plain atomics and never touch the allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grow(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
            grow(new_size);
        }
        p
    }
}

fn grow(bytes: usize) {
    ACTIVE.store(true, Ordering::Relaxed);
    let now = CURRENT.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

/// Whether [`Counting`] is this process's allocator (it has seen an allocation).
pub fn installed() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// Heap bytes alive now.
pub fn current() -> usize {
    CURRENT.load(Ordering::Relaxed)
}

/// The largest [`current`] since the last [`reset_peak`].
pub fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak measurement from the bytes alive now.
pub fn reset_peak() {
    PEAK.store(current(), Ordering::Relaxed);
}
