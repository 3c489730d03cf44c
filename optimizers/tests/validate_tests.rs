//! `ragged_optimizers::validate` and the public scatter/gather of `LocalShard`: the validator
//! passes the real optimizers, catches an optimizer whose step depends on the world size, and
//! rejects bad input; scatter and gather are inverse and refuse inconsistent buffers.

use ragged::checkpoint::{CheckpointState, FieldData, FieldDataMut, FieldLayout};
use ragged::comm::Communicator;
use ragged::model::{DType, TensorSpec, Unit};
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::PlanOptions;
use ragged::{AtomicBlock, Result};
use ragged_optimizers::bench::OptimKind;
use ragged_optimizers::validate::{validate, validate_with, LayoutKind, ValidateConfig};
use ragged_optimizers::{AdamState, AdamW, AdamWConfig, Muon, MuonConfig, NsMethod};

mod harness;
use harness::default_ns_method;

/// `w.up` (192×64) takes Gram Newton–Schulz under Muon's default `NsMethod::Auto`, `w.q`
/// (64×96) the standard iteration, so the validator checks both methods.
fn specs() -> Vec<TensorSpec> {
    [
        ("w.q", vec![64, 96]),
        ("w.up", vec![192, 64]),
        ("norm", vec![64]),
    ]
    .into_iter()
    .map(|(n, s)| TensorSpec::new(n, &s, DType::F32).unwrap())
    .collect()
}

/// The one unit `u` holding `specs`.
fn unit_of(specs: &[TensorSpec]) -> Unit<'_> {
    Unit {
        name: "u".into(),
        tensors: specs.iter().collect(),
    }
}

fn config(optimizer: OptimKind) -> ValidateConfig {
    ValidateConfig {
        optimizer,
        worlds: vec![1, 2, 3, 8],
        layouts: vec![LayoutKind::Ragged, LayoutKind::Fsdp2],
        steps: 2,
        seed: 7,
        mesh_invariance: true,
    }
}

#[test]
fn the_real_optimizers_pass_and_the_checks_are_not_vacuous() {
    let specs = specs();
    // Muon's case runs both Newton–Schulz methods.
    assert_eq!(default_ns_method(64, 96), NsMethod::Standard);
    assert_eq!(default_ns_method(192, 64), NsMethod::Gram);
    let unit = unit_of(&specs);
    let kinds = [
        OptimKind::AdamW,
        OptimKind::Adam8bit,
        OptimKind::Muon,
        OptimKind::MuonBf16,
        OptimKind::Shampoo,
    ];
    for kind in kinds {
        let report = validate(std::slice::from_ref(&unit), &config(kind)).unwrap();
        assert_eq!(report.breaches(), 0, "{kind}: {report:?}");
        // Every parameter at every world of the ragged layout was compared.
        let ragged = report
            .sharded
            .iter()
            .filter(|c| c.layout == LayoutKind::Ragged)
            .count();
        assert_eq!(ragged, 3 * 4, "{kind}");
        if kind != OptimKind::Adam8bit {
            assert_eq!(report.reference.len(), 3, "{kind}");
            assert!(
                report.reference.iter().all(|r| r.max_rel > 0.0),
                "f32 vs f64 differ"
            );
        }
        // Every optimizer's state at every world of the ragged layout (and FSDP2's, where
        // the optimizer takes it) was compared, field by field.
        let ragged = report
            .mesh
            .iter()
            .filter(|m| m.layout == LayoutKind::Ragged);
        assert_eq!(ragged.count(), 4, "{kind}: {:?}", report.mesh);
    }
}

/// AdamW whose every step ends with `params` on the local parameters and `state` on its local
/// state: a layout dependence of the kind the contract forbids, planted to see the validation
/// catch it.
struct Tampered {
    adamw: AdamW,
    params: fn(&LocalShard, &mut [f32]),
    state: fn(&LocalShard, &mut AdamState),
}

