//! Communication beside computation (`--overlap`): the pass keeps every plan verifiable with the same
//! collectives, double-buffers SUMMA steps and lets data-parallel gradient sums run
//! beside the backward pass; the verifier refuses an unsafe schedule; runs on threads give bit-identical
//! losses and weights with and without it on several meshes and strategies; `run --profile` shows
//! communication hidden; `simulate` follows the plan's starts and waits; `inspect` reports them.

mod common;

use common::{optimusc, read_weights, text};
use optimus::cost::{Hardware, Options, simulate};
use optimus::elab::Override;
use optimus::front::check_source;
use optimus::plan::overlap::overlap_collectives;
use optimus::plan::verify::verify;
use optimus::plan::{
    BufferId, CollectiveKind, Instr, Kernel, MemoryOptions, Mesh, Mode, Plan, Precision, ReasonKind, Recompute,
    Strategy,
};
use optimus::shard::{Target, compile};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Every example shrunk: two layers of width 32 (4 heads), a vocabulary of 101, batches of 8
/// sequences of 8 tokens, which every mesh here divides.
const SMALL: [(&str, &str); 8] = [
    ("layers", "2"),
    ("hidden", "32"),
    ("heads", "4"),
    ("ffn", "64"),
    ("vocab", "101"),
    ("seq", "8"),
    ("context", "16"),
    ("batch", "8"),
];

fn compile_example(name: &str, mesh: Mesh, strategy: Strategy, mode: Mode, memory: MemoryOptions) -> Plan {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples").join(format!("{name}.opt"));
    let source = std::fs::read_to_string(path).expect("example");
    // Llama groups its 4 query heads over 2 key/value heads.
    let grouped = if name == "llama" { &[("kv_heads", "2")][..] } else { &[] };
    let overrides: Vec<Override> = SMALL
        .iter()
        .chain(grouped)
        .map(|(k, v)| Override { name: (*k).to_string(), value: (*v).to_string() })
        .collect();
    let model = check_source(&source, &overrides).model.expect("the example checks");
    compile(&model, name, &source, Target { memory, ..Target::plain(mesh, strategy, mode) })
        .expect("compiles and verifies")
}

fn overlapped(plan: &Plan) -> Plan {
    let mut plan = plan.clone();
    overlap_collectives(&mut plan);
    plan
}

/// Each collective's kind, group, root and bytes, in program order: what the members of a group meet on.
fn meetings(plan: &Plan) -> Vec<(CollectiveKind, String, Option<u64>, u64)> {
    plan.program
        .iter()
        .filter_map(|i| match i {
            Instr::Collective { collective: c, .. } => {
                Some((c.kind, c.group.name().to_string(), c.root, plan.buffer(c.send).bytes()))
            }
            _ => None,
        })
        .collect()
}

/// Overlapped collectives as (start, wait, send, recv) positions and buffers.
fn spans(plan: &Plan) -> Vec<(usize, usize, BufferId, BufferId)> {
    let mut out = Vec::new();
    for (start, instr) in plan.program.iter().enumerate() {
        let Instr::Collective { collective: c, .. } = instr else { continue };
        if !c.overlapped {
            continue;
        }
        let wait = plan.program[start..]
            .iter()
            .position(|i| matches!(i, Instr::Wait { send, recv } if *send == c.send && *recv == c.recv))
            .map(|k| start + k)
            .expect("every overlapped collective has its wait");
        out.push((start, wait, c.send, c.recv));
    }
    out
}

fn reads(instr: &Instr, id: BufferId) -> bool {
    matches!(instr, Instr::Kernel { inputs, .. } if inputs.contains(&id))
}

