//! bf16 matrix products on the AMX tile unit (x86-64 with AMX-TILE, AMX-BF16 and AVX-512 BW),
//! for Newton–Schulz: bf16 operands, `f32` accumulation in the tiles, one rounding to bf16
//! (nearest, ties to even) per output element.
//!
//! A product packs both operands once into tile-contiguous panels, zero-padded to multiples
//! of 32 (so any shape works and the padding adds exact zeros), except a left operand whose
//! sides and row stride are multiples of 32 and whose start is 64-byte aligned
//! ([`AlignedBf16`]): its tiles are loaded where it is. Matrices may be stored with rows
//! further apart than their width ([`Strides`]; [`Amx::matmul_strided`],
//! [`Amx::sym_strided`]): Newton–Schulz pads its rows to an odd number of cache lines
//! ([`padded_ld`]) so that those in-place tile loads spread over L1's sets (a bf16 Muon step
//! of the d = 1024 stack 0.925× / 0.91× the time of dense rows, both orders of 20
//! alternating rounds). Then it runs one 32×32 output
//! block per microkernel call: four `f32` accumulator tiles, two tiles of the left operand
//! and two of the right in the VNNI pair layout `TDPBF16PS` reads, `KC` of `k` per call (the
//! accumulators are stored between calls). Blocks are shared out over rayon's threads an
//! `MC × NC` output region at a time (packing a panel per task), or all run on the calling
//! thread with `Parallelism::None` (a caller that runs one matrix per thread); each task
//! loads the tile configuration before its first block and releases the tiles after its
//! last.
//!
//! | operand | packed as | tile `(block, kb, half)` starts at line |
//! |---|---|---|
//! | left `a: m×k` | 32 rows × 32 `k` per step, rows as they are (or read in place) | `(block·KB + kb)·32 + 16·half` |
//! | left `aᵀ` for `a: k×m` ([`Amx::sym_tn`]) | the same, each 32×32 block of `a` transposed | same |
//! | right `b` (`k×n`, or `n×k` read transposed) | 16 `k`-pairs × 16 columns × 2 per tile | same |
//!
//! Summation order: each output is `Σ_k a·b` over `k` ascending, in pairs (`TDPBF16PS`
//! multiplies bf16 exactly in `f32` and adds the two products of a pair in turn), with
//! denormal inputs and outputs flushed to zero by the unit. So the result does not depend on
//! the thread count or the blocking; it differs from oneDNN's (which splits `k`) in the last
//! bits of the `f32` sum.
//!
//! Symmetric products ([`Amx::sym_nt`], [`Amx::sym_tn`]) compute only the blocks on and
//! below the diagonal and write each off-diagonal block a second time, transposed, so the
//! result is exactly symmetric. The epilogue runs after a region's products, one call a block
//! (rounding with AVX512-BF16 where the CPU has it); it prefetches the next block's addend
//! and output rows while it rounds the current one. A call a row had taken 40 % of a
//! product's region time, stalled on reading back its arguments from the stack.

use std::fmt;
use std::sync::OnceLock;

use half::bf16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::{threaded, Parallelism};

/// Output block side, and the `k` consumed per microkernel step.
const BLOCK: usize = 32;
/// Rows of one tile (and `k`-pairs of a right-operand tile).
const TILE_ROWS: usize = 16;

/// One 64-byte tile row: 32 bf16 bit patterns (or 16 VNNI pairs).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u16; BLOCK]);

const ZERO_LINE: Line = Line([0; BLOCK]);

thread_local! {
    /// The calling thread's packed operands, kept between products (fresh buffers of a few
    /// MiB cost more in page faults than packing into them) up to [`super::RETAIN_BYTES`].
    static PACKED: std::cell::RefCell<(Vec<Line>, Vec<Line>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `f` on this thread's packing buffers, taken out of [`PACKED`] for the call (a
/// product nested in it, run by this thread while it waits for rayon, gets fresh ones
/// rather than a second borrow) and put back after.
fn with_packing(f: impl FnOnce(&mut Vec<Line>, &mut Vec<Line>)) {
    let (mut a, mut b) = PACKED.take();
    f(&mut a, &mut b);
    PACKED.set((super::retained(a), super::retained(b)));
}

/// A bf16 buffer whose start is 64-byte aligned, so that the products read a left operand
/// held in it in place (its rows whole cache lines when their length is a multiple of 32)
/// rather than packing it first. It only grows.
#[derive(Default)]
pub struct AlignedBf16(Vec<Line>);

impl AlignedBf16 {
    /// Its first `len` elements, grown (with zeros) to hold them.
    pub fn get(&mut self, len: usize) -> &mut [bf16] {
        let lines = reserve_lines(&mut self.0, len.div_ceil(BLOCK));
        // SAFETY: `Line` is `repr(C)` around `[u16; BLOCK]` and `bf16` is a transparent
        // `u16` with every bit pattern valid: the lines' memory is `BLOCK·lines ≥ len`
        // initialized `bf16`s, borrowed mutably through `self` for the slice's life.
        unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<bf16>(), len) }
    }

    /// Itself, or empty (its memory freed) when it holds more than
    /// [`RETAIN_BYTES`](super::RETAIN_BYTES).
    pub fn retained(self) -> Self {
        AlignedBf16(super::retained(self.0))
    }
}

/// Why AMX products are unavailable here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AmxUnavailable(pub String);

impl fmt::Display for AmxUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AMX bf16 unavailable: {}", self.0)
    }
}

impl std::error::Error for AmxUnavailable {}

impl From<AmxUnavailable> for ragged::Error {
    fn from(e: AmxUnavailable) -> Self {
        ragged::Error::Msg(e.to_string())
    }
}

/// Proof that this process may use the AMX tiles (see [`amx`]).
#[derive(Debug)]
pub struct Amx {
    _private: (),
}

/// The process's AMX handle: `Ok` when the CPU has AMX-TILE, AMX-BF16, AVX-512 F and BW and
/// the kernel granted this process the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`,
/// asked once). `Err` says which of those failed.
pub fn amx() -> Result<&'static Amx, AmxUnavailable> {
    static AMX: OnceLock<Result<Amx, AmxUnavailable>> = OnceLock::new();
    AMX.get_or_init(probe).as_ref().map_err(Clone::clone)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn probe() -> Result<Amx, AmxUnavailable> {
    // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 22 AMX-BF16 (std's detection of these is not
    // stable yet).
    // CPUID leaf 7 exists on every x86-64 CPU that reports AVX-512 (checked first).
    let has_avx512 = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw");
    let leaf7 = has_avx512.then(|| std::arch::x86_64::__cpuid_count(7, 0).edx);
    let missing: Vec<&str> = [
        ("avx512f, avx512bw", has_avx512),
        ("amx-tile", leaf7.is_some_and(|d| d & (1 << 24) != 0)),
        ("amx-bf16", leaf7.is_some_and(|d| d & (1 << 22) != 0)),
    ]
    .into_iter()
    .filter(|(_, has)| !has)
    .map(|(name, _)| name)
    .collect();
    if !missing.is_empty() {
        return Err(AmxUnavailable(format!(
            "the CPU lacks {}",
            missing.join(", ")
        )));
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes this process's permission to use
    // the tile data state; it reads and writes no memory.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    if rc != 0 {
        return Err(AmxUnavailable(format!(
            "the kernel refused the tile data state (arch_prctl: {})",
            std::io::Error::last_os_error()
        )));
    }
    Ok(Amx { _private: () })
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn probe() -> Result<Amx, AmxUnavailable> {
    Err(AmxUnavailable("needs x86-64 Linux".into()))
}

/// The right operand of a product.
#[derive(Clone, Copy, Debug)]
pub enum Rhs<'a> {
    /// `b: k×n` row-major.
    Plain(&'a [bf16]),
    /// `bᵀ`, given as `b: n×k` row-major (the product is `a·bᵀ`).
    Transposed(&'a [bf16]),
}

/// `out ← alpha·acc + beta·add` for each output element, rounded once to bf16.
#[derive(Clone, Copy, Debug)]
pub struct Epilogue<'a> {
    /// Scales the product.
    pub alpha: f32,
    /// `Some((beta, add))`: adds `beta` times the same element of `add` (`m×n`, rows
    /// [`Strides::add`] apart).
    pub add: Option<(f32, &'a [bf16])>,
}

impl Epilogue<'_> {
    /// No scale, no addend: `out ← acc`.
    pub const PLAIN: Epilogue<'static> = Epilogue {
        alpha: 1.0,
        add: None,
    };
}