/// Nudges the first local element by one ulp when the world has more than one rank.
fn nudge_first(shard: &LocalShard, x: &mut [f32]) {
    if let Some(p) = shard.pieces.first().filter(|_| shard.world > 1) {
        x[p.offset] = f32::from_bits(x[p.offset].to_bits() + 1);
    }
}

fn world_dependent() -> Tampered {
    Tampered {
        adamw: AdamW::new(AdamWConfig::default()).unwrap(),
        params: nudge_first,
        state: |_, _| {},
    }
}

/// The parameters agree; the second moment `v` does not (a state that only a later step, or a
/// resumed run, would reveal).
fn state_world_dependent() -> Tampered {
    Tampered {
        adamw: AdamW::new(AdamWConfig::default()).unwrap(),
        params: |_, _| {},
        state: |shard, s| {
            let v = s.v.cpu_mut().unwrap();
            nudge_first(shard, v)
        },
    }
}

impl Optimizer for Tampered {
    type State = AdamState;
    fn name(&self) -> &'static str {
        "tampered"
    }
    fn atomic_block(&self, _: &str, _: &[usize]) -> AtomicBlock {
        AtomicBlock::Element
    }
    fn init(&self, shard: &LocalShard) -> Result<AdamState> {
        self.adamw.init(shard)
    }
    fn step(
        &self,
        state: &mut AdamState,
        shard: &LocalShard,
        params: ragged::storage::ViewMut<'_, f32>,
        grads: ragged::storage::View<'_, f32>,
        comm: &dyn Communicator,
    ) -> Result<()> {
        let params = params.cpu("validate test")?;
        self.adamw.step(state, shard, params.into(), grads, comm)?;
        (self.params)(shard, params);
        (self.state)(shard, state);
        Ok(())
    }
}

impl CheckpointState for Tampered {
    fn state_layout(&self, shard: &LocalShard) -> Result<Vec<FieldLayout>> {
        self.adamw.state_layout(shard)
    }
    fn state_data<'a>(&self, state: &'a AdamState) -> Result<Vec<FieldData<'a>>> {
        self.adamw.state_data(state)
    }
    fn state_data_mut<'a>(&self, state: &'a mut AdamState) -> Result<Vec<FieldDataMut<'a>>> {
        self.adamw.state_data_mut(state)
    }
    fn state_step(&self, state: &AdamState) -> u64 {
        self.adamw.state_step(state)
    }
    fn set_state_step(&self, state: &mut AdamState, step: u64) {
        self.adamw.set_state_step(state, step)
    }
}

#[test]
fn a_world_dependent_step_is_a_breach_with_its_ulps() {
    let specs = specs();
    let unit = unit_of(&specs);
    let opt = world_dependent();
    let report = validate_with(&opt, &[unit], &config(OptimKind::AdamW)).unwrap();
    assert!(report.breaches() > 0);
    let bad: Vec<_> = report.sharded.iter().filter(|c| !c.bitwise).collect();
    assert!(bad
        .iter()
        .all(|c| c.world > 1 && c.max_ulp >= 1 && c.max_abs > 0.0));
    assert!(report
        .sharded
        .iter()
        .filter(|c| c.world == 1)
        .all(|c| c.bitwise));
}

/// The mesh check reads every state field in global order: a `v` that depends on the world
/// is a breach naming the field and parameter, though every parameter agrees bitwise.
#[test]
fn a_world_dependent_state_is_a_breach_naming_its_field() {
    let specs = specs();
    let unit = unit_of(&specs);
    let opt = state_world_dependent();
    let report = validate_with(&opt, &[unit], &config(OptimKind::AdamW)).unwrap();
    assert!(report.sharded.iter().all(|c| c.bitwise), "{report:?}");
    assert!(report.breaches() > 0);
    for m in &report.mesh {
        if m.world == 1 {
            assert!(m.differs.is_empty(), "{m:?}");
        } else {
            // Each rank's first piece: rank 0's is `w.q`'s, the others' some parameter's.
            assert!(!m.differs.is_empty(), "{m:?}");
            assert!(m.differs.iter().all(|d| d.starts_with("v of w.")), "{m:?}");
        }
    }
    let rendered = ragged_optimizers::validate::render(&report);
    assert!(rendered.contains("DIFFERENT: v of w.q"), "{rendered}");
}

