//! Checkpoints and token data: safetensors round trips, Hugging Face GPT-2 key styles and buffers,
//! error reports, dtypes, and the data-window rule of token files.

mod common;

use optimus::elab::Override;
use optimus::front::check_source;
use optimus::io::{Order, TokenData, TokenDtype, check_inputs, load_checkpoint, random_batch, save_checkpoint};
use optimus::plan::tensor::Tensor;
use optimus::plan::{Mesh, Mode, Plan, Strategy};
use optimus::runtime::exec::RunConfig;
use optimus::runtime::local::run;
use optimus::runtime::settings::{OptimizerKind, OptimizerSettings};
use optimus::shard::{Target, compile};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

// ---- helpers -------------------------------------------------------------------------------------

fn plan(file: &str, sets: &[(&str, &str)], mesh: (u64, u64), strategy: Strategy) -> Plan {
    let source = std::fs::read_to_string(file).expect("example exists");
    let overrides: Vec<Override> =
        sets.iter().map(|(n, v)| Override { name: n.to_string(), value: v.to_string() }).collect();
    let model = check_source(&source, &overrides).model.expect("example checks");
    let target = Target::plain(Mesh::new(mesh.0, mesh.1), strategy, Mode::Train);
    match compile(&model, file, &source, target) {
        Ok(p) => p,
        Err(d) => panic!("compile failed: {}", optimus::diag::render_plain(file, &source, &d)),
    }
}

/// examples/gpt2.opt made small: same names, same `transformer.` prefix.
fn small_gpt2() -> Plan {
    let sets = [
        ("layers", "1"),
        ("hidden", "8"),
        ("heads", "2"),
        ("vocab", "50"),
        ("context", "16"),
        ("seq", "8"),
        ("batch", "2"),
    ];
    plan("examples/gpt2.opt", &sets, (1, 1), Strategy::None)
}

/// A fresh, empty directory for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("io").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

fn files_in(dir: &Path) -> Vec<String> {
    let entries = std::fs::read_dir(dir).expect("readable directory");
    entries.map(|e| e.expect("entry").file_name().to_string_lossy().into_owned()).collect()
}

/// Distinct values exactly representable in f16 and bf16 (multiples of 1/8 in [-6, 6]).
fn known_params(plan: &Plan) -> BTreeMap<String, Tensor> {
    let one = |k: usize, shape: &[u64]| {
        let n = shape.iter().product::<u64>() as usize;
        let values = (0..n).map(|e| ((k * 7 + e) % 97) as f32 / 8.0 - 6.0).collect();
        Tensor::from_f32(shape, values)
    };
    plan.params.iter().enumerate().map(|(k, p)| (p.name.clone(), one(k, &p.shape))).collect()
}

/// A file tensor: name, dtype, shape, little-endian bytes.
type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

fn encode(dtype: Dtype, values: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::F64 => values.iter().flat_map(|&v| f64::from(v).to_le_bytes()).collect(),
        Dtype::F16 => values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
        Dtype::BF16 => values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
        other => panic!("no encoder for {other:?}"),
    }
}

fn entry(name: &str, dtype: Dtype, shape: &[u64], values: &[f32]) -> Entry {
    (name.to_string(), dtype, shape.iter().map(|&d| d as usize).collect(), encode(dtype, values))
}

/// Every parameter of `params` under `prefix` + its checkpoint name.
fn entries(plan: &Plan, params: &BTreeMap<String, Tensor>, prefix: &str, dtype: Dtype) -> Vec<Entry> {
    let value = |p: &optimus::plan::PlanParam| params[&p.name].f32().expect("f32").to_vec();
    plan.params.iter().map(|p| entry(&format!("{prefix}{}", p.checkpoint), dtype, &p.shape, &value(p))).collect()
}

