//! Token files and other user-named inputs are read safely: devices, FIFOs and directories are refused
//! at once (never read until memory runs out, never blocking), token data is mapped rather than read,
//! batches are exactly the documented windows, and data shorter than one step draws a warning.
#![cfg(unix)]

mod common;

use optimus::io::{Order, TokenData, TokenDtype};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// Generous: every command here finishes in well under a second on a healthy build.
const DEADLINE: Duration = Duration::from_secs(20);

/// Runs optimusc, killing it and failing the test if it has not exited by [`DEADLINE`].
fn optimusc(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("optimusc starts");
    let started = Instant::now();
    while child.try_wait().expect("optimusc can be waited on").is_none() {
        if started.elapsed() > DEADLINE {
            child.kill().expect("a hung optimusc can be killed");
            child.wait().expect("the killed optimusc is reaped");
            panic!("optimusc {} did not finish within {DEADLINE:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("optimusc output")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn text(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

/// `optimusc run examples/tiny.opt --steps 1 --data PATH` (batch 8, seq 8, vocabulary 101).
fn run_tiny_on(data: &Path) -> Output {
    optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--data", text(data)])
}

fn write_u16(path: &Path, tokens: &[u16]) {
    std::fs::write(path, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).expect("writes");
}

/// Refused with exit status 1, naming the path and what it is.
fn assert_refused(out: &Output, path: &str, kind: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("`{path}`")) && err.contains(kind), "{err}");
    assert!(err.contains("not a regular file"), "{err}");
}

#[test]
fn endless_devices_are_refused_at_once() {
    for device in ["/dev/zero", "/dev/urandom"] {
        let started = Instant::now();
        let out = run_tiny_on(Path::new(device));
        assert_refused(&out, device, "character device");
        assert!(started.elapsed() < Duration::from_secs(10), "{device} took {:?}", started.elapsed());
    }
}

#[test]
fn a_fifo_is_refused_without_waiting_for_a_writer() {
    let dir = TempDir::new().expect("temp dir");
    let fifo = dir.path().join("tokens.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", fifo.display());
    assert_refused(&run_tiny_on(&fifo), text(&fifo), "FIFO");
}

#[test]
fn a_directory_is_refused() {
    let dir = TempDir::new().expect("temp dir");
    assert_refused(&run_tiny_on(dir.path()), text(dir.path()), "directory");
}

#[test]
fn a_symlink_to_a_token_file_is_followed() {
    let dir = TempDir::new().expect("temp dir");
    let file = dir.path().join("train.u16");
    write_u16(&file, &(0..500).map(|t| t % 101).collect::<Vec<u16>>());
    let link = dir.path().join("link.u16");
    std::os::unix::fs::symlink(&file, &link).expect("symlink");
    let out = run_tiny_on(&link);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn a_100_gb_sparse_file_trains_without_being_read() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("huge.u16");
    // All zeros (a valid token id), and no disk blocks: reading it in full would take minutes and 100 GB.
    std::fs::File::create(&path).expect("creates").set_len(100 << 30).expect("sparse length");
    let started = Instant::now();
    let out = run_tiny_on(&path);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(started.elapsed() < DEADLINE, "one step took {:?}", started.elapsed());
    let data = TokenData::open(&path, TokenDtype::U16).expect("maps");
    assert_eq!(data.len(), 50 << 30);
    assert_eq!(data.token((50 << 30) - 1), 0);
}

/// A simple, obviously right reader: token i of the file, wrapping, decoded from the raw bytes.
fn reference_token(bytes: &[u8], size: usize, index: u64) -> i32 {
    let count = (bytes.len() / size) as u64;
    let at = (index % count) as usize * size;
    let mut word = [0u8; 4];
    word[..size].copy_from_slice(&bytes[at..at + size]);
    u32::from_le_bytes(word) as i32
}

/// Step k, sequence r reads seq + 1 tokens from (k * batch + r) * seq: inputs are the first seq, targets the last.
fn reference_batch(bytes: &[u8], size: usize, step: u64, batch: u64, seq: u64) -> (Vec<i32>, Vec<i32>) {
    let (mut tokens, mut targets) = (Vec::new(), Vec::new());
    for r in 0..batch {
        let start = (step * batch + r) * seq;
        tokens.extend((0..seq).map(|t| reference_token(bytes, size, start + t)));
        targets.extend((1..=seq).map(|t| reference_token(bytes, size, start + t)));
    }
    (tokens, targets)
}

/// Pseudo-random ids below `vocab`, reproducible.
fn ids(count: usize, vocab: u64) -> Vec<u64> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..count)
        .map(|_| {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) % vocab
        })
        .collect()
}

