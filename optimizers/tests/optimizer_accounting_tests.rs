//! Accounting of the optimizers: checkpoint fields that reshard exactly between world sizes,
//! Muon's root assignment and its routes when one root gathers several matrices, role
//! settings, learning-rate changes of Muon's fallback, 8-bit state sizes, and the breach
//! count of `ragged validate`.

use ragged::checkpoint::{CheckpointState, FieldData, FieldDataMut, FieldLayout};
use ragged::comm::threads::ThreadWorld;
use ragged::comm::{Communicator, SingleRank};
use ragged::model::{TensorSpec, Unit};
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::PlanOptions;
use ragged::{RoleRule, RoleSettings};
use ragged_optimizers::validate::{LayoutKind, MeshCheck, ValidateReport};
use ragged_optimizers::{
    Adam8bit, Adam8bitConfig, AdamState, AdamW, AdamWConfig, LrScale, MatrixLayout, Muon,
    MuonConfig, NsConfig, NsPrecision, Shampoo,
};

mod harness;
use harness::{
    bits, data, fsdp2_shards, gather, loud_shampoo, numels, planned_shards, scatter, specs,
    whole_shard_by,
};

fn whole<O: Optimizer>(opt: &O, specs: &[TensorSpec]) -> LocalShard {
    whole_shard_by(specs, &|t| opt.atomic_block(&t.name, &t.shape))
}

// ---------------------------------------------------------------------------------------------
// 1. Checkpoint fields reshard exactly
// ---------------------------------------------------------------------------------------------

/// One field's global arrays, per parameter, as bit patterns (`f32` bits, `u16`, `u8`).
type Global = Vec<Vec<u32>>;

fn field_bits(d: &FieldData<'_>) -> Vec<u32> {
    let all = 0..d.len();
    match d {
        FieldData::F32(x) => x.read(all).unwrap().iter().map(|x| x.to_bits()).collect(),
        FieldData::U16(x) => x.read(all).unwrap().iter().map(|&x| x.into()).collect(),
        FieldData::U8(x) => x.read(all).unwrap().iter().map(|&x| x.into()).collect(),
    }
}

/// Every rank's state written into global per-parameter arrays through the checkpoint
/// layout, field by field (name, arrays); asserts that the ranks agree on every global
/// length and that every global element is written exactly once.
fn save<O: CheckpointState>(
    opt: &O,
    shards: &[LocalShard],
    states: &[O::State],
) -> Vec<(&'static str, Global)> {
    let layouts: Vec<Vec<FieldLayout>> = shards
        .iter()
        .map(|s| opt.state_layout(s).unwrap())
        .collect();
    let mut out = Vec::new();
    for (f, first) in layouts[0].iter().enumerate() {
        // A rank reports a packed field's global length for the parameters it holds (0 for
        // the others); the ranks that report one agree on it.
        let lens: Vec<usize> = (0..first.global_len.len())
            .map(|k| layouts.iter().map(|l| l[f].global_len[k]).max().unwrap())
            .collect();
        let mut global: Global = lens.iter().map(|&n| vec![0; n]).collect();
        let mut written: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0; n]).collect();
        for ((layout, state), shard) in layouts.iter().zip(states).zip(shards) {
            let field = &layout[f];
            assert_eq!(field.name, first.name, "field order differs between ranks");
            for (k, &n) in field.global_len.iter().enumerate() {
                assert!(
                    n == lens[k] || (n == 0 && !field.spans.iter().any(|s| s.param == k)),
                    "rank {}: field {} gives parameter {k} {n} elements, another rank {}",
                    shard.rank,
                    field.name,
                    lens[k]
                );
            }
            let data = opt.state_data(state).unwrap();
            let local = field_bits(&data[f]);
            assert_eq!(local.len(), field.local_len, "field {}", field.name);
            for span in &field.spans {
                let n = span.global.len();
                assert!(
                    span.global.end <= lens[span.param],
                    "field {}: span {:?} beyond global length {}",
                    field.name,
                    span.global,
                    lens[span.param]
                );
                global[span.param][span.global.clone()]
                    .copy_from_slice(&local[span.local..span.local + n]);
                for w in &mut written[span.param][span.global.clone()] {
                    *w += 1;
                }
            }
        }
        assert!(
            written.iter().flatten().all(|&w| w == 1),
            "field {}: every global element written exactly once",
            first.name
        );
        out.push((first.name, global));
    }
    out
}

