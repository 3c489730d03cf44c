//! Reading saved arrays back: any range of any field, from whichever ranks saved it, through
//! [`redistribute`] from the saved layout (the one redistribution path), verifying every chunk
//! it touches.

use std::collections::HashMap;
use std::path::Path;

use super::bad;
use super::manifest::{tensor_name, FieldRecord, FileRecord, Manifest};
use super::safetensors::Reader;
use super::state::{FieldDataMut, FieldType};
use crate::ragged::{redistribute, RaggedShard};
use crate::Result;

/// The rank files of a checkpoint being read, opened on first use with their digests.
pub struct SourceFiles<'a> {
    dir: &'a Path,
    manifest: &'a Manifest,
    open: HashMap<usize, Reader>,
    /// Bytes of saved arrays read so far.
    pub bytes_read: u64,
}

/// Most rank files open at once (each caches one chunk).
const MAX_OPEN: usize = 16;

impl<'a> SourceFiles<'a> {
    pub fn new(dir: &'a Path, manifest: &'a Manifest) -> Self {
        SourceFiles {
            dir,
            manifest,
            open: HashMap::new(),
            bytes_read: 0,
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir
    }

    /// `Err` unless every rank file is a regular file of the size the manifest records: a
    /// missing or truncated file found before a load replaces any value.
    pub fn check_sizes(&self) -> Result<()> {
        for rec in &self.manifest.files {
            let path = self.present(rec)?;
            let size = crate::limits::regular_file_size("checkpoint: open", &path)?;
            super::safetensors::check_size(&path, &rec.digest, size)?;
        }
        Ok(())
    }

    /// The path of the rank file `rec` names ([`rank_file`]).
    fn present(&self, rec: &FileRecord) -> Result<std::path::PathBuf> {
        rank_file(self.dir, rec)
    }

    fn reader(&mut self, rank: usize) -> Result<&mut Reader> {
        if !self.open.contains_key(&rank) {
            if self.open.len() >= MAX_OPEN {
                self.open.clear();
            }
            let rec = &self.manifest.files[rank];
            let path = self.present(rec)?;
            self.open
                .insert(rank, Reader::open(&path, Some(&rec.digest))?);
        }
        Ok(self.open.get_mut(&rank).expect("inserted above"))
    }

    /// Reads elements `global` of a saved array into `out` starting at element `at`: the
    /// transfers of [`redistribute`] from the saved layout to one where this reader holds
    /// exactly `global`.
    pub fn read_range(
        &mut self,
        rec: &FieldRecord,
        global: std::ops::Range<usize>,
        out: &mut FieldDataMut<'_>,
        at: usize,
    ) -> Result<()> {
        if out.dtype() != rec.dtype || global.end > rec.len {
            return Err(bad(
                self.dir,
                format!(
                    "{} of {}: saved {} {:?} elements, asked for {global:?} as {:?}",
                    rec.field,
                    rec.param,
                    rec.len,
                    rec.dtype,
                    out.dtype()
                ),
            ));
        }
        if global.is_empty() {
            return Ok(());
        }
        let src = rec.ragged_shard(self.manifest.world)?;
        let (a, b, len) = (global.start, global.end, rec.len);
        let dst = RaggedShard::new(&[len], 1, vec![a, b - a, len - b])?;
        let size = rec.dtype.size();
        let tensor = tensor_name(&rec.param, &rec.field);
        for t in redistribute(&src, &dst)?.iter().filter(|t| t.dst_rank == 1) {
            let to = at + t.dst_offset;
            let from = (t.src_offset * size) as u64..((t.src_offset + t.len) * size) as u64;
            let reader = self.reader(t.src_rank)?;
            out.fill_bytes(to..to + t.len, |bytes| {
                reader.read_tensor(&tensor, from, bytes)
            })?;
            self.bytes_read += (t.len * size) as u64;
        }
        Ok(())
    }
}

/// A whole saved array as little-endian bytes (one tensor in memory: for tools and tests).
pub fn read_global(dir: &Path, manifest: &Manifest, rec: &FieldRecord) -> Result<Vec<u8>> {
    SourceFiles::new(dir, manifest).read_global(rec)
}

impl SourceFiles<'_> {
    /// [`read_global`] through these open files (an export reads every tensor through one
    /// `SourceFiles`, so each rank file's header is parsed once, not once per tensor).
    pub fn read_global(&mut self, rec: &FieldRecord) -> Result<Vec<u8>> {
        const OP: &str = "checkpoint::read_global";
        // `len` comes from the manifest: size the buffers before allocating them (a typed copy
        // and its bytes), so a hostile or mistaken length is an error, not an abort.
        let what = format!("{} of {}", rec.field, rec.param);
        // The files must hold what the manifest claims before its length sizes an allocation.
        for &[rank, start, end] in &rec.holders {
            check_held(self.reader(rank)?, rec, start..end)?;
        }
        let n = crate::limits::checked_product(OP, &what, &[rec.len, rec.dtype.size()])?;
        crate::limits::fits_in_memory(
            OP,
            &what,
            crate::limits::checked_product(OP, &what, &[n, 2])?,
        )?;
        let mut bytes = crate::limits::zeroed::<u8>(OP, &what, n)?;
        match rec.dtype {
            FieldType::F32 => {
                let mut v = crate::limits::zeroed::<f32>(OP, &what, rec.len)?;
                self.read_range(rec, 0..rec.len, &mut FieldDataMut::from(&mut v[..]), 0)?;
                bytes.copy_from_slice(bytemuck::cast_slice(&v));
            }
            FieldType::U16 => {
                let mut v = crate::limits::zeroed::<u16>(OP, &what, rec.len)?;
                self.read_range(rec, 0..rec.len, &mut FieldDataMut::from(&mut v[..]), 0)?;
                bytes.copy_from_slice(bytemuck::cast_slice(&v));
            }
            FieldType::U8 => {
                self.read_range(rec, 0..rec.len, &mut FieldDataMut::from(&mut bytes[..]), 0)?;
            }
        }
        Ok(bytes)
    }
}