#[test]
fn overlapped_plans_verify_with_the_same_collectives_and_computation() {
    let bf16 = MemoryOptions { precision: Precision::Bf16, ..MemoryOptions::DEFAULT };
    let layers = MemoryOptions { recompute: Some(Recompute::Layers), ..MemoryOptions::DEFAULT };
    let zero = MemoryOptions { zero: 1, ..MemoryOptions::DEFAULT };
    let cases = [
        ("gpt2", Mesh::new(2, 2), Strategy::Optimus, Mode::Train, MemoryOptions::DEFAULT),
        ("gpt2", Mesh::new(4, 4), Strategy::Optimus, Mode::Infer, bf16),
        ("llama", Mesh::new(2, 2), Strategy::Optimus, Mode::Train, layers),
        ("bert", Mesh::new(1, 4), Strategy::Megatron, Mode::Train, bf16),
        ("llama", Mesh::new(1, 2).with_data(2), Strategy::Megatron, Mode::Train, zero),
        ("gpt2", Mesh::new(2, 2).with_data(2), Strategy::Optimus, Mode::Train, MemoryOptions::DEFAULT),
    ];
    for (name, mesh, strategy, mode, memory) in cases {
        let what = format!("{name} {mesh} {strategy:?} {mode:?} {memory:?}");
        let plain = compile_example(name, mesh, strategy, mode, memory);
        let plan = overlapped(&plain);
        assert!(plan.overlap, "{what}");
        verify(&plan).unwrap_or_else(|e| panic!("{what}: {e:?}"));
        // The same collectives; the early starts of backward collectives reorder them, the same way on
        // every device (one program), so every group's members still meet in one order.
        let sorted = |p: &Plan| {
            let mut m = meetings(p);
            m.sort();
            m
        };
        assert_eq!(sorted(&plan), sorted(&plain), "{what}: the same collectives");
        assert!(!spans(&plan).is_empty(), "{what}: something overlaps");
        assert!(plan.memory.peak_bytes >= plain.memory.peak_bytes, "{what}: overlap never saves memory");
        assert_eq!(overlapped(&plan), plan, "{what}: the pass applies once");
        let kernels = |p: &Plan| p.program.iter().filter(|i| matches!(i, Instr::Kernel { .. })).count();
        assert_eq!(kernels(&plan), kernels(&plain), "{what}: the same computation");
    }
    // The simulation says something overlapped where the plan overlaps something, not where its flag
    // alone says so (a plan edited to claim it).
    let plain = compile_example("gpt2", Mesh::new(2, 2), Strategy::Optimus, Mode::Train, MemoryOptions::DEFAULT);
    let dgx = Hardware::load("dgx-a100").unwrap_or_else(|e| panic!("{e}"));
    assert!(simulate(&overlapped(&plain), &dgx, &Options::default()).overlap);
    let claimed = Plan { overlap: true, ..plain };
    assert!(!simulate(&claimed, &dgx, &Options::default()).overlap, "nothing in the plan overlaps");
}

#[test]
fn summa_steps_are_double_buffered() {
    let plain = compile_example("gpt2", Mesh::new(2, 2), Strategy::Optimus, Mode::Train, MemoryOptions::DEFAULT);
    let plan = overlapped(&plain);
    let second: Vec<_> = plan.buffers.iter().filter(|b| b.name.ends_with(" (second buffer)")).collect();
    assert!(!second.is_empty(), "SUMMA blocks get a second buffer");
    let growth = plan.memory.peak_bytes - plain.memory.peak_bytes;
    let doubled: u64 = second.iter().map(|b| b.bytes()).sum();
    assert!(growth <= doubled, "the peak grows by at most the second buffers ({growth} > {doubled})");
    // A broadcast of step t+1 is in flight while step t's product reads the block of step t's broadcast.
    let broadcasts: Vec<_> = spans(&plan)
        .into_iter()
        .filter(|&(start, ..)| {
            matches!(&plan.program[start], Instr::Collective { collective, .. } if collective.kind == CollectiveKind::Broadcast)
        })
        .collect();
    let double_buffered = broadcasts.iter().any(|&(start, wait, _, recv)| {
        plan.program[start + 1..wait].iter().any(|i| {
            matches!(i, Instr::Kernel { kernel: Kernel::MatMul { .. }, inputs, .. }
                if !inputs.contains(&recv) && inputs.iter().any(|b| plan.buffer(*b).name.contains('%')))
        })
    });
    assert!(double_buffered, "a product runs while the next step's broadcast is in flight");
    // Nothing between a start and its wait reads what is being received.
    for (start, wait, _, recv) in spans(&plan) {
        assert!(!plan.program[start + 1..wait].iter().any(|i| reads(i, recv)), "instructions {start}..{wait}");
    }
}

#[test]
fn gradient_sums_over_the_replicas_run_beside_the_backward_pass() {
    let plain =
        compile_example("gpt2", Mesh::new(2, 2).with_data(2), Strategy::Optimus, Mode::Train, MemoryOptions::DEFAULT);
    let plan = overlapped(&plain);
    let is_gradient_sum = |start: usize| match &plan.program[start] {
        Instr::Collective { reason, .. } => {
            matches!(plan.reasons[*reason as usize].kind, ReasonKind::DataParallelGradient { .. })
        }
        _ => false,
    };
    let sums = plan.program.iter().enumerate().filter(|(k, _)| is_gradient_sum(*k)).count();
    let beside: Vec<_> = spans(&plan).into_iter().filter(|&(start, ..)| is_gradient_sum(start)).collect();
    assert!(2 * beside.len() >= sums, "{} of {sums} gradient sums overlap", beside.len());
    for (start, wait, ..) in beside {
        let computed = plan.program[start..wait].iter().filter(|i| matches!(i, Instr::Kernel { .. })).count();
        assert!(computed > 0, "the sum started at {start} runs beside computation");
        assert!(
            !plan.program[start..wait].iter().any(|i| matches!(i, Instr::Kernel { kernel: Kernel::OptimizerStep, .. })),
            "every sum is complete before the updates"
        );
    }
}

