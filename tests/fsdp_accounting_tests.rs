//! What `ShardedModel` accumulates, counts and agrees on between a backward and a step:
//! gradients over several backwards and several reductions, a non-finite loss on one rank,
//! skipped steps, clipping below the threshold and above it (torch's `max_norm / (norm + 1e-6)`,
//! a NaN norm from a non-finite gradient), the padding of a reused gradient buffer, discarded
//! gradients, the default reduction (an average in rank order), plans that differ between
//! ranks, a role's weight decay under AdamW, and the optimizer's events summed over ranks.
//! Each test was written
//! against a mutation of the runtime that no other test caught (an overwrite instead of an
//! add, a rank deciding alone, ...) and fails on it.

use candle_core::{DType, Device, Tensor};
use ragged::comm::threads::ThreadWorld;
use ragged::comm::{Communicator, SingleRank};
use ragged::fsdp::{fully_shard, FsdpOptions, NonFinitePolicy, ShardedModel};
use ragged::optim::Optimizer;
use ragged::plan::{Order, PlanOptions};
use ragged::roles::{Role, RoleFn, RoleRule, RoleSettings};
use ragged_optimizers::shampoo::ROOT_FAILURES;
use ragged_optimizers::{AdamW, AdamWConfig, Shampoo, ShampooConfig};

mod common;
use common::{adamw, local_grads};

fn ones(name: &str, shape: &[usize]) -> (String, Tensor) {
    let t = Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap();
    (name.to_string(), t)
}

/// `w` (16×20) and `b` (20), all ones: 340 elements.
fn params() -> Vec<(String, Tensor)> {
    vec![ones("w", &[16, 20]), ones("b", &[20])]
}

/// A backward of `Σ c·p` over every parameter: each gradient element is `c` (per rank; the
/// reduction averages equal values, so it stays `c`).
fn backward<O: Optimizer>(s: &mut ShardedModel<'_, O>, c: f64) -> ragged::Result<()> {
    let full = s.unshard()?;
    let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu)?;
    for t in full.values() {
        loss = (loss + (t * c)?.sum_all()?)?;
    }
    loss.backward()?;
    Ok(())
}

fn skip_step() -> FsdpOptions {
    FsdpOptions {
        non_finite: NonFinitePolicy::SkipStep,
        ..FsdpOptions::default()
    }
}

/// Two reductions before one step add up (gradient accumulation across micro-batches that each
/// reduce), at one rank (the shard adopted as the local gradient) and several.
#[test]
fn two_reductions_before_a_step_accumulate() {
    for world in [1, 2, 3] {
        ThreadWorld::run(world, |c| {
            let mut s = fully_shard(&params(), adamw(), c, FsdpOptions::default())?;
            backward(&mut s, 3.0)?;
            s.reduce_gradients()?;
            backward(&mut s, 5.0)?;
            s.reduce_gradients()?;
            let g = local_grads(&s);
            assert!(!g.is_empty() || c.rank() > 0);
            assert!(g.iter().all(|&x| x == 8.0), "V={world}: {g:?}");
            Ok(())
        })
        .unwrap();
    }
}

/// Two backwards before one reduction add up in the gradient sink.
#[test]
fn two_backwards_before_a_reduction_accumulate() {
    for world in [1, 2] {
        ThreadWorld::run(world, |c| {
            let mut s = fully_shard(&params(), adamw(), c, FsdpOptions::default())?;
            backward(&mut s, 3.0)?;
            backward(&mut s, 5.0)?;
            s.reduce_gradients()?;
            let g = local_grads(&s);
            assert!(g.iter().all(|&x| x == 8.0), "V={world}: {g:?}");
            Ok(())
        })
        .unwrap();
    }
}

/// A NaN loss noted on one rank only skips the step on every rank (the flag is all-reduced),
/// and a skipped step is not a step taken (the schedule does not move).
#[test]
fn a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank() {
    let counts = ThreadWorld::run(2, |c| {
        let mut s = fully_shard(&params(), adamw(), c, skip_step())?;
        backward(&mut s, 1.0)?;
        s.reduce_gradients()?;
        if c.rank() == 1 {
            s.note_loss(f32::NAN);
        }
        s.step()?;
        let untouched = s.full_params()?.values().flatten().all(|&x| x == 1.0);
        Ok((s.skipped_steps(), s.steps_taken(), untouched))
    })
    .unwrap();
    assert_eq!(counts, vec![(1, 0, true), (1, 0, true)]);
    let mut s = fully_shard(&params(), adamw(), &SingleRank, skip_step()).unwrap();
    backward(&mut s, 1.0).unwrap();
    s.reduce_gradients().unwrap();
    s.note_loss(f32::INFINITY);
    s.step().unwrap();
    assert_eq!((s.skipped_steps(), s.steps_taken()), (1, 0));
}

