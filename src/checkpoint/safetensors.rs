//! safetensors files, written as a stream and read by byte range, with a digest per chunk.
//!
//! The format (huggingface/safetensors): an 8-byte little-endian header length `N`, `N` bytes
//! of JSON (`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {..}}`,
//! padded with spaces to a multiple of 8), then the tensors' bytes, little-endian, offsets
//! relative to the end of the header. Any safetensors reader (candle's
//! `VarBuilder::from_mmaped_safetensors`) reads what [`Writer`] writes.
//!
//! Integrity: the writer hashes the file in chunks of `chunk_bytes` (XXH3-128, a checksum
//! against damage, not an adversary; fast enough that verifying does not slow a read) as it
//! streams; the digests go to the checkpoint manifest. A [`Reader`] opened with
//! them checks the file's size, and every chunk a read touches before using a byte of it, so
//! a rank that reads a fraction of a file verifies that fraction (plus at most one chunk at
//! each end), not the whole file.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::{xxh3_128, Xxh3Default};

use super::bad;
use crate::limits::folder_of;
use crate::{Error, Result};

/// Default chunk size of the digests: 4 MiB (a 100 GB checkpoint lists 25 600 digests).
pub const CHUNK_BYTES: u64 = 4 << 20;

/// Largest header a reader accepts (the safetensors crate's own limit).
pub(crate) const MAX_HEADER: u64 = 100_000_000;

/// What the manifest records of one written file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    /// Size in bytes.
    pub bytes: u64,
    pub chunk_bytes: u64,
    /// Hex of each chunk's XXH3-128, in file order.
    pub chunks: Vec<String>,
    /// SHA-256 (hex) of the concatenated chunk digests: one checksum for the whole file.
    pub sha256: String,
}

fn chunk_digest(bytes: &[u8]) -> String {
    format!("{:032x}", xxh3_128(bytes))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn file_sha(chunks: &[String]) -> String {
    let mut h = Sha256::new();
    chunks.iter().for_each(|c| h.update(c.as_bytes()));
    hex(&h.finalize())
}

/// A tensor's entry in a header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorHeader {
    pub name: String,
    /// A safetensors dtype (`"F32"`, `"U16"`, `"U8"`, `"BF16"`, ...).
    pub dtype: &'static str,
    pub shape: Vec<usize>,
}

/// Bytes per element of a safetensors dtype this crate reads or writes.
fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "U8" | "I8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
        _ => return None,
    })
}

/// Writes one safetensors file as a stream: the header first (every tensor's size is known),
/// then each tensor's bytes in header order, hashed as they pass.
pub struct Writer {
    path: PathBuf,
    out: BufWriter<File>,
    /// Bytes each tensor still expects, in order.
    sizes: Vec<u64>,
    next: usize,
    chunk_bytes: u64,
    hasher: Xxh3Default,
    in_chunk: u64,
    chunks: Vec<String>,
    written: u64,
}

