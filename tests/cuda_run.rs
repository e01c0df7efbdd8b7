//! `optimusc run --backend cuda` end to end (feature `cuda`): the GPU run's losses equal the CPU
//! backend's on every mesh this machine has GPUs for, in f32 and in bf16 (`--precision bf16`, within
//! bf16's tolerance). Without a CUDA driver or GPU the tests say what did not run and pass, unless
//! `OPTIMUS_REQUIRE_CUDA=1`.
#![cfg(feature = "cuda")]

use std::process::{Command, Output};

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

/// The GPUs visible, or `None` (printing that `what` did not run, and why) where the test cannot run.
fn gpus(what: &str) -> Option<u64> {
    // SAFETY: only probes whether the driver library loads.
    let count = if unsafe { cudarc::driver::sys::is_culib_present() } {
        cudarc::driver::CudaContext::device_count().unwrap_or(0) as u64
    } else {
        0
    };
    if count == 0 {
        assert!(std::env::var("OPTIMUS_REQUIRE_CUDA").as_deref() != Ok("1"), "OPTIMUS_REQUIRE_CUDA=1 but no GPU");
        eprintln!("skipped (not run on a GPU): {what}, because this machine has no CUDA driver or GPU");
        return None;
    }
    Some(count)
}

fn losses(out: &Output) -> Vec<f64> {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = String::from_utf8_lossy(&out.stdout);
    lines
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON")["loss"].as_f64().expect("loss"))
        .collect()
}

#[test]
fn gpu_runs_give_the_cpu_backends_losses() {
    let meshes = [("1x1", 1), ("1x2", 2), ("2x2", 4)];
    compare_runs("f32 runs of tiny.opt on the GPU against the CPU backend", &[], &meshes, 1e-4);
}

/// bf16 plans on the GPU (bf16 kernels, gemmEx products) track the CPU backend's bf16 run: the two differ
/// by summation order and, in attention, by the bf16 rounding of the probabilities as product operands.
#[test]
fn gpu_bf16_runs_track_the_cpu_backends_bf16_losses() {
    let bf16 = ["--precision", "bf16"];
    let meshes = [("1x1", 1), ("2x2", 4)];
    compare_runs("bf16 runs of tiny.opt on the GPU against the CPU backend's bf16", &bf16, &meshes, 2e-2);
}

/// Three SGD steps of tiny.opt on the CPU and the GPU on each mesh (name, devices) this machine has
/// GPUs for: every loss within `tol`, relative.
fn compare_runs(what: &str, extra: &[&str], meshes: &[(&str, u64)], tol: f64) {
    let Some(gpus) = gpus(what) else { return };
    for &(mesh, devices) in meshes {
        if devices > gpus {
            eprintln!("skipped (not run on a GPU): {what} on the {mesh} mesh, because this machine has {gpus} GPUs");
            continue;
        }
        let base = ["run", "examples/tiny.opt", "--mesh", mesh, "--steps", "3", "--json", "--optimizer", "sgd"];
        let args = [&base[..], extra].concat();
        let cpu = losses(&optimusc(&args));
        let gpu = losses(&optimusc(&[&args[..], &["--backend", "cuda"]].concat()));
        assert_eq!(cpu.len(), gpu.len());
        for (step, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
            assert!((c - g).abs() <= tol * c.abs().max(1.0), "{what}, {mesh} step {step}: cpu {c} vs cuda {g}");
        }
    }
}

#[test]
fn a_mesh_larger_than_the_gpus_is_a_clear_error() {
    let Some(gpus) = gpus("the error for a mesh larger than the GPUs") else { return };
    if gpus >= 4 {
        eprintln!("skipped: {gpus} GPUs hold every 2x2 device");
        return;
    }
    let out = optimusc(&["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "1", "--backend", "cuda"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("one device per GPU"));
}
