//! Whole or split: where each Muon matrix lives, chosen per tensor by a byte cost model.
//!
//! Keeping a matrix whole on one rank (block [`AtomicBlock::Matrix`]) makes its
//! Newton–Schulz local, but a large block can force padding into every collective buffer of
//! the group. Letting the planner cut it (block [`AtomicBlock::Element`]) removes that padding
//! and costs a trip to a root and back every step ([`crate::roots`]).
//!
//! # Cost model (bytes on the wire per step, all ranks together)
//! - Padding: every padded element rides in each step's parameter all-gather and gradient
//!   reduce-scatter and reaches the `V − 1` other ranks: `2·(V − 1)·padding` elements of 4
//!   bytes.
//! - Split matrices: each element not already on its root travels there and back:
//!   `2·moved` elements ([`RootPlan::moved_elems`](crate::roots::RootPlan::moved_elems)) of
//!   [`Muon::route_elem_bytes`]: 4, or 2 when Newton–Schulz runs in bf16 (the routes carry
//!   bf16), which makes splitting cheaper.
//!
//! [`MatrixLayout::Auto`] searches greedily from both ends, every Muon tensor whole (then
//! splitting some while that lowers the total) and every one split (then making some whole),
//! and keeps the cheaper of the two. The greedy moves *classes* of interchangeable tensors
//! (same shape, same name up to its numbers: the experts of an MoE layer), largest first,
//! trying `n, n/2, n/4, …, 1` members of each and keeping the cheapest count; a class of one is
//! one tensor at a time. An MoE layer with hundreds of experts thus costs tens of plans, not
//! hundreds. Units equal up to names (the layers of a model) are planned once, under every
//! layout: the [`Muon`] and its clones remember each plan. Every choice is reported
//! ([`LayoutReport`]). The model counts bytes, not time: Newton–Schulz load balance is left
//! to the root assignment.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use ragged::model::{TensorSpec, Unit};
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::{plan_unit, Plan, PlanOptions};
use ragged::{AtomicBlock, Result};

use crate::muon::Muon;
use crate::newton_schulz::NsPrecision;

/// How Muon lays out its matrices (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MatrixLayout {
    /// Per tensor, by the byte cost model.
    #[default]
    Auto,
    /// Every matrix whole on one rank: no Muon communication.
    Whole,
    /// Every matrix may be cut: no padding from Muon's blocks.
    Split,
}

/// The choice for one Muon tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorChoice {
    pub name: String,
    pub shape: Vec<usize>,
    /// [`AtomicBlock::Matrix`] or, for a flattened tensor, [`AtomicBlock::Whole`] (whole);
    /// [`AtomicBlock::Element`] (split).
    pub block: AtomicBlock,
    /// Its elements that travel to roots per step and direction in the final plan.
    pub moved: usize,
}

impl TensorChoice {
    /// Whether its matrices are split over ranks (gathered to roots).
    pub fn is_split(&self) -> bool {
        self.block == AtomicBlock::Element
    }
}

/// What [`Muon::plan_layout`] chose for a unit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutReport {
    pub unit: String,
    pub world: usize,
    pub layout: MatrixLayout,
    /// Muon tensors in unit order.
    pub tensors: Vec<TensorChoice>,
    /// Padding elements of the final plan (all ranks).
    pub padding: usize,
    /// Padding elements with every Muon matrix whole (what splitting saves from).
    pub whole_padding: usize,
    /// Elements sent to roots per step and direction by the final plan.
    pub moved: usize,
    /// Bytes of one element on the routes to the roots ([`Muon::route_elem_bytes`]).
    pub route_elem_bytes: u64,
}

impl LayoutReport {
    /// Bytes on the wire per step that the layout costs (module doc).
    pub fn cost_bytes(&self) -> u64 {
        wire_bytes(self.world, self.padding, self.moved, self.route_elem_bytes)
    }
}

impl fmt::Display for LayoutReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let split = self.tensors.iter().filter(|t| t.is_split()).count();
        writeln!(
            f,
            "{} (V = {}, {:?}): {} of {} Muon tensors split; padding {} elements ({} with all \
             whole), {} elements to roots per step; {:.2} MB on the wire per step",
            self.unit,
            self.world,
            self.layout,
            split,
            self.tensors.len(),
            self.padding,
            self.whole_padding,
            self.moved,
            self.cost_bytes() as f64 / 1e6
        )?;
        for t in &self.tensors {
            let how = if t.is_split() {
                format!("split (moves {} per way)", t.moved)
            } else {
                "whole".to_string()
            };
            writeln!(f, "  {:<40} {:?}: {how}", t.name, t.shape)?;
        }
        Ok(())
    }
}

/// The module doc's cost: padding in `f32` collectives, moved elements of `route_elem_bytes`.
fn wire_bytes(world: usize, padding: usize, moved: usize, route_elem_bytes: u64) -> u64 {
    let padding = 2 * (world.saturating_sub(1) as u64) * padding as u64;
    4 * padding + 2 * moved as u64 * route_elem_bytes
}

