//! Blocked Shampoo's device backend: the host step's blocks and scalars (`checked_blocks`,
//! `StepScalars` in [`crate::shampoo`]) on device memory, through `kernels/shampoo.cu`,
//! bitwise equal to the host step:
//!
//! | steps | on the device |
//! |---|---|
//! | 3, 5 | `shampoo_moments`, one launch per piece (padding untouched): `m`, `v` and `Ḡ` |
//! | 2 | `shampoo_mul_abt`, one launch for every block's `L ← β₂·L + w·G·Gᵀ` and one for every `R ← β₂·R + w·Gᵀ·G`, in the host's `f64` lanes |
//! | 4 | on the host: the factors downloaded, rooted by the host step's code, the roots uploaded |
//! | 7 | `shampoo_mul_abt`, three launches: every `L·Ḡ` into `P_s`'s buffer; then `(L·Ḡ)·R` of the blocks with both factors into `Ḡ`'s place, and `Ḡ·R` of those with `R` only into `P_s`'s buffer |
//! | 6–9 | `shampoo_apply`, one thread block per Shampoo block: the grafting direction from `g`, `m` and `v`, its norms in the host's lanes, the update |
//!
//! So a step makes 5 product launches whatever the number of blocks (each launch a group of
//! products, one per grid `z`). Roots are the only host work: every `precondition_frequency`
//! steps the factors and roots travel to the host and the roots back (8 bytes per factor
//! element down, 4 up); the rest of a step stays on the device. The step's buffers (`Ḡ` and
//! `P_s`, 4 bytes per shard element each, and the launch tables) are kept between steps by the
//! [`Shampoo`], so a step allocates nothing once the first has run.

use ragged::cuda::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use ragged::cuda::{count, elementwise, guarded, ops, Device, Scratch, SHAMPOO};
use ragged::optim::LocalShard;
use ragged::storage::View;
use ragged::{Error, Result};

use super::{device_array, device_view};
use crate::shampoo::{non_finite, Block, Direction, Shampoo, ShampooState, StepScalars};

/// Entry points of `kernels/shampoo.cu`.
pub const SHAMPOO_MOMENTS: &str = "shampoo_moments";
pub const SHAMPOO_MUL_ABT: &str = "shampoo_mul_abt";
pub const SHAMPOO_APPLY: &str = "shampoo_apply";

/// Output tile side of `shampoo_mul_abt` (`SHAMPOO_TILE`).
const TILE: usize = 32;
/// Threads per block of `shampoo_mul_abt` and `shampoo_apply` (their `__launch_bounds__`).
const THREADS: u32 = 256;
/// Words per block of `shampoo_apply`'s table (`SHAMPOO_TABLE_WORDS`).
const TABLE_WORDS: usize = 5;
/// Words per product of `shampoo_mul_abt`'s table (`SHAMPOO_PRODUCT_WORDS`).
const PRODUCT_WORDS: usize = 11;
/// The most thread blocks along a grid's `y` and `z` (CUDA's limits): the most rows of a
/// product over 32, and the most products of one launch.
const GRID_YZ_MAX: usize = 65_535;

/// The device buffers of a Shampoo step, kept between steps (module doc).
#[derive(Default)]
pub(crate) struct DeviceWork {
    gbar: Scratch<f32>,
    ps: Scratch<f32>,
    products: Scratch<u64>,
    table: Scratch<u64>,
    count: Scratch<u64>,
}

/// Shampoo's step on device memory; the caller checked every length (`blocks` is the shard's
/// layout).
pub(crate) fn step(
    opt: &Shampoo,
    state: &mut ShampooState,
    shard: &LocalShard,
    blocks: &[Block],
    params: &mut CudaViewMut<'_, f32>,
    grads: View<'_, f32>,
) -> Result<()> {
    let grads = device_view(OP, grads)?;
    let (dev, _) = device_array(OP, &mut state.m)?;
    for s in [&mut state.v, &mut state.factors, &mut state.roots] {
        device_array(OP, s)?;
    }
    let mut work = opt.device_work.take();
    let out = step_in(opt, &dev, state, shard, blocks, params, &grads, &mut work);
    opt.device_work.put(work);
    out
}

const OP: &str = "Shampoo::step (device)";

