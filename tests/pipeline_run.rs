//! Pipelines that run (`optimusc run --pipeline P`): every schedule, on stages of 1x1, optimus 2x2 and
//! megatron 1x2 grids with and without data-parallel replicas, computes what the unpipelined plan
//! computes with as many accumulated micro-batches (the same losses, final weights and gradients), and
//! each stage keeps the activations its schedule says it does.

mod common;

use common::optimusc;
use optimus::front::check_source;
use optimus::plan::pipeline::Schedule;
use optimus::plan::pipeline_cut::{PipelineProgram, cut};
use optimus::plan::tensor::Tensor;
use optimus::plan::{Mesh, Mode, Plan, Strategy};
use optimus::runtime::exec::{RunConfig, RunOutput};
use optimus::runtime::pipeline::{PipelineOutput, PipelineRun, run_on_threads};
use optimus::shard::{Target, compile};
use std::collections::BTreeMap;
use std::time::Duration;

/// tiny.opt with `layers` repeated layers, compiled for `mesh`.
fn plan(layers: u64, mesh: Mesh, strategy: Strategy) -> Plan {
    plan_of("examples/tiny.opt", &[format!("layers={layers}")], mesh, strategy)
}

/// The example `file` with the `--set`s `sets`, compiled for `mesh`.
fn plan_of(file: &str, sets: &[String], mesh: Mesh, strategy: Strategy) -> Plan {
    let source = std::fs::read_to_string(file).expect("example exists");
    let overrides: Vec<_> = sets.iter().map(|set| set.parse().expect("an override")).collect();
    let model = check_source(&source, &overrides).model.expect("example checks");
    let target = Target::plain(mesh, strategy, Mode::Train);
    match compile(&model, file, &source, target) {
        Ok(p) => p,
        Err(d) => panic!("compile failed: {}", optimus::diag::render_plain(file, &source, &d)),
    }
}

fn config(steps: u64, micro_batches: u64, clip: Option<f32>) -> RunConfig {
    RunConfig {
        timeout: Duration::from_secs(60),
        accumulation: micro_batches,
        clip_grad_norm: clip,
        ..RunConfig::new(7, steps, common::adamw())
    }
}

fn unpipelined(plan: &Plan, config: &RunConfig) -> RunOutput {
    optimus::runtime::local::run(plan, config, &common::pattern_batches(plan, 5), &BTreeMap::new(), &|_| {})
        .expect("the unpipelined run")
}

fn pipelined(plan: &Plan, program: &PipelineProgram, schedule: Schedule, config: &RunConfig) -> PipelineOutput {
    let pipe = PipelineRun { program, schedule };
    run_on_threads(plan, pipe, config, &common::pattern_batches(plan, 5), &BTreeMap::new(), &|_| {})
        .expect("the pipelined run")
}

fn largest_difference(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut worst = 0f32;
    for (name, x) in a {
        let (x, y) = (x.f32().expect("f32"), b[name].f32().expect("f32"));
        assert_eq!(x.len(), y.len(), "{name}");
        for (u, v) in x.iter().zip(y) {
            worst = worst.max((u - v).abs() / (1.0 + u.abs()));
        }
    }
    worst
}

/// The pipelined run equals the unpipelined one: losses per step, final weights and last gradients.
fn assert_same_run(what: &str, want: &RunOutput, got: &RunOutput, tolerance: f32) {
    assert_eq!(want.steps.len(), got.steps.len(), "{what}");
    for (a, b) in want.steps.iter().zip(&got.steps) {
        let (x, y) = (a.loss.expect("a loss"), b.loss.expect("a loss"));
        assert!((x - y).abs() <= tolerance * (1.0 + x.abs()), "{what}: step {} loss {x} vs {y}", a.step);
        let (n, m) = (a.grad_norm.expect("a norm"), b.grad_norm.expect("a norm"));
        assert!((n - m).abs() <= 1e-5 * (1.0 + n), "{what}: step {} gradient norm {n} vs {m}", a.step);
    }
    let params = largest_difference(&want.params, &got.params);
    assert!(params <= tolerance, "{what}: weights differ by {params}");
    let grads = largest_difference(&want.grads, &got.grads);
    assert!(grads <= tolerance, "{what}: gradients differ by {grads}");
}

