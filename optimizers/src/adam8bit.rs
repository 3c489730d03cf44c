//! 8-bit Adam on a local shard: bitsandbytes-style block-wise dynamic quantization of both
//! Adam moments, with **256-element scale blocks inside 32-row blocks of the global shape**,
//! so that every block lies on one rank and the numerics cannot depend on the world size or
//! layout.
//!
//! Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022
//! (arXiv:2110.02861); reference text: `/work/shared/reference/optimizers.md` §3 (bnb layout,
//! maps, update orders, small-tensor fallback) and §3.4 (blocks on the global shape).
//!
//! # Which parameters are 8-bit ([`Tiling::of`])
//! A parameter gets 8-bit state when **all** of these hold; otherwise it keeps `f32` Adam
//! state exactly as [`AdamW`] (the *small-tensor fallback*, bnb's `numel < min_8bit_size`):
//! - it has two or more dimensions: a batch of trailing matrices `[.., m, n]` (a 2-D parameter
//!   is one matrix, `[E, m, n]` is `E` matrices);
//! - its row length `n` (last dimension) is a multiple of 32;
//! - it has at least `min_8bit_size` elements (default 4096, bnb's), counted on the **global**
//!   shape, never on the local piece.
//!
//! A shape that does not tile (1-D, 0-D, `n % 32 ≠ 0`) falls back to `f32` state. So do
//! parameters whose role ([`AdamWConfig::roles`] of [`Adam8bitConfig::adam`],
//! [`ragged::roles`]) is `Fp32State` (by default: embeddings), as bnb's `StableEmbedding` does;
//! `Frozen` ones are not stepped. The decision depends on the name, the global shape and the
//! config only.
//!
//! # Row blocks and scale blocks
//! A row block is 32 consecutive rows of **one** trailing matrix (the unit the planner keeps on
//! one rank). Rows are grouped from each matrix's first row, so a matrix whose `m` is not a
//! multiple of 32 ends with a short row block (`m mod 32` rows). Each row block is cut,
//! row-major from its first element, into **scale blocks** of [`SCALE_BLOCK`] (256)
//! consecutive elements, each with its own scale for `m` and for `v`; a short row block may
//! end with a shorter one (a multiple of 32 elements). A full row block holds `32·n / 256 =
//! n / 8` scale blocks, so on a 2-D matrix with `m % 32 = 0` the scale blocks are exactly
//! bitsandbytes' flat 256-element blocks.
//!
//! | shape | block ([`Optimizer::atomic_block`]) | scale blocks |
//! |---|---|---|
//! | `[64, 96]` | `Tile { 32, 32 }` | 2 row blocks × 12 = 24 |
//! | `[100, 64]` | `Tile { 32, 32 }` | 3 × 8 + 1 (4 rows = 256 elements) = 25 |
//! | `[3, 64, 64]` | `Tile { 32, 32 }` | 3 · 2 · 8 = 48 |
//! | `[3, 40, 64]` | `Matrix` | 3 · (8 + 2) = 30 |
//! | `[33]`, `[5, 7]` | `Element` | fallback, `f32` state |
//!
//! The planner measures a `Tile { 32, 32 }` block as 32 rows of the flattened tensor from its
//! first element ([`ragged::block`]). That keeps every row block whole when the matrices hold
//! whole 32-row blocks (2-D, or `m % 32 = 0`). For a batch of matrices with `m % 32 ≠ 0` a
//! 32-flat-row cut could fall inside a matrix's short block, so such parameters ask for
//! `Matrix` (each matrix whole on one rank) instead. [`Adam8bit::step`] checks that every
//! local piece starts and ends on a row-block edge and returns `Err` otherwise.
//!
//! # State layout ([`Adam8bitState`], 2 + 4/256 ≈ 2.016 bytes per parameter)
//! - `m`, `v`: one code per element of the local shard (`shard.len` bytes each). Positions that
//!   are not in an 8-bit piece (fallback pieces, padding) hold the code of 0.0 (127 in `m`, 0
//!   in `v`) and never change.
//! - `scale_m`, `scale_v`: one 16-bit scale ([`crate::quant::encode_scale`]: `f32`'s exponent
//!   and top 8 mantissa bits) per scale block held locally, ordered by local piece (shard
//!   order), then within a piece row-major (matrix, row block, block).
//! - `m32`, `v32`: `f32` moments of the fallback pieces only, concatenated in shard order.
//!
//! # The step (bnb 0.50 CPU backend order, reference §3.3)
//! For every scale block held locally, at step `t` (after the increment), for each element:
//!
//! | # | operation | piece |
//! |---|---|---|
//! | 1 | `p ← p·(1 − lr·wd)` (decoupled, **before** the update; if decayed) | [`crate::common::decay_elem`] |
//! | 2 | `m = qmap₁[c₁]·s₁`, `v = qmap₂[c₂]·s₂` (dequantize to `f32` with the decoded scales) | [`crate::quant::dequantize`] |
//! | 3 | `m ← lerp(m, g, 1 − β₁)`, `v ← v·β₂ + ((1 − β₂)·g)·g` | [`crate::common::lerp_elem`], [`crate::common::ema_sq_elem`] |
//! | 4 | `p ← p + (−lr·√bc₂/bc₁)·m / (√v + ε·√bc₂)` with the **fresh, unquantized** `m`, `v` (torch's `(−lr/bc₁)·m / (√v/√bc₂ + ε)` with `√bc₂` folded into the scalars, bnb's form: one division less) | [`crate::common::apply_folded_adam_elem`] |
//!
//! then, per block: 5. new scales `s₁ = scale(max |m|)`, `s₂ = scale(max v)` over the block's
//! updated `f32` moments, each rounded to the nearest 16-bit scale (within 2⁻⁹; a value just
//! above its scale quantizes to the end code 1.0); 6. requantize `c = nearest(m / s)`
//! ([`crate::quant::quantize`], ties up; `m / s` as `m · (1/s)`, [`crate::quant::Unscale`]), **no sign fix-up** (the CPU backend has none; bnb's
//! CUDA kernel has one and decays after the update, §3.2); and 7. the **second-moment
//! floor**: a positive `v` whose nearest code is 0 takes code 1
//! ([`crate::quant::keep_positive_nonzero`]). Without it an element whose `v` is tiny next to
//! its block's maximum (below 1.6e-7 of it) while its `m` keeps a code steps by `lr·m/ε`; on
//! gradients with row and column scales that multiplies the drift from fp32 Adam by 6.7
//! (0.530 against 0.079, see [`crate::drift`]). bnb's CPU quantizer happens to avoid it differently: it never returns
//! a `v` code below 7. The moment updates are this crate's torch-AdamW forms (`lerp`, see
//! [`crate::adamw`]); `ε` sits outside the square root, after the bias correction.
//! Non-finite gradients are not special-cased (bnb's CUDA kernel zeroes the moments; the CPU
//! backend propagates them, as here).
//!
//! Every element operation is one IEEE `f32` operation, the scalars are computed in `f64` and
//! rounded once ([`crate::common::AdamScale`]); every scale block is local; so a sharded step
//! is bitwise equal to the unsharded one at every world size and layout.
//!
//! # Quality
//! On the seeded streams of [`crate::drift`] (four 65 536-element matrices, 50 steps, lr
//! 1e-3), the drift `‖p₈ − p₃₂‖ / ‖p₃₂ − p₀‖` is 0.01420 / 0.02477 / 0.07919 (i.i.d. /
//! row-scaled / row- and column-scaled gradients) against bitsandbytes 0.50.2 `Adam8bit`'s
//! 0.01418 / 0.03519 / 0.17577 on the same bits (`scripts/adam8bit_vs_bnb.py`). The previous
//! layout (32×32 tiles, one `f32` scale per 1024 elements, no floor) drifted 0.01566 /
//! 0.04572 / 1.2775.
//!
//! # Speed
//! Scale blocks are independent, so a step cuts every stepped piece into work items (runs of
//! at most [`CHUNK_ELEMS`] elements of one row block; `f32` fallback pieces into AdamW-sized
//! runs) and puts all of them, over every piece of the shard, in **one queue**: the calling
//! thread and rayon's workers claim items from it (`kernels::work_share`; the
//! caller works from the first item on, instead of sleeping while rayon's workers wake), and
//! steps of fewer than [`PARALLEL_MIN_ELEMS`] elements stay on the calling thread. No bit
//! depends on who runs an item. A run is stepped scale block by scale block, whose new
//! moments (2 KiB) stay on the stack. Three builds of that kernel ([`Adam8bitKernel`]), chosen at run time
//! ([`Adam8bitKernel::detect`]; [`Adam8bit::with_kernel`] forces one), compute the same bits
//! (each lane the scalar operations in the scalar order; Rust never contracts to FMA;
//! `tests/adam8bit_kernel_tests.rs` compares them on random states and edge inputs):
//! - **portable**: plain loops, table lookups from the map, requantizing with
//!   [`crate::quant::CodeBook`], a threshold table that gives [`crate::quant::quantize`]'s
//!   code with one lookup (checked on all 2^32 `f32` inputs);
//! - **AVX2 + FMA**: the same loop compiled for AVX2, dequantizing and requantizing with
//!   8-lane lookups made of scalar loads (`vpgatherdd` took ~1.4× their time on Zen 3, and
//!   ~1.6× on the whole step with the block maxima folded by the compiler; see
//!   [`crate::quant::dequantize_32_avx2`]);
//! - **AVX-512 F/BW/VBMI** ([`crate::kernels::adam8bit_avx512`]): no gathers. It
//!   dequantizes with VBMI byte permutes over the maps held as four 256-byte planes, steps 16
//!   lanes, and requantizes 64 lanes at a time with byte permutes over a 512-bucket
//!   nearest-code index ([`crate::kernels::octave_index`]).
//!
//! Per element the step needs one IEEE square root and one division (bitsandbytes' folded
//! update; each moment is scaled into the map by its block's reciprocal), and the portable
//! and AVX2 builds four table lookups (two to dequantize, two to requantize), which were the
//! AVX-512 build's largest cost before its byte permutes.

