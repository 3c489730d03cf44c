//! [`ShardedModel`]'s checkpoints (format and guarantees: [`crate::checkpoint`]): save, load
//! at any world size and layout, consolidated safetensors export and import, and a digest of
//! the parameters.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{PartlyLoaded, ShardLayout, ShardedModel, ShardedUnit};
use crate::checkpoint::bad;
use crate::checkpoint::manifest::{
    rank_file, tensor_name, BufferRecord, FieldRecord, FileRecord, Manifest, ModelTensor,
    OptimizerRecord, Progress, TrainingRecord, UnitRecord, FORMAT, PARAM_FIELD, VERSION,
};
use crate::checkpoint::read::SourceFiles;
use crate::checkpoint::safetensors::{hex, Consolidated, FileDigest, Reader, TensorHeader, Writer};
use crate::checkpoint::sources::Sources;
use crate::checkpoint::{
    agree, fs, CheckpointState, FieldDataMut, FieldLayout, FieldType, Loaded, SaveOptions, Saved,
};
use crate::optim::Optimizer;
use crate::{Error, Result};

/// One rank's range of one saved array (what each rank tells rank 0 for the manifest).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Held {
    param: String,
    field: String,
    dtype: FieldType,
    len: usize,
    start: usize,
    end: usize,
}

/// What a load reads into one buffer: its fields, and for each field's spans the saved array
/// each comes from (`None`: not read).
struct UnitReads<'m> {
    fields: Vec<FieldLayout>,
    reads: Vec<Vec<Option<&'m FieldRecord>>>,
}

/// What one rank wrote.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RankWrite {
    digest: FileDigest,
    held: Vec<Held>,
}

/// A buffer's fields on this rank, the parameters then the optimizer state's, checked
/// against the arrays they describe (what a save writes and a load fills).
fn fields_of<O: CheckpointState>(
    optimizer: &O,
    unit: &ShardedUnit<O::State>,
) -> Result<Vec<FieldLayout>> {
    let mut fields = vec![FieldLayout::like_shard(
        PARAM_FIELD,
        FieldType::F32,
        &unit.local,
    )];
    fields.extend(optimizer.state_layout(&unit.optimizer_shard())?);
    let state = optimizer.state_data(&unit.state)?;
    let lens = std::iter::once((FieldType::F32, unit.local.len))
        .chain(state.iter().map(|d| (d.dtype(), d.len())))
        .collect::<Vec<_>>();
    crate::checkpoint::state::check_fields("checkpoint", &fields, lens.into_iter())?;
    Ok(fields)
}

/// `Err` on every rank when a rank passed another `keep` or `metadata` than rank 0 (`all`:
/// each rank's, serialized alike): rank 0 publishes and rotates, so another rank's would be
/// dropped without a word.
fn same_save_options(all: &[Vec<u8>]) -> Result<()> {
    let differ: Vec<usize> = (1..all.len()).filter(|&r| all[r] != all[0]).collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(Error::BadInput {
        op: "ShardedModel::save",
        what: "SaveOptions".into(),
        reason: format!(
            "ranks {differ:?} passed another keep or metadata than rank 0 (a save is one call \
             of every rank, with the same options)"
        ),
    })
}

