//! 8-bit Adam's device backend: one warp per 256-element scale block (`kernels/adam8bit.cu`),
//! the fallback pieces through the AdamW kernel. Where each scale block lies comes from
//! [`Adam8bit`]'s own layout and row-block walk (the host step's), as runs of equal row blocks,
//! so the device state has exactly the host state's layout and the step is bitwise equal to the
//! host step. The quantizer is [`CodeBook::quantize`]'s own bucket index (one table word per
//! bucket), read from shared memory in the form `QuantizerTables` gives it.

use std::sync::Arc;

use ragged::cuda::cudarc::driver::{
    CudaFunction, CudaSlice, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use ragged::cuda::{guarded, Device, ADAM8BIT, ADAMW};
use ragged::optim::LocalShard;
use ragged::storage::View;
use ragged::{Error, Result};

use super::{device_array, device_view, launch_adamw, ADAMW_STEP};
use crate::adam8bit::{Adam8bit, Adam8bitState, PieceState, SCALE_BLOCK};
use crate::common::{check_len, AdamScale, MomentCoeffs};
use crate::quant::{CodeBook, BASE_SHIFT, MAP_LEN, SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE};

/// Entry point of `kernels/adam8bit.cu`.
pub const ADAM8BIT_BLOCKS: &str = "adam8bit_blocks";

/// Threads per thread block tried, largest first: each warp steps one scale block per pass.
/// The kernel's `__launch_bounds__` allows the first.
const BLOCK_SIZES: [u32; 2] = [256, 128];

/// Words of the kernel's quantizer table (`TABLE_WORDS` in `kernels/adam8bit.cu`, which
/// sizes its shared memory by it): the two maps, then their bucket words; the two dynamic
/// maps' tables fill it exactly (1600 signed buckets per sign, 3328 unsigned).
const TABLE_WORDS: usize = 7040;

/// Word offsets of the maps in the table (`T_MAP_M`, `T_MAP_V`).
const T_MAP_M: usize = 0;
const T_MAP_V: usize = MAP_LEN;

/// Words per run of equal row blocks (`S_WORDS` in the kernel).
const S_WORDS: usize = 6;

/// One map's bucket index as the kernel reads it (`MapIndex` in `kernels/adam8bit.cu`, field
/// for field): the bucket of `x` is `min(max((x bits & abs_mask) >> shift as i32, lo) − lo,
/// last)`, plus `half` for a negative `x`; its word plus the low bits `(x bits ^ sign mask) &
/// low_mask` has the code in its top byte.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct MapIndex {
    /// Word offset of the bucket words in the table.
    buckets: u32,
    /// `0x7fff_ffff`; `0xffff_ffff` where every negative `x` shares bucket 0's code, so the
    /// table has no negative half: shifted as a signed integer, a negative `x` clamps to 0.
    abs_mask: u32,
    shift: u32,
    lo: i32,
    last: i32,
    /// Words from a bucket to its negative twin (0: no negative half).
    half: u32,
    low_mask: u32,
}

// SAFETY: `MapIndex` is `repr(C)` plain data (seven 4-byte integers, no padding), the layout
// of the kernel's `struct MapIndex`, so passing its bytes as a kernel argument is sound.
unsafe impl DeviceRepr for MapIndex {}

/// Both maps' quantizer as the kernel reads it: the table ([`TABLE_WORDS`] words: m's map,
/// v's map, m's bucket words, v's) and each map's [`MapIndex`], built once per optimizer.
#[derive(Clone, PartialEq)]
pub(crate) struct QuantizerTables {
    words: Box<[u32]>,
    m: MapIndex,
    v: MapIndex,
}

impl std::fmt::Debug for QuantizerTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantizerTables")
            .field("m", &self.m)
            .field("v", &self.v)
            .finish_non_exhaustive()
    }
}

/// A quantizer table on a device, with the words it holds.
struct ResidentTable {
    words: Box<[u32]>,
    table: CudaSlice<u32>,
}

