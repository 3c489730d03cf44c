//! A small decoder-only transformer on bytes: the model of the main example (`examples/train.rs`),
//! the end-to-end tests and the training-step benchmark. Plain candle-nn layers over a
//! `VarBuilder`, so it runs unchanged on sharded views or on ordinary variables.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{embedding, linear_no_bias, Embedding, Linear, VarBuilder};

use crate::checkpoint::{CheckpointState, SaveOptions};
use crate::comm::{BufMut, Communicator, ReduceOp};
use crate::dbuffer::candle;
use crate::fsdp::{fully_shard, FsdpOptions, ShardedModel, StageReport, Stages, UnitParams};
use crate::optim::Optimizer;
use crate::{Error, Result};

/// Model size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransformerConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub d_ff: usize,
    pub seq_len: usize,
}

impl TransformerConfig {
    /// About 3.3 million parameters: byte vocabulary, 4 layers of width 256.
    pub const SMALL: TransformerConfig = TransformerConfig {
        vocab: 256,
        d_model: 256,
        n_layers: 4,
        n_heads: 4,
        d_ff: 1024,
        seq_len: 64,
    };

    /// A few thousand parameters with uneven sizes, for fast tests.
    pub const TINY: TransformerConfig = TransformerConfig {
        vocab: 61,
        d_model: 24,
        n_layers: 2,
        n_heads: 2,
        d_ff: 40,
        seq_len: 12,
    };

    /// `Err` unless the sizes are positive (`n_layers` may be 0), `d_model` splits into
    /// `n_heads` whole heads and token ids fit `u32` (candle's index type).
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab", self.vocab),
            ("d_model", self.d_model),
            ("n_heads", self.n_heads),
            ("d_ff", self.d_ff),
            ("seq_len", self.seq_len),
        ];
        let reason = if let Some((name, _)) = sizes.iter().find(|(_, n)| *n == 0) {
            format!("{name} is 0")
        } else if self.d_model % self.n_heads != 0 {
            format!(
                "d_model {} is not a multiple of n_heads {}",
                self.d_model, self.n_heads
            )
        } else if u32::try_from(self.vocab).is_err() {
            format!("vocab {} does not fit the u32 token ids", self.vocab)
        } else {
            return Ok(());
        };
        Err(Error::BadInput {
            op: "TransformerConfig::validate",
            what: format!("{self:?}"),
            reason,
        })
    }

    /// Every parameter's name and shape, in registration order.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (d, f) = (self.d_model, self.d_ff);
        let mut out = vec![("embed.weight".to_string(), vec![self.vocab, d])];
        for i in 0..self.n_layers {
            let p = |s: &str| format!("layers.{i}.{s}");
            out.push((p("attn_norm.weight"), vec![d]));
            for w in ["q", "k", "v", "o"] {
                out.push((p(&format!("attn.{w}.weight")), vec![d, d]));
            }
            out.push((p("mlp_norm.weight"), vec![d]));
            out.push((p("mlp.up.weight"), vec![f, d]));
            out.push((p("mlp.down.weight"), vec![d, f]));
        }
        out.push(("norm.weight".to_string(), vec![d]));
        out.push(("head.weight".to_string(), vec![self.vocab, d]));
        out
    }

    /// Deterministic initial values (same on every rank): norms at one, matrices uniform in
    /// `±1/√fan_in` from a seeded generator.
    pub fn init_params(&self, seed: u64) -> Result<Vec<(String, Tensor)>> {
        self.validate()?;
        let mut rng = SplitMix(seed);
        self.param_shapes()
            .into_iter()
            .map(|(name, shape)| {
                let n: usize = shape.iter().product();
                let values: Vec<f32> = if shape.len() == 1 {
                    vec![1.0; n]
                } else {
                    let bound = 1.0 / (shape[1] as f32).sqrt();
                    (0..n).map(|_| bound * rng.uniform()).collect()
                };
                let t = Tensor::from_vec(values, shape.as_slice(), &Device::Cpu)
                    .map_err(candle("init_params"))?;
                Ok((name, t))
            })
            .collect()
    }
}

