//! `ragged validate`: the numerics contract checked on a user's model. Every FSDP unit of the
//! model is stepped with seeded gradients on thread ranks at each world size and layout, and
//! every parameter is compared with the unsharded run (the contract: bitwise equal) and, where
//! an independent f64 reference exists, with it (the README's tolerance).
//!
//! | check | what | breach |
//! |---|---|---|
//! | sharded vs unsharded | per parameter: bitwise, max ulp, max abs and relative error | any bit differs |
//! | f64 reference (AdamW; Muon; Shampoo) | the final parameters of [`crate::validate_f64`]'s f64 Adam / Muon / Shampoo on the same inputs | AdamW: relative error above [`ADAMW_F64_RTOL`] per step; Muon matrices: absolute error above `lr·scale·5e-4` per step (+ f32 rounding of `p`) with f32 Newton–Schulz, the update's relative Frobenius error above [`MUON_BF16_UPDATE_RTOL`] with bf16; Shampoo (run again with `ε` = [`SHAMPOO_REFERENCE_EPSILON`] for this check): the update's relative Frobenius error above [`SHAMPOO_UPDATE_RTOL`] |
//! | mesh invariance (`--mesh-invariance`) | every state field in global order (the checkpoint's form: Adam's moments, 8-bit codes and scales, Muon's momentum, Shampoo's factors) | any bit differs from the unsharded state |
//!
//! A layout that an optimizer refuses (8-bit Adam on FSDP2's element cuts, which would split
//! its scale blocks) is reported as refused, not as a breach: the optimizer returned `Err`
//! before touching anything, which is the contract's answer to such a layout.

use ragged::checkpoint::state::check_fields;
use ragged::checkpoint::{CheckpointState, FieldLayout, FieldSpan};
use ragged::comm::threads::{ThreadWorld, MAX_THREAD_RANKS};
use ragged::comm::{Communicator, SingleRank};
use ragged::demo::SplitMix;
use ragged::fsdp::fsdp2::Fsdp2Unit;
use ragged::model::{TensorSpec, Unit};
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::PlanOptions;
use ragged::{Error, Result};

use crate::bench::{muon_config, shampoo_config, OptimKind};
use crate::validate_f64::{adamw_f64, muon_f64, shampoo_f64};
use crate::{
    Adam8bit, Adam8bitConfig, AdamW, AdamWConfig, Muon, NsPrecision, Shampoo, ShampooConfig,
};

/// Tolerance of AdamW's final parameters against the f64 Adam, per step, relative to the
/// tensor's largest magnitude (initial or final): torch's f32 order rounds ≲ 4.2 units of
/// `2⁻²⁴` of `|p|` per element and step (`adamw_tests.rs`' derivation), and `1e-6` leaves a
/// factor ~4. The gradients do not depend on the parameters, so the errors add up without
/// growing. Relative to the tensor's scale, not to each element: over a long run an element
/// can pass through 0, where its own relative error means nothing.
pub const ADAMW_F64_RTOL: f64 = 1e-6;

/// Tolerance of a Muon matrix's update with bf16 Newton–Schulz against the f64 Muon, as a
/// relative Frobenius error `‖p − p_f64‖ / ‖p_f64 − p₀‖`. Observed at most 1.6e-2 (Gram
/// Newton–Schulz; torch's standard iteration 8.8e-3) on `llama3_8b`, `gpt_oss_20b` and
/// `deepseek_v3_671b` at `--scale 8` and `32`, 3 steps (AMX Xeon, session 35); against the
/// same runs an f64 Muon with its learning rate 5 % off errs 4.7e-2, with one Newton–Schulz
/// step fewer 3.4e-2, with the quintic's `a` 5 % off 0.14: this bound tells them apart.
pub const MUON_BF16_UPDATE_RTOL: f64 = 2.5e-2;

/// `ε` of the Shampoo that `validate` compares with the f64 Shampoo (the sharded checks run
/// fb's `1e-12`). Its seeded factors are rank-deficient wherever `steps` gradients cannot span
/// a side (a 1-D weight of 256 elements: `R` of rank 3 after 3 steps; a block of 80 rows: `R`
/// of rank 240 of 256). With `ε = 1e-12` the roots amplify the `f32` eigendecomposition's
/// errors in those near-null directions by up to `ε^(−e)` = 10⁶, as they would for any `f32`
/// solver, and the update's error reached 0.7 on `llama3_8b` at `--scale 16` (session 54):
/// that compares solvers' noise, not formulas. At `1e-2`, small against the factors' largest
/// eigenvalues (hundreds, from unit gradients), every root is well conditioned.
pub const SHAMPOO_REFERENCE_EPSILON: f64 = 1e-2;

