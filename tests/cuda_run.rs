//! `optimusc run --backend cuda` end to end (feature `cuda`): the GPU run's losses equal the CPU
//! backend's on every mesh this machine has GPUs for. Without a CUDA driver or GPU the tests say so
//! and pass, unless `OPTIMUS_REQUIRE_CUDA=1`.
#![cfg(feature = "cuda")]

use std::process::{Command, Output};

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

/// The GPUs visible, or `None` (with the reason printed) where the test cannot run.
fn gpus() -> Option<u64> {
    // SAFETY: only probes whether the driver library loads.
    let count = if unsafe { cudarc::driver::sys::is_culib_present() } {
        cudarc::driver::CudaContext::device_count().unwrap_or(0) as u64
    } else {
        0
    };
    if count == 0 {
        assert!(std::env::var("OPTIMUS_REQUIRE_CUDA").as_deref() != Ok("1"), "OPTIMUS_REQUIRE_CUDA=1 but no GPU");
        eprintln!("skipped: no CUDA driver or GPU on this machine");
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
    let Some(gpus) = gpus() else { return };
    let meshes: Vec<&str> = [("1x1", 1), ("1x2", 2), ("2x2", 4)].iter().filter(|m| m.1 <= gpus).map(|m| m.0).collect();
    for mesh in meshes {
        let args = ["run", "examples/tiny.opt", "--mesh", mesh, "--steps", "3", "--json", "--optimizer", "sgd"];
        let cpu = losses(&optimusc(&args));
        let gpu = losses(&optimusc(&[&args[..], &["--backend", "cuda"]].concat()));
        assert_eq!(cpu.len(), gpu.len());
        for (step, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
            assert!((c - g).abs() <= 1e-4 * c.abs().max(1.0), "{mesh} step {step}: cpu {c} vs cuda {g}");
        }
    }
}

#[test]
fn a_mesh_larger_than_the_gpus_is_a_clear_error() {
    let Some(gpus) = gpus() else { return };
    if gpus >= 4 {
        eprintln!("skipped: {gpus} GPUs hold every 2x2 device");
        return;
    }
    let out = optimusc(&["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "1", "--backend", "cuda"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("one device per GPU"));
}