/// Uniform numbers in `[-1, 1)` from a 64-bit SplitMix generator (tiny and reproducible).
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

struct Block {
    attn_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    mlp_norm: Tensor,
    up: Linear,
    down: Linear,
    n_heads: usize,
}

/// The transformer.
pub struct Transformer {
    cfg: TransformerConfig,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: Tensor,
    head: Linear,
}

fn rms_norm(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::ops::rms_norm_slow(x, w, 1e-5)
}

impl Block {
    /// Layer `i` from `vb` (names `layers.<i>.…`, as in [`TransformerConfig::param_shapes`]).
    fn new(cfg: &TransformerConfig, i: usize, vb: &VarBuilder) -> candle_core::Result<Self> {
        // Every way to build a block (the model, the stages) passes here before dividing.
        cfg.validate()
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let (d, f) = (cfg.d_model, cfg.d_ff);
        let vb = vb.pp(format!("layers.{i}"));
        Ok(Block {
            attn_norm: vb.get(d, "attn_norm.weight")?,
            q: linear_no_bias(d, d, vb.pp("attn.q"))?,
            k: linear_no_bias(d, d, vb.pp("attn.k"))?,
            v: linear_no_bias(d, d, vb.pp("attn.v"))?,
            o: linear_no_bias(d, d, vb.pp("attn.o"))?,
            mlp_norm: vb.get(d, "mlp_norm.weight")?,
            up: linear_no_bias(d, f, vb.pp("mlp.up"))?,
            down: linear_no_bias(f, d, vb.pp("mlp.down"))?,
            n_heads: cfg.n_heads,
        })
    }

    /// Pre-norm attention and MLP, each with a residual. In a stage (`params`), the MLP's down
    /// projection feeds only the residual add, so recomputation may skip its value
    /// ([`UnitParams::output_linear`]).
    fn forward(
        &self,
        x: &Tensor,
        mask: &Tensor,
        params: Option<&UnitParams>,
    ) -> candle_core::Result<Tensor> {
        let x = (x + self.attention(&rms_norm(x, &self.attn_norm)?, mask)?)?;
        let h = self.up.forward(&rms_norm(&x, &self.mlp_norm)?)?.gelu()?;
        let down = match params {
            Some(p) => p.output_linear(&h, self.down.weight())?,
            None => self.down.forward(&h)?,
        };
        &x + down
    }

    fn attention(&self, x: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let dh = d / self.n_heads;
        let heads = |l: &Linear| -> candle_core::Result<Tensor> {
            l.forward(x)?
                .reshape((b, t, self.n_heads, dh))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (heads(&self.q)?, heads(&self.k)?, heads(&self.v)?);
        let scores = (q.matmul(&k.t()?)? / (dh as f64).sqrt())?.broadcast_add(mask)?;
        // The differentiable softmax: `softmax_last_dim` is forward-only in candle, and with it
        // q and k would never get a gradient.
        let attn = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let y = attn.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?;
        self.o.forward(&y)
    }
}

/// The model's input and target tokens of a batch `[batch, seq_len + 1]`.
fn split_ids(ids: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let t = ids.dim(1)? - 1;
    Ok((ids.narrow(1, 0, t)?, ids.narrow(1, 1, t)?))
}

/// Final norm, head and mean next-token cross-entropy.
fn head_loss(
    cfg: &TransformerConfig,
    x: &Tensor,
    norm: &Tensor,
    head: &Linear,
    targets: &Tensor,
) -> candle_core::Result<Tensor> {
    let logits = head.forward(&rms_norm(x, norm)?)?;
    // The loss in f32 whatever the compute dtype (a bf16 log-softmax and mean lose digits).
    let logits = logits.reshape(((), cfg.vocab))?.to_dtype(DType::F32)?;
    candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)
}

