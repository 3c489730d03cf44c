//! 8-bit Adam's device backend: one thread block per 256-element scale block
//! (`kernels/adam8bit.cu`), the fallback pieces through the AdamW kernel. The scale blocks,
//! their order and the fallback offsets come from [`Adam8bit`]'s own layout and row-block walk
//! (the host step's), so the device state has exactly the host state's layout and the step is
//! bitwise equal to the host step.

use ragged::cuda::cudarc::driver::{CudaViewMut, LaunchConfig, PushKernelArg};
use ragged::cuda::{guarded, ADAM8BIT, ADAMW};
use ragged::optim::LocalShard;
use ragged::storage::View;
use ragged::{Error, Result};

use super::{device_array, device_view, launch_adamw, ADAMW_STEP};
use crate::adam8bit::{Adam8bit, Adam8bitState, PieceState, SCALE_BLOCK};
use crate::common::{check_len, AdamScale, MomentCoeffs};
use crate::quant::{SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE};

/// Entry point of `kernels/adam8bit.cu`.
pub const ADAM8BIT_BLOCKS: &str = "adam8bit_blocks";

/// Threads per scale block (the kernel's `BLOCK`: one per element).
const BLOCK_THREADS: u32 = SCALE_BLOCK as u32;

/// The kernel's per-block table, in local scale order (the CPU's `scale_*` order).
#[derive(Debug, Default, PartialEq)]
pub struct BlockTable {
    /// Local-shard element of the block's first element.
    pub off: Vec<u64>,
    /// Elements in the block (256, or fewer at the end of a short row block).
    pub len: Vec<u32>,
    /// The decay factor of the block's parameter (`1` when not decayed: `p·1 = p` exactly).
    pub decay: Vec<f32>,
}

impl Adam8bit {
    /// The scale-block table of `shard`: the CPU step's walk (piece, row block, block), so
    /// block `k` of the table is `scale_*[k]` of the state.
    pub fn block_table(&self, shard: &LocalShard) -> Result<BlockTable> {
        const OP: &str = "Adam8bit::block_table";
        let (layout, scales, _) = self.layout(OP, shard)?;
        let mut t = BlockTable::default();
        for (piece, place) in shard.pieces.iter().zip(&layout) {
            let PieceState::Tiled {
                tiling,
                first_scale,
            } = *place
            else {
                continue;
            };
            if first_scale != t.off.len() {
                return Err(Error::InvalidShard {
                    op: OP,
                    reason: format!("scale order: {first_scale} != {}", t.off.len()),
                });
            }
            let decay = self
                .adamw
                .decay_for(&shard.params[piece.param])
                .unwrap_or(1.0);
            let mut at = 0usize;
            for (_, len) in tiling.row_blocks(piece.range.clone()) {
                for start in (0..len).step_by(SCALE_BLOCK) {
                    t.off.push((piece.offset + at + start) as u64);
                    t.len.push(SCALE_BLOCK.min(len - start) as u32);
                    t.decay.push(decay);
                }
                at += len;
            }
        }
        check_len(OP, "block table", t.off.len(), scales)?;
        Ok(t)
    }
}

/// 8-bit Adam's step on device memory: one launch for every scale block of the shard, one
/// AdamW launch per fallback piece; bitwise the host step. The block table and the two maps
/// (a few KiB) are uploaded each call. `layout` comes from the host step's checks, which also
/// checked the scale arrays against it (one block per scale).
pub(crate) fn step(
    opt: &Adam8bit,
    state: &mut Adam8bitState,
    shard: &LocalShard,
    layout: &[PieceState],
    params: &mut CudaViewMut<'_, f32>,
    grads: View<'_, f32>,
    t: u64,
) -> Result<()> {
    const OP: &str = "Adam8bit::step (device)";
    let grads = device_view(OP, grads)?;
    let (dev, m) = device_array(OP, &mut state.m)?;
    let (_, v) = device_array(OP, &mut state.v)?;
    let (_, scale_m) = device_array(OP, &mut state.scale_m)?;
    let (_, scale_v) = device_array(OP, &mut state.scale_v)?;
    let scales = scale_m.len();
    let (_, m32) = device_array(OP, &mut state.m32)?;
    let (_, v32) = device_array(OP, &mut state.v32)?;
    let c = &opt.config().adam;
    let mo = MomentCoeffs::new(c.beta1, c.beta2);
    let s = AdamScale::new(c.lr, c.beta1, c.beta2, c.eps, t);
    let dev = &*dev;
    // Fallback pieces: AdamW on their f32 moments, at their role's rates (frozen: not
    // stepped). The scale-block kernel takes one learning rate for every block.
    let adamw = dev.function(&ADAMW, ADAMW_STEP)?;
    for (piece, place) in shard.pieces.iter().zip(layout) {
        let meta = &shard.params[piece.param];
        if matches!(place, PieceState::Tiled { .. })
            && opt.adamw.rates_for(meta).map(|r| r.0) != Some(c.lr)
        {
            return Err(Error::BadInput {
                op: OP,
                what: meta.name.clone(),
                reason: "the device step runs every 8-bit block at one learning rate; a \
                         role lr_scale other than 1 on 8-bit parameters needs the host step"
                    .into(),
            });
        }
        if let PieceState::Fallback { at } = *place {
            // The host step's run (none when frozen).
            let Some(run) = opt.adamw.run_of(shard, piece, t) else {
                continue;
            };
            let r = run.range.clone();
            let sr = at..at + piece.range.len();
            launch_adamw(
                dev,
                &adamw,
                &mut params.slice_mut(r.clone()),
                &grads.slice(r),
                &mut m32.slice_mut(sr.clone()),
                &mut v32.slice_mut(sr),
                &run,
                &mo,
            )?;
        }
    }

    // Scale blocks: one thread block each.
    if scales > 0 {
        let table = opt.block_table(shard)?;
        let (off, len) = (dev.upload(&table.off)?, dev.upload(&table.len)?);
        let decay = dev.upload(&table.decay)?;
        let (qm, qv) = (dev.upload(opt.book_m.map())?, dev.upload(opt.book_v.map())?);
        let f = dev.function(&ADAM8BIT, ADAM8BIT_BLOCKS)?;
        let blocks = u32::try_from(scales).map_err(|_| Error::BadInput {
            op: OP,
            what: format!("{scales} scale blocks"),
            reason: "more than u32::MAX scale blocks in one shard".into(),
        })?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (mz, vz) = (SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE);
        // SAFETY: the arguments follow `adam8bit_blocks`' signature in order and type; the
        // buffers have the lengths `checked_layout` verified, and every table block
        // (offset + length, at most 256 = the threads) lies inside the local shard.
        guarded(OP, || unsafe {
            dev.stream()
                .launch_builder(&f)
                .arg(&mut *params)
                .arg(&grads)
                .arg(&mut *m)
                .arg(&mut *v)
                .arg(&mut *scale_m)
                .arg(&mut *scale_v)
                .arg(&qm)
                .arg(&qv)
                .arg(&off)
                .arg(&len)
                .arg(&decay)
                .arg(&mo.lerp_weight)
                .arg(&mo.beta2)
                .arg(&mo.one_minus_beta2)
                .arg(&s.folded_neg_step_size)
                .arg(&s.folded_eps)
                .arg(&mz)
                .arg(&vz)
                .launch(cfg)
        })?;
    }
    Ok(())
}