impl Writer {
    /// Creates `path` (new: `Err` if it exists) and writes the header of `tensors` with `metadata`.
    pub fn create(
        path: &Path,
        tensors: &[TensorHeader],
        metadata: &BTreeMap<String, String>,
        chunk_bytes: u64,
    ) -> Result<Writer> {
        let mut header = serde_json::Map::new();
        let mut sizes = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for t in tensors {
            let elem =
                dtype_size(t.dtype).ok_or_else(|| bad(path, format!("dtype {}", t.dtype)))?;
            let n = t
                .shape
                .iter()
                .try_fold(elem, |acc, &d| acc.checked_mul(d as u64))
                .ok_or_else(|| bad(path, format!("{}: size overflows", t.name)))?;
            let entry = serde_json::json!({
                "dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + n],
            });
            if header.insert(t.name.clone(), entry).is_some() {
                return Err(bad(path, format!("tensor {} written twice", t.name)));
            }
            sizes.push(n);
            offset += n;
        }
        if !metadata.is_empty() {
            header.insert("__metadata__".into(), serde_json::to_value(metadata)?);
        }
        let mut json = serde_json::to_vec(&header)?;
        json.resize(json.len().div_ceil(8) * 8, b' ');
        // Created new, so an existing file (or a link) is never written through.
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| Error::io("checkpoint: create", path, e))?;
        let mut w = Writer {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(1 << 20, file),
            sizes,
            next: 0,
            chunk_bytes: chunk_bytes.max(1),
            hasher: Xxh3Default::new(),
            in_chunk: 0,
            chunks: Vec::new(),
            written: 0,
        };
        w.put(&(json.len() as u64).to_le_bytes())?;
        w.put(&json)?;
        w.skip_empty();
        Ok(w)
    }

    fn skip_empty(&mut self) {
        while self.next < self.sizes.len() && self.sizes[self.next] == 0 {
            self.next += 1;
        }
    }

    /// Appends bytes to the file, hashing them chunk by chunk.
    fn put(&mut self, mut bytes: &[u8]) -> Result<()> {
        self.out
            .write_all(bytes)
            .map_err(|e| Error::io("checkpoint: write", &self.path, e))?;
        self.written += bytes.len() as u64;
        while !bytes.is_empty() {
            let take = ((self.chunk_bytes - self.in_chunk) as usize).min(bytes.len());
            self.hasher.update(&bytes[..take]);
            self.in_chunk += take as u64;
            bytes = &bytes[take..];
            if self.in_chunk == self.chunk_bytes {
                self.chunks
                    .push(format!("{:032x}", self.hasher.digest128()));
                self.hasher.reset();
                self.in_chunk = 0;
            }
        }
        Ok(())
    }

    /// Appends the next bytes of the current tensor (a tensor may come in several calls).
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let mut rest = bytes;
        while !rest.is_empty() {
            let Some(&left) = self.sizes.get(self.next) else {
                return Err(bad(&self.path, "more bytes than the header announced"));
            };
            let take = (left as usize).min(rest.len());
            self.put(&rest[..take])?;
            self.sizes[self.next] -= take as u64;
            rest = &rest[take..];
            self.skip_empty();
        }
        Ok(())
    }

    /// Flushes and fsyncs the file; `Err` unless every tensor got all its bytes.
    pub fn finish(mut self) -> Result<FileDigest> {
        if self.next < self.sizes.len() {
            return Err(bad(&self.path, "fewer bytes than the header announced"));
        }
        if self.in_chunk > 0 {
            self.chunks
                .push(format!("{:032x}", self.hasher.digest128()));
        }
        let file = self
            .out
            .into_inner()
            .map_err(|e| Error::io("checkpoint: write", &self.path, e.into_error()))?;
        file.sync_all()
            .map_err(|e| Error::io("checkpoint: fsync", &self.path, e))?;
        Ok(FileDigest {
            bytes: self.written,
            chunk_bytes: self.chunk_bytes,
            sha256: file_sha(&self.chunks),
            chunks: self.chunks,
        })
    }
}

/// A tensor in a file being read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub bytes: Range<u64>,
}

/// Most dimensions a header's tensor may have: a 100 MB header could otherwise claim one
/// tensor of 50 M dimensions of 1 (and a reader hold them all).
const MAX_DIMS: usize = 64;

/// A header's tensor entry, as written.
#[derive(Deserialize)]
struct Entry {
    dtype: String,
    #[serde(deserialize_with = "bounded_shape")]
    shape: Vec<usize>,
    data_offsets: [u64; 2],
}

/// A header's entries in file order, repeated names kept (a JSON map keeps one of two equal
/// keys), parsed straight into their types: no JSON tree of a header that may be 100 MB.
struct Header {
    tensors: Vec<(String, Entry)>,
    metadata: Vec<BTreeMap<String, String>>,
}

impl<'de> Deserialize<'de> for Header {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Header;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Header, A::Error> {
                let mut header = Header {
                    tensors: Vec::new(),
                    metadata: Vec::new(),
                };
                while let Some(name) = map.next_key::<String>()? {
                    let named = |e: A::Error| A::Error::custom(format!("{name}: {e}"));
                    if name == "__metadata__" {
                        header.metadata.push(map.next_value().map_err(named)?);
                    } else {
                        let entry = map.next_value().map_err(named)?;
                        header.tensors.push((name, entry));
                    }
                }
                Ok(header)
            }
        }
        d.deserialize_map(Visit)
    }
}

