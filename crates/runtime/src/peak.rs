//! This CPU's measured peak float32 FLOP/s: independent fused multiply-add chains on as many threads as
//! the pool that runs large products, in the widest vector instructions the CPU has. `optimusc run
//! --profile` compares the FLOP/s its products achieve with this figure.

use crate::cpu::vmath::{self, Isa};
use serde::Serialize;
use std::hint::black_box;
use std::sync::{Barrier, OnceLock};
use std::time::{Duration, Instant};

/// Independent accumulators per thread: more than FMA latency (4 cycles) times FMA units (2), so that
/// every unit starts an FMA every cycle.
const CHAINS: usize = 12;

/// The length one timed trial aims at; the calibration and the trials stay under 200 ms.
const TRIAL: Duration = Duration::from_millis(20);

/// Timed trials; the fastest counts, so that a trial that other processes slowed down does not.
const TRIALS: usize = 7;

/// A calibration run at least this long sizes the trials.
const CALIBRATION: Duration = Duration::from_millis(5);

/// The measured peak, with what it was measured on.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Peak {
    /// Float32 GFLOP/s of all `threads` together (an FMA is 2 FLOPs per lane).
    pub gflops: f64,
    pub threads: usize,
    /// The instructions the chains ran ("AVX-512 FMA", "AVX2 FMA", or the baseline).
    pub isa: String,
    /// The peak measured before the run, where one was ([`measure_before_run`]): against `gflops`,
    /// measured after it, whether the machine kept its speed through the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub before_run_gflops: Option<f64>,
}

/// What a profile's kernels are measured against: the CPU's measured float32 peak on the kernel pool's
/// threads; on a GPU none (its kernels are timed on the GPU, and the CPU's peak says nothing of them).
pub fn of_backend(backend: super::backend::BackendKind) -> Peak {
    match backend {
        super::backend::BackendKind::Cpu => {
            Peak { before_run_gflops: BEFORE_RUN.get().copied(), ..measure_peak(product_threads()) }
        }
        super::backend::BackendKind::Cuda => {
            Peak { gflops: 0.0, threads: 0, isa: "GPU".into(), before_run_gflops: None }
        }
    }
}

/// The number of threads the CPU kernels' products use (the kernel pool's size).
pub fn product_threads() -> usize {
    super::cpu::par::threads()
}

/// This CPU's float32 GFLOP/s on `threads` threads at once (about 0.15 s of work, the best of 7 trials).
pub fn measured_peak_gflops(threads: usize) -> f64 {
    measure_peak(threads).gflops
}

/// Measures the peak on `threads` threads (at least one) with the widest FMA the CPU has.
pub fn measure_peak(threads: usize) -> Peak {
    let threads = threads.max(1);
    let isa = Chains::detect();
    let iterations = trial_iterations(isa);
    let best = (0..TRIALS).map(|_| parallel_seconds(isa, threads, iterations)).fold(f64::INFINITY, f64::min);
    let flops = threads as f64 * iterations as f64 * (CHAINS * isa.lanes() * 2) as f64;
    Peak { gflops: flops / best.max(1e-9) / 1e9, threads, isa: isa.name(), before_run_gflops: None }
}

/// One short trial of the chains on `threads` threads (at least one), about `seconds` long: their
/// GFLOP/s. A benchmark pairs it turn by turn with what it times, so that a machine whose speed drifts
/// slows both alike (`examples/sgemm_shapes.rs --against-peak`).
pub fn trial_gflops(threads: usize, seconds: f64) -> f64 {
    static ITERATIONS: OnceLock<u64> = OnceLock::new();
    let threads = threads.max(1);
    let isa = Chains::detect();
    let per_trial = *ITERATIONS.get_or_init(|| trial_iterations(isa));
    let iterations = (per_trial as f64 * seconds / TRIAL.as_secs_f64()).max(1.0) as u64;
    let flops = threads as f64 * iterations as f64 * (CHAINS * isa.lanes() * 2) as f64;
    flops / parallel_seconds(isa, threads, iterations).max(1e-9) / 1e9
}

/// The peak measured just before a profiled run began ([`measure_before_run`]), which [`of_backend`]
/// gives beside the one it measures after the run.
static BEFORE_RUN: OnceLock<f64> = OnceLock::new();

