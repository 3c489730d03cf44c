//! Parameter inventories: the planner's inputs.
//!
//! An [`Inventory`] is the ordered list of a model's parameter tensors (name, shape, dtype) in
//! `named_parameters()` order. It comes from a JSON file in the format of `models/README.md` or
//! from a built-in preset computed from config values ([`presets`]). [`Inventory::units`] groups
//! it into FSDP units as the runtime wraps a transformer by default: one unit per numbered block
//! (`layers.3`, `transformer.h.3`, `model.encoder.layers.3`, …) and one `root` unit for
//! everything else.

pub mod presets;

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::Deserialize;

use crate::{block, Context, Error, Result};

/// Storage type of a parameter; only its size matters to the layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F8,
    BF16,
    F16,
    F32,
    F64,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F8 => 1,
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "fp8" | "f8" | "float8" => Ok(DType::F8),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "fp16" | "f16" | "float16" | "half" => Ok(DType::F16),
            "fp32" | "f32" | "float32" | "float" => Ok(DType::F32),
            "fp64" | "f64" | "float64" | "double" => Ok(DType::F64),
            _ => Err(Error::BadInput {
                op: "DType::from_str",
                what: format!("dtype {s:?}"),
                reason: "expected one of fp8, bf16, fp16, fp32, fp64".into(),
            }),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F8 => "fp8",
            DType::BF16 => "bf16",
            DType::F16 => "fp16",
            DType::F32 => "fp32",
            DType::F64 => "fp64",
        };
        f.write_str(s)
    }
}

/// One parameter tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl TensorSpec {
    /// A tensor with a validated shape (no zero dimensions, a count that fits `usize`); the
    /// error names the tensor.
    pub fn new(name: impl Into<String>, shape: &[usize], dtype: DType) -> Result<Self> {
        let name = name.into();
        block::numel(shape).map_err(|e| match e {
            Error::InvalidShape { op, shape, reason } => Error::InvalidShape {
                op,
                shape,
                reason: format!("{reason} (tensor {name})"),
            },
            e => e,
        })?;
        Ok(TensorSpec {
            name,
            shape: shape.to_vec(),
            dtype,
        })
    }

    /// Number of elements (validated at construction).
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<usize>().max(1)
    }
}

/// A model's parameters, in registration order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inventory {
    pub model: String,
    pub tensors: Vec<TensorSpec>,
}

/// An FSDP unit: the tensors planned, gathered and reduced together (borrowed from the
/// inventory, so grouping a 45,000-tensor model copies nothing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit<'a> {
    pub name: String,
    pub tensors: Vec<&'a TensorSpec>,
}

#[derive(Deserialize)]
struct FileParam {
    name: String,
    shape: Vec<usize>,
    dtype: Option<String>,
}

#[derive(Deserialize)]
struct FileInventory {
    model: Option<String>,
    dtype: Option<String>,
    num_tensors: Option<usize>,
    total_params: Option<u64>,
    params: Vec<FileParam>,
}