#[allow(clippy::too_many_arguments)]
fn step_in(
    opt: &Shampoo,
    dev: &Device,
    state: &mut ShampooState,
    shard: &LocalShard,
    blocks: &[Block],
    params: &mut CudaViewMut<'_, f32>,
    grads: &CudaView<'_, f32>,
    work: &mut DeviceWork,
) -> Result<()> {
    let bad = {
        let mut c = work.count.upload(dev, &[0u64])?;
        ops::add_non_finite(dev, grads, &mut c)?;
        dev.download(&c)?[0]
    };
    if bad > 0 {
        return Err(non_finite(OP, format!("{bad} non-finite gradients")));
    }
    let t = crate::common::next_step(OP, state.step)?;
    let sc = opt.scalars(t);
    let mut k = Kernels::new(dev, &mut work.products)?;
    let (_, m) = device_array(OP, &mut state.m)?;
    let (_, v) = device_array(OP, &mut state.v)?;
    let mut gbar = work.gbar.view_mut(dev, shard.len)?;
    for piece in &shard.pieces {
        let r = piece.offset..piece.offset + piece.range.len();
        k.moments(&sc, &grads.slice(r.clone()), m, v, &mut gbar, r)?;
    }
    let (_, factors) = device_array(OP, &mut state.factors)?;
    let mut factors = factors.slice_mut(..);
    for side in [Side::Left, Side::Right] {
        let group = factor_products(blocks, side);
        k.mul_abt(grads, grads, &mut factors, &group, sc.factor_decay.into())?;
    }
    state.step = t;
    if sc.roots_now {
        state.root_failures += roots_on_host(opt, dev, state, blocks, &sc)?;
    }
    // Reserved at every step, used or not, so that no later step allocates.
    let mut ps = work.ps.view_mut(dev, shard.len)?;
    if sc.direction != Direction::GraftOnly {
        let (_, roots) = device_array(OP, &mut state.roots)?;
        let roots = roots.as_view();
        let [left, both, right] = preconditioner_products(blocks);
        k.mul_abt(&roots, &gbar.as_view(), &mut ps, &left, Epilogue::Store)?;
        k.mul_abt(&ps.as_view(), &roots, &mut gbar, &both, Epilogue::Store)?;
        k.mul_abt(&gbar.as_view(), &roots, &mut ps, &right, Epilogue::Store)?;
    }
    let table = work.table.upload(dev, &block_table(blocks))?;
    let (_, m) = device_array(OP, &mut state.m)?;
    let (_, v) = device_array(OP, &mut state.v)?;
    let bufs = Bufs {
        grads,
        m: m.as_view(),
        v: v.as_view(),
        ps: ps.as_view(),
        pp: gbar.as_view(),
    };
    k.apply(params, &bufs, &table, blocks.len(), &sc)
}

/// Which factor of a block.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Left,
    Right,
}

/// Step 2's products of one side: `L += G·Gᵀ` (rows of `G` against rows) or `R += Gᵀ·G`
/// (columns against columns), into the block's factor.
fn factor_products(blocks: &[Block], side: Side) -> Vec<Product> {
    let mut out = Vec::new();
    for b in blocks {
        let (n, c) = (b.rows, b.cols);
        let left = if b.has_left() { n * n } else { 0 };
        let p = match side {
            Side::Left if b.has_left() => {
                let g = Operand::new(b.at, b.stride, 1);
                Product::new(g, g, b.factor_at, n, [n, n, c])
            }
            Side::Right if b.has_right() => {
                let gt = Operand::new(b.at, 1, b.stride);
                Product::new(gt, gt, b.factor_at + left, c, [c, c, n])
            }
            _ => continue,
        };
        out.push(p);
    }
    out
}

/// Step 7's products, in three groups: `L·Ḡ` of every block with `L` into `P_s`'s buffer
/// (the result for a block without `R`); `(L·Ḡ)·R` of the blocks with both factors, from that
/// buffer into `Ḡ`'s place (which only that block's products read); `Ḡ·R` of the blocks with
/// `R` only into `P_s`'s buffer. [`block_table`] says where each block's `P_s` ends up.
fn preconditioner_products(blocks: &[Block]) -> [Vec<Product>; 3] {
    let [mut left, mut both, mut right] = [Vec::new(), Vec::new(), Vec::new()];
    for b in blocks {
        let (n, c) = (b.rows, b.cols);
        let in_shard = Operand::new(b.at, b.stride, 1);
        let r = Operand::new(b.factor_at + if b.has_left() { n * n } else { 0 }, c, 1);
        if b.has_left() {
            // (L·Ḡ)[i][j] = Σ_k L[i][k]·Ḡ[k][j]: B(j, k) = Ḡ[k][j].
            let l = Operand::new(b.factor_at, n, 1);
            let g_cols = Operand::new(b.at, 1, b.stride);
            left.push(Product::new(l, g_cols, b.at, b.stride, [n, c, n]));
        }
        if b.has_right() {
            let group = if b.has_left() { &mut both } else { &mut right };
            group.push(Product::new(in_shard, r, b.at, b.stride, [n, c, c]));
        }
    }
    [left, both, right]
}

