//! An optimizer state as checkpointable fields.
//!
//! Every state array of every optimizer here is, per parameter, a piece of one *global* array
//! that does not depend on the world size or the layout: Adam's moments have one element per
//! parameter element, 8-bit Adam's scales one per 256-element scale block of the global shape,
//! Shampoo's factors one run per Kronecker block. A rank holds a contiguous range of each
//! parameter's global array (blocks never straddle ranks), so a state is described by
//! [`FieldLayout`]s: for each field, its element type, its global length per parameter, and
//! where this rank's ranges lie in its local array. That is all a checkpoint needs to write a
//! state at one world size and read it back at another ([`crate::ragged::redistribute`] on the
//! global arrays).

use std::borrow::Cow;
use std::ops::Range;

use crate::comm::BufMut;
use crate::optim::{LocalShard, Optimizer, ParamMeta, Sgd};
use crate::storage::{Elem, Placement, Storage};
use crate::{Error, Result};

/// Element type of a state field (and of a checkpoint tensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum FieldType {
    F32,
    U16,
    U8,
}

impl FieldType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            FieldType::F32 => 4,
            FieldType::U16 => 2,
            FieldType::U8 => 1,
        }
    }

    /// The safetensors `dtype` string.
    pub fn safetensors(self) -> &'static str {
        match self {
            FieldType::F32 => "F32",
            FieldType::U16 => "U16",
            FieldType::U8 => "U8",
        }
    }
}

/// Elements `global` of parameter `param`'s global field array sit at `local` in this rank's
/// local array of the field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldSpan {
    /// Index into [`LocalShard::params`].
    pub param: usize,
    pub global: Range<usize>,
    pub local: usize,
}

/// One field of a state on one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldLayout {
    /// Short and unique within the state (`"m"`, `"scale_v"`, `"factors"`).
    pub name: &'static str,
    pub dtype: FieldType,
    /// Elements of the field's global array per parameter of the shard (`0`: the parameter has
    /// no such field).
    pub global_len: Vec<usize>,
    /// This rank's ranges, in local order; at most one per parameter.
    pub spans: Vec<FieldSpan>,
    /// Elements of the local array (padding included).
    pub local_len: usize,
}

impl FieldLayout {
    /// A field laid out like the local shard: one element per parameter element, at the
    /// pieces' offsets (padding between them belongs to no parameter).
    pub fn like_shard(name: &'static str, dtype: FieldType, shard: &LocalShard) -> Self {
        FieldLayout {
            name,
            dtype,
            global_len: shard.params.iter().map(ParamMeta::numel).collect(),
            spans: shard
                .pieces
                .iter()
                .map(|p| FieldSpan {
                    param: p.param,
                    global: p.range.clone(),
                    local: p.offset,
                })
                .collect(),
            local_len: shard.len,
        }
    }

    /// A field packed in shard order: `of(meta, piece range)` gives, for a parameter that has
    /// the field, its global length and the global range the piece covers; the ranges are
    /// concatenated without gaps in the local array.
    pub fn packed(
        name: &'static str,
        dtype: FieldType,
        shard: &LocalShard,
        of: impl Fn(&ParamMeta, &Range<usize>) -> Result<Option<(usize, Range<usize>)>>,
    ) -> Result<Self> {
        let mut global_len = vec![0; shard.params.len()];
        let (mut spans, mut at) = (Vec::new(), 0);
        for piece in &shard.pieces {
            let meta = &shard.params[piece.param];
            let Some((len, global)) = of(meta, &piece.range)? else {
                continue;
            };
            global_len[piece.param] = len;
            let n = global.len();
            if n == 0 {
                // A piece of blocks without state (Shampoo's 1×1 blocks): nothing to hold.
                continue;
            }
            spans.push(FieldSpan {
                param: piece.param,
                global,
                local: at,
            });
            at += n;
        }
        Ok(FieldLayout {
            name,
            dtype,
            global_len,
            spans,
            local_len: at,
        })
    }
}

