//! HSDP (`FsdpOptions::replicas`): units sharded over groups of `V / R` ranks and replicated
//! over `R` groups, through `ThreadWorld::run` as users call it.
//!
//! - A step equals the unsharded reference **bitwise** for every optimizer when one rank holds
//!   the whole batch's gradient and the reduction sums (every sum then adds exact zeros), so a
//!   missing, doubled or averaged replica all-reduce, or a collective in the wrong group, shows
//!   as different bits.
//! - With every rank on its own data (averaged), training tracks the unsharded run within the
//!   tolerance of `fsdp_tests.rs` (the averages are taken in another order), and every rank of
//!   every replica holds bitwise the same parameters: also with micro-batches, the FSDP2-style
//!   layout, bf16 reductions and frozen parameters.
//! - A checkpoint saved under HSDP is the shard group's (its files, its world) and loads at
//!   any world, under HSDP or not, with every array bitwise; resuming from it is bitwise.
//! - A rank holds what a rank of a plain world of its group's size holds; a failing rank ends
//!   every rank promptly, with its own error.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Tensor};
use ragged::checkpoint::{fs as ckpt_fs, CheckpointState, Manifest, SaveOptions};
use ragged::comm::threads::ThreadWorld;
use ragged::comm::{Communicator, ReduceOp, SingleRank};
use ragged::demo::{batch, corpus, TransformerConfig, TransformerStages};
use ragged::fsdp::{fully_shard, FsdpOptions, MixedPrecision, ShardLayout};
use ragged_optimizers::{
    Adam8bit, Adam8bitConfig, AdamW, AdamWConfig, MatrixLayout, Muon, MuonConfig, Shampoo,
    ShampooConfig,
};

mod common;
use common::{backward_on_one_rank, saved_arrays, scratch, thread_read_bytes};

const CFG: TransformerConfig = common::SMALL;
/// Divisible by every world size used here (1, 2, 3, 4, 6).
const BATCH: usize = 12;
const LR: f64 = 1e-2;
/// `(world, replicas)`: two and three replicas of groups of two and three, and replicas of one
/// rank each (every unit whole on every rank: data parallelism).
const MESHES: [(usize, usize); 4] = [(4, 2), (6, 3), (6, 2), (4, 4)];

type Params = Vec<(String, Tensor)>;
/// Parameters by name, gathered (f32).
type Full = HashMap<String, Vec<f32>>;

fn adamw() -> AdamW {
    common::adamw_decayed(LR)
}

fn hsdp(replicas: usize, reduce: ReduceOp) -> FsdpOptions {
    FsdpOptions {
        replicas,
        reduce,
        ..FsdpOptions::default()
    }
}

/// Two steps in which only rank `holder` backpropagates the batch (the others' losses are
/// scaled by 0) and gradients are summed: the norm of each step's gradients, clipped to 0.5,
/// and the parameters after, gathered.
fn steps_with_one_holder<O: CheckpointState>(
    c: &dyn Communicator,
    params: &Params,
    opt: O,
    replicas: usize,
    holder: usize,
) -> ragged::Result<(Vec<u32>, Full)> {
    let mut m = fully_shard(params, opt, c, hsdp(replicas, ReduceOp::Sum))?;
    let mut norms = Vec::new();
    for step in 0..2 {
        let ids = batch(corpus()?, &CFG, step, 0, 4)?;
        backward_on_one_rank(&mut m, CFG, &ids, c.rank(), holder)?;
        norms.push(m.clip_grad_norm(0.5)?.to_bits());
        m.step()?;
    }
    Ok((norms, m.full_params()?))
}

