//! Vectorisable f32 transcendentals (exp, tanh, ln) for the CPU kernels, and runtime ISA dispatch.
//!
//! The scalar functions [`exp`], [`tanh`] and [`ln`] are branch-free: range reduction, a polynomial,
//! and the result's exponent built from bits, with special cases (overflow, underflow, NaN, infinities,
//! zeros) resolved by selects. Inlined into a loop (they are `#[inline(always)]`), the loop becomes SIMD
//! code. [`vectorized`] runs a closure compiled for the best instruction set this CPU has (AVX-512,
//! AVX2 + FMA, or the baseline the binary targets), chosen once at run time, so that a kernel writes
//! `vectorized(#[inline(always)] || for v in s.iter_mut() { *v = vmath::exp(*v) })` and gets 16- or
//! 8-wide code from a portable build.
//!
//! The kernels' exps ([`exp`], [`exp_in_place`], [`softmax_row`], [`exp_sub_sum`]) are
//! the f32 polynomial: within 1 ulp of libm's `expf`, about 3.5x faster than evaluating e^x in f64 and
//! rounding it once (which these kernels once did, to give libm's bits exactly), and the
//! same bits on every ISA. The softmax and cross-entropy sums keep the kernels' eight-lane order.
//!
//! Accuracy against libm, measured over all 2^32 inputs: exp and ln within 1 ulp, tanh within 2 ulp,
//! with zeros and infinities exactly where libm has them (the tests sweep a sample of the whole range
//! and dense windows at the edges). The formulas use separate multiplies and adds (Rust never contracts
//! them into FMA), so every ISA gives bit-identical results.
//!
//! Speed needs an optimised build: at the test profile's opt-level 1 nothing is vectorised and these
//! are slower than libm; in release (`speed_against_libm_over_8m_floats`, run by hand), e^x over 8M
//! floats inside [`vectorized`] took 5.1 ms on AVX-512 against 19.8 ms for `f32::exp` (2026-11-27, a
//! Sapphire Rapids core); as a plain loop it is as fast as libm.

/// log2(e), to find the power of two nearest e^x.
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// The high part of ln 2, with 15 significant bits, so that `n * LN2_HI` is exact for |n| < 512.
const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
/// ln 2 - LN2_HI, rounded.
const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
/// 1.5 * 2^23: adding and subtracting it rounds an f32 of magnitude below 2^22 to the nearest integer,
/// and the sum's low mantissa bits are that integer.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// Above this, e^x overflows (ln of the largest f32 is 88.72284); clamping keeps the exponent arithmetic
/// in range while the result still rounds to +inf.
const EXP_INPUT_MAX: f32 = 89.0;
/// Below this, e^x rounds to +0 (half the smallest subnormal is e^-103.97).
const EXP_INPUT_MIN: f32 = -104.0;

/// e^r = 1 + r + r^2 Q(r) on |r| <= ln(2)/2: Q's coefficients, a Chebyshev fit of (e^r - 1 - r) / r^2
/// (|error| < 7e-8 in Q, so < 1e-8 relative in e^r).
const EXP_Q: [f32; 5] = [0.5, 0.166_665_76, 0.041_666_553, 0.008_363_346, 0.001_392_639_2];

/// |x| below this uses the odd polynomial for tanh; above, 1 - 2 / (e^{2|x|} + 1), which has no
/// harmful cancellation once tanh |x| > 1/2.
const TANH_POLY_LIMIT: f32 = 0.625;
/// tanh x = x + x^3 P(x^2) on |x| <= TANH_POLY_LIMIT: P's coefficients, a Chebyshev fit of
/// (tanh x - x) / x^3 in u = x^2 (|error| < 2e-8 in P).
const TANH_P: [f32; 6] = [-0.333_333_34, 0.133_333_04, -0.053_959_258, 0.021_768_918, -0.008_343_945, 0.002_292_744_8];

/// The bits of sqrt(1/2): subtracting them from x's bits splits x into 2^e * m with m in [sqrt(1/2), sqrt(2)).
const SQRT_HALF_BITS: u32 = 0x3f35_04f3;
/// 2^23, to bring subnormal inputs of ln into the normal range.
const TWO_POW_23: f32 = 8_388_608.0;
/// ln(1 + f) = 2s + s R(s^2) with s = f / (2 + f), |s| <= 3 - 2 sqrt(2): R(z) = z (c0 + c1 z + c2 z^2 + c3 z^3),
/// a Chebyshev fit of (2 atanh(s) / s - 2) / z (|error| < 3e-8, so < 1e-9 relative in ln).
const LN_R: [f32; 4] = [0.666_666_7, 0.400_001_26, 0.285_503_98, 0.233_419_43];

/// Lanes of the sums and maxima in the slice helpers: eight, the order the scalar kernels have
/// always summed in (the exps themselves, the costly part, run at the full vector width).
const LANES: usize = 8;
/// Elements per block of the sums: `f` fills a buffer this long (in L1) before the lanes add it.
const BLOCK: usize = 1024;