/// Elements between consecutive rows of a product's matrices as stored: the left operand
/// (as given: `m×k`, or `k×n` for [`Amx::sym_tn`]), the right one (as given: `k×n` plain,
/// `n×k` transposed), the output and the epilogue's addend. Dense matrices have their
/// column counts; Newton–Schulz pads its rows ([`padded_ld`]) so that the tile loads of a
/// left operand read in place do not fall into a few L1 sets, and writes its last product
/// straight into a dense result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strides {
    /// Between rows of the left operand.
    pub a: usize,
    /// Between rows of the right operand (ignored by [`Amx::sym_strided`]).
    pub b: usize,
    /// Between rows of the output.
    pub out: usize,
    /// Between rows of the epilogue's addend (unused without one).
    pub add: usize,
}

/// The row stride Newton–Schulz stores a matrix of `cols` columns with: `cols` rounded up to
/// 32 elements (so every row starts on a 64-byte line), plus 32 more when that is an even
/// number of lines. An odd number of lines between rows sends the 16 rows of a tile to 16
/// different L1 sets; a stride of 2 KiB sent them to two sets (12 ways each), 4 KiB to one,
/// and a 2048-wide product with its left operand read in place ran 8–9 % slower than with
/// 2016 or 2080 columns (in-process alternation, AMX Xeon, session 30).
pub fn padded_ld(cols: usize) -> usize {
    let ld = cols.next_multiple_of(BLOCK);
    if (ld / BLOCK).is_multiple_of(2) {
        ld + BLOCK
    } else {
        ld
    }
}

impl Amx {
    /// `out (m×n) ← alpha·a·rhs + beta·add` with `a: m×k` row-major (see [`Rhs`],
    /// [`Epilogue`]).
    ///
    /// # Panics
    /// If a slice's length does not match the shape (an internal invariant).
    #[allow(clippy::too_many_arguments)]
    #[track_caller]
    pub fn matmul(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: &[bf16],
        rhs: Rhs<'_>,
        out: &mut [bf16],
        epi: Epilogue<'_>,
        par: Parallelism,
    ) {
        let b = match rhs {
            Rhs::Plain(_) => n,
            Rhs::Transposed(_) => k,
        };
        let ld = Strides {
            a: k,
            b,
            out: n,
            add: n,
        };
        self.matmul_strided(m, n, k, a, rhs, out, epi, par, ld);
    }

    /// [`Amx::matmul`] on matrices stored with the row strides `ld` (the same bits).
    ///
    /// # Panics
    /// If a slice does not hold exactly its rows at its stride, or a stride is below its
    /// row's length (an internal invariant).
    #[allow(clippy::too_many_arguments)]
    #[track_caller]
    pub fn matmul_strided(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: &[bf16],
        rhs: Rhs<'_>,
        out: &mut [bf16],
        epi: Epilogue<'_>,
        par: Parallelism,
        ld: Strides,
    ) {
        check_lengths((m, n, k), a, (m, k), rhs, out, epi, ld);
        if m == 0 || n == 0 {
            return;
        }
        let par = threaded(par);
        with_packing(|abuf, bbuf| {
            let ap = lhs(a, m, k, ld.a, abuf, par);
            let bp = match rhs {
                Rhs::Plain(b) => pack_plain(b, k, n, ld.b, bbuf, par),
                Rhs::Transposed(b) => pack_transposed(b, n, k, ld.b, bbuf, par),
            };
            run_blocks(ap, bp, (m, n, k), out, ld, epi, false, par);
        });
    }

    /// `out (n×n) ← alpha·a·aᵀ + beta·add` with `a: n×k` row-major and `add` symmetric:
    /// only the blocks on and below the diagonal are multiplied; the result is exactly
    /// symmetric.
    ///
    /// # Panics
    /// As [`Amx::matmul`].
    #[track_caller]
    pub fn sym_nt(
        &self,
        n: usize,
        k: usize,
        a: &[bf16],
        out: &mut [bf16],
        epi: Epilogue<'_>,
        par: Parallelism,
    ) {
        let ld = Strides {
            a: k,
            b: k,
            out: n,
            add: n,
        };
        self.sym_strided(n, k, a, out, epi, par, false, ld);
    }

    /// `out (n×n) ← alpha·aᵀ·a + beta·add` with `a: k×n` row-major (a tall matrix's Gram
    /// matrix without transposing it first) and `add` symmetric: [`Amx::sym_nt`] of `aᵀ`,
    /// with the same bits (the same lower blocks, the same pairs summed in the same order).
    ///
    /// # Panics
    /// As [`Amx::matmul`].
    #[track_caller]
    pub fn sym_tn(
        &self,
        n: usize,
        k: usize,
        a: &[bf16],
        out: &mut [bf16],
        epi: Epilogue<'_>,
        par: Parallelism,
    ) {
        let ld = Strides {
            a: n,
            b: n,
            out: n,
            add: n,
        };
        self.sym_strided(n, k, a, out, epi, par, true, ld);
    }

    /// [`Amx::sym_nt`] (`a·aᵀ`, `a: n×k`) or, when `tall`, [`Amx::sym_tn`] (`aᵀ·a`, `a: k×n`)
    /// on matrices stored with the row strides `ld` (`ld.b` is ignored: `a` is both
    /// operands): the blocks on and below the diagonal, each off-diagonal one written again
    /// transposed.
    ///
    /// # Panics
    /// As [`Amx::matmul_strided`].
    #[allow(clippy::too_many_arguments)]
    #[track_caller]
    pub fn sym_strided(
        &self,
        n: usize,
        k: usize,
        a: &[bf16],
        out: &mut [bf16],
        epi: Epilogue<'_>,
        par: Parallelism,
        tall: bool,
        ld: Strides,
    ) {
        let (rhs, a_shape) = if tall {
            (Rhs::Plain(a), (k, n))
        } else {
            (Rhs::Transposed(a), (n, k))
        };
        let ld = Strides { b: ld.a, ..ld };
        check_lengths((n, n, k), a, a_shape, rhs, out, epi, ld);
        if n == 0 {
            return;
        }
        // One matrix is both operands, packed (or read) in two different tile layouts.
        let par = threaded(par);
        with_packing(|abuf, bbuf| {
            let (ap, bp) = if tall {
                let ap = Lhs::Packed(pack_columns(a, k, n, ld.a, abuf, par));
                (ap, pack_plain(a, k, n, ld.a, bbuf, par))
            } else {
                let ap = lhs(a, n, k, ld.a, abuf, par);
                (ap, pack_transposed(a, n, k, ld.a, bbuf, par))
            };
            run_blocks(ap, bp, (n, n, k), out, ld, epi, true, par);
        });
    }

    /// `out (n×n) ← alpha·u·v + beta·add` for symmetric `u`, `v` that commute, so that `u·v`
    /// is symmetric (Gram Newton–Schulz's products of polynomials of one matrix), with `add`
    /// symmetric: only the blocks on and below the diagonal are multiplied; each off-diagonal
    /// one is written again transposed, and each diagonal block's lower triangle over its
    /// upper one (rounded inputs commute only approximately, so the product's own upper
    /// triangle differs in the last bits), so the result is exactly symmetric: its elements
    /// on and below the diagonal are those of [`Amx::matmul`]`(u, Rhs::Plain(v))`. Row
    /// strides as [`Amx::matmul_strided`] (`ld.b` for `v`).
    ///
    /// # Panics
    /// As [`Amx::matmul_strided`].
    #[allow(clippy::too_many_arguments)]
    #[track_caller]
    pub fn sym_product_strided(
        &self,
        n: usize,
        u: &[bf16],
        v: &[bf16],
        out: &mut [bf16],
        epi: Epilogue<'_>,
        par: Parallelism,
        ld: Strides,
    ) {
        check_lengths((n, n, n), u, (n, n), Rhs::Plain(v), out, epi, ld);
        if n == 0 {
            return;
        }
        let par = threaded(par);
        with_packing(|abuf, bbuf| {
            let ap = lhs(u, n, n, ld.a, abuf, par);
            let bp = pack_plain(v, n, n, ld.b, bbuf, par);
            run_blocks(ap, bp, (n, n, n), out, ld, epi, true, par);
        });
        for start in (0..n).step_by(BLOCK) {
            for i in start..(start + BLOCK).min(n) {
                for j in start..i {
                    out[j * ld.out + i] = out[i * ld.out + j];
                }
            }
        }
    }
}

