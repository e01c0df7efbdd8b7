//! Sharded plans compute what the unsharded model computes: the loss, every parameter's gradient, and
//! the parameters after several optimizer steps, on several optimus and megatron meshes.

use optimus::elab::Override;
use optimus::front::check_source;
use optimus::plan::init::mix64;
use optimus::plan::tensor::Tensor;
use optimus::plan::{Mesh, Mode, Plan, Strategy};
use optimus::runtime::compare::relative_differences;
use optimus::runtime::exec::{RunConfig, RunOutput};
use optimus::runtime::local::run;
use optimus::runtime::settings::{OptimizerKind, OptimizerSettings};
use optimus::shard::{Target, compile};
use std::collections::BTreeMap;
use std::time::Duration;

const TOLERANCE: f64 = 1e-4;

fn sets(pairs: &[(&str, &str)]) -> Vec<Override> {
    pairs.iter().map(|(n, v)| Override { name: n.to_string(), value: v.to_string() }).collect()
}

fn plan(file: &str, overrides: &[Override], mesh: (u64, u64), strategy: Strategy, mode: Mode) -> Plan {
    let source = std::fs::read_to_string(file).expect("example exists");
    let checked = check_source(&source, overrides);
    let model = checked.model.expect("example checks");
    let target = Target::plain(Mesh::new(mesh.0, mesh.1), strategy, mode);
    match compile(&model, file, &source, target) {
        Ok(p) => p,
        Err(d) => panic!("compile failed: {}", optimus::diag::render_plain(file, &source, &d)),
    }
}

fn config_int(plan: &Plan, name: &str) -> u64 {
    let value = plan.config.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    match value {
        Some(optimus::plan::types::Scalar::Int(v)) => v as u64,
        other => panic!("config {name} is {other:?}"),
    }
}

/// Random token ids and targets for step k, a function of the seed alone.
fn batches(plan: &Plan, seed: u64) -> impl Fn(u64) -> Result<BTreeMap<String, Tensor>, String> + Sync {
    let (vocab, batch, seq) = (config_int(plan, "vocab"), config_int(plan, "batch"), config_int(plan, "seq"));
    let mut names: Vec<String> = plan.inputs.iter().map(|i| i.name.clone()).collect();
    names.sort();
    names.dedup();
    move |step| {
        let mut out = BTreeMap::new();
        for (k, name) in names.iter().enumerate() {
            // Token ids and targets range over the vocabulary; other inputs (BERT's segments) over 0..2.
            let range = if name == "tokens" || name == "targets" { vocab } else { 2 };
            let ids = (0..batch * seq)
                .map(|n| (mix64(seed ^ mix64(step * 8 + k as u64) ^ mix64(n)) % range) as i32)
                .collect();
            out.insert(name.clone(), Tensor::from_i32(&[batch, seq], ids));
        }
        Ok(out)
    }
}

/// AdamW's update is lr * m / (sqrt(v) + eps). A gradient that is zero in exact arithmetic (the key
/// bias of attention: softmax ignores a shift shared by all keys) is float noise, which an eps of 1e-8
/// turns into a step of about lr with a random sign, on one device as on many. An eps of 1e-4 keeps
/// every other part of AdamW (moments, bias correction, decoupled decay) and makes the comparison
/// well-conditioned.
fn settings(kind: OptimizerKind) -> OptimizerSettings {
    OptimizerSettings { kind, lr: 1e-2, weight_decay: 0.1, momentum: 0.9, beta1: 0.9, beta2: 0.999, eps: 1e-4 }
}

fn execute(plan: &Plan, steps: u64, kind: OptimizerKind) -> RunOutput {
    let config = RunConfig { timeout: Duration::from_secs(60), ..RunConfig::new(7, steps, settings(kind)) };
    run(plan, &config, &batches(plan, 11), &BTreeMap::new(), &|_| {}).expect("run succeeds")
}

fn assert_close(what: &str, a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{what}: different tensors");
    for (name, d) in relative_differences(a, b) {
        assert!(d <= TOLERANCE, "{what} `{name}` differs by {d:.2e} relative");
    }
}

fn compare(file: &str, overrides: &[Override], mesh: (u64, u64), strategy: Strategy) {
    let reference = plan(file, overrides, (1, 1), Strategy::None, Mode::Train);
    let sharded = plan(file, overrides, mesh, strategy, Mode::Train);
    let (r, s) = (execute(&reference, 1, OptimizerKind::Sgd), execute(&sharded, 1, OptimizerKind::Sgd));
    let (lr, ls) = (r.steps[0].loss.expect("loss"), s.steps[0].loss.expect("loss"));
    assert!(((lr - ls) / lr).abs() as f64 <= TOLERANCE, "loss {ls} on {mesh:?} vs {lr} on one device");
    assert_close("gradient", &s.grads, &r.grads);
    assert_eq!(r.grads.len(), reference.params.len(), "every parameter has a gradient");
    let (r3, s3) = (execute(&reference, 3, OptimizerKind::AdamW), execute(&sharded, 3, OptimizerKind::AdamW));
    for (a, b) in r3.steps.iter().zip(&s3.steps) {
        let (a, b) = (a.loss.expect("loss"), b.loss.expect("loss"));
        assert!(((a - b) / a).abs() as f64 <= TOLERANCE, "AdamW loss {b} vs {a}");
    }
    assert_close("parameter after 3 AdamW steps", &s3.params, &r3.params);
}

#[test]
fn tiny_optimus_2x2() {
    compare("examples/tiny.opt", &[], (2, 2), Strategy::Optimus);
}

