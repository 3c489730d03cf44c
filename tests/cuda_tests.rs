//! The GPU backend's gate, device storage ops and collectives (feature `cuda`). Tests that need
//! a GPU open device 0 through the gate and, without a driver or GPU, print `skipped: <reason>`
//! and return. The element ops are one IEEE `f32` operation per element, compared bit for bit.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use half::bf16;
use ragged::comm::conformance::{exercise, gather_into_segments, uneven_all_to_all, SLICE};
use ragged::comm::{Communicator, ReduceOp, Segment};
use ragged::cuda::collective::ViaDevice;
use ragged::cuda::Device;
use ragged::storage::{NonFiniteCounts, Placement, Storage};
use ragged::Error;

#[path = "common/cuda.rs"]
mod cuda;
use cuda::{
    bits, device, nccl_ranks_of_one_process, on_each_thread, segments_of, two_or_more_devices,
    values, zeroed_parts,
};

#[test]
fn gate_returns_an_error_instead_of_panicking_when_no_gpu_is_usable() {
    // Twice: cudarc's library cell stays empty after a failed load, so a second call is where
    // an ungated entry point would panic again.
    for _ in 0..2 {
        let outcome = std::panic::catch_unwind(|| Device::open(0).map(|_| ()));
        match outcome {
            Ok(Ok(())) => println!("a CUDA device is present: the gate let it through"),
            Ok(Err(e)) => {
                assert!(matches!(e, Error::CudaUnavailable { .. }), "{e:?}");
                println!("gate: {e}");
            }
            Err(_) => panic!("Device::open panicked instead of returning Err"),
        }
    }
    // An ordinal past the last device is always an error, never a panic.
    assert!(matches!(
        Device::open(1 << 20),
        Err(Error::CudaUnavailable { .. })
    ));
}

#[test]
fn gate_error_names_the_missing_library_on_a_machine_without_a_driver() {
    // On a machine with a driver this test has nothing to check.
    let has_driver = ragged::cuda::driver_available().is_ok();
    if has_driver {
        println!("skipped: a CUDA driver library is present");
        return;
    }
    let e = Device::open(0).unwrap_err();
    assert!(e.to_string().contains("libcuda"), "{e}");
}

/// The same element ops on host and device storage give the same bits, and touch only their
/// ranges.
#[test]
fn device_storage_ops_equal_the_host_ops_bitwise() {
    let Some(dev) = device() else { return };
    let n = 1000;
    let run = |place: Placement| -> Vec<Vec<f32>> {
        let mut x = place.put(values(n, 1)).unwrap();
        let y = place.put(values(300, 2)).unwrap();
        let mut seen = Vec::new();
        x.scale(0.3).unwrap();
        seen.push(x.to_vec().unwrap());
        x.write_range(100..400, y.view(), true).unwrap();
        seen.push(x.to_vec().unwrap());
        x.write_range(500..800, y.view(), false).unwrap();
        seen.push(x.to_vec().unwrap());
        x.zero_range(0..50).unwrap();
        seen.push(x.to_vec().unwrap());
        seen
    };
    let (host, device) = (run(Placement::Cpu), run(Placement::Cuda(dev.clone())));
    for (i, (h, d)) in host.iter().zip(&device).enumerate() {
        assert_eq!(bits(d), bits(h), "op {i}");
    }
    // SGD's update: `axpy` with a = −lr gives the bits of the host's `p -= lr * g`.
    let (p, g, lr) = (values(n, 3), values(n, 4), 0.0123f32);
    let mut want = p.clone();
    want.iter_mut().zip(&g).for_each(|(p, g)| *p -= lr * g);
    let mut dp = dev.upload(&p).unwrap();
    let dg = dev.upload(&g).unwrap();
    ragged::cuda::ops::axpy(&dev, &mut dp.slice_mut(..), &dg.slice(..), -lr).unwrap();
    assert_eq!(bits(&dev.download(&dp).unwrap()), bits(&want), "axpy");
    // The non-finite count (the step's check) equals the host's, past one block of threads.
    let mut odd = values(70_000, 6);
    for (i, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN]
        .iter()
        .enumerate()
    {
        odd[i * 17_000 + 3] = *v;
    }
    odd[5] = f32::MAX;
    odd[6] = f32::from_bits(1); // subnormal: finite
    for place in [Placement::Cpu, Placement::Cuda(dev.clone())] {
        assert_eq!(
            place.put(odd.clone()).unwrap().count_non_finite().unwrap(),
            4
        );
        assert_eq!(
            place.put(values(n, 7)).unwrap().count_non_finite().unwrap(),
            0
        );
    }
    // A range past the end, and host elements into device storage, are refused.
    let mut x = Placement::Cuda(dev).zeros::<f32>(10).unwrap();
    assert!(x.zero_range(5..11).is_err());
    let host = [1.0f32; 4];
    assert!(x.write_range(0..4, (&host[..]).into(), false).is_err());
    assert!(matches!(x, Storage::Cuda(_)));
}

/// Protects the device branches of `Storage`'s range ops away from the start of a buffer:
/// `zero_range`, `fill_range` and `read_range` each touch exactly their range, as on the host
/// (a gradient buffer's gaps and untouched slots are zeroed in its middle; a checkpoint reads
/// and fills a shard's fields by range). `device_storage_ops_equal_the_host_ops_bitwise`
/// zeroes only a range that starts at 0.
#[test]
fn device_range_ops_away_from_the_start_touch_exactly_their_ranges() {
    let Some(dev) = device() else { return };
    let run = |place: Placement| -> (Vec<u32>, Vec<u32>) {
        let mut x = place.put(values(1000, 11)).unwrap();
        x.zero_range(300..420).unwrap();
        x.fill_range(600..650, |out| {
            for (i, v) in out.iter_mut().enumerate() {
                *v = i as f32 + 0.5;
            }
            Ok(())
        })
        .unwrap();
        let part = x.read_range(250..700).unwrap().into_owned();
        (bits(&x.to_vec().unwrap()), bits(&part))
    };
    let host = run(Placement::Cpu);
    assert_eq!(run(Placement::Cuda(dev)), host);
}

