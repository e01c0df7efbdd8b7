//! Plans are not trusted: a hand-edited or corrupted plan is refused by the verifier with a message
//! naming what is wrong (never run to a panic, an abort or a wrong answer), a plan this machine cannot
//! run (too many device threads, too much memory) is refused before it starts, and `read_plan` refuses
//! files that are not plans (devices, FIFOs, directories, oversized files) without reading them.

use optimus::elab::Override;
use optimus::front::check_source;
use optimus::io::plan_file::{MAX_PLAN_BYTES, read_plan};
use optimus::plan::verify::verify;
use optimus::plan::{Mesh, Mode, Plan, Strategy};
use optimus::runtime::limits::{MAX_DEVICE_THREADS, available_memory, check_host_can_run, peak_bytes_per_device};
use optimus::shard::{Target, compile};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

// ---- helpers ----------------------------------------------------------------------------------------

fn example_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(format!("{name}.opt"))
}

/// Compiles `examples/<name>.opt` with config overrides for a target; the compiler verifies it.
fn try_compile(
    name: &str,
    sets: &[(&str, &str)],
    strategy: Strategy,
    mesh: (u64, u64),
    mode: Mode,
) -> Result<Plan, String> {
    let text = std::fs::read_to_string(example_path(name)).map_err(|e| e.to_string())?;
    let overrides: Vec<Override> =
        sets.iter().map(|(k, v)| Override { name: (*k).to_string(), value: (*v).to_string() }).collect();
    let checked = check_source(&text, &overrides);
    let model = checked.model.ok_or_else(|| format!("{name} does not check: {:?}", checked.diagnostics))?;
    let target = Target::plain(Mesh::new(mesh.0, mesh.1), strategy, mode);
    compile(&model, &format!("examples/{name}.opt"), &text, target)
        .map_err(|d| format!("{name} {} {}x{} {mode:?}: {d:?}", strategy.name(), mesh.0, mesh.1))
}

/// The tiny GPT on a 2x2 optimus mesh, training, as JSON.
fn tiny_2x2() -> Value {
    let plan = try_compile("tiny", &[], Strategy::Optimus, (2, 2), Mode::Train).expect("tiny compiles on 2x2");
    serde_json::to_value(plan).expect("a plan serialises")
}

/// A small GPT whose attention is spelled out (reshape, transpose, select, slice), on 2x2.
fn manual_attention_2x2() -> Value {
    let sets = [
        ("vocab", "101"),
        ("context", "16"),
        ("seq", "8"),
        ("batch", "4"),
        ("layers", "1"),
        ("heads", "4"),
        ("hidden", "32"),
    ];
    let plan = try_compile("gpt2_manual_attention", &sets, Strategy::Optimus, (2, 2), Mode::Train)
        .expect("the manual-attention GPT compiles on 2x2");
    serde_json::to_value(plan).expect("a plan serialises")
}

/// The kernels of a given kind in a plan's JSON, mutably.
fn kernels_of<'v>(plan: &'v mut Value, kind: &str) -> Vec<&'v mut Value> {
    let program = plan["program"].as_array_mut().expect("a program");
    let found: Vec<&mut Value> = program
        .iter_mut()
        .filter(|i| i["instr"] == "kernel" && i["kernel"]["kind"] == kind)
        .map(|i| &mut i["kernel"])
        .collect();
    assert!(!found.is_empty(), "the plan has no `{kind}` kernel");
    found
}

/// The verifier's errors for a mutated plan (which must still deserialise).
fn verify_errors(plan: &Value) -> Vec<String> {
    let plan: Plan = serde_json::from_value(plan.clone()).expect("the mutation keeps the plan's types");
    match verify(&plan) {
        Ok(()) => Vec::new(),
        Err(errors) => errors,
    }
}

/// Asserts that verification fails with an error containing every one of `needles`.
fn assert_refused(plan: &Value, needles: &[&str]) -> String {
    let errors = verify_errors(plan);
    let found = errors.iter().find(|e| needles.iter().all(|n| e.contains(n)));
    match found {
        Some(e) => e.clone(),
        None => panic!("expected an error containing {needles:?}, got {errors:#?}"),
    }
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("plan_trust_{name}_")).tempdir().expect("a temporary directory")
}

fn write_json(dir: &Path, name: &str, plan: &Value) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_vec(plan).expect("JSON")).expect("write the plan");
    path
}