/// A field's local array of element type `T`: host elements, or a state's storage in host
/// or device memory (a device array is read and written range by range, through the host).
#[derive(Debug)]
pub enum FieldArray<'a, T> {
    Host(&'a [T]),
    Storage(&'a Storage<T>),
}

/// A field's local array, to fill ([`FieldArray`]'s forms).
#[derive(Debug)]
pub enum FieldArrayMut<'a, T> {
    Host(&'a mut [T]),
    Storage(&'a mut Storage<T>),
}

impl<T: Elem> FieldArray<'_, T> {
    pub fn len(&self) -> usize {
        match self {
            FieldArray::Host(x) => x.len(),
            FieldArray::Storage(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `range` on the host (downloaded from a device); `Err` past the end.
    pub fn read(&self, range: Range<usize>) -> Result<Cow<'_, [T]>> {
        match self {
            FieldArray::Host(x) => x
                .get(range.clone())
                .map(Cow::Borrowed)
                .ok_or_else(|| past_end("FieldArray::read", &range, x.len())),
            FieldArray::Storage(s) => s.read_range(range),
        }
    }
}

impl<T: Elem> FieldArrayMut<'_, T> {
    pub fn len(&self) -> usize {
        match self {
            FieldArrayMut::Host(x) => x.len(),
            FieldArrayMut::Storage(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sets elements `range` by `fill`, which writes every element of the slice it gets (on
    /// a device, a host buffer uploaded after it); `Err` past the end, or `fill`'s.
    pub fn fill(
        &mut self,
        range: Range<usize>,
        fill: impl FnOnce(&mut [T]) -> Result<()>,
    ) -> Result<()> {
        match self {
            FieldArrayMut::Host(x) => {
                let len = x.len();
                let part = x
                    .get_mut(range.clone())
                    .ok_or_else(|| past_end("FieldArrayMut::fill", &range, len))?;
                fill(part)
            }
            FieldArrayMut::Storage(s) => s.fill_range(range, fill),
        }
    }
}

fn past_end(op: &'static str, range: &Range<usize>, len: usize) -> Error {
    Error::BadInput {
        op,
        what: format!("range {range:?}"),
        reason: format!("the field holds {len} elements"),
    }
}

/// A field's local array.
#[derive(Debug)]
pub enum FieldData<'a> {
    F32(FieldArray<'a, f32>),
    U16(FieldArray<'a, u16>),
    U8(FieldArray<'a, u8>),
}

/// A field's local array, to fill.
#[derive(Debug)]
pub enum FieldDataMut<'a> {
    F32(FieldArrayMut<'a, f32>),
    U16(FieldArrayMut<'a, u16>),
    U8(FieldArrayMut<'a, u8>),
}

/// `FieldData` and `FieldDataMut` from the arrays of one element type: host slices and
/// storage (host storage as its slice).
macro_rules! field_from {
    ($t:ty, $variant:ident) => {
        impl<'a> From<&'a [$t]> for FieldData<'a> {
            fn from(x: &'a [$t]) -> Self {
                FieldData::$variant(FieldArray::Host(x))
            }
        }
        impl<'a> From<&'a Storage<$t>> for FieldData<'a> {
            fn from(s: &'a Storage<$t>) -> Self {
                FieldData::$variant(match s {
                    Storage::Cpu(x) => FieldArray::Host(x),
                    #[allow(unreachable_patterns)]
                    s => FieldArray::Storage(s),
                })
            }
        }
        impl<'a> From<&'a mut [$t]> for FieldDataMut<'a> {
            fn from(x: &'a mut [$t]) -> Self {
                FieldDataMut::$variant(FieldArrayMut::Host(x))
            }
        }
        impl<'a> From<&'a mut Storage<$t>> for FieldDataMut<'a> {
            fn from(s: &'a mut Storage<$t>) -> Self {
                FieldDataMut::$variant(match s {
                    Storage::Cpu(x) => FieldArrayMut::Host(x),
                    #[allow(unreachable_patterns)]
                    s => FieldArrayMut::Storage(s),
                })
            }
        }
    };
}

field_from!(f32, F32);
field_from!(u16, U16);
field_from!(u8, U8);

impl FieldDataMut<'_> {
    /// The whole local array as one collective buffer (`u16` elements as their bytes, which
    /// is all a copy needs): HSDP's replicas receive a loaded shard through it.
    pub fn as_buf_mut(&mut self) -> BufMut<'_> {
        match self {
            FieldDataMut::F32(FieldArrayMut::Host(x)) => BufMut::F32(x),
            FieldDataMut::F32(FieldArrayMut::Storage(s)) => s.view_mut().into(),
            FieldDataMut::U8(FieldArrayMut::Host(x)) => BufMut::U8(x),
            FieldDataMut::U8(FieldArrayMut::Storage(s)) => s.view_mut().into(),
            FieldDataMut::U16(FieldArrayMut::Host(x)) => BufMut::U8(bytemuck::cast_slice_mut(x)),
            FieldDataMut::U16(FieldArrayMut::Storage(s)) => u16_bytes(s),
        }
    }
}

/// `u16` storage as its bytes.
fn u16_bytes(s: &mut Storage<u16>) -> BufMut<'_> {
    match s {
        Storage::Cpu(x) => BufMut::U8(bytemuck::cast_slice_mut(x)),
        #[cfg(feature = "cuda")]
        Storage::Cuda(d) => {
            let bytes = 2 * d.data.len();
            // SAFETY: every bit pattern is a valid `u8`, `u8` needs no alignment, and the view
            // covers the slice's own bytes, borrowed mutably for the view's lifetime.
            let view = unsafe { d.data.transmute_mut::<u8>(bytes) };
            view.expect("two bytes per u16 element").into()
        }
    }
}

impl FieldData<'_> {
    pub fn dtype(&self) -> FieldType {
        match self {
            FieldData::F32(_) => FieldType::F32,
            FieldData::U16(_) => FieldType::U16,
            FieldData::U8(_) => FieldType::U8,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            FieldData::F32(x) => x.len(),
            FieldData::U16(x) => x.len(),
            FieldData::U8(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Gives `with` elements `range` as little-endian bytes (the checkpoint's byte order),
    /// downloaded first from a device; `Err` past the end, or `with`'s.
    pub fn with_bytes<R>(
        &self,
        range: Range<usize>,
        with: impl FnOnce(&[u8]) -> Result<R>,
    ) -> Result<R> {
        match self {
            FieldData::F32(x) => with(bytemuck::cast_slice(&x.read(range)?)),
            FieldData::U16(x) => with(bytemuck::cast_slice(&x.read(range)?)),
            FieldData::U8(x) => with(&x.read(range)?),
        }
    }
}

impl FieldDataMut<'_> {
    pub fn dtype(&self) -> FieldType {
        match self {
            FieldDataMut::F32(_) => FieldType::F32,
            FieldDataMut::U16(_) => FieldType::U16,
            FieldDataMut::U8(_) => FieldType::U8,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            FieldDataMut::F32(x) => x.len(),
            FieldDataMut::U16(x) => x.len(),
            FieldDataMut::U8(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sets elements `range` by `fill`, which writes every byte of the little-endian bytes it
    /// gets (uploaded after it to a device); `Err` past the end, or `fill`'s.
    pub fn fill_bytes(
        &mut self,
        range: Range<usize>,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        match self {
            FieldDataMut::F32(x) => x.fill(range, |x| fill(bytemuck::cast_slice_mut(x))),
            FieldDataMut::U16(x) => x.fill(range, |x| fill(bytemuck::cast_slice_mut(x))),
            FieldDataMut::U8(x) => x.fill(range, fill),
        }
    }
}

/// An optimizer whose state can be written to a checkpoint and read back at any world size
/// and layout. `state_layout`, `state_data` and `state_data_mut` list the same fields in the
/// same order.
pub trait CheckpointState: Optimizer {
    /// The fields of a state of `shard` (what [`Optimizer::init`] allocates).
    fn state_layout(&self, shard: &LocalShard) -> Result<Vec<FieldLayout>>;

    /// The local arrays of `state`, in [`Self::state_layout`]'s order, where they live (a
    /// device array is read range by range when the checkpoint is written).
    fn state_data<'a>(&self, state: &'a Self::State) -> Result<Vec<FieldData<'a>>>;

    /// The local arrays of `state`, to fill, in [`Self::state_layout`]'s order, where they
    /// live.
    fn state_data_mut<'a>(&self, state: &'a mut Self::State) -> Result<Vec<FieldDataMut<'a>>>;

    /// Steps the state has taken.
    fn state_step(&self, state: &Self::State) -> u64;

    fn set_state_step(&self, state: &mut Self::State, step: u64);
}

/// `Err` unless `data` matches `layout` field by field (name order, element type, length).
pub fn check_fields(
    op: &'static str,
    layout: &[FieldLayout],
    types_and_lens: impl ExactSizeIterator<Item = (FieldType, usize)>,
) -> Result<()> {
    if layout.len() != types_and_lens.len() {
        return Err(Error::InvalidShard {
            op,
            reason: format!(
                "the state has {} fields, its layout {}",
                types_and_lens.len(),
                layout.len()
            ),
        });
    }
    for (f, (dtype, len)) in layout.iter().zip(types_and_lens) {
        if f.dtype != dtype || f.local_len != len {
            return Err(Error::InvalidShard {
                op,
                reason: format!(
                    "state field {}: {len} {dtype:?} elements, its layout says {} {:?}",
                    f.name, f.local_len, f.dtype
                ),
            });
        }
    }
    Ok(())
}

impl CheckpointState for Sgd {
    fn state_layout(&self, _shard: &LocalShard) -> Result<Vec<FieldLayout>> {
        Ok(Vec::new())
    }

    fn state_data<'a>(&self, _state: &'a Placement) -> Result<Vec<FieldData<'a>>> {
        Ok(Vec::new())
    }

    fn state_data_mut<'a>(&self, _state: &'a mut Placement) -> Result<Vec<FieldDataMut<'a>>> {
        Ok(Vec::new())
    }

    fn state_step(&self, _state: &Placement) -> u64 {
        0
    }

    fn set_state_step(&self, _state: &mut Placement, _step: u64) {}
}