#[test]
fn a_memo_is_made_once_per_device_and_keeps_its_type() {
    let Some(dev) = device() else { return };
    let made = std::sync::atomic::AtomicUsize::new(0);
    let table = |dev: &Device| {
        made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        dev.upload(&[1u32, 2, 3])
    };
    let first = dev.memo("test table", table).unwrap();
    let again = dev.memo("test table", table).unwrap();
    assert!(
        Arc::ptr_eq(&first, &again),
        "the second call made another value"
    );
    assert_eq!(made.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(dev.download(&*again).unwrap(), [1, 2, 3]);
    // Another `Device` (a second handle on the same GPU) makes its own.
    let Some(other) = device() else { return };
    let theirs = other.memo("test table", table).unwrap();
    assert!(!Arc::ptr_eq(&first, &theirs));
    assert_eq!(made.load(std::sync::atomic::Ordering::Relaxed), 2);
    // A make may ask for another memo (launch shapes ask for the multiprocessor count).
    let outer = dev.memo("outer", |d| Ok(*d.memo("inner", |_| Ok(3u32))? + 1));
    assert_eq!(*outer.unwrap(), 4);
    // A key holds one type; a failed make is not kept.
    let wrong = dev.memo("test table", |_| Ok(7u64));
    assert!(matches!(wrong, Err(Error::Cuda { .. })), "{wrong:?}");
    let failed = dev.memo("failing", |_| -> ragged::Result<u32> {
        Err(Error::Cuda {
            op: "test",
            reason: "no".into(),
        })
    });
    assert!(failed.is_err());
    assert_eq!(*dev.memo("failing", |_| Ok(5u32)).unwrap(), 5);
}

#[test]
fn a_missing_kernel_entry_point_is_an_error_and_spoils_no_later_lookup() {
    let Some(dev) = device() else { return };
    let missing = dev.function(&ragged::cuda::ADAMW, "no_such_kernel");
    assert!(matches!(missing, Err(Error::Cuda { .. })), "{missing:?}");
    for _ in 0..2 {
        dev.function(&ragged::cuda::ADAMW, "adamw_step").unwrap();
    }
    let again = dev.function(&ragged::cuda::ADAMW, "no_such_kernel");
    assert!(matches!(again, Err(Error::Cuda { .. })), "{again:?}");
}

/// Mixed precision's device casts (`cuda::ops::f32_to_bf16`, `bf16_to_f32`,
/// `accumulate_bf16`) equal the host's (`half::bf16::from_f32`; widening and one f32 addition) bit for bit: ties to even,
/// the extremes, subnormals, infinities and NaN (a quiet NaN with the sign and payload kept).
#[test]
fn bf16_casts_and_gradient_accumulation_equal_the_host_loops_bitwise() {
    let Some(dev) = device() else { return };
    let mut x = values(5000, 9);
    let ties = [
        0x3f80_8000u32,
        0x3f81_8000,
        0x7f7f_ffff,
        0x0000_8000,
        0x0001_8000,
    ];
    let special = [
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::MIN_POSITIVE,
    ];
    x.extend(ties.iter().map(|&b| f32::from_bits(b)));
    x.extend(special);
    x.push(f32::from_bits(0x7f80_0001)); // a signalling NaN: made quiet
    let want: Vec<u16> = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    let dx = dev.upload(&x).unwrap();
    let mut db = dev.zeros::<half::bf16>(x.len()).unwrap();
    ragged::cuda::ops::f32_to_bf16(&dev, &dx.slice(..), &mut db.slice_mut(..)).unwrap();
    let got: Vec<u16> = dev
        .download(&db)
        .unwrap()
        .iter()
        .map(|b| b.to_bits())
        .collect();
    assert_eq!(got, want, "f32 to bf16");
    // And back: the exact widening.
    let mut wide = dev.zeros::<f32>(x.len()).unwrap();
    ragged::cuda::ops::bf16_to_f32(&dev, &db.slice(..), &mut wide.slice_mut(..)).unwrap();
    let widened: Vec<f32> = want
        .iter()
        .map(|&b| half::bf16::from_bits(b).to_f32())
        .collect();
    assert_eq!(
        bits(&dev.download(&wide).unwrap()),
        bits(&widened),
        "bf16 to f32"
    );
    // Into an f32 slot: the first gradient is widened, the next ones added.
    let g: Vec<half::bf16> = want.iter().map(|&b| half::bf16::from_bits(b)).collect();
    let mut host = values(x.len(), 10);
    let mut slot = dev.upload(&host).unwrap();
    for first in [true, false, false] {
        host.iter_mut()
            .zip(&g)
            .for_each(|(h, g)| *h = if first { g.to_f32() } else { *h + g.to_f32() });
        let dg = dev.upload(&g).unwrap();
        ragged::cuda::ops::accumulate_bf16(&dev, &mut slot.slice_mut(..), &dg.slice(..), first)
            .unwrap();
        assert_eq!(
            bits(&dev.download(&slot).unwrap()),
            bits(&host),
            "first: {first}"
        );
    }
    // Lengths that differ are refused.
    let short = dev.zeros::<half::bf16>(3).unwrap();
    let r =
        ragged::cuda::ops::accumulate_bf16(&dev, &mut slot.slice_mut(..), &short.slice(..), true);
    assert!(r.is_err());
}

/// All-gathers `send` into fresh device segments at `spans`, as
/// `conformance::gather_into_segments` does into host ones: their values back to back and the
/// bytes staged (cuda_alloc_tests counts the device memory the gather allocates).
fn gather_into_device_segments(
    c: &dyn Communicator,
    dev: &Device,
    send: &[f32],
    spans: &[std::ops::Range<usize>],
) -> ragged::Result<(Vec<f32>, usize)> {
    let send = dev.upload(send)?;
    let mut parts = zeroed_parts(dev, spans)?;
    let mut segments = segments_of(spans, &mut parts);
    let staged = c.all_gather_segments(send.slice(..).into(), &mut segments)?;
    drop(segments);
    let mut gathered = Vec::new();
    for p in &parts {
        gathered.extend(dev.download(p)?);
    }
    Ok((gathered, staged))
}

/// Device 0 and a fresh NCCL id, or `None` after printing why not (no GPU, no NCCL).
fn device_and_nccl_id() -> Option<(Arc<Device>, [u8; ragged::cuda::nccl::ID_BYTES])> {
    let dev = device()?;
    match ragged::cuda::nccl::unique_id() {
        Ok(id) => Some((dev, id)),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

#[test]
fn nccl_world_of_one_gathers_and_reduces_in_place() {
    use ragged::cuda::nccl::NcclComm;
    let Some((dev, id)) = device_and_nccl_id() else {
        return;
    };
    let comm = NcclComm::from_rank(dev.clone(), 0, 1, &id).unwrap();
    let s = 1000;
    let hx = values(s, 5);
    let mut x = dev.upload(&hx).unwrap();
    comm.all_gather_in_place(x.slice_mut(..).into()).unwrap();
    assert_eq!(bits(&dev.download(&x).unwrap()), bits(&hx), "all-gather");
    comm.reduce_scatter_in_place(x.slice_mut(..).into(), ReduceOp::Sum)
        .unwrap();
    assert_eq!(
        bits(&dev.download(&x).unwrap()),
        bits(&hx),
        "reduce-scatter"
    );
    // Host buffers (staged through device copies) and device buffers: every collective of a
    // world of one returns its input, and the grouped send/recv of all-to-all-v moves a rank's
    // segment to itself.
    let want = exercise(&ragged::comm::SingleRank).unwrap();
    assert_eq!(exercise(&comm).unwrap(), want, "host buffers");
    let on_device = ViaDevice::new(&comm, &dev);
    assert_eq!(exercise(&on_device).unwrap(), want, "device buffers");
    let bad = comm.all_to_all_v(
        (&hx[..]).into(),
        &[3],
        (&mut vec![0f32; 4][..]).into(),
        &[4],
    );
    assert!(bad.is_err(), "counts that do not add up are refused");
}

/// Joining an NCCL communicator is bounded: a rank whose peers never join returns `Err` within
/// the limit instead of waiting for ever in `ncclCommInitRank` (which has no timeout; on
/// tools/cuda-emu it fails after `CUDA_EMU_NCCL_WAIT_S`, 120 s by default, far past this
/// limit), and ranks that do join within it get working communicators, each on its own device
/// (the join runs on a thread of its own, which must bind the rank's device: on the emulator,
/// two ranks on one device are refused). The second part needs two devices.
#[test]
fn joining_an_nccl_world_is_bounded_and_binds_each_ranks_device() {
    use ragged::cuda::nccl::{unique_id, NcclComm};
    let Some((dev, id)) = device_and_nccl_id() else {
        return;
    };
    let limit = Duration::from_millis(1500);
    let start = Instant::now();
    let alone = NcclComm::from_rank_within(dev, 0, 2, &id, limit);
    let waited = start.elapsed();
    let e = alone.expect_err("rank 0 of 2 joined without rank 1");
    assert!(
        e.to_string()
            .contains("joined the NCCL communicator within 1.5 s"),
        "{e}"
    );
    assert!(
        waited >= limit && waited < limit * 10,
        "returned after {waited:?}"
    );

    // The two-rank join.
    let Some(devs) = two_or_more_devices() else {
        return;
    };
    let id = unique_id().unwrap();
    let sums = on_each_thread(&devs[..2], |rank, dev| {
        let comm = NcclComm::from_rank_within(dev.clone(), rank, 2, &id, limit * 20)?;
        let mut x = vec![rank as f32 + 1.0; 4];
        comm.all_reduce((&mut x[..]).into(), ReduceOp::Sum)?;
        ragged::Result::Ok(x)
    });
    let sums: Vec<Vec<f32>> = sums.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(sums, vec![vec![3.0f32; 4]; 2]);
}

/// The bits of each data-movement result, and each reduction's values.
type MovesAndSums = (Vec<Vec<u32>>, Vec<Vec<f32>>);

/// What [`nccl_ranks_of_one_process_match_the_cpu_thread_backend`] compares: the results of
/// the collectives that move data (bitwise on every backend) and of those that sum (NCCL's
/// order over ranks is its own).
fn moves_and_sums(c: &dyn Communicator) -> ragged::Result<MovesAndSums> {
    let (rank, world, s) = (c.rank(), c.world_size(), 37);
    let mut x = values(world * s, rank as u32 + 1);
    c.all_gather_in_place((&mut x[..]).into())?;
    let mut moves = vec![bits(&x)];
    moves.push(bits(&uneven_all_to_all(c)?));
    let mut x = values(s, rank as u32 + 8);
    c.broadcast((&mut x[..]).into(), world - 1)?;
    moves.push(bits(&x));
    c.barrier()?;
    let mut sums = Vec::new();
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        let mut x = values(world * s, rank as u32 + 3);
        c.reduce_scatter_in_place((&mut x[..]).into(), op)?;
        sums.push(x[rank * s..(rank + 1) * s].to_vec());
        let mut x = values(world * s, rank as u32 + 4);
        c.all_reduce((&mut x[..]).into(), op)?;
        sums.push(x);
    }
    Ok((moves, sums))
}

/// One process driving several GPUs (`NcclComm::from_devices`, one thread per rank), on host
/// and on device buffers: gathers, all-to-all-v and broadcast equal the CPU thread backend bit
/// for bit; sums and averages of 2-3 values of magnitude <= 1 agree within 1e-6 absolute (they
/// lie below 4, where an f32 ulp is 4.8e-7: another order of the additions moves a result by an
/// ulp or two). Needs two devices or
/// more (the H200 machine has one: skipped there; the CPU emulation in tools/cuda-emu has
/// three with CUDA_EMU_DEVICES=3).
#[test]
fn nccl_ranks_of_one_process_match_the_cpu_thread_backend() {
    use ragged::comm::threads::ThreadWorld;
    let Some(comms) = nccl_ranks_of_one_process() else {
        return;
    };
    let cpu = ThreadWorld::run(comms.len(), |c| moves_and_sums(c)).unwrap();
    for on_device in [false, true] {
        let nccl = on_each_thread(&comms, |_, c| match on_device {
            true => moves_and_sums(&ViaDevice::new(c, c.device())).unwrap(),
            false => moves_and_sums(c).unwrap(),
        });
        for (rank, ((moves, sums), (cpu_moves, cpu_sums))) in nccl.iter().zip(&cpu).enumerate() {
            assert_eq!(moves, cpu_moves, "rank {rank}, device buffers: {on_device}");
            for (got, want) in sums.iter().zip(cpu_sums) {
                assert_eq!(got.len(), want.len());
                let worst = got
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(worst <= 1e-6, "rank {rank}: sums differ by {worst}");
            }
        }
    }
}

/// Protects NCCL's out-of-place device collectives over several ranks
/// (`NcclComm::reduce_scatter` on device buffers: one `ncclReduceScatter` from the send buffer
/// into the receive buffer with the caller's operation; `all_gather` from a send buffer;
/// `all_gather_segments` into separate device allocations, uneven, with gaps and crossing
/// rank slices, as grouped sends and receives with nothing staged), which `moves_and_sums`
/// (in-place forms only) and the world of one (where an average is the sum and every slice
/// is the rank's own) leave unchecked: against the CPU thread backend, the gathers bit for
/// bit, sums and averages within 1e-6 (NCCL's own order over ranks). Needs two devices
/// (tools/cuda-emu with CUDA_EMU_DEVICES=3 has three).
/// Segments of a full buffer of `world` slices of `s`: uneven, with gaps, the last one
/// crossing every slice boundary (from rank 0's slice into the last rank's).
fn spans_of(world: usize, s: usize) -> Vec<std::ops::Range<usize>> {
    vec![0..1, 3..s - 3, s - 2..world * s - 1]
}

#[test]
fn nccl_out_of_place_device_collectives_of_several_ranks_match_the_cpu_thread_backend() {
    use ragged::comm::threads::ThreadWorld;
    use ragged::cuda::nccl::NcclComm;
    let Some(comms) = nccl_ranks_of_one_process() else {
        return;
    };
    let s = 37;
    // (the all-gather's bits, the own slice of a reduce-scatter by Sum and by Avg, the
    // segments' bits and the bytes staged for them)
    type Out = (Vec<u32>, Vec<Vec<f32>>, Vec<u32>, usize);
    let cpu: Vec<Out> = ThreadWorld::run(comms.len(), |c| {
        let (rank, world) = (c.rank(), c.world_size());
        let send = values(s, rank as u32 + 2);
        let mut all = vec![0f32; world * s];
        c.all_gather((&send[..]).into(), (&mut all[..]).into())?;
        let (gathered, staged) = gather_into_segments(c, &send, &spans_of(world, s))?;
        let mut sums = Vec::new();
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let mut x = values(world * s, rank as u32 + 3);
            let mut own = vec![0f32; s];
            c.reduce_scatter((&mut x[..]).into(), (&mut own[..]).into(), op)?;
            sums.push(own);
        }
        Ok((bits(&all), sums, bits(&gathered), staged))
    })
    .unwrap();
    let on_device = |c: &NcclComm| -> ragged::Result<Out> {
        let (rank, world, dev) = (c.rank(), c.world_size(), c.device());
        let host = values(s, rank as u32 + 2);
        let send = dev.upload(&host)?;
        let mut all = dev.upload(&vec![0f32; world * s])?;
        c.all_gather(send.slice(..).into(), all.slice_mut(..).into())?;
        let (gathered, staged) = gather_into_device_segments(c, dev, &host, &spans_of(world, s))?;
        let mut sums = Vec::new();
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let mut x = dev.upload(&values(world * s, rank as u32 + 3))?;
            let mut own = dev.upload(&vec![0f32; s])?;
            c.reduce_scatter(x.slice_mut(..).into(), own.slice_mut(..).into(), op)?;
            sums.push(dev.download(&own)?);
        }
        Ok((bits(&dev.download(&all)?), sums, bits(&gathered), staged))
    };
    let gpu = on_each_thread(&comms, |_, c| on_device(c).unwrap());
    for (rank, (got, want)) in gpu.iter().zip(&cpu).enumerate() {
        let ((moved, sums, segs, staged), (cpu_moved, cpu_sums, cpu_segs, _)) = (got, want);
        assert_eq!(moved, cpu_moved, "rank {rank}: all-gather");
        assert_eq!(segs, cpu_segs, "rank {rank}: all-gather into segments");
        assert_eq!(*staged, 0, "rank {rank}: bytes staged for the segments");
        for ((got, want), op) in sums.iter().zip(cpu_sums).zip(["Sum", "Avg"]) {
            assert_eq!(got.len(), want.len());
            // (A NaN fails the comparison.)
            let close = got.iter().zip(want).all(|(a, b)| (a - b).abs() <= 1e-6);
            assert!(
                close,
                "rank {rank}: reduce-scatter by {op}: {got:?}, CPU {want:?}"
            );
        }
    }
}