/// Measures the peak before a profiled run starts (about 0.15 s; once a process).
pub fn measure_before_run() {
    BEFORE_RUN.get_or_init(|| measure_peak(product_threads()).gflops);
}

/// How far apart measurements of the peak may be before a long measurement (a calibration, a profiled
/// run) warns that the machine's speed changed under it.
pub const UNSTEADY: f64 = 0.10;

/// The peak measured several times over a long measurement, to tell whether the machine kept its speed:
/// a virtual machine whose host is shared can run 1.5x slower for seconds at a time, and then no timing
/// taken during those seconds (a calibration's, a profile's) can be trusted closer than that.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Steadiness {
    gflops: Vec<f64>,
}

impl Steadiness {
    /// Measures the peak once more, on the kernel pool's threads (about 0.15 s).
    pub fn probe(&mut self) {
        self.add(measure_peak(product_threads()).gflops);
    }

    /// Adds a peak measured elsewhere.
    pub fn add(&mut self, gflops: f64) {
        if gflops.is_finite() && gflops > 0.0 {
            self.gflops.push(gflops);
        }
    }

    /// How far the fastest measurement is above the slowest (0.38: 38% faster); `None` below two.
    pub fn variation(&self) -> Option<f64> {
        let (slowest, fastest) = self.range()?;
        Some(fastest / slowest - 1.0)
    }

    fn range(&self) -> Option<(f64, f64)> {
        if self.gflops.len() < 2 {
            return None;
        }
        let slowest = self.gflops.iter().copied().fold(f64::INFINITY, f64::min);
        let fastest = self.gflops.iter().copied().fold(0.0, f64::max);
        Some((slowest, fastest))
    }

    /// Whether the measurements are more than [`UNSTEADY`] apart.
    pub fn is_unsteady(&self) -> bool {
        self.variation().is_some_and(|v| v > UNSTEADY)
    }

    /// "the peak measured 6 times: 101.3 to 140.2 GFLOP/s, 38% apart".
    pub fn describe(&self) -> String {
        match (self.range(), self.variation()) {
            (Some((slowest, fastest)), Some(variation)) => format!(
                "the peak measured {} times: {slowest:.1} to {fastest:.1} GFLOP/s, {:.0}% apart",
                self.gflops.len(),
                100.0 * variation
            ),
            _ => format!("the peak measured {} time(s)", self.gflops.len()),
        }
    }
}

/// Iterations of the chains that take about [`TRIAL`] on one thread.
fn trial_iterations(isa: Chains) -> u64 {
    let mut iterations: u64 = 1 << 10;
    loop {
        let start = Instant::now();
        isa.run(black_box(iterations));
        let took = start.elapsed();
        if took >= CALIBRATION || iterations >= 1 << 40 {
            let scale = TRIAL.as_secs_f64() / took.as_secs_f64().max(1e-9);
            return ((iterations as f64 * scale) as u64).max(1);
        }
        iterations *= 4;
    }
}

/// Wall seconds for `threads` threads that each run `iterations` of the chains, started together: from
/// the first worker's start to the last one's end, both read by the workers themselves (a clock read by a
/// waiting thread could start late and make the figure too high).
fn parallel_seconds(isa: Chains, threads: usize, iterations: u64) -> f64 {
    if threads == 1 {
        // On this thread, where a one-thread product it is paired with runs: a spawned thread could
        // land on the other core, which a shared VM may run at another speed.
        let start = Instant::now();
        isa.run(black_box(iterations));
        return start.elapsed().as_secs_f64();
    }
    let barrier = Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    barrier.wait();
                    let start = Instant::now();
                    isa.run(black_box(iterations));
                    (start, Instant::now())
                })
            })
            .collect();
        // A worker cannot panic; one that did would only be left out.
        workers.into_iter().filter_map(|w| w.join().ok()).collect()
    });
    let first = spans.iter().map(|s| s.0).min();
    let last = spans.iter().map(|s| s.1).max();
    match (first, last) {
        (Some(first), Some(last)) => last.duration_since(first).as_secs_f64(),
        _ => f64::INFINITY,
    }
}

/// The vector instructions the chains run in: those the CPU kernels use ([`vmath::isa`], the widest the
/// CPU has, no wider than `OPTIMUS_CPU_ISA`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Chains(Isa);

impl Chains {
    fn detect() -> Chains {
        Chains(vmath::isa())
    }