#[test]
fn bad_configurations_are_rejected() {
    let specs = specs();
    let unit = unit_of(&specs);
    let units = [unit];
    let good = config(OptimKind::AdamW);
    for bad in [
        ValidateConfig {
            worlds: vec![],
            ..good.clone()
        },
        ValidateConfig {
            worlds: vec![2, 0],
            ..good.clone()
        },
        ValidateConfig {
            worlds: vec![1, 2, 1],
            ..good.clone()
        },
        ValidateConfig {
            steps: 0,
            ..good.clone()
        },
        ValidateConfig {
            layouts: vec![],
            ..good.clone()
        },
        ValidateConfig {
            layouts: vec![LayoutKind::Fsdp2, LayoutKind::Ragged, LayoutKind::Fsdp2],
            ..good.clone()
        },
    ] {
        assert!(validate(&units, &bad).is_err(), "{bad:?}");
    }
    // An 8-billion-element unit cannot fit in any machine's memory this runs on: refused
    // before its inputs are drawn (not an allocation abort), through both entry points.
    let big = TensorSpec::new("w.big", &[1 << 16, 1 << 17], DType::F32).unwrap();
    let huge = [Unit {
        name: "huge".into(),
        tensors: vec![&big],
    }];
    for err in [
        validate(&huge, &good).unwrap_err(),
        validate_with(&AdamW::default(), &huge, &good).unwrap_err(),
    ] {
        assert!(err.to_string().contains("available"), "{err}");
    }
    // Nothing to check is not a pass.
    assert!(validate(&[], &good).is_err());
    let empty = [Unit {
        name: "empty".into(),
        tensors: vec![],
    }];
    assert!(validate_with(&AdamW::default(), &empty, &good).is_err());
    assert!("zero3".parse::<LayoutKind>().is_err());
    assert!(ragged_optimizers::validate::scaled(&specs, 0).is_err());
}

#[test]
fn scatter_and_gather_are_inverse_and_refuse_inconsistent_buffers() {
    let specs = specs();
    let unit = unit_of(&specs);
    let opt = AdamW::new(AdamWConfig::default()).unwrap();
    let plan = opt.plan_unit(&unit, 3, &PlanOptions::default()).unwrap();
    let shards: Vec<LocalShard> = (0..3)
        .map(|r| LocalShard::from_plan(&plan, r).unwrap())
        .collect();
    let global: Vec<Vec<f32>> = specs
        .iter()
        .enumerate()
        .map(|(k, t)| (0..t.numel()).map(|i| (k * 10_000 + i) as f32).collect())
        .collect();
    let locals: Vec<Vec<f32>> = shards.iter().map(|s| s.scatter(&global).unwrap()).collect();
    let split = (0..specs.len())
        .filter(|&i| {
            shards
                .iter()
                .filter(|s| s.pieces.iter().any(|p| p.param == i))
                .count()
                > 1
        })
        .count();
    assert!(split >= 1, "some tensor is split across ranks");
    assert_eq!(LocalShard::gather(&shards, &locals).unwrap(), global);
    // A missing tensor, a short local buffer, a missing rank: errors, not panics.
    assert!(shards[0].scatter(&global[..2]).is_err());
    let mut short = locals.clone();
    short[1].pop();
    assert!(LocalShard::gather(&shards, &short).is_err());
    assert!(LocalShard::gather(&shards[..2], &locals[..2]).is_err());
    assert!(LocalShard::gather::<f32>(&[], &[]).is_err());
    // A hand-built shard whose piece runs past its buffer (the offset wraps when added to the
    // length): refused by scatter and gather alike.
    let mut wrapped = shards.clone();
    wrapped[0].pieces[0].offset = usize::MAX;
    assert!(wrapped[0].scatter(&global).is_err());
    assert!(LocalShard::gather(&wrapped, &locals).is_err());
}

