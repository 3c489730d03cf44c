//! The start-up table of a sharded model: every parameter's role, planned block, unit and
//! which ranks hold it (what a user checks before a long run: did the rule send the embedding
//! to the fallback, is this matrix whole on one rank or split).

use std::fmt;

use super::ShardedModel;
use crate::optim::Optimizer;
use crate::{AtomicBlock, Role};

/// One parameter of [`ShardedModel::describe`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamRow {
    pub name: String,
    pub shape: Vec<usize>,
    /// Its FSDP unit.
    pub unit: String,
    /// The optimizer's role for it ([`Optimizer::role`]; `Frozen` for a frozen buffer).
    pub role: Role,
    /// The block it was planned with.
    pub block: AtomicBlock,
    /// The ranks that hold elements of it, ascending: one rank when it is whole there (under
    /// HSDP, ranks of a shard group: each replica holds it alike).
    pub ranks: Vec<usize>,
}

impl ParamRow {
    /// Whether one rank holds all of it.
    pub fn is_whole(&self) -> bool {
        self.ranks.len() == 1
    }
}

/// Every parameter of a sharded model, in unit and shard order; `Display` prints a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamTable {
    pub rows: Vec<ParamRow>,
}

impl ParamTable {
    /// Parameters per role, in the order matrix, element-wise, fp32-state, frozen.
    pub fn count(&self, role: Role) -> usize {
        self.rows.iter().filter(|r| r.role == role).count()
    }
}

/// `rank 2` for one rank, `ranks 0-3` for a run, else the list.
fn ranks_text(ranks: &[usize]) -> String {
    match ranks {
        [] => "none".into(),
        [r] => format!("rank {r} (whole)"),
        [a, .., b] if b - a + 1 == ranks.len() => format!("ranks {a}-{b} (split)"),
        _ => format!("ranks {ranks:?} (split)"),
    }
}

impl fmt::Display for ParamTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let widest = |len: fn(&ParamRow) -> usize, min: usize| {
            self.rows.iter().map(len).max().unwrap_or(min).max(min)
        };
        let (width, unit) = (widest(|r| r.name.len(), 9), widest(|r| r.unit.len(), 4));
        writeln!(
            f,
            "{:<width$}  {:<14} {:<12} {:<unit$}  {:<12} layout",
            "parameter", "shape", "role", "unit", "block"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<width$}  {:<14} {:<12} {:<unit$}  {:<12} {}",
                r.name,
                format!("{:?}", r.shape),
                r.role.to_string(),
                r.unit,
                r.block.to_string(),
                ranks_text(&r.ranks)
            )?;
        }
        let roles = [
            Role::Matrix,
            Role::ElementWise,
            Role::Fp32State,
            Role::Frozen,
        ];
        let counts: Vec<String> = roles
            .iter()
            .map(|&role| format!("{} {role}", self.count(role)))
            .collect();
        write!(f, "{} parameters: {}", self.rows.len(), counts.join(", "))
    }
}

impl<O: Optimizer> ShardedModel<'_, O> {
    /// The start-up table: every parameter with its role, unit, block and holding ranks (the
    /// same on every rank: the plan is).
    pub fn describe(&self) -> ParamTable {
        let mut rows = Vec::new();
        for unit in &self.units {
            for meta in &unit.local.params {
                let role = if unit.params.is_frozen() {
                    Role::Frozen
                } else {
                    self.optimizer.role(&meta.name, &meta.shape)
                };
                let mut ranks: Vec<usize> = meta.holdings.iter().map(|h| h.rank).collect();
                ranks.dedup();
                rows.push(ParamRow {
                    name: meta.name.clone(),
                    shape: meta.shape.clone(),
                    unit: unit.name.clone(),
                    role,
                    block: meta.block,
                    ranks,
                });
            }
        }
        ParamTable { rows }
    }
}
