//! Multi-process runs under Open MPI's mpirun (feature `mpi`): 4 and 9 processes give the thread
//! backend's losses and weights, 8 processes on data-parallel, tesseract and 3d meshes give one device's, and a rank
//! that errs, panics, hangs or is killed ends the whole job with an error naming it, within seconds. Each run is its own mpirun job, so MPI is initialised
//! once per process.
#![cfg(feature = "mpi")]

mod common;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_optimusc");

/// How long any one job may take before the test calls it hung.
const JOB_LIMIT: Duration = Duration::from_secs(90);

/// Runs `mpirun -np P optimusc ARGS`, with the settings that let Open MPI start more ranks than
/// cores (and run as root in containers). Fails the test if the job outlives [`JOB_LIMIT`].
fn mpirun(processes: u32, args: &[&str], env: &[(&str, &str)]) -> (Output, Duration) {
    let mut command = Command::new("mpirun");
    command
        .args(["-np", &processes.to_string(), "--oversubscribe", BIN])
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("RAYON_NUM_THREADS", "1")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = command.spawn().expect("mpirun starts (the test command installs Open MPI: openmpi-bin)");
    let (mut stdout, mut stderr) = (child.stdout.take().expect("stdout"), child.stderr.take().expect("stderr"));
    let out_reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stderr.read_to_end(&mut s);
        s
    });
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for mpirun") {
            break status;
        }
        if start.elapsed() > JOB_LIMIT {
            let _ = child.kill();
            panic!("mpirun {args:?} did not end within {JOB_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    let output = Output {
        status,
        stdout: out_reader.join().expect("stdout reader"),
        stderr: err_reader.join().expect("stderr reader"),
    };
    (output, elapsed)
}

fn threads(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("optimusc runs")
}

fn losses(out: &Output) -> Vec<f64> {
    assert!(out.status.success(), "stderr:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("each stdout line is one JSON object");
            v["loss"].as_f64().expect("a loss")
        })
        .collect()
}

fn assert_close(mpi: &[f64], thread: &[f64]) {
    assert_eq!(mpi.len(), thread.len(), "one line per step, from rank 0 only: {mpi:?} vs {thread:?}");
    for (step, (a, b)) in mpi.iter().zip(thread).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "step {step}: mpi {a} vs threads {b}");
    }
}

/// A fresh path for `name`: whatever an earlier run whose process had the same id left there is
/// removed first, so that a stale checkpoint folder never meets a new run.
fn scratch(name: &str) -> PathBuf {
    let dir = common::process_dir("mpi");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    let _ = std::fs::remove_dir_all(&path);
    let _ = std::fs::remove_file(&path);
    path
}

/// A small GPT-2 that every mesh up to 3x3 divides.
const MODEL_3X3: [&str; 17] = [
    "examples/gpt2.opt",
    "--set",
    "layers=2",
    "--set",
    "hidden=36",
    "--set",
    "heads=9",
    "--set",
    "batch=9",
    "--set",
    "vocab=333",
    "--set",
    "context=64",
    "--set",
    "seq=30",
    "--set",
    "pdrop=0.1",
];

fn with<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(more).copied().collect()
}