/// A threshold above the norm returns the norm and leaves every gradient bitwise as it was
/// (torch's `clip_grad_norm_` scales by `min(1, max/norm)`, never up).
#[test]
fn clipping_below_the_threshold_changes_no_gradient() {
    let mut s = fully_shard(&params(), adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    backward(&mut s, 3.0).unwrap();
    s.reduce_gradients().unwrap();
    let norm = s.clip_grad_norm(1e3).unwrap();
    // 340 gradients of 3: the f32 norm is within a few ulps of 3·√340.
    assert!((norm - 3.0 * 340f32.sqrt()).abs() < 1e-3, "{norm}");
    assert!(local_grads(&s).iter().all(|&x| x == 3.0));
}

/// The padding of a gradient buffer is zero after every reduction, also when the pool hands a
/// unit the buffer another unit used (both units' full buffers have 384 elements at V = 2):
/// clipping and the non-finite check read the whole local shard, padding included.
#[test]
fn the_padding_of_a_reused_gradient_buffer_reads_zero() {
    let ps = vec![ones("layers.0.w", &[5, 60]), ones("layers.1.w", &[4, 65])];
    ThreadWorld::run(2, |c| {
        let mut s = fully_shard(&ps, adamw(), c, FsdpOptions::default())?;
        for step in 0..3 {
            let full = s.unshard()?;
            let loss = ((&full["layers.0.w"] * 3.0)?.sum_all()?
                + (&full["layers.1.w"] * 5.0)?.sum_all()?)?;
            loss.backward()?;
            s.reduce_gradients()?;
            s.with_local_grads(|local, g| {
                let mut covered = vec![false; g.len()];
                for p in &local.pieces {
                    covered[p.offset..p.offset + p.range.len()].fill(true);
                }
                let stale: Vec<f32> = (0..g.len())
                    .filter(|&i| !covered[i] && g[i] != 0.0)
                    .map(|i| g[i])
                    .collect();
                assert!(stale.is_empty(), "step {step}: padding holds {stale:?}");
            })?;
            s.step()?;
        }
        Ok(())
    })
    .unwrap();
}

/// Ranks whose plans differ (here by the tensor order each was allowed) refuse to train, each
/// with an error naming the plan, instead of gathering each other's shards in other layouts.
#[test]
fn ranks_with_different_plans_refuse_to_train() {
    // `b` registered first, `w` larger: module order puts `b` first, shape order `w`.
    let ps = vec![ones("b", &[20]), ones("w", &[16, 20])];
    let errors = ThreadWorld::run(2, |c| {
        let order = if c.rank() == 1 {
            Order::Shape
        } else {
            Order::Module
        };
        let opts = FsdpOptions {
            plan: PlanOptions {
                orders: vec![order],
                ..PlanOptions::default()
            },
            ..FsdpOptions::default()
        };
        Ok(fully_shard(&ps, adamw(), c, opts)
            .err()
            .map(|e| e.to_string()))
    })
    .unwrap();
    for e in &errors {
        let e = e.as_ref().expect("ranks with different plans must refuse");
        assert!(e.contains("the plan"), "{e}");
    }
}

/// A role's weight decay replaces AdamW's own: with a zero gradient only decay moves a
/// parameter, so `b` (element-wise, decay 0) stays 1 and `w` (matrix, decay 0.5) becomes
/// `1 − lr·wd = 0.95`.
#[test]
fn adamw_takes_a_roles_weight_decay() {
    let f: RoleFn = |name, _| {
        Some(if name == "b" {
            Role::ElementWise
        } else {
            Role::Matrix
        })
    };
    let roles = RoleRule {
        element_wise: RoleSettings {
            lr_scale: 1.0,
            weight_decay: Some(0.0),
        },
        ..RoleRule::with_fn(f)
    };
    let opt = AdamW::new(AdamWConfig {
        lr: 0.1,
        weight_decay: 0.5,
        roles,
        ..AdamWConfig::default()
    })
    .unwrap();
    let mut s = fully_shard(&params(), opt, &SingleRank, FsdpOptions::default()).unwrap();
    let full = s.unshard().unwrap();
    let zero = ((&full["w"] * 0.0).unwrap().sum_all().unwrap()
        + (&full["b"] * 0.0).unwrap().sum_all().unwrap())
    .unwrap();
    zero.backward().unwrap();
    s.reduce_gradients().unwrap();
    s.step().unwrap();
    let p = s.full_params().unwrap();
    assert!(
        p["b"].iter().all(|&x| x == 1.0),
        "b decayed: {:?}",
        &p["b"][..3]
    );
    assert!(
        p["w"].iter().all(|&x| x == 0.95f32),
        "w: {:?}",
        &p["w"][..3]
    );
}

/// Shampoo's roots that cannot be computed (factors overflowing on gradients of 1e21) are
/// counted by the ranks holding their blocks; `optimizer_events` sums them over units and
/// ranks, the same total on every rank (a rank-local sum, or one rank's, would differ: the
/// blocks are spread over the ranks).
#[test]
fn optimizer_events_sum_every_ranks_counts() {
    let config = ShampooConfig {
        max_preconditioner_dim: 4,
        precondition_frequency: 1,
        start_preconditioning_step: Some(1),
        ..ShampooConfig::default()
    };
    let params = vec![ones("a", &[8, 8]), ones("b", &[8, 12]), ones("c", &[12, 8])];
    let out = ThreadWorld::run(3, |c| {
        let opt = Shampoo::new(config)?;
        let mut m = fully_shard(&params, opt, c, FsdpOptions::default())?;
        assert_eq!(m.optimizer_events()?, vec![(ROOT_FAILURES, 0)]);
        backward(&mut m, 1e21)?;
        m.reduce_gradients()?;
        m.step()?;
        let mine: u64 = m.states().iter().map(|s| s.root_failures).sum();
        Ok((m.optimizer_events()?, mine))
    })
    .unwrap();
    let total: u64 = out.iter().map(|(_, mine)| mine).sum();
    assert!(
        out.iter().filter(|(_, mine)| *mine > 0).count() >= 2,
        "failures on one rank only: {out:?}"
    );
    for (events, _) in &out {
        assert_eq!(events, &vec![(ROOT_FAILURES, total)]);
    }
    // AdamW counts nothing.
    let m = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    assert_eq!(m.optimizer_events().unwrap(), vec![]);
}

/// One parameter `w`, a 4 × 4 matrix of ones: its gradient under `sum(w · c)` is `c` exactly.
fn ones_matrix_w() -> Vec<(String, Tensor)> {
    let w = Tensor::ones((4, 4), DType::F32, &Device::Cpu).unwrap();
    vec![("w".to_string(), w)]
}

/// The clip factor is torch's `max_norm / (norm + 1e-6)`, computed in f64 and applied as one
/// f32 multiply. With a small norm the `1e-6` matters: 16 gradients of 1e-4 have norm 4e-4
/// (exact: 16·g² and its square root are exact in f64), and a maximum of 1e-4 scales them by
/// 1e-4 / (4e-4 + 1e-6) ≈ 0.2494, not 0.25; each clipped gradient must be bitwise
/// `g · f32(factor)`, the factor derived here from the gradients, not from the returned norm.
#[test]
fn clipping_scales_by_max_norm_over_norm_plus_torchs_1e_minus_6() {
    let params = ones_matrix_w();
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let w = sharded.unshard().unwrap().remove("w").unwrap();
    (w * 1e-4).unwrap().sum_all().unwrap().backward().unwrap();
    sharded.reduce_gradients().unwrap();
    let mut before = Vec::new();
    sharded
        .with_local_grads(|_, g| before.extend_from_slice(g))
        .unwrap();
    // The local shard may hold zero padding after the 16 gradients.
    let g0 = before[0];
    assert!(g0 > 0.0);
    assert_eq!(before.iter().filter(|&&x| x == g0).count(), 16);
    assert!(before.iter().all(|&x| x == g0 || x == 0.0));
    let norm: f64 = before
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    let max_norm = 1e-4f32;
    let factor = (f64::from(max_norm) / (norm + 1e-6)) as f32;
    assert_ne!(
        factor,
        (f64::from(max_norm) / norm) as f32,
        "the 1e-6 matters"
    );
    let got = sharded.clip_grad_norm(max_norm).unwrap();
    assert_eq!(got, norm as f32);
    sharded
        .with_local_grads(|_, g| {
            for (i, (&a, &b)) in g.iter().zip(&before).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    (b * factor).to_bits(),
                    "element {i}: {a} vs {b}·{factor}"
                );
            }
        })
        .unwrap();
}

