//! Blocked Shampoo's device backend: the host step's blocks and scalars (`checked_blocks`,
//! `StepScalars` in [`crate::shampoo`]) on device memory, through `kernels/shampoo.cu`,
//! bitwise equal to the host step:
//!
//! | steps | on the device |
//! |---|---|
//! | 3, 5 | `shampoo_moments`, one launch per piece (padding untouched): `m`, `v` and `Ḡ` |
//! | 2 | `shampoo_mul_abt` per factor: `G·Gᵀ`, `Gᵀ·G` in the host's `f64` lanes, decayed into the factor |
//! | 4 | on the host: the factors downloaded, rooted by the host step's code, the roots uploaded |
//! | 7 | `shampoo_mul_abt`: `L·Ḡ` (into a block-sized buffer when `R` follows), then `·R` |
//! | 6–9 | `shampoo_apply`, one thread block per Shampoo block: the grafting direction from `Ḡ` and `v`, its norms in the host's lanes, the update |
//!
//! Roots are the only host work: every `precondition_frequency` steps the factors and roots
//! travel to the host and the roots back (8 bytes per factor element down, 4 up), the rest of
//! a step stays on the device. The step's buffers (`Ḡ` and `P_s`, 4 bytes per shard element
//! each; one block's `L·Ḡ`; the block table) are kept between steps by the [`Shampoo`], so a
//! step allocates nothing once the first has run.

use ragged::cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
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
/// The most thread blocks along a grid's `y` (CUDA's limit), so the most rows of a product.
const GRID_Y_MAX: usize = 65_535;

/// The device buffers of a Shampoo step, kept between steps (module doc).
#[derive(Default)]
pub(crate) struct DeviceWork {
    gbar: Scratch<f32>,
    ps: Scratch<f32>,
    left: Scratch<f32>,
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
    const OP: &str = "Shampoo::step (device)";
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
    const OP: &str = "Shampoo::step (device)";
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
    let n = shard.len;
    let kernels = Kernels::new(dev)?;
    let (_, m) = device_array(OP, &mut state.m)?;
    let (_, v) = device_array(OP, &mut state.v)?;
    let (_, factors) = device_array(OP, &mut state.factors)?;
    let mut gbar = work.gbar.view_mut(dev, n)?;
    for piece in &shard.pieces {
        let r = piece.offset..piece.offset + piece.range.len();
        kernels.moments(&sc, &grads.slice(r.clone()), m, v, &mut gbar, r)?;
    }
    for b in blocks {
        kernels.update_factors(b, grads, factors, &sc)?;
    }
    state.step = t;
    if sc.roots_now {
        state.root_failures += roots_on_host(opt, dev, state, blocks, &sc)?;
    }
    let (_, roots) = device_array(OP, &mut state.roots)?;
    // Reserved at every step, used or not, so that no later step allocates.
    let mut ps = work.ps.view_mut(dev, n)?;
    let most = blocks.iter().map(|b| b.rows * b.cols).max().unwrap_or(0);
    let mut left = work.left.view_mut(dev, most)?;
    if sc.direction != Direction::GraftOnly {
        for b in blocks {
            kernels.precondition(b, &gbar, roots, &mut ps, &mut left)?;
        }
    }
    let table = block_table(blocks);
    let table = work.table.upload(dev, &table)?;
    let (_, v) = device_array(OP, &mut state.v)?;
    let bufs = [&gbar, &ps].map(|b| b.as_view());
    kernels.apply(params, bufs, v, &table, blocks.len(), &sc)
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

/// Step 4: the factors and roots to the host, [`Shampoo::compute_all_roots`], the roots back.
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
    let (_, r) = device_array("Shampoo::step (device)", &mut state.roots)?;
    dev.upload_into(&roots, r)?;
    Ok(failed)
}

/// `shampoo_apply`'s table: per block `at, stride, rows, cols`, and 1 where `P_s` is `Ḡ`
/// itself (a block with no factor), else 0.
fn block_table(blocks: &[Block]) -> Vec<u64> {
    let mut table = Vec::with_capacity(TABLE_WORDS * blocks.len());
    for b in blocks {
        let no_factor = u64::from(b.order() == 0);
        table.extend([b.at, b.stride, b.rows, b.cols].map(|x| x as u64));
        table.push(no_factor);
    }
    table
}

/// One operand of `shampoo_mul_abt`: element `(i, k)` at `at + i·row + k·k_step`.
#[derive(Clone, Copy)]
struct Operand {
    at: usize,
    row: usize,
    k_step: usize,
}