impl Inventory {
    /// Reads an inventory file (format: `models/README.md`).
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        // Inventories of the largest models are a few MB.
        const MAX_BYTES: u64 = 100_000_000;
        let bytes = crate::limits::read_regular("read inventory", path, MAX_BYTES)?;
        let text = String::from_utf8(bytes).map_err(|e| Error::BadInput {
            op: "read inventory",
            what: path.display().to_string(),
            reason: format!("not UTF-8 text: {e}"),
        })?;
        // A byte-order mark (some Windows editors save one) is no part of the JSON.
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        Self::from_json_str(text).map_err(|e| Error::Context {
            context: format!("inventory {}", path.display()),
            inner: Box::new(e),
        })
    }

    /// Parses an inventory; checks names are unique, shapes non-empty, and the optional
    /// `num_tensors` / `total_params` fields agree with the list.
    pub fn from_json_str(text: &str) -> Result<Self> {
        if text.trim_start().starts_with('[') {
            // serde would read the list as the struct's fields in order and complain about
            // the first one's type.
            return Err(Error::BadInput {
                op: "Inventory::from_json_str",
                what: "a JSON list".into(),
                reason:
                    "an inventory is an object, {\"params\": [{\"name\": …, \"shape\": […]}, …]} \
                         (models/README.md)"
                        .into(),
            });
        }
        let file: FileInventory = serde_json::from_str(text)?;
        let default = match &file.dtype {
            Some(s) => s.parse()?,
            None => DType::BF16,
        };
        let mut tensors = Vec::with_capacity(file.params.len());
        for p in file.params {
            let dtype = match &p.dtype {
                Some(s) => s.parse()?,
                None => default,
            };
            tensors.push(TensorSpec::new(p.name, &p.shape, dtype)?);
        }
        let inv = Inventory {
            model: file.model.unwrap_or_else(|| "unnamed".into()),
            tensors,
        };
        inv.validate(file.num_tensors, file.total_params)?;
        Ok(inv)
    }

    /// `Err` for an empty inventory, a name listed twice, element counts whose sum overflows,
    /// or counts that disagree with the file's `num_tensors` / `total_params` (when given).
    pub(crate) fn validate(&self, num_tensors: Option<usize>, total: Option<u64>) -> Result<()> {
        let bad = |reason: String| Error::BadInput {
            op: "Inventory::validate",
            what: format!("model {}", self.model),
            reason,
        };
        if self.tensors.is_empty() {
            return Err(bad("no parameters".into()));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(t) = self.tensors.iter().find(|t| !seen.insert(t.name.as_str())) {
            return Err(bad(format!("parameter {} listed twice", t.name)));
        }
        if let Some(n) = num_tensors.filter(|&n| n != self.tensors.len()) {
            return Err(bad(format!(
                "num_tensors says {n}, params lists {}",
                self.tensors.len()
            )));
        }
        // Each shape's count fits `usize` (TensorSpec::new); their sum must fit `u64`, or every
        // total and offset computed from the inventory later would wrap.
        let sum = self
            .tensors
            .iter()
            .try_fold(0u64, |acc, t| acc.checked_add(t.numel() as u64));
        if sum.is_none() {
            return Err(bad(
                "the parameters' element counts sum past u64::MAX (overflow)".into(),
            ));
        }
        if let Some(n) = total.filter(|&n| n != self.total_params()) {
            return Err(bad(format!(
                "total_params says {n}, params sum to {}",
                self.total_params()
            )));
        }
        Ok(())
    }

    /// A preset name (see [`presets::NAMES`]), a path to an inventory file, or a path to a
    /// `.safetensors` file ([`Inventory::from_safetensors`]).
    pub fn load(preset_or_path: &str) -> Result<Self> {
        match presets::by_name(preset_or_path) {
            Some(inv) => Ok(inv),
            None if preset_or_path.ends_with(".safetensors") => {
                Self::from_safetensors(Path::new(preset_or_path))
            }
            None if Path::new(preset_or_path).exists() => Self::from_json_file(preset_or_path),
            None => Err(Error::BadInput {
                op: "Inventory::load",
                what: format!("model {preset_or_path:?}"),
                reason: format!(
                    "neither a preset ({}) nor an existing file",
                    presets::NAMES.join(", ")
                ),
            }),
        }
    }

    /// The floating-point tensors of a safetensors file, by name, from its header (parsed and
    /// checked by the checkpoint reader: offsets, sizes, overlaps); integer and boolean
    /// buffers are not parameters and are left out. `Err` if none is left.
    pub fn from_safetensors(path: &Path) -> Result<Self> {
        let file = crate::checkpoint::safetensors::Reader::open(path, None)?;
        let mut tensors = file
            .tensors()
            .iter()
            .filter_map(|(name, info)| {
                let dtype = match info.dtype.as_str() {
                    "F8_E4M3" | "F8_E5M2" => DType::F8,
                    d => d.to_ascii_lowercase().parse().ok()?,
                };
                Some(TensorSpec::new(name.clone(), &info.shape, dtype))
            })
            .collect::<Result<Vec<_>>>()
            .with_context(|| format!("safetensors {}", path.display()))?;
        if tensors.is_empty() {
            return Err(Error::BadInput {
                op: "Inventory::from_safetensors",
                what: path.display().to_string(),
                reason: "no floating-point tensors (nothing to plan or validate)".into(),
            });
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let inv = Inventory {
            model: path.display().to_string(),
            tensors,
        };
        inv.validate(None, None)
            .with_context(|| format!("safetensors {}", path.display()))?;
        Ok(inv)
    }

    /// Total number of parameters.
    /// (Saturates at `u64::MAX`; a parsed inventory is refused before its total overflows.)
    pub fn total_params(&self) -> u64 {
        self.tensors
            .iter()
            .fold(0u64, |acc, t| acc.saturating_add(t.numel() as u64))
    }

    /// FSDP units as the runtime wraps them by default: `root` (everything outside a numbered
    /// block) first, then one unit per numbered block ([`numbered_block_of`]: `layers.3`,
    /// `transformer.h.3`, `model.encoder.layers.3`, …) in order of first appearance. A unit is
    /// named by its decoder layer (`layers.<i>`, [`layer_of`]) where that names no other
    /// block, else by the whole block (an encoder's and a decoder's `layers.0` are two units).
    /// Tensors keep their inventory order inside a unit.
    pub fn units(&self) -> Vec<Unit<'_>> {
        let mut blocks_of_layer: std::collections::HashMap<&str, std::collections::HashSet<&str>> =
            std::collections::HashMap::new();
        for t in &self.tensors {
            if let (Some(block), Some(layer)) = (numbered_block_of(&t.name), layer_of(&t.name)) {
                blocks_of_layer.entry(layer).or_default().insert(block);
            }
        }
        self.units_by(&|name| {
            let block = numbered_block_of(name)?;
            let layer = layer_of(name).filter(|l| {
                blocks_of_layer.get(l).is_some_and(|b| b.len() == 1) && block.ends_with(*l)
            });
            Some(layer.unwrap_or(block).to_string())
        })
    }

    /// FSDP units by a wrap rule: `unit_of(name)` names a tensor's unit, `None` (or `root`)
    /// puts it in `root`. `root` first (if not empty), then the units in order of first
    /// appearance.
    pub fn units_by(&self, unit_of: &dyn Fn(&str) -> Option<String>) -> Vec<Unit<'_>> {
        let mut root = Unit {
            name: "root".into(),
            tensors: Vec::new(),
        };
        let mut units: Vec<Unit> = Vec::new();
        let mut index: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        for t in &self.tensors {
            match unit_of(&t.name).filter(|unit| *unit != root.name) {
                None => root.tensors.push(t),
                Some(unit) => {
                    let i = *index.entry(unit.clone()).or_insert_with(|| {
                        units.push(Unit {
                            name: unit,
                            tensors: Vec::new(),
                        });
                        units.len() - 1
                    });
                    units[i].tensors.push(t);
                }
            }
        }
        let mut out = Vec::with_capacity(units.len() + 1);
        if !root.tensors.is_empty() {
            out.push(root);
        }
        out.extend(units);
        out
    }
}

