//! Device memory the optimizer steps allocate (feature `cuda`), as tools/cuda-emu's driver
//! counts it. A binary of its own: the count is the device's, so no other test may use the
//! device while one runs (cargo runs a binary's tests on parallel threads; these share the
//! device only with each other, one at a time). Under a real driver, which has no count, the
//! test says so and checks nothing more; without a GPU it prints `skipped: <reason>`. Each
//! test holds `alone` for its whole run.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use ragged::comm::Communicator;
use ragged::cuda::Device;
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::PlanOptions;
use ragged::storage::Placement;
use ragged_optimizers::newton_schulz::{NsMethod, NsPrecision};
use ragged_optimizers::{
    Adam8bit, Adam8bitConfig, AdamW, AdamWConfig, Muon, MuonConfig, NsConfig, Shampoo,
};

mod harness;
use harness::cuda::{allocated_by_every_rank, alone, Allocated};
use harness::{device, planned_shards, scatter, split_case, split_rows};

/// After its first step no device optimizer step allocates device memory. Muon keeps `U`, the
/// roots' arena, the all-to-all buffers and Newton–Schulz's workspace between steps (these
/// are far below the 64 MiB it keeps), sized before use (split and whole matrices; `f32` and
/// bf16, the standard and the Gram iteration); AdamW and 8-bit Adam step in their state; Shampoo
/// keeps its buffers (gradient copies, `P_s`, the block table) and computes roots through
/// host copies.
/// Counted by tools/cuda-emu's driver over two steps of three thread ranks on one GPU
/// ([`steps_after_the_first_allocate`]).
#[test]
fn device_steps_after_the_first_allocate_no_device_memory() {
    let _alone = alone();
    let Some(dev) = device() else { return };
    let (spec, p0, grads) = split_case(37, 3);
    let mut counted = Vec::new();
    for precision in [NsPrecision::F32, NsPrecision::Bf16] {
        for method in [NsMethod::Standard, NsMethod::Gram] {
            let ns = NsConfig {
                precision,
                method,
                ..Default::default()
            };
            let opt = Muon::new(MuonConfig {
                lr: 1e-2,
                ns,
                ..Default::default()
            })
            .unwrap();
            let shards = split_rows(&opt, &spec, 3);
            let (allocated, ranks) =
                steps_after_the_first_allocate(&opt, &shards, &dev, &p0, &grads);
            counted.push((format!("Muon {precision:?} {method:?}"), allocated));
            // What each rank's Muon kept is device memory that `release_buffers` frees: at
            // least `U`.
            for (o, shard) in ranks.iter().zip(&shards) {
                let kept = o.release_buffers();
                assert!(
                    kept >= 4 * shard.len,
                    "rank {}: {kept} bytes kept",
                    shard.rank
                );
            }
        }
    }
    let opts = PlanOptions::default();
    let adamw = AdamW::new(AdamWConfig::default()).unwrap();
    let shards = planned_shards(&adamw, &spec, 3, &opts);
    let (allocated, _) = steps_after_the_first_allocate(&adamw, &shards, &dev, &p0, &grads);
    counted.push(("AdamW".into(), allocated));
    let adam8bit = Adam8bit::new(Adam8bitConfig {
        min_8bit_size: 256,
        ..Default::default()
    })
    .unwrap();
    let shards = planned_shards(&adam8bit, &spec, 3, &opts);
    let (allocated, _) = steps_after_the_first_allocate(&adam8bit, &shards, &dev, &p0, &grads);
    counted.push(("8-bit Adam".into(), allocated));
    // Shampoo: its kept buffers, and host copies of the factors for the roots.
    let shampoo = Shampoo::new(harness::loud_shampoo()).unwrap();
    let shards = planned_shards(&shampoo, &spec, 3, &opts);
    let (allocated, _) = steps_after_the_first_allocate(&shampoo, &shards, &dev, &p0, &grads);
    counted.push(("Shampoo".into(), allocated));
    for (what, allocated) in counted {
        match allocated {
            Some(a) => assert_eq!(a, Allocated::NONE, "{what}: device allocations"),
            None => println!("skipped the count: the driver is not cuda-emu"),
        }
    }
}

/// A device workspace over the `Muon`'s keep limit ([`Muon::keep_device_workspace`], 64 MiB by
/// default) lives for one step: after a step the `Muon` holds `U` only (what `release_buffers`
/// frees); at the default limit it holds the workspace too.
#[test]
fn a_device_workspace_over_the_keep_limit_is_not_kept_between_steps() {
    let _alone = alone();
    let Some(dev) = device() else { return };
    let kept_after_a_step = |keep: Option<usize>| {
        let mut opt = Muon::new(MuonConfig::default()).unwrap();
        if let Some(bytes) = keep {
            opt.keep_device_workspace(bytes);
        }
        let spec = harness::specs(&[("experts", &[4, 16, 32])]);
        let shard = harness::whole_shard_by(&spec, &|t| opt.atomic_block(&t.name, &t.shape));
        let mut rng = harness::Rng::new(3);
        let mut p = dev.upload(&rng.units(shard.len)).unwrap();
        let g = dev.upload(&rng.units(shard.len)).unwrap();
        let mut st = opt.init_on(&shard, &Placement::Cuda(dev.clone())).unwrap();
        let (pv, gv) = (p.slice_mut(..).into(), g.slice(..).into());
        opt.step(&mut st, &shard, pv, gv, &ragged::comm::SingleRank)
            .unwrap();
        (opt.release_buffers(), 4 * shard.len)
    };
    let (kept, u) = kept_after_a_step(None);
    assert!(kept > u, "default limit: {kept} bytes kept, U is {u}");
    let (kept, u) = kept_after_a_step(Some(1024));
    assert_eq!(kept, u, "a 1 KiB limit: only U kept");
}

/// The device memory `opt`'s steps after the first allocate on thread ranks on one GPU, one
/// rank per shard: each rank steps once on `grads[0]`, then on the others while rank 0 counts
/// (`allocated_by_every_rank`). Each rank steps its own clone of `opt`,
/// as each rank of `fully_shard` has its own (a `Muon` keeps one step's buffers: ranks sharing
/// one would take turns keeping theirs). Returns the count (`None` under a real driver) and
/// the ranks' optimizers after their steps.
fn steps_after_the_first_allocate<O: Optimizer + Clone + Send>(
    opt: &O,
    shards: &[LocalShard],
    dev: &Arc<Device>,
    p0: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
) -> (Option<Allocated>, Vec<O>) {
    use ragged::cuda::threads::ThreadDeviceComm;
    let allocated = ThreadDeviceComm::run(dev.clone(), shards.len(), |c| {
        let opt = opt.clone();
        let (shard, d) = (&shards[c.rank()], c.device());
        let mut p = d.upload(&scatter(shard, p0))?;
        let mut st = opt.init_on(shard, &Placement::Cuda(dev.clone()))?;
        let gs = grads
            .iter()
            .map(|g| d.upload(&scatter(shard, g)))
            .collect::<ragged::Result<Vec<_>>>()?;
        let mut step = |g: &ragged::cuda::cudarc::driver::CudaSlice<f32>| {
            let (pv, gv) = (p.slice_mut(..).into(), g.slice(..).into());
            opt.step(&mut st, shard, pv, gv, c)
        };
        step(&gs[0])?;
        let counting = c.rank() == 0;
        let allocated =
            allocated_by_every_rank(c, d, counting, || gs[1..].iter().try_for_each(&mut step))?;
        Ok((allocated, opt))
    })
    .unwrap();
    let count = allocated[0].0;
    (count, allocated.into_iter().map(|(_, o)| o).collect())
}
