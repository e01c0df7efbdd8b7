//! Structured reasons: every SUMMA step of every example's plan says by its kind which product, step and
//! part it is (and agrees with its text and with the instruction it explains), Megatron's products are
//! local products, recomputed copies keep their kind, and the simulator's SUMMA overlap reads the kind,
//! never the text.

use optimus::cost::{Hardware, Options, simulate};
use optimus::elab::Override;
use optimus::front::check_source;
use optimus::plan::{
    CollectiveKind, Group, Instr, Kernel, MemoryOptions, Mesh, Mode, Plan, Precision, Reason, ReasonKind, Recompute,
    Strategy, SummaPart, SummaProduct,
};
use optimus::shard::{Target, compile};
use std::path::PathBuf;

fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples")
}

/// The names of every example model, sorted.
fn examples() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(examples_dir())
        .expect("examples")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "opt"))
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    names.sort();
    names
}

/// An example with two layers (every example has a `layers` config), compiled for training.
fn compile_example(name: &str, mesh: (u64, u64), memory: MemoryOptions) -> Plan {
    let text = std::fs::read_to_string(examples_dir().join(format!("{name}.opt"))).expect("example");
    let overrides = [Override { name: "layers".to_string(), value: "2".to_string() }];
    let model = check_source(&text, &overrides).model.expect("the example checks");
    let strategy = if mesh.0 == mesh.1 { Strategy::Optimus } else { Strategy::Megatron };
    let target = Target { memory, ..Target::plain(Mesh::new(mesh.0, mesh.1), strategy, Mode::Train) };
    match compile(&model, name, &text, target) {
        Ok(plan) => plan,
        Err(e) => panic!("{name} {mesh:?}: {e:?}"),
    }
}

/// Every kernel and collective with its reason.
fn explained(plan: &Plan) -> Vec<(&Instr, &Reason)> {
    plan.program
        .iter()
        .filter_map(|instr| match instr {
            Instr::Kernel { reason, .. } | Instr::Collective { reason, .. } => {
                Some((instr, &plan.reasons[*reason as usize]))
            }
            Instr::Free { .. } | Instr::Wait { .. } => None,
        })
        .collect()
}

/// What the text of a SUMMA step says it is (product, step, steps, part), read from the words; an
/// independent check of the kind the compiler gives it.
fn summa_in_words(text: &str) -> Option<(SummaProduct, u64, u64, SummaPart)> {
    let rest = &text[text.find(": SUMMA ")? + ": SUMMA ".len()..];
    let (name, rest) = rest.split_at(rest.find(" step ")?);
    let product = match name {
        "AB" => SummaProduct::Ab,
        "ABT" => SummaProduct::Abt,
        "ATB" => SummaProduct::Atb,
        "ABT (B in place)" => SummaProduct::AbtKeepingB,
        "AB (B in place)" => SummaProduct::AbKeepingB,
        "ATB (accumulated)" => SummaProduct::AtbAccumulated,
        "ABT (accumulated)" => SummaProduct::AbtAccumulated,
        "AB (reduced)" => SummaProduct::AbReduced,
        "ATB (B moving)" => SummaProduct::AtbMovingB,
        "AB (B across, in place)" => SummaProduct::AbKeepingBAcross,
        "ABT (B across, in place)" => SummaProduct::AbtKeepingBAcross,
        "ATB (accumulated across)" => SummaProduct::AtbAccumulatedAcross,
        other => panic!("unknown product {other} in `{text}`"),
    };
    let mut words = rest.trim_start().splitn(5, ' ');
    let (_, step, _, steps) = (words.next()?, words.next()?, words.next()?, words.next()?);
    let steps = steps.trim_end_matches(':');
    let part = match words.next()? {
        "broadcast A block along the row" | "broadcast A block along the column" => SummaPart::BroadcastA,
        "broadcast B block along the column" | "broadcast B block along the row" => SummaPart::BroadcastB,
        "multiply" => SummaPart::Multiply,
        "multiply-accumulate" => SummaPart::MultiplyAccumulate,
        "reduce C block along the row" | "reduce C block along the column" => SummaPart::ReduceC,
        other => panic!("unknown part `{other}` in `{text}`"),
    };
    Some((product, step.parse().ok()?, steps.parse().ok()?, part))
}

