//! 8-bit Adam: golden values against an f64 reference (codes exact), sharded ≡ unsharded
//! bitwise (params, codes, absmax, fallback moments) over world sizes and uneven shapes, state
//! size, state round trips, block choice and input validation.

use ragged::comm::SingleRank;
use ragged::model::{DType, TensorSpec};
use ragged::optim::{LocalShard, Optimizer};
use ragged::plan::PlanOptions;
use ragged::AtomicBlock;
use ragged_optimizers::quant::{dynamic_map, MAP_LEN};
use ragged_optimizers::{
    Adam8bit, Adam8bitConfig, Adam8bitState, AdamW, AdamWConfig, DecayRule, Tiling,
};

mod harness;
use harness::{bits, gather, numels, padding, planned_shards, scatter, whole_shard, Rng};

// ---------------------------------------------------------------------------------------------
// Helpers (the structure of `adamw_tests.rs`)
// ---------------------------------------------------------------------------------------------

fn specs(shapes: &[&[usize]]) -> Vec<TensorSpec> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| TensorSpec::new(format!("t{i}"), s, DType::F32).unwrap())
        .collect()
}

/// Per-tile absmax in global tile order (tensor, then the module's tile order), gathered
/// from every rank; NaN where no rank wrote (caught by the bitwise comparison).
fn gather_absmax(
    opt: &Adam8bit,
    shards: &[LocalShard],
    local: &[Vec<f32>],
    specs: &[TensorSpec],
) -> Vec<Vec<f32>> {
    let mut global: Vec<Vec<f32>> = specs
        .iter()
        .map(|t| vec![f32::NAN; opt.tiling(&t.name, &t.shape).map_or(0, |t| t.num_tiles())])
        .collect();
    for (shard, local) in shards.iter().zip(local) {
        let mut at = 0;
        for p in &shard.pieces {
            if let Some(t) = opt.tiling(&shard.params[p.param].name, &shard.params[p.param].shape) {
                let a = t.tiles_before(p.range.start).unwrap();
                let b = t.tiles_before(p.range.end).unwrap();
                global[p.param][a..b].copy_from_slice(&local[at..at + b - a]);
                at += b - a;
            }
        }
        assert_eq!(at, local.len(), "absmax entries beyond the local tiles");
    }
    global
}

/// The global result of a run: params, m codes, v codes, absmax m, absmax v, and the fp32
/// fallback moments written back per element (0 for 8-bit tensors).
#[derive(Debug, PartialEq)]
struct Global {
    params: Vec<Vec<u32>>,
    m: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
    absmax_m: Vec<Vec<u32>>,
    absmax_v: Vec<Vec<u32>>,
    m32: Vec<Vec<u32>>,
    v32: Vec<Vec<u32>>,
}

/// The fallback moments, placed per element of the local shard (0 elsewhere).
fn fallback_local(opt: &Adam8bit, shard: &LocalShard, compact: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; shard.len];
    let mut at = 0;
    for p in &shard.pieces {
        if opt
            .tiling(&shard.params[p.param].name, &shard.params[p.param].shape)
            .is_none()
        {
            let n = p.range.len();
            out[p.offset..p.offset + n].copy_from_slice(&compact[at..at + n]);
            at += n;
        }
    }
    assert_eq!(at, compact.len());
    out
}