/// Tolerance of a Shampoo parameter's update against the f64 Shampoo, as a relative Frobenius
/// error `‖p − p_f64‖ / ‖p_f64 − p₀‖`, with `ε` = [`SHAMPOO_REFERENCE_EPSILON`]. Observed at
/// most 3.2e-5 on `llama3_8b` (`--scale 16`, 3 and 6 steps), `gpt_oss_20b` and
/// `deepseek_v3_671b` (`--scale 32`), two units each, on an AVX-512 Zen 4 (session 54).
/// Against the same runs an f64 Shampoo with its learning rate 1 % off errs 9.9e-3, with the
/// root exponent 5 % off up to 2.8e-2, with `ε` doubled up to 7e-3, with the grafting scale
/// `1 + 10⁻³·rows` off up to 0.26, and without the filtered gradient's bias correction 4.8:
/// this bound, 10× the observed, tells each of them apart.
pub const SHAMPOO_UPDATE_RTOL: f64 = 3e-4;

/// The layouts `--layouts` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutKind {
    /// The optimizer's own plan ([`Optimizer::plan_unit`]: its atomic blocks, Muon's cost model).
    Ragged,
    /// FSDP2's `Shard(0)` layout (row cuts at `⌈rows / world⌉`, whatever the optimizer needs).
    Fsdp2,
}

impl std::str::FromStr for LayoutKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "ragged" => Ok(LayoutKind::Ragged),
            "fsdp2" => Ok(LayoutKind::Fsdp2),
            _ => Err(Error::BadInput {
                op: "LayoutKind::from_str",
                what: s.into(),
                reason: "expected ragged or fsdp2".into(),
            }),
        }
    }
}

impl LayoutKind {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            LayoutKind::Ragged => "ragged",
            LayoutKind::Fsdp2 => "fsdp2",
        }
    }
}

/// What to validate.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidateConfig {
    pub optimizer: OptimKind,
    pub worlds: Vec<usize>,
    pub layouts: Vec<LayoutKind>,
    pub steps: usize,
    pub seed: u64,
    /// Also compare every field of the optimizer's state, in global order, with the unsharded
    /// run's: the same bits at every world size and layout.
    pub mesh_invariance: bool,
}

/// Sharded against unsharded, one parameter at one world size and layout.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamCheck {
    pub layout: LayoutKind,
    pub world: usize,
    pub name: String,
    pub bitwise: bool,
    pub max_ulp: u64,
    pub max_abs: f64,
    pub max_rel: f64,
}

/// Against the f64 reference, one parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceCheck {
    pub name: String,
    pub max_abs: f64,
    pub max_rel: f64,
    /// The bound, on `max_rel` or (when `absolute`) on `max_abs`.
    pub tolerance: f64,
    pub absolute: bool,
}

impl ReferenceCheck {
    /// Within the tolerance (a NaN error fails).
    pub fn passes(&self) -> bool {
        let err = if self.absolute {
            self.max_abs
        } else {
            self.max_rel
        };
        err <= self.tolerance
    }
}

/// An optimizer state in global order against the unsharded run's, one unit at one world size
/// and layout (`--mesh-invariance`).
#[derive(Clone, Debug, PartialEq)]
pub struct MeshCheck {
    pub unit: String,
    pub layout: LayoutKind,
    pub world: usize,
    /// `field of parameter` for each array whose bits differ (empty: the same bits).
    pub differs: Vec<String>,
}

/// The whole run: every check, and the layouts an optimizer refused.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ValidateReport {
    pub sharded: Vec<ParamCheck>,
    pub reference: Vec<ReferenceCheck>,
    /// `None` where no f64 reference exists for the optimizer.
    pub reference_note: Option<String>,
    /// The optimizer state against the unsharded state, per unit, layout and world.
    pub mesh: Vec<MeshCheck>,
    /// `(layout, world, reason)`.
    pub refused: Vec<(LayoutKind, usize, String)>,
}

impl ValidateReport {
    /// Number of breaches of the numerics contract.
    pub fn breaches(&self) -> usize {
        self.sharded.iter().filter(|c| !c.bitwise).count()
            + self.reference.iter().filter(|c| !c.passes()).count()
            + self.mesh.iter().filter(|m| !m.differs.is_empty()).count()
    }
}

/// Every dimension of `tensors` divided by `scale` (rounded up; `scale = 1` keeps them).
pub fn scaled(tensors: &[TensorSpec], scale: usize) -> Result<Vec<TensorSpec>> {
    if scale == 0 {
        return Err(Error::BadInput {
            op: "validate::scaled",
            what: "--scale 0".into(),
            reason: "the scale divides every dimension; use 1 or more".into(),
        });
    }
    tensors
        .iter()
        .map(|t| {
            let shape: Vec<usize> = t.shape.iter().map(|&d| d.div_ceil(scale)).collect();
            TensorSpec::new(t.name.clone(), &shape, t.dtype)
        })
        .collect()
}

/// Sharded against unsharded (and, with `cfg.mesh_invariance`, the state too) for any
/// checkpointable optimizer (`cfg.optimizer` is not consulted; no f64 reference): what
/// [`validate`] runs for each optimizer, open to optimizers of other crates.
pub fn validate_with<O: CheckpointState>(
    opt: &O,
    units: &[Unit],
    cfg: &ValidateConfig,
) -> Result<ValidateReport> {
    check_config(cfg)?;
    check_units(units, cfg)?;
    let mut report = ValidateReport::default();
    for u in units {
        validate_unit(opt, u, cfg, &mut report)?;
    }
    Ok(report)
}