use ragged::block::numel;
use ragged::comm::Communicator;
use ragged::optim::{LocalShard, Optimizer};
use ragged::storage::{Placement, Storage, View, ViewMut};
use ragged::{AtomicBlock, Error, Result, Role};

use crate::adamw::{adamw_update, AdamRun, AdamW, AdamWConfig};
use crate::common::{
    apply_folded_adam_elem, check_len, check_step_inputs, decay_elem, ema_sq_elem, lerp_large_elem,
    lerp_small_elem, lerp_weight_is_small, next_step, AdamScale, MomentCoeffs,
};
#[cfg(target_arch = "x86_64")]
use crate::kernels::adam8bit_avx512::{BytePlanes, LaneIndex};
use crate::kernels::work_share;
#[cfg(target_arch = "x86_64")]
use crate::quant::dequantize_32_avx2;
use crate::quant::{
    decode_scale, dequantize_slice, dynamic_map, encode_scale, keep_positive_nonzero, CodeBook,
    ScaleCode, MAP_LEN, SIGNED_ZERO_CODE, UNSIGNED_ZERO_CODE,
};

/// Rows of a row block (the planner's `Tile { 32, 32 }` block keeps 32 whole rows on one
/// rank); 8-bit parameters need rows of a multiple of 32 elements.
pub const TILE: usize = 32;

/// Elements per scale block: each row block (32 rows of one matrix) is cut, row-major from
/// its first element, into runs of 256 elements (bitsandbytes' block size), each with its own
/// scale per moment; a short row block may end with a shorter run (a multiple of 32).
pub const SCALE_BLOCK: usize = 256;

/// bnb's default `min_8bit_size`: smaller parameters keep `f32` state.
pub const MIN_8BIT_SIZE: usize = 4096;

/// 8-bit Adam hyperparameters: the AdamW ones (lr, betas, eps, decoupled weight decay and its
/// rule, defaults `torch.optim.AdamW`'s) plus the small-tensor threshold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam8bitConfig {
    /// Adam hyperparameters; `weight_decay` is decoupled and applied before the update.
    pub adam: AdamWConfig,
    /// Parameters with fewer elements (global shape) keep `f32` state (default 4096).
    pub min_8bit_size: usize,
}

impl Default for Adam8bitConfig {
    fn default() -> Self {
        Adam8bitConfig {
            adam: AdamWConfig::default(),
            min_8bit_size: MIN_8BIT_SIZE,
        }
    }
}

/// How an 8-bit parameter is cut into tiles: `batch` trailing matrices of `rows × cols`
/// (global shape). A pure function of the shape; see the module doc.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tiling {
    /// Number of trailing matrices (product of the leading dimensions; 1 for 2-D).
    pub batch: usize,
    /// Rows per matrix, `m`.
    pub rows: usize,
    /// Columns per matrix, `n` (a multiple of [`TILE`]).
    pub cols: usize,
}

impl Tiling {
    /// The tiling of a parameter of global `shape`, or `None` when it keeps `f32` state
    /// (fewer than two dimensions, `n % 32 ≠ 0`, fewer than `min_8bit_size` elements, or an
    /// invalid shape).
    pub fn of(shape: &[usize], min_8bit_size: usize) -> Option<Tiling> {
        let n = numel(shape).ok()?;
        let d = shape.len();
        if d < 2 || !shape[d - 1].is_multiple_of(TILE) || n < min_8bit_size {
            return None;
        }
        Some(Tiling {
            batch: shape[..d - 2].iter().product(),
            rows: shape[d - 2],
            cols: shape[d - 1],
        })
    }