#[test]
fn tiny_optimus_4x4() {
    compare("examples/tiny.opt", &[], (4, 4), Strategy::Optimus);
}

#[test]
fn tiny_optimus_3x3_with_padded_vocabulary() {
    let o = sets(&[("batch", "9"), ("heads", "3"), ("hidden", "24")]);
    compare("examples/tiny.opt", &o, (3, 3), Strategy::Optimus);
}

#[test]
fn tiny_megatron_1x2() {
    compare("examples/tiny.opt", &[], (1, 2), Strategy::Megatron);
}

#[test]
fn tiny_megatron_1x4() {
    compare("examples/tiny.opt", &[], (1, 4), Strategy::Megatron);
}

#[test]
fn small_gpt2_optimus_2x2_and_megatron_1x4() {
    let o = sets(&[
        ("layers", "2"),
        ("hidden", "64"),
        ("heads", "4"),
        ("vocab", "333"),
        ("context", "32"),
        ("seq", "16"),
        ("batch", "4"),
        ("pdrop", "0.0"),
    ]);
    compare("examples/gpt2.opt", &o, (2, 2), Strategy::Optimus);
    compare("examples/gpt2.opt", &o, (1, 4), Strategy::Megatron);
}

/// How an optimus plan's tied head multiplies, read from its reasons: with its table laid across the
/// mesh, in place (moving the tokens' blocks and the logits'), or moving the table's blocks.
fn tied_head_way(plan: &Plan) -> &'static str {
    let says = |words: &str| plan.reasons.iter().any(|r| r.text.contains(words));
    if says("table across the mesh") {
        "across"
    } else if says("table in place") {
        "in place"
    } else {
        "moving the table"
    }
}

/// The way that moves the fewest elements a device in a training step, from the closed formulas of
/// docs/2d-parallelism.md for T tokens, a V x H table and a q x q mesh (each pass's SUMMA steps move
/// q blocks of each operand that moves): across, 3(T + V)H/q and three transposes of a V H/q^2 block
/// (the table's for the forward and again for dX, the gradient's back); in
/// place, 3(T V + T H)/q; moving the table, 3(T V + V H)/q. In place needs fewer tokens than rows.
fn cheapest_tied_head(t: u64, v: u64, h: u64, q: u64) -> &'static str {
    let across = 3 * (t + v) * h * q + 3 * v * h;
    let (way, other) =
        if t < v { ("in place", 3 * (t * v + t * h) * q) } else { ("moving the table", 3 * (t * v + v * h) * q) };
    if across < other { "across" } else { way }
}

/// A tied head takes the way that moves least: its table laid across the mesh (one transpose of a
/// block, then only token and table blocks move), kept in place over fewer tokens than rows, or its
/// table's blocks moving. Every way computes what one device computes: the loss, every gradient (the
/// table's too), and the weights after AdamW steps.
#[test]
fn tied_head_takes_the_way_that_moves_least() {
    let gpt2 = |vocab: &str, batch: &str| {
        let pairs = [("layers", "1"), ("hidden", "48"), ("heads", "12"), ("context", "16"), ("seq", "8")];
        let mut o = sets(&pairs);
        o.extend(sets(&[("vocab", vocab), ("batch", batch), ("pdrop", "0.0")]));
        o
    };
    // (vocabulary, batch of 8-token sequences, mesh, the way): 32, 48 or 96 tokens.
    let cases = [
        ("301", "6", 3, "in place"),
        ("200", "6", 2, "in place"),
        ("248", "4", 4, "in place"),
        ("95", "12", 3, "across"),
        ("100", "12", 2, "across"),
        ("248", "12", 4, "across"),
        ("40", "6", 2, "moving the table"),
        ("36", "6", 3, "moving the table"),
    ];
    for (vocab, batch, q, way) in cases {
        let o = gpt2(vocab, batch);
        let sharded = plan("examples/gpt2.opt", &o, (q, q), Strategy::Optimus, Mode::Train);
        // The vocabulary padded to divide over the mesh, as the plan holds it.
        let table = sharded.params.iter().find(|p| p.name == "wte.weight").map(|p| sharded.buffer(p.buffer));
        let rows = table.and_then(|b| b.logical_shape.first().copied()).unwrap_or(0);
        let tokens: u64 = batch.parse::<u64>().unwrap_or(0) * 8;
        assert_eq!(cheapest_tied_head(tokens, rows, 48, q), way, "vocab {vocab}, batch {batch}, {q}x{q}: the formulas");
        assert_eq!(tied_head_way(&sharded), way, "vocab {vocab}, batch {batch}, {q}x{q}");
        compare("examples/gpt2.opt", &o, (q, q), Strategy::Optimus);
    }
}

#[test]
fn small_bert_optimus_2x2_and_megatron_1x2() {
    let o = sets(&[
        ("layers", "2"),
        ("hidden", "32"),
        ("heads", "4"),
        ("vocab", "101"),
        ("context", "16"),
        ("seq", "8"),
        ("batch", "4"),
        ("pdrop", "0.0"),
    ]);
    compare("examples/bert.opt", &o, (2, 2), Strategy::Optimus);
    compare("examples/bert.opt", &o, (1, 2), Strategy::Megatron);
}

#[test]
fn manual_attention_optimus_2x2() {
    let o =
        sets(&[("layers", "2"), ("hidden", "32"), ("heads", "4"), ("vocab", "101"), ("context", "16"), ("seq", "8")]);
    compare("examples/gpt2_manual_attention.opt", &o, (2, 2), Strategy::Optimus);
}