    /// What the profile calls them, saying so where `OPTIMUS_CPU_ISA` chose them.
    fn name(self) -> String {
        let capped = matches!(vmath::isa_cap(), Some(Ok(_)));
        let name = match self.0 {
            Isa::Avx512 => "AVX-512 FMA",
            Isa::Avx2Fma => "AVX2 FMA",
            Isa::Baseline if capped => "baseline multiply-add",
            Isa::Baseline => "baseline multiply-add, no FMA detected",
        };
        if capped { format!("{name}, as {} allows", vmath::ISA_CAP_VARIABLE) } else { name.to_string() }
    }

    /// Float32 lanes per accumulator.
    fn lanes(self) -> usize {
        match self.0 {
            Isa::Avx512 => 16,
            Isa::Avx2Fma => 8,
            Isa::Baseline => BASELINE_LANES,
        }
    }

    /// Runs [`CHAINS`] independent chains of `iterations` multiply-adds of [`Chains::lanes`] lanes each.
    fn run(self, iterations: u64) {
        match self.0 {
            // SAFETY: vmath::isa chose these only where the CPU has the features they enable.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::chains_avx512(iterations) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => {
                black_box(unsafe { x86::chains_avx2_fma(iterations) });
            }
            _ => {
                black_box(chains_baseline(iterations));
            }
        }
    }
}

/// Lanes of the baseline's accumulators (what SSE or NEON holds).
const BASELINE_LANES: usize = 4;