    /// The row blocks of the elements `range` of the flattened parameter (starting on a row
    /// block's edge, as a piece's do), in order: each block's rows (up to 32 rows of one
    /// matrix) and its elements. The one walk the host step and the device block table share.
    pub fn row_blocks(
        &self,
        range: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (usize, usize)> {
        let tiling = *self;
        let mut elem = range.start;
        std::iter::from_fn(move || {
            if elem >= range.end || tiling.cols == 0 {
                return None;
            }
            let in_matrix = (elem / tiling.cols) % tiling.rows;
            let rows = TILE.min(tiling.rows - in_matrix);
            let len = rows * tiling.cols;
            elem += len;
            Some((rows, len))
        })
    }

    /// Row blocks per matrix (the last may be short).
    pub fn row_blocks_per_matrix(&self) -> usize {
        self.rows.div_ceil(TILE)
    }

    /// Tiles per row block, `n / 32`.
    pub fn tiles_per_row_block(&self) -> usize {
        self.cols / TILE
    }

    /// Tiles in the whole parameter.
    pub fn num_tiles(&self) -> usize {
        self.batch * self.row_blocks_per_matrix() * self.tiles_per_row_block()
    }

    /// Scale blocks in a row block of `rows` rows (≤ 32): `⌈rows·n / 256⌉`.
    pub fn scales_in_row_block(&self, rows: usize) -> usize {
        (rows * self.cols).div_ceil(SCALE_BLOCK)
    }

    /// Scale blocks per matrix: its full row blocks, then the short one (if any).
    pub fn scales_per_matrix(&self) -> usize {
        (self.rows / TILE) * self.scales_in_row_block(TILE)
            + self.scales_in_row_block(self.rows % TILE)
    }

    /// Scales per moment in the whole parameter.
    pub fn num_scales(&self) -> usize {
        self.batch * self.scales_per_matrix()
    }

    /// Scale blocks before flattened element `elem` (on a row-block edge), in the order of
    /// the module doc; `None` inside a tile.
    pub fn scales_before(&self, elem: usize) -> Option<usize> {
        self.row_blocks_before(elem)?;
        let row = elem / self.cols;
        let (matrix, r) = (row / self.rows, row % self.rows);
        Some(matrix * self.scales_per_matrix() + (r / TILE) * self.scales_in_row_block(TILE))
    }

    /// The atomic block that keeps every tile on one rank: `Tile { 32, 32 }` when the planner's
    /// 32-flat-row blocks coincide with the per-matrix row blocks (one matrix, or `m % 32 = 0`),
    /// `Matrix` otherwise.
    pub fn block(&self) -> AtomicBlock {
        if self.batch == 1 || self.rows.is_multiple_of(TILE) {
            AtomicBlock::Tile {
                rows: TILE,
                cols: TILE,
            }
        } else {
            AtomicBlock::Matrix
        }
    }

    /// Row blocks before flattened element `elem` of the parameter, when `elem` lies on a
    /// row-block edge (or at the end); `None` when it falls inside a tile.
    pub fn row_blocks_before(&self, elem: usize) -> Option<usize> {
        if !elem.is_multiple_of(self.cols) {
            return None;
        }
        let row = elem / self.cols;
        let (matrix, r) = (row / self.rows, row % self.rows);
        (r % TILE == 0).then(|| matrix * self.row_blocks_per_matrix() + r / TILE)
    }

    /// Where flattened element `elem` falls, for an error about a cut inside a tile: its
    /// matrix, row and column, and the rows of the tile it cuts.
    pub fn describe_cut(&self, elem: usize) -> String {
        let (row, col) = (elem / self.cols.max(1), elem % self.cols.max(1));
        let (matrix, r) = (row / self.rows.max(1), row % self.rows.max(1));
        let lo = r - r % TILE;
        let hi = (lo + TILE).min(self.rows);
        format!(
            "the piece edge at element {elem} (matrix {matrix}, row {r}, column {col}) falls \
             inside the tile of rows {lo}..{hi}"
        )
    }

    /// Tiles before flattened element `elem` (on a row-block edge), in the tile order of the
    /// module doc; `None` inside a tile.
    pub fn tiles_before(&self, elem: usize) -> Option<usize> {
        self.row_blocks_before(elem)
            .map(|b| b * self.tiles_per_row_block())
    }
}

/// 8-bit Adam state of one rank's shard of one group; see the module doc for the layout.
/// Checkpointing is [`Adam8bitState::to_le_bytes`].
#[derive(Debug, PartialEq)]
pub struct Adam8bitState {
    /// Steps taken (`t`). `0` before the first step.
    pub step: u64,
    /// First-moment codes in the signed dynamic map, one per local-shard element.
    pub m: Storage<u8>,
    /// Second-moment codes in the unsigned dynamic map, one per local-shard element.
    pub v: Storage<u8>,
    /// Scales of `m` ([`encode_scale`] of max |m| of each 256-element scale block after the
    /// last step), local order (piece, then row-major within the piece).
    pub scale_m: Storage<ScaleCode>,
    /// Scales of `v` (max v of each scale block), in the order of `scale_m`.
    pub scale_v: Storage<ScaleCode>,
    /// `f32` first moment of the fallback pieces, concatenated in shard order.
    pub m32: Storage<f32>,
    /// `f32` second moment of the fallback pieces, concatenated in shard order.
    pub v32: Storage<f32>,
}

/// The arrays of an [`Adam8bitState`] in host memory ([`Adam8bitState::host_mut`]).
pub(crate) struct HostArrays<'a> {
    pub m: &'a mut [u8],
    pub v: &'a mut [u8],
    pub scale_m: &'a mut [ScaleCode],
    pub scale_v: &'a mut [ScaleCode],
    pub m32: &'a mut [f32],
    pub v32: &'a mut [f32],
}

const HEADER_WORDS: usize = 4;

impl Adam8bitState {
    /// Every array as a host slice (`Err` when the state lives on a device).
    pub(crate) fn host_mut(&mut self) -> Result<HostArrays<'_>> {
        Ok(HostArrays {
            m: self.m.cpu_mut()?,
            v: self.v.cpu_mut()?,
            scale_m: self.scale_m.cpu_mut()?,
            scale_v: self.scale_v.cpu_mut()?,
            m32: self.m32.cpu_mut()?,
            v32: self.v32.cpu_mut()?,
        })
    }

    /// A copy in the same memory.
    pub fn try_clone(&self) -> Result<Self> {
        Ok(Adam8bitState {
            step: self.step,
            m: self.m.try_clone()?,
            v: self.v.try_clone()?,
            scale_m: self.scale_m.try_clone()?,
            scale_v: self.scale_v.try_clone()?,
            m32: self.m32.try_clone()?,
            v32: self.v32.try_clone()?,
        })
    }

    /// The same state in the memory `place` names (a copy of every array).
    pub fn to_placement(&self, place: &Placement) -> Result<Self> {
        Ok(Adam8bitState {
            step: self.step,
            m: place.put(self.m.to_vec()?)?,
            v: place.put(self.v.to_vec()?)?,
            scale_m: place.put(self.scale_m.to_vec()?)?,
            scale_v: place.put(self.scale_v.to_vec()?)?,
            m32: place.put(self.m32.to_vec()?)?,
            v32: place.put(self.v32.to_vec()?)?,
        })
    }

    /// Serializes the state: `step`, `len` (codes per moment), `scales` (scales per moment),
    /// `fp32` (fallback elements per moment), as u64; then `m`, `v` (bytes), `scale_m`,
    /// `scale_v` (u16), `m32`, `v32` (f32); all little-endian (device arrays are downloaded).
    /// Exact: loading gives back the same bits.
    pub fn to_le_bytes(&self) -> Result<Vec<u8>> {
        let (m, v) = (self.m.host()?, self.v.host()?);
        let (scale_m, scale_v) = (self.scale_m.host()?, self.scale_v.host()?);
        let (m32, v32) = (self.m32.host()?, self.v32.host()?);
        let mut out = Vec::new();
        for w in [
            self.step,
            m.len() as u64,
            scale_m.len() as u64,
            m32.len() as u64,
        ] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.extend_from_slice(&m);
        out.extend_from_slice(&v);
        for x in scale_m.iter().chain(scale_v.iter()) {
            out.extend_from_slice(&x.to_le_bytes());
        }
        for x in m32.iter().chain(v32.iter()) {
            out.extend_from_slice(&x.to_le_bytes());
        }
        Ok(out)
    }

    /// Loads a state written by [`Adam8bitState::to_le_bytes`]; `Err` when the byte count is
    /// not the one the header announces.
    pub fn from_le_bytes(bytes: &[u8]) -> Result<Self> {
        let bad = |reason: String| Error::BadInput {
            op: "Adam8bitState::from_le_bytes",
            what: format!("{} bytes", bytes.len()),
            reason,
        };
        if bytes.len() < 8 * HEADER_WORDS {
            return Err(bad("shorter than the 32-byte header".into()));
        }
        let word = |k: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[8 * k..8 * k + 8]);
            u64::from_le_bytes(w)
        };
        let (step, len, scales, fp32) = (word(0), word(1), word(2), word(3));
        let size = |x: u64, each: usize| usize::try_from(x).ok()?.checked_mul(each);
        let want = (|| {
            (8 * HEADER_WORDS)
                .checked_add(size(len, 2)?)?
                .checked_add(size(scales, 4)?)?
                .checked_add(size(fp32, 8)?)
        })();
        if want != Some(bytes.len()) {
            return Err(bad(format!(
                "header announces {len} codes, {scales} scales and {fp32} fp32 elements per moment"
            )));
        }
        let (len, scales, fp32) = (len as usize, scales as usize, fp32 as usize);
        let (m, rest) = bytes[8 * HEADER_WORDS..].split_at(len);
        let (v, rest) = rest.split_at(len);
        let (s16, f32s) = rest.split_at(4 * scales);
        let halves: Vec<ScaleCode> = s16
            .chunks_exact(2)
            .map(|b| ScaleCode::from_le_bytes([b[0], b[1]]))
            .collect();
        let floats: Vec<f32> = f32s
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (scale_m, scale_v) = halves.split_at(scales);
        let (m32, v32) = floats.split_at(fp32);
        Ok(Adam8bitState {
            step,
            m: m.to_vec().into(),
            v: v.to_vec().into(),
            scale_m: scale_m.to_vec().into(),
            scale_v: scale_v.to_vec().into(),
            m32: m32.to_vec().into(),
            v32: v32.to_vec().into(),
        })
    }

    /// Bytes of optimizer state held (codes, scales and fallback moments; not the header).
    pub fn state_bytes(&self) -> usize {
        self.m.len()
            + self.v.len()
            + 2 * (self.scale_m.len() + self.scale_v.len())
            + 4 * (self.m32.len() + self.v32.len())
    }
}