/// Validates `cfg.optimizer` on every unit of `units`.
pub fn validate(units: &[Unit], cfg: &ValidateConfig) -> Result<ValidateReport> {
    check_config(cfg)?;
    check_units(units, cfg)?;
    let mut report = ValidateReport::default();
    let adam = AdamWConfig::default();
    match cfg.optimizer {
        OptimKind::AdamW => {
            for u in units {
                validate_unit(&AdamW::new(adam)?, u, cfg, &mut report)?;
                adamw_reference(&adam, u, cfg, &mut report)?;
            }
        }
        OptimKind::Adam8bit => {
            let opt = Adam8bit::new(Adam8bitConfig::default())?;
            for u in units {
                validate_unit(&opt, u, cfg, &mut report)?;
            }
            report.reference_note = Some(
                "adam8bit: the f64 reference with exact codes is adam8bit_tests.rs' (not run here)"
                    .into(),
            );
        }
        OptimKind::Muon | OptimKind::MuonBf16 => {
            let precision = if cfg.optimizer == OptimKind::Muon {
                NsPrecision::F32
            } else {
                NsPrecision::Bf16
            };
            let opt = Muon::new(muon_config(precision))?;
            for u in units {
                validate_unit(&opt, u, cfg, &mut report)?;
                muon_reference(&opt, u, cfg, &mut report)?;
            }
        }
        OptimKind::Shampoo => {
            let opt = Shampoo::new(shampoo_config())?;
            for u in units {
                validate_unit(&opt, u, cfg, &mut report)?;
                shampoo_reference(&opt, u, cfg, &mut report)?;
            }
        }
    }
    Ok(report)
}

