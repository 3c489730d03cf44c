//! 8-bit Adam on the device: one thread block per 32×32 tile (`kernels/adam8bit.cu`), the
//! fallback pieces through the AdamW kernel. The tiles, their order and the fallback offsets
//! come from [`Adam8bit`]'s own layout (the CPU step's), so the device state has exactly the
//! CPU state's layout and the step is bitwise equal to the CPU step.

use ragged::cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use ragged::cuda::{guarded, Device, ADAM8BIT, ADAMW};
use ragged::optim::LocalShard;
use ragged::{Error, Result};

use super::{launch_adamw, ADAMW_STEP};
use crate::adam8bit::{Adam8bit, Adam8bitState, PieceState, StateLens, TILE};
use crate::common::{check_len, check_shard, next_step, AdamScale, MomentCoeffs};
use crate::quant::{SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE};

/// Entry point of `kernels/adam8bit.cu`.
pub const ADAM8BIT_TILES: &str = "adam8bit_tiles";

/// Threads per tile block (the kernel's `THREADS`).
const TILE_THREADS: u32 = 256;

/// [`Adam8bitState`] in device memory, field for field.
pub struct DeviceAdam8bitState {
    pub step: u64,
    pub m: CudaSlice<u8>,
    pub v: CudaSlice<u8>,
    pub absmax_m: CudaSlice<f32>,
    pub absmax_v: CudaSlice<f32>,
    pub m32: CudaSlice<f32>,
    pub v32: CudaSlice<f32>,
}

impl DeviceAdam8bitState {
    /// A device copy of a host state.
    pub fn upload(dev: &Device, s: &Adam8bitState) -> Result<Self> {
        Ok(DeviceAdam8bitState {
            step: s.step,
            m: dev.upload(&s.m)?,
            v: dev.upload(&s.v)?,
            absmax_m: dev.upload(&s.absmax_m)?,
            absmax_v: dev.upload(&s.absmax_v)?,
            m32: dev.upload(&s.m32)?,
            v32: dev.upload(&s.v32)?,
        })
    }

    /// A host copy (for checkpoints and tests).
    pub fn download(&self, dev: &Device) -> Result<Adam8bitState> {
        Ok(Adam8bitState {
            step: self.step,
            m: dev.download(&self.m)?,
            v: dev.download(&self.v)?,
            absmax_m: dev.download(&self.absmax_m)?,
            absmax_v: dev.download(&self.absmax_v)?,
            m32: dev.download(&self.m32)?,
            v32: dev.download(&self.v32)?,
        })
    }
}

/// The kernel's per-tile table, in local tile order (the CPU's `absmax` order).
#[derive(Debug, Default, PartialEq)]
pub struct TileTable {
    /// Local-shard element of the tile's first element.
    pub off: Vec<u64>,
    /// Rows in the tile (32, or fewer in a matrix's last row block).
    pub rows: Vec<u32>,
    /// Elements between the tile's rows (the matrix's `cols`).
    pub stride: Vec<u32>,
    /// The decay factor of the tile's parameter (`1` when not decayed: `p·1 = p` exactly).
    pub decay: Vec<f32>,
}

impl Adam8bit {
    /// The tile table of `shard`: the CPU step's walk (piece, row block, column tile), so
    /// tile `k` of the table is `absmax_*[k]` of the state.
    pub fn tile_table(&self, shard: &LocalShard) -> Result<TileTable> {
        const OP: &str = "Adam8bit::tile_table";
        let (layout, tiles, _) = self.layout(OP, shard)?;
        let mut t = TileTable::default();
        for (piece, place) in shard.pieces.iter().zip(&layout) {
            let PieceState::Tiled { tiling, first_tile } = *place else {
                continue;
            };
            if first_tile != t.off.len() {
                return Err(Error::InvalidShard {
                    op: OP,
                    reason: format!("tile order: {first_tile} != {}", t.off.len()),
                });
            }
            let decay = self
                .adamw
                .decay_for(&shard.params[piece.param])
                .unwrap_or(1.0);
            let cols = u32::try_from(tiling.cols).map_err(|_| Error::InvalidShape {
                op: OP,
                shape: shard.params[piece.param].shape.clone(),
                reason: "rows longer than u32::MAX elements".into(),
            })?;
            let (mut at, mut elem) = (0usize, piece.range.start);
            while elem < piece.range.end {
                let in_matrix = (elem / tiling.cols) % tiling.rows;
                let nrows = TILE.min(tiling.rows - in_matrix);
                for j in 0..tiling.tiles_per_row_block() {
                    t.off.push((piece.offset + at + j * TILE) as u64);
                    t.rows.push(nrows as u32);
                    t.stride.push(cols);
                    t.decay.push(decay);
                }
                at += nrows * tiling.cols;
                elem += nrows * tiling.cols;
            }
        }
        check_len(OP, "tile table", t.off.len(), tiles)?;
        Ok(t)
    }

