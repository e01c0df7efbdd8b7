//! Activation recomputation (`--recompute layers|selective`): runs are bit-identical to keeping every
//! activation (losses, gradient norms and final weights, dropout on, on several meshes and strategies),
//! `layers` costs exactly one extra forward per repeated block in the plan's FLOP count and cuts the kept
//! activations of GPT-2 small by more than 3x, and every recomputed instruction says so in the plan.

mod common;

use optimus::elab::Override;
use optimus::front::check_source;
use optimus::plan::report::kernel_flops;
use optimus::plan::{Instr, MemoryOptions, Mesh, Mode, Plan, Recompute, Strategy};
use optimus::shard::{Target, compile};
use std::path::PathBuf;
use std::process::Command;

fn compile_example(name: &str, sets: &[(&str, &str)], recompute: Recompute, mesh: (u64, u64)) -> Plan {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples").join(format!("{name}.opt"));
    let text = std::fs::read_to_string(path).expect("example");
    let overrides: Vec<Override> =
        sets.iter().map(|(k, v)| Override { name: (*k).to_string(), value: (*v).to_string() }).collect();
    let model = check_source(&text, &overrides).model.expect("the example checks");
    let strategy = if mesh.0 == mesh.1 { Strategy::Optimus } else { Strategy::Megatron };
    let memory = MemoryOptions { recompute: Some(recompute), ..MemoryOptions::DEFAULT };
    let target = Target { memory, ..Target::plain(Mesh::new(mesh.0, mesh.1), strategy, Mode::Train) };
    compile(&model, name, &text, target).expect("compiles and verifies")
}

/// The FLOPs of one instruction (0 for collectives and frees).
fn instr_flops(plan: &Plan, instr: &Instr) -> u64 {
    match instr {
        Instr::Kernel { kernel, inputs, output, .. } => {
            let ins: Vec<_> = inputs.iter().map(|&b| plan.buffer(b)).collect();
            kernel_flops(kernel, &ins, plan.buffer(*output))
        }
        _ => 0,
    }
}

/// The scope of an instruction's origin.
fn scope(plan: &Plan, instr: &Instr) -> String {
    match instr {
        Instr::Kernel { origin, .. } | Instr::Collective { origin, .. } => {
            plan.origins.get(*origin as usize).map(|o| o.scope.clone()).unwrap_or_default()
        }
        Instr::Free { .. } | Instr::Wait { .. } => String::new(),
    }
}

const GPT2_SMALL_AT_1024: [(&str, &str); 3] = [("batch", "8"), ("seq", "1024"), ("context", "1024")];

#[test]
fn layers_keeps_a_third_of_gpt2_smalls_activations_or_less() {
    let none = compile_example("gpt2", &GPT2_SMALL_AT_1024, Recompute::None, (2, 2));
    let layers = compile_example("gpt2", &GPT2_SMALL_AT_1024, Recompute::Layers, (2, 2));
    let (kept_none, kept_layers) =
        (none.memory.activations_kept_for_backward, layers.memory.activations_kept_for_backward);
    assert!(kept_none >= 3 * kept_layers, "kept activations {kept_none} -> {kept_layers}: less than 3x");
    assert!(layers.memory.peak_bytes < none.memory.peak_bytes);
    let selective = compile_example("gpt2", &GPT2_SMALL_AT_1024, Recompute::Selective, (2, 2));
    assert!(selective.memory.activations_kept_for_backward < kept_none, "selective drops the GELU outputs");
}

#[test]
fn layers_costs_one_extra_forward_per_repeated_block() {
    for mesh in [(2, 2), (1, 4)] {
        let sets = [("layers", "3"), ("batch", "4"), ("seq", "64"), ("context", "64"), ("vocab", "1000")];
        let none = compile_example("gpt2", &sets, Recompute::None, mesh);
        let layers = compile_example("gpt2", &sets, Recompute::Layers, mesh);
        let forward_end = none.memory.forward_end;
        let in_block = |s: &str| (0..3).any(|k| s == format!("h.{k}") || s.starts_with(&format!("h.{k}.")));
        let block_forward: u64 = none.program[..forward_end]
            .iter()
            .filter(|i| in_block(&scope(&none, i)))
            .map(|i| instr_flops(&none, i))
            .sum();
        let total = |p: &Plan| p.program.iter().map(|i| instr_flops(p, i)).sum::<u64>();
        assert!(block_forward > 0);
        assert_eq!(total(&layers) - total(&none), block_forward, "{mesh:?}");
        // Every extra instruction is a recomputation, and says of which block.
        let recomputed = layers
            .program
            .iter()
            .filter(|i| match i {
                Instr::Kernel { reason, .. } | Instr::Collective { reason, .. } => {
                    layers.reasons[*reason as usize].recompute.as_ref().is_some_and(|unit| unit.starts_with("h."))
                }
                Instr::Free { .. } | Instr::Wait { .. } => false,
            })
            .count();
        let count = |p: &Plan| p.program.iter().filter(|i| !matches!(i, Instr::Free { .. })).count();
        assert_eq!(count(&layers) - count(&none), recomputed, "{mesh:?}");
    }
}

