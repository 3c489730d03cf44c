//! `fully_shard` end to end on a real candle transformer over thread ranks, through the entry
//! points users call (`ThreadWorld::run`, `train_rank`, `forward_backward`, `unshard`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use ragged::comm::threads::ThreadWorld;
use ragged::comm::{Buf, BufMut, Communicator, HeldComm, ReduceOp, Segment, SingleRank};
use ragged::dbuffer::with_ref;
use ragged::demo::{
    batch, corpus, train_rank, TrainMode, TrainRun, Transformer, TransformerConfig,
    TransformerStages,
};
use ragged::fsdp::{
    forward_unsharded, fully_shard, FsdpOptions, MixedPrecision, ShardLayout, Stages, UnitParams,
};
use ragged::roles::{Role, RoleFn, RoleRule};
use ragged_optimizers::{AdamW, AdamWConfig};

mod common;

const CFG: TransformerConfig = TransformerConfig::TINY;
const LR: f64 = 1e-2;
const STEPS: usize = 4;
const BATCH: usize = 12;

fn adamw() -> AdamW {
    AdamW::new(AdamWConfig {
        lr: LR,
        ..AdamWConfig::default()
    })
    .unwrap()
}

type Run = TrainRun;

/// Trains on `world` thread ranks and returns rank 0's result (all ranks must agree).
fn train(world: usize, opts: FsdpOptions, mode: TrainMode) -> Run {
    let params = CFG.init_params(7).unwrap();
    let runs = ThreadWorld::run(world, |c| {
        train_rank(
            CFG,
            &params,
            adamw(),
            c,
            opts.clone(),
            mode,
            STEPS,
            BATCH,
            |_, _| {},
        )
    })
    .unwrap();
    for r in &runs[1..] {
        assert_eq!(r.1, runs[0].1, "ranks disagree on the gathered parameters");
    }
    runs.into_iter().next().unwrap()
}

fn unsharded() -> Run {
    let params = CFG.init_params(7).unwrap();
    let opts = FsdpOptions::default();
    train_rank(
        CFG,
        &params,
        adamw(),
        &SingleRank,
        opts,
        TrainMode::UnitByUnit,
        STEPS,
        BATCH,
        |_, _| {},
    )
    .unwrap()
}

fn bits(run: &Run) -> Vec<(String, Vec<u32>)> {
    let mut v: Vec<_> = run
        .1
        .iter()
        .map(|(n, x)| (n.clone(), x.iter().map(|f| f.to_bits()).collect()))
        .collect();
    v.sort();
    v
}

fn max_abs_diff(a: &HashMap<String, Vec<f32>>, b: &HashMap<String, Vec<f32>>) -> f32 {
    a.iter()
        .flat_map(|(n, x)| x.iter().zip(&b[n]).map(|(p, q)| (p - q).abs()))
        .fold(0.0, |m, d| {
            if d.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(d)
            }
        })
}

/// Tolerance: sharded ranks average per-rank mean gradients while the reference takes one mean
/// over the global batch, so gradients differ by float rounding (~1e-7 relative). Adam's update
/// `m/√v` has magnitude ~lr whatever the gradient's size, so where a gradient is at rounding
/// level the two runs can step differently by up to ~lr. The bound lr/10 = 1e-3 still fails if a
/// shard were stepped with the wrong gradient (that moves parameters by ~lr). Losses agree to
/// 1e-4 relative (rounding of the forward pass and of the parameters).
#[test]
fn sharded_training_matches_unsharded_within_tolerance() {
    let reference = unsharded();
    for world in [2, 3, 4] {
        let run = train(world, FsdpOptions::default(), TrainMode::UnitByUnit);
        for (s, (a, b)) in run.0.iter().zip(&reference.0).enumerate() {
            assert!(
                (a.loss - b.loss).abs() <= 1e-4 * b.loss.abs(),
                "V={world} step {s}: loss {} vs {}",
                a.loss,
                b.loss
            );
        }
        let diff = max_abs_diff(&run.1, &reference.1);
        println!("V={world}: max |Δparam| after {STEPS} steps = {diff:.3e}");
        assert!(diff <= LR as f32 / 10.0, "V={world}: {diff}");
    }
    assert!(
        reference.0.last().unwrap().loss < reference.0[0].loss,
        "training must reduce the loss"
    );
}

#[test]
fn ragged_and_fsdp2_layouts_train_bitwise_identically() {
    // Both reduce every element over ranks in rank order and AdamW is element-wise, so the
    // layouts may differ only in how bytes move, never in values.
    for world in [1, 3] {
        let ragged = train(world, FsdpOptions::default(), TrainMode::UnitByUnit);
        let fsdp2 = FsdpOptions {
            layout: ShardLayout::Fsdp2,
            ..FsdpOptions::default()
        };
        assert_eq!(
            bits(&ragged),
            bits(&train(world, fsdp2, TrainMode::UnitByUnit)),
            "V={world}"
        );
    }
}

/// Recomputing a stage in backward runs the same kernels on the same bits as its forward, so
/// freeing units between forward and backward changes memory, never values; and the
/// whole-model mode (one graph, one backward) computes the same gradients.
/// Overlap (the next unit gathered, and the last unit's gradients reduce-scattered, on a
/// second thread while a stage computes; the default) gives the same bits as running each
/// collective in turn, and the collectives really ran behind compute on every rank.
#[test]
fn overlapped_collectives_change_nothing_but_when_they_run() {
    let serial = FsdpOptions {
        overlap: false,
        ..FsdpOptions::default()
    };
    for (reshard, recompute) in [(true, false), (true, true), (false, false)] {
        let with = |overlap| FsdpOptions {
            overlap,
            reshard_after_forward: reshard,
            recompute,
            ..serial.clone()
        };
        assert_eq!(
            bits(&train(3, with(true), TrainMode::UnitByUnit)),
            bits(&train(3, with(false), TrainMode::UnitByUnit)),
            "reshard_after_forward {reshard}, recompute {recompute}"
        );
    }
    // Stages long enough (milliseconds) that a gather overlaps them on every rank.
    let cfg = TransformerConfig {
        d_model: 128,
        d_ff: 512,
        seq_len: 32,
        ..CFG
    };
    let params = cfg.init_params(7).unwrap();
    let prefetched = ThreadWorld::run(3, |c| {
        let mut m = fully_shard(&params, adamw(), c, FsdpOptions::default())?;
        let ids = ragged::demo::batch(corpus()?, &cfg, 0, c.rank() * 8, 8)?;
        let r = m.forward_backward(&TransformerStages(cfg), &ids)?;
        Ok(r.overlapped_seconds)
    })
    .unwrap();
    assert!(prefetched.iter().all(|&t| t > 0.0), "{prefetched:?}");
    // On the host the thread runs at world 1 too (a gather there is a copy on this core that
    // the thread hides); only a device at world 1 runs without it (`cuda_tests`).
    let one = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    assert!(one.overlaps() && one.memory_plan().overlap_possible);
    assert!(!fully_shard(&params, adamw(), &SingleRank, serial)
        .unwrap()
        .overlaps());
}

#[test]
fn recomputation_and_whole_model_mode_change_nothing_but_memory() {
    // The default: storages freed after forward, graphs kept, storages refilled for backward.
    let freed = train(3, FsdpOptions::default(), TrainMode::UnitByUnit);
    let recompute = FsdpOptions {
        recompute: true,
        ..FsdpOptions::default()
    };
    assert_eq!(
        bits(&freed),
        bits(&train(3, recompute, TrainMode::UnitByUnit))
    );
    let kept = FsdpOptions {
        reshard_after_forward: false,
        ..FsdpOptions::default()
    };
    assert_eq!(
        bits(&freed),
        bits(&train(3, kept.clone(), TrainMode::UnitByUnit))
    );
    let whole = train(3, kept, TrainMode::WholeModel);
    let diff = max_abs_diff(&freed.1, &whole.1);
    println!("unit by unit vs whole model: max |Δparam| = {diff:.3e}");
    assert_eq!(bits(&freed), bits(&whole));
}

#[test]
fn ragged_path_copies_nothing_and_fsdp2_copies_each_parameter_twice_per_step() {
    let n: u64 = CFG
        .param_shapes()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() as u64)
        .sum();
    for (reshard_after_forward, recompute) in [(true, false), (true, true), (false, false)] {
        let opts = FsdpOptions {
            reshard_after_forward,
            recompute,
            ..FsdpOptions::default()
        };
        let ragged = train(2, opts, TrainMode::UnitByUnit);
        assert!(ragged.0.iter().all(|r| r.copied_bytes == 0));
    }
    let fsdp2 = FsdpOptions {
        layout: ShardLayout::Fsdp2,
        reshard_after_forward: false,
        ..FsdpOptions::default()
    };
    for (step, r) in train(2, fsdp2, TrainMode::UnitByUnit).0.iter().enumerate() {
        // copy-out after every all-gather and copy-in before every reduce-scatter, f32.
        assert_eq!(r.copied_bytes, (step as u64 + 1) * 2 * 4 * n, "step {step}");
    }
}

fn address(t: &Tensor) -> usize {
    with_ref(t, |b| match b {
        Buf::F32(x) => Ok(x.as_ptr() as usize),
        _ => unreachable!(),
    })
    .unwrap()
}

/// A kept unit (`reshard_after_forward: false`) that a step made stale is rewritten in place
/// by the next gather: the very storages the model was built on (the tensors handed out before
/// stay valid, nothing is allocated) now hold the stepped master values.
#[test]
fn a_kept_unit_is_rewritten_in_place_after_a_step() {
    let params = CFG.init_params(3).unwrap();
    ThreadWorld::run(2, |c| {
        let opts = FsdpOptions {
            reshard_after_forward: false,
            ..FsdpOptions::default()
        };
        let mut sharded = fully_shard(&params, adamw(), c, opts)?;
        let views = sharded.unshard()?;
        let model = Transformer::new(
            CFG,
            VarBuilder::from_tensors(views.clone(), DType::F32, &Device::Cpu),
        )?;
        let ids = batch(corpus().unwrap(), &CFG, 0, c.rank(), 3)?;
        model.loss(&ids)?.backward()?;
        sharded.reduce_gradients()?;
        let before = sharded.full_params()?;
        sharded.step()?;
        let again = sharded.unshard()?;
        let stepped = sharded.full_params()?;
        for (name, t) in &again {
            assert_eq!(address(t), address(&views[name]), "{name}: another storage");
            let seen: Vec<f32> = views[name].flatten_all()?.to_vec1()?;
            assert_eq!(seen, stepped[name], "{name}: not the stepped values");
            assert_ne!(seen, before[name], "{name}: the step changed nothing");
        }
        Ok(())
    })
    .unwrap();
}

/// What the recording communicator and optimizer saw on one rank.
#[derive(Default)]
struct Observed {
    /// `(offset in the full buffer, address)` of every segment gathered into.
    segments: Mutex<Vec<(usize, usize)>>,
    /// Every reduce-scatter.
    reduced: Mutex<Vec<ReduceScatter>>,
    /// `(address, length)` of every all-reduce buffer.
    all_reduced: Mutex<Vec<(usize, usize)>>,
    /// `(address, length)` of the gradients every optimizer step read.
    stepped: Mutex<Vec<(usize, usize)>>,
}

/// What one reduce-scatter read and wrote.
#[derive(Clone)]
struct ReduceScatter {
    input: usize,
    contents: Vec<f32>,
    /// Address and length.
    output: (usize, usize),
}

fn span(b: &BufMut<'_>) -> Option<(usize, usize)> {
    match b {
        BufMut::F32(x) => Some((x.as_ptr() as usize, x.len())),
        _ => None,
    }
}

/// A communicator that records where the all-gather wrote, what the reduce-scatter read and
/// wrote, and where the all-reduce ran; its groups (HSDP's shard and replica groups) record
/// into the same [`Observed`].
struct Recorder<'a> {
    inner: HeldComm<'a>,
    seen: Arc<Observed>,
}

