//! 3D tensor parallelism (`--strategy 3d --mesh QxQxQ`, `RxQxQxQ` with replicas) end to end: training
//! on 2x2x2 (with replicas and ZeRO-1 too) gives one device's losses and final weights; GPT-2, BERT
//! and Llama verify there and on 3x3x3 (with recompute and bf16); the products' reduce-scatters and
//! the parameters per device equal closed formulas; meshes that are not cubes are clear errors.

mod common;
mod family;

use common::optimusc;
use family::{CONTEXT, FFN, HIDDEN, LAYERS, SEQ, SMALL, assert_same_training, scratch, small_gpt2, train, verifies};
use optimus::plan::{CollectiveKind, Group, Instr, Mesh, Plan, ReasonKind, Strategy};
use std::collections::BTreeMap;

#[test]
fn training_on_3d_meshes_equals_one_device_with_the_whole_batch() {
    let dir = scratch("3d", "equal");
    let one = train(&["--mesh", "1x1", "--strategy", "none", "--seed", "3"], &dir, "one");
    for (mesh, zero) in [("2x2x2", "0"), ("2x2x2x2", "0"), ("2x2x2x2", "1")] {
        let what = format!("3d {mesh} zero {zero}");
        let flags = ["--strategy", "3d", "--mesh", mesh, "--zero", zero, "--seed", "3"];
        let got = train(&flags, &dir, &what.replace(' ', "-"));
        assert_same_training(&what, &got, &one);
    }
}

#[test]
fn gpt2_bert_and_llama_verify_on_a_cube_with_and_without_replicas() {
    for model in ["examples/gpt2.opt", "examples/bert.opt", "examples/llama.opt"] {
        for mesh in ["2x2x2", "2x2x2x2"] {
            verifies("3d", model, mesh, &SMALL, &[]);
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
    verifies("3d", "examples/gpt2.opt", "3x3x3", &cube, &[]);
}

#[test]
fn recompute_bf16_and_zero_1_verify_on_3d() {
    verifies("3d", "examples/llama.opt", "2x2x2", &SMALL, &["--recompute", "selective"]);
    verifies("3d", "examples/gpt2.opt", "2x2x2x2", &SMALL, &["--recompute", "layers", "--zero", "1"]);
    let bf16 = ["--precision", "bf16", "--recompute", "layers", "--tolerance", "2e-2"];
    verifies("3d", "examples/llama.opt", "2x2x2x2", &SMALL, &bf16);
}

fn gpt2(mesh: Mesh, vocab: u64, batch: u64) -> Plan {
    small_gpt2(mesh, Strategy::ThreeD, vocab, batch)
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
    // Each gathered activation, gradient or weight block is scattered back once: per group, the
    // all-gathers receive what the reduce-scatters send.
    for group in [Group::Row, Group::Column, Group::Depth] {
        let moved = |kind: CollectiveKind| -> u64 {
            plan.program
                .iter()
                .filter_map(|instr| match instr {
                    Instr::Collective { collective: c, .. } if c.group == group && c.kind == kind => {
                        let block = if kind == CollectiveKind::AllGather { c.recv } else { c.send };
                        Some(plan.buffer(block).elements())
                    }
                    _ => None,
                })
                .sum()
        };
        let gathered = moved(CollectiveKind::AllGather);
        assert!(gathered > 0, "{group:?}: something is gathered");
        assert_eq!(gathered, moved(CollectiveKind::ReduceScatter), "{group:?}: gathered as much as scattered");
    }
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

/// Placed by blocks on 8-GPU nodes, a 4x4x4 cube keeps its depth groups (which carry most of 3D's
/// bytes) inside a node: each node holds 4 depth layers of 2 devices of the grid. Tesseract's depth
/// groups carry only gradient sums, so its nodes keep holding blocks of one layer.
#[test]
fn blocks_placement_keeps_the_heaviest_groups_inside_a_node() {
    use optimus::plan::placement::{NodeMap, RankPlacement};
    let cube = gpt2(Mesh::new(4, 4).with_depth(4), 101, 16);
    let map = NodeMap::of_plan(&cube, 8, RankPlacement::Blocks);
    assert_eq!(map.depth_block, 4, "{:?}", map.note);
    assert_eq!(map.block.map(|(a, b)| a * b), Some(2), "with 2 devices of one layer's grid");
    assert!(!map.spans_nodes(Group::Depth), "depth groups inside a node");
    let mut per_node = BTreeMap::new();
    for c in cube.mesh.all_coords() {
        *per_node.entry(map.node_of(c)).or_insert(0) += 1;
    }
    assert_eq!(per_node.len(), 8, "64 devices on 8 nodes");
    assert!(per_node.values().all(|&n| n == 8), "{per_node:?}");
    let tesseract = small_gpt2(Mesh::new(4, 4).with_depth(4), Strategy::Tesseract, 101, 16);
    let map = NodeMap::of_plan(&tesseract, 8, RankPlacement::Blocks);
    assert_eq!(map.depth_block, 1, "tesseract: blocks of one layer");
    assert_eq!(map.block, NodeMap::new(tesseract.mesh, 8, RankPlacement::Blocks).block);
}

/// `simulate --placement auto` (the default) simulates both placements of a mesh that spans nodes and
/// keeps the faster, saying so: blocks for the 3D cube (its depth groups stay inside nodes), and the same
/// step as the better fixed placement for every strategy.
#[test]
fn auto_placement_keeps_the_faster_of_row_major_and_blocks() {
    use optimus::cost::{Hardware, Options, RankPlacement, simulate};
    let hw = Hardware::load("dgx-a100").expect("a built-in profile");
    let plans = [
        small_gpt2(Mesh::new(4, 4).with_depth(4), Strategy::ThreeD, 101, 16),
        small_gpt2(Mesh::new(4, 4).with_depth(4), Strategy::Tesseract, 101, 16),
        small_gpt2(Mesh::new(4, 4), Strategy::Optimus, 101, 16),
    ];
    for plan in &plans {
        let fixed = |placement| simulate(plan, &hw, &Options { placement, ..Options::default() });
        let (row_major, blocks) = (fixed(RankPlacement::RowMajor), fixed(RankPlacement::Blocks));
        let auto = simulate(plan, &hw, &Options { auto_placement: true, ..Options::default() });
        let best = if blocks.step_time_s < row_major.step_time_s { &blocks } else { &row_major };
        assert_eq!(auto.step_time_s, best.step_time_s, "{}: {}", plan.mesh, auto.placement);
        assert_eq!(auto.placement, format!("{} (auto)", best.placement));
        let note = auto.placement_note.as_deref().unwrap_or_default();
        assert!(note.contains("row-major") && note.contains("blocks"), "{}: {note}", plan.mesh);
    }
    let cube = simulate(&plans[0], &hw, &Options { auto_placement: true, ..Options::default() });
    assert_eq!(cube.placement, "blocks (auto)", "{:?}", cube.placement_note);
    let one_node = small_gpt2(Mesh::new(2, 2).with_depth(2), Strategy::ThreeD, 101, 16);
    let auto = simulate(&one_node, &hw, &Options { auto_placement: true, ..Options::default() });
    assert_eq!((auto.placement.as_str(), auto.placement_note), ("row-major (auto)", None), "8 devices fit one node");
}