/// Each stage's measured memory is its program's plan under the schedule: the activations kept and the
/// gradient sums exactly, the storage (the arena, laid out with alignment and gaps) within 10% of the
/// memory plan's peak, the whole within 10%; and the micro-batches in flight are the schedule's formula
/// (1F1B: min(P - s, m) on stage s; GPipe: m).
fn assert_memory_as_planned(what: &str, program: &PipelineProgram, schedule: Schedule, m: u64, got: &PipelineOutput) {
    let planned = program.memory_plan(schedule, m).expect("a memory plan");
    let p = program.stages.len() as u64;
    for (s, (measured, plan)) in got.stages.iter().zip(&planned).enumerate() {
        let what = format!("{what}: stage {s}");
        assert_eq!(measured.peak_kept_bytes, plan.kept_bytes, "{what}: activations kept");
        assert_eq!(measured.peak_in_flight, plan.in_flight, "{what}: in flight");
        assert_eq!(measured.gradient_sum_bytes, plan.gradient_sum_bytes, "{what}: gradient sums");
        assert!(measured.storage_bytes >= plan.storage_bytes, "{what}: the arena holds the plan's peak");
        let ratio = measured.peak_bytes() as f64 / plan.peak_bytes as f64;
        assert!((1.0..=1.1).contains(&ratio), "{what}: measured {measured:?} against {plan:?}");
        match schedule {
            Schedule::OneFOneB => assert_eq!(plan.in_flight, (p - s as u64).min(m), "{what}"),
            Schedule::GPipe => assert_eq!(plan.in_flight, m, "{what}"),
            Schedule::Interleaved { .. } => {}
        }
    }
}

#[test]
fn every_schedule_on_one_device_stages_equals_accumulation() {
    let plan = plan(4, Mesh::new(1, 1), Strategy::None);
    for (stages, schedule, m) in [
        (2, Schedule::GPipe, 3),
        (2, Schedule::OneFOneB, 4),
        (4, Schedule::OneFOneB, 4),
        (4, Schedule::GPipe, 2),
        (2, Schedule::Interleaved { chunks: 2 }, 4),
    ] {
        let config = config(3, m, None);
        let want = unpipelined(&plan, &config);
        let program = cut(&plan, stages, schedule.chunks(), None).expect("a cut");
        let got = pipelined(&plan, &program, schedule, &config);
        let what = format!("{stages} stages {schedule:?} m={m}");
        assert_same_run(&what, &want, &got.run, 2e-6);
        assert_memory_as_planned(&what, &program, schedule, m, &got);
    }
}

/// Llama names its embedding `model.embed_tokens` and its final norm `model.norm`: the norm's backward
/// went with the embedding (they share the name `model`), on the first stage, and every interleaved
/// schedule waited forever for it. Each schedule now equals accumulation.
#[test]
fn llama_pipelines_equal_accumulation_on_every_schedule() {
    let sets =
        ["vocab=97", "context=16", "seq=8", "batch=4", "heads=4", "kv_heads=2", "hidden=16", "ffn=24", "layers=4"];
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let plan = plan_of("examples/llama.opt", &sets, Mesh::new(1, 1), Strategy::None);
    for (stages, schedule, m) in
        [(2, Schedule::Interleaved { chunks: 2 }, 2), (2, Schedule::OneFOneB, 2), (2, Schedule::GPipe, 2)]
    {
        let config = RunConfig { timeout: Duration::from_secs(20), ..config(2, m, None) };
        let want = unpipelined(&plan, &config);
        let program = cut(&plan, stages, schedule.chunks(), None).expect("a cut");
        let got = pipelined(&plan, &program, schedule, &config);
        assert_same_run(&format!("llama {stages} stages {schedule:?} m={m}"), &want, &got.run, 2e-6);
    }
}