/// The repeated numbered block a parameter belongs to, under any prefix: the name up to its
/// first all-digit component (`layers.3` of `layers.3.attn.q.weight`, `transformer.h.11` of
/// GPT-2's `transformer.h.11.mlp.c_fc.weight`, `model.layers.2` of an expert weight
/// `model.layers.2.mlp.experts.7.w1`). `None` for names without one (embeddings, final norm,
/// head), which go to the root unit.
pub fn numbered_block_of(name: &str) -> Option<&str> {
    let mut end = 0;
    for (i, part) in name.split('.').enumerate() {
        let start = if i == 0 { 0 } else { end + 1 };
        end = start + part.len();
        let last = end == name.len();
        if !last && !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            return Some(&name[..end]);
        }
    }
    None
}

/// The `layers.<i>` part of a parameter name, if it belongs to a decoder layer.
pub fn layer_of(name: &str) -> Option<&str> {
    let start = name
        .match_indices("layers.")
        .map(|(i, _)| i)
        .find(|&i| i == 0 || name.as_bytes()[i - 1] == b'.')?;
    let rest = &name[start + "layers.".len()..];
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let after = rest.as_bytes().get(digits).copied();
    if digits == 0 || after != Some(b'.') {
        return None;
    }
    Some(&name[start..start + "layers.".len() + digits])
}
