//! Which library runs the CPU kernels' float32 products: OpenBLAS, loaded at run time when the
//! machine has it (Debian: `libopenblas0`); else our own AVX2 kernel ([`super::sgemm`]) on CPUs whose
//! widest vectors are AVX2; else faer. Measured on a 2-core AVX2 EPYC, OpenBLAS's products match
//! faer's on plain shapes and are faster on the weight gradients' (a transposed left operand), which
//! faer runs at 25-60% of the peak: the tied head's (8192x1024x256) ran at 43-53 GFLOP/s in faer and
//! 113-127 in OpenBLAS, and whole steps ran 1.05-1.41x faster (`scripts/bench_products.sh`). On a CPU
//! whose widest vectors are AVX2, our kernel runs every product it takes (all but those of fewer than
//! six rows, a decoding step's, which go to OpenBLAS's matrix-vector path): since it prefetches its
//! output it ran GPT-2 training steps 0.99-1.08x as fast as OpenBLAS's Haswell kernels under the AVX2
//! cap, hidden 256 to 768 (see its module). Nothing is needed at build time.
//!
//! OpenBLAS is held to one thread per call: the kernel pool splits large products itself, by blocks
//! of output rows, so results depend only on the pool's size, as with faer, and concurrent calls from
//! the pool's workers do not fight over OpenBLAS's own threads. `OPTIMUS_BLAS` chooses: `faer`;
//! `optimus` (our kernel for every product it runs, wherever the CPU has AVX2 and FMA, on AVX-512 too);
//! a path (that OpenBLAS alone). The bf16 emulation's products stay in faer ([`faer_only`]).
//!
//! An OpenBLAS older than its CPU does not know it and falls back to its SSE3 kernels: Debian's 0.3.21
//! on an Emerald Rapids Xeon chose Prescott's, and the products of a GPT-2 training step ran at 39
//! GFLOP/s against 196-243 with its SkylakeX kernels. `optimusc` therefore asks OpenBLAS for the kernels
//! of the CPU's width (`OPENBLAS_CORETYPE`, see its `main`), and one found whose kernels are still
//! narrower than the CPU kernels' instructions is left aside ([`left_aside`]): faer or our kernel run
//! its products.

use super::vmath::{Isa, isa};
use faer::{MatMut, MatRef};
use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// Sequential product calls OpenBLAS, faer and our kernel ran, since the process started (see [`calls`]).
static BLAS_CALLS: AtomicU64 = AtomicU64::new(0);
static FAER_CALLS: AtomicU64 = AtomicU64::new(0);
static OPTIMUS_CALLS: AtomicU64 = AtomicU64::new(0);

/// How many of the CPU kernels' sequential products (the parts a product is split into) OpenBLAS, faer
/// and our kernel ran since the process started: `run --profile` shows it, so that a run says which library did
/// its products, not only which was found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Calls {
    pub openblas: u64,
    pub faer: u64,
    /// Our AVX2 kernel's ([`super::sgemm`]).
    #[serde(default)]
    pub optimus: u64,
}

impl Calls {
    pub fn total(self) -> u64 {
        self.openblas + self.faer + self.optimus
    }
}

pub fn calls() -> Calls {
    Calls {
        openblas: BLAS_CALLS.load(Ordering::Relaxed),
        faer: FAER_CALLS.load(Ordering::Relaxed),
        optimus: OPTIMUS_CALLS.load(Ordering::Relaxed),
    }
}

/// Counts one sequential product in faer.
pub fn count_faer_call() {
    FAER_CALLS.fetch_add(1, Ordering::Relaxed);
}

