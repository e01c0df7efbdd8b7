//! Times our AVX2 product against the OpenBLAS found on the machine, alone, on the shapes GPT-2
//! small's plans make (a benchmark, not a test: `scripts/bench_sgemm.sh` runs it).
//!
//! For each shape and library it prints one JSON line: the best of `--reps` calls on one thread and
//! on two (each thread a half of the output, as the kernel pool splits a product), in GFLOP/s and in %
//! of the peak `run --profile` measures, and the medians of the calls (`median_gflops_1`,
//! `median_gflops_2`), to set beside the median calls of `run --profile`'s products by shape.
//! `--cold` writes 64 MiB between calls, so the operands come from memory as they do inside a
//! training step. `OPTIMUS_CPU_ISA=avx2` narrows OpenBLAS and the peak
//! (set `OPENBLAS_CORETYPE=Haswell` too, or `SkylakeX` uncapped on AVX-512: `optimusc` does it itself,
//! and leaves aside an OpenBLAS whose kernels are narrower than the CPU's). The libraries take
//! turns call by call, so a machine whose speed drifts (a shared VM's does, for seconds at a time)
//! slows each alike instead of whichever ran during the slow spell.
//!
//! `--against-peak` times our product alone against the peak's FMA chains instead, the two taking
//! turns (about 10 ms each, the first of a turn alternating): per shape and thread count one JSON line
//! with the median, quartiles and best over turns of the product's GFLOP/s over the chains' in the same
//! turn, a figure a slow spell of the machine moves far less than a peak and a product timed apart.

use faer::{MatMut, MatRef};
use optimus_runtime::cpu::{blas, sgemm};
use optimus_runtime::peak;
use std::time::Instant;

/// m, n, k and whether the left and right operands are stored transposed: the linears' forward
/// products, their input gradients (right transposed) and weight gradients (left transposed), at
/// 1x1 (1024 tokens, hidden 256, vocabulary 8192) and at one device of a 2x2 mesh.
const SHAPES: [(&str, usize, usize, usize, bool, bool); 20] = [
    ("1x1", 1024, 768, 256, false, false),
    ("1x1", 1024, 1024, 256, false, false),
    ("1x1", 1024, 256, 1024, false, false),
    ("1x1", 1024, 8192, 256, false, true),
    ("1x1", 1024, 256, 768, false, true),
    ("1x1", 1024, 256, 8192, false, false),
    ("1x1", 256, 768, 1024, true, false),
    ("1x1", 256, 1024, 1024, true, false),
    ("1x1", 1024, 256, 1024, true, false),
    ("1x1", 8192, 256, 1024, true, false),
    ("2x2", 512, 384, 128, false, false),
    ("2x2", 512, 512, 128, false, false),
    ("2x2", 512, 128, 512, false, false),
    ("2x2", 512, 4096, 128, false, true),
    ("2x2", 512, 128, 384, false, true),
    ("2x2", 512, 128, 4096, false, false),
    ("2x2", 128, 384, 512, true, false),
    ("2x2", 128, 512, 512, true, false),
    ("2x2", 512, 128, 512, true, false),
    ("2x2", 4096, 128, 512, true, false),
];

#[derive(Clone, Copy, PartialEq)]
enum Library {
    Ours,
    OpenBlas,
}