#[test]
fn batches_are_the_documented_windows_including_wrap_around() {
    let dir = TempDir::new().expect("temp dir");
    for (dtype, size, vocab) in [(TokenDtype::U16, 2, 60_000), (TokenDtype::U32, 4, 70_000)] {
        let bytes: Vec<u8> = ids(37, vocab).iter().flat_map(|&id| id.to_le_bytes()[..size].to_vec()).collect();
        let path = dir.path().join(format!("train-{size}.bin"));
        std::fs::write(&path, &bytes).expect("writes");
        let data = TokenData::open(&path, dtype).expect("opens");
        assert_eq!(data.len(), 37);
        let (batch, seq) = (3, 4);
        // 37 tokens, 12 per step: steps 3 and later start past the end and wrap.
        for step in [0, 1, 2, 3, 4, 7, 36, 1_000_003] {
            let got = data.batch(Order::Sequential, step, (batch, seq), vocab).expect("in the vocabulary");
            let (tokens, targets) = reference_batch(&bytes, size, step, batch, seq);
            assert_eq!(got["tokens"].i32().expect("i32"), &tokens[..], "{dtype:?} step {step} tokens");
            assert_eq!(got["targets"].i32().expect("i32"), &targets[..], "{dtype:?} step {step} targets");
            assert_eq!(got["tokens"].shape, vec![batch, seq]);
        }
    }
}

#[test]
fn a_clone_reads_the_same_tokens() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("train.u16");
    write_u16(&path, &[5, 6, 7, 8, 9]);
    let data = TokenData::open(&path, TokenDtype::U16).expect("opens");
    let copy = data.clone();
    drop(data);
    assert_eq!((0..7).map(|i| copy.token(i)).collect::<Vec<u32>>(), vec![5, 6, 7, 8, 9, 5, 6]);
}

#[test]
fn data_shorter_than_one_step_is_warned_about_with_the_numbers() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("short.u16");
    write_u16(&path, &[1; 50]);
    let data = TokenData::open(&path, TokenDtype::U16).expect("opens");
    // batch 8, seq 8: one step reads tokens 0..=64, 65 of them.
    let warning = data.shortfall_warning(8, 8).expect("50 tokens are fewer than 65");
    assert!(warning.contains(&format!("`{}` holds 50 tokens", path.display())), "{warning}");
    assert!(warning.contains("the 65 one step reads") && warning.contains("8 sequences x 8 tokens"), "{warning}");
    assert_eq!(data.shortfall_warning(7, 7), None, "7 x 7 + 1 = 50 tokens fit");
    assert!(data.shortfall_warning(u64::MAX, u64::MAX).is_some(), "no overflow");

    let out = run_tiny_on(&path);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert_eq!(err.matches("warning: token data").count(), 1, "{err}");
    assert!(err.contains("holds 50 tokens, fewer than the 65 one step reads"), "{err}");
}

#[test]
fn data_of_one_step_or_more_draws_no_warning() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("enough.u16");
    write_u16(&path, &[1; 65]);
    let out = run_tiny_on(&path);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("warning"), "{}", stderr(&out));
}

#[test]
fn check_refuses_devices_and_oversized_sources() {
    assert_refused(&optimusc(&["check", "/dev/zero"]), "/dev/zero", "character device");
    let dir = TempDir::new().expect("temp dir");
    let huge = dir.path().join("huge.opt");
    std::fs::File::create(&huge).expect("creates").set_len(65 << 20).expect("sparse length");
    let out = optimusc(&["check", text(&huge)]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("`{}`", huge.display())) && err.contains("limit of 64 MiB"), "{err}");
}

