//! What a checkpoint, a consolidated import and the compute copies must carry over exactly,
//! beyond the parameters and optimizer state the round-trip tests of `checkpoint_tests.rs`
//! compare: the progress counters and learning rate a load restores (and the flags it
//! resets), the newest checkpoint a root resolves to, a saved model larger than the one it is
//! loaded into, F16 files and half-precision tensors larger than one conversion block, split
//! files whose index interleaves them, compute copies gathered before a load, the bf16 casts
//! of mixed precision at one rank and several, and ranks whose initial values differ in one
//! element. Each test goes through the entry points users call (`fully_shard`,
//! `ThreadWorld::run`, real files in a scratch folder).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use ragged::checkpoint::SaveOptions;
use ragged::comm::threads::ThreadWorld;
use ragged::comm::{Communicator, SingleRank};
use ragged::fsdp::{fully_shard, FsdpOptions, MixedPrecision, NonFinitePolicy, ShardedModel};
use ragged_optimizers::AdamW;

mod common;
use common::{adamw, local_grads, scratch};

const SUITE: &str = "ragged-checkpoint-accounting-tests";

/// A tensor of `shape` whose elements are distinct, not integers, and mostly not bf16 values.
fn varied(shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 100_003) as f32 / 37_813.7
                - 1.3
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// `w` (16×20) and `b` (20): 340 elements, varied values.
fn params() -> Vec<(String, Tensor)> {
    vec![
        ("w".to_string(), varied(&[16, 20], 1)),
        ("b".to_string(), varied(&[20], 2)),
    ]
}

fn skip_step() -> FsdpOptions {
    FsdpOptions {
        non_finite: NonFinitePolicy::SkipStep,
        ..FsdpOptions::default()
    }
}

fn bf16() -> FsdpOptions {
    FsdpOptions {
        mixed_precision: MixedPrecision {
            param_dtype: DType::BF16,
            reduce_dtype: DType::BF16,
        },
        ..FsdpOptions::default()
    }
}

/// A backward of `Σ c·p²/2` over every parameter (the gradient of element `p` is `c·p`, in
/// the compute dtype).
fn backward(s: &mut ShardedModel<'_, AdamW>, c: f64) -> ragged::Result<()> {
    let full = s.unshard()?;
    let mut loss = Tensor::zeros((), full.values().next().unwrap().dtype(), &Device::Cpu)?;
    for t in full.values() {
        loss = (loss + ((t * t)? * (c / 2.0))?.sum_all()?)?;
    }
    loss.backward()?;
    Ok(())
}

/// A backward, a reduction and a step.
fn train_step(s: &mut ShardedModel<'_, AdamW>, c: f64) -> ragged::Result<()> {
    backward(s, c)?;
    s.reduce_gradients()?;
    s.step()
}

/// The compute copies as f32, by name.
fn compute_copies(s: &mut ShardedModel<'_, AdamW>) -> HashMap<String, Vec<f32>> {
    s.unshard()
        .unwrap()
        .into_iter()
        .map(|(n, t)| {
            let v = common::f32_values(&t);
            (n, v)
        })
        .collect()
}

/// A load restores the progress as saved: the skipped-step count, the learning rate set by
/// `set_learning_rate` (not the optimizer config's), the step count; it clears a non-finite
/// loss noted before it (the next step is taken); and the next step matches the run that
/// saved, bitwise. `Loaded::saved_world` is the world that wrote the checkpoint, also when
/// loaded at another world size.
#[test]
fn a_load_restores_skips_learning_rate_and_clears_the_non_finite_flag() {
    let root = scratch(SUITE, "progress");
    let runs = ThreadWorld::run(2, |c| {
        let mut s = fully_shard(&params(), adamw(), c, skip_step())?;
        backward(&mut s, 1.0)?;
        s.reduce_gradients()?;
        if c.rank() == 0 {
            s.note_loss(f32::NAN);
        }
        s.step()?;
        s.set_learning_rate(0.05)?;
        train_step(&mut s, 1.0)?;
        assert_eq!((s.skipped_steps(), s.steps_taken()), (1, 1));
        s.save(&root, &SaveOptions::default())?;
        train_step(&mut s, 0.5)?;
        let want = s.full_params()?;

        let mut t = fully_shard(&params(), adamw(), c, skip_step())?;
        t.note_loss(f32::NAN);
        let loaded = t.load(&root)?;
        assert_eq!((loaded.steps, loaded.saved_world), (1, 2));
        assert_eq!(t.skipped_steps(), 1, "skipped steps restored");
        assert_eq!(t.steps_taken(), 1);
        assert_eq!(t.learning_rate(), Some(0.05), "learning rate restored");
        train_step(&mut t, 0.5)?;
        assert_eq!(
            (t.skipped_steps(), t.steps_taken()),
            (1, 2),
            "a NaN noted before the load does not skip the step after it"
        );
        Ok(t.full_params()? == want)
    })
    .unwrap();
    assert_eq!(
        runs,
        vec![true, true],
        "resumed step differs from the saver's"
    );
    let mut one = fully_shard(&params(), adamw(), &SingleRank, skip_step()).unwrap();
    let loaded = one.load(&root).unwrap();
    assert_eq!(loaded.saved_world, 2, "the world that saved it");
    assert_eq!(one.skipped_steps(), 1);
}