impl Transformer {
    /// Builds the model from `vb` (names as in [`TransformerConfig::param_shapes`]).
    pub fn new(cfg: TransformerConfig, vb: VarBuilder) -> Result<Self> {
        let build = || -> candle_core::Result<Self> {
            let d = cfg.d_model;
            let blocks = (0..cfg.n_layers)
                .map(|i| Block::new(&cfg, i, &vb))
                .collect::<candle_core::Result<_>>()?;
            Ok(Transformer {
                cfg,
                embed: embedding(cfg.vocab, d, vb.pp("embed"))?,
                blocks,
                norm: vb.get(d, "norm.weight")?,
                head: linear_no_bias(d, cfg.vocab, vb.pp("head"))?,
            })
        };
        build().map_err(candle("Transformer::new"))
    }

    /// Mean next-token cross-entropy of `ids` (`[batch, seq_len + 1]` byte tokens, u32).
    pub fn loss(&self, ids: &Tensor) -> Result<Tensor> {
        self.loss_inner(ids).map_err(candle("Transformer::loss"))
    }

    fn loss_inner(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (inputs, targets) = split_ids(ids)?;
        let mut x = self.embed.forward(&inputs)?;
        let mask = causal_mask(inputs.dim(1)?, x.device())?.to_dtype(x.dtype())?;
        for b in &self.blocks {
            x = b.forward(&x, &mask, None)?;
        }
        head_loss(&self.cfg, &x, &self.norm, &self.head, &targets)
    }
}

/// The transformer as stages for the unit-by-unit runtime: the embedding (unit `root`), one
/// stage per layer (`layers.<i>`), then norm, head and loss (`root` again).
#[derive(Clone, Copy, Debug)]
pub struct TransformerStages(pub TransformerConfig);

impl Stages for TransformerStages {
    type Batch = Tensor;

    fn stage_units(&self) -> Vec<String> {
        let layers = (0..self.0.n_layers).map(|i| format!("layers.{i}"));
        std::iter::once("root".to_string())
            .chain(layers)
            .chain(std::iter::once("root".to_string()))
            .collect()
    }

    fn forward(
        &self,
        stage: usize,
        params: &UnitParams,
        x: Option<&Tensor>,
        ids: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let cfg = &self.0;
        let vb = params.vb();
        let (inputs, targets) = split_ids(ids)?;
        match (stage, x) {
            (0, _) => embedding(cfg.vocab, cfg.d_model, vb.pp("embed"))?.forward(&inputs),
            (s, Some(x)) if s <= cfg.n_layers => {
                let mask = causal_mask(inputs.dim(1)?, x.device())?.to_dtype(x.dtype())?;
                Block::new(cfg, s - 1, &vb)?.forward(x, &mask, Some(params))
            }
            (_, Some(x)) => {
                let head = linear_no_bias(cfg.d_model, cfg.vocab, vb.pp("head"))?;
                head_loss(cfg, x, params.get("norm.weight")?, &head, &targets)
            }
            (s, None) => Err(candle_core::Error::Msg(format!("stage {s} has no input"))),
        }
    }
}

fn causal_mask(t: usize, device: &Device) -> candle_core::Result<Tensor> {
    let m: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(m, (t, t), device)
}

/// Where the demo's training text lives: `data/corpus.txt` of this source tree (a frozen
/// snapshot of the project's own documentation). Read at run time, not embedded in the library.
pub const CORPUS_PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/corpus.txt");

/// The demo's training text ([`CORPUS_PATH`]), read once.
pub fn corpus() -> Result<&'static [u8]> {
    static TEXT: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    if let Some(t) = TEXT.get() {
        return Ok(t);
    }
    let text = std::fs::read(CORPUS_PATH)
        .map_err(|e| Error::io("read the demo corpus", CORPUS_PATH, e))?;
    if text.len() < 1024 {
        return Err(Error::BadInput {
            op: "demo corpus",
            what: CORPUS_PATH.into(),
            reason: format!("{} bytes; the demo needs at least 1024", text.len()),
        });
    }
    Ok(TEXT.get_or_init(|| text))
}

