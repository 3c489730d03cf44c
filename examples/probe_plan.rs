use ragged::model::Inventory;
use ragged::plan::{plan_model, PlanOptions};
use ragged::AtomicBlock;
fn main() {
    for m in ["llama3_8b", "gpt_oss_120b", "deepseek_v3_671b"] {
        let inv = Inventory::from_json_file(format!("models/{m}.json")).unwrap();
        for b in ["elem", "rows:1", "rows:16", "rows:128", "tile:32x32"] {
            let blk: AtomicBlock = b.parse().unwrap();
            for v in [8, 1024, 4096] {
                let p = plan_model(&inv, &|_| blk, v, &PlanOptions::default()).unwrap();
                let checks: usize = p.units.iter().map(|u| u.stats.checks).sum();
                println!(
                    "{m} {b} V={v}: pad {:.3}% {:?} distinct {} checks(sum) {}",
                    p.padding_frac() * 100.0,
                    p.elapsed,
                    p.distinct_units,
                    checks
                );
            }
        }
    }
}