/// `Err` for a config [`validate`] refuses (no world or a world of 0, a world or layout
/// listed twice, no layout, no step, ...), before any work: what a caller checks before
/// printing a header.
pub fn check_config(cfg: &ValidateConfig) -> Result<()> {
    let bad = |what: String, reason: &str| {
        Err(Error::BadInput {
            op: "validate",
            what,
            reason: reason.into(),
        })
    };
    if cfg.worlds.is_empty() || cfg.worlds.contains(&0) {
        return bad(
            format!("worlds {:?}", cfg.worlds),
            "needs one or more world sizes, each ≥ 1",
        );
    }
    // Every world runs as thread ranks, each with its own copy of the units' data: refused
    // here, before any of it is built, not by `ThreadWorld` after.
    if let Some(w) = cfg.worlds.iter().find(|&&w| w > MAX_THREAD_RANKS) {
        return bad(
            format!("worlds {:?}", cfg.worlds),
            &format!("world {w} is more than {MAX_THREAD_RANKS} thread ranks (one process)"),
        );
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(w) = cfg.worlds.iter().find(|&&w| !seen.insert(w)) {
        return bad(
            format!("worlds {:?}", cfg.worlds),
            &format!("world {w} is listed twice (each world runs once)"),
        );
    }
    if cfg.layouts.is_empty() {
        return bad("no layouts".into(), "name at least one of ragged, fsdp2");
    }
    let names: Vec<&str> = cfg.layouts.iter().map(|l| l.name()).collect();
    if let Some(i) = (1..names.len()).find(|&i| names[..i].contains(&names[i])) {
        return bad(
            format!("layouts {}", names.join(",")),
            &format!(
                "layout {} is listed twice (each layout runs once)",
                names[i]
            ),
        );
    }
    if cfg.steps == 0 {
        return bad("--steps 0".into(), "needs at least one step");
    }
    Ok(())
}

/// `Err` when there is nothing to check (no unit holds a tensor: a report of 0 checks would
/// read as a pass), or when the largest unit's inputs and runs cannot fit in the memory
/// available now.
/// A unit holds its seeded inputs (`steps + 1` f32 values per element) while it runs: the
/// estimate adds 96 bytes per element for the runs' parameters and state (f32 unsharded and
/// sharded, f64 reference), so it is a floor, and a model too big for this machine (a full
/// preset at `--steps 100000`) is refused before anything is allocated.
fn check_units(units: &[Unit], cfg: &ValidateConfig) -> Result<()> {
    const OP: &str = "validate";
    if units.iter().all(|u| u.tensors.is_empty()) {
        return Err(Error::BadInput {
            op: OP,
            what: format!("{} units", units.len()),
            reason: "no tensors to validate (--units 0, or a model without float tensors)".into(),
        });
    }
    // Saturating: a count near usize::MAX overflows the product below, which says so.
    let per_element = cfg
        .steps
        .saturating_add(1)
        .saturating_mul(4)
        .saturating_add(96);
    for u in units {
        let numel = u.tensors.iter().map(|t| t.numel()).sum::<usize>();
        let what = format!("unit {} at --steps {}", u.name, cfg.steps);
        let bytes = ragged::limits::checked_product(OP, &what, &[per_element, numel])?;
        ragged::limits::fits_in_memory(OP, &what, bytes)?;
    }
    Ok(())
}

/// Seeded inputs of one unit: initial parameters and every step's gradients, uniform in
/// `[0.5, 1.5)` with a random sign and `[-1, 1)`.
fn inputs(unit: &Unit, steps: usize, seed: u64) -> (Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>) {
    let mut rng = SplitMix(seed ^ fnv(&unit.name));
    let p0 = unit
        .tensors
        .iter()
        .map(|t| {
            (0..t.numel())
                .map(|_| {
                    let u = rng.uniform();
                    (0.5 + u.abs()).copysign(u)
                })
                .collect()
        })
        .collect();
    let grads = (0..steps)
        .map(|_| {
            unit.tensors
                .iter()
                .map(|t| (0..t.numel()).map(|_| rng.uniform()).collect())
                .collect()
        })
        .collect();
    (p0, grads)
}

/// FNV-1a of a name, so every unit gets its own stream from one seed.
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Every rank's shard of `unit` at `world` in `layout`.
fn shards<O: Optimizer>(
    opt: &O,
    unit: &Unit,
    world: usize,
    layout: LayoutKind,
) -> Result<Vec<LocalShard>> {
    match layout {
        LayoutKind::Ragged => {
            let plan = opt.plan_unit(unit, world, &PlanOptions::default())?;
            (0..world)
                .map(|r| LocalShard::from_plan(&plan, r))
                .collect()
        }
        LayoutKind::Fsdp2 => (0..world)
            .map(|r| Ok(Fsdp2Unit::new(unit, world, r)?.local_shard(unit)))
            .collect(),
    }
}

/// Runs `opt` on `shards` (one thread rank each) from `p0` with `grads`: final local params
/// and states per rank.
fn run_ranks<O: Optimizer>(
    opt: &O,
    shards: &[LocalShard],
    p0: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
) -> Result<Vec<(Vec<f32>, O::State)>> {
    let rank = |shard: &LocalShard,
                comm: &dyn ragged::comm::Communicator|
     -> Result<(Vec<f32>, O::State)> {
        let mut p = shard.scatter(p0)?;
        let mut state = opt.init(shard)?;
        for g in grads {
            opt.step(
                &mut state,
                shard,
                (&mut p).into(),
                (&shard.scatter(g)?).into(),
                comm,
            )?;
        }
        Ok((p, state))
    };
    if shards.len() == 1 {
        return Ok(vec![rank(&shards[0], &SingleRank)?]);
    }
    ThreadWorld::run(shards.len(), |comm| rank(&shards[comm.rank()], comm))
}

/// Per state field: its name and each parameter's global array as little-endian bytes.
type GlobalState = Vec<(&'static str, Vec<Vec<u8>>)>;

/// A state's fields in global order (the checkpoint's form, which no world size or layout
/// changes): per field, its name and each parameter's global array as little-endian bytes,
/// put together from every rank's spans. `Err` unless the ranks hold every element of every
/// field exactly once, under the same field names.
fn global_state<O: CheckpointState>(
    opt: &O,
    shards: &[LocalShard],
    states: &[O::State],
) -> Result<GlobalState> {
    let layouts = shards
        .iter()
        .map(|s| opt.state_layout(s))
        .collect::<Result<Vec<_>>>()?;
    let data = states
        .iter()
        .map(|s| opt.state_data(s))
        .collect::<Result<Vec<_>>>()?;
    for (layout, data) in layouts.iter().zip(&data) {
        check_fields(OP_STATE, layout, data.iter().map(|d| (d.dtype(), d.len())))?;
    }
    let mut fields = Vec::new();
    for (f, first) in layouts[0].iter().enumerate() {
        let len = global_lengths(&layouts, f)?;
        let size = first.dtype.size();
        let mut bytes: Vec<Vec<u8>> = len.iter().map(|&n| vec![0; n * size]).collect();
        let mut held: Vec<Vec<bool>> = len.iter().map(|&n| vec![false; n]).collect();
        for (rank, (layout, data)) in layouts.iter().zip(&data).enumerate() {
            for span in &layout[f].spans {
                let (to, marks) =
                    span_targets(&mut bytes, &mut held, span, size).ok_or_else(|| {
                        state_error(format!(
                            "rank {rank}: {} span {span:?} is past its global array, or held twice",
                            first.name
                        ))
                    })?;
                marks.fill(true);
                data[f].with_bytes(span.local..span.local + span.global.len(), |b| {
                    to.copy_from_slice(b);
                    Ok(())
                })?;
            }
        }
        if let Some(p) = held.iter().position(|h| h.contains(&false)) {
            let reason = format!("no rank holds part of {} of parameter {p}", first.name);
            return Err(state_error(reason));
        }
        fields.push((first.name, bytes));
    }
    Ok(fields)
}

const OP_STATE: &str = "validate::global_state";

fn state_error(reason: String) -> Error {
    Error::InvalidShard {
        op: OP_STATE,
        reason,
    }
}

/// Field `f`'s global length per parameter: what the ranks holding part of it say (a rank
/// that holds none may say 0). `Err` if ranks name the fields differently or disagree.
fn global_lengths(layouts: &[Vec<FieldLayout>], f: usize) -> Result<Vec<usize>> {
    let first = &layouts[0][f];
    let mut len = vec![0; first.global_len.len()];
    for (rank, layout) in layouts.iter().enumerate() {
        let field = layout
            .get(f)
            .filter(|x| x.name == first.name && x.dtype == first.dtype)
            .filter(|x| x.global_len.len() == len.len())
            .ok_or_else(|| {
                state_error(format!("rank {rank}'s state fields differ from rank 0's"))
            })?;
        for (n, &m) in len.iter_mut().zip(&field.global_len) {
            if m != 0 && *n != 0 && m != *n {
                let reason = format!("ranks disagree on the length of {} ({n}, {m})", first.name);
                return Err(state_error(reason));
            }
            *n = (*n).max(m);
        }
    }
    Ok(len)
}

/// The bytes and the held-marks `span` covers, or `None` past the end or where some element
/// is held already.
fn span_targets<'a>(
    bytes: &'a mut [Vec<u8>],
    held: &'a mut [Vec<bool>],
    span: &FieldSpan,
    size: usize,
) -> Option<(&'a mut [u8], &'a mut [bool])> {
    let g = &span.global;
    let to = bytes
        .get_mut(span.param)?
        .get_mut(g.start * size..g.end * size)?;
    let marks = held.get_mut(span.param)?.get_mut(g.clone())?;
    (!marks.contains(&true)).then_some((to, marks))
}

/// The `field of parameter` names where `got` differs from `want` (empty: the same bits).
fn state_differences(unit: &Unit, got: &GlobalState, want: &GlobalState) -> Vec<String> {
    let names = |s: &GlobalState| s.iter().map(|f| f.0).collect::<Vec<_>>();
    if names(got) != names(want) {
        return vec![format!(
            "fields {:?} (unsharded: {:?})",
            names(got),
            names(want)
        )];
    }
    let mut differs = Vec::new();
    for ((name, g), (_, w)) in got.iter().zip(want) {
        for ((a, b), t) in g.iter().zip(w).zip(&unit.tensors) {
            if a != b {
                differs.push(format!("{name} of {}", t.name));
            }
        }
    }
    differs
}

/// The unsharded shard of `unit` with `opt`'s blocks.
fn unsharded<O: Optimizer>(opt: &O, unit: &Unit) -> Result<LocalShard> {
    LocalShard::unsharded(
        unit.tensors
            .iter()
            .map(|t| (t.name.as_str(), t.shape.as_slice())),
        &|name, shape| opt.atomic_block(name, shape),
    )
}

/// The sharded run at one world and layout, or `None` (recorded as refused) when the layout
/// or the optimizer refuses.
#[allow(clippy::type_complexity)]
fn sharded_run<O: Optimizer>(
    opt: &O,
    unit: &Unit,
    world: usize,
    layout: LayoutKind,
    p0: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
    report: &mut ValidateReport,
) -> Result<Option<(Vec<LocalShard>, Vec<(Vec<f32>, O::State)>)>> {
    let refuse = |report: &mut ValidateReport, e: Error| {
        report
            .refused
            .push((layout, world, format!("{}: {e}", unit.name)));
    };
    let sh = match shards(opt, unit, world, layout) {
        Ok(s) => s,
        Err(e) => {
            refuse(report, e);
            return Ok(None);
        }
    };
    match run_ranks(opt, &sh, p0, grads) {
        Ok(got) => Ok(Some((sh, got))),
        Err(
            e @ (Error::InvalidShard { .. } | Error::BlockSplit { .. } | Error::Infeasible { .. }),
        ) => {
            refuse(report, e);
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Sharded against unsharded for one optimizer on one unit: the parameters, and with
/// `cfg.mesh_invariance` every state field in global order.
fn validate_unit<O: CheckpointState>(
    opt: &O,
    unit: &Unit,
    cfg: &ValidateConfig,
    report: &mut ValidateReport,
) -> Result<()> {
    let (p0, grads) = inputs(unit, cfg.steps, cfg.seed);
    let whole = vec![unsharded(opt, unit)?];
    let (base_p, base_s): (Vec<_>, Vec<_>) =
        run_ranks(opt, &whole, &p0, &grads)?.into_iter().unzip();
    let want_p = LocalShard::gather(&whole, &base_p)?;
    let want_s = match cfg.mesh_invariance {
        true => Some(global_state(opt, &whole, &base_s)?),
        false => None,
    };
    for &layout in &cfg.layouts {
        for &world in &cfg.worlds {
            let Some((sh, got)) = sharded_run(opt, unit, world, layout, &p0, &grads, report)?
            else {
                continue;
            };
            let (ps, ss): (Vec<_>, Vec<_>) = got.into_iter().unzip();
            let got_p = LocalShard::gather(&sh, &ps)?;
            compare(unit, layout, world, &got_p, &want_p, report);
            if let Some(want_s) = &want_s {
                let differs = state_differences(unit, &global_state(opt, &sh, &ss)?, want_s);
                report.mesh.push(MeshCheck {
                    unit: unit.name.clone(),
                    layout,
                    world,
                    differs,
                });
            }
        }
    }
    Ok(())
}

/// Distance in units in the last place between two `f32`s (`u64::MAX` when one is NaN and
/// the other is not).
fn ulps(a: f32, b: f32) -> u64 {
    if a.is_nan() || b.is_nan() {
        return if a.is_nan() && b.is_nan() {
            0
        } else {
            u64::MAX
        };
    }
    let key = |x: f32| {
        let b = x.to_bits() as i32;
        i64::from(if b < 0 { i32::MIN - b } else { b })
    };
    key(a).abs_diff(key(b))
}

fn compare(
    unit: &Unit,
    layout: LayoutKind,
    world: usize,
    got: &[Vec<f32>],
    want: &[Vec<f32>],
    report: &mut ValidateReport,
) {
    for ((t, g), w) in unit.tensors.iter().zip(got).zip(want) {
        let (mut ulp, mut abs, mut rel, mut bitwise) = (0u64, 0f64, 0f64, true);
        for (&a, &b) in g.iter().zip(w) {
            bitwise &= a.to_bits() == b.to_bits();
            ulp = ulp.max(ulps(a, b));
            let d = (f64::from(a) - f64::from(b)).abs();
            abs = abs.max(d);
            rel = rel.max(d / f64::from(b).abs().max(f64::MIN_POSITIVE));
        }
        report.sharded.push(ParamCheck {
            layout,
            world,
            name: t.name.clone(),
            bitwise,
            max_ulp: ulp,
            max_abs: abs,
            max_rel: rel,
        });
    }
}

/// An f32 Adam run against f64 from `p0`: the largest error relative to the tensor's largest
/// magnitude, against [`ADAMW_F64_RTOL`] per step.
fn adam_check(name: &str, got: &[f32], want: &[f64], p0: &[f32], steps: usize) -> ReferenceCheck {
    let (abs, _) = errors(got, want);
    let largest = want
        .iter()
        .map(|w| w.abs())
        .chain(p0.iter().map(|&p| f64::from(p).abs()))
        .fold(0.0, f64::max);
    ReferenceCheck {
        name: name.to_string(),
        max_abs: abs,
        max_rel: abs / largest,
        tolerance: ADAMW_F64_RTOL * steps as f64,
        absolute: false,
    }
}

/// Max absolute and relative error of `got` against `want`; NaN when any element's is (a
/// NaN result fails its check: `f64::max` would skip it), 0 relative where both are 0.
fn errors(got: &[f32], want: &[f64]) -> (f64, f64) {
    let worst = |a: f64, b: f64| {
        if a.is_nan() || b.is_nan() {
            f64::NAN
        } else {
            a.max(b)
        }
    };
    got.iter().zip(want).fold((0f64, 0f64), |(a, r), (&x, &w)| {
        let d = (f64::from(x) - w).abs();
        let rel = if d == 0.0 { 0.0 } else { d / w.abs() };
        (worst(a, d), worst(r, rel))
    })
}

/// The unsharded f32 run's final parameters of `unit`.
fn unsharded_result<O: Optimizer>(
    opt: &O,
    unit: &Unit,
    p0: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
) -> Result<Vec<Vec<f32>>> {
    let whole = vec![unsharded(opt, unit)?];
    let locals: Vec<Vec<f32>> = run_ranks(opt, &whole, p0, grads)?
        .into_iter()
        .map(|r| r.0)
        .collect();
    LocalShard::gather(&whole, &locals)
}

/// AdamW against [`adamw_f64`] on the same inputs.
fn adamw_reference(
    c: &AdamWConfig,
    unit: &Unit,
    cfg: &ValidateConfig,
    report: &mut ValidateReport,
) -> Result<()> {
    let (p0, grads) = inputs(unit, cfg.steps, cfg.seed);
    let got = unsharded_result(&AdamW::new(*c)?, unit, &p0, &grads)?;
    for (k, t) in unit.tensors.iter().enumerate() {
        let g: Vec<&[f32]> = grads.iter().map(|s| s[k].as_slice()).collect();
        let want = adamw_f64(c, c.decay_rule.decays(&t.shape), &p0[k], &g)?;
        report
            .reference
            .push(adam_check(&t.name, &got[k], &want, &p0[k], cfg.steps));
    }
    Ok(())
}

/// Muon (f32 Newton–Schulz) against [`muon_f64`]; its AdamW parameters against
/// [`adamw_f64`]. Muon's tolerance is the README's, absolute: per step `lr·scale·5e-4` (f32
/// Newton–Schulz within 5e-4 of f64, `muon_tests.rs`) plus `4·2⁻²⁴·max|p|` for the f32
/// roundings of the decay and the update.
fn muon_reference(
    opt: &Muon,
    unit: &Unit,
    cfg: &ValidateConfig,
    report: &mut ValidateReport,
) -> Result<()> {
    let c = opt.config();
    let (p0, grads) = inputs(unit, cfg.steps, cfg.seed);
    let got = unsharded_result(opt, unit, &p0, &grads)?;
    for (k, t) in unit.tensors.iter().enumerate() {
        let g: Vec<&[f32]> = grads.iter().map(|s| s[k].as_slice()).collect();
        if !opt.uses_muon(&t.name, &t.shape) {
            let want = adamw_f64(&c.adamw, c.adamw.decay_rule.decays(&t.shape), &p0[k], &g)?;
            report
                .reference
                .push(adam_check(&t.name, &got[k], &want, &p0[k], cfg.steps));
            continue;
        }
        let want = muon_f64(c, &t.name, &t.shape, &p0[k], &g)?;
        if c.ns.precision == NsPrecision::Bf16 {
            report
                .reference
                .push(update_check(&t.name, &got[k], &want, &p0[k]));
            continue;
        }
        let (_, rows, cols) = c.matrices_of(&t.name, &t.shape)?;
        let scale = c.lr * c.lr_scale.factor(rows, cols);
        let p_max = want.iter().fold(0f64, |a, w| a.max(w.abs()));
        let (abs, rel) = errors(&got[k], &want);
        report.reference.push(ReferenceCheck {
            name: t.name.clone(),
            max_abs: abs,
            max_rel: rel,
            tolerance: cfg.steps as f64 * (scale * 5e-4 + 4.0 * 2f64.powi(-24) * p_max),
            absolute: true,
        });
    }
    Ok(())
}

/// Shampoo against [`shampoo_f64`], every parameter, both with `ε` =
/// [`SHAMPOO_REFERENCE_EPSILON`]: [`update_error`] against [`SHAMPOO_UPDATE_RTOL`].
fn shampoo_reference(
    opt: &Shampoo,
    unit: &Unit,
    cfg: &ValidateConfig,
    report: &mut ValidateReport,
) -> Result<()> {
    let opt = &Shampoo::new(ShampooConfig {
        epsilon: SHAMPOO_REFERENCE_EPSILON,
        ..*opt.config()
    })?;
    let (p0, grads) = inputs(unit, cfg.steps, cfg.seed);
    let got = unsharded_result(opt, unit, &p0, &grads)?;
    for (k, t) in unit.tensors.iter().enumerate() {
        let g: Vec<&[f32]> = grads.iter().map(|s| s[k].as_slice()).collect();
        let want = shampoo_f64(opt.config(), &t.shape, &p0[k], &g)?;
        let (abs, _) = errors(&got[k], &want);
        report.reference.push(ReferenceCheck {
            name: t.name.clone(),
            max_abs: abs,
            max_rel: update_error(&got[k], &want, &p0[k]),
            tolerance: SHAMPOO_UPDATE_RTOL,
            absolute: false,
        });
    }
    Ok(())
}

/// A Muon matrix with bf16 Newton–Schulz against the f64 Muon: [`update_error`] against
/// [`MUON_BF16_UPDATE_RTOL`] (bf16 keeps 8 bits: per element its error is of the order of the
/// update's own rounding, so only the whole update's error is a sharp measure).
fn update_check(name: &str, got: &[f32], want: &[f64], p0: &[f32]) -> ReferenceCheck {
    let (abs, _) = errors(got, want);
    ReferenceCheck {
        name: name.to_string(),
        max_abs: abs,
        max_rel: update_error(got, want, p0),
        tolerance: MUON_BF16_UPDATE_RTOL,
        absolute: false,
    }
}

/// The relative Frobenius error of an update: `‖p − p_ref‖ / ‖p_ref − p₀‖` for final
/// parameters `got`, reference final parameters `want` and initial ones `p0`.
pub fn update_error(got: &[f32], want: &[f64], p0: &[f32]) -> f64 {
    let sq = |v: f64| v * v;
    let err: f64 = got
        .iter()
        .zip(want)
        .map(|(&x, &w)| sq(f64::from(x) - w))
        .sum();
    let update: f64 = want
        .iter()
        .zip(p0)
        .map(|(&w, &p)| sq(w - f64::from(p)))
        .sum();
    (err / update).sqrt()
}

/// The report as text: one line per parameter and check, then the verdict.
pub fn render(report: &ValidateReport) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "sharded vs unsharded (contract: bitwise)");
    let _ = writeln!(
        out,
        "{:<8} {:>5}  {:<48} {:>7} {:>8} {:>10} {:>10}",
        "layout", "world", "parameter", "bitwise", "max ulp", "max abs", "max rel"
    );
    for c in &report.sharded {
        let _ = writeln!(
            out,
            "{:<8} {:>5}  {:<48} {:>7} {:>8} {:>10.3e} {:>10.3e}",
            c.layout.name(),
            c.world,
            c.name,
            if c.bitwise { "yes" } else { "NO" },
            c.max_ulp,
            c.max_abs,
            c.max_rel
        );
    }
    if !report.reference.is_empty() {
        let _ = writeln!(out, "\nagainst the f64 reference");
        let _ = writeln!(
            out,
            "{:<48} {:>10} {:>10} {:>14} {:>6}",
            "parameter", "max abs", "max rel", "tolerance", "ok"
        );
        let _ = writeln!(
            out,
            "(AdamW's max rel: to the tensor's largest |p|, initial or final; with bf16 \
             Newton–Schulz a Muon matrix's, and Shampoo's (at ε = {SHAMPOO_REFERENCE_EPSILON:e}): \
             the update's relative Frobenius error)"
        );
        for c in &report.reference {
            let ok = if c.passes() { "yes" } else { "NO" };
            let kind = if c.absolute { "abs" } else { "rel" };
            let _ = writeln!(
                out,
                "{:<48} {:>10.3e} {:>10.3e} {:>10.1e} {kind} {:>6}",
                c.name, c.max_abs, c.max_rel, c.tolerance, ok
            );
        }
    }
    if let Some(note) = &report.reference_note {
        let _ = writeln!(out, "\nf64 reference: {note}");
    }
    if !report.mesh.is_empty() {
        let _ = writeln!(out, "\nmesh invariance (optimizer state bits vs unsharded)");
        for m in &report.mesh {
            let verdict = match m.differs.as_slice() {
                [] => "same bits".to_string(),
                d => format!("DIFFERENT: {}", d.join(", ")),
            };
            let _ = writeln!(
                out,
                "{:<8} {:>5}  {:<48} {verdict}",
                m.layout.name(),
                m.world,
                m.unit
            );
        }
    }
    render_refused(&mut out, &report.refused);
    let b = report.breaches();
    let _ = writeln!(
        out,
        "\n{} checks, {b} breaches of the numerics contract",
        report.sharded.len() + report.reference.len() + report.mesh.len()
    );
    out
}

/// The refused layouts, one line per layout and world: the first unit's reason in full, then
/// how many more units it refused (the same cause, named for each unit, repeated for every layer
/// of a model would bury the table).
fn render_refused(out: &mut String, refused: &[(LayoutKind, usize, String)]) {
    use std::fmt::Write;
    let mut groups: Vec<(LayoutKind, usize, &str, Vec<&str>)> = Vec::new();
    for (layout, world, why) in refused {
        let unit = why.split_once(':').map_or(why.as_str(), |(u, _)| u);
        match groups
            .iter_mut()
            .find(|(l, w, _, _)| l == layout && w == world)
        {
            Some(group) => group.3.push(unit),
            None => groups.push((*layout, *world, why, Vec::new())),
        }
    }
    for (layout, world, why, more) in groups {
        let _ = write!(out, "refused: {} at world {world}: {why}", layout.name());
        match more.as_slice() {
            [] => {}
            [one] => {
                let _ = write!(out, " (and unit {one})");
            }
            [first, .., last] => {
                let _ = write!(out, " (and {} more units, {first} to {last})", more.len());
            }
        }
        let _ = writeln!(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One line per refused layout and world, naming the first unit's reason and the count and
    /// range of the others; a layout refused at two worlds is two lines.
    #[test]
    fn refusals_are_one_line_per_layout_and_world() {
        let fsdp2 = LayoutKind::Fsdp2;
        let refused = [
            (fsdp2, 2, "layers.0: tile split at row 112".to_string()),
            (fsdp2, 2, "layers.1: tile split at row 112".to_string()),
            (fsdp2, 4, "layers.0: tile split at row 56".to_string()),
            (fsdp2, 2, "layers.2: tile split at row 112".to_string()),
        ];
        let mut out = String::new();
        render_refused(&mut out, &refused);
        assert_eq!(
            out,
            "refused: fsdp2 at world 2: layers.0: tile split at row 112 (and 2 more units, \
             layers.1 to layers.2)\nrefused: fsdp2 at world 4: layers.0: tile split at row 56\n"
        );
    }

    /// A NaN result against a finite reference fails the check (the fold skipped it and
    /// reported 0 error); exact zeros are no error.
    #[test]
    fn a_nan_result_is_an_error_not_a_skip() {
        let (abs, rel) = errors(&[1.0, f32::NAN, 0.0], &[1.0, 2.0, 0.0]);
        assert!(abs.is_nan() && rel.is_nan());
        let check = ReferenceCheck {
            name: "w".into(),
            max_abs: abs,
            max_rel: rel,
            tolerance: 1.0,
            absolute: true,
        };
        assert!(!check.passes());
        assert_eq!(errors(&[0.0, 3.0], &[0.0, 2.0]), (1.0, 0.5));
    }
}