/// Token windows `[batch, seq_len + 1]` for global step `step`: rows `first..first + batch` of
/// a deterministic sequence of windows, so ranks can take disjoint slices of one global batch.
pub fn batch(
    corpus: &[u8],
    cfg: &TransformerConfig,
    step: usize,
    first: usize,
    rows: usize,
) -> Result<Tensor> {
    cfg.validate()?;
    let window = cfg.seq_len + 1;
    let span = corpus
        .len()
        .checked_sub(window)
        .filter(|&s| s > 0)
        .ok_or_else(|| Error::BadInput {
            op: "demo batch",
            what: "corpus".into(),
            reason: format!("{} bytes for windows of {window}", corpus.len()),
        })?;
    let mut ids = Vec::with_capacity(rows * window);
    for r in first..first + rows {
        let mut rng = SplitMix((step as u64) << 32 | r as u64);
        let start = (rng.next_u64() % span as u64) as usize;
        ids.extend(
            corpus[start..start + window]
                .iter()
                .map(|&b| b as u32 % cfg.vocab as u32),
        );
    }
    Tensor::from_vec(ids, (rows, window), &Device::Cpu).map_err(candle("batch"))
}

/// A model over ordinary (unsharded) variables, for references: the same names and values.
pub fn varbuilder_from(params: &[(String, Tensor)]) -> VarBuilder<'static> {
    let map = params.iter().cloned().collect();
    VarBuilder::from_tensors(map, DType::F32, &Device::Cpu)
}

/// What one training step measured on one rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Loss averaged over all ranks (the global batch's mean loss).
    pub loss: f32,
    /// Wall time of the whole step on this rank.
    pub seconds: f64,
    /// The sharding part of it: gathers, gradient reductions and the optimizer step.
    pub fsdp_seconds: f64,
    /// The forward and backward phases (whole-model mode: gathers and reductions only).
    pub phases: StageReport,
    /// The optimizer step.
    pub step_seconds: f64,
    /// Bytes copied outside collectives so far (0 on the ragged path).
    pub copied_bytes: u64,
}

/// Per-step reports and the final full parameters (by name) of one training run.
pub type TrainRun = (Vec<StepReport>, HashMap<String, Vec<f32>>);

/// How [`train_rank`] runs a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainMode {
    /// The FSDP rhythm: unit by unit ([`ShardedModel::forward_backward`]).
    UnitByUnit,
    /// Every unit gathered at once, the model built once ([`ShardedModel::unshard`]).
    WholeModel,
}

/// Where [`train_rank_with`] saves and resumes (all off by default).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Checkpointing {
    /// Root folder of the checkpoints (`step-N` folders).
    pub dir: Option<std::path::PathBuf>,
    /// Save every this many steps (and after the last); `0`: only after the last.
    pub save_every: usize,
    /// Keep the newest this many checkpoints (`0`: all).
    pub keep: usize,
    /// Resume from this checkpoint folder or root (its newest checkpoint).
    pub resume: Option<std::path::PathBuf>,
    /// Start from the parameter values of this safetensors file, or of the Hugging Face index
    /// of a checkpoint split over several ([`crate::fsdp::ShardedModel::load_safetensors`]);
    /// the optimizer starts fresh. Not with `resume` (which restores parameters too).
    pub init_from: Option<std::path::PathBuf>,
    /// Write the final parameters to this consolidated safetensors file.
    pub export: Option<std::path::PathBuf>,
}

/// The key under which [`train_rank_with`] records the global batch in its checkpoints.
pub const GLOBAL_BATCH: &str = "global_batch";