impl Muon {
    /// Bytes of one element on the routes of split matrices to their roots: 2 when
    /// Newton–Schulz runs in bf16 (the host and device steps carry them in bf16), else 4.
    pub fn route_elem_bytes(&self) -> u64 {
        match self.config().ns.precision {
            NsPrecision::Bf16 => 2,
            NsPrecision::F32 => 4,
        }
    }

    /// Plans `unit` under [`crate::MuonConfig::layout`] and reports the choice per tensor.
    pub fn plan_layout(
        &self,
        unit: &Unit,
        world: usize,
        opts: &PlanOptions,
    ) -> Result<(Plan, LayoutReport)> {
        let muon: Vec<bool> = unit
            .tensors
            .iter()
            .map(|t| self.uses_muon(&t.name, &t.shape))
            .collect();
        let layout = self.config().layout;
        let base: Vec<AtomicBlock> = unit
            .tensors
            .iter()
            .map(|t| self.atomic_block(&t.name, &t.shape))
            .collect();
        let all = |block: AtomicBlock| -> Vec<AtomicBlock> {
            base.iter()
                .zip(&muon)
                .map(|(&b, &m)| if m { block } else { b })
                .collect()
        };
        let key = LayoutKey::new(unit, &base, &muon, world, opts);
        let (whole_padding, best) = match self.layouts.get(&key) {
            Some((whole_padding, found)) => (whole_padding, found.renamed(unit)),
            None => {
                let found = self.layout_of(unit, layout, &all, &muon, world, opts)?;
                self.layouts.insert(key, found.clone());
                found
            }
        };
        let tensors = unit
            .tensors
            .iter()
            .enumerate()
            .filter(|&(i, _)| muon[i])
            .map(|(i, t)| TensorChoice {
                name: t.name.clone(),
                shape: t.shape.clone(),
                block: best.plan.placements[i].block,
                moved: best.per_param[i],
            })
            .collect();
        let report = LayoutReport {
            unit: unit.name.clone(),
            world,
            layout,
            tensors,
            padding: best.plan.padding(),
            whole_padding,
            moved: best.moved,
            route_elem_bytes: self.route_elem_bytes(),
        };
        Ok((best.plan, report))
    }

    /// The plan `layout` gives `unit` (`all(b)`: block `b` for every Muon tensor, the base
    /// blocks for the others), with the padding of every Muon matrix whole.
    fn layout_of(
        &self,
        unit: &Unit,
        layout: MatrixLayout,
        all: &dyn Fn(AtomicBlock) -> Vec<AtomicBlock>,
        muon: &[bool],
        world: usize,
        opts: &PlanOptions,
    ) -> Result<(usize, Costed)> {
        let whole_blocks = all(AtomicBlock::Matrix);
        let whole = self.costed(unit, &whole_blocks, world, opts)?;
        let whole_padding = whole.plan.padding();
        let best = match layout {
            MatrixLayout::Whole => whole,
            MatrixLayout::Split => self.costed(unit, &all(AtomicBlock::Element), world, opts)?,
            MatrixLayout::Auto => {
                self.search(unit, all, (whole_blocks, whole), muon, world, opts)?
            }
        };
        Ok((whole_padding, best))
    }

    /// [`MatrixLayout::Auto`]'s search: greedy from both ends (splitting one matrix alone may
    /// free no padding while the others stay whole, and vice versa); the cheaper result.
    fn search(
        &self,
        unit: &Unit,
        all: &dyn Fn(AtomicBlock) -> Vec<AtomicBlock>,
        whole: (Vec<AtomicBlock>, Costed),
        muon: &[bool],
        world: usize,
        opts: &PlanOptions,
    ) -> Result<Costed> {
        let classes = classes(unit, muon);
        let split_blocks = all(AtomicBlock::Element);
        let split = self.costed(unit, &split_blocks, world, opts)?;
        let from_whole = self.improve(unit, whole, &classes, AtomicBlock::Element, world, opts)?;
        let from_split = self.improve(
            unit,
            (split_blocks, split),
            &classes,
            AtomicBlock::Matrix,
            world,
            opts,
        )?;
        Ok(if from_split.1.wire < from_whole.1.wire {
            from_split.1
        } else {
            from_whole.1
        })
    }

    /// From `start` (blocks and their costed plan), flips Muon tensors to `to` class by class,
    /// largest first: of `n, n/2, …, 1` members flipped (the first ones in unit order), keeps
    /// the count that lowers the wire cost most, if any.
    fn improve(
        &self,
        unit: &Unit,
        start: (Vec<AtomicBlock>, Costed),
        classes: &[Vec<usize>],
        to: AtomicBlock,
        world: usize,
        opts: &PlanOptions,
    ) -> Result<(Vec<AtomicBlock>, Costed)> {
        let (mut blocks, mut best) = start;
        for class in classes {
            let mut taken = None;
            for count in halvings(class.len()) {
                let mut trial_blocks = blocks.clone();
                for &i in &class[..count] {
                    trial_blocks[i] = to;
                }
                let trial = self.costed(unit, &trial_blocks, world, opts)?;
                if trial.wire < best.wire {
                    best = trial;
                    taken = Some(trial_blocks);
                }
            }
            if let Some(b) = taken {
                blocks = b;
            }
        }
        Ok((blocks, best))
    }