#[test]
fn an_overlapped_plan_runs_under_mpirun_with_the_losses_of_threads() {
    // Under MPI a started collective completes where it starts; the losses are those of threads.
    let base = ["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "3", "--json", "--seed", "7"];
    let thread = losses(&threads(&base));
    let (mpi, _) = mpirun(4, &with(&base, &["--overlap"]), &[]);
    assert_close(&losses(&mpi), &thread);
}

#[test]
fn four_processes_give_the_thread_backends_losses() {
    let base = ["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "4", "--json", "--seed", "11"];
    let thread = losses(&threads(&base));
    for placement in ["row-major", "blocks"] {
        let (out, _) = mpirun(4, &with(&base, &["--placement", placement]), &[]);
        assert_close(&losses(&out), &thread);
    }
}

#[test]
fn four_processes_run_megatron_and_inference_plans() {
    for extra in [&["--strategy", "megatron", "--mesh", "1x4"][..], &["--mode", "infer", "--mesh", "2x2"][..]] {
        let args = with(&["run", "examples/tiny.opt", "--steps", "2", "--json"], extra);
        assert_close(&losses(&mpirun(4, &args, &[]).0), &losses(&threads(&args)));
    }
}

#[test]
fn bf16_runs_give_the_thread_backends_losses() {
    // bf16 collectives reduce in f32 in member order and round once on both communicators, so the
    // losses agree as closely as float32 runs do.
    let base = ["run", "examples/tiny.opt", "--steps", "3", "--json", "--seed", "5", "--precision", "bf16"];
    for extra in [&["--mesh", "2x2"][..], &["--strategy", "megatron", "--mesh", "1x4"][..]] {
        let args = with(&base, extra);
        assert_close(&losses(&mpirun(4, &args, &[]).0), &losses(&threads(&args)));
    }
}

#[test]
fn nine_processes_give_the_thread_backends_losses_and_weights() {
    let mpi_weights = scratch("mpi9.safetensors");
    let thread_weights = scratch("threads9.safetensors");
    let args = with(&["run"], &MODEL_3X3);
    let args = with(&args, &["--mesh", "3x3", "--steps", "3", "--json", "--optimizer", "sgd", "--lr", "0.1"]);
    let (out, _) = mpirun(9, &with(&args, &["--save-weights", mpi_weights.to_str().expect("utf-8")]), &[]);
    let thread = threads(&with(&args, &["--save-weights", thread_weights.to_str().expect("utf-8")]));
    assert_close(&losses(&out), &losses(&thread));
    let (a, b) = (std::fs::read(&mpi_weights).expect("rank 0 saved"), std::fs::read(&thread_weights).expect("saved"));
    let (a, b) = (
        safetensors::SafeTensors::deserialize(&a).expect("safetensors"),
        safetensors::SafeTensors::deserialize(&b).expect("safetensors"),
    );
    assert_eq!(a.names().len(), b.names().len());
    for name in b.names() {
        let (x, y) = (a.tensor(name).expect("same names"), b.tensor(name).expect("tensor"));
        assert_eq!(x.shape(), y.shape(), "{name}");
        let floats = |d: &[u8]| -> Vec<f32> {
            d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        };
        for (p, q) in floats(x.data()).iter().zip(floats(y.data())) {
            assert!((p - q).abs() <= 1e-5 * q.abs().max(1e-2), "{name}: {p} vs {q}");
        }
    }
}

#[test]
fn eight_processes_on_data_parallel_tesseract_and_3d_meshes_give_one_devices_losses_and_weights() {
    // Two replicas of a 2x2 optimus mesh and of a 1x4 megatron mesh, with and without ZeRO-1, and two
    // tesseract depth layers of a 2x2 grid: every process runs one device, and the losses and final
    // weights are one device's with the whole batch.
    let base =
        ["run", "examples/tiny.opt", "--steps", "3", "--json", "--seed", "7", "--optimizer", "sgd", "--lr", "0.1"];
    let one_weights = scratch("one-device.safetensors");
    let single = with(&base, &["--mesh", "1x1", "--strategy", "none", "--save-weights", text(&one_weights)]);
    let one = losses(&threads(&single));
    let meshes: [(&str, &[&str], &[&str]); 4] = [
        ("2x2x2", &["--mesh", "2x2x2"], &["0", "1"]),
        ("2x1x4", &["--mesh", "2x1x4", "--strategy", "megatron"], &["0", "1"]),
        ("tesseract-2x2x2", &["--mesh", "2x2x2", "--strategy", "tesseract"], &["0"]),
        ("3d-2x2x2", &["--mesh", "2x2x2", "--strategy", "3d"], &["0"]),
    ];
    for (name, mesh, zeros) in meshes {
        for &zero in zeros {
            let weights = scratch(&format!("dp-{name}-zero{zero}.safetensors"));
            let args = with(&with(&base, mesh), &["--zero", zero, "--save-weights", text(&weights)]);
            let mpi = losses(&mpirun(8, &args, &[]).0);
            assert_eq!(mpi.len(), one.len(), "{args:?}");
            for (step, (a, b)) in mpi.iter().zip(&one).enumerate() {
                assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{args:?} step {step}: mpi {a} vs one device {b}");
            }
            assert_same_weights(&weights, &one_weights, 1e-4);
        }
    }
}

fn text(path: &std::path::Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// Every tensor of two safetensors files agrees within `tolerance` (relative, floor 1e-2).
fn assert_same_weights(got: &std::path::Path, want: &std::path::Path, tolerance: f32) {
    let (a, b) = (std::fs::read(got).expect("saved"), std::fs::read(want).expect("saved"));
    let (a, b) = (
        safetensors::SafeTensors::deserialize(&a).expect("safetensors"),
        safetensors::SafeTensors::deserialize(&b).expect("safetensors"),
    );
    assert_eq!(a.names().len(), b.names().len());
    let floats =
        |d: &[u8]| -> Vec<f32> { d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect() };
    for name in b.names() {
        let (x, y) = (a.tensor(name).expect("same names"), b.tensor(name).expect("tensor"));
        assert_eq!(x.shape(), y.shape(), "{name}");
        for (p, q) in floats(x.data()).iter().zip(floats(y.data())) {
            assert!((p - q).abs() <= tolerance * q.abs().max(1e-2), "{}: {name}: {p} vs {q}", got.display());
        }
    }
}

#[test]
fn a_job_whose_size_is_not_the_mesh_says_so_once() {
    let (out, _) = mpirun(3, &["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "1"], &[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let message = "4 devices but the job has 3 processes";
    assert_eq!(stderr.matches(message).count(), 1, "{stderr}");
    // Checked before the model compiles: tiny does not compile on 3x3 (E0602), and the job's size is
    // what is wrong first.
    let (out, _) = mpirun(3, &["run", "examples/tiny.opt", "--mesh", "3x3", "--steps", "1"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("9 devices but the job has 3 processes"), "{stderr}");
    assert!(!stderr.contains("E0602"), "{stderr}");
}

/// Runs a 2x2 job with a fault injected on device `device` at step 1 and checks that the job fails
/// quickly with the rank named.
fn fails_fast(kind: &str, device: u64, expect: &[&str]) {
    let fault = format!("{kind}:{device}:1");
    let args = ["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "4", "--timeout", "3"];
    let (out, elapsed) = mpirun(4, &args, &[("OPTIMUS_INJECT_FAULT", &fault)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{kind}: the job must fail\n{stderr}");
    for text in expect {
        assert!(stderr.contains(text), "{kind}: expected `{text}` in\n{stderr}");
    }
    assert!(elapsed < Duration::from_secs(30), "{kind}: took {elapsed:?}");
}

#[test]
fn a_rank_that_errs_ends_the_job_naming_it() {
    fails_fast("error", 3, &["rank 3: device (1, 1) failed: injected error at step 1"]);
}

/// When a rank fails, mpirun sends the others SIGTERM: the first signal's note (a training run's
/// "finishing the current step") comes from rank 0 at most, not once per rank.
#[test]
fn the_ranks_that_mpirun_stops_say_so_once_at_most() {
    let dir = common::process_dir("mpi-interrupt");
    let checkpoints = dir.to_string_lossy().into_owned();
    let args = [
        "run",
        "examples/tiny.opt",
        "--mesh",
        "2x2",
        "--steps",
        "4",
        "--timeout",
        "3",
        "--checkpoint-dir",
        &checkpoints,
    ];
    let (out, _) = mpirun(4, &args, &[("OPTIMUS_INJECT_FAULT", "error:2:1")]);
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("rank 2"), "{stderr}");
    assert!(stderr.matches("interrupt: finishing the current step").count() <= 1, "{stderr}");
}

#[test]
fn a_rank_that_panics_ends_the_job_naming_it() {
    fails_fast("panic", 2, &["rank 2 (device (1, 0)) panicked", "injected panic"]);
}

#[test]
fn a_rank_that_hangs_is_caught_by_the_collective_timeout() {
    fails_fast("hang", 1, &["waited 3 s for its peers"]);
}

#[test]
fn a_killed_rank_ends_the_job() {
    fails_fast("kill", 2, &["rank 2", "signal 9"]);
}

/// The train records (loss present) of a run, leaving out checkpoint and validation records.
fn train_losses(out: &Output) -> Vec<f64> {
    assert!(out.status.success(), "stderr:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["loss"].as_f64())
        .collect()
}

#[test]
fn four_processes_write_a_checkpoint_that_threads_resume_on_another_mesh() {
    let dir = scratch("mpi-checkpoints");
    let _ = std::fs::remove_dir_all(&dir);
    let base = ["run", "examples/tiny.opt", "--steps", "4", "--json", "--seed", "11", "--optimizer", "sgd"];
    let dir_text = dir.to_str().expect("utf-8");
    let (out, _) =
        mpirun(4, &with(&base, &["--mesh", "2x2", "--checkpoint-dir", dir_text, "--checkpoint-every", "2"]), &[]);
    let mpi = train_losses(&out);
    for step in ["step-00000002", "step-00000004"] {
        let files = std::fs::read_dir(dir.join(step)).expect("a complete checkpoint").count();
        assert_eq!(files, 5, "{step}: four device files and the manifest");
    }
    let resumed = with(&base, &["--mesh", "1x4", "--strategy", "megatron"]);
    let after_2 = dir.join("step-00000002");
    let again = scratch("mpi-checkpoints-resumed");
    let resuming = ["--resume", after_2.to_str().expect("utf-8"), "--checkpoint-dir", again.to_str().expect("utf-8")];
    let rest = train_losses(&threads(&with(&resumed, &resuming)));
    assert_close(&rest, &mpi[2..]);
}

#[test]
fn pipelines_under_mpirun_give_the_threads_losses_weights_and_stage_reports() {
    // One process per device of every stage: 2 stages of optimus 2x2 (8 processes, 1F1B), 2 of megatron
    // 1x2 interleaved (4), 4 of one device under GPipe (4) and 2 of two data-parallel replicas (4).
    let base = [
        "run",
        "examples/tiny.opt",
        "--set",
        "layers=4",
        "--steps",
        "3",
        "--json",
        "--seed",
        "5",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--set",
        "vocab=333",
    ];
    let base = [&base[..], &common::PARAGRAPH_VALIDATED_EVERY_2].concat();
    let cases: [(&str, u32, &[&str]); 4] = [
        ("optimus-2x2-1f1b", 8, &["--mesh", "2x2", "--pipeline", "2", "--accum", "4"]),
        (
            "megatron-1x2-interleaved",
            4,
            &[
                "--mesh",
                "1x2",
                "--strategy",
                "megatron",
                "--pipeline",
                "2",
                "--pipeline-schedule",
                "interleaved",
                "--accum",
                "4",
            ],
        ),
        (
            "none-1x1-pp4-gpipe",
            4,
            &["--mesh", "1x1", "--strategy", "none", "--pipeline", "4", "--pipeline-schedule", "gpipe", "--accum", "2"],
        ),
        (
            "dp2-1f1b",
            4,
            &["--mesh", "2x1x1", "--strategy", "none", "--pipeline", "2", "--accum", "2", "--clip-grad-norm", "0.5"],
        ),
    ];
    for (name, processes, flags) in cases {
        let (mpi_weights, thread_weights) =
            (scratch(&format!("pp-{name}-mpi.safetensors")), scratch(&format!("pp-{name}-threads.safetensors")));
        let args = with(&base, flags);
        let (out, _) = mpirun(processes, &with(&args, &["--save-weights", text(&mpi_weights)]), &[]);
        let thread = threads(&with(&args, &["--save-weights", text(&thread_weights)]));
        let (mpi_records, thread_records) = (records(&out), records(&thread));
        let steps = |r: &[serde_json::Value]| -> Vec<f64> { r.iter().filter_map(|v| v["loss"].as_f64()).collect() };
        assert_close(&steps(&mpi_records), &steps(&thread_records));
        let validated =
            |r: &[serde_json::Value]| -> Vec<f64> { r.iter().filter_map(|v| v["val_loss"].as_f64()).collect() };
        assert_eq!(validated(&thread_records).len(), 1, "{name}: validated after step 2 of 3");
        assert_close(&validated(&mpi_records), &validated(&thread_records));
        assert_same_weights(&mpi_weights, &thread_weights, 1e-5);
        let report = |r: &[serde_json::Value]| r.iter().find(|v| v.get("pipeline").is_some()).cloned();
        let (a, b) = (report(&mpi_records), report(&thread_records));
        assert!(a.is_some(), "{name}: rank 0 prints the stages' report");
        assert_eq!(a, b, "{name}: the same stages, memory and bytes between stages");
    }
}

/// Every JSON line of a successful run's standard output.
fn records(out: &Output) -> Vec<serde_json::Value> {
    assert!(out.status.success(), "stderr:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object a line"))
        .collect()
}

#[test]
fn a_pipeline_job_of_the_wrong_size_says_how_many_processes_it_needs() {
    let args = ["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "1", "--accum", "2", "--pipeline", "2"];
    let (out, _) = mpirun(4, &args, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(stderr.matches("has 4 devices in each of 2 stages but the job has 4 processes").count(), 1, "{stderr}");
    assert!(stderr.contains("-np 8"), "{stderr}");
}

#[test]
fn a_pipeline_whose_loss_is_not_finite_ends_the_job_naming_the_step() {
    let args = [&common::NAN_LOSS_PIPELINE[..], &["--timeout", "20"]].concat();
    let (out, elapsed) = mpirun(2, &args, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("step 1: the loss is NaN, so the run stops before updating any weight"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
}

#[test]
fn a_pipeline_under_mpirun_writes_the_checkpoint_threads_write_and_resumes_at_another_depth() {
    let base = [
        "run",
        "examples/tiny.opt",
        "--set",
        "layers=4",
        "--steps",
        "4",
        "--accum",
        "4",
        "--json",
        "--seed",
        "3",
        "--eps",
        "0.0001",
        "--lr",
        "0.01",
        "--checkpoint-every",
        "2",
    ];
    let (mpi_dir, thread_dir, resumed_dir) =
        (scratch("pp-ckpt-mpi"), scratch("pp-ckpt-threads"), scratch("pp-ckpt-resumed"));
    let pipeline = ["--mesh", "2x2", "--pipeline", "2"];
    let (out, _) = mpirun(8, &with(&with(&base, &pipeline), &["--checkpoint-dir", text(&mpi_dir)]), &[]);
    let mpi = train_losses(&out);
    let thread = train_losses(&threads(&with(&with(&base, &pipeline), &["--checkpoint-dir", text(&thread_dir)])));
    assert_close(&mpi, &thread);
    for device in ["0-0", "0-1", "1-0", "1-1"] {
        let file = format!("step-00000002/device-{device}.safetensors");
        assert_same_weights(&mpi_dir.join(&file), &thread_dir.join(&file), 1e-6);
    }
    let first = mpi_dir.join("step-00000002");
    let resume = ["--mesh", "1x2", "--strategy", "megatron", "--pipeline", "4", "--resume", text(&first)];
    let resumed = with(&with(&base, &resume), &["--checkpoint-dir", text(&resumed_dir)]);
    let (out, _) = mpirun(8, &resumed, &[]);
    assert_close(&train_losses(&out), &thread[2..]);
}
