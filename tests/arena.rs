//! The arena layout of every example plan: buffers alive at the same time never share words (checked
//! by an independent sweep of the program), and the arena is within 10% of the plan's memory peak.

use optimus::elab::Override;
use optimus::front::check_source;
use optimus::plan::memory::persistent;
use optimus::plan::{Instr, Mesh, Mode, Plan, Strategy};
use optimus::runtime::arena::{self, ArenaLayout};
use optimus::shard::{Target, compile};

const EXAMPLES: [&str; 5] = [
    "examples/tiny.opt",
    "examples/gpt2.opt",
    "examples/gpt2_manual_attention.opt",
    "examples/bert.opt",
    "examples/gpt3.opt",
];

const TARGETS: [((u64, u64), Strategy); 4] =
    [((1, 1), Strategy::None), ((2, 2), Strategy::Optimus), ((1, 2), Strategy::Megatron), ((1, 4), Strategy::Megatron)];

fn plan(file: &str, mesh: (u64, u64), strategy: Strategy, mode: Mode) -> Plan {
    let source = std::fs::read_to_string(file).expect("example exists");
    let overrides = vec![Override { name: "layers".into(), value: "2".into() }];
    let model = check_source(&source, &overrides).model.expect("example checks");
    let target = Target::plain(Mesh::new(mesh.0, mesh.1), strategy, mode);
    match compile(&model, file, &source, target) {
        Ok(p) => p,
        Err(d) => panic!("{file} does not compile: {}", optimus::diag::render_plain(file, &source, &d)),
    }
}

/// The word range of a buffer in the layout.
fn range(plan: &Plan, layout: &ArenaLayout, id: usize) -> (usize, usize) {
    let start = layout.offsets[id].unwrap_or_else(|| panic!("`{}` is alive but has no place", plan.buffers[id].name));
    (start, start + arena::words(&plan.buffers[id]))
}

/// Sweeps the program keeping the set of live buffers (persistent ones always; others from the first
/// instruction that touches them to their `Free`, or for good) and checks at every instruction that
/// no two live buffers overlap and that every range lies within the arena.
fn check_no_live_overlap(plan: &Plan, layout: &ArenaLayout, what: &str) {
    let mut live: Vec<bool> = plan.buffers.iter().map(|b| persistent(b.role)).collect();
    for (index, instr) in plan.program.iter().enumerate() {
        for id in optimus::plan::memory::touched(instr) {
            live[id.0 as usize] = true;
        }
        let mut ranges: Vec<(usize, usize, usize)> = (0..plan.buffers.len())
            .filter(|&b| live[b])
            .map(|b| range(plan, layout, b))
            .enumerate()
            .filter(|(_, (s, e))| e > s)
            .map(|(k, (s, e))| (s, e, k))
            .collect();
        ranges.sort_unstable();
        for pair in ranges.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "{what}: at instruction {index}, live buffers overlap: {pair:?}");
        }
        assert!(ranges.iter().all(|r| r.1 <= layout.total), "{what}: a buffer lies past the arena");
        if let Instr::Free { buffer } = instr
            && !persistent(plan.buffer(*buffer).role)
        {
            live[buffer.0 as usize] = false;
        }
    }
}

#[test]
fn live_buffers_never_share_words_and_the_arena_is_within_ten_percent_of_the_peak() {
    let mut worst = 0.0f64;
    for file in EXAMPLES {
        for (mesh, strategy) in TARGETS {
            for mode in [Mode::Train, Mode::Infer] {
                let plan = plan(file, mesh, strategy, mode);
                let what = format!("{file} {}x{} {strategy:?} {mode:?}", mesh.0, mesh.1);
                let layout = arena::layout(&plan);
                check_no_live_overlap(&plan, &layout, &what);
                assert!(plan.buffers.iter().all(|b| b.dtype.bytes() == 4), "{what}: a buffer is not 4 bytes wide");
                let ratio = (layout.total * 4) as f64 / plan.memory.peak_bytes as f64;
                println!("{what}: arena {} B, peak {} B, ratio {ratio:.4}", layout.total * 4, plan.memory.peak_bytes);
                assert!(ratio <= 1.1, "{what}: the arena is {ratio:.3}x the plan's peak");
                worst = worst.max(ratio);
            }
        }
    }
    println!("worst ratio {worst:.4}");
}