/// What [`train_rank_with`] returns.
#[derive(Clone, Debug)]
pub struct Trained {
    /// The final full parameters, by name.
    pub params: HashMap<String, Vec<f32>>,
    /// [`ShardedModel::param_digest`] of the final parameters.
    pub digest: String,
    /// The step this run started at (0, or where the resumed checkpoint was saved).
    pub first_step: usize,
    /// [`ShardedModel::optimizer_events`] at the end (over every rank).
    pub optimizer_events: Vec<(&'static str, u64)>,
    /// A resumed run's settings that differ from its checkpoint's
    /// ([`crate::checkpoint::Loaded::changed_settings`], then the global batch).
    pub changed_settings: Vec<String>,
    /// Checkpoints of later steps its saves moved aside ([`crate::checkpoint::Saved::set_aside`]).
    pub set_aside: Vec<std::path::PathBuf>,
    /// Under [`Checkpointing::init_from`], the file's tensors the model does not have
    /// ([`ShardedModel::load_safetensors`]'s answer; empty otherwise).
    pub unused_tensors: Vec<String>,
}

/// Trains the transformer for `steps` steps on one rank of `comm`: each rank takes its
/// `global_batch / V` rows of every global batch; gradients are averaged over ranks. Returns
/// the per-step reports and the final full parameters. `on_step` sees every report (progress).
#[allow(clippy::too_many_arguments)]
pub fn train_rank<O: CheckpointState>(
    cfg: TransformerConfig,
    params: &[(String, Tensor)],
    optimizer: O,
    comm: &dyn Communicator,
    opts: FsdpOptions,
    mode: TrainMode,
    steps: usize,
    global_batch: usize,
    mut on_step: impl FnMut(usize, &StepReport),
) -> Result<TrainRun> {
    let job = (cfg, mode, steps, global_batch);
    let none = Checkpointing::default();
    let mut reports = Vec::new();
    let record = |step: usize, report: &StepReport| {
        on_step(step, report);
        reports.push(*report);
    };
    let t = train_rank_with(params, optimizer, comm, opts, job, &none, record)?;
    Ok((reports, t.params))
}

/// [`train_rank`] with checkpoints, keeping no reports (`on_step` sees each, and keeps what
/// its caller wants: a run of a million steps would otherwise hold a million): resumes from
/// [`Checkpointing::resume`] (the steps already taken are not run again; batches follow the
/// step number, so a resumed run sees what an uninterrupted one would), saves every [`Checkpointing::save_every`] steps and after the
/// last (a fresh run of 0 steps saves its initial state), recording the global batch
/// ([`GLOBAL_BATCH`]; a resume at another is allowed and listed in
/// [`Trained::changed_settings`]), and exports at the end. `job` is
/// `(cfg, mode, steps, global_batch)`.
pub fn train_rank_with<O: CheckpointState>(
    params: &[(String, Tensor)],
    optimizer: O,
    comm: &dyn Communicator,
    opts: FsdpOptions,
    job: (TransformerConfig, TrainMode, usize, usize),
    ckpt: &Checkpointing,
    mut on_step: impl FnMut(usize, &StepReport),
) -> Result<Trained> {
    let (cfg, mode, steps, global_batch) = job;
    let rows = crate::limits::even_share(
        "train_rank",
        "a global batch of",
        global_batch,
        comm.world_size(),
    )?;
    // Before the training it would otherwise end (rank 0 writes the export).
    if let (Some(out), 0) = (&ckpt.export, comm.rank()) {
        use crate::checkpoint::safetensors::{check_export_not_input, check_export_target};
        check_export_target(out)?;
        if let Some(input) = &ckpt.init_from {
            check_export_not_input(out, input)?;
        }
    }
    if let Some(dir) = &ckpt.dir {
        check_checkpoint_dir(dir, ckpt.resume.as_deref(), comm.rank())?;
    }
    let mut sharded = fully_shard(params, optimizer, comm, opts)?;
    let (mut changed_settings, mut unused_tensors) = (Vec::new(), Vec::new());
    match (&ckpt.resume, &ckpt.init_from) {
        (Some(_), Some(_)) => {
            return Err(crate::Error::BadInput {
                op: "train_rank_with",
                what: "Checkpointing".into(),
                reason: "resume and init_from both set: a resumed run restores its parameters"
                    .into(),
            })
        }
        (Some(from), None) => {
            let loaded = sharded.load(from)?;
            changed_settings = loaded.changed_settings;
            let now = global_batch.to_string();
            // Batches follow the step at any size, so a new size is allowed (a ramp), and said.
            match loaded.metadata.get(GLOBAL_BATCH) {
                Some(saved) if *saved != now => {
                    changed_settings.push(format!("{GLOBAL_BATCH}: {saved} → {now}"))
                }
                _ => {}
            }
        }
        (None, Some(file)) => unused_tensors = sharded.load_safetensors(file)?,
        (None, None) => {}
    }
    // Steps taken and steps skipped each consumed a batch.
    let first_step = sharded
        .steps_taken()
        .checked_add(sharded.skipped_steps())
        .ok_or_else(|| crate::Error::BadInput {
            op: "train_rank_with",
            what: "step count".into(),
            reason: "steps taken plus steps skipped overflow".into(),
        })?;
    check_resumable(first_step, steps)?;
    let save = SaveOptions {
        keep: ckpt.keep,
        metadata: [(GLOBAL_BATCH.to_string(), global_batch.to_string())].into(),
        ..SaveOptions::default()
    };
    let mut set_aside = Vec::new();
    // A fresh run of no steps saves its initial state (what `--steps 0` is for).
    if let (Some(dir), 0, None) = (&ckpt.dir, steps, &ckpt.resume) {
        set_aside = sharded.save(dir, &save)?.set_aside;
    }
    let mut whole: Option<Transformer> = None;
    let stages = TransformerStages(cfg);
    for step in first_step..steps {
        let start = Instant::now();
        let ids = batch(corpus()?, &cfg, step, comm.rank() * rows, rows)?;
        // The batch goes where the parameters live.
        let ids = match params.first() {
            Some((_, t)) if !t.device().is_cpu() => {
                ids.to_device(t.device()).map_err(candle("batch"))?
            }
            _ => ids,
        };
        let phases = match mode {
            TrainMode::UnitByUnit => sharded.forward_backward(&stages, &ids)?,
            TrainMode::WholeModel => whole_model_step(&mut sharded, &mut whole, cfg, &ids)?,
        };
        let step_start = Instant::now();
        sharded.step()?;
        let step_seconds = step_start.elapsed().as_secs_f64();
        let mut l = [phases.loss];
        comm.all_reduce(BufMut::F32(&mut l), ReduceOp::Avg)?;
        let report = StepReport {
            loss: l[0],
            seconds: start.elapsed().as_secs_f64(),
            fsdp_seconds: phases.gather_seconds + phases.reduce_seconds + step_seconds,
            phases,
            step_seconds,
            copied_bytes: sharded.stats().copied(),
        };
        on_step(step, &report);
        let due = ckpt.save_every > 0 && (step + 1) % ckpt.save_every == 0;
        if let (Some(dir), true) = (&ckpt.dir, due || step + 1 == steps) {
            set_aside.extend(sharded.save(dir, &save)?.set_aside);
        }
    }
    if let Some(path) = &ckpt.export {
        sharded.export_safetensors(path)?;
    }
    Ok(Trained {
        params: sharded.full_params()?,
        digest: sharded.param_digest()?,
        first_step,
        optimizer_events: sharded.optimizer_events()?,
        changed_settings,
        set_aside,
        unused_tensors,
    })
}

/// `Err` when a resumed checkpoint has consumed more than `steps` batches (`batches`, steps
/// taken and skipped): nothing would run, and the result would be the checkpoint's, not
/// `steps` steps'. A program may call it before it starts (`examples/train.rs` reads the
/// manifest first); [`train_rank_with`] calls it after its load.
pub fn check_resumable(batches: usize, steps: usize) -> Result<()> {
    if batches <= steps {
        return Ok(());
    }
    Err(Error::BadInput {
        op: "train_rank_with",
        what: format!("{steps} steps"),
        reason: format!(
            "the resumed checkpoint is already past them ({batches} batches consumed): ask for \
             at least {batches} steps"
        ),
    })
}

/// `Err` unless a run may save into `dir`: writable (found now, not at the first save), and
/// holding no checkpoints unless the run resumes from one of them. A root holds one run's
/// line: a fresh run's saves would mix with another run's steps there, and rotation or the
/// move of later steps aside would treat that run's checkpoints as its own.
fn check_checkpoint_dir(
    dir: &std::path::Path,
    resume: Option<&std::path::Path>,
    rank: usize,
) -> Result<()> {
    use crate::checkpoint::fs;
    fs::check_writable(dir, rank)?;
    let held = fs::list(dir)?;
    let Some((newest, _)) = held.last() else {
        return Ok(());
    };
    let inside = |from: &std::path::Path| {
        let (from, dir) = (std::fs::canonicalize(from), std::fs::canonicalize(dir));
        matches!((from, dir), (Ok(f), Ok(d)) if f.starts_with(&d))
    };
    if resume.is_some_and(inside) {
        return Ok(());
    }
    Err(Error::Checkpoint {
        path: dir.display().to_string(),
        reason: format!(
            "it holds checkpoints of another run ({} of them, the newest of step {newest}): \
             resume from it to continue that run, or save into another folder",
            held.len()
        ),
    })
}

/// One forward and backward in whole-model mode: the model is built from the first gather's
/// tensors and reused; later gathers rewrite them in place.
fn whole_model_step<O: Optimizer>(
    sharded: &mut ShardedModel<'_, O>,
    model: &mut Option<Transformer>,
    cfg: TransformerConfig,
    ids: &Tensor,
) -> Result<StageReport> {
    let start = Instant::now();
    let tensors = sharded.unshard()?;
    let gather_seconds = start.elapsed().as_secs_f64();
    if model.is_none() {
        let first = tensors.values().next();
        let dtype = first.map_or(DType::F32, |t| t.dtype());
        let device = first.map_or(Device::Cpu, |t| t.device().clone());
        let vb = VarBuilder::from_tensors(tensors, dtype, &device);
        *model = Some(Transformer::new(cfg, vb)?);
    }
    let compute = Instant::now();
    let loss = model.as_ref().expect("built above").loss(ids)?;
    let forward_seconds = compute.elapsed().as_secs_f64();
    let backward = Instant::now();
    loss.backward().map_err(candle("backward"))?;
    let backward_seconds = backward.elapsed().as_secs_f64();
    let reduce = Instant::now();
    sharded.reduce_gradients()?;
    let loss = loss.to_dtype(DType::F32).and_then(|l| l.to_scalar::<f32>());
    let loss = loss.map_err(candle("loss"))?;
    sharded.note_loss(loss);
    Ok(StageReport {
        loss,
        gather_seconds,
        forward_seconds,
        backward_seconds,
        reduce_seconds: reduce.elapsed().as_secs_f64(),
        overlapped_seconds: 0.0,
    })
}

/// A stack of MLP blocks, `Linear(width → hidden)`, GELU, `Linear(hidden → width)`, no bias:
/// the training-step benchmark's model (transformer-sized layers without attention), trained
/// to regress random targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpConfig {
    pub width: usize,
    pub hidden: usize,
    pub layers: usize,
}