impl Communicator for Recorder<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather_in_place(&self, buf: BufMut<'_>) -> ragged::Result<()> {
        self.inner.all_gather_in_place(buf)
    }
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> ragged::Result<()> {
        self.inner.all_gather(send, recv)
    }
    fn reduce_scatter_in_place(&self, buf: BufMut<'_>, op: ReduceOp) -> ragged::Result<()> {
        self.inner.reduce_scatter_in_place(buf, op)
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> ragged::Result<()> {
        self.seen.all_reduced.lock().unwrap().extend(span(&buf));
        self.inner.all_reduce(buf, op)
    }
    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        sc: &[usize],
        recv: BufMut<'_>,
        rc: &[usize],
    ) -> ragged::Result<()> {
        self.inner.all_to_all_v(send, sc, recv, rc)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> ragged::Result<()> {
        self.inner.broadcast(buf, root)
    }
    fn barrier(&self) -> ragged::Result<()> {
        self.inner.barrier()
    }
    fn all_gather_segments(
        &self,
        send: Buf<'_>,
        segs: &mut [Segment<'_>],
    ) -> ragged::Result<usize> {
        let mut rec = self.seen.segments.lock().unwrap();
        rec.extend(
            segs.iter()
                .filter_map(|s| Some((s.offset, span(&s.buf)?.0))),
        );
        drop(rec);
        self.inner.all_gather_segments(send, segs)
    }
    fn reduce_scatter(
        &self,
        send: BufMut<'_>,
        recv: BufMut<'_>,
        op: ReduceOp,
    ) -> ragged::Result<usize> {
        if let (BufMut::F32(b), Some(out)) = (&send, span(&recv)) {
            let seen = ReduceScatter {
                input: b.as_ptr() as usize,
                contents: b.to_vec(),
                output: out,
            };
            self.seen.reduced.lock().unwrap().push(seen);
        }
        self.inner.reduce_scatter(send, recv, op)
    }
    fn split(&self, color: usize) -> ragged::Result<Box<dyn Communicator + '_>> {
        Ok(Box::new(Recorder {
            inner: HeldComm::Group(self.inner.split(color)?),
            seen: self.seen.clone(),
        }))
    }
}

/// AdamW that records where each step's gradients are.
struct RecordingAdamW {
    inner: AdamW,
    seen: Arc<Observed>,
}

impl ragged::optim::Optimizer for RecordingAdamW {
    type State = <AdamW as ragged::optim::Optimizer>::State;
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn atomic_block(&self, name: &str, shape: &[usize]) -> ragged::AtomicBlock {
        self.inner.atomic_block(name, shape)
    }
    fn init(&self, shard: &ragged::optim::LocalShard) -> ragged::Result<Self::State> {
        self.inner.init(shard)
    }
    fn step(
        &self,
        state: &mut Self::State,
        shard: &ragged::optim::LocalShard,
        params: ragged::storage::ViewMut<'_, f32>,
        grads: ragged::storage::View<'_, f32>,
        comm: &dyn Communicator,
    ) -> ragged::Result<()> {
        let g = grads.cpu("recording step")?;
        let at = (g.as_ptr() as usize, g.len());
        self.seen.stepped.lock().unwrap().push(at);
        self.inner.step(state, shard, params, g.into(), comm)
    }
}