/// Pending gradients are dropped by a load (`load`'s "drops pending gradients"), whether
/// reduced but not stepped or still in the sinks (a backward without its reduction): a save
/// right after is not refused, and the next step is that of a model that loaded without
/// them, bitwise.
#[test]
fn a_load_drops_pending_gradients_reduced_or_not() {
    let root = scratch(SUITE, "pending");
    for reduced in [true, false] {
        let same = ThreadWorld::run(2, |c| {
            let mut s = fully_shard(&params(), adamw(), c, FsdpOptions::default())?;
            train_step(&mut s, 1.0)?;
            let saved = root.join(format!("reduced-{reduced}"));
            s.save(&saved, &SaveOptions::default())?;

            let mut clean = fully_shard(&params(), adamw(), c, FsdpOptions::default())?;
            clean.load(&saved)?;
            train_step(&mut clean, 1.0)?;

            let mut dirty = fully_shard(&params(), adamw(), c, FsdpOptions::default())?;
            backward(&mut dirty, 7.0)?;
            if reduced {
                dirty.reduce_gradients()?;
            }
            dirty.load(&saved)?;
            let again = dirty.save(saved.join("again"), &SaveOptions::default());
            train_step(&mut dirty, 1.0)?;
            Ok((
                again.map(|_| ()).map_err(|e| e.to_string()),
                dirty.full_params()? == clean.full_params()?,
            ))
        })
        .unwrap();
        for (again, same) in same {
            assert_eq!(again, Ok(()), "reduced {reduced}: save after load refused");
            assert!(
                same,
                "reduced {reduced}: gradients from before the load reached the step"
            );
        }
    }
}