thread_local! {
    /// Set while this thread runs a kernel whose products must be faer's (see [`faer_only`]).
    static FAER_ONLY: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with this thread's products in faer. The CPU's bf16 emulation needs it: it cuts products
/// into tiles that must give the whole product's bits, which faer's fixed blocking does and OpenBLAS's
/// edge kernels do not. Products read this where they start (the split parts inherit it).
pub fn faer_only<R>(f: impl FnOnce() -> R) -> R {
    let before = FAER_ONLY.with(|flag| flag.replace(true));
    let result = f();
    FAER_ONLY.with(|flag| flag.set(before));
    result
}

/// The library a product runs in.
#[derive(Clone, Copy)]
pub enum Products {
    /// Our AVX2 kernel ([`super::sgemm`]).
    Optimus,
    OpenBlas(&'static Blas),
    /// Our kernel for every product it takes, OpenBLAS for the others (fewer than six rows).
    Mixed(&'static Blas),
    Faer,
}

impl Products {
    /// dst = alpha * lhs * rhs (+ dst when `accumulate`) on this thread, in this library where it takes
    /// the layouts, else in faer; the dimensions match and are non-zero (the caller checked).
    pub fn product(
        self,
        dst: MatMut<'_, f32>,
        lhs: MatRef<'_, f32>,
        rhs: MatRef<'_, f32>,
        accumulate: bool,
        alpha: f32,
    ) {
        let mut dst = dst;
        let ours = matches!(self, Products::Optimus | Products::Mixed(_));
        if ours && super::sgemm::product(dst.as_mut(), lhs, rhs, accumulate, alpha) {
            OPTIMUS_CALLS.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // `Blas::product` counts its own calls.
        if let Products::OpenBlas(blas) | Products::Mixed(blas) = self
            && blas.product(dst.as_mut(), lhs, rhs, accumulate, alpha)
        {
            return;
        }
        count_faer_call();
        let accum = if accumulate { faer::Accum::Add } else { faer::Accum::Replace };
        faer::linalg::matmul::matmul(dst, accum, lhs, rhs, alpha, faer::Par::Seq);
    }
}

/// The library a product started on this thread runs in: faer inside [`faer_only`]; else as
/// [`Choice`] says.
pub fn for_this_thread() -> Products {
    if FAER_ONLY.with(Cell::get) { Products::Faer } else { chosen() }
}

/// The library products run in outside [`faer_only`], decided once: the variable, the library found
/// and the CPU do not change while the process runs, and every product kernel asks.
fn chosen() -> Products {
    static CHOSEN: OnceLock<Products> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let ours = Ours { present: super::sgemm::applies(true), widest: super::sgemm::applies(false) };
        match (pick(choice(), loaded().is_some(), ours), loaded()) {
            (Library::Optimus, _) => Products::Optimus,
            (Library::OpenBlas, Some(blas)) => Products::OpenBlas(blas),
            (Library::Mixed, Some(blas)) => Products::Mixed(blas),
            (Library::OpenBlas | Library::Mixed | Library::Faer, _) => Products::Faer,
        }
    })
}

/// Where our kernel can run: the CPU has AVX2 and FMA (`present`), and they are its widest vectors.
#[derive(Clone, Copy)]
struct Ours {
    present: bool,
    widest: bool,
}

/// A library, without its loaded handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Library {
    Optimus,
    OpenBlas,
    /// Our kernel, and OpenBLAS for the products it does not take.
    Mixed,
    Faer,
}

/// The library `choice` gives, with OpenBLAS loaded or not and our kernel able to run or not.
fn pick(choice: &Choice, openblas: bool, ours: Ours) -> Library {
    match choice {
        Choice::Optimus if ours.present => Library::Optimus,
        Choice::Faer => Library::Faer,
        Choice::Best if openblas && ours.widest => Library::Mixed,
        _ if openblas => Library::OpenBlas,
        Choice::Best | Choice::Optimus if ours.widest => Library::Optimus,
        _ => Library::Faer,
    }
}

/// What `OPTIMUS_BLAS` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Choice {
    /// Unset: OpenBLAS where found (beside our kernel where the CPU's widest vectors are AVX2), else our
    /// kernel on such CPUs, else faer.
    Best,
    Faer,
    /// Our kernel wherever the CPU has AVX2 and FMA (on AVX-512 too); as `Best` elsewhere.
    Optimus,
    /// The OpenBLAS-compatible library at this path.
    Library(String),
}

fn choice() -> &'static Choice {
    static CHOICE: OnceLock<Choice> = OnceLock::new();
    CHOICE.get_or_init(|| choice_of(std::env::var("OPTIMUS_BLAS").ok().as_deref()))
}

fn choice_of(value: Option<&str>) -> Choice {
    match value.map(str::trim) {
        None | Some("") => Choice::Best,
        Some("faer") => Choice::Faer,
        Some("optimus") => Choice::Optimus,
        Some(path) => Choice::Library(path.to_string()),
    }
}

/// `cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)`.
type Sgemm = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    f32,
    *const f32,
    c_int,
    *const f32,
    c_int,
    f32,
    *mut f32,
    c_int,
);