    /// Zero device state for `shard`, laid out as [`Optimizer::init`](ragged::optim::Optimizer::init)'s.
    pub fn init_cuda(&self, dev: &Device, shard: &LocalShard) -> Result<DeviceAdam8bitState> {
        use ragged::optim::Optimizer;
        check_shard("Adam8bit::init_cuda", shard)?;
        DeviceAdam8bitState::upload(dev, &self.init(shard)?)
    }

    /// [`Optimizer::step`](ragged::optim::Optimizer::step) on device buffers: one launch for
    /// every tile of the shard, one AdamW launch per fallback piece. Bitwise equal to the CPU
    /// step. The tile table and the two maps (a few KiB) are uploaded each call.
    pub fn step_cuda(
        &self,
        dev: &Device,
        state: &mut DeviceAdam8bitState,
        shard: &LocalShard,
        params: &mut CudaViewMut<'_, f32>,
        grads: &CudaView<'_, f32>,
    ) -> Result<()> {
        const OP: &str = "Adam8bit::step_cuda";
        let lens = StateLens {
            params: params.len(),
            grads: grads.len(),
            codes: [state.m.len(), state.v.len()],
            absmax: [state.absmax_m.len(), state.absmax_v.len()],
            fp32: [state.m32.len(), state.v32.len()],
        };
        let (layout, tiles) = self.checked_layout(OP, shard, &lens)?;
        let t = next_step(OP, state.step)?;
        let c = &self.config().adam;
        let mo = MomentCoeffs::new(c.beta1, c.beta2);
        let s = AdamScale::new(c.lr, c.beta1, c.beta2, c.eps, t);

        // Fallback pieces: AdamW on their f32 moments.
        let adamw = dev.function(&ADAMW, ADAMW_STEP)?;
        for (piece, place) in shard.pieces.iter().zip(&layout) {
            if let PieceState::Fallback { at } = *place {
                let r = piece.offset..piece.offset + piece.range.len();
                let sr = at..at + piece.range.len();
                launch_adamw(
                    dev,
                    &adamw,
                    &mut params.slice_mut(r.clone()),
                    &grads.slice(r),
                    &mut state.m32.slice_mut(sr.clone()),
                    &mut state.v32.slice_mut(sr),
                    self.adamw.decay_for(&shard.params[piece.param]),
                    &mo,
                    &s,
                )?;
            }
        }

        // Tiles: one block each.
        if tiles > 0 {
            let table = self.tile_table(shard)?;
            let (off, rows) = (dev.upload(&table.off)?, dev.upload(&table.rows)?);
            let (stride, decay) = (dev.upload(&table.stride)?, dev.upload(&table.decay)?);
            let (qm, qv) = (
                dev.upload(self.book_m.map())?,
                dev.upload(self.book_v.map())?,
            );
            let f = dev.function(&ADAM8BIT, ADAM8BIT_TILES)?;
            let blocks = u32::try_from(tiles).map_err(|_| Error::BadInput {
                op: OP,
                what: format!("{tiles} tiles"),
                reason: "more than u32::MAX tiles in one shard".into(),
            })?;
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (TILE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let (mz, vz) = (SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE);
            guarded(OP, || unsafe {
                dev.stream()
                    .launch_builder(&f)
                    .arg(&mut *params)
                    .arg(grads)
                    .arg(&mut state.m)
                    .arg(&mut state.v)
                    .arg(&mut state.absmax_m)
                    .arg(&mut state.absmax_v)
                    .arg(&qm)
                    .arg(&qv)
                    .arg(&off)
                    .arg(&rows)
                    .arg(&stride)
                    .arg(&decay)
                    .arg(&mo.lerp_weight)
                    .arg(&mo.beta2)
                    .arg(&mo.one_minus_beta2)
                    .arg(&s.neg_step_size)
                    .arg(&s.bc2_sqrt)
                    .arg(&s.eps)
                    .arg(&mz)
                    .arg(&vz)
                    .launch(cfg)
            })?;
        }
        state.step = t;
        Ok(())
    }
}