/// Panics unless each slice holds exactly its matrix: `a` as `a_shape` (rows, columns) rows
/// `ld.a` apart, the right operand `k×n` (plain) or `n×k` (transposed) rows `ld.b` apart, the
/// output and the addend `m×n` rows `ld.out` apart (`rows·ld` elements: `rows·cols` for a
/// dense matrix); and no stride is below its row.
#[track_caller]
fn check_lengths(
    (m, n, k): (usize, usize, usize),
    a: &[bf16],
    a_shape: (usize, usize),
    rhs: Rhs<'_>,
    out: &[bf16],
    epi: Epilogue<'_>,
    ld: Strides,
) {
    let fits = |len: usize, (rows, cols): (usize, usize), ld: usize| {
        ld >= cols && Some(len) == rows.checked_mul(ld)
    };
    let (b, b_shape) = match rhs {
        Rhs::Plain(b) => (b, (k, n)),
        Rhs::Transposed(b) => (b, (n, k)),
    };
    let add_ok = epi
        .add
        .is_none_or(|(_, add)| fits(add.len(), (m, n), ld.add));
    assert!(
        fits(a.len(), a_shape, ld.a)
            && fits(b.len(), b_shape, ld.b)
            && fits(out.len(), (m, n), ld.out)
            && add_ok,
        "Amx: lengths {}, {}, {} (strides {ld:?}) for {m}×{k}·{k}×{n}",
        a.len(),
        b.len(),
        out.len()
    );
}

fn blocks(x: usize) -> usize {
    x.div_ceil(BLOCK)
}

fn bits(x: &[bf16]) -> &[u16] {
    x.reinterpret_cast()
}

/// The first `lines` lines of `buf`, grown with zero lines to hold them (a fresh allocation
/// in 2 MiB pages, [`super::grow_huge`]); the lines it already had keep whatever they held
/// (every packer writes each of its lines in full, zero padding included, and Newton–Schulz
/// writes every element of an [`AlignedBf16`] before reading it).
fn reserve_lines(buf: &mut Vec<Line>, lines: usize) -> &mut [Line] {
    super::grow_huge(buf, lines, ZERO_LINE);
    &mut buf[..lines]
}

/// `panels` panels of `kb` steps of 32 lines into `buf`, a rayon task per panel when
/// `threaded`; `fill(panel, step, lines)` writes every line of one step, zero padding
/// included.
fn pack_steps(
    buf: &mut Vec<Line>,
    panels: usize,
    kb: usize,
    threaded: bool,
    fill: impl Fn(usize, usize, &mut [Line]) + Sync,
) -> &[Line] {
    let out = reserve_lines(buf, panels * kb * BLOCK);
    let panel = |(panel, lines): (usize, &mut [Line])| {
        for (step, lines) in lines.chunks_mut(BLOCK).enumerate() {
            fill(panel, step, lines);
        }
    };
    if threaded {
        out.par_chunks_mut(kb * BLOCK).enumerate().for_each(panel);
    } else {
        out.chunks_mut(kb * BLOCK).enumerate().for_each(panel);
    }
    out
}

/// The left operand as the tile loop reads it.
#[derive(Clone, Copy)]
enum Lhs<'b> {
    /// Packed by [`pack_rows`] (or [`pack_columns`]): 32-row stripes of 32-wide `k` steps.
    Packed(&'b [Line]),
    /// The row-major `m×k` matrix itself, rows `ld` elements apart, whose tiles are loaded in
    /// place: `m`, `k` and `ld` multiples of 32 and the start 64-byte aligned, so that every
    /// tile row is one whole cache line and no tile reaches past the matrix.
    Rows(&'b [u16], usize),
}

impl Lhs<'_> {
    /// Where the tile loop starts for stripe `ib`, step `ks` (`kb` steps a stripe): the
    /// first row's address, the bytes between rows, the offset of the stripe's second
    /// 16-row tile, the bytes between steps; `steps` steps must lie inside.
    fn tiles(&self, ib: usize, ks: usize, kb: usize, steps: usize) -> LhsTiles {
        match *self {
            Lhs::Packed(ap) => LhsTiles {
                at: ap[(ib * kb + ks) * BLOCK..][..steps * BLOCK]
                    .as_ptr()
                    .cast(),
                row: 64,
                second: 1024,
                step: 2048,
            },
            Lhs::Rows(a, ld) => {
                let first = ib * BLOCK * ld + ks * BLOCK;
                // The last element the tiles read: row 31 of the stripe, the last step.
                assert!(first + (BLOCK - 1) * ld + steps * BLOCK <= a.len());
                LhsTiles {
                    at: a[first..].as_ptr().cast(),
                    row: 2 * ld,
                    second: 2 * ld * TILE_ROWS,
                    step: 2 * BLOCK,
                }
            }
        }
    }
}

/// One block's left-operand addressing for [`block_product`] (bytes).
struct LhsTiles {
    at: *const u8,
    row: usize,
    second: usize,
    step: usize,
}

/// The left operand `a: m×k` (rows `ld` apart) as the tile loop reads it: in place where it
/// can be ([`Lhs::Rows`]: a copy less of a matrix the loop reads from L2 anyway), else
/// packed.
fn lhs<'b>(
    a: &'b [bf16],
    m: usize,
    k: usize,
    ld: usize,
    buf: &'b mut Vec<Line>,
    threaded: bool,
) -> Lhs<'b> {
    let aligned = a.as_ptr().cast::<Line>().is_aligned();
    if aligned && [m, k, ld].iter().all(|x| x.is_multiple_of(BLOCK)) {
        Lhs::Rows(bits(a), ld)
    } else {
        Lhs::Packed(pack_rows(a, m, k, ld, buf, threaded))
    }
}

/// `a: m×k` (rows `ld` apart) as 32-row stripes of 32-wide `k` steps, zero-padded, into
/// `buf`.
fn pack_rows<'b>(
    a: &[bf16],
    m: usize,
    k: usize,
    ld: usize,
    buf: &'b mut Vec<Line>,
    threaded: bool,
) -> &'b [Line] {
    let a = bits(a);
    pack_steps(buf, blocks(m), blocks(k), threaded, |ib, step, lines| {
        let k0 = step * BLOCK;
        let width = BLOCK.min(k - k0);
        for (r, line) in lines.iter_mut().enumerate() {
            let i = ib * BLOCK + r;
            let row = if i < m {
                &a[i * ld + k0..][..width]
            } else {
                &[]
            };
            // A full row as one fixed-size copy (a 64-byte move, not a `memmove` call).
            match <&[u16; BLOCK]>::try_from(row) {
                Ok(full) => line.0 = *full,
                Err(_) => {
                    *line = ZERO_LINE;
                    line.0[..row.len()].copy_from_slice(row);
                }
            }
        }
    })
}

/// `aᵀ` for `a: k×m` row-major (rows `ld` apart), in [`pack_rows`]' layout (32-row stripes
/// of `aᵀ`, i.e. of `a`'s columns): each 32×32 block of `a` transposed, zero-padded past the
/// edges.
fn pack_columns<'b>(
    a: &[bf16],
    k: usize,
    m: usize,
    ld: usize,
    buf: &'b mut Vec<Line>,
    threaded: bool,
) -> &'b [Line] {
    let a = bits(a);
    pack_steps(buf, blocks(m), blocks(k), threaded, |ib, step, lines| {
        let (i0, k0) = (ib * BLOCK, step * BLOCK);
        let (cols, depth) = (BLOCK.min(m - i0), BLOCK.min(k - k0));
        // The block's rows straight into the lines (a 64-byte move each when full), then
        // transposed in place.
        for (r, line) in lines.iter_mut().enumerate() {
            let row = if r < depth {
                &a[(k0 + r) * ld + i0..][..cols]
            } else {
                &[]
            };
            match <&[u16; BLOCK]>::try_from(row) {
                Ok(full) => line.0 = *full,
                Err(_) => {
                    *line = ZERO_LINE;
                    line.0[..row.len()].copy_from_slice(row);
                }
            }
        }
        let rows = as_rows(lines);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `amx()` checked AVX-512 F and BW.
        unsafe {
            simd::transpose_32x32(rows)
        };
        #[cfg(not(target_arch = "x86_64"))]
        transpose_32x32(rows);
    })
}

