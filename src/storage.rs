//! Where a buffer's elements live: host memory or (feature `cuda`) device memory, behind one
//! type, as candle's `Storage { Cpu, Cuda }`.
//!
//! - [`Storage`] owns elements (an optimizer's state arrays);
//! - [`View`] / [`ViewMut`] borrow them (the local shard an optimizer steps on, its gradients);
//! - [`Placement`] says where new storage goes ([`crate::optim::Optimizer::init_on`]).
//!
//! An optimizer's step takes views and state of either kind and runs the backend of that
//! storage over one piece walk; a step given host and device memory at once returns `Err`
//! ([`mixed`]). Without the `cuda` feature only the host variants exist. The enums are
//! `#[non_exhaustive]`: code in other crates matches them with a last arm for the storage it
//! has no backend for (see [`no_backend`]), so it builds whichever features are on.

#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits};

#[cfg(feature = "cuda")]
use crate::cuda::Device;
use crate::{Error, Result};

/// The element types storage holds (plain data; on a `cuda` build also device-representable).
#[cfg(feature = "cuda")]
pub trait Elem:
    Copy + Default + Send + Sync + 'static + bytemuck::Zeroable + DeviceRepr + ValidAsZeroBits
{
}
/// The element types storage holds (plain data; on a `cuda` build also device-representable).
#[cfg(not(feature = "cuda"))]
pub trait Elem: Copy + Default + Send + Sync + 'static + bytemuck::Zeroable {}

impl Elem for f32 {}
impl Elem for u8 {}
impl Elem for u16 {}
impl Elem for u32 {}
impl Elem for u64 {}

/// Elements in device memory, with the device that holds them (its stream orders every
/// operation on them).
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct DeviceVec<T> {
    pub data: CudaSlice<T>,
    pub dev: Arc<Device>,
}

/// Owned elements, in host or device memory.
#[derive(Debug)]
#[non_exhaustive]
pub enum Storage<T> {
    Cpu(Vec<T>),
    #[cfg(feature = "cuda")]
    Cuda(DeviceVec<T>),
}

/// Borrowed elements, read-only.
#[derive(Debug)]
#[non_exhaustive]
pub enum View<'a, T> {
    Cpu(&'a [T]),
    #[cfg(feature = "cuda")]
    Cuda(CudaView<'a, T>),
}

/// Borrowed elements, writable.
#[derive(Debug)]
#[non_exhaustive]
pub enum ViewMut<'a, T> {
    Cpu(&'a mut [T]),
    #[cfg(feature = "cuda")]
    Cuda(CudaViewMut<'a, T>),
}

/// Where new storage is allocated.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub enum Placement {
    #[default]
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(Arc<Device>),
}

/// The error of an operation given host and device memory at once (or device memory where
/// only host memory is supported).
pub fn mixed(op: &'static str, what: &str) -> Error {
    Error::BadInput {
        op,
        what: what.into(),
        reason: "the local shard, its gradients and the state must all be host memory or all \
                 device memory of one device (and this operation must support that storage)"
            .into(),
    }
}

/// The error of an operation given a storage it has no backend for in this build (device
/// memory to a crate built without its `cuda` feature).
pub fn no_backend(op: &'static str) -> Error {
    Error::BadInput {
        op,
        what: "device memory".into(),
        reason: "this build has no device backend for the operation (build the crate that \
                 provides it with its `cuda` feature)"
            .into(),
    }
}

#[cfg(feature = "cuda")]
fn on_device(op: &'static str) -> Error {
    Error::BadInput {
        op,
        what: "device memory".into(),
        reason: "the elements live on a GPU: read them with Storage::to_vec".into(),
    }
}

impl Placement {
    /// `len` zeroed elements here; `Err`, not an abort, where the memory is refused.
    pub fn zeros<T: Elem>(&self, len: usize) -> Result<Storage<T>> {
        match self {
            Placement::Cpu => Ok(Storage::Cpu(crate::limits::zeroed(
                "Placement::zeros",
                "host storage",
                len,
            )?)),
            #[cfg(feature = "cuda")]
            Placement::Cuda(dev) => Ok(Storage::Cuda(DeviceVec {
                data: dev.zeros(len)?,
                dev: Arc::clone(dev),
            })),
        }
    }

    /// A copy of `host` here (the vector itself for the host).
    pub fn put<T: Elem>(&self, host: Vec<T>) -> Result<Storage<T>> {
        match self {
            Placement::Cpu => Ok(Storage::Cpu(host)),
            #[cfg(feature = "cuda")]
            Placement::Cuda(dev) => Ok(Storage::Cuda(DeviceVec {
                data: dev.upload(&host)?,
                dev: Arc::clone(dev),
            })),
        }
    }

    /// Whether this is host memory (work on it is done when its call returns).
    pub fn is_cpu(&self) -> bool {
        matches!(self, Placement::Cpu)
    }

    /// Waits until the work this thread queued here has finished: nothing on the host (host
    /// work is done when its call returns); on a device, its stream as this thread sees it
    /// (candle's is the per-thread default stream, so each thread waits for its own work).
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Placement::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Placement::Cuda(dev) => dev.sync(),
        }
    }
}

