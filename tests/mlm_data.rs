//! Feeding every model input from data, and masked language modelling: the windows of segment and
//! label files, the MLM objective end to end (loss over the positions not ignored, sharded plans that
//! verify), `optimusc mask-data`, and the usage errors for inputs without a source.

mod common;

use optimus::elab::Override;
use optimus::front::check_source;
use optimus::io::data::{TokenData, TokenDtype};
use optimus::io::sources::{Objective, Sources};
use optimus::plan::{IGNORE_INDEX, Mesh, Mode, Plan, Strategy};
use optimus::shard::{Target, compile};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn scratch(name: &str) -> PathBuf {
    let dir = common::process_dir("mlm-data");
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

fn text(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

fn write_u16(name: &str, values: &[u16]) -> PathBuf {
    let path = scratch(name);
    std::fs::write(&path, values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).expect("write");
    path
}

fn write_u32(name: &str, values: &[u32]) -> PathBuf {
    let path = scratch(name);
    std::fs::write(&path, values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).expect("write");
    path
}

fn read_u16(path: &Path) -> Vec<u16> {
    std::fs::read(path).expect("read").chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect()
}

/// examples/bert.opt made small, compiled for one device.
fn small_bert(batch: u64, seq: u64) -> Plan {
    let file = "examples/bert.opt";
    let source = std::fs::read_to_string(file).expect("example exists");
    let sets = [
        ("layers", "1".to_string()),
        ("hidden", "8".to_string()),
        ("heads", "2".to_string()),
        ("ffn", "16".to_string()),
        ("vocab", "50".to_string()),
        ("context", seq.to_string()),
        ("seq", seq.to_string()),
        ("batch", batch.to_string()),
    ];
    let overrides: Vec<Override> =
        sets.iter().map(|(n, v)| Override { name: n.to_string(), value: v.clone() }).collect();
    let model = check_source(&source, &overrides).model.expect("example checks");
    let target = Target::plain(Mesh::new(1, 1), Strategy::None, Mode::Train);
    compile(&model, file, &source, target).unwrap_or_else(|_| panic!("{file} compiles"))
}

// ---- windows ----------------------------------------------------------------------------------------

#[test]
fn segments_and_labels_are_read_at_the_offsets_of_the_tokens_and_labels_are_not_shifted() {
    let (batch, seq, n) = (2u64, 4u64, 40u64);
    let plan = small_bert(batch, seq);
    let tokens: Vec<u16> = (0..n as u16).map(|i| (i * 7) % 50).collect();
    // BERT has 2 token types: 0 and 1.
    let segments: Vec<u16> = (0..n as u16).map(|i| (i / 3) % 2).collect();
    let labels: Vec<u16> = (0..n as u16).map(|i| if i % 3 == 0 { u16::MAX } else { (i + 11) % 50 }).collect();
    let open = |name: &str, values: &[u16]| TokenData::open(&write_u16(name, values), TokenDtype::U16).expect("opens");
    let (t, s, l) = (open("w.tokens", &tokens), open("w.segments", &segments), open("w.labels", &labels));
    let mlm = Sources::new(Some(t.clone()), Some(s.clone()), Some(l), Objective::Mlm, 0, "").expect("consistent");
    let causal = Sources::new(Some(t), Some(s), None, Objective::Causal, 0, "").expect("consistent");
    // Batch 7 (step 7, or micro-batch m of step k with 7 = k * N + m) wraps around the 40-token files.
    for step in [0u64, 3, 7] {
        let fed = mlm.batch(&plan, step).expect("a batch");
        let shifted = causal.batch(&plan, step).expect("a batch");
        for r in 0..batch {
            let o = (step * batch + r) * seq;
            for t in 0..seq {
                let (at, k) = (((o + t) % n) as usize, (r * seq + t) as usize);
                let label = if labels[at] == u16::MAX { IGNORE_INDEX } else { i32::from(labels[at]) };
                assert_eq!(fed["tokens"].i32().expect("ints")[k], i32::from(tokens[at]), "step {step} r {r} t {t}");
                assert_eq!(fed["segments"].i32().expect("ints")[k], i32::from(segments[at]));
                assert_eq!(fed["targets"].i32().expect("ints")[k], label, "labels are not shifted");
                let next = i32::from(tokens[((o + t + 1) % n) as usize]);
                assert_eq!(shifted["targets"].i32().expect("ints")[k], next, "causal targets are the next token");
                assert_eq!(shifted["segments"], fed["segments"]);
            }
        }
    }
}

#[test]
fn the_ignore_id_of_u32_label_files_is_the_largest_u32() {
    let plan = small_bert(1, 4);
    let tokens = TokenData::open(&write_u32("u32.tokens", &[1, 2, 3, 4]), TokenDtype::U32).expect("opens");
    let segments = TokenData::open(&write_u32("u32.segments", &[0, 0, 1, 1]), TokenDtype::U32).expect("opens");
    let labels = write_u32("u32.labels", &[u32::MAX, 7, u32::MAX, 65535]);
    let labels = TokenData::open(&labels, TokenDtype::U32).expect("opens");
    let sources = Sources::new(Some(tokens), Some(segments), Some(labels), Objective::Mlm, 0, "").expect("ok");
    // 65535 is an ordinary label in a u32 file, and outside this 50-token vocabulary.
    let e = sources.batch(&plan, 0).expect_err("65535 is not below 50").to_string();
    assert!(e.contains("label 65535 at offset 3") && e.contains("ignore id 4294967295"), "{e}");
    let labels = TokenData::open(&write_u32("u32.labels2", &[u32::MAX, 7, u32::MAX, 49]), TokenDtype::U32);
    let tokens = TokenData::open(&write_u32("u32.tokens", &[1, 2, 3, 4]), TokenDtype::U32).expect("opens");
    let sources = Sources::new(Some(tokens), None, Some(labels.expect("opens")), Objective::Mlm, 0, "");
    let e = sources.expect("consistent").check(&plan, "").expect_err("segments have no source").to_string();
    assert!(e.contains("input `segments` holds token types") && e.contains("--segments FILE"), "{e}");
}

#[test]
fn drawn_mlm_labels_ignore_some_positions_and_predict_others() {
    let plan = small_bert(4, 16);
    let sources = Sources::new(None, None, None, Objective::Mlm, 3, "").expect("no files");
    let fed = sources.batch(&plan, 0).expect("a batch");
    let labels = fed["targets"].i32().expect("ints");
    let ignored = labels.iter().filter(|&&l| l == IGNORE_INDEX).count();
    assert!(ignored > 8 && ignored < 56, "{ignored} of 64 ignored");
    assert!(labels.iter().all(|&l| l == IGNORE_INDEX || (0..50).contains(&l)));
    // Sentence A then B, as the model has two token types.
    assert_eq!(&fed["segments"].i32().expect("ints")[..16], &[0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]);
}

// ---- the objective end to end -------------------------------------------------------------------

const SMALL_BERT: [&str; 16] = [
    "--set",
    "layers=1",
    "--set",
    "hidden=16",
    "--set",
    "heads=4",
    "--set",
    "ffn=32",
    "--set",
    "vocab=50",
    "--set",
    "context=8",
    "--set",
    "seq=8",
    "--set",
    "batch=4",
];

#[test]
fn bert_with_the_mlm_objective_verifies_on_optimus_2x2_and_megatron_1x4() {
    for mesh in [&["--mesh", "2x2"][..], &["--mesh", "1x4", "--strategy", "megatron"]] {
        let mut args = vec!["verify", "examples/bert.opt", "--objective", "mlm", "--steps", "2"];
        args.extend(SMALL_BERT);
        args.extend(mesh);
        let out = optimusc(&args);
        assert!(out.status.success(), "{mesh:?}: {}", stderr(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("verified: the plan computes what one device computes"), "{stdout}");
    }
}

/// The loss of the first step (lr 0, no dropout) of small BERT on 32 tokens with these labels.
fn first_loss(labels: &[u16], tokens: &Path, segments: &Path, name: &str) -> f64 {
    let labels = write_u16(name, labels);
    let mut args = vec!["run", "examples/bert.opt", "--mesh", "2x2", "--steps", "1", "--lr", "0", "--json"];
    args.extend(SMALL_BERT);
    args.extend(["--set", "pdrop=0.0", "--objective", "mlm", "--data", text(tokens), "--segments", text(segments)]);
    args.extend(["--labels", text(&labels)]);
    let out = optimusc(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let record: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().expect("a record")).expect("JSON");
    record["loss"].as_f64().expect("a loss")
}

#[test]
fn the_mlm_loss_is_the_mean_over_the_positions_not_ignored() {
    // One step reads all 32 positions. Labels A and B predict disjoint positions, C their union: the
    // per-position losses do not depend on the labels, so n_C loss_C = n_A loss_A + n_B loss_B, which a
    // mean over all 32 positions (or over any other count) would break.
    let tokens: Vec<u16> = (0..32).map(|i| (i * 13 + 5) % 50).collect();
    let (tokens, segments) = (write_u16("e2e.tokens", &tokens), write_u16("e2e.segments", &[0; 32]));
    let target = |i: u16| (i * 7 + 3) % 50;
    let ignore = u16::MAX;
    let a: Vec<u16> = (0..32).map(|i| if i % 4 == 1 { target(i) } else { ignore }).collect();
    let b: Vec<u16> = (0..32).map(|i| if i % 5 == 2 && i % 4 != 1 { target(i) } else { ignore }).collect();
    let c: Vec<u16> = a.iter().zip(&b).map(|(&x, &y)| if x != ignore { x } else { y }).collect();
    let count = |l: &[u16]| l.iter().filter(|&&v| v != ignore).count() as f64;
    let (la, lb, lc) = (
        first_loss(&a, &tokens, &segments, "e2e.a"),
        first_loss(&b, &tokens, &segments, "e2e.b"),
        first_loss(&c, &tokens, &segments, "e2e.c"),
    );
    let (na, nb, nc) = (count(&a), count(&b), count(&c));
    assert_eq!((na, nb, nc), (8.0, 5.0, 13.0));
    let want = (na * la + nb * lb) / nc;
    assert!((lc - want).abs() <= 1e-5 * want, "loss over the union {lc}, weighted mean of the parts {want}");
    assert!((la - lb).abs() > 1e-4, "the parts differ, so the weights matter: {la} {lb}");
}

#[test]
fn mask_data_output_trains_bert_with_validation() {
    let prefix = scratch("para");
    let out = optimusc(&[
        "mask-data",
        "examples/data/paragraph.u16",
        "--mask-id",
        "125",
        "--vocab",
        "126",
        "--seed",
        "1",
        "-o",
        text(&prefix),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (inputs, labels) = (format!("{}.tokens.bin", text(&prefix)), format!("{}.labels.bin", text(&prefix)));
    // With lr 0 and no dropout, validation batches 0 and 1 have the losses of training steps 0 and 1.
    let mut args = vec!["run", "examples/bert.opt", "--steps", "2", "--objective", "mlm", "--json", "--lr", "0"];
    args.extend(SMALL_BERT);
    args.extend(["--set", "vocab=126", "--set", "pdrop=0.0", "--data", &inputs, "--labels", &labels]);
    args.extend(["--segments", "examples/data/paragraph.segments.u16", "--val-data", &inputs]);
    args.extend(["--val-labels", &labels, "--val-segments", "examples/data/paragraph.segments.u16"]);
    args.extend(["--eval-batches", "2"]);
    let out = optimusc(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let records: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("JSON")).collect();
    let train: Vec<f64> = records.iter().filter_map(|r| r["loss"].as_f64()).collect();
    let val: Vec<f64> = records.iter().filter_map(|r| r["val_loss"].as_f64()).collect();
    assert_eq!((train.len(), val.len()), (2, 1), "{records:?}");
    let want = (train[0] + train[1]) / 2.0;
    assert!((val[0] - want).abs() <= 1e-6 * want, "validation loss {}, want {want}", val[0]);
}

// ---- usage errors -----------------------------------------------------------------------------------

/// Runs `optimusc run` on small BERT with `extra` flags; returns (exit status, stderr).
fn run_bert(extra: &[&str]) -> (Option<i32>, String) {
    let mut args = vec!["run", "examples/bert.opt", "--steps", "1"];
    args.extend(SMALL_BERT);
    args.extend(["--set", "vocab=333"]);
    args.extend(extra);
    let out = optimusc(&args);
    (out.status.code(), stderr(&out))
}

#[test]
fn an_input_without_a_source_is_a_usage_error_naming_it() {
    let data = "examples/data/paragraph.u16";
    let segments = "examples/data/paragraph.segments.u16";
    let cases: [(&[&str], &str); 6] = [
        (
            &["--data", data],
            "error: input `segments` holds token types, and nothing feeds it: give --segments FILE (token type \
             ids aligned with --data, same dtype)",
        ),
        (
            &["--data", data, "--segments", segments, "--objective", "mlm"],
            "error: --objective mlm reads its targets from a label file: give --labels FILE (`optimusc mask-data` \
             writes one)",
        ),
        (
            &["--data", data, "--segments", segments, "--labels", data],
            "error: --labels are the targets of --objective mlm; the causal objective predicts the next token of \
             --data",
        ),
        (&["--segments", segments], "error: --segments is aligned with a token file: give --data FILE as well"),
        (
            &["--data", data, "--segments", segments, "--objective", "mlm", "--labels", data, "--val-data", data],
            "error: --objective mlm reads its targets from a label file: give --val-labels FILE",
        ),
        (
            &["--data", data, "--segments", segments, "--val-labels", data],
            "error: --val-segments and --val-labels go with --val-data FILE",
        ),
    ];
    for (flags, want) in cases {
        let (status, err) = run_bert(flags);
        assert_eq!(status, Some(2), "{flags:?}: {err}");
        assert!(err.starts_with(want), "{flags:?}:\n{err}\nwant:\n{want}");
    }
    // A token type the model's `types` (2) has no row for, before the first step, naming the file.
    let mut types = vec![0u16; 4716];
    types[5] = 7;
    let wide = write_u16("wide.segments", &types);
    let (status, err) = run_bert(&["--data", data, "--segments", text(&wide)]);
    assert_eq!(status, Some(2), "{err}");
    assert!(err.contains("token type 7 at offset 5 (token index) is not below the model's `types` (2)"), "{err}");
    let short = write_u16("short.segments", &[0; 10]);
    let (status, err) = run_bert(&["--data", data, "--segments", text(&short)]);
    assert_eq!(status, Some(2), "{err}");
    assert!(err.contains("holds 10 tokens but --data `examples/data/paragraph.u16` holds 4716"), "{err}");
    assert!(err.contains("must be the same length"), "{err}");
}

#[test]
fn inputs_are_matched_by_name_and_an_unknown_name_is_refused() {
    let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--segments", "examples/data/paragraph.u16"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let out = optimusc(&[
        "run",
        "examples/tiny.opt",
        "--steps",
        "1",
        "--set",
        "vocab=333",
        "--data",
        "examples/data/paragraph.u16",
        "--segments",
        "examples/data/paragraph.segments.u16",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out)
            .contains("--segments feeds an input named `segments` or `token_type_ids`, and model `tiny` has none")
    );
    let source = std::fs::read_to_string("examples/tiny.opt").expect("tiny");
    let extra = source
        .replace("input targets: i32[batch, seq]", "input targets: i32[batch, seq]\ninput extra: i32[batch, seq]")
        .replace("wte(tokens) + wpe(tokens)", "wte(tokens) + wte(extra) + wpe(tokens)");
    let model = scratch("extra.opt");
    std::fs::write(&model, extra).expect("write");
    let out = optimusc(&["run", text(&model), "--steps", "1"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out)
            .starts_with("error: input `extra` of model `tiny` has no data source: optimusc feeds inputs by name"),
        "{}",
        stderr(&out)
    );
}

// ---- mask-data ----------------------------------------------------------------------------------------

#[test]
fn mask_data_follows_berts_rule_and_is_deterministic() {
    let vocab = 30000u32;
    let n = 400_000usize;
    let tokens: Vec<u16> = (0..n as u64).map(|i| (optimus::plan::init::mix64(i) % u64::from(vocab)) as u16).collect();
    let input = write_u16("large.u16", &tokens);
    let mask = |seed: &str, prefix: &str| {
        let prefix = scratch(prefix);
        let out = optimusc(&["mask-data", text(&input), "--mask-id", "103", "--seed", seed, "-o", text(&prefix)]);
        assert!(out.status.success(), "{}", stderr(&out));
        let (inputs, labels) = optimus::io::mask::output_paths(&prefix);
        (read_u16(&inputs), read_u16(&labels))
    };
    let (masked, labels) = mask("5", "large-a");
    assert_eq!((masked.len(), labels.len()), (n, n));
    let (mut chosen, mut mask_id, mut same, mut other) = (0usize, 0usize, 0usize, 0usize);
    for ((&original, &fed), &label) in tokens.iter().zip(&masked).zip(&labels) {
        if label == u16::MAX {
            assert_eq!(fed, original, "a position not chosen is kept");
            continue;
        }
        assert_eq!(label, original, "the label of a chosen position is its original token");
        chosen += 1;
        match fed {
            103 => mask_id += 1,
            f if f == original => same += 1,
            f => {
                assert!(u32::from(f) < vocab, "a random token is in the vocabulary");
                other += 1;
            }
        }
    }
    let share = |k: usize, of: usize| k as f64 / of as f64;
    // 400,000 draws: the standard deviation of the chosen share is 0.06%, of the others below 0.2%.
    assert!((share(chosen, n) - 0.15).abs() < 0.003, "chosen {}", share(chosen, n));
    assert!((share(mask_id, chosen) - 0.80).abs() < 0.01, "mask id {}", share(mask_id, chosen));
    assert!((share(same, chosen) - 0.10).abs() < 0.01, "kept {}", share(same, chosen));
    assert!((share(other, chosen) - 0.10).abs() < 0.01, "random {}", share(other, chosen));
    assert_eq!(mask("5", "large-b"), (masked.clone(), labels.clone()), "the same seed gives the same files");
    assert_ne!(mask("6", "large-c").1, labels, "another seed chooses other positions");
}

#[test]
fn mask_data_refuses_what_it_cannot_mask() {
    let input = write_u16("small.u16", &[1, 2, 3, 4, 5, 6]);
    let prefix = scratch("small-out");
    let (inputs, labels) = optimus::io::mask::output_paths(&prefix);
    let run = |extra: &[&str]| {
        let mut args = vec!["mask-data", text(&input), "-o", text(&prefix)];
        args.extend(extra);
        optimusc(&args)
    };
    let out = run(&["--mask-id", "9", "--vocab", "8"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--mask-id 9 is outside the vocabulary of 8 tokens"), "{}", stderr(&out));
    let out = run(&["--mask-id", "1", "--vocab", "5"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("token 5 at offset 4 (token index) is not below --vocab 5"), "{}", stderr(&out));
    // The mask id that is the label files' ignore value is named as that, not as a vocabulary too large.
    let out = run(&["--mask-id", "65535"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--mask-id 65535 is not below 65535, the value that marks ignored"),
        "{}",
        stderr(&out)
    );
    let out = run(&["--mask-id", "1", "--vocab", "65536"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("a vocabulary of 65536 tokens does not fit u16 files"), "{}", stderr(&out));
    assert!(stderr(&out).contains("use --data-dtype u32"), "{}", stderr(&out));
    assert!(!inputs.exists() && !labels.exists(), "nothing is written after an error");
    // With u32 files already, there is no wider dtype to suggest.
    let wide = write_u32("wide.u32", &[1, 2, 3]);
    let wide_args = ["mask-data", text(&wide), "--mask-id", "3", "--vocab", "4294967296", "--data-dtype", "u32"];
    let out = optimusc(&[&wide_args[..], &["-o", text(&prefix)]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("does not fit u32 files") && !stderr(&out).contains("use --data-dtype"),
        "{}",
        stderr(&out)
    );
    let ignored = write_u16("holds-ignore.u16", &[1, u16::MAX, 3]);
    let out = optimusc(&["mask-data", text(&ignored), "--mask-id", "0", "-o", text(&prefix)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("holds 65535 at offset 1"), "{}", stderr(&out));
    let odd = scratch("odd.u16");
    std::fs::write(&odd, [1u8, 2, 3]).expect("write");
    let out = optimusc(&["mask-data", text(&odd), "--mask-id", "0", "-o", text(&prefix)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("not a whole number of 2-byte U16 tokens"), "{}", stderr(&out));
    // A .u16 file read as u32 (as `run --data` refuses it): every id would be two glued together.
    let out = run(&["--mask-id", "1", "--data-dtype", "u32"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("is named a u16 file, but --data-dtype is u32"), "{}", stderr(&out));
    // Without --vocab the vocabulary is the largest id (or the mask id) plus one.
    let out = run(&["--mask-id", "7", "--seed", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("(vocabulary 8)"), "{}", stderr(&out));
    assert_eq!(read_u16(&labels).len(), 6);
}

/// Every f32 tensor of a safetensors file, by name.
fn weights_of(path: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).expect("saved weights");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            (name, view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
        })
        .collect()
}

/// An embedding's padding row (`padding_idx`, torch's) gets no gradient from its lookups on any mesh:
/// after training on tokens that include the padding id, that row is what it started as, and the rows
/// of the other ids that occur have moved. An index outside the table is an error at its span.
#[test]
fn the_padding_row_of_an_embedding_never_moves_on_any_mesh() {
    let model = scratch("padding.opt");
    std::fs::write(
        &model,
        "model padded\nconfig {\n  vocab = 36\n  hidden = 8\n  seq = 8\n  batch = 4\n  pad = 3\n}\n\
         input tokens: i32[batch, seq]\ninput targets: i32[batch, seq]\n\
         layer wte = embedding(vocab, hidden, padding_idx: pad)\nlayer head = linear(hidden, vocab)\n\
         forward {\n  output loss = cross_entropy(head(wte(tokens)), targets)\n}\n",
    )
    .expect("model");
    let tokens =
        write_u16("padding.u16", &(0..512u16).map(|i| [3, 1, 7, 3, 12, 30, 3, 5][i as usize % 8]).collect::<Vec<_>>());
    for mesh in [
        ["--mesh", "1x1", "--strategy", "none"],
        ["--mesh", "2x2", "--strategy", "optimus"],
        ["--mesh", "1x4", "--strategy", "megatron"],
    ] {
        let start = scratch(&format!("padding-start-{}.safetensors", mesh[1]));
        let end = scratch(&format!("padding-end-{}.safetensors", mesh[1]));
        for (steps, lr, out) in [("1", "0", &start), ("3", "0.5", &end)] {
            let mut args = vec!["run", text(&model), "--data", text(&tokens), "--optimizer", "sgd", "--lr", lr];
            args.extend_from_slice(&["--steps", steps, "--save-weights", text(out)]);
            args.extend_from_slice(&mesh);
            let run = optimusc(&args);
            assert!(run.status.success(), "{mesh:?}: {}", stderr(&run));
        }
        let (before, after) = (&weights_of(&start)["wte.weight"], &weights_of(&end)["wte.weight"]);
        let row = |w: &[f32], r: usize| w[r * 8..(r + 1) * 8].to_vec();
        assert_eq!(row(after, 3), row(before, 3), "{mesh:?}: the padding row moved");
        for id in [1, 7, 12, 30] {
            assert_ne!(row(after, id), row(before, id), "{mesh:?}: row {id} did not train");
        }
    }
    let bad = optimusc(&["check", "examples/bert.opt", "--set", "pad=30522"]);
    assert_eq!(bad.status.code(), Some(1), "{}", stderr(&bad));
    assert!(stderr(&bad).contains("padding_idx") && stderr(&bad).contains("30522"), "{}", stderr(&bad));
}