/// One step's 32 lines as the 32×32 block they hold.
fn as_rows(lines: &mut [Line]) -> &mut [[u16; BLOCK]; BLOCK] {
    let lines: &mut [Line; BLOCK] = lines.try_into().expect("a step is 32 lines");
    // SAFETY: `Line` is `repr(C)` around one `[u16; BLOCK]` (64 bytes, also its alignment,
    // so no padding): 32 lines are laid out as 32 such rows, and the borrow is carried over.
    unsafe { &mut *std::ptr::from_mut(lines).cast::<[[u16; BLOCK]; BLOCK]>() }
}

/// `b: k×n` row-major (rows `ld` apart) as VNNI tiles into `buf`: line `r` of tile
/// `(jp, step, t)` holds, for each of its 16 columns `j`, the pair `(b[2r][j], b[2r+1][j])`
/// of the step's rows.
fn pack_plain<'b>(
    b: &[bf16],
    k: usize,
    n: usize,
    ld: usize,
    buf: &'b mut Vec<Line>,
    threaded: bool,
) -> &'b [Line] {
    let b = bits(b);
    pack_steps(buf, blocks(n), blocks(k), threaded, |jp, step, tiles| {
        let j0 = jp * BLOCK;
        let cols = BLOCK.min(n - j0);
        #[cfg(target_arch = "x86_64")]
        if cols == BLOCK && (step + 1) * BLOCK <= k {
            // SAFETY: `amx()` checked AVX-512 F and BW; the step's 32 rows of 32 columns
            // lie inside `b` (full step, full panel).
            unsafe { simd::interleave_rows(&b[step * BLOCK * ld + j0..], ld, tiles) };
            return;
        }
        // One 32-wide row of the panel, zero past the edges.
        let row = |kk: usize| {
            let mut r = [0u16; BLOCK];
            if kk < k {
                r[..cols].copy_from_slice(&b[kk * ld + j0..][..cols]);
            }
            r
        };
        for pair in 0..TILE_ROWS {
            let kk = step * BLOCK + 2 * pair;
            let (even, odd) = (row(kk), row(kk + 1));
            for t in 0..2 {
                let line = &mut tiles[t * TILE_ROWS + pair].0;
                for c in 0..TILE_ROWS {
                    line[2 * c] = even[t * TILE_ROWS + c];
                    line[2 * c + 1] = odd[t * TILE_ROWS + c];
                }
            }
        }
    })
}

/// `bᵀ` for `b: n×k` row-major (rows `ld` apart), as VNNI tiles into `buf`: line `r` of tile
/// `(jp, step, t)` holds, for each of its 16 columns `j`, the pair `(b[j][2r], b[j][2r+1])`:
/// the 16×16 transpose of the 32-bit pairs of 16 rows of `b`.
fn pack_transposed<'b>(
    b: &[bf16],
    n: usize,
    k: usize,
    ld: usize,
    buf: &'b mut Vec<Line>,
    threaded: bool,
) -> &'b [Line] {
    let b = bits(b);
    pack_steps(buf, blocks(n), blocks(k), threaded, |jp, step, tiles| {
        let k0 = step * BLOCK;
        let width = BLOCK.min(k - k0);
        for (t, tile) in tiles.chunks_mut(TILE_ROWS).enumerate() {
            let j0 = jp * BLOCK + t * TILE_ROWS;
            #[cfg(target_arch = "x86_64")]
            if width == BLOCK && j0 + TILE_ROWS <= n {
                // SAFETY: `amx()` checked AVX-512 F; the tile's 16 rows of 32 `k` values
                // lie inside `b`.
                unsafe { simd::transpose_pairs(&b[j0 * ld + k0..], ld, tile) };
                continue;
            }
            // The tile's 16 source rows as 16 pairs each, zero past the edges.
            let mut src = [[0u32; TILE_ROWS]; TILE_ROWS];
            for (c, pairs) in src.iter_mut().enumerate() {
                if j0 + c < n {
                    let mut row = [0u16; BLOCK];
                    row[..width].copy_from_slice(&b[(j0 + c) * ld + k0..][..width]);
                    for (p, two) in pairs.iter_mut().zip(row.chunks_exact(2)) {
                        *p = u32::from(two[0]) | (u32::from(two[1]) << 16);
                    }
                }
            }
            for (pair, line) in tile.iter_mut().enumerate() {
                for (two, pairs) in line.0.chunks_exact_mut(2).zip(&src) {
                    two[0] = pairs[pair] as u16;
                    two[1] = (pairs[pair] >> 16) as u16;
                }
            }
        }
    })
}

/// Raw pointer to the output, shared by the region tasks: each writes disjoint blocks.
#[derive(Clone, Copy)]
struct OutPtr(*mut u16);
// SAFETY: the tasks write disjoint elements (each block is written by one task only) and
// the owner of the buffer waits for all of them (rayon's scope) before reading it.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// `k` per accumulation pass: one pass streams a 32×`KC` sub-panel of each operand (64 KiB,
/// from L2), and the accumulators go to memory between passes. 256 (operands in L1, the
/// accumulators out and in every 8 steps) took 1.08–1.14× the time of 1024 on Newton–Schulz's
/// three products of a 1024 × 3584 matrix (medians of 25–40 alternations, AMX Xeon, session
/// 26): a tile loop that stores and reloads its accumulators every 8 steps ran at 0.67× one
/// that never does, and one with both operands from L2 at 0.8× one from L1.
const KC: usize = 1024;
/// Output rows per task (4 stripes of blocks).
const MC: usize = 128;
/// Output columns per task: the task's accumulators (`MC·NC` `f32`, 256 KiB) stay in L2.
/// 256 (and `MC` 64) took a bf16 Muon step about as long or 1–3 % longer (session 29).
const NC: usize = 512;

/// Whether this CPU has AVX512-BF16 (every AMX CPU so far has).
fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx512bf16");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Every output block of the `m×k · k×n` product (only those with `jp ≤ ib` when `lower`,
/// mirrored), an `MC × NC` region per rayon task when `threaded`, else all on this thread.
#[allow(clippy::too_many_arguments)]
fn run_blocks(
    ap: Lhs<'_>,
    bp: &[Line],
    (m, n, k): (usize, usize, usize),
    out: &mut [bf16],
    ld: Strides,
    epi: Epilogue<'_>,
    lower: bool,
    threaded: bool,
) {
    let (mb, nb) = (blocks(m), blocks(n));
    let (tile_m, tile_n) = (MC / BLOCK, NC / BLOCK);
    let ctx = BlockOut {
        out: OutPtr(out.as_mut_ptr().cast::<u16>()),
        m,
        n,
        ld: ld.out,
        add_ld: ld.add,
        bf16_convert: has_avx512_bf16(),
        alpha: epi.alpha,
        add: epi.add.map(|(beta, add)| (beta, bits(add))),
    };
    // Column-region major: consecutive regions (on one thread, or claimed in turn) share
    // their right-operand panels (`NC × KC`, 1 MiB, which stay in L2) while the left
    // operand's stripes stream, rather than re-reading the panels from L3 for every row
    // region (a bf16 Muon step 0.966× / 0.971× the time of row-major, both orders).
    let regions: Vec<Region> = (0..nb.div_ceil(tile_n))
        .flat_map(|tj| (0..mb.div_ceil(tile_m)).map(move |ti| (ti, tj)))
        .map(|(ti, tj)| Region {
            rows: ti * tile_m..((ti + 1) * tile_m).min(mb),
            cols: tj * tile_n..((tj + 1) * tile_n).min(nb),
        })
        .filter(|r| !lower || r.cols.start < r.rows.end)
        .collect();
    if !threaded {
        let _tiles = TileSession::start();
        for region in regions {
            region.run(ap, bp, blocks(k), lower, &ctx);
        }
        return;
    }
    regions
        .into_par_iter()
        .with_min_len(1)
        .for_each_init(TileSession::start, |_, region| {
            region.run(ap, bp, blocks(k), lower, &ctx);
        });
}

/// Blocks `rows × cols` of the output (in 32-block units).
struct Region {
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
}