/// Runs optimusc with a deadline (the child is killed past it and the test fails): nothing may hang.
fn optimusc(args: &[&str], deadline: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(args)
        .env_remove("OPTIMUS_SKIP_MEMORY_CHECK")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("optimusc starts");
    let start = Instant::now();
    while child.try_wait().expect("wait for optimusc").is_none() {
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("optimusc {args:?} did not finish within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("optimusc's output")
}

/// An exit with status 1 and an error containing `needle`; never a panic or an abort.
fn assert_clean_failure(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit status (101 is a panic, 134 an abort); stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "a panic: {stderr}");
    assert!(stderr.contains(needle), "expected `{needle}` in: {stderr}");
}

const HUGE: u64 = 1 << 62;

// ---- offsets --------------------------------------------------------------------------------------

/// What a plan says it was compiled for, which `inspect` prints and `simulate` costs, must agree with
/// what it holds: a strategy edited to one that cannot use the mesh, replicas added to a plan that sums
/// nothing over them, and a precision edited either way are refused.
#[test]
fn the_recorded_strategy_replicas_and_precision_must_agree_with_the_program() {
    assert!(verify_errors(&tiny_2x2()).is_empty());
    for strategy in ["megatron", "none", "3d"] {
        let mut plan = tiny_2x2();
        plan["strategy"] = json!(strategy);
        assert_refused(&plan, &[&format!("the plan says it is a {strategy} plan for a 2x2 mesh")]);
    }
    let mut plan = tiny_2x2();
    plan["mesh"]["data"] = json!(2);
    assert_refused(&plan, &["2 data-parallel replicas, and nothing in the program sums over them"]);
    let mut plan = tiny_2x2();
    plan["precision"] = json!("bf16");
    assert_refused(&plan, &["the plan says bf16, and it holds no bf16 buffer"]);
    // A bf16 plan verifies as compiled, and not once it says f32.
    let text = std::fs::read_to_string(example_path("tiny")).expect("tiny.opt");
    let model = check_source(&text, &[]).model.expect("tiny checks");
    let mut target = Target::plain(Mesh::new(2, 2), Strategy::Optimus, Mode::Train);
    target.memory.precision = optimus::plan::Precision::Bf16;
    let bf16 = compile(&model, "examples/tiny.opt", &text, target).expect("tiny compiles in bf16");
    let mut plan = serde_json::to_value(bf16).expect("JSON");
    assert!(verify_errors(&plan).is_empty(), "{:#?}", verify_errors(&plan));
    plan["precision"] = json!("f32");
    assert_refused(&plan, &["the plan says f32, and it holds bf16 buffers"]);
}

#[test]
fn every_offset_block_set_to_two_to_the_62_is_refused_by_name() {
    let mut plan = tiny_2x2();
    let program = plan["program"].as_array_mut().expect("a program");
    for instr in program.iter_mut().filter(|i| i["kernel"].get("offset").is_some()) {
        instr["kernel"]["offset"]["block"] = json!(HUGE);
    }
    let lookup = assert_refused(&plan, &["embedding lookup", "offset.block 4611686018427387904", "`wte.weight`"]);
    assert!(lookup.contains("tiny.opt:") && lookup.contains("`wte`"), "the source line and scope: {lookup}");
    assert_refused(&plan, &["embedding grad", "offset.block 4611686018427387904"]);
    assert_refused(&plan, &["cross entropy max", "offset.block 4611686018427387904", "vocabulary columns"]);
    assert_refused(&plan, &["cross entropy grad", "offset.block 4611686018427387904"]);
}

#[test]
fn an_offset_block_off_by_one_is_refused_with_the_expected_block() {
    let mut plan = tiny_2x2();
    let mut lookups = kernels_of(&mut plan, "embedding_lookup");
    let block = lookups[0]["offset"]["block"].as_u64().expect("a block");
    lookups[0]["offset"]["block"] = json!(block - 1);
    let e = assert_refused(&plan, &["embedding lookup", "does not follow from `wte.weight`"]);
    assert!(e.contains(&format!("expected mesh axis 0 x block {block}")), "{e}");

    let mut plan = tiny_2x2();
    kernels_of(&mut plan, "cross_entropy_stats")[0]["offset"]["block"] = json!(block - 1);
    assert_refused(&plan, &["cross entropy stats", "does not follow from the logits"]);
}

#[test]
fn an_offset_on_the_wrong_axis_or_unmasked_is_refused() {
    let mut plan = tiny_2x2();
    kernels_of(&mut plan, "embedding_grad")[0]["offset"]["axis"] = json!(1);
    assert_refused(&plan, &["embedding grad", "expected mesh axis 0"]);

    let mut plan = tiny_2x2();
    kernels_of(&mut plan, "embedding_lookup")[0]["offset"]["axis"] = json!(7);
    assert_refused(&plan, &["embedding lookup", "mesh axis 7"]);

    let mut plan = tiny_2x2();
    kernels_of(&mut plan, "embedding_lookup")[0]["masked"] = json!(false);
    assert_refused(&plan, &["embedding lookup", "`masked` must be true"]);
}

// ---- shapes and sizes -----------------------------------------------------------------------------

#[test]
fn a_billion_element_buffer_is_refused() {
    let mut plan = tiny_2x2();
    plan["buffers"][5]["shape"] = json!([1_000_000_000u64]);
    let name = plan["buffers"][5]["name"].as_str().expect("a name").to_string();
    assert_refused(&plan, &[&format!("buffer `{name}`"), "[1000000000]"]);

    // Logical and block shapes agreeing does not help: every kernel that touches it disagrees.
    let mut plan = tiny_2x2();
    let (logical, layout) = (json!([1_000_000_000u64]), json!([{ "kind": "replicate" }, { "kind": "replicate" }]));
    let buffer = &mut plan["buffers"][5];
    buffer["shape"] = logical.clone();
    buffer["logical_shape"] = logical;
    buffer["layout"] = layout;
    assert!(!verify_errors(&plan).is_empty(), "a resized buffer must not verify");
}

#[test]
fn shapes_whose_sizes_overflow_are_refused() {
    let mut plan = tiny_2x2();
    let buffer = &mut plan["buffers"][5];
    buffer["logical_shape"] = json!([HUGE, HUGE]);
    buffer["shape"] = json!([HUGE, HUGE]);
    buffer["layout"] = json!([{ "kind": "replicate" }, { "kind": "replicate" }]);
    assert_refused(&plan, &["its logical shape [4611686018427387904, 4611686018427387904] has more elements"]);
    assert_refused(&plan, &["its block [4611686018427387904, 4611686018427387904] has more elements"]);
}

#[test]
fn a_parameter_shape_of_two_to_the_62_is_refused() {
    let mut plan = tiny_2x2();
    plan["params"][0]["shape"] = json!([HUGE]);
    assert_refused(&plan, &["parameter `wte.weight`", "[4611686018427387904]", "does not match its buffer"]);
}

#[test]
fn inputs_padding_and_optimizer_state_must_agree_with_their_buffers() {
    let mut plan = tiny_2x2();
    plan["inputs"][0]["shape"] = json!([8, 9]);
    assert_refused(&plan, &["input `tokens`", "[8, 9]"]);

    let mut plan = tiny_2x2();
    plan["padding"][0]["padded"] = json!(HUGE);
    assert_refused(&plan, &["padding record 0", "`wte.weight`"]);

    let mut plan = tiny_2x2();
    plan["padding"][0]["tensor"] = json!("nothing");
    assert_refused(&plan, &["padding record 0", "no parameter has that name"]);

    let mut plan = tiny_2x2();
    let state = plan["params"][0]["state"][0].as_u64().expect("a state buffer") as usize;
    plan["buffers"][state]["layout"] = json!([{ "kind": "replicate" }, { "kind": "replicate" }]);
    plan["buffers"][state]["shape"] = plan["buffers"][state]["logical_shape"].clone();
    assert_refused(&plan, &["parameter `wte.weight`", "is not shaped like its buffer"]);
}

#[test]
fn the_gradient_norm_and_the_optimizer_steps_must_name_what_the_plan_declares() {
    // A gradient norm that is no buffer, or a buffer that is not one float32 value: `run` read it as
    // the norm (and panicked on an index past the buffers).
    let mut plan = tiny_2x2();
    let buffers = plan["buffers"].as_array().expect("buffers").len();
    plan["grad_norm"] = json!(buffers);
    assert_refused(&plan, &[&format!("buffer {buffers} is referenced but does not exist")]);
    for (id, what) in [(0, "F32 [51, 16]"), (1, "I32")] {
        let mut plan = tiny_2x2();
        plan["grad_norm"] = json!(id);
        assert_refused(&plan, &["the gradient norm's buffer", "is not one float32 value", what]);
    }
    // An optimizer step whose parameter record lost its state: the run would never create the state.
    let mut plan = tiny_2x2();
    plan["params"][0]["state"] = json!([]);
    assert_refused(&plan, &["(optimizer step) reads", "parameter `wte.weight`", "state []"]);
    // A gradient of another element type names both types.
    let mut plan = tiny_2x2();
    let grad = plan["params"][0]["grad"].as_u64().expect("a gradient buffer") as usize;
    plan["buffers"][grad]["dtype"] = json!("i32");
    assert_refused(&plan, &["is not shaped like its buffer", "I32", "F32"]);
}

#[test]
fn a_split_that_does_not_divide_is_refused() {
    let mut plan = tiny_2x2();
    // wte.weight is [102, 32] split (S(0), S(1)) into [51, 16]; 101 rows cannot be halved.
    let k = plan["params"][0]["buffer"].as_u64().expect("a buffer id") as usize;
    assert_eq!(plan["buffers"][k]["name"], "wte.weight");
    plan["buffers"][k]["logical_shape"] = json!([101, 32]);
    plan["buffers"][k]["shape"] = json!([50, 16]);
    assert_refused(&plan, &["buffer `wte.weight`", "does not split evenly over 2 devices"]);
}

#[test]
fn a_split_gathered_or_cut_around_another_axis_split_of_the_same_dimension_is_refused() {
    let shard = |dim: u64| json!({ "kind": "shard", "dim": dim, "outer": 1, "inner": 1 });
    // Gathering over the mesh rows (axis 0) a dimension that the columns (axis 1) also split: the
    // gathered blocks would not be contiguous ranges of it.
    let mut plan = tiny_2x2();
    let program = plan["program"].as_array().expect("a program");
    let gather = program
        .iter()
        .find(|i| {
            i["instr"] == "collective"
                && i["collective"]["kind"] == "all_gather"
                && i["collective"]["group"] == "column"
        })
        .expect("a gather over the column");
    let send = gather["collective"]["send"].as_u64().expect("a buffer id") as usize;
    assert_eq!(plan["buffers"][send]["layout"][0], shard(0), "the rows split dimension 0");
    assert_eq!(plan["buffers"][send]["logical_shape"], json!([8, 8, 32]));
    plan["buffers"][send]["layout"] = json!([shard(0), shard(0)]);
    plan["buffers"][send]["shape"] = json!([2, 8, 32]);
    assert_refused(&plan, &["is split along mesh axis 0 around a split of the same dimension by mesh axis 1"]);
    // Cutting along the rows a dimension that the columns already split.
    let mut plan = manual_attention_2x2();
    let program = plan["program"].as_array().expect("a program");
    let at = program.iter().position(|i| i["kernel"]["kind"] == "slice_shard").expect("a slice");
    let (input, output) = (program[at]["inputs"][0].as_u64(), program[at]["output"].as_u64());
    let (input, output) = (input.expect("an input") as usize, output.expect("an output") as usize);
    assert_eq!(plan["buffers"][input]["logical_shape"], json!([4, 4, 8, 8]));
    plan["program"][at]["kernel"]["axis"] = json!(0);
    plan["buffers"][input]["layout"] = json!([{ "kind": "replicate" }, shard(1)]);
    plan["buffers"][input]["shape"] = json!([4, 2, 8, 8]);
    plan["buffers"][output]["layout"] = json!([shard(1), shard(1)]);
    plan["buffers"][output]["shape"] = json!([4, 1, 8, 8]);
    assert_refused(&plan, &["is cut along mesh axis 0 where mesh axis 1 already splits the same dimension inside it"]);
}

#[test]
fn a_transpose_must_swap_the_grids_placements_over_mirror_groups() {
    // 128 tokens over a 101-row table 32 wide: the tied head lays its table across the mesh.
    let sets = [
        ("vocab", "101"),
        ("context", "16"),
        ("seq", "16"),
        ("batch", "8"),
        ("layers", "1"),
        ("heads", "4"),
        ("hidden", "32"),
    ];
    let compiled = try_compile("gpt2", &sets, Strategy::Optimus, (2, 2), Mode::Train).expect("GPT-2 compiles on 2x2");
    let plan = serde_json::to_value(compiled).expect("a plan serialises");
    let program = plan["program"].as_array().expect("a program");
    let at = program
        .iter()
        .position(|i| i["instr"] == "collective" && i["collective"]["kind"] == "transpose")
        .expect("the table is transposed");
    assert_eq!(program[at]["collective"]["group"], "mirror");
    let send = program[at]["collective"]["send"].as_u64().expect("a buffer id") as usize;
    let recv = program[at]["collective"]["recv"].as_u64().expect("a buffer id") as usize;
    let mut over_rows = plan.clone();
    over_rows["program"][at]["collective"]["group"] = json!("row");
    assert_refused(&over_rows, &["a transpose runs over mirror groups"]);
    let mut unswapped = plan.clone();
    unswapped["buffers"][recv]["layout"] = plan["buffers"][send]["layout"].clone();
    assert_refused(&unswapped, &["transpose over the mirror", "arrives laid out"]);
}

// ---- other kernel parameters ----------------------------------------------------------------------

#[test]
fn transpose_dims_out_of_range_are_refused() {
    let mut plan = manual_attention_2x2();
    kernels_of(&mut plan, "transpose")[0]["dim1"] = json!(9);
    assert_refused(&plan, &["transpose", "dims", "9"]);
}

#[test]
fn select_index_and_dim_out_of_range_are_refused() {
    let mut plan = manual_attention_2x2();
    kernels_of(&mut plan, "select")[0]["index"] = json!(HUGE);
    assert_refused(&plan, &["(select", "index 4611686018427387904 is outside dimension"]);

    let mut plan = manual_attention_2x2();
    kernels_of(&mut plan, "select_grad")[0]["dim"] = json!(200);
    assert_refused(&plan, &["select grad", "dim 200 is not a dimension"]);
}

#[test]
fn slice_shard_parameters_must_fit_the_mesh_and_shapes() {
    let mut plan = manual_attention_2x2();
    kernels_of(&mut plan, "slice_shard")[0]["axis"] = json!(5);
    assert_refused(&plan, &["slice shard", "mesh axis 5 does not exist"]);

    let mut plan = manual_attention_2x2();
    kernels_of(&mut plan, "slice_shard")[0]["placement"] =
        json!({ "kind": "shard", "dim": 40, "outer": 1, "inner": 1 });
    assert_refused(&plan, &["slice shard", "names a dimension"]);
}

#[test]
fn layer_norm_cross_entropy_attention_and_dropout_parameters_are_checked() {
    let cases: [(&str, &str, Value, &[&str]); 7] = [
        ("layer_norm_apply", "n", json!(16), &["layer norm apply", "n = 16", "32 elements"]),
        ("layer_norm_grad_input", "eps", json!(-1.0), &["layer norm grad input", "eps = -1"]),
        ("cross_entropy_max", "valid", json!(50), &["cross entropy max", "valid = 50"]),
        ("cross_entropy_grad", "valid", json!(50), &["cross entropy grad", "valid = 50"]),
        ("attention", "heads", json!(5), &["(attention", "heads"]),
        ("attention_grad", "wrt", json!(2), &["attention grad", "wrt = 2"]),
        ("dropout", "p", json!(1.5), &["(dropout", "drop probability 1.5"]),
    ];
    for (kind, field, value, needles) in cases {
        let mut plan = tiny_2x2();
        kernels_of(&mut plan, kind)[0][field] = value;
        assert_refused(&plan, needles);
    }
}

#[test]
fn a_cross_entropy_count_that_is_not_one_number_is_refused() {
    // The loss's operands are (max, stats, targets, count): give it the stats as its count.
    let mut plan = tiny_2x2();
    let program = plan["program"].as_array_mut().expect("a program");
    let instr = program.iter_mut().find(|i| i["kernel"]["kind"] == "cross_entropy_loss").expect("a loss");
    let stats = instr["inputs"][1].clone();
    instr["inputs"][3] = stats;
    assert_refused(&plan, &["cross entropy loss", "not one number"]);
}

#[test]
fn a_kernel_with_the_wrong_number_of_inputs_is_refused() {
    let mut plan = tiny_2x2();
    let program = plan["program"].as_array_mut().expect("a program");
    let instr = program.iter_mut().find(|i| i["kernel"]["kind"] == "layer_norm_apply").expect("a layer norm");
    instr["inputs"].as_array_mut().expect("inputs").truncate(2);
    assert_refused(&plan, &["layer norm apply", "takes 5 inputs, not 2"]);
}

#[test]
fn a_gather_along_a_missing_dimension_is_refused() {
    let mut plan = tiny_2x2();
    let program = plan["program"].as_array_mut().expect("a program");
    let gather = program
        .iter_mut()
        .find(|i| i["instr"] == "collective" && i["collective"]["kind"] == "all_gather")
        .expect("an all-gather");
    gather["collective"]["shard"] = json!({ "kind": "shard", "dim": 30, "outer": 1, "inner": 1 });
    assert_refused(&plan, &["all_gather", "gathered dimension 30 does not exist"]);
}

// ---- the command line on refused plans ------------------------------------------------------------

#[test]
fn run_and_inspect_refuse_hostile_plans_with_exit_1_and_no_panic() {
    let dir = scratch("cli");
    let mut offsets = tiny_2x2();
    for instr in offsets["program"].as_array_mut().expect("a program") {
        if instr["kernel"].get("offset").is_some() {
            instr["kernel"]["offset"]["block"] = json!(HUGE);
        }
    }
    let mut param = tiny_2x2();
    param["params"][0]["shape"] = json!([HUGE]);
    let mut buffer = tiny_2x2();
    buffer["buffers"][5]["shape"] = json!([1_000_000_000u64]);
    let cases = [
        ("offsets.json", offsets, "offset.block 4611686018427387904"),
        ("param.json", param, "parameter `wte.weight`"),
        ("buffer.json", buffer, "[1000000000]"),
    ];
    for (name, plan, needle) in cases {
        let path = write_json(dir.path(), name, &plan);
        let path = path.to_str().expect("a UTF-8 path");
        let run = optimusc(&["run", path, "--steps", "1"], Duration::from_secs(60));
        assert_clean_failure(&run, needle);
        assert_clean_failure(&run, "failed verification");
        assert_clean_failure(&optimusc(&["inspect", path], Duration::from_secs(60)), needle);
    }
}

// ---- what this machine can run --------------------------------------------------------------------

/// The tiny GPT with a batch so large that no machine holds it (the plan itself is small).
fn enormous_batch_plan() -> Plan {
    let sets = [("batch", "16777216")];
    try_compile("tiny", &sets, Strategy::None, (1, 1), Mode::Train).expect("a large batch still compiles")
}

#[test]
fn a_plan_needing_more_memory_than_available_is_refused_even_with_an_edited_summary() {
    let Some(available) = available_memory() else { return eprintln!("no memory figure on this system: skipped") };
    let mut plan = enormous_batch_plan();
    let need = peak_bytes_per_device(&plan);
    assert_eq!(need, plan.memory.peak_bytes, "the recomputed peak is the compiler's");
    assert!(need > available, "the test plan must exceed {available} bytes, needs {need}");
    let dir = scratch("memory");
    let path = write_json(dir.path(), "huge.json", &serde_json::to_value(&plan).expect("JSON"));
    let out = optimusc(&["run", path.to_str().expect("UTF-8"), "--steps", "1"], Duration::from_secs(60));
    assert_clean_failure(&out, "the plan needs 1 device x");

    plan.memory.peak_bytes = 0;
    let e = check_host_can_run(&plan, 1).expect_err("refused").to_string();
    assert!(e.contains("the plan needs 1 device x") && e.contains("available"), "{e}");
    assert!(e.contains("OPTIMUS_SKIP_MEMORY_CHECK=1"), "{e}");
    // And the verifier refuses the edited summary, which `inspect` and `simulate` would show.
    let errors = verify(&plan).expect_err("an edited summary");
    assert!(errors.iter().any(|e| e.contains("memory summary does not match")), "{errors:#?}");
    // The message names the field that differs, a nested one by its path, with both values.
    plan.memory.peak_bytes = need;
    plan.memory.at_peak.parameters += 1;
    let errors = verify(&plan).expect_err("an edited breakdown");
    let named = format!(
        "memory.at_peak.parameters {} (recomputed {})",
        plan.memory.at_peak.parameters,
        plan.memory.at_peak.parameters - 1
    );
    assert!(errors.iter().any(|e| e.contains(&named) && !e.contains("memory.peak_bytes")), "{errors:#?}");
}

#[test]
fn the_recomputed_peak_matches_the_compilers_for_every_strategy() {
    for (strategy, mesh) in [(Strategy::None, (1, 1)), (Strategy::Megatron, (1, 4)), (Strategy::Optimus, (2, 2))] {
        for mode in [Mode::Train, Mode::Infer] {
            let plan = try_compile("tiny", &[], strategy, mesh, mode).expect("tiny compiles");
            assert_eq!(peak_bytes_per_device(&plan), plan.memory.peak_bytes, "{} {mesh:?} {mode:?}", strategy.name());
        }
    }
}

#[test]
fn meshes_beyond_the_thread_cap_are_refused_before_any_thread_starts() {
    let mut plan = try_compile("tiny", &[], Strategy::Optimus, (2, 2), Mode::Infer).expect("tiny compiles");
    for side in [64u64, 1024] {
        plan.mesh = Mesh::new(side, side);
        let devices = side * side;
        let e = check_host_can_run(&plan, devices).expect_err("over the cap").to_string();
        assert!(e.contains(&format!("{devices} devices")) && e.contains(&MAX_DEVICE_THREADS.to_string()), "{e}");
        assert!(e.contains(&format!("mpirun -np {devices}")) && e.contains("srun"), "{e}");
    }
    // The same check through the command line, on a real 64x64 plan.
    let sets = [("heads", "64"), ("hidden", "256"), ("batch", "64")];
    let plan = try_compile("tiny", &sets, Strategy::Optimus, (64, 64), Mode::Train).expect("tiny compiles on 64x64");
    let dir = scratch("threads");
    let path = write_json(dir.path(), "mesh64.json", &serde_json::to_value(&plan).expect("JSON"));
    let out = optimusc(&["run", path.to_str().expect("UTF-8"), "--steps", "1"], Duration::from_secs(60));
    assert_clean_failure(&out, "at most 1024 device threads");
}

// ---- reading plan files ---------------------------------------------------------------------------

#[test]
fn inspect_refuses_a_device_a_fifo_and_a_directory_quickly() {
    let dir = scratch("files");
    let fifo = dir.path().join("plan.json");
    let made = Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success());
    let mut cases: Vec<(PathBuf, &str)> = vec![(dir.path().to_path_buf(), "is a directory")];
    if Path::new("/dev/zero").exists() {
        cases.push((PathBuf::from("/dev/zero"), "not a regular file"));
    }
    if made {
        cases.push((fifo, "not a regular file"));
    }
    for (path, needle) in cases {
        let path = path.to_str().expect("UTF-8");
        let start = Instant::now();
        assert_clean_failure(&optimusc(&["inspect", path], Duration::from_secs(20)), needle);
        assert!(start.elapsed() < Duration::from_secs(20), "{path} took {:?}", start.elapsed());
        let e = read_plan(Path::new(path)).expect_err("not a plan").to_string();
        assert!(e.contains(needle), "{e}");
    }
}

