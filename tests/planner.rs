//! `optimusc plan`: the search's best configuration is at least as fast as every configuration it
//! enumerates (checked by compiling and scoring each one on its own), every configuration it returns
//! fits, `-o` writes a plan that `run` accepts, JSON is best first, and bad inputs are clear errors.

mod common;

use optimus::cost::planner::{self, Config, Request};
use optimus::cost::search::Source;
use optimus::cost::{Hardware, Options};
use optimus::plan::{Mode, Precision};
use std::path::PathBuf;
use std::process::Command;

fn example(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples").join(name)
}

fn tiny_text() -> String {
    match std::fs::read_to_string(example("tiny.opt")) {
        Ok(text) => text,
        Err(e) => panic!("cannot read tiny.opt: {e}"),
    }
}

fn dgx() -> Hardware {
    match Hardware::load("dgx-a100") {
        Ok(hw) => hw,
        Err(e) => panic!("{e}"),
    }
}

/// Every configuration of tiny.opt on `devices`, scored on its own with unlimited memory.
fn brute_force(
    source: &Source,
    hw: &Hardware,
    (devices, precisions): (u64, &[Precision]),
    options: Options,
    max_pipeline: u64,
) -> Vec<(Config, f64, u64)> {
    let request = Request {
        source,
        devices,
        hardware: hw,
        capacity: u64::MAX,
        mode: Mode::Train,
        precisions,
        options,
        max_pipeline,
    };
    let all = planner::configurations(devices, 8, Mode::Train, precisions, (2, max_pipeline));
    assert!(!all.is_empty());
    all.iter()
        .filter_map(|c| planner::evaluate(&request, c).ok().map(|s| (*c, s.step_time_s, s.peak_bytes_per_device)))
        .collect()
}

/// The search, with memory tight enough that some configurations do not fit, against brute force, both
/// simulating with `options`.
fn check_against_brute_force(devices: u64, precisions: &[Precision], options: Options, max_pipeline: u64) {
    let text = tiny_text();
    let name = example("tiny.opt").display().to_string();
    let source = Source { name: &name, text: &text, overrides: &[] };
    let hw = dgx();
    let everything = brute_force(&source, &hw, (devices, precisions), options, max_pipeline);
    assert!(everything.len() >= 4, "too few configurations compile: {}", everything.len());
    // The median peak as capacity: about half of the configurations fit.
    let mut peaks: Vec<u64> = everything.iter().map(|e| e.2).collect();
    peaks.sort_unstable();
    let capacity = peaks[peaks.len() / 2];
    let request = Request {
        source: &source,
        devices,
        hardware: &hw,
        capacity,
        mode: Mode::Train,
        precisions,
        options,
        max_pipeline,
    };
    let calls = std::cell::RefCell::new(Vec::new());
    let record = |p: planner::SearchProgress| calls.borrow_mut().push((p.done, p.total, p.next.to_string()));
    let outcome = match planner::plan_with_progress(&request, &record) {
        Ok(o) => o,
        Err(e) => panic!("{}", e.message),
    };
    // Progress: one call before each layout search, counting up, and a last one when all are done.
    let calls = calls.into_inner();
    let total = calls.first().map_or(0, |c| c.1);
    assert!(total > 0 && calls.len() == total + 1, "{calls:?}");
    for (k, (done, of, next)) in calls.iter().enumerate() {
        assert_eq!((*done, *of, next.is_empty()), (k, total, k == total), "{calls:?}");
    }
    let best = &outcome.ranked[0];
    for (config, step, peak) in &everything {
        if *peak <= capacity {
            assert!(
                best.step_time_s <= step * (1.0 + 1e-12),
                "{devices} devices: {} ({} s) beats the plan's best {} ({} s)",
                config.label(),
                step,
                best.config.label(),
                best.step_time_s
            );
        }
    }
    for s in &outcome.ranked {
        assert!(s.peak_bytes_per_device <= capacity, "{} does not fit", s.config.label());
        // Its figures are those of the configuration scored on its own.
        let alone = everything.iter().find(|e| e.0 == s.config).map(|e| (e.1, e.2));
        assert_eq!(alone, Some((s.step_time_s, s.peak_bytes_per_device)), "{}", s.config.label());
        assert_eq!(s.config.parallelism.data * s.config.micro_batch * s.config.accumulation, 8);
        assert_eq!(s.config.parallelism.devices(), devices);
        assert_eq!(s.placement.ends_with("(auto)"), options.auto_placement, "{}", s.placement);
    }
    for pair in outcome.ranked.windows(2) {
        assert!(pair[0].step_time_s <= pair[1].step_time_s);
    }
    let c = &outcome.counts;
    assert_eq!(
        c.illegal + c.too_large + c.dominated_recompute + c.dominated_micro_batch + c.bounded + c.scored,
        c.enumerated,
        "{c:?}"
    );
    assert_eq!(c.scored, outcome.ranked.len() as u64);
    assert!(c.too_large > 0, "the capacity should leave some configurations out: {c:?}");
    assert!(c.compiled < everything.len() as u64, "the search compiled everything: {c:?}");
}

