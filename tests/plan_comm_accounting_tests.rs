//! Accounting tests of the planner, the collectives and redistribution: each one pins a
//! result that a plausible slip in the code would change silently (a check skipped, a
//! tie-break flipped, a field written from the wrong value, a slice taken from the wrong rank),
//! and that no other test looked at. Every expected value is derived in a comment or computed
//! independently from the definition.

use std::time::{Duration, Instant};

use ragged::comm::rendezvous::Rendezvous;
use ragged::comm::threads::ThreadWorld;
use ragged::comm::{Buf, BufMut, Communicator, ReduceOp, SingleRank};
use ragged::model::DType;
use ragged::plan::export::{unit_runs, write_multi_json};
use ragged::plan::fit::fits;
use ragged::plan::multi::{plan_multi_items, MultiOptions};
use ragged::plan::multi_model::{MultiModelPlan, MultiPlan};
use ragged::plan::oracle::exact_any_order;
use ragged::plan::search::min_shard;
use ragged::plan::shard_fill::shard_fill;
use ragged::plan::{plan_items, Item, ModelPlan, Order, Placement, Plan, PlanOptions, SearchStats};
use ragged::{AtomicBlock, Error};

/// A one-tensor [`Plan`] of `numel` elements in blocks of `block` at `offset` of a buffer of
/// `world × shard` elements (collective alignment 1).
fn one_tensor_plan(numel: usize, block: usize, offset: usize, shard: usize, world: usize) -> Plan {
    Plan {
        unit: "u".into(),
        world,
        shard_size: shard,
        coll_align: 1,
        order: Order::Module,
        placements: vec![Placement {
            name: "t".into(),
            shape: vec![numel],
            dtype: DType::F32,
            block: AtomicBlock::Element,
            block_elems: block,
            offset,
        }],
        stats: SearchStats::default(),
        lower_bound: shard,
    }
}