/// A root holding several checkpoints loads the newest: saved after steps 1, 2 and 3 (none
/// removed), the load resumes at step 3 with step 3's parameters.
#[test]
fn a_root_resolves_to_its_newest_checkpoint() {
    let root = scratch(SUITE, "newest");
    let mut s = fully_shard(&params(), adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    for _ in 0..3 {
        train_step(&mut s, 1.0).unwrap();
        s.save(&root, &SaveOptions::default()).unwrap();
    }
    let want = s.full_params().unwrap();
    let mut t = fully_shard(&params(), adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let loaded = t.load(&root).unwrap();
    assert_eq!(loaded.steps, 3);
    assert_eq!(t.steps_taken(), 3);
    assert!(
        t.full_params().unwrap() == want,
        "loaded an older checkpoint"
    );
}

/// A checkpoint that holds every parameter of the model and more (another, larger model that
/// shares its names) does not load: the model would silently miss part of what was trained.
#[test]
fn a_checkpoint_with_parameters_the_model_lacks_is_refused() {
    let root = scratch(SUITE, "larger");
    let mut s = fully_shard(&params(), adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    train_step(&mut s, 1.0).unwrap();
    s.save(&root, &SaveOptions::default()).unwrap();
    let smaller = vec![params().remove(0)];
    let mut t = fully_shard(&smaller, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let err = t.load(&root).map(|_| ()).unwrap_err().to_string();
    assert!(
        err.contains("2 parameters") && err.contains("\"b\""),
        "{err}"
    );
}

/// Compute copies gathered before a load (by `unshard`, which later calls rewrite in place) are
/// refreshed by it: after `load` and after `load_safetensors`, the next `unshard` returns the
/// loaded values, not the ones gathered before.
#[test]
fn compute_copies_gathered_before_a_load_show_the_loaded_values() {
    let root = scratch(SUITE, "stale");
    for world in [1, 2] {
        let dir = root.join(format!("v{world}"));
        ThreadWorld::run(world, |c| {
            let mut s = fully_shard(&params(), adamw(), c, FsdpOptions::default())?;
            train_step(&mut s, 1.0)?;
            s.save(&dir, &SaveOptions::default())?;
            s.export_safetensors(dir.join("model.safetensors"))?;
            let want = s.full_params()?;

            let mut t = fully_shard(&params(), adamw(), c, FsdpOptions::default())?;
            let before = compute_copies(&mut t);
            assert!(before != want);
            t.load(&dir)?;
            assert!(
                compute_copies(&mut t) == want,
                "V={world}: stale after load"
            );

            let mut u = fully_shard(&params(), adamw(), c, FsdpOptions::default())?;
            compute_copies(&mut u);
            u.load_safetensors(dir.join("model.safetensors"))?;
            assert!(
                compute_copies(&mut u) == want,
                "V={world}: stale after load_safetensors"
            );
            Ok(())
        })
        .unwrap();
    }
}

/// Imports F16 and BF16 tensors as f32 exactly as candle converts them, at 1 and 2 ranks,
/// with tensors whose pieces span several conversion blocks (65 536 elements).
#[test]
fn half_precision_imports_convert_f16_and_bf16_over_many_blocks() {
    let root = scratch(SUITE, "half");
    let shapes: [(&str, &[usize]); 2] = [("big", &[600, 512]), ("small", &[7, 3])];
    let model: Vec<(String, Tensor)> = shapes
        .iter()
        .map(|&(n, s)| {
            (
                n.to_string(),
                Tensor::zeros(s, DType::F32, &Device::Cpu).unwrap(),
            )
        })
        .collect();
    for dtype in [DType::F16, DType::BF16] {
        let file: HashMap<String, Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(n, s))| {
                let t = (varied(s, 10 + i as u32) * 3.0).unwrap();
                (n.to_string(), t.to_dtype(dtype).unwrap())
            })
            .collect();
        let path = root.join(format!("{dtype:?}.safetensors"));
        candle_core::safetensors::save(&file, &path).unwrap();
        for world in [1, 2] {
            let got = ThreadWorld::run(world, |c| {
                let mut m = fully_shard(&model, adamw(), c, FsdpOptions::default())?;
                m.load_safetensors(&path)?;
                m.full_params()
            })
            .unwrap()
            .remove(0);
            for (name, t) in &file {
                let want = common::f32_values(t);
                assert!(got[name] == want, "{dtype:?} at V={world}: {name} differs");
            }
        }
    }
}

/// A Hugging Face index may interleave its files (`a` and `c` in one, `b` in the other): each
/// tensor is read from the file the index names.
#[test]
fn an_index_that_interleaves_files_loads_every_tensor_from_its_file() {
    let root = scratch(SUITE, "index");
    let names = ["a", "b", "c", "d"];
    let model: Vec<(String, Tensor)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.to_string(), varied(&[5 + i, 4], 20 + i as u32)))
        .collect();
    let mut files: Vec<(String, Vec<(String, Tensor)>)> = (0..2)
        .map(|i| (format!("part-{i}.safetensors"), Vec::new()))
        .collect();
    for (i, named) in model.iter().enumerate() {
        files[i % 2].1.push(named.clone());
    }
    let index = common::write_split_checkpoint(&root, &files);
    let zeros: Vec<(String, Tensor)> = model
        .iter()
        .map(|(n, t)| (n.clone(), t.zeros_like().unwrap()))
        .collect();
    let got = ThreadWorld::run(2, |c| {
        let mut m = fully_shard(&zeros, adamw(), c, FsdpOptions::default())?;
        assert!(m.load_safetensors(&index)?.is_empty());
        m.full_params()
    })
    .unwrap()
    .remove(0);
    for (n, t) in &model {
        let want: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        assert!(got[n] == want, "{n} read from the wrong file");
    }
}