/// Checks that the instruction is the part of a SUMMA step its kind says: broadcasts of A along the
/// row (the column for ABT keeping B in place and AB keeping a B across in place) and of B along the column (the row for ATB moving B),
/// rooted at the step's member; the product; the reduction of C (along the column for ATB, AB keeping B
/// in place and ATB moving B).
fn assert_instruction_is_its_part(instr: &Instr, product: SummaProduct, step: u64, part: SummaPart, text: &str) {
    let root = Some(step - 1);
    let accumulated = matches!(
        product,
        SummaProduct::Ab
            | SummaProduct::AtbAccumulated
            | SummaProduct::AbtAccumulated
            | SummaProduct::AtbAccumulatedAcross
    );
    match (part, instr) {
        (SummaPart::BroadcastA | SummaPart::BroadcastB, Instr::Collective { collective: c, .. }) => {
            let along_row = match part {
                SummaPart::BroadcastA => !matches!(
                    product,
                    SummaProduct::AbtKeepingB | SummaProduct::AbKeepingBAcross | SummaProduct::AtbAccumulatedAcross
                ),
                _ => matches!(product, SummaProduct::AtbMovingB | SummaProduct::AtbAccumulatedAcross),
            };
            let group = if along_row { Group::Row } else { Group::Column };
            assert_eq!((c.kind, c.group, c.root), (CollectiveKind::Broadcast, group, root), "{text}");
        }
        (SummaPart::ReduceC, Instr::Collective { collective: c, .. }) => {
            let along_column = matches!(
                product,
                SummaProduct::Atb
                    | SummaProduct::AbKeepingB
                    | SummaProduct::AtbMovingB
                    | SummaProduct::AbtKeepingBAcross
            );
            let group = if along_column { Group::Column } else { Group::Row };
            assert_eq!((c.kind, c.group, c.root), (CollectiveKind::Reduce, group, root), "{text}");
        }
        (SummaPart::Multiply, Instr::Kernel { kernel: Kernel::MatMul { accumulate, .. }, .. }) => {
            assert!(!accumulate && !accumulated, "{text}");
        }
        (SummaPart::MultiplyAccumulate, Instr::Kernel { kernel: Kernel::MatMul { accumulate, .. }, .. }) => {
            // Accumulated products add every step after the first; a product whose partials are reduced
            // adds only a later term into the step's partial (input gradients summed before the reduce).
            assert!(if accumulated { *accumulate == (step > 1) } else { *accumulate }, "{text}");
        }
        _ => panic!("`{text}` explains {instr:?}"),
    }
}

/// Checks every SUMMA step of an optimus plan on a q x q mesh; returns how many instructions are steps.
fn check_summa_steps(plan: &Plan, q: u64, what: &str) -> usize {
    let mut steps_seen = 0;
    let mut previous: Option<(SummaProduct, u64)> = None;
    for (instr, reason) in explained(plan) {
        let in_words = summa_in_words(&reason.text);
        let ReasonKind::Summa { product, step, steps, part } = reason.kind else {
            assert_eq!(in_words, None, "{what}: `{}` is {:?}", reason.text, reason.kind);
            if let Instr::Collective { collective: c, .. } = instr {
                let moves_blocks = matches!(c.kind, CollectiveKind::Broadcast | CollectiveKind::Reduce);
                assert!(!moves_blocks, "{what}: a {:?} outside SUMMA: `{}`", c.kind, reason.text);
            }
            continue;
        };
        steps_seen += 1;
        assert_eq!(in_words, Some((product, step, steps, part)), "{what}: `{}`", reason.text);
        assert!(steps == q && (1..=q).contains(&step), "{what}: `{}`", reason.text);
        assert_instruction_is_its_part(instr, product, step, part, &reason.text);
        // Program order: a product's steps run 1 to q; the next product starts again at 1.
        if let Some((p, s)) = previous.filter(|&(_, s)| s != step) {
            let next = p == product && step == s + 1;
            assert!(next || (step == 1 && s == q), "{what}: step {s} of {p:?}, then `{}`", reason.text);
        }
        previous = Some((product, step));
    }
    steps_seen
}

#[test]
fn every_summa_step_of_every_example_says_its_product_step_and_part() {
    let names = examples();
    assert!(names.len() >= 7, "{names:?}");
    for name in &names {
        let plan = compile_example(name, (2, 2), MemoryOptions::DEFAULT);
        let steps = check_summa_steps(&plan, 2, &format!("{name} 2x2"));
        assert!(steps > 0, "{name}: no SUMMA steps");
        let megatron = compile_example(name, (1, 4), MemoryOptions::DEFAULT);
        for (instr, reason) in explained(&megatron) {
            assert!(!matches!(reason.kind, ReasonKind::Summa { .. }), "{name} 1x4: `{}`", reason.text);
            assert_eq!(summa_in_words(&reason.text), None, "{name} 1x4");
            if let Instr::Kernel { kernel: Kernel::MatMul { .. } | Kernel::BatchedMatMul, .. } = instr {
                assert_eq!(reason.kind, ReasonKind::LocalProduct, "{name} 1x4: `{}`", reason.text);
            }
        }
    }
}

