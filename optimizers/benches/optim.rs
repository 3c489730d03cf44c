//! Criterion timing of one `Optimizer::step` per optimizer on small shapes, through the same
//! cases as `ragged bench optim` (`ragged_optimizers::bench`), which has the full table with
//! FLOPs, bytes and the same-run memcpy and GEMM baselines.

use criterion::{criterion_group, criterion_main, Criterion};
use ragged_optimizers::bench::{llama3_8b_layer, square, Case, OptimKind};

fn steps(c: &mut Criterion) {
    let mut group = c.benchmark_group("optimizer_step");
    group.sample_size(10);
    for kind in OptimKind::ALL {
        for set in [llama3_8b_layer(16), square(256)] {
            let mut case = Case::new(kind, &set).expect("case");
            group.bench_function(format!("{kind}/{}", set.name), |b| {
                b.iter(|| case.step().expect("step"))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, steps);
criterion_main!(benches);