/// Three Muon steps under `c` on one `shape` matrix from unsharded initial parameters:
/// `(p0, grads, final p)`. Gradient `s` samples a wave at `k·(s + 2) + shift·s`.
fn three_muon_steps(
    c: &MuonConfig,
    shape: [usize; 2],
    shift: usize,
) -> (Vec<f32>, Vec<Vec<f32>>, Vec<f32>) {
    use ragged::comm::SingleRank;
    let n = shape[0] * shape[1];
    let wave = |k: usize, s: f32| ((k * 7919 % 1013) as f32 / 1013.0 - 0.5) * s;
    let p0: Vec<f32> = (0..n).map(|k| 1.0 + wave(k, 1.0)).collect();
    let grads: Vec<Vec<f32>> = (0..3)
        .map(|s| (0..n).map(|k| wave(k * (s + 2) + shift * s, 1.0)).collect())
        .collect();
    let opt = Muon::new(c.clone()).unwrap();
    let spec = [TensorSpec::new("w", &shape, DType::F32).unwrap()];
    let shard = LocalShard::unsharded(
        spec.iter().map(|t| (t.name.as_str(), t.shape.as_slice())),
        &|name, shape| opt.atomic_block(name, shape),
    )
    .unwrap();
    let mut p = p0.clone();
    let mut state = opt.init(&shard).unwrap();
    for g in &grads {
        opt.step_slices(&mut state, &shard, &mut p, g, &SingleRank)
            .unwrap();
    }
    (p0, grads, p)
}

#[test]
fn the_f64_muon_reference_tells_a_changed_formula_from_f32_rounding() {
    use ragged_optimizers::validate_f64::muon_f64;
    let shape = [64usize, 96];
    let n = shape[0] * shape[1];
    let c = MuonConfig::default();
    let (p0, grads, p) = three_muon_steps(&c, shape, 0);
    let g: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
    let max_err = |want: &[f64]| {
        p.iter()
            .zip(want)
            .map(|(&x, &w)| (f64::from(x) - w).abs())
            .fold(0f64, f64::max)
    };
    // validate's tolerance for this matrix: 3 steps × (lr·scale·5e-4 + 4u·max|p|).
    let tol = 3.0 * (1e-3 * 5e-4 + 4.0 * 2f64.powi(-24) * 1.5);
    let right = max_err(&muon_f64(&c, "w", &shape, &p0, &g).unwrap());
    assert!(right <= tol, "f32 Muon vs f64: {right} > {tol}");
    let plain = MuonConfig {
        nesterov: false,
        ..c.clone()
    };
    let wrong = max_err(&muon_f64(&plain, "w", &shape, &p0, &g).unwrap());
    // Bad input is an error, not a panic.
    assert!(muon_f64(&c, "w", &[n], &p0, &g).is_err());
    assert!(muon_f64(
        &c,
        "w",
        &shape,
        &p0,
        &g[..1].iter().map(|g| &g[1..]).collect::<Vec<_>>()
    )
    .is_err());
    assert!(
        wrong > 10.0 * tol,
        "without Nesterov: {wrong}, tolerance {tol}"
    );
}

