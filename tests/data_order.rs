//! `run --shuffle`: each epoch reads every whole window of --data once, in an order drawn from the seed
//! and the epoch; a resumed run reads exactly what an uninterrupted one reads; and a note says which
//! step starts each new pass over the file, shuffled or in order.

use optimus::io::{Order, TokenData, TokenDtype};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Output};
use tempfile::TempDir;

const DATA: &str = "examples/data/paragraph.u16";

/// A small GPT-2 reading sequences of 32 tokens, 8 to a step.
const MODEL: &[&str] = &[
    "examples/gpt2.opt",
    "--set",
    "layers=1",
    "--set",
    "hidden=32",
    "--set",
    "heads=4",
    "--set",
    "vocab=333",
    "--set",
    "context=64",
    "--set",
    "seq=32",
    "--set",
    "batch=8",
];

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

fn run(extra: &[&str]) -> Output {
    let mut args = vec!["run"];
    args.extend_from_slice(MODEL);
    args.extend_from_slice(extra);
    let out = optimusc(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    out
}

fn losses(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|r| r.get("loss").map(|l| l.to_string()))
        .collect()
}

#[test]
fn every_epoch_reads_each_whole_window_once_in_its_own_order() {
    let data = TokenData::open(Path::new(DATA), TokenDtype::U16).expect("the example data");
    let (batch, seq) = (8u64, 32u64);
    let windows = data.windows(seq);
    assert_eq!(windows, (data.len() - 1) / seq);
    let order = Order::Shuffled { seed: 5 };
    let starts: Vec<u64> =
        (0..3 * windows).map(|g| data.window_start(order, g / batch, batch, g % batch, seq)).collect();
    let epochs: Vec<&[u64]> = starts.chunks(windows as usize).collect();
    for epoch in &epochs {
        let distinct: BTreeSet<u64> = epoch.iter().copied().collect();
        assert_eq!(distinct, (0..windows).map(|w| w * seq).collect(), "each window once per epoch");
        assert!(epoch.iter().all(|&s| s + seq < data.len()), "whole windows only: a target follows every token");
    }
    assert_ne!(epochs[0], epochs[1], "a new order each epoch");
    let in_order: Vec<u64> = (0..windows).map(|g| data.window_start(Order::Sequential, 0, 1, g, seq)).collect();
    assert_ne!(epochs[0], in_order.as_slice(), "shuffled");
    let other_seed = Order::Shuffled { seed: 6 };
    let first_step = |order| (0..batch).map(|r| data.window_start(order, 0, batch, r, seq)).collect::<Vec<_>>();
    assert_ne!(first_step(order), first_step(other_seed), "the seed draws the order");
}

#[test]
fn a_file_shorter_than_one_window_is_read_in_order_even_when_shuffled() {
    let dir = TempDir::new().expect("a scratch folder");
    let path = dir.path().join("short.u16");
    let tokens: Vec<u8> = (0u16..20).flat_map(u16::to_le_bytes).collect();
    std::fs::write(&path, tokens).expect("written");
    let data = TokenData::open(&path, TokenDtype::U16).expect("opens");
    assert_eq!(data.windows(32), 0);
    let shuffled = Order::Shuffled { seed: 3 };
    for step in 0..4 {
        for row in 0..3 {
            let start = data.window_start(shuffled, step, 3, row, 32);
            assert_eq!(start, data.window_start(Order::Sequential, step, 3, row, 32));
        }
        assert_eq!(data.epoch(shuffled, step, 3, 32), data.epoch(Order::Sequential, step, 3, 32));
    }
}

#[test]
fn a_resumed_shuffled_run_reads_what_an_uninterrupted_one_reads() {
    let straight = run(&["--data", DATA, "--shuffle", "--steps", "24", "--json"]);
    let in_order = run(&["--data", DATA, "--steps", "24", "--json"]);
    assert_ne!(losses(&straight), losses(&in_order), "--shuffle changes what is read");

    let dir = TempDir::new().expect("a scratch folder");
    let checkpoints = dir.path().join("ck");
    let checkpoints = checkpoints.to_str().expect("utf-8");
    run(&["--data", DATA, "--shuffle", "--steps", "20", "--checkpoint-dir", checkpoints, "--checkpoint-every", "20"]);
    let resumed = optimusc(&["run", "examples/gpt2.opt", "--resume", checkpoints, "--steps", "24", "--json"]);
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(resumed.status.success(), "{stderr}");
    assert!(stderr.contains("--shuffle true"), "the checkpoint recorded --shuffle: {stderr}");
    assert_eq!(losses(&resumed), losses(&straight)[20..], "steps 20 to 23, resumed against straight");
}

#[test]
fn a_note_names_the_step_that_starts_each_new_epoch() {
    // 4716 tokens: 147 whole windows of 33, so the 8 sequences of step 18 (rows 144-151) begin epoch 2.
    let shuffled = run(&["--data", DATA, "--shuffle", "--steps", "40"]);
    let notes: Vec<String> = String::from_utf8_lossy(&shuffled.stderr)
        .lines()
        .filter(|l| l.contains("starts epoch"))
        .map(String::from)
        .collect();
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(notes[0].starts_with("note: step 18 starts epoch 2 of") && notes[0].contains("147 windows"), "{notes:?}");
    assert!(notes[1].starts_with("note: step 36 starts epoch 3 of"), "{notes:?}");

    // In order, step 18's last sequence starts at 151 * 32 = 4832, past the 4716 tokens.
    let in_order = run(&["--data", DATA, "--mesh", "2x2", "--steps", "20"]);
    let stderr = String::from_utf8_lossy(&in_order.stderr);
    let notes: Vec<&str> = stderr.lines().filter(|l| l.contains("starts epoch")).collect();
    assert_eq!(notes.len(), 1, "once for the four devices: {notes:?}");
    assert!(
        notes[0].starts_with("note: step 18 starts epoch 2 of") && notes[0].contains("wrapped past its end"),
        "{notes:?}"
    );
}

#[test]
fn shuffle_without_data_is_a_usage_error() {
    let mut args = vec!["run"];
    args.extend_from_slice(MODEL);
    args.extend_from_slice(&["--shuffle", "--steps", "1"]);
    let out = optimusc(&args);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--shuffle orders the windows of --data"));
}