/// Where one local piece keeps its state.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PieceState {
    /// 8-bit: tiling, and the piece's first scale in `scale_*`.
    Tiled { tiling: Tiling, first_scale: usize },
    /// fp32 fallback: offset into `m32`/`v32`.
    Fallback { at: usize },
}

/// 8-bit Adam on local shards. Holds only hyperparameters and the two quantization maps.
#[derive(Clone, Debug, PartialEq)]
pub struct Adam8bit {
    config: Adam8bitConfig,
    pub(crate) adamw: AdamW,
    /// The signed map of `m`, with its nearest-code index.
    pub(crate) book_m: CodeBook,
    /// The unsigned map of `v`, with its nearest-code index.
    pub(crate) book_v: CodeBook,
    /// Which build of the row-block kernel steps run ([`Adam8bitKernel::detect`] by default).
    kernel: Adam8bitKernel,
    /// The maps as byte planes, for the AVX-512 kernel's byte-permute dequantization.
    #[cfg(target_arch = "x86_64")]
    planes: Box<[BytePlanes; 2]>,
    /// The maps' nearest-code indexes for the AVX-512 kernel's byte-permute quantizer.
    #[cfg(target_arch = "x86_64")]
    lanes: Box<[LaneIndex; 2]>,
    /// Steps of fewer elements run on the calling thread ([`PARALLEL_MIN_ELEMS`] by default).
    parallel_min: usize,
    /// Both maps' quantizer tables as the CUDA kernel reads them.
    #[cfg(feature = "cuda")]
    pub(crate) device_tables: crate::cuda::adam8bit::QuantizerTables,
    /// The device step's buffer for its row-block runs, kept between steps.
    #[cfg(feature = "cuda")]
    pub(crate) device_runs: crate::common::BetweenSteps<ragged::cuda::Scratch<u32>>,
}

impl Adam8bit {
    /// An 8-bit Adam with validated hyperparameters ([`AdamWConfig::validate`]).
    pub fn new(config: Adam8bitConfig) -> Result<Self> {
        let (book_m, book_v) = (
            CodeBook::new(dynamic_map(true))?,
            CodeBook::new(dynamic_map(false))?,
        );
        #[cfg(target_arch = "x86_64")]
        let (index_m, index_v) = (octave_index(&book_m)?, octave_index(&book_v)?);
        Ok(Adam8bit {
            config,
            adamw: AdamW::new(config.adam)?,
            #[cfg(target_arch = "x86_64")]
            planes: Box::new([BytePlanes::of(book_m.map()), BytePlanes::of(book_v.map())]),
            #[cfg(feature = "cuda")]
            device_tables: crate::cuda::adam8bit::QuantizerTables::of(&book_m, &book_v)?,
            #[cfg(feature = "cuda")]
            device_runs: Default::default(),
            #[cfg(target_arch = "x86_64")]
            lanes: Box::new([LaneIndex::of(index_m), LaneIndex::of(index_v)]),
            book_m,
            book_v,
            kernel: Adam8bitKernel::detect(),
            parallel_min: PARALLEL_MIN_ELEMS,
        })
    }

    /// This optimizer with steps of fewer than `elems` elements (summed over the stepped
    /// pieces) on the calling thread, larger ones shared with rayon's workers (default
    /// [`PARALLEL_MIN_ELEMS`]; `0` always shares, `usize::MAX` never). No bit of a step
    /// depends on it; it exists to measure the threshold and to test both paths.
    pub fn with_parallel_min(mut self, elems: usize) -> Result<Self> {
        self.parallel_min = elems;
        Ok(self)
    }

    /// This optimizer with its steps on `kernel`; `Err` when this CPU cannot run it. Every
    /// kernel computes the same bits; the choice exists so that tests and benchmarks can run
    /// the slower ones on a CPU that has a faster one.
    pub fn with_kernel(mut self, kernel: Adam8bitKernel) -> Result<Self> {
        if !kernel.is_available() {
            return Err(Error::BadInput {
                op: "Adam8bit::with_kernel",
                what: format!("{kernel:?}"),
                reason: "this CPU lacks the instructions it needs".into(),
            });
        }
        self.kernel = kernel;
        Ok(self)
    }

    /// The kernel steps run on.
    pub fn kernel(&self) -> Adam8bitKernel {
        self.kernel
    }

    /// The hyperparameters.
    pub fn config(&self) -> &Adam8bitConfig {
        &self.config
    }

    /// The tiling of a parameter of this name and global shape, `None` for the `f32`
    /// fallback (role `Fp32State` or `Frozen`, or no [`Tiling::of`] its shape).
    pub fn tiling(&self, name: &str, shape: &[usize]) -> Option<Tiling> {
        match self.config.adam.roles.role_of(name, shape) {
            Role::Fp32State | Role::Frozen => None,
            Role::Matrix | Role::ElementWise => Tiling::of(shape, self.config.min_8bit_size),
        }
    }

