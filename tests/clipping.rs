//! `run --clip-grad-norm` end to end: the global gradient norm in every record agrees across meshes and
//! strategies (each replicated shard counted once), and clipping bounds the update: with plain SGD
//! (no momentum, no weight decay) one update moves the weights by exactly lr * min(norm, X) in L2.

mod common;

use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

fn scratch(name: &str) -> PathBuf {
    let dir = common::process_dir("clipping");
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

/// The JSON records of a run on `mesh` (e.g. ["--mesh", "2x2"]), after checking it succeeded.
fn records(mesh: &[&str], extra: &[&str]) -> Vec<serde_json::Value> {
    let mut args = vec!["run", "examples/tiny.opt", "--steps", "3", "--json", "--seed", "7"];
    args.extend_from_slice(mesh);
    args.extend_from_slice(extra);
    let out = optimusc(&args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("JSON line")).collect()
}

fn grad_norms(records: &[serde_json::Value]) -> Vec<f64> {
    records.iter().map(|r| r["grad_norm"].as_f64().expect("every train record has grad_norm")).collect()
}

const MESHES: [&[&str]; 4] = [
    &["--mesh", "1x1", "--strategy", "none"],
    &["--mesh", "2x2"],
    &["--mesh", "4x4"],
    &["--mesh", "1x4", "--strategy", "megatron"],
];

#[test]
fn the_gradient_norm_is_the_same_on_every_mesh() {
    let reference = grad_norms(&records(MESHES[0], &[]));
    assert!(reference.iter().all(|n| n.is_finite() && *n > 0.0), "{reference:?}");
    for mesh in &MESHES[1..] {
        let norms = grad_norms(&records(mesh, &[]));
        for (a, b) in norms.iter().zip(&reference) {
            assert!((a - b).abs() <= 1e-5 * b, "{mesh:?}: {norms:?} vs {reference:?}");
        }
    }
}

/// The parameters of a safetensors file, flattened in key order.
fn weights(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).expect("saved weights");
    let file = SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut names: Vec<String> = file.names().into_iter().map(String::from).collect();
    names.sort();
    names
        .iter()
        .flat_map(|n| {
            let view = file.tensor(n).expect("tensor");
            view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn one_clipped_sgd_update_moves_the_weights_by_the_clip_norm() {
    for (k, mesh) in MESHES.iter().enumerate() {
        let (before, after) = (scratch(&format!("before{k}.safetensors")), scratch(&format!("after{k}.safetensors")));
        let sgd = ["--optimizer", "sgd", "--momentum", "0", "--weight-decay", "0", "--steps", "1"];
        let mut args: Vec<&str> = vec!["run", "examples/tiny.opt", "--seed", "3", "--json"];
        args.extend_from_slice(mesh);
        args.extend_from_slice(&sgd);
        let run = |lr: &str, out: &Path, clip: Option<&str>| {
            let mut a = args.clone();
            a.extend_from_slice(&["--lr", lr, "--save-weights", out.to_str().expect("utf-8 path")]);
            if let Some(clip) = clip {
                a.extend_from_slice(&["--clip-grad-norm", clip]);
            }
            let o = optimusc(&a);
            assert!(o.status.success(), "{a:?}: {}", String::from_utf8_lossy(&o.stderr));
            let line = String::from_utf8_lossy(&o.stdout).lines().next().map(str::to_string).unwrap_or_default();
            let record: serde_json::Value = serde_json::from_str(&line).expect("a record");
            record["grad_norm"].as_f64().expect("grad_norm")
        };
        let norm = run("0", &before, None);
        let clip = norm / 4.0;
        let clipped = run("1", &after, Some(&format!("{clip}")));
        assert!((clipped - norm).abs() <= 1e-6 * norm, "the record holds the norm before clipping");
        let moved: f64 =
            weights(&after).iter().zip(weights(&before)).map(|(a, b)| f64::from(a - b).powi(2)).sum::<f64>().sqrt();
        assert!((moved - clip).abs() <= 1e-4 * clip, "{mesh:?}: moved {moved}, clip {clip}, norm {norm}");
        // A clip above the norm changes nothing: the step moves by the whole norm.
        let unclipped = run("1", &after, Some(&format!("{}", norm * 2.0)));
        let moved: f64 =
            weights(&after).iter().zip(weights(&before)).map(|(a, b)| f64::from(a - b).powi(2)).sum::<f64>().sqrt();
        assert!((moved - unclipped).abs() <= 1e-4 * unclipped, "{mesh:?}: moved {moved}, norm {unclipped}");
    }
}

#[test]
fn clip_grad_norm_must_be_positive_and_finite() {
    for bad in ["0", "-1", "nan", "inf", "x"] {
        let flag = format!("--clip-grad-norm={bad}");
        let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1", &flag]);
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("--clip-grad-norm"), "{bad}");
    }
}

#[test]
fn clipping_needs_a_training_plan_that_computes_the_norm() {
    let out = optimusc(&["run", "examples/tiny.opt", "--mode", "infer", "--steps", "1", "--clip-grad-norm", "1"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--clip-grad-norm sets up training, and this plan infers"));
    // A plan written before the norm was part of the plan has no `grad_norm` buffer.
    let plan = scratch("plan.json");
    let compiled = optimusc(&["compile", "examples/tiny.opt", "--mesh", "2x2", "-o", plan.to_str().expect("utf-8")]);
    assert!(compiled.status.success(), "{}", String::from_utf8_lossy(&compiled.stderr));
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan).expect("plan")).expect("JSON");
    json.as_object_mut().expect("an object").remove("grad_norm").expect("train plans name the norm's buffer");
    let old = scratch("old-plan.json");
    std::fs::write(&old, json.to_string()).expect("write");
    let out = optimusc(&["run", old.to_str().expect("utf-8"), "--steps", "1", "--clip-grad-norm", "1"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("compile it again"));
}