#[test]
fn thread_ranks_on_one_gpu_equal_the_cpu_thread_backend_bitwise() {
    use ragged::comm::threads::ThreadWorld;
    use ragged::cuda::threads::ThreadDeviceComm;
    let Some(dev) = device() else { return };
    for world in [1, 2, 3, 4] {
        let cpu = ThreadWorld::run(world, |c| exercise(c)).unwrap();
        let gpu = ThreadDeviceComm::run(dev.clone(), world, |c| {
            exercise(&ViaDevice::new(c, c.device()))
        })
        .unwrap();
        assert_eq!(gpu, cpu, "world of {world}, device buffers");
        let host = ThreadDeviceComm::run(dev.clone(), world, |c| exercise(c)).unwrap();
        assert_eq!(host, cpu, "world of {world}, host buffers");
        // Device segments straight from the device shards: no device memory allocated for
        // the call, nothing staged, the values of the CPU backend's host segments.
        let spans = ragged::comm::conformance::segment_spans(world);
        let seed = |c: &dyn Communicator| values(SLICE, c.rank() as u32 + 5);
        let cpu = ThreadWorld::run(world, |c| gather_into_segments(c, &seed(c), &spans)).unwrap();
        let gpu = ThreadDeviceComm::run(dev.clone(), world, |c| {
            gather_into_device_segments(c, c.device(), &seed(c), &spans)
        })
        .unwrap();
        for (rank, ((got, staged), (want, _))) in gpu.iter().zip(&cpu).enumerate() {
            assert_eq!(
                bits(got),
                bits(want),
                "world of {world}, rank {rank}: segments"
            );
            assert_eq!(*staged, 0, "world of {world}, rank {rank}: bytes staged");
        }
    }
}