impl Region {
    /// Multiplies the region's blocks pass by pass over `k`, then writes them out.
    fn run(&self, ap: Lhs<'_>, bp: &[Line], kb: usize, lower: bool, ctx: &BlockOut<'_>) {
        let width = self.cols.len();
        let wanted = |ib: usize, jp: usize| !lower || jp <= ib;
        ACCS.with_borrow_mut(|accs| {
            if accs.len() < self.rows.len() * width {
                accs.resize_with(self.rows.len() * width, || Acc([0.0; BLOCK * BLOCK]));
            }
            for ks in (0..kb).step_by(KC / BLOCK) {
                let steps = (KC / BLOCK).min(kb - ks);
                let panel = |jp: usize, ks: usize| &bp[(jp * kb + ks) * BLOCK..];
                for jp in self.cols.clone() {
                    let b = &panel(jp, ks)[..steps * BLOCK];
                    // What this column's products pull into L2 for the next: the next
                    // column's panel, or the next pass's first.
                    let next = if jp + 1 < self.cols.end {
                        panel(jp + 1, ks)
                    } else if ks + KC / BLOCK < kb {
                        panel(self.cols.start, ks + KC / BLOCK)
                    } else {
                        b
                    };
                    for (i, ib) in self.rows.clone().filter(|&ib| wanted(ib, jp)).enumerate() {
                        let a = ap.tiles(ib, ks, kb, steps);
                        let acc = &mut accs[(ib - self.rows.start) * width + jp - self.cols.start];
                        // The `i`-th product of the column fetches the `i`-th quarter.
                        let ahead = next
                            .get(i * steps * PREFETCH_LINES..(i + 1) * steps * PREFETCH_LINES)
                            .unwrap_or(&b[..steps * PREFETCH_LINES]);
                        // SAFETY: tiles are configured on this thread (`TileSession`); `a`
                        // and `b` hold `steps ≥ 1` steps of 32 lines, `ahead` 8 lines a step.
                        unsafe { block_product(a, b, ahead, steps, acc, ks > 0) };
                    }
                }
            }
            // One block's rounded rows, zeroed once per region rather than once per block
            // (2 KiB each time: ~3 % of a bf16 Muon step).
            let mut rows = [[0u16; BLOCK]; BLOCK];
            let mut order = self
                .rows
                .clone()
                .flat_map(|ib| self.cols.clone().map(move |jp| (ib, jp)))
                .filter(|&(ib, jp)| wanted(ib, jp))
                .peekable();
            while let Some((ib, jp)) = order.next() {
                if let Some(&(nib, njp)) = order.peek() {
                    ctx.prefetch(nib, njp);
                }
                let acc = &accs[(ib - self.rows.start) * width + jp - self.cols.start];
                ctx.write(acc, ib, jp, lower && jp < ib, &mut rows);
            }
        });
    }
}

thread_local! {
    /// A task's accumulator blocks, kept between tasks on each thread.
    static ACCS: std::cell::RefCell<Vec<Acc>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// 32×32 `f32` accumulator block, rows 128 bytes apart.
#[repr(C, align(64))]
struct Acc([f32; BLOCK * BLOCK]);

/// Tile configuration held by one thread: 8 tiles of 16 rows × 64 bytes. Released on drop.
struct TileSession;

impl TileSession {
    fn start() -> TileSession {
        let mut cfg = TileConfig([0; 64]);
        cfg.0[0] = 1; // palette 1
        for t in 0..8 {
            cfg.0[16 + 2 * t] = 64; // bytes per row (low byte of a u16)
            cfg.0[48 + t] = TILE_ROWS as u8;
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `amx()` succeeded before any product runs (an `Amx` exists), so the CPU
        // has AMX and the process holds the tile state; the config is a valid palette-1
        // layout, 64 bytes, 64-byte aligned.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("an Amx exists only on x86-64 ({cfg:p})");
        #[cfg(target_arch = "x86_64")]
        TileSession
    }
}

impl Drop for TileSession {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: releases this thread's tile state (configured in `start`).
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem))
        };
    }
}

#[repr(C, align(64))]
struct TileConfig([u8; 64]);

/// Lines of the right operand's next panel that one step of [`block_product`] prefetches
/// into L2: a column's four products fetch the next column's panel (32 lines a step) while
/// they run, so its first product does not wait on L3. Alternated with the loop without
/// prefetches on an AMX Xeon (session 27, 2 threads, medians of 8–10 rounds on a host whose
/// speed varied 2× run to run): Newton–Schulz's products 1.05–1.39× faster but for two
/// symmetric shapes in one run (0.7×, 0.9×; 1.1×, 1.4× in the next), and a bf16 Muon step
/// of the d = 1024 stack 0.94× the time (`scripts/ab_muon_steps.py`, 12 rounds).
const PREFETCH_LINES: usize = 8;
const _: () = assert!(
    PREFETCH_LINES == 8,
    "block_product's loop has eight prefetches"
);

/// `acc ← acc + Σ over `steps` steps of a_tiles·b_tiles` for one 32×32 block (`acc`
/// taken as zero unless `accumulate`), pulling `ahead` into L2 on the way.
///
/// # Safety
/// The calling thread has loaded the tile configuration of [`TileSession`]; `a` addresses
/// `steps ≥ 1` steps of two 16-row tiles ([`Lhs::tiles`] checked them), `b` holds at least
/// `steps` steps of 32 lines, `ahead` `steps` of [`PREFETCH_LINES`].
unsafe fn block_product(
    a: LhsTiles,
    b: &[Line],
    ahead: &[Line],
    steps: usize,
    acc: &mut Acc,
    accumulate: bool,
) {
    debug_assert!(steps >= 1 && b.len() >= steps * BLOCK);
    debug_assert!(ahead.len() >= steps * PREFETCH_LINES);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "an Amx exists only on x86-64 ({:p}, {b:p}, {ahead:p}, {acc:p}, {accumulate})",
        a.at
    );
    #[cfg(target_arch = "x86_64")]
    let c = acc.0.as_mut_ptr();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: (caller) tiles configured as 16 rows × 64 bytes; the accumulator loads and
    // stores touch the 4 KiB of `acc` (rows 128 bytes apart).
    unsafe {
        if accumulate {
            std::arch::asm!(
                "tileloadd tmm0, [{c} + {s128}*1]",
                "tileloadd tmm1, [{c} + {s128}*1 + 64]",
                "tileloadd tmm2, [{c} + {s128}*1 + 2048]",
                "tileloadd tmm3, [{c} + {s128}*1 + 2112]",
                c = in(reg) c,
                s128 = in(reg) 128usize,
                options(nostack, readonly),
            );
        } else {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
        }
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: (caller) each tile load reads 16 rows of 64 bytes inside `a`'s tiles or `b`;
    // the prefetches touch `ahead`'s 8 lines a step (and would not fault outside it).
    unsafe {
        std::arch::asm!(
            "2:",
            "tileloadd tmm4, [{a} + {ar}*1]",
            "tileloadd tmm6, [{b} + {s64}*1]",
            "prefetcht1 [{p}]",
            "prefetcht1 [{p} + 64]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm7, [{b} + {s64}*1 + 1024]",
            "prefetcht1 [{p} + 128]",
            "prefetcht1 [{p} + 192]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tileloadd tmm5, [{a2} + {ar}*1]",
            "prefetcht1 [{p} + 256]",
            "prefetcht1 [{p} + 320]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "prefetcht1 [{p} + 384]",
            "prefetcht1 [{p} + 448]",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a}, {astep}",
            "add {a2}, {astep}",
            "add {b}, 2048",
            "add {p}, 512",
            "dec {n}",
            "jnz 2b",
            "tilestored [{c} + {s128}*1], tmm0",
            "tilestored [{c} + {s128}*1 + 64], tmm1",
            "tilestored [{c} + {s128}*1 + 2048], tmm2",
            "tilestored [{c} + {s128}*1 + 2112], tmm3",
            a = inout(reg) a.at => _,
            a2 = inout(reg) a.at.wrapping_add(a.second) => _,
            ar = in(reg) a.row,
            astep = in(reg) a.step,
            b = inout(reg) b.as_ptr() => _,
            p = inout(reg) ahead.as_ptr() => _,
            n = inout(reg) steps => _,
            c = in(reg) c,
            s64 = in(reg) 64usize,
            s128 = in(reg) 128usize,
            options(nostack),
        );
    }
}

