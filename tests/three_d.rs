//! 3D tensor parallelism (`--strategy 3d --mesh QxQxQ`, `RxQxQxQ` with replicas) end to end: training
//! on 2x2x2 (with replicas and ZeRO-1 too) gives one device's losses and final weights; GPT-2, BERT
//! and Llama verify there and on 3x3x3 (with recompute and bf16); the products' reduce-scatters and
//! the parameters per device equal closed formulas; meshes that are not cubes are clear errors.

mod common;

use common::{optimusc, read_weights, text};
use optimus::front::check_source;
use optimus::plan::{CollectiveKind, Group, Instr, MemoryOptions, Mesh, Mode, Plan, ReasonKind, Strategy};
use optimus::shard::{Target, compile};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("optimus-3d-{}", std::process::id())).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Two layers of width 32 (4 heads), a vocabulary of 101, batches of 16 sequences of 8 tokens.
const SMALL: [&str; 16] = [
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

/// Dropout on, AdamW with clipping and two micro-batches.
const TRAINING: [&str; 10] =
    ["--set", "pdrop=0.1", "--seed", "3", "--eps", "0.0001", "--clip-grad-norm", "0.5", "--accum", "2"];

type Training = (Vec<f64>, Vec<(String, Vec<f32>)>);

fn train(flags: &[&str], dir: &Path, name: &str) -> Training {
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

#[test]
fn training_on_3d_meshes_equals_one_device_with_the_whole_batch() {
    let dir = scratch("equal");
    let one = train(&["--mesh", "1x1", "--strategy", "none"], &dir, "one");
    for (mesh, zero) in [("2x2x2", "0"), ("2x2x2x2", "0"), ("2x2x2x2", "1")] {
        let what = format!("3d {mesh} zero {zero}");
        let got = train(&["--strategy", "3d", "--mesh", mesh, "--zero", zero], &dir, &what.replace(' ', "-"));
        assert_eq!(got.0.len(), one.0.len(), "{what}: steps");
        for (step, (a, b)) in got.0.iter().zip(&one.0).enumerate() {
            assert!((a - b).abs() / b.abs().max(1e-3) <= 1e-4, "{what}: step {step} loss {a} vs one device {b}");
        }
        for ((name, a), (other, b)) in got.1.iter().zip(&one.1) {
            assert_eq!((name, a.len()), (other, b.len()), "{what}");
            let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1e-2)).fold(0.0f32, f32::max);
            assert!(worst <= 1e-4, "{what}: `{name}` differs from one device's by {worst:.2e} (relative)");
        }
    }
}