/// Fresh states of `shards` filled from `saved` through the checkpoint layout, at `step`.
fn load<O: CheckpointState>(
    opt: &O,
    shards: &[LocalShard],
    saved: &[(&'static str, Global)],
    step: u64,
) -> Vec<O::State> {
    shards
        .iter()
        .map(|shard| {
            let layout = opt.state_layout(shard).unwrap();
            let mut state = opt.init(shard).unwrap();
            {
                let mut data = opt.state_data_mut(&mut state).unwrap();
                for ((field, d), (name, global)) in layout.iter().zip(&mut data).zip(saved) {
                    assert_eq!(field.name, *name);
                    for span in &field.spans {
                        let src = &global[span.param][span.global.clone()];
                        let at = span.local..span.local + src.len();
                        let filled = match d {
                            FieldDataMut::F32(x) => x.fill(at, |x| {
                                let bits = src.iter().map(|&b| f32::from_bits(b));
                                x.iter_mut().zip(bits).for_each(|(x, b)| *x = b);
                                Ok(())
                            }),
                            FieldDataMut::U16(x) => x.fill(at, |x| {
                                x.iter_mut().zip(src).for_each(|(x, &b)| *x = b as u16);
                                Ok(())
                            }),
                            FieldDataMut::U8(x) => x.fill(at, |x| {
                                x.iter_mut().zip(src).for_each(|(x, &b)| *x = b as u8);
                                Ok(())
                            }),
                        };
                        filled.unwrap();
                    }
                }
            }
            opt.set_state_step(&mut state, step);
            state
        })
        .collect()
}

/// `steps` steps of every rank (no communication: element and block optimizers).
fn run<O: Optimizer>(
    opt: &O,
    shards: &[LocalShard],
    params: &mut [Vec<f32>],
    states: &mut [O::State],
    grads: &[Vec<Vec<f32>>],
) {
    for g in grads {
        for ((shard, p), s) in shards.iter().zip(params.iter_mut()).zip(states.iter_mut()) {
            let local = scatter(shard, g);
            opt.step_slices(s, shard, p, &local, &SingleRank).unwrap();
        }
    }
}

/// Steps at world `a`, saves the state's checkpoint fields, loads them at world `b` and
/// steps on: the parameters and every saved field equal an uninterrupted unsharded run's,
/// bit for bit.
fn reshard_continues_bitwise<O: CheckpointState>(opt: &O, spec: &[TensorSpec], a: usize, b: usize) {
    let n = numels(spec);
    let (p0, grads) = data(spec, 5, 0xC0FFEE);
    let (before, after) = grads.split_at(3);
    let opts = PlanOptions::default();

    // Uninterrupted, unsharded.
    let one = vec![whole(opt, spec)];
    let mut p_one = vec![scatter(&one[0], &p0)];
    let mut s_one = vec![opt.init(&one[0]).unwrap()];
    run(opt, &one, &mut p_one, &mut s_one, &grads);
    let want_p = gather(&one, &p_one, &n);
    let want_fields = save(opt, &one, &s_one);

    // World a, then world b.
    let sa = planned_shards(opt, spec, a, &opts);
    let mut pa: Vec<Vec<f32>> = sa.iter().map(|s| scatter(s, &p0)).collect();
    let mut sta: Vec<O::State> = sa.iter().map(|s| opt.init(s).unwrap()).collect();
    run(opt, &sa, &mut pa, &mut sta, before);
    let step = opt.state_step(&sta[0]);
    assert_eq!(step, before.len() as u64);
    let saved = save(opt, &sa, &sta);
    let mid = gather(&sa, &pa, &n);

    let sb = planned_shards(opt, spec, b, &opts);
    let mut pb: Vec<Vec<f32>> = sb.iter().map(|s| scatter(s, &mid)).collect();
    let mut stb = load(opt, &sb, &saved, step);
    for s in &stb {
        assert_eq!(
            opt.state_step(s),
            step,
            "the loaded state resumes at its step"
        );
    }
    run(opt, &sb, &mut pb, &mut stb, after);
    let got_p = gather(&sb, &pb, &n);
    for (k, t) in spec.iter().enumerate() {
        assert_eq!(
            bits(&got_p[k]),
            bits(&want_p[k]),
            "{} after resharding {a} -> {b} ranks",
            t.name
        );
    }
    let got_fields = save(opt, &sb, &stb);
    for ((name, got), (_, want)) in got_fields.iter().zip(&want_fields) {
        assert!(
            got == want,
            "field {name} after resharding {a} -> {b} ranks"
        );
    }
}

/// 8-bit Adam's checkpoint fields (codes, both scale arrays, fallback `m32`/`v32` of
/// parameters split over ranks) carry a run from one world size to another exactly.
#[test]
fn adam8bit_state_reshards_through_its_checkpoint_fields() {
    let spec = specs(&[
        ("w", &[160, 64]),
        ("experts", &[2, 64, 32]),
        ("tok_embed", &[600, 40]),
        ("bias", &[70]),
        ("odd", &[21, 9]),
    ]);
    let opt = Adam8bit::new(Adam8bitConfig {
        adam: AdamWConfig {
            lr: 0.02,
            beta1: 0.8,
            beta2: 0.9,
            weight_decay: 0.1,
            ..AdamWConfig::default()
        },
        ..Adam8bitConfig::default()
    })
    .unwrap();
    // A fallback parameter is split over ranks in these layouts.
    let opts = PlanOptions::default();
    for world in [3, 2] {
        let shards = planned_shards(&opt, &spec, world, &opts);
        let holders = |name: &str| {
            shards
                .iter()
                .filter(|s| {
                    s.pieces
                        .iter()
                        .any(|p| s.params[p.param].name == name && !p.range.is_empty())
                })
                .count()
        };
        assert!(
            ["tok_embed", "bias", "odd"].iter().any(|n| holders(n) > 1),
            "world {world}: some fallback parameter is split"
        );
    }
    reshard_continues_bitwise(&opt, &spec, 3, 2);
    reshard_continues_bitwise(&opt, &spec, 2, 3);
}

/// Shampoo's packed factors and roots (row blocks that end in a short tail block, column
/// chunks) and its step count carry a run from one world size to another exactly.
#[test]
fn shampoo_state_reshards_through_its_checkpoint_fields() {
    let spec = specs(&[("w", &[21, 10]), ("v", &[13]), ("x", &[9, 1])]);
    let opt = Shampoo::new(loud_shampoo()).unwrap();
    reshard_continues_bitwise(&opt, &spec, 3, 2);
    reshard_continues_bitwise(&opt, &spec, 1, 4);
}

/// AdamW's `m`, `v` and step carry a run from one world size to another exactly.
#[test]
fn adamw_state_reshards_through_its_checkpoint_fields() {
    let spec = specs(&[("w", &[12, 7]), ("b", &[5])]);
    let opt = AdamW::new(AdamWConfig {
        lr: 0.01,
        ..AdamWConfig::default()
    })
    .unwrap();
    reshard_continues_bitwise(&opt, &spec, 2, 3);
}

// ---------------------------------------------------------------------------------------------
// 2. Muon: roots and routes
// ---------------------------------------------------------------------------------------------

fn muon(config: MuonConfig) -> Muon {
    Muon::new(config).unwrap()
}

/// Every rank stepping `opt` on its own thread; the global parameters.
fn muon_world(
    opt: &Muon,
    shards: &[LocalShard],
    p0: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
    n: &[usize],
) -> Vec<Vec<f32>> {
    let ps: Vec<Vec<f32>> = ThreadWorld::run(shards.len(), |comm| {
        let shard = &shards[comm.rank()];
        let mut p = scatter(shard, p0);
        let mut st = opt.init(shard)?;
        for g in grads {
            let g = scatter(shard, g);
            opt.step_slices(&mut st, shard, &mut p, &g, comm)?;
        }
        Ok(p)
    })
    .unwrap();
    gather(shards, &ps, n)
}

/// A rank that roots several split matrices, each gathered from several peers (FSDP2's
/// `Shard(0)` over 3 ranks, six equal matrices: two per root), still orthogonalizes each one
/// whole: the sharded step equals the unsharded step bit for bit.
#[test]
fn a_root_of_several_matrices_from_several_peers_steps_like_unsharded() {
    let names: Vec<String> = (0..6).map(|k| format!("layer.w{k}")).collect();
    let shapes: [&[usize]; 6] = [&[12, 8]; 6];
    let tensors: Vec<(&str, &[usize])> = names.iter().map(|s| s.as_str()).zip(shapes).collect();
    let spec = specs(&tensors);
    let n = numels(&spec);
    let opt = muon(MuonConfig {
        lr: 0.05,
        momentum: 0.9,
        ..MuonConfig::default()
    });
    let (p0, grads) = data(&spec, 3, 11);
    let want = muon_world(&opt, &[whole(&opt, &spec)], &p0, &grads, &n);
    for world in [3, 4] {
        let shards = fsdp2_shards(&spec, world);
        let roots = opt.roots(&shards[0]);
        let busiest = (0..world)
            .map(|r| roots.rooted_here(r).count())
            .max()
            .unwrap();
        assert!(busiest >= 2, "world {world}: a rank roots two matrices");
        let got = muon_world(&opt, &shards, &p0, &grads, &n);
        for k in 0..spec.len() {
            assert_eq!(
                bits(&got[k]),
                bits(&want[k]),
                "{} at world {world}",
                names[k]
            );
        }
    }
}

/// Root assignment: a split matrix goes to the least-loaded of its holders, where matrices
/// held whole by one rank are charged to it first, and a tie goes to the lower rank.
#[test]
fn split_matrices_root_on_the_least_loaded_holder_ties_to_the_lower_rank() {
    let opt = muon(MuonConfig {
        layout: MatrixLayout::Split,
        ..MuonConfig::default()
    });
    // FSDP2 over 2 ranks: experts 0 and 1 whole on rank 0, expert 2 whole on rank 1; "w" split.
    let spec = specs(&[("experts", &[3, 16, 16]), ("w", &[16, 16])]);
    let shards = fsdp2_shards(&spec, 2);
    let roots = opt.roots(&shards[0]);
    let cost = roots.jobs[0].cost;
    assert!(roots.jobs.iter().all(|j| j.cost == cost));
    let w = roots.jobs.iter().find(|j| j.split).expect("w is split");
    assert_eq!(w.root, 1, "rank 1 holds one whole expert, rank 0 two");
    assert_eq!(roots.load, vec![2 * cost, 2 * cost]);
    for s in &shards[1..] {
        assert_eq!(opt.roots(s), roots, "every rank computes the same roots");
    }

    // Two equal split matrices, nothing whole: the first to rank 0 (tie), the second to 1.
    let spec = specs(&[("a", &[16, 16]), ("b", &[16, 16])]);
    let shards = fsdp2_shards(&spec, 2);
    let roots = opt.roots(&shards[0]);
    let got: Vec<(bool, usize)> = roots.jobs.iter().map(|j| (j.split, j.root)).collect();
    assert_eq!(got, vec![(true, 0), (true, 1)]);
    let c = roots.jobs[0].cost;
    assert_eq!(roots.load, vec![c, c]);
}

/// A layout's wire cost is the module's byte model: every padding element rides in the
/// all-gather and the reduce-scatter to the `V − 1` other ranks, and every element not on its
/// root travels there and back; `moved` is what the roots of the planned shard move.
#[test]
fn layout_cost_counts_padding_and_both_trips_of_moved_elements() {
    let opts = PlanOptions {
        coll_align: 1,
        ..PlanOptions::default()
    };
    let spec = specs(&[("w_big", &[64, 64]), ("b", &[100]), ("w_small", &[8, 8])]);
    let unit = Unit {
        name: "unit".into(),
        tensors: spec.iter().collect(),
    };
    // Moved elements travel in f32, or in bf16 when Newton–Schulz runs in bf16.
    let layouts = [MatrixLayout::Split, MatrixLayout::Auto, MatrixLayout::Whole];
    let precisions = [(NsPrecision::F32, 4), (NsPrecision::Bf16, 2)];
    for (layout, (precision, route)) in layouts.into_iter().flat_map(|l| precisions.map(|p| (l, p)))
    {
        for world in [3, 8] {
            let opt = muon(MuonConfig {
                layout,
                ns: NsConfig {
                    precision,
                    ..NsConfig::default()
                },
                ..MuonConfig::default()
            });
            let (plan, report) = opt.plan_layout(&unit, world, &opts).unwrap();
            let v = world as u64;
            let (pad, moved) = (report.padding as u64, report.moved as u64);
            assert_eq!(report.route_elem_bytes, route);
            assert_eq!(
                report.cost_bytes(),
                4 * 2 * (v - 1) * pad + route * 2 * moved
            );
            let shard = LocalShard::from_plan(&plan, 0).unwrap();
            assert_eq!(opt.roots(&shard).moved_elems(&shard), report.moved);
            if layout == MatrixLayout::Split {
                assert!(report.moved > 0, "{report}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Rates: roles and learning-rate changes
// ---------------------------------------------------------------------------------------------

/// One unsharded run of `steps` steps; the global parameters.
fn steps_whole<O: Optimizer>(
    opt: &O,
    spec: &[TensorSpec],
    p0: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
) -> Vec<Vec<f32>> {
    let shard = vec![whole(opt, spec)];
    let mut p = vec![scatter(&shard[0], p0)];
    let mut s = vec![opt.init(&shard[0]).unwrap()];
    run(opt, &shard, &mut p, &mut s, grads);
    gather(&shard, &p, &numels(spec))
}

/// The `Matrix` role's learning-rate scale multiplies Muon's rate for its matrices (update
/// and decay): Muon at `lr` with scale ½ steps a matrix exactly like Muon at `lr/2`.
#[test]
fn the_matrix_roles_lr_scale_scales_muons_rate() {
    let spec = specs(&[("w", &[12, 8])]);
    let (p0, grads) = data(&spec, 2, 5);
    let base = MuonConfig {
        lr: 0.04,
        weight_decay: 0.5,
        lr_scale: LrScale::MatchRmsAdamW,
        ..MuonConfig::default()
    };
    let scaled = MuonConfig {
        roles: RoleRule {
            matrix: RoleSettings {
                lr_scale: 0.5,
                weight_decay: None,
            },
            ..RoleRule::default()
        },
        ..base.clone()
    };
    let half = MuonConfig {
        lr: 0.02,
        ..base.clone()
    };
    let got = steps_whole(&muon(scaled), &spec, &p0, &grads);
    let want = steps_whole(&muon(half), &spec, &p0, &grads);
    assert_eq!(bits(&got[0]), bits(&want[0]));
    let full = steps_whole(&muon(base), &spec, &p0, &grads);
    assert_ne!(bits(&full[0]), bits(&want[0]), "the scale matters");
}

/// A role's weight decay replaces AdamW's for that role only: element-wise parameters with
/// role decay 0 step like AdamW without decay, matrices keep the configured decay.
#[test]
fn a_roles_weight_decay_replaces_adamws_for_that_role() {
    let spec = specs(&[("w", &[6, 5]), ("bias", &[9])]);
    let (p0, grads) = data(&spec, 3, 9);
    let c = AdamWConfig {
        lr: 0.05,
        weight_decay: 0.4,
        ..AdamWConfig::default()
    };
    let roles = RoleRule {
        element_wise: RoleSettings {
            lr_scale: 1.0,
            weight_decay: Some(0.0),
        },
        ..RoleRule::default()
    };
    let got = steps_whole(
        &AdamW::new(AdamWConfig { roles, ..c }).unwrap(),
        &spec,
        &p0,
        &grads,
    );
    let decayed = steps_whole(&AdamW::new(c).unwrap(), &spec, &p0, &grads);
    let plain = steps_whole(
        &AdamW::new(AdamWConfig {
            weight_decay: 0.0,
            ..c
        })
        .unwrap(),
        &spec,
        &p0,
        &grads,
    );
    assert_eq!(bits(&got[0]), bits(&decayed[0]), "the matrix keeps wd 0.4");
    assert_eq!(bits(&got[1]), bits(&plain[1]), "the bias has wd 0");
    assert_ne!(bits(&plain[1]), bits(&decayed[1]), "the decay matters");
}

/// Muon's `set_learning_rate` moves the AdamW fallback's rate in proportion to the configured
/// rates, also after passing through 0 (a warm-up from 0): the fallback parameters then step
/// exactly like an AdamW at that proportional rate.
#[test]
fn muon_learning_rate_changes_keep_the_fallback_in_proportion() {
    let adamw = AdamWConfig {
        lr: 0.004,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let mut opt = muon(MuonConfig {
        lr: 0.02,
        adamw,
        ..MuonConfig::default()
    });
    opt.set_learning_rate(0.01).unwrap();
    assert_eq!(opt.config().adamw.lr, 0.004 * (0.01 / 0.02));
    opt.set_learning_rate(0.0).unwrap();
    assert_eq!(opt.config().adamw.lr, 0.0);
    opt.set_learning_rate(0.04).unwrap();
    let want_rate = 0.004 * (0.04 / 0.02);
    assert_eq!(opt.config().adamw.lr, want_rate);
    assert_eq!(opt.learning_rate(), Some(0.04));

    let spec = specs(&[("bias", &[17]), ("norm.weight", &[4, 6])]);
    let (p0, grads) = data(&spec, 2, 21);
    let got = steps_whole(&opt, &spec, &p0, &grads);
    let reference = AdamW::new(AdamWConfig {
        lr: want_rate,
        ..adamw
    })
    .unwrap();
    let want = steps_whole(&reference, &spec, &p0, &grads);
    for k in 0..spec.len() {
        assert_eq!(bits(&got[k]), bits(&want[k]), "{}", spec[k].name);
    }
}

// ---------------------------------------------------------------------------------------------
// 4. 8-bit state size
// ---------------------------------------------------------------------------------------------

/// `state_bytes` counts one byte per code, two per 16-bit scale and four per fallback `f32`,
/// and is the serialized size less its 32-byte header.
#[test]
fn adam8bit_state_bytes_count_codes_scales_and_fallback_moments() {
    let spec = specs(&[("w", &[64, 64]), ("bias", &[33])]);
    let opt = Adam8bit::new(Adam8bitConfig::default()).unwrap();
    let shard = whole(&opt, &spec);
    let mut state = opt.init(&shard).unwrap();
    let (p0, grads) = data(&spec, 1, 3);
    let mut p = scatter(&shard, &p0);
    opt.step_slices(
        &mut state,
        &shard,
        &mut p,
        &scatter(&shard, &grads[0]),
        &SingleRank,
    )
    .unwrap();
    let scales = 64 * 64 / 256;
    assert_eq!(state.scale_m.len(), scales);
    assert_eq!(state.m32.len(), 33);
    let want = 2 * shard.len + 2 * 2 * scales + 2 * 4 * 33;
    assert_eq!(state.state_bytes(), want);
    assert_eq!(state.to_le_bytes().unwrap().len(), 32 + want);
    let adam = AdamState::zeros(shard.len);
    assert_eq!(adam.to_le_bytes().unwrap().len(), 16 + 8 * shard.len);
}

// ---------------------------------------------------------------------------------------------
// 5. `ragged validate`'s verdict
// ---------------------------------------------------------------------------------------------

/// A mesh-invariance mismatch of an optimizer state is a breach (one per unit, layout and world) of the contract, counted like a
/// sharded parameter that differs from the unsharded run.
#[test]
fn a_mesh_mismatch_is_counted_as_a_breach() {
    let mut report = ValidateReport::default();
    let check = |world, differs: &[&str]| MeshCheck {
        unit: "unit".into(),
        layout: LayoutKind::Ragged,
        world,
        differs: differs.iter().map(|d| d.to_string()).collect(),
    };
    report.mesh.push(check(2, &[]));
    assert_eq!(report.breaches(), 0);
    report.mesh.push(check(3, &["m of w", "v of w"]));
    assert_eq!(report.breaches(), 1);
}