/// Where and how one block's accumulators go out.
struct BlockOut<'a> {
    out: OutPtr,
    m: usize,
    n: usize,
    /// Elements between rows of the output.
    ld: usize,
    /// Elements between rows of the addend.
    add_ld: usize,
    /// Whether the CPU has AVX512-BF16 for the epilogue's rounding
    /// ([`simd::finish_row_bf16`]).
    bf16_convert: bool,
    alpha: f32,
    add: Option<(f32, &'a [u16])>,
}

impl BlockOut<'_> {
    /// Asks for block `(ib, jp)`'s addend rows and output rows ahead of [`BlockOut::write`]
    /// (both are cold: the addend and the output are matrices of several MiB).
    fn prefetch(&self, ib: usize, jp: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0};
            let (i0, j0) = (ib * BLOCK, jp * BLOCK);
            for r in 0..BLOCK.min(self.m - i0) {
                // SAFETY: a prefetch never faults, whatever the address.
                unsafe {
                    if let Some((_, add)) = self.add {
                        let at = (i0 + r) * self.add_ld + j0;
                        let p = add.as_ptr().wrapping_add(at).cast::<i8>();
                        _mm_prefetch::<_MM_HINT_T0>(p);
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(63));
                    }
                    let o = self
                        .out
                        .0
                        .wrapping_add((i0 + r) * self.ld + j0)
                        .cast::<i8>();
                    _mm_prefetch::<_MM_HINT_ET0>(o);
                    _mm_prefetch::<_MM_HINT_ET0>(o.wrapping_add(63));
                }
            }
        }
    }

    /// Block `(ib, jp)` of the output from `acc`; with `mirror`, block `(jp, ib)` too, as
    /// its transpose (`add` symmetric, so its elements are the same). `rows` is scratch: rows
    /// past the matrix edge keep what an earlier block left and are never stored (nor, once
    /// transposed, are their columns).
    fn write(
        &self,
        acc: &Acc,
        ib: usize,
        jp: usize,
        mirror: bool,
        rows: &mut [[u16; BLOCK]; BLOCK],
    ) {
        self.finish(acc, ib, jp, rows);
        self.store(rows, ib, jp);
        if mirror {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `amx()` checked AVX-512 F and BW.
            unsafe {
                simd::transpose_32x32(rows)
            };
            #[cfg(not(target_arch = "x86_64"))]
            transpose_32x32(rows);
            self.store(rows, jp, ib);
        }
    }

    /// `rows ← bf16(alpha·acc + beta·add)` for block `(ib, jp)` (full 32×32; elements past
    /// the matrix edge are computed from zero padding and never stored).
    fn finish(&self, acc: &Acc, ib: usize, jp: usize, rows: &mut [[u16; BLOCK]; BLOCK]) {
        let (i0, j0) = (ib * BLOCK, jp * BLOCK);
        let (count, cols) = (BLOCK.min(self.m - i0), BLOCK.min(self.n - j0));
        #[cfg(target_arch = "x86_64")]
        if cols == BLOCK {
            let add = self
                .add
                .map(|(beta, add)| (beta, &add[i0 * self.add_ld + j0..]));
            let (acc, alpha, ld) = (&acc.0, self.alpha, self.add_ld);
            if self.bf16_convert {
                // SAFETY: checked AVX-512 F, BW and BF16 (`bf16_convert`).
                unsafe { simd::finish_block_bf16(acc, alpha, add, ld, rows, count) };
            } else {
                // SAFETY: `amx()` checked AVX-512 F and BW.
                unsafe { simd::finish_block(acc, alpha, add, ld, rows, count) };
            }
            return;
        }
        // A block cut by the matrix's last column, row by row.
        for (r, row) in rows.iter_mut().enumerate().take(count) {
            let add_row = self
                .add
                .map(|(beta, add)| (beta, &add[(i0 + r) * self.add_ld + j0..][..cols]));
            finish_row(&acc.0[r * BLOCK..][..BLOCK], self.alpha, add_row, row);
        }
    }

    fn store(&self, rows: &[[u16; BLOCK]; BLOCK], ib: usize, jp: usize) {
        let (i0, j0) = (ib * BLOCK, jp * BLOCK);
        let cols = BLOCK.min(self.n - j0);
        for (r, row) in rows.iter().enumerate().take(BLOCK.min(self.m - i0)) {
            // SAFETY: row `i0 + r < m`, columns `j0..j0 + cols ≤ n ≤ ld` of the m×n output
            // (rows `ld` apart, checked to fit); this block is written by this task only
            // (`OutPtr`).
            unsafe {
                let dst = self.out.0.add((i0 + r) * self.ld + j0);
                if cols == BLOCK {
                    // A full row as one fixed-size move (not a `memmove` call).
                    dst.cast::<[u16; BLOCK]>().write_unaligned(*row);
                } else {
                    std::ptr::copy_nonoverlapping(row.as_ptr(), dst, cols);
                }
            }
        }
    }
}

/// One row of the epilogue: `out ← bf16(alpha·acc + beta·add)` (`add` may be shorter than
/// 32 at the matrix edge; the rest of the row is computed without it).
fn finish_row(acc: &[f32], alpha: f32, add: Option<(f32, &[u16])>, out: &mut [u16; BLOCK]) {
    let mut v = [0.0f32; BLOCK];
    for (v, &a) in v.iter_mut().zip(acc) {
        *v = alpha * a;
    }
    if let Some((beta, add)) = add {
        for (v, &x) in v.iter_mut().zip(add) {
            *v += beta * f32::from_bits(u32::from(x) << 16);
        }
    }
    for (o, &v) in out.iter_mut().zip(&v) {
        *o = bf16::from_f32(v).to_bits();
    }
}

/// In-place transpose of a 32×32 block of 16-bit values (the portable form of
/// `simd::transpose_32x32`).
#[cfg_attr(all(target_arch = "x86_64", not(test)), allow(dead_code))]
fn transpose_32x32(rows: &mut [[u16; BLOCK]; BLOCK]) {
    let before = *rows;
    for (i, row) in rows.iter_mut().enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            *v = before[j][i];
        }
    }
}