#[test]
fn simulate_refuses_a_device_as_hardware_profile() {
    let out = optimusc(&["simulate", "examples/tiny.opt", "--hardware", "/dev/zero"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "a bad profile is a usage error: {err}");
    assert!(err.contains("hardware profile `/dev/zero`") && err.contains("character device"), "{err}");
}

#[test]
fn a_missing_token_file_is_named() {
    let dir = TempDir::new().expect("temp dir");
    let absent: PathBuf = dir.path().join("absent.u16");
    let out = run_tiny_on(&absent);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("cannot read token data `{}`", absent.display())), "{err}");
}

#[test]
fn a_token_past_the_vocabulary_is_a_usage_error_before_step_0_in_training_validation_and_verify() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("wide.u16");
    let mut tokens = vec![1u16; 65];
    tokens[3] = 5000;
    write_u16(&path, &tokens);
    // The message names the batch and the file (and --val-data its flag).
    let cases = [("run", "--data", "batch 0 of the data: "), ("run", "--val-data", "--val-data: validation batch 0: ")];
    for (command, flag, says) in [&cases[..], &[("verify", "--data", "batch 0 of the data: ")]].concat() {
        let out = optimusc(&[command, "examples/tiny.opt", "--steps", "1", flag, text(&path)]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert!(err.contains(says) && err.contains(&format!("`{}`", path.display())), "{flag}: {err}");
        assert!(err.contains("token 5000 at offset 3"), "{flag}: {err}");
        assert!(err.contains("is not below the vocabulary size 101"), "{flag}: {err}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("step 0") && !err.contains("step 0"), "{flag}: {err}");
    }
}

/// `verify` refuses what `run` refuses before a step as usage errors (exit status 2), and the input
/// nothing feeds among them.
#[test]
fn verify_refuses_bad_inputs_as_usage_errors() {
    let dir = TempDir::new().expect("temp dir");
    let wide = dir.path().join("wide.u32");
    std::fs::write(&wide, [1u8, 0, 0, 0, 2, 0, 0, 0]).expect("writes");
    let cases: [(&[&str], &str); 3] = [
        (&["--data", text(&wide)], "--data-dtype u32"),
        (&["--mode", "infer"], "drop --mode infer"),
        (&["--labels", "examples/data/paragraph.u16"], "--labels"),
    ];
    for (extra, says) in cases {
        let out = optimusc(&[&["verify", "examples/tiny.opt", "--mesh", "2x2", "--steps", "1"][..], extra].concat());
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}

/// A resumed run reads the batch it starts from before its first step, as a fresh run reads batch 0:
/// a token past the vocabulary there is a usage error naming the batch.
#[test]
fn a_resumed_run_checks_the_batch_it_starts_from() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("late.u16");
    // tiny.opt reads 8 x 8 tokens a step: batch 2 reads tokens 128..=192, batches 0 and 1 none past 128.
    common::tokens_with_a_bad_id(&path, 130);
    let ckpt = dir.path().join("ckpt");
    let first =
        optimusc(&["run", "examples/tiny.opt", "--steps", "2", "--data", text(&path), "--checkpoint-dir", text(&ckpt)]);
    assert!(first.status.success(), "{}", stderr(&first));
    let resumed = optimusc(&["run", "examples/tiny.opt", "--steps", "4", "--resume", text(&ckpt)]);
    let err = stderr(&resumed);
    assert_eq!(resumed.status.code(), Some(2), "{err}");
    assert!(err.contains("batch 2 of the data: ") && err.contains("token 5000 at offset 130"), "{err}");
    assert!(!err.contains("step 2:"), "refused before its first step: {err}");
    // Batch 0 is not read again: a bad token there does not stop a run resumed past it.
    let early = dir.path().join("early.u16");
    common::tokens_with_a_bad_id(&early, 10);
    let args = ["run", "examples/tiny.opt", "--steps", "3", "--resume", text(&ckpt), "--data", text(&early)];
    let past =
        optimusc(&[&args[..], &["--allow-changes", "--checkpoint-dir", text(&dir.path().join("again"))]].concat());
    assert!(past.status.success(), "{}", stderr(&past));
}
