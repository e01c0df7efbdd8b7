//! Tesseract (2.5D, `--strategy tesseract --mesh DxQxQ`, `RxDxQxQ` with replicas) end to end:
//! training on depth 2 and 4 with q = 2, with and without replicas and ZeRO-1, gives one device's
//! losses and final weights; GPT-2, BERT and Llama verify there (with recompute and bf16); the SUMMA
//! traffic per device, the sum over the depth and the memory per device equal closed formulas; the
//! mesh is read with the strategy, and meshes that do not fit are clear errors.

mod common;
mod family;

use common::optimusc;
use family::{
    CONTEXT, FFN, HIDDEN, LAYERS, SEQ, SMALL, Training, assert_same_training, scratch, small_gpt2, train, verifies,
};
use optimus::plan::{CollectiveKind, Group, Instr, Mesh, Plan, ReasonKind, Role, Strategy};
use std::collections::BTreeMap;

#[test]
fn training_on_tesseract_meshes_equals_one_device_with_the_whole_batch() {
    let dir = scratch("tesseract", "equal");
    let one: Training = train(&["--mesh", "1x1", "--strategy", "none", "--seed", "7"], &dir, "one");
    assert_eq!(one.0.len(), 3);
    for (mesh, zero) in [("2x2x2", "0"), ("4x2x2", "0"), ("2x2x2x2", "0"), ("2x2x2x2", "1")] {
        let name = format!("{mesh}-zero{zero}");
        let got = train(&["--strategy", "tesseract", "--mesh", mesh, "--zero", zero, "--seed", "7"], &dir, &name);
        assert_same_training(&name, &got, &one);
    }
}

#[test]
fn gpt2_bert_and_llama_verify_on_depth_2_and_4_with_and_without_replicas() {
    for model in ["examples/gpt2.opt", "examples/bert.opt", "examples/llama.opt"] {
        for mesh in ["2x2x2", "4x2x2", "2x2x2x2"] {
            verifies("tesseract", model, mesh, &SMALL, &[]);
        }
    }
}

#[test]
fn recompute_bf16_and_zero_1_verify_on_tesseract() {
    verifies("tesseract", "examples/llama.opt", "2x2x2", &SMALL, &["--recompute", "selective"]);
    verifies("tesseract", "examples/gpt2.opt", "4x2x2", &SMALL, &["--recompute", "layers"]);
    let bf16 = ["--precision", "bf16", "--recompute", "layers", "--zero", "1", "--tolerance", "2e-2"];
    verifies("tesseract", "examples/llama.opt", "2x2x2x2", &SMALL, &bf16);
}

const VOCAB: u64 = 101;

fn gpt2(mesh: Mesh, strategy: Strategy, batch: u64) -> Plan {
    small_gpt2(mesh, strategy, VOCAB, batch)
}

/// Elements a device moves per step, by (group, collective), over the collectives `keep` selects.
fn moved(plan: &Plan, keep: impl Fn(&ReasonKind) -> bool) -> BTreeMap<(Group, CollectiveKind), u64> {
    let mut by = BTreeMap::new();
    for instr in &plan.program {
        let Instr::Collective { collective: c, reason, .. } = instr else { continue };
        if keep(&plan.reasons[*reason as usize].kind) {
            let block = if c.kind == CollectiveKind::AllGather { c.recv } else { c.send };
            *by.entry((c.group, c.kind)).or_default() += plan.buffer(block).elements();
        }
    }
    by
}

/// The vocabulary padded to a multiple of q.
fn padded_vocab(q: u64) -> u64 {
    VOCAB.div_ceil(q) * q
}

/// Parameter elements per device: weights 1/q^2 (the tied table too), biases, norms and the position
/// table 1/q (split over the columns only), the same on every depth layer.
fn parameter_elements(q: u64) -> u64 {
    let (h, f) = (HIDDEN, FFN);
    let weights = 4 * h * h + 2 * h * f;
    // c_attn and c_proj biases, c_fc and the MLP's c_proj biases, two norms of weight and bias.
    let vectors = 3 * h + h + f + h + 4 * h;
    LAYERS * (weights / (q * q) + vectors / q) + padded_vocab(q) * h / (q * q) + CONTEXT * h / q + 2 * h / q
}