fn bitwise_on_every_mesh<O: CheckpointState + Clone>(label: &str, opt: O) {
    let params = CFG.init_params(4).unwrap();
    let (norms, reference) =
        steps_with_one_holder(&SingleRank, &params, opt.clone(), 1, 0).unwrap();
    for (world, replicas) in MESHES {
        let ranks = ThreadWorld::run(world, |c| {
            steps_with_one_holder(c, &params, opt.clone(), replicas, world - 1)
        })
        .unwrap();
        for (r, (n, full)) in ranks.iter().enumerate() {
            let at = format!(
                "{label}, {replicas} replicas of {}, rank {r}",
                world / replicas
            );
            assert_eq!(n, &norms, "{at}: gradient norms");
            for (name, want) in &reference {
                let same = full[name]
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{at}: {name} differs from the unsharded step");
            }
        }
    }
    println!("{label}: bitwise the unsharded steps on meshes {MESHES:?}");
}

/// Every optimizer's state is sharded by the shard group's plan, and Muon gathers its matrices
/// (Shampoo its blocks) within that group: the steps are the unsharded ones, bit for bit.
#[test]
fn an_hsdp_step_is_bitwise_the_unsharded_step_for_every_optimizer() {
    bitwise_on_every_mesh("adamw", adamw());
    let adam8 = Adam8bitConfig {
        adam: AdamWConfig {
            lr: LR,
            ..AdamWConfig::default()
        },
        ..Adam8bitConfig::default()
    };
    bitwise_on_every_mesh("adam8bit", Adam8bit::new(adam8).unwrap());
    let muon = |layout| {
        let cfg = MuonConfig {
            lr: 0.02,
            layout,
            ..MuonConfig::default()
        };
        Muon::new(cfg).unwrap()
    };
    bitwise_on_every_mesh("muon (split matrices)", muon(MatrixLayout::Split));
    bitwise_on_every_mesh("muon (whole matrices)", muon(MatrixLayout::Whole));
    bitwise_on_every_mesh("muon (the cost model's choice)", muon(MatrixLayout::Auto));
    let shampoo = ShampooConfig {
        lr: LR,
        epsilon: 1e-4,
        max_preconditioner_dim: 32,
        ..ShampooConfig::default()
    };
    bitwise_on_every_mesh("shampoo", Shampoo::new(shampoo).unwrap());
}

/// Trains `steps` with every rank on its own rows of the batch; returns the losses and the
/// gathered parameters of every rank.
fn train(world: usize, opts: FsdpOptions, params: &Params, steps: usize) -> Vec<(Vec<f32>, Full)> {
    ThreadWorld::run(world, |c| {
        let mut m = fully_shard(params, adamw(), c, opts.clone())?;
        let rows = BATCH / world;
        let mut losses = Vec::new();
        for step in 0..steps {
            let ids = batch(corpus()?, &CFG, step, c.rank() * rows, rows)?;
            let report = m.forward_backward(&TransformerStages(CFG), &ids)?;
            m.step()?;
            // Each rank's loss is its rows' mean: average over the world for the batch's.
            let mut loss = [report.loss];
            c.all_reduce((&mut loss[..]).into(), ReduceOp::Avg)?;
            losses.push(loss[0]);
        }
        Ok((losses, m.full_params()?))
    })
    .unwrap()
}

/// Tolerance (as `fsdp_tests::sharded_training_matches_unsharded_within_tolerance`): the ranks'
/// mean gradients are averaged in another order than the reference's one mean, so parameters
/// part by rounding, at most ~lr per step where Adam normalizes a gradient at rounding level;
/// lr/10 still fails a shard stepped with the wrong gradient.
#[test]
fn hsdp_training_tracks_the_unsharded_run_and_replicas_stay_identical() {
    let params = CFG.init_params(7).unwrap();
    let reference = train(1, hsdp(1, ReduceOp::Avg), &params, 4).remove(0);
    assert!(
        reference.0[3] < reference.0[0],
        "training must reduce the loss"
    );
    for (world, replicas) in MESHES {
        let ranks = train(world, hsdp(replicas, ReduceOp::Avg), &params, 4);
        let at = format!("{replicas} replicas of {}", world / replicas);
        assert_ranks_agree(&ranks, &at);
        let (losses, full) = &ranks[0];
        for (s, (a, b)) in losses.iter().zip(&reference.0).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * b.abs(),
                "{at}, step {s}: loss {a} vs {b}"
            );
        }
        let diff = full
            .iter()
            .flat_map(|(n, x)| x.iter().zip(&reference.1[n]).map(|(p, q)| (p - q).abs()))
            .fold(0f32, f32::max);
        println!("{at}: max |Δparam| after 4 steps = {diff:.3e}");
        assert!(diff <= LR as f32 / 10.0, "{at}: {diff}");
    }
}