/// [`Plan::validate`] is the independent check many planner tests lean on, so it must reject
/// every layout the definition rejects: a shard boundary strictly inside the tensor at a
/// distance from its start that is not a whole number of blocks. The O(1) check looks at the
/// first boundary and, when the block does not divide `S`, at the second; the sweep compares
/// it with every boundary on every small case, and pins one case where only the second
/// boundary is wrong.
#[test]
fn validate_rejects_a_block_split_by_any_boundary_not_only_the_first() {
    // S = 4, block 3, 12 elements at offset 1 on 4 ranks: the boundary at 4 is 3 elements in
    // (one block), the one at 8 is 7 elements in (not a multiple of 3).
    let err = one_tensor_plan(12, 3, 1, 4, 4).validate().unwrap_err();
    assert!(
        matches!(err, Error::BlockSplit { offset: 7, .. }),
        "expected the split at 7 elements: {err}"
    );
    let mut checked = 0;
    for shard in 1..=7usize {
        for block in 1..=6usize {
            for numel in block..=20 {
                for offset in 0..=12 {
                    let world = (offset + numel).div_ceil(shard);
                    let split = (offset / shard + 1..)
                        .map(|k| k * shard)
                        .take_while(|&b| b < offset + numel)
                        .any(|b| (b - offset) % block != 0);
                    let plan = one_tensor_plan(numel, block, offset, shard, world);
                    assert_eq!(
                        plan.validate().is_err(),
                        split,
                        "S={shard} block={block} numel={numel} offset={offset}"
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 5_000);
}

/// "Earlier orders win ties" ([`PlanOptions::orders`]): when every order reaches the same `S`,
/// the layout is the first order's. Two tensors of 8 elements, blocks 1 and 2, on 2 ranks:
/// `S = 8` (no padding) in the module order `[t0, t1]` and in the block-size order `[t1, t0]`
/// (the shape order is the module order again, ties to the smaller block).
#[test]
fn equal_shard_sizes_keep_the_earliest_order() {
    let items = [Item::new(8, 1, 1).unwrap(), Item::new(8, 2, 1).unwrap()];
    let opts = |orders: Vec<Order>| PlanOptions {
        coll_align: 1,
        start_align: 1,
        orders,
    };
    let all = plan_items(&items, 2, &opts(Order::ALL.to_vec())).unwrap();
    assert_eq!((all.shard_size, all.order), (8, Order::Module));
    assert_eq!(all.offsets, vec![0, 8]);
    let reversed = plan_items(&items, 2, &opts(vec![Order::BlockSize, Order::Module])).unwrap();
    assert_eq!((reversed.shard_size, reversed.order), (8, Order::BlockSize));
    assert_eq!(reversed.offsets, vec![8, 0]);
}

/// [`ModelPlan::lower_bound_padding_frac`] is the padding of each unit at its lower bound, not
/// at its plan. One unit of 10 elements on 2 ranks planned at `S = 8` with a lower bound of 6:
/// padding `(16 − 10)/10 = 0.6`, floor `(12 − 10)/10 = 0.2`.
#[test]
fn lower_bound_padding_uses_the_lower_bound_not_the_plan() {
    let mut unit = one_tensor_plan(10, 1, 0, 8, 2);
    unit.lower_bound = 6;
    let plan = ModelPlan {
        model: "m".into(),
        world: 2,
        units: vec![unit],
        elapsed: Duration::ZERO,
        distinct_units: 1,
    };
    assert!((plan.padding_frac() - 0.6).abs() < 1e-12);
    assert!((plan.lower_bound_padding_frac() - 0.2).abs() < 1e-12);
}

/// The search is exact for its order: no size below the one it returns fits. The pinned input
/// is one where the bisection stops one collective-alignment step above the true minimum, so
/// the exact finish must check the very last candidate below the bisection's size.
#[test]
fn the_exact_finish_checks_the_last_size_below_the_bisection() {
    let items: Vec<Item> = [(3, 1), (21, 1), (18, 3), (26, 2), (25, 3), (8, 5)]
        .iter()
        .map(|&(e, g)| Item::new(e, g, 1).unwrap())
        .collect();
    let world = 7;
    // The smallest feasible S for this order, straight from the greedy (exact per size).
    let scan = (1..).find(|&s| fits(&items, s, world, |_| {})).unwrap();
    let (shard, offsets, stats) = min_shard(&items, world, 1).unwrap();
    assert!(stats.exact);
    assert_eq!(shard, scan);
    assert!(fits(&items, shard, world, |_| {}));
    assert_eq!(offsets.len(), items.len());
    // Guards the test: the case still sits on the edge it was chosen for.
    assert_eq!(
        stats.bisection_bound,
        shard + 1,
        "the bisection no longer stops one step above the minimum: pick another input"
    );
}

/// A layout built shard by shard may need every spare element of the buffer: one tensor of 7
/// elements in blocks of 3 on 2 ranks of 4 can only start at 1 (the boundary at 4 must be 3
/// elements in), so the gap before it is the whole spare `2·4 − 7 = 1`; and tensors that fill
/// the buffer exactly leave a spare of 0.
#[test]
fn shard_fill_may_use_the_whole_spare() {
    assert_eq!(
        shard_fill(&[Item::new(7, 3, 1).unwrap()], 2, 4).unwrap(),
        Some(vec![1])
    );
    let full = [Item::new(8, 4, 1).unwrap(); 3];
    let mut offsets = shard_fill(&full, 3, 8)
        .unwrap()
        .expect("3 x 8 elements fill 3 x 8");
    offsets.sort_unstable();
    assert_eq!(offsets, vec![0, 8, 16]);
}

/// The smallest `Σ S` over every split of `items` into at most two buffers and every order of
/// each (exhaustive: 2^(n−1) splits).
fn exhaustive_two_buffers(items: &[Item], world: usize) -> usize {
    let n = items.len();
    let one = |group: Vec<Item>| exact_any_order(&group, world, 1).unwrap().0;
    let mut best = one(items.to_vec());
    for mask in 1..(1u32 << (n - 1)) {
        let pick = |inside: bool| -> Vec<Item> {
            (0..n)
                .filter(|&i| (mask & (1 << i) != 0) == inside)
                .map(|i| items[i])
                .collect()
        };
        best = best.min(one(pick(true)) + one(pick(false)));
    }
    best
}

/// The floor a multi-buffer plan reports is a lower bound for its number of buffers: never
/// above the exhaustive optimum. On these units the two-buffer plan is one element per rank
/// above that optimum, so a floor that claimed the plan optimal (for example a one-buffer
/// bound applied to two buffers) would be caught.
#[test]
fn the_multi_buffer_floor_never_passes_the_exhaustive_optimum() {
    let mopts = MultiOptions {
        max_buffers: 2,
        collective_latency_s: 0.0,
        ..MultiOptions::default()
    };
    let opts = PlanOptions {
        coll_align: 1,
        start_align: 1,
        orders: Order::ALL.to_vec(),
    };
    let cases: [(&[(usize, usize)], usize); 3] = [
        (&[(42, 7), (59, 7), (24, 11), (39, 3)], 2),
        (&[(32, 7), (64, 14), (46, 13), (24, 2)], 2),
        (&[(57, 14), (60, 16), (59, 10), (41, 10), (40, 10)], 4),
    ];
    let mut below_plan = 0;
    for (spec, world) in cases {
        let items: Vec<Item> = spec
            .iter()
            .map(|&(e, g)| Item::new(e, g, 1).unwrap())
            .collect();
        let layout = plan_multi_items(&items, world, &opts, &mopts).unwrap();
        let best = exhaustive_two_buffers(&items, world);
        assert!(
            layout.shard_sum() >= best,
            "{spec:?}: plan below the optimum"
        );
        assert!(
            layout.floor <= best,
            "{spec:?} V={world}: floor {} above the optimum {best} (plan {}, {} buffers)",
            layout.floor,
            layout.shard_sum(),
            layout.groups.len()
        );
        below_plan += usize::from(best < layout.shard_sum());
    }
    // Guards the test: a floor raised to the plan shows only where the plan is not optimal.
    assert!(
        below_plan > 0,
        "every plan is optimal now: pick other inputs"
    );
}

/// `unit_runs` (what `ragged plan --json` writes) expands to exactly the unit counts of
/// [`Plan::units_per_rank`] for every valid placement of one tensor on small buffers, short
/// tail blocks included (a tensor of 10 elements in blocks of 4 holds a last unit of 2).
#[test]
fn unit_runs_count_the_short_tail_block() {
    let plan = one_tensor_plan(10, 4, 0, 4, 3);
    assert_eq!(plan.units_per_rank(0).unwrap(), vec![1, 1, 1]);
    assert_eq!(
        unit_runs(&plan, 0).unwrap(),
        vec![[0, 1, 1], [1, 1, 1], [2, 1, 1]]
    );
    let mut checked = 0;
    for shard in 1..=6usize {
        for block in 1..=5usize {
            for numel in block..=17 {
                for offset in 0..=8 {
                    let world = (offset + numel).div_ceil(shard) + 1;
                    let plan = one_tensor_plan(numel, block, offset, shard, world);
                    if plan.validate().is_err() {
                        continue;
                    }
                    let mut expanded = vec![0; world];
                    for [first, ranks, units] in unit_runs(&plan, 0).unwrap() {
                        expanded[first..first + ranks].fill(units);
                    }
                    assert_eq!(
                        expanded,
                        plan.units_per_rank(0).unwrap(),
                        "S={shard} block={block} numel={numel} offset={offset}"
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 1_000);
}

/// A plan over `(name, numel, block, offset)` tensors of one buffer.
fn buffer_plan(name: &str, tensors: &[(&str, usize, usize, usize)], shard: usize) -> Plan {
    Plan {
        unit: name.into(),
        world: 2,
        shard_size: shard,
        coll_align: 1,
        order: Order::Module,
        placements: tensors
            .iter()
            .map(|&(n, numel, block, offset)| Placement {
                name: n.into(),
                shape: vec![numel],
                dtype: DType::BF16,
                block: AtomicBlock::Element,
                block_elems: block,
                offset,
            })
            .collect(),
        stats: SearchStats::default(),
        lower_bound: shard,
    }
}

/// Every number of the multi-buffer JSON comes from its own buffer (or the unit's single
/// plan): one unit on 2 ranks whose buffers and single plan all differ.
/// - buffer 0, `S = 3`: `a` (6 elements, blocks of 3) at 0; padding `2·3 − 6 = 0`;
/// - buffer 1, `S = 5`: `b` (5, blocks of 1) at 0, `c` (4, blocks of 2) at 5; padding
///   `2·5 − 9 = 1`;
/// - the single plan, `S = 9`: `a` at 0, `b` at 6, `c` at 11; padding `2·9 − 15 = 3`.
#[test]
fn multi_buffer_json_writes_each_field_from_its_own_plan() {
    let buffers = vec![
        buffer_plan("layers.0#0", &[("a", 6, 3, 0)], 3),
        buffer_plan("layers.0#1", &[("b", 5, 1, 0), ("c", 4, 2, 5)], 5),
    ];
    let single = buffer_plan(
        "layers.0",
        &[("a", 6, 3, 0), ("b", 5, 1, 6), ("c", 4, 2, 11)],
        9,
    );
    for p in buffers.iter().chain([&single]) {
        p.validate().unwrap();
    }
    let plan = MultiModelPlan {
        model: "m".into(),
        world: 2,
        layers_per_unit: 1,
        units: vec![MultiPlan {
            unit: "layers.0".into(),
            world: 2,
            buffers,
            single,
            floor_shard_sum: 8,
            cost_s: 0.0,
        }],
        elapsed: Duration::ZERO,
        distinct_units: 1,
    };
    let mut out = Vec::new();
    write_multi_json(&plan, true, &mut out).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let unit = &json["units"][0];
    assert_eq!(unit["k"], 2);
    assert_eq!(unit["floor_shard_sum"], 8);
    assert_eq!(unit["single_shard_size"], 9);
    // Totals: Σ V·S_b = 6 + 10 = 16 for 15 elements.
    assert_eq!(json["numel"], 15);
    assert_eq!(json["buffer_elems"], 16);
    let buffers = unit["buffers"].as_array().unwrap();
    let want = [("layers.0#0", 3, 0), ("layers.0#1", 5, 1)];
    for (b, (name, shard, padding)) in buffers.iter().zip(want) {
        assert_eq!(b["name"], name);
        assert_eq!(b["shard_size"], shard);
        assert_eq!(b["padding"], padding, "{name}");
    }
    // a: one block on each rank; b: 5 units on rank 0; c: [5, 9) on rank 1, 2 units.
    let runs = |b: usize, t: usize| buffers[b]["tensors"][t]["unit_runs"].clone();
    assert_eq!(runs(0, 0), serde_json::json!([[0, 1, 1], [1, 1, 1]]));
    assert_eq!(runs(1, 0), serde_json::json!([[0, 1, 5]]));
    assert_eq!(runs(1, 1), serde_json::json!([[1, 1, 2]]));
    assert_eq!(buffers[1]["tensors"][1]["offset"], 5);
    assert_eq!(
        buffers[1]["tensors"][1]["units_per_rank"],
        serde_json::json!([0, 2])
    );
}

/// The out-of-place reduce-scatter checks, like every other reducing collective, that the
/// ranks agree on the reduce op: Sum on one rank and Avg on the other is an error on both.
#[test]
fn out_of_place_reduce_scatter_refuses_mismatched_ops() {
    let outcomes = ThreadWorld::run(2, |c| {
        let mut send = [1.0f32; 4];
        let mut recv = vec![0.0f32; 2];
        let op = if c.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Avg
        };
        let res = c.reduce_scatter((&mut send[..]).into(), (&mut recv[..]).into(), op);
        Ok((res.map_err(|e| e.to_string()), recv))
    })
    .unwrap();
    for (rank, (res, recv)) in outcomes.iter().enumerate() {
        let err = res.as_ref().expect_err("mismatched ops must fail");
        assert!(err.contains("reduce op"), "rank {rank}: {err}");
        assert_eq!(recv, &[0.0, 0.0], "rank {rank}: memory touched");
    }
}

/// One rank calling a second collective while its first is still waiting for the others is an
/// error naming that misuse, on that call, and the world fails for everyone (it never pairs
/// the two calls with the other ranks' one). Rank 1 joins only after both calls returned.
#[test]
fn a_second_concurrent_call_on_one_rank_is_an_error() {
    let gate = std::sync::Barrier::new(2);
    let start = Instant::now();
    let seen = ThreadWorld::run_with_timeout(2, Duration::from_secs(5), |c| {
        if c.rank() == 0 {
            let (a, b) = std::thread::scope(|s| {
                let a = s.spawn(|| c.barrier());
                let b = s.spawn(|| c.barrier());
                (a.join().unwrap(), b.join().unwrap())
            });
            gate.wait();
            Ok([a, b]
                .into_iter()
                .map(|r| r.expect_err("one call is the second").to_string())
                .collect::<Vec<_>>())
        } else {
            gate.wait();
            let late = c.barrier().expect_err("the world failed").to_string();
            Ok(vec![late])
        }
    })
    .unwrap();
    assert!(
        seen[0]
            .iter()
            .any(|e| e.contains("during another collective")),
        "{seen:?}"
    );
    assert!(seen[1][0].contains("failed earlier"), "{seen:?}");
    // Noticed at once, not at the rendezvous timeout.
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
}

/// A rank waiting at a rendezvous for a rank that is alive but absent fails at the configured
/// timeout, not at a multiple of it. Rank 1 stays alive (it waits for rank 0's verdict, or 3 s,
/// past four timeouts) and never joins the barrier.
#[test]
fn a_rendezvous_fails_near_its_configured_timeout() {
    let timeout = Duration::from_millis(500);
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let result = ThreadWorld::run_with_timeout(2, timeout, |c| {
        if c.rank() == 1 {
            let _ = rx.lock().unwrap().recv_timeout(Duration::from_secs(3));
            return Ok(Duration::ZERO);
        }
        let start = Instant::now();
        let res = c.barrier();
        let waited = start.elapsed();
        tx.send(()).unwrap();
        assert!(res.unwrap_err().to_string().contains("timed out"));
        Ok(waited)
    })
    .unwrap();
    let waited = result[0];
    assert!(waited >= timeout, "{waited:?}");
    // Up to three timeouts (a second of slack for a loaded machine); a wait of four timeouts
    // is not the timeout.
    assert!(
        waited < 3 * timeout,
        "waited {waited:?} for a {timeout:?} timeout"
    );
}

/// A launch with a run id takes rank 0's message over TCP only if it carries the same id: a
/// message without one comes from another launch (an older build, or one without a run id),
/// and is refused at once, as a file without one is skipped.
#[test]
fn a_tcp_message_without_the_launchs_run_id_is_refused() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let via = Rendezvous::Tcp(format!("127.0.0.1:{port}"));
    let timeout = Duration::from_secs(20);
    let (root, peer) = std::thread::scope(|s| {
        let root = s.spawn(|| via.share_in_run("", 0, 2, timeout, || Ok([7u8; 16])));
        let peer = s.spawn(|| via.share_in_run("job-b", 1, 2, timeout, || Ok([0u8; 16])));
        (root.join().unwrap(), peer.join().unwrap())
    });
    assert_eq!(root.unwrap(), [7u8; 16]);
    let err = peer.expect_err("another launch's message").to_string();
    assert!(err.contains("this launch is run \"job-b\""), "{err}");
}

/// A one-rank world has only root 0: broadcasting from rank 1 is an error, in the one-rank
/// backend as in a thread world of one rank.
#[test]
fn a_one_rank_world_refuses_a_broadcast_from_rank_1() {
    let mut x = [1.0f32, 2.0];
    assert!(SingleRank.broadcast(BufMut::F32(&mut x), 1).is_err());
    assert!(SingleRank.broadcast(BufMut::F32(&mut x), 0).is_ok());
    let threads = ThreadWorld::run(1, |c| {
        let mut y = [1.0f32, 2.0];
        Ok(c.broadcast(BufMut::F32(&mut y), 1).is_err())
    })
    .unwrap();
    assert_eq!(threads, [true]);
}

/// A one-rank world's all-to-all-v takes exactly one count per side, equal to the buffer: counts
/// for a larger world are refused even where they add up (`[n, 0]`), as in a thread world of
/// one rank.
#[test]
fn a_one_rank_world_refuses_counts_for_another_world_size() {
    let send = [1.0f32, 2.0, 3.0];
    let mut recv = [0.0f32; 3];
    for (sc, rc) in [
        (&[3, 0][..], &[3][..]),
        (&[3][..], &[3, 0][..]),
        (&[][..], &[3][..]),
    ] {
        let single = SingleRank.all_to_all_v(Buf::F32(&send), sc, BufMut::F32(&mut recv), rc);
        assert!(single.is_err(), "SingleRank took counts {sc:?} / {rc:?}");
        let threads = ThreadWorld::run(1, |c| {
            let mut r = [0.0f32; 3];
            Ok(c.all_to_all_v(Buf::F32(&send), sc, BufMut::F32(&mut r), rc)
                .is_err())
        })
        .unwrap();
        assert_eq!(threads, [true], "counts {sc:?} / {rc:?}");
    }
    assert_eq!(recv, [0.0; 3]);
    SingleRank
        .all_to_all_v(Buf::F32(&send), &[3], BufMut::F32(&mut recv), &[3])
        .unwrap();
    assert_eq!(recv, send);
}
