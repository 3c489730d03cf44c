//! Work sharing for one step's independent items (8-bit Adam's scale-block chunks and small
//! fallback pieces): the **calling thread** and up to `helpers` of rayon's workers claim items
//! from one queue until it is empty.
//!
//! # Why not `par_iter` or a rayon scope
//! A step is usually called from a thread outside rayon's pool (the training loop, a thread
//! rank). There `par_iter` injects the whole job into the pool and puts the caller to sleep
//! until a worker has woken, run it and woken the caller again: two cross-thread wake-ups per
//! step, which on a 0.1 ms step of a 256 × 256 matrix cost as much as the second core saves.
//! A rayon scope lets the caller work at once, but it must wait at its end for every spawned
//! job to run, even one whose worker has not woken yet and would find nothing left to do:
//! measured on a loaded 2-vCPU machine (`examples/adam8bit_steps.rs threshold`), that wait
//! made a shared 4096-element step 2.9× as slow as one on the caller alone.
//!
//! Here the caller starts on the first item at once and, when the queue is empty, waits only
//! for the items a helper is still running (at most one each). A helper that starts after the
//! caller has closed the queue returns without touching it: the helpers are plain
//! `rayon::spawn` jobs holding a type-erased pointer to the queue and a shared gate
//! ([`Gate`]) that says whether the queue still exists. Which thread runs an item changes no
//! result: the items are independent.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Runs `work` on every item of `items`, on the calling thread and up to `helpers` rayon
/// workers (none when `helpers` is 0 or there is at most one item). Returns when every item
/// is done; a helper that wakes later does nothing.
pub(crate) fn share<T: Send, F: Fn(T) + Sync>(items: Vec<T>, helpers: usize, work: F) {
    let helpers = helpers.min(items.len().saturating_sub(1));
    if helpers == 0 {
        items.into_iter().for_each(work);
        return;
    }
    let queue = Queue {
        items: Mutex::new(items.into_iter()),
        work: &work,
    };
    let gate = Arc::new(Gate::default());
    // Closes the gate and waits for the helpers inside it when this frame ends, also if
    // `work` panics here, so that no helper can reach `queue` after it is gone.
    let _closer = Closer(&gate);
    let erased = Erased(std::ptr::from_ref(&queue).cast());
    let run: unsafe fn(*const ()) = drain_erased::<T, F>;
    for _ in 0..helpers {
        let gate = Arc::clone(&gate);
        rayon::spawn(move || {
            // A method call, so that the closure captures the whole `Erased` (which is
            // `Send`), not its raw-pointer field.
            let queue = erased.ptr();
            if gate.enter() {
                // SAFETY: the gate is open, so the caller's frame (and `queue` in it) lives
                // until this helper leaves: `Closer` closes the gate and waits for every
                // entered helper before the frame ends. `queue` is a `Queue<T, F>` with
                // `T: Send` and `F: Sync`, so draining it from this thread is sound.
                unsafe { run(queue) };
                gate.leave();
            }
        });
    }
    queue.drain();
}

/// The items left and the function that runs them.
struct Queue<'w, T, F> {
    items: Mutex<std::vec::IntoIter<T>>,
    work: &'w F,
}

impl<T, F: Fn(T)> Queue<'_, T, F> {
    /// Claims and runs items until none is left.
    fn drain(&self) {
        loop {
            // A poisoned lock means a `work` panicked on the calling thread (a helper's
            // panic aborts the process); the iterator itself is still sound to read.
            let next = self.items.lock().unwrap_or_else(|e| e.into_inner()).next();
            match next {
                Some(item) => (self.work)(item),
                None => break,
            }
        }
    }
}