/// Groups split from thread ranks on one GPU (each a thread world of its own on the device) and
/// from NCCL ranks of one process (`ncclCommSplit`) run their collectives as worlds of their
/// own: the GPU thread ranks' groups (`rank / 2` of 4) bitwise the CPU thread backend's on
/// host and device buffers; NCCL's (ranks by parity) against a CPU thread world of the group's
/// size, moves bitwise and sums within 1e-6 (as `nccl_ranks_of_one_process_match_…`).
#[test]
fn groups_split_from_gpu_thread_ranks_and_nccl_are_worlds_of_their_own() {
    use ragged::comm::threads::ThreadWorld;
    use ragged::cuda::threads::ThreadDeviceComm;
    let Some(dev) = device() else { return };
    let cpu = ThreadWorld::run(2, |c| exercise(c)).unwrap();
    let gpu = ThreadDeviceComm::run(dev, 4, |c| {
        let g = c.split(c.rank() / 2)?;
        let on_device = exercise(&ViaDevice::new(&*g, c.device()))?;
        Ok((g.rank(), on_device, exercise(&*g)?))
    })
    .unwrap();
    for (r, (rank, on_device, on_host)) in gpu.iter().enumerate() {
        assert_eq!(*rank, r % 2);
        assert_eq!(
            on_device,
            &cpu[r % 2],
            "rank {r}: a group on device buffers"
        );
        assert_eq!(on_host, &cpu[r % 2], "rank {r}: a group on host buffers");
    }
    let Some(comms) = nccl_ranks_of_one_process() else {
        return;
    };
    let got = on_each_thread(&comms, |_, c| {
        let g = c.split(c.rank() % 2).unwrap();
        (g.rank(), g.world_size(), moves_and_sums(&*g).unwrap())
    });
    for (r, (rank, size, (moves, sums))) in got.iter().enumerate() {
        assert_eq!((*rank, *size), (r / 2, comms.len().div_ceil(2) - r % 2));
        let want = ThreadWorld::run(*size, |c| moves_and_sums(c)).unwrap();
        let (want_moves, want_sums) = &want[*rank];
        assert_eq!(moves, want_moves, "rank {r}: an NCCL group's moves");
        for (a, b) in sums.iter().flatten().zip(want_sums.iter().flatten()) {
            assert!(
                (a - b).abs() <= 1e-6,
                "rank {r}: an NCCL group's sums: {a} vs {b}"
            );
        }
    }
}

