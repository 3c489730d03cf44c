//! What the fifth mutation audit (buffers and views, the FSDP2 layout, roles, schedules, model
//! inventories) found no test for: the bounds `Schedule::validate` documents as accepted, the
//! order a `RoleRule` asks its custom function and its patterns in, the FSDP2 copy-out's byte
//! count under bf16 and its 0-D parameters, a gradient buffer's one-element trailing padding
//! when reused, a replaced master shard marking gathered copies stale, the compute copies'
//! bytes in bf16, and an F8 element's size. Each test goes through the public API (the
//! buffers directly, or `fully_shard` and `ThreadWorld::run`).

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use ragged::comm::threads::ThreadWorld;
use ragged::dbuffer::{
    anchor, CopyStats, GradPool, GradSink, Materialized, ParamBuffer, TensorSlot,
};
use ragged::fsdp::{fully_shard, FsdpOptions, MixedPrecision, ShardLayout};
use ragged::schedule::Schedule;
use ragged::storage::Placement;
use ragged::{Role, RoleRule};

mod common;
use common::adamw;

/// `validate` accepts what it documents: `warmup = total` (no decay steps, the floor from
/// `total` on) and `min_factor` at both ends of `[0, 1]` (1: a constant after warmup).
#[test]
fn schedules_at_the_documented_bounds_are_valid() {
    for (warmup, total) in [(5, 5), (0, 0), (3, 8)] {
        for min_factor in [0.0, 0.5, 1.0] {
            for s in [
                Schedule::WarmupCosine {
                    warmup,
                    total,
                    min_factor,
                },
                Schedule::WarmupLinear {
                    warmup,
                    total,
                    min_factor,
                },
            ] {
                assert!(s.validate().is_ok(), "{s:?} refused");
            }
        }
    }
    let flat = Schedule::WarmupLinear {
        warmup: 2,
        total: 6,
        min_factor: 1.0,
    };
    assert_eq!((2..9).map(|t| flat.factor(t)).collect::<Vec<_>>(), [1.0; 7]);
}

fn embeddings_are_matrices(name: &str, _: &[usize]) -> Option<Role> {
    name.contains("embed").then_some(Role::Matrix)
}

/// The custom function is asked before the patterns (module doc: "the custom function, then
/// the first name pattern contained in the name, then the default").
#[test]
fn a_role_rules_custom_function_outranks_its_patterns() {
    let rule = RoleRule {
        patterns: &[("embed", Role::Frozen)],
        ..RoleRule::with_fn(embeddings_are_matrices)
    };
    assert_eq!(
        rule.role_of("model.embed_tokens.weight", &[8, 4]),
        Role::Matrix
    );
    // The function declines: the pattern decides; neither matches: the default.
    let rule = RoleRule {
        patterns: &[("lm_head", Role::Frozen)],
        ..RoleRule::with_fn(embeddings_are_matrices)
    };
    assert_eq!(rule.role_of("lm_head.weight", &[8, 4]), Role::Frozen);
    assert_eq!(rule.role_of("layers.0.q.weight", &[4, 4]), Role::Matrix);
}

/// The first pattern the name contains gives the role, not a later (more specific) one.
#[test]
fn a_role_rules_first_matching_pattern_wins() {
    let rule = RoleRule::with_patterns(&[
        ("embed", Role::Frozen),
        ("embed_tokens", Role::ElementWise),
        ("q_proj", Role::Fp32State),
    ]);
    assert_eq!(
        rule.role_of("model.embed_tokens.weight", &[8, 4]),
        Role::Frozen
    );
    assert_eq!(
        rule.role_of("model.layers.0.q_proj.weight", &[4, 4]),
        Role::Fp32State
    );
    assert_eq!(
        rule.role_of("model.layers.0.k_proj.weight", &[4, 4]),
        Role::Matrix
    );
}

fn fsdp2(param_dtype: DType) -> FsdpOptions {
    FsdpOptions {
        layout: ShardLayout::Fsdp2,
        mixed_precision: MixedPrecision {
            param_dtype,
            reduce_dtype: DType::F32,
        },
        ..FsdpOptions::default()
    }
}