    /// Where each local piece keeps its state, and the totals (scales, fallback elements).
    /// `Err` when an 8-bit piece starts or ends inside a tile.
    pub(crate) fn layout(
        &self,
        op: &'static str,
        shard: &LocalShard,
    ) -> Result<(Vec<PieceState>, usize, usize)> {
        let (mut scales, mut fp32) = (0, 0);
        let mut out = Vec::with_capacity(shard.pieces.len());
        for piece in &shard.pieces {
            let meta = &shard.params[piece.param];
            match self.tiling(&meta.name, &meta.shape) {
                Some(tiling) => {
                    let (a, b) = (
                        tiling.scales_before(piece.range.start),
                        tiling.scales_before(piece.range.end),
                    );
                    let (Some(a), Some(b)) = (a, b) else {
                        let cut = if a.is_none() {
                            piece.range.start
                        } else {
                            piece.range.end
                        };
                        return Err(Error::InvalidShard {
                            op,
                            reason: format!(
                                "8-bit Adam cannot hold rank {}'s elements {:?} of {} {:?}: {}; \
                                 each 32-row block of the global shape keeps its scale blocks \
                                 ({SCALE_BLOCK} elements each), so the whole block must be on \
                                 one rank. Plan with Adam8bit::atomic_block ({}); a layout that \
                                 splits dim 0 into ⌈rows/V⌉-row chunks (the FSDP2-style layout) \
                                 holds it only when every chunk edge falls on a {TILE}-row edge",
                                shard.rank,
                                piece.range,
                                meta.name,
                                meta.shape,
                                tiling.describe_cut(cut),
                                tiling.block()
                            ),
                        });
                    };
                    out.push(PieceState::Tiled {
                        tiling,
                        first_scale: scales,
                    });
                    scales += b - a;
                }
                None => {
                    out.push(PieceState::Fallback { at: fp32 });
                    fp32 += piece.range.len();
                }
            }
        }
        Ok((out, scales, fp32))
    }
}

/// The nearest-code index of `book`'s map for the AVX-512 quantizer (both dynamic maps fit; a
/// map that does not is an `Err`, never a silent fallback).
#[cfg(target_arch = "x86_64")]
fn octave_index(book: &CodeBook) -> Result<crate::kernels::octave_index::OctaveIndex> {
    crate::kernels::octave_index::OctaveIndex::new(&book.thresholds()).ok_or_else(|| {
        Error::BadInput {
            op: "Adam8bit::new",
            what: "quantization map".into(),
            reason: "its thresholds need more than 512 octave-index buckets (the quantizer of \
                     the AVX-512 kernel)"
                .into(),
        }
    })
}

/// Buffer lengths of one step's inputs and 8-bit state, host or device: `[m, v]` each.
pub(crate) struct StateLens {
    pub params: usize,
    pub grads: usize,
    pub codes: [usize; 2],
    pub scales: [usize; 2],
    pub fp32: [usize; 2],
}

impl Adam8bit {
    /// Checks a step's inputs and state against `shard` and returns where each piece keeps
    /// its state, and the number of local scale blocks (the one prologue of the CPU and GPU
    /// steps).
    pub(crate) fn checked_layout(
        &self,
        op: &'static str,
        shard: &LocalShard,
        lens: &StateLens,
    ) -> Result<(Vec<PieceState>, usize)> {
        let [m, v] = lens.codes;
        check_step_inputs(op, shard, lens.params, lens.grads, m, v)?;
        let (layout, scales, fp32) = self.layout(op, shard)?;
        check_len(op, "state.scale_m", lens.scales[0], scales)?;
        check_len(op, "state.scale_v", lens.scales[1], scales)?;
        check_len(op, "state.m32", lens.fp32[0], fp32)?;
        check_len(op, "state.v32", lens.fp32[1], fp32)?;
        Ok((layout, scales))
    }
}

impl Optimizer for Adam8bit {
    type State = Adam8bitState;

    fn name(&self) -> &'static str {
        "adam8bit"
    }

    fn learning_rate(&self) -> Option<f64> {
        Some(self.config.adam.lr)
    }

    fn settings(&self) -> String {
        format!("{:?}", self.config)
    }

    /// The 8-bit moments and the f32 fallback share one rate.
    fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        // AdamW's checks: the rates of `config.adam` at `lr`, roles included.
        self.adamw.set_learning_rate(lr)?;
        self.config.adam.lr = lr;
        Ok(())
    }

    fn role(&self, name: &str, shape: &[usize]) -> Role {
        self.config.adam.roles.role_of(name, shape)
    }

    fn atomic_block(&self, name: &str, shape: &[usize]) -> AtomicBlock {
        self.tiling(name, shape)
            .map_or(AtomicBlock::Element, |t| t.block())
    }

    fn init(&self, shard: &LocalShard) -> Result<Adam8bitState> {
        self.init_on(shard, &Placement::Cpu)
    }

    fn init_on(&self, shard: &LocalShard, place: &Placement) -> Result<Adam8bitState> {
        const OP: &str = "Adam8bit::init";
        shard.check(OP)?;
        let (_, scales, fp32) = self.layout(OP, shard)?;
        Ok(Adam8bitState {
            step: 0,
            m: place.put(vec![SIGNED_ZERO_CODE; shard.len])?,
            v: place.put(vec![UNSIGNED_ZERO_CODE; shard.len])?,
            scale_m: place.zeros(scales)?,
            scale_v: place.zeros(scales)?,
            m32: place.zeros(fp32)?,
            v32: place.zeros(fp32)?,
        })
    }

    fn step(
        &self,
        state: &mut Adam8bitState,
        shard: &LocalShard,
        params: ViewMut<'_, f32>,
        grads: View<'_, f32>,
        _comm: &dyn Communicator,
    ) -> Result<()> {
        const OP: &str = "Adam8bit::step";
        let lens = StateLens {
            params: params.len(),
            grads: grads.len(),
            codes: [state.m.len(), state.v.len()],
            scales: [state.scale_m.len(), state.scale_v.len()],
            fp32: [state.m32.len(), state.v32.len()],
        };
        // `checked_layout` also checks the scale arrays' lengths (the device launch size).
        let (layout, _) = self.checked_layout(OP, shard, &lens)?;
        let t = next_step(OP, state.step)?;
        match params {
            ViewMut::Cpu(params) => {
                let grads = grads.cpu(OP)?;
                self.step_host(state.host_mut()?, shard, &layout, params, grads, t);
            }
            #[cfg(feature = "cuda")]
            ViewMut::Cuda(mut params) => {
                crate::cuda::adam8bit::step(self, state, shard, &layout, &mut params, grads, t)?;
            }
            _ => return Err(ragged::storage::no_backend(OP)),
        }
        state.step = t;
        Ok(())
    }
}

impl Adam8bit {
    /// The step on host memory (after [`Adam8bit::checked_layout`]): every piece's work
    /// ([`step_items`]) in one queue, shared by the calling thread and rayon's workers
    /// ([`work_share::share`]) when there are at least `parallel_min` elements to step.
    fn step_host(
        &self,
        state: HostArrays<'_>,
        shard: &LocalShard,
        layout: &[PieceState],
        params: &mut [f32],
        grads: &[f32],
        t: u64,
    ) {
        let c = &self.config.adam;
        let moments = MomentCoeffs::new(c.beta1, c.beta2);
        let runs = shard
            .pieces
            .iter()
            .zip(layout)
            .filter_map(|(piece, place)| {
                Some((self.adamw.run_of(shard, piece, t)?, piece, *place))
            });
        let (items, elems) = step_items(runs, state, params, grads);
        let helpers = if elems >= self.parallel_min {
            rayon::current_num_threads().saturating_sub(1)
        } else {
            0
        };
        work_share::share(items, helpers, |item| match item {
            Work::Tiled {
                block,
                decay,
                scale,
            } => self.update_row_block(block, decay, &moments, &scale),
            Work::Fallback {
                p,
                g,
                m,
                v,
                decay,
                scale,
            } => adamw_update(p, g, m, v, decay, &moments, &scale),
        });
    }
}