/// Under a bf16 compute dtype the gathered copies are the master values rounded to nearest
/// (`half::bf16::from_f32`, torch's cast), not truncated, at 1 and 3 ranks.
#[test]
fn bf16_compute_copies_round_the_master_to_nearest() {
    let p = params();
    let truncated_differs = p.iter().any(|(_, t)| {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter()
            .any(|&x| half::bf16::from_f32(x).to_bits() != (x.to_bits() >> 16) as u16)
    });
    assert!(
        truncated_differs,
        "the values must tell rounding from truncation"
    );
    for world in [1, 3] {
        ThreadWorld::run(world, |c| {
            let mut m = fully_shard(&p, adamw(), c, bf16())?;
            let master = m.full_params()?;
            for (name, got) in compute_copies(&mut m) {
                let want: Vec<f32> = master[&name]
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_f32())
                    .collect();
                assert!(got == want, "V={world}: {name} not rounded to nearest");
            }
            Ok(())
        })
        .unwrap();
    }
}

/// Under `reduce_dtype` bf16 the reduced gradients are bf16 values, at one rank too: two
/// backwards whose gradients are bf16 values (`p` then `2⁻¹⁰·p`) add up in the f32 buffer to
/// values that are not, and the reduction rounds them as at several ranks.
#[test]
fn bf16_reductions_round_the_gradients_at_every_world_size() {
    let mut reduced = Vec::new();
    for world in [1, 2] {
        let grads = ThreadWorld::run(world, |c| {
            let mut m = fully_shard(&params(), adamw(), c, bf16())?;
            backward(&mut m, 1.0)?;
            backward(&mut m, 1.0 / 1024.0)?;
            m.reduce_gradients()?;
            let g = local_grads(&m);
            assert!(
                g.iter().all(|&x| half::bf16::from_f32(x).to_f32() == x),
                "V={world}: reduced gradients are not bf16 values"
            );
            Ok(g)
        })
        .unwrap();
        reduced.push(grads.concat());
    }
    assert!(reduced[0] == reduced[1], "one rank reduces as two do");
}

/// Ranks whose initial values differ in a single element, late in a tensor, are refused on
/// every rank (the fingerprint covers every value, not a prefix).
#[test]
fn ranks_differing_in_one_late_initial_value_are_refused() {
    let errors = ThreadWorld::run(2, |c| {
        let mut p = params();
        if c.rank() == 1 {
            let mut v: Vec<f32> = p[0].1.flatten_all()?.to_vec1()?;
            let last = v.len() - 1;
            v[last] += 1.0;
            p[0].1 = Tensor::from_vec(v, (16, 20), &Device::Cpu)?;
        }
        Ok(fully_shard(&p, adamw(), c, FsdpOptions::default())
            .map(|_| ())
            .map_err(|e| e.to_string()))
    })
    .unwrap();
    for e in errors {
        let e = e.expect_err("ranks with other initial values must not shard");
        assert!(e.contains("initial values"), "{e}");
    }
}

/// Under `reshard_after_forward`, a stack of identical blocks gathers each block into the
/// storages an earlier block freed (the pool keeps them by the blocks' shape, whichever block
/// freed them): over six blocks the forward touches at most two storages per weight (one
/// without prefetching, two with it), not one per block.
#[test]
fn identical_blocks_gather_into_storages_earlier_blocks_freed() {
    let mlp = ragged::demo::MlpConfig {
        width: 8,
        hidden: 16,
        layers: 6,
    };
    let params = mlp.init_params(2).unwrap();
    for overlap in [false, true] {
        let opts = FsdpOptions {
            overlap,
            ..FsdpOptions::default()
        };
        let mut m = fully_shard(&params, adamw(), &SingleRank, opts).unwrap();
        for step in 0..2 {
            // Each stage's weights' storage addresses.
            let seen = std::sync::Mutex::new(Vec::new());
            let watched = common::Watching {
                stages: ragged::demo::MlpStages(mlp),
                watch: |s: usize, p: &ragged::fsdp::UnitParams| {
                    let up = common::storage_address(p.get(&format!("layers.{s}.up.weight"))?);
                    let down = common::storage_address(p.get(&format!("layers.{s}.down.weight"))?);
                    seen.lock().unwrap().push([up, down]);
                    Ok(())
                },
            };
            m.forward_backward(&watched, &mlp.batch(step, 4).unwrap())
                .unwrap();
            m.step().unwrap();
            let seen = seen.into_inner().unwrap();
            assert_eq!(seen.len(), mlp.layers);
            for w in 0..2 {
                let mut distinct: Vec<usize> = seen.iter().map(|a| a[w]).collect();
                distinct.sort();
                distinct.dedup();
                assert!(
                    distinct.len() <= 2,
                    "overlap {overlap}, step {step}: weight {w} in {} storages",
                    distinct.len()
                );
            }
        }
    }
}