#[test]
fn an_oversized_plan_file_is_refused_without_reading_it() {
    let dir = scratch("size");
    let path = dir.path().join("big.json");
    let file = std::fs::File::create(&path).expect("create");
    file.set_len(MAX_PLAN_BYTES + 1).expect("a sparse file");
    drop(file);
    let e = read_plan(&path).expect_err("too large").to_string();
    assert!(e.contains(&format!("more than the {MAX_PLAN_BYTES} bytes")), "{e}");
    let out = optimusc(&["inspect", path.to_str().expect("UTF-8")], Duration::from_secs(20));
    assert_clean_failure(&out, "more than the");
}

/// Floats survive a write and a read exactly (0.02 / sqrt(2 * 96) is 0.014142135623730949, not ...47).
#[test]
fn floats_round_trip_exactly() {
    let written = 0.02 / (2.0f64 * 96.0).sqrt();
    let read: f64 = serde_json::from_str(&serde_json::to_string(&written).expect("JSON")).expect("a float");
    assert_eq!(read.to_bits(), written.to_bits());
}

#[test]
fn another_format_version_is_named_even_when_the_rest_does_not_parse() {
    let dir = scratch("version");
    let path = write_json(dir.path(), "old.json", &json!({ "format_version": 7, "model": 5 }));
    let e = read_plan(&path).expect_err("version 7").to_string();
    assert!(e.contains("plan format version 7") && e.contains("recompile"), "{e}");
    let path = write_json(dir.path(), "none.json", &json!({ "model": "m" }));
    let e = read_plan(&path).expect_err("no version").to_string();
    assert!(e.contains("is not a plan: it has no `format_version`"), "{e}");
    // An array is not a plan at all, though serde would read a struct from one.
    for (name, text) in [("array.json", "[]"), ("spaced.json", " \n [ 4 ]"), ("number.json", "4")] {
        std::fs::write(dir.path().join(name), text).expect("write");
        let e = read_plan(&dir.path().join(name)).expect_err("not an object").to_string();
        assert!(e.contains("is not a plan: it is JSON but not an object"), "{text}: {e}");
    }
    std::fs::write(dir.path().join("bad.json"), b"{\"format_version\": 1, ").expect("write");
    let e = read_plan(&dir.path().join("bad.json")).expect_err("invalid JSON").to_string();
    assert!(e.contains("invalid JSON"), "{e}");
}