/// Elements of one work item of a tiled piece: 32 scale blocks of one row block (scale blocks
/// are independent, so a row block can be cut at any of their edges). Small enough that the
/// calling thread and a late-waking worker split a 256 × 256 matrix's eight items evenly,
/// large enough (~10 µs) that claiming one costs nothing.
pub const CHUNK_ELEMS: usize = 32 * SCALE_BLOCK;

/// Elements of one work item of an `f32` fallback piece (AdamW's task size).
const FALLBACK_CHUNK: usize = crate::adamw::PAR_CHUNK;

/// Steps of at least this many elements share their work with rayon's workers; smaller ones
/// run on the calling thread. Measured on a 2-vCPU AVX-512 EPYC under other builds' load
/// (`adam8bit_steps threshold 300 cold`: always-shared against calling-thread steps,
/// alternating, each after a 256 MiB copy): shared steps took 1.19× / 1.12× / 1.07× the time
/// at 4096 / 8192 / 16 384 elements and 0.89× at 32 768 ("8-bit Adam on small
/// matrices" in `docs/optimizer-measurements.md`).
pub const PARALLEL_MIN_ELEMS: usize = 1 << 15;

/// One independent unit of a step.
enum Work<'a> {
    /// A run of whole scale blocks of one row block, with its piece's decay and rates.
    Tiled {
        block: RowBlock<'a>,
        decay: Option<f32>,
        scale: AdamScale,
    },
    /// A run of an `f32` fallback piece (AdamW's element-wise update).
    Fallback {
        p: &'a mut [f32],
        g: &'a [f32],
        m: &'a mut [f32],
        v: &'a mut [f32],
        decay: Option<f32>,
        scale: AdamScale,
    },
}

/// Cuts the front of a slice by absolute position: the pieces of a shard are in offset order
/// and do not overlap ([`LocalShard::check`]), and so are their scales and fallback moments, so each
/// array is split once, front to back, into disjoint borrows.
struct Cursor<'a, T> {
    rest: &'a mut [T],
    at: usize,
}

impl<'a, T> Cursor<'a, T> {
    fn new(all: &'a mut [T]) -> Self {
        Cursor { rest: all, at: 0 }
    }

    /// The elements `range` (at or after the previous range's end).
    fn take(&mut self, range: std::ops::Range<usize>) -> &'a mut [T] {
        let rest = std::mem::take(&mut self.rest);
        let (_, rest) = rest.split_at_mut(range.start - self.at);
        let (taken, rest) = rest.split_at_mut(range.len());
        (self.rest, self.at) = (rest, range.end);
        taken
    }
}

/// The work items of every stepped piece (`runs`, in shard order) and their element count:
/// tiled pieces cut into row blocks and those into [`CHUNK_ELEMS`] runs, fallback pieces into
/// [`FALLBACK_CHUNK`] runs. One queue for the whole step (a multi-tensor step, as torch's
/// `foreach`): a shard of many small tensors costs one hand-off, not one per tensor.
fn step_items<'a>(
    runs: impl Iterator<Item = (AdamRun, &'a ragged::optim::LocalPiece, PieceState)>,
    state: HostArrays<'a>,
    params: &'a mut [f32],
    grads: &'a [f32],
) -> (Vec<Work<'a>>, usize) {
    let (mut p, mut mc, mut vc) = (
        Cursor::new(params),
        Cursor::new(state.m),
        Cursor::new(state.v),
    );
    let (mut sm, mut sv) = (Cursor::new(state.scale_m), Cursor::new(state.scale_v));
    let (mut m32, mut v32) = (Cursor::new(state.m32), Cursor::new(state.v32));
    let (mut items, mut elems) = (Vec::new(), 0);
    for (run, piece, place) in runs {
        let AdamRun {
            range: r,
            decay,
            scale,
        } = run;
        elems += r.len();
        match place {
            PieceState::Fallback { at } => {
                let g = &grads[r.clone()];
                let s = at..at + r.len();
                let (p, m, v) = (p.take(r), m32.take(s.clone()), v32.take(s));
                let chunks = p
                    .chunks_mut(FALLBACK_CHUNK)
                    .zip(g.chunks(FALLBACK_CHUNK))
                    .zip(
                        m.chunks_mut(FALLBACK_CHUNK)
                            .zip(v.chunks_mut(FALLBACK_CHUNK)),
                    );
                items.extend(chunks.map(|((p, g), (m, v))| Work::Fallback {
                    p,
                    g,
                    m,
                    v,
                    decay,
                    scale,
                }));
            }
            PieceState::Tiled {
                tiling,
                first_scale,
            } => {
                let (mut at, mut s_at) = (r.start, first_scale);
                for (rows, len) in tiling.row_blocks(piece.range.clone()) {
                    let ns = tiling.scales_in_row_block(rows);
                    let mut block = RowBlock {
                        p: p.take(at..at + len),
                        g: &grads[at..at + len],
                        mc: mc.take(at..at + len),
                        vc: vc.take(at..at + len),
                        scale_m: sm.take(s_at..s_at + ns),
                        scale_v: sv.take(s_at..s_at + ns),
                    };
                    (at, s_at) = (at + len, s_at + ns);
                    while !block.p.is_empty() {
                        let (front, rest) = block.split_front(CHUNK_ELEMS);
                        items.push(Work::Tiled {
                            block: front,
                            decay,
                            scale,
                        });
                        block = rest;
                    }
                }
            }
        }
    }
    (items, elems)
}

/// One row block of a tiled piece (up to 32 rows of one matrix): its elements and the scales
/// of its 256-element scale blocks.
pub(crate) struct RowBlock<'a> {
    pub p: &'a mut [f32],
    pub g: &'a [f32],
    pub mc: &'a mut [u8],
    pub vc: &'a mut [u8],
    pub scale_m: &'a mut [ScaleCode],
    pub scale_v: &'a mut [ScaleCode],
}

impl<'a> RowBlock<'a> {
    /// The first `elems` elements (a multiple of [`SCALE_BLOCK`]; all when fewer are left)
    /// with their scales, and the rest: both are runs of whole scale blocks, stepped alike.
    fn split_front(self, elems: usize) -> (RowBlock<'a>, RowBlock<'a>) {
        let n = elems.min(self.p.len());
        let ns = n.div_ceil(SCALE_BLOCK);
        let (p0, p1) = self.p.split_at_mut(n);
        let (g0, g1) = self.g.split_at(n);
        let (m0, m1) = self.mc.split_at_mut(n);
        let (v0, v1) = self.vc.split_at_mut(n);
        let (a0, a1) = self.scale_m.split_at_mut(ns);
        let (b0, b1) = self.scale_v.split_at_mut(ns);
        let front = RowBlock {
            p: p0,
            g: g0,
            mc: m0,
            vc: v0,
            scale_m: a0,
            scale_v: b0,
        };
        let rest = RowBlock {
            p: p1,
            g: g1,
            mc: m1,
            vc: v1,
            scale_m: a1,
            scale_v: b1,
        };
        (front, rest)
    }
}