/// Runs `opt` on `shards` from `p0` with `grads`, checking padding invariants every step.
fn run(
    opt: &Adam8bit,
    shards: &[LocalShard],
    spec: &[TensorSpec],
    p0: &[Vec<f32>],
    grads: &[Vec<Vec<f32>>],
) -> Global {
    let n = numels(spec);
    let mut params: Vec<Vec<f32>> = shards.iter().map(|s| scatter(s, p0)).collect();
    let mut states: Vec<Adam8bitState> = shards.iter().map(|s| opt.init(s).unwrap()).collect();
    for g in grads {
        for (r, shard) in shards.iter().enumerate() {
            let mut local_g = scatter(shard, g);
            for i in padding(shard) {
                local_g[i] = 1.0;
            }
            opt.step(&mut states[r], shard, &mut params[r], &local_g, &SingleRank)
                .unwrap();
            for i in padding(shard) {
                assert_eq!(params[r][i].to_bits(), 0, "param padding at {i}");
                assert_eq!(states[r].m[i], 127, "m padding must stay the code of 0");
                assert_eq!(states[r].v[i], 0, "v padding must stay the code of 0");
            }
        }
    }
    let u32s = |x: Vec<Vec<f32>>| x.iter().map(|v| bits(v)).collect::<Vec<_>>();
    let take = |f: &dyn Fn(&Adam8bitState) -> Vec<f32>| states.iter().map(f).collect::<Vec<_>>();
    let m32: Vec<Vec<f32>> = shards
        .iter()
        .zip(&states)
        .map(|(s, st)| fallback_local(opt, s, &st.m32))
        .collect();
    let v32: Vec<Vec<f32>> = shards
        .iter()
        .zip(&states)
        .map(|(s, st)| fallback_local(opt, s, &st.v32))
        .collect();
    Global {
        params: u32s(gather(shards, &params, &n)),
        m: gather(
            shards,
            &states.iter().map(|s| s.m.clone()).collect::<Vec<_>>(),
            &n,
        ),
        v: gather(
            shards,
            &states.iter().map(|s| s.v.clone()).collect::<Vec<_>>(),
            &n,
        ),
        absmax_m: u32s(gather_absmax(
            opt,
            shards,
            &take(&|s| s.absmax_m.clone()),
            spec,
        )),
        absmax_v: u32s(gather_absmax(
            opt,
            shards,
            &take(&|s| s.absmax_v.clone()),
            spec,
        )),
        m32: u32s(gather(shards, &m32, &n)),
        v32: u32s(gather(shards, &v32, &n)),
    }
}

fn data(specs: &[TensorSpec], steps: usize, seed: u64) -> (Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>) {
    let mut rng = Rng::new(seed);
    let p0 = specs.iter().map(|t| rng.vec(t.numel(), 0.5, 2.0)).collect();
    let grads = (0..steps)
        .map(|_| {
            specs
                .iter()
                .map(|t| rng.vec(t.numel(), 1e-4, 1.0))
                .collect()
        })
        .collect();
    (p0, grads)
}

/// Hyperparameters under which every term is visible (decay order, eps placement, bias
/// corrections), with a threshold of `min` elements.
fn loud(min: usize) -> Adam8bitConfig {
    Adam8bitConfig {
        adam: AdamWConfig {
            lr: 0.05,
            beta1: 0.8,
            beta2: 0.95,
            eps: 1e-3,
            weight_decay: 0.2,
            decay_rule: DecayRule::All,
        },
        min_8bit_size: min,
        ..Adam8bitConfig::default()
    }
}

const SHAPES: [&[usize]; 6] = [
    &[64, 96],
    &[96, 32],
    &[3, 40, 64],
    &[100, 64],
    &[33],
    &[5, 7],
];
const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];

// ---------------------------------------------------------------------------------------------
// 1. Golden values against an f64 reference
// ---------------------------------------------------------------------------------------------

/// Nearest code by exhaustive search in f64 (ties up), the runner-up, and the margin: the gap
/// between their distances relative to the map spacing there (0 on a decision boundary).
fn nearest_f64(x: f64, map: &[f32; MAP_LEN]) -> (u8, u8, f64) {
    let mut d: Vec<(f64, usize)> = (0..MAP_LEN)
        .map(|c| ((map[c] as f64 - x).abs(), c))
        .collect();
    d.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
    let spacing = (map[d[0].1] as f64 - map[d[1].1] as f64).abs();
    (d[0].1 as u8, d[1].1 as u8, (d[1].0 - d[0].0) / spacing)
}

/// Below this margin (in units of the local map spacing) the f32 run may legitimately pick
/// the runner-up code. Why: the f32 normalized moment `x = m/absmax` differs from the f64 one
/// by a few roundings (≲ 4u ≈ 2.4e-7 relative, |x| ≤ 1), and the map spacing near |x| is at
/// least 0.007·|x| (unsigned top decade; the signed map and lower decades are coarser), so
/// the error is < 3.5e-5 spacings and can only flip a code whose margin is below 7e-5.
/// 2e-4 leaves a factor ~3.
const AMBIGUOUS_MARGIN: f64 = 2e-4;