/// `shampoo_apply`'s table: per block `at, stride, rows, cols`, and 1 where `P_s` is in `Ḡ`'s
/// buffer (a block with both factors, and a block with none, whose `P_s` is `Ḡ`), else 0.
fn block_table(blocks: &[Block]) -> Vec<u64> {
    let mut table = Vec::with_capacity(TABLE_WORDS * blocks.len());
    for b in blocks {
        let in_gbar = u64::from(b.has_left() == b.has_right());
        table.extend([b.at, b.stride, b.rows, b.cols].map(|x| x as u64));
        table.push(in_gbar);
    }
    table
}

/// Step 4: the factors and roots to the host, rooted by the host step's code, the roots back.
/// Returns how many roots failed (each kept its previous value).
fn roots_on_host(
    opt: &Shampoo,
    dev: &Device,
    state: &mut ShampooState,
    blocks: &[Block],
    sc: &StepScalars,
) -> Result<u64> {
    let factors = state.factors.to_vec()?;
    let mut roots = state.roots.to_vec()?;
    let failed = opt.compute_all_roots(blocks, &factors, &mut roots, sc.factor_bc2);
    let (_, r) = device_array(OP, &mut state.roots)?;
    dev.upload_into(&roots, r)?;
    Ok(failed)
}

/// One operand of a product: element `(i, k)` at `at + i·row + k·k_step`.
#[derive(Clone, Copy)]
struct Operand {
    at: usize,
    row: usize,
    k_step: usize,
}

impl Operand {
    fn new(at: usize, row: usize, k_step: usize) -> Self {
        Operand { at, row, k_step }
    }

    /// The offset of its last element for `rows` rows of `kn` terms.
    fn last(&self, rows: usize, kn: usize) -> usize {
        self.at + (rows - 1) * self.row + kn.saturating_sub(1) * self.k_step
    }
}

/// One product of a `shampoo_mul_abt` group: `out[out_at + i·ldo + j]` from
/// `Σ_k A(i, k)·B(j, k)` for `i < n`, `j < m`, `k < kn`.
#[derive(Clone, Copy)]
struct Product {
    a: Operand,
    b: Operand,
    out_at: usize,
    ldo: usize,
    n: usize,
    m: usize,
    kn: usize,
}

impl Product {
    fn new(a: Operand, b: Operand, out_at: usize, ldo: usize, [n, m, kn]: [usize; 3]) -> Self {
        Product {
            a,
            b,
            out_at,
            ldo,
            n,
            m,
            kn,
        }
    }

    /// Its words in the kernel's table, after checking that it stays inside its buffers and
    /// within one launch's grid.
    fn words(&self, [a, b, out]: [usize; 3]) -> Result<[u64; PRODUCT_WORDS]> {
        let (n, m, kn) = (self.n, self.m, self.kn);
        let fits = self.a.last(n, kn) < a
            && self.b.last(m, kn) < b
            && self.out_at + (n - 1) * self.ldo + m <= out;
        if !fits || n.div_ceil(TILE) > GRID_YZ_MAX || kn > u32::MAX as usize {
            return Err(Error::BadInput {
                op: OP,
                what: format!("{n} × {m} × {kn} product"),
                reason: "its operands exceed their buffers, or it has more rows than one launch \
                         covers (65535 × 32)"
                    .into(),
            });
        }
        let (a, b) = (self.a, self.b);
        Ok([
            a.at,
            a.row,
            a.k_step,
            b.at,
            b.row,
            b.k_step,
            self.out_at,
            self.ldo,
            n,
            m,
            kn,
        ]
        .map(|x| x as u64))
    }
}

/// What `shampoo_mul_abt` does with each sum `s` (`mode`, `beta2`, `w` in the kernel).
#[derive(Clone, Copy)]
enum Epilogue {
    Store,
    Add,
    Decay { beta2: f32, w: f32 },
}