/// A small training batch of a wide GPT-2 keeps its weights in place, those across the mesh too: every
/// SUMMA step of those products is the part its reason names (on 2x2 and 4x4).
#[test]
fn every_summa_step_of_a_small_batch_keeping_the_weights_says_its_part() {
    let text = std::fs::read_to_string(examples_dir().join("gpt2.opt")).expect("example");
    let sets = [("layers", "1"), ("hidden", "512"), ("heads", "8"), ("vocab", "512"), ("context", "8"), ("seq", "8")];
    for (q, batch) in [(2, "2"), (4, "4")] {
        let overrides: Vec<Override> = sets
            .iter()
            .chain(&[("batch", batch)])
            .map(|(name, value)| Override { name: name.to_string(), value: value.to_string() })
            .collect();
        let model = check_source(&text, &overrides).model.expect("the example checks");
        let target = Target::plain(Mesh::new(q, q), Strategy::Optimus, Mode::Train);
        let plan = compile(&model, "gpt2", &text, target).unwrap_or_else(|e| panic!("{q}x{q}: {e:?}"));
        assert!(check_summa_steps(&plan, q, &format!("gpt2 small batch {q}x{q}")) > 0);
        for product in [SummaProduct::AbtKeepingBAcross, SummaProduct::AtbAccumulatedAcross] {
            let used = explained(&plan)
                .iter()
                .any(|(_, r)| matches!(r.kind, ReasonKind::Summa { product: p, .. } if p == product));
            assert!(used, "{q}x{q}: no {product:?} step");
        }
    }
}

/// Recomputed copies keep the kind of what they recompute and name their block; bf16 casts say so.
#[test]
fn recomputed_and_bf16_instructions_keep_their_kinds() {
    for q in [2, 4] {
        let memory = MemoryOptions { recompute: Some(Recompute::Layers), precision: Precision::Bf16, zero: 0 };
        let plan = compile_example("gpt2", (q, q), memory);
        assert!(check_summa_steps(&plan, q, &format!("gpt2 {q}x{q} bf16 layers")) > 0);
        let mut recomputed_steps = 0;
        for (instr, reason) in explained(&plan) {
            match &reason.recompute {
                Some(unit) => {
                    assert!(reason.text.starts_with(&format!("recompute of {unit}: ")), "{}", reason.text);
                    recomputed_steps += usize::from(matches!(reason.kind, ReasonKind::Summa { .. }));
                }
                None => assert!(!reason.text.starts_with("recompute of "), "{}", reason.text),
            }
            if let Instr::Kernel { kernel: Kernel::Cast, .. } = instr {
                assert_eq!(reason.kind, ReasonKind::Cast, "{}", reason.text);
            }
        }
        assert!(recomputed_steps > 0, "the recomputed blocks' linears are SUMMA steps too");
    }
}

/// The plan with `edit` applied to every reason.
fn with_reasons(plan: &Plan, edit: impl Fn(&mut Reason)) -> Plan {
    let mut edited = plan.clone();
    edited.reasons.iter_mut().for_each(edit);
    edited
}

#[test]
fn the_simulator_overlaps_summa_steps_by_their_kind_not_their_text() {
    let hw = Hardware::load("dgx-a100").expect("built-in profile");
    let options = Options::default();
    assert!(options.overlap);
    for name in ["gpt2", "bert", "llama"] {
        let plan = compile_example(name, (4, 4), MemoryOptions::DEFAULT);
        let base = simulate(&plan, &hw, &options);
        assert!(base.hidden_communication_s > 0.0, "{name}: {base:?}");
        // Words mean nothing to it: the same numbers with every text replaced.
        let words = with_reasons(&plan, |r| r.text = "SUMMA AB step 1 of 4: somewhere".to_string());
        assert_eq!(simulate(&words, &hw, &options), base, "{name}");
        // Without the kinds nothing hides behind a product; the same work is done.
        let unkind = with_reasons(&plan, |r| {
            if matches!(r.kind, ReasonKind::Summa { .. }) {
                r.kind = ReasonKind::Compute;
            }
        });
        let sim = simulate(&unkind, &hw, &options);
        assert_eq!(sim.hidden_communication_s, 0.0, "{name}");
        assert_eq!((sim.compute_s, sim.communication_s), (base.compute_s, base.communication_s), "{name}");
        assert!(sim.step_time_s > base.step_time_s, "{name}");
        // Steps that do not follow one another hide nothing either: a step hides behind the one before it.
        let one_step = with_reasons(&plan, |r| {
            if let ReasonKind::Summa { step, .. } = &mut r.kind {
                *step = 1;
            }
        });
        assert_eq!(simulate(&one_step, &hw, &options).hidden_communication_s, 0.0, "{name}");
        // Not double-buffered: no hiding at all, whatever the kinds say.
        let serial = simulate(&plan, &hw, &Options { overlap: false, ..options });
        assert_eq!(serial.hidden_communication_s, 0.0, "{name}");
        assert_eq!(serial.step_time_s, sim.step_time_s, "{name}");
    }
}