impl Library {
    fn name(self) -> &'static str {
        match self {
            Library::Ours => sgemm::DESCRIPTION,
            Library::OpenBlas => "OpenBLAS",
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let reps = args.iter().position(|a| a == "--reps").and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok());
    let reps: usize = reps.unwrap_or(20);
    let cold = args.iter().any(|a| a == "--cold");
    if !sgemm::applies(true) {
        eprintln!("this CPU lacks AVX2 or FMA: nothing to compare");
        std::process::exit(1);
    }
    let openblas = blas::loaded();
    // `--shape m,n,k,tl,tr` (tl, tr: 1 for a transposed operand) measures that shape instead.
    let given: Vec<(&str, usize, usize, usize, bool, bool)> =
        args.windows(2).filter(|w| w[0] == "--shape").filter_map(|w| parse_shape(&w[1])).collect();
    let shapes = if given.is_empty() { SHAPES.to_vec() } else { given };
    if args.iter().any(|a| a == "--against-peak") {
        for &(mesh, m, n, k, ta, tb) in &shapes {
            against_peak((mesh, m, n, k, ta, tb), reps.max(5));
        }
        return;
    }
    let peaks = [peak::measured_peak_gflops(1), peak::measured_peak_gflops(2)];
    let mut junk = vec![0u8; if cold { 64 << 20 } else { 0 }];
    for &(mesh, m, n, k, ta, tb) in &shapes {
        let a = stored(1, m * k);
        let b = stored(2, k * n);
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
        let mut c = vec![0f32; m * n];
        let libraries: Vec<Library> = [Library::Ours, Library::OpenBlas]
            .into_iter()
            .filter(|l| *l == Library::Ours || openblas.is_some())
            .collect();
        let mut times = vec![[Vec::new(), Vec::new()]; libraries.len()];
        for rep in 0..reps {
            for (&library, times) in libraries.iter().zip(times.iter_mut()) {
                for (threads, times) in times.iter_mut().enumerate() {
                    if cold {
                        junk.iter_mut().for_each(|x| *x = rep as u8);
                        std::hint::black_box(&junk);
                    }
                    let dst = MatMut::from_row_major_slice_mut(&mut c, m, n);
                    let start = Instant::now();
                    split(library, openblas, dst, lhs, rhs, threads + 1);
                    times.push(start.elapsed().as_secs_f64());
                }
            }
        }
        let gflops = |seconds: f64| 2.0 * (m * n * k) as f64 / seconds / 1e9;
        for (library, times) in libraries.iter().zip(&times) {
            let [(best_1, median_1), (best_2, median_2)] = [&times[0], &times[1]].map(|t| best_and_median(t));
            println!(
                "{{\"mesh\":\"{mesh}\",\"m\":{m},\"n\":{n},\"k\":{k},\"transposed_left\":{ta},\"transposed_right\":{tb},\"library\":\"{}\",\"gflops_1\":{:.1},\"peak_pct_1\":{:.1},\"gflops_2\":{:.1},\"peak_pct_2\":{:.1},\"median_gflops_1\":{:.1},\"median_gflops_2\":{:.1},\"cold\":{cold}}}",
                library.name(),
                gflops(best_1),
                100.0 * gflops(best_1) / peaks[0],
                gflops(best_2),
                100.0 * gflops(best_2) / peaks[1],
                gflops(median_1),
                gflops(median_2),
            );
        }
    }
}

/// Our product on one shape against the peak's chains, turn by turn, on one and on two threads: prints
/// the product's share of the chains' GFLOP/s over `turns` turns (median, quartiles, best).
fn against_peak((mesh, m, n, k, ta, tb): (&str, usize, usize, usize, bool, bool), turns: usize) {
    let (a, b) = (stored(1, m * k), stored(2, k * n));
    let lhs =
        if ta { MatRef::from_row_major_slice(&a, k, m).transpose() } else { MatRef::from_row_major_slice(&a, m, k) };
    let rhs =
        if tb { MatRef::from_row_major_slice(&b, n, k).transpose() } else { MatRef::from_row_major_slice(&b, k, n) };
    let mut c = vec![0f32; m * n];
    let flops = 2.0 * (m * n * k) as f64;
    for threads in [1, 2] {
        let mut call = |calls: usize| {
            let start = Instant::now();
            for _ in 0..calls {
                split(Library::Ours, None, MatMut::from_row_major_slice_mut(&mut c, m, n), lhs, rhs, threads);
            }
            start.elapsed().as_secs_f64()
        };
        call(1);
        // Calls to a turn: about 10 ms of products.
        let calls = ((0.010 / call(1).max(1e-7)) as usize).clamp(1, 10_000);
        let mut shares: Vec<f64> = (0..turns)
            .map(|turn| {
                let (seconds, chains) = if turn % 2 == 0 {
                    let seconds = call(calls);
                    (seconds, peak::trial_gflops(threads, seconds))
                } else {
                    let chains = peak::trial_gflops(threads, 0.010);
                    (call(calls), chains)
                };
                calls as f64 * flops / seconds / 1e9 / chains
            })
            .collect();
        shares.sort_by(f64::total_cmp);
        let at = |q: f64| shares[((shares.len() - 1) as f64 * q).round() as usize];
        println!(
            "{{\"mesh\":\"{mesh}\",\"m\":{m},\"n\":{n},\"k\":{k},\"transposed_left\":{ta},\"transposed_right\":{tb},\"library\":\"{}\",\"threads\":{threads},\"turns\":{turns},\"peak_share_median\":{:.3},\"peak_share_q1\":{:.3},\"peak_share_q3\":{:.3},\"peak_share_best\":{:.3}}}",
            sgemm::DESCRIPTION,
            at(0.5),
            at(0.25),
            at(0.75),
            at(1.0),
        );
    }
}