    /// The plan for `blocks` with its wire cost.
    fn costed(
        &self,
        unit: &Unit,
        blocks: &[AtomicBlock],
        world: usize,
        opts: &PlanOptions,
    ) -> Result<Costed> {
        let index = |t: &TensorSpec| {
            unit.tensors
                .iter()
                .position(|u| std::ptr::eq(*u, t))
                .expect("a tensor of the unit")
        };
        // `Matrix` stands for "whole" in the search: a flattened tensor's whole block is `Whole`.
        let block = |t: &TensorSpec| match blocks[index(t)] {
            AtomicBlock::Matrix => self.atomic_block(&t.name, &t.shape),
            b => b,
        };
        let plan = plan_unit(unit, &block, world, opts)?;
        let shard = LocalShard::from_plan(&plan, 0)?;
        let roots = self.roots(&shard);
        let mut per_param = vec![0; plan.placements.len()];
        for job in &roots.jobs {
            per_param[job.param] += roots.moved(&shard, job);
        }
        let moved = per_param.iter().sum();
        Ok(Costed {
            wire: wire_bytes(world, plan.padding(), moved, self.route_elem_bytes()),
            plan,
            moved,
            per_param,
        })
    }
}

#[derive(Clone)]
struct Costed {
    plan: Plan,
    moved: usize,
    per_param: Vec<usize>,
    wire: u64,
}

impl Costed {
    /// The same layout for `unit`, a unit whose tensors have the shapes and blocks of the one
    /// this was planned for (placements are in unit order): its unit, tensor names and dtypes.
    fn renamed(mut self, unit: &Unit) -> Self {
        self.plan.unit.clone_from(&unit.name);
        for (p, t) in self.plan.placements.iter_mut().zip(&unit.tensors) {
            p.name.clone_from(&t.name);
            p.dtype = t.dtype;
        }
        self
    }
}

/// `n, n/2, n/4, …, 1` (each once).
fn halvings(n: usize) -> impl Iterator<Item = usize> {
    std::iter::successors((n > 0).then_some(n), |&k| (k > 1).then_some(k / 2))
}

/// The Muon tensors of `unit` grouped into classes of interchangeable ones (same shape, same
/// name with its digit runs dropped), classes ordered by tensor size, largest first (ties in
/// unit order); members in unit order.
fn classes(unit: &Unit, muon: &[bool]) -> Vec<Vec<usize>> {
    let mut index: HashMap<(String, &[usize]), usize> = HashMap::new();
    let mut classes: Vec<Vec<usize>> = Vec::new();
    for (i, t) in unit.tensors.iter().enumerate().filter(|&(i, _)| muon[i]) {
        let name: String = t.name.chars().filter(|c| !c.is_ascii_digit()).collect();
        let k = *index.entry((name, &t.shape)).or_insert_with(|| {
            classes.push(Vec::new());
            classes.len() - 1
        });
        classes[k].push(i);
    }
    classes.sort_by_key(|c| std::cmp::Reverse(unit.tensors[c[0]].numel())); // stable
    classes
}

/// What decides a unit's layout (the layout rule being the `Muon`'s): per tensor its shape, base block and whether
/// Muon steps it (names only matter through that), the world and the planner options.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct LayoutKey {
    tensors: Vec<(Vec<usize>, AtomicBlock, bool)>,
    world: usize,
    opts: PlanOptions,
}

impl LayoutKey {
    fn new(
        unit: &Unit,
        base: &[AtomicBlock],
        muon: &[bool],
        world: usize,
        opts: &PlanOptions,
    ) -> Self {
        let tensors = unit
            .tensors
            .iter()
            .zip(base.iter().zip(muon))
            .map(|(t, (&b, &m))| (t.shape.clone(), b, m))
            .collect();
        LayoutKey {
            tensors,
            world,
            opts: opts.clone(),
        }
    }
}

/// The layouts of units already planned, shared by clones of a [`Muon`] (whose layout is one
/// and the same): the identical layers of a model, and thread ranks handed clones of one
/// `Muon`, plan (for [`MatrixLayout::Auto`]: search) once. A cache, not configuration: it
/// takes no part in equality.
#[derive(Clone, Default)]
pub(crate) struct LayoutCache(Arc<Mutex<HashMap<LayoutKey, Remembered>>>);

/// What planning found: the padding with every Muon matrix whole, and the costed plan (under
/// the names of the unit it was found for; its placements hold the blocks chosen).
type Remembered = (usize, Costed);

impl LayoutCache {
    fn get(&self, key: &LayoutKey) -> Option<Remembered> {
        self.lock().get(key).cloned()
    }

    fn insert(&self, key: LayoutKey, found: Remembered) {
        self.lock().insert(key, found);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<LayoutKey, Remembered>> {
        // A panic elsewhere while holding the lock leaves the map whole (inserts are atomic).
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl PartialEq for LayoutCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl fmt::Debug for LayoutCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LayoutCache({} units)", self.lock().len())
    }
}