/// A non-finite gradient makes the norm NaN (whatever the finite ones sum to) and leaves every
/// gradient as it was, for the step's non-finite policy to see; a norm summed over the finite
/// elements only would look healthy and scale the others.
#[test]
fn a_non_finite_gradient_gives_a_nan_norm_and_no_scaling() {
    let params = ones_matrix_w();
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let w = sharded.unshard().unwrap().remove("w").unwrap();
    let mut c = vec![1e3f32; 16];
    c[5] = f32::NAN;
    let c = Tensor::from_vec(c, (4, 4), &Device::Cpu).unwrap();
    // d(sum(w·c))/dw = c, exactly.
    (w * c).unwrap().sum_all().unwrap().backward().unwrap();
    sharded.reduce_gradients().unwrap();
    let mut before = Vec::new();
    sharded
        .with_local_grads(|_, g| before.extend(g.iter().map(|x| x.to_bits())))
        .unwrap();
    assert_eq!(
        before.iter().filter(|&&b| f32::from_bits(b) == 1e3).count(),
        15
    );
    let norm = sharded.clip_grad_norm(1.0).unwrap();
    assert!(norm.is_nan(), "norm {norm}");
    sharded
        .with_local_grads(|_, g| {
            let after: Vec<u32> = g.iter().map(|x| x.to_bits()).collect();
            assert_eq!(after, before, "gradients changed");
        })
        .unwrap();
}

