//! 8-bit Adam's device backend: one warp per 256-element scale block (`kernels/adam8bit.cu`),
//! the fallback pieces through the AdamW kernel. Where each scale block lies comes from
//! [`Adam8bit`]'s own layout and row-block walk (the host step's), as runs of equal row blocks,
//! so the device state has exactly the host state's layout and the step is bitwise equal to the
//! host step. The quantizer is the AVX-512 kernel's octave index
//! ([`crate::kernels::octave_index`]), read from shared memory.

use ragged::cuda::cudarc::driver::{CudaFunction, CudaViewMut, LaunchConfig, PushKernelArg};
use ragged::cuda::{guarded, Device, ADAM8BIT, ADAMW};
use ragged::optim::LocalShard;
use ragged::storage::View;
use ragged::{Error, Result};

use super::{device_array, device_view, launch_adamw, ADAMW_STEP};
use crate::adam8bit::{Adam8bit, Adam8bitState, PieceState, SCALE_BLOCK};
use crate::common::{check_len, AdamScale, MomentCoeffs};
use crate::kernels::octave_index::{OctaveIndex, BUCKETS, SLOTS};
use crate::quant::{CodeBook, MAP_LEN, SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE};

/// Entry point of `kernels/adam8bit.cu`.
pub const ADAM8BIT_BLOCKS: &str = "adam8bit_blocks";

/// Threads per thread block tried, largest first: each warp steps one scale block per pass.
/// The kernel's `__launch_bounds__` allows the first.
const BLOCK_SIZES: [u32; 2] = [256, 128];

/// The kernel's table layout per map (`T_*` in `kernels/adam8bit.cu`): the map, the
/// thresholds, the bucket bases as bytes, the octave slots, a header, padding.
const T_MAP: usize = 0;
const T_THRESH: usize = 256;
const T_BASE: usize = 512;
const T_SLOT: usize = 640;
const T_HEADER: usize = 672;
const T_WORDS: usize = 676;

/// Words per run of equal row blocks (`S_WORDS` in the kernel).
const S_WORDS: usize = 6;

/// Both maps' quantizer tables as the kernel reads them (`2 × T_WORDS` words, m's then v's),
/// built once per optimizer.
#[derive(Clone, PartialEq)]
pub(crate) struct QuantizerTables(Box<[u32]>);

impl std::fmt::Debug for QuantizerTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QuantizerTables({} words)", self.0.len())
    }
}

impl QuantizerTables {
    /// The tables of both maps; `Err` when a map's thresholds do not fit the octave index
    /// (both dynamic maps do).
    pub(crate) fn of(books: [(&CodeBook, &OctaveIndex); 2]) -> Self {
        let mut words = Vec::with_capacity(2 * T_WORDS);
        for (book, index) in books {
            words.extend(table_words(book.map(), index));
        }
        QuantizerTables(words.into())
    }
}

/// One map's `T_WORDS` words.
fn table_words(map: &[f32; MAP_LEN], index: &OctaveIndex) -> [u32; T_WORDS] {
    const _: () = assert!(BUCKETS == 4 * (T_SLOT - T_BASE) && SLOTS == T_HEADER - T_SLOT);
    let mut w = [0u32; T_WORDS];
    for (k, x) in map.iter().enumerate() {
        w[T_MAP + k] = x.to_bits();
    }
    for (k, x) in index.thresholds.iter().enumerate() {
        w[T_THRESH + k] = x.to_bits();
    }
    for (k, b) in index.base.chunks_exact(4).enumerate() {
        w[T_BASE + k] = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    for k in 0..SLOTS {
        w[T_SLOT + k] = u32::from(index.shift[k]) | u32::from(index.add[k] as u16) << 16;
    }
    w[T_HEADER] = u32::from(index.e_base) | u32::from(index.signed) << 16;
    w
}

/// `x` as a `u32` kernel argument, or a clear error.
fn word(op: &'static str, what: &str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| Error::BadInput {
        op,
        what: format!("{what} {x}"),
        reason: "the device step indexes scale blocks and row blocks with 32 bits".into(),
    })
}

