//! `optimusc eval` end to end: the JSON record, the same loss on every mesh and with data-parallel
//! replicas, and bad input refused. (Agreement with Hugging Face's perplexity in float64 is checked by
//! scripts/hf_eval_check.py.)

use serde_json::Value;
use std::process::{Command, Output};

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

const SMALL: &[&str] = &[
    "--set",
    "layers=2",
    "--set",
    "hidden=32",
    "--set",
    "heads=4",
    "--set",
    "ffn=64",
    "--set",
    "vocab=128",
    "--set",
    "seq=16",
    "--set",
    "context=16",
    "--set",
    "batch=4",
    "--set",
    "pdrop=0",
];

fn eval(extra: &[&str]) -> Value {
    let mut args = vec!["eval", "examples/gpt2.opt", "--data", "examples/data/paragraph.u16", "--json"];
    args.extend(SMALL);
    args.extend(extra);
    let out = optimusc(&args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON record")
}

#[test]
fn every_token_is_predicted_once_with_the_same_loss_on_every_mesh() {
    let one = eval(&[]);
    // paragraph.u16 holds 4716 tokens: 4715 predicted, in 295 windows of 16 (294 whole, one at the end).
    assert_eq!(
        (one["tokens"].as_u64(), one["windows"].as_u64(), one["batches"].as_u64()),
        (Some(4715), Some(295), Some(74))
    );
    let loss = one["loss"].as_f64().expect("a loss");
    assert!((one["perplexity"].as_f64().expect("a perplexity") - loss.exp()).abs() < 1e-9 * loss.exp());
    for mesh in [&["--mesh", "2x2"][..], &["--mesh", "1x4", "--strategy", "megatron"], &["--mesh", "2x1x1"]] {
        let other = eval(mesh)["loss"].as_f64().expect("a loss");
        assert!((other - loss).abs() <= 1e-5 * loss, "{mesh:?}: {other} against {loss}");
    }
    // A shorter stride gives each prediction more context: a different mean over the same targets.
    let strided = eval(&["--stride", "4"]);
    assert_eq!(strided["tokens"].as_u64(), Some(4715));
    assert_ne!(strided["loss"].as_f64(), Some(loss));
}

#[test]
fn bad_evaluations_are_usage_errors() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let short = dir.path().join("short.u16");
    std::fs::write(&short, [1u8, 0, 2, 0, 3, 0]).expect("written");
    let short = short.to_string_lossy().into_owned();
    // A file `tokenize` named for 32-bit ids, read with the default 16-bit ones.
    let wide = dir.path().join("wide.u32");
    std::fs::copy("examples/data/paragraph.u16", &wide).expect("copied");
    let wide = wide.to_string_lossy().into_owned();
    let plan = dir.path().join("train.json").to_string_lossy().into_owned();
    let mut compile = vec!["compile", "examples/gpt2.opt", "-o", &plan];
    compile.extend(SMALL);
    assert!(optimusc(&compile).status.success());
    let paragraph = "examples/data/paragraph.u16";
    let cases: &[(&[&str], &str)] = &[
        (&["eval", "examples/gpt2.opt", "--data", &short], "one window reads seq + 1 = 17"),
        (&["eval", "examples/gpt2.opt", "--data", paragraph, "--stride", "17"], "--stride 17 must be"),
        (&["eval", "examples/gpt2.opt", "--data", paragraph, "--mode", "train"], "drop --mode train"),
        (&["eval", &plan, "--data", paragraph], "is a training plan"),
        (&["eval", "examples/gpt2.opt", "--data", paragraph, "--set", "vocab=100"], "token 116 at offset 2"),
        (&["eval", "examples/gpt2.opt", "--data", &wide], "is named a u32 file, but --data-dtype is u16"),
    ];
    for (args, message) in cases {
        let mut args = args.to_vec();
        if !args[1].ends_with(".json") {
            // The small config first: a later --set of the same name wins.
            args.splice(2..2, SMALL.iter().copied());
        }
        let out = optimusc(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}