/// The verifier's messages for `plan`, which must fail.
fn refusals(plan: &Plan) -> String {
    verify(plan).err().map(|e| e.join("\n")).unwrap_or_else(|| panic!("an unsafe schedule verified"))
}

#[test]
fn the_verifier_refuses_unsafe_overlap() {
    let plain = compile_example("gpt2", Mesh::new(2, 2), Strategy::Optimus, Mode::Train, MemoryOptions::DEFAULT);
    let plan = overlapped(&plain);
    let &(start, wait, send, recv) = spans(&plan).first().expect("an overlapped collective");

    let mut no_wait = plan.clone();
    no_wait.program.remove(wait);
    assert!(refusals(&no_wait).contains("is never waited for"), "{}", refusals(&no_wait));

    // The wait moved past the first instruction that reads the result.
    let reader = (wait + 1..plan.program.len()).find(|&k| reads(&plan.program[k], recv)).expect("a reader");
    let mut late = plan.clone();
    let moved = late.program.remove(wait);
    late.program.insert(reader, moved);
    let messages = refusals(&late);
    assert!(
        messages.contains("while the collective started at instruction") && messages.contains("in flight"),
        "{messages}"
    );

    let mut stray = plan.clone();
    stray.program.insert(start, Instr::Wait { send, recv });
    assert!(refusals(&stray).contains("that is not in flight"), "{}", refusals(&stray));

    // A kernel that overwrites the block being sent.
    let writer = plan
        .program
        .iter()
        .find(|i| matches!(i, Instr::Kernel { output, .. } if *output != send))
        .cloned()
        .expect("a kernel");
    let Instr::Kernel { kernel, inputs, origin, reason, .. } = writer else { unreachable!() };
    let mut overwrite = plan.clone();
    overwrite.program.insert(start + 1, Instr::Kernel { kernel, inputs, output: send, origin, reason });
    assert!(refusals(&overwrite).contains("writes or frees"), "{}", refusals(&overwrite));
}