impl Adam8bit {
    /// The scale blocks of `shard` as the kernel reads them: runs of equal row blocks in the
    /// host step's walk (piece, row block), `S_WORDS` words each (first element in the local
    /// shard as two words, row-block length, scale blocks per row block, first scale, decay
    /// factor bits: `1` when not decayed, `p·1 = p` exactly). Scale `k` of the walk is
    /// `scale_*[k]` of the state.
    fn segments(&self, shard: &LocalShard, layout: &[PieceState]) -> Result<(Vec<u32>, usize)> {
        const OP: &str = "Adam8bit::step (device)";
        let (mut words, mut scales) = (Vec::new(), 0usize);
        for (piece, place) in shard.pieces.iter().zip(layout) {
            let PieceState::Tiled {
                tiling,
                first_scale,
            } = *place
            else {
                continue;
            };
            if first_scale != scales {
                return Err(Error::InvalidShard {
                    op: OP,
                    reason: format!("scale order: {first_scale} != {scales}"),
                });
            }
            let decay = self
                .adamw
                .decay_for(&shard.params[piece.param])
                .unwrap_or(1.0);
            // (first element, row-block length, row blocks) of the run being built.
            let mut run: Option<(usize, usize, usize)> = None;
            let mut push = |(at, len, n): (usize, usize, usize)| -> Result<()> {
                let per = len.div_ceil(SCALE_BLOCK);
                words.extend([
                    at as u32,
                    (at as u64 >> 32) as u32,
                    word(OP, "row-block length", len)?,
                    word(OP, "scale blocks per row block", per)?,
                    word(OP, "scale block", scales)?,
                    decay.to_bits(),
                ]);
                scales += n * per;
                Ok(())
            };
            let mut at = piece.offset;
            for (_, len) in tiling.row_blocks(piece.range.clone()) {
                run = match run {
                    Some((start, l, n)) if l == len => Some((start, l, n + 1)),
                    done => {
                        done.map(&mut push).transpose()?;
                        Some((at, len, 1))
                    }
                };
                at += len;
            }
            run.map(&mut push).transpose()?;
        }
        Ok((words, scales))
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

    if scales == 0 {
        return Ok(());
    }
    // Scale blocks: one warp each; the tables and the runs in one upload.
    let (runs, walked) = opt.segments(shard, layout)?;
    check_len(OP, "scale blocks", walked, scales)?;
    let n_runs = word(OP, "row-block runs", runs.len() / S_WORDS)?;
    let n_scales = word(OP, "scale blocks", scales)?;
    let tables = dev.upload(&[&opt.device_tables.0[..], &runs].concat())?;
    let f = dev.function(&ADAM8BIT, ADAM8BIT_BLOCKS)?;
    let cfg = launch_shape(dev, &f, scales)?;
    let (quantizer, runs) = (tables.slice(..2 * T_WORDS), tables.slice(2 * T_WORDS..));
    let (mz, vz) = (SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE);
    // SAFETY: the arguments follow `adam8bit_blocks`' signature in order and type; the
    // buffers have the lengths `checked_layout` verified (one scale per block of the walk,
    // checked against it above), and every run's scale blocks lie inside the local shard
    // (the host step's walk of the pieces).
    guarded(OP, || unsafe {
        dev.stream()
            .launch_builder(&f)
            .arg(&mut *params)
            .arg(&grads)
            .arg(&mut *m)
            .arg(&mut *v)
            .arg(&mut *scale_m)
            .arg(&mut *scale_v)
            .arg(&quantizer)
            .arg(&runs)
            .arg(&n_runs)
            .arg(&n_scales)
            .arg(&mo.lerp_weight)
            .arg(&mo.beta2)
            .arg(&mo.one_minus_beta2)
            .arg(&s.folded_neg_step_size)
            .arg(&s.folded_eps)
            .arg(&mz)
            .arg(&vz)
            .launch(cfg)
    })?;
    Ok(())
}

/// The launch for `scales` scale blocks (one warp each): the block size of [`BLOCK_SIZES`]
/// under which the most warps are resident at once (the kernel's registers decide: at 72
/// registers a thread, 24 warps a multiprocessor in blocks of 256, 28 in blocks of 128), and
/// at most as many blocks as are resident at once, so every block is resident from the start
/// and strides over the rest: no last partial wave of blocks that start late.
fn launch_shape(dev: &Device, f: &CudaFunction, scales: usize) -> Result<LaunchConfig> {
    const OP: &str = "Adam8bit::step (device)";
    let mut best = (0, BLOCK_SIZES[0], 1);
    for threads in BLOCK_SIZES {
        let resident = guarded(OP, || {
            f.occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
        })?
        .max(1);
        let warps = resident * threads / 32;
        if warps > best.0 {
            best = (warps, threads, resident);
        }
    }
    let (_, threads, resident) = best;
    let most = dev.multiprocessors()? * resident as usize;
    let blocks = scales.div_ceil(threads as usize / 32).clamp(1, most);
    Ok(LaunchConfig {
        grid_dim: (word(OP, "thread blocks", blocks)?, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}