/// A plan of format version 3 (reasons as bare strings) is refused by its version, with the advice to
/// recompile, by the reader and by `inspect`, `simulate` and `run`; a version-4 plan whose reasons are
/// strings (no kind) is refused as invalid, not read with its kinds made up.
#[test]
fn a_plan_with_text_reasons_is_refused_by_its_version() {
    let dir = scratch("text_reasons");
    let mut plan = tiny_2x2();
    let texts: Vec<Value> = plan["reasons"].as_array().expect("reasons").iter().map(|r| r["text"].clone()).collect();
    assert!(texts.iter().all(Value::is_string) && !texts.is_empty());
    plan["reasons"] = Value::Array(texts);
    plan["format_version"] = json!(3);
    let path = write_json(dir.path(), "v3.json", &plan);
    let e = read_plan(&path).expect_err("version 3").to_string();
    assert!(e.contains("plan format version 3") && e.contains("reads version 4") && e.contains("recompile"), "{e}");
    let file = path.to_str().expect("UTF-8");
    for args in
        [vec!["inspect", file], vec!["simulate", file, "--hardware", "dgx-a100"], vec!["run", file, "--steps", "1"]]
    {
        assert_clean_failure(&optimusc(&args, Duration::from_secs(20)), "plan format version 3");
    }
    plan["format_version"] = json!(4);
    let path = write_json(dir.path(), "v4_text.json", &plan);
    let e = read_plan(&path).expect_err("reasons without kinds").to_string();
    assert!(e.contains("is not a valid plan"), "{e}");
}