/// A unit serving several stages (the root: embedding first, head last) stays gathered from
/// its first forward use to its backward: while the blocks between run, the root's tensors
/// keep their full storages (it is not freed after its first stage and gathered again).
#[test]
fn a_unit_used_by_several_stages_stays_gathered_between_them() {
    let cfg = ragged::demo::TransformerConfig {
        n_layers: 3,
        ..ragged::demo::TransformerConfig::TINY
    };
    let params = cfg.init_params(4).unwrap();
    let mut m = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let ids = ragged::demo::batch(ragged::demo::corpus().unwrap(), &cfg, 0, 0, 2).unwrap();
    // The root's embedding tensor from the first stage, and its storage's length at every
    // later stage.
    let embed = std::sync::Mutex::new(None::<Tensor>);
    let lengths = std::sync::Mutex::new(Vec::new());
    let watch = common::Watching {
        stages: ragged::demo::TransformerStages(cfg),
        watch: |s: usize, p: &ragged::fsdp::UnitParams| {
            let mut embed = embed.lock().unwrap();
            if s == 0 {
                *embed = Some(p.get("embed.weight")?.clone());
            } else if let Some(t) = embed.as_ref() {
                lengths.lock().unwrap().push(common::storage_elements(t));
            }
            Ok(())
        },
    };
    m.forward_backward(&watch, &ids).unwrap();
    let lengths = lengths.into_inner().unwrap();
    assert_eq!(lengths.len(), cfg.n_layers + 1);
    let full = cfg.vocab * cfg.d_model;
    assert!(
        lengths.iter().all(|&n| n == full),
        "root storages between its stages: {lengths:?}"
    );
}

/// One stage per unit `layers.{s}`: `x + Σ w`, the last returning the scalar.
struct Sums(usize);

impl ragged::fsdp::Stages for Sums {
    type Batch = ();
    fn stage_units(&self) -> Vec<String> {
        (0..self.0).map(|s| format!("layers.{s}")).collect()
    }
    fn forward(
        &self,
        s: usize,
        p: &ragged::fsdp::UnitParams,
        x: Option<&Tensor>,
        _: &(),
    ) -> candle_core::Result<Tensor> {
        let w = p.get(&format!("layers.{s}.w"))?.sum_all()?;
        match x {
            Some(x) => x + w,
            None => Ok(w),
        }
    }
}

/// The memory plan replays the runtime's pool of freed compute-copy storages with its limit
/// (two units' kept): with four units of four sizes (no storages to share), the third unit's
/// storages are dropped when it is freed, so its size does not move the peak (reached in the
/// last unit's backward), whatever it is. The runtime agrees: while the last stage runs, the
/// pool holds the first two units' storages only.
#[test]
fn the_memory_plan_keeps_as_many_spare_storages_as_the_runtime() {
    let model = |rows2: usize| -> Vec<(String, Tensor)> {
        [8, 9, rows2, 40]
            .iter()
            .enumerate()
            .map(|(i, &r)| (format!("layers.{i}.w"), varied(&[r, 8], 30 + i as u32)))
            .collect()
    };
    let opts = FsdpOptions {
        overlap: false,
        ..FsdpOptions::default()
    };
    let peaks: Vec<usize> = [10, 12]
        .iter()
        .map(|&rows2| {
            let m = fully_shard(&model(rows2), adamw(), &SingleRank, opts.clone()).unwrap();
            assert_eq!(
                m.unit_names(),
                ["layers.0", "layers.1", "layers.2", "layers.3"]
            );
            let plan = m.memory_plan();
            plan.peak_unit_by_unit(&[0, 1, 2, 3], &opts, &[]).unwrap() - plan.shard_bytes()
        })
        .collect();
    assert_eq!(
        peaks[0], peaks[1],
        "a dropped unit's storages counted in the peak"
    );
    let mut m = fully_shard(&model(10), adamw(), &SingleRank, opts).unwrap();
    for _ in 0..2 {
        m.forward_backward(&Sums(4), &()).unwrap();
        m.step().unwrap();
    }
    assert_eq!(
        m.spare_param_bytes(),
        4 * 8 * (8 + 9),
        "the runtime keeps two units"
    );
}