/// Shampoo's f64 reference at validate's `ε` tells a changed formula from `f32` rounding:
/// validate's measure (the update's relative Frobenius error) of the `f32` Shampoo is within
/// [`SHAMPOO_UPDATE_RTOL`], against an f64 Shampoo with its learning rate 1 % off or its root
/// exponent 5 % off it is not; on a matrix of two row blocks and two column chunks (blocks of
/// 32 here), a 1-D tensor (`R` only) and a `[.., 1]` one (`L` only).
#[test]
fn the_f64_shampoo_reference_tells_a_changed_formula_from_f32_rounding() {
    use ragged::comm::SingleRank;
    use ragged_optimizers::bench::shampoo_config;
    use ragged_optimizers::validate::{
        update_error, SHAMPOO_REFERENCE_EPSILON, SHAMPOO_UPDATE_RTOL,
    };
    use ragged_optimizers::validate_f64::shampoo_f64;
    use ragged_optimizers::{Shampoo, ShampooConfig};
    let c = ShampooConfig {
        epsilon: SHAMPOO_REFERENCE_EPSILON,
        max_preconditioner_dim: 32,
        ..shampoo_config()
    };
    let opt = Shampoo::new(c).unwrap();
    let wave = |k: usize, s: usize| ((k * (7919 + 2 * s) % 1013) as f32 / 1013.0 - 0.5) * 2.0;
    for shape in [vec![48usize, 40], vec![64], vec![40, 1]] {
        let n: usize = shape.iter().product();
        let p0: Vec<f32> = (0..n).map(|k| 1.0 + wave(k, 9)).collect();
        let grads: Vec<Vec<f32>> = (0..3)
            .map(|s| (0..n).map(|k| wave(k, s)).collect())
            .collect();
        let spec = [TensorSpec::new("w", &shape, DType::F32).unwrap()];
        let shard = LocalShard::unsharded(
            spec.iter().map(|t| (t.name.as_str(), t.shape.as_slice())),
            &|name, shape| opt.atomic_block(name, shape),
        )
        .unwrap();
        let (mut p, mut state) = (p0.clone(), opt.init(&shard).unwrap());
        for g in &grads {
            opt.step_slices(&mut state, &shard, &mut p, g, &SingleRank)
                .unwrap();
        }
        let g: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
        let error =
            |c: &ShampooConfig| update_error(&p, &shampoo_f64(c, &shape, &p0, &g).unwrap(), &p0);
        let right = error(&c);
        let lr = error(&ShampooConfig {
            lr: c.lr * 1.01,
            ..c
        });
        let order = if shape.len() == 2 && shape[1] > 1 {
            2.0
        } else {
            1.0
        };
        let exponent = error(&ShampooConfig {
            inverse_exponent_override: Some(1.05 / (2.0 * order)),
            ..c
        });
        eprintln!("{shape:?}: f32 vs f64 {right:.2e}, lr 1 % off {lr:.2e}, exponent 5 % off {exponent:.2e}");
        assert!(right <= SHAMPOO_UPDATE_RTOL, "{shape:?}: {right}");
        assert!(lr > SHAMPOO_UPDATE_RTOL, "{shape:?}: lr 1 % off {lr}");
        assert!(
            exponent > SHAMPOO_UPDATE_RTOL,
            "{shape:?}: exponent 5 % off {exponent}"
        );
    }
}

#[test]
fn the_bf16_muon_reference_tells_a_short_newton_schulz_from_bf16_rounding() {
    use ragged_optimizers::validate::{update_error, MUON_BF16_UPDATE_RTOL};
    use ragged_optimizers::validate_f64::muon_f64;
    use ragged_optimizers::{NsConfig, NsPrecision};
    let c = MuonConfig {
        ns: NsConfig {
            precision: NsPrecision::Bf16,
            ..NsConfig::default()
        },
        ..MuonConfig::default()
    };
    // A wide matrix (Gram Newton–Schulz under `Auto`) and a square one (standard).
    for shape in [[64usize, 256], [96, 96]] {
        let (p0, grads, p) = three_muon_steps(&c, shape, 1);
        let g: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
        // validate's measure: the update's relative Frobenius error.
        let right = update_error(&p, &muon_f64(&c, "w", &shape, &p0, &g).unwrap(), &p0);
        let mut short = c.clone();
        short.ns.steps = 4;
        let wrong = update_error(&p, &muon_f64(&short, "w", &shape, &p0, &g).unwrap(), &p0);
        eprintln!("{shape:?}: bf16 vs f64 {right:.3e}, one step short {wrong:.3e}");
        assert!(right <= MUON_BF16_UPDATE_RTOL, "{shape:?}: {right}");
        assert!(wrong > MUON_BF16_UPDATE_RTOL, "{shape:?}: {wrong}");
    }
}