fn write_file(path: &Path, entries: &[Entry]) {
    let views: Vec<(String, TensorView<'_>)> = entries
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).expect("consistent view")))
        .collect();
    let bytes = safetensors::serialize(views, None).expect("serializes");
    std::fs::write(path, bytes).expect("writes");
}

fn load_err(path: &Path, plan: &Plan) -> String {
    match load_checkpoint(path, plan, false) {
        Ok(_) => panic!("loading `{}` should fail", path.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_bits_equal(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, t) in a {
        let u = &b[name];
        assert_eq!(t.shape, u.shape, "{name}");
        let bits = |x: &Tensor| x.f32().expect("f32").iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(t), bits(u), "{name}");
    }
}

// ---- checkpoints ---------------------------------------------------------------------------------

#[test]
fn round_trip_after_training_is_bit_exact() {
    let plan = plan("examples/tiny.opt", &[], (2, 2), Strategy::Optimus);
    let (batch, seq) = check_inputs(&plan).expect("tiny feeds tokens and targets");
    let optimizer = OptimizerSettings {
        kind: OptimizerKind::AdamW,
        lr: 1e-2,
        weight_decay: 0.1,
        momentum: 0.9,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    let config = RunConfig { timeout: Duration::from_secs(60), ..RunConfig::new(3, 2, optimizer) };
    let batches = |step| Ok(random_batch(5, step, batch, seq, 101));
    let trained = run(&plan, &config, &batches, &BTreeMap::new(), &|_| {}).expect("run succeeds").params;
    assert_eq!(trained.len(), plan.params.len());

    let dir = scratch("round_trip");
    let path = dir.join("model.safetensors");
    save_checkpoint(&path, &plan, &trained).expect("saves");
    assert_eq!(files_in(&dir), vec!["model.safetensors".to_string()], "no temporary file is left");
    assert_bits_equal(&trained, &load_checkpoint(&path, &plan, false).expect("loads"));

    let bytes = std::fs::read(&path).expect("file exists");
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).expect("valid header");
    let format = metadata.metadata().as_ref().and_then(|m| m.get("format").cloned());
    assert_eq!(format.as_deref(), Some("pt"));
    assert!(metadata.tensors().values().all(|info| info.dtype == Dtype::F32));
}

#[test]
fn save_writes_prefixed_keys_and_loads_them_back() {
    let plan = small_gpt2();
    assert_eq!(plan.checkpoint_prefix.as_deref(), Some("transformer."));
    let params = known_params(&plan);
    let path = scratch("save_prefixed").join("model.safetensors");
    save_checkpoint(&path, &plan, &params).expect("saves");
    let bytes = std::fs::read(&path).expect("file exists");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("valid file");
    let mut names: Vec<String> = file.names().into_iter().map(String::from).collect();
    names.sort();
    let mut expected: Vec<String> = plan.params.iter().map(|p| format!("transformer.{}", p.checkpoint)).collect();
    expected.sort();
    assert_eq!(names, expected);
    assert!(names.contains(&"transformer.h.0.attn.c_attn.weight".to_string()));
    assert_bits_equal(&params, &load_checkpoint(&path, &plan, false).expect("loads"));
}

#[test]
fn bare_and_prefixed_keys_both_load() {
    let plan = small_gpt2();
    let params = known_params(&plan);
    let dir = scratch("key_styles");
    for prefix in ["", "transformer."] {
        let path = dir.join(format!("{}model.safetensors", prefix));
        write_file(&path, &entries(&plan, &params, prefix, Dtype::F32));
        assert_bits_equal(&params, &load_checkpoint(&path, &plan, false).expect("loads"));
    }
}

#[test]
fn mask_buffers_and_a_tied_lm_head_are_ignored() {
    let plan = small_gpt2();
    let params = known_params(&plan);
    let dir = scratch("ignored");
    for prefix in ["", "transformer."] {
        let mut file = entries(&plan, &params, prefix, Dtype::F32);
        let mask = vec![1.0; 16 * 16];
        file.push(entry(&format!("{prefix}h.0.attn.bias"), Dtype::F32, &[1, 1, 16, 16], &mask));
        file.push(entry(&format!("{prefix}h.0.attn.masked_bias"), Dtype::F32, &[], &[-1e4]));
        file.push(entry("lm_head.weight", Dtype::F32, &[50, 8], params["wte.weight"].f32().expect("f32")));
        let path = dir.join(format!("{prefix}model.safetensors"));
        write_file(&path, &file);
        assert_bits_equal(&params, &load_checkpoint(&path, &plan, false).expect("buffers are ignored"));
    }
}

#[test]
fn an_attn_bias_with_a_parameter_shape_is_not_ignored() {
    let plan = small_gpt2();
    let params = known_params(&plan);
    let mut file = entries(&plan, &params, "", Dtype::F32);
    file.push(entry("h.0.attn.bias", Dtype::F32, &[8], &[0.0; 8]));
    let path = scratch("attn_bias_param_shape").join("model.safetensors");
    write_file(&path, &file);
    let e = load_err(&path, &plan);
    assert!(e.contains("unexpected `h.0.attn.bias`: found [8]"), "{e}");
}

#[test]
fn extra_missing_and_misshaped_tensors_are_reported_together() {
    let plan = small_gpt2();
    let params = known_params(&plan);
    let dir = scratch("mismatches");
    let base = entries(&plan, &params, "", Dtype::F32);

    let mut extra = base.clone();
    extra.push(entry("h.7.mlp.c_fc.weight", Dtype::F32, &[2, 3], &[0.0; 6]));
    let path = dir.join("extra.safetensors");
    write_file(&path, &extra);
    let e = load_err(&path, &plan);
    assert!(e.contains("unexpected `h.7.mlp.c_fc.weight`: found [2, 3]"), "{e}");

    let missing: Vec<Entry> = base.iter().filter(|t| t.0 != "ln_f.bias").cloned().collect();
    let path = dir.join("missing.safetensors");
    write_file(&path, &missing);
    let e = load_err(&path, &plan);
    assert!(e.contains("missing `ln_f.bias`: expected [8]"), "{e}");

    let mut misshaped: Vec<Entry> = base.iter().filter(|t| t.0 != "wte.weight").cloned().collect();
    misshaped.push(entry("wte.weight", Dtype::F32, &[49, 8], &[0.5; 49 * 8]));
    let path = dir.join("misshaped.safetensors");
    write_file(&path, &misshaped);
    let e = load_err(&path, &plan);
    assert!(e.contains("`wte.weight`: expected [50, 8], found [49, 8]"), "{e}");

    let mut all: Vec<Entry> = misshaped.into_iter().filter(|t| t.0 != "ln_f.bias").collect();
    all.push(entry("h.7.mlp.c_fc.weight", Dtype::F32, &[2, 3], &[0.0; 6]));
    let path = dir.join("all.safetensors");
    write_file(&path, &all);
    let e = load_err(&path, &plan);
    for part in ["unexpected `h.7.mlp.c_fc.weight`: found [2, 3]", "missing `ln_f.bias`", "found [49, 8]"] {
        assert!(e.contains(part), "`{part}` missing from: {e}");
    }
    assert!(e.contains("transformer."), "the message says both key styles were tried: {e}");
}

#[test]
fn save_with_a_missing_tensor_writes_nothing() {
    let plan = small_gpt2();
    let mut params = known_params(&plan);
    params.remove("h.0.mlp.c_proj.bias");
    params.insert("wpe.weight".to_string(), Tensor::from_f32(&[3, 8], vec![0.0; 24]));
    let dir = scratch("save_missing");
    let path = dir.join("model.safetensors");
    let e = save_checkpoint(&path, &plan, &params).expect_err("a parameter is missing").to_string();
    assert!(e.contains("missing `h.0.mlp.c_proj.bias`: expected [8]"), "{e}");
    assert!(e.contains("`wpe.weight`: expected [16, 8], found [3, 8]"), "{e}");
    assert!(files_in(&dir).is_empty(), "nothing is written: {:?}", files_in(&dir));
}

#[test]
fn a_longer_position_table_loads_its_first_rows() {
    let plan = small_gpt2();
    let params = known_params(&plan);
    let mut file: Vec<Entry> =
        entries(&plan, &params, "", Dtype::F32).into_iter().filter(|t| t.0 != "wpe.weight").collect();
    let mut long = params["wpe.weight"].f32().expect("f32").to_vec();
    long.extend((0..8 * 8).map(|e| e as f32));
    file.push(entry("wpe.weight", Dtype::F32, &[24, 8], &long));
    let dir = scratch("position_table");
    let path = dir.join("long.safetensors");
    write_file(&path, &file);
    assert_bits_equal(&params, &load_checkpoint(&path, &plan, false).expect("first rows load"));

    let last = file.len() - 1;
    file[last] = entry("wpe.weight", Dtype::F32, &[8, 8], &long[..64]);
    let path = dir.join("short.safetensors");
    write_file(&path, &file);
    let e = load_err(&path, &plan);
    assert!(e.contains("`wpe.weight`: expected [16, 8], found [8, 8]"), "{e}");
}

#[test]
fn a_longer_table_of_another_role_is_a_mismatch() {
    let plan = small_gpt2();
    let params = known_params(&plan);
    let mut file: Vec<Entry> =
        entries(&plan, &params, "", Dtype::F32).into_iter().filter(|t| t.0 != "wte.weight").collect();
    file.push(entry("wte.weight", Dtype::F32, &[51, 8], &[0.0; 51 * 8]));
    let path = scratch("token_table").join("model.safetensors");
    write_file(&path, &file);
    let e = load_err(&path, &plan);
    assert!(e.contains("`wte.weight`: expected [50, 8], found [51, 8]"), "{e}");
}

#[test]
fn f16_bf16_and_f64_files_load() {
    let plan = small_gpt2();
    let params = known_params(&plan);
    let dir = scratch("dtypes");
    for dtype in [Dtype::F16, Dtype::BF16, Dtype::F64] {
        let path = dir.join(format!("{dtype:?}.safetensors"));
        write_file(&path, &entries(&plan, &params, "transformer.", dtype));
        assert_bits_equal(&params, &load_checkpoint(&path, &plan, false).expect("loads"));
    }
}

#[test]
fn an_integer_tensor_is_reported() {
    let plan = small_gpt2();
    let params = known_params(&plan);
    let mut file: Vec<Entry> =
        entries(&plan, &params, "", Dtype::F32).into_iter().filter(|t| t.0 != "ln_f.bias").collect();
    file.push(("ln_f.bias".to_string(), Dtype::I32, vec![8], vec![0; 32]));
    let path = scratch("integer").join("model.safetensors");
    write_file(&path, &file);
    let e = load_err(&path, &plan);
    assert!(e.contains("`ln_f.bias`: dtype I32"), "{e}");
}

#[test]
fn unreadable_and_invalid_files_are_clear_errors() {
    let plan = small_gpt2();
    let dir = scratch("invalid");
    let e = load_err(&dir.join("absent.safetensors"), &plan);
    assert!(e.contains("cannot read checkpoint") && e.contains("absent.safetensors"), "{e}");
    let path = dir.join("garbage.safetensors");
    std::fs::write(&path, b"this is not a safetensors file at all").expect("writes");
    let e = load_err(&path, &plan);
    assert!(e.contains("is not a valid safetensors file"), "{e}");
}

/// small_gpt2's known parameters with one value of `c_fc.weight` replaced by `bad`, written as F32.
fn write_with_bad_value(path: &Path, plan: &Plan, index: usize, bad: f32) {
    let mut params = known_params(plan);
    let t = params.get_mut("h.0.mlp.c_fc.weight").expect("gpt2 has c_fc");
    let mut values = t.f32().expect("f32").to_vec();
    values[index] = bad;
    *t = Tensor::from_f32(&t.shape.clone(), values);
    write_file(path, &entries(plan, &params, "", Dtype::F32));
}

#[test]
fn a_nan_weight_names_the_tensor_and_element() {
    let plan = small_gpt2();
    let dir = scratch("nan");
    let path = dir.join("nan.safetensors");
    write_with_bad_value(&path, &plan, 17, f32::NAN);
    let e = load_err(&path, &plan);
    assert!(e.contains("tensor `h.0.mlp.c_fc.weight` holds NaN at element 17"), "{e}");
    assert!(e.contains("nan.safetensors") && e.contains("--allow-non-finite-weights"), "{e}");
    let loaded = load_checkpoint(&path, &plan, true).expect("allowed non-finite weights load");
    assert!(loaded["h.0.mlp.c_fc.weight"].f32().expect("f32")[17].is_nan());
}

#[test]
fn an_infinite_weight_is_reported_too() {
    let plan = small_gpt2();
    let dir = scratch("inf");
    let path = dir.join("inf.safetensors");
    write_with_bad_value(&path, &plan, 3, f32::NEG_INFINITY);
    let e = load_err(&path, &plan);
    assert!(e.contains("tensor `h.0.mlp.c_fc.weight` holds -infinity at element 3"), "{e}");
}

#[test]
fn a_long_mismatch_list_is_cut_short() {
    let plan = small_gpt2();
    let dir = scratch("many_extras");
    let path = dir.join("extras.safetensors");
    let mut file = entries(&plan, &known_params(&plan), "", Dtype::F32);
    file.extend((0..500).map(|k| entry(&format!("extra.{k:04}"), Dtype::F32, &[1], &[0.0])));
    write_file(&path, &file);
    let e = load_err(&path, &plan);
    assert_eq!(e.lines().filter(|l| l.contains("unexpected `extra.")).count(), 20, "{e}");
    assert!(e.contains("... and 480 more"), "{e}");
}

#[test]
fn control_characters_in_keys_are_escaped() {
    let plan = small_gpt2();
    let dir = scratch("escape");
    let path = dir.join("escape.safetensors");
    let mut file = entries(&plan, &known_params(&plan), "", Dtype::F32);
    file.push(entry("evil\u{1b}[2J\u{7}key", Dtype::F32, &[1], &[0.0]));
    write_file(&path, &file);
    let e = load_err(&path, &plan);
    assert!(!e.contains('\u{1b}') && !e.contains('\u{7}'), "{e:?}");
    assert!(e.contains("unexpected `evil\\u{1b}[2J\\u{7}key`"), "{e}");
}

#[test]
fn devices_and_fifos_are_refused_without_reading() {
    let plan = small_gpt2();
    let e = load_err(Path::new("/dev/zero"), &plan);
    assert!(e.contains("`/dev/zero`") && e.contains("not a regular file"), "{e}");
    let dir = scratch("fifo");
    let fifo = dir.join("weights.fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
    assert!(made.success(), "mkfifo failed");
    // Opening a FIFO with no writer would block: the check must come before any open.
    let e = load_err(&fifo, &plan);
    assert!(e.contains("not a regular file"), "{e}");
    let e = load_err(&dir, &plan);
    assert!(e.contains("not a regular file"), "{e}");
}

// ---- token data ----------------------------------------------------------------------------------

fn write_u16(path: &Path, tokens: &[u16]) {
    std::fs::write(path, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).expect("writes");
}

fn ids(batch: &BTreeMap<String, Tensor>, name: &str) -> Vec<i32> {
    let t = &batch[name];
    assert_eq!(t.shape, vec![2, 3], "{name}");
    t.i32().expect("i32").to_vec()
}

#[test]
fn windows_follow_the_step_rule_and_wrap() {
    let path = scratch("windows").join("train.bin");
    let tokens: Vec<u16> = (0..10).map(|i| 100 + i).collect();
    write_u16(&path, &tokens);
    let data = TokenData::open(&path, TokenDtype::U16).expect("opens");
    assert_eq!(data.len(), 10);

    // batch 2, seq 3: step 0 reads from 0 and 3, step 1 from 6 and 9 (which wraps to 0, 1, 2).
    let step0 = data.batch(Order::Sequential, 0, (2, 3), 1000).expect("step 0");
    assert_eq!(ids(&step0, "tokens"), vec![100, 101, 102, 103, 104, 105]);
    assert_eq!(ids(&step0, "targets"), vec![101, 102, 103, 104, 105, 106]);
    let step1 = data.batch(Order::Sequential, 1, (2, 3), 1000).expect("step 1");
    assert_eq!(ids(&step1, "tokens"), vec![106, 107, 108, 109, 100, 101]);
    assert_eq!(ids(&step1, "targets"), vec![107, 108, 109, 100, 101, 102]);
    // Step 5 starts at 30, which is 0 modulo 10.
    assert_eq!(data.batch(Order::Sequential, 5, (2, 3), 1000).expect("step 5"), step0);
}

#[test]
fn u32_files_hold_large_ids() {
    let path = scratch("u32").join("train.bin");
    let tokens: [u32; 4] = [70_000, 1, 99_999, 65_536];
    std::fs::write(&path, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).expect("writes");
    let data = TokenData::open(&path, TokenDtype::U32).expect("opens");
    assert_eq!(data.len(), 4);
    let b = data.batch(Order::Sequential, 0, (1, 2), 100_000).expect("batch");
    assert_eq!(b["tokens"].i32().expect("i32"), &[70_000, 1]);
    assert_eq!(b["targets"].i32().expect("i32"), &[1, 99_999]);
    let b = data.batch(Order::Sequential, 1, (1, 2), 100_000).expect("batch");
    assert_eq!(b["tokens"].i32().expect("i32"), &[99_999, 65_536]);
    assert_eq!(b["targets"].i32().expect("i32"), &[65_536, 70_000]);
}

#[test]
fn a_token_outside_the_vocabulary_gives_its_offset() {
    let path = scratch("vocab").join("train.bin");
    write_u16(&path, &[1, 2, 3, 4, 500, 6, 7, 8]);
    let data = TokenData::open(&path, TokenDtype::U16).expect("opens");
    data.batch(Order::Sequential, 0, (1, 3), 100).expect("tokens 0..=3 are in the vocabulary");
    let e = data.batch(Order::Sequential, 1, (1, 3), 100).expect_err("token 4 is 500").to_string();
    assert!(e.contains("token 500 at offset 4"), "{e}");
}

#[test]
fn empty_and_ragged_files_are_errors() {
    let dir = scratch("bad_data");
    let empty = dir.join("empty.bin");
    std::fs::write(&empty, b"").expect("writes");
    let e = TokenData::open(&empty, TokenDtype::U16).expect_err("empty").to_string();
    assert!(e.contains("is empty"), "{e}");
    let ragged = dir.join("ragged.bin");
    std::fs::write(&ragged, [1u8, 2, 3, 4, 5, 6]).expect("writes");
    assert!(TokenData::open(&ragged, TokenDtype::U16).is_ok());
    let e = TokenData::open(&ragged, TokenDtype::U32).expect_err("6 bytes are not whole u32 tokens").to_string();
    assert!(e.contains("6 bytes"), "{e}");
    let e = TokenData::open(&dir.join("absent.bin"), TokenDtype::U16).expect_err("absent").to_string();
    assert!(e.contains("cannot read token data"), "{e}");
}

#[test]
fn random_batches_depend_only_on_seed_step_and_position() {
    let a = random_batch(1, 4, 3, 5, 101);
    assert_eq!(a, random_batch(1, 4, 3, 5, 101));
    assert_ne!(a, random_batch(2, 4, 3, 5, 101));
    assert_ne!(a, random_batch(1, 5, 3, 5, 101));
    // A bigger batch keeps the rows of a smaller one.
    let wide = random_batch(1, 4, 4, 5, 101);
    assert_eq!(a["tokens"].i32().expect("i32"), &wide["tokens"].i32().expect("i32")[..15]);
    let (tokens, targets) = (a["tokens"].i32().expect("i32"), a["targets"].i32().expect("i32"));
    assert!(tokens.iter().chain(targets).all(|&t| (0..101).contains(&t)));
    for r in 0..3 {
        assert_eq!(tokens[r * 5 + 1..r * 5 + 5], targets[r * 5..r * 5 + 4], "targets follow tokens");
    }
    assert_eq!(a["tokens"].shape, vec![3, 5]);
}

#[test]
fn check_inputs_names_the_plan_inputs() {
    let mut plan = plan("examples/tiny.opt", &[], (1, 1), Strategy::None);
    assert_eq!(check_inputs(&plan).ok(), Some((8, 8)));
    plan.inputs[0].name = "ids".to_string();
    let e = check_inputs(&plan).expect_err("no `tokens` input").to_string();
    assert!(e.contains("`ids`: i32[8, 8]") && e.contains("`targets`: i32[8, 8]"), "{e}");
    // Other inputs (BERT's token types) are allowed here; `io::sources` checks that each has a source.
    assert_eq!(check_inputs(&plan_of_bert()).ok(), Some((2, 8)));
    let sharded = self::plan("examples/tiny.opt", &[], (2, 2), Strategy::Optimus);
    assert_eq!(check_inputs(&sharded).ok(), Some((8, 8)), "an input read in two layouts is still one input");
}

fn plan_of_bert() -> Plan {
    let sets = [("layers", "1"), ("hidden", "8"), ("heads", "2"), ("vocab", "50"), ("seq", "8"), ("batch", "2")];
    plan("examples/bert.opt", &sets, (1, 1), Strategy::None)
}

#[test]
fn plans_without_a_prefix_keep_the_json_unchanged() {
    let plan = plan("examples/tiny.opt", &[], (1, 1), Strategy::None);
    assert_eq!(plan.checkpoint_prefix, None);
    let json = serde_json::to_string(&plan).expect("serializes");
    assert!(!json.contains("checkpoint_prefix"));
    let _: HashMap<String, serde_json::Value> = serde_json::from_str(&json).expect("an object");
}

#[test]
fn gpt2_parameters_carry_the_hub_names_and_shapes() {
    let plan = plan("examples/gpt2.opt", &[], (1, 1), Strategy::None);
    assert_eq!(plan.checkpoint_prefix.as_deref(), Some("transformer."));
    let mut hub: Vec<(String, Vec<u64>)> = vec![
        ("wte.weight".into(), vec![50257, 768]),
        ("wpe.weight".into(), vec![1024, 768]),
        ("ln_f.weight".into(), vec![768]),
        ("ln_f.bias".into(), vec![768]),
    ];
    for i in 0..12 {
        for (name, shape) in [
            ("ln_1.weight", vec![768]),
            ("ln_1.bias", vec![768]),
            ("attn.c_attn.weight", vec![768, 2304]),
            ("attn.c_attn.bias", vec![2304]),
            ("attn.c_proj.weight", vec![768, 768]),
            ("attn.c_proj.bias", vec![768]),
            ("ln_2.weight", vec![768]),
            ("ln_2.bias", vec![768]),
            ("mlp.c_fc.weight", vec![768, 3072]),
            ("mlp.c_fc.bias", vec![3072]),
            ("mlp.c_proj.weight", vec![3072, 768]),
            ("mlp.c_proj.bias", vec![768]),
        ] {
            hub.push((format!("h.{i}.{name}"), shape));
        }
    }
    hub.sort();
    let mut ours: Vec<(String, Vec<u64>)> =
        plan.params.iter().map(|p| (p.checkpoint.clone(), p.shape.clone())).collect();
    ours.sort();
    assert_eq!(ours, hub);
}

/// An MLM head as BertForMaskedLM lays it out: a decoder tied to the embedding, with its own bias.
const TIED_HEAD: &str = r#"model t(linear_orientation: "out_in")
config { vocab = 6; hidden = 4 }
input tokens: i32[2, 3]
input targets: i32[2, 3]
block Predictions {
  layer decoder = linear(hidden, vocab, tied: "embed")
  forward(x) { return decoder(x) }
}
block Cls {
  layer predictions = Predictions()
  forward(x) { return predictions(x) }
}
layer embed = embedding(vocab, hidden)
layer cls = Cls()
forward { output loss = cross_entropy(cls(embed(tokens)), targets) }
"#;

fn tied_head_plan() -> Plan {
    let model = check_source(TIED_HEAD, &[]).model.expect("the model checks");
    let target = Target::plain(Mesh::new(1, 1), Strategy::None, Mode::Train);
    compile(&model, "t.opt", TIED_HEAD, target).unwrap_or_else(|_| panic!("the model compiles"))
}

/// Loads the named f32 tensors, written to a safetensors file, into `plan`.
fn load_tied(plan: &Plan, tensors: &[(&str, Vec<usize>, Vec<f32>)]) -> Result<BTreeMap<String, Tensor>, String> {
    let data: Vec<Vec<u8>> =
        tensors.iter().map(|(_, _, values)| values.iter().flat_map(|v| v.to_le_bytes()).collect()).collect();
    let views: Vec<(&str, TensorView)> = tensors
        .iter()
        .zip(&data)
        .map(|((name, shape, _), bytes)| (*name, TensorView::new(Dtype::F32, shape.clone(), bytes).expect("a view")))
        .collect();
    let bytes = safetensors::serialize(views, None).expect("serializes");
    let dir = common::process_dir("checkpoint-unit");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(format!("t-{}.safetensors", tensors.len()));
    std::fs::write(&path, bytes).expect("write");
    let loaded = load_checkpoint(&path, plan, false).map_err(|e| e.to_string());
    let _ = std::fs::remove_file(&path);
    loaded
}

fn bias_of(loaded: &BTreeMap<String, Tensor>) -> Vec<f32> {
    loaded["cls.predictions.decoder.bias"].f32().expect("f32").to_vec()
}

#[test]
fn a_tied_decoder_bias_is_read_from_its_parents_name_as_save_pretrained_writes_it() {
    let plan = tied_head_plan();
    let table = ("embed.weight", vec![6, 4], (0..24).map(|i| i as f32).collect::<Vec<_>>());
    let parent = ("cls.predictions.bias", vec![6], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let own = ("cls.predictions.decoder.bias", vec![6], vec![-1.0; 6]);

    let loaded = load_tied(&plan, &[table.clone(), parent.clone()]).expect("the parent's name is accepted");
    assert_eq!(bias_of(&loaded), parent.2);

    let loaded = load_tied(&plan, &[table.clone(), own.clone()]).expect("the decoder's own name is accepted");
    assert_eq!(bias_of(&loaded), own.2);

    let both = load_tied(&plan, &[table.clone(), parent, own.clone()]).expect("both names: the tied tensor twice");
    assert_eq!(bias_of(&both), own.2, "the decoder's own name wins");

    let wrong = ("cls.predictions.bias", vec![5], vec![0.0; 5]);
    let err = load_tied(&plan, &[table, wrong]).expect_err("a wrong shape is still an error");
    assert!(err.contains("`cls.predictions.bias`: expected [6], found [5]"), "{err}");
}