/// e^x with an f32 polynomial, within 1 ulp of libm's `expf` (the same bits on every ISA): +inf above
/// the overflow threshold, subnormal results where they are due, +0 below -103.97, e^0 = 1, and NaN
/// for NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = clamp_keeping_nan(x, EXP_INPUT_MIN, EXP_INPUT_MAX);
    let (n, n_float) = round_to_integer(x * LOG2_E);
    let r = (x - n_float * LN2_HI) - n_float * LN2_LO;
    scale_by_power_of_two(exp_near_zero(r), n)
}

/// tanh x, within 2 ulp of libm over the whole f32 range; tanh(+-0) = +-0, tanh(+-inf) = +-1, NaN for NaN.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let near_zero = tanh_odd_polynomial(a);
    let far = tanh_from_exp(a);
    let magnitude = if a < TANH_POLY_LIMIT { near_zero } else { far };
    magnitude.copysign(x)
}

/// The natural logarithm, within 1 ulp of libm over the whole f32 range (subnormal inputs included):
/// ln(+-0) = -inf, ln(negative) = NaN, ln(+inf) = +inf, ln(1) = 0, NaN for NaN.
#[inline(always)]
pub fn ln(x: f32) -> f32 {
    let subnormal = x < f32::MIN_POSITIVE;
    let normal = if subnormal { x * TWO_POW_23 } else { x };
    let extra_exponent = if subnormal { -23 } else { 0 };
    let (exponent, mantissa) = split_exponent(normal);
    let e = exponent.wrapping_add(extra_exponent) as f32;
    let value = e * LN2_HI + (e * LN2_LO + ln_near_one(mantissa - 1.0));
    let value = if x == f32::INFINITY { x } else { value };
    let value = if x == 0.0 { f32::NEG_INFINITY } else { value };
    let value = if x < 0.0 { f32::NAN } else { value };
    if x.is_nan() { x } else { value }
}

/// x limited to [lo, hi]; NaN stays NaN (both comparisons are false for it).
#[inline(always)]
fn clamp_keeping_nan(x: f32, lo: f32, hi: f32) -> f32 {
    let x = if x < lo { lo } else { x };
    if x > hi { hi } else { x }
}

/// y rounded to the nearest integer (|y| < 2^22), as an i32 and as an f32, without a conversion
/// instruction or a branch.
#[inline(always)]
fn round_to_integer(y: f32) -> (i32, f32) {
    let shifted = y + ROUND_MAGIC;
    let n = (shifted.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    (n, shifted - ROUND_MAGIC)
}

/// e^r for |r| <= ln(2)/2 (plus rounding), as 1 + (r + r^2 Q(r)) so that only the last add rounds at 1.
#[inline(always)]
fn exp_near_zero(r: f32) -> f32 {
    let q = EXP_Q[0] + r * (EXP_Q[1] + r * (EXP_Q[2] + r * (EXP_Q[3] + r * EXP_Q[4])));
    1.0 + (r + (r * r) * q)
}

/// p * 2^n for n in [-150, 128], in two exact power-of-two steps (each within the normal exponent range)
/// so that a subnormal or overflowing result rounds once, at the last multiply.
#[inline(always)]
fn scale_by_power_of_two(p: f32, n: i32) -> f32 {
    let first = n >> 1;
    let second = n.wrapping_sub(first);
    p * power_of_two(first) * power_of_two(second)
}

/// 2^k for k in [-126, 127], built from its exponent bits.
#[inline(always)]
fn power_of_two(k: i32) -> f32 {
    f32::from_bits((k.wrapping_add(127) as u32) << 23)
}

/// tanh a for 0 <= a <= TANH_POLY_LIMIT: a + a^3 P(a^2).
#[inline(always)]
fn tanh_odd_polynomial(a: f32) -> f32 {
    let u = a * a;
    let p = TANH_P[0] + u * (TANH_P[1] + u * (TANH_P[2] + u * (TANH_P[3] + u * (TANH_P[4] + u * TANH_P[5]))));
    a + a * (u * p)
}

/// tanh a for a >= TANH_POLY_LIMIT: 1 - 2 / (e^{2a} + 1); 1 once e^{2a} overflows, NaN for NaN.
#[inline(always)]
fn tanh_from_exp(a: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * a) + 1.0)
}

/// A positive normal x as (e, m) with x = 2^e * m and m in [sqrt(1/2), sqrt(2)).
#[inline(always)]
fn split_exponent(x: f32) -> (i32, f32) {
    let offset = x.to_bits().wrapping_sub(SQRT_HALF_BITS) as i32;
    let exponent = offset >> 23;
    let mantissa = f32::from_bits(x.to_bits().wrapping_sub((exponent << 23) as u32));
    (exponent, mantissa)
}