/// Leaves the first element of the first tensor at `-0.0` unsharded and at `+0.0` on more
/// than one rank: equal as numbers, not as bits.
fn sign_of_zero() -> Tampered {
    let zero = |shard: &LocalShard, params: &mut [f32]| {
        let first = |p: &&ragged::optim::LocalPiece| p.param == 0 && p.range.start == 0;
        if let Some(p) = shard.pieces.iter().find(first) {
            params[p.offset] = if shard.world > 1 { 0.0 } else { -0.0 };
        }
    };
    Tampered {
        params: zero,
        ..world_dependent()
    }
}

/// The contract is bitwise: `+0.0` against `-0.0` is a breach although the two compare equal,
/// and it is 0 ulps and 0 absolute error apart (adjacent across zero, not 2³¹ apart).
#[test]
fn a_sign_of_zero_is_a_breach_zero_ulps_apart() {
    let specs = specs();
    let unit = unit_of(&specs);
    let opt = sign_of_zero();
    let cfg = config(OptimKind::AdamW);
    let report = validate_with(&opt, &[unit], &cfg).unwrap();
    let sharded = cfg.worlds.iter().filter(|&&w| w > 1).count() * cfg.layouts.len();
    assert_eq!(report.breaches(), sharded, "{report:?}");
    for c in &report.sharded {
        let breach = c.world > 1 && c.name == "w.q";
        assert_eq!(c.bitwise, !breach, "{c:?}");
        assert_eq!((c.max_ulp, c.max_abs, c.max_rel), (0, 0.0, 0.0), "{c:?}");
    }
}

/// Every layout asked for is run and compared at every world: the world-dependent step is a
/// breach under FSDP2's layout as under the optimizer's own.
#[test]
fn every_layout_is_compared_at_every_world() {
    let specs = specs();
    let unit = unit_of(&specs);
    let opt = world_dependent();
    let cfg = config(OptimKind::AdamW);
    let report = validate_with(&opt, &[unit], &cfg).unwrap();
    assert!(report.refused.is_empty(), "{:?}", report.refused);
    for &layout in &cfg.layouts {
        for &world in &cfg.worlds {
            let checks: Vec<_> = report
                .sharded
                .iter()
                .filter(|c| c.layout == layout && c.world == world)
                .collect();
            assert_eq!(checks.len(), specs.len(), "{layout:?} at {world}");
            assert_eq!(
                checks.iter().any(|c| !c.bitwise),
                world > 1,
                "{layout:?} at {world}: {checks:?}"
            );
        }
    }
}

/// Muon's f64 check is as tight as the README states: per step `lr·scale·5e-4` plus the f32
/// roundings of `p` (`4·2⁻²⁴·max|p|`, `|p|` here under 1.5 plus the steps' updates), never
/// looser, so that a wrong formula cannot pass it.
#[test]
fn the_muon_reference_tolerance_is_the_stated_one() {
    let specs = specs();
    let unit = unit_of(&specs);
    let cfg = ValidateConfig {
        worlds: vec![1],
        layouts: vec![LayoutKind::Ragged],
        ..config(OptimKind::Muon)
    };
    let report = validate(&[unit], &cfg).unwrap();
    assert_eq!(report.breaches(), 0, "{report:?}");
    let c = MuonConfig::default();
    let steps = cfg.steps as f64;
    let mut matrices = 0;
    for t in &specs {
        let Some(check) = report.reference.iter().find(|r| r.name == t.name) else {
            panic!("{}: no reference check", t.name);
        };
        if t.shape.len() < 2 {
            assert!(!check.absolute, "{check:?}");
            continue;
        }
        matrices += 1;
        let scale = c.lr * c.lr_scale.factor(t.shape[0], t.shape[1]);
        let p_max = 1.5 + steps * scale * 2.0;
        let most = steps * (scale * 5e-4 + 4.0 * 2f64.powi(-24) * p_max);
        assert!(check.absolute, "{check:?}");
        assert!(
            check.tolerance >= steps * scale * 5e-4 && check.tolerance <= most,
            "{}: tolerance {} outside [{}, {most}]",
            t.name,
            check.tolerance,
            steps * scale * 5e-4
        );
    }
    assert_eq!(matrices, 2);
}
