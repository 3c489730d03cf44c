//! Checkpointable states ([`ragged::checkpoint::CheckpointState`]): every optimizer's state as
//! fields of global per-parameter arrays, so a checkpoint written at one world size loads at
//! any other.
//!
//! | optimizer | field | type | global array per parameter |
//! |---|---|---|---|
//! | AdamW | `m`, `v` | f32 | one element per parameter element |
//! | Muon | `m` | f32 | one element per parameter element |
//! | | `v` | f32 | one per element of a parameter that is not a Muon matrix |
//! | 8-bit Adam | `m`, `v` | u8 codes | one per element (fallback parameters hold the zero code) |
//! | | `scale_m`, `scale_v` | u16 | one per 256-element scale block, in [`Tiling::scales_before`] order |
//! | | `m32`, `v32` | f32 | one per element of a fallback parameter |
//! | Shampoo | `m`, `v` (if grafting has one) | f32 | one per element |
//! | | `factors`, `roots` | f32 | every block's `L` then `R`, row-major, blocks in row-block then column-chunk order |
//!
//! A rank holds whole blocks of each parameter (8-bit row blocks, Shampoo row blocks), so its
//! range of every array is contiguous.

use std::ops::Range;

use ragged::checkpoint::{CheckpointState, FieldData, FieldDataMut, FieldLayout, FieldType};
use ragged::optim::{LocalShard, ParamMeta};
use ragged::{Error, Result};

use crate::adam8bit::Tiling;
use crate::{Adam8bit, Adam8bitState, AdamState, AdamW, Muon, MuonState, Shampoo, ShampooState};

impl CheckpointState for AdamW {
    /// `m` and `v`, both like the shard.
    fn state_layout(&self, shard: &LocalShard) -> Result<Vec<FieldLayout>> {
        Ok(vec![
            FieldLayout::like_shard("m", FieldType::F32, shard),
            FieldLayout::like_shard("v", FieldType::F32, shard),
        ])
    }

    fn state_data<'a>(&self, s: &'a AdamState) -> Result<Vec<FieldData<'a>>> {
        Ok(vec![(&s.m).into(), (&s.v).into()])
    }

    fn state_data_mut<'a>(&self, s: &'a mut AdamState) -> Result<Vec<FieldDataMut<'a>>> {
        Ok(vec![(&mut s.m).into(), (&mut s.v).into()])
    }

    fn state_step(&self, state: &AdamState) -> u64 {
        state.step
    }

    fn set_state_step(&self, state: &mut AdamState, step: u64) {
        state.step = step;
    }
}

impl CheckpointState for Muon {
    fn state_layout(&self, shard: &LocalShard) -> Result<Vec<FieldLayout>> {
        let fallback = |meta: &ParamMeta, range: &Range<usize>| {
            Ok((!self.is_muon(meta)).then(|| (meta.numel(), range.clone())))
        };
        Ok(vec![
            FieldLayout::like_shard("m", FieldType::F32, shard),
            FieldLayout::packed("v", FieldType::F32, shard, fallback)?,
        ])
    }

    fn state_data<'a>(&self, s: &'a MuonState) -> Result<Vec<FieldData<'a>>> {
        Ok(vec![(&s.m).into(), (&s.v).into()])
    }

    fn state_data_mut<'a>(&self, s: &'a mut MuonState) -> Result<Vec<FieldDataMut<'a>>> {
        Ok(vec![(&mut s.m).into(), (&mut s.v).into()])
    }

    fn state_step(&self, state: &MuonState) -> u64 {
        state.step
    }

    fn set_state_step(&self, state: &mut MuonState, step: u64) {
        state.step = step;
    }
}

fn cut_error(meta: &ParamMeta, range: &Range<usize>, what: &str) -> Error {
    Error::InvalidShard {
        op: "checkpoint state layout",
        reason: format!(
            "{}'s piece {range:?} does not start and end on a {what} edge",
            meta.name
        ),
    }
}

impl Adam8bit {
    /// The scale blocks a piece of an 8-bit parameter covers, and the parameter's total.
    fn scale_span(
        &self,
        meta: &ParamMeta,
        range: &Range<usize>,
    ) -> Result<Option<(usize, Range<usize>)>> {
        let Some(t) = self.tiling(&meta.name, &meta.shape) else {
            return Ok(None);
        };
        match (t.scales_before(range.start), t.scales_before(range.end)) {
            (Some(a), Some(b)) => Ok(Some((t.num_scales(), a..b))),
            _ => Err(cut_error(meta, range, "32-row block")),
        }
    }

    /// The elements of a fallback (f32-state) parameter a piece covers.
    fn fallback_span(
        &self,
        meta: &ParamMeta,
        range: &Range<usize>,
    ) -> Option<(usize, Range<usize>)> {
        let tiled: Option<Tiling> = self.tiling(&meta.name, &meta.shape);
        tiled.is_none().then(|| (meta.numel(), range.clone()))
    }
}

