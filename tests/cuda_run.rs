//! `optimusc run --backend cuda` end to end (feature `cuda`): the GPU run's losses equal the CPU
//! backend's on 1x1, 1x2, 2x2 and data-parallel meshes (devices share GPUs where the mesh has more devices
//! than the machine has GPUs), in f32 and in bf16 (`--precision bf16`, within bf16's tolerance). Without a
//! CUDA driver or GPU the tests say what did not run and pass, unless `OPTIMUS_REQUIRE_CUDA=1`.
#![cfg(feature = "cuda")]

mod common;

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
    let meshes = ["1x1", "1x2", "2x2"];
    compare_runs("f32 runs of tiny.opt on the GPU against the CPU backend", &[], &meshes, 1e-4);
}

/// A GPT-2-shaped model with dropout, AdamW, clipping and a data-parallel replica axis, on meshes whose
/// devices share the GPUs: every loss as the CPU backend's.
#[test]
fn gpu_training_with_adamw_dropout_and_replicas_gives_the_cpu_backends_losses() {
    let model = [&small_gpt2("batch=4")[..], &["--clip-grad-norm", "1.0"]].concat();
    let meshes = ["1x1", "2x2", "2x2x2", "2x1x2"];
    compare_runs("GPT-2-shaped AdamW runs on the GPU against the CPU backend", &model, &meshes, 1e-4);
}