/// ln(1 + f) for f in [sqrt(1/2) - 1, sqrt(2) - 1] (f exact): with s = f / (2 + f), ln(1 + f) = 2 atanh s
/// = 2s + s R(s^2), and 2s = f - s f, so ln(1 + f) = f + s (R - f): f carries the value exactly and the
/// rounded part is a small correction.
#[inline(always)]
fn ln_near_one(f: f32) -> f32 {
    let s = f / (2.0 + f);
    let z = s * s;
    let r = z * (LN_R[0] + z * (LN_R[1] + z * (LN_R[2] + z * LN_R[3])));
    f + s * (r - f)
}

/// Which instruction set [`vectorized`] compiles its closure for on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 F and VL with AVX2 and FMA: 16-wide f32.
    Avx512,
    /// AVX2 and FMA: 8-wide f32.
    Avx2Fma,
    /// What the binary was built for (SSE2 on baseline x86-64; the target's own on other architectures).
    Baseline,
}

impl Isa {
    /// f32 lanes of a vector (baseline counts as one: its code is not assumed vectorised).
    pub fn lanes(self) -> usize {
        match self {
            Isa::Avx512 => 16,
            Isa::Avx2Fma => 8,
            Isa::Baseline => 1,
        }
    }

    /// What `OPTIMUS_CPU_ISA` calls it.
    pub fn env_name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2Fma => "avx2",
            Isa::Baseline => "baseline",
        }
    }

    /// The OpenBLAS core (`OPENBLAS_CORETYPE`) whose kernels use this set and no wider: every AVX-512
    /// core OpenBLAS names (SkylakeX, Cooperlake, SapphireRapids) runs SkylakeX's float32 products.
    pub fn openblas_core(self) -> &'static str {
        match self {
            Isa::Avx512 => "SkylakeX",
            Isa::Avx2Fma => "Haswell",
            Isa::Baseline => "Nehalem",
        }
    }

    /// The widest set of these whose instructions the kernels of the OpenBLAS core `name` (as
    /// `openblas_get_corename` gives it) use; `None` for a name this does not know (a newer OpenBLAS's).
    pub fn of_openblas_core(name: &str) -> Option<Isa> {
        const AVX512: [&str; 3] = ["skylakex", "cooperlake", "sapphirerapids"];
        const AVX2_FMA: [&str; 3] = ["haswell", "zen", "excavator"];
        // The other names of OpenBLAS's `corename` table: SSE, and AVX without AVX2 (Sandybridge, the
        // Bulldozer family), below AVX2 as the baseline is.
        const NARROWER: [&str; 21] = [
            "unknown",
            "katmai",
            "coppermine",
            "northwood",
            "prescott",
            "banias",
            "atom",
            "core2",
            "penryn",
            "dunnington",
            "nehalem",
            "athlon",
            "opteron",
            "opteron_sse3",
            "barcelona",
            "nano",
            "sandybridge",
            "bobcat",
            "bulldozer",
            "piledriver",
            "steamroller",
        ];
        let name = name.trim().to_ascii_lowercase();
        if AVX512.contains(&name.as_str()) {
            Some(Isa::Avx512)
        } else if AVX2_FMA.contains(&name.as_str()) {
            Some(Isa::Avx2Fma)
        } else if NARROWER.contains(&name.as_str()) {
            Some(Isa::Baseline)
        } else {
            None
        }
    }
}

/// The environment variable that narrows the instructions the CPU kernels and the measured peak use,
/// to measure on a wide CPU what a narrower one does (`avx2` on an AVX-512 machine).
pub const ISA_CAP_VARIABLE: &str = "OPTIMUS_CPU_ISA";

/// The cap `OPTIMUS_CPU_ISA` sets (`avx512`, `avx2` or `baseline`), `None` when unset or empty, and the value
/// when it is none of those.
pub fn isa_cap() -> Option<Result<Isa, String>> {
    // Empty is unset, as for the other variables optimusc reads.
    let value = std::env::var(ISA_CAP_VARIABLE).ok().filter(|v| !v.trim().is_empty())?;
    let cap = [Isa::Avx512, Isa::Avx2Fma, Isa::Baseline].into_iter().find(|isa| isa.env_name() == value.trim());
    Some(cap.ok_or(value))
}

/// The instruction set of this CPU that [`vectorized`] uses, detected on the first call and cached
/// (no wider than `OPTIMUS_CPU_ISA` where that is set).
pub fn isa() -> Isa {
    detection::cached_isa()
}