/// [`Queue::drain`] behind a type-erased pointer, so that a `'static` rayon job can hold it.
///
/// # Safety
/// `queue` must point to a live `Queue<T, F>` that may be used from this thread.
unsafe fn drain_erased<T, F: Fn(T)>(queue: *const ()) {
    // SAFETY: the caller's contract.
    unsafe { (*queue.cast::<Queue<'_, T, F>>()).drain() }
}

/// A pointer to the caller's [`Queue`], sent to the helpers.
#[derive(Clone, Copy)]
struct Erased(*const ());

impl Erased {
    fn ptr(self) -> *const () {
        self.0
    }
}

// SAFETY: the pointer is dereferenced only through the gate protocol of `share`, which
// keeps the queue alive while a helper uses it; the queue's items are `Send` and its work
// `Sync` (the bounds of `share`).
unsafe impl Send for Erased {}

/// Whether the queue may still be used, and how many helpers are using it: the count in the
/// low bits, [`CLOSED`] set once the caller is done.
#[derive(Default)]
struct Gate(AtomicUsize);

const CLOSED: usize = 1 << (usize::BITS - 1);

impl Gate {
    /// Enters if the gate is still open (then [`Gate::leave`] must follow).
    fn enter(&self) -> bool {
        // Acquire pairs with nothing the caller writes to the queue after closing; it keeps
        // the helper's reads of the queue after its entry.
        if self.0.fetch_add(1, Ordering::Acquire) & CLOSED == 0 {
            return true;
        }
        self.0.fetch_sub(1, Ordering::Relaxed);
        false
    }

    /// Leaves: the helper's writes (the items it ran) happen before the caller's return.
    fn leave(&self) {
        self.0.fetch_sub(1, Ordering::Release);
    }

    /// Closes the gate and waits until no helper is inside.
    fn close_and_wait(&self) {
        let mut seen = self.0.fetch_or(CLOSED, Ordering::AcqRel);
        let mut spins = 0u32;
        while seen & !CLOSED != 0 {
            // A helper is finishing its last item (at most one each): spin briefly, then let
            // the scheduler run it (on a loaded machine it may be waiting for this core).
            if spins < 64 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
            seen = self.0.load(Ordering::Acquire);
        }
    }
}

/// Closes its gate when dropped ([`Gate::close_and_wait`]).
struct Closer<'g>(&'g Gate);

impl Drop for Closer<'_> {
    fn drop(&mut self) {
        self.0.close_and_wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Every item runs exactly once, with and without helpers, and more helpers than items.
    #[test]
    fn every_item_runs_once_whatever_the_helpers() {
        for helpers in [0, 1, 3, 100] {
            let counts: Vec<AtomicUsize> = (0..37).map(|_| AtomicUsize::new(0)).collect();
            share((0..37).collect(), helpers, |k: usize| {
                counts[k].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                "{helpers} helpers"
            );
        }
    }

    /// A caller whose helper cannot start (it is queued behind the caller itself, the only
    /// worker of a one-thread pool) runs every item and returns without waiting for it; the
    /// stale helper later does nothing. A `share` that waited would never return: the test
    /// then fails on its timeout.
    #[test]
    fn the_caller_does_not_wait_for_a_helper_that_has_not_started() {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .expect("a one-thread pool");
            let ran = pool.install(|| {
                let caller = std::thread::current().id();
                let counts: Vec<AtomicUsize> = (0..8).map(|_| AtomicUsize::new(0)).collect();
                let elsewhere = AtomicUsize::new(0);
                share((0..8).collect(), 1, |k: usize| {
                    if std::thread::current().id() != caller {
                        elsewhere.fetch_add(1, Ordering::Relaxed);
                    }
                    counts[k].fetch_add(1, Ordering::Relaxed);
                });
                let once = counts.iter().all(|c| c.load(Ordering::Relaxed) == 1);
                (once, elsewhere.load(Ordering::Relaxed))
            });
            let _ = done.send(ran);
        });
        let ran = finished
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("share waited for a helper that could not start");
        assert_eq!(ran, (true, 0));
    }

    /// In a pool of two threads the helper takes items: with items long enough for the
    /// pool's other worker to steal the helper's job, two threads run them.
    #[test]
    fn a_helper_takes_items_when_the_pool_has_a_free_thread() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a two-thread pool");
        let threads = Mutex::new(std::collections::HashSet::new());
        pool.install(|| {
            share((0..64).collect(), 1, |_k: usize| {
                std::thread::sleep(std::time::Duration::from_millis(2));
                let mut seen = threads.lock().unwrap_or_else(|e| e.into_inner());
                seen.insert(std::thread::current().id());
            });
        });
        let seen = threads.into_inner().unwrap_or_else(|e| e.into_inner());
        assert_eq!(seen.len(), 2, "the helper never ran an item");
    }
}
