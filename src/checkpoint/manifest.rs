//! The manifest of a checkpoint folder (`manifest.json`): what was saved, how it was laid out,
//! and a digest of every rank file.

use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::bad;
use super::safetensors::FileDigest;
use super::state::FieldType;
use crate::ragged::RaggedShard;
use crate::Result;

/// `format` of every manifest.
pub const FORMAT: &str = "ragged-checkpoint";

/// The newest format version this build writes and reads. Version 2 added the manifest's own
/// checksum ([`Manifest::checksum`]); version 1 manifests (without it) are still read.
pub const VERSION: u32 = 2;

/// [`VERSION`] as the JSON reader gives it.
const VERSION_U64: u64 = VERSION as u64;

/// The first version whose manifest carries its own checksum.
const CHECKSUM_VERSION: u64 = 2;

/// The largest `manifest.json` read: a manifest grows with tensors × fields × holders
/// (hundreds of MB for thousands of tensors over thousands of ranks at most), and one far
/// larger is damage, not a checkpoint, which must not exhaust memory before it is refused.
const MAX_MANIFEST_BYTES: u64 = 1 << 30;

/// `dtype` of every model tensor: the parameters are saved as their f32 master values.
const MODEL_DTYPE: &str = "F32";

/// The field name of the parameters themselves (their f32 master values).
pub const PARAM_FIELD: &str = "param";

/// A checkpoint's description.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// Ranks that wrote it (one file each).
    pub world: usize,
    /// `"ragged"` or `"fsdp2"`.
    pub layout: String,
    /// The model's parameters (name, global shape, saved element type), in unit order.
    pub model: Vec<ModelTensor>,
    pub optimizer: OptimizerRecord,
    pub progress: Progress,
    /// The plan: every unit's collective buffers, their shard size and tensor offsets.
    pub units: Vec<UnitRecord>,
    /// Every saved array: a parameter's values or one optimizer state field of it, as the
    /// global array the ranks hold contiguous ranges of (its RaggedShard).
    pub fields: Vec<FieldRecord>,
    /// One per rank, in rank order.
    pub files: Vec<FileRecord>,
    /// How the run that saved it trained beyond the optimizer (informational: reported by a
    /// load where it differs); absent in checkpoints saved before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub training: Option<TrainingRecord>,
    /// SHA-256 (hex) of the manifest's own bytes as written with these 64 hex digits all `0`
    /// ([`Manifest::write`] fills it in, [`Manifest::read`] checks it): an edit or a flipped
    /// bit anywhere in the manifest (a step count, a holder range, a name) is an `Err`.
    /// Empty in version 1.
    #[serde(default)]
    pub checksum: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: String,
    /// The parameter's role when saved (`Matrix`, `ElementWise`, `Fp32State`, `Frozen`: what
    /// its optimizer state means); absent in checkpoints saved before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainingRecord {
    /// The FSDP options that change the numbers (mixed precision, the reduction, the
    /// non-finite policy), as [`crate::fsdp::FsdpOptions::numerics`] prints them.
    pub fsdp: String,
    /// What the saving run recorded ([`super::SaveOptions::metadata`]).
    pub metadata: std::collections::BTreeMap<String, String>,
    /// The saving run's id ([`crate::fsdp::ShardedModel::run_id`]); `None` in checkpoints
    /// from before runs had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OptimizerRecord {
    pub name: String,
    /// The hyperparameters as the optimizer prints them ([`crate::optim::Optimizer::settings`];
    /// informational: a resumed run may change them).
    pub config: String,
}

/// Where training stood.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Steps taken (the schedule's clock).
    pub steps: usize,
    /// Steps skipped for non-finite values.
    pub skipped: usize,
    /// The optimizer states' step counter (bias corrections).
    pub state_step: u64,
    /// The optimizer's learning rate when saved.
    pub learning_rate: Option<f64>,
    /// The schedule and the base rate it multiplies, if one was set, as text (informational).
    pub schedule: Option<String>,
    /// The same, restored by a load (its position is `steps`); absent in version 1.
    #[serde(default)]
    pub schedule_state: Option<(crate::schedule::Schedule, f64)>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitRecord {
    pub name: String,
    pub buffers: Vec<BufferRecord>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferRecord {
    /// Elements per rank, `S`.
    pub shard_size: usize,
    /// Whether the buffer holds frozen parameters.
    pub frozen: bool,
    /// `(tensor, offset in the full buffer)`; empty for the FSDP2-style layout (rank-major).
    pub tensors: Vec<(String, usize)>,
}

/// One saved global array and which rank holds which range of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldRecord {
    pub param: String,
    /// [`PARAM_FIELD`] or an optimizer state field.
    pub field: String,
    pub dtype: FieldType,
    /// Elements of the global array.
    pub len: usize,
    /// `[rank, start, end)`, ascending, tiling `0..len`.
    pub holders: Vec<[usize; 3]>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    pub rank: usize,
    /// File name inside the checkpoint folder.
    pub file: String,
    pub digest: FileDigest,
}