/// Runs `optimusc run ARGS --json --save-weights OUT` and returns stdout and the saved bytes.
fn run(args: &[&str], out: &str) -> (String, Vec<u8>) {
    let output = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(args)
        .args(["--json", "--save-weights", out])
        .output()
        .expect("optimusc runs");
    assert!(output.status.success(), "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout).lines().map(without_time).collect::<Vec<_>>().join("\n");
    (stdout, std::fs::read(out).expect("saved weights"))
}

/// A record without its timings (which differ run to run).
fn without_time(line: &str) -> String {
    let mut v: serde_json::Value = serde_json::from_str(line).expect("JSON");
    if let Some(o) = v.as_object_mut() {
        o.remove("elapsed_s");
        o.remove("tokens_per_s");
    }
    v.to_string()
}

#[test]
fn recomputation_is_bit_identical_with_dropout_on_every_mesh() {
    let dir = common::process_dir("recompute");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let small = ["--set", "layers=2", "--set", "hidden=32", "--set", "heads=4", "--set", "vocab=101"];
    for example in ["examples/tiny.opt", "examples/gpt2_manual_attention.opt"] {
        for mesh in [&["--mesh", "2x2"][..], &["--mesh", "4x4"], &["--mesh", "1x4", "--strategy", "megatron"]] {
            let mut base = vec!["run", example, "--steps", "3", "--seed", "5", "--set", "pdrop=0.1"];
            base.extend_from_slice(&small);
            base.extend_from_slice(&["--set", "seq=8", "--set", "batch=4", "--set", "context=16"]);
            base.extend_from_slice(mesh);
            let out = |r: &str| dir.join(format!("{r}.safetensors")).to_string_lossy().into_owned();
            let reference = run(&[&base[..], &["--recompute", "none"]].concat(), &out("none"));
            for r in ["layers", "selective"] {
                let got = run(&[&base[..], &["--recompute", r]].concat(), &out(r));
                assert_eq!(got.0, reference.0, "{example} {mesh:?} {r}: records differ");
                assert!(got.1 == reference.1, "{example} {mesh:?} {r}: final weights differ");
            }
        }
    }
}

/// tiny.opt with `edit` applied to its text, compiled on 2x2 with the given flag.
fn tiny_with(edit: (&str, &str), recompute: Option<Recompute>) -> Plan {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/tiny.opt");
    let text = std::fs::read_to_string(path).expect("example").replace(edit.0, edit.1);
    assert!(text.contains("checkpoint"), "the edit applies");
    let model = check_source(&text, &[]).model.expect("the edited model checks");
    let memory = MemoryOptions { recompute, ..MemoryOptions::DEFAULT };
    let target = Target { memory, ..Target::plain(Mesh::new(2, 2), Strategy::Optimus, Mode::Train) };
    compile(&model, "tiny.opt", &text, target).expect("compiles")
}

/// The blocks a plan recomputes, from its reasons.
fn recomputed_blocks(plan: &Plan) -> std::collections::BTreeSet<String> {
    plan.reasons.iter().filter_map(|r| r.recompute.clone()).collect()
}

#[test]
fn the_model_can_mark_blocks_checkpoint_and_the_flag_overrides_it() {
    let repeat = ("layer h       = repeat(layers) Layer()", "layer h       = checkpoint repeat(layers) Layer()");
    let marked = tiny_with(repeat, None);
    assert_eq!(marked.recompute, Recompute::Layers);
    let blocks: Vec<String> = recomputed_blocks(&marked).into_iter().collect();
    assert_eq!(blocks, ["h.0", "h.1"]);
    let flagged = compile_example("tiny", &[], Recompute::Layers, (2, 2));
    assert_eq!(marked.program, flagged.program, "the mark on the repeat is --recompute layers");
    let overridden = tiny_with(repeat, Some(Recompute::None));
    assert!(recomputed_blocks(&overridden).is_empty(), "--recompute none overrides the mark");
    let attention = tiny_with(("block Attention {", "checkpoint block Attention {"), None);
    let blocks: Vec<String> = recomputed_blocks(&attention).into_iter().collect();
    assert_eq!(blocks, ["h.0.attn", "h.1.attn"], "every instance of a checkpoint block, and nothing else");
    assert!(attention.memory.activations_kept_for_backward < overridden.memory.activations_kept_for_backward);
}