impl CheckpointState for Adam8bit {
    fn state_layout(&self, shard: &LocalShard) -> Result<Vec<FieldLayout>> {
        let scales =
            |name| FieldLayout::packed(name, FieldType::U16, shard, |m, r| self.scale_span(m, r));
        let fp32 = |name| {
            FieldLayout::packed(name, FieldType::F32, shard, |m, r| {
                Ok(self.fallback_span(m, r))
            })
        };
        Ok(vec![
            FieldLayout::like_shard("m", FieldType::U8, shard),
            FieldLayout::like_shard("v", FieldType::U8, shard),
            scales("scale_m")?,
            scales("scale_v")?,
            fp32("m32")?,
            fp32("v32")?,
        ])
    }

    fn state_data<'a>(&self, s: &'a Adam8bitState) -> Result<Vec<FieldData<'a>>> {
        Ok(vec![
            (&s.m).into(),
            (&s.v).into(),
            (&s.scale_m).into(),
            (&s.scale_v).into(),
            (&s.m32).into(),
            (&s.v32).into(),
        ])
    }

    fn state_data_mut<'a>(&self, s: &'a mut Adam8bitState) -> Result<Vec<FieldDataMut<'a>>> {
        Ok(vec![
            (&mut s.m).into(),
            (&mut s.v).into(),
            (&mut s.scale_m).into(),
            (&mut s.scale_v).into(),
            (&mut s.m32).into(),
            (&mut s.v32).into(),
        ])
    }

    fn state_step(&self, state: &Adam8bitState) -> u64 {
        state.step
    }

    fn set_state_step(&self, state: &mut Adam8bitState, step: u64) {
        state.step = step;
    }
}

impl Shampoo {
    /// Factor elements of one row block of `rows` rows of a parameter with `cols` columns
    /// (column chunks of `d`; a dimension of 1 has no factor, as [`crate::shampoo::Block`]).
    fn row_block_factor_len(rows: usize, cols: usize, d: usize) -> usize {
        let mut len = 0;
        let mut c0 = 0;
        while c0 < cols {
            let c = d.min(cols - c0);
            len += if rows > 1 { rows * rows } else { 0 } + if c > 1 { c * c } else { 0 };
            c0 += c;
        }
        len
    }

    /// The factor elements a piece covers, and the parameter's total.
    fn factor_span(
        &self,
        meta: &ParamMeta,
        range: &Range<usize>,
    ) -> Result<Option<(usize, Range<usize>)>> {
        let d = self.config().max_preconditioner_dim;
        let cols = meta.shape.last().copied().unwrap_or(1).max(1);
        let rows = meta.numel() / cols;
        let full = Self::row_block_factor_len(d, cols, d);
        let before = |elem: usize| -> Option<usize> {
            let row = elem / cols;
            if !elem.is_multiple_of(cols) || (!row.is_multiple_of(d) && row != rows) {
                return None;
            }
            let tail = if row == rows && !rows.is_multiple_of(d) {
                Self::row_block_factor_len(rows % d, cols, d)
            } else {
                0
            };
            Some((row / d) * full + tail)
        };
        match (before(range.start), before(range.end), before(meta.numel())) {
            (Some(a), Some(b), Some(total)) => Ok(Some((total, a..b))),
            _ => Err(cut_error(meta, range, "Shampoo row-block")),
        }
    }
}

impl CheckpointState for Shampoo {
    fn state_layout(&self, shard: &LocalShard) -> Result<Vec<FieldLayout>> {
        let mut fields = vec![FieldLayout::like_shard("m", FieldType::F32, shard)];
        if self.config().grafting.has_accumulator() {
            fields.push(FieldLayout::like_shard("v", FieldType::F32, shard));
        }
        for name in ["factors", "roots"] {
            fields.push(FieldLayout::packed(name, FieldType::F32, shard, |m, r| {
                self.factor_span(m, r)
            })?);
        }
        Ok(fields)
    }

    fn state_data<'a>(&self, s: &'a ShampooState) -> Result<Vec<FieldData<'a>>> {
        let mut out = vec![FieldData::from(&s.m)];
        if self.config().grafting.has_accumulator() {
            out.push((&s.v).into());
        }
        out.extend([(&s.factors).into(), (&s.roots).into()]);
        Ok(out)
    }

    fn state_data_mut<'a>(&self, s: &'a mut ShampooState) -> Result<Vec<FieldDataMut<'a>>> {
        let mut out = vec![FieldDataMut::from(&mut s.m)];
        if self.config().grafting.has_accumulator() {
            out.push((&mut s.v).into());
        }
        out.extend([(&mut s.factors).into(), (&mut s.roots).into()]);
        Ok(out)
    }

    fn state_step(&self, state: &ShampooState) -> u64 {
        state.step
    }

    fn set_state_step(&self, state: &mut ShampooState, step: u64) {
        state.step = step;
    }
}