/// `shape`, refused past [`MAX_DIMS`] dimensions before they are all read.
fn bounded_shape<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<usize>, D::Error> {
    use serde::de::Error as _;
    struct Visit;
    impl<'de> serde::de::Visitor<'de> for Visit {
        type Value = Vec<usize>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "a list of at most {MAX_DIMS} dimensions")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> std::result::Result<Vec<usize>, A::Error> {
            let mut dims = Vec::new();
            while let Some(d) = seq.next_element()? {
                if dims.len() == MAX_DIMS {
                    return Err(A::Error::custom(format!(
                        "a shape of more than {MAX_DIMS} dimensions"
                    )));
                }
                dims.push(d);
            }
            Ok(dims)
        }
    }
    d.deserialize_seq(Visit)
}

/// The chunks of a file and which were verified.
struct Chunks {
    digest: FileDigest,
    verified: Vec<bool>,
}

/// Reads tensors of a safetensors file by byte range, verifying chunk digests when given.
pub struct Reader {
    path: PathBuf,
    file: File,
    tensors: HashMap<String, TensorInfo>,
    metadata: BTreeMap<String, String>,
    chunks: Option<Chunks>,
    /// The last partly used chunk (verified), to serve neighbouring reads.
    cache: Option<(usize, Vec<u8>)>,
}

impl Reader {
    /// Opens `path` and parses its header. With `digest`, the file's size must match and the
    /// header's chunks are verified before it is parsed.
    pub fn open(path: &Path, digest: Option<&FileDigest>) -> Result<Reader> {
        // Checked before the open, which blocks on a FIFO.
        let size = crate::limits::regular_file_size("checkpoint: open", path)?;
        let file = File::open(path).map_err(|e| Error::io("checkpoint: open", path, e))?;
        let chunks = match digest {
            Some(d) => {
                check_digest_shape(path, d, size)?;
                Some(Chunks {
                    verified: vec![false; d.chunks.len()],
                    digest: d.clone(),
                })
            }
            None => None,
        };
        let mut r = Reader {
            path: path.to_path_buf(),
            file,
            tensors: HashMap::new(),
            metadata: BTreeMap::new(),
            chunks,
            cache: None,
        };
        r.parse_header(size)?;
        Ok(r)
    }

    fn parse_header(&mut self, size: u64) -> Result<()> {
        if size < 8 {
            return Err(bad(
                &self.path,
                format!("{size} bytes: too short for a header"),
            ));
        }
        let mut len = [0u8; 8];
        self.read_at(0, &mut len)?;
        let n = u64::from_le_bytes(len);
        if n > MAX_HEADER || n > size - 8 {
            return Err(bad(
                &self.path,
                format!("header of {n} bytes in a file of {size} (truncated or not safetensors)"),
            ));
        }
        let mut json = vec![0u8; n as usize];
        self.read_at(8, &mut json)?;
        // Its entries as written: which of two entries of one name a reader takes is not a
        // question a checkpoint may leave open.
        let header: Header = serde_json::from_slice(&json).map_err(|e| {
            let what = match e.is_data() {
                true => "header is not a JSON object of tensors",
                false => "header is not JSON",
            };
            bad(&self.path, format!("{what}: {e}"))
        })?;
        let mut names = header.tensors.iter().map(|(n, _)| n.as_str());
        let mut seen = std::collections::HashSet::new();
        let metadata_twice = header.metadata.len() > 1;
        let twice = names.find(|&n| !seen.insert(n));
        if let Some(name) = twice.or(metadata_twice.then_some("__metadata__")) {
            return Err(bad(&self.path, format!("header names {name} twice")));
        }
        self.metadata = header.metadata.into_iter().next().unwrap_or_default();
        let data_start = 8 + n;
        let mut spans = Vec::new();
        for (name, entry) in header.tensors {
            let info = self.tensor_info(&name, entry, data_start, size)?;
            spans.push((info.bytes.clone(), name.clone()));
            self.tensors.insert(name, info);
        }
        spans.sort_by_key(|(r, _)| (r.start, r.end));
        for w in spans.windows(2) {
            if w[1].0.start < w[0].0.end {
                return Err(bad(
                    &self.path,
                    format!("tensors {} and {} overlap", w[0].1, w[1].1),
                ));
            }
        }
        Ok(())
    }