/// Multiply and add on arrays the compiler may vectorise with the baseline instructions.
fn chains_baseline(iterations: u64) -> f32 {
    let (a, b) = (black_box(0.999_999f32), black_box(1e-6f32));
    let mut acc = [[1.0f32; BASELINE_LANES]; CHAINS];
    for _ in 0..iterations {
        for chain in &mut acc {
            for x in chain.iter_mut() {
                *x = *x * a + b;
            }
        }
    }
    acc.iter().flatten().sum()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;
    use std::hint::black_box;

    /// [`CHAINS`] chains of `iterations` AVX-512 FMAs, in assembly: the AVX-512 intrinsics are newer than
    /// the crate's minimum Rust. The accumulators stay zero (0 * 0 + 0), which no CPU runs faster.
    #[target_feature(enable = "avx512f")]
    pub fn chains_avx512(iterations: u64) {
        if iterations == 0 {
            return;
        }
        // SAFETY: registers only (all declared clobbered), no memory or stack; callers outside AVX-512F
        // code reach this function only through an `unsafe` call after checking the feature.
        unsafe {
            std::arch::asm!(
                "vxorps zmm0, zmm0, zmm0",
                "vxorps zmm1, zmm1, zmm1",
                "vxorps zmm2, zmm2, zmm2",
                "vxorps zmm3, zmm3, zmm3",
                "vxorps zmm4, zmm4, zmm4",
                "vxorps zmm5, zmm5, zmm5",
                "vxorps zmm6, zmm6, zmm6",
                "vxorps zmm7, zmm7, zmm7",
                "vxorps zmm8, zmm8, zmm8",
                "vxorps zmm9, zmm9, zmm9",
                "vxorps zmm10, zmm10, zmm10",
                "vxorps zmm11, zmm11, zmm11",
                "vxorps zmm12, zmm12, zmm12",
                "vxorps zmm13, zmm13, zmm13",
                "2:",
                "vfmadd231ps zmm0, zmm12, zmm13",
                "vfmadd231ps zmm1, zmm12, zmm13",
                "vfmadd231ps zmm2, zmm12, zmm13",
                "vfmadd231ps zmm3, zmm12, zmm13",
                "vfmadd231ps zmm4, zmm12, zmm13",
                "vfmadd231ps zmm5, zmm12, zmm13",
                "vfmadd231ps zmm6, zmm12, zmm13",
                "vfmadd231ps zmm7, zmm12, zmm13",
                "vfmadd231ps zmm8, zmm12, zmm13",
                "vfmadd231ps zmm9, zmm12, zmm13",
                "vfmadd231ps zmm10, zmm12, zmm13",
                "vfmadd231ps zmm11, zmm12, zmm13",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) iterations => _,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _,
                out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _,
                out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _,
                options(nostack, nomem),
            );
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn chains_avx2_fma(iterations: u64) -> f32 {
        let a = _mm256_set1_ps(black_box(0.999_999));
        let b = _mm256_set1_ps(black_box(1e-6));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        for _ in 0..iterations {
            for x in &mut acc {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let total = acc.iter().fold(_mm256_setzero_ps(), |t, &x| _mm256_add_ps(t, x));
        // Every lane takes part in the sum, so none of the chains can be dropped.
        let half = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps::<1>(total));
        let quarter = _mm_hadd_ps(half, half);
        _mm_cvtss_f32(_mm_hadd_ps(quarter, quarter))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_peak_carries_the_one_measured_before_the_run_and_a_gpu_none() {
        use crate::backend::BackendKind;
        measure_before_run();
        let cpu = of_backend(BackendKind::Cpu);
        assert!(cpu.before_run_gflops.is_some_and(|g| g > 0.0), "{cpu:?}");
        assert_eq!(of_backend(BackendKind::Cuda).before_run_gflops, None);
        assert_eq!(measure_peak(1).before_run_gflops, None, "a peak measured alone is alone");
    }

    #[test]
    fn steadiness_is_how_far_the_fastest_peak_is_above_the_slowest() {
        let mut s = Steadiness::default();
        assert_eq!(s.variation(), None);
        s.add(100.0);
        assert!(!s.is_unsteady(), "one measurement says nothing");
        for g in [105.0, 109.0, f64::NAN, 0.0] {
            s.add(g);
        }
        assert!((s.variation().unwrap_or_default() - 0.09).abs() < 1e-12, "{s:?}");
        assert!(!s.is_unsteady());
        s.add(138.0);
        assert!(s.is_unsteady());
        assert_eq!(s.describe(), "the peak measured 4 times: 100.0 to 138.0 GFLOP/s, 38% apart");
    }

    #[test]
    fn the_chains_compute_what_they_claim() {
        // Each lane starts at 1 and maps x -> 0.999999 x + 1e-6, which keeps it at 1.
        let baseline = chains_baseline(1000) / (CHAINS * BASELINE_LANES) as f32;
        assert!((baseline - 1.0).abs() < 1e-3, "{baseline}");
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has both features.
            let avx2 = unsafe { x86::chains_avx2_fma(1000) } / (CHAINS * 8) as f32;
            assert!((avx2 - 1.0).abs() < 1e-3, "{avx2}");
        }
        for isa in [Chains::detect(), Chains(Isa::Baseline)] {
            isa.run(0);
            isa.run(3);
        }
    }

    #[test]
    fn the_peak_is_positive_and_finite() {
        let peak = measure_peak(1);
        assert!(peak.gflops.is_finite() && peak.gflops > 0.0, "{peak:?}");
        assert_eq!(peak.threads, 1);
    }

    /// Run by hand (`cargo test --release --lib peak -- --ignored --nocapture`): a large faer product on
    /// every thread of the pool next to the measured peak; the product should not beat it.
    #[test]
    #[ignore = "takes a few seconds and prints numbers to compare by eye"]
    fn a_large_product_stays_below_the_measured_peak() {
        let threads = product_threads();
        let peak = measure_peak(threads);
        let n = 2048;
        let a = faer::Mat::<f32>::from_fn(n, n, |i, j| ((i * 7 + j * 3) % 13) as f32 / 13.0);
        let b = faer::Mat::<f32>::from_fn(n, n, |i, j| ((i * 5 + j * 11) % 17) as f32 / 17.0);
        let mut c = faer::Mat::<f32>::zeros(n, n);
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let start = Instant::now();
            faer::linalg::matmul::matmul(
                c.as_mut(),
                faer::Accum::Replace,
                a.as_ref(),
                b.as_ref(),
                1.0,
                faer::Par::rayon(0),
            );
            best = best.min(start.elapsed().as_secs_f64());
        }
        let product = 2.0 * (n as f64).powi(3) / best / 1e9;
        println!(
            "peak {:.1} GFLOP/s on {threads} threads ({}); {n}^3 faer product {product:.1} GFLOP/s ({:.1}% of peak)",
            peak.gflops,
            peak.isa,
            100.0 * product / peak.gflops
        );
        assert!(product <= peak.gflops * 1.05, "the product beats the measured peak: {product} > {}", peak.gflops);
    }
}