/// The name of a field's tensor inside a rank file.
pub fn tensor_name(param: &str, field: &str) -> String {
    if field == PARAM_FIELD {
        param.to_string()
    } else {
        format!("{param}::{field}")
    }
}

/// The name of rank `rank`'s file of a `world`-rank checkpoint.
pub fn rank_file(rank: usize, world: usize) -> String {
    format!("rank-{rank:05}-of-{world:05}.safetensors")
}

impl FieldRecord {
    /// The field's layout over the checkpoint's ranks: rank `k` holds `units[k]` elements.
    pub fn ragged_shard(&self, world: usize) -> Result<RaggedShard> {
        let mut units = vec![0; world];
        for &[rank, start, end] in &self.holders {
            units[rank] = end - start;
        }
        RaggedShard::new(&[self.len], 1, units)
    }

    /// `Err` unless the holders tile `0..len` in rank order on ranks of `world`.
    fn check(&self, world: usize, path: &Path) -> Result<()> {
        let mut at = 0;
        let mut last_rank = None;
        for &[rank, start, end] in &self.holders {
            if start != at || end <= start || rank >= world || last_rank >= Some(rank) {
                return Err(bad(
                    path,
                    format!(
                        "{} of {}: holder [{rank}, {start}, {end}) does not continue at {at} \
                         on a later rank of {world}",
                        self.field, self.param
                    ),
                ));
            }
            (at, last_rank) = (end, Some(rank));
        }
        if at != self.len || self.len == 0 {
            return Err(bad(
                path,
                format!(
                    "{} of {}: holders cover {at} of {} elements",
                    self.field, self.param, self.len
                ),
            ));
        }
        Ok(())
    }
}

/// A manifest's `version` field as a message names it: the number, or that there is none.
fn version_text(version: Option<u64>) -> String {
    version.map_or("none (missing or not a whole number)".to_string(), |v| {
        v.to_string()
    })
}