/// Every rank holds bitwise rank 0's parameters.
fn assert_ranks_agree(ranks: &[(Vec<f32>, Full)], at: &str) {
    for (r, (_, full)) in ranks.iter().enumerate() {
        assert!(
            same_bits(full, &ranks[0].1),
            "{at}: rank {r}'s parameters differ from rank 0's"
        );
    }
}

fn same_bits(a: &Full, b: &Full) -> bool {
    a.len() == b.len()
        && a.iter()
            .all(|(n, x)| x.iter().zip(&b[n]).all(|(p, q)| p.to_bits() == q.to_bits()))
}

/// The FSDP2-style layout under HSDP trains bitwise as the ragged one (both reduce in rank
/// order, AdamW is element-wise); bf16 parameters and reductions keep the replicas bitwise
/// identical and track the unsharded bf16 run within the loss tolerance of
/// `fsdp_tests::bf16_mixed_precision_keeps_layouts_bitwise_and_tracks_unsharded` (2 %).
#[test]
fn the_fsdp2_layout_and_bf16_reductions_run_under_hsdp() {
    let params = CFG.init_params(7).unwrap();
    let ragged = train(4, hsdp(2, ReduceOp::Avg), &params, 3);
    let fsdp2 = FsdpOptions {
        layout: ShardLayout::Fsdp2,
        ..hsdp(2, ReduceOp::Avg)
    };
    let fsdp2 = train(4, fsdp2, &params, 3);
    for (r, (a, b)) in ragged.iter().zip(&fsdp2).enumerate() {
        assert!(same_bits(&a.1, &b.1), "rank {r}: the layouts differ");
    }
    let bf16 = |replicas| FsdpOptions {
        mixed_precision: MixedPrecision {
            param_dtype: DType::BF16,
            reduce_dtype: DType::BF16,
        },
        ..hsdp(replicas, ReduceOp::Avg)
    };
    let reference = train(1, bf16(1), &params, 3).remove(0);
    let ranks = train(4, bf16(2), &params, 3);
    assert_ranks_agree(&ranks, "bf16, 2 replicas of 2");
    for (s, (a, b)) in ranks[0].0.iter().zip(&reference.0).enumerate() {
        assert!(
            (a - b).abs() <= 0.02 * b.abs(),
            "bf16 step {s}: loss {a} vs {b}"
        );
    }
}

/// On `world` ranks with `replicas`: a model of the parameters initialized from `init`,
/// loaded from `from` (if given), trained `steps` (the step number picks the batch, each rank
/// its rows), saved to `to` (if given); every rank's parameter digest.
fn digest_after(
    mesh: (usize, usize),
    init: u64,
    from: Option<&Path>,
    steps: std::ops::Range<usize>,
    to: Option<&Path>,
) -> Vec<String> {
    let runs = run_after(mesh, init, from, steps, to);
    runs.into_iter().map(|(digest, _)| digest).collect()
}

/// [`digest_after`], with the bytes each rank's thread read during the load.
fn run_after(
    (world, replicas): (usize, usize),
    init: u64,
    from: Option<&Path>,
    steps: std::ops::Range<usize>,
    to: Option<&Path>,
) -> Vec<(String, u64)> {
    let params = CFG.init_params(init).unwrap();
    ThreadWorld::run(world, |c| {
        let mut m = fully_shard(&params, adamw(), c, hsdp(replicas, ReduceOp::Avg))?;
        let mut read = 0;
        if let Some(from) = from {
            let before = thread_read_bytes();
            m.load(from)?;
            read = thread_read_bytes() - before;
        }
        let rows = BATCH / world;
        for step in steps.clone() {
            let ids = batch(corpus()?, &CFG, step, c.rank() * rows, rows)?;
            m.forward_backward(&TransformerStages(CFG), &ids)?;
            m.step()?;
        }
        if let Some(to) = to {
            m.save(to, &SaveOptions::default())?;
        }
        Ok((m.param_digest()?, read))
    })
    .unwrap()
}