    fn tensor_info(&self, name: &str, e: Entry, data_start: u64, size: u64) -> Result<TensorInfo> {
        let elem = dtype_size(&e.dtype)
            .ok_or_else(|| bad(&self.path, format!("tensor {name}: dtype {}", e.dtype)))?;
        let want = e
            .shape
            .iter()
            .try_fold(elem, |acc, &d| acc.checked_mul(d as u64));
        let [a, b] = e.data_offsets;
        let (start, end) = (data_start.checked_add(a), data_start.checked_add(b));
        match (want, start, end) {
            (Some(w), Some(s), Some(t)) if s <= t && t - s == w && t <= size => Ok(TensorInfo {
                dtype: e.dtype,
                shape: e.shape,
                bytes: s..t,
            }),
            _ => Err(bad(
                &self.path,
                format!(
                    "tensor {name}: offsets {a}..{b} do not hold {:?} {} in a file of {size} \
                     bytes (truncated?)",
                    e.shape, e.dtype
                ),
            )),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensors by name.
    pub fn tensors(&self) -> &HashMap<String, TensorInfo> {
        &self.tensors
    }

    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The tensor `name`, or an error naming the file.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| bad(&self.path, format!("no tensor {name}")))
    }

    /// Reads bytes `range` of tensor `name` (relative to its first byte) into `out`.
    pub fn read_tensor(&mut self, name: &str, range: Range<u64>, out: &mut [u8]) -> Result<()> {
        let info = self.tensor(name)?;
        let len = info.bytes.end - info.bytes.start;
        if range.start > range.end || range.end > len || out.len() as u64 != range.end - range.start
        {
            return Err(bad(
                &self.path,
                format!("tensor {name}: read of bytes {range:?} of {len}"),
            ));
        }
        let at = info.bytes.start + range.start;
        self.read_at(at, out)
    }

    /// Reads `out.len()` bytes at file offset `at`, verifying every chunk they touch.
    fn read_at(&mut self, at: u64, out: &mut [u8]) -> Result<()> {
        let Some(chunk) = self.chunks.as_ref().map(|c| c.digest.chunk_bytes) else {
            return self.raw(at, out);
        };
        let end = at + out.len() as u64;
        let mut pos = at;
        while pos < end {
            let c = (pos / chunk) as usize;
            let (c0, c1) = (c as u64 * chunk, ((c as u64 + 1) * chunk).min(self.size()));
            if pos == c0 && c1 <= end {
                // Whole chunks (up to 64 MiB at once): read in place, verify each there.
                let most = ((64 << 20) / chunk).max(1);
                let whole = ((end - c0) / chunk).min(most);
                // No whole chunk fits only for the file's short last chunk.
                let run_end = if whole == 0 { c1 } else { c0 + whole * chunk };
                let dst = &mut out[(pos - at) as usize..(run_end - at) as usize];
                self.raw(c0, dst)?;
                for (i, part) in dst.chunks(chunk as usize).enumerate() {
                    self.verify(c + i, part)?;
                }
                pos = run_end;
                continue;
            }
            // Part of a chunk: verify the whole chunk once (cached), copy the part.
            let dst = &mut out[(pos - at) as usize..(c1.min(end) - at) as usize];
            let bytes = self.cached_chunk(c, c0, c1)?;
            let from = (pos - c0) as usize;
            dst.copy_from_slice(&bytes[from..from + dst.len()]);
            pos = c1.min(end);
        }
        Ok(())
    }

    fn size(&self) -> u64 {
        self.chunks.as_ref().map_or(u64::MAX, |c| c.digest.bytes)
    }