#[test]
fn stages_of_meshes_with_replicas_equal_accumulation() {
    for (mesh, strategy, stages, schedule) in [
        (Mesh::new(2, 2), Strategy::Optimus, 2, Schedule::OneFOneB),
        (Mesh::new(1, 2), Strategy::Megatron, 2, Schedule::GPipe),
        (Mesh::new(1, 2).with_data(2), Strategy::Megatron, 2, Schedule::OneFOneB),
        (Mesh::new(2, 2).with_data(2), Strategy::Optimus, 2, Schedule::Interleaved { chunks: 2 }),
        (Mesh::new(1, 1).with_data(2), Strategy::None, 4, Schedule::OneFOneB),
    ] {
        let plan = plan(4, mesh, strategy);
        let config = config(2, 4, Some(0.5));
        let want = unpipelined(&plan, &config);
        let program = cut(&plan, stages, schedule.chunks(), None).expect("a cut");
        let got = pipelined(&plan, &program, schedule, &config);
        let what = format!("{strategy:?} {mesh:?} {stages} stages {schedule:?}");
        assert_same_run(&what, &want, &got.run, 5e-6);
        assert_memory_as_planned(&what, &program, schedule, 4, &got);
    }
}

/// The `{"pipeline": ...}` record of a `run --pipeline --json`, and the losses of its steps.
fn pipeline_record(args: &[&str]) -> (serde_json::Value, Vec<f64>) {
    let out = optimusc(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let records: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("a JSON record")).collect();
    let losses = records.iter().filter_map(|r| r.get("loss")?.as_f64()).collect();
    let pipeline = records.iter().find_map(|r| r.get("pipeline").cloned()).expect("a pipeline record");
    (pipeline, losses)
}

#[test]
fn the_command_line_runs_pipelines_and_reports_what_each_stage_kept() {
    let base =
        ["run", "examples/tiny.opt", "--set", "layers=4", "--steps", "2", "--accum", "4", "--json", "--seed", "3"];
    let plain = optimusc(&base);
    assert!(plain.status.success());
    let want: Vec<f64> = String::from_utf8_lossy(&plain.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?.get("loss")?.as_f64())
        .collect();
    for (stages, schedule) in [(4u64, "1f1b"), (2, "1f1b"), (4, "gpipe"), (2, "gpipe")] {
        let p = stages.to_string();
        let args: Vec<&str> = base.iter().copied().chain(["--pipeline", &p, "--pipeline-schedule", schedule]).collect();
        let (record, losses) = pipeline_record(&args);
        assert_eq!(losses.len(), want.len());
        for (a, b) in want.iter().zip(&losses) {
            assert!((a - b).abs() <= 1e-6 * a.abs(), "{stages} {schedule}: loss {b} vs {a}");
        }
        let per_stage = record["stages"].as_array().expect("stages");
        assert_eq!(per_stage.len() as u64, stages);
        // 1F1B keeps P - s micro-batches in flight on stage s (at most m = 4); GPipe all m everywhere.
        for (s, stage) in per_stage.iter().enumerate() {
            let in_flight = stage["peak_in_flight"].as_u64().expect("a count");
            let expected = if schedule == "gpipe" { 4 } else { (stages - s as u64).min(4) };
            assert_eq!(in_flight, expected, "{stages} {schedule} stage {s}");
            assert!(stage["peak_kept_bytes"].as_u64().expect("bytes") > 0);
        }
    }
}

#[test]
fn pipeline_flags_that_do_not_fit_are_usage_errors() {
    let run = ["run", "examples/tiny.opt", "--steps", "1"];
    for (extra, says) in [
        (&["--pipeline", "3"][..], "need at least 3 repeated layers"),
        (&["--pipeline", "2", "--pipeline-schedule", "interleaved", "--accum", "3"][..], "multiple"),
        (&["--pipeline", "2", "--virtual-stages", "2"][..], "interleaved"),
        (&["--pipeline", "2", "--pipeline-split", "1,2"][..], "2 layers in all"),
        (&["--pipeline", "2", "--pipeline-split", "2"][..], "gives 1 runs"),
        (&["--pipeline", "2", "--pipeline-split", "2,0"][..], "gives virtual stage 1 no layers"),
        // Counts whose sum passes 2^64 are too many, not wrapped around to a small sum.
        (&["--pipeline", "2", "--pipeline-split", "18446744073709551615,3"][..], "gives more than 2^64"),
        (&["--pipeline", "2", "--pipeline-hardware", "nope"][..], "unknown hardware `nope`"),
        (&["--pipeline", "2", "--mode", "infer"][..], "training plan"),
    ] {
        let args: Vec<&str> = run.iter().chain(extra).copied().collect();
        let out = optimusc(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains(says), "{extra:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{extra:?}: {stderr}");
    }
    let out = optimusc(&["run", "examples/tiny.opt", "--pipeline-schedule", "gpipe"]);
    assert_eq!(out.status.code(), Some(2), "--pipeline-schedule needs --pipeline");
}

