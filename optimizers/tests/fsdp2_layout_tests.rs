//! Which optimizers the FSDP2-style layout (`ragged::fsdp::fsdp2`: dim 0 split into
//! `⌈rows/V⌉`-row chunks per rank) can hold, on the real layout's local shards. AdamW and Muon
//! hold any split (element-wise; Muon gathers split matrices to a root). 8-bit Adam needs every
//! chunk edge on a 32-row tile edge, Shampoo every chunk edge on a `max_preconditioner_dim`-row
//! block edge; where the layout breaks that, `init` must say which optimizer, tensor, rows and
//! why, instead of a bare "cuts a block".

use ragged::fsdp::fsdp2::Fsdp2Unit;
use ragged::model::{DType, TensorSpec, Unit};
use ragged::optim::{LocalShard, Optimizer};
use ragged_optimizers::{Adam8bit, Adam8bitConfig, Shampoo, ShampooConfig};

/// Rank `rank`'s FSDP2-style shard of one tensor of `shape` on `world` ranks.
fn fsdp2_shard(shape: &[usize], world: usize, rank: usize) -> LocalShard {
    let spec = TensorSpec::new("layers.0.w", shape, DType::F32).unwrap();
    let unit = Unit {
        name: "unit".into(),
        tensors: vec![&spec],
    };
    Fsdp2Unit::new(&unit, world, rank)
        .unwrap()
        .local_shard(&unit)
}

#[test]
fn adam8bit_holds_fsdp2_chunks_on_tile_edges_and_names_the_tile_otherwise() {
    let opt = Adam8bit::new(Adam8bitConfig::default()).unwrap();
    // 96 rows on 3 ranks: 32-row chunks, every edge on a tile edge.
    for rank in 0..3 {
        opt.init(&fsdp2_shard(&[96, 64], 3, rank)).unwrap();
    }
    // 64 rows on 3 ranks: 22-row chunks; rank 0's chunk ends at row 22, inside rows 0..32.
    let err = opt
        .init(&fsdp2_shard(&[64, 64], 3, 0))
        .unwrap_err()
        .to_string();
    for want in [
        "8-bit Adam",
        "rank 0",
        "layers.0.w",
        "row 22",
        "rows 0..32",
        "FSDP2",
    ] {
        assert!(err.contains(want), "{err:?} lacks {want:?}");
    }
}

#[test]
fn shampoo_on_fsdp2_chunks_names_the_block_a_chunk_cuts() {
    let opt = Shampoo::new(ShampooConfig::default()).unwrap();
    let d = opt.config().max_preconditioner_dim;
    // One rank holds the whole tensor: nothing is cut.
    opt.init(&fsdp2_shard(&[64, 48], 1, 0)).unwrap();
    // Two ranks: 32-row chunks of a 64-row tensor, which is one Shampoo block (64 ≤ d).
    assert!(64 <= d, "the test needs a tensor of at most d = {d} rows");
    let err = opt
        .init(&fsdp2_shard(&[64, 48], 2, 1))
        .unwrap_err()
        .to_string();
    for want in [
        "Shampoo",
        "rank 1",
        "layers.0.w",
        "row 32",
        "rows 0..64",
        "FSDP2",
    ] {
        assert!(err.contains(want), "{err:?} lacks {want:?}");
    }
}