/// `cblas_sgemv(order, trans, m, n, alpha, a, lda, x, incx, beta, y, incy)`.
type Sgemv =
    unsafe extern "C" fn(c_int, c_int, c_int, c_int, f32, *const f32, c_int, *const f32, c_int, f32, *mut f32, c_int);

/// Products of at most this many rows go through matrix-vector products, one per row: sgemm packs
/// the whole right operand first, which for one row (a decoding step's LM head: its weight, 50 MB for
/// GPT-2's vocabulary) costs more than the product.
const GEMV_ROWS: usize = 2;

const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;

/// Library names tried in order when `OPTIMUS_BLAS` does not name one.
const SEARCHED: [&str; 2] = ["libopenblas.so.0", "libopenblas.so"];

/// A loaded OpenBLAS: its product and what it calls itself.
pub struct Blas {
    sgemm: Sgemm,
    sgemv: Option<Sgemv>,
    description: String,
    /// The kernels it chose for this CPU (`openblas_get_corename`: "Haswell", "SkylakeX", "Prescott").
    core: Option<String>,
    /// Keeps the library mapped for as long as `sgemm` may be called (the process's life).
    _library: libloading::Library,
}

/// The libraries the CPU kernels' products may use: "optimus AVX2 6x16", "OpenBLAS 0.3.21 ..." or
/// "faer" (none found), as [`for_this_thread`] chooses outside the bf16 emulation.
pub fn product_library() -> String {
    match for_this_thread() {
        Products::Optimus => super::sgemm::DESCRIPTION.to_string(),
        Products::OpenBlas(blas) => blas.description.clone(),
        Products::Mixed(blas) => format!("{} and {}", blas.description, super::sgemm::DESCRIPTION),
        Products::Faer => "faer".to_string(),
    }
}

/// The process's OpenBLAS, loaded on first use; `None` where there is none or it is turned off.
pub fn loaded() -> Option<&'static Blas> {
    state().library.as_ref().ok().and_then(Option::as_ref)
}

/// Why the library `OPTIMUS_BLAS` names cannot run the products (it does not load, or is not OpenBLAS),
/// which `optimusc` refuses as a usage error before any work, as it does a bad `OPTIMUS_CPU_ISA`; `None`
/// when the variable is unset, names `faer` or `optimus`, or names a library that loaded. Loads nothing
/// unless the variable names a library.
pub fn named_library_problem() -> Option<String> {
    if !matches!(choice(), Choice::Library(_)) {
        return None;
    }
    state()
        .library
        .as_ref()
        .err()
        .map(|e| format!("OPTIMUS_BLAS={e}; it takes `faer`, `optimus` or the path of an OpenBLAS (CBLAS) library"))
}

/// Why the OpenBLAS found on the machine is not used, where it was found but left aside: its kernels
/// are narrower than the CPU kernels' instructions (see [`narrower_than_the_cpu`]). `None` otherwise.
pub fn left_aside() -> Option<&'static str> {
    state().left_aside.as_deref()
}

/// What the process found for its products, decided once.
struct Found {
    /// The library chosen by `OPTIMUS_BLAS` or found on the machine (`Ok(None)`: faer), or the named
    /// library and why it did not load.
    library: Result<Option<Blas>, String>,
    /// Why the library found, not named, is not used: its kernels are narrower than the CPU's
    /// instructions, and faer or our kernel run its products faster.
    left_aside: Option<String>,
}

fn state() -> &'static Found {
    static FOUND: OnceLock<Found> = OnceLock::new();
    FOUND.get_or_init(|| match choice() {
        Choice::Faer => Found { library: Ok(None), left_aside: None },
        Choice::Library(path) => {
            Found { library: load(path).map(Some).map_err(|e| format!("{path}: {e}")), left_aside: None }
        }
        Choice::Best | Choice::Optimus => {
            let found = SEARCHED.iter().find_map(|name| load(name).ok());
            let narrower =
                found.as_ref().and_then(|blas| narrower_than_the_cpu(&blas.description, blas.core.as_deref(), isa()));
            match narrower {
                Some(why) => Found { library: Ok(None), left_aside: Some(why) },
                None => Found { library: Ok(found), left_aside: None },
            }
        }
    })
}