/// The reference 8-bit Adam of one tensor in f64, written from the formulas of
/// optimizers.md §3 (CPU-backend order): tiles of 32 rows × 32 columns of each trailing
/// matrix, dequantize `map[c]·absmax`, decay before the update, `β·m + (1 − β)·g`,
/// `√(v/bc₂) + ε`, update with the unquantized moments, new absmax `max|·|` per tile, nearest
/// code by exhaustive search.
struct Reference {
    tiles: Vec<Vec<usize>>,
    p: Vec<f64>,
    mc: Vec<u8>,
    vc: Vec<u8>,
    am: Vec<f64>,
    av: Vec<f64>,
    t: i32,
    /// Codes found within [`AMBIGUOUS_MARGIN`] of a decision boundary.
    ambiguous: usize,
}

impl Reference {
    fn new(shape: &[usize], p0: &[f32]) -> Self {
        let d = shape.len();
        let (rows, cols) = (shape[d - 2], shape[d - 1]);
        let batch: usize = shape[..d - 2].iter().product();
        // Tiles as element lists, in (matrix, row block, column block) order.
        let mut tiles: Vec<Vec<usize>> = Vec::new();
        for e in 0..batch {
            for r0 in (0..rows).step_by(32) {
                for c0 in (0..cols).step_by(32) {
                    let mut t = Vec::new();
                    for r in r0..(r0 + 32).min(rows) {
                        for col in c0..c0 + 32 {
                            t.push((e * rows + r) * cols + col);
                        }
                    }
                    tiles.push(t);
                }
            }
        }
        let n = p0.len();
        Reference {
            am: vec![0.0; tiles.len()],
            av: vec![0.0; tiles.len()],
            tiles,
            p: p0.iter().map(|&x| x as f64).collect(),
            mc: vec![127; n],
            vc: vec![0; n],
            t: 0,
            ambiguous: 0,
        }
    }

    /// One step; `got_m`, `got_v` are the run's codes after the same step. A code must equal
    /// the reference's exactly unless it lies within [`AMBIGUOUS_MARGIN`] of a boundary; there
    /// the run's code must be one of the two nearest, and the reference adopts it (so both
    /// continue from the same state).
    fn step(&mut self, c: &AdamWConfig, g: &[f32], got_m: &[u8], got_v: &[u8]) {
        let (qm, qv) = (dynamic_map(true), dynamic_map(false));
        self.t += 1;
        let (bc1, bc2) = (1.0 - c.beta1.powi(self.t), 1.0 - c.beta2.powi(self.t));
        for (ti, tile) in self.tiles.iter().enumerate() {
            let mut m = vec![0.0; tile.len()];
            let mut v = vec![0.0; tile.len()];
            for (j, &i) in tile.iter().enumerate() {
                let g = g[i] as f64;
                self.p[i] *= 1.0 - c.lr * c.weight_decay;
                let m0 = qm[self.mc[i] as usize] as f64 * self.am[ti];
                let v0 = qv[self.vc[i] as usize] as f64 * self.av[ti];
                m[j] = c.beta1 * m0 + (1.0 - c.beta1) * g;
                v[j] = c.beta2 * v0 + (1.0 - c.beta2) * g * g;
                self.p[i] -= c.lr * (m[j] / bc1) / ((v[j] / bc2).sqrt() + c.eps);
            }
            self.am[ti] = m.iter().fold(0.0f64, |a, x| a.max(x.abs()));
            self.av[ti] = v.iter().fold(0.0f64, |a, &x| a.max(x));
            for (j, &i) in tile.iter().enumerate() {
                for (x, map, got, code) in [
                    (m[j] / self.am[ti], &qm, got_m[i], &mut self.mc[i]),
                    (v[j] / self.av[ti], &qv, got_v[i], &mut self.vc[i]),
                ] {
                    let (best, second, margin) = nearest_f64(x, map);
                    if margin < AMBIGUOUS_MARGIN {
                        assert!(
                            got == best || got == second,
                            "step {}, element {i}: code {got}, want {best} or {second}",
                            self.t
                        );
                        self.ambiguous += 1;
                        *code = got;
                    } else {
                        assert_eq!(got, best, "step {}, element {i}: code", self.t);
                        *code = best;
                    }
                }
            }
        }
    }
}