/// Saved by 2 replicas of 2 ranks: the checkpoint is the shard group's (2 rank files, world 2,
/// file j written by replica j mod 2), and loads at 3 ranks and at 3 replicas of 2 with the
/// same digest; saved again at 3 ranks, every array (parameters and AdamW's moments) is
/// bitwise the same.
#[test]
fn an_hsdp_checkpoint_is_the_shard_groups_and_loads_at_any_world() {
    let root = scratch("ragged-hsdp-tests", "checkpoint");
    let (hsdp_root, plain_root) = (root.join("hsdp"), root.join("plain"));
    let saved = digest_after((4, 2), 7, None, 0..2, Some(&hsdp_root));
    assert!(saved.iter().all(|d| d == &saved[0]));
    let dir = ckpt_fs::resolve(&hsdp_root).unwrap();
    let manifest = Manifest::read(&dir).unwrap();
    assert_eq!(manifest.world, 2, "the shard group's world");
    let files = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().starts_with("rank-")
        })
        .count();
    assert_eq!(files, 2, "one file per rank of the shard group");
    for d in digest_after((3, 1), 11, Some(&hsdp_root), 0..0, Some(&plain_root)) {
        assert_eq!(d, saved[0], "loaded at 3 ranks");
    }
    for d in digest_after((6, 3), 11, Some(&hsdp_root), 0..0, None) {
        assert_eq!(d, saved[0], "loaded by 3 replicas of 2");
    }
    let (a, b) = (saved_arrays(&hsdp_root), saved_arrays(&plain_root));
    assert_eq!(a.len(), b.len());
    for (key, bytes) in &a {
        assert!(b[key] == *bytes, "{key:?} differs after a load at 3 ranks");
    }
    assert!(a.keys().any(|(_, f)| f == "m") && a.keys().any(|(_, f)| f == "v"));
}

/// A number of replicas that does not divide the world is refused on every rank, naming it.
#[test]
fn replicas_must_divide_the_world() {
    let params = CFG.init_params(7).unwrap();
    for replicas in [0, 4] {
        let errors = ThreadWorld::run(6, |c| {
            let m = fully_shard(&params, adamw(), c, hsdp(replicas, ReduceOp::Avg));
            Ok(m.err().map(|e| e.to_string()))
        })
        .unwrap();
        for e in errors {
            let e = e.expect("refused");
            assert!(
                e.contains(&format!("replicas = {replicas} on a world of 6")),
                "{e}"
            );
        }
    }
}