// ---- every valid plan still verifies --------------------------------------------------------------

/// Every example, on none 1x1, megatron 1x2 and 1x4 and optimus 2x2, in both modes, compiles (the
/// compiler verifies), survives a write and a streaming read, verifies again, and passes the host
/// checks' thread cap.
#[test]
fn every_example_verifies_after_a_round_trip_through_a_file() {
    let dir = scratch("examples");
    let targets = [
        (Strategy::None, (1, 1)),
        (Strategy::Megatron, (1, 2)),
        (Strategy::Megatron, (1, 4)),
        (Strategy::Optimus, (2, 2)),
    ];
    for name in ["tiny", "gpt2", "gpt2_manual_attention", "bert", "gpt3"] {
        let sets: &[(&str, &str)] = if name == "gpt3" { &[("layers", "1")] } else { &[] };
        for (strategy, mesh) in targets {
            for mode in [Mode::Train, Mode::Infer] {
                let plan = try_compile(name, sets, strategy, mesh, mode).unwrap_or_else(|e| panic!("{e}"));
                let path = dir.path().join("plan.json");
                optimus::io::plan_file::write_plan(&plan, &path).expect("write the plan");
                let back = read_plan(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
                let same = serde_json::to_string(&back).ok() == serde_json::to_string(&plan).ok();
                assert!(same, "{name} {} {mesh:?} {mode:?}: the plan changed on the way", strategy.name());
                assert_eq!(verify(&back), Ok(()), "{name} {} {mesh:?} {mode:?}", strategy.name());
            }
        }
    }
}

// ---- a sweep of kernel parameter edits -----------------------------------------------------------

/// Fields whose value follows from the buffers and layouts: an edit the verifier accepts must leave
/// the answer unchanged. Others are the program's meaning, which no check can recover (eps, p, a select
/// index, which buffer an instruction reads, the root of a SUMMA step): edits of those must only never
/// panic.
const DERIVED: [&str; 14] = [
    "axis", "block", "masked", "valid", "count", "n", "wrt", "fused", "heads", "dim", "dim0", "dim1", "outer", "inner",
];

/// Candidate replacements for a JSON scalar.
fn edits_of(value: &Value) -> Vec<Value> {
    match value {
        Value::Bool(b) => vec![json!(!b)],
        Value::Null => vec![json!(0), json!(1), json!(2)],
        Value::Number(n) => match n.as_u64() {
            Some(v) => [0, 1, 2, 3, v + 1, v.saturating_sub(1), v * 2, 255, 1 << 32, HUGE]
                .into_iter()
                .filter(|&x| x != v)
                .map(|x| json!(x))
                .collect(),
            None => vec![json!(0.0), json!(-1.0), json!(1e300)],
        },
        _ => Vec::new(),
    }
}

/// (path inside the kernel, value) for every scalar field of a kernel, nested ones included.
fn scalar_fields(kernel: &Value) -> Vec<(Vec<String>, Value)> {
    let mut out = Vec::new();
    let Some(map) = kernel.as_object() else { return out };
    for (key, value) in map.iter().filter(|(k, _)| *k != "kind") {
        match value {
            Value::Object(inner) => {
                for (k2, v2) in inner.iter().filter(|(k, _)| *k != "kind") {
                    out.push((vec![key.clone(), k2.clone()], v2.clone()));
                }
            }
            v => out.push((vec![key.clone()], v.clone())),
        }
    }
    out
}

/// One training step of a plan, with panics caught (a panic is a failure of the verifier's promise).
fn one_step(plan: &Plan) -> Result<optimus::runtime::exec::RunOutput, String> {
    use optimus::plan::tensor::Tensor;
    use optimus::runtime::settings::{OptimizerKind, OptimizerSettings};
    use std::collections::BTreeMap;
    let optimizer = OptimizerSettings {
        kind: OptimizerKind::Sgd,
        lr: 0.1,
        weight_decay: 0.0,
        momentum: 0.0,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    let config = optimus::runtime::exec::RunConfig {
        timeout: Duration::from_secs(30),
        ..optimus::runtime::exec::RunConfig::new(3, 1, optimizer)
    };
    let shapes: Vec<(String, Vec<u64>)> = plan.inputs.iter().map(|i| (i.name.clone(), i.shape.clone())).collect();
    let batches = move |_step: u64| -> Result<BTreeMap<String, Tensor>, String> {
        let tensor = |shape: &[u64]| {
            let n = shape.iter().product::<u64>();
            Tensor::from_i32(shape, (0..n).map(|k| (k * 37 % 101) as i32).collect())
        };
        Ok(shapes.iter().map(|(name, shape)| (name.clone(), tensor(shape))).collect())
    };
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        optimus::runtime::local::run(plan, &config, &batches, &BTreeMap::new(), &|_| {})
    }));
    run.unwrap_or_else(|_| Err("panicked outside a device thread".into()))
}

