use ragged::model::Inventory;
use ragged::plan::{plan_model, PlanOptions};
use ragged::AtomicBlock;
use std::time::Instant;
fn main() {
    let inv = Inventory::from_json_file("models/deepseek_v3_671b.json").unwrap();
    for _ in 0..3 {
        let t = Instant::now();
        let u = inv.units();
        println!("units {:?} {}", t.elapsed(), u.len());
        let blk: AtomicBlock = "rows:1".parse().unwrap();
        let t = Instant::now();
        let p = plan_model(&inv, &|_| blk, 1024, &PlanOptions::default()).unwrap();
        println!("plan {:?} internal {:?}", t.elapsed(), p.elapsed);
    }
}