fn scratch(name: &str) -> PathBuf {
    let dir = common::process_dir("overlap");
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

fn small_args() -> Vec<String> {
    SMALL.iter().flat_map(|(k, v)| ["--set".to_string(), format!("{k}={v}")]).collect()
}

/// Trains the small GPT-2 for 3 steps; returns the losses and the bit patterns of the saved weights.
fn train(flags: &[&str], weights: &Path) -> (Vec<f64>, Vec<(String, Vec<u32>)>) {
    let mut args: Vec<String> =
        ["run", "examples/gpt2.opt", "--steps", "3", "--seed", "11", "--json"].into_iter().map(String::from).collect();
    args.extend(small_args());
    args.extend(["--save-weights".to_string(), text(weights).to_string()]);
    args.extend(flags.iter().map(|f| f.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = optimusc(&refs);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let losses = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("JSON line"))
        .filter_map(|r| r.get("loss").and_then(Value::as_f64))
        .collect();
    let bits = read_weights(weights).into_iter().map(|(name, v)| (name, v.iter().map(|x| x.to_bits()).collect()));
    (losses, bits.collect())
}

#[test]
fn runs_with_overlap_equal_runs_without_bit_for_bit() {
    let configs: [&[&str]; 5] = [
        &["--mesh", "2x2", "--set", "pdrop=0.1"],
        &["--mesh", "1x4", "--strategy", "megatron", "--precision", "bf16"],
        &["--mesh", "2x2x2", "--accum", "2", "--zero", "1", "--clip-grad-norm", "0.5"],
        &["--mesh", "2x1x2", "--strategy", "megatron", "--accum", "2"],
        &["--mesh", "2x2", "--recompute", "layers", "--precision", "bf16"],
    ];
    for (k, flags) in configs.iter().enumerate() {
        let plain = train(flags, &scratch(&format!("plain{k}.safetensors")));
        let with: Vec<&str> = flags.iter().copied().chain(["--overlap"]).collect();
        let overlapped = train(&with, &scratch(&format!("overlapped{k}.safetensors")));
        assert_eq!(plain.0.len(), 3, "{flags:?}: three losses");
        assert_eq!(overlapped.0, plain.0, "{flags:?}: losses");
        assert!(overlapped.1 == plain.1, "{flags:?}: the saved weights differ");
    }
}

/// The `profile` record of a profiled run.
fn profile_of(flags: &[&str]) -> Value {
    let mut args: Vec<String> =
        ["run", "examples/gpt2.opt", "--mesh", "2x2", "--steps", "3", "--profile", "--json"].map(String::from).to_vec();
    args.extend(small_args());
    args.extend(flags.iter().map(|f| f.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = optimusc(&refs);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().expect("records");
    serde_json::from_str::<Value>(last).expect("JSON")["profile"].clone()
}

fn hidden_ms(profile: &Value) -> (f64, f64) {
    let rows: f64 = profile["rows"].as_array().expect("rows").iter().filter_map(|r| r["hidden_ms"].as_f64()).sum();
    let devices: f64 = profile["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .map(|d| d["hidden_communication_ms"].as_f64().expect("hidden per device"))
        .sum();
    (rows, devices)
}

#[test]
fn the_profile_shows_communication_hidden_under_computation() {
    let (rows, devices) = hidden_ms(&profile_of(&["--overlap"]));
    assert!(rows > 0.0 && devices > 0.0, "hidden communication: rows {rows} ms, devices {devices} ms");
    assert!((rows - devices).abs() <= 1e-6 * rows.max(1.0), "rows {rows} and devices {devices} agree");
    assert_eq!(hidden_ms(&profile_of(&[])), (0.0, 0.0), "nothing is hidden without --overlap");
}

#[test]
fn simulate_follows_the_plans_starts_and_waits() {
    let plain =
        compile_example("gpt2", Mesh::new(2, 2).with_data(2), Strategy::Optimus, Mode::Train, MemoryOptions::DEFAULT);
    let plan = overlapped(&plain);
    let hw = Hardware::load("dgx-a100").expect("a named cluster");
    let close = |a: f64, b: f64, what: &str| assert!((a - b).abs() <= 1e-9 * b.abs().max(1e-12), "{what}: {a} != {b}");
    let sequential = simulate(&plain, &hw, &Options { overlap: false, ..Options::default() });
    let scheduled = simulate(&plan, &hw, &Options::default());
    close(sequential.step_time_s, sequential.compute_s + sequential.communication_s, "nothing hidden");
    close(scheduled.step_time_s, scheduled.compute_s + scheduled.exposed_communication_s, "step");
    close(
        scheduled.exposed_communication_s + scheduled.hidden_communication_s,
        scheduled.communication_s,
        "exposed and hidden",
    );
    assert!(scheduled.hidden_communication_s > 0.0, "the plan's overlap hides communication");
    // One compute and one communication stream: the step is at least each stream's busy time.
    assert!(scheduled.step_time_s >= scheduled.compute_s.max(scheduled.communication_s) * (1.0 - 1e-12));
    assert!(scheduled.step_time_s <= sequential.step_time_s * (1.0 + 1e-12));
    close(scheduled.compute_s, sequential.compute_s, "the same kernels");
    let exposed: f64 = scheduled.communication.iter().map(|c| c.exposed_s).sum();
    close(exposed, scheduled.exposed_communication_s, "exposed time by group");
}

#[test]
fn inspect_reports_what_overlaps() {
    let plan_path = scratch("overlapped.json");
    let mut args: Vec<String> = ["compile", "examples/gpt2.opt", "--mesh", "2x2", "--overlap", "-o", text(&plan_path)]
        .map(String::from)
        .to_vec();
    args.extend(small_args());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = optimusc(&refs);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let inspected = optimusc(&["inspect", text(&plan_path)]);
    let report = String::from_utf8_lossy(&inspected.stdout);
    assert!(report.contains("collectives run beside computation"), "{report}");
    let json = optimusc(&["inspect", text(&plan_path), "--json"]);
    let doc: Value = serde_json::from_slice(&json.stdout).expect("inspect JSON");
    let waited: Vec<&Value> =
        doc["communication"].as_array().expect("entries").iter().filter(|c| !c["waited_at"].is_null()).collect();
    assert!(!waited.is_empty());
    for c in waited {
        assert!(c["waited_at"].as_u64() > c["instruction"].as_u64(), "{c}");
    }
    // A plan file takes --overlap at run time too.
    let plain_path = scratch("plain.json");
    let mut args: Vec<String> =
        ["compile", "examples/gpt2.opt", "--mesh", "2x2", "-o", text(&plain_path)].map(String::from).to_vec();
    args.extend(small_args());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    assert!(optimusc(&refs).status.success());
    let run = optimusc(&["run", text(&plain_path), "--steps", "1", "--overlap"]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
}