/// A rank that fails mid-run under HSDP ends the job promptly through `ThreadWorld::run`: its
/// shard group fails at the next gather, the other replicas at the next replica all-reduce (or
/// when a rank of their group leaves), and `run` returns the failing rank's error.
#[test]
fn a_rank_failing_under_hsdp_ends_every_rank_promptly() {
    let params = CFG.init_params(7).unwrap();
    let start = std::time::Instant::now();
    let out = ThreadWorld::run(4, |c| {
        let mut m = fully_shard(&params, adamw(), c, hsdp(2, ReduceOp::Avg))?;
        for step in 0..20 {
            if c.rank() == 3 && step == 1 {
                return Err(ragged::Error::Msg("rank 3 fails on purpose".into()));
            }
            let ids = batch(corpus()?, &CFG, step, c.rank() * 3, 3)?;
            m.forward_backward(&TransformerStages(CFG), &ids)?;
            m.step()?;
        }
        Ok(())
    });
    let err = out.expect_err("rank 3 failed").to_string();
    assert!(err.contains("on purpose"), "{err}");
    assert!(
        start.elapsed() < std::time::Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
}

/// A rank under HSDP holds what a rank of a plain world of the shard group's size holds: the
/// same shard lengths, unit by unit, at its rank within the group (memory per rank is the
/// shard group's, whatever the number of replicas).
#[test]
fn an_hsdp_rank_holds_the_shards_of_a_world_of_its_group() {
    let params = CFG.init_params(7).unwrap();
    let shards = |world: usize, replicas: usize| {
        ThreadWorld::run(world, |c| {
            let m = fully_shard(&params, adamw(), c, hsdp(replicas, ReduceOp::Avg))?;
            Ok(m.local_shards().iter().map(|s| s.len).collect::<Vec<_>>())
        })
        .unwrap()
    };
    for (world, replicas) in MESHES {
        let group = world / replicas;
        let plain = shards(group, 1);
        for (r, lens) in shards(world, replicas).iter().enumerate() {
            assert_eq!(
                lens,
                &plain[r % group],
                "{replicas} replicas of {group}, rank {r}"
            );
        }
    }
    assert!(shards(4, 2)[0].iter().sum::<usize>() > shards(4, 1)[0].iter().sum::<usize>());
}

/// Saved under HSDP after 2 steps and resumed (by a model initialized otherwise) for 2 more:
/// the parameters are bitwise those of 4 uninterrupted HSDP steps. Each shard rank's file is
/// read by one replica (`j mod R`, the one that wrote it), which sends the values to the
/// other: by the kernel's count of bytes each rank's thread read, the reading rank reads at
/// least its file's arrays and the other rank next to nothing (the manifest), and the ranks
/// that read nothing resume bitwise too, so what they received is the parameters and AdamW's
/// moments as saved.
#[test]
fn resuming_under_hsdp_is_bitwise_with_one_read_per_shard() {
    let root = scratch("ragged-hsdp-tests", "resume");
    let straight = digest_after((4, 2), 7, None, 0..4, None);
    digest_after((4, 2), 7, None, 0..2, Some(&root));
    let resumed = run_after((4, 2), 8, Some(&root), 2..4, None);
    let digests: Vec<String> = resumed.iter().map(|(d, _)| d.clone()).collect();
    assert_eq!(digests, straight);
    let dir = ckpt_fs::resolve(&root).unwrap();
    let manifest = Manifest::read(&dir).unwrap();
    let arrays: Vec<u64> = (0..2).map(|j| arrays_in_file(&manifest, j)).collect();
    // Shard rank j = r mod 2 is read by replica j mod 2: world ranks 0 and 3.
    for (r, (_, read)) in resumed.iter().enumerate() {
        let j = r % 2;
        match r == (j % 2) * 2 + j {
            true => assert!(*read >= arrays[j], "rank {r} read {read} of {}", arrays[j]),
            false => assert!(
                *read < arrays[j] / 8,
                "rank {r} read {read} of {}",
                arrays[j]
            ),
        }
    }
}

/// A safetensors import under HSDP: each shard rank's ranges are read by one replica, which
/// sends them to the other (by the kernel's count of bytes each rank's thread read: the
/// readers together read every parameter, the others next to nothing, the file's header), and
/// every rank holds the exported values.
#[test]
fn an_import_under_hsdp_reads_each_shard_on_one_replica() {
    let root = scratch("ragged-hsdp-tests", "import");
    let file = root.join("model.safetensors");
    let params = CFG.init_params(7).unwrap();
    let exported = ThreadWorld::run(2, |c| {
        let mut m = fully_shard(&params, adamw(), c, FsdpOptions::default())?;
        m.export_safetensors(&file)?;
        m.param_digest()
    })
    .unwrap();
    let other = CFG.init_params(8).unwrap();
    let imported = ThreadWorld::run(4, |c| {
        let mut m = fully_shard(&other, adamw(), c, hsdp(2, ReduceOp::Avg))?;
        let before = thread_read_bytes();
        let unused = m.load_safetensors(&file)?;
        let read = thread_read_bytes() - before;
        Ok((m.param_digest()?, read, unused))
    })
    .unwrap();
    let param_bytes: u64 = other.iter().map(|(_, t)| 4 * t.elem_count() as u64).sum();
    // Shard rank j = r mod 2 is read by replica j mod 2: world ranks 0 and 3.
    let readers = imported[0].1 + imported[3].1;
    assert!(
        readers >= param_bytes,
        "the readers read {readers} of {param_bytes}"
    );
    for r in [1, 2] {
        let read = imported[r].1;
        assert!(
            read < param_bytes / 16,
            "rank {r} read {read} of {param_bytes}"
        );
    }
    for (r, (digest, _, unused)) in imported.iter().enumerate() {
        assert_eq!(digest, &exported[0], "rank {r}");
        assert!(unused.is_empty(), "rank {r}: {unused:?}");
    }
}

/// Bytes of the saved arrays held in shard rank `j`'s file.
fn arrays_in_file(manifest: &Manifest, j: usize) -> u64 {
    let held = manifest.fields.iter().flat_map(|f| {
        let size = f.dtype.size() as u64;
        let mine = f.holders.iter().filter(move |h| h[0] == j);
        mine.map(move |h| (h[2] - h[1]) as u64 * size)
    });
    held.sum()
}

/// Frozen parameters under HSDP: gathered in the shard group, never reduced over replicas or
/// stepped, so they stay bitwise at their initial values on every rank while the rest trains
/// and the replicas agree.
#[test]
fn frozen_parameters_stay_put_under_hsdp() {
    let params = CFG.init_params(7).unwrap();
    let frozen = |name: &str| name.contains("attn");
    let opts = FsdpOptions {
        frozen: Some(ragged::fsdp::NameRule::new(frozen)),
        ..hsdp(2, ReduceOp::Avg)
    };
    let ranks = train(4, opts, &params, 2);
    assert_ranks_agree(&ranks, "frozen attention, 2 replicas of 2");
    let initial: Full = params
        .iter()
        .map(|(n, t)| (n.clone(), t.flatten_all().unwrap().to_vec1().unwrap()))
        .collect();
    let full = &ranks[0].1;
    let moved = |n: &str| full[n] != initial[n];
    assert!(full.keys().any(|n| frozen(n)), "the rule freezes something");
    for n in full.keys() {
        assert_eq!(moved(n), !frozen(n), "{n}");
    }
}

/// Two micro-batches a step (gradients accumulated between reductions): each reduced share is
/// all-reduced over the replicas before it is added, so the replicas stay bitwise identical and
/// the run tracks the unsharded one with the same micro-batches (the tolerance above).
#[test]
fn accumulated_micro_batches_under_hsdp() {
    let params = CFG.init_params(7).unwrap();
    let run = |world: usize, replicas: usize| {
        ThreadWorld::run(world, |c| {
            let mut m = fully_shard(&params, adamw(), c, hsdp(replicas, ReduceOp::Avg))?;
            let rows = BATCH / world;
            for step in 0..3 {
                for micro in 0..2 {
                    let ids = batch(corpus()?, &CFG, 2 * step + micro, c.rank() * rows, rows)?;
                    m.forward_backward(&TransformerStages(CFG), &ids)?;
                }
                m.step()?;
            }
            Ok((Vec::new(), m.full_params()?))
        })
        .unwrap()
    };
    let reference = run(1, 1).remove(0).1;
    let ranks = run(4, 2);
    assert_ranks_agree(&ranks, "micro-batches, 2 replicas of 2");
    let diff = ranks[0]
        .1
        .iter()
        .flat_map(|(n, x)| x.iter().zip(&reference[n]).map(|(p, q)| (p - q).abs()))
        .fold(0f32, f32::max);
    assert!(diff <= LR as f32 / 10.0, "{diff}");
}