/// Runs `f` compiled for the best instruction set this CPU has (see [`isa`]). `f` is inlined into a
/// function built with those target features, so loops over the scalar functions of this module (and
/// any other inlined code in `f`) become AVX-512 or AVX2 code while the binary stays portable. On
/// other architectures it just calls `f`.
///
/// Write the closure as `vectorized(#[inline(always)] || ...)` (an attribute that stable Rust accepts on
/// a call argument). Without it LLVM inlines only small closures into the three copies (AVX-512, AVX2,
/// baseline); a closure it does not inline still runs correctly, but as baseline code.
#[inline(always)]
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        match isa() {
            // SAFETY: isa() returns Avx512 only after is_x86_feature_detected! found avx512f, avx512vl,
            // avx2 and fma on this CPU, the features `with_avx512` is compiled for.
            Isa::Avx512 => unsafe { x86::with_avx512(f) },
            // SAFETY: isa() returns Avx2Fma only after is_x86_feature_detected! found avx2 and fma on
            // this CPU, the features `with_avx2_fma` is compiled for.
            Isa::Avx2Fma => unsafe { x86::with_avx2_fma(f) },
            Isa::Baseline => f(),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        f()
    }
}

/// The target-feature trampolines. `#[inline(always)]` cannot be combined with `#[target_feature]`, but
/// these are generic and tiny, so `f` (called once) is inlined into them and vectorised with their
/// features, and they are inlined into no caller without those features.
#[cfg(target_arch = "x86_64")]
mod x86 {
    /// Calls `f` compiled for AVX-512.
    ///
    /// # Safety
    /// The CPU must support avx512f, avx512vl, avx2 and fma.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    #[inline]
    pub(super) unsafe fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    /// Calls `f` compiled for AVX2 and FMA.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn with_avx2_fma<R>(f: impl FnOnce() -> R) -> R {
        f()
    }
}

/// Detects the instruction set once and keeps it in an atomic.
mod detection {
    use super::Isa;
    use std::sync::atomic::{AtomicU8, Ordering};

    const UNKNOWN: u8 = 0;
    const AVX512: u8 = 1;
    const AVX2_FMA: u8 = 2;
    const BASELINE: u8 = 3;

    static DETECTED: AtomicU8 = AtomicU8::new(UNKNOWN);

    /// The cached result of [`detect`] (detection is idempotent, so a race only repeats it).
    #[inline(always)]
    pub(super) fn cached_isa() -> Isa {
        match DETECTED.load(Ordering::Relaxed) {
            AVX512 => Isa::Avx512,
            AVX2_FMA => Isa::Avx2Fma,
            BASELINE => Isa::Baseline,
            _ => detect_and_cache(),
        }
    }

    #[cold]
    fn detect_and_cache() -> Isa {
        let isa = detect();
        let code = match isa {
            Isa::Avx512 => AVX512,
            Isa::Avx2Fma => AVX2_FMA,
            Isa::Baseline => BASELINE,
        };
        DETECTED.store(code, Ordering::Relaxed);
        isa
    }