    fn cached_chunk(&mut self, c: usize, c0: u64, c1: u64) -> Result<&[u8]> {
        if self.cache.as_ref().is_none_or(|(i, _)| *i != c) {
            let mut buf = vec![0u8; (c1 - c0) as usize];
            self.raw(c0, &mut buf)?;
            self.verify(c, &buf)?;
            self.cache = Some((c, buf));
        }
        Ok(&self.cache.as_ref().expect("filled above").1)
    }

    fn verify(&mut self, c: usize, bytes: &[u8]) -> Result<()> {
        let chunks = self.chunks.as_mut().expect("verify runs with digests");
        if chunks.verified[c] {
            return Ok(());
        }
        if chunk_digest(bytes) != chunks.digest.chunks[c] {
            let c0 = c as u64 * chunks.digest.chunk_bytes;
            return Err(bad(
                &self.path,
                format!(
                    "bytes {c0}..{} do not match their checksum (the file was modified or \
                     damaged after it was written)",
                    c0 + bytes.len() as u64
                ),
            ));
        }
        chunks.verified[c] = true;
        Ok(())
    }

    fn raw(&self, at: u64, out: &mut [u8]) -> Result<()> {
        self.file.read_exact_at(out, at).map_err(|e| {
            bad(
                &self.path,
                format!("read of {} bytes at {at}: {e} (truncated?)", out.len()),
            )
        })
    }

    /// Reads and verifies every chunk (a full check of the file).
    pub fn verify_all(&mut self) -> Result<()> {
        let Some(chunk) = self.chunks.as_ref().map(|c| c.digest.chunk_bytes) else {
            return Ok(());
        };
        let size = self.size();
        let mut buf = vec![0u8; chunk.min(size) as usize];
        let mut at = 0;
        while at < size {
            let n = chunk.min(size - at) as usize;
            self.raw(at, &mut buf[..n])?;
            self.verify((at / chunk) as usize, &buf[..n])?;
            at += n as u64;
        }
        Ok(())
    }
}

/// `Err` unless the digest describes a file of `size` bytes.
/// `Err` unless the file at `path` has the `size` its digest records.
pub(crate) fn check_size(path: &Path, d: &FileDigest, size: u64) -> Result<()> {
    if size != d.bytes {
        return Err(bad(
            path,
            format!(
                "{size} bytes, the manifest says {} (truncated or replaced)",
                d.bytes
            ),
        ));
    }
    Ok(())
}

fn check_digest_shape(path: &Path, d: &FileDigest, size: u64) -> Result<()> {
    check_size(path, d, size)?;
    let want = d.bytes.div_ceil(d.chunk_bytes.max(1));
    if d.chunk_bytes == 0 || d.chunks.len() as u64 != want || file_sha(&d.chunks) != d.sha256 {
        return Err(bad(
            path,
            "the manifest's checksums for this file are inconsistent",
        ));
    }
    Ok(())
}

/// `Err` unless `out` can take an export: its folder exists; it is new or a writable regular
/// file (the rename that ends an export replaces what `out` names: never a device, a FIFO, a
/// folder, a link, whose target it would not write, a file its owner made read-only, or a
/// file that is not safetensors, which a mistyped name would destroy); it
/// is neither inside a checkpoint folder (whose manifest or rank file it would replace) nor
/// named as one (a `step-N` a save may create); and it is not `-`, which other commands read
/// as stdout. A run checks it before it trains.
pub fn check_export_target(out: &Path) -> Result<()> {
    if out.as_os_str() == "-" {
        return Err(bad(
            out,
            "an export is a file, not written to stdout: name a file (./- for one called -)",
        ));
    }
    let folder = folder_of(out);
    if !folder.is_dir() {
        return Err(bad(out, "its folder does not exist"));
    }
    let name = out.file_name().unwrap_or_default();
    let within = folder.canonicalize().map(|f| f.join(name));
    let named_as_step = super::fs::is_step_name(&name.to_string_lossy());
    let enclosing = within.ok().and_then(|p| match named_as_step {
        true => Some(p),
        false => super::fs::enclosing_checkpoint(&p),
    });
    if let Some(ckpt) = enclosing {
        let reason = format!(
            "is inside or named as the checkpoint folder {}: write the export elsewhere",
            ckpt.display()
        );
        return Err(bad(out, reason));
    }
    match std::fs::symlink_metadata(out) {
        Ok(meta) if !meta.is_file() => Err(bad(
            out,
            "exists and is not a regular file: export to a new or regular file",
        )),
        Ok(meta) if meta.permissions().readonly() => Err(bad(
            out,
            "is read-only: export elsewhere, or make it writable to replace it",
        )),
        // A typo must not replace notes or code: only an earlier safetensors file (or an
        // empty one) is replaced.
        Ok(meta) if meta.len() > 0 && Reader::open(out, None).is_err() => Err(bad(
            out,
            "exists and is not a safetensors file: export elsewhere, or remove it first",
        )),
        _ => Ok(()),
    }
}

