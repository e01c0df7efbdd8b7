//! Data-parallel replicas of the tensor-parallel mesh (`--mesh DxRxC`) and ZeRO-1 (`--zero 1`), end to
//! end: training runs on 2x2x2, 2x1x4 and 4x1x1 give one device's losses and final weights; every
//! example verifies on 2x2x2; each replica reads its own sequences; the communication over the
//! replicas per step is the gradient bytes; ZeRO-1 shards the optimizer state and its checkpoints
//! resume on another mesh; bad meshes and stages are clear errors.

mod common;

use common::{optimusc, read_weights, text};
use optimus::front::check_source;
use optimus::plan::layout::{DATA_AXIS, Placement};
use optimus::plan::{CollectiveKind, Group, Instr, MemoryOptions, Mesh, Mode, Plan, ReasonKind, Role, Strategy};
use optimus::shard::{Target, compile};
use std::path::{Path, PathBuf};

/// A fresh folder for one test's files.
fn scratch(name: &str) -> PathBuf {
    common::scratch("dp", name)
}

/// Every example shrunk: two layers of width 32 (4 heads), a vocabulary of 101, batches of 8
/// sequences of 8 tokens, which every mesh here divides.
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
    "batch=8",
];

/// Small GPT-2 with dropout on; AdamW with clipping and two micro-batches, so that every piece of the
/// update crosses the replicas.
const TRAINING: [&str; 10] =
    ["--set", "pdrop=0.1", "--seed", "5", "--eps", "0.0001", "--clip-grad-norm", "0.5", "--accum", "2"];

/// `run examples/gpt2.opt` shrunk, with the shared training settings.
fn model_args() -> Vec<&'static str> {
    [&["run", "examples/gpt2.opt"][..], &SMALL, &TRAINING].concat()
}

/// Trains the small GPT-2 for 3 steps on `mesh` (with `extra` flags); returns the losses and the saved weights.
fn train(mesh: &[&str], extra: &[&str], dir: &Path, name: &str) -> (Vec<f64>, Vec<(String, Vec<f32>)>) {
    let weights = dir.join(format!("{name}.safetensors"));
    let mut args = model_args();
    args.extend_from_slice(&["--steps", "3", "--json", "--save-weights", text(&weights)]);
    args.extend_from_slice(mesh);
    args.extend_from_slice(extra);
    let out = optimusc(&args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let losses = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON line"))
        .filter_map(|r| r.get("loss").and_then(serde_json::Value::as_f64))
        .collect();
    (losses, read_weights(&weights))
}

fn relative(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-3)
}

fn assert_same_training(
    what: &str,
    got: &(Vec<f64>, Vec<(String, Vec<f32>)>),
    want: &(Vec<f64>, Vec<(String, Vec<f32>)>),
) {
    assert_eq!(got.0.len(), want.0.len(), "{what}: steps");
    for (step, (a, b)) in got.0.iter().zip(&want.0).enumerate() {
        assert!(relative(*a, *b) <= 1e-4, "{what}: step {step} loss {a} vs one device {b}");
    }
    assert_eq!(got.1.len(), want.1.len(), "{what}: tensors");
    for ((name, a), (other, b)) in got.1.iter().zip(&want.1) {
        assert_eq!(name, other, "{what}");
        assert_eq!(a.len(), b.len(), "{what}: {name}");
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64 / (y.abs() as f64).max(1e-2)).fold(0.0, f64::max);
        assert!(worst <= 1e-4, "{what}: `{name}` differs from one device's by {worst:.2e} (relative)");
    }
}

#[test]
fn training_on_data_parallel_meshes_equals_one_device_with_the_whole_batch() {
    let dir = scratch("equal");
    let one = train(&["--mesh", "1x1", "--strategy", "none"], &[], &dir, "one");
    assert_eq!(one.0.len(), 3);
    let meshes: [&[&str]; 3] = [
        &["--mesh", "2x2x2"],
        &["--mesh", "2x1x4", "--strategy", "megatron"],
        &["--mesh", "4x1x1", "--strategy", "none"],
    ];
    for mesh in meshes {
        for zero in ["0", "1"] {
            let name = format!("{}-zero{zero}", mesh[1]);
            let got = train(mesh, &["--zero", zero], &dir, &name);
            assert_same_training(&name, &got, &one);
        }
    }
}