/// Tolerances of the golden test, and why.
/// - Codes: exact, except within [`AMBIGUOUS_MARGIN`] of a decision boundary (see there);
///   the test asserts such codes are rare (< 0.1 % of all quantizations).
/// - absmax: relative `1e-6` (a maximum of f32 moments, ~4 roundings each from the same
///   dequantized state).
/// - Params: relative `2e-6` after 3 steps (|p| ≥ 1; ≲ 4.2u per step as for AdamW, plus the
///   f32 absmax's rounding in the dequantized moments, ≲ 2u of an update term). Decay after
///   the update, eps inside the root or a missing bias correction move p by ≥ 1e-3 relative
///   under these hyperparameters.
const GOLDEN_P_RTOL: f64 = 2e-6;
const GOLDEN_ABSMAX_RTOL: f64 = 1e-6;

#[test]
fn adam8bit_matches_an_f64_reference_with_exact_codes() {
    // [40, 64]: a full and a short (8-row) row block; [2, 40, 32]: per-matrix tiles of a
    // stacked parameter; [40, 320]: ten tiles per row block, so a full panel of eight and a
    // partial one. Threshold 0 so these small tensors are 8-bit.
    let shapes: [&[usize]; 3] = [&[40, 64], &[2, 40, 32], &[40, 320]];
    let spec = specs(&shapes);
    let shard = whole_shard(&spec);
    let c = loud(0);
    let opt = Adam8bit::new(c).unwrap();
    let steps = 3;
    let mut rng = Rng::new(11);
    let p0: Vec<Vec<f32>> = spec.iter().map(|t| rng.vec(t.numel(), 1.0, 3.0)).collect();
    let grads: Vec<Vec<Vec<f32>>> = (0..steps)
        .map(|_| spec.iter().map(|t| rng.vec(t.numel(), 1e-4, 1.0)).collect())
        .collect();
    let mut refs: Vec<Reference> = spec
        .iter()
        .zip(&p0)
        .map(|(t, p0)| Reference::new(&t.shape, p0))
        .collect();
    let mut state = opt.init(&shard).unwrap();
    let mut p = scatter(&shard, &p0);
    for g in &grads {
        opt.step(&mut state, &shard, &mut p, &scatter(&shard, g), &SingleRank)
            .unwrap();
        let (mut at, mut tile_at) = (0, 0);
        for (ti, (t, r)) in spec.iter().zip(&mut refs).enumerate() {
            let n = t.numel();
            r.step(&c.adam, &g[ti], &state.m[at..at + n], &state.v[at..at + n]);
            for (k, (&a, &b)) in r.am.iter().zip(&r.av).enumerate() {
                let (gm, gv) = (
                    state.absmax_m[tile_at + k] as f64,
                    state.absmax_v[tile_at + k] as f64,
                );
                assert!(
                    (gm - a).abs() <= GOLDEN_ABSMAX_RTOL * a,
                    "tensor {ti} absmax_m[{k}]"
                );
                assert!(
                    (gv - b).abs() <= GOLDEN_ABSMAX_RTOL * b,
                    "tensor {ti} absmax_v[{k}]"
                );
            }
            at += n;
            tile_at += r.am.len();
        }
        assert_eq!(tile_at, state.absmax_m.len());
    }
    let mut at = 0;
    let mut quantizations = 0;
    for (ti, r) in refs.iter().enumerate() {
        for (i, &rp) in r.p.iter().enumerate() {
            let e = (p[at + i] as f64 - rp).abs() / rp.abs();
            assert!(e <= GOLDEN_P_RTOL, "tensor {ti} p[{i}]: rel err {e}");
        }
        at += r.p.len();
        quantizations += 2 * steps * r.p.len();
    }
    let ambiguous: usize = refs.iter().map(|r| r.ambiguous).sum();
    assert!(
        ambiguous * 1000 < quantizations,
        "{ambiguous} of {quantizations} codes on a boundary"
    );
    assert!(state.m32.is_empty());
}