#[test]
fn the_best_is_at_least_as_fast_as_every_configuration_on_4_devices() {
    check_against_brute_force(4, &[Precision::F32], Options::default(), 1);
}

/// With pipelines of tiny.opt's 2 layers: 2-stage layouts beside the rest, the best still at least as
/// fast as each of them.
#[test]
fn the_best_with_pipelines_is_at_least_as_fast_as_every_configuration() {
    for devices in [4, 16] {
        check_against_brute_force(devices, &[Precision::F32], Options::default(), 2);
    }
}

#[test]
fn the_best_is_at_least_as_fast_as_every_configuration_on_16_devices_in_either_precision() {
    check_against_brute_force(16, &[Precision::Bf16, Precision::F32], Options::default(), 1);
}

/// As `optimusc plan` searches: every configuration at its faster placement (16 devices span two
/// 8-GPU nodes), the best still at least as fast as each of them.
#[test]
fn the_best_is_at_least_as_fast_as_every_configuration_at_its_faster_placement() {
    check_against_brute_force(16, &[Precision::F32], Options { auto_placement: true, ..Options::default() }, 1);
}

fn optimusc(args: &[&str]) -> (i32, String, String) {
    match Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output() {
        Ok(o) => (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        ),
        Err(e) => panic!("cannot run optimusc: {e}"),
    }
}

#[test]
fn json_lists_fitting_configurations_best_first() {
    let tiny = example("tiny.opt");
    let (code, out, err) = optimusc(&[
        "plan",
        &tiny.to_string_lossy(),
        "--devices",
        "8",
        "--hardware",
        "dgx-a100",
        "--json",
        "--top",
        "50",
    ]);
    assert_eq!(code, 0, "{err}");
    let value: serde_json::Value = match serde_json::from_str(&out) {
        Ok(v) => v,
        Err(e) => panic!("not JSON ({e}): {out}"),
    };
    let configs = value["configurations"].as_array().cloned().unwrap_or_default();
    assert!(!configs.is_empty());
    let capacity = value["capacity_bytes"].as_u64().unwrap_or(0);
    let steps: Vec<f64> = configs.iter().map(|c| c["step_time_s"].as_f64().unwrap_or(f64::NAN)).collect();
    assert!(steps.windows(2).all(|w| w[0] <= w[1]), "{steps:?}");
    for c in &configs {
        assert!(c["peak_bytes_per_device"].as_u64().unwrap_or(u64::MAX) <= capacity);
        let product =
            ["data", "micro_batch", "accumulation"].iter().map(|k| c[k].as_u64().unwrap_or(0)).product::<u64>();
        assert_eq!(product, 8, "{c}");
    }
    assert!(value["counts"]["enumerated"].as_u64().unwrap_or(0) >= configs.len() as u64);
}