/// Why the OpenBLAS `description`, whose kernels are those of `core`, should not run products on a
/// CPU whose kernels use `isa`, if they are narrower (an OpenBLAS older than the CPU falls back to its
/// SSE3 ones); `None` when they are as wide, or the core is unknown here.
fn narrower_than_the_cpu(description: &str, core: Option<&str>, isa: Isa) -> Option<String> {
    let core = core?;
    let width = Isa::of_openblas_core(core)?;
    (width.lanes() < isa.lanes()).then(|| {
        format!(
            "{} left aside: its {core} kernels are narrower than the instructions of this CPU's kernels ({}); \
             an OpenBLAS that does not know its CPU falls back to such kernels, and OPENBLAS_CORETYPE={} \
             picks its kernels of that width",
            description,
            isa.env_name(),
            isa.openblas_core()
        )
    })
}

/// Loads `name`, checks that it is OpenBLAS (it must say how many threads to use) and holds it to one.
fn load(name: &str) -> Result<Blas, String> {
    // SAFETY: loading runs the library's initialisers; OpenBLAS's only set up its buffers and threads.
    let library = unsafe { libloading::Library::new(name) }.map_err(|e| format!("cannot load it ({e})"))?;
    // SAFETY: the symbols are looked up with the signatures OpenBLAS's cblas.h gives them.
    unsafe {
        let sgemm = *library.get::<Sgemm>(b"cblas_sgemm\0").map_err(|e| format!("no cblas_sgemm ({e})"))?;
        let sgemv = library.get::<Sgemv>(b"cblas_sgemv\0").ok().map(|f| *f);
        let set_threads = *library
            .get::<unsafe extern "C" fn(c_int)>(b"openblas_set_num_threads\0")
            .map_err(|e| format!("not OpenBLAS: no openblas_set_num_threads ({e})"))?;
        set_threads(1);
        let description = library_text(&library, b"openblas_get_config\0").unwrap_or_else(|| "OpenBLAS".to_string());
        let core = library_text(&library, b"openblas_get_corename\0");
        Ok(Blas { sgemm, sgemv, description, core, _library: library })
    }
}

/// The text an OpenBLAS function of no arguments returns (`openblas_get_config`, `openblas_get_corename`),
/// trimmed; `None` where the library lacks it or returns none.
///
/// # Safety
/// `symbol` (NUL-terminated) must name a function of that signature returning a C string or null.
unsafe fn library_text(library: &libloading::Library, symbol: &[u8]) -> Option<String> {
    // SAFETY: the caller names a function `() -> *const c_char`; its text is copied at once.
    unsafe {
        let get = library.get::<unsafe extern "C" fn() -> *const c_char>(symbol).ok()?;
        let text = get();
        (!text.is_null()).then(|| CStr::from_ptr(text).to_string_lossy().trim().to_string())
    }
}

/// How cblas reads a matrix: transposed or not, and its leading dimension; `None` when neither of its
/// strides is one (faer takes those).
fn cblas_layout(rows: usize, cols: usize, row_stride: isize, col_stride: isize) -> Option<(c_int, c_int)> {
    let leading = |stride: isize, at_least: usize| {
        usize::try_from(stride).ok().map(|s| s.max(at_least.max(1))).and_then(|s| c_int::try_from(s).ok())
    };
    if col_stride == 1 || cols <= 1 {
        leading(row_stride, cols).map(|ld| (NO_TRANS, ld))
    } else if row_stride == 1 || rows <= 1 {
        leading(col_stride, rows).map(|ld| (TRANS, ld))
    } else {
        None
    }
}