#[test]
fn thread_ranks_on_one_gpu_refuse_disagreeing_ranks_on_every_rank() {
    use ragged::cuda::threads::ThreadDeviceComm;
    let Some(dev) = device() else { return };
    // Rank 1 posts a buffer of another length: both ranks get the same Err, nobody hangs.
    let outcomes = ThreadDeviceComm::run(dev.clone(), 2, |c| {
        let mut x = c.device().zeros::<f32>(8 + 2 * c.rank()).unwrap();
        Ok(c.all_gather_in_place(x.slice_mut(..).into())
            .map_err(|e| e.to_string()))
    })
    .unwrap();
    assert!(outcomes.iter().all(|o| o.is_err()), "{outcomes:?}");
}

/// NCCL ranks that disagree get the same `Err` on every rank before any data moves (their
/// descriptors compared over NCCL first), in well under the collective timeout, where NCCL
/// alone would wait for it (or move mismatched bytes): rank 1 gathers a buffer of another
/// length, then into segments laid out otherwise, then calls a broadcast where the others
/// all-reduce, then sends rank 0 more than it receives in an all-to-all-v; after each refusal the ranks agree again and a matching call works. Without
/// the check (`set_check(false)`), rank 1's other layout is not seen before the data moves.
#[test]
fn nccl_ranks_refuse_disagreeing_calls_on_every_rank_before_moving_data() {
    let Some(mut comms) = nccl_ranks_of_one_process() else {
        return;
    };
    for c in &mut comms {
        c.set_timeout(Some(Duration::from_secs(60)));
    }
    let started = Instant::now();
    let outcomes = on_each_thread(&comms, |rank, c| -> Vec<String> {
        let dev = c.device();
        let world = c.world_size();
        let other = usize::from(rank == 1);
        let mut refusals = Vec::new();
        let mut refused = |r: ragged::Result<()>, what: &str| match r {
            Err(e) => refusals.push(e.to_string()),
            Ok(()) => panic!("rank {rank}: {what} was not refused"),
        };
        let mut x = dev.zeros::<f32>(world * (4 + other)).unwrap();
        refused(
            c.all_gather_in_place(x.slice_mut(..).into()),
            "a gather of another length",
        );
        let send = dev.upload(&values(4, rank as u32)).unwrap();
        let mut part = dev.zeros::<f32>(3).unwrap();
        let mut segments = [Segment {
            offset: 1 + other,
            buf: part.slice_mut(..).into(),
        }];
        let laid_out = c.all_gather_segments(send.slice(..).into(), &mut segments);
        refused(laid_out.map(drop), "segments laid out otherwise");
        let mut y = dev.zeros::<f32>(6).unwrap();
        let mixed = match rank {
            1 => c.broadcast(y.slice_mut(..).into(), 0),
            _ => c.all_reduce(y.slice_mut(..).into(), ReduceOp::Sum),
        };
        refused(mixed, "a broadcast against an all-reduce");
        // All-to-all-v whose counts disagree (their own table, exchanged second): rank 1
        // sends rank 0 two elements where rank 0 expects one.
        let send_counts: Vec<usize> = (0..world)
            .map(|j| 1 + other * usize::from(j == 0))
            .collect();
        let (s, r) = (
            dev.zeros::<f32>(send_counts.iter().sum()).unwrap(),
            vec![1; world],
        );
        let mut into = dev.zeros::<f32>(world).unwrap();
        let moved = c.all_to_all_v(
            s.slice(..).into(),
            &send_counts,
            into.slice_mut(..).into(),
            &r,
        );
        refused(moved, "all-to-all-v counts that do not match");
        // The ranks agree again: a matching call goes through.
        let mut z = dev.upload(&vec![rank as f32 + 1.0; world * 2]).unwrap();
        c.all_gather_in_place(z.slice_mut(..).into()).unwrap();
        refusals
    });
    let took = started.elapsed();
    assert!(took < Duration::from_secs(30), "refusals took {took:?}");
    for (rank, refusals) in outcomes.iter().enumerate() {
        assert_eq!(refusals.len(), 4, "rank {rank}: {refusals:?}");
        let counts = &refusals[3];
        assert!(
            counts.contains("sends 2 elements to rank 0, which expects 1"),
            "{counts}"
        );
        assert!(
            refusals[1].contains("laid out otherwise"),
            "rank {rank}: {}",
            refusals[1]
        );
        // Every rank's reason is the same (what follows "<op> on rank <r>: ").
        for (j, msg) in refusals.iter().enumerate() {
            let reason = |m: &str| m.split_once(": ").map(|(_, r)| r.to_string());
            assert_eq!(
                reason(msg),
                reason(&outcomes[0][j]),
                "rank {rank}, refusal {j}"
            );
        }
    }
    // Without the check, the other layout goes unseen before the data moves: rank 1's
    // segment gets values (or the call times out), not the refusal.
    for c in &mut comms {
        c.set_check(false);
        c.set_timeout(Some(Duration::from_secs(2)));
    }
    let unchecked = on_each_thread(&comms, |rank, c| {
        let dev = c.device();
        let send = dev.upload(&values(4, rank as u32)).unwrap();
        let mut part = dev.zeros::<f32>(2).unwrap();
        let mut segments = [Segment {
            offset: 1 + usize::from(rank == 1),
            buf: part.slice_mut(..).into(),
        }];
        c.all_gather_segments(send.slice(..).into(), &mut segments)
            .map_err(|e| e.to_string())
    });
    assert!(
        unchecked.iter().all(|r| r
            .as_ref()
            .err()
            .is_none_or(|e| !e.contains("laid out otherwise"))),
        "{unchecked:?}"
    );
}