/// With the default options, reduced gradients are the rank-order average over ranks (torch
/// FSDP's mean), not the sum: rank r's gradient is the constant c_r, so every element the
/// ranks hold reduces to ((c_0 + c_1) + c_2) / 3 in f32, bitwise, and the padding to zero.
#[test]
fn default_options_average_gradients_over_ranks_in_rank_order() {
    let params = ones_matrix_w();
    let c = [0.1f32, 0.7, 1.3];
    let want = ((c[0] + c[1]) + c[2]) / 3.0;
    assert_ne!(want, (c[0] + c[1]) + c[2]);
    let held = ThreadWorld::run(3, |comm| {
        let mut sharded = fully_shard(&params, adamw(), comm, FsdpOptions::default())?;
        let w = sharded.unshard()?.remove("w").unwrap();
        // d(sum(w·c_r))/dw = c_r, exactly.
        (w * f64::from(c[comm.rank()]))?.sum_all()?.backward()?;
        sharded.reduce_gradients()?;
        let mut local = Vec::new();
        sharded.with_local_grads(|_, g| local.extend_from_slice(g))?;
        Ok(local)
    })
    .unwrap();
    let mut owned = 0;
    for (rank, g) in held.iter().enumerate() {
        for (i, &x) in g.iter().enumerate() {
            if x.to_bits() == want.to_bits() {
                owned += 1;
            } else {
                assert_eq!(x.to_bits(), 0, "rank {rank} element {i}: {x}, want {want}");
            }
        }
    }
    assert_eq!(owned, 16, "every element reduced once: {held:?}");
}

/// Gradients discarded before a step are gone: the next backward starts from zero, not from
/// the discarded values (the discarded buffer goes back to the pool and is handed out again,
/// so the first gradient into each tensor must overwrite, not accumulate).
#[test]
fn a_backward_after_discard_gradients_starts_from_zero() {
    let params = ones_matrix_w();
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let w = sharded.unshard().unwrap().remove("w").unwrap();
    (w * 3.0).unwrap().sum_all().unwrap().backward().unwrap();
    sharded.discard_gradients();
    let w = sharded.unshard().unwrap().remove("w").unwrap();
    (w * 0.5).unwrap().sum_all().unwrap().backward().unwrap();
    sharded.reduce_gradients().unwrap();
    let mut got = Vec::new();
    sharded
        .with_local_grads(|_, g| got.extend_from_slice(g))
        .unwrap();
    assert_eq!(got.iter().filter(|&&x| x == 0.5).count(), 16, "{got:?}");
    assert!(got.iter().all(|&x| x == 0.5 || x.to_bits() == 0), "{got:?}");
}