/// The loop-invariant inputs of a row block's step.
#[derive(Clone, Copy)]
pub(crate) struct StepConsts<'a> {
    pub decay: f32,
    pub mo: &'a MomentCoeffs,
    pub s: &'a AdamScale,
}

/// The builds of 8-bit Adam's row-block kernel. All compute the same bits (each lane the
/// scalar operations in the scalar order); they differ in instructions and speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adam8bitKernel {
    /// Plain Rust, the compiler's baseline ISA, scalar table lookups.
    Portable,
    /// The same loop compiled for AVX2 + FMA, table lookups by scalar loads into 8 lanes.
    Avx2,
    /// AVX-512 F/BW/VBMI, no gathers: byte-permute dequantization, 16-lane moments and
    /// update, 64-lane byte-permute quantizer (`kernels/adam8bit_avx512.rs`).
    Avx512,
}

impl Adam8bitKernel {
    /// Every build, slowest first.
    pub const ALL: [Adam8bitKernel; 3] = [
        Adam8bitKernel::Portable,
        Adam8bitKernel::Avx2,
        Adam8bitKernel::Avx512,
    ];

    /// The fastest build this CPU runs (checked at run time).
    pub fn detect() -> Self {
        Self::ALL
            .into_iter()
            .rev()
            .find(|k| k.is_available())
            .unwrap_or(Adam8bitKernel::Portable)
    }

    /// Whether this CPU has what the build needs.
    pub fn is_available(self) -> bool {
        match self {
            Adam8bitKernel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Adam8bitKernel::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Adam8bitKernel::Avx512 => crate::kernels::adam8bit_avx512::available(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// What the build is, for benchmark rows and logs.
    pub fn name(self) -> &'static str {
        match self {
            Adam8bitKernel::Portable => "portable build, threshold-table quantizer",
            Adam8bitKernel::Avx2 => "AVX2+FMA build, 8-lane scalar-load lookups, threshold-table quantizer",
            Adam8bitKernel::Avx512 => {
                "AVX-512 F/BW/VBMI: VBMI byte-permute dequantize, 16-lane step, 64-lane byte-permute quantizer"
            }
        }
    }
}

impl Adam8bit {
    /// Updates one row block: steps 1–6 of the module table on each of its scale blocks.
    /// Decides the decay and `lerp` branches once, and runs the body compiled for AVX2 and
    /// FMA when the CPU has them (only the instruction selection changes: every lane does the
    /// scalar operations in the scalar order, and Rust never contracts a multiply and an add
    /// into an FMA, so the bits are the same).
    fn update_row_block(&self, b: RowBlock, decay: Option<f32>, mo: &MomentCoeffs, s: &AdamScale) {
        let small = lerp_weight_is_small(mo.lerp_weight);
        let k = StepConsts {
            decay: decay.unwrap_or(1.0),
            mo,
            s,
        };
        match (decay.is_some(), small) {
            (true, true) => self.row_block_dispatch::<true, true>(b, k),
            (true, false) => self.row_block_dispatch::<true, false>(b, k),
            (false, true) => self.row_block_dispatch::<false, true>(b, k),
            (false, false) => self.row_block_dispatch::<false, false>(b, k),
        }
    }

    fn row_block_dispatch<const DECAY: bool, const SMALL: bool>(&self, b: RowBlock, k: StepConsts) {
        match self.kernel {
            #[cfg(target_arch = "x86_64")]
            Adam8bitKernel::Avx512 => {
                use crate::kernels::adam8bit_avx512::{row_block, Tables};
                let t = Tables {
                    planes: [&self.planes[0], &self.planes[1]],
                    index: [&self.lanes[0], &self.lanes[1]],
                };
                // SAFETY: `with_kernel` and `detect` choose Avx512 only where the CPU has
                // AVX-512 F/BW/VBMI; `step` builds the row block's slices as it requires.
                unsafe { row_block::<DECAY, SMALL>(b, k, &t) }
            }
            #[cfg(target_arch = "x86_64")]
            Adam8bitKernel::Avx2 => {
                // SAFETY: chosen only where the CPU has AVX2 and FMA.
                unsafe { self.row_block_avx2::<DECAY, SMALL>(b, k) }
            }
            _ => self.row_block::<DECAY, SMALL, false>(b, k),
        }
    }

    /// [`Adam8bit::row_block`] compiled with AVX2 and FMA enabled.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn row_block_avx2<const DECAY: bool, const SMALL: bool>(
        &self,
        b: RowBlock,
        k: StepConsts,
    ) {
        self.row_block::<DECAY, SMALL, true>(b, k)
    }

    /// A row block, scale block by scale block: its 32-element segments are dequantized,
    /// stepped and folded into the block's running maxima ([`segment_step`]), the new
    /// moments staying on the stack (2 KiB, in L1); then the block's scales are known and it
    /// is requantized. No closures here, so the whole body inherits
    /// [`Adam8bit::row_block_avx2`]'s target features. `AVX2`: called from there.
    #[inline(always)]
    fn row_block<const DECAY: bool, const SMALL: bool, const AVX2: bool>(
        &self,
        b: RowBlock,
        k: StepConsts,
    ) {
        let RowBlock {
            p,
            g,
            mc,
            vc,
            scale_m,
            scale_v,
        } = b;
        let (map_m, map_v) = (self.book_m.map(), self.book_v.map());
        let mut m_new = [0f32; SCALE_BLOCK];
        let mut v_new = [0f32; SCALE_BLOCK];
        for (blk, start) in (0..p.len()).step_by(SCALE_BLOCK).enumerate() {
            let len = SCALE_BLOCK.min(p.len() - start);
            let old = [decode_scale(scale_m[blk]), decode_scale(scale_v[blk])];
            let mut max_m = [0f32; LANES];
            let mut max_v = [0f32; LANES];
            for o in (0..len).step_by(TILE) {
                let e = start + o;
                let seg = Segment {
                    p: (&mut p[e..e + TILE]).try_into().unwrap(),
                    g: g[e..e + TILE].try_into().unwrap(),
                    mc: mc[e..e + TILE].try_into().unwrap(),
                    vc: vc[e..e + TILE].try_into().unwrap(),
                    m_new: (&mut m_new[o..o + TILE]).try_into().unwrap(),
                    v_new: (&mut v_new[o..o + TILE]).try_into().unwrap(),
                };
                segment_step::<DECAY, SMALL, AVX2>(
                    seg,
                    old,
                    [map_m, map_v],
                    k,
                    [&mut max_m, &mut max_v],
                );
            }
            let fold = |lanes: &[f32; LANES]| lanes.iter().fold(0f32, |a, &x| a.max(x));
            scale_m[blk] = encode_scale(fold(&max_m));
            scale_v[blk] = encode_scale(fold(&max_v));
            let r = start..start + len;
            self.book_m.quantize_scaled_slice(
                &m_new[..len],
                decode_scale(scale_m[blk]),
                SIGNED_ZERO_CODE,
                &mut mc[r.clone()],
            );
            self.book_v.quantize_scaled_slice(
                &v_new[..len],
                decode_scale(scale_v[blk]),
                UNSIGNED_ZERO_CODE,
                &mut vc[r.clone()],
            );
            keep_positive_nonzero(&v_new[..len], &mut vc[r]);
        }
    }
}

/// Which build of the row-block kernel [`Adam8bit::step`] runs on this CPU by default
/// ([`Adam8bitKernel::detect`]).
pub fn kernel_name() -> &'static str {
    Adam8bitKernel::detect().name()
}

