//! Device memory the collectives allocate (feature `cuda`), as tools/cuda-emu's driver counts
//! it. A binary of its own: the count is the device's, so no other test may use the devices
//! while one runs (cargo runs a binary's tests on parallel threads; these take turns, `alone`).
//! Under a real driver, which has no count, each test says so and checks nothing more; without
//! a GPU it prints `skipped: <reason>`.
#![cfg(feature = "cuda")]

use ragged::comm::conformance::{segment_spans, SLICE};
use ragged::comm::{Communicator, ReduceOp};
use ragged::cuda::threads::ThreadDeviceComm;
use ragged::cuda::Device;

#[path = "common/cuda.rs"]
mod cuda;
use cuda::{
    allocated_by_every_rank, alone, device, nccl_ranks_of_one_process, on_each_thread, segments_of,
    values, zeroed_parts, Allocated,
};

/// Gathers into device segments allocate nothing (each rank's shard goes straight into the
/// peers' segments): thread ranks on one GPU (worlds 1–4) and NCCL ranks of one process.
#[test]
fn device_segment_gathers_allocate_no_device_memory() {
    expect_none_on_every_backend("gathers", gather_allocates);
}

/// Reduce-scatters and all-reduces after the first allocate nothing (GPU thread ranks keep
/// their reduction kernel's table of source addresses, NCCL its descriptor buffers and its
/// barrier's flag): thread ranks on one GPU (worlds 1–4) and NCCL ranks of one process.
#[test]
fn device_reductions_after_the_first_allocate_no_device_memory() {
    expect_none_on_every_backend("reductions", reductions_allocate);
}

/// What `calls` of every rank allocate (see [`gather_allocates`]; `counting` is whether this
/// rank reads the count): nothing on thread ranks on one GPU (worlds 1–4, rank 0 counting)
/// nor on the NCCL ranks of one process (each counting its own device). Holds `alone`.
fn expect_none_on_every_backend(
    what: &str,
    calls: impl Fn(&dyn Communicator, &Device, bool) -> ragged::Result<Option<Allocated>> + Sync,
) {
    let _alone = alone();
    let Some(dev) = device() else { return };
    for world in [1, 2, 3, 4] {
        let allocated =
            ThreadDeviceComm::run(dev.clone(), world, |c| calls(c, c.device(), c.rank() == 0))
                .unwrap();
        expect_none(
            allocated[0],
            &format!("{what} of a world of {world} thread ranks"),
        );
    }
    let Some(comms) = nccl_ranks_of_one_process() else {
        return;
    };
    let allocated = on_each_thread(&comms, |_, c| calls(c, c.device(), true).unwrap());
    for (rank, allocated) in allocated.into_iter().enumerate() {
        expect_none(allocated, &format!("NCCL rank {rank}'s {what}"));
    }
}

/// Asserts that nothing was allocated, or says that the driver counts nothing.
fn expect_none(allocated: Option<Allocated>, what: &str) {
    match allocated {
        Some(a) => assert_eq!(a, Allocated::NONE, "{what}: device allocations"),
        None => println!("not under cuda-emu: {what} not counted"),
    }
}

/// The device memory an all-gather into device segments allocates on every rank
/// ([`allocated_by_every_rank`]).
fn gather_allocates(
    c: &dyn Communicator,
    dev: &Device,
    counting: bool,
) -> ragged::Result<Option<Allocated>> {
    let spans = segment_spans(c.world_size());
    let send = dev.upload(&values(SLICE, c.rank() as u32 + 5))?;
    let mut parts = zeroed_parts(dev, &spans)?;
    let mut segments = segments_of(&spans, &mut parts);
    allocated_by_every_rank(c, dev, counting, || {
        c.all_gather_segments(send.slice(..).into(), &mut segments)
            .map(drop)
    })
}

/// The device memory a reduce-scatter (out of place and in place) and an all-reduce of device
/// buffers allocate on every rank after one of each has run ([`allocated_by_every_rank`]).
fn reductions_allocate(
    c: &dyn Communicator,
    dev: &Device,
    counting: bool,
) -> ragged::Result<Option<Allocated>> {
    let world = c.world_size();
    let mut full = dev.upload(&values(world * SLICE, c.rank() as u32 + 9))?;
    let mut out = dev.upload(&[0f32; SLICE])?;
    let mut reduce = || -> ragged::Result<()> {
        let (send, recv) = (full.slice_mut(..).into(), out.slice_mut(..).into());
        c.reduce_scatter(send, recv, ReduceOp::Sum)?;
        c.reduce_scatter_in_place(full.slice_mut(..).into(), ReduceOp::Sum)?;
        c.all_reduce(full.slice_mut(..).into(), ReduceOp::Avg)
    };
    reduce()?;
    allocated_by_every_rank(c, dev, counting, reduce)
}
