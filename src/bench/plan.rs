//! The planner benchmark: plan time and padding of the ragged planner next to every baseline
//! layout, over models × world sizes × blocks. `ragged bench plan` writes the table into
//! `docs/benchmarks.md`; `benches/plan.rs` times the same calls with criterion.

use std::fmt::Write as _;
use std::time::Duration;

use crate::model::Inventory;
use crate::plan::baselines::{self, Baseline, BaselineLayout, BaselineOptions};
use crate::plan::multi::MultiOptions;
use crate::plan::multi_model::{coarse_wrap, hsdp_group, plan_model_multi, MultiModelPlan};
use crate::plan::{plan_model, ModelPlan, PlanOptions};
use crate::{AtomicBlock, Context, Result};

/// World sizes of the sweep.
pub const WORLDS: [usize; 5] = [8, 64, 256, 1024, 4096];

/// Blocks of the sweep, in CLI form.
pub const BLOCKS: [&str; 5] = ["elem", "rows:1", "rows:16", "rows:128", "tile:32x32"];

/// One baseline's numbers for a (model, V, block) point.
#[derive(Clone, Debug)]
pub struct BaselineCell {
    pub baseline: Baseline,
    pub padding_frac: f64,
    pub cut_blocks: u64,
}

/// One (model, V, block) point.
#[derive(Clone, Debug)]
pub struct PlanRow {
    pub model: String,
    pub world: usize,
    pub block: AtomicBlock,
    /// Best of `repeats` runs of [`plan_model`].
    pub plan_time: Duration,
    pub padding_frac: f64,
    /// Padding that no layout with these blocks can avoid ([`ModelPlan::lower_bound_padding_frac`]).
    pub floor_frac: f64,
    /// `V·⌈N/V⌉`: the element-granular bound, as a padding fraction.
    pub bound_frac: f64,
    pub baselines: Vec<BaselineCell>,
    /// The multi-buffer plan ([`MultiOptions::default`]: at most 3 buffers per unit).
    pub multi: MultiCell,
}

/// The multi-buffer numbers of one (model, V, block) point.
#[derive(Clone, Debug)]
pub struct MultiCell {
    pub padding_frac: f64,
    /// Padding no layout with at most each unit's `k` buffers can avoid.
    pub floor_frac: f64,
    /// The most buffers any unit uses.
    pub max_k: usize,
    /// Best of `repeats` runs of [`plan_model_multi`].
    pub plan_time: Duration,
    /// Where a rank's share of a decoder layer is smaller than one of its blocks: the coarser
    /// wrap (layers per unit) that fixes that, and its multi-buffer padding.
    pub coarse: Option<(usize, f64)>,
    /// The same case by HSDP instead: the largest shard group whose layer shares reach a
    /// block, and the multi-buffer padding at that group size.
    pub hsdp: Option<(usize, f64)>,
}

/// The ragged plan of `inv`, timed as the best of `repeats` runs.
pub fn timed_plan(
    inv: &Inventory,
    block: AtomicBlock,
    world: usize,
    opts: &PlanOptions,
    repeats: usize,
) -> Result<ModelPlan> {
    let mut best: Option<ModelPlan> = None;
    for _ in 0..repeats.max(1) {
        let p = plan_model(inv, &|_| block, world, opts)?;
        if best.as_ref().is_none_or(|b| p.elapsed < b.elapsed) {
            best = Some(p);
        }
    }
    Ok(best.expect("at least one run"))
}

/// The multi-buffer plan of `inv` with `layers_per_unit` layers per unit, timed as the best
/// of `repeats` runs; every buffer is validated.
pub fn timed_multi_plan(
    inv: &Inventory,
    block: AtomicBlock,
    world: usize,
    layers_per_unit: usize,
    repeats: usize,
) -> Result<MultiModelPlan> {
    let (opts, mopts) = (PlanOptions::default(), MultiOptions::default());
    let mut best: Option<MultiModelPlan> = None;
    for _ in 0..repeats.max(1) {
        let p = plan_model_multi(inv, &|_| block, world, layers_per_unit, &opts, &mopts)?;
        if best.as_ref().is_none_or(|b| p.elapsed < b.elapsed) {
            best = Some(p);
        }
    }
    let best = best.ok_or_else(|| crate::Error::BadInput {
        op: "timed_multi_plan",
        what: "repeats".into(),
        reason: "no run".into(),
    })?;
    for buffer in best.units.iter().flat_map(|u| &u.buffers) {
        buffer.validate()?;
    }
    Ok(best)
}

