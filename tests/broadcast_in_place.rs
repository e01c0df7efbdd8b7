//! Broadcasts read in place (devices as threads of one process): the same arithmetic as copying each
//! broadcast into its receive buffer first, so every loss and every saved weight is bit for bit the
//! same with `OPTIMUS_BROADCAST_IN_PLACE=off`, on SUMMA meshes with replicas, depth, 3D, bf16,
//! recomputation, overlapped collectives and accumulation.

mod common;

use common::{read_weights, scratch, text};
use std::process::Command;

/// The losses an `optimusc run ... --json` printed and the weights it saved, with or without
/// broadcasts read in place.
fn run(args: &[&str], in_place: bool, weights: &std::path::Path) -> (Vec<String>, Vec<(String, Vec<f32>)>) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_optimusc"));
    command.args(args).args(["--json", "--save-weights", text(weights)]);
    if !in_place {
        command.env("OPTIMUS_BROADCAST_IN_PLACE", "off");
    }
    let out = command.output().expect("optimusc runs");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let losses = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|r| r.get("loss").map(|v| v.to_string()))
        .collect();
    (losses, read_weights(weights))
}

#[test]
fn reading_broadcasts_in_place_changes_no_bit() {
    let dir = scratch("in-place", "runs");
    let model = ["run", "examples/gpt2.opt", "--set", "layers=2", "--set", "hidden=64", "--set", "heads=4"];
    let model = [&model[..], &["--set", "vocab=500", "--set", "seq=32", "--set", "batch=4", "--steps", "3"]].concat();
    let cases: [&[&str]; 7] = [
        &["--mesh", "2x2"],
        &["--mesh", "2x2x2", "--clip-grad-norm", "0.5"],
        &["--mesh", "2x2x2", "--strategy", "tesseract", "--accum", "2"],
        &["--mesh", "2x2x2", "--strategy", "3d"],
        &["--mesh", "2x2", "--precision", "bf16"],
        &["--mesh", "2x2", "--recompute", "layers", "--overlap"],
        &["--mesh", "4x4"],
    ];
    for (k, case) in cases.iter().enumerate() {
        let args = [&model[..], case].concat();
        let (a, b) = (dir.join(format!("{k}-in-place.safetensors")), dir.join(format!("{k}-copied.safetensors")));
        let (in_place, copied) = (run(&args, true, &a), run(&args, false, &b));
        assert_eq!(in_place.0.len(), 3, "{case:?}: {:?}", in_place.0);
        assert_eq!(in_place.0, copied.0, "{case:?}: the losses");
        assert_eq!(in_place.1.len(), copied.1.len());
        for ((name, x), (_, y)) in in_place.1.iter().zip(&copied.1) {
            let same = x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "{case:?}: `{name}` differs");
        }
    }
}

#[test]
fn every_summa_step_of_a_2x2_plan_is_read_in_place_unless_its_product_could_write_a_root_block() {
    use optimus::plan::phases::StepPhases;
    use optimus::plan::{CollectiveKind, Instr, Mesh, Mode, Strategy};
    let source = include_str!("../examples/tiny.opt");
    let checked = optimus::front::check_source(source, &[]);
    let Some(model) = checked.model else { panic!("tiny.opt checks") };
    let target = optimus::shard::Target::plain(Mesh::new(2, 2), Strategy::Optimus, Mode::Train);
    let plan = optimus::shard::compile(&model, "tiny", source, target).unwrap_or_else(|e| panic!("{e:?}"));
    let phases = StepPhases::of(&plan);
    let groups = optimus::runtime::exec::in_place_groups(&plan, &phases, &|_, _| false);
    let broadcasts: Vec<usize> = (0..plan.program.len())
        .filter(|&k| matches!(&plan.program[k], Instr::Collective { collective: c, .. } if c.kind == CollectiveKind::Broadcast))
        .collect();
    assert!(!broadcasts.is_empty());
    // Groups do not overlap, each ends with the product reading every broadcast's result, and every
    // broadcast of the plan is in one (the SUMMA steps of tiny.opt's linears, forward and backward).
    let mut grouped = Vec::new();
    let mut next_free = 0;
    for (start, group) in groups.iter().enumerate() {
        let Some(group) = group else { continue };
        if start < next_free {
            continue;
        }
        let Instr::Kernel { inputs, .. } = &plan.program[group.kernel] else { panic!("a kernel ends a group") };
        for &b in &group.broadcasts {
            let Instr::Collective { collective: c, .. } = &plan.program[b] else { panic!("a broadcast") };
            assert!(inputs.contains(&c.recv), "the product reads broadcast {b}'s result");
        }
        grouped.extend(group.broadcasts.iter().copied());
        next_free = group.kernel + 1;
    }
    assert_eq!(grouped, broadcasts);
    // A product that may write where a root's block is makes no group: those broadcasts copy.
    assert!(optimus::runtime::exec::in_place_groups(&plan, &phases, &|_, _| true).iter().all(Option::is_none));
}
