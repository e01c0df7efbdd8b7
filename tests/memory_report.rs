//! The memory report: the peak's breakdown by category adds up to the peak on every kind of plan, and
//! `inspect --memory SIZE` finds the largest batch that fits (the next one does not), which recomputation
//! raises.

mod common;

use optimus::front::check_source;
use optimus::plan::{MemoryOptions, Mesh, Mode, Plan, Recompute, Strategy};
use optimus::shard::{Target, compile};
use std::process::Command;

fn plan(sets: &[(&str, &str)], strategy: Strategy, mesh: (u64, u64), mode: Mode, recompute: Recompute) -> Plan {
    let text = std::fs::read_to_string("examples/gpt2.opt").expect("example");
    let overrides: Vec<_> =
        sets.iter().map(|(k, v)| optimus::elab::Override { name: (*k).to_string(), value: (*v).to_string() }).collect();
    let model = check_source(&text, &overrides).model.expect("checks");
    let memory = MemoryOptions { recompute: Some(recompute), ..MemoryOptions::DEFAULT };
    let target = Target { memory, ..Target::plain(Mesh::new(mesh.0, mesh.1), strategy, mode) };
    compile(&model, "examples/gpt2.opt", &text, target).expect("compiles")
}

const SMALL: [(&str, &str); 4] = [("layers", "2"), ("seq", "128"), ("context", "128"), ("batch", "4")];

#[test]
fn the_peak_breakdown_adds_up_to_the_peak() {
    for (strategy, mesh) in [(Strategy::Optimus, (2, 2)), (Strategy::Megatron, (1, 4)), (Strategy::None, (1, 1))] {
        for mode in [Mode::Train, Mode::Infer] {
            for recompute in [Recompute::None, Recompute::Layers, Recompute::Selective] {
                let p = plan(&SMALL, strategy, mesh, mode, recompute);
                let b = p.memory.at_peak;
                let sum = b.parameters
                    + b.gradients
                    + b.optimizer_state
                    + b.inputs
                    + b.activations
                    + b.communication
                    + b.workspace;
                assert_eq!(sum, p.memory.peak_bytes, "{strategy:?} {mesh:?} {mode:?} {recompute:?}");
                assert_eq!(b.parameters, p.memory.parameters);
                if strategy != Strategy::None {
                    assert!(b.communication > 0 || mode == Mode::Infer || b.workspace > 0);
                }
            }
        }
    }
}

/// `inspect PLAN --memory SIZE --json`'s `max_batch` object.
fn max_batch(plan_path: &str, size: &str) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(["inspect", plan_path, "--memory", size, "--json"])
        .output()
        .expect("optimusc runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    report["max_batch"].clone()
}

#[test]
fn inspect_finds_the_largest_batch_that_fits_and_recompute_raises_it() {
    let dir = common::process_dir("memory-report");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let capacity: u64 = 64 << 20;
    let mut found = Vec::new();
    for recompute in ["none", "layers"] {
        let path = dir.join(format!("{recompute}.json"));
        let path_text = path.to_str().expect("utf-8");
        let mut args: Vec<String> =
            ["compile", "examples/gpt2.opt", "--mesh", "2x2", "--recompute", recompute, "-o", path_text]
                .map(String::from)
                .to_vec();
        for (k, v) in SMALL[..3].iter().chain(&[("hidden", "256"), ("heads", "4"), ("vocab", "2000")]) {
            args.extend(["--set".to_string(), format!("{k}={v}")]);
        }
        let out = Command::new(env!("CARGO_BIN_EXE_optimusc")).args(&args).output().expect("compile runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let fit = max_batch(path_text, "64MiB");
        let batch = fit["max_batch"].as_u64().expect("a batch");
        assert_eq!(fit["memory_bytes"].as_u64(), Some(capacity));
        assert!(batch > 0, "{fit}");
        // The batch found fits; the next multiple does not.
        let sets =
            [("layers", "2"), ("seq", "128"), ("context", "128"), ("hidden", "256"), ("heads", "4"), ("vocab", "2000")];
        let r = if recompute == "none" { Recompute::None } else { Recompute::Layers };
        let at = |b: u64| {
            let b = b.to_string();
            let mut s: Vec<(&str, &str)> = sets.to_vec();
            s.push(("batch", &b));
            plan(&s, Strategy::Optimus, (2, 2), Mode::Train, r).memory.peak_bytes
        };
        let multiple = fit["multiple"].as_u64().expect("multiple");
        assert!(at(batch) <= capacity && at(batch + multiple) > capacity, "{recompute}: {fit}");
        found.push(batch);
    }
    assert!(found[1] > found[0], "recomputation fits a larger batch: {found:?}");
}

#[test]
fn inspect_memory_explains_what_it_cannot_do() {
    let dir = common::process_dir("memory-errors");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let plan = dir.join("plan.json");
    let plan_text = plan.to_str().expect("utf-8");
    let bin = env!("CARGO_BIN_EXE_optimusc");
    let compiled = Command::new(bin).args(["compile", "examples/tiny.opt", "--mesh", "2x2", "-o", plan_text]).output();
    assert!(compiled.expect("compile runs").status.success());
    let bad_size = Command::new(bin).args(["inspect", plan_text, "--memory", "24XB"]).output().expect("runs");
    assert_eq!(bad_size.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_size.stderr).contains("the unit must be"));
    // A plan whose model file is gone cannot be recompiled at other batch sizes.
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan).expect("plan")).expect("JSON");
    json["source"] = serde_json::Value::from("gone/model.opt");
    let moved = dir.join("moved.json");
    std::fs::write(&moved, json.to_string()).expect("write");
    let out =
        Command::new(bin).args(["inspect", moved.to_str().expect("utf-8"), "--memory", "1GiB"]).output().expect("runs");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("gone/model.opt"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A source that is a device is refused, not read until memory runs out.
    json["source"] = serde_json::Value::from("/dev/zero");
    std::fs::write(&moved, json.to_string()).expect("write");
    let out =
        Command::new(bin).args(["inspect", moved.to_str().expect("utf-8"), "--memory", "1GiB"]).output().expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(1) && stderr.contains("not a regular file"), "{stderr}");
}