/// Lanes of the running maxima (one AVX2 vector).
const LANES: usize = 8;

/// 32 consecutive elements of one scale block, and where their new moments go.
struct Segment<'a> {
    p: &'a mut [f32; TILE],
    g: &'a [f32; TILE],
    mc: &'a [u8; TILE],
    vc: &'a [u8; TILE],
    m_new: &'a mut [f32; TILE],
    v_new: &'a mut [f32; TILE],
}

/// Steps 1–5 of the module table on one segment: dequantize with the block's old scales,
/// decay, moments, update (each lane the scalar operations in the scalar order), and fold
/// `|m|` and `v` into the block's eight running maxima. The fold is a plain `>` select
/// (which compiles to `maxps`); it equals `f32::max` here because the maxima start at `+0.0`
/// and a NaN moment never replaces one (`NaN > a` is false, as `max` ignores NaN); and `max`
/// is exact, so the fold order changes no bit.
///
/// `AVX2` only when the CPU has AVX2 (the dequantizing lookups and the maxima's fold).
#[inline(always)]
fn segment_step<const DECAY: bool, const SMALL: bool, const AVX2: bool>(
    seg: Segment,
    [sm, sv]: [f32; 2],
    [map_m, map_v]: [&[f32; MAP_LEN]; 2],
    k: StepConsts,
    [mx_m, mx_v]: [&mut [f32; LANES]; 2],
) {
    let (w, b2, c2) = (k.mo.lerp_weight, k.mo.beta2, k.mo.one_minus_beta2);
    // Table lookups first, so that the arithmetic below vectorizes.
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: `AVX2` is set only on CPUs with AVX2 (see `row_block_dispatch`).
        unsafe {
            dequantize_32_avx2(seg.mc, sm, map_m, seg.m_new);
            dequantize_32_avx2(seg.vc, sv, map_v, seg.v_new);
        }
    }
    if !AVX2 || cfg!(not(target_arch = "x86_64")) {
        dequantize_slice(seg.mc, sm, map_m, seg.m_new);
        dequantize_slice(seg.vc, sv, map_v, seg.v_new);
    }
    for i in 0..TILE {
        let g = seg.g[i];
        let p0 = if DECAY {
            decay_elem(seg.p[i], k.decay)
        } else {
            seg.p[i]
        };
        let m = if SMALL {
            lerp_small_elem(seg.m_new[i], g, w)
        } else {
            lerp_large_elem(seg.m_new[i], g, w)
        };
        let v = ema_sq_elem(seg.v_new[i], g, b2, c2);
        seg.p[i] = apply_folded_adam_elem(p0, m, v, k.s);
        seg.m_new[i] = m;
        seg.v_new[i] = v;
    }
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: as above.
        return unsafe { fold_maxima_avx2(seg.m_new, seg.v_new, mx_m, mx_v) };
    }
    for c in 0..TILE / LANES {
        for l in 0..LANES {
            let (m, v) = (seg.m_new[c * LANES + l].abs(), seg.v_new[c * LANES + l]);
            mx_m[l] = if m > mx_m[l] { m } else { mx_m[l] };
            mx_v[l] = if v > mx_v[l] { v } else { mx_v[l] };
        }
    }
}

/// [`segment_step`]'s fold in AVX2 registers: `vmaxps(x, acc)` is `if x > acc { x } else
/// { acc }`, the scalar select, lane for lane.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn fold_maxima_avx2(
    m: &[f32; TILE],
    v: &[f32; TILE],
    mx_m: &mut [f32; LANES],
    mx_v: &mut [f32; LANES],
) {
    use std::arch::x86_64::*;
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    // SAFETY: every load and store is 8 floats within its array (TILE = 4 · LANES).
    unsafe {
        let (mut am, mut av) = (
            _mm256_loadu_ps(mx_m.as_ptr()),
            _mm256_loadu_ps(mx_v.as_ptr()),
        );
        for c in (0..TILE).step_by(LANES) {
            let x = _mm256_and_ps(_mm256_loadu_ps(m.as_ptr().add(c)), abs);
            am = _mm256_max_ps(x, am);
            av = _mm256_max_ps(_mm256_loadu_ps(v.as_ptr().add(c)), av);
        }
        _mm256_storeu_ps(mx_m.as_mut_ptr(), am);
        _mm256_storeu_ps(mx_v.as_mut_ptr(), av);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 + FMA build of a row block and the portable one give the same bits (the
    /// portable one never runs on an AVX2 CPU otherwise).
    #[test]
    fn portable_and_avx2_row_blocks_agree_bitwise() {
        #[cfg(target_arch = "x86_64")]
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            println!("skipped: this CPU has no AVX2 + FMA, only the portable build runs");
            return;
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            println!("skipped: not x86_64, only the portable build runs");
            return;
        }
        #[cfg(target_arch = "x86_64")]
        for (rows, cols) in [(32, 320), (8, 96), (4, 96)] {
            let opt = Adam8bit::new(Adam8bitConfig::default()).unwrap();
            let n = rows * cols;
            let wave = |k: usize, s: f32| ((k * 7919 % 1013) as f32 / 1013.0 - 0.4) * s;
            let mut g: Vec<f32> = (0..n).map(|k| wave(k, 1e-2)).collect();
            // Non-finite and huge moments: the block maxima must skip NaN as the scalar
            // fold does (a NaN 8 elements after the block's largest `|m|`, in its lane),
            // and saturate alike.
            let special = [
                (5, f32::NAN),
                (200, -1e30),
                (208, f32::NAN),
                (300, f32::INFINITY),
            ];
            for (i, x) in special {
                g[i] = x;
            }
            let mo = MomentCoeffs::new(0.9, 0.999);
            let s = AdamScale::new(1e-3, 0.9, 0.999, 1e-8, 3);
            let k = StepConsts {
                decay: 0.999,
                mo: &mo,
                s: &s,
            };
            let run = |avx2: bool| {
                let mut p: Vec<f32> = (0..n).map(|k| 1.0 + wave(k, 1.0)).collect();
                let mut mc: Vec<u8> = (0..n).map(|k| (k * 31 % 256) as u8).collect();
                let mut vc: Vec<u8> = (0..n).map(|k| (k * 17 % 256) as u8).collect();
                let scales = (rows * cols).div_ceil(SCALE_BLOCK);
                let scale = |j: usize, s: f32| encode_scale(s * (j + 1) as f32);
                let mut am: Vec<u16> = (0..scales).map(|j| scale(j, 0.01)).collect();
                let mut av: Vec<u16> = (0..scales).map(|j| scale(j, 1e-4)).collect();
                am[scales - 1] = 0; // a zero scale: every code of the block means 0
                let b = RowBlock {
                    p: &mut p,
                    g: &g,
                    mc: &mut mc,
                    vc: &mut vc,
                    scale_m: &mut am,
                    scale_v: &mut av,
                };
                if avx2 {
                    // SAFETY: checked above.
                    unsafe { opt.row_block_avx2::<true, true>(b, k) };
                } else {
                    opt.row_block::<true, true, false>(b, k);
                }
                let bits: Vec<u32> = p.iter().map(|x| x.to_bits()).collect();
                (bits, am, av, mc, vc)
            };
            assert!(run(true) == run(false), "{rows}×{cols}: the builds differ");
        }
    }
}