impl Manifest {
    /// Reads and checks `dir/manifest.json`: the format, a version this build reads, one file
    /// per rank, and holders that tile every field.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join("manifest.json");
        let text = read_bounded(dir, &path)?;
        let head: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| bad(&path, format!("not JSON (damaged?): {e}")))?;
        if head.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(bad(&path, format!("not a {FORMAT} manifest")));
        }
        let version = head.get("version").and_then(|v| v.as_u64());
        match version {
            Some(1..=VERSION_U64) => {}
            v => {
                let why = match v {
                    Some(n) if n > VERSION_U64 => "written by a newer ragged?",
                    _ => "damaged?",
                };
                return Err(bad(
                    &path,
                    format!(
                        "format version {}: this build of ragged reads versions 1 to \
                         {VERSION} ({why})",
                        version_text(v)
                    ),
                ));
            }
        }
        if version >= Some(CHECKSUM_VERSION) {
            check_sealed(&text, &path)?;
        } else if head.get("checksum").is_some() {
            // A version without the seal never wrote one: a lowered version must not turn
            // the check off.
            return Err(bad(
                &path,
                format!(
                    "says format version {}, which has no checksum, but carries one: the \
                     version was edited or damaged",
                    version_text(version)
                ),
            ));
        }
        let m: Manifest = serde_json::from_value(head)
            .map_err(|e| bad(&path, format!("malformed manifest: {e}")))?;
        m.check(&path)?;
        Ok(m)
    }

    /// `Err` unless the manifest describes one checkpoint this build can read: one file per
    /// rank in rank order, a known layout, a non-empty model of unique f32 tensors, one
    /// parameter array per tensor of its shape's size, unique fields of those tensors whose
    /// holders tile them, and a step count that does not overflow.
    fn check(&self, path: &Path) -> Result<()> {
        self.check_files(path)?;
        if !["ragged", "fsdp2"].contains(&self.layout.as_str()) {
            return Err(bad(
                path,
                format!("layout {:?}: expected \"ragged\" or \"fsdp2\"", self.layout),
            ));
        }
        self.check_model(path)?;
        self.check_fields(path)?;
        let p = &self.progress;
        if p.steps.checked_add(p.skipped).is_none() {
            return Err(bad(
                path,
                format!(
                    "{} steps taken and {} skipped overflow a step count",
                    p.steps, p.skipped
                ),
            ));
        }
        Ok(())
    }

    fn check_files(&self, path: &Path) -> Result<()> {
        // Rank files are plain names inside the checkpoint folder, never a path elsewhere.
        if let Some(f) = self.files.iter().find(|f| !is_plain_file_name(&f.file)) {
            return Err(bad(
                path,
                format!(
                    "rank {}'s file {:?} is not a file name in this folder",
                    f.rank, f.file
                ),
            ));
        }
        // Compared in place: `world` is the file's word, and may be any number.
        let out_of_order = self.files.iter().enumerate().find(|(i, f)| f.rank != *i);
        if self.world == 0 || self.files.len() != self.world || out_of_order.is_some() {
            let ranks = match out_of_order {
                Some((i, f)) => format!(", rank {} in place {i}", f.rank),
                None => String::new(),
            };
            return Err(bad(
                path,
                format!(
                    "{} rank files{ranks} in a world of {}: expected one per rank, in rank order",
                    self.files.len(),
                    self.world
                ),
            ));
        }
        Ok(())
    }

    fn check_model(&self, path: &Path) -> Result<()> {
        if self.model.is_empty() {
            return Err(bad(path, "an empty model (no parameters saved)"));
        }
        let mut names = std::collections::HashSet::new();
        for t in &self.model {
            if t.dtype != MODEL_DTYPE || !names.insert(t.name.as_str()) {
                return Err(bad(
                    path,
                    format!(
                        "model tensor {} ({}): a repeated name, or a dtype other than the \
                         {MODEL_DTYPE} this build saves and reads",
                        t.name, t.dtype
                    ),
                ));
            }
        }
        Ok(())
    }

    fn check_fields(&self, path: &Path) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        let mut shapes: std::collections::HashMap<&str, Option<&[usize]>> = self
            .model
            .iter()
            .map(|t| (t.name.as_str(), Some(t.shape.as_slice())))
            .collect();
        for f in &self.fields {
            f.check(self.world, path)?;
            if !seen.insert((f.param.as_str(), f.field.as_str())) || !shapes.contains_key(&*f.param)
            {
                return Err(bad(
                    path,
                    format!(
                        "{} of {}: a repeated field, or one of no model tensor",
                        f.field, f.param
                    ),
                ));
            }
            if f.field == PARAM_FIELD {
                let shape = shapes
                    .get_mut(f.param.as_str())
                    .and_then(Option::take)
                    .unwrap_or_default();
                let n = crate::limits::checked_product("checkpoint manifest", &f.param, shape);
                if n.ok() != Some(f.len) {
                    return Err(bad(
                        path,
                        format!(
                            "{} has shape {shape:?} but {} saved elements",
                            f.param, f.len
                        ),
                    ));
                }
            }
        }
        match shapes.iter().find(|(_, unsaved)| unsaved.is_some()) {
            Some((name, _)) => Err(bad(path, format!("no values for {name} in it"))),
            None => Ok(()),
        }
    }

    /// Writes the manifest to `dir/manifest.json`, with its checksum, and fsyncs it.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join("manifest.json");
        let unsealed = Manifest {
            checksum: "0".repeat(64),
            ..self.clone()
        };
        let mut text = serde_json::to_vec_pretty(&unsealed)?;
        let at = checksum_span(&text).ok_or_else(|| bad(&path, "no checksum field written"))?;
        let sum = super::safetensors::hex(&Sha256::digest(&text));
        text[at].copy_from_slice(sum.as_bytes());
        super::fs::write_synced(&path, &text)
    }
}

/// The byte range of the 64 hex digits of the top-level `"checksum"` (the last such key: the
/// pretty printer writes it last, and names inside the manifest are escaped values, not keys).
fn checksum_span(text: &[u8]) -> Option<std::ops::Range<usize>> {
    const KEY: &[u8] = b"\"checksum\": \"";
    let key = text.windows(KEY.len()).rposition(|w| w == KEY)?;
    let start = key + KEY.len();
    let end = start + 64;
    (text.get(end) == Some(&b'"')).then_some(start..end)
}

/// The bytes of `path` (`dir`'s manifest), refused unread past [`MAX_MANIFEST_BYTES`].
fn read_bounded(dir: &Path, path: &Path) -> Result<Vec<u8>> {
    if !path.exists() {
        return Err(bad(
            dir,
            "no manifest.json (not a checkpoint folder, or a save that did not finish)",
        ));
    }
    crate::limits::read_regular("checkpoint: read manifest", path, MAX_MANIFEST_BYTES)
}

/// `Err` unless the manifest bytes `text`, with their checksum's digits set to `0`, hash to it.
fn check_sealed(text: &[u8], path: &Path) -> Result<()> {
    let at = checksum_span(text).ok_or_else(|| bad(path, "has no checksum (damaged?)"))?;
    let claimed = text[at.clone()].to_vec();
    let mut zeroed = text.to_vec();
    zeroed[at].fill(b'0');
    let sum = super::safetensors::hex(&Sha256::digest(&zeroed));
    if sum.as_bytes() != claimed.as_slice() {
        return Err(bad(
            path,
            "does not match its checksum: the manifest was edited or damaged",
        ));
    }
    Ok(())
}

/// A name of a file directly inside a folder: not empty, no separator, not `.`/`..` or hidden.
pub(crate) fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && !name.starts_with('.') && !name.contains(['/', '\\', '\0'])
}