impl MlpConfig {
    /// 8 blocks of width 1024 and hidden 4096: 67 M parameters.
    pub const BENCH: MlpConfig = MlpConfig {
        width: 1024,
        hidden: 4096,
        layers: 8,
    };

    /// Every parameter's name and shape (`layers.<i>.up.weight`, `layers.<i>.down.weight`).
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        (0..self.layers)
            .flat_map(|i| {
                [
                    (
                        format!("layers.{i}.up.weight"),
                        vec![self.hidden, self.width],
                    ),
                    (
                        format!("layers.{i}.down.weight"),
                        vec![self.width, self.hidden],
                    ),
                ]
            })
            .collect()
    }

    /// Seeded values uniform in `±1/√fan_in`.
    pub fn init_params(&self, seed: u64) -> Result<Vec<(String, Tensor)>> {
        let mut rng = SplitMix(seed);
        self.param_shapes()
            .into_iter()
            .map(|(name, shape)| {
                let bound = 1.0 / (shape[1] as f32).sqrt();
                let values: Vec<f32> = (0..shape[0] * shape[1])
                    .map(|_| bound * rng.uniform())
                    .collect();
                let t = Tensor::from_vec(values, shape.as_slice(), &Device::Cpu)
                    .map_err(candle("MlpConfig::init_params"))?;
                Ok((name, t))
            })
            .collect()
    }

    /// Seeded inputs and targets, `[rows, width]` each.
    pub fn batch(&self, step: usize, rows: usize) -> Result<MlpBatch> {
        let mut rng = SplitMix(0x5EED ^ step as u64);
        let mut take = || -> Result<Tensor> {
            let v: Vec<f32> = (0..rows * self.width).map(|_| rng.uniform()).collect();
            Tensor::from_vec(v, (rows, self.width), &Device::Cpu)
                .map_err(candle("MlpConfig::batch"))
        };
        Ok(MlpBatch {
            x: take()?,
            y: take()?,
        })
    }

    /// Block `i` on `x`, with its weights from `params` (names as [`Self::param_shapes`]).
    pub fn block(
        &self,
        i: usize,
        get: impl Fn(&str) -> candle_core::Result<Tensor>,
        x: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let (h, down) = self.hidden(i, get, x)?;
        Linear::new(down, None).forward(&h)
    }

    /// Block `i`'s hidden activations on `x`, and its down projection's weight.
    fn hidden(
        &self,
        i: usize,
        get: impl Fn(&str) -> candle_core::Result<Tensor>,
        x: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let up = Linear::new(get(&format!("layers.{i}.up.weight"))?, None);
        let h = up.forward(x)?.gelu()?;
        Ok((h, get(&format!("layers.{i}.down.weight"))?))
    }

    /// Mean squared error of the output against the targets.
    pub fn loss(out: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        (out - y)?.sqr()?.mean_all()
    }
}