impl<O: CheckpointState> ShardedModel<'_, O> {
    /// Saves parameters, optimizer state and progress to `root/step-N/` (N = steps taken),
    /// from every rank (call it on all ranks, between steps). Returns once the checkpoint is
    /// complete and durable on every rank; rotates older ones per [`SaveOptions::keep`].
    pub fn save(&mut self, root: impl AsRef<Path>, opts: &SaveOptions) -> Result<Saved> {
        let (root, start) = (root.as_ref(), Instant::now());
        let rank = self.mesh.world().rank();
        // Under HSDP the replicas share the writing, so `R` nodes write at once.
        let (shard_rank, shards) = (self.mesh.shard().rank(), self.mesh.shard().world_size());
        let writer = self.mesh.writer_of(shard_rank) == rank;
        let step = self.steps;
        let tmp = fs::tmp_dir(root, step);
        let savable = self
            .check_not_partly_loaded("ShardedModel::save")
            .and_then(|_| self.check_no_pending_gradients(root));
        // Rank 0 holds the root's lock until the save returns.
        let mut _lock = None;
        let prepared = match (savable, rank) {
            (Err(e), _) => Err(e),
            (Ok(()), 0) => {
                fs::prepare(root, step, &self.run_id).map(|(_, lock)| _lock = Some(lock))
            }
            (Ok(()), _) => Ok(()),
        };
        // With each rank's options: rank 0's are the ones written and applied.
        let options = prepared.and_then(|()| Ok(serde_json::to_vec(&(opts.keep, &opts.metadata))?));
        let same = agree(self.mesh.world(), root, options).and_then(|all| same_save_options(&all));
        if let Err(e) = same {
            if rank == 0 {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            return Err(e);
        }
        let file = tmp.join(rank_file(shard_rank, shards));
        // Rank 0 made `tmp`: a rank that does not see it was given another root, or its file
        // system is not rank 0's (the bare "No such file or directory" said neither).
        let visible = if rank != 0 && writer && !tmp.is_dir() {
            Err(bad(
                root,
                format!(
                    "the temporary folder {}, which rank 0 makes, is not there: every rank \
                     must pass the same root, on a file system that every rank sees",
                    tmp.display()
                ),
            ))
        } else {
            Ok(())
        };
        let written = match writer {
            true => visible
                .and_then(|()| self.write_rank_file(&file, opts.chunk_bytes))
                .and_then(|w| Ok(serde_json::to_vec(&w)?)),
            false => Ok(Vec::new()),
        };
        let writes = agree(self.mesh.world(), root, written).and_then(|all| {
            (0..shards)
                .map(|j| {
                    Ok(serde_json::from_slice::<RankWrite>(
                        &all[self.mesh.writer_of(j)],
                    )?)
                })
                .collect::<Result<Vec<RankWrite>>>()
        });
        let writes = match writes {
            Ok(w) => w,
            Err(e) => {
                if rank == 0 {
                    let _ = std::fs::remove_dir_all(&tmp);
                }
                return Err(e);
            }
        };
        let published = if rank == 0 {
            self.publish(root, &tmp, &writes, opts)
        } else {
            Ok(Vec::new())
        };
        if published.is_err() && rank == 0 {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        let moved = agree(self.mesh.world(), root, published)?;
        let (removed, set_aside): (Vec<PathBuf>, Vec<PathBuf>) = serde_json::from_slice(&moved[0])?;
        Ok(Saved {
            dir: fs::step_dir(root, step),
            bytes: writes.iter().map(|w| w.digest.bytes).sum(),
            seconds: start.elapsed().as_secs_f64(),
            removed,
            set_aside,
        })
    }

    fn check_no_pending_gradients(&self, root: &Path) -> Result<()> {
        let pending = self
            .units
            .iter()
            .any(|u| u.grads.local("save").is_ok() || u.grads.sink().holds_gradients());
        if pending {
            return Err(bad(
                root,
                "gradients are pending (save between optimizer steps: after step(), before the \
                 next backward)",
            ));
        }
        Ok(())
    }

    /// Writes this rank's file: every field's every span as one 1-D tensor.
    fn write_rank_file(&self, path: &Path, chunk_bytes: u64) -> Result<RankWrite> {
        let mut headers = Vec::new();
        let mut held = Vec::new();
        let mut layouts = Vec::with_capacity(self.units.len());
        for unit in &self.units {
            let fields = fields_of(&self.optimizer, unit)?;
            for f in &fields {
                for s in &f.spans {
                    let param = &unit.local.params[s.param].name;
                    headers.push(TensorHeader {
                        name: tensor_name(param, f.name),
                        dtype: f.dtype.safetensors(),
                        shape: vec![s.global.len()],
                    });
                    held.push(Held {
                        param: param.clone(),
                        field: f.name.to_string(),
                        dtype: f.dtype,
                        len: f.global_len[s.param],
                        start: s.global.start,
                        end: s.global.end,
                    });
                }
            }
            layouts.push(fields);
        }
        let (rank, world) = (self.mesh.shard().rank(), self.mesh.shard().world_size());
        let metadata = BTreeMap::from([
            ("format".to_string(), FORMAT.to_string()),
            ("rank".to_string(), rank.to_string()),
            ("world".to_string(), world.to_string()),
            ("step".to_string(), self.steps.to_string()),
        ]);
        let mut w = Writer::create(path, &headers, &metadata, chunk_bytes)?;
        for (unit, fields) in self.units.iter().zip(&layouts) {
            let data = std::iter::once(unit.params.master_storage().into())
                .chain(self.optimizer.state_data(&unit.state)?);
            for (f, d) in fields.iter().zip(data) {
                for s in &f.spans {
                    d.with_bytes(s.local..s.local + s.global.len(), |b| w.write(b))?;
                }
            }
        }
        Ok(RankWrite {
            digest: w.finish()?,
            held,
        })
    }

    /// Rank 0: the manifest from every rank's writes, then the rename into place and rotation.
    fn publish(
        &self,
        root: &Path,
        tmp: &Path,
        writes: &[RankWrite],
        opts: &SaveOptions,
    ) -> Result<Vec<u8>> {
        let world = self.mesh.shard().world_size();
        let mut fields: BTreeMap<(String, String), FieldRecord> = BTreeMap::new();
        let mut files = Vec::with_capacity(world);
        for (rank, w) in writes.iter().enumerate() {
            for h in w.held.iter().cloned() {
                let rec = fields
                    .entry((h.param.clone(), h.field.clone()))
                    .or_insert_with(|| FieldRecord {
                        param: h.param.clone(),
                        field: h.field.clone(),
                        dtype: h.dtype,
                        len: h.len,
                        holders: Vec::new(),
                    });
                if rec.dtype != h.dtype || rec.len != h.len {
                    return Err(bad(
                        tmp,
                        format!("ranks disagree on {} of {}", h.field, h.param),
                    ));
                }
                rec.holders.push([rank, h.start, h.end]);
            }
            files.push(FileRecord {
                rank,
                file: rank_file(rank, world),
                digest: w.digest.clone(),
            });
        }
        let manifest = Manifest {
            format: FORMAT.into(),
            version: VERSION,
            world,
            layout: match self.opts.layout {
                ShardLayout::Ragged => "ragged".into(),
                ShardLayout::Fsdp2 => "fsdp2".into(),
            },
            model: self.model_tensors(),
            optimizer: OptimizerRecord {
                name: self.optimizer.name().into(),
                config: self.optimizer.settings(),
            },
            progress: self.progress()?,
            units: self.unit_records(),
            fields: fields.into_values().collect(),
            files,
            training: Some(TrainingRecord {
                fsdp: self.opts.numerics(),
                metadata: opts.metadata.clone(),
                run: Some(self.run_id.clone()),
            }),
            checksum: String::new(),
        };
        manifest.write(tmp)?;
        // Read back through the loader's checks: a manifest that would not load is not published.
        Manifest::read(tmp)?;
        let (mut removed, set_aside) = match opts.keep {
            0 => (Vec::new(), fs::set_aside_later(root, self.steps)?),
            _ => (fs::remove_later(root, self.steps)?, Vec::new()),
        };
        fs::publish(root, tmp, self.steps)?;
        if opts.keep > 0 {
            removed.extend(fs::rotate(root, opts.keep, self.steps)?);
        }
        Ok(serde_json::to_vec(&(removed, set_aside))?)
    }

    fn progress(&self) -> Result<Progress> {
        let mut steps = self
            .units
            .iter()
            .filter(|u| !u.params.is_frozen())
            .map(|u| self.optimizer.state_step(&u.state));
        let first = steps.next().unwrap_or(0);
        if steps.any(|s| s != first) {
            return Err(Error::Msg(
                "checkpoint: the units' optimizer states disagree on the step count".into(),
            ));
        }
        Ok(Progress {
            steps: self.steps,
            skipped: self.skipped,
            state_step: first,
            learning_rate: self.optimizer.learning_rate(),
            schedule: self
                .schedule
                .map(|(s, base)| format!("{s:?} of base rate {base}")),
            schedule_state: self.schedule,
        })
    }

    fn unit_records(&self) -> Vec<UnitRecord> {
        self.groups
            .iter()
            .map(|(name, buffers)| UnitRecord {
                name: name.clone(),
                buffers: buffers
                    .iter()
                    .map(|&b| {
                        let u = &self.units[b];
                        BufferRecord {
                            shard_size: u.local.len,
                            frozen: u.params.is_frozen(),
                            tensors: match &u.layout {
                                super::layout::UnitLayout::Ragged(g) => g
                                    .tensors
                                    .iter()
                                    .map(|(n, _, off)| (n.clone(), *off))
                                    .collect(),
                                super::layout::UnitLayout::Fsdp2(_) => Vec::new(),
                            },
                        }
                    })
                    .collect(),
            })
            .collect()
    }

    /// Loads a checkpoint saved at any world size and layout: `path` is a checkpoint folder or
    /// a root holding `step-N` folders (the newest complete one is taken). Restores the
    /// parameters, the optimizer state, the step counters and the learning rate; drops pending
    /// gradients. Call it on every rank; every rank returns the same `Ok` or `Err`. An `Err`
    /// found before any value is replaced (no checkpoint, another model or optimizer, a rank
    /// file missing or truncated) leaves the model as it was; one while reading (a checksum
    /// mismatch, an I/O error) leaves it partly loaded, and then every use of it but another
    /// load returns an `Err` naming the cause.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<Loaded> {
        let (path, start) = (path.as_ref(), Instant::now());
        let resolved = fs::resolve(path);
        let dir = match &resolved {
            Ok(d) => d.clone(),
            Err(_) => path.to_path_buf(),
        };
        let checked = resolved.and_then(|d| {
            let m = Manifest::read(&d)?;
            self.check_compatible(&m, &d)?;
            Ok((d, m))
        });
        let (named, checked) = match checked {
            Ok((d, m)) => (Ok(d.display().to_string().into_bytes()), Some((d, m))),
            Err(e) => (Err(e), None),
        };
        let names = agree(self.mesh.world(), &dir, named)?;
        if names.iter().any(|n| n != &names[0]) {
            return Err(bad(&dir, "ranks resolved different checkpoint folders"));
        }
        let (dir, manifest) = checked.expect("every rank succeeded above");
        // Every rank checks what it will read before any rank replaces a value.
        let planned = Self::check_progress(&manifest.progress)
            .and_then(|_| self.planned_reads(&dir, &manifest));
        let (plan, status) = match planned {
            Ok(plan) => (Some(plan), Ok(Vec::new())),
            Err(e) => (None, Err(e)),
        };
        agree(self.mesh.world(), &dir, status)?;
        let plan = plan.expect("every rank succeeded above");
        let read = self.read_all(&dir, &manifest, &plan);
        let bytes_read = *read.as_ref().unwrap_or(&0);
        let applied = agree(self.mesh.world(), &dir, read.map(|_| Vec::new()))
            .and_then(|_| self.share_loaded())
            .and_then(|_| self.restore_progress(&manifest.progress));
        self.partly_loaded = applied.as_ref().err().map(|e| PartlyLoaded {
            cause: e.to_string(),
            state_too: true,
        });
        applied?;
        // After the restored learning rate (and Muon's fallback rate with it) is in place.
        let mut changed_settings =
            crate::settings::changes(&manifest.optimizer.config, &self.optimizer.settings());
        let training = manifest.training.unwrap_or_default();
        // Its saves continue the loaded run (and may share its root).
        if let Some(run) = &training.run {
            self.run_id.clone_from(run);
        }
        if !training.fsdp.is_empty() {
            let fsdp = crate::settings::changes(&training.fsdp, &self.opts.numerics());
            changed_settings.extend(fsdp.into_iter().map(|c| format!("fsdp.{c}")));
        }
        Ok(Loaded {
            changed_settings,
            metadata: training.metadata,
            saved_world: manifest.world,
            steps: manifest.progress.steps,
            bytes_read,
            seconds: start.elapsed().as_secs_f64(),
            dir,
        })
    }

    /// `Err` unless the checkpoint holds this model (same names and shapes) and optimizer.
    fn check_compatible(&self, m: &Manifest, dir: &Path) -> Result<()> {
        let saved: HashMap<&str, &ModelTensor> =
            m.model.iter().map(|t| (t.name.as_str(), t)).collect();
        let ours = self.model_tensors();
        for t in &ours {
            match saved.get(t.name.as_str()) {
                None => {
                    return Err(bad(
                        dir,
                        format!(
                            "the model's parameter {} is not in it (another model?)",
                            t.name
                        ),
                    ))
                }
                Some(s) if s.shape != t.shape || s.dtype != t.dtype => {
                    return Err(bad(
                        dir,
                        format!(
                            "{}: saved as {:?} {}, the model has {:?} {}",
                            t.name, s.shape, s.dtype, t.shape, t.dtype
                        ),
                    ))
                }
                Some(s) if !role_change_allowed(s.role.as_deref(), t.role.as_deref()) => {
                    return Err(bad(
                        dir,
                        format!(
                            "{}: saved with role {}, this model's optimizer gives it {}: its \
                             saved optimizer state means something else under another role \
                             (another role rule?); only freezing and unfreezing may change",
                            t.name,
                            s.role.as_deref().unwrap_or_default(),
                            t.role.as_deref().unwrap_or_default()
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        if ours.len() != m.model.len() {
            let names: HashSet<&str> = ours.iter().map(|t| t.name.as_str()).collect();
            let extra: Vec<&str> = m
                .model
                .iter()
                .map(|t| t.name.as_str())
                .filter(|n| !names.contains(n))
                .take(5)
                .collect();
            return Err(bad(
                dir,
                format!(
                    "it holds {} parameters, the model {} (not in the model: {extra:?})",
                    m.model.len(),
                    ours.len()
                ),
            ));
        }
        if m.optimizer.name != self.optimizer.name() {
            return Err(bad(
                dir,
                format!(
                    "saved with optimizer {}, this model uses {}",
                    m.optimizer.name,
                    self.optimizer.name()
                ),
            ));
        }
        Ok(())
    }

    /// Every range this rank reads, unit by unit and field by field (`None`: a parameter
    /// saved frozen and trained now, whose state stays as initialized), each checked against
    /// the record it comes from, and every rank file found at its saved size: what can be
    /// found wrong before a value is replaced.
    fn planned_reads<'m>(&self, dir: &Path, m: &'m Manifest) -> Result<Vec<UnitReads<'m>>> {
        let frozen = role_name(crate::Role::Frozen);
        let saved_frozen: HashSet<&str> = m
            .model
            .iter()
            .filter(|t| t.role.as_deref() == Some(frozen.as_str()))
            .map(|t| t.name.as_str())
            .collect();
        let records: HashMap<(&str, &str), &FieldRecord> = m
            .fields
            .iter()
            .map(|f| ((f.param.as_str(), f.field.as_str()), f))
            .collect();
        let mut plan = Vec::with_capacity(self.units.len());
        for unit in &self.units {
            let fields = fields_of(&self.optimizer, unit)?;
            let mut reads = Vec::with_capacity(fields.len());
            for f in &fields {
                let mut spans = Vec::with_capacity(f.spans.len());
                for span in &f.spans {
                    let name = &unit.local.params[span.param].name;
                    if f.name != PARAM_FIELD && saved_frozen.contains(name.as_str()) {
                        spans.push(None);
                        continue;
                    }
                    let rec = records.get(&(name.as_str(), f.name)).ok_or_else(|| {
                        bad(
                            dir,
                            format!(
                                "no {} for {name} in it (saved with another optimizer config?)",
                                f.name
                            ),
                        )
                    })?;
                    let len = f.global_len[span.param];
                    if rec.len != len || rec.dtype != f.dtype {
                        return Err(bad(
                            dir,
                            format!(
                                "{} of {name}: saved {} {:?} elements, this model needs {len} {:?}",
                                f.name, rec.len, rec.dtype, f.dtype
                            ),
                        ));
                    }
                    spans.push(Some(*rec));
                }
                reads.push(spans);
            }
            plan.push(UnitReads { fields, reads });
        }
        SourceFiles::new(dir, m).check_sizes()?;
        Ok(plan)
    }

    /// Reads this rank's ranges of every field, as planned, where this rank reads files
    /// ([`super::mesh::Mesh::reads_files`]; the other replicas receive the values from it next,
    /// [`Self::share_loaded`]); returns the bytes read. Only a file that fails its checksum or
    /// its read part way leaves values replaced and others not.
    fn read_all(&mut self, dir: &Path, m: &Manifest, plan: &[UnitReads<'_>]) -> Result<u64> {
        let mut files = SourceFiles::new(dir, m);
        // Gradients since the last step belong to the values being replaced.
        self.discard_gradients();
        let (optimizer, reads) = (&self.optimizer, self.mesh.reads_files());
        for (unit, planned) in self.units.iter_mut().zip(plan) {
            let ShardedUnit { params, state, .. } = unit;
            let data = std::iter::once(FieldDataMut::from(params.master_storage_mut()))
                .chain(optimizer.state_data_mut(state)?);
            for ((f, recs), mut d) in planned.fields.iter().zip(&planned.reads).zip(data) {
                for (span, rec) in f.spans.iter().zip(recs).filter(|_| reads) {
                    if let Some(rec) = rec {
                        files.read_range(rec, span.global.clone(), &mut d, span.local)?;
                    }
                }
            }
            optimizer.set_state_step(state, m.progress.state_step);
        }
        Ok(files.bytes_read)
    }

    /// Under HSDP, sends every unit's loaded parameters and optimizer state from the replica
    /// that read them to the others ([`super::mesh::Mesh::share_loaded`]); nothing without
    /// HSDP. Called on every rank after every rank's reads succeeded (the fields are the ones
    /// the reads filled, so no rank fails here alone).
    fn share_loaded(&mut self) -> Result<()> {
        self.share_loaded_params()?;
        let (optimizer, mesh) = (&self.optimizer, &self.mesh);
        for unit in &mut self.units {
            for mut f in optimizer.state_data_mut(&mut unit.state)? {
                mesh.share_loaded(f.as_buf_mut())?;
            }
        }
        Ok(())
    }

    /// `Err` unless the saved schedule and its base rate are valid (checked before a load
    /// replaces values; the saved rate itself is checked where it is set).
    fn check_progress(p: &Progress) -> Result<()> {
        if let Some((schedule, base)) = p.schedule_state {
            schedule.validate()?;
            crate::optim::check_learning_rate(base)?;
        }
        Ok(())
    }

    fn restore_progress(&mut self, p: &Progress) -> Result<()> {
        if let (Some(lr), Some(_)) = (p.learning_rate, self.optimizer.learning_rate()) {
            self.optimizer.set_learning_rate(lr)?;
        }
        self.steps = p.steps;
        self.skipped = p.skipped;
        // The schedule that was running goes on from `steps`, with the base it multiplied.
        if let Some(saved) = p.schedule_state {
            self.schedule = Some(saved);
        }
        Ok(())
    }
}

impl<O: Optimizer> ShardedModel<'_, O> {
    /// Writes every parameter (f32 master values, the model's own names and shapes) to one
    /// safetensors file at `path` on rank 0 (`VarBuilder::from_mmaped_safetensors` loads it).
    /// Call it on every rank: each unit is gathered in turn, so a rank holds one unit at a time.
    pub fn export_safetensors(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let (mut file, mut failed) = (None, None);
        if self.mesh.world().rank() == 0 {
            let tensors = self.units.iter().flat_map(|u| u.params.slots());
            match Consolidated::create(path, tensors.map(|s| (s.name.clone(), s.shape.clone()))) {
                Ok(f) => file = Some(f),
                Err(e) => failed = Some(e),
            }
        }
        // Every rank takes part in every gather, even after rank 0 failed to write.
        for u in 0..self.units.len() {
            let values = self.gather_buffer(u)?;
            if let (Some(f), None) = (file.as_mut(), &failed) {
                failed = values
                    .iter()
                    .find_map(|v| f.write(bytemuck::cast_slice(v)).err());
            }
        }
        let done = match (file, failed) {
            (_, Some(e)) => Err(e),
            (Some(f), None) => f.finish(),
            (None, None) => Ok(()),
        };
        agree(self.mesh.world(), path, done.map(|_| Vec::new())).map(|_| ())
    }

    /// SHA-256 (hex) of the parameters' f32 values, by name: the same for the same values
    /// whatever the world size, layout or compute dtype (compare two runs by eye). Gathers one
    /// unit at a time; call it on every rank.
    pub fn param_digest(&mut self) -> Result<String> {
        let mut per_tensor = Vec::new();
        for u in 0..self.units.len() {
            let values = self.gather_buffer(u)?;
            for (slot, v) in self.units[u].params.slots().iter().zip(values) {
                let mut h = Sha256::new();
                h.update(slot.name.as_bytes());
                slot.shape
                    .iter()
                    .for_each(|d| h.update((*d as u64).to_le_bytes()));
                h.update(bytemuck::cast_slice::<f32, u8>(&v));
                per_tensor.push((slot.name.clone(), h.finalize()));
            }
        }
        per_tensor.sort();
        let mut h = Sha256::new();
        per_tensor.iter().for_each(|(_, d)| h.update(d));
        Ok(hex(&h.finalize()))
    }

    /// Overwrites the parameters from a consolidated safetensors file (a Hugging Face or
    /// [`Self::export_safetensors`] checkpoint), or a Hugging Face checkpoint split over
    /// several files (the path of its `model.safetensors.index.json`): each rank reads only
    /// its ranges of each tensor, converting F32, BF16 or F16 to the f32 master. Every model
    /// parameter must be in the file(s) with its shape and finite values (a NaN or an infinity
    /// is refused naming its tensor and element); returns the tensors the model does not
    /// have. The optimizer state is left as it is (fresh after `fully_shard`); pending
    /// gradients are dropped.
    pub fn load_safetensors(&mut self, path: impl AsRef<Path>) -> Result<Vec<String>> {
        let path = path.as_ref();
        let (sources, status) = match self.import_sources(path) {
            Ok(sources) => (Some(sources), Ok(Vec::new())),
            Err(e) => (None, Err(e)),
        };
        agree(self.mesh.world(), path, status)?;
        let mut sources = sources.expect("every rank succeeded above");
        let read = self.import_local(&mut sources);
        let applied = agree(self.mesh.world(), path, read.map(|_| Vec::new()))
            .and_then(|_| self.share_loaded_params());
        // A failed `load` left optimizer state partly replaced too, which this does not read.
        let state_too = self.partly_loaded.as_ref().is_some_and(|p| p.state_too);
        self.partly_loaded = match (&applied, state_too) {
            (Err(e), _) => Some(PartlyLoaded {
                cause: e.to_string(),
                state_too,
            }),
            (Ok(_), true) => self.partly_loaded.take(),
            (Ok(_), false) => None,
        };
        applied?;
        Ok(self.unused_tensors(&sources))
    }

    /// Every parameter (name, global shape, the saved f32, its role), in unit order.
    fn model_tensors(&self) -> Vec<ModelTensor> {
        let role =
            |u: &ShardedUnit<O::State>, m: &crate::optim::ParamMeta| match u.params.is_frozen() {
                true => crate::Role::Frozen,
                false => self.optimizer.role(&m.name, &m.shape),
            };
        self.units
            .iter()
            .flat_map(|u| u.local.params.iter().map(move |m| (u, m)))
            .map(|(u, m)| ModelTensor {
                name: m.name.clone(),
                shape: m.shape.clone(),
                dtype: "F32".into(),
                role: Some(role_name(role(u, m))),
            })
            .collect()
    }

    /// The file(s) at `path`, checked to hold every parameter with its shape in a dtype
    /// loads as f32: what can be found wrong before a value is replaced.
    fn import_sources(&self, path: &Path) -> Result<Sources> {
        let mut sources = Sources::open(path)?;
        for meta in self.units.iter().flat_map(|u| &u.local.params) {
            let (_, info) = sources.tensor(&meta.name)?;
            if info.shape != meta.shape {
                return Err(bad(
                    path,
                    format!(
                        "{}: {:?} in the file, {:?} in the model",
                        meta.name, info.shape, meta.shape
                    ),
                ));
            }
            element_size(path, &meta.name, &info.dtype)?;
        }
        Ok(sources)
    }

    /// Under HSDP, sends every unit's loaded parameters from the replica that read them to the
    /// others ([`super::mesh::Mesh::share_loaded`]); nothing without HSDP.
    fn share_loaded_params(&mut self) -> Result<()> {
        for unit in &mut self.units {
            let master = unit.params.master_storage_mut();
            self.mesh.share_loaded(master.view_mut().into())?;
        }
        Ok(())
    }

    /// Reads this rank's pieces of every parameter from `sources`, where this rank reads
    /// files ([`super::mesh::Mesh::reads_files`]; the other replicas receive them next).
    fn import_local(&mut self, sources: &mut Sources) -> Result<()> {
        self.discard_gradients();
        if !self.mesh.reads_files() {
            return Ok(());
        }
        for unit in &mut self.units {
            let local = &unit.local;
            let master = unit.params.master_storage_mut();
            for piece in &local.pieces {
                let meta = &local.params[piece.param];
                let (file, info) = sources.tensor(&meta.name)?;
                let at = piece.offset..piece.offset + piece.range.len();
                master.fill_range(at, |out| {
                    read_as_f32(file, &meta.name, &info.dtype, piece.range.clone(), out)
                })?;
            }
        }
        Ok(())
    }

    /// The tensors of `sources` the model does not have, sorted.
    fn unused_tensors(&self, sources: &Sources) -> Vec<String> {
        let model = self.model_tensors();
        let names: HashSet<&str> = model.iter().map(|t| t.name.as_str()).collect();
        let mut unused: Vec<String> = sources
            .names()
            .filter(|n| !names.contains(n.as_str()))
            .cloned()
            .collect();
        unused.sort();
        unused
    }
}

/// Reads elements `range` of tensor `name` (of `dtype`) as f32 into `out`; `Err` naming the
/// first element that is NaN or infinite: a starting point with one would train on (a row no
/// gradient reaches) or fail at the first step far from its cause.
fn read_as_f32(
    file: &mut Reader,
    name: &str,
    dtype: &str,
    range: std::ops::Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    let start = range.start;
    read_values(file, name, dtype, range, out)?;
    match out.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(bad(
            file.path(),
            format!(
                "{name}: element {} is {} (a starting point must be finite)",
                start + i,
                out[i]
            ),
        )),
    }
}

/// [`read_as_f32`]'s reading and conversion.
fn read_values(
    file: &mut Reader,
    name: &str,
    dtype: &str,
    range: std::ops::Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    let size = element_size(file.path(), name, dtype)?;
    let bytes_of = |r: std::ops::Range<usize>| (r.start * size) as u64..(r.end * size) as u64;
    if size == 4 {
        return file.read_tensor(name, bytes_of(range), bytemuck::cast_slice_mut(out));
    }
    // Half precision: convert in blocks, so no second copy of the piece exists.
    const BLOCK: usize = 1 << 16;
    let mut buf = vec![0u16; BLOCK.min(range.len())];
    for (i, chunk) in out.chunks_mut(BLOCK).enumerate() {
        let a = range.start + i * BLOCK;
        let half = &mut buf[..chunk.len()];
        file.read_tensor(
            name,
            bytes_of(a..a + chunk.len()),
            bytemuck::cast_slice_mut(half),
        )?;
        for (o, &h) in chunk.iter_mut().zip(half.iter()) {
            *o = if dtype == "BF16" {
                half::bf16::from_bits(h).to_f32()
            } else {
                half::f16::from_bits(h).to_f32()
            };
        }
    }
    Ok(())
}

/// Bytes per element of a tensor of `dtype` that loads as f32, or `Err` for another dtype.
fn element_size(path: &Path, name: &str, dtype: &str) -> Result<usize> {
    match dtype {
        "F32" => Ok(4),
        "BF16" | "F16" => Ok(2),
        other => Err(bad(
            path,
            format!("{name}: dtype {other}; F32, BF16 and F16 load as f32"),
        )),
    }
}

/// A role's name as checkpoints record it (its `Debug` text, written and compared here only).
fn role_name(role: crate::Role) -> String {
    format!("{role:?}")
}

/// Whether a parameter saved with role `saved` may load under role `now`: the same role, a
/// checkpoint that did not record it, or freezing and unfreezing (a frozen parameter has no
/// saved state; one unfrozen starts its state afresh). Other changes would read one role's
/// state as another's (AdamW moments as Muon momentum).
fn role_change_allowed(saved: Option<&str>, now: Option<&str>) -> bool {
    match (saved, now) {
        (Some(a), Some(b)) => {
            let frozen = role_name(crate::Role::Frozen);
            a == b || a == frozen || b == frozen
        }
        _ => true,
    }
}
