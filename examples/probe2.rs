use ragged::model::Inventory;
use ragged::plan::{plan_items, plan_model, Item, PlanOptions};
use ragged::AtomicBlock;
use std::time::Instant;
fn main() {
    let inv = Inventory::from_json_file("models/deepseek_v3_671b.json").unwrap();
    let blk: AtomicBlock = std::env::args()
        .nth(1)
        .unwrap_or("rows:16".into())
        .parse()
        .unwrap();
    for _ in 0..3 {
        let t = Instant::now();
        let u = inv.units();
        let t_units = t.elapsed();
        let t = Instant::now();
        let mut n = 0;
        for unit in &u[..3] {
            let items: Vec<Item> = unit
                .tensors
                .iter()
                .map(|t| Item::new(t.numel(), blk.elems(&t.shape).unwrap(), 1).unwrap())
                .collect();
            let l = plan_items(&items, 1024, &PlanOptions::default()).unwrap();
            n += l.stats.checks;
        }
        let t_search = t.elapsed();
        let t = Instant::now();
        let p = plan_model(&inv, &|_| blk, 1024, &PlanOptions::default()).unwrap();
        println!(
            "units {:?} search(3 units) {:?} checks {n} plan_model {:?}",
            t_units,
            t_search,
            t.elapsed()
        );
        drop(p);
    }
}