/// Inputs and regression targets of the MLP stack.
pub struct MlpBatch {
    pub x: Tensor,
    pub y: Tensor,
}

/// The MLP stack as stages: one per block (unit `layers.<i>`), the loss in the last.
#[derive(Clone, Copy, Debug)]
pub struct MlpStages(pub MlpConfig);

impl Stages for MlpStages {
    type Batch = MlpBatch;

    fn stage_units(&self) -> Vec<String> {
        (0..self.0.layers).map(|i| format!("layers.{i}")).collect()
    }

    fn forward(
        &self,
        stage: usize,
        params: &UnitParams,
        x: Option<&Tensor>,
        batch: &MlpBatch,
    ) -> candle_core::Result<Tensor> {
        let (h, down) = self
            .0
            .hidden(stage, |n| params.get(n).cloned(), x.unwrap_or(&batch.x))?;
        // The block's output is the stage's: recomputation may skip its value.
        let out = params.output_linear(&h, &down)?;
        if stage + 1 == self.0.layers {
            MlpConfig::loss(&out, &batch.y)
        } else {
            Ok(out)
        }
    }
}

/// `println!` that returns `ragged::Result<()>` instead of panicking when stdout fails: for
/// programs ([`print_stdout`]).
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::demo::print_stdout(&format!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes `text` to standard output and flushes it (an unflushed tail would be written at
/// exit, where its error could no longer be reported): `Err` when stdout fails (a full disk,
/// `>/dev/full`), where `println!` panics. A reader that went away (`train | head`) is not an
/// error: the output is dropped and the program goes on (a training run to its checkpoints and
/// export), unless the program restored SIGPIPE ([`end_quietly_when_stdout_closes`]).
pub fn print_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::io("print", "-", e)),
        _ => Ok(()),
    }
}

/// Makes this process end quietly when the reader of its stdout goes away (`train | head`), as
/// other command-line tools do: Rust ignores SIGPIPE, so a `println!` after that panicked (in a
/// rank's thread, reported as that rank failing). For programs (the `ragged` CLI, the
/// examples), at the start of `main`.
pub fn end_quietly_when_stdout_closes() {
    // SAFETY: restoring a signal's default disposition has no preconditions; at the start of
    // `main` no other thread can be relying on SIGPIPE being ignored.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