fn verifies(model: &str, mesh: &str, sets: &[&str], extra: &[&str]) {
    let mut args = vec!["verify", model, "--strategy", "3d", "--mesh", mesh];
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

#[test]
fn gpt2_bert_and_llama_verify_on_a_cube_with_and_without_replicas() {
    for model in ["examples/gpt2.opt", "examples/bert.opt", "examples/llama.opt"] {
        for mesh in ["2x2x2", "2x2x2x2"] {
            verifies(model, mesh, &SMALL, &[]);
        }
    }
    // A 3x3x3 cube: 27 devices, 3 heads, every width a multiple of 9.
    let cube = [
        "--set",
        "layers=1",
        "--set",
        "hidden=36",
        "--set",
        "heads=3",
        "--set",
        "ffn=72",
        "--set",
        "vocab=101",
        "--set",
        "seq=4",
        "--set",
        "context=9",
        "--set",
        "batch=9",
    ];
    verifies("examples/gpt2.opt", "3x3x3", &cube, &[]);
}

#[test]
fn recompute_bf16_and_zero_1_verify_on_3d() {
    verifies("examples/llama.opt", "2x2x2", &SMALL, &["--recompute", "selective"]);
    verifies("examples/gpt2.opt", "2x2x2x2", &SMALL, &["--recompute", "layers", "--zero", "1"]);
    let bf16 = ["--precision", "bf16", "--recompute", "layers", "--tolerance", "2e-2"];
    verifies("examples/llama.opt", "2x2x2x2", &SMALL, &bf16);
}

const LAYERS: u64 = 2;
const HIDDEN: u64 = 32;
const FFN: u64 = 64;
const CONTEXT: u64 = 16;
const SEQ: u64 = 8;

/// The small GPT-2 (dropout off) on `mesh` with a vocabulary of `vocab` and `batch` sequences.
fn gpt2(mesh: Mesh, vocab: u64, batch: u64) -> Plan {
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
    let target = Target { mesh, strategy: Strategy::ThreeD, mode: Mode::Train, memory: MemoryOptions::DEFAULT };
    compile(&model, "gpt2.opt", &source, target).expect("compiles")
}

/// Elements each device sends per step in the products' reduce-scatters, by group.
fn product_scatters(plan: &Plan) -> BTreeMap<Group, u64> {
    let mut by = BTreeMap::new();
    for instr in &plan.program {
        let Instr::Collective { collective: c, reason, .. } = instr else { continue };
        let reason = &plan.reasons[*reason as usize];
        let product = reason.text.contains("3D") && reason.text.contains("sum the partial products");
        if c.kind == CollectiveKind::ReduceScatter && matches!(reason.kind, ReasonKind::PartialSum { .. }) && product {
            *by.entry(c.group).or_default() += plan.buffer(c.send).elements();
        }
    }
    by
}

#[test]
fn product_traffic_and_parameters_per_device_equal_the_closed_formulas() {
    let (h, f, q, batch) = (HIDDEN, FFN, 2, 16);
    let tokens = batch * SEQ;
    // A vocabulary of 104 divides q^3: the tied table is split over all 8 devices.
    let vocab = 104;
    let plan = gpt2(Mesh::new(q, q).with_depth(q), vocab, batch);
    // Per layer, the linears on L1 (c_attn h -> 3h, c_fc h -> f) sum their outputs over the depth and
    // their input gradients over the columns; those on L2 (c_proj h -> h, the MLP's f -> h) sum their
    // outputs over the columns and their input gradients over the depth. The tied head sums the logits
    // over the depth and its input gradient over the columns. Each partial block has tokens / q rows
    // and 1/q of the features: tokens / q^2 elements per feature.
    let rows = tokens / (q * q);
    let over_columns = LAYERS * (h + h + h + h) + h;
    let over_depth = LAYERS * (3 * h + f + h + f) + vocab;
    let want = BTreeMap::from([(Group::Row, rows * over_columns), (Group::Depth, rows * over_depth)]);
    assert_eq!(product_scatters(&plan), want, "reduce-scatters of the products' partial sums");
    // Matrices are split over all q^3 devices; the position table (whose rows the depth does not
    // split) over q^2; biases and norms over q.
    let matrices = LAYERS * (4 * h * h + 2 * h * f) + vocab * h;
    let vectors = LAYERS * (3 * h + h + f + h + 4 * h) + 2 * h;
    let parameters = matrices / (q * q * q) + CONTEXT * h / (q * q) + vectors / q;
    assert_eq!(plan.memory.parameters, 4 * parameters, "parameter bytes per device");
    assert_eq!(plan.memory.optimizer_state, 8 * parameters, "AdamW's two moments");
}

#[test]
fn meshes_3d_cannot_use_are_clear_errors() {
    let cases: [(&[&str], &str); 3] = [
        (&["--mesh", "2x2x4"], "the 3d strategy needs a q x q x q cube"),
        (&["--mesh", "2x2"], "the 3d strategy needs a q x q x q cube"),
        (&["--mesh", "3x3x3", "--set", "batch=4"], "cannot be split 9 ways"),
    ];
    for (flags, expected) in cases {
        let args = [&["compile", "examples/tiny.opt", "-o", "/dev/null", "--strategy", "3d"][..], flags].concat();
        let out = optimusc(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} must fail");
        assert!(stderr.contains(expected), "{flags:?}: expected `{expected}` in\n{stderr}");
        assert!(!stderr.contains("panicked"), "{flags:?}: {stderr}");
    }
}