/// Entry points of every kernel file (the launchers' constants).
const ENTRIES: [(&str, &[&str]); 7] = [
    (
        "group_ops.cu",
        &[
            "group_zero",
            "group_scale",
            "group_add",
            "group_axpy",
            "group_copy",
            "group_count_non_finite",
            "group_exact_squares",
            "group_f32_to_bf16",
            "group_bf16_to_f32",
            "group_accumulate_bf16",
        ],
    ),
    ("adamw.cu", &["adamw_step"]),
    ("adam8bit.cu", &["adam8bit_blocks"]),
    ("muon.cu", &["muon_momentum", "muon_apply"]),
    (
        "newton_schulz.cu",
        &[
            "ns_transpose",
            "ns_sumsq_partial",
            "ns_normalize",
            "ns_symmetrize_lower",
            "ns_add_diagonal_f32",
            "ns_add_diagonal_bf16",
        ],
    ),
    (
        "reduce_ranks.cu",
        &["reduce_ranks_f32", "reduce_ranks_bf16", "reduce_ranks_u8"],
    ),
    (
        "shampoo.cu",
        &["shampoo_moments", "shampoo_mul_abt", "shampoo_apply"],
    ),
];

#[test]
fn the_entry_list_names_every_kernel_of_every_source() {
    // So the PTX test below checks every entry point: the `extern "C" __global__` functions of
    // each source, read from its text, are exactly the list's.
    let marker = "extern \"C\" __global__ void ";
    for src in ragged::cuda::ALL_KERNELS {
        let mut found: Vec<&str> = src
            .src
            .match_indices(marker)
            .map(|(at, _)| {
                let mut rest = &src.src[at + marker.len()..];
                if let Some(bounded) = rest.strip_prefix("__launch_bounds__(") {
                    rest = &bounded[bounded.find(')').unwrap() + 1..];
                }
                rest[..rest.find('(').unwrap()].trim()
            })
            .collect();
        let (_, listed) = ENTRIES.iter().find(|(n, _)| *n == src.name).unwrap();
        let mut listed = listed.to_vec();
        found.sort_unstable();
        listed.sort_unstable();
        assert_eq!(found, listed, "{}", src.name);
    }
}

#[test]
fn every_kernel_compiles_with_nvrtc_without_fma_contraction_and_with_ieee_div_and_sqrt() {
    // Needs only the NVRTC library (no GPU): runs wherever libnvrtc.so.13 loads.
    for arch in ["compute_80", "compute_90"] {
        for src in ragged::cuda::ALL_KERNELS {
            let ptx = match ragged::cuda::compile(&src, arch) {
                Ok(p) => p.to_src(),
                Err(e @ Error::CudaUnavailable { .. }) => {
                    println!("skipped: {e}");
                    return;
                }
                Err(e) => panic!("{e}"),
            };
            let (_, entries) = ENTRIES.iter().find(|(n, _)| *n == src.name).unwrap();
            for e in *entries {
                assert!(
                    ptx.contains(&format!(".entry {e}(")),
                    "{}: no entry {e}",
                    src.name
                );
            }
            // --fmad=false: no multiply-add was contracted into an FMA, and every f32/f64 add,
            // sub and mul carries an explicit rounding mode (`.rn`), which forbids ptxas to
            // contract them later (PTX ISA: "mul/add with .rn are not fused"). Shampoo's
            // products call `fma` on f64 values widened from f32, whose products are exact, so
            // it rounds where a multiply then add would: the one FMA allowed.
            assert!(
                !ptx.contains("fma.rn.f32"),
                "{}: contracted FMA in PTX",
                src.name
            );
            if src.name != "shampoo.cu" {
                assert!(!ptx.contains("fma.rn"), "{}: FMA in PTX", src.name);
            }
            for plain in [
                "mul.f32", "add.f32", "sub.f32", "mul.f64", "add.f64", "sub.f64",
            ] {
                assert!(!ptx.contains(plain), "{}: {plain} without .rn", src.name);
            }
            // IEEE division and square root only (-prec-div, -prec-sqrt).
            for approx in ["div.approx", "div.full", "sqrt.approx", "rcp.approx"] {
                assert!(!ptx.contains(approx), "{}: {approx} in PTX", src.name);
            }
            if src.name == "shampoo.cu" {
                // The f64 lanes' products and sums and the norms' square root, rounded.
                for op in ["fma.rn.f64", "add.rn.f64", "sqrt.rn.f64", "cvt.rn.f32.f64"] {
                    assert!(ptx.contains(op), "shampoo.cu: no {op}");
                }
            }
            if src.name == "adamw.cu" || src.name == "adam8bit.cu" || src.name == "shampoo.cu" {
                // The update's division and square root are there, correctly rounded.
                assert!(ptx.contains("div.rn.f32"), "{}: no div.rn.f32", src.name);
                assert!(ptx.contains("sqrt.rn.f32"), "{}: no sqrt.rn.f32", src.name);
                assert!(ptx.contains("mul.rn.f32"), "{}: no mul.rn.f32", src.name);
            }
            println!("{arch} {}: {} bytes of PTX", src.name, ptx.len());
        }
    }
}