#[test]
fn a_given_split_is_the_stages_layers_and_computes_the_same() {
    let plan = plan(4, Mesh::new(1, 2), Strategy::Megatron);
    let config = config(2, 2, None);
    let want = unpipelined(&plan, &config);
    let split = optimus::plan::stages::ranges_of_starts(&[0, 3], 4);
    let program = cut(&plan, 2, 1, Some(&split)).expect("a cut");
    assert_eq!(program.describe_stage(0), "embedding + h.0..2");
    assert_eq!(program.describe_stage(1), "h.3 + head");
    let got = pipelined(&plan, &program, Schedule::OneFOneB, &config);
    assert_same_run("megatron 1x2, layers 3 + 1", &want, &got.run, 5e-6);
    let out = optimusc(&[
        "run",
        "examples/tiny.opt",
        "--set",
        "layers=4",
        "--steps",
        "1",
        "--accum",
        "2",
        "--pipeline",
        "2",
        "--pipeline-split",
        "1,3",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("pipeline stage 0 (embedding + h.0)") && stderr.contains("stage 1 (h.1..3 + head)"),
        "{stderr}"
    );
}

#[test]
fn a_loss_that_is_not_finite_stops_every_stage_before_any_update() {
    let out = optimusc(&[&common::NAN_LOSS_PIPELINE[..], &["--timeout", "30"]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("step 1: the loss is NaN, so the run stops before updating any weight"), "{stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("timed out"), "{stderr}");
}

/// A pipeline is refused before it allocates when its largest stage, with the activations its schedule
/// keeps (GPipe: every micro-batch's), would not fit this machine, though the whole plan's one
/// micro-batch peak does (the check used to take that peak for every stage device).
#[test]
fn a_pipeline_whose_kept_activations_do_not_fit_is_refused_before_it_runs() {
    let args = ["run", "examples/gpt2.opt", "--pipeline", "2", "--pipeline-schedule", "gpipe", "--accum", "512"];
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args([&args[..], &["--steps", "1"]].concat())
        .env_remove("OPTIMUS_SKIP_MEMORY_CHECK")
        .output()
        .expect("optimusc runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("TiB") && stderr.contains("OPTIMUS_SKIP_MEMORY_CHECK=1"), "{stderr}");
    // The whole plan's peak for both stage devices would have passed: the refusal is the stages' own.
    let whole = plan_of_gpt2();
    let per_device = optimus::runtime::limits::peak_bytes_per_device(&whole);
    assert!(per_device * 2 < 64 << 30, "the one-micro-batch peak is {per_device} bytes");
}

/// examples/gpt2.opt as `run` compiles it by default (1x1, training).
fn plan_of_gpt2() -> Plan {
    let file = "examples/gpt2.opt";
    let source = std::fs::read_to_string(file).expect("example exists");
    let model = check_source(&source, &[]).model.expect("example checks");
    let target = Target::plain(Mesh::new(1, 1), Strategy::Optimus, Mode::Train);
    compile(&model, file, &source, target).unwrap_or_else(|_| panic!("gpt2.opt compiles"))
}

/// The layers of each stage that `run --pipeline` reported on standard error, stage by stage.
fn stage_layers(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("pipeline stage "))
        .filter_map(|l| Some(l.split_once(" (")?.1.split_once("): ")?.0.to_string()))
        .collect()
}

#[test]
fn without_a_split_the_stages_are_balanced_by_the_cost_model_as_simulate_cuts_them() {
    // A vocabulary of 16384 on hidden 128: the head costs about three layers, so of 6 layers the
    // last of 2 stages gets fewer, on the built-in rough CPU as on a profile simulate also reads.
    let model = ["examples/gpt2.opt", "--set", "layers=6", "--set", "hidden=128", "--set", "heads=4"];
    let sizes = ["--set", "vocab=16384", "--set", "seq=64", "--set", "context=64", "--set", "batch=4"];
    let run = |extra: &[&str]| {
        let args = [&["run"][..], &model, &sizes, &["--steps", "1", "--accum", "2", "--pipeline", "2"], extra].concat();
        let out = optimusc(&args);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{extra:?}: {stderr}");
        stage_layers(&stderr)
    };
    let rough = run(&[]);
    assert_eq!(rough.len(), 2, "{rough:?}");
    assert!(rough[0].starts_with("embedding + h.0..") && rough[1].ends_with(" + head"), "{rough:?}");
    assert!(
        rough[1].starts_with("h.4") || rough[1].starts_with("h.5"),
        "the head's stage has fewer of the 6 layers: {rough:?}"
    );
    // With a profile, the run's stages are exactly the ones `simulate --pipeline` reports on it.
    let on_a100 = run(&["--pipeline-hardware", "dgx-a100"]);
    let sim = optimusc(
        &[&["simulate"][..], &model, &sizes, &["--pipeline", "2", "--hardware", "dgx-a100", "--json"]].concat(),
    );
    assert!(sim.status.success(), "{}", String::from_utf8_lossy(&sim.stderr));
    let value: serde_json::Value = serde_json::from_slice(&sim.stdout).expect("JSON");
    let simulated: Vec<String> = value["per_stage"]
        .as_array()
        .expect("per_stage")
        .iter()
        .map(|s| s["layers"][0].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(on_a100, simulated);
    // A split of the user's and a profile to balance by contradict each other.
    let both = optimusc(
        &[&["run"][..], &model, &["--pipeline", "2", "--pipeline-split", "3,3", "--pipeline-hardware", "dgx-a100"]]
            .concat(),
    );
    assert_eq!(both.status.code(), Some(2), "{}", String::from_utf8_lossy(&both.stderr));
}

/// The `{"profile": ...}` record of an `optimusc run ... --json` (the last line that has one).
fn profile_record(args: &[&str]) -> serde_json::Value {
    let out = optimusc(args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find(|l| l.starts_with("{\"profile\"")).expect("a profile record");
    serde_json::from_str::<serde_json::Value>(line).expect("JSON")["profile"].clone()
}

fn row_count(profile: &serde_json::Value, name: &str) -> Option<u64> {
    profile["rows"].as_array()?.iter().find(|r| r["name"] == name)?["count"].as_u64()
}

#[test]
fn a_profiled_pipeline_times_every_stage_device_and_its_own_work() {
    let model = ["examples/tiny.opt", "--set", "layers=4", "--steps", "3", "--accum", "2", "--json", "--profile"];
    let whole = profile_record(&[&["run"][..], &model, &["--mesh", "1x2", "--strategy", "megatron"]].concat());
    let piped = profile_record(
        &[
            &["run"][..],
            &model,
            &["--mesh", "1x2", "--strategy", "megatron", "--pipeline", "2", "--pipeline-split", "2,2"],
        ]
        .concat(),
    );
    // Every device of both stages, named by stage, and the warm-up step left out as without a pipeline.
    let devices = piped["devices"].as_array().expect("devices");
    let stages: Vec<u64> = devices.iter().filter_map(|d| d["stage"].as_u64()).collect();
    assert_eq!(stages, vec![0, 0, 1, 1], "{devices:?}");
    assert_eq!(piped["steps_profiled"], 2);
    assert_eq!(piped["warm_up_excluded"], true);
    // The peak before the run beside the one after, as without a pipeline.
    assert!(piped["peak_before_run_gflops"].as_f64().is_some_and(|g| g > 0.0), "{piped}");
    // Each product of the model runs on exactly one stage: the stages' products add up to the whole's.
    assert_eq!(row_count(&piped, "MatMul"), row_count(&whole, "MatMul"));
    assert!(row_count(&whole, "MatMul").is_some_and(|n| n > 0));
    // The stages' own work: per device and profiled step, one receive a micro-batch on each stage
    // (activations forward, gradients back), the kept activations out and back once a micro-batch.
    for (name, at_least) in
        [("receive (stage)", 4 * 2), ("send (stage)", 4 * 2), ("kept activations out (host)", 4 * 2 * 2)]
    {
        let count = row_count(&piped, name).unwrap_or(0);
        assert!(count >= at_least, "{name}: {count}");
    }
    assert_eq!(row_count(&piped, "kept activations back (host)"), row_count(&piped, "kept activations out (host)"));
    assert_eq!(row_count(&whole, "receive (stage)"), None);
}

/// The validation losses an `optimusc run ... --json` printed, in order.
fn validation_losses(args: &[&str]) -> Vec<f64> {
    let out = optimusc(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|r| r.get("val_loss")?.as_f64())
        .collect()
}

#[test]
fn a_pipeline_validates_as_the_unpipelined_run_does() {
    // GPT-2 with dropout (off in validation) and the tied head, validated after every second update.
    let model = [
        "run",
        "examples/gpt2.opt",
        "--set",
        "layers=4",
        "--set",
        "hidden=64",
        "--set",
        "heads=4",
        "--set",
        "vocab=333",
        "--set",
        "seq=32",
        "--set",
        "batch=4",
        "--steps",
        "4",
        "--accum",
        "4",
        "--json",
    ];
    for (mesh, strategy, pipeline) in [
        ("1x1", "none", &["--pipeline", "2"][..]),
        (
            "2x2",
            "optimus",
            &["--pipeline", "2", "--pipeline-schedule", "interleaved", "--pipeline-split", "1,1,1,1"][..],
        ),
        ("2x1x2", "megatron", &["--pipeline", "4", "--pipeline-schedule", "gpipe"][..]),
    ] {
        let grid = ["--mesh", mesh, "--strategy", strategy];
        let validated = common::PARAGRAPH_VALIDATED_EVERY_2;
        let want = validation_losses(&[&model[..], &validated, &grid].concat());
        let got = validation_losses(&[&model[..], &validated, &grid, pipeline].concat());
        assert_eq!(want.len(), 2, "{mesh}: {want:?}");
        assert_eq!(got.len(), want.len(), "{mesh} {pipeline:?}: {got:?}");
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{mesh} {pipeline:?}: {got:?} against {want:?}");
        }
    }
}

#[test]
fn inspect_shows_the_stages_memory_and_schedule_that_run_pipeline_runs() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let plan = dir.path().join("plan.json");
    let plan_arg = plan.to_str().expect("a UTF-8 path");
    let sizes = ["--set", "layers=4", "--set", "hidden=64", "--set", "heads=4", "--set", "vocab=4096", "--mesh", "2x2"];
    let compiled = optimusc(&[&["compile", "examples/gpt2.opt"][..], &sizes, &["-o", plan_arg]].concat());
    assert!(compiled.status.success(), "{}", String::from_utf8_lossy(&compiled.stderr));
    for pipeline in [
        &["--pipeline", "2", "--accum", "4"][..],
        &["--pipeline", "2", "--accum", "4", "--pipeline-schedule", "interleaved"],
    ] {
        let inspected = optimusc(&[&["inspect", plan_arg, "--json"][..], pipeline].concat());
        assert!(inspected.status.success(), "{}", String::from_utf8_lossy(&inspected.stderr));
        let view: serde_json::Value = serde_json::from_slice(&inspected.stdout).expect("JSON");
        let ran = optimusc(&[&["run", plan_arg, "--steps", "1", "--json"][..], pipeline].concat());
        assert!(ran.status.success(), "{}", String::from_utf8_lossy(&ran.stderr));
        let stdout = String::from_utf8_lossy(&ran.stdout);
        let record: serde_json::Value = stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|r| r.get("pipeline").is_some())
            .expect("a pipeline record")["pipeline"]
            .clone();
        let shown = view["pipeline"]["stages"].as_array().expect("stages");
        let run_stages = record["stages"].as_array().expect("stages");
        assert_eq!(shown.len(), run_stages.len());
        for (a, b) in shown.iter().zip(run_stages) {
            assert_eq!(a["layers"], b["layers"], "{pipeline:?}");
            assert_eq!(a["memory"], b["planned"], "{pipeline:?}: the stage's memory is the plan run measures against");
        }
        // The drawn schedule: every stage runs each micro-batch's forward and backward once a chunk.
        let passes = view["pipeline"]["simulated"]["passes"].as_array().expect("passes");
        let chunks = if pipeline.contains(&"interleaved") { 2 } else { 1 };
        for stage in passes {
            assert_eq!(stage.as_array().map(Vec::len), Some(4 * 2 * chunks), "{stage:?}");
        }
    }
    let text = optimusc(&["inspect", plan_arg, "--pipeline", "2", "--accum", "4"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("pipeline: 2 stages under 1f1b, 4 micro-batches") && text.contains("  stage   1 |"),
        "{text}"
    );
    let bad = optimusc(&["inspect", plan_arg, "--pipeline", "9", "--accum", "4"]);
    assert_eq!(bad.status.code(), Some(2), "{}", String::from_utf8_lossy(&bad.stderr));
    let inferring = dir.path().join("infer.json");
    let infer_arg = inferring.to_str().expect("a UTF-8 path");
    let compiled =
        optimusc(&[&["compile", "examples/gpt2.opt"][..], &sizes, &["--mode", "infer", "-o", infer_arg]].concat());
    assert!(compiled.status.success(), "{}", String::from_utf8_lossy(&compiled.stderr));
    let refused = optimusc(&["inspect", infer_arg, "--pipeline", "2"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("training plan") && !stderr.contains("panicked"), "{stderr}");
}

/// A batch a pipeline cannot read (a token past the vocabulary, after the first batch, which is checked
/// before step 0) names its step and batch once, with the file and offset.
#[test]
fn a_bad_batch_in_a_pipeline_names_its_step_and_batch_once() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let data = dir.path().join("late.u16");
    // tiny.opt reads 8 x 8 tokens a step: token 100 is in batch 1 only.
    common::tokens_with_a_bad_id(&data, 100);
    let data = data.to_str().expect("utf-8 path");
    let out = optimusc(&["run", "examples/tiny.opt", "--steps", "3", "--pipeline", "2", "--data", data]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.matches("step 1: ").count(), 1, "{stderr}");
    assert!(stderr.contains("step 1: batch 1: ") && stderr.contains("token 5000 at offset 100"), "{stderr}");
}

/// A repeated block applied twice (`h(h(x))`) runs its first layer again after its last: its activations
/// would go from the last stage back to the first, which 1F1B and interleaved schedules waited on until
/// their timeout. The cut refuses it, naming the layers, and the command line exits 2 at once.
#[test]
fn a_block_applied_twice_is_refused_as_a_pipeline() {
    let source = "model twice\nconfig { vocab = 53; seq = 8; batch = 4; layers = 4; hidden = 8 }\n\
        input tokens: i32[batch, seq]\ninput targets: i32[batch, seq]\n\
        block Layer {\n  layer fc = linear(hidden, hidden)\n  forward(x) { return x + gelu(fc(x)) }\n}\n\
        layer wte = embedding(vocab, hidden)\nlayer head = linear(hidden, vocab)\nlayer h = repeat(layers) Layer()\n\
        forward {\n  output loss = cross_entropy(head(h(h(wte(tokens)))), targets)\n}\n";
    let dir = common::scratch("pipeline_run", "twice");
    let path = dir.join("twice.opt");
    std::fs::write(&path, source).expect("the model is written");
    let path = path.to_string_lossy().into_owned();
    for schedule in ["1f1b", "gpipe"] {
        let args = ["run", &path, "--steps", "1", "--accum", "2", "--pipeline", "2", "--pipeline-schedule", schedule];
        let out = common::optimusc(&[&args[..], &["--timeout", "20"]].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{schedule}: {stderr}");
        assert!(stderr.contains("runs the repeated layer `h.0` again after `h.3`"), "{stderr}");
    }
    let plain = common::optimusc(&["run", &path, "--steps", "1", "--accum", "2"]);
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
}