/// The fastest and the median of `times` (seconds; infinite when empty).
fn best_and_median(times: &[f64]) -> (f64, f64) {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    let best = sorted.first().copied().unwrap_or(f64::INFINITY);
    (best, sorted.get(sorted.len() / 2).copied().unwrap_or(f64::INFINITY))
}

/// "m,n,k,tl,tr" as a shape of its own ("given").
fn parse_shape(text: &str) -> Option<(&'static str, usize, usize, usize, bool, bool)> {
    let v: Vec<usize> = text.split(',').map(|x| x.trim().parse().ok()).collect::<Option<_>>()?;
    match v[..] {
        [m, n, k, tl, tr] if m > 0 && n > 0 && k > 0 => Some(("given", m, n, k, tl == 1, tr == 1)),
        _ => None,
    }
}

/// Values in [-1, 1).
fn stored(seed: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 7919 + seed * 104729) % 2001) as f32 / 1000.0 - 1.0).collect()
}

/// The product on `threads` threads (1 or 2), the second taking the lower half of the rows (or the
/// right half of the columns, when wider than tall), as the kernel pool splits it.
fn split(
    library: Library,
    openblas: Option<&blas::Blas>,
    dst: MatMut<'_, f32>,
    lhs: MatRef<'_, f32>,
    rhs: MatRef<'_, f32>,
    threads: usize,
) {
    let one = |dst: MatMut<'_, f32>, lhs: MatRef<'_, f32>, rhs: MatRef<'_, f32>| {
        let done = match (library, openblas) {
            (Library::Ours, _) => sgemm::product(dst, lhs, rhs, false, 1.0),
            (Library::OpenBlas, Some(blas)) => blas.product(dst, lhs, rhs, false, 1.0),
            (Library::OpenBlas, None) => false,
        };
        assert!(done, "the library took the product");
    };
    if threads == 1 {
        return one(dst, lhs, rhs);
    }
    let (m, n) = (dst.nrows(), dst.ncols());
    // Two long-lived workers (as the kernel pool's), so each keeps its packing buffers between calls.
    static PAIR: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    let pair = PAIR.get_or_init(|| rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("two threads"));
    pair.install(|| {
        if m >= n {
            let at = (m / 2).div_ceil(16) * 16;
            let (top, bottom) = dst.split_at_row_mut(at);
            let (upper, lower) = lhs.split_at_row(at);
            rayon::join(|| one(top, upper, rhs), || one(bottom, lower, rhs));
        } else {
            let at = (n / 2).div_ceil(16) * 16;
            let (left, right) = dst.split_at_col_mut(at);
            let (first, second) = rhs.split_at_col(at);
            rayon::join(|| one(left, lhs, first), || one(right, lhs, second));
        }
    });
}