fn ramp(shape: &[usize], start: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| start + 0.25 * i as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The FSDP2 copy-out counts the bytes it moves in the compute dtype: every element once, 2
/// bytes each under bf16, 4 under f32 (a gather copies nothing else outside the collective).
#[test]
fn the_fsdp2_copy_out_counts_bytes_of_the_compute_dtype() {
    let params = vec![
        ("w".to_string(), ramp(&[5, 3], 0.5)),
        ("b".to_string(), ramp(&[7], -1.0)),
    ];
    for (dtype, size) in [(DType::BF16, 2u64), (DType::F32, 4)] {
        let copied = ThreadWorld::run(2, |c| {
            let mut s = fully_shard(&params, adamw(), c, fsdp2(dtype))?;
            let before = s.stats().copied();
            s.unshard()?;
            Ok(s.stats().copied() - before)
        })
        .unwrap();
        assert_eq!(copied, vec![22 * size; 2], "{dtype:?}");
    }
}

/// A 0-D parameter under the FSDP2 layout is one row of one element: rank 0 holds it and the
/// gather gives every rank its value.
#[test]
fn a_scalar_parameter_survives_the_fsdp2_layout() {
    let params = vec![
        ("w".to_string(), ramp(&[3, 2], 1.0)),
        (
            "scale".to_string(),
            Tensor::new(0.75f32, &Device::Cpu).unwrap(),
        ),
    ];
    let got = ThreadWorld::run(2, |c| {
        let mut s = fully_shard(&params, adamw(), c, fsdp2(DType::F32))?;
        let full = s.unshard()?;
        let scale = full["scale"].to_vec0::<f32>()?;
        Ok((scale, s.full_params()?["scale"].clone()))
    })
    .unwrap();
    assert_eq!(got, vec![(0.75, vec![0.75]); 2]);
}

/// A reused gradient buffer has its padding zeroed, a trailing gap of one element included
/// (another sink of the same length, sharing the pool, wrote every element of it).
#[test]
fn a_one_element_trailing_gap_of_a_reused_gradient_buffer_reads_zero() {
    let stats = Arc::new(CopyStats::default());
    let pool = Arc::new(GradPool::default());
    let dirty = GradSink::new(vec![(0, 4)], 4, stats.clone())
        .unwrap()
        .with_pool(pool.clone());
    dirty.accumulate(0, &ramp(&[4], 7.0)).unwrap();
    dirty.discard();
    assert_eq!(pool.spare_bytes(), 16);
    for slots in [vec![(0, 3)], vec![(1, 3)]] {
        let sink = GradSink::new(slots.clone(), 4, stats.clone())
            .unwrap()
            .with_pool(pool.clone());
        sink.accumulate(0, &ramp(&[3], 1.0)).unwrap();
        let (buf, touched) = sink.take().unwrap();
        let mut want = [0.0; 4];
        want[slots[0].0..slots[0].0 + 3].copy_from_slice(&[1.0, 1.25, 1.5]);
        assert_eq!(buf.cpu().unwrap(), &want[..], "{slots:?}");
        assert_eq!(touched, [true]);
        // Dirty it again for the next shape.
        let refill = GradSink::new(vec![(0, 4)], 4, stats.clone())
            .unwrap()
            .with_pool(pool.clone());
        drop(buf);
        refill.accumulate(0, &ramp(&[4], 7.0)).unwrap();
        refill.discard();
    }
}

fn buffer(dtype: DType) -> ParamBuffer {
    let slots = vec![
        TensorSlot {
            name: "w".into(),
            shape: vec![2, 3],
        },
        TensorSlot {
            name: "b".into(),
            shape: vec![5],
        },
    ];
    let stats = Arc::new(CopyStats::default());
    let sink = Arc::new(GradSink::new(vec![(0, 6), (6, 5)], 11, stats).unwrap());
    ParamBuffer::new(slots, &Placement::Cpu, 11, dtype, sink, anchor().unwrap()).unwrap()
}

/// A master shard replaced by `set_master` (as a load does) makes gathered copies stale, and
/// the next gather rewrites them with the new values.
#[test]
fn set_master_marks_gathered_copies_stale() {
    use ragged::comm::{Buf, BufMut};
    let fill = |m: Buf<'_>, dsts: &mut [BufMut<'_>]| -> ragged::Result<()> {
        let Buf::F32(m) = m else { unreachable!() };
        let mut at = 0;
        for d in dsts.iter_mut() {
            let BufMut::F32(d) = d else { unreachable!() };
            d.copy_from_slice(&m[at..at + d.len()]);
            at += d.len();
        }
        Ok(())
    };
    let mut b = buffer(DType::F32);
    b.gather(fill).unwrap();
    assert_eq!(b.state(), Materialized::Unsharded);
    b.set_master((0..11).map(|i| i as f32).collect()).unwrap();
    assert_eq!(b.state(), Materialized::Stale);
    assert!(b.tensors().is_err());
    b.gather(fill).unwrap();
    let w = b.tensors().unwrap()[1].to_vec1::<f32>().unwrap();
    assert_eq!(w, [6.0, 7.0, 8.0, 9.0, 10.0]);
}

/// The compute copies' bytes are counted in their dtype: 2 per element under bf16.
#[test]
fn compute_copy_bytes_follow_the_compute_dtype() {
    assert_eq!(buffer(DType::F32).full_bytes(), 44);
    assert_eq!(buffer(DType::BF16).full_bytes(), 22);
}

