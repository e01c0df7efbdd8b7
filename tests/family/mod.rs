//! Helpers shared by the tests of the tensor-parallel family (tesseract.rs, three_d.rs): training the
//! small GPT-2 and comparing it with one device, `verify` under a strategy, and compiling the small
//! GPT-2 for a target.

use super::common::{optimusc, read_weights, text};
use optimus::front::check_source;
use optimus::plan::{Mesh, Mode, Plan, Strategy};
use optimus::shard::{Target, compile};
use std::path::Path;

pub use super::common::scratch;

/// Two layers of width 32 (4 heads), a vocabulary of 101 (padded on every sharded mesh), batches of 16
/// sequences of 8 tokens: every mesh of these tests (up to 8 batch splits) divides them.
pub const SMALL: [&str; 16] = [
    "--set",
    "layers=2",
    "--set",
    "hidden=32",
    "--set",
    "heads=4",
    "--set",
    "ffn=64",
    "--set",
    "vocab=101",
    "--set",
    "seq=8",
    "--set",
    "context=16",
    "--set",
    "batch=16",
];

/// Dropout on, AdamW with clipping and two micro-batches, so that every part of the update crosses
/// the mesh; the seed comes with the flags of each run.
const TRAINING: [&str; 8] = ["--set", "pdrop=0.1", "--eps", "0.0001", "--clip-grad-norm", "0.5", "--accum", "2"];

/// The losses of a run and its saved weights.
pub type Training = (Vec<f64>, Vec<(String, Vec<f32>)>);

/// Trains the small GPT-2 for 3 steps with `flags`; returns the losses and the saved weights.
pub fn train(flags: &[&str], dir: &Path, name: &str) -> Training {
    let weights = dir.join(format!("{name}.safetensors"));
    let head = ["run", "examples/gpt2.opt", "--steps", "3", "--json", "--save-weights", text(&weights)];
    let args = [&head[..], &SMALL, &TRAINING, flags].concat();
    let out = optimusc(&args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let losses = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON line"))
        .filter_map(|r| r.get("loss").and_then(serde_json::Value::as_f64))
        .collect();
    (losses, read_weights(&weights))
}

/// Losses and every weight within 1e-4 (relative) of one device's.
pub fn assert_same_training(what: &str, got: &Training, want: &Training) {
    assert_eq!(got.0.len(), want.0.len(), "{what}: steps");
    for (step, (a, b)) in got.0.iter().zip(&want.0).enumerate() {
        assert!((a - b).abs() / b.abs().max(1e-3) <= 1e-4, "{what}: step {step} loss {a} vs one device {b}");
    }
    assert_eq!(got.1.len(), want.1.len(), "{what}: tensors");
    for ((name, a), (other, b)) in got.1.iter().zip(&want.1) {
        assert_eq!((name, a.len()), (other, b.len()), "{what}");
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1e-2)).fold(0.0f32, f32::max);
        assert!(worst <= 1e-4, "{what}: `{name}` differs from one device's by {worst:.2e} (relative)");
    }
}

/// `verify` of `model` on `mesh` under `strategy`, with `sets` (and two key/value heads for Llama)
/// and `extra` flags.
pub fn verifies(strategy: &str, model: &str, mesh: &str, sets: &[&str], extra: &[&str]) {
    let mut args = vec!["verify", model, "--strategy", strategy, "--mesh", mesh];
    args.extend_from_slice(sets);
    if model.contains("llama") {
        args.extend_from_slice(&["--set", "kv_heads=2"]);
    }
    args.extend_from_slice(extra);
    let out = optimusc(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("verified"),
        "{args:?}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The sizes of [`SMALL`] that the formula tests compute with.
pub const LAYERS: u64 = 2;
pub const HIDDEN: u64 = 32;
pub const FFN: u64 = 64;
pub const CONTEXT: u64 = 16;
pub const SEQ: u64 = 8;

/// The small GPT-2 (the sizes above, 4 heads, dropout off) with a vocabulary of `vocab` and `batch`
/// sequences, compiled for training on `mesh` under `strategy`.
pub fn small_gpt2(mesh: Mesh, strategy: Strategy, vocab: u64, batch: u64) -> Plan {
    let source = std::fs::read_to_string("examples/gpt2.opt").expect("reads");
    let sets = [
        ("layers", LAYERS),
        ("hidden", HIDDEN),
        ("heads", 4),
        ("ffn", FFN),
        ("vocab", vocab),
        ("seq", SEQ),
        ("context", CONTEXT),
        ("batch", batch),
    ];
    let mut overrides: Vec<_> =
        sets.iter().map(|(k, v)| optimus::elab::Override { name: (*k).to_string(), value: v.to_string() }).collect();
    overrides.push(optimus::elab::Override { name: "pdrop".into(), value: "0.0".into() });
    let model = check_source(&source, &overrides).model.expect("checks");
    let target = Target::plain(mesh, strategy, Mode::Train);
    compile(&model, "gpt2.opt", &source, target).expect("compiles")
}