/// A decoding step of `seq` positions with caches of `context`, compiled as generate compiles its
/// prefill (`seq` > 1, the head on the last position) and decode (`seq` = 1) programs.
fn decoding_plan(file: &str, seq: u64, mesh: (u64, u64), strategy: Strategy) -> Plan {
    let source = std::fs::read_to_string(file).expect("example exists");
    let seq = seq.to_string();
    let mut values = vec![("layers", "2"), ("hidden", "64"), ("heads", "4"), ("vocab", "97"), ("batch", "4")];
    values.extend([("seq", seq.as_str()), ("context", "64")]);
    if file.contains("llama") {
        values.extend([("kv_heads", "2"), ("ffn", "96")]);
    }
    let overrides: Vec<Override> =
        values.into_iter().map(|(name, value)| Override { name: name.into(), value: value.into() }).collect();
    let checked = check_source(&source, &overrides);
    let model = checked.model.unwrap_or_else(|| panic!("{file}: {:?}", checked.diagnostics));
    let step = optimus::decode::with_cache(&model, 40).expect("a causal model");
    let step = optimus::decode::last_position_head(&step).unwrap_or(step);
    let target = Target::plain(Mesh::new(mesh.0, mesh.1), strategy, Mode::Infer);
    compile(&step, file, &source, target)
        .unwrap_or_else(|d| panic!("{}", optimus::diag::render_plain(file, &source, &d)))
}

/// generate's prefill and decode programs place every parameter and cache at the same offsets, so a
/// device's storage passes from one to the other without a copy; plans on another mesh do not.
#[test]
fn prefill_and_decode_programs_place_parameters_and_caches_alike() {
    for file in ["examples/gpt2.opt", "examples/llama.opt"] {
        for (mesh, strategy) in [((1, 1), Strategy::None), ((2, 2), Strategy::Optimus), ((1, 2), Strategy::Megatron)] {
            let (prefill, decode) = (decoding_plan(file, 7, mesh, strategy), decoding_plan(file, 1, mesh, strategy));
            let (pl, dl) = (arena::layout(&prefill), arena::layout(&decode));
            assert!(arena::places_alike((&prefill, &pl), (&decode, &dl)), "{file} {mesh:?}");
            assert!(prefill.buffers.iter().any(|b| b.role == optimus::plan::Role::Cache));
        }
        let (one, four) =
            (decoding_plan(file, 1, (1, 1), Strategy::None), decoding_plan(file, 1, (2, 2), Strategy::Optimus));
        assert!(!arena::places_alike((&one, &arena::layout(&one)), (&four, &arena::layout(&four))), "{file}");
    }
}

/// Two plans that place a parameter at the same offset with the same size but lay it out differently
/// (the same bytes hold another block of the tensor) do not place it alike: handing the storage over
/// would silently swap blocks.
#[test]
fn a_parameter_laid_out_differently_is_not_placed_alike() {
    let prefill = decoding_plan("examples/gpt2.opt", 7, (2, 2), Strategy::Optimus);
    let mut transposed = prefill.clone();
    let param = transposed.params.iter().map(|p| p.buffer).find(|&b| {
        let layout = transposed.buffer(b).layout;
        layout.mirrored().is_some_and(|m| m != layout)
    });
    let param = param.expect("a parameter split over the rows and the columns");
    let buffer = &mut transposed.buffers[param.0 as usize];
    buffer.layout = buffer.layout.mirrored().expect("a mirror");
    let layout = arena::layout(&prefill);
    assert_eq!(arena::layout(&transposed).offsets, layout.offsets, "the same offsets and sizes");
    assert!(arena::places_alike((&prefill, &layout), (&prefill, &layout)));
    assert!(!arena::places_alike((&prefill, &layout), (&transposed, &arena::layout(&transposed))));
}
