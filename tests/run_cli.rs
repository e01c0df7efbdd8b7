//! `optimusc run` and `optimusc verify` end to end: per-step JSON, failures that name the device and
//! leave no files behind, and verify's exit status.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

fn scratch(name: &str) -> PathBuf {
    let dir = common::process_dir("run-cli");
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

#[test]
fn run_prints_one_json_object_per_step() {
    let out = optimusc(&["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "3", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<serde_json::Value> =
        stdout.lines().map(|l| serde_json::from_str(l).expect("each line is JSON")).collect();
    assert_eq!(lines.len(), 3);
    for (k, line) in lines.iter().enumerate() {
        assert_eq!(line["step"], k as u64);
        let loss = line["loss"].as_f64().expect("loss");
        assert!(loss.is_finite() && loss > 0.0, "{loss}");
        assert!(line["tokens_per_s"].as_f64().expect("throughput") > 0.0);
        assert!(line["elapsed_s"].as_f64().expect("elapsed") >= 0.0);
    }
}

#[test]
fn a_token_outside_the_vocabulary_fails_naming_the_device_and_offset() {
    let data = scratch("bad.u16");
    let mut tokens: Vec<u16> = (0..200).map(|t| t % 100).collect();
    // In the second batch (tiny.opt's batch 0 reads tokens 0..=64): the first is checked before step 0.
    tokens[100] = 5000;
    std::fs::write(&data, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).expect("write data");
    let saved = scratch("never.safetensors");
    let out = optimusc(&[
        "run",
        "examples/tiny.opt",
        "--mesh",
        "2x2",
        "--steps",
        "2",
        "--data",
        data.to_str().expect("utf-8 path"),
        "--save-weights",
        saved.to_str().expect("utf-8 path"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("device (") && stderr.contains("step 1: batch 1: ") && stderr.contains("offset 100"),
        "{stderr}"
    );
    assert!(!saved.exists(), "no weights are written after a failed run");
}

#[test]
fn save_weights_then_load_them_back() {
    let saved = scratch("tiny.safetensors");
    let path = saved.to_str().expect("utf-8 path");
    let first = optimusc(&["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "2", "--save-weights", path]);
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    // Inference from the saved weights on another mesh reports a finite loss.
    let second = optimusc(&[
        "run",
        "examples/tiny.opt",
        "--strategy",
        "megatron",
        "--mesh",
        "1x2",
        "--mode",
        "infer",
        "--steps",
        "1",
        "--weights",
        path,
        "--json",
    ]);
    assert!(second.status.success(), "{}", String::from_utf8_lossy(&second.stderr));
    let line: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&second.stdout).trim()).expect("one JSON line");
    assert!(line["loss"].as_f64().expect("loss").is_finite());
    // An inference step updates nothing: no rate, no gradient norm.
    assert!(line["lr"].is_null() && line["grad_norm"].is_null(), "{line}");
}

#[test]
fn verify_passes_and_fails_by_its_tolerance() {
    let ok = optimusc(&["verify", "examples/tiny.opt", "--mesh", "2x2"]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stdout));
    assert!(String::from_utf8_lossy(&ok.stdout).contains("verified"));
    let strict = optimusc(&["verify", "examples/tiny.opt", "--mesh", "2x2", "--tolerance", "1e-12"]);
    assert_eq!(strict.status.code(), Some(1), "float summation order differs between meshes");
    assert!(String::from_utf8_lossy(&strict.stdout).contains("FAILED"));
}

#[test]
fn unknown_backend_is_a_usage_error() {
    let out = optimusc(&["run", "examples/tiny.opt", "--backend", "tpu"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_corrupted_plan_is_refused_not_run() {
    let plan = scratch("plan.json");
    let path = plan.to_str().expect("utf-8 path");
    let out = optimusc(&["compile", "examples/tiny.opt", "--mesh", "2x2", "-o", path]);
    assert!(out.status.success());
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan).expect("plan")).expect("JSON");
    json["buffers"][3]["shape"] = serde_json::json!([1_000_000, 1_000_000]);
    let bad = scratch("bad-plan.json");
    std::fs::write(&bad, serde_json::to_vec(&json).expect("serialise")).expect("write");
    for command in ["run", "inspect"] {
        let out = optimusc(&[command, bad.to_str().expect("utf-8 path")]);
        assert_eq!(out.status.code(), Some(1), "{command}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("failed verification"), "{command}");
    }
}

#[test]
fn the_cuda_backend_without_a_gpu_is_a_clear_error_not_a_panic() {
    #[cfg(feature = "cuda")]
    // SAFETY: only probes whether the driver library loads.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    let out = optimusc(&["run", "examples/tiny.opt", "--mesh", "2x2", "--steps", "1", "--backend", "cuda"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let explained = if cfg!(feature = "cuda") { "CUDA driver library" } else { "--features cuda" };
    assert!(stderr.contains(explained) && !stderr.contains("panicked"), "{stderr}");
}

#[test]
fn json_records_carry_the_scheduled_rate_of_each_update() {
    let (peak, floor, warmup, steps) = (1e-2f64, 1e-3f64, 2u64, 6u64);
    for (schedule, decay) in [
        ("cosine", (|p: f64| 0.5 * (1.0 + (std::f64::consts::PI * p).cos())) as fn(f64) -> f64),
        ("linear", |p: f64| 1.0 - p),
    ] {
        let out = optimusc(&[
            "run",
            "examples/tiny.opt",
            "--steps",
            "6",
            "--lr",
            "0.01",
            "--min-lr",
            "0.001",
            "--warmup-steps",
            "2",
            "--lr-schedule",
            schedule,
            "--json",
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        for (k, line) in stdout.lines().enumerate() {
            let record: serde_json::Value = serde_json::from_str(line).expect("JSON");
            let k = k as u64;
            // Hugging Face's schedules, written out here from their definitions.
            let want = if k < warmup {
                peak * k as f64 / warmup as f64
            } else {
                floor + (peak - floor) * decay((k - warmup) as f64 / (steps - warmup) as f64)
            };
            let got = record["lr"].as_f64().expect("lr");
            assert!((got - want).abs() <= 1e-7 * peak, "{schedule} step {k}: lr {got}, want {want}");
        }
    }
}

#[test]
fn schedule_flags_that_cannot_mean_anything_are_usage_errors() {
    for (flags, says) in [
        (&["--min-lr", "0.001"][..], "--lr-schedule cosine or linear"),
        (&["--lr-schedule", "cosine", "--lr", "0.001", "--min-lr", "0.01"][..], "above --lr"),
        (&["--warmup-steps", "5"][..], "longer than the run"),
        (&["--lr-schedule", "cosine", "--min-lr", "nan"][..], "--min-lr"),
    ] {
        let mut args = vec!["run", "examples/tiny.opt", "--steps", "3"];
        args.extend_from_slice(flags);
        let out = optimusc(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(says), "{flags:?}: {stderr}");
    }
}

#[test]
fn validation_losses_are_the_mean_loss_of_the_validation_batches() {
    // With lr 0 the weights never move, so validation batch v (read as training step v reads) has the
    // loss training step v reported: the validation loss is the mean of the first V training losses.
    let out = optimusc(&[
        "run",
        "examples/tiny.opt",
        "--set",
        "vocab=333",
        "--mesh",
        "2x2",
        "--steps",
        "4",
        "--lr",
        "0",
        "--data",
        "examples/data/paragraph.u16",
        "--val-data",
        "examples/data/paragraph.u16",
        "--eval-every",
        "2",
        "--eval-batches",
        "3",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let records: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("JSON")).collect();
    let train: Vec<f64> = records.iter().filter_map(|r| r["loss"].as_f64()).collect();
    let val: Vec<(u64, f64)> =
        records.iter().filter_map(|r| Some((r["step"].as_u64()?, r["val_loss"].as_f64()?))).collect();
    assert_eq!(train.len(), 4);
    assert_eq!(val.iter().map(|v| v.0).collect::<Vec<_>>(), vec![1, 3], "after every second update");
    let want = train[..3].iter().sum::<f64>() / 3.0;
    for (step, loss) in val {
        assert!((loss - want).abs() <= 1e-6 * want, "step {step}: validation loss {loss}, want {want}");
    }
    let out = optimusc(&["run", "examples/tiny.opt", "--steps", "2", "--eval-batches", "2"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Every tensor of a safetensors file of float32 tensors, by name.
fn float_tensors(path: &std::path::Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).expect("read weights");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            (name, values)
        })
        .collect()
}

#[test]
fn accumulating_micro_batches_equals_one_batch_of_all_their_sequences() {
    // Two micro-batches of 4 sequences read the rows one batch of 8 reads, so the mean gradient, the
    // loss and the weights after each update are those of the batch of 8 (up to float rounding).
    let run = |batch: &str, accum: &str, weights: &std::path::Path| {
        let out = optimusc(&[
            "run",
            "examples/tiny.opt",
            "--set",
            "vocab=333",
            "--set",
            batch,
            "--accum",
            accum,
            "--mesh",
            "2x2",
            "--data",
            "examples/data/paragraph.u16",
            "--optimizer",
            "sgd",
            "--lr",
            "0.1",
            "--momentum",
            "0.9",
            "--steps",
            "3",
            "--json",
            "--save-weights",
            weights.to_str().expect("utf-8 path"),
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        stdout
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON")["loss"].as_f64().expect("loss"))
            .collect::<Vec<f64>>()
    };
    let (whole, micro) = (scratch("batch8.safetensors"), scratch("accum2.safetensors"));
    let (losses_whole, losses_micro) = (run("batch=8", "1", &whole), run("batch=4", "2", &micro));
    assert_eq!(losses_whole.len(), 3);
    for (k, (a, b)) in losses_whole.iter().zip(&losses_micro).enumerate() {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "step {k}: loss {b} with --accum 2, {a} in one batch");
    }
    let (a, b) = (float_tensors(&whole), float_tensors(&micro));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, x) in &a {
        let scale = x.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
        let diff = x.iter().zip(&b[name]).fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(diff <= 1e-5 * scale, "{name}: weights differ by {diff} (scale {scale})");
    }
}

/// `OPTIMUS_TRACE_STARTUP=1` prints each start-up stage with its time since the process started, in
/// order; without it nothing of the kind is printed.
#[test]
fn the_startup_trace_names_each_stage_only_when_asked() {
    let args = ["run", "examples/tiny.opt", "--steps", "1"];
    let traced = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(args)
        .env("OPTIMUS_TRACE_STARTUP", "1")
        .output()
        .expect("runs");
    assert!(traced.status.success(), "{}", String::from_utf8_lossy(&traced.stderr));
    let text = String::from_utf8_lossy(&traced.stderr);
    let stages = [
        "process started",
        "plan ready and data opened",
        "initial weights drawn",
        "backend open",
        "parameters written",
    ];
    let mut last = (0, 0.0f64);
    for stage in stages {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("startup: {stage} at ")))
            .unwrap_or_else(|| panic!("no `{stage}`: {text}"));
        let position = text.find(line).unwrap_or_default();
        let seconds: f64 =
            line.rsplit(" at ").next().and_then(|t| t.trim_end_matches(" s").parse().ok()).expect("seconds");
        assert!(position >= last.0 && seconds >= last.1, "`{stage}` out of order: {text}");
        last = (position, seconds);
    }
    let plain = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(args)
        .env_remove("OPTIMUS_TRACE_STARTUP")
        .output()
        .expect("runs");
    assert!(!String::from_utf8_lossy(&plain.stderr).contains("startup:"), "no trace unless asked");
}

/// A bias before a layer norm over the positions: the norm removes anything the positions share, so the
/// bias's gradient is zero in exact arithmetic and float noise on every mesh, pure data parallelism
/// (which only reorders the sums) among them. verify measured it against its own noise and failed
/// every one of these meshes; it now measures it against a share of the largest gradient too.
#[test]
fn a_gradient_that_is_zero_in_exact_arithmetic_verifies_on_every_mesh() {
    let model = scratch("norm_over_positions.opt");
    let source = "model norm_over_positions\n\
        config { vocab = 24; hidden = 16; batch = 8; seq = 4 }\n\
        input tokens: i32[batch, seq]\ninput targets: i32[batch, seq]\n\
        layer emb = embedding(vocab, hidden)\nlayer f = linear(hidden, hidden)\n\
        layer norm = layernorm(seq)\nlayer head = linear(hidden, vocab)\n\
        forward {\n  t = norm(transpose(f(emb(tokens)), 1, 2))\n\
        \x20 output loss = cross_entropy(head(transpose(t, 1, 2)), targets)\n}\n";
    std::fs::write(&model, source).expect("the model is written");
    let model = model.to_string_lossy().into_owned();
    for (strategy, mesh) in [("none", "2x1x1"), ("megatron", "1x2"), ("optimus", "2x2"), ("3d", "2x2x2")] {
        for seed in ["0", "1"] {
            let out = optimusc(&["verify", &model, "--strategy", strategy, "--mesh", mesh, "--seed", seed]);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success() && stdout.contains("verified"), "{strategy} {mesh} seed {seed}:\n{stdout}");
        }
    }
    // At a tolerance of 0 every difference fails; the line names the largest, not the last.
    let out = optimusc(&["verify", &model, "--mesh", "2x2", "--tolerance", "0", "--verbose"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let largest = |kind: &str| {
        let each = stdout.lines().filter_map(|l| l.strip_prefix(&format!("  {kind}: ")));
        let each = each.filter_map(|l| l.split_whitespace().collect::<Vec<_>>().get(1).and_then(|v| v.parse().ok()));
        each.fold(0f64, f64::max)
    };
    let summary = stdout.lines().find(|l| l.starts_with("gradients ")).unwrap_or_default();
    let worst: f64 = summary.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(-1.0);
    assert!(summary.contains("FAILED") && worst == largest("gradients") && worst > 0.0, "{stdout}");
}

/// `--save-weights NAME/` (a folder) where NAME is a file says so, rather than the system's "File exists".
#[test]
fn a_weights_folder_where_a_file_is_says_so() {
    let file = scratch("a-file-not-a-folder");
    std::fs::write(&file, "in the way").expect("a file");
    for folder in [format!("{}/", file.display()), format!("{}/below/", file.display())] {
        let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--save-weights", &folder]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(&format!("`{}` is a file, not a folder", file.display())), "{stderr}");
    }
}

/// An output whose last dimension is a padded vocabulary (17 classes over 2 shards: 18 columns) comes
/// back with the model's 17: verify compared 18 columns with one device's 17 and failed (`inf`).
#[test]
fn an_output_of_a_padded_vocabulary_comes_back_unpadded() {
    let model = scratch("padded_output.opt");
    let source = "model padded_output\nconfig { vocab = 17; hidden = 8; batch = 4; seq = 4 }\n\
        input tokens: i32[batch, seq]\ninput targets: i32[batch, seq]\n\
        layer wte = embedding(vocab, hidden)\nlayer head = linear(hidden, vocab)\n\
        forward {\n  logits = head(wte(tokens))\n  output loss = cross_entropy(logits, targets)\n  output logits = logits\n}\n";
    std::fs::write(&model, source).expect("the model is written");
    let model = model.to_string_lossy().into_owned();
    for (strategy, mesh) in [("megatron", "1x2"), ("optimus", "2x2"), ("3d", "2x2x2")] {
        let out = optimusc(&["verify", &model, "--strategy", strategy, "--mesh", mesh]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && stdout.contains("verified"), "{strategy} {mesh}:\n{stdout}");
    }
    let plan = scratch("padded_output.json");
    let out =
        optimusc(&["compile", &model, "--strategy", "megatron", "--mesh", "1x2", "-o", plan.to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan).expect("the plan")).expect("JSON");
    let logits = plan["outputs"].as_array().expect("outputs").iter().find(|o| o["name"] == "logits").cloned();
    assert_eq!(logits.expect("a logits output")["unpadded"], serde_json::json!([4, 4, 17]));
}