/// The AVX-512 forms of the packers' and the mirror's shuffles.
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{Line, BLOCK, TILE_ROWS};
    use std::arch::x86_64::*;

    /// A block-swap transpose of rows of 32-bit lanes works in rounds: in the round moving
    /// groups of `g` lanes, for each row pair `top = v[r]`, `bottom = v[r + s]`, the top row
    /// takes the bottom's left `g` lanes of each `2g` group into its right ones and the
    /// bottom row the top's right ones into its left; after the rounds for `g = 8, 4, 2, 1`
    /// on 16 rows (`s = g`), the rows hold the transpose. Each round is one two-source 32-bit
    /// permute per row (one µop; the 16-bit one is three) with these two index vectors
    /// (`ROUND_INDEX[i]` moves groups of `8 >> i` lanes), built at compile time: built per
    /// call, they cost more than the permutes.
    const fn round_index(g: usize) -> [[u32; 16]; 2] {
        let mut idx = [[0u32; 16]; 2];
        let mut j = 0;
        while j < 16 {
            let right = j & g != 0;
            idx[0][j] = if right { 16 + j - g } else { j } as u32;
            idx[1][j] = if right { 16 + j } else { j + g } as u32;
            j += 1;
        }
        idx
    }

    static ROUND_INDEX: [[[u32; 16]; 2]; 4] = [
        round_index(8),
        round_index(4),
        round_index(2),
        round_index(1),
    ];

    /// One round ([`round_index`]) on the rows `v`, pairs `s` rows apart, moving groups of
    /// `8 >> i` 32-bit lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn swap_round(v: &mut [__m512i], s: usize, i: usize) {
        let [lo, hi] = &ROUND_INDEX[i];
        // SAFETY: 64 bytes each.
        let (lo, hi) = unsafe {
            (
                _mm512_loadu_si512(lo.as_ptr().cast()),
                _mm512_loadu_si512(hi.as_ptr().cast()),
            )
        };
        for base in (0..v.len()).step_by(2 * s) {
            for r in base..base + s {
                let (top, bottom) = (v[r], v[r + s]);
                v[r] = _mm512_permutex2var_epi32(top, lo, bottom);
                v[r + s] = _mm512_permutex2var_epi32(top, hi, bottom);
            }
        }
    }

    /// The last round of a 16-bit transpose: the top row's odd lanes take the bottom's even
    /// ones (shifted up within each 32 bits), the bottom's even lanes the top's odd ones.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn swap_halves(v: &mut [__m512i]) {
        for r in (0..v.len()).step_by(2) {
            let (top, bottom) = (v[r], v[r + 1]);
            v[r] = _mm512_mask_blend_epi16(0xAAAA_AAAA, top, _mm512_slli_epi32::<16>(bottom));
            v[r + 1] = _mm512_mask_blend_epi16(0x5555_5555, bottom, _mm512_srli_epi32::<16>(top));
        }
    }

    /// `out ← bf16(alpha·acc + beta·add)` for a full row of 32 (`add` 32 long), rounded to
    /// nearest, ties to even: the bits of the portable `finish_row` (`half::bf16::from_f32`)
    /// for every result that is not NaN, and NaN where it is NaN (tested below; the sign of a
    /// NaN made from two NaNs follows operand order, which the compiler may swap in the
    /// portable loop).
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW; `acc` (and `add`) hold 32 elements.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    pub(super) unsafe fn finish_row(
        acc: &[f32],
        alpha: f32,
        add: Option<(f32, &[u16])>,
        out: &mut [u16; BLOCK],
    ) {
        debug_assert!(acc.len() >= BLOCK && add.is_none_or(|(_, a)| a.len() >= BLOCK));
        for half in 0..2 {
            let o = half * TILE_ROWS;
            // SAFETY: (caller) 16 f32 of `acc` and 16 u16 of `add` at `o`; 32 bytes of `out`.
            unsafe {
                let v = row_sum(acc, alpha, add, o);
                let b = _mm512_castps_si512(v);
                let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
                let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
                let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
                let magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
                let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f80_0000));
                let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
                let bits = _mm512_mask_blend_epi32(nan, rounded, quiet);
                _mm256_storeu_si256(out[o..].as_mut_ptr().cast(), _mm512_cvtepi32_epi16(bits));
            }
        }
    }

    /// `alpha·acc + beta·add` for the 16 lanes at `o`: separate multiply and add, as the
    /// portable loop (no fused rounding).
    ///
    /// # Safety
    /// AVX-512 F and BW; 16 `f32` of `acc` and 16 `u16` of `add` at `o`.
    #[inline(always)]
    unsafe fn row_sum(acc: &[f32], alpha: f32, add: Option<(f32, &[u16])>, o: usize) -> __m512 {
        // SAFETY: (caller) as above.
        unsafe {
            let v = _mm512_mul_ps(_mm512_set1_ps(alpha), _mm512_loadu_ps(acc[o..].as_ptr()));
            match add {
                Some((beta, add)) => {
                    let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(add[o..].as_ptr().cast()));
                    let x = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide));
                    _mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(beta), x))
                }
                None => v,
            }
        }
    }

    /// [`finish_row`] with AVX512-BF16's rounding: `vcvtne2ps2bf16` rounds 32 lanes to
    /// nearest even in one instruction where the integer sequence takes about eleven per
    /// 16, and makes any NaN quiet as [`super::finish_row`] does. It reads a subnormal `f32`
    /// as zero, where the portable rounding keeps it; so a row holding one (rare: the tiles
    /// flush subnormal products, only `alpha·acc + beta·add` can make one) is rounded by
    /// [`finish_row`] instead.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and BF16; `acc` holds at least 32 elements, `add` (if any)
    /// at least 32.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    pub(super) unsafe fn finish_row_bf16(
        acc: &[f32],
        alpha: f32,
        add: Option<(f32, &[u16])>,
        out: &mut [u16; BLOCK],
    ) {
        debug_assert!(acc.len() >= BLOCK && add.is_none_or(|(_, a)| a.len() >= BLOCK));
        // SAFETY: (caller) 32 f32 of `acc` and 32 u16 of `add`; 64 bytes of `out`.
        unsafe {
            let (lo, hi) = (
                row_sum(acc, alpha, add, 0),
                row_sum(acc, alpha, add, TILE_ROWS),
            );
            let exponent = _mm512_set1_epi32(0x7f80_0000);
            let mantissa = _mm512_set1_epi32(0x007f_ffff);
            let subnormal = |v: __m512| {
                let b = _mm512_castps_si512(v);
                _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(b, exponent), b, mantissa)
            };
            if subnormal(lo) | subnormal(hi) != 0 {
                return finish_row(acc, alpha, add, out);
            }
            // `__m512bh` and `__m512i` are the same 64 bytes (32 bf16 bit patterns, in order).
            let bits = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out.as_mut_ptr().cast(), bits);
        }
    }

    /// [`finish_row`] on the first `count` rows of a block 32 wide (`add`'s rows `ld` apart
    /// from its first): one call a block, where a call a row cost more than the row (its
    /// arguments go through the stack, and reading them back stalled on the store).
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn finish_block(
        acc: &[f32; BLOCK * BLOCK],
        alpha: f32,
        add: Option<(f32, &[u16])>,
        ld: usize,
        rows: &mut [[u16; BLOCK]; BLOCK],
        count: usize,
    ) {
        // SAFETY: (caller) AVX-512 F and BW; full rows of 32.
        each_row(acc, add, ld, rows, count, |acc, add, out| unsafe {
            finish_row(acc, alpha, add, out)
        });
    }

    /// [`finish_block`] with [`finish_row_bf16`]'s rounding.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn finish_block_bf16(
        acc: &[f32; BLOCK * BLOCK],
        alpha: f32,
        add: Option<(f32, &[u16])>,
        ld: usize,
        rows: &mut [[u16; BLOCK]; BLOCK],
        count: usize,
    ) {
        // SAFETY: (caller) AVX-512 F, BW and BF16; full rows of 32.
        each_row(acc, add, ld, rows, count, |acc, add, out| unsafe {
            finish_row_bf16(acc, alpha, add, out)
        });
    }

    /// `row(acc row, add row, out row)` for each of a block's first `count` rows, `add`'s
    /// rows `ld` apart. Always inlined, so that `row` (a closure of a target-feature function, which
    /// inherits its features) is inlined into that function too.
    #[inline(always)]
    fn each_row(
        acc: &[f32; BLOCK * BLOCK],
        add: Option<(f32, &[u16])>,
        ld: usize,
        rows: &mut [[u16; BLOCK]; BLOCK],
        count: usize,
        row: impl Fn(&[f32], Option<(f32, &[u16])>, &mut [u16; BLOCK]),
    ) {
        for (r, out) in rows.iter_mut().enumerate().take(count) {
            let add_row = add.map(|(beta, add)| (beta, &add[r * ld..][..BLOCK]));
            row(&acc[r * BLOCK..][..BLOCK], add_row, out);
        }
    }

    /// Transposes 32 rows of 32 16-bit values in place: the first round (rows 16 apart,
    /// groups of 8 32-bit lanes) row pair by row pair through memory, then the other four on
    /// each half of 16 rows held in registers (all 32 rows at once would not fit beside the
    /// index vectors, and spilled).
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn transpose_32x32(rows: &mut [[u16; BLOCK]; BLOCK]) {
        let base = rows.as_mut_ptr().cast::<__m512i>();
        // SAFETY: `r < 32`: row `r` of the 32 (64 bytes each, contiguous).
        let ptr = |r: usize| unsafe { base.add(r) };
        // SAFETY: each row is 64 bytes, read and written unaligned; (caller) AVX-512 F/BW.
        unsafe {
            for r in 0..TILE_ROWS {
                let mut pair = [
                    _mm512_loadu_si512(ptr(r)),
                    _mm512_loadu_si512(ptr(r + TILE_ROWS)),
                ];
                swap_round(&mut pair, 1, 0);
                _mm512_storeu_si512(ptr(r), pair[0]);
                _mm512_storeu_si512(ptr(r + TILE_ROWS), pair[1]);
            }
            for half in [0, TILE_ROWS] {
                // A loop rather than `array::from_fn`, whose closure would be compiled
                // without this function's target features unless `from_fn` is inlined.
                let mut v = [_mm512_setzero_si512(); TILE_ROWS];
                for (r, x) in v.iter_mut().enumerate() {
                    *x = _mm512_loadu_si512(ptr(half + r));
                }
                swap_round(&mut v, 8, 1);
                swap_round(&mut v, 4, 2);
                swap_round(&mut v, 2, 3);
                swap_halves(&mut v);
                for (r, v) in v.into_iter().enumerate() {
                    _mm512_storeu_si512(ptr(half + r), v);
                }
            }
        }
    }

    /// The VNNI tiles of one full 32×32 step of a row-major `b` (`rows` starts at the
    /// step's first element, rows `ld` apart): line `pair` of tile `t` interleaves columns
    /// `16t..16t+16` of rows `2·pair` and `2·pair + 1`.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW; `rows` holds 32 rows of 32 elements, `ld` apart.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn interleave_rows(rows: &[u16], ld: usize, tiles: &mut [Line]) {
        debug_assert!(rows.len() >= 31 * ld + BLOCK && tiles.len() >= BLOCK);
        let (mut first, mut second) = ([0u16; 32], [0u16; 32]);
        for c in 0..TILE_ROWS {
            first[2 * c] = c as u16;
            first[2 * c + 1] = (BLOCK + c) as u16;
            second[2 * c] = (TILE_ROWS + c) as u16;
            second[2 * c + 1] = (BLOCK + TILE_ROWS + c) as u16;
        }
        // SAFETY: (caller) every load reads 64 bytes of a row inside `rows`; every store
        // writes one 64-byte line of `tiles`.
        unsafe {
            let first = _mm512_loadu_si512(first.as_ptr().cast());
            let second = _mm512_loadu_si512(second.as_ptr().cast());
            for pair in 0..TILE_ROWS {
                let even = _mm512_loadu_si512(rows.as_ptr().add(2 * pair * ld).cast());
                let odd = _mm512_loadu_si512(rows.as_ptr().add((2 * pair + 1) * ld).cast());
                let lo = _mm512_permutex2var_epi16(even, first, odd);
                let hi = _mm512_permutex2var_epi16(even, second, odd);
                _mm512_store_si512(tiles[pair].0.as_mut_ptr().cast(), lo);
                _mm512_store_si512(tiles[TILE_ROWS + pair].0.as_mut_ptr().cast(), hi);
            }
        }
    }

    /// One VNNI tile of `bᵀ`: line `pair` holds the `pair`-th 32-bit pair of each of the
    /// 16 rows of `b` (`rows` starts at the tile's first element, rows `ld` apart).
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW; `rows` holds 16 rows of 32 elements, `ld` apart.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn transpose_pairs(rows: &[u16], ld: usize, tile: &mut [Line]) {
        debug_assert!(rows.len() >= 15 * ld + BLOCK && tile.len() >= TILE_ROWS);
        // SAFETY: (caller) every load reads 64 bytes of a row inside `rows`.
        let mut v: [__m512i; TILE_ROWS] = std::array::from_fn(|c| unsafe {
            _mm512_loadu_si512(rows.as_ptr().add(c * ld).cast())
        });
        // SAFETY: (caller) AVX-512 F and BW.
        unsafe {
            swap_round(&mut v, 8, 0);
            swap_round(&mut v, 4, 1);
            swap_round(&mut v, 2, 2);
            swap_round(&mut v, 1, 3);
        }
        for (line, v) in tile.iter_mut().zip(v) {
            // SAFETY: a 64-byte aligned line.
            unsafe { _mm512_store_si512(line.0.as_mut_ptr().cast(), v) };
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    fn avx512_or_skip(test: &str) -> bool {
        let ok = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw");
        if !ok {
            eprintln!("{test}: skipped, the CPU lacks AVX-512 F/BW");
        }
        ok
    }

    /// A seeded stream of bit patterns with the special values mixed in: NaNs, infinities,
    /// zeros, denormals and exact bf16 rounding ties.
    fn patterns(n: usize, seed: u64) -> Vec<u32> {
        let special = [
            0x7fc0_0000,
            0xffc0_0001,
            0x7f80_0000,
            0xff80_0000,
            0,
            0x8000_0000,
            0x0000_8001,
            0x3f80_8000,
            0x3f81_8000,
            0x7f7f_ffff,
        ];
        let mut x = seed;
        (0..n)
            .map(|i| {
                crate::common::lcg(&mut x);
                if i % 7 == 0 {
                    special[(x >> 60) as usize % special.len()]
                } else {
                    (x >> 32) as u32
                }
            })
            .collect()
    }

    #[test]
    fn avx512_epilogue_rounds_as_the_portable_one() {
        if !avx512_or_skip("avx512_epilogue_rounds_as_the_portable_one") {
            return;
        }
        for seed in 0..200 {
            let acc: Vec<f32> = patterns(BLOCK, seed)
                .into_iter()
                .map(f32::from_bits)
                .collect();
            let add: Vec<u16> = patterns(BLOCK, seed + 1000)
                .iter()
                .map(|&b| (b >> 16) as u16)
                .collect();
            for (alpha, addend) in [(1.0, None), (-0.75, Some((2.5, &add[..])))] {
                let (mut want, mut got, mut got_bf16) = ([0u16; BLOCK], [0u16; BLOCK], None);
                finish_row(&acc, alpha, addend, &mut want);
                // SAFETY: AVX-512 F and BW checked above; rows of 32.
                unsafe { simd::finish_row(&acc, alpha, addend, &mut got) };
                if has_avx512_bf16() {
                    let mut row = [0u16; BLOCK];
                    // SAFETY: AVX-512 BF16 checked too; rows of 32.
                    unsafe { simd::finish_row_bf16(&acc, alpha, addend, &mut row) };
                    got_bf16 = Some(row);
                }
                let is_nan = |b: u16| b & 0x7fff > 0x7f80;
                for got in std::iter::once(got).chain(got_bf16) {
                    for (j, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        let same = g == w || (is_nan(g) && is_nan(w));
                        assert!(
                            same,
                            "seed {seed}, alpha {alpha}, lane {j}: {g:#06x} vs {w:#06x}"
                        );
                    }
                }
            }
        }
    }

    /// The block epilogues (one call a block) give each row the portable row's bits, with
    /// the addend's rows `ld` apart (an `ld` past 32, so that a wrong row offset shows).
    #[test]
    fn avx512_block_epilogue_is_the_portable_one_row_by_row() {
        if !avx512_or_skip("avx512_block_epilogue_is_the_portable_one_row_by_row") {
            return;
        }
        let ld = BLOCK + 5;
        let mut acc = [0.0f32; BLOCK * BLOCK];
        for (a, b) in acc.iter_mut().zip(patterns(BLOCK * BLOCK, 3)) {
            *a = f32::from_bits(b);
        }
        let add: Vec<u16> = patterns(BLOCK * ld, 4)
            .iter()
            .map(|&b| (b >> 16) as u16)
            .collect();
        for (alpha, addend) in [(1.0, None), (-0.75, Some((2.5, &add[..])))] {
            let mut want = [[0u16; BLOCK]; BLOCK];
            for (r, row) in want.iter_mut().enumerate() {
                let add_row = addend.map(|(beta, a)| (beta, &a[r * ld..][..BLOCK]));
                finish_row(&acc[r * BLOCK..][..BLOCK], alpha, add_row, row);
            }
            let mut got = [[0u16; BLOCK]; BLOCK];
            // SAFETY: AVX-512 F and BW checked above.
            unsafe { simd::finish_block(&acc, alpha, addend, ld, &mut got, BLOCK) };
            let mut blocks = vec![got];
            if has_avx512_bf16() {
                let mut got = [[0u16; BLOCK]; BLOCK];
                // SAFETY: AVX-512 BF16 checked too.
                unsafe { simd::finish_block_bf16(&acc, alpha, addend, ld, &mut got, BLOCK) };
                blocks.push(got);
            }
            let is_nan = |b: u16| b & 0x7fff > 0x7f80;
            for got in blocks {
                for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                    for (j, (&g, &w)) in g.iter().zip(w).enumerate() {
                        let same = g == w || (is_nan(g) && is_nan(w));
                        assert!(same, "alpha {alpha}, ({r}, {j}): {g:#06x} vs {w:#06x}");
                    }
                }
            }
        }
    }

    #[test]
    fn avx512_transpose_is_the_portable_transpose() {
        if !avx512_or_skip("avx512_transpose_is_the_portable_transpose") {
            return;
        }
        let values = patterns(BLOCK * BLOCK, 7);
        let mut want = [[0u16; BLOCK]; BLOCK];
        for (i, row) in want.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = values[i * BLOCK + j] as u16;
            }
        }
        let mut got = want;
        transpose_32x32(&mut want);
        // SAFETY: AVX-512 F and BW checked above.
        unsafe { simd::transpose_32x32(&mut got) };
        assert_eq!(got, want);
        assert_ne!(want[0][1], want[1][0], "the seeded block is not symmetric");
    }
}