impl<T: Elem> Storage<T> {
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(v) => v.len(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => d.data.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the elements live.
    pub fn placement(&self) -> Placement {
        match self {
            Storage::Cpu(_) => Placement::Cpu,
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => Placement::Cuda(Arc::clone(&d.dev)),
        }
    }

    /// The host elements (`Err` for device memory).
    pub fn cpu(&self) -> Result<&[T]> {
        match self {
            Storage::Cpu(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(on_device("Storage::cpu")),
        }
    }

    /// The host elements, writable (`Err` for device memory).
    pub fn cpu_mut(&mut self) -> Result<&mut [T]> {
        match self {
            Storage::Cpu(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(on_device("Storage::cpu_mut")),
        }
    }

    /// A host copy (downloaded from the device, waiting for its stream).
    pub fn to_vec(&self) -> Result<Vec<T>> {
        Ok(self.host()?.into_owned())
    }

    /// The elements as a host vector: moved out of host storage, downloaded from a device.
    pub fn into_vec(self) -> Result<Vec<T>> {
        match self {
            Storage::Cpu(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => d.dev.download(&d.data),
        }
    }

    /// The elements on the host: borrowed from host storage, downloaded from a device.
    pub fn host(&self) -> Result<std::borrow::Cow<'_, [T]>> {
        match self {
            Storage::Cpu(v) => Ok(std::borrow::Cow::Borrowed(v)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => Ok(std::borrow::Cow::Owned(d.dev.download(&d.data)?)),
        }
    }

    /// Elements `range` on the host: borrowed from host storage, downloaded from a device
    /// (that range only); `Err` for a range past the end.
    pub fn read_range(&self, range: std::ops::Range<usize>) -> Result<std::borrow::Cow<'_, [T]>> {
        self.check_range("Storage::read_range", &range)?;
        match self {
            Storage::Cpu(v) => Ok(std::borrow::Cow::Borrowed(&v[range])),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => Ok(std::borrow::Cow::Owned(
                d.dev.download(&d.data.slice(range))?,
            )),
        }
    }

    /// Sets elements `range` by `fill`, which must write every element of the slice it gets:
    /// the elements themselves in host storage, a host buffer uploaded into the range after it
    /// for a device; `Err` for a range past the end, or `fill`'s.
    pub fn fill_range(
        &mut self,
        range: std::ops::Range<usize>,
        fill: impl FnOnce(&mut [T]) -> Result<()>,
    ) -> Result<()> {
        self.check_range("Storage::fill_range", &range)?;
        match self {
            Storage::Cpu(v) => fill(&mut v[range]),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => {
                let mut host = vec![T::default(); range.len()];
                fill(&mut host)?;
                d.dev.upload_into(&host, &mut d.data.slice_mut(range))
            }
        }
    }

    /// `Err` unless `range` lies inside the storage.
    fn check_range(&self, op: &'static str, range: &std::ops::Range<usize>) -> Result<()> {
        if range.start <= range.end && range.end <= self.len() {
            return Ok(());
        }
        Err(Error::InvalidShard {
            op,
            reason: format!("{range:?} of {}", self.len()),
        })
    }

    /// A copy in the same memory (device to device for device storage).
    pub fn try_clone(&self) -> Result<Self> {
        match self {
            Storage::Cpu(v) => Ok(Storage::Cpu(v.clone())),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => {
                let stream = d.dev.stream();
                let data =
                    crate::cuda::guarded("Storage::try_clone", || stream.clone_dtod(&d.data))?;
                Ok(Storage::Cuda(DeviceVec {
                    data,
                    dev: Arc::clone(&d.dev),
                }))
            }
        }
    }

    pub fn view(&self) -> View<'_, T> {
        match self {
            Storage::Cpu(v) => View::Cpu(v),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => View::Cuda(d.data.slice(..)),
        }
    }

    pub fn view_mut(&mut self) -> ViewMut<'_, T> {
        match self {
            Storage::Cpu(v) => ViewMut::Cpu(v),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => ViewMut::Cuda(d.data.slice_mut(..)),
        }
    }
}

/// Host copies and element loops of at least this many bytes run in parts on rayon's threads:
/// one core's memcpy reaches about half of a machine's copy bandwidth.
pub const PARALLEL_BYTES: usize = 4 << 20;

/// Elements per part of a parallel host loop over `f32`.
const PARALLEL_ELEMS: usize = PARALLEL_BYTES / 8;

/// Element ops on `f32` storage, by a host loop or one device kernel (`cuda::ops`): each is
/// one IEEE `f32` operation per element, so both give the same bits (and parts of a host loop
/// run on several threads: the operation per element is the same).
impl Storage<f32> {
    /// `self[range] ← src`, or `self[range] += src` when `add`.
    pub fn write_range(
        &mut self,
        range: std::ops::Range<usize>,
        src: View<'_, f32>,
        add: bool,
    ) -> Result<()> {
        const OP: &str = "Storage::write_range";
        self.check_range(OP, &range)?;
        if src.len() != range.len() {
            return Err(Error::InvalidShard {
                op: OP,
                reason: format!("{} elements into {range:?} of {}", src.len(), self.len()),
            });
        }
        use rayon::prelude::*;
        let write = |d: &mut [f32], s: &[f32]| {
            if add {
                d.iter_mut().zip(s).for_each(|(d, s)| *d += s)
            } else {
                d.copy_from_slice(s)
            }
        };
        match (self, src) {
            (Storage::Cpu(v), View::Cpu(src)) if range.len() < 2 * PARALLEL_ELEMS => {
                write(&mut v[range], src)
            }
            (Storage::Cpu(v), View::Cpu(src)) => v[range]
                .par_chunks_mut(PARALLEL_ELEMS)
                .zip(src.par_chunks(PARALLEL_ELEMS))
                .for_each(|(d, s)| write(d, s)),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(d), View::Cuda(src)) => {
                let mut dst = d.data.slice_mut(range);
                if add {
                    crate::cuda::ops::add(&d.dev, &mut dst, &src)?
                } else {
                    crate::cuda::ops::copy(&d.dev, &mut dst, &src)?
                }
            }
            #[cfg(feature = "cuda")]
            _ => return Err(mixed(OP, "host and device memory")),
        }
        Ok(())
    }