/// `Err` when `out` and `input` are one file: an export over the file a run started from
/// would replace the weights it read.
pub fn check_export_not_input(out: &Path, input: &Path) -> Result<()> {
    if !crate::limits::same_file(out, input) {
        return Ok(());
    }
    let reason = format!(
        "is the file the run starts from ({}): export to another file",
        input.display()
    );
    Err(bad(out, reason))
}

/// Between an export's name and the process id, in its temporary file's name.
const TMP_INFIX: &str = ".tmp-";

/// Removes the temporary files earlier exports to `out` left when they were killed (a partial
/// file of up to the model's size): `OUT.tmp-PID` of processes that no longer run.
fn remove_abandoned_exports(out: &Path) {
    let Some(name) = out.file_name() else {
        return;
    };
    let prefix = format!("{}{TMP_INFIX}", name.to_string_lossy());
    for left in super::fs::left_by_ended_processes(folder_of(out), &prefix) {
        // Not through a link (`is_file` of the entry itself).
        if std::fs::symlink_metadata(&left).is_ok_and(|m| m.is_file()) {
            let _ = std::fs::remove_file(left);
        }
    }
}

/// A consolidated checkpoint being written: one f32 tensor per parameter (names and shapes as
/// given), under a temporary name that [`Consolidated::finish`] renames to the destination,
/// so a failed export never leaves a partial file under the real name; dropped before it is
/// finished (an error on the way), it removes the temporary file.
pub struct Consolidated {
    /// `None` once finished.
    writer: Option<Writer>,
    tmp: PathBuf,
    out: PathBuf,
}

impl Drop for Consolidated {
    fn drop(&mut self) {
        if self.writer.is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

impl Consolidated {
    /// Creates `out`'s temporary file and writes the header of `tensors` (name, shape).
    pub fn create(
        out: &Path,
        tensors: impl IntoIterator<Item = (String, Vec<usize>)>,
    ) -> Result<Self> {
        let headers: Vec<TensorHeader> = tensors
            .into_iter()
            .map(|(name, shape)| TensorHeader {
                name,
                dtype: "F32",
                shape,
            })
            .collect();
        check_export_target(out)?;
        remove_abandoned_exports(out);
        // This process's own name, created new: never a file of the user's, nor a link's
        // target.
        let mut tmp = out.as_os_str().to_owned();
        tmp.push(format!("{TMP_INFIX}{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        Ok(Consolidated {
            writer: Some(Writer::create(&tmp, &headers, &meta, u64::MAX)?),
            tmp,
            out: out.to_path_buf(),
        })
    }

    /// The next bytes, in header order (little-endian f32).
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        match &mut self.writer {
            Some(w) => w.write(bytes),
            None => Err(bad(&self.out, "written after it was finished")),
        }
    }

    /// Fsyncs the file and renames it into place.
    pub fn finish(mut self) -> Result<()> {
        let writer = self
            .writer
            .take()
            .ok_or_else(|| bad(&self.out, "finished twice"))?;
        let done = writer.finish().and_then(|_| {
            std::fs::rename(&self.tmp, &self.out)
                .map_err(|e| Error::io("checkpoint: export", &self.out, e))
        });
        if done.is_err() {
            let _ = std::fs::remove_file(&self.tmp);
        }
        done
    }
}