impl Blas {
    /// dst = alpha * lhs * rhs (+ dst when `accumulate`) on one thread; `false` (nothing done) when a
    /// layout or size is one cblas cannot take, so the caller uses faer. The dimensions match (checked
    /// by the caller) and are non-zero.
    pub fn product(
        &self,
        dst: MatMut<'_, f32>,
        lhs: MatRef<'_, f32>,
        rhs: MatRef<'_, f32>,
        accumulate: bool,
        alpha: f32,
    ) -> bool {
        let (m, n, k) = (dst.nrows(), dst.ncols(), lhs.ncols());
        let sizes = (c_int::try_from(m), c_int::try_from(n), c_int::try_from(k));
        let (Ok(mi), Ok(ni), Ok(ki)) = sizes else { return false };
        let out = match cblas_layout(m, n, dst.row_stride(), dst.col_stride()) {
            Some((NO_TRANS, ldc)) => Some(ldc),
            _ => None,
        };
        let a = cblas_layout(m, k, lhs.row_stride(), lhs.col_stride());
        let b = cblas_layout(k, n, rhs.row_stride(), rhs.col_stride());
        let (Some(ldc), Some((ta, lda)), Some((tb, ldb))) = (out, a, b) else { return false };
        let beta = if accumulate { 1.0 } else { 0.0 };
        if m <= GEMV_ROWS
            && let Some(sgemv) = self.sgemv
            && rows_by_gemv(sgemv, (&dst, lhs, rhs), (tb, ldb), (alpha, beta))
        {
            BLAS_CALLS.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        // SAFETY: each view's elements lie within its slice (faer checked that when it was made) and
        // the layouts describe exactly those elements; dst is the only mutable view and alone in its
        // rows and columns; OpenBLAS runs on this thread only (held to one thread at load).
        unsafe {
            (self.sgemm)(
                ROW_MAJOR,
                ta,
                tb,
                mi,
                ni,
                ki,
                alpha,
                lhs.as_ptr(),
                lda,
                rhs.as_ptr(),
                ldb,
                beta,
                dst.as_ptr_mut(),
                ldc,
            );
        }
        BLAS_CALLS.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// dst = alpha * lhs * rhs + beta * dst, one row at a time as y = rhs^T x (rhs laid out `tb` with
/// leading dimension `ldb`); `false` (nothing done) when a row or column stride is not a positive
/// number cblas takes.
fn rows_by_gemv(
    sgemv: Sgemv,
    (dst, lhs, rhs): (&MatMut<'_, f32>, MatRef<'_, f32>, MatRef<'_, f32>),
    (tb, ldb): (c_int, c_int),
    (alpha, beta): (f32, f32),
) -> bool {
    let (k, n) = (rhs.nrows(), rhs.ncols());
    let positive = |stride: isize| c_int::try_from(stride).ok().filter(|&s| s > 0);
    let (Some(incx), Some(incy)) = (positive(lhs.col_stride()), positive(dst.col_stride())) else { return false };
    let (Ok(ki), Ok(ni)) = (c_int::try_from(k), c_int::try_from(n)) else { return false };
    // Row-major [k, n] read transposed gives rhs^T x; its transpose stored [n, k] is read as it is.
    let (trans, rows, cols) = if tb == NO_TRANS { (TRANS, ki, ni) } else { (NO_TRANS, ni, ki) };
    let Ok(rows_out) = isize::try_from(dst.nrows()) else { return false };
    for row in 0..rows_out {
        let x = lhs.as_ptr().wrapping_offset(row * lhs.row_stride());
        let y = dst.as_ptr_mut().wrapping_offset(row * dst.row_stride());
        // SAFETY: as for `product`: the views' elements lie within their slices, rhs's layout (tb,
        // ldb) and the rows' strides describe exactly those elements, and `dst` is the only view
        // written, one row at a time on this thread.
        unsafe { sgemv(ROW_MAJOR, trans, rows, cols, alpha, rhs.as_ptr(), ldb, x, incx, beta, y, incy) };
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_openblas_whose_kernels_are_narrower_than_the_cpu_is_left_aside_and_says_why() {
        let description = "OpenBLAS 0.3.21 DYNAMIC_ARCH Prescott";
        let why = narrower_than_the_cpu(description, Some("Prescott"), Isa::Avx512).expect("left aside");
        assert_eq!(
            why,
            "OpenBLAS 0.3.21 DYNAMIC_ARCH Prescott left aside: its Prescott kernels are narrower than the \
             instructions of this CPU's kernels (avx512); an OpenBLAS that does not know its CPU falls back \
             to such kernels, and OPENBLAS_CORETYPE=SkylakeX picks its kernels of that width"
        );
        assert!(narrower_than_the_cpu(description, Some("Sandybridge"), Isa::Avx2Fma).is_some());
        assert!(narrower_than_the_cpu(description, Some("Haswell"), Isa::Avx512).is_some());
        // As wide as the CPU's kernels (a cap narrows those), wider, or unknown here: kept.
        for (core, isa) in [
            ("SkylakeX", Isa::Avx512),
            ("Cooperlake", Isa::Avx512),
            ("Zen", Isa::Avx2Fma),
            ("Haswell", Isa::Avx2Fma),
            ("SkylakeX", Isa::Avx2Fma),
            ("Nehalem", Isa::Baseline),
            ("Zen5", Isa::Avx512),
        ] {
            assert_eq!(narrower_than_the_cpu(description, Some(core), isa), None, "{core} on {isa:?}");
        }
        assert_eq!(narrower_than_the_cpu(description, None, Isa::Avx512), None, "no core name given");
    }

    #[test]
    fn the_variable_names_a_library_or_a_path() {
        assert_eq!(choice_of(None), Choice::Best);
        assert_eq!(choice_of(Some(" ")), Choice::Best);
        assert_eq!(choice_of(Some("faer")), Choice::Faer);
        assert_eq!(choice_of(Some("optimus")), Choice::Optimus);
        assert_eq!(choice_of(Some("/opt/lib/libopenblas.so")), Choice::Library("/opt/lib/libopenblas.so".into()));
    }

    #[test]
    fn openblas_beside_our_kernel_on_avx2_then_openblas_then_our_kernel_then_faer() {
        let avx2 = Ours { present: true, widest: true };
        let avx512 = Ours { present: true, widest: false };
        let neither = Ours { present: false, widest: false };
        let path = Choice::Library("/opt/libopenblas.so".into());
        assert_eq!(pick(&Choice::Best, true, avx2), Library::Mixed);
        assert_eq!(pick(&Choice::Best, true, avx512), Library::OpenBlas);
        assert_eq!(pick(&Choice::Best, false, avx2), Library::Optimus);
        assert_eq!(pick(&Choice::Best, false, avx512), Library::Faer);
        assert_eq!(pick(&Choice::Best, false, neither), Library::Faer);
        assert_eq!(pick(&Choice::Optimus, true, avx512), Library::Optimus);
        assert_eq!(pick(&Choice::Optimus, true, neither), Library::OpenBlas);
        assert_eq!(pick(&Choice::Optimus, false, neither), Library::Faer);
        assert_eq!(pick(&Choice::Faer, true, avx2), Library::Faer);
        assert_eq!(pick(&path, true, avx2), Library::OpenBlas);
        // A path that did not load leaves faer, as the warning says.
        assert_eq!(pick(&path, false, avx2), Library::Faer);
    }

    #[test]
    fn layouts_name_the_unit_stride() {
        assert_eq!(cblas_layout(4, 3, 3, 1), Some((NO_TRANS, 3)));
        assert_eq!(cblas_layout(4, 3, 1, 4), Some((TRANS, 4)));
        assert_eq!(cblas_layout(4, 3, 6, 2), None);
        assert_eq!(cblas_layout(4, 3, -3, 1), None);
    }

    #[test]
    fn products_equal_faer_where_openblas_is_present() {
        // Loaded here, not through `loaded()`, which leaves aside an OpenBLAS narrower than the CPU.
        let Some(blas) = SEARCHED.iter().find_map(|name| load(name).ok()) else { return };
        let blas = &blas;
        // 37 rows go through sgemm, 1 and 2 through a matrix-vector product per row.
        for m in [37, 1, 2] {
            products_equal_faer(blas, m);
        }
    }

    fn products_equal_faer(blas: &Blas, m: usize) {
        let (k, n) = (53, 29);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 13) as f32 / 13.0 - 0.5).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 17) as f32 / 17.0 - 0.5).collect();
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let lhs = if ta {
                MatRef::from_row_major_slice(&a, k, m).transpose()
            } else {
                MatRef::from_row_major_slice(&a, m, k)
            };
            let rhs = if tb {
                MatRef::from_row_major_slice(&b, n, k).transpose()
            } else {
                MatRef::from_row_major_slice(&b, k, n)
            };
            let mut expected = vec![1.0f32; m * n];
            let mut got = expected.clone();
            faer::linalg::matmul::matmul(
                MatMut::from_row_major_slice_mut(&mut expected, m, n),
                faer::Accum::Add,
                lhs,
                rhs,
                0.5,
                faer::Par::Seq,
            );
            assert!(blas.product(MatMut::from_row_major_slice_mut(&mut got, m, n), lhs, rhs, true, 0.5));
            let worst = expected.iter().zip(&got).map(|(e, g)| (e - g).abs()).fold(0.0f32, f32::max);
            assert!(worst < 1e-5, "m={m} ta={ta} tb={tb}: differs by {worst}");
        }
    }
}