    /// `self[range] ← 0`.
    pub fn zero_range(&mut self, range: std::ops::Range<usize>) -> Result<()> {
        self.check_range("Storage::zero_range", &range)?;
        match self {
            Storage::Cpu(v) => v[range].fill(0.0),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => crate::cuda::ops::zero(&d.dev, &mut d.data.slice_mut(range))?,
        }
        Ok(())
    }

    /// How many elements are NaN or infinite (on a device: one kernel, 8 bytes downloaded).
    pub fn count_non_finite(&self) -> Result<u64> {
        let mut counts = NonFiniteCounts::new(&self.placement(), 1)?;
        counts.add(0, self)?;
        Ok(counts.read()?[0])
    }

    /// `self ← a·self`.
    pub fn scale(&mut self, a: f32) -> Result<()> {
        match self {
            Storage::Cpu(v) => v.iter_mut().for_each(|x| *x *= a),
            #[cfg(feature = "cuda")]
            Storage::Cuda(d) => crate::cuda::ops::scale(&d.dev, &mut d.data.slice_mut(..), a)?,
        }
        Ok(())
    }
}

/// Non-finite element counts of several `f32` storages of one placement, a slot each, read
/// with one wait for the device ([`NonFiniteCounts::read`]): checking every unit's gradients
/// before a step costs one device synchronization, not one per unit.
#[derive(Debug)]
pub struct NonFiniteCounts {
    slots: Storage<u64>,
}