/// [`Device::memo`]'s keys: the quantizer table on the device and the kernel's launch shape.
const TABLE_MEMO: &str = "adam8bit quantizer table";
const LAUNCH_MEMO: &str = "adam8bit launch shape";

impl QuantizerTables {
    /// The table on `dev`: uploaded at the first step there and kept, as every 8-bit Adam
    /// has the same one (made from the two dynamic maps, [`Adam8bit::new`]); a table of
    /// other words (compared, 28 KiB) is uploaded for its own step.
    fn on(&self, dev: &Device) -> Result<Arc<ResidentTable>> {
        let kept = dev.memo(TABLE_MEMO, |dev| self.upload(dev))?;
        if kept.words == self.words {
            Ok(kept)
        } else {
            self.upload(dev).map(Arc::new)
        }
    }

    fn upload(&self, dev: &Device) -> Result<ResidentTable> {
        let table = dev.upload(&self.words)?;
        // Complete before any stream reads it: thread ranks may share the device.
        dev.sync()?;
        Ok(ResidentTable {
            words: self.words.clone(),
            table,
        })
    }

    /// The tables of the maps of `m` and `v`; `Err` when they do not fit [`TABLE_WORDS`]
    /// (the two dynamic maps fill it).
    pub(crate) fn of(m: &CodeBook, v: &CodeBook) -> Result<Self> {
        let mut words = vec![0u32; 2 * MAP_LEN];
        for (at, book) in [(T_MAP_M, m), (T_MAP_V, v)] {
            for (w, x) in words[at..at + MAP_LEN].iter_mut().zip(book.map()) {
                *w = x.to_bits();
            }
        }
        let (m, v) = (bucket_words(m, &mut words), bucket_words(v, &mut words));
        if words.len() > TABLE_WORDS {
            return Err(Error::BadInput {
                op: "Adam8bit::new",
                what: "quantization maps".into(),
                reason: format!(
                    "their bucket indexes need {} table words, the CUDA kernel holds {TABLE_WORDS}",
                    words.len()
                ),
            });
        }
        words.resize(TABLE_WORDS, 0);
        Ok(QuantizerTables {
            words: words.into(),
            m,
            v,
        })
    }
}