/// Every example, shrunk, verifies on 2x2x2 with and without ZeRO-1.
#[test]
fn every_example_verifies_on_two_replicas_of_a_2x2_mesh() {
    for entry in std::fs::read_dir("examples").expect("examples") {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("opt") {
            continue;
        }
        let source = std::fs::read_to_string(&path).expect("reads");
        let mut args = vec!["verify", text(&path), "--mesh", "2x2x2"];
        if !path.ends_with("tiny.opt") {
            args.extend_from_slice(&SMALL);
        }
        if source.contains("kv_heads") {
            args.extend_from_slice(&["--set", "kv_heads=2"]);
        }
        for zero in ["0", "1"] {
            let out = optimusc(&[&args[..], &["--zero", zero]].concat());
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains("verified"),
                "{} zero {zero}: {stdout}{}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

fn small_gpt2(mesh: Mesh, strategy: Strategy, zero: u8) -> Plan {
    let sets = [("layers", "2"), ("hidden", "64"), ("heads", "4"), ("ffn", "128"), ("vocab", "512"), ("seq", "16")];
    gpt2(&sets, mesh, strategy, zero)
}

/// examples/gpt2.opt with `sets` (and 16-token contexts, batches of 8), compiled for training.
fn gpt2(sets: &[(&str, &str)], mesh: Mesh, strategy: Strategy, zero: u8) -> Plan {
    let source = std::fs::read_to_string("examples/gpt2.opt").expect("reads");
    let overrides: Vec<_> = sets
        .iter()
        .chain(&[("context", "16"), ("batch", "8")])
        .map(|(k, v)| optimus::elab::Override { name: (*k).to_string(), value: (*v).to_string() })
        .collect();
    let model = check_source(&source, &overrides).model.expect("checks");
    let memory = MemoryOptions { zero, ..MemoryOptions::DEFAULT };
    let target = Target { memory, ..Target::plain(mesh, strategy, Mode::Train) };
    compile(&model, "gpt2.opt", &source, target).expect("compiles")
}

/// Bytes a device sends (all-reduce, reduce-scatter) or receives (all-gather) per step over the
/// replicas, by collective kind.
fn data_axis_bytes(plan: &Plan) -> [u64; 3] {
    let mut bytes = [0u64; 3];
    for instr in &plan.program {
        let Instr::Collective { collective: c, .. } = instr else { continue };
        if c.group != Group::Data {
            continue;
        }
        match c.kind {
            CollectiveKind::AllReduce => bytes[0] += plan.buffer(c.send).bytes(),
            CollectiveKind::ReduceScatter => bytes[1] += plan.buffer(c.send).bytes(),
            CollectiveKind::AllGather => bytes[2] += plan.buffer(c.recv).bytes(),
            other => panic!("unexpected {} over the replicas", other.name()),
        }
    }
    bytes
}

/// Bytes of a parameter's block on one replica (its tensor-parallel block, whole over the replicas).
fn replica_block_bytes(plan: &Plan, id: optimus::plan::BufferId) -> u64 {
    let b = plan.buffer(id);
    let split = b.layout.0[DATA_AXIS] != Placement::Replicate;
    b.bytes() * if split { plan.mesh.data } else { 1 }
}

#[test]
fn communication_over_the_replicas_is_the_gradient_bytes() {
    for (mesh, strategy) in
        [(Mesh::new(2, 2).with_data(2), Strategy::Optimus), (Mesh::new(1, 4).with_data(2), Strategy::Megatron)]
    {
        let plain = small_gpt2(mesh, strategy, 0);
        let gradient_bytes: u64 = plain.params.iter().map(|p| plain.buffer(p.grad.expect("grad")).bytes()).sum();
        // Besides the gradients, the replicas sum two float32 scalars: the loss and the count of
        // targets that the mean divides by.
        let scalars = 2 * 4;
        assert_eq!(
            data_axis_bytes(&plain),
            [gradient_bytes + scalars, 0, 0],
            "{mesh}: one all-reduce of every gradient"
        );

        let zero = small_gpt2(mesh, strategy, 1);
        let [all_reduced, scattered, gathered] = data_axis_bytes(&zero);
        let (mut sharded, mut whole) = (0, 0);
        for p in &zero.params {
            let bytes = replica_block_bytes(&zero, p.buffer);
            if zero.buffer(p.buffer).layout.0[DATA_AXIS] == Placement::Replicate {
                whole += bytes
            } else {
                sharded += bytes
            }
        }
        assert!(sharded > whole, "{mesh}: most parameters are sharded over the replicas");
        assert_eq!(scattered + all_reduced, gradient_bytes + scalars, "{mesh}: every gradient is summed once");
        assert_eq!((scattered, all_reduced), (sharded, whole + scalars), "{mesh}: reduce-scatter where sharded");
        assert_eq!(gathered, sharded, "{mesh}: each sharded parameter is gathered once per step");
        // Every sum of a gradient over the replicas is a data-parallel gradient reduction, in buckets.
        let mut gradient_sums = 0;
        for instr in &zero.program {
            if let Instr::Collective { collective: c, reason, .. } = instr
                && c.group == Group::Data
                && c.kind != CollectiveKind::AllGather
                && matches!(zero.reasons[*reason as usize].kind, ReasonKind::DataParallelGradient { .. })
            {
                gradient_sums += zero.buffer(c.send).bytes();
            }
        }
        assert_eq!(gradient_sums, gradient_bytes, "{mesh}: the gradient sums are named as such");
    }
}

#[test]
fn zero_1_divides_optimizer_state_over_the_replicas() {
    let mesh = Mesh::new(2, 2).with_data(2);
    let state_bytes = |plan: &Plan| -> u64 {
        plan.buffers.iter().filter(|b| b.role == Role::OptimizerState).map(|b| b.bytes()).sum()
    };
    let (plain, zero) = (small_gpt2(mesh, Strategy::Optimus, 0), small_gpt2(mesh, Strategy::Optimus, 1));
    let (a, b) = (state_bytes(&plain), state_bytes(&zero));
    assert!(b * 2 <= a + a / 20, "ZeRO-1 state {b} bytes is about half of {a}");
    assert!(zero.memory.peak_bytes < plain.memory.peak_bytes, "the peak falls");
    assert_eq!(zero.zero, 1);
}

#[test]
fn each_replica_reads_its_own_contiguous_sequences() {
    let plan = small_gpt2(Mesh::new(2, 2).with_data(2), Strategy::Optimus, 0);
    for input in &plan.inputs {
        let meta = plan.buffer(input.buffer);
        let seq = meta.logical_shape[1];
        let mut by_replica = vec![std::collections::BTreeSet::new(); 2];
        for coords in plan.mesh.all_coords() {
            let indices = optimus::plan::logical::logical_indices(meta, coords, plan.mesh);
            assert!(!indices.is_empty());
            by_replica[coords.d() as usize].extend(indices.iter().map(|i| i / seq));
        }
        // Replica d reads sequences 4d..4d+3 of the batch of 8, and nothing else.
        for (d, rows) in by_replica.into_iter().enumerate() {
            let want: Vec<u64> = (4 * d as u64..4 * d as u64 + 4).collect();
            assert_eq!(rows.into_iter().collect::<Vec<_>>(), want, "`{}` on replica {d}", input.name);
        }
    }
}

#[test]
fn a_zero_1_checkpoint_resumes_on_one_device() {
    let dir = scratch("resume");
    let ckpt = dir.join("ckpt");
    let base = |steps: &'static str| {
        let mut args = model_args();
        args.extend_from_slice(&["--steps", steps, "--json"]);
        args
    };
    let whole = dir.join("whole.safetensors");
    let resumed = dir.join("resumed.safetensors");
    let one = [&base("4")[..], &["--mesh", "1x1", "--strategy", "none", "--save-weights", text(&whole)]].concat();
    assert!(optimusc(&one).status.success());
    let first = [
        &base("4")[..],
        &["--mesh", "2x2x2", "--zero", "1", "--checkpoint-dir", text(&ckpt), "--checkpoint-every", "2"],
    ]
    .concat();
    let out = optimusc(&first);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let after_2 = ckpt.join("step-00000002");
    let again = dir.join("resumed-checkpoints");
    let rest = [
        &base("4")[..],
        &["--mesh", "1x1", "--strategy", "none", "--resume", text(&after_2), "--save-weights", text(&resumed)],
        &["--checkpoint-dir", text(&again)],
    ]
    .concat();
    let out = optimusc(&rest);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for ((name, a), (_, b)) in read_weights(&resumed).iter().zip(read_weights(&whole)) {
        let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs() / y.abs().max(1e-2)).fold(0.0f32, f32::max);
        assert!(worst <= 1e-4, "`{name}` after resuming a ZeRO-1 2x2x2 checkpoint on 1x1: {worst:.2e}");
    }
}

#[test]
fn bad_data_parallel_meshes_and_stages_are_clear_errors() {
    let cases: [(&[&str], &str); 7] = [
        (&["--mesh", "0x2x2"], "mesh sides must be between 1 and 1024"),
        // Digits past any integer are a side out of range too, not a malformed mesh.
        (&["--mesh", "18446744073709551616x1"], "mesh sides must be between 1 and 1024"),
        (&["--mesh", "2x2x2x2x2"], "expected ROWSxCOLS, REPLICASxROWSxCOLS"),
        (&["--mesh", "2x2x2x2"], "only the tesseract and 3d strategies have a depth axis"),
        (&["--mesh", "2x2x2", "--zero", "2"], "--zero"),
        (&["--mesh", "2x4x4", "--set", "batch=4"], "`batch` (4) cannot be split 8 ways"),
        (&["--mesh", "2x3x1", "--strategy", "none"], "the none strategy runs each replica on one device"),
    ];
    for (flags, expected) in cases {
        let out = optimusc(&[&["compile", "examples/tiny.opt", "-o", "/dev/null"][..], flags].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} must fail");
        assert!(stderr.contains(expected), "{flags:?}: expected `{expected}` in\n{stderr}");
        assert!(!stderr.contains("panicked"), "{flags:?}: {stderr}");
    }
}

#[test]
fn simulate_hides_gradient_sums_over_the_replicas_behind_the_backward_pass() {
    use optimus::cost::hardware::Hardware;
    use optimus::cost::step::{Options, simulate};
    // About 60 MiB of gradients: three buckets, the first two summed while the backward pass goes on.
    let sets = [("layers", "4"), ("hidden", "512"), ("heads", "8"), ("ffn", "2048"), ("vocab", "4096"), ("seq", "16")];
    let plan = gpt2(&sets, Mesh::new(1, 1).with_data(4), Strategy::None, 0);
    let hw = Hardware::load("dgx-a100").expect("profile");
    let data = |overlap: bool| {
        let sim = simulate(&plan, &hw, &Options { overlap, ..Options::default() });
        let entry = sim.communication.iter().find(|c| c.group == "data" && c.kind == "all_reduce").cloned();
        (sim, entry.expect("sums over the replicas"))
    };
    let (serial, serial_sums) = data(false);
    let (overlapped, sums) = data(true);
    assert_eq!(serial_sums.exposed_s, serial_sums.time_s, "without overlap every sum is exposed");
    assert_eq!(sums.time_s, serial_sums.time_s);
    assert!(sums.exposed_s < sums.time_s, "the backward pass after a bucket hides part of its sums");
    let hidden = sums.time_s - sums.exposed_s;
    assert!(
        (serial.step_time_s - overlapped.step_time_s - hidden).abs() < 1e-12,
        "the step is shorter by what is hidden"
    );
    assert_eq!(serial.compute_s, overlapped.compute_s);
}

#[test]
fn the_largest_batch_that_fits_counts_every_replicas_share() {
    use optimus::cost::search::{Source, max_batch};
    let text = std::fs::read_to_string("examples/gpt2.opt").expect("reads");
    let sets = [("layers", "2"), ("hidden", "64"), ("heads", "4"), ("ffn", "128"), ("vocab", "512"), ("seq", "16")];
    let overrides: Vec<_> =
        sets.iter().map(|(k, v)| optimus::elab::Override { name: (*k).to_string(), value: (*v).to_string() }).collect();
    let source = Source { name: "gpt2.opt", text: &text, overrides: &overrides };
    let target = |mesh: Mesh| Target::plain(mesh, Strategy::Optimus, Mode::Train);
    let capacity = 64 << 20;
    let one = max_batch(&source, target(Mesh::new(2, 2)), capacity);
    let two = max_batch(&source, target(Mesh::new(2, 2).with_data(2)), capacity);
    assert_eq!((one.multiple, two.multiple), (2, 4), "two replicas of 2 rows take batches in fours");
    assert!(one.max_batch > 0, "{one:?}");
    assert_eq!(two.max_batch, 2 * one.max_batch, "each replica holds what one mesh holds: {one:?} {two:?}");
}

#[test]
fn the_plan_says_which_collectives_are_gradient_sums_and_where_the_updates_begin() {
    use optimus::plan::phases::{Phase, StepPhases};
    for (mesh, strategy) in [(Mesh::new(2, 2).with_data(2), Strategy::Optimus), (Mesh::new(1, 2), Strategy::Megatron)] {
        let plan = small_gpt2(mesh, strategy, 0);
        let phases = StepPhases::of(&plan);
        let of = |p: Phase| (0..plan.program.len()).filter(|&i| phases.phase(i) == p).collect::<Vec<_>>();
        let updates = of(Phase::Update);
        assert_eq!(updates.len(), plan.params.len(), "{mesh}: one update per parameter");
        assert_eq!(phases.updates_begin(), *updates.iter().chain(&of(Phase::GradientNorm)).min().expect("updates"));
        let sums = of(Phase::GradientSum);
        for &i in &sums {
            let Instr::Collective { reason, .. } = &plan.program[i] else { panic!("{mesh}: {i} is not a collective") };
            assert!(matches!(plan.reasons[*reason as usize].kind, ReasonKind::DataParallelGradient { .. }));
            assert!(i < phases.updates_begin(), "{mesh}: gradient sums come before the updates");
        }
        assert_eq!(sums.is_empty(), mesh.data == 1, "{mesh}: gradient sums exactly where there are replicas");
        let loss = plan.outputs.iter().find(|o| o.is_loss).expect("a loss").buffer;
        let end = phases.forward_end();
        assert!(end <= phases.updates_begin(), "{mesh}: the forward pass ends before the updates");
        let writes_loss = |i: &Instr| match i {
            Instr::Kernel { output, .. } => *output == loss,
            Instr::Collective { collective, .. } => collective.recv == loss,
            Instr::Free { .. } | Instr::Wait { .. } => false,
        };
        assert!(writes_loss(&plan.program[end - 1]), "{mesh}: the forward pass ends with the loss");
        assert!(!plan.program[end..phases.updates_begin()].iter().any(writes_loss), "{mesh}: the last loss write");
    }
}

/// Operators that mix the sequences of a batch the replicas split (a linear over the batch, attention
/// over it, logits transposed against their targets) are refused by name on meshes with replicas or
/// depth layers (they had failed the plan's own verification, E0699), and verify on meshes without.
#[test]
fn operators_that_mix_the_batch_are_refused_where_replicas_split_it() {
    let header = "config { vocab = 16; hidden = 8; batch = 4; seq = 4; heads = 2 }\n\
                  input tokens: i32[batch, seq]\ninput targets: i32[batch, seq]\n\
                  layer wte = embedding(vocab, hidden)\nlayer head = linear(hidden, vocab)\n";
    let models = [
        (
            "over_batch",
            "layer mix = linear(batch, batch)\nforward {\n  y = transpose(mix(transpose(wte(tokens), 0, 2)), 0, 2)\n\
             \x20 output loss = cross_entropy(head(y), targets)\n}\n",
            "`linear` reads whole the batch dimension (dimension 2 of f32[8, 4, 4])",
        ),
        (
            "attention_over_batch",
            "forward {\n  t = transpose(wte(tokens), 0, 1)\n  z = transpose(self_attention(t, t, t, heads: heads), 0, 1)\n\
             \x20 output loss = cross_entropy(head(z), targets)\n}\n",
            "`self_attention` reads whole the batch dimension (dimension 1 of f32[4, 4, 8])",
        ),
        (
            "select_of_the_batch",
            "forward {\n  x = wte(tokens)\n  output loss = cross_entropy(head(x), targets) + \
             cross_entropy(head(select(x, 0, 1)), select(targets, 0, 1))\n}\n",
            "`select` picks one index of the batch dimension (dimension 0 of f32[4, 4, 8])",
        ),
        (
            "transposed_logits",
            "forward {\n  output loss = cross_entropy(head(transpose(wte(tokens), 0, 1)), targets)\n}\n",
            "the operands of `cross_entropy` carry the batch in different dimensions (1 and 0)",
        ),
    ];
    for (name, body, says) in models {
        let path = scratch(name).join(format!("{name}.opt"));
        std::fs::write(&path, format!("model {name}\n{header}{body}")).expect("the model is written");
        for (strategy, mesh) in [("none", "2x1x1"), ("megatron", "2x1x2"), ("optimus", "2x2x2"), ("tesseract", "2x2x2")]
        {
            let out = optimusc(&["compile", text(&path), "--strategy", strategy, "--mesh", mesh, "-o", "-"]);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{name} {strategy} {mesh}: {stderr}");
            assert!(stderr.contains("error[E0602]") && stderr.contains(says), "{name} {strategy} {mesh}: {stderr}");
            assert!(!stderr.contains("E0699"), "{stderr}");
        }
        for (strategy, mesh) in [("optimus", "2x2"), ("megatron", "1x2")] {
            let out = optimusc(&["verify", text(&path), "--strategy", strategy, "--mesh", mesh]);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{name} {strategy} {mesh}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        }
    }
}