impl NonFiniteCounts {
    /// `n` slots at zero, in `placement`.
    pub fn new(placement: &Placement, n: usize) -> Result<Self> {
        Ok(NonFiniteCounts {
            slots: placement.zeros(n)?,
        })
    }

    /// Adds to slot `slot` how many elements of `x` are NaN or infinite (on a device, queued).
    pub fn add(&mut self, slot: usize, x: &Storage<f32>) -> Result<()> {
        const OP: &str = "NonFiniteCounts::add";
        if slot >= self.slots.len() {
            return Err(Error::BadInput {
                op: OP,
                what: format!("slot {slot}"),
                reason: format!("there are {} slots", self.slots.len()),
            });
        }
        match (&mut self.slots, x) {
            (Storage::Cpu(c), Storage::Cpu(v)) => {
                c[slot] += v.iter().filter(|x| !x.is_finite()).count() as u64;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(c), Storage::Cuda(d)) if Arc::ptr_eq(&c.dev, &d.dev) => {
                let mut total = c.data.slice_mut(slot..slot + 1);
                crate::cuda::ops::add_non_finite(&d.dev, &d.data.slice(..), &mut total)
            }
            #[allow(unreachable_patterns)]
            _ => Err(mixed(OP, "the counted storage")),
        }
    }

    /// Every slot's count (from a device: one download, which waits for the counts).
    pub fn read(&self) -> Result<Vec<u64>> {
        self.slots.to_vec()
    }
}

impl<T> From<Vec<T>> for Storage<T> {
    fn from(v: Vec<T>) -> Self {
        Storage::Cpu(v)
    }
}

/// Host storage compares by value; device storage is never equal to anything (compare
/// [`Storage::to_vec`] copies instead).
impl<T: PartialEq> PartialEq for Storage<T> {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Storage::Cpu(a), Storage::Cpu(b)) => a == b,
            #[cfg(feature = "cuda")]
            _ => false,
        }
    }
}

