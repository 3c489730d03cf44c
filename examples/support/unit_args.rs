//! Command line of the one-unit planner examples (`unit_gap`, `exact_unit`):
//! `MODEL UNIT BLOCK V K`, the unit loaded from the inventory and its tensors as planner items.

use ragged::model::{Inventory, Unit};
use ragged::plan::{Item, PlanOptions};
use ragged::{AtomicBlock, Error, Result};

/// `MODEL UNIT BLOCK V K`, parsed, with the model's inventory loaded.
pub struct UnitArgs {
    pub model: String,
    pub unit_name: String,
    pub block: AtomicBlock,
    pub world: usize,
    pub k: usize,
    pub inv: Inventory,
}

impl UnitArgs {
    /// Parses the process arguments; `op` names the example in errors.
    pub fn from_env(op: &'static str) -> Result<Self> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        if args.iter().any(|a| a == "-h" || a == "--help") {
            println!("usage: {op} MODEL UNIT BLOCK V K");
            println!("  MODEL  a preset (llama3_8b, ...) or an inventory .json");
            println!("  UNIT   a unit of the model (`ragged plan --model MODEL` lists them)");
            println!("  BLOCK  elem, rows:K or tile:RxC");
            println!("  V      devices; K  at most K buffers per unit");
            std::process::exit(0);
        }
        let [model, unit_name, block, world, k] = args.as_slice() else {
            return Err(Error::BadInput {
                op,
                what: format!("{args:?}"),
                reason: format!("usage: {op} MODEL UNIT BLOCK V K"),
            });
        };
        let number = |s: &str| {
            s.parse::<usize>().map_err(|e| Error::BadInput {
                op,
                what: s.into(),
                reason: e.to_string(),
            })
        };
        let (world, k) = (number(world)?, number(k)?);
        ragged::limits::at_least(op, "V", world, 1)?;
        ragged::limits::at_least(op, "K", k, 1)?;
        let most = ragged::plan::multi::MAX_BUFFERS;
        ragged::limits::at_most(op, "K", k, most, "the planner's limit on buffers per unit")?;
        Ok(UnitArgs {
            model: model.clone(),
            unit_name: unit_name.clone(),
            block: block.parse()?,
            world,
            k,
            inv: Inventory::load(model)?,
        })
    }

    /// The unit named on the command line.
    pub fn unit(&self, op: &'static str) -> Result<Unit<'_>> {
        self.inv
            .units()
            .into_iter()
            .find(|u| u.name == self.unit_name)
            .ok_or_else(|| Error::BadInput {
                op,
                what: self.unit_name.clone(),
                reason: format!("no such unit in {}", self.model),
            })
    }

    /// The unit's tensors as planner items, each with the block of the command line.
    pub fn items(&self, unit: &Unit<'_>, opts: &PlanOptions) -> Result<Vec<Item>> {
        unit.tensors
            .iter()
            .map(|t| Item::new(t.numel(), self.block.elems(&t.shape)?, opts.start_align))
            .collect()
    }
}

/// The process's exit status for `result`, printing an error as the CLI does (`error: ...`,
/// not the `Debug` form `main` would print).
pub fn exit(result: Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