/// A two-layer GPT-2 of hidden size 64 (vocabulary 512, sequence 32) trained with AdamW, at `batch`
/// (`batch=N`), as `compare_runs` takes it.
fn small_gpt2(batch: &'static str) -> Vec<&'static str> {
    let sizes = ["layers=2", "hidden=64", "heads=4", "vocab=512", "context=32", "seq=32", batch];
    let sets = sizes.iter().flat_map(|s| ["--set", s]);
    ["--model", "examples/gpt2.opt"].into_iter().chain(sets).chain(["--optimizer", "adamw"]).collect()
}

/// bf16 plans on the GPU (bf16 kernels, gemmEx products) track the CPU backend's bf16 run: the two differ
/// by summation order and, in attention, by the bf16 rounding of the probabilities as product operands.
#[test]
fn gpu_bf16_runs_track_the_cpu_backends_bf16_losses() {
    let bf16 = ["--precision", "bf16"];
    compare_runs("bf16 runs of tiny.opt on the GPU against the CPU backend's bf16", &bf16, &["1x1", "2x2"], 2e-2);
}

/// A bf16 Llama (RMSNorm, rotary positions, grouped-query attention, SwiGLU) on the GPU, whose norms and
/// rotations run on their bf16 kernels, tracks the CPU backend's bf16 run on one device and on a 2x2 mesh.
#[test]
fn gpu_bf16_llama_runs_track_the_cpu_backends_bf16_losses() {
    let sizes = ["layers=2", "hidden=64", "heads=4", "kv_heads=2", "ffn=96", "vocab=256", "seq=32", "context=32"];
    let sets = sizes.iter().flat_map(|s| ["--set", s]);
    let model: Vec<&str> =
        ["--model", "examples/llama.opt"].into_iter().chain(sets).chain(["--precision", "bf16"]).collect();
    compare_runs("bf16 Llama runs on the GPU against the CPU backend's bf16", &model, &["1x1", "2x2"], 2e-2);
}

/// Tesseract (2.5D) and 3D plans on one GPU: their depth groups run on the shared-GPU fabric too.
#[test]
fn gpu_tesseract_and_3d_runs_give_the_cpu_backends_losses() {
    let model = small_gpt2("batch=8");
    let meshes = ["tesseract:2x2x2", "3d:2x2x2", "tesseract:2x2x2x2"];
    compare_runs("tesseract and 3d runs on the GPU against the CPU backend", &model, &meshes, 1e-4);
}

/// Three steps on the CPU and the GPU on each mesh (`STRATEGY:MESH`, or optimus where it is square, else megatron): every
/// loss within `tol`, relative. Devices share
/// the GPUs where the mesh has more devices than the machine has GPUs. `extra` may start with
/// `--model PATH` (default examples/tiny.opt, three SGD steps).
fn compare_runs(what: &str, extra: &[&str], meshes: &[&str], tol: f64) {
    if gpus(what).is_none() {
        return;
    }
    let (model, extra) = match extra {
        ["--model", path, rest @ ..] => (*path, rest),
        _ => ("examples/tiny.opt", extra),
    };
    let optimizer: &[&str] = if extra.contains(&"--optimizer") { &[] } else { &["--optimizer", "sgd"] };
    for &target in meshes {
        let (strategy, mesh) = match target.split_once(':') {
            Some((strategy, mesh)) => (strategy, mesh),
            None => {
                let sides: Vec<&str> = target.rsplit('x').take(2).collect();
                (if sides[0] == sides[1] { "optimus" } else { "megatron" }, target)
            }
        };
        let base = ["run", model, "--mesh", mesh, "--strategy", strategy, "--steps", "3", "--json"];
        let args = [&base[..], optimizer, extra].concat();
        let cpu = losses(&optimusc(&args));
        let gpu = losses(&optimusc(&[&args[..], &["--backend", "cuda"]].concat()));
        assert_eq!(cpu.len(), gpu.len());
        for (step, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
            assert!((c - g).abs() <= tol * c.abs().max(1.0), "{what}, {mesh} step {step}: cpu {c} vs cuda {g}");
        }
        eprintln!("{what}, {mesh}: {} losses agree within {tol} ({gpu:?})", gpu.len());
    }
}

/// The backend holds a step's AdamW updates (with their clipping scales) and its gradients' casts back
/// to run many at a time: losses and final weights are bit-identical to running each where it is issued
/// (`OPTIMUS_CUDA_BATCH=off`), in bf16 (where the casts are) with clipping that applies, on one device
/// and with data-parallel replicas under ZeRO-1.
#[test]
fn held_back_updates_and_casts_change_no_bit() {
    let what = "AdamW updates and casts held back to run many at a time";
    if gpus(what).is_none() {
        return;
    }
    let dir = common::process_dir("cuda-batch");
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let model = small_gpt2("batch=8");
    for (mesh, extra) in [("1x1", &[][..]), ("2x1x1", &["--zero", "1"][..])] {
        let run = |batch: &str| {
            let weights = dir.join(format!("{mesh}-{batch}.safetensors"));
            let weights_arg = weights.to_string_lossy().into_owned();
            let base = ["run", model[1], "--mesh", mesh, "--steps", "3", "--json", "--backend", "cuda"];
            let clip = ["--precision", "bf16", "--clip-grad-norm", "0.05", "--save-weights", &weights_arg];
            let args = [&base[..], &model[2..], extra, &clip[..]].concat();
            let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
                .args(&args)
                .env("OPTIMUS_CUDA_BATCH", batch)
                .output()
                .expect("optimusc runs");
            (losses(&out), std::fs::read(&weights).expect("saved weights"))
        };
        let (held, held_weights) = run("on");
        let (each, each_weights) = run("off");
        assert_eq!(held, each, "{what}, {mesh}: losses");
        assert!(held_weights == each_weights, "{what}, {mesh}: the saved weights differ");
        eprintln!("{what}, {mesh}: {} losses and the weights bit-identical", held.len());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--profile` on the GPU times each kernel on the GPU, alone (events around it, the stream held busy
/// while the host queues it): the profiled run trains as the unprofiled one, bit for bit, and its
/// profile has a positive GPU time for every kernel kind, adding up to less than the profiled wall time.
#[test]
fn a_gpu_profile_times_kernels_on_the_gpu_and_trains_as_an_unprofiled_run() {
    let what = "the GPU-timed profile";
    if gpus(what).is_none() {
        return;
    }
    let model = small_gpt2("batch=8");
    let base = ["run", model[1], "--steps", "3", "--json", "--backend", "cuda", "--precision", "bf16"];
    let args = [&base[..], &model[2..]].concat();
    let plain = optimusc(&args);
    let profiled = optimusc(&[&args[..], &["--profile"]].concat());
    assert!(profiled.status.success(), "{}", String::from_utf8_lossy(&profiled.stderr));
    let stdout = String::from_utf8_lossy(&profiled.stdout);
    let (steps, profile): (Vec<&str>, Vec<&str>) = stdout.lines().partition(|l| l.starts_with("{\"elapsed_s\""));
    let loss = |l: &&str| serde_json::from_str::<serde_json::Value>(l).expect("JSON")["loss"].as_f64().expect("loss");
    assert_eq!(losses(&plain), steps.iter().map(loss).collect::<Vec<_>>(), "{what}: losses");
    let record: serde_json::Value = serde_json::from_str(profile.last().expect("a profile record")).expect("JSON");
    let rows = record["profile"]["rows"].as_array().expect("profile rows");
    assert!(rows.iter().any(|r| r["name"] == "MatMul"), "{what}: no MatMul row");
    for row in rows.iter().filter(|r| r["category"] == "compute") {
        assert!(row["total_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{what}: {row}");
    }
    let device = &record["profile"]["devices"][0];
    let (compute, wall) = (device["compute_ms"].as_f64().expect("compute"), device["wall_ms"].as_f64().expect("wall"));
    assert!(compute > 0.0 && compute < wall, "{what}: compute {compute} ms against wall {wall} ms");
    eprintln!("{what}: losses equal, {} kernel kinds, {compute:.2} ms of GPU time in {wall:.2} ms", rows.len());
}

/// A driver library that loads but lacks the functions the backend calls (a stub, an old or a broken
/// driver: here the C maths library under CUDA's names) is an error saying so, exit 1, with no panic
/// (cudarc panics on a missing symbol) and nothing written. Runs on any machine: the stub is made here.
#[test]
fn a_driver_that_lacks_its_functions_is_a_clear_error_not_a_panic() {
    let libm = ["/usr/lib/x86_64-linux-gnu/libm.so.6", "/lib/x86_64-linux-gnu/libm.so.6"]
        .into_iter()
        .map(std::path::Path::new)
        .find(|p| p.is_file());
    let Some(libm) = libm else {
        eprintln!("skipped: no libm.so.6 to stand in for the CUDA libraries");
        return;
    };
    let stubs = tempfile::tempdir().expect("a temporary directory");
    for name in ["libcuda.so", "libcuda.so.1", "libnvrtc.so", "libcublas.so", "libcublasLt.so", "libnccl.so"] {
        std::fs::copy(libm, stubs.path().join(name)).expect("copied");
    }
    let log = stubs.path().join("log.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(["run", "examples/tiny.opt", "--steps", "1", "--backend", "cuda", "--log"])
        .arg(&log)
        .env("LD_LIBRARY_PATH", stubs.path())
        .output()
        .expect("optimusc runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("an old or broken driver") && !stderr.contains("panicked"), "{stderr}");
    assert!(!log.exists(), "nothing is written");
}

/// Without a GPU, `generate --backend cuda` says so before it compiles the model or reads its weights
/// (it read a whole weights file first, and a missing one was reported instead).
#[test]
fn generate_checks_the_gpu_before_reading_weights() {
    // SAFETY: only probes whether the driver library loads.
    if unsafe { cudarc::driver::sys::is_culib_present() }
        && cudarc::driver::CudaContext::device_count().unwrap_or(0) > 0
    {
        eprintln!("skipped (a GPU is present): generate_checks_the_gpu_before_reading_weights");
        return;
    }
    let missing = "/nonexistent/weights.safetensors";
    let out =
        optimusc(&["generate", "examples/tiny.opt", "--backend", "cuda", "--prompt-ids", "1,2", "--weights", missing]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--backend cuda") && !stderr.contains(missing), "{stderr}");
}