impl<'a, T> View<'a, T> {
    pub fn len(&self) -> usize {
        match self {
            View::Cpu(v) => v.len(),
            #[cfg(feature = "cuda")]
            View::Cuda(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host elements (`Err(mixed)` for device memory).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn cpu(self, op: &'static str) -> Result<&'a [T]> {
        match self {
            View::Cpu(v) => Ok(v),
            #[cfg(feature = "cuda")]
            View::Cuda(_) => Err(mixed(op, "device gradients")),
        }
    }
}

impl<'a, T> ViewMut<'a, T> {
    /// The same elements for a shorter borrow (so the view can be used again after).
    pub fn reborrow(&mut self) -> ViewMut<'_, T> {
        match self {
            ViewMut::Cpu(v) => ViewMut::Cpu(v),
            #[cfg(feature = "cuda")]
            ViewMut::Cuda(v) => ViewMut::Cuda(v.slice_mut(..)),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            ViewMut::Cpu(v) => v.len(),
            #[cfg(feature = "cuda")]
            ViewMut::Cuda(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host elements (`Err(mixed)` for device memory).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn cpu(self, op: &'static str) -> Result<&'a mut [T]> {
        match self {
            ViewMut::Cpu(v) => Ok(v),
            #[cfg(feature = "cuda")]
            ViewMut::Cuda(_) => Err(mixed(op, "device parameters")),
        }
    }
}

impl<'a, T> From<&'a [T]> for View<'a, T> {
    fn from(v: &'a [T]) -> Self {
        View::Cpu(v)
    }
}

impl<'a, T> From<&'a mut [T]> for ViewMut<'a, T> {
    fn from(v: &'a mut [T]) -> Self {
        ViewMut::Cpu(v)
    }
}

impl<'a, T> From<&'a Vec<T>> for View<'a, T> {
    fn from(v: &'a Vec<T>) -> Self {
        View::Cpu(v)
    }
}

impl<'a, T> From<&'a mut Vec<T>> for ViewMut<'a, T> {
    fn from(v: &'a mut Vec<T>) -> Self {
        ViewMut::Cpu(v)
    }
}

#[cfg(feature = "cuda")]
impl<'a, T> From<CudaView<'a, T>> for View<'a, T> {
    fn from(v: CudaView<'a, T>) -> Self {
        View::Cuda(v)
    }
}

#[cfg(feature = "cuda")]
impl<'a, T> From<CudaViewMut<'a, T>> for ViewMut<'a, T> {
    fn from(v: CudaViewMut<'a, T>) -> Self {
        ViewMut::Cuda(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_storage_round_trips_and_reports_its_placement() {
        let mut s = Placement::Cpu.zeros::<f32>(4).unwrap();
        assert_eq!(s.len(), 4);
        s.cpu_mut().unwrap()[2] = 7.0;
        assert_eq!(s.to_vec().unwrap(), vec![0.0, 0.0, 7.0, 0.0]);
        assert!(s.placement().is_cpu());
        s.view_mut().cpu("test").unwrap()[0] = 1.0;
        assert_eq!(s.cpu().unwrap()[0], 1.0);
        assert_eq!(
            Placement::Cpu.put(vec![3u8, 4]).unwrap(),
            Storage::Cpu(vec![3u8, 4])
        );
    }

    /// Host storage beyond memory, or beyond the address space, is an `Err` naming the op:
    /// `vec![0.0; n]` aborted the process ("memory allocation of … bytes failed") or panicked
    /// ("capacity overflow"), reached from `fully_shard` with a huge collective alignment.
    #[test]
    fn host_storage_beyond_memory_is_an_error_not_an_abort() {
        // 2^60 f32 = 4 EiB (no machine has it); 2^62 f32 = 2^64 bytes overflows usize.
        for len in [1usize << 60, 1 << 62] {
            let err = Placement::Cpu.zeros::<f32>(len).unwrap_err().to_string();
            assert!(
                err.contains("Placement::zeros") && err.contains("cannot allocate"),
                "{err}"
            );
        }
        let s = Placement::Cpu.zeros::<u16>(5).unwrap();
        assert_eq!(s.cpu().unwrap(), &[0u16; 5]);
    }

    #[test]
    fn host_element_ops_touch_only_their_range() {
        let mut s = Placement::Cpu.put(vec![1.0f32; 6]).unwrap();
        let src = [2.0f32, 3.0];
        s.write_range(1..3, (&src[..]).into(), true).unwrap();
        s.write_range(4..6, (&src[..]).into(), false).unwrap();
        assert_eq!(s.cpu().unwrap(), &[1.0, 3.0, 4.0, 1.0, 2.0, 3.0]);
        s.zero_range(0..2).unwrap();
        s.scale(0.5).unwrap();
        assert_eq!(s.cpu().unwrap(), &[0.0, 0.0, 2.0, 0.5, 1.0, 1.5]);
        assert!(s.write_range(5..7, (&src[..]).into(), false).is_err());
        assert!(s.write_range(0..3, (&src[..]).into(), false).is_err());
        assert!(s.zero_range(3..7).is_err());
        // A reversed range has length 0 but cannot be sliced: refused, not a panic.
        #[allow(clippy::reversed_empty_ranges)]
        let (rev_a, rev_b) = (5..3, 4..2);
        assert!(s.write_range(rev_a, (&src[..0]).into(), false).is_err());
        assert!(s.zero_range(rev_b).is_err());
    }

    #[test]
    fn non_finite_elements_are_counted_and_extremes_are_not() {
        let odd = [f32::NAN, 1.0, f32::INFINITY, f32::MAX, f32::NEG_INFINITY];
        let s = Placement::Cpu.put(odd.to_vec()).unwrap();
        assert_eq!(s.count_non_finite().unwrap(), 3);
        let tiny = [f32::from_bits(1), -0.0, f32::MIN, f32::MIN_POSITIVE];
        let s = Placement::Cpu.put(tiny.to_vec()).unwrap();
        assert_eq!(s.count_non_finite().unwrap(), 0);
    }

    #[test]
    fn large_host_writes_run_in_parts_with_the_same_result() {
        let n = 3 * PARALLEL_ELEMS + 7;
        let src: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        let mut s = Placement::Cpu.put(vec![1.0f32; n + 2]).unwrap();
        s.write_range(1..n + 1, (&src[..]).into(), true).unwrap();
        let v = s.cpu().unwrap();
        assert!(v[0] == 1.0 && v[n + 1] == 1.0);
        assert!(v[1..=n].iter().zip(&src).all(|(a, b)| *a == 1.0 + b));
        s.write_range(1..n + 1, (&src[..]).into(), false).unwrap();
        assert!(s.cpu().unwrap()[1..=n] == src[..]);
    }
}