#[test]
fn summa_traffic_the_depth_sum_and_memory_equal_the_closed_formulas() {
    // 16 sequences: fewer tokens a depth layer than vocabulary rows; 64: more. The tied head keeps its
    // table in place over 32 tokens a layer (16 sequences over 4 layers, 8 over 2), lays it across the
    // mesh over more.
    for (batch, depth, q) in [(16, 2, 2), (16, 4, 2), (16, 2, 4), (64, 2, 2), (64, 4, 2), (8, 2, 2)] {
        let tokens = batch * SEQ;
        let mesh = Mesh::new(q, q).with_depth(depth);
        let plan = gpt2(mesh, Strategy::Tesseract, batch);
        let (h, f, v) = (HIDDEN, FFN, padded_vocab(q));
        // Per layer, the narrower of each linear's input and output widths, and their in x out products:
        // the three linears that widen or keep their input move its blocks; fc2 (f -> h) has its weight
        // across the mesh and moves its output's blocks (and dY's) instead of its f-wide input's.
        let (narrow, products) = (LAYERS * (3 * h + f.min(h)), LAYERS * (4 * h * h + 2 * h * f));
        // Two activation blocks along the row for each linear's forward, dX and dW together, and one
        // reduced there; each device takes q blocks of tokens / (d q) rows per product.
        let (t, rows) = (tokens / depth, tokens / (depth * q));
        // The tied head, the way that moves least (see docs/2d-parallelism.md). Laid across the mesh
        // (its table's block transposed for the forward and again for dX, its gradient's back), it moves its input's blocks
        // along the row (forward and dE) and reduces dX's there, and moves the table's blocks along the
        // column (forward and dX) and reduces dE's there. Otherwise it moves dY's blocks along the row
        // twice and reduces the logits' there, and along the column moves its table's blocks (twice,
        // and reduces its gradient), or, over fewer tokens a depth layer than vocabulary rows, keeps
        // the table in place and moves the tokens' blocks of its input instead.
        let across_moves = 3 * (t + v) * h * q + 3 * v * h;
        let other_moves = if t < v { 3 * (t * v + t * h) * q } else { 3 * (t * v + v * h) * q };
        let across = across_moves < other_moves;
        let (along_row, head) = match (across, t < v) {
            (true, _) => (h, v * h / q),
            (false, true) => (v, rows * h),
            (false, false) => (v, v * h / q),
        };
        let mut want = BTreeMap::from([
            ((Group::Row, CollectiveKind::Broadcast), 2 * rows * (narrow + along_row)),
            ((Group::Column, CollectiveKind::Broadcast), 2 * (products / q + head)),
            ((Group::Row, CollectiveKind::Reduce), rows * (narrow + along_row)),
            ((Group::Column, CollectiveKind::Reduce), products / q + head),
        ]);
        let summa = moved(&plan, |k| matches!(k, ReasonKind::Summa { .. }));
        assert_eq!(summa, want, "{mesh}: SUMMA elements per device per step");
        let transposed = moved(&plan, |k| matches!(k, ReasonKind::Transpose));
        want.clear();
        if across {
            want.insert((Group::Mirror, CollectiveKind::Transpose), 3 * v * h / (q * q));
        }
        assert_eq!(transposed, want, "{mesh}: the table's transposes");
        // Over the depth: every gradient once, and the loss with its count of targets.
        let depth_sums =
            moved(&plan, |_| true).into_iter().filter(|((g, _), _)| *g == Group::Depth).collect::<Vec<_>>();
        let grads = parameter_elements(q);
        assert_eq!(depth_sums, [((Group::Depth, CollectiveKind::AllReduce), grads + 2)], "{mesh}: over the depth");
        // Weights 1/q^2 whatever the depth; AdamW's two moments; activations 1/(d q^2).
        let m = &plan.memory;
        assert_eq!((m.parameters, m.gradients, m.optimizer_state), (4 * grads, 4 * grads, 8 * grads), "{mesh}");
        // What the backward keeps scales with the batch, but for the count of targets the loss divides
        // by (two float32 scalars kept by every device: its partial count and the count summed).
        let flat = gpt2(Mesh::new(q, q), Strategy::Optimus, batch);
        let counts = 2 * 4;
        let kept = m.activations_kept_for_backward - counts;
        assert_eq!(kept * depth, flat.memory.activations_kept_for_backward - counts, "{mesh}: activations");
        // Each depth layer reads its share of the batch: the token ids whole over its grid (for the
        // vocabulary-parallel lookup), the targets split over the grid rows.
        let read: u64 = plan.buffers.iter().filter(|b| b.role == Role::Input).map(|b| b.bytes()).sum();
        assert_eq!(
            read,
            4 * tokens / depth + 4 * tokens / (depth * q),
            "{mesh}: the tokens and targets a device reads"
        );
    }
}

#[test]
fn three_sizes_are_depth_for_tesseract_and_replicas_for_the_others() {
    let dir = scratch("tesseract", "mesh");
    let plan_of = |flags: &[&str]| -> serde_json::Value {
        let out_path = dir.join("plan.json");
        let args = [&["compile", "examples/tiny.opt", "-o", common::text(&out_path)][..], flags].concat();
        let out = optimusc(&args);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&std::fs::read(&out_path).expect("plan")).expect("JSON")
    };
    let tesseract = plan_of(&["--strategy", "tesseract", "--mesh", "2x2x2"]);
    assert_eq!((tesseract["mesh"]["depth"].as_u64(), tesseract["mesh"]["data"].as_u64()), (Some(2), None));
    let replicas = plan_of(&["--strategy", "tesseract", "--mesh", "3x2x2x2", "--set", "batch=24"]);
    assert_eq!((replicas["mesh"]["depth"].as_u64(), replicas["mesh"]["data"].as_u64()), (Some(2), Some(3)));
    let optimus = plan_of(&["--mesh", "2x2x2"]);
    assert_eq!((optimus["mesh"]["depth"].as_u64(), optimus["mesh"]["data"].as_u64()), (None, Some(2)));
}