fn same_result(a: &optimus::runtime::exec::RunOutput, b: &optimus::runtime::exec::RunOutput) -> bool {
    let loss =
        |o: &optimus::runtime::exec::RunOutput| o.steps.iter().map(|s| s.loss.map(f32::to_bits)).collect::<Vec<_>>();
    loss(a) == loss(b) && a.params == b.params && a.outputs == b.outputs
}

/// The scalar fields of the first kernel of each kind and the first collective of each kind and group:
/// (instruction index, what it is, the field's path inside the instruction, its value).
fn editable_fields(program: &[Value]) -> Vec<(usize, String, Vec<String>, Value)> {
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for (index, instr) in program.iter().enumerate() {
        let (key, what) = match instr["instr"].as_str() {
            Some("kernel") => ("kernel", instr["kernel"]["kind"].to_string()),
            Some("collective") => {
                ("collective", format!("{} {}", instr["collective"]["kind"], instr["collective"]["group"]))
            }
            _ => continue,
        };
        if !seen.insert(what.clone()) {
            continue;
        }
        for (mut path, value) in scalar_fields(&instr[key]) {
            path.insert(0, key.to_string());
            out.push((index, what.clone(), path, value));
        }
    }
    out
}

/// Edits every field of [`editable_fields`] to values around and far from its own: the verifier
/// refuses the edit, or the plan runs without a panic; an accepted edit of a field that follows from
/// the layouts gives exactly the unedited answer. Returns what went wrong.
fn sweep_edits(original: &Value) -> Vec<String> {
    let baseline = one_step(&serde_json::from_value(original.clone()).expect("a plan")).expect("the plan runs");
    let program = original["program"].as_array().expect("a program");
    let mut failures = Vec::new();
    for (index, what, path, value) in editable_fields(program) {
        for edit in edits_of(&value) {
            let mut plan = original.clone();
            let mut slot = &mut plan["program"][index];
            for key in &path {
                slot = &mut slot[key.as_str()];
            }
            *slot = edit.clone();
            let Ok(plan) = serde_json::from_value::<Plan>(plan) else { continue };
            if verify(&plan).is_err() {
                continue;
            }
            let case = format!("instruction {index} ({what}) {} = {edit}", path.join("."));
            let derived = path.last().is_some_and(|k| DERIVED.contains(&k.as_str()));
            match one_step(&plan) {
                Err(e) if e.contains("panicked") => failures.push(format!("{case}: {e}")),
                Ok(out) if derived && !same_result(&out, &baseline) => {
                    failures.push(format!("{case}: verified, but the answer changed"))
                }
                Err(e) if derived => failures.push(format!("{case}: verified, but the run failed: {e}")),
                _ => {}
            }
        }
    }
    failures
}