/// `Err` unless rank `rank`'s file (`reader`) holds every range the manifest says it holds,
/// each a tensor of that many elements of the field's type: the manifest and the files agree.
fn check_holdings(manifest: &Manifest, rank: usize, reader: &Reader) -> Result<()> {
    for rec in &manifest.fields {
        for &[_, start, end] in rec.holders.iter().filter(|h| h[0] == rank) {
            check_held(reader, rec, start..end)?;
        }
    }
    Ok(())
}

/// `Err` unless `reader`'s file holds elements `range` of `rec` as the manifest says: one flat
/// tensor of that many elements of the field's type.
fn check_held(reader: &Reader, rec: &FieldRecord, range: std::ops::Range<usize>) -> Result<()> {
    let name = tensor_name(&rec.param, &rec.field);
    let info = reader.tensor(&name)?;
    let want = (range.len() as u64).checked_mul(rec.dtype.size() as u64);
    let got = info.bytes.end - info.bytes.start;
    let flat = info.shape == [range.len()];
    if info.dtype != rec.dtype.safetensors() || want != Some(got) || !flat {
        return Err(bad(
            reader.path(),
            format!(
                "{name}: {got} bytes of {} as shape {:?}, the manifest says elements {range:?} \
                 of {}",
                info.dtype,
                info.shape,
                rec.dtype.safetensors()
            ),
        ));
    }
    Ok(())
}

/// The path of the rank file `rec` names in `dir`, or `Err` saying what is there instead:
/// nothing, a link to nothing or a link loop, or something other than a regular file (a
/// folder, a device, a FIFO, which a read would not end on).
fn rank_file(dir: &Path, rec: &FileRecord) -> Result<std::path::PathBuf> {
    let path = dir.join(&rec.file);
    let reason = match (std::fs::metadata(&path), std::fs::symlink_metadata(&path)) {
        (Ok(meta), _) if meta.is_file() => return Ok(path),
        (Ok(_), _) => "not a regular file (a folder, a device or a FIFO)",
        (Err(_), Ok(_)) => "a link to nothing, or a link loop",
        (Err(_), Err(_)) => "missing (every rank's file is needed)",
    };
    Err(bad(&path, reason))
}

/// Reads and verifies every chunk of every rank file of the checkpoint in `dir`, and that each
/// file holds the ranges the manifest gives its rank; returns the bytes checked. `progress(file, bytes)` is called after each file.
pub fn verify(dir: &Path, mut progress: impl FnMut(&str, u64)) -> Result<u64> {
    let manifest = Manifest::read(dir)?;
    let mut total = 0;
    for f in &manifest.files {
        let path = rank_file(dir, f)?;
        let mut reader = Reader::open(&path, Some(&f.digest))?;
        check_holdings(&manifest, f.rank, &reader)?;
        reader.verify_all()?;
        total += f.digest.bytes;
        progress(&f.file, f.digest.bytes);
    }
    Ok(total)
}

/// Writes the checkpoint's parameters (f32, the model's names and shapes) to one safetensors
/// file at `out`, with no training world: one tensor at a time is read from the rank files
/// and written. `progress(tensor)` is called after each.
pub fn export(dir: &Path, out: &Path, mut progress: impl FnMut(&str)) -> Result<()> {
    use super::manifest::PARAM_FIELD;
    use super::safetensors::Consolidated;
    // `Manifest::read` checked that every model tensor has one parameter array of its size,
    // so a mismatch is refused before anything is written.
    let manifest = Manifest::read(dir)?;
    let records: HashMap<&str, &FieldRecord> = manifest
        .fields
        .iter()
        .filter(|f| f.field == PARAM_FIELD)
        .map(|f| (f.param.as_str(), f))
        .collect();
    let tensors = manifest
        .model
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()));
    let mut file = Consolidated::create(out, tensors)?;
    let mut files = SourceFiles::new(dir, &manifest);
    for t in &manifest.model {
        let rec = records
            .get(t.name.as_str())
            .ok_or_else(|| bad(dir, format!("no values for {} in it", t.name)))?;
        file.write(&files.read_global(rec)?)?;
        progress(&t.name);
    }
    file.finish()
}