// ---- Edge cases a mutation audit of the GPU code found unprotected (session 22) ----
// The non-finite count past one grid of threads, bf16 NaN through the rank reduction, element
// ops on empty views, the device ordinal bound, the count checks of all-to-all-v, u8
// reductions over NCCL, and the watchdog's polling; compared with the CPU backends bit for
// bit.

/// Protects `group_count_non_finite`'s per-thread total: the element kernels' grid is capped
/// at 65 535 blocks of 256 threads, so past 16 776 960 elements a thread visits several, and
/// it must add **how many** of them were non-finite, not 1. Two non-finite elements one grid
/// stride apart fall to one thread; more elsewhere.
#[test]
fn non_finite_counts_count_every_element_a_thread_visits_one_slot_each() {
    let Some(dev) = device() else { return };
    let stride = 65_535 * 256;
    let n = stride + 1000;
    let mut x = vec![0.25f32; n];
    let bad = [3, stride + 3, 500, stride + 500, stride + 999];
    for (k, &i) in bad.iter().enumerate() {
        x[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][k % 3];
    }
    let host = Placement::Cpu
        .put(x.clone())
        .unwrap()
        .count_non_finite()
        .unwrap();
    assert_eq!(host, bad.len() as u64);
    // On the device: two storages in two slots of one tally, and the first counted twice (the
    // kernel adds to its slot), read with one download.
    let on_gpu = Placement::Cuda(dev);
    let (big, small) = (
        on_gpu.put(x).unwrap(),
        on_gpu.put(vec![f32::NAN, 1.0]).unwrap(),
    );
    let mut counts = NonFiniteCounts::new(&on_gpu, 2).unwrap();
    counts.add(0, &big).unwrap();
    counts.add(1, &small).unwrap();
    counts.add(0, &big).unwrap();
    assert_eq!(counts.read().unwrap(), [2 * host, 1]);
    assert_eq!(big.count_non_finite().unwrap(), host);
    // A slot past the end, and host memory counted into device slots: errors.
    assert!(counts.add(2, &small).is_err());
    let on_host = Placement::Cpu.put(vec![f32::NAN]).unwrap();
    assert!(counts.add(0, &on_host).is_err());
}

/// Protects the bf16 rounding's NaN rule in the rank reduction (`f32_to_bf16` in
/// `reduce_ranks.cu`: a NaN stays NaN, made quiet, as `half::bf16::from_f32`): a world of one
/// sums without an addition, so a signalling NaN reaches the rounding as it is; without the
/// rule it would round as a number. Also NaNs whose low bits would carry into the sign.
#[test]
fn bf16_rank_reduction_keeps_nan_quiet_like_the_cpu_backend() {
    use ragged::comm::threads::ThreadWorld;
    use ragged::cuda::collective::ViaDevice;
    use ragged::cuda::threads::ThreadDeviceComm;
    let Some(dev) = device() else { return };
    let values: Vec<bf16> = [0x7f81u16, 0xff81, 0x7fc0, 0x7fff, 0x3f80, 0xffff, 0x7f80]
        .iter()
        .map(|&b| bf16::from_bits(b))
        .collect();
    let run = |c: &dyn Communicator| -> ragged::Result<Vec<u16>> {
        let mut x = values.clone();
        c.all_reduce((&mut x[..]).into(), ReduceOp::Sum)?;
        let mut y = values.clone();
        c.reduce_scatter_in_place((&mut y[..]).into(), ReduceOp::Sum)?;
        Ok(x.iter().chain(&y).map(|v| v.to_bits()).collect())
    };
    let cpu = ThreadWorld::run(1, |c| run(c)).unwrap();
    let gpu = ThreadDeviceComm::run(dev, 1, |c| run(&ViaDevice::new(c, c.device()))).unwrap();
    assert_eq!(gpu, cpu);
    assert!(
        cpu[0].iter().take(2).all(|&b| b & 0x0040 != 0),
        "quiet NaNs"
    );
}

/// Protects the element kernels' launch shape on empty views (`elementwise(0)`: one block,
/// never a grid of 0 blocks, which the driver refuses): every op on an empty view succeeds
/// and changes nothing, as on the host.
#[test]
fn element_ops_on_empty_views_succeed_and_change_nothing() {
    let Some(dev) = device() else { return };
    let x0 = vec![1.5f32; 8];
    let mut x = dev.upload(&x0).unwrap();
    let y = dev.upload(&[2.0f32; 8]).unwrap();
    ragged::cuda::ops::zero(&dev, &mut x.slice_mut(3..3)).unwrap();
    ragged::cuda::ops::scale(&dev, &mut x.slice_mut(8..), 3.0).unwrap();
    ragged::cuda::ops::add(&dev, &mut x.slice_mut(..0), &y.slice(..0)).unwrap();
    ragged::cuda::ops::copy(&dev, &mut x.slice_mut(4..4), &y.slice(4..4)).unwrap();
    ragged::cuda::ops::axpy(&dev, &mut x.slice_mut(2..2), &y.slice(5..5), 0.5).unwrap();
    let mut n = dev.zeros::<u64>(1).unwrap();
    ragged::cuda::ops::add_non_finite(&dev, &x.slice(5..5), &mut n.slice_mut(..)).unwrap();
    assert_eq!(dev.download(&n).unwrap(), [0]);
    assert_eq!(dev.download(&x).unwrap(), x0);
}

