//! Criterion timing of whole-model plans (the `ragged bench plan` table has the padding).
//! Baseline in the same run: the FSDP2 layout of the same model, which is plain arithmetic, so
//! the ratio shows what the block-aware search costs on top of it. The multi-buffer plan (at most
//! 3 buffers per unit) is timed next to the single-buffer plan of the same point.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use ragged::model::Inventory;
use ragged::plan::baselines::{layout, Baseline, BaselineOptions};
use ragged::plan::multi::MultiOptions;
use ragged::plan::multi_model::plan_model_multi;
use ragged::plan::{plan_model, PlanOptions};
use ragged::AtomicBlock;

fn plans(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan_model");
    group.sample_size(10);
    for name in ["llama3_70b", "gpt_oss_120b", "deepseek_v3_671b"] {
        let inv = Inventory::from_json_file(format!("models/{name}.json")).expect("inventory");
        for block in ["rows:1", "tile:32x32"] {
            let block: AtomicBlock = block.parse().expect("block");
            group.bench_function(format!("{name}/V1024/{block}"), |b| {
                b.iter(|| plan_model(&inv, &|_| block, black_box(1024), &PlanOptions::default()))
            });
            group.bench_function(format!("{name}/V1024/{block}/multi-k3"), |b| {
                b.iter(|| {
                    plan_model_multi(
                        &inv,
                        &|_| block,
                        black_box(1024),
                        1,
                        &PlanOptions::default(),
                        &MultiOptions::default(),
                    )
                })
            });
        }
        group.bench_function(format!("{name}/V1024/fsdp2-baseline"), |b| {
            b.iter(|| {
                layout(
                    Baseline::Fsdp2,
                    &inv,
                    black_box(1024),
                    &BaselineOptions::default(),
                )
            })
        });
    }
    group.finish();
}

criterion_group!(benches, plans);
criterion_main!(benches);