/// An F8 element is one byte (a model's memory is counted from these sizes).
#[test]
fn inventory_dtypes_have_their_sizes() {
    use ragged::model::DType as D;
    let sizes = [
        (D::F8, 1),
        (D::BF16, 2),
        (D::F16, 2),
        (D::F32, 4),
        (D::F64, 8),
    ];
    for (d, size) in sizes {
        assert_eq!(d.size_in_bytes(), size, "{d:?}");
    }
}

/// Under `reshard_after_forward` the last stage's unit stays gathered into backward (its
/// backward runs next): every other unit is gathered twice a step, that one once. So the
/// collective bytes resharding adds to a step are less than one gather of every unit (which
/// freeing the last unit too, and gathering it again, would cost).
#[test]
fn resharding_keeps_the_last_stages_unit_gathered_into_backward() {
    use ragged::demo::{MlpConfig, MlpStages};
    let mlp = MlpConfig {
        width: 8,
        hidden: 16,
        layers: 3,
    };
    let params = mlp.init_params(5).unwrap();
    let run = |reshard: bool, overlap: bool| {
        let opts = FsdpOptions {
            reshard_after_forward: reshard,
            overlap,
            ..FsdpOptions::default()
        };
        ThreadWorld::run(2, |c| {
            let mut s = fully_shard(&params, adamw(), c, opts.clone())?;
            let all_units = s.stats().collective();
            s.unshard()?;
            let gather_all = s.stats().collective() - all_units;
            let mut t = fully_shard(&params, adamw(), c, opts.clone())?;
            let before = t.stats().collective();
            let batch = mlp.batch(0, 4)?;
            t.forward_backward(&MlpStages(mlp), &batch)?;
            Ok((t.stats().collective() - before, gather_all))
        })
        .unwrap()
        .remove(0)
    };
    for overlap in [false, true] {
        let (kept, gather_all) = run(false, overlap);
        let (resharded, _) = run(true, overlap);
        let extra = resharded - kept;
        assert!(
            0 < extra && extra < gather_all,
            "overlap {overlap}: resharding adds {extra} bytes, one gather of all is {gather_all}"
        );
    }
}

/// A second reduction before a step adds its result into the local gradient shard: one pass
/// over the shard, counted as accumulated bytes (4 per element of every unit's shard) on top of
/// what the backward itself accumulates.
#[test]
fn a_second_reduction_counts_its_pass_over_the_local_shard() {
    let params = vec![
        ("w".to_string(), ramp(&[5, 3], 0.5)),
        ("b".to_string(), ramp(&[7], -1.0)),
    ];
    let got = ThreadWorld::run(2, |c| {
        let mut s = fully_shard(&params, adamw(), c, FsdpOptions::default())?;
        let mut rounds = Vec::new();
        for _ in 0..2 {
            let before = s.stats().accumulated();
            let full = s.unshard()?;
            let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu)?;
            for t in full.values() {
                loss = (loss + (t * t)?.sum_all()?)?;
            }
            loss.backward()?;
            s.reduce_gradients()?;
            rounds.push(s.stats().accumulated() - before);
        }
        let mut shard = 0;
        s.with_local_grads(|_, g| shard += g.len())?;
        Ok((rounds, shard as u64))
    })
    .unwrap();
    for (rounds, shard) in got {
        assert_eq!(rounds[0], 4 * 22, "the backward adds each gradient once");
        assert_eq!(rounds[1], rounds[0] + 4 * shard);
    }
}

/// A gradient pool keeps at most [`GradPool::SPARE`] buffers: one more given back is dropped
/// (its memory returns), so the pool never holds more than the schedule has in flight.
#[test]
fn a_gradient_pool_keeps_at_most_its_spare_buffers() {
    let pool = GradPool::default();
    for k in 1..=GradPool::SPARE + 2 {
        pool.give_back(Placement::Cpu.zeros::<f32>(5).unwrap());
        assert_eq!(pool.spare_bytes(), 20 * k.min(GradPool::SPARE), "after {k}");
    }
}

/// A strided gradient (a transposed view) is made contiguous before it is added, and that copy
/// is counted as copied bytes; a contiguous one is added with no copy. Both count as
/// accumulated, and the slot holds their sum.
#[test]
fn a_strided_gradient_counts_its_contiguous_copy() {
    let stats = Arc::new(CopyStats::default());
    let sink = GradSink::new(vec![(0, 6)], 6, stats.clone()).unwrap();
    let plain = ramp(&[2, 3], 1.0);
    sink.accumulate(0, &plain).unwrap();
    assert_eq!((stats.copied(), stats.accumulated()), (0, 24));
    let strided = ramp(&[3, 2], 4.0).t().unwrap();
    assert!(!strided.is_contiguous());
    sink.accumulate(0, &strided).unwrap();
    assert_eq!((stats.copied(), stats.accumulated()), (24, 48));
    let want: Vec<f32> = (plain + strided)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let (buf, touched) = sink.take().unwrap();
    assert_eq!(buf.cpu().unwrap(), &want[..]);
    assert_eq!(touched, [true]);
}