#[test]
fn edited_parameters_of_an_optimus_plan_are_refused_or_harmless() {
    let failures = sweep_edits(&tiny_2x2());
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn edited_parameters_of_a_megatron_plan_are_refused_or_harmless() {
    let plan = try_compile("tiny", &[], Strategy::Megatron, (1, 2), Mode::Train).expect("tiny compiles on 1x2");
    let failures = sweep_edits(&serde_json::to_value(plan).expect("JSON"));
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn edited_parameters_of_spelled_out_attention_are_refused_or_harmless() {
    let failures = sweep_edits(&manual_attention_2x2());
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Buffer declarations edited (shape dimensions, layout placements): refused, or the same answer
/// without a panic (the targets laid out unlike the logits' rows were accepted before this test). (A buffer's layout follows from the program; a kernel reads its block as laid out.)
#[test]
fn edited_buffer_declarations_are_refused_or_harmless() {
    let original = tiny_2x2();
    let baseline = one_step(&serde_json::from_value(original.clone()).expect("a plan")).expect("the plan runs");
    let count = original["buffers"].as_array().expect("buffers").len();
    let mut failures = Vec::new();
    // Every input and parameter buffer and every eighth other one, to keep the sweep short.
    let chosen = (0..count).filter(|&k| {
        let role = &original["buffers"][k]["role"];
        k % 8 == 0 || role == "input" || role == "parameter"
    });
    for k in chosen {
        let buffer = &original["buffers"][k];
        let mut fields: Vec<(Vec<Value>, Value)> = Vec::new();
        for axis in 0..2 {
            let placement = &buffer["layout"][axis];
            let path = |key: &str| vec![json!("layout"), json!(axis), json!(key)];
            for key in ["dim", "outer", "inner"] {
                if let Some(v) = placement.get(key) {
                    fields.push((path(key), v.clone()));
                }
            }
            fields.push((vec![json!("layout"), json!(axis)], placement.clone()));
        }
        for d in 0..buffer["shape"].as_array().map_or(0, Vec::len) {
            fields.push((vec![json!("shape"), json!(d)], buffer["shape"][d].clone()));
        }
        for (path, value) in fields {
            let edits = if value.is_object() {
                vec![
                    json!({ "kind": "replicate" }),
                    json!({ "kind": "partial" }),
                    json!({ "kind": "shard", "dim": 0, "outer": 1, "inner": 1 }),
                ]
            } else {
                edits_of(&value)
            };
            for edit in edits.into_iter().filter(|e| *e != value) {
                let mut plan = original.clone();
                let mut slot = &mut plan["buffers"][k];
                for key in &path {
                    slot = match key {
                        Value::String(s) => &mut slot[s.as_str()],
                        other => &mut slot[other.as_u64().unwrap_or(0) as usize],
                    };
                }
                *slot = edit.clone();
                let Ok(plan) = serde_json::from_value::<Plan>(plan) else { continue };
                if verify(&plan).is_err() {
                    continue;
                }
                let case = format!("buffer {k} ({}) {path:?} = {edit}", buffer["name"]);
                match one_step(&plan) {
                    Ok(out) if same_result(&out, &baseline) => {}
                    Ok(_) => failures.push(format!("{case}: verified, but the answer changed")),
                    Err(e) => failures.push(format!("{case}: verified, but the run failed: {e}")),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn a_collective_that_carries_token_ids_is_refused() {
    // The runtimes move floating-point buffers only: a plan that gathers an integer input would fail on
    // every device at its first step, so the verifier refuses it before it is written.
    let mut plan = tiny_2x2();
    let tokens = plan["inputs"].as_array().expect("inputs").iter().find(|i| i["name"] == "tokens").cloned();
    let tokens = tokens.expect("tiny reads tokens")["buffer"].clone();
    let program = plan["program"].as_array_mut().expect("a program");
    let collective = program.iter_mut().find(|i| i["instr"] == "collective" && i["collective"]["kind"] == "all_reduce");
    let collective = collective.expect("tiny on 2x2 sums something");
    collective["collective"]["send"] = tokens.clone();
    collective["collective"]["recv"] = tokens;
    let error = assert_refused(&plan, &["holds i32, and only floating-point buffers are communicated"]);
    assert!(error.contains("`tokens`"), "{error}");
}