/// Zero copy by storage identity, through `ThreadWorld::run`: every parameter tensor the model
/// computes with *is* the segment the all-gather wrote (same address), the reduce-scatter reads
/// the very buffer backward accumulated into and writes the very storage the optimizer steps
/// on (with HSDP, `replicas > 1`, the replica all-reduce runs on that storage too), and the
/// buffer backward wrote holds, at the planned offsets, exactly the gradients plain candle
/// computes for the same model and batch.
fn collectives_run_on_the_model_storage(world: usize, replicas: usize) {
    let params = CFG.init_params(3).unwrap();
    ThreadWorld::run(world, |c| {
        let seen = Arc::new(Observed::default());
        let rec = Recorder {
            inner: HeldComm::Borrowed(c),
            seen: seen.clone(),
        };
        let opt = RecordingAdamW {
            inner: adamw(),
            seen: seen.clone(),
        };
        let opts = FsdpOptions {
            replicas,
            ..FsdpOptions::default()
        };
        let mut sharded = fully_shard(&params, opt, &rec, opts)?;
        let views = sharded.unshard()?;
        let model = Transformer::new(
            CFG,
            VarBuilder::from_tensors(views.clone(), DType::F32, &Device::Cpu),
        )?;
        let ids = batch(corpus().unwrap(), &CFG, 0, 0, 3)?;
        model.loss(&ids)?.backward()?;
        let sink = sharded
            .grad_sink("layers.0")
            .unwrap()
            .buffer_address()
            .unwrap();
        sharded.reduce_gradients()?;
        sharded.step()?;
        // Parameters: each view's storage is the segment the gather wrote for its offset.
        let segments = seen.segments.lock().unwrap().clone();
        for (unit, name, offset) in sharded.offsets() {
            let gathered: Vec<usize> = segments
                .iter()
                .filter(|s| s.0 == offset)
                .map(|s| s.1)
                .collect();
            assert!(
                gathered.contains(&address(&views[&name])),
                "{unit}/{name}: not the gathered storage"
            );
        }
        // Gradients: every unit's reduce-scatter wrote the storage its step read, which is
        // also where the replica all-reduce ran...
        let reduced = seen.reduced.lock().unwrap().clone();
        let outputs: Vec<(usize, usize)> = reduced.iter().map(|r| r.output).collect();
        assert_eq!(outputs.len(), sharded.unit_names().len());
        let mut stepped = seen.stepped.lock().unwrap().clone();
        stepped.sort_unstable();
        let mut sorted = outputs.clone();
        sorted.sort_unstable();
        assert_eq!(
            stepped, sorted,
            "the step must read the reduce-scatter's output"
        );
        let all_reduced = seen.all_reduced.lock().unwrap().clone();
        for out in &outputs {
            assert_eq!(
                all_reduced.contains(out),
                replicas > 1,
                "replica all-reduce on the reduced shard {out:?}: {all_reduced:?}"
            );
        }
        // ...the reduce-scatter input of layers.0 is the sink backward wrote...
        let order = sharded
            .unit_names()
            .iter()
            .position(|n| *n == "layers.0")
            .unwrap();
        let ReduceScatter {
            input, contents, ..
        } = reduced[order].clone();
        assert_eq!(
            input, sink.0,
            "reduce-scatter must read the buffer backward wrote"
        );
        // ...and holds exactly plain candle's gradients at the planned offsets.
        let reference: Vec<(String, Tensor)> = params
            .iter()
            .map(|(n, t)| (n.clone(), t.copy().unwrap()))
            .collect();
        let vars: Vec<(String, candle_core::Var)> = reference
            .iter()
            .map(|(n, t)| (n.clone(), candle_core::Var::from_tensor(t).unwrap()))
            .collect();
        let vb_map = vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let plain = Transformer::new(
            CFG,
            VarBuilder::from_tensors(vb_map, DType::F32, &Device::Cpu),
        )?;
        let grads = plain.loss(&ids)?.backward()?;
        for (unit, name, offset) in sharded.offsets().into_iter().filter(|o| o.0 == "layers.0") {
            let var = &vars.iter().find(|(n, _)| *n == name).unwrap().1;
            let g = grads
                .get(var.as_tensor())
                .unwrap()
                .flatten_all()?
                .to_vec1::<f32>()?;
            assert_eq!(&contents[offset..offset + g.len()], &g[..], "{unit}/{name}");
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn collectives_run_on_the_storage_the_model_backward_and_step_use() {
    collectives_run_on_the_model_storage(2, 1);
}

/// HSDP: 4 ranks as 2 replicas of shard groups of 2; the gathers and reduce-scatters run in
/// the groups, the replica all-reduce on the reduced shard.
#[test]
fn under_hsdp_collectives_run_on_the_storage_the_model_backward_and_step_use() {
    collectives_run_on_the_model_storage(4, 2);
}

/// The model is built once: tensors handed out by the first `unshard` see every later update.
#[test]
fn parameter_tensors_stay_valid_across_steps() {
    let params = CFG.init_params(3).unwrap();
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let views = sharded.unshard().unwrap();
    let q = views["layers.0.attn.q.weight"].clone();
    let model = Transformer::new(
        CFG,
        VarBuilder::from_tensors(views, DType::F32, &Device::Cpu),
    )
    .unwrap();
    let ids = batch(corpus().unwrap(), &CFG, 0, 0, 2).unwrap();
    let mut before = q.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for _ in 0..2 {
        model.loss(&ids).unwrap().backward().unwrap();
        sharded.reduce_gradients().unwrap();
        sharded.step().unwrap();
        sharded.unshard().unwrap();
        let after = q.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_ne!(
            before, after,
            "the first view must see the updated parameters"
        );
        assert_eq!(
            after,
            sharded.full_params().unwrap()["layers.0.attn.q.weight"]
        );
        before = after;
    }
}

/// Every parameter of the demo model trains: after one step through the entry point users call,
/// every parameter's reduced gradient is nonzero somewhere (attention q and k included, which a
/// forward-only softmax would leave at zero), and the runtime reports none as gradient-less.
#[test]
fn every_parameter_of_the_demo_model_receives_a_nonzero_gradient() {
    let params = CFG.init_params(5).unwrap();
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let ids = batch(corpus().unwrap(), &CFG, 0, 0, 4).unwrap();
    sharded
        .forward_backward(&TransformerStages(CFG), &ids)
        .unwrap();
    let mut zero = Vec::new();
    sharded
        .with_local_grads(|local, g| {
            for piece in &local.pieces {
                let span = &g[piece.offset..piece.offset + piece.range.len()];
                if span.iter().all(|&x| x == 0.0) {
                    zero.push(local.params[piece.param].name.clone());
                }
            }
        })
        .unwrap();
    assert!(
        zero.is_empty(),
        "parameters with an all-zero gradient: {zero:?}"
    );
    assert_eq!(sharded.params_without_gradient(), Some(&[][..]));
}

/// A staged model runs without sharding through `forward_unsharded` over `Var`s, and candle's
/// backward there gives, bitwise, the loss and every gradient that `forward_backward` reduces
/// in a world of one rank: the check of a user's staged model against plain candle.
#[test]
fn a_staged_model_runs_unsharded_with_the_gradients_a_world_of_one_reduces() {
    let params = CFG.init_params(5).unwrap();
    let ids = batch(corpus().unwrap(), &CFG, 0, 0, 4).unwrap();
    let vars: Vec<(String, candle_core::Var)> = params
        .iter()
        .map(|(n, t)| (n.clone(), candle_core::Var::from_tensor(t).unwrap()))
        .collect();
    let all = vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone()));
    let unit_params = UnitParams::from_tensors(all).unwrap();
    let loss = forward_unsharded(&TransformerStages(CFG), &unit_params, &ids).unwrap();
    let grads = loss.backward().unwrap();

    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let report = sharded
        .forward_backward(&TransformerStages(CFG), &ids)
        .unwrap();
    assert_eq!(
        report.loss.to_bits(),
        loss.to_scalar::<f32>().unwrap().to_bits()
    );
    let mut compared = 0;
    sharded
        .with_local_grads(|local, g| {
            for piece in &local.pieces {
                let name = &local.params[piece.param].name;
                let (_, var) = vars.iter().find(|(n, _)| n == name).unwrap();
                let full = grads.get(var).expect("a gradient").flatten_all().unwrap();
                let want = full.to_vec1::<f32>().unwrap()[piece.range.clone()].to_vec();
                let got = &g[piece.offset..piece.offset + piece.range.len()];
                assert!(
                    want.iter().any(|&x| x != 0.0),
                    "{name}: an all-zero gradient"
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(got), bits(&want), "{name}");
                compared += piece.range.len();
            }
        })
        .unwrap();
    assert_eq!(
        compared,
        params.iter().map(|(_, t)| t.elem_count()).sum::<usize>()
    );
    // Bad input is named.
    let t = || Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
    let twice = UnitParams::from_tensors([("a".into(), t()), ("a".into(), t())]);
    assert!(twice.err().unwrap().to_string().contains("listed twice"));
    let f64 = Tensor::zeros(2, DType::F64, &Device::Cpu).unwrap();
    let mixed = UnitParams::from_tensors([("a".into(), t()), ("b".into(), f64)]);
    assert!(mixed
        .err()
        .unwrap()
        .to_string()
        .contains("is F64, the ones before F32"));
}

/// A stage that ignores a parameter (as a forward-only kernel does) gets it reported by name.
#[test]
fn parameters_that_get_no_gradient_are_reported_by_name() {
    struct SkipsHead(TransformerStages);
    impl Stages for SkipsHead {
        type Batch = Tensor;
        fn stage_units(&self) -> Vec<String> {
            self.0.stage_units()
        }
        fn forward(
            &self,
            s: usize,
            p: &UnitParams,
            x: Option<&Tensor>,
            ids: &Tensor,
        ) -> candle_core::Result<Tensor> {
            match x {
                Some(x) if s + 1 == self.0.stage_units().len() => {
                    x.detach().sqr()?.mean_all() + p.get("norm.weight")?.sum_all()?
                }
                _ => self.0.forward(s, p, x, ids),
            }
        }
    }
    let params = CFG.init_params(5).unwrap();
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let ids = batch(corpus().unwrap(), &CFG, 0, 0, 2).unwrap();
    sharded
        .forward_backward(&SkipsHead(TransformerStages(CFG)), &ids)
        .unwrap();
    let mut missing = sharded.params_without_gradient().unwrap().to_vec();
    missing.sort();
    let mut expected: Vec<String> = CFG
        .param_shapes()
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| n != "norm.weight")
        .collect();
    expected.sort();
    assert_eq!(missing, expected);
    // `require_gradients`: the first backward fails on every rank, naming every one of them
    // (not only those of the first unit reduced).
    let strict = FsdpOptions {
        require_gradients: true,
        ..FsdpOptions::default()
    };
    let errors = ThreadWorld::run(2, |c| {
        let mut sharded = fully_shard(&params, adamw(), c, strict.clone())?;
        let ids = batch(corpus()?, &CFG, 0, c.rank() * 2, 2)?;
        let stages = SkipsHead(TransformerStages(CFG));
        Ok(sharded
            .forward_backward(&stages, &ids)
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    for e in errors {
        assert!(e.contains("no gradient reached"), "{e}");
        for name in &expected {
            assert!(e.contains(&format!("{name:?}")), "{name} not in {e}");
        }
        assert!(!e.contains("\"norm.weight\""), "{e}");
    }
}

/// `layers.0.w` and `layers.1.w`, random `n × n`: two units of one matrix each.
fn two_square_layers(n: usize) -> Vec<(String, Tensor)> {
    (0..2)
        .map(|i| {
            let w = Tensor::randn(0f32, 0.1, (n, n), &Device::Cpu).unwrap();
            (format!("layers.{i}.w"), w)
        })
        .collect()
}

/// A stage that computes with a parameter of an earlier stage's unit (a weight shared between
/// units, kept from that stage): with the default reshard-after-forward that unit's storages
/// are freed by then. The stage gets an `Err` naming the freed unit and the two fixes, on every
/// rank, through the entry point users call, whether the op it runs checks its operands
/// (a matmul) or reads the storage directly (a unary op, which panics inside candle); before,
/// candle's kernels read past the emptied `f32` storage and the process died of a segfault.
/// With `reshard_after_forward: false`, the fix the error names, the same model trains.
#[test]
fn a_stage_using_a_freed_parameter_gets_an_error_naming_the_cause_not_a_crash() {
    use std::sync::Mutex as StdMutex;
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Use {
        /// `x · w0`: candle checks the operands' dtypes.
        Matmul,
        /// `exp(w0)`: reads the storage directly.
        Unary,
        /// Not `w0` at all: a shape error of the stage's own.
        OwnError,
    }
    struct KeepsWeight {
        kept: StdMutex<Option<Tensor>>,
        use_: Use,
    }
    impl Stages for KeepsWeight {
        type Batch = Tensor;
        fn stage_units(&self) -> Vec<String> {
            vec!["layers.0".into(), "layers.1".into()]
        }
        fn forward(
            &self,
            s: usize,
            p: &UnitParams,
            x: Option<&Tensor>,
            batch: &Tensor,
        ) -> candle_core::Result<Tensor> {
            if s == 0 {
                let w = p.get("layers.0.w")?;
                *self.kept.lock().unwrap() = Some(w.clone());
                return batch.matmul(w);
            }
            let w0 = self.kept.lock().unwrap().clone().expect("stage 0 ran");
            let x = x.expect("stage 1 has an input");
            let y = match self.use_ {
                Use::Unary => x.broadcast_add(&w0.exp()?.sum_all()?)?,
                Use::Matmul => x.matmul(&w0)?,
                Use::OwnError => x.matmul(x)?,
            };
            y.matmul(p.get("layers.1.w")?)?.sqr()?.mean_all()
        }
    }
    let params = two_square_layers(64);
    let run = |use_: Use, reshard: bool| {
        ThreadWorld::run(2, |c| {
            let opts = FsdpOptions {
                reshard_after_forward: reshard,
                ..FsdpOptions::default()
            };
            let mut sharded = fully_shard(&params, adamw(), c, opts)?;
            let batch = Tensor::ones((8, 64), DType::F32, &Device::Cpu)?;
            let model = KeepsWeight {
                kept: StdMutex::new(None),
                use_,
            };
            sharded.forward_backward(&model, &batch)?;
            sharded.step()
        })
    };
    for use_ in [Use::Matmul, Use::Unary] {
        let e = run(use_, true).expect_err("a freed parameter was read");
        let text = e.to_string();
        assert!(
            text.contains("stage 1")
                && text.contains("[\"layers.0\"] were freed after their forward")
                && text.contains("reshard_after_forward: false"),
            "{use_:?}: {text}"
        );
        run(use_, false).expect("gathered from forward to backward, the weight is there");
    }
    // The stage's own error, after a freed unit, is not blamed on the freed unit.
    let text = run(Use::OwnError, true).unwrap_err().to_string();
    assert!(
        text.contains("stage 1")
            && text.contains("shape mismatch")
            && !text.contains("were freed after their forward"),
        "{text}"
    );
}

/// A stage that computes with a parameter tensor it kept from the previous step (its storage
/// freed since, a U8 placeholder) gets an error that says so, not only candle's dtype mismatch.
#[test]
fn a_stage_using_a_tensor_kept_from_an_earlier_step_is_told_why_it_fails() {
    use std::sync::Mutex as StdMutex;
    struct KeepsAcrossSteps(StdMutex<Option<Tensor>>);
    impl Stages for KeepsAcrossSteps {
        type Batch = Tensor;
        fn stage_units(&self) -> Vec<String> {
            vec!["layers.0".into(), "layers.1".into()]
        }
        fn forward(
            &self,
            s: usize,
            p: &UnitParams,
            x: Option<&Tensor>,
            batch: &Tensor,
        ) -> candle_core::Result<Tensor> {
            let w = p.get(&format!("layers.{s}.w"))?.clone();
            let w = match s {
                0 => self.0.lock().unwrap().get_or_insert(w).clone(),
                _ => w,
            };
            let y = x.unwrap_or(batch).matmul(&w)?;
            if s == 1 {
                return y.sqr()?.mean_all();
            }
            Ok(y)
        }
    }
    let params = two_square_layers(16);
    let mut m = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let model = KeepsAcrossSteps(StdMutex::new(None));
    let batch = Tensor::ones((4, 16), DType::F32, &Device::Cpu).unwrap();
    m.forward_backward(&model, &batch).unwrap();
    m.step().unwrap();
    let e = m
        .forward_backward(&model, &batch)
        .expect_err("a kept tensor's storage is freed");
    assert!(
        e.to_string()
            .contains("kept from an earlier forward_backward"),
        "{e}"
    );
}

/// A stage that asks for another unit's parameter (a wrap rule that put it in the wrong unit)
/// gets an error naming the unit that holds it, not the hint about freed parameters that a
/// resharded unit before it would otherwise add.
#[test]
fn a_stage_asking_for_another_units_parameter_is_told_where_it_is() {
    struct AsksForLayer0;
    impl Stages for AsksForLayer0 {
        type Batch = Tensor;
        fn stage_units(&self) -> Vec<String> {
            vec!["layers.0".into(), "layers.1".into()]
        }
        fn forward(
            &self,
            s: usize,
            p: &UnitParams,
            x: Option<&Tensor>,
            batch: &Tensor,
        ) -> candle_core::Result<Tensor> {
            match x {
                None => batch.matmul(p.get("layers.0.w")?),
                Some(x) => x.matmul(p.get(&format!("layers.{}.w", s - 1))?)?.mean_all(),
            }
        }
    }
    let params = two_square_layers(16);
    let errors = ThreadWorld::run(2, |c| {
        let mut sharded = fully_shard(&params, adamw(), c, FsdpOptions::default())?;
        let batch = Tensor::ones((4, 16), DType::F32, &Device::Cpu)?;
        Ok(sharded
            .forward_backward(&AsksForLayer0, &batch)
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    for text in errors {
        assert!(
            text.contains("stage 1")
                && text
                    .contains("layers.0.w is a parameter of unit layers.0, not of unit layers.1")
                && !text.contains("were freed"),
            "{text}"
        );
    }
}

fn bf16_policy() -> FsdpOptions {
    FsdpOptions {
        mixed_precision: MixedPrecision {
            param_dtype: DType::BF16,
            reduce_dtype: DType::BF16,
        },
        ..FsdpOptions::default()
    }
}

/// The mixed-precision contract. Under one policy the layouts and recomputation stay bitwise
/// (same casts, same reductions in rank order), and the master weights stay f32. Sharded vs
/// unsharded is a tolerance: every op of the bf16 forward and backward rounds to 8 mantissa
/// bits, so per-rank mean gradients differ from the global batch's in about the third digit,
/// and Adam steps each element by up to ~lr whatever its gradient's size: parameters may drift
/// apart by up to ~lr per step (bound STEPS·lr), while the losses track within 2 %.
#[test]
fn bf16_mixed_precision_keeps_layouts_bitwise_and_tracks_unsharded() {
    let ragged = train(3, bf16_policy(), TrainMode::UnitByUnit);
    let fsdp2 = FsdpOptions {
        layout: ShardLayout::Fsdp2,
        ..bf16_policy()
    };
    assert_eq!(bits(&ragged), bits(&train(3, fsdp2, TrainMode::UnitByUnit)));
    let keep = FsdpOptions {
        reshard_after_forward: false,
        ..bf16_policy()
    };
    assert_eq!(bits(&ragged), bits(&train(3, keep, TrainMode::UnitByUnit)));
    let recompute = FsdpOptions {
        recompute: true,
        ..bf16_policy()
    };
    assert_eq!(
        bits(&ragged),
        bits(&train(3, recompute, TrainMode::UnitByUnit))
    );
    let params = CFG.init_params(7).unwrap();
    let one = train_rank(
        CFG,
        &params,
        adamw(),
        &SingleRank,
        bf16_policy(),
        TrainMode::UnitByUnit,
        STEPS,
        BATCH,
        |_, _| {},
    )
    .unwrap();
    let diff = max_abs_diff(&ragged.1, &one.1);
    println!("bf16 V=3 vs unsharded: max |Δparam| = {diff:.3e}");
    assert!(diff <= STEPS as f32 * LR as f32, "{diff}");
    // Master weights are f32: some values are not representable in bf16.
    let f32_only = ragged
        .1
        .values()
        .flatten()
        .filter(|x| half::bf16::from_f32(**x).to_f32() != **x)
        .count();
    assert!(
        f32_only > 0,
        "the master weights must not be rounded to bf16"
    );
    for (a, b) in ragged.0.iter().zip(&one.0) {
        assert!(
            (a.loss - b.loss).abs() <= 2e-2 * b.loss.abs(),
            "loss {} vs {}",
            a.loss,
            b.loss
        );
    }
}

/// bf16 gathers and reductions move exactly half the collective bytes of f32 ones.
#[test]
fn bf16_collectives_move_half_the_bytes() {
    let params = CFG.init_params(2).unwrap();
    let bytes = |opts: FsdpOptions| {
        ThreadWorld::run(2, |c| {
            let mut sharded = fully_shard(&params, adamw(), c, opts.clone())?;
            let ids = batch(corpus().unwrap(), &CFG, 0, c.rank() * 2, 2)?;
            sharded.forward_backward(&TransformerStages(CFG), &ids)?;
            Ok(sharded.stats().collective())
        })
        .unwrap()[0]
    };
    let (f32_bytes, bf16_bytes) = (bytes(FsdpOptions::default()), bytes(bf16_policy()));
    assert!(f32_bytes > 0);
    assert_eq!(2 * bf16_bytes, f32_bytes);
}

/// Every rank's error is rank 0's, which names `what` and rank 1.
fn same_error_naming_rank_1(errors: &[Option<String>], what: &str) {
    let first = errors[0].clone().expect("rank 0 must fail too");
    assert!(
        first.contains(what) && first.contains("ranks [1]"),
        "{first}"
    );
    assert!(
        errors.iter().all(|e| e.as_ref() == Some(&first)),
        "{errors:?}"
    );
}

/// Rank 1 given the same pairs in another order (a `HashMap`'s iteration order), or other
/// initial values: every rank gets the same error, naming what differs, and nothing trains.
#[test]
fn ranks_that_disagree_fail_on_every_rank_with_the_same_error() {
    let params = CFG.init_params(7).unwrap();
    let mut reversed = params.clone();
    reversed.reverse();
    let other_seed = CFG.init_params(8).unwrap();
    for (what, rank1) in [
        ("names and order", &reversed),
        ("initial values", &other_seed),
    ] {
        let errors = ThreadWorld::run(3, |c| {
            let mine = if c.rank() == 1 { rank1 } else { &params };
            Ok(fully_shard(mine, adamw(), c, FsdpOptions::default())
                .err()
                .map(|e| e.to_string()))
        })
        .unwrap();
        same_error_naming_rank_1(&errors, what);
    }
    // Another optimizer setting on rank 1 (a launcher script that differs per rank): the
    // learning rate, the weight decay (named with both values), or a role rule that makes
    // the norms matrices (the same text, other roles).
    let same_fn: RoleFn = |_, _| None;
    let cfg = || AdamWConfig {
        lr: LR,
        roles: RoleRule::with_fn(same_fn),
        ..AdamWConfig::default()
    };
    let norms_as_matrices: RoleFn = |name, _| name.contains("norm").then_some(Role::Matrix);
    let configs = [
        (
            "learning rate",
            AdamWConfig {
                lr: LR * 2.0,
                ..cfg()
            },
        ),
        (
            "rank 0 has `weight_decay: 0.01`, rank 1 `weight_decay: 0.02`",
            AdamWConfig {
                weight_decay: 0.02,
                ..cfg()
            },
        ),
        (
            "the parameters' roles",
            AdamWConfig {
                roles: RoleRule::with_fn(norms_as_matrices),
                ..cfg()
            },
        ),
    ];
    for (what, rank1) in configs {
        let errors = ThreadWorld::run(3, |c| {
            let config = if c.rank() == 1 { rank1 } else { cfg() };
            Ok(
                fully_shard(&params, AdamW::new(config)?, c, FsdpOptions::default())
                    .err()
                    .map(|e| e.to_string()),
            )
        })
        .unwrap();
        same_error_naming_rank_1(&errors, what);
    }
    // Other FsdpOptions on rank 1: another overlap or reshard rhythm would call other
    // collectives mid-step, another non-finite policy would part the ranks silently.
    for (what, rank1) in [
        (
            "rank 0 has `overlap: true`, rank 1 `overlap: false`",
            FsdpOptions {
                overlap: false,
                ..FsdpOptions::default()
            },
        ),
        (
            "rank 0 has `non_finite: Error`, rank 1 `non_finite: SkipStep`",
            FsdpOptions {
                non_finite: ragged::fsdp::NonFinitePolicy::SkipStep,
                ..FsdpOptions::default()
            },
        ),
    ] {
        let errors = ThreadWorld::run(3, |c| {
            let opts = if c.rank() == 1 {
                rank1.clone()
            } else {
                FsdpOptions::default()
            };
            Ok(fully_shard(&params, adamw(), c, opts)
                .err()
                .map(|e| e.to_string()))
        })
        .unwrap();
        same_error_naming_rank_1(&errors, what);
        assert!(errors[0].as_deref().unwrap().contains("the FsdpOptions"));
    }
    // The same input everywhere passes.
    ThreadWorld::run(3, |c| {
        fully_shard(&params, adamw(), c, FsdpOptions::default()).map(|_| ())
    })
    .unwrap();
}

/// Units by default detect numbered blocks under any prefix (GPT-2's `transformer.h.N`, an
/// MoE layer's experts stay inside their layer), and a custom rule regroups them.
#[test]
fn units_follow_numbered_blocks_or_a_custom_wrap_rule() {
    let shape = |n: &str, s: &[usize]| {
        (
            n.to_string(),
            Tensor::zeros(s, DType::F32, &Device::Cpu).unwrap(),
        )
    };
    let params = vec![
        shape("transformer.wte.weight", &[16, 8]),
        shape("transformer.h.0.attn.c_attn.weight", &[8, 24]),
        shape("transformer.h.0.mlp.experts.3.w1", &[8, 8]),
        shape("transformer.h.1.attn.c_attn.weight", &[8, 24]),
        shape("transformer.h.10.attn.c_attn.weight", &[8, 24]),
        shape("transformer.ln_f.weight", &[8]),
    ];
    let names = |opts: FsdpOptions| {
        let sharded = fully_shard(&params, adamw(), &SingleRank, opts).unwrap();
        let units: Vec<String> = sharded.unit_names().iter().map(|s| s.to_string()).collect();
        let sizes: Vec<usize> = sharded
            .local_shards()
            .iter()
            .map(|l| l.params.len())
            .collect();
        (units, sizes)
    };
    let (units, sizes) = names(FsdpOptions::default());
    assert_eq!(
        units,
        [
            "root",
            "transformer.h.0",
            "transformer.h.1",
            "transformer.h.10"
        ]
    );
    assert_eq!(sizes, [2, 2, 1, 1]);
    let pairs = ragged::fsdp::WrapPolicy::Custom(std::sync::Arc::new(|name: &str| {
        let layer: usize = ragged::model::numbered_block_of(name)?
            .rsplit('.')
            .next()?
            .parse()
            .ok()?;
        Some(format!("pair{}", layer / 2))
    }));
    let (units, _) = names(FsdpOptions {
        wrap: pairs,
        ..FsdpOptions::default()
    });
    assert_eq!(units, ["root", "pair0", "pair5"]);
    // A rule that names `root` itself puts the tensor in the one root unit, not a second unit
    // of the same name that no stage list could tell apart.
    let into_root = ragged::fsdp::WrapPolicy::Custom(std::sync::Arc::new(|name: &str| {
        Some(
            if name.contains(".h.1") {
                "late"
            } else {
                "root"
            }
            .to_string(),
        )
    }));
    let (units, sizes) = names(FsdpOptions {
        wrap: into_root,
        ..FsdpOptions::default()
    });
    assert_eq!(
        (units, sizes),
        (vec!["root".into(), "late".into()], vec![4, 2])
    );
}

/// A diverging run (lr 1e19, just under the largest rate accepted, 2^64) is stopped before
/// its first non-finite step on every rank, with an error saying why; under `SkipStep` the bad
/// steps are skipped and counted, and the parameters stay finite.
#[test]
fn non_finite_values_stop_or_skip_the_step_on_every_rank() {
    let params = CFG.init_params(7).unwrap();
    let huge = || {
        AdamW::new(AdamWConfig {
            lr: 1e19,
            ..AdamWConfig::default()
        })
        .unwrap()
    };
    let errors = ThreadWorld::run(2, |c| {
        let out = train_rank(
            CFG,
            &params,
            huge(),
            c,
            FsdpOptions::default(),
            TrainMode::UnitByUnit,
            4,
            4,
            |_, _| {},
        );
        Ok(out.err().map(|e| e.to_string()))
    })
    .unwrap();
    for e in &errors {
        let e = e.as_ref().expect("every rank must fail");
        assert!(
            e.contains("non-finite") && e.contains("NaN or infinite"),
            "{e}"
        );
    }
    let skipped = ThreadWorld::run(2, |c| {
        let opts = FsdpOptions {
            non_finite: ragged::fsdp::NonFinitePolicy::SkipStep,
            ..FsdpOptions::default()
        };
        let mut sharded = fully_shard(&params, huge(), c, opts)?;
        for step in 0..4 {
            let ids = batch(corpus().unwrap(), &CFG, step, c.rank() * 2, 2)?;
            sharded.forward_backward(&TransformerStages(CFG), &ids)?;
            sharded.step()?;
        }
        let finite = sharded
            .full_params()?
            .values()
            .flatten()
            .all(|x| x.is_finite());
        Ok((sharded.skipped_steps(), finite))
    })
    .unwrap();
    for (n, finite) in skipped {
        assert!(n >= 1 && finite, "skipped {n}, finite {finite}");
    }
}

/// Finite gradients whose global norm overflows f32 (every element 3e38) are clipped to the
/// requested norm (the factor, ~1e-40, is subnormal in f32: applied in one multiply it left
/// the norm at 1.0000004 for a maximum of 1), and the returned norm saturates to +inf.
#[test]
fn gradients_whose_norm_overflows_f32_are_clipped_to_max_norm() {
    let params = vec![(
        "w".to_string(),
        Tensor::ones((16, 20), DType::F32, &Device::Cpu).unwrap(),
    )];
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let w = sharded.unshard().unwrap().remove("w").unwrap();
    // d(sum(w·c))/dw = c, exactly.
    (w * 3e38).unwrap().sum_all().unwrap().backward().unwrap();
    sharded.reduce_gradients().unwrap();
    let norm = sharded.clip_grad_norm(1.0).unwrap();
    assert_eq!(norm, f32::INFINITY);
    let mut squares = 0f64;
    sharded
        .with_local_grads(|_, g| {
            assert!(g.iter().all(|&x| x == g[0] && x > 0.0), "clipped alike");
            squares = g.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        })
        .unwrap();
    let clipped = squares.sqrt();
    assert!(
        (clipped - 1.0).abs() <= 1.2e-7,
        "clipped norm {clipped}, max_norm 1"
    );
}

/// Clipping given the same gradients: rank 0 backpropagates the whole batch, the others a zero
/// loss, and gradients are summed, so every sharding holds exactly the unsharded gradients.
/// The global norm is then the same bits at V = 1, 2, 3, 4 and unsharded, so are the clipped
/// gradients, and the norm agrees with a plain f64 sum (which rounds as it goes) to f32 rounding.
#[test]
fn clipping_is_bitwise_the_same_sharded_and_unsharded() {
    let params = CFG.init_params(4).unwrap();
    let ids = batch(corpus().unwrap(), &CFG, 0, 0, 4).unwrap();
    let clip = |c: &dyn Communicator| -> ragged::Result<(f32, HashMap<String, Vec<u32>>)> {
        let opts = FsdpOptions {
            reduce: ReduceOp::Sum,
            ..FsdpOptions::default()
        };
        let mut sharded = fully_shard(&params, adamw(), c, opts)?;
        common::backward_on_one_rank(&mut sharded, CFG, &ids, c.rank(), 0)?;
        let norm = sharded.clip_grad_norm(0.5)?;
        let mut clipped = HashMap::new();
        sharded.with_local_grads(|local, g| {
            for p in &local.pieces {
                let bits = g[p.offset..p.offset + p.range.len()]
                    .iter()
                    .map(|x| x.to_bits());
                let name = format!("{}@{}", local.params[p.param].name, p.range.start);
                clipped.insert(name, bits.collect());
            }
        })?;
        Ok((norm, clipped))
    };
    let (norm, reference) = clip(&SingleRank).unwrap();
    assert!(norm > 0.5, "the test must clip: norm {norm}");
    for world in [1, 2, 3, 4] {
        let runs = ThreadWorld::run(world, |c| clip(c)).unwrap();
        for (r, (n, pieces)) in runs.iter().enumerate() {
            assert_eq!(n.to_bits(), norm.to_bits(), "V={world} rank {r}: norm");
            for (name, bits) in pieces {
                let (param, start) = name.split_once('@').unwrap();
                let start: usize = start.parse().unwrap();
                let whole = reference
                    .iter()
                    .find(|(k, _)| k.starts_with(&format!("{param}@")))
                    .unwrap()
                    .1;
                assert_eq!(
                    &whole[start..start + bits.len()],
                    &bits[..],
                    "V={world}: {name}"
                );
            }
        }
    }
    // Against a plain f64 sum of the unclipped gradients: the exact sum is within rounding.
    let grads = {
        let mut s = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
        let views = s.unshard().unwrap();
        let m = Transformer::new(
            CFG,
            VarBuilder::from_tensors(views, DType::F32, &Device::Cpu),
        )
        .unwrap();
        m.loss(&ids).unwrap().backward().unwrap();
        s.reduce_gradients().unwrap();
        let mut sum = 0f64;
        s.with_local_grads(|_, g| g.iter().for_each(|&x| sum += f64::from(x) * f64::from(x)))
            .unwrap();
        sum.sqrt()
    };
    assert!(
        (f64::from(norm) - grads).abs() <= 1e-6 * grads,
        "{norm} vs {grads}"
    );
}

/// After a unit-by-unit step no unit holds a full gradient buffer or gathered parameters: each
/// was reduced and freed during backward, and nothing reached it afterwards (a stage's input
/// gradient carries a graph back into the next stage's weights unless it is detached; the MLP
/// stack, whose input gradients are matmuls with the weights, shows it).
#[test]
fn forward_backward_leaves_only_shards_behind() {
    fn check<M: Stages>(
        sharded: &mut ragged::fsdp::ShardedModel<'_, AdamW>,
        model: &M,
        batch: &M::Batch,
    ) {
        for step in 0..2 {
            sharded.forward_backward(model, batch).unwrap();
            for name in sharded.unit_names() {
                let sink = sharded.grad_sink(name).unwrap();
                assert!(
                    !sink.holds_gradients(),
                    "step {step}: unit {name} still holds gradients"
                );
            }
            let sharded_only = sharded
                .unshard_state()
                .iter()
                .all(|s| *s == ragged::dbuffer::Materialized::Sharded);
            assert!(sharded_only, "step {step}: a unit is still gathered");
            sharded.step().unwrap();
        }
    }
    let params = CFG.init_params(9).unwrap();
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let ids = batch(corpus().unwrap(), &CFG, 0, 0, 2).unwrap();
    check(&mut sharded, &TransformerStages(CFG), &ids);
    let mlp = ragged::demo::MlpConfig {
        width: 8,
        hidden: 16,
        layers: 3,
    };
    let params = mlp.init_params(1).unwrap();
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    check(
        &mut sharded,
        &ragged::demo::MlpStages(mlp),
        &mlp.batch(0, 4).unwrap(),
    );
}

/// The MLP stack (whose stage-input gradients are matmuls with the weights) trains bitwise the
/// same unit by unit, with recomputation, as in one whole-model backward, over several steps.
#[test]
fn mlp_stack_trains_the_same_unit_by_unit_and_whole() {
    let mlp = ragged::demo::MlpConfig {
        width: 8,
        hidden: 16,
        layers: 3,
    };
    let params = mlp.init_params(1).unwrap();
    let run = |whole: bool| {
        let mut sharded =
            fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
        for step in 0..3 {
            let b = mlp.batch(step, 4).unwrap();
            if whole {
                let views = sharded.unshard().unwrap();
                let mut x = b.x.clone();
                for i in 0..mlp.layers {
                    x = mlp.block(i, |n| Ok(views[n].clone()), &x).unwrap();
                }
                ragged::demo::MlpConfig::loss(&x, &b.y)
                    .unwrap()
                    .backward()
                    .unwrap();
                sharded.reduce_gradients().unwrap();
            } else {
                sharded
                    .forward_backward(&ragged::demo::MlpStages(mlp), &b)
                    .unwrap();
            }
            sharded.step().unwrap();
        }
        let mut v: Vec<_> = sharded.full_params().unwrap().into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v.into_iter()
            .map(|(n, x)| (n, x.iter().map(|f| f.to_bits()).collect::<Vec<_>>()))
            .collect::<Vec<_>>()
    };
    assert_eq!(run(false), run(true));
}

/// The MLP stack's stages with a twist: only the first `listed` stages are listed, and on
/// rank `zero_rank` the loss is multiplied by 0, by `affine` (which drops candle's graph) when
/// `drop_graph`, else by a zeros tensor (graph kept, zero gradients).
struct TweakedMlp {
    inner: ragged::demo::MlpStages,
    listed: usize,
    rank: usize,
    zero_rank: Option<usize>,
    drop_graph: bool,
}

impl Stages for TweakedMlp {
    type Batch = ragged::demo::MlpBatch;
    fn stage_units(&self) -> Vec<String> {
        self.inner.stage_units()[..self.listed].to_vec()
    }
    fn forward(
        &self,
        stage: usize,
        params: &UnitParams,
        x: Option<&Tensor>,
        batch: &Self::Batch,
    ) -> candle_core::Result<Tensor> {
        let out = self.inner.forward(stage, params, x, batch)?;
        if stage + 1 < self.inner.0.layers || self.zero_rank != Some(self.rank) {
            Ok(out)
        } else if self.drop_graph {
            out.affine(0.0, 0.0)
        } else {
            out.broadcast_mul(&out.zeros_like()?)
        }
    }
}

const MLP3: ragged::demo::MlpConfig = ragged::demo::MlpConfig {
    width: 8,
    hidden: 16,
    layers: 3,
};

/// A rank whose loss reaches no parameter (times 0 by candle's `affine`, which drops the
/// graph) takes part in the same collectives as the others: the steps succeed on every rank
/// and equal those where that rank's loss is multiplied by a zeros tensor (graph kept, zero
/// gradients), with and without overlap. Before, that rank skipped its re-gathers and the
/// ranks called different collectives.
#[test]
fn a_rank_whose_graph_is_cut_calls_the_same_collectives() {
    let params = MLP3.init_params(1).unwrap();
    for overlap in [false, true] {
        let run = |drop_graph: bool| {
            ThreadWorld::run(2, |c| {
                let opts = FsdpOptions {
                    overlap,
                    ..FsdpOptions::default()
                };
                let mut m = fully_shard(&params, adamw(), c, opts)?;
                let stages = TweakedMlp {
                    inner: ragged::demo::MlpStages(MLP3),
                    listed: MLP3.layers,
                    rank: c.rank(),
                    zero_rank: Some(1),
                    drop_graph,
                };
                for step in 0..2 {
                    m.forward_backward(&stages, &MLP3.batch(step, 4)?)?;
                    m.step()?;
                }
                m.full_params()
            })
            .unwrap()
            .remove(0)
        };
        assert!(run(true) == run(false), "overlap {overlap}");
    }
}

/// Whether a parameter got a gradient is decided over all ranks: one whose loss reaches no
/// parameter (rank 1's, times 0) while rank 0's reaches them all reports none missing, as
/// rank 0 does, and `require_gradients` passes on both. Before, each rank judged its own
/// backward: rank 1 listed every parameter and, under `require_gradients`, failed alone while
/// rank 0 went on to a step whose collectives rank 1 never joined.
#[test]
fn parameters_without_gradient_are_judged_over_all_ranks() {
    let params = MLP3.init_params(1).unwrap();
    for require_gradients in [false, true] {
        let opts = FsdpOptions {
            require_gradients,
            ..FsdpOptions::default()
        };
        let missing = ThreadWorld::run(2, |c| {
            let mut m = fully_shard(&params, adamw(), c, opts.clone())?;
            let stages = TweakedMlp {
                inner: ragged::demo::MlpStages(MLP3),
                listed: MLP3.layers,
                rank: c.rank(),
                zero_rank: Some(1),
                drop_graph: true,
            };
            m.forward_backward(&stages, &MLP3.batch(0, 4)?)?;
            m.step()?;
            Ok(m.params_without_gradient().map(<[String]>::to_vec))
        })
        .unwrap();
        assert_eq!(
            missing,
            vec![Some(vec![]), Some(vec![])],
            "require_gradients {require_gradients}"
        );
    }
}

/// A unit with trainable parameters that no stage lists is named by `forward_backward`
/// (before, every `step` failed with "no reduced gradients", naming nothing).
#[test]
fn a_unit_no_stage_runs_is_named() {
    let params = MLP3.init_params(1).unwrap();
    let mut m = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let first_two = TweakedMlp {
        inner: ragged::demo::MlpStages(MLP3),
        listed: 2,
        rank: 0,
        zero_rank: None,
        drop_graph: false,
    };
    let err = m
        .forward_backward(&first_two, &MLP3.batch(0, 4).unwrap())
        .expect_err("layers.2 is in no stage");
    assert!(err.to_string().contains("unit layers.2"), "{err}");
}

/// A schedule sets the rate of every step (factor of the step count times the configured
/// rate), and `learning_rate` reports it from before the first step on; a rate of 0 leaves the
/// parameters bitwise unchanged; bad rates are refused.
#[test]
fn schedules_and_set_learning_rate_drive_the_optimizer() {
    use ragged::schedule::Schedule;
    let params = CFG.init_params(6).unwrap();
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let schedule = Schedule::WarmupCosine {
        warmup: 2,
        total: 5,
        min_factor: 0.0,
    };
    sharded.set_schedule(schedule).unwrap();
    // Before any step: the rate the first step will take (warmup's first factor, 1/2).
    assert_eq!(sharded.learning_rate(), Some(LR * schedule.factor(0)));
    assert!(schedule.factor(0) < 1.0);
    let ids = batch(corpus().unwrap(), &CFG, 0, 0, 2).unwrap();
    for step in 0..6 {
        sharded
            .forward_backward(&TransformerStages(CFG), &ids)
            .unwrap();
        let before = sharded.full_params().unwrap();
        sharded.step().unwrap();
        let lr = sharded.learning_rate().unwrap();
        assert_eq!(lr, LR * schedule.factor(step), "step {step}");
        let after = sharded.full_params().unwrap();
        // Step 5 is past `total`: factor 0, so nothing moves.
        assert_eq!(before == after, step == 5, "step {step}");
    }
    assert_eq!(sharded.steps_taken(), 6);
    assert!(sharded.set_learning_rate(-1.0).is_err());
    assert!(sharded.set_learning_rate(f64::NAN).is_err());
    sharded.set_learning_rate(0.5).unwrap();
    assert_eq!(sharded.learning_rate(), Some(0.5));
}

/// A schedule whose rates the optimizer would refuse is refused by `set_schedule`, not by the
/// step that reaches such a rate: a floor of 1e-300 (a rate of 1e-302, subnormal in f32)
/// failed `step()` at step `total` of a run, and a long warmup from a small rate failed the
/// first step. The refusal leaves the rate and any earlier schedule as they were.
#[test]
fn a_schedule_with_a_rate_the_optimizer_refuses_is_refused_when_set() {
    use ragged::schedule::Schedule;
    let params = CFG.init_params(6).unwrap();
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let good = Schedule::WarmupLinear {
        warmup: 0,
        total: 3,
        min_factor: 0.5,
    };
    sharded.set_schedule(good).unwrap();
    let floor = Schedule::WarmupLinear {
        warmup: 1,
        total: 3,
        min_factor: 1e-300,
    };
    let err = sharded.set_schedule(floor).expect_err("a subnormal rate");
    let err = err.to_string();
    assert!(
        err.contains("set_schedule") && err.contains("learning rate must be 0 or lie in"),
        "{err}"
    );
    // The good schedule still runs, from the configured rate.
    let ids = batch(corpus().unwrap(), &CFG, 0, 0, 2).unwrap();
    for step in 0..4 {
        sharded
            .forward_backward(&TransformerStages(CFG), &ids)
            .unwrap();
        sharded.step().unwrap();
        assert_eq!(sharded.learning_rate(), Some(LR * good.factor(step)));
    }
    // A warmup's first rate: 1e-30 / 1e9 is subnormal in f32; the rate stays 1e-30.
    sharded.set_learning_rate(1e-30).unwrap();
    let warmup = Schedule::WarmupLinear {
        warmup: 1_000_000_000,
        total: 1_000_000_000,
        min_factor: 1.0,
    };
    assert!(sharded.set_schedule(warmup).is_err());
    assert_eq!(sharded.learning_rate(), Some(1e-30));
    // A floor of 0 is a rate (the run ends there), and so are small but normal rates.
    let to_zero = Schedule::WarmupCosine {
        warmup: 1_000,
        total: 2_000,
        min_factor: 0.0,
    };
    sharded.set_schedule(to_zero).unwrap();
}

/// The lowest positive rate of a decay to zero comes at step `total − 1`, not at `total` (0, a
/// rate) or at 0: a linear decay over 10⁶ steps from 1e-33 sets 1e-33 · 10⁻⁶ = 1e-39 there,
/// subnormal in f32, and `set_schedule` must refuse it then rather than the step that gets there.
#[test]
fn a_schedule_whose_rate_just_before_total_is_subnormal_is_refused_when_set() {
    use ragged::schedule::Schedule;
    let params = CFG.init_params(6).unwrap();
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    sharded.set_learning_rate(1e-33).unwrap();
    let total = 1_000_000;
    let last = (1e-33 * (1.0 / total as f64)) as f32;
    assert!(last > 0.0 && last < f32::MIN_POSITIVE, "{last}");
    let decay = Schedule::WarmupLinear {
        warmup: 0,
        total,
        min_factor: 0.0,
    };
    let err = sharded
        .set_schedule(decay)
        .expect_err("a subnormal rate at step total - 1")
        .to_string();
    assert!(
        err.contains("at step 999999") && err.contains("learning rate must be 0 or lie in"),
        "{err}"
    );
    assert_eq!(sharded.learning_rate(), Some(1e-33));
}

/// Ranks about to step at different learning rates (`set_learning_rate` or `set_schedule`
/// called on some ranks only) all get the same `Err` and take no step; before, each rank
/// moved its shard of the same parameters by its own rate, with no error. The gradients are
/// kept: once the rates agree again, the step goes on and equals a run that never differed.
#[test]
fn ranks_stepping_at_different_learning_rates_are_refused_on_every_rank() {
    use ragged::schedule::Schedule;
    let params = CFG.init_params(7).unwrap();
    let run = |diverge: bool| {
        ThreadWorld::run(2, |c| {
            let mut m = fully_shard(&params, adamw(), c, FsdpOptions::default())?;
            let ids = batch(corpus()?, &CFG, 0, c.rank() * 2, 2)?;
            m.forward_backward(&TransformerStages(CFG), &ids)?;
            let mut refused = Vec::new();
            if diverge {
                if c.rank() == 1 {
                    m.set_learning_rate(LR / 2.0)?;
                }
                refused.push(m.step().unwrap_err().to_string());
                m.set_learning_rate(LR)?;
                if c.rank() == 0 {
                    m.set_schedule(Schedule::WarmupLinear {
                        warmup: 4,
                        total: 8,
                        min_factor: 0.5,
                    })?;
                }
                refused.push(m.step().unwrap_err().to_string());
                m.set_learning_rate(LR)?;
            }
            m.step()?;
            Ok((refused, m.full_params()?))
        })
        .unwrap()
    };
    let diverged = run(true);
    for (refused, _) in &diverged {
        assert_eq!(refused, &diverged[0].0);
    }
    let [by_rate, by_schedule] = &diverged[0].0[..] else {
        panic!("{:?}", diverged[0].0)
    };
    assert!(
        by_rate
            .contains("ranks [1] differ from rank 0: rank 1 would step at 0.005, rank 0 at 0.01"),
        "{by_rate}"
    );
    assert!(
        by_schedule.contains("rank 1 would step at 0.01, rank 0 at 0.0025"),
        "{by_schedule}"
    );
    assert_eq!(
        diverged[0].1,
        run(false)[0].1,
        "the kept gradients stepped alike"
    );
}

/// A trained parameter whose initial value is NaN or infinite (or an f64 beyond f32's range,
/// infinite in the f32 master) is refused by `fully_shard` on every rank, naming the element,
/// as `load_safetensors` refuses such a starting point. Before, it was taken, and the first
/// step failed advising a lower learning rate (under `SkipStep`, every step was skipped). A
/// frozen parameter (a mask of `-inf`) is not stepped and may hold any value.
#[test]
fn initial_values_that_are_not_finite_are_refused_naming_the_element() {
    let finite = Tensor::new(&[1f32, 2.0, 3.0], &Device::Cpu).unwrap();
    let cases = [
        Tensor::new(&[1f32, 2.0, f32::NAN], &Device::Cpu).unwrap(),
        Tensor::new(&[1f32, 2.0, f32::NEG_INFINITY], &Device::Cpu).unwrap(),
        Tensor::new(&[1f64, 2.0, 1e300], &Device::Cpu).unwrap(),
    ];
    for bad in cases {
        let params = vec![
            ("layers.0.w".to_string(), finite.clone()),
            ("layers.1.w".to_string(), bad.clone()),
        ];
        let errors = ThreadWorld::run(2, |c| {
            let e = fully_shard(&params, adamw(), c, FsdpOptions::default()).err();
            Ok(e.map(|e| e.to_string()))
        })
        .unwrap();
        for e in &errors {
            let e = e.as_deref().unwrap_or("accepted");
            assert!(e.contains("layers.1.w: element 2 is"), "{bad}: {e}");
        }
        // Frozen, the same value is taken.
        let opts = FsdpOptions {
            frozen: Some(ragged::fsdp::NameRule::new(|n| n == "layers.1.w")),
            ..FsdpOptions::default()
        };
        fully_shard(&params, adamw(), &SingleRank, opts).unwrap();
    }
}

/// Two parameters of one name would share their values, their gathered copy and their
/// checkpoint entry: `fully_shard` refuses them, naming the parameter.
#[test]
fn duplicate_parameter_names_are_refused() {
    let mut params = CFG.init_params(6).unwrap();
    params.push(params[0].clone());
    let err = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default())
        .err()
        .expect("a name listed twice must be refused");
    assert!(
        err.to_string()
            .contains(&format!("{} listed twice", params[0].0)),
        "{err}"
    );
    // An integer buffer is not a parameter; an empty tensor holds nothing to shard (torch
    // accepts one; here the error says to leave it out).
    let mut with_ids = CFG.init_params(6).unwrap();
    let ids = Tensor::zeros(4, DType::U32, &Device::Cpu).unwrap();
    with_ids.push(("position_ids".into(), ids));
    let err = fully_shard(&with_ids, adamw(), &SingleRank, FsdpOptions::default())
        .err()
        .expect("an integer tensor must be refused");
    assert!(
        err.to_string().contains("position_ids of dtype U32"),
        "{err}"
    );
    let mut with_empty = CFG.init_params(6).unwrap();
    let empty = Tensor::zeros((0, 4), DType::F32, &Device::Cpu).unwrap();
    with_empty.push(("empty.weight".into(), empty));
    let err = fully_shard(&with_empty, adamw(), &SingleRank, FsdpOptions::default())
        .err()
        .expect("an empty tensor is refused");
    let text = err.to_string();
    assert!(
        text.contains(
            "parameter empty.weight of shape [0, 4]: holds no elements, so nothing of it \
             shards, trains or is saved: leave it out of the list"
        ),
        "{err}"
    );
    // `w` and `w::m` would both train, and every save would then fail on `w`'s AdamW moment.
    let mut colliding = CFG.init_params(6).unwrap();
    let m = colliding[0].1.clone();
    colliding.push((format!("{}::m", colliding[0].0), m));
    let err = fully_shard(&colliding, adamw(), &SingleRank, FsdpOptions::default())
        .err()
        .expect("a name with `::` is refused");
    assert!(
        err.to_string().contains("::m\"") && err.to_string().contains("checkpoint"),
        "{err}"
    );
    // One tensor under two names (a tied embedding and head) would train as two copies.
    let mut tied = CFG.init_params(6).unwrap();
    let shared = tied[0].1.clone();
    tied.push(("lm_head_tied.weight".into(), shared));
    let err = fully_shard(&tied, adamw(), &SingleRank, FsdpOptions::default())
        .err()
        .expect("one tensor under two names is refused");
    assert!(
        err.to_string()
            .contains(&format!("parameters {} and lm_head_tied.weight", tied[0].0))
            && err.to_string().contains("are one tensor"),
        "{err}"
    );
    // Equal values in two tensors are two parameters.
    let mut copied = CFG.init_params(6).unwrap();
    let copy = copied[0].1.copy().unwrap();
    copied.push(("lm_head_copy.weight".into(), copy));
    assert!(fully_shard(&copied, adamw(), &SingleRank, FsdpOptions::default()).is_ok());
    // A wrap rule that names a unit "" (it was taken, and showed as a blank unit).
    let blank = FsdpOptions {
        wrap: ragged::fsdp::WrapPolicy::Custom(std::sync::Arc::new(|name: &str| {
            name.starts_with("layers.0").then(String::new)
        })),
        ..FsdpOptions::default()
    };
    let err = fully_shard(&CFG.init_params(6).unwrap(), adamw(), &SingleRank, blank)
        .err()
        .expect("an empty unit name is refused");
    assert!(
        err.to_string().contains("the unit of parameter layers.0.")
            && err.to_string().contains("named it \"\""),
        "{err}"
    );
    // An empty name (it was taken, and keyed the values and the checkpoint entry as "").
    let mut unnamed = CFG.init_params(6).unwrap();
    unnamed[1].0 = String::new();
    let err = fully_shard(&unnamed, adamw(), &SingleRank, FsdpOptions::default())
        .err()
        .expect("an empty name is refused");
    assert!(
        err.to_string().contains("an unnamed parameter of shape"),
        "{err}"
    );
}

/// A demo configuration that cannot work is an `Err` naming the field, wherever it enters:
/// initial values, batches, and the stages of a model built from good parameters.
#[test]
fn impossible_demo_configurations_are_errors_not_panics() {
    let no_heads = TransformerConfig { n_heads: 0, ..CFG };
    let uneven = TransformerConfig { n_heads: 5, ..CFG };
    let no_vocab = TransformerConfig { vocab: 0, ..CFG };
    for (cfg, needle) in [(no_heads, "n_heads is 0"), (uneven, "not a multiple")] {
        let err = cfg.init_params(1).unwrap_err().to_string();
        assert!(err.contains(needle), "{err}");
    }
    let err = batch(corpus().unwrap(), &no_vocab, 0, 0, 2).unwrap_err();
    assert!(err.to_string().contains("vocab is 0"), "{err}");
    let params = CFG.init_params(6).unwrap();
    let mut sharded = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let ids = batch(corpus().unwrap(), &CFG, 0, 0, 2).unwrap();
    let err = sharded
        .forward_backward(&TransformerStages(no_heads), &ids)
        .expect_err("a stage with 0 heads must fail");
    assert!(err.to_string().contains("n_heads is 0"), "{err}");
}

/// Muon's element-wise fallback follows its matrix rate in proportion.
#[test]
fn muon_set_learning_rate_scales_its_fallback() {
    use ragged::optim::Optimizer;
    let mut muon = ragged_optimizers::Muon::new(ragged_optimizers::MuonConfig::default()).unwrap();
    let (lr, fallback) = (muon.config().lr, muon.config().adamw.lr);
    muon.set_learning_rate(lr / 4.0).unwrap();
    assert_eq!(muon.learning_rate(), Some(lr / 4.0));
    assert_eq!(muon.config().adamw.lr, fallback / 4.0);
    // A rate of 0 on the way (a warm-up from 0) keeps the proportion.
    muon.set_learning_rate(0.0).unwrap();
    assert_eq!(muon.config().adamw.lr, 0.0);
    muon.set_learning_rate(lr * 2.0).unwrap();
    assert_eq!(muon.config().adamw.lr, fallback * 2.0);
}

/// AdamW stepping on matrices planned in 8-row blocks (blocks of different sizes, whose lattice
/// a single buffer must satisfy at once), so the multi-buffer planner has something to split; element-wise, so any layout steps the same.
#[derive(Clone, Copy)]
struct WholeMatrixAdamW(AdamW);

impl ragged::optim::Optimizer for WholeMatrixAdamW {
    type State = <AdamW as ragged::optim::Optimizer>::State;
    fn name(&self) -> &'static str {
        "adamw (whole matrices)"
    }
    fn atomic_block(&self, _: &str, shape: &[usize]) -> ragged::AtomicBlock {
        if shape.len() == 2 {
            ragged::AtomicBlock::Rows(8)
        } else {
            ragged::AtomicBlock::Element
        }
    }
    fn init(&self, shard: &ragged::optim::LocalShard) -> ragged::Result<Self::State> {
        self.0.init(shard)
    }
    fn step(
        &self,
        state: &mut Self::State,
        shard: &ragged::optim::LocalShard,
        params: ragged::storage::ViewMut<'_, f32>,
        grads: ragged::storage::View<'_, f32>,
        comm: &dyn Communicator,
    ) -> ragged::Result<()> {
        self.0.step(state, shard, params, grads, comm)
    }
}

/// Units planned as several collective buffers (each with its own shard size, gathered and
/// reduced on its own) train bitwise like one buffer per unit, and pad no more. (The one-buffer
/// run also covers a plan whose offsets are not in the unit's tensor order, which the gather
/// once refused.)
#[test]
fn multi_buffer_units_train_bitwise_like_one_buffer() {
    use ragged::plan::multi::MultiOptions;
    let params = CFG.init_params(7).unwrap();
    let run = |buffers: Option<MultiOptions>| {
        let opts = FsdpOptions {
            buffers,
            ..FsdpOptions::default()
        };
        let runs = ThreadWorld::run(3, |c| {
            let opt = WholeMatrixAdamW(adamw());
            let mut sharded = fully_shard(&params, opt, c, opts.clone())?;
            let per_unit: Vec<usize> = sharded.buffers_per_unit().iter().map(|(_, k)| *k).collect();
            let s_sum: usize = sharded.shard_sizes().iter().map(|(_, s)| s).sum();
            for step in 0..3 {
                let ids = batch(corpus()?, &CFG, step, c.rank() * 4, 4)?;
                sharded.forward_backward(&TransformerStages(CFG), &ids)?;
                sharded.step()?;
            }
            Ok((per_unit, s_sum, sharded.full_params()?))
        })
        .unwrap();
        runs.into_iter().next().unwrap()
    };
    let (one, s_one, reference) = run(None);
    assert!(one.iter().all(|&k| k == 1));
    let free_collectives = MultiOptions {
        collective_latency_s: 0.0,
        ..MultiOptions::default()
    };
    let (many, s_many, split) = run(Some(free_collectives));
    println!("buffers per unit {many:?}; Σ S {s_one} -> {s_many}");
    assert!(
        many.iter().any(|&k| k > 1),
        "the planner must split some unit: {many:?}"
    );
    // One-buffer plans already take the shard-by-shard layouts (plan_one_buffer), so on
    // this small model splitting may only tie; it must never pad more.
    assert!(
        s_many <= s_one,
        "several buffers must not pad more: {s_many} vs {s_one}"
    );
    let bits = |m: &HashMap<String, Vec<f32>>| {
        let mut v: Vec<_> = m
            .iter()
            .map(|(n, x)| (n.clone(), x.iter().map(|f| f.to_bits()).collect::<Vec<_>>()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(bits(&reference), bits(&split));
}

/// Frozen parameters are gathered for compute but take no gradient, are never reduced and
/// never stepped: after training they are bitwise their initial values, everything else moved,
/// and the collectives carry less (no reduce-scatter of the frozen buffers).
#[test]
fn frozen_parameters_stay_put_and_skip_the_reduction() {
    let params = CFG.init_params(3).unwrap();
    let frozen = |name: &str| name == "embed.weight" || name.starts_with("layers.0.");
    let run = |freeze: bool| {
        let opts = FsdpOptions {
            frozen: freeze.then(|| ragged::fsdp::NameRule::new(frozen)),
            ..FsdpOptions::default()
        };
        ThreadWorld::run(2, |c| {
            let mut sharded = fully_shard(&params, adamw(), c, opts.clone())?;
            for step in 0..3 {
                let ids = batch(corpus()?, &CFG, step, c.rank() * 2, 2)?;
                sharded.forward_backward(&TransformerStages(CFG), &ids)?;
                sharded.step()?;
            }
            let without = sharded.params_without_gradient().map(<[String]>::to_vec);
            Ok((
                sharded.full_params()?,
                sharded.stats().collective(),
                without,
            ))
        })
        .unwrap()
        .remove(0)
    };
    let (trained, bytes_frozen, without) = run(true);
    let (_, bytes_all, _) = run(false);
    for (name, init) in &params {
        let init = init.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(trained[name] == init, frozen(name), "{name}");
    }
    assert!(bytes_frozen < bytes_all, "{bytes_frozen} vs {bytes_all}");
    assert_eq!(
        without,
        Some(Vec::new()),
        "frozen parameters are not reported as gradient-less"
    );
}

/// What the MLP stack's stages read: (clones of) each stage's parameter tensors, which share
/// their storage objects with the graph, their values at the stage's forward, and, at every
/// stage's forward, the storage lengths of the earlier stages' parameters.
#[derive(Default)]
struct Seen {
    params: Mutex<Vec<Vec<(String, Tensor)>>>,
    values_seen: Mutex<Vec<(String, Vec<f32>)>>,
    lengths_seen: Mutex<Vec<Vec<usize>>>,
}

impl Seen {
    /// `common::Watching`'s watch: records stage `s`'s parameters `p`.
    fn record(&self, s: usize, p: &UnitParams) -> candle_core::Result<()> {
        let mut params = self.params.lock().unwrap();
        let earlier = params
            .iter()
            .flatten()
            .map(|(_, t)| common::storage_elements(t));
        self.lengths_seen.lock().unwrap().push(earlier.collect());
        let names = [
            format!("layers.{s}.up.weight"),
            format!("layers.{s}.down.weight"),
        ];
        let mine: Vec<(String, Tensor)> = names
            .into_iter()
            .map(|n| Ok((n.clone(), p.get(&n)?.clone())))
            .collect::<candle_core::Result<_>>()?;
        let mut values = self.values_seen.lock().unwrap();
        for (n, t) in &mine {
            values.push((n.clone(), t.flatten_all()?.to_vec1::<f32>()?));
        }
        params.push(mine);
        Ok(())
    }
}

/// FSDP2's rhythm without recomputation (the default), proven on the storage objects the
/// graph holds: after a unit's forward its parameters' storages are empty (0 elements) while
/// later stages run; every stage's forward reads the current parameters (also from storages
/// another unit left, whose old values the gather overwrote); after the step every unit's
/// storages were handed on (0 elements again), and two units' are kept for the next gathers.
/// The gradients, and so the trained weights, are bitwise those of keeping units gathered and
/// of recomputing: a backward that read a freed or stale storage could not match them.
#[test]
fn kept_graphs_hold_empty_storages_between_forward_and_backward() {
    let mlp = ragged::demo::MlpConfig {
        width: 8,
        hidden: 16,
        layers: 4,
    };
    let params = mlp.init_params(2).unwrap();
    let run = |opts: FsdpOptions| {
        ThreadWorld::run(2, |c| {
            let mut sharded = fully_shard(&params, adamw(), c, opts.clone())?;
            let mut storages = Vec::new();
            let mut after = Vec::new();
            for step in 0..3 {
                let seen = Seen::default();
                let watched = common::Watching {
                    stages: ragged::demo::MlpStages(mlp),
                    watch: |s: usize, p: &UnitParams| seen.record(s, p),
                };
                let full = sharded.full_params()?;
                let b = mlp.batch(step, 4)?;
                let rows = |t: &Tensor| t.narrow(0, 2 * c.rank(), 2);
                let b = ragged::demo::MlpBatch {
                    x: rows(&b.x)?,
                    y: rows(&b.y)?,
                };
                sharded.forward_backward(&watched, &b)?;
                for (name, values) in seen.values_seen.into_inner().unwrap() {
                    assert_eq!(values, full[&name], "step {step}: {name} read stale values");
                }
                let params = seen.params.into_inner().unwrap();
                let lengths: Vec<usize> = params
                    .iter()
                    .flatten()
                    .map(|(_, t)| common::storage_elements(t))
                    .collect();
                after.push((lengths, sharded.spare_param_bytes()));
                storages.push(seen.lengths_seen.into_inner().unwrap());
                sharded.step()?;
            }
            Ok((storages, after, sharded.full_params()?))
        })
        .unwrap()
        .remove(0)
    };
    let (lengths, after, trained) = run(FsdpOptions::default());
    // A layer unit: up and down weights, width × hidden f32 each.
    let unit_bytes = 2 * 4 * mlp.width * mlp.hidden;
    for (step, (lengths, spare)) in after.iter().enumerate() {
        assert!(
            lengths.iter().all(|&n| n == 0),
            "step {step}: {lengths:?} kept after the step"
        );
        assert_eq!(*spare, 2 * unit_bytes, "step {step}: spare storages");
    }
    for (step, seen) in lengths.iter().enumerate() {
        for (stage, earlier) in seen.iter().enumerate() {
            assert_eq!(earlier.len(), 2 * stage);
            assert!(
                earlier.iter().all(|&n| n == 0),
                "step {step}, stage {stage}: earlier units' storages {earlier:?} not freed"
            );
        }
    }
    let sorted = |m: HashMap<String, Vec<f32>>| {
        let mut v: Vec<_> = m.into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let keep_units = FsdpOptions {
        reshard_after_forward: false,
        ..FsdpOptions::default()
    };
    let recompute = FsdpOptions {
        recompute: true,
        ..FsdpOptions::default()
    };
    let (kept_lengths, kept_after, kept) = run(keep_units);
    // Kept units keep their storages whole: the checks above can tell the two apart.
    assert!(kept_lengths[0][1].iter().all(|&n| n > 0));
    assert!(kept_after[0].0.iter().all(|&n| n > 0) && kept_after[0].1 == 0);
    assert_eq!(sorted(trained.clone()), sorted(kept));
    assert_eq!(sorted(trained), sorted(run(recompute).2));
}

/// The activations the runtime measures are what candle's graph of an MLP block holds: the
/// up projection, its GELU and the down projection (rows × (2·hidden + width) f32), the last
/// stage's loss adding the difference, its square, their sum and the mean (two scalars); the
/// same whether the graph
/// is kept from forward or rebuilt by recomputation. The memory plan adds them.
#[test]
fn measured_activations_are_the_graphs_tensors() {
    let mlp = ragged::demo::MlpConfig {
        width: 8,
        hidden: 16,
        layers: 3,
    };
    let params = mlp.init_params(2).unwrap();
    let rows = 5;
    let block = 4 * rows * (2 * mlp.hidden + mlp.width);
    let output = 4 * rows * mlp.width;
    for recompute in [false, true] {
        let opts = FsdpOptions {
            recompute,
            ..FsdpOptions::default()
        };
        let mut sharded = fully_shard(&params, adamw(), &SingleRank, opts.clone()).unwrap();
        let plan = sharded.memory_plan();
        let order = [0, 1, 2];
        let without = plan.peak_unit_by_unit(&order, &opts, &[]).unwrap();
        // A stage on a unit the plan lacks is an error, not an index panic.
        assert!(plan.peak_unit_by_unit(&[0, 3], &opts, &[]).is_err());
        sharded
            .forward_backward(&ragged::demo::MlpStages(mlp), &mlp.batch(0, rows).unwrap())
            .unwrap();
        let acts = sharded.activations();
        let graphs: Vec<usize> = acts.iter().map(|a| a.graph_bytes).collect();
        assert_eq!(
            graphs,
            [block, block, block + 2 * output + 8],
            "recompute {recompute}"
        );
        let outputs: Vec<usize> = acts.iter().map(|a| a.output_bytes).collect();
        assert_eq!(outputs, [output, output, 4]);
        assert!(plan.peak_unit_by_unit(&order, &opts, acts).unwrap() > without);
    }
}

/// Full gradient buffers are reused from unit to unit (a spare kept after each reduce-scatter)
/// and a tensor's first gradient is copied, not added, into its slot: a reused buffer still
/// reduces exact zeros for a parameter no gradient reached (here `layers.0.down.weight`,
/// detached in the second step, whose buffer is the spare another unit's gradients filled).
#[test]
fn a_reused_gradient_buffer_holds_zeros_where_no_gradient_arrived() {
    let mlp = ragged::demo::MlpConfig {
        width: 8,
        hidden: 16,
        layers: 2,
    };
    let params = mlp.init_params(4).unwrap();
    // Two ranks: at world 1 the full buffer becomes the local shard instead (no reduction).
    let held = ThreadWorld::run(2, |c| {
        let mut sharded = fully_shard(&params, adamw(), c, FsdpOptions::default()).unwrap();
        let views = sharded.unshard().unwrap();
        let skipped = "layers.0.down.weight";
        let grads_of = |sharded: &ragged::fsdp::ShardedModel<'_, AdamW>| {
            let mut out = HashMap::new();
            sharded
                .with_local_grads(|local, g| {
                    for piece in &local.pieces {
                        let span = g[piece.offset..piece.offset + piece.range.len()].to_vec();
                        out.insert(local.params[piece.param].name.clone(), span);
                    }
                })
                .unwrap();
            out
        };
        let mut addresses = Vec::new();
        let mut held = 0;
        for step in 0..2 {
            let b = mlp.batch(step, 4).unwrap();
            let mut x = b.x.clone();
            for i in 0..mlp.layers {
                let get = |n: &str| {
                    let t = views[n].clone();
                    Ok(if step == 1 && n == skipped {
                        t.detach()
                    } else {
                        t
                    })
                };
                x = mlp.block(i, get, &x).unwrap();
            }
            let loss = ragged::demo::MlpConfig::loss(&x, &b.y).unwrap();
            loss.backward().unwrap();
            let sinks = ["layers.0", "layers.1"].map(|u| sharded.grad_sink(u).unwrap());
            addresses.push(sinks.map(|s| s.buffer_address().unwrap().0));
            sharded.reduce_gradients().unwrap();
            let grads = grads_of(&sharded);
            // Pieces of the skipped tensor this rank owns (every element is owned by one rank).
            if let Some(g) = grads.get(skipped) {
                held += g.len();
                let zero = g.iter().all(|&x| x == 0.0);
                assert_eq!(zero, step == 1, "step {step}: {skipped} gradient {g:?}");
            }
            sharded.step().unwrap();
            sharded.unshard().unwrap();
        }
        // The second step's buffers are the first step's, handed from unit to unit.
        let mut first = addresses[0].to_vec();
        let mut second = addresses[1].to_vec();
        first.sort_unstable();
        second.sort_unstable();
        assert_eq!(first, second, "the buffers were not reused");
        Ok(held)
    })
    .unwrap();
    let n = mlp.width * mlp.hidden;
    assert_eq!(
        held.iter().sum::<usize>(),
        2 * n,
        "two steps of every element"
    );
}

const MLP: ragged::demo::MlpConfig = ragged::demo::MlpConfig {
    width: 8,
    hidden: 16,
    layers: 3,
};

/// This rank's two rows of the MLP stack's 4-row batch `step` (world 2).
fn mlp_rows(step: usize, rank: usize) -> ragged::Result<ragged::demo::MlpBatch> {
    let b = MLP.batch(step, 4)?;
    let rows = |t: &Tensor| t.narrow(0, 2 * rank, 2);
    Ok(ragged::demo::MlpBatch {
        x: rows(&b.x)?,
        y: rows(&b.y)?,
    })
}

/// The MLP stack in the order `order` (unit indices), each stage computing with its own unit's
/// layer: any order runs, so ranks that list them differently would each gather another unit
/// in lockstep (the layers are the same size) and train on scrambled values.
struct InOrder(Vec<usize>);

impl Stages for InOrder {
    type Batch = ragged::demo::MlpBatch;
    fn stage_units(&self) -> Vec<String> {
        self.0.iter().map(|i| format!("layers.{i}")).collect()
    }
    fn forward(
        &self,
        s: usize,
        p: &UnitParams,
        x: Option<&Tensor>,
        b: &Self::Batch,
    ) -> candle_core::Result<Tensor> {
        let out = MLP.block(self.0[s], |n| p.get(n).cloned(), x.unwrap_or(&b.x))?;
        if s + 1 == self.0.len() {
            ragged::demo::MlpConfig::loss(&out, &b.y)
        } else {
            Ok(out)
        }
    }
}

/// Ranks whose stage lists differ (here rank 1 runs the first two layers swapped) get the same
/// `Err` on every rank, naming the ranks and both lists, before any gather; lists that agree
/// train, and a change that every rank makes is compared again and accepted.
#[test]
fn ranks_running_different_stage_lists_fail_on_every_rank() {
    let params = MLP.init_params(2).unwrap();
    let results = ThreadWorld::run_with_timeout(2, std::time::Duration::from_secs(20), |c| {
        let mut m = fully_shard(&params, adamw(), c, FsdpOptions::default())?;
        let b = mlp_rows(0, c.rank())?;
        let mine = if c.rank() == 1 { [1, 0, 2] } else { [0, 1, 2] };
        let differ = m.forward_backward(&InOrder(mine.to_vec()), &b).err();
        m.forward_backward(&InOrder(vec![0, 1, 2]), &b)?;
        m.forward_backward(&InOrder(vec![1, 0, 2]), &b)?;
        m.step()?;
        Ok(differ.map(|e| e.to_string()))
    })
    .unwrap();
    for (rank, e) in results.iter().enumerate() {
        let e = e
            .as_deref()
            .unwrap_or_else(|| panic!("rank {rank} ran differing stages"));
        assert!(
            e.contains("ranks [1] differ from rank 0")
                && e.contains(r#"rank 1 runs ["layers.1","layers.0","layers.2"]"#)
                && e.contains(r#"rank 0 runs ["layers.0","layers.1","layers.2"]"#),
            "rank {rank}: {e}"
        );
    }
}

/// A backward that fails part way (stage 0 fails when recomputed, after the later units'
/// gradients were reduce-scattered) leaves gradients that count the batch for some units only:
/// `step` refuses them, saying what to do, also once the next batch's backward has completed
/// every unit (before, that step counted the failed batch for two units of three), and after
/// `discard_gradients` the next batch's step is bitwise the step of a model that never saw the
/// failed one.
#[test]
fn a_backward_that_fails_part_way_leaves_gradients_step_refuses() {
    let params = MLP.init_params(3).unwrap();
    let opts = FsdpOptions {
        recompute: true,
        ..FsdpOptions::default()
    };
    let run = |fail: bool| {
        ThreadWorld::run(2, |c| {
            let mut m = fully_shard(&params, adamw(), c, opts.clone())?;
            let calls = std::sync::atomic::AtomicUsize::new(0);
            let failing = common::Watching {
                stages: ragged::demo::MlpStages(MLP),
                watch: |s: usize, _: &UnitParams| match s == 0 && calls.fetch_add(1, SeqCst) == 1 {
                    true => Err(candle_core::Error::Msg(
                        "stage 0 fails when recomputed".into(),
                    )),
                    false => Ok(()),
                },
            };
            let mut refused = None;
            if fail {
                let e = m.forward_backward(&failing, &mlp_rows(0, c.rank())?);
                assert!(format!("{:?}", e.err()).contains("fails when recomputed"));
                m.forward_backward(&ragged::demo::MlpStages(MLP), &mlp_rows(1, c.rank())?)?;
                refused = m.step().err().map(|e| e.to_string());
                m.discard_gradients();
            }
            m.forward_backward(&ragged::demo::MlpStages(MLP), &mlp_rows(1, c.rank())?)?;
            m.step()?;
            Ok((refused, m.full_params()?))
        })
        .unwrap()
        .remove(0)
    };
    use std::sync::atomic::Ordering::SeqCst;
    let (refused, after_failure) = run(true);
    let refused = refused.expect("step took gradients of a failed backward");
    assert!(
        refused.contains("failed part way") && refused.contains("discard_gradients()"),
        "{refused}"
    );
    let (_, clean) = run(false);
    assert_eq!(after_failure, clean);
}

/// Whole-model mode trains only if `unshard()` runs before each step's forward: a backward
/// on the tensors of before the last step (the masters moved, the model's tensors did not)
/// is refused at the reduction, naming the fix, instead of a loss that stops falling.
#[test]
fn a_backward_on_parameters_gathered_before_the_last_step_is_refused() {
    let params = MLP.init_params(5).unwrap();
    let mut m = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let b = MLP.batch(0, 2).unwrap();
    let views = m.unshard().unwrap();
    let loss = || {
        let mut x = b.x.clone();
        for i in 0..MLP.layers {
            x = MLP.block(i, |n| Ok(views[n].clone()), &x)?;
        }
        ragged::demo::MlpConfig::loss(&x, &b.y)?.backward()
    };
    loss().unwrap();
    m.reduce_gradients().unwrap();
    m.step().unwrap();
    loss().unwrap();
    let e = m
        .reduce_gradients()
        .expect_err("stale parameters")
        .to_string();
    assert!(e.contains("call unshard() before each step"), "{e}");
    m.discard_gradients();
    m.unshard().unwrap();
    loss().unwrap();
    m.reduce_gradients().unwrap();
    m.step().unwrap();
}

/// A last stage whose loss is an integer tensor (no gradient reaches any parameter through it)
/// is an `Err`, not a step on zero gradients.
#[test]
fn an_integer_loss_is_refused() {
    struct IntegerLoss;
    impl Stages for IntegerLoss {
        type Batch = ragged::demo::MlpBatch;
        fn stage_units(&self) -> Vec<String> {
            ragged::demo::MlpStages(MLP).stage_units()
        }
        fn forward(
            &self,
            s: usize,
            p: &UnitParams,
            x: Option<&Tensor>,
            b: &Self::Batch,
        ) -> candle_core::Result<Tensor> {
            let out = ragged::demo::MlpStages(MLP).forward(s, p, x, b)?;
            match s + 1 == MLP.layers {
                true => (out * 1000.0)?.to_dtype(DType::U32),
                false => Ok(out),
            }
        }
    }
    let params = MLP.init_params(4).unwrap();
    let mut m = fully_shard(&params, adamw(), &SingleRank, FsdpOptions::default()).unwrap();
    let e = m
        .forward_backward(&IntegerLoss, &MLP.batch(0, 2).unwrap())
        .expect_err("an integer loss")
        .to_string();
    assert!(e.contains("dtype U32") && e.contains("float scalar"), "{e}");
}
