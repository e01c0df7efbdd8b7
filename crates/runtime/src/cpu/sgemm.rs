//! Our own float32 product for AVX2 + FMA machines: packed panels and a 6x16 register tile.
//!
//! On AVX2 CPUs (the 2-core EPYCs the issues measure on, or any CPU under `OPTIMUS_CPU_ISA=avx2`)
//! OpenBLAS's Haswell kernels left the products of our plans at 77-82% of the measured peak. This
//! product follows the usual blocked scheme (a KC-deep panel of the right operand packed into 16-column
//! strips, a block of left-operand rows in 6-row strips, a micro-kernel that keeps a 6x16 tile of the
//! result in twelve registers) and differs where our shapes gain:
//!
//! - with `beta = 0` the result is written once, never cleared first (OpenBLAS clears it, a pass over
//!   the output as large as a logits tensor);
//! - a left operand stored by rows (every forward product and input gradient) is not packed at all: the
//!   micro-kernel broadcasts its six rows where they lie. Packing cost about a cycle an element, and an
//!   element serves 2n flops, so narrow results lost most (alone, one thread under the AVX2 cap on an
//!   AMD EPYC: 1024x256x8192 from 0.89-0.90 to 0.93-0.94 of the peak, one 2x2 device's 512x128x4096
//!   from 0.87-0.88 to 0.94, and 1-3 points on the wide ones; `bench/results/2026-11-29-left-in-place/`).
//!   Read in place by steps instead, a transposed left operand (a weight gradient's) ran at 0.6 of the
//!   peak where its steps lie 16-32 KiB apart, so it stays packed, its runs fetched eight steps ahead;
//! - a transposed right operand is packed with 8x8 register transposes, not element by element;
//! - a tile's output lines are fetched into cache when the tile starts, so its stores do not wait on
//!   memory (alone under the AVX2 cap: the tied head's 1024x8192x256 product from 77% to 87% of the
//!   peak on one thread, 1024x256x1024 from 82% to 88%).
//!
//! Each element of the result is one FMA chain over k within a panel, the panels taken in order, so
//! the bits depend on neither the split of rows and columns over threads nor where a tile falls.
//!
//! Measured alone against OpenBLAS 0.3.21 (Haswell core) on a Xeon narrowed to AVX2, GPT-2 small's
//! shapes (`scripts/bench_sgemm.sh`): before the output prefetch, level on the 1x1 shapes and ahead on
//! one 2x2 device's, behind on wider models' (k above 256, several panels each reading the output back:
//! 70-81% against 79-89% of the peak; `bench/results/2026-11-27-own-sgemm/`), so it took only the
//! one-panel products beside OpenBLAS. With the prefetch it is level or ahead on most shapes, 2-5 points
//! behind on one thread on weight gradients of few rows (256x768x1024, 256x1024x1024, 128x512x512;
//! `bench/results/2026-11-28-prefetch-pin/`), and GPT-2 training steps with it for every
//! product, against OpenBLAS beside it for the one-panel products, ran 1.042x (1x1) and 1.076x (2x2)
//! at hidden 768, 1.047x and 1.003x at hidden 512, 1.007x and 0.993x at hidden 256 and 1.013x on
//! megatron 1x4: so where the CPU's widest vectors are AVX2 it runs every product it takes, OpenBLAS
//! (or faer) the rest.

use faer::{MatMut, MatRef};

/// How `run --profile` names this product.
pub const DESCRIPTION: &str = "optimus AVX2 6x16";

/// Rows of the register tile.
const MR: usize = 6;
/// Columns of the register tile: two 8-float vectors.
const NR: usize = 16;
/// Rows of the left operand packed per block (rounded to a multiple of MR, blocks balanced).
const MC: usize = 144;
/// Columns of the right operand packed per panel.
const NC: usize = 1024;

/// A strided read-only matrix: element (i, j) at `p + i * rs + j * cs`.
#[derive(Clone, Copy)]
struct Strided {
    p: *const f32,
    rs: isize,
    cs: isize,
}

impl Strided {
    fn of(m: MatRef<'_, f32>) -> Strided {
        Strided { p: m.as_ptr(), rs: m.row_stride(), cs: m.col_stride() }
    }

    fn transposed(self) -> Strided {
        Strided { p: self.p, rs: self.cs, cs: self.rs }
    }