/// A plan's strategy reads a `--mesh` given with it: 2x2x2 is the tesseract plan's own mesh, and
/// under another strategy the same sizes are replicas, which the refusal spells out.
#[test]
fn a_mesh_given_with_a_plan_is_read_as_its_strategy_reads_it() {
    let dir = scratch("tesseract", "plan-mesh");
    let plan = dir.join("plan.json");
    let out = optimusc(&[
        "compile",
        "examples/tiny.opt",
        "--strategy",
        "tesseract",
        "--mesh",
        "2x2x2",
        "-o",
        common::text(&plan),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let run = |flags: &[&str]| optimusc(&[&["run", common::text(&plan), "--steps", "1"][..], flags].concat());
    let same = run(&["--mesh", "2x2x2"]);
    assert!(same.status.success(), "{}", String::from_utf8_lossy(&same.stderr));
    let other = run(&["--mesh", "2x2x2", "--strategy", "optimus"]);
    let stderr = String::from_utf8_lossy(&other.stderr);
    assert!(!other.status.success(), "{stderr}");
    let expected = "--mesh 2x2x2 (2 replicas of a 2x2 grid; the plan is for 2 depth layers of a 2x2 grid)";
    assert!(stderr.contains(expected), "{stderr}");
}

#[test]
fn meshes_tesseract_cannot_use_are_clear_errors() {
    let cases: [(&[&str], &str); 3] = [
        (&["--mesh", "2x2x4"], "the tesseract strategy needs a square q x q mesh"),
        (&["--mesh", "2x3x3", "--set", "batch=4"], "cannot be split 6 ways"),
        (&["--mesh", "0x2x2"], "mesh sides must be between 1 and 1024"),
    ];
    for (flags, expected) in cases {
        let args =
            [&["compile", "examples/tiny.opt", "-o", "/dev/null", "--strategy", "tesseract"][..], flags].concat();
        let out = optimusc(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} must fail");
        assert!(stderr.contains(expected), "{flags:?}: expected `{expected}` in\n{stderr}");
        assert!(!stderr.contains("panicked"), "{flags:?}: {stderr}");
    }
}

/// The planner searches 2.5D as optimus with the depth layers as replicas. Without replicas the two
/// plans have the same instructions (kinds, group sizes and payloads), memory and simulated step; with
/// r replicas tesseract sums each gradient over the depth and then over the replicas, where optimus
/// sums it once over d r replicas, so optimus's step is never longer.
#[test]
fn a_tesseract_plan_is_the_optimus_plan_with_its_depth_layers_as_replicas() {
    use optimus::cost::hardware::Hardware;
    use optimus::cost::step::{Options, simulate};
    let hw = Hardware::load("dgx-a100").expect("profile");
    let shape = |plan: &Plan| -> Vec<String> {
        plan.program
            .iter()
            .map(|instr| match instr {
                Instr::Collective { collective: c, .. } => format!(
                    "{} over {} of {} bytes",
                    c.kind.name(),
                    plan.mesh.group_size(c.group),
                    plan.buffer(c.send).bytes()
                ),
                Instr::Kernel { kernel, output, .. } => format!("{kernel:?} into {:?}", plan.buffer(*output).shape),
                other => format!("{other:?}"),
            })
            .collect()
    };
    let step = |plan: &Plan| simulate(plan, &hw, &Options::default()).step_time_s;
    for (depth, q, replicas) in [(2, 2, 1), (4, 2, 1), (2, 2, 2), (2, 2, 4)] {
        let tesseract = gpt2(Mesh::new(q, q).with_depth(depth).with_data(replicas), Strategy::Tesseract, 32);
        let optimus = gpt2(Mesh::new(q, q).with_data(depth * replicas), Strategy::Optimus, 32);
        let what = format!("tesseract {depth}x{q}x{q} with {replicas} replicas");
        assert_eq!(tesseract.memory.peak_bytes, optimus.memory.peak_bytes, "{what}");
        if replicas == 1 {
            assert_eq!(shape(&tesseract), shape(&optimus), "{what}");
            assert_eq!(tesseract.memory, optimus.memory, "{what}");
            assert_eq!(step(&tesseract), step(&optimus), "{what}");
        } else {
            assert!(step(&optimus) <= step(&tesseract), "{what}: {} > {}", step(&optimus), step(&tesseract));
        }
    }
}