impl From<(Option<f32>, f32)> for Epilogue {
    /// The factors' update from [`StepScalars::factor_decay`]: decayed, or added when `β₂ = 1`.
    fn from(decay: (Option<f32>, f32)) -> Self {
        match decay {
            (Some(beta2), w) => Epilogue::Decay { beta2, w },
            (None, _) => Epilogue::Add,
        }
    }
}

/// What `shampoo_apply` reads: the gradients, `m`, `v` (recomputing `Ḡ` and the grafting
/// direction) and the two buffers `P_s` may be in (module doc).
struct Bufs<'a, 'g> {
    grads: &'a CudaView<'g, f32>,
    m: CudaView<'a, f32>,
    v: CudaView<'a, f32>,
    ps: CudaView<'a, f32>,
    pp: CudaView<'a, f32>,
}

/// The grafting scalars as the kernels take them (`graft`, `beta2`, `one_minus_beta2`, `eps`,
/// `bias2`, `bc2`): flags 0 or 1, and scalars the kernels do not read without their flag.
#[derive(Clone, Copy)]
struct GraftArgs {
    on: i32,
    beta2: f32,
    w: f32,
    eps: f32,
    bias2: i32,
    bc2: f32,
}

impl GraftArgs {
    fn new(sc: &StepScalars) -> Self {
        let Some((beta2, w, eps, bc2)) = sc.graft else {
            return GraftArgs {
                on: 0,
                beta2: 1.0,
                w: 1.0,
                eps: 1.0,
                bias2: 0,
                bc2: 1.0,
            };
        };
        let (bias2, bc2) = flag(bc2);
        GraftArgs {
            on: 1,
            beta2,
            w,
            eps,
            bias2,
            bc2,
        }
    }
}

/// The kernels of `kernels/shampoo.cu` on one device, and the buffer of the product tables.
struct Kernels<'d, 'w> {
    dev: &'d Device,
    moments: CudaFunction,
    mul_abt: CudaFunction,
    apply: CudaFunction,
    tables: &'w mut Scratch<u64>,
}

impl<'d, 'w> Kernels<'d, 'w> {
    fn new(dev: &'d Device, tables: &'w mut Scratch<u64>) -> Result<Self> {
        Ok(Kernels {
            dev,
            moments: dev.function(&SHAMPOO, SHAMPOO_MOMENTS)?,
            mul_abt: dev.function(&SHAMPOO, SHAMPOO_MUL_ABT)?,
            apply: dev.function(&SHAMPOO, SHAMPOO_APPLY)?,
            tables,
        })
    }
    /// Steps 3 and 5 on the run `r` of the shard (`g` is its gradient): `m`, `v` and `Ḡ`.
    fn moments(
        &self,
        sc: &StepScalars,
        g: &CudaView<'_, f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        gbar: &mut CudaViewMut<'_, f32>,
        r: std::ops::Range<usize>,
    ) -> Result<()> {
        let len = r.len();
        if len == 0 {
            return Ok(());
        }
        let (momentum, w1) = flag(sc.momentum);
        let (bias1, bc1) = flag(sc.bc1);
        let ga = GraftArgs::new(sc);
        let mut m = m.slice_mut(r.clone());
        let mut gbar = gbar.slice_mut(r.clone());
        // Without grafting `v` is empty (a live one-element allocation that says it holds
        // none: `Device::zeros`) and not read.
        let mut v = if ga.on == 1 {
            v.slice_mut(r)
        } else {
            v.slice_mut(0..0)
        };
        let n = count(len);
        // SAFETY: `shampoo_moments` reads `n` elements of `g` and writes `n` of `m` and `gbar`
        // (each a slice of exactly `n`), and of `v` only with `graft` = 1 (then `n` too).
        guarded("shampoo_moments launch", || unsafe {
            self.dev
                .stream()
                .launch_builder(&self.moments)
                .arg(g)
                .arg(&mut m)
                .arg(&mut v)
                .arg(&mut gbar)
                .arg(&n)
                .arg(&momentum)
                .arg(&w1)
                .arg(&bias1)
                .arg(&bc1)
                .arg(&ga.on)
                .arg(&ga.beta2)
                .arg(&ga.w)
                .launch(elementwise(len))
        })
        .map(drop)
    }