/// The multi-buffer cell of one point, with the coarser wrap where a share is below a block.
pub fn multi_cell(
    inv: &Inventory,
    block: AtomicBlock,
    world: usize,
    repeats: usize,
) -> Result<MultiCell> {
    let plan = timed_multi_plan(inv, block, world, 1, repeats)?;
    let coarse = match coarse_wrap(&plan) {
        Some(w) => Some((w, timed_multi_plan(inv, block, world, w, 1)?.padding_frac())),
        None => None,
    };
    let hsdp = match hsdp_group(&plan) {
        Some(g) => Some((g, timed_multi_plan(inv, block, g, 1, 1)?.padding_frac())),
        None => None,
    };
    Ok(MultiCell {
        padding_frac: plan.padding_frac(),
        floor_frac: plan.floor_padding_frac(),
        max_k: plan.max_k(),
        plan_time: plan.elapsed,
        coarse,
        hsdp,
    })
}

/// Every baseline layout of `inv` at `world` (they do not depend on the block).
pub fn baseline_layouts(inv: &Inventory, world: usize) -> Result<Vec<BaselineLayout>> {
    Baseline::ALL
        .iter()
        .map(|&b| baselines::layout(b, inv, world, &BaselineOptions::default()))
        .collect()
}

/// Measures one point; `layouts` come from [`baseline_layouts`] for the same model and world.
pub fn plan_row(
    inv: &Inventory,
    layouts: &[BaselineLayout],
    block: AtomicBlock,
    world: usize,
    repeats: usize,
) -> Result<PlanRow> {
    let ctx = || format!("{} at V={world} with block {block}", inv.model);
    let plan = timed_plan(inv, block, world, &PlanOptions::default(), repeats).with_context(ctx)?;
    for unit in &plan.units {
        unit.validate().with_context(ctx)?;
    }
    let n = inv.total_params();
    let bound = (n.div_ceil(world as u64) * world as u64 - n) as f64 / n as f64;
    let baselines = layouts
        .iter()
        .map(|l| {
            Ok(BaselineCell {
                baseline: l.baseline,
                padding_frac: l.padding_frac(),
                cut_blocks: baselines::cut_blocks(l, inv, block)?,
            })
        })
        .collect::<Result<_>>()?;
    let multi = multi_cell(inv, block, world, repeats).with_context(ctx)?;
    Ok(PlanRow {
        model: inv.model.clone(),
        world,
        block,
        plan_time: plan.elapsed,
        padding_frac: plan.padding_frac(),
        floor_frac: plan.lower_bound_padding_frac(),
        bound_frac: bound,
        baselines,
        multi,
    })
}

/// A markdown table of `rows`: padding % of ragged, the padding its blocks force on any layout
/// (`block floor`), the multi-buffer padding, its floor, the most buffers a unit uses and its
/// plan time, the coarser wrap where a rank's share of a layer is below one block, padding %
/// of each baseline, blocks cut by each baseline (ragged cuts none, checked by
/// [`crate::plan::Plan::validate`]), plan time.
pub fn markdown(rows: &[PlanRow]) -> String {
    let mut s = String::new();
    s.push_str("| model | V | block | ragged pad % | block floor % | plan ms |");
    s.push_str(" k≤3 pad % | k≤3 floor % | max k | k≤3 ms | share < block: wrap, pad %; HSDP group, pad % |");
    for b in Baseline::ALL {
        let _ = write!(s, " {b} pad % |");
    }
    for b in Baseline::ALL {
        let _ = write!(s, " {b} cuts |");
    }
    s.push_str(" bound pad % |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|");
    s.push_str(&"---:|".repeat(2 * Baseline::ALL.len() + 1));
    s.push('\n');
    for r in rows {
        let _ = write!(
            s,
            "| {} | {} | {} | {} | {} | {:.2} |",
            short_name(&r.model),
            r.world,
            r.block,
            pct(r.padding_frac),
            pct(r.floor_frac),
            r.plan_time.as_secs_f64() * 1e3
        );
        let m = &r.multi;
        let mut coarse = match m.coarse {
            Some((w, p)) => format!("{w} layers: {}", pct(p)),
            None => String::new(),
        };
        if let Some((g, p)) = m.hsdp {
            let _ = write!(coarse, "; HSDP {g}: {}", pct(p));
        }
        let _ = write!(
            s,
            " {} | {} | {} | {:.2} | {coarse} |",
            pct(m.padding_frac),
            pct(m.floor_frac),
            m.max_k,
            m.plan_time.as_secs_f64() * 1e3
        );
        for c in &r.baselines {
            let _ = write!(s, " {} |", pct(c.padding_frac));
        }
        for c in &r.baselines {
            let _ = write!(s, " {} |", c.cut_blocks);
        }
        let _ = writeln!(s, " {} |", pct(r.bound_frac));
    }
    s
}

/// A padding fraction as a percentage: exact zero, `<0.001`, or three decimals.
pub fn pct(frac: f64) -> String {
    match frac * 100.0 {
        0.0 => "0".into(),
        p if p < 0.001 => "<0.001".into(),
        p => format!("{p:.3}"),
    }
}

fn short_name(model: &str) -> &str {
    model.rsplit('/').next().unwrap_or(model)
}
