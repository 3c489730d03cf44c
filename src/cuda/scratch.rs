//! Device buffers kept between calls: an optimizer step's workspace declared before use (its
//! lengths computed from the plan and the shapes before the first kernel runs), a
//! collective's table; once grown to what the calls need, the next calls allocate nothing.
//!
//! Why keep them: a fresh `cuMemAllocAsync` per buffer per call comes from the stream's memory
//! pool, which by default hands memory back to the driver at every synchronization (release
//! threshold 0), so each step would map its buffers afresh; and a workspace that appears
//! for one call and vanishes makes the device's peak depend on which call is running.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaViewMut, DeviceRepr, ValidAsZeroBits};

use super::Device;
use crate::Result;

/// One device buffer that grows to the longest length reserved of it and never shrinks; on
/// one device (a reservation on another device frees it and allocates there).
pub struct Scratch<T>(Option<CudaSlice<T>>);

impl<T> std::fmt::Debug for Scratch<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let len = self.0.as_ref().map_or(0, |b| b.len());
        write!(f, "Scratch({len} elements)")
    }
}

impl<T> Default for Scratch<T> {
    fn default() -> Self {
        Scratch(None)
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> Scratch<T> {
    /// Its first `len` elements on `dev`: allocated (zeroed) only when it must grow or the
    /// device changed, the old buffer freed first. What an earlier use left there is still
    /// there: callers write before they read.
    pub fn view_mut(&mut self, dev: &Device, len: usize) -> Result<CudaViewMut<'_, T>> {
        let kept = self
            .0
            .take()
            .filter(|b| b.len() >= len && Arc::ptr_eq(b.stream(), dev.stream()));
        let buf = match kept {
            Some(b) => self.0.insert(b),
            None => self.0.insert(dev.zeros::<T>(len)?),
        };
        Ok(buf.slice_mut(..len))
    }

    /// Its first `host.len()` elements on `dev` ([`Scratch::view_mut`]) holding a copy of
    /// `host`, the upload queued on `dev`'s stream.
    pub fn upload(&mut self, dev: &Device, host: &[T]) -> Result<CudaViewMut<'_, T>> {
        let mut view = self.view_mut(dev, host.len())?;
        dev.upload_into(host, &mut view)?;
        Ok(view)
    }

    /// At least `len` elements on `dev` from now on ([`Scratch::view_mut`]).
    pub fn reserve(&mut self, dev: &Device, len: usize) -> Result<()> {
        self.view_mut(dev, len).map(drop)
    }

    /// The bytes it holds.
    pub fn bytes(&self) -> usize {
        self.0
            .as_ref()
            .map_or(0, |b| b.len() * std::mem::size_of::<T>())
    }
}
