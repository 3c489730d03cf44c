//! The tensors of a consolidated checkpoint: one safetensors file, or a Hugging Face
//! checkpoint split over several (`model.safetensors.index.json`, whose `weight_map` names the
//! file beside it that holds each tensor).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::bad;
use super::manifest::is_plain_file_name;
use super::safetensors::{Reader, TensorInfo};
use crate::Result;

/// Every file of a consolidated checkpoint, opened (headers checked), and which holds each
/// tensor.
pub struct Sources {
    /// What was opened: the file or the index.
    path: PathBuf,
    files: Vec<Reader>,
    holder: HashMap<String, usize>,
}

/// The part of a Hugging Face index this reads.
#[derive(serde::Deserialize)]
struct Index {
    weight_map: WeightMap,
}

/// `weight_map`'s `(tensor, file)` entries as written: a JSON map keeps one of two entries of
/// a name, and which file holds a tensor named twice is not a question to leave open.
struct WeightMap(Vec<(String, String)>);

impl<'de> serde::Deserialize<'de> for WeightMap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = WeightMap;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of tensor names and file names")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<WeightMap, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    entries.push(entry);
                }
                Ok(WeightMap(entries))
            }
        }
        d.deserialize_map(Visit)
    }
}

impl Sources {
    /// A `.safetensors` file, or a `*.index.json` whose files lie in its folder (plain names
    /// only, each opened once).
    pub fn open(path: &Path) -> Result<Sources> {
        let is_index = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(".index.json"));
        if !is_index {
            let file = Reader::open(path, None)?;
            let holder = file.tensors().keys().map(|n| (n.clone(), 0)).collect();
            return Ok(Sources {
                path: path.into(),
                files: vec![file],
                holder,
            });
        }
        // At most a header's size: an index lists one short entry per tensor, as a header
        // does (a large model's is a few hundred KiB).
        let most = super::safetensors::MAX_HEADER;
        let text = crate::limits::read_regular("checkpoint: read index", path, most)?;
        let index: Index = serde_json::from_slice(&text)
            .map_err(|e| bad(path, format!("not a safetensors index (weight_map): {e}")))?;
        let folder = path.parent().unwrap_or(Path::new("."));
        let (mut files, mut opened) = (Vec::new(), HashMap::new());
        let mut holder = HashMap::new();
        for (tensor, file) in &index.weight_map.0 {
            if holder.contains_key(tensor) {
                return Err(bad(path, format!("weight_map names {tensor} twice")));
            }
            if !is_plain_file_name(file) {
                return Err(bad(
                    path,
                    format!("{tensor}: file {file:?} is not a plain name"),
                ));
            }
            let at = match opened.get(file) {
                Some(&at) => at,
                None => {
                    files.push(Reader::open(&folder.join(file), None)?);
                    opened.insert(file.clone(), files.len() - 1);
                    files.len() - 1
                }
            };
            holder.insert(tensor.clone(), at);
        }
        if files.is_empty() {
            return Err(bad(path, "the index maps no tensors"));
        }
        Ok(Sources {
            path: path.into(),
            files,
            holder,
        })
    }

    /// The file holding `name` and its entry, or an error naming the checkpoint.
    pub fn tensor(&mut self, name: &str) -> Result<(&mut Reader, TensorInfo)> {
        let Some(&at) = self.holder.get(name) else {
            return Err(bad(&self.path, self.missing(name)));
        };
        let file = &mut self.files[at];
        let info = file.tensor(name)?.clone();
        Ok((file, info))
    }

    /// "no tensor `name`", with a tensor whose name differs by a leading prefix if there is
    /// one (a file saved with `model.` before every name, or without it).
    fn missing(&self, name: &str) -> String {
        let prefixed = |long: &str, short: &str| long.ends_with(&format!(".{short}"));
        let near = self
            .holder
            .keys()
            .filter(|k| prefixed(k, name) || prefixed(name, k))
            .min();
        match near {
            Some(k) => format!("no tensor {name} (the file has {k}: do the prefixes differ?)"),
            None => format!("no tensor {name}"),
        }
    }

    /// Every tensor name.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.holder.keys()
    }
}