/// What `shampoo_mul_abt` does with each sum `s` (`mode`, `beta2`, `w` in the kernel).
#[derive(Clone, Copy)]
enum Epilogue {
    Store,
    Add,
    Decay { beta2: f32, w: f32 },
}

/// The kernels of `kernels/shampoo.cu` on one device.
struct Kernels<'d> {
    dev: &'d Device,
    moments: ragged::cuda::cudarc::driver::CudaFunction,
    mul_abt: ragged::cuda::cudarc::driver::CudaFunction,
    apply: ragged::cuda::cudarc::driver::CudaFunction,
}

impl<'d> Kernels<'d> {
    fn new(dev: &'d Device) -> Result<Self> {
        Ok(Kernels {
            dev,
            moments: dev.function(&SHAMPOO, SHAMPOO_MOMENTS)?,
            mul_abt: dev.function(&SHAMPOO, SHAMPOO_MUL_ABT)?,
            apply: dev.function(&SHAMPOO, SHAMPOO_APPLY)?,
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

    /// Step 2 on one block: `L ← β₂·L + w·G·Gᵀ`, `R ← β₂·R + w·Gᵀ·G` (read from `grads`).
    fn update_factors(
        &self,
        b: &Block,
        grads: &CudaView<'_, f32>,
        factors: &mut CudaSlice<f32>,
        sc: &StepScalars,
    ) -> Result<()> {
        let epilogue = match sc.factor_decay {
            (Some(beta2), w) => Epilogue::Decay { beta2, w },
            (None, _) => Epilogue::Add,
        };
        let mut at = b.factor_at;
        if b.has_left() {
            let g = Operand {
                at: b.at,
                row: b.stride,
                k_step: 1,
            };
            let mut out = factors.slice_mut(at..at + b.rows * b.rows);
            self.mul_abt(
                grads,
                g,
                grads,
                g,
                &mut out,
                b.rows,
                [b.rows, b.rows, b.cols],
                epilogue,
            )?;
            at += b.rows * b.rows;
        }
        if b.has_right() {
            let gt = Operand {
                at: b.at,
                row: 1,
                k_step: b.stride,
            };
            let mut out = factors.slice_mut(at..at + b.cols * b.cols);
            self.mul_abt(
                grads,
                gt,
                grads,
                gt,
                &mut out,
                b.cols,
                [b.cols, b.cols, b.rows],
                epilogue,
            )?;
        }
        Ok(())
    }

    /// Step 7's `P_s` of one block into `ps` at the block's elements: `L·Ḡ` (into `left`,
    /// row-major, when `R` follows), then `·R`. A block with no factor is left alone (the
    /// table points `shampoo_apply` at `Ḡ`).
    fn precondition(
        &self,
        b: &Block,
        gbar: &CudaViewMut<'_, f32>,
        roots: &CudaSlice<f32>,
        ps: &mut CudaViewMut<'_, f32>,
        left: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let (n, c) = (b.rows, b.cols);
        let in_shard = |at| Operand {
            at,
            row: b.stride,
            k_step: 1,
        };
        let gbar = gbar.as_view();
        let roots = roots.as_view();
        let r_at = b.factor_at + if b.has_left() { n * n } else { 0 };
        let r = Operand {
            at: r_at,
            row: c,
            k_step: 1,
        };
        if b.has_left() {
            // (L·Ḡ)[i][j] = Σ_k L[i][k]·Ḡ[k][j]: B(j, k) = Ḡ[k][j].
            let l = Operand {
                at: b.factor_at,
                row: n,
                k_step: 1,
            };
            let g_cols = Operand {
                at: b.at,
                row: 1,
                k_step: b.stride,
            };
            if !b.has_right() {
                let mut out = ps.slice_mut(b.at..);
                return self.mul_abt(
                    &roots,
                    l,
                    &gbar,
                    g_cols,
                    &mut out,
                    b.stride,
                    [n, c, n],
                    Epilogue::Store,
                );
            }
            let mut out = left.slice_mut(0..n * c);
            self.mul_abt(
                &roots,
                l,
                &gbar,
                g_cols,
                &mut out,
                c,
                [n, c, n],
                Epilogue::Store,
            )?;
            let x = Operand {
                at: 0,
                row: c,
                k_step: 1,
            };
            let mut out = ps.slice_mut(b.at..);
            return self.mul_abt(
                &left.as_view(),
                x,
                &roots,
                r,
                &mut out,
                b.stride,
                [n, c, c],
                Epilogue::Store,
            );
        }
        if b.has_right() {
            let mut out = ps.slice_mut(b.at..);
            return self.mul_abt(
                &gbar,
                in_shard(b.at),
                &roots,
                r,
                &mut out,
                b.stride,
                [n, c, c],
                Epilogue::Store,
            );
        }
        Ok(())
    }

    /// `out[i·ldo + j] ← epilogue(Σ_k A(i, k)·B(j, k))` for `i < n`, `j < m`, `k < kn`
    /// (`[n, m, kn]`), in the host's `f64` lanes.
    #[allow(clippy::too_many_arguments)]
    fn mul_abt(
        &self,
        a: &CudaView<'_, f32>,
        ao: Operand,
        b: &CudaView<'_, f32>,
        bo: Operand,
        out: &mut CudaViewMut<'_, f32>,
        ldo: usize,
        [n, m, kn]: [usize; 3],
        epilogue: Epilogue,
    ) -> Result<()> {
        const OP: &str = "Shampoo::step (device product)";
        if n == 0 || m == 0 {
            return Ok(());
        }
        let last =
            |o: Operand, rows: usize| o.at + (rows - 1) * o.row + kn.saturating_sub(1) * o.k_step;
        let fits = last(ao, n) < a.len() && last(bo, m) < b.len() && (n - 1) * ldo + m <= out.len();
        let dims = [n, m, kn].map(u32::try_from);
        if !fits || n.div_ceil(TILE) > GRID_Y_MAX || dims.iter().any(|d| d.is_err()) {
            return Err(Error::BadInput {
                op: OP,
                what: format!("{n} × {m} × {kn} product"),
                reason: "its operands exceed their buffers, or it has more rows than one launch \
                         covers (65535 × 32)"
                    .into(),
            });
        }
        let [n32, m32, k32] = dims.map(|d| d.unwrap_or(0));
        let (mode, beta2, w) = match epilogue {
            Epilogue::Store => (0i32, 0.0f32, 0.0f32),
            Epilogue::Add => (1, 0.0, 0.0),
            Epilogue::Decay { beta2, w } => (2, beta2, w),
        };
        let a = a.slice(ao.at..);
        let b = b.slice(bo.at..);
        let [a_row, a_k, b_row, b_k, ldo] = [ao.row, ao.k_step, bo.row, bo.k_step, ldo].map(count);
        let cfg = LaunchConfig {
            grid_dim: (m.div_ceil(TILE) as u32, n.div_ceil(TILE) as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `shampoo_mul_abt` reads A(i, k) at `a[i·a_row + k·a_k]` for i < n, k < kn,
        // B likewise, and writes `out[i·ldo + j]` for i < n, j < m: the last of each lies
        // inside its slice (checked above).
        guarded("shampoo_mul_abt launch", || unsafe {
            self.dev
                .stream()
                .launch_builder(&self.mul_abt)
                .arg(&a)
                .arg(&a_row)
                .arg(&a_k)
                .arg(&b)
                .arg(&b_row)
                .arg(&b_k)
                .arg(out)
                .arg(&ldo)
                .arg(&n32)
                .arg(&m32)
                .arg(&k32)
                .arg(&mode)
                .arg(&beta2)
                .arg(&w)
                .launch(cfg)
        })
        .map(drop)
    }

    /// Steps 6–9 of every block, one thread block each, from `[Ḡ, P_s]` (shard-long) and
    /// the grafting accumulator `v`.
    fn apply(
        &self,
        params: &mut CudaViewMut<'_, f32>,
        [gbar, ps]: [CudaView<'_, f32>; 2],
        v: &CudaSlice<f32>,
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
        let (decay, wd) = flag(sc.wd);
        let cfg = LaunchConfig {
            grid_dim: (u32::try_from(blocks).map_err(|_| too_many(blocks))?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let ga = GraftArgs::new(sc);
        let (v, table) = (v.as_view(), table.as_view());
        // SAFETY: `shampoo_apply` reads and writes the elements of the table's blocks, which
        // lie inside the shard (`Shampoo::blocks`), of `params`, `gbar` and `ps` (each
        // shard-long) and, with grafting, of `v` (then shard-long too); it reads `TABLE_WORDS`
        // words per block of `table`.
        guarded("shampoo_apply launch", || unsafe {
            self.dev
                .stream()
                .launch_builder(&self.apply)
                .arg(params)
                .arg(&gbar)
                .arg(&v)
                .arg(&ps)
                .arg(&table)
                .arg(&mode)
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