#[test]
fn o_writes_a_data_parallel_plan_that_run_accepts() {
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("{e}"),
    };
    let out = dir.path().join("plan.json");
    let tiny = example("tiny.opt");
    let (code, text, err) = optimusc(&[
        "plan",
        &tiny.to_string_lossy(),
        "--devices",
        "16",
        "--hardware",
        "dgx-a100",
        "-o",
        &out.to_string_lossy(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(text.contains("best:") && text.contains("why:"), "{text}");
    // The hint says how to run it (with --accum when the winner accumulates).
    let hint = text.lines().find(|l| l.starts_with("wrote ")).unwrap_or_default().to_string();
    let accum = hint.split("--accum ").nth(1).and_then(|t| t.split('`').next()).unwrap_or("1").to_string();
    let (code, _, err) = optimusc(&["run", &out.to_string_lossy(), "--steps", "1", "--accum", &accum]);
    assert_eq!(code, 0, "run refused the plan ({hint}): {err}");
    // The written plan is the winner's: its replicas, tensor mesh, ZeRO stage and micro step's batch.
    let (code, listing, err) =
        optimusc(&["plan", &tiny.to_string_lossy(), "--devices", "16", "--hardware", "dgx-a100", "--json"]);
    assert_eq!(code, 0, "{err}");
    let listing: serde_json::Value = serde_json::from_str(&listing).unwrap_or_default();
    let best = &listing["configurations"][0];
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap_or_default()).unwrap_or_default();
    let mesh = &plan["mesh"];
    let data = mesh["data"].as_u64().unwrap_or(1);
    assert!(data > 1, "on 16 devices the winner replicates its mesh ({best}), so the plan has a data axis");
    assert_eq!(Some(data), best["data"].as_u64(), "{mesh} against {best}");
    assert_eq!(format!("{}x{}", mesh["rows"], mesh["cols"]), best["mesh"].as_str().unwrap_or_default());
    assert_eq!(plan["zero"].as_u64().unwrap_or(0), best["zero"].as_u64().unwrap_or(9));
    let batch = plan["config"].as_array().and_then(|c| c.iter().find(|kv| kv[0] == "batch")).map(|kv| kv[1].clone());
    let micro = best["micro_batch"].as_u64().unwrap_or(0);
    assert_eq!(batch.and_then(|b| b["Int"].as_u64().or(b.as_u64())), Some(data * micro), "{}", plan["config"]);
}

/// GPT-3's example keeps a batch of 8: 1,024 devices cannot split it, and the error says that the model's
/// `batch` is the global batch and how to give the real run's.
#[test]
fn a_batch_too_small_for_the_devices_says_batch_is_the_global_batch() {
    let gpt3 = example("gpt3.opt").display().to_string();
    let (code, _, err) = optimusc(&["plan", &gpt3, "--devices", "1024", "--hardware", "dgx-a100"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no configuration of 1024 devices compiles and fits"), "{err}");
    assert!(err.contains("help: the model's `batch` (8 sequences) is the global batch"), "{err}");
    assert!(err.contains("`--set batch=N`"), "{err}");
}

#[test]
fn bad_inputs_are_clear_errors() {
    let tiny = example("tiny.opt");
    let tiny = tiny.to_string_lossy();
    for devices in ["0", "99999999999", "-1", "x"] {
        let (code, _, err) = optimusc(&["plan", &tiny, "--devices", devices, "--hardware", "dgx-a100"]);
        assert_eq!(code, 2, "--devices {devices}: {err}");
        assert!(err.contains("--devices"), "{err}");
    }
    // 7 devices: the batch (8) does not split over 7 replicas, and 8 heads do not split 7 ways.
    let (code, _, err) = optimusc(&["plan", &tiny, "--devices", "7", "--hardware", "dgx-a100"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no configuration") && err.contains("does not split"), "{err}");
    assert!(err.contains("cannot be split 7 ways"), "the compile error of megatron 1x7 is listed: {err}");
    // Nothing fits in 1 KB: the closest candidates say how much they need.
    let (code, _, err) = optimusc(&["plan", &tiny, "--devices", "4", "--hardware", "dgx-a100", "--memory", "1KB"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no configuration") && err.contains("per device, more than"), "{err}");
    let (code, _, err) = optimusc(&["plan", &tiny, "--devices", "4", "--hardware", "nowhere"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = optimusc(&["plan", &tiny, "--devices", "4", "--hardware", "dgx-a100", "--set", "batch=0"]);
    assert_ne!(code, 0);
    assert_ne!(code, 101, "{err}");
}

#[test]
fn giant_sizes_are_diagnostics_not_crashes() {
    let gpt2 = example("gpt2.opt");
    let gpt2 = gpt2.to_string_lossy();
    for set in ["hidden=9223372036854775800", "context=4611686018427387904", "batch=1099511627776", "seq=4294967296"] {
        let (code, _, err) = optimusc(&["plan", &gpt2, "--devices", "4", "--hardware", "dgx-a100", "--set", set]);
        assert_eq!(code, 1, "--set {set}: {err}");
        assert!(err.contains("error[E"), "--set {set}: {err}");
    }
}

/// `--max-pipeline`: pipelined layouts ranked beside the rest (each on all the devices); with -o, a
/// pipelined winner's stage-grid plan is written and the hint runs it as that pipeline.
#[test]
fn max_pipeline_ranks_pipelines_and_o_writes_a_plan_the_hint_runs_as_the_pipeline() {
    let tiny = example("tiny.opt");
    let tiny = tiny.to_string_lossy();
    let base = ["plan", &tiny, "--devices", "8", "--hardware", "dgx-a100", "--top", "1000"];
    let (code, out, err) = optimusc(&[&base[..], &["--max-pipeline", "2", "--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let listing: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    let configs = listing["configurations"].as_array().cloned().unwrap_or_default();
    let piped: Vec<&serde_json::Value> = configs.iter().filter(|c| c["pipeline"] == 2).collect();
    assert!(!piped.is_empty(), "no 2-stage pipeline ranked: {out}");
    for c in &configs {
        let mesh: u64 = c["mesh"].as_str().unwrap_or("0").split('x').filter_map(|n| n.parse::<u64>().ok()).product();
        let devices = mesh * c["data"].as_u64().unwrap_or(0) * c["pipeline"].as_u64().unwrap_or(0);
        assert_eq!(devices, 8, "{c}");
    }
    for c in &piped {
        let bubble = c["bubble_fraction"].as_f64().unwrap_or(-1.0);
        assert!((0.0..1.0).contains(&bubble), "{c}");
    }
    let (code, out, err) = optimusc(&[&base[..], &["--max-pipeline", "1", "--json"]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("\"pipeline\":2"), "--max-pipeline 1 searches no pipelines");
    // Inference is not searched as a pipeline: the flag is refused, not ignored.
    let (code, _, err) = optimusc(&[&base[..], &["--max-pipeline", "2", "--mode", "infer"]].concat());
    assert!(code == 2 && err.contains("--max-pipeline searches pipelines of training steps"), "{err}");
    // Four layers on two devices: a 2-stage pipeline of 1x1 grids wins on dgx-a100.
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let plan = dir.path().join("plan.json");
    let plan_text = plan.to_string_lossy().into_owned();
    let args = ["plan", &tiny, "--devices", "2", "--hardware", "dgx-a100", "--set", "layers=4", "--max-pipeline", "2"];
    let (code, out, err) = optimusc(&[&args[..], &["-o", &plan_text]].concat());
    assert_eq!(code, 0, "{err}");
    let text = format!("{out}{err}");
    assert!(text.contains("best: none 1x1 DP 1 PP 2"), "{text}");
    let hint = text.split("run it with `optimusc ").nth(1).and_then(|rest| rest.split('`').next()).expect("a hint");
    assert!(hint.contains("--pipeline 2 --pipeline-schedule 1f1b --pipeline-hardware dgx-a100"), "{hint}");
    let mut words: Vec<&str> = hint.split_whitespace().collect();
    words.extend(["--steps", "1"]);
    let (code, _, err) = optimusc(&words);
    assert_eq!(code, 0, "the hint runs: {hint}: {err}");
    assert!(err.contains("pipeline stage 1 (h.2..3 + head)"), "{err}");
    // The search estimates a stage's memory from the whole plan's pieces, below what the stage programs
    // plan for themselves: the warning says so, and the inspect it names shows the same figure.
    let warning = text.lines().find(|l| l.starts_with("warning: the stage programs of")).expect("a warning");
    let most = warning.split("plan up to ").nth(1).and_then(|r| r.split(" a device").next()).expect("a figure");
    let inspect = warning.split("(`optimusc ").nth(1).and_then(|r| r.split('`').next()).expect("a command");
    let (code, out, err) = optimusc(&inspect.split_whitespace().collect::<Vec<_>>());
    assert_eq!(code, 0, "{inspect}: {err}");
    assert!(out.contains(&format!(": {most} a device at most")), "{most} in {out}");
}

/// On a profile of our CPU runtime the search fits a pipeline by its stage programs' own memory, the
/// figure `run --pipeline` holds: the winner's peak is the one `inspect --pipeline` gives for the hint's
/// split, `plan -o` has nothing to warn of, and a `--memory` just under that figure leaves the
/// configuration out.
#[test]
fn on_a_cpu_profile_a_pipelines_memory_is_its_stage_programs() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let profile = dir.path().join("cpu.toml");
    std::fs::write(&profile, common::SHARED_CPU).unwrap_or_else(|e| panic!("{e}"));
    let (tiny, profile) = (example("tiny.opt"), profile.to_string_lossy().into_owned());
    let tiny = tiny.to_string_lossy();
    let plan = dir.path().join("plan.json").to_string_lossy().into_owned();
    let base = ["plan", &tiny, "--devices", "2", "--hardware", &profile, "--set", "layers=4", "--max-pipeline", "2"];
    let (code, out, err) = optimusc(&[&base[..], &["--json", "--top", "1000"]].concat());
    assert_eq!(code, 0, "{err}");
    let listing: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    let configs = listing["configurations"].as_array().cloned().unwrap_or_default();
    let winner = configs.first().cloned().unwrap_or_default();
    assert_eq!((winner["pipeline"].as_u64(), winner["micro_batch"].as_u64()), (Some(2), Some(8)), "{winner}");
    let peak = winner["peak_bytes_per_device"].as_u64().unwrap_or(0);
    let (code, out, err) = optimusc(&[&base[..], &["-o", &plan]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(!format!("{out}{err}").contains("warning: the stage programs of"), "{out}{err}");
    let inspect = ["inspect", &plan, "--pipeline", "2", "--accum", "1", "--pipeline-hardware", &profile, "--json"];
    let (code, out, err) = optimusc(&inspect);
    assert_eq!(code, 0, "{err}");
    let view: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    let stages = view["pipeline"]["stages"].as_array().cloned().unwrap_or_default();
    let most = stages.iter().filter_map(|s| s["memory"]["peak_bytes"].as_u64()).max();
    assert_eq!(most, Some(peak), "{out}");
    let tight = format!("{}B", peak - 1);
    let (code, out, err) = optimusc(&[&base[..], &["--json", "--top", "1000", "--memory", &tight]].concat());
    assert_eq!(code, 0, "{err}");
    let listing: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    let configs = listing["configurations"].as_array().cloned().unwrap_or_default();
    let same = |c: &&serde_json::Value| {
        ["strategy", "mesh", "data", "pipeline", "micro_batch", "recompute"].iter().all(|k| c[k] == winner[k])
    };
    assert!(!configs.iter().any(|c| same(&c)), "{winner} ranked under {tight}: {out}");
    assert!(configs.iter().all(|c| c["peak_bytes_per_device"].as_u64() < Some(peak)), "{out}");
}

/// On a calibrated CPU profile every pipelined configuration the search scores is what `simulate
/// --pipeline` gives its stage grid's plan: the same split (the pieces costed for every stage's devices
/// on the shared engine, which depends on the depth), step and memory. The search once balanced the
/// stages its own way and fitted a pipeline by stages `simulate` and `run` would cut otherwise.
#[test]
fn on_a_cpu_profile_every_pipeline_scores_what_simulate_gives() {
    let hw = Hardware::parse(common::SHARED_CPU, "cpu").unwrap_or_else(|e| panic!("{e}"));
    let text = tiny_text();
    let overrides: Vec<_> =
        ["layers=4", "vocab=4001"].iter().map(|s| s.parse().unwrap_or_else(|e| panic!("{e:?}"))).collect();
    let source = Source { name: "tiny.opt", text: &text, overrides: &overrides };
    let options = Options { auto_placement: true, ..Options::default() };
    let request = Request {
        source: &source,
        devices: 4,
        hardware: &hw,
        capacity: u64::MAX,
        mode: Mode::Train,
        precisions: &[Precision::F32],
        options,
        max_pipeline: 2,
    };
    let mut seen = 0;
    for config in planner::configurations(4, 8, Mode::Train, &[Precision::F32], (4, 2)) {
        let p = config.parallelism;
        if p.pipeline < 2 {
            continue;
        }
        let Ok(scored) = planner::evaluate(&request, &config) else { continue };
        let plan = planner::compile_candidate(&source, &config, Mode::Train).unwrap_or_else(|e| panic!("{e}"));
        let pipeline = optimus::cost::staged::Pipeline {
            stages: p.pipeline,
            schedule: p.schedule(),
            micro_batches: config.accumulation,
        };
        let simulated = optimus::cost::staged::simulate_pipeline(&plan, &hw, &options, pipeline)
            .unwrap_or_else(|e| panic!("{}: {e}", config.label()));
        assert_eq!(scored.peak_bytes_per_device, simulated.peak_bytes_per_device, "{}", config.label());
        let close = (scored.step_time_s - simulated.step_time_s).abs() <= 1e-9 * simulated.step_time_s;
        assert!(close, "{}: {} against {}", config.label(), scored.step_time_s, simulated.step_time_s);
        seen += 1;
    }
    assert!(seen >= 4, "only {seen} pipelined configurations scored");
}

/// The ranking table keeps its columns whatever their width: a data-parallel degree of 16384 lines up
/// under its header (the table once gave that column a fixed width of 4).
#[test]
fn the_table_aligns_wide_values_under_their_headers() {
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args([
            "plan",
            "examples/tiny.opt",
            "--devices",
            "16384",
            "--hardware",
            "dgx-a100",
            "--set",
            "batch=16384",
            "--top",
            "40",
        ])
        .output()
        .expect("optimusc runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    let header = text.lines().find(|l| l.starts_with("rank")).expect("a table header");
    // Right-aligned columns end where their header ends.
    let end_of = |word: &str| header.find(word).map(|at| at + word.len());
    let rows: Vec<&str> =
        text.lines().skip_while(|l| !l.starts_with("rank")).skip(1).take_while(|l| !l.trim().is_empty()).collect();
    assert!(rows.len() >= 3, "{text}");
    assert!(rows.iter().any(|r| r.contains(" 16384 ")), "a degree of 16384 is shown: {text}");
    for word in ["DP", "tokens/s", "peak/device"] {
        for row in &rows {
            let end = end_of(word).expect("a header");
            let before = row[..end].chars().last();
            let after = row[end..].chars().next();
            assert!(before.is_some_and(|c| !c.is_whitespace()), "{word} ends at {end} in {row:?}\n{header}");
            assert!(after.is_none_or(char::is_whitespace), "{word} ends at {end} in {row:?}\n{header}");
        }
    }
}