    /// One launch per 65535 products of `group` (the grid's `z`), each product's tiles on
    /// `x` and `y`; every product reads `a` and `b` and writes its own elements of `out`.
    fn mul_abt(
        &mut self,
        a: &CudaView<'_, f32>,
        b: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, f32>,
        group: &[Product],
        epilogue: Epilogue,
    ) -> Result<()> {
        let (mode, beta2, w) = match epilogue {
            Epilogue::Store => (0i32, 0.0f32, 0.0f32),
            Epilogue::Add => (1, 0.0, 0.0),
            Epilogue::Decay { beta2, w } => (2, beta2, w),
        };
        let lens = [a.len(), b.len(), out.len()];
        for chunk in group.chunks(GRID_YZ_MAX) {
            let mut words = Vec::with_capacity(PRODUCT_WORDS * chunk.len());
            for p in chunk {
                words.extend(p.words(lens)?);
            }
            let tiles = |f: fn(&Product) -> usize| {
                chunk.iter().map(|p| f(p).div_ceil(TILE)).max().unwrap_or(0) as u32
            };
            let cfg = LaunchConfig {
                grid_dim: (tiles(|p| p.m), tiles(|p| p.n), chunk.len() as u32),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let uploaded = self.tables.upload(self.dev, &words)?;
            let table = uploaded.as_view();
            // SAFETY: product z of `table` reads A(i, k) at `a[a_at + i·a_row + k·a_k]` for
            // i < n, k < kn, B likewise, and writes `out[out_at + i·ldo + j]` for i < n,
            // j < m: the last of each lies inside its buffer (`Product::words`). The table
            // holds `PRODUCT_WORDS` words per product of the grid's `z`.
            guarded("shampoo_mul_abt launch", || unsafe {
                self.dev
                    .stream()
                    .launch_builder(&self.mul_abt)
                    .arg(a)
                    .arg(b)
                    .arg(&mut *out)
                    .arg(&table)
                    .arg(&mode)
                    .arg(&beta2)
                    .arg(&w)
                    .launch(cfg)
            })?;
        }
        Ok(())
    }

    /// Steps 6–9 of every block, one thread block each.
    fn apply(
        &self,
        params: &mut CudaViewMut<'_, f32>,
        bufs: &Bufs<'_, '_>,
        table: &CudaViewMut<'_, u64>,
        blocks: usize,
        sc: &StepScalars,
    ) -> Result<()> {
        if blocks == 0 {
            return Ok(());
        }
        let mode: i32 = match sc.direction {
            Direction::GraftOnly => 0,
            Direction::Shampoo => 1,
            Direction::Grafted => 2,
        };
        let (momentum, _) = flag(sc.momentum);
        let (bias1, bc1) = flag(sc.bc1);
        let ga = GraftArgs::new(sc);
        let (decay, wd) = flag(sc.wd);
        let cfg = LaunchConfig {
            grid_dim: (u32::try_from(blocks).map_err(|_| too_many(blocks))?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let table = table.as_view();
        // SAFETY: `shampoo_apply` reads and writes the elements of the table's blocks, which
        // lie inside the shard (`Shampoo::blocks`), of `params`, `grads`, `m`, `ps` and `pp`
        // (each shard-long) and, with grafting, of `v` (then shard-long too); it reads
        // `TABLE_WORDS` words per block of `table`.
        guarded("shampoo_apply launch", || unsafe {
            self.dev
                .stream()
                .launch_builder(&self.apply)
                .arg(params)
                .arg(bufs.grads)
                .arg(&bufs.m)
                .arg(&bufs.v)
                .arg(&bufs.ps)
                .arg(&bufs.pp)
                .arg(&table)
                .arg(&mode)
                .arg(&momentum)
                .arg(&bias1)
                .arg(&bc1)
                .arg(&ga.on)
                .arg(&ga.bias2)
                .arg(&ga.bc2)
                .arg(&ga.eps)
                .arg(&sc.neg_lr)
                .arg(&decay)
                .arg(&wd)
                .launch(cfg)
        })
        .map(drop)
    }
}

/// A kernel's flag and scalar: `(1, x)` for `Some(x)`, `(0, 0)` for `None`.
fn flag(x: Option<f32>) -> (i32, f32) {
    x.map_or((0, 0.0), |x| (1, x))
}

fn too_many(blocks: usize) -> Error {
    Error::BadInput {
        op: "Shampoo::step (device)",
        what: format!("{blocks} blocks"),
        reason: "more Shampoo blocks than one launch covers".into(),
    }
}