    /// The element pointer of (i, j); the caller keeps (i, j) within the matrix.
    fn at(self, i: usize, j: usize) -> *const f32 {
        self.p.wrapping_offset(i as isize * self.rs + j as isize * self.cs)
    }
}

/// The output: row-major with rows `rs` apart (unit column stride).
#[derive(Clone, Copy)]
struct Output {
    p: *mut f32,
    rs: isize,
}

impl Output {
    fn at(self, i: usize, j: usize) -> Output {
        Output { p: self.p.wrapping_offset(i as isize * self.rs + j as isize), rs: self.rs }
    }
}

/// Whether this product can run here: AVX2 and FMA present and, unless `forced`, the CPU kernels' widest
/// instruction set AVX2 (on AVX-512, faer's 16-wide kernels are faster than this one).
pub fn applies(forced: bool) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let present = std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
        present && (forced || super::vmath::isa() == super::vmath::Isa::Avx2Fma)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = forced;
        false
    }
}

/// dst = alpha * lhs * rhs (+ dst when `accumulate`) on this thread; `false` (nothing done) where the
/// CPU lacks AVX2 or FMA, neither of dst's strides is one, or it has fewer than 6 rows (and columns).
/// The dimensions match (the caller checked).
pub fn product(dst: MatMut<'_, f32>, lhs: MatRef<'_, f32>, rhs: MatRef<'_, f32>, accumulate: bool, alpha: f32) -> bool {
    if !applies(true) {
        return false;
    }
    let (m, n, k) = (dst.nrows(), dst.ncols(), lhs.ncols());
    if m == 0 || n == 0 {
        return true;
    }
    let (a, b) = (Strided::of(lhs), Strided::of(rhs));
    // A column-major output is the transposed product written row-major: dst^T = rhs^T lhs^T.
    let (a, b, c, m, n) = if dst.col_stride() == 1 || n == 1 {
        (a, b, Output { p: dst.as_ptr_mut(), rs: dst.row_stride() }, m, n)
    } else if dst.row_stride() == 1 || m == 1 {
        (b.transposed(), a.transposed(), Output { p: dst.as_ptr_mut(), rs: dst.col_stride() }, n, m)
    } else {
        return false;
    };
    if m < MR {
        // Fewer rows than a tile (a decoding step's one row): packing the right operand would cost
        // more than the product; faer's matrix-vector path does better.
        return false;
    }
    // SAFETY: faer's views hold every element their dimensions and strides reach, `dst` is the only
    // view written and the blocked loops read and write only elements within (m, n, k).
    #[cfg(target_arch = "x86_64")]
    unsafe {
        x86::blocked(Sizes { m, n, k }, a, b, c, (alpha, accumulate));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (a, b, c, k);
    true
}

/// The product's dimensions: dst is m x n, the inner dimension k.
#[derive(Clone, Copy)]
struct Sizes {
    m: usize,
    n: usize,
    k: usize,
}

/// Steps of k packed per panel: a 16-column strip of 256 (16 KiB) and a 6-row strip (6 KiB) stay in
/// a 32 KiB L1 (an EPYC's) beside the tile's output rows. 512, tried on a 48 KiB L1, ran GPT-2 small's
/// weight gradients slower (70-80% of the peak against 78-85%), though some hidden-512 shapes ran
/// faster alone; deeper panels are what this kernel would need to catch OpenBLAS on wider models.
const KC: usize = 256;

thread_local! {
    /// This thread's packing buffers (left block, right panel), kept between products.
    static PANELS: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Rows per block of the left operand: at most MC, a multiple of MR, the blocks about equal.
fn block_rows(m: usize) -> usize {
    let blocks = m.div_ceil(MC);
    m.div_ceil(blocks).div_ceil(MR) * MR
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The AVX2 + FMA loops: blocking, packing and the 6x16 micro-kernel.

    use super::{KC, MR, NC, NR, Output, PANELS, Sizes, Strided, block_rows};
    use std::arch::x86_64::*;

    /// c = alpha * a * b (+ c when accumulating), blocked: for each NC-column panel of b and each
    /// KC-deep slice, pack the panel, then each block of a's rows (or only its partial last strip, where
    /// a's rows are read in place), and run the micro-kernel over the tiles.
    ///
    /// # Safety
    /// a is m x k, b is k x n and c is m x n, each element reachable through its strides; c is the only
    /// one written (and read back when accumulating).
    pub(super) unsafe fn blocked(sizes: Sizes, a: Strided, b: Strided, c: Output, (alpha, accumulate): (f32, bool)) {
        let Sizes { m, n, k } = sizes;
        let mc = block_rows(m);
        PANELS.with_borrow_mut(|(left, right)| {
            let left = aligned(left, mc.div_ceil(MR) * MR * KC + 8);
            let right = aligned(right, n.min(NC).div_ceil(NR) * NR * KC);
            for j0 in (0..n).step_by(NC) {
                let nc = (n - j0).min(NC);
                for k0 in (0..k).step_by(KC) {
                    let kc = (k - k0).min(KC);
                    let store = if accumulate || k0 > 0 { Store::Add } else { Store::Write };
                    // SAFETY: the panel and blocks lie within b, a and c (the caller's contract).
                    unsafe {
                        pack_right(right, b, (k0, kc), (j0, nc));
                        for i0 in (0..m).step_by(mc) {
                            let rows = (m - i0).min(mc);
                            let block = if a.cs == 1 {
                                // Only a last strip of fewer than MR rows is packed (zero-padded).
                                let full = rows / MR * MR;
                                if full < rows {
                                    pack_left(left, a, (i0 + full, rows - full), (k0, kc));
                                }
                                Left::InPlace { first: a.at(i0, k0), rs: a.rs, edge: left }
                            } else {
                                pack_left(left, a, (i0, rows), (k0, kc));
                                Left::Packed(left)
                            };
                            tiles(block, right, Sizes { m: rows, n: nc, k: kc }, c.at(i0, j0), (alpha, store));
                        }
                    }
                }
            }
        });
        if k == 0 && !accumulate {
            // No panel ran: the product of empty operands is zero.
            for i in 0..m {
                // SAFETY: row i of c holds n elements.
                unsafe { std::ptr::write_bytes(c.at(i, 0).p, 0, n) };
            }
        }
    }

    /// A block of the left operand as the tiles read it.
    #[derive(Clone, Copy)]
    enum Left<'a> {
        /// Packed into 6-row strips by [`pack_left`].
        Packed(&'a [f32]),
        /// Read where it is: row r of the block at `first + r * rs`, unit stride along k; a last strip
        /// of fewer than MR rows is packed into `edge`, zero-padded.
        InPlace { first: *const f32, rs: isize, edge: &'a [f32] },
    }

    /// One 6-row strip of a [`Left`] block, k steps deep.
    #[derive(Clone, Copy)]
    enum LeftStrip {
        Packed(*const f32),
        InPlace(*const f32, isize),
    }

    impl Left<'_> {
        /// Strip p, which has `rows` rows, of a block k steps deep.
        fn strip(self, p: usize, rows: usize, k: usize) -> LeftStrip {
            match self {
                Left::Packed(packed) => LeftStrip::Packed(packed[p * MR * k..].as_ptr()),
                Left::InPlace { edge, .. } if rows < MR => LeftStrip::Packed(edge.as_ptr()),
                Left::InPlace { first, rs, .. } => {
                    LeftStrip::InPlace(first.wrapping_offset((p * MR) as isize * rs), rs)
                }
            }
        }
    }

    impl LeftStrip {
        /// The micro-kernel over this strip.
        ///
        /// # Safety
        /// As for [`micro`].
        unsafe fn micro(self, k: usize, b: *const f32, c: Output, alpha: f32, store: Store) {
            // SAFETY: the caller's contract; the strip holds six rows of k steps.
            unsafe {
                match self {
                    LeftStrip::Packed(a) => micro::<false>(k, (a, 1), b, c, alpha, store),
                    LeftStrip::InPlace(a, rs) => micro::<true>(k, (a, rs), b, c, alpha, store),
                }
            }
        }
    }

    /// How a tile's sums reach the output.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Store {
        /// c = alpha * sum.
        Write,
        /// c = alpha * sum + c, one FMA.
        Add,
    }

    fn grow(v: &mut Vec<f32>, len: usize) {
        if v.len() < len {
            v.resize(len, 0.0);
        }
    }

    /// `len` floats of `v` starting on a cache line (64 bytes), `v` grown to hold them. A 16-column
    /// strip's step is one line: where the allocator left a buffer 16 or 48 bytes off a line, one of
    /// each step's two loads straddled two lines, and products ran 0.4-4.6% slower (alone, on one
    /// thread under the AVX2 cap, nine shapes, paired call by call, two rounds).
    pub(super) fn aligned(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
        let slack = LINE / size_of::<f32>();
        grow(v, len + slack);
        let first = v.as_ptr().align_offset(LINE).min(slack);
        &mut v[first..first + len]
    }

    /// A cache line's bytes.
    const LINE: usize = 64;

    /// Steps of k ahead that [`left_columns`] fetches its runs. A weight gradient's steps lie a row of
    /// its input apart (32 KiB for the vocabulary's 8192x256x1024), further than the hardware
    /// prefetchers follow: fetched ahead, that product went from 0.86 to 0.91 of the peak (alone, one
    /// thread under the AVX2 cap on an AMD EPYC), 4096x128x512 from 0.82-0.84 to 0.88.
    const AHEAD: usize = 8;

    /// Runs the micro-kernel over every 6x16 tile of the block: strips of the right panel outside (each
    /// stays in L1 while the block's row strips stream past it), full tiles straight into c, edge tiles
    /// through a scratch tile.
    ///
    /// # Safety
    /// `left` holds the block of these sizes (packed, or in place with its partial strip packed),
    /// `right` the packed panel; c holds sizes.m x sizes.n.
    unsafe fn tiles(left: Left<'_>, right: &[f32], sizes: Sizes, c: Output, (alpha, store): (f32, Store)) {
        let Sizes { m, n, k } = sizes;
        let mut scratch = [0f32; MR * NR];
        for q in 0..n.div_ceil(NR) {
            let cols = (n - q * NR).min(NR);
            let strip = right[q * NR * k..].as_ptr();
            for p in 0..m.div_ceil(MR) {
                let rows = (m - p * MR).min(MR);
                let a = left.strip(p, rows, k);
                let tile = c.at(p * MR, q * NR);
                // SAFETY: the strips hold k steps each; a full tile lies within c.
                unsafe {
                    if rows == MR && cols == NR {
                        a.micro(k, strip, tile, alpha, store);
                    } else {
                        let out = Output { p: scratch.as_mut_ptr(), rs: NR as isize };
                        a.micro(k, strip, out, 1.0, Store::Write);
                        for i in 0..rows {
                            for j in 0..cols {
                                let d = tile.at(i, j).p;
                                let v = scratch[i * NR + j];
                                *d = if store == Store::Add { alpha.mul_add(v, *d) } else { alpha * v };
                            }
                        }
                    }
                }
            }
        }
    }

    /// c[0..6][0..16] = alpha * sum_k a[k][0..6] x b[k][0..16] (+ c when `add`, one FMA per element), with
    /// the tile in twelve registers; b is a packed strip of k steps, a a packed one or six rows in place.
    ///
    /// # Safety
    /// a's strip holds six rows of k steps (packed: 6k floats; in place: rows `rs` apart), b holds 16k
    /// floats; c's 6 rows of 16 are writable.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn micro<const IN_PLACE: bool>(
        k: usize,
        (a, rs): (*const f32, isize),
        b: *const f32,
        c: Output,
        alpha: f32,
        store: Store,
    ) {
        // The tile's output lines, fetched now so that they are in cache when the sums are stored. A
        // wide output (the tied head's logits, 32 MiB at GPT-2 small's 1x1) is not in any cache: its
        // stores waited on memory, and the product ran at 76% of the peak against 91% for a
        // 1024-column one.
        for r in 0..MR {
            let row = c.at(r, 0).p.cast_const().cast::<i8>();
            _mm_prefetch::<_MM_HINT_T0>(row);
            _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(4 * (NR - 1)));
        }
        let zero = _mm256_setzero_ps();
        let mut acc = [[zero; 2]; MR];
        let (mut a, mut b) = (a, b);
        // Four steps a turn of the loop, its counter and pointer updates once for 48 FMAs: the loop
        // then issues about 21 instructions a step instead of 23 (paired call by call against the loop
        // of one step, nine shapes alone on one thread under the AVX2 cap: 0.93-1.00 of its time, the
        // most while the VM ran slow).
        // A packed strip holds step k's six values together; rows read in place hold them `rs` apart,
        // the next step's one float on.
        let a_step = if IN_PLACE { 1 } else { MR };
        for _ in 0..k / UNROLL {
            for _ in 0..UNROLL {
                // SAFETY: step k of each strip lies within it.
                unsafe { step::<IN_PLACE>(&mut acc, (a, rs), b) };
                (a, b) = (a.wrapping_add(a_step), b.wrapping_add(NR));
            }
        }
        for _ in 0..k % UNROLL {
            // SAFETY: as above.
            unsafe { step::<IN_PLACE>(&mut acc, (a, rs), b) };
            (a, b) = (a.wrapping_add(a_step), b.wrapping_add(NR));
        }
        let scale = _mm256_set1_ps(alpha);
        for (r, row) in acc.iter().enumerate() {
            for (h, v) in row.iter().enumerate() {
                let p = c.at(r, 8 * h).p;
                // SAFETY: row r of the tile holds 16 floats.
                unsafe {
                    match store {
                        Store::Write => _mm256_storeu_ps(p, _mm256_mul_ps(scale, *v)),
                        Store::Add => _mm256_storeu_ps(p, _mm256_fmadd_ps(scale, *v, _mm256_loadu_ps(p))),
                    }
                }
            }
        }
    }

    /// Steps of k the micro-kernel's loop takes a turn.
    const UNROLL: usize = 4;

    /// One step of k: the tile's sums += a[0..6] x b[0..16], a's values consecutive (packed) or `rs`
    /// apart (in place).
    ///
    /// # Safety
    /// a's six values and b's 16 floats lie within their operands.
    #[inline(always)]
    unsafe fn step<const IN_PLACE: bool>(acc: &mut [[__m256; 2]; MR], (a, rs): (*const f32, isize), b: *const f32) {
        // SAFETY: the caller's contract.
        unsafe {
            let b0 = _mm256_loadu_ps(b);
            let b1 = _mm256_loadu_ps(b.add(8));
            for (r, row) in acc.iter_mut().enumerate() {
                let value = if IN_PLACE { a.offset(r as isize * rs) } else { a.add(r) };
                let ar = _mm256_broadcast_ss(&*value);
                row[0] = _mm256_fmadd_ps(ar, b0, row[0]);
                row[1] = _mm256_fmadd_ps(ar, b1, row[1]);
            }
        }
    }

    /// Packs rows i0.. of a, columns k0..k0+kc, into 6-row strips: strip p holds a[6p + r][k] at k*6 + r,
    /// rows past the block zero.
    ///
    /// # Safety
    /// The rows and columns lie within a; `dst` holds the strips and 8 floats more.
    unsafe fn pack_left(dst: &mut [f32], a: Strided, (i0, rows): (usize, usize), (k0, kc): (usize, usize)) {
        let d = dst.as_mut_ptr();
        if a.rs == 1 {
            // SAFETY: as below.
            unsafe { left_columns(d, a, (i0, rows), (k0, kc)) };
            return;
        }
        for p in 0..rows.div_ceil(MR) {
            let strip = d.wrapping_add(p * MR * kc);
            let height = (rows - p * MR).min(MR);
            let first = a.at(i0 + p * MR, k0);
            // SAFETY: strip p and its source rows lie within dst and a.
            unsafe {
                for k in 0..kc {
                    for r in 0..MR {
                        let v = if r < height { *first.offset(r as isize * a.rs + k as isize * a.cs) } else { 0.0 };
                        *strip.add(k * MR + r) = v;
                    }
                }
            }
        }
    }

    /// [`pack_left`] for a left operand of unit row stride (a transposed row-major matrix): step k of
    /// every strip comes from one contiguous run, so the runs are read in order, each once.
    ///
    /// # Safety
    /// As for [`pack_left`].
    unsafe fn left_columns(d: *mut f32, a: Strided, (i0, rows): (usize, usize), (k0, kc): (usize, usize)) {
        let full = rows / MR;
        for k in 0..kc {
            let run = a.at(i0, k0 + k);
            if k + AHEAD < kc {
                let ahead = a.at(i0, k0 + k + AHEAD);
                for i in (0..rows).step_by(LINE / size_of::<f32>()).chain([rows - 1]) {
                    // SAFETY: a prefetch reads nothing; the address lies within a anyway.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(i).cast::<i8>()) };
                }
            }
            // SAFETY: the run holds `rows` elements; strip p's step k lies within dst.
            unsafe {
                for p in 0..full {
                    std::ptr::copy_nonoverlapping(run.add(p * MR), d.add(p * MR * kc + k * MR), MR);
                }
                if full * MR < rows {
                    for r in 0..MR {
                        let i = full * MR + r;
                        *d.add(full * MR * kc + k * MR + r) = if i < rows { *run.add(i) } else { 0.0 };
                    }
                }
            }
        }
    }

    /// Packs rows k0..k0+kc of b, columns j0..j0+nc, into 16-column strips: strip q holds b[k][16q + j]
    /// at k*16 + j, columns past the panel zero.
    ///
    /// # Safety
    /// The rows and columns lie within b; `dst` holds the strips.
    unsafe fn pack_right(dst: &mut [f32], b: Strided, (k0, kc): (usize, usize), (j0, nc): (usize, usize)) {
        let d = dst.as_mut_ptr();
        for q in 0..nc.div_ceil(NR) {
            let strip = d.wrapping_add(q * NR * kc);
            let width = (nc - q * NR).min(NR);
            let first = b.at(k0, j0 + q * NR);
            // SAFETY: strip q and its source lie within dst and b.
            unsafe {
                if width == NR && b.rs == 1 {
                    right_columns(strip, first, b.cs, kc);
                } else if width == NR && b.cs == 1 {
                    for k in 0..kc {
                        std::ptr::copy_nonoverlapping(first.offset(k as isize * b.rs), strip.add(k * NR), NR);
                    }
                } else {
                    for k in 0..kc {
                        for j in 0..NR {
                            let v = if j < width { *first.offset(k as isize * b.rs + j as isize * b.cs) } else { 0.0 };
                            *strip.add(k * NR + j) = v;
                        }
                    }
                }
            }
        }
    }

    /// Packs sixteen columns of b stored as rows (unit stride along k, `cs` apart): dst[k*16 + j] =
    /// column j[k], by two 8x8 transposes per eight k.
    ///
    /// # Safety
    /// The sixteen columns hold kc floats each; dst holds 16kc floats.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn right_columns(dst: *mut f32, first: *const f32, cs: isize, kc: usize) {
        let mut k = 0;
        while k + 8 <= kc {
            for half in 0..2 {
                // SAFETY: k..k+8 lies within each column; the stores within dst.
                unsafe {
                    let column = |j: usize| first.wrapping_offset((half * 8 + j) as isize * cs).add(k);
                    let cols = transpose8(std::array::from_fn(|j| _mm256_loadu_ps(column(j))));
                    for (i, col) in cols.iter().enumerate() {
                        _mm256_storeu_ps(dst.add((k + i) * NR + half * 8), *col);
                    }
                }
            }
            k += 8;
        }
        for k in k..kc {
            for j in 0..NR {
                // SAFETY: as above, one element at a time.
                unsafe { *dst.add(k * NR + j) = *first.wrapping_offset(j as isize * cs).add(k) };
            }
        }
    }

    /// The columns of the 8x8 block whose rows are `r`: out[k] = [r[0][k], ..., r[7][k]].
    #[target_feature(enable = "avx2,fma")]
    fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        let t = [
            _mm256_unpacklo_ps(r[0], r[1]),
            _mm256_unpackhi_ps(r[0], r[1]),
            _mm256_unpacklo_ps(r[2], r[3]),
            _mm256_unpackhi_ps(r[2], r[3]),
            _mm256_unpacklo_ps(r[4], r[5]),
            _mm256_unpackhi_ps(r[4], r[5]),
            _mm256_unpacklo_ps(r[6], r[7]),
            _mm256_unpackhi_ps(r[6], r[7]),
        ];
        let s = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
        ];
        [
            _mm256_permute2f128_ps::<0x20>(s[0], s[4]),
            _mm256_permute2f128_ps::<0x20>(s[1], s[5]),
            _mm256_permute2f128_ps::<0x20>(s[2], s[6]),
            _mm256_permute2f128_ps::<0x20>(s[3], s[7]),
            _mm256_permute2f128_ps::<0x31>(s[0], s[4]),
            _mm256_permute2f128_ps::<0x31>(s[1], s[5]),
            _mm256_permute2f128_ps::<0x31>(s[2], s[6]),
            _mm256_permute2f128_ps::<0x31>(s[3], s[7]),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faer::Mat;

    /// Deterministic values in [-1, 1) with no pattern a blocking could hide behind.
    fn values(seed: u64, len: usize) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// A `rows x cols` operand stored row-major (or, when `transposed`, as its transpose row-major), with
    /// `pad` unused elements after each stored row.
    struct Operand {
        data: Vec<f32>,
        rows: usize,
        cols: usize,
        transposed: bool,
        pad: usize,
    }

    impl Operand {
        fn new(seed: u64, (rows, cols): (usize, usize), transposed: bool, pad: usize) -> Operand {
            let stored = if transposed { cols * (rows + pad) } else { rows * (cols + pad) };
            Operand { data: values(seed, stored), rows, cols, transposed, pad }
        }

        fn view(&self) -> MatRef<'_, f32> {
            if self.transposed {
                MatRef::from_row_major_slice_with_stride(&self.data, self.cols, self.rows, self.rows + self.pad)
                    .transpose()
            } else {
                MatRef::from_row_major_slice_with_stride(&self.data, self.rows, self.cols, self.cols + self.pad)
            }
        }
    }

    /// alpha * a * b (+ c0) in f64, and the bound on each element's f32 rounding: k ulps of the sum of
    /// the magnitudes, generously.
    fn reference(
        a: MatRef<'_, f32>,
        b: MatRef<'_, f32>,
        c0: &Mat<f32>,
        (alpha, accumulate): (f32, bool),
    ) -> (Mat<f64>, Mat<f64>) {
        let (m, n, k) = (a.nrows(), b.ncols(), a.ncols());
        let mut exact = Mat::<f64>::zeros(m, n);
        let mut bound = Mat::<f64>::zeros(m, n);
        for i in 0..m {
            for j in 0..n {
                let (mut sum, mut magnitude) = (0.0f64, 0.0f64);
                for l in 0..k {
                    let term = f64::from(a[(i, l)]) * f64::from(b[(l, j)]);
                    sum += term;
                    magnitude += term.abs();
                }
                let base = if accumulate { f64::from(c0[(i, j)]) } else { 0.0 };
                exact[(i, j)] = f64::from(alpha) * sum + base;
                bound[(i, j)] =
                    (k as f64 + 2.0) * f64::from(f32::EPSILON) * (f64::from(alpha.abs()) * magnitude + base.abs());
            }
        }
        (exact, bound)
    }

    /// Runs our product on every layout of the operands and of the output and checks each element.
    fn check(m: usize, n: usize, k: usize) {
        for (case, (ta, tb, column_major_out)) in [
            (false, false, false),
            (true, false, false),
            (false, true, false),
            (true, true, true),
            (false, false, true),
        ]
        .into_iter()
        .enumerate()
        {
            let seed = (m * 1_000_003 + n * 1009 + k * 7 + case) as u64;
            let (a, b) = (Operand::new(seed, (m, k), ta, 3), Operand::new(seed + 1, (k, n), tb, 0));
            for (alpha, accumulate) in [(1.0f32, false), (0.5, true)] {
                let c0 = Mat::<f32>::from_fn(m, n, |i, j| ((i * 31 + j * 17) % 11) as f32 - 5.0);
                let mut c = if column_major_out { c0.clone() } else { Mat::<f32>::zeros(n, m) };
                let mut out = if column_major_out { c.as_mut() } else { c.as_mut().transpose_mut() };
                if !column_major_out {
                    out.copy_from(c0.as_ref());
                }
                // A column-major output is written as its transpose: n rows.
                let tile_rows = if column_major_out { n } else { m };
                let done = product(out.as_mut(), a.view(), b.view(), accumulate, alpha);
                assert_eq!(done, tile_rows >= MR, "{m}x{n}x{k} case {case}");
                if !done {
                    continue;
                }
                let (exact, bound) = reference(a.view(), b.view(), &c0, (alpha, accumulate));
                for i in 0..m {
                    for j in 0..n {
                        let error = (f64::from(out[(i, j)]) - exact[(i, j)]).abs();
                        assert!(
                            error <= bound[(i, j)] + 1e-30,
                            "{m}x{n}x{k} case {case} alpha {alpha} accumulate {accumulate}: ({i}, {j}) off by {error:e}, bound {:e}",
                            bound[(i, j)]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn products_match_the_f64_product_on_every_layout_and_edge() {
        if !applies(true) {
            return;
        }
        // Tiles of 6x16 with partial edges, a k deeper than the panel depth (several panels), an n wider
        // than one packed panel (NC), tiny and odd sizes, and several row blocks the last of which ends
        // in a partial strip (packed beside rows read in place).
        for (m, n, k) in [
            (6, 16, 1),
            (7, 17, 9),
            (13, 33, 64),
            (48, 32, 1030),
            (6, 2100, 20),
            (150, 40, 300),
            (31, 5, 17),
            (299, 35, 520),
        ] {
            check(m, n, k);
        }
    }

    #[test]
    fn products_match_the_f64_product_on_random_shapes() {
        if !applies(true) {
            return;
        }
        // Shapes the fixed list may miss: every residue of the tile's rows and columns and of the loop's
        // unrolling, one or several panels deep, one or several row blocks.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut draw = |below: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % below as u64) as usize
        };
        for _ in 0..24 {
            let (m, n, k) = (6 + draw(160), 1 + draw(90), 1 + draw(600));
            check(m, n, k);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn packing_buffers_start_on_a_cache_line_whatever_the_allocator_gives() {
        // Buffers of every length the allocator may place anywhere; each view starts on a 64-byte line.
        for start in [0usize, 1, 7, 100, 4096] {
            let mut v = vec![0f32; start];
            for len in [1usize, 17, 6 * 256 + 8, 1 << 16] {
                let view = x86::aligned(&mut v, len);
                assert_eq!(view.len(), len);
                assert_eq!(view.as_ptr() as usize % 64, 0, "start {start}, len {len}");
            }
        }
    }

    #[test]
    fn an_empty_inner_dimension_gives_zero_or_leaves_the_sum() {
        if !applies(true) {
            return;
        }
        let (a, b) = (Operand::new(3, (7, 0), false, 0), Operand::new(4, (0, 18), false, 0));
        for (accumulate, expected) in [(false, 0.0f32), (true, 2.5)] {
            let mut c = Mat::<f32>::from_fn(18, 7, |_, _| 2.5);
            assert!(product(c.as_mut().transpose_mut(), a.view(), b.view(), accumulate, 1.0));
            assert!(c.col_iter().all(|col| col.iter().all(|&x| x == expected)), "accumulate {accumulate}");
        }
    }

    #[test]
    fn fewer_rows_than_a_tile_are_left_to_the_caller() {
        if !applies(true) {
            return;
        }
        let (a, b) = (Operand::new(1, (5, 8), false, 0), Operand::new(2, (8, 4), false, 0));
        let mut c = Mat::<f32>::zeros(4, 5);
        // Row-major 5x4 output: 5 rows, fewer than a tile.
        assert!(!product(c.as_mut().transpose_mut(), a.view(), b.view(), false, 1.0));
    }

    #[test]
    fn the_bits_do_not_depend_on_how_rows_and_columns_are_split() {
        if !applies(true) {
            return;
        }
        let (m, n, k) = (61, 45, 700);
        let (a, b) = (Operand::new(5, (m, k), false, 0), Operand::new(6, (k, n), true, 0));
        let mut whole = Mat::<f32>::zeros(n, m);
        assert!(product(whole.as_mut().transpose_mut(), a.view(), b.view(), false, 0.75));
        for (rows, cols) in [(7, 45), (61, 19), (25, 33)] {
            let mut parts = Mat::<f32>::zeros(n, m);
            let mut out = parts.as_mut().transpose_mut();
            for (r0, r1) in [(0, rows), (rows, m)] {
                for (c0, c1) in [(0, cols), (cols, n)] {
                    if r1 - r0 < MR || c1 == c0 {
                        continue;
                    }
                    let dst = out.as_mut().submatrix_mut(r0, c0, r1 - r0, c1 - c0);
                    let (lhs, rhs) = (a.view().subrows(r0, r1 - r0), b.view().subcols(c0, c1 - c0));
                    assert!(product(dst, lhs, rhs, false, 0.75));
                }
            }
            for i in 0..m {
                for j in 0..n {
                    let skipped = (i < rows && rows < MR) || (i >= rows && m - rows < MR);
                    if !skipped {
                        assert_eq!(
                            out[(i, j)].to_bits(),
                            whole[(j, i)].to_bits(),
                            "split at row {rows}, column {cols}: ({i}, {j})"
                        );
                    }
                }
            }
        }
    }
}