#[test]
fn codes_are_not_all_trivial_so_the_golden_test_has_teeth() {
    // The golden data must use many codes of both maps, or exact code equality proves little.
    let spec = specs(&[&[40, 64]]);
    let shard = whole_shard(&spec);
    let opt = Adam8bit::new(loud(0)).unwrap();
    let mut rng = Rng::new(3);
    let mut p = rng.vec(shard.len, 1.0, 3.0);
    let mut state = opt.init(&shard).unwrap();
    for _ in 0..2 {
        let g = rng.vec(shard.len, 1e-4, 1.0);
        opt.step(&mut state, &shard, &mut p, &g, &SingleRank)
            .unwrap();
    }
    let distinct = |c: &[u8]| {
        let mut seen = [false; 256];
        c.iter().for_each(|&x| seen[x as usize] = true);
        seen.iter().filter(|&&s| s).count()
    };
    assert!(
        distinct(&state.m) > 100,
        "m uses {} codes",
        distinct(&state.m)
    );
    assert!(
        distinct(&state.v) > 60,
        "v uses {} codes",
        distinct(&state.v)
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Sharded ≡ unsharded, bitwise
// ---------------------------------------------------------------------------------------------

#[test]
fn sharded_adam8bit_is_bitwise_equal_to_unsharded_at_every_world_size() {
    let spec = specs(&SHAPES);
    let (p0, grads) = data(&spec, 4, 42);
    // Default threshold (4096: [96, 32] falls back) and 1024 ([96, 32] is 8-bit).
    for (ci, c) in [Adam8bitConfig::default(), loud(1024)].iter().enumerate() {
        let opt = Adam8bit::new(*c).unwrap();
        let want = run(&opt, &[whole_shard(&spec)], &spec, &p0, &grads);
        for coll_align in [1, 64] {
            let opts = PlanOptions {
                coll_align,
                ..PlanOptions::default()
            };
            for world in WORLDS {
                let shards = planned_shards(&opt, &spec, world, &opts);
                let got = run(&opt, &shards, &spec, &p0, &grads);
                assert!(
                    got == want,
                    "config {ci}, world {world}, coll_align {coll_align}: sharded differs"
                );
            }
        }
    }
}

#[test]
fn sharding_actually_splits_8bit_tensors_across_ranks() {
    // Guards the bitwise test against passing vacuously with every tensor on one rank.
    let spec = specs(&SHAPES);
    let opt = Adam8bit::new(loud(1024)).unwrap();
    let opts = PlanOptions {
        coll_align: 1,
        ..PlanOptions::default()
    };
    let shards = planned_shards(&opt, &spec, 8, &opts);
    let split = (0..4)
        .filter(|&i| {
            shards
                .iter()
                .filter(|s| s.pieces.iter().any(|p| p.param == i))
                .count()
                > 1
        })
        .count();
    assert!(
        split >= 2,
        "only {split} 8-bit tensors are split at world 8"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. State size
// ---------------------------------------------------------------------------------------------

#[test]
fn state_of_a_large_matrix_costs_at_most_2_01_bytes_per_parameter() {
    let spec = specs(&[&[1024, 1024]]);
    let opt = default_opt();
    let shard = whole_shard(&spec);
    let state = opt.init(&shard).unwrap();
    let per = state.state_bytes() as f64 / shard.len as f64;
    // m and v codes (2 bytes) + two f32 absmax per 1024-element tile (8/1024).
    assert!(per <= 2.01, "{per} bytes per parameter");
    assert_eq!(state.absmax_m.len(), 1024 * 1024 / 1024);
    assert!(state.m32.is_empty() && state.v32.is_empty());
}

/// The optimizer with bnb's defaults (threshold 4096).
fn default_opt() -> Adam8bit {
    Adam8bit::new(Adam8bitConfig::default()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// 4. State round trip
// ---------------------------------------------------------------------------------------------

#[test]
fn state_round_trip_through_bytes_continues_bitwise() {
    let spec = specs(&SHAPES);
    let (p0, grads) = data(&spec, 4, 5);
    let opt = Adam8bit::new(loud(1024)).unwrap();
    for world in [1, 3] {
        let shards = planned_shards(&opt, &spec, world, &PlanOptions::default());
        for shard in &shards {
            let mut p = scatter(shard, &p0);
            let mut state = opt.init(shard).unwrap();
            for g in &grads[..2] {
                opt.step(&mut state, shard, &mut p, &scatter(shard, g), &SingleRank)
                    .unwrap();
            }
            let bytes = state.to_le_bytes();
            let mut loaded = Adam8bitState::from_le_bytes(&bytes).unwrap();
            assert_eq!(loaded, state);
            assert_eq!(loaded.to_le_bytes(), bytes);
            let mut p2 = p.clone();
            for g in &grads[2..] {
                let g = scatter(shard, g);
                opt.step(&mut state, shard, &mut p, &g, &SingleRank)
                    .unwrap();
                opt.step(&mut loaded, shard, &mut p2, &g, &SingleRank)
                    .unwrap();
            }
            assert_eq!(bits(&p), bits(&p2), "world {world}: params after resume");
            assert_eq!(
                loaded.to_le_bytes(),
                state.to_le_bytes(),
                "world {world}: state"
            );
        }
    }
}

#[test]
fn truncated_or_inconsistent_state_bytes_are_rejected() {
    let spec = specs(&[&[64, 64], &[5, 7]]);
    let shard = whole_shard(&spec);
    let opt = default_opt();
    let bytes = opt.init(&shard).unwrap().to_le_bytes();
    assert!(Adam8bitState::from_le_bytes(&bytes[..bytes.len() - 1]).is_err());
    assert!(Adam8bitState::from_le_bytes(&bytes[..20]).is_err());
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(Adam8bitState::from_le_bytes(&longer).is_err());
    let mut huge = bytes.clone();
    huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(Adam8bitState::from_le_bytes(&huge).is_err());
}

// ---------------------------------------------------------------------------------------------
// 5. Blocks and bad input
// ---------------------------------------------------------------------------------------------

/// Six steps of `opt` on a `[64, 64]` table named `name` with embedding-like gradients: odd
/// rows get `1e-3` of the even rows' gradient (rare tokens), so under 8-bit state their `v`
/// sinks below the smallest unsigned code of its tile while `m` keeps a non-zero code.
/// Returns the largest one-step parameter change and the final parameters.
fn rare_rows_run<O: Optimizer>(opt: &O, name: &str) -> (f32, Vec<f32>) {
    let spec = vec![TensorSpec::new(name.to_string(), &[64, 64], DType::F32).unwrap()];
    let shard = whole_shard(&spec);
    let mut rng = Rng::new(3);
    let mut p = rng.units(64 * 64);
    let mut state = opt.init(&shard).unwrap();
    let mut worst = 0.0f32;
    for _ in 0..6 {
        let mut g = rng.units(64 * 64);
        for row in g.chunks_mut(64).skip(1).step_by(2) {
            row.iter_mut().for_each(|g| *g *= 1e-3);
        }
        let before = p.clone();
        opt.step(&mut state, &shard, &mut p, &g, &SingleRank)
            .unwrap();
        for (a, b) in p.iter().zip(&before) {
            worst = worst.max((a - b).abs());
        }
    }
    (worst, p)
}

#[test]
fn embeddings_keep_f32_state_because_8bit_v_underflows_on_rare_rows() {
    let lr = 1e-3;
    let cfg = |fp32_patterns: &'static [&'static str]| Adam8bitConfig {
        adam: AdamWConfig {
            lr,
            ..AdamWConfig::default()
        },
        fp32_patterns,
        ..Adam8bitConfig::default()
    };
    // The hazard: with 8-bit state, a rare row's update is lr·m/ε, far beyond Adam's ~lr.
    let eight_bit = Adam8bit::new(cfg(&[])).unwrap();
    assert_eq!(
        eight_bit.atomic_block("tok_embed", &[64, 64]),
        AtomicBlock::Tile { rows: 32, cols: 32 }
    );
    let (worst, _) = rare_rows_run(&eight_bit, "tok_embed");
    assert!(worst > 100.0 * lr as f32, "8-bit worst step {worst}");
    // The default keeps embeddings on f32 state: the step is AdamW's, bit for bit.
    let stable = Adam8bit::new(cfg(&["embed"])).unwrap();
    assert_eq!(
        stable.atomic_block("tok_embed", &[64, 64]),
        AtomicBlock::Element
    );
    assert!(stable.tiling("tok_embed", &[64, 64]).is_none());
    let (worst, p) = rare_rows_run(&stable, "tok_embed");
    let (_, q) = rare_rows_run(&AdamW::new(cfg(&[]).adam).unwrap(), "tok_embed");
    assert_eq!(bits(&p), bits(&q));
    assert!(worst <= 1.1 * lr as f32, "f32 worst step {worst}");
}

#[test]
fn blocks_follow_the_global_shape_and_shapes_that_do_not_tile_fall_back() {
    let opt = default_opt();
    let tile = AtomicBlock::Tile { rows: 32, cols: 32 };
    assert_eq!(opt.atomic_block("w", &[64, 96]), tile);
    assert_eq!(opt.atomic_block("w", &[100, 64]), tile);
    assert_eq!(opt.atomic_block("w", &[3, 64, 64]), tile);
    assert_eq!(opt.atomic_block("w", &[3, 40, 64]), AtomicBlock::Matrix);
    assert_eq!(opt.atomic_block("w", &[96, 32]), AtomicBlock::Element); // 3072 < 4096
    assert_eq!(opt.atomic_block("w", &[4096]), AtomicBlock::Element); // 1-D
    assert_eq!(opt.atomic_block("w", &[128, 100]), AtomicBlock::Element); // 100 % 32 ≠ 0
    assert_eq!(opt.atomic_block("w", &[5, 7]), AtomicBlock::Element);
    assert_eq!(opt.atomic_block("w", &[]), AtomicBlock::Element);
    let t = Tiling::of(&[3, 40, 64], 0).unwrap();
    assert_eq!(t.num_tiles(), 3 * 2 * 2);
    assert_eq!(t.tiles_before(32 * 64), Some(2));
    assert_eq!(t.tiles_before(40 * 64), Some(4));
    assert_eq!(
        t.tiles_before(64 * 64),
        None,
        "row 64 is inside matrix 1's first tile"
    );
    assert_eq!(Tiling::of(&[100, 64], 0).unwrap().num_tiles(), 4 * 2);
}

#[test]
fn a_piece_that_cuts_a_tile_is_rejected() {
    let spec = specs(&[&[64, 64]]);
    let mut shard = whole_shard(&spec);
    shard.pieces[0].range = 0..16 * 64; // half a row block
    shard.len = 16 * 64;
    let opt = default_opt();
    assert!(opt.init(&shard).is_err());
    let mut state = Adam8bitState {
        step: 0,
        m: vec![127; shard.len],
        v: vec![0; shard.len],
        absmax_m: vec![],
        absmax_v: vec![],
        m32: vec![],
        v32: vec![],
    };
    let mut p = vec![1.0; shard.len];
    let g = vec![1.0; shard.len];
    assert!(opt
        .step(&mut state, &shard, &mut p, &g, &SingleRank)
        .is_err());
    assert_eq!(state.step, 0);
}

#[test]
fn step_with_wrong_lengths_errs_and_changes_nothing() {
    let spec = specs(&[&[64, 64], &[5, 7]]);
    let shard = whole_shard(&spec);
    let opt = default_opt();
    let fresh = opt.init(&shard).unwrap();
    let good_g = vec![0.5f32; shard.len];
    let short = vec![0.5f32; shard.len - 1];
    let mut state = fresh.clone();
    let mut p = vec![1.0f32; shard.len];
    assert!(opt
        .step(&mut state, &shard, &mut p, &short, &SingleRank)
        .is_err());
    let mut p_short = short.clone();
    assert!(opt
        .step(&mut state, &shard, &mut p_short, &good_g, &SingleRank)
        .is_err());
    let corruptions: [fn(&mut Adam8bitState); 3] = [
        |s: &mut Adam8bitState| {
            s.m.pop();
        },
        |s: &mut Adam8bitState| {
            s.absmax_v.pop();
        },
        |s: &mut Adam8bitState| {
            s.m32.push(0.0);
        },
    ];
    for corrupt in corruptions {
        let mut bad = fresh.clone();
        corrupt(&mut bad);
        let before = bad.clone();
        assert!(opt
            .step(&mut bad, &shard, &mut p, &good_g, &SingleRank)
            .is_err());
        assert_eq!(bad, before, "a failed step must not touch the state");
    }
    assert_eq!(state, fresh);
    assert!(
        p.iter().all(|&x| x == 1.0),
        "a failed step must not touch params"
    );
    opt.step(&mut state, &shard, &mut p, &good_g, &SingleRank)
        .unwrap();
    assert_eq!(state.step, 1);
}

#[test]
fn invalid_hyperparameters_are_rejected() {
    let d = Adam8bitConfig::default();
    for adam in [
        AdamWConfig { lr: -1.0, ..d.adam },
        AdamWConfig {
            beta1: 1.0,
            ..d.adam
        },
        AdamWConfig {
            beta2: -0.1,
            ..d.adam
        },
        AdamWConfig {
            eps: f64::NAN,
            ..d.adam
        },
        AdamWConfig {
            weight_decay: -1.0,
            ..d.adam
        },
    ] {
        assert!(
            Adam8bit::new(Adam8bitConfig { adam, ..d }).is_err(),
            "{adam:?}"
        );
    }
}