/// Protects the gate's ordinal bound: the first ordinal past the last device is
/// `CudaUnavailable` naming the count (not a driver error from creating its context).
#[test]
fn the_first_missing_ordinal_is_refused_by_the_gate() {
    let Some(_dev) = device() else { return };
    let present = (0..64).take_while(|&i| Device::open(i).is_ok()).count();
    match Device::open(present) {
        Err(e @ Error::CudaUnavailable { .. }) => {
            assert!(e.to_string().contains("asked for"), "{e}");
        }
        other => panic!("ordinal {present} of {present} devices: {other:?}"),
    }
}

/// Protects the count checks of all-to-all-v on device buffers (`check_counts`): there must
/// be exactly one count per rank, even when the counts add up to the buffer lengths; NCCL
/// (world of one) and thread ranks on one GPU both refuse, and the buffers are untouched.
#[test]
fn all_to_all_v_refuses_a_count_vector_longer_than_the_world() {
    use ragged::cuda::nccl::{unique_id, NcclComm};
    use ragged::cuda::threads::ThreadDeviceComm;
    let Some(dev) = device() else { return };
    let send = dev.upload(&[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let mut recv = dev.upload(&[0.0f32; 4]).unwrap();
    let outcomes = ThreadDeviceComm::run(dev.clone(), 1, |c| {
        let mut recv = c.device().upload(&[0.0f32; 4])?;
        let send = c.device().upload(&[1.0f32, 2.0, 3.0, 4.0])?;
        Ok(c.all_to_all_v(
            send.slice(..).into(),
            &[1, 3],
            recv.slice_mut(..).into(),
            &[1, 3],
        )
        .is_err())
    })
    .unwrap();
    assert_eq!(outcomes, vec![true], "thread ranks");
    let id = match unique_id() {
        Ok(id) => id,
        Err(e) => {
            println!("skipped the NCCL part: {e}");
            return;
        }
    };
    let comm = NcclComm::from_rank(dev.clone(), 0, 1, &id).unwrap();
    let out = comm.all_to_all_v(
        send.slice(..).into(),
        &[1, 3],
        recv.slice_mut(..).into(),
        &[1, 3],
    );
    assert!(out.is_err(), "NCCL accepted two counts for a world of one");
    assert_eq!(dev.download(&recv).unwrap(), vec![0.0f32; 4]);
}

/// Protects NCCL's refusal of `u8` reductions over more than one rank (NCCL sums `u8` modulo
/// 256 where every other backend saturates): on two and on three ranks of one process, every
/// rank gets `Err` and its buffer is unchanged. Needs two devices (tools/cuda-emu with
/// CUDA_EMU_DEVICES=3 has three).
#[test]
fn nccl_refuses_u8_reductions_over_two_or_more_ranks() {
    use ragged::cuda::nccl::NcclComm;
    let Some(devs) = two_or_more_devices() else {
        return;
    };
    for world in 2..=devs.len() {
        let comms = match NcclComm::from_devices(&devs[..world]) {
            Ok(c) => c,
            Err(e) => {
                println!("skipped: {e}");
                return;
            }
        };
        let outcomes = on_each_thread(&comms, |_, c| {
            let mut x = vec![200u8; 6];
            let err = c.all_reduce((&mut x[..]).into(), ReduceOp::Sum).is_err();
            (err, x)
        });
        for (rank, (err, x)) in outcomes.iter().enumerate() {
            assert!(*err, "world {world}, rank {rank}: u8 sum accepted: {x:?}");
            assert_eq!(x, &vec![200u8; 6], "world {world}, rank {rank}");
        }
    }
}

/// Protects the watchdog's polling pause, capped at 1 ms ("a finished collective is noticed
/// within about a millisecond"): a collective that finishes after 300 ms is noticed within
/// 100 ms of finishing (room for a loaded machine's scheduling), not after a pause that kept
/// doubling (the look after 300 ms would come at about 524 ms: 224 ms late).
#[test]
fn the_watchdog_notices_a_finished_collective_promptly() {
    use ragged::cuda::watchdog::{wait, Progress};
    let done_at = Duration::from_millis(300);
    let start = Instant::now();
    wait("all_reduce", 0, Duration::from_secs(30), || {
        if start.elapsed() >= done_at {
            Progress::Done
        } else {
            Progress::Pending
        }
    })
    .unwrap();
    let late = start.elapsed() - done_at;
    assert!(late < Duration::from_millis(100), "noticed {late:?} late");
}

/// Protects the rank order of the reductions over thread ranks (rank 0, 1, 2, … added left to
/// right, as the CPU thread backend): values whose sums are order-dependent in f32 (2³⁰ + 1
/// rounds to 2³⁰), in every arrangement over three ranks, in bf16 (widened, summed in f32,
/// rounded once) and f32, Sum and Avg. Sums of bf16 values of like magnitude (the conformance
/// suite's) are exact in f32 in any order, so only such spreads show the order.
#[test]
fn rank_reductions_on_one_gpu_add_in_rank_order() {
    use ragged::comm::threads::ThreadWorld;
    use ragged::cuda::collective::ViaDevice;
    use ragged::cuda::threads::ThreadDeviceComm;
    let Some(dev) = device() else { return };
    let world = 3;
    let perms = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    let terms = [2f32.powi(30), 1.0, -(2f32.powi(30))];
    let mine = |rank: usize| -> Vec<f32> {
        (0..4 * perms.len() * world)
            .map(|i| {
                terms[perms[i % perms.len()][rank]] * [1.0, 0.5, -2.0, 4.0][i / perms.len() % 4]
            })
            .collect()
    };
    let run = |c: &dyn Communicator| -> ragged::Result<Vec<u32>> {
        let mut out = Vec::new();
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let mut x = mine(c.rank());
            c.all_reduce((&mut x[..]).into(), op)?;
            out.extend(x.iter().map(|v| v.to_bits()));
            let mut b: Vec<bf16> = mine(c.rank()).into_iter().map(bf16::from_f32).collect();
            c.all_reduce((&mut b[..]).into(), op)?;
            out.extend(b.iter().map(|v| u32::from(v.to_bits())));
        }
        Ok(out)
    };
    let cpu = ThreadWorld::run(world, |c| run(c)).unwrap();
    let gpu = ThreadDeviceComm::run(dev, world, |c| run(&ViaDevice::new(c, c.device()))).unwrap();
    assert_eq!(gpu, cpu);
}