/// Appends `book`'s bucket words to `words` in the kernel's form and returns their index.
/// `CodeBook`'s word `base << 24 | field` (code `base + [low ≥ field]`) becomes
/// `(base << 24) + 2²⁴ − field`, to which adding the low bits carries into the top byte
/// exactly when `low ≥ field` (`field ≤ 2^shift`, the low bits `< 2^shift ≤ 2²³`;
/// `base + 1 ≤ 255` wherever a threshold is inside, there being 256 codes). The negative
/// half is left out where it and bucket 0 all hold one word without a threshold (the
/// unsigned map).
fn bucket_words(book: &CodeBook, words: &mut Vec<u32>) -> MapIndex {
    let index = book.index();
    let shift = 23 - index.bits;
    let low_mask = (1u32 << shift) - 1;
    let (positive, negative) = index.table.split_at(index.buckets);
    let none = |w: u32| w & ((1 << BASE_SHIFT) - 1) == low_mask + 1;
    let shared_zero = none(positive[0]) && negative.iter().all(|&w| w == positive[0]);
    let kept = if shared_zero { positive } else { index.table };
    let at = words.len();
    words.extend(kept.iter().map(|&w| {
        let (base, field) = (w >> BASE_SHIFT, w & ((1 << BASE_SHIFT) - 1));
        (base << BASE_SHIFT).wrapping_add((1 << BASE_SHIFT) - field)
    }));
    MapIndex {
        buckets: at as u32,
        abs_mask: if shared_zero { u32::MAX } else { 0x7fff_ffff },
        shift,
        lo: (index.min_exp << index.bits) as i32,
        last: index.buckets as i32 - 1,
        half: if shared_zero { 0 } else { index.buckets as u32 },
        low_mask,
    }
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
/// AdamW launch per fallback piece; bitwise the host step. The runs of row blocks are
/// copied each call into a buffer the optimizer keeps, the quantizer table (27.5 KiB) and the
/// launch shape are kept per device ([`Device::memo`]). `layout` comes from the host step's
/// checks, which also checked the scale arrays against it (one block per scale).
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
    // Scale blocks: one warp each; the table uploaded once per device, the runs each step.
    let (runs, walked) = opt.segments(shard, layout)?;
    check_len(OP, "scale blocks", walked, scales)?;
    let n_runs = word(OP, "row-block runs", runs.len() / S_WORDS)?;
    let n_scales = word(OP, "scale blocks", scales)?;
    let quantizer = &opt.device_tables;
    let table = quantizer.on(dev)?;
    // Into a buffer the optimizer keeps between steps: a step allocates nothing after the
    // first.
    let mut kept = opt.device_runs.take();
    let runs_on_device = kept.upload(dev, &runs)?;
    let runs = runs_on_device.as_view();
    let f = dev.function(&ADAM8BIT, ADAM8BIT_BLOCKS)?;
    let cfg = launch_shape(dev, &f, scales)?;
    let (mz, vz) = (u32::from(SIGNED_ZERO_CODE), u32::from(UNSIGNED_ZERO_CODE));
    // SAFETY: the arguments follow `adam8bit_blocks`' signature in order and type (`MapIndex`
    // is the kernel's struct); the table has the TABLE_WORDS words the kernel reads, 16-byte
    // aligned at the start of its allocation; the buffers have the lengths `checked_layout`
    // verified (one scale per block of the walk, checked against it above), and every run's
    // scale blocks lie inside the local shard (the host step's walk of the pieces).
    guarded(OP, || unsafe {
        dev.stream()
            .launch_builder(&f)
            .arg(&mut *params)
            .arg(&grads)
            .arg(&mut *m)
            .arg(&mut *v)
            .arg(&mut *scale_m)
            .arg(&mut *scale_v)
            .arg(&table.table)
            .arg(&quantizer.m)
            .arg(&quantizer.v)
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
    opt.device_runs.put(kept);
    Ok(())
}

/// The kernel's block size and what the driver holds of it at once: threads per block,
/// resident warps per multiprocessor and resident blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Occupancy {
    threads: u32,
    warps: u32,
    blocks: u32,
}

/// The block size of [`BLOCK_SIZES`] under which the most warps of `f` are resident at once
/// (its registers decide: at 64 a thread, 32 warps a multiprocessor either way; at 72, 24 in
/// blocks of 256 and 28 in blocks of 128).
fn occupancy(f: &CudaFunction) -> Result<Occupancy> {
    const OP: &str = "Adam8bit::step (device)";
    let mut best = Occupancy {
        threads: BLOCK_SIZES[0],
        warps: 0,
        blocks: 1,
    };
    for threads in BLOCK_SIZES {
        let blocks = guarded(OP, || {
            f.occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
        })?
        .max(1);
        let warps = blocks * threads / 32;
        if warps > best.warps {
            best = Occupancy {
                threads,
                warps,
                blocks,
            };
        }
    }
    Ok(best)
}

/// The 8-bit kernel's launch shape on `dev` in words (for `ragged bench optim --device
/// cuda`): its block size, the registers the driver's compiler allotted it, resident warps.
pub(crate) fn launch_note(dev: &Device) -> Result<String> {
    let f = dev.function(&ADAM8BIT, ADAM8BIT_BLOCKS)?;
    let registers = guarded("Adam8bit launch note", || f.num_regs())?;
    let o = occupancy(&f)?;
    Ok(format!(
        "blocks of {}, {registers} registers, {} warps/SM",
        o.threads, o.warps
    ))
}

/// The launch for `scales` scale blocks (one warp each): blocks of [`occupancy`]'s size, and
/// at most as many as are resident at once (asked of the driver once per device), so every
/// block is resident from the start and strides over the rest: no last partial wave of
/// blocks that start late.
fn launch_shape(dev: &Device, f: &CudaFunction, scales: usize) -> Result<LaunchConfig> {
    const OP: &str = "Adam8bit::step (device)";
    let (o, most) = *dev.memo(LAUNCH_MEMO, |dev| {
        let o = occupancy(f)?;
        Ok((o, dev.multiprocessors()? * o.blocks as usize))
    })?;
    let blocks = scales.div_ceil(o.threads as usize / 32).clamp(1, most);
    Ok(LaunchConfig {
        grid_dim: (word(OP, "thread blocks", blocks)?, 1, 1),
        block_dim: (o.threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dynamic_map;

    /// The kernel's `quantize` (`kernels/adam8bit.cu`), operation for operation.
    fn kernel_code(words: &[u32], ix: &MapIndex, x: f32) -> u8 {
        let bits = x.to_bits();
        let sign = ((bits as i32) >> 31) as u32;
        let a = ((bits & ix.abs_mask) as i32) >> ix.shift;
        let b = (a.max(ix.lo) - ix.lo).min(ix.last);
        let word = words[(ix.buckets + b as u32 + (sign & ix.half)) as usize];
        let coded = word.wrapping_add((bits ^ sign) & ix.low_mask);
        if x.is_nan() {
            0
        } else {
            (coded >> BASE_SHIFT) as u8
        }
    }

    /// The kernel's codes from [`QuantizerTables`] equal [`CodeBook::quantize`] (itself equal
    /// to bisection on every `f32`) on `xs` for both maps; the maps are in place.
    fn assert_kernel_codes(xs: impl Iterator<Item = f32> + Clone) {
        let books = [true, false].map(|s| CodeBook::new(dynamic_map(s)).unwrap());
        let tables = QuantizerTables::of(&books[0], &books[1]).unwrap();
        assert_eq!(tables.words.len(), TABLE_WORDS);
        for (book, ix, map) in [
            (&books[0], &tables.m, T_MAP_M),
            (&books[1], &tables.v, T_MAP_V),
        ] {
            let in_table: Vec<u32> = book.map().iter().map(|x| x.to_bits()).collect();
            assert_eq!(tables.words[map..map + MAP_LEN], in_table[..]);
            for x in xs.clone() {
                assert_eq!(
                    kernel_code(&tables.words, ix, x),
                    book.quantize(x),
                    "{x:e} {ix:?}"
                );
            }
        }
    }

    /// The two dynamic maps fill the table exactly (the signed one with both halves, the
    /// unsigned one without its negative half), and the kernel's codes are the CPU's on
    /// every threshold and its neighbours, the specials, and every 997th bit pattern.
    #[test]
    fn the_kernels_bucket_words_give_the_cpus_codes() {
        let books = [true, false].map(|s| CodeBook::new(dynamic_map(s)).unwrap());
        let tables = QuantizerTables::of(&books[0], &books[1]).unwrap();
        assert_eq!((tables.m.half, tables.v.half), (1600, 0));
        let end = tables.v.buckets as usize + tables.v.last as usize + 1;
        assert_eq!((tables.m.buckets, end), (2 * MAP_LEN as u32, TABLE_WORDS));
        assert_eq!(
            (tables.m.abs_mask, tables.v.abs_mask),
            (0x7fff_ffff, u32::MAX)
        );
        let mut xs = vec![
            0.0,
            -0.0,
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        for book in &books {
            for t in book.thresholds() {
                for d in -2i32..=2 {
                    let x = f32::from_bits(t.to_bits().wrapping_add_signed(d));
                    xs.extend([x, -x]);
                }
            }
        }
        xs.extend((0..=u32::MAX).step_by(997).map(f32::from_bits));
        assert_kernel_codes(xs.into_iter());
    }

    /// Every one of the 2^32 `f32` bit patterns, both maps (about 30 s in release): `cargo
    /// test --release -p ragged-optimizers --features cuda --lib bucket_words -- --ignored`.
    #[test]
    #[ignore = "2^32 inputs × 2 maps: run by hand after changing the kernel's quantizer"]
    fn the_kernels_bucket_words_give_the_cpus_codes_on_every_f32() {
        assert_kernel_codes((0..=u32::MAX).map(f32::from_bits));
    }
}