    /// The widest set the CPU has, narrowed to [`super::isa_cap`] where one is set.
    fn detect() -> Isa {
        let found = hardware();
        match super::isa_cap() {
            Some(Ok(cap)) if cap.lanes() < found.lanes() => cap,
            _ => found,
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn hardware() -> Isa {
        let avx2_fma = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        let avx512 = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl");
        match (avx2_fma, avx512) {
            (true, true) => Isa::Avx512,
            (true, false) => Isa::Avx2Fma,
            _ => Isa::Baseline,
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn hardware() -> Isa {
        Isa::Baseline
    }
}

/// e^x for every element, in place.
pub fn exp_in_place(v: &mut [f32]) {
    vectorized(
        #[inline(always)]
        || v.iter_mut().for_each(|x| *x = exp(*x)),
    );
}

/// tanh x for every element, in place.
pub fn tanh_in_place(v: &mut [f32]) {
    vectorized(
        #[inline(always)]
        || v.iter_mut().for_each(|x| *x = tanh(*x)),
    );
}

/// ln x for every element, in place.
pub fn ln_in_place(v: &mut [f32]) {
    vectorized(
        #[inline(always)]
        || v.iter_mut().for_each(|x| *x = ln(*x)),
    );
}

/// Max-subtracted softmax of a row, in place: e^(x - max) / sum. The max ignores NaN (as `f32::max`
/// does) but a NaN still makes the whole row NaN through the sum; an empty row is left as it is.
pub fn softmax_row(row: &mut [f32]) {
    vectorized(
        #[inline(always)]
        || softmax_row_formula(row),
    );
}

/// The sum of e^(x - max) over the row, without writing anything (the denominator of a softmax or a
/// cross-entropy).
pub fn exp_sub_sum(row: &[f32], max: f32) -> f32 {
    vectorized(
        #[inline(always)]
        || exp_sub_sum_formula(row, max),
    )
}

/// [`softmax_row`] without the dispatch.
#[inline(always)]
fn softmax_row_formula(row: &mut [f32]) {
    let max = lane_max(row);
    let mut sum = LaneSum::default();
    for block in row.chunks_mut(BLOCK) {
        block.iter_mut().for_each(|x| *x = exp(*x - max));
        sum.add(block);
    }
    let inv = 1.0 / sum.total();
    row.iter_mut().for_each(|x| *x *= inv);
}

/// [`exp_sub_sum`] without the dispatch.
#[inline(always)]
fn exp_sub_sum_formula(row: &[f32], max: f32) -> f32 {
    let mut sum = LaneSum::default();
    let mut values = [0.0f32; BLOCK];
    for block in row.chunks(BLOCK) {
        let values = &mut values[..block.len()];
        values.iter_mut().zip(block).for_each(|(y, &x)| *y = exp(x - max));
        sum.add(values);
    }
    sum.total()
}

/// The largest element of `v`, NaN ignored (-inf for an empty or all-NaN slice), as `f32::max` folded
/// over it gives (but for the sign of a zero maximum), in vector code.
pub fn max_ignoring_nan(v: &[f32]) -> f32 {
    vectorized(
        #[inline(always)]
        || lane_max(v),
    )
}

/// The largest element (NaN ignored; -inf for an empty slice), kept in [`LANES`] lanes.
#[inline(always)]
fn lane_max(v: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = v.chunks_exact(LANES);
    for chunk in &mut chunks {
        acc.iter_mut().zip(chunk).for_each(|(a, &x)| *a = if x > *a { x } else { *a });
    }
    acc.iter_mut().zip(chunks.remainder()).for_each(|(a, &x)| *a = if x > *a { x } else { *a });
    acc.iter().fold(f32::NEG_INFINITY, |m, &a| if a > m { a } else { m })
}

/// The kernels' summation order, the same as the scalar kernels have always used (so that moving a
/// kernel onto these functions changes no bit of its result): element k of the whole slice goes to
/// lane k mod [`LANES`], except the last len mod [`LANES`] elements, which are summed in order on
/// their own; the total is the lanes summed in order, plus that tail. Blocks must be multiples of
/// [`LANES`] except the last.
#[derive(Default)]
struct LaneSum {
    lanes: [f32; LANES],
    tail: f32,
}

impl LaneSum {
    #[inline(always)]
    fn add(&mut self, v: &[f32]) {
        let mut chunks = v.chunks_exact(LANES);
        for chunk in &mut chunks {
            self.lanes.iter_mut().zip(chunk).for_each(|(a, &x)| *a += x);
        }
        self.tail = chunks.remainder().iter().fold(self.tail, |t, &x| t + x);
    }

    #[inline(always)]
    fn total(&self) -> f32 {
        self.lanes.iter().sum::<f32>() + self.tail
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_set_names_an_openblas_core_of_its_own_width() {
        for isa in [Isa::Avx512, Isa::Avx2Fma, Isa::Baseline] {
            assert_eq!(Isa::of_openblas_core(isa.openblas_core()), Some(isa), "{isa:?}");
        }
        assert_eq!(Isa::of_openblas_core(" Prescott "), Some(Isa::Baseline));
        assert_eq!(Isa::of_openblas_core("ZEN"), Some(Isa::Avx2Fma));
        assert_eq!(Isa::of_openblas_core("SapphireRapids"), Some(Isa::Avx512));
        assert_eq!(Isa::of_openblas_core("Zen5"), None, "a core named after this was written");
    }

    #[test]
    fn the_slice_functions_give_the_scalar_exps_bits() {
        // Every 61st float between the underflow and overflow thresholds, both signs of the range, plus
        // the special values: a vector of them at a time, as the kernels call them.
        let mut inputs: Vec<f32> = Vec::new();
        let (lo, hi) = ((-105.0f32).to_bits(), 90.0f32.to_bits());
        inputs.extend((0..lo).step_by(61).map(f32::from_bits).filter(|x| *x >= -105.0));
        inputs.extend((0..hi).step_by(61).map(f32::from_bits));
        inputs.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 88.72283, 88.72284, -103.97, -87.33]);
        let mut in_place = inputs.clone();
        exp_in_place(&mut in_place);
        for (&x, &y) in inputs.iter().zip(&in_place) {
            assert!(y.to_bits() == exp(x).to_bits() || (y.is_nan() && x.is_nan()), "exp({x:e}) = {y:e}");
        }
        // The sums: the scalar exps added in the kernels' lane order.
        let row: Vec<f32> = (0..2500).map(|k| ((k * 37) % 101) as f32 * 0.1 - 5.0).collect();
        let mut lanes = LaneSum::default();
        lanes.add(&row.iter().map(|&x| exp(x - 4.0)).collect::<Vec<_>>());
        assert_eq!(exp_sub_sum(&row, 4.0).to_bits(), lanes.total().to_bits());
    }

    #[test]
    fn the_vector_max_is_the_folded_max() {
        let fold = |v: &[f32]| v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let values: Vec<f32> = (0..1001).map(|k| ((k * 7919) % 1009) as f32 * 0.37 - 150.0).collect();
        for len in [0, 1, 7, 8, 9, 100, 1001] {
            let v = &values[..len];
            assert_eq!(max_ignoring_nan(v).to_bits(), fold(v).to_bits(), "{len} values");
        }
        let with_specials = [f32::NAN, -3.0, f32::NAN, 2.5, f32::NEG_INFINITY, 1.0, f32::NAN, 0.5, -7.0, f32::NAN];
        assert_eq!(max_ignoring_nan(&with_specials), 2.5);
        assert_eq!(max_ignoring_nan(&[f32::NAN; 11]), f32::NEG_INFINITY);
        assert_eq!(max_ignoring_nan(&[1.0, f32::INFINITY, f32::NAN]), f32::INFINITY);
    }

    // Measured maxima against libm over all 2^32 inputs (an exhaustive run, too slow for the suite):
    // exp 1 ulp, ln 1 ulp, tanh 2 ulp. The sweeps below assert the looser bounds the kernels need.
    const EXP_MAX_ULP: u64 = 2;
    const LN_MAX_ULP: u64 = 2;
    const TANH_MAX_ULP: u64 = 3;

    /// A position on a line where adjacent floats are 1 apart and +0 and -0 are the same point.
    fn ordinal(x: f32) -> i64 {
        let magnitude = i64::from(x.to_bits() & 0x7fff_ffff);
        if x.is_sign_negative() { -magnitude } else { magnitude }
    }

    /// How many floats apart `a` and `b` are; NaN is 0 from NaN and infinitely far from anything else.
    fn ulp_distance(a: f32, b: f32) -> u64 {
        match (a.is_nan(), b.is_nan()) {
            (true, true) => 0,
            (false, false) => (ordinal(a) - ordinal(b)).unsigned_abs(),
            _ => u64::MAX,
        }
    }

    /// Every `step`-th of all 2^32 bit patterns: both signs, subnormals, infinities and NaNs.
    fn every_nth_pattern(step: usize) -> impl Iterator<Item = f32> {
        (0..=u32::MAX).step_by(step).map(f32::from_bits)
    }

    /// Every `step`-th float from `lo` to `hi` (both finite and of the same sign), by bit pattern.
    fn floats_between(lo: f32, hi: f32, step: usize) -> impl Iterator<Item = f32> {
        let (a, b) = (lo.to_bits(), hi.to_bits());
        (a.min(b)..=a.max(b)).step_by(step).map(f32::from_bits)
    }

    /// `count` consecutive floats on each side of `x` (by bit pattern, staying on x's side of zero).
    fn floats_around(x: f32, count: u32) -> impl Iterator<Item = f32> {
        let bits = x.to_bits();
        let sign = bits & 0x8000_0000;
        let magnitude = bits & 0x7fff_ffff;
        (magnitude.saturating_sub(count)..=magnitude.saturating_add(count)).map(move |m| f32::from_bits(sign | m))
    }

    /// The inputs and their negations.
    fn both_signs(inputs: impl Iterator<Item = f32>) -> impl Iterator<Item = f32> {
        inputs.flat_map(|x| [x, -x])
    }

    /// Checks `ours` against `reference` on every input: within `max_ulp`, and bit-identical wherever
    /// the reference gives a zero or an infinity (so no stray tiny or huge results). Returns the worst
    /// distance seen.
    fn check_against(
        name: &str,
        inputs: impl Iterator<Item = f32>,
        ours: fn(f32) -> f32,
        reference: fn(f32) -> f32,
        max_ulp: u64,
    ) -> u64 {
        let mut worst = 0;
        for x in inputs {
            let (got, want) = (ours(x), reference(x));
            let distance = ulp_distance(got, want);
            assert!(distance <= max_ulp, "{name}({x:e}) [{:#010x}] = {got:e}, libm {want:e}", x.to_bits());
            if want == 0.0 || want.is_infinite() {
                assert_eq!(got.to_bits(), want.to_bits(), "{name}({x:e}) = {got:e}, libm gives exactly {want:e}");
            }
            worst = worst.max(distance);
        }
        worst
    }

    #[test]
    fn exp_matches_libm_across_all_bit_patterns() {
        check_against("exp", every_nth_pattern(97), exp, libm::expf, EXP_MAX_ULP);
    }

    #[test]
    fn exp_matches_libm_densely_near_zero_and_at_the_reduction_edges() {
        let near_zero = both_signs(floats_between(2.0f32.powi(-30), 1.0, 211));
        let rounds_to_one = both_signs(floats_around(2.0f32.powi(-24), 1 << 16));
        let half_ln2 = both_signs(floats_around(std::f32::consts::LN_2 / 2.0, 1 << 18));
        let all = near_zero.chain(rounds_to_one).chain(half_ln2);
        check_against("exp", all, exp, libm::expf, EXP_MAX_ULP);
    }

    #[test]
    fn exp_overflows_to_infinity_exactly_where_libm_does() {
        check_against("exp", floats_between(87.0, 90.0, 1), exp, libm::expf, EXP_MAX_ULP);
        assert_eq!(exp(88.72283), libm::expf(88.72283));
        assert_eq!(exp(88.72284), f32::INFINITY);
        assert_eq!(exp(1.0e4), f32::INFINITY);
        assert_eq!(exp(f32::MAX), f32::INFINITY);
    }

    #[test]
    fn exp_underflows_through_subnormals_to_zero_where_libm_does() {
        // e^x is subnormal from -87.34 and rounds to +0 below -103.97: every float in between.
        check_against("exp", floats_between(-87.0, -105.0, 1), exp, libm::expf, EXP_MAX_ULP);
        assert_eq!(exp(-104.0).to_bits(), 0);
        assert_eq!(exp(-1.0e4).to_bits(), 0);
        assert_eq!(exp(f32::MIN).to_bits(), 0);
    }

    #[test]
    fn exp_special_values() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY).to_bits(), 0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-f32::NAN).is_nan());
        assert_eq!(exp(1.0), libm::expf(1.0));
    }

    #[test]
    fn tanh_matches_libm_across_all_bit_patterns() {
        check_against("tanh", every_nth_pattern(97), tanh, libm::tanhf, TANH_MAX_ULP);
    }

    #[test]
    fn tanh_matches_libm_densely_near_zero_at_the_switch_and_at_saturation() {
        let near_zero = both_signs(floats_between(2.0f32.powi(-14), 0.25, 29));
        let switch = both_signs(floats_around(TANH_POLY_LIMIT, 1 << 19));
        let saturation = both_signs(floats_between(8.0, 10.0, 1));
        let all = near_zero.chain(switch).chain(saturation);
        check_against("tanh", all, tanh, libm::tanhf, TANH_MAX_ULP);
    }

    #[test]
    fn tanh_special_values() {
        assert_eq!(tanh(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh(20.0), 1.0);
        assert_eq!(tanh(-f32::MAX), -1.0);
        assert!(tanh(f32::NAN).is_nan());
        let tiny = f32::from_bits(1);
        assert_eq!(tanh(tiny), tiny);
        assert_eq!(tanh(-tiny), -tiny);
    }

    #[test]
    fn ln_matches_libm_across_all_bit_patterns() {
        check_against("ln", every_nth_pattern(97), ln, libm::logf, LN_MAX_ULP);
    }

    #[test]
    fn ln_matches_libm_densely_near_one_at_the_mantissa_split_and_for_subnormals() {
        let near_one = floats_around(1.0, 1 << 21);
        let split = floats_around(f32::from_bits(SQRT_HALF_BITS), 1 << 18);
        let subnormals = floats_between(f32::from_bits(1), f32::MIN_POSITIVE, 7);
        let smallest_normals = floats_around(f32::MIN_POSITIVE, 1 << 16);
        let largest = floats_between(f32::MAX / 2.0, f32::MAX, 17);
        let all = near_one.chain(split).chain(subnormals).chain(smallest_normals).chain(largest);
        check_against("ln", all, ln, libm::logf, LN_MAX_ULP);
    }

    #[test]
    fn ln_special_values() {
        assert_eq!(ln(0.0), f32::NEG_INFINITY);
        assert_eq!(ln(-0.0), f32::NEG_INFINITY);
        assert!(ln(-1.0).is_nan());
        assert!(ln(-f32::from_bits(1)).is_nan());
        assert!(ln(f32::NEG_INFINITY).is_nan());
        assert!(ln(f32::NAN).is_nan());
        assert_eq!(ln(f32::INFINITY), f32::INFINITY);
        assert_eq!(ln(1.0).to_bits(), 0);
        assert_eq!(ln(f32::from_bits(1)), libm::logf(f32::from_bits(1)));
        assert_eq!(ln(std::f32::consts::E), 1.0);
    }

    /// A few thousand floats of every kind (by bit pattern), plus the special values.
    fn mixed_inputs() -> Vec<f32> {
        let specials = [0.0, -0.0, 1.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE, f32::MAX];
        every_nth_pattern(700_001).chain(specials).chain(floats_between(-110.0, 110.0, 50_021)).collect()
    }

    /// Asserts `a` and `b` hold the same bits (NaNs compare as NaN).
    fn assert_same(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len());
        for (k, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()), "{what}[{k}]: {x:e} vs {y:e}");
        }
    }

    /// A slice helper with its name and the scalar function it applies.
    type Helper = (&'static str, fn(&mut [f32]), fn(f32) -> f32);

    #[test]
    fn in_place_helpers_match_the_scalar_functions_bit_for_bit() {
        // No FMA contraction happens in either path (Rust does not contract), so the ISA chosen by
        // `vectorized` gives the same bits as scalar calls.
        let input = mixed_inputs();
        let helpers: [Helper; 3] = [("exp", exp_in_place, exp), ("tanh", tanh_in_place, tanh), ("ln", ln_in_place, ln)];
        for (name, in_place, scalar) in helpers {
            let mut dispatched = input.clone();
            in_place(&mut dispatched);
            let scalar: Vec<f32> = input.iter().map(|&x| scalar(x)).collect();
            assert_same(&dispatched, &scalar, name);
        }
    }

    /// Deterministic values in [-scale, scale) (a linear congruential generator).
    fn pseudo_random(len: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut state = seed;
        (0..len)
            .map(|_| {
                state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    const ROW_LENGTHS: [usize; 8] = [1, 7, 16, 17, 255, 1024, 1031, 50_257];

    /// The relative error allowed in a sum over `len` terms: each of the eight lanes adds len / 8 terms
    /// in order (the kernels' summation order, kept so that their results do not change), so the
    /// rounding of the sum grows with the row.
    fn sum_tolerance(len: usize) -> f64 {
        2e-6 + 1e-9 * len as f64
    }

    #[test]
    fn softmax_rows_sum_to_one_and_match_the_undispatched_formula() {
        for (k, len) in ROW_LENGTHS.into_iter().enumerate() {
            let input = pseudo_random(len, k as u64, 30.0);
            let mut dispatched = input.clone();
            softmax_row(&mut dispatched);
            let mut plain = input.clone();
            softmax_row_formula(&mut plain);
            assert_same(&dispatched, &plain, "softmax_row");
            let sum: f64 = dispatched.iter().map(|&p| f64::from(p)).sum();
            assert!((sum - 1.0).abs() <= sum_tolerance(len), "a row of {len} sums to {sum}");
            // Against f64 from the same f32 differences x - max (their rounding is not vmath's error):
            // within 1 ulp from exp, 1 from the scaling, and the f32 lanes' rounding of the sum.
            let max = input.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let exact: Vec<f64> = input.iter().map(|&x| f64::from(x - max).exp()).collect();
            let total: f64 = exact.iter().sum();
            for (&p, e) in dispatched.iter().zip(&exact) {
                assert!((f64::from(p) - e / total).abs() <= sum_tolerance(len) * (e / total), "{p} vs {}", e / total);
            }
        }
    }

    #[test]
    fn softmax_of_an_empty_row_does_nothing() {
        let mut row: [f32; 0] = [];
        softmax_row(&mut row);
    }

    #[test]
    fn exp_sub_sum_matches_the_undispatched_formula_and_f64() {
        for (k, len) in ROW_LENGTHS.into_iter().enumerate() {
            let row = pseudo_random(len, 100 + k as u64, 20.0);
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let sum = exp_sub_sum(&row, max);
            assert_eq!(sum.to_bits(), exp_sub_sum_formula(&row, max).to_bits());
            let exact: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
            assert!((f64::from(sum) - exact).abs() <= sum_tolerance(len) * exact, "{sum} vs {exact}");
        }
        assert_eq!(exp_sub_sum(&[], 0.0), 0.0);
    }

    #[test]
    fn isa_is_detected_once_and_stays() {
        assert_eq!(isa(), isa());
        assert_eq!(vectorized(|| 41 + 1), 42);
    }

    /// Release timing: `cargo test --release --lib vmath::tests::speed -- --ignored --nocapture`.
    #[test]
    #[ignore = "a timing, meaningful in release only"]
    fn speed_against_libm_over_8m_floats() {
        use std::hint::black_box;
        use std::time::Instant;
        fn best_ms(mut f: impl FnMut()) -> f64 {
            (0..7)
                .map(|_| {
                    let start = Instant::now();
                    f();
                    start.elapsed().as_secs_f64() * 1e3
                })
                .fold(f64::MAX, f64::min)
        }
        let input: Vec<f32> = pseudo_random(8 << 20, 7, 80.0);
        let mut v = input.clone();
        let mut time = |f: &dyn Fn(&mut [f32])| {
            best_ms(|| {
                v.copy_from_slice(&input);
                f(black_box(&mut v));
                black_box(&v);
            })
        };
        let copy = time(&|_| {});
        let libm_exp = time(&|s| s.iter_mut().for_each(|x| *x = x.exp())) - copy;
        let plain = time(&|s| s.iter_mut().for_each(|x| *x = exp(*x))) - copy;
        let dispatched = time(&|s| exp_in_place(s)) - copy;
        println!(
            "exp over 8M floats on {:?}: f32::exp (libm) {libm_exp:.2} ms, vmath::exp plain {plain:.2} ms ({:.1}x), in vectorized {dispatched:.2} ms ({:.1}x)",
            isa(),
            libm_exp / plain,
            libm_exp / dispatched
        );
    }
}
