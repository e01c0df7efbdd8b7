//! `optimusc tokenize` end to end: the files and sidecar it writes, the separator between documents, the
//! validation share, a hand-written tokenizer.json, and bad input refused without leaving a file behind.
//! (The ids against tiktoken and Hugging Face tokenizers on large and awkward texts are checked by
//! scripts/hf_tokenize_compare.py.)

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

fn text(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("written");
    text(&path)
}

fn u16s(path: &Path) -> Vec<u16> {
    std::fs::read(path).expect("a token file").chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect()
}

fn sidecar(prefix: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(prefix.with_extension("json")).expect("a sidecar")).expect("JSON")
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(dir).expect("a folder").map(|e| e.expect("an entry").path()).collect();
    files.sort();
    files
}

#[test]
fn gpt2_documents_are_joined_with_end_of_text_and_the_tail_goes_to_validation() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let a = write(dir.path(), "a.txt", b"Hello world");
    let b = write(dir.path(), "b.jsonl", b"{\"text\": \"Hello world\"}\n\n{\"text\": \"Hello world\"}\n");
    let prefix = dir.path().join("corpus");
    let out = optimusc(&["tokenize", &a, &b, "-o", &text(&prefix), "--val-fraction", "0.25"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // "Hello world" is [15496, 995] in GPT-2; three documents, two separators: 8 tokens, 2 to validation.
    let mut ids = u16s(&dir.path().join("corpus.u16"));
    ids.extend(u16s(&dir.path().join("corpus.val.u16")));
    assert_eq!(ids, [15496, 995, 50256, 15496, 995, 50256, 15496, 995]);
    assert_eq!(u16s(&dir.path().join("corpus.val.u16")).len(), 2);
    let side = sidecar(&prefix);
    assert_eq!(
        (side["tokenizer"].as_str(), side["vocab_size"].as_u64(), side["dtype"].as_str()),
        (Some("gpt2"), Some(50257), Some("u16"))
    );
    assert_eq!((side["documents"].as_u64(), side["tokens"].as_u64()), (Some(3), Some(8)));
    assert_eq!((side["train"]["tokens"].as_u64(), side["val"]["tokens"].as_u64()), (Some(6), Some(2)));
    assert_eq!(side["separator"]["id"].as_u64(), Some(50256));
    // The bytes of the documents' text (3 x 11), not of the .jsonl's JSON.
    assert_eq!(side["bytes"].as_u64(), Some(33));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("tokenized 3 documents, 33 bytes of text, into 8 tokens (4.12 bytes a token)"), "{stderr}");
    assert!(stderr.contains("next: optimusc run MODEL.opt --set vocab=50257 --data"), "{stderr}");
    // Six training tokens and two to validate: the model's seq must be under 2.
    for (file, tokens) in [("training", 6), ("validation", 2)] {
        let note = format!(
            "note: the {file} file holds {tokens} tokens: a run reads windows of seq + 1 tokens, so the model's \
             `seq` must be under {tokens} to read it"
        );
        assert!(stderr.contains(&note), "{note}: {stderr}");
    }
    assert!(!stderr.contains("given 2 times"), "{stderr}");
}

/// Tokenizing again into a prefix removes the token files the earlier run's sidecar named and this run
/// does not write (a validation split, the other width's file), saying so; a file of such a name that
/// no sidecar named stays.
#[test]
fn a_second_tokenize_of_a_prefix_removes_the_files_only_the_first_wrote() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let a = write(dir.path(), "a.txt", b"Hello world. Hello world. Hello world.");
    let prefix = dir.path().join("corpus");
    let val = dir.path().join("corpus.val.u16");
    let out = optimusc(&["tokenize", &a, "-o", &text(&prefix), "--val-fraction", "0.25"]);
    assert!(out.status.success() && val.is_file(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = optimusc(&["tokenize", &a, "-o", &text(&prefix)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!val.exists() && stderr.contains("note: removed") && stderr.contains("corpus.val.u16"), "{stderr}");
    assert!(sidecar(&prefix)["val"].is_null() && dir.path().join("corpus.u16").is_file());
    // A file of that name that the sidecar never named is not this tool's to remove.
    std::fs::write(&val, [1u8, 0]).expect("written");
    let out = optimusc(&["tokenize", &a, "-o", &text(&prefix)]);
    assert!(out.status.success() && val.is_file(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_file_given_twice_is_tokenized_twice_with_a_warning() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let a = write(dir.path(), "a.txt", b"Hello world");
    let again = format!("{}/./a.txt", dir.path().display());
    let prefix = dir.path().join("twice");
    let out = optimusc(&["tokenize", &a, &again, "-o", &text(&prefix)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("warning: `") && stderr.contains("a.txt` is given 2 times"), "{stderr}");
    assert_eq!(u16s(&dir.path().join("twice.u16")), [15496, 995, 50256, 15496, 995]);
}

/// A WordLevel tokenizer.json written by hand: whitespace pre-tokenizer, five tokens.
const WORD_LEVEL: &str = r#"{"version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [{"id": 4, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false,
                    "normalized": false, "special": true}],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "again": 3, "</s>": 4},
            "unk_token": "[UNK]"}}"#;

#[test]
fn a_tokenizer_json_encodes_its_own_vocabulary_with_its_end_of_text() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let json = write(dir.path(), "tokenizer.json", WORD_LEVEL.as_bytes());
    let a = write(dir.path(), "a.txt", b"hello world\nworld  again");
    let b = write(dir.path(), "b.txt", b"hello unknown");
    let prefix = dir.path().join("words");
    let out = optimusc(&["tokenize", &a, &b, "--tokenizer", &json, "-o", &text(&prefix)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(u16s(&dir.path().join("words.u16")), [1, 2, 2, 3, 4, 1, 0]);
    let side = sidecar(&prefix);
    assert_eq!((side["vocab_size"].as_u64(), side["separator"]["token"].as_str()), (Some(5), Some("</s>")));
    assert!(side["val"].is_null());
    // Another separator, named.
    let out = optimusc(&["tokenize", &a, &b, "--tokenizer", &json, "--eot", "again", "-o", &text(&prefix)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(u16s(&dir.path().join("words.u16")), [1, 2, 2, 3, 3, 1, 0]);
}

#[test]
fn bad_input_is_refused_and_leaves_no_file() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let good = write(dir.path(), "good.txt", b"Hello world");
    let latin1 = write(dir.path(), "latin1.txt", b"caf\xe9");
    let empty = write(dir.path(), "empty.txt", b"");
    let blank_lines = write(dir.path(), "blank.jsonl", b"{\"text\": \"\"}\n{\"text\": \"\"}\n");
    // Text a whitespace pre-tokenizer makes nothing of.
    let spaces = write(dir.path(), "spaces.txt", b"   ");
    let json = write(dir.path(), "tokenizer.json", WORD_LEVEL.as_bytes());
    // A corpus that `-o notes` would overwrite with its sidecar.
    let notes = write(dir.path(), "notes.json", b"a JSON-named text");
    let prefix = text(&dir.path().join("out"));
    let before = files_in(dir.path());
    let cases: &[(&[&str], i32, &str)] = &[
        (&["tokenize", &good, "-o", &prefix, "--val-fraction", "1"], 2, "--val-fraction 1 is not in [0, 1)"),
        (&["tokenize", &good, "-o", &prefix, "--tokenizer", "bert"], 2, "unknown tokenizer `bert`"),
        (&["tokenize", &good, "-o", &prefix, "--eot", "<|nope|>"], 2, "is not a token"),
        (&["tokenize", &good, "-o", &format!("{}/", dir.path().display())], 2, "names a folder"),
        (&["tokenize", &good, &latin1, "-o", &prefix], 1, "is not UTF-8 text: invalid bytes at byte 3"),
        (&["tokenize", &empty, "-o", &prefix], 1, "the corpus has no tokens: every file is empty"),
        (&["tokenize", &blank_lines, "-o", &prefix], 1, "it has no text (every `text` of its .jsonl lines is empty)"),
        (
            &["tokenize", &spaces, "-o", &prefix, "--tokenizer", &json],
            1,
            "the tokenizer made none of its 3 bytes of text",
        ),
        (&["tokenize", &good, "-o", &prefix, "--val-fraction", "0.1"], 2, "each needs at least one"),
        (&["tokenize", &notes, "-o", &text(&dir.path().join("notes"))], 2, "notes.json"),
        // The tokenizer is an input too: `-o tokenizer` would write its sidecar over tokenizer.json.
        (&["tokenize", &good, "--tokenizer", &json, "-o", &text(&dir.path().join("tokenizer"))], 2, "is the input"),
    ];
    for (args, status, message) in cases {
        let out = optimusc(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(*status), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert_eq!(files_in(dir.path()), before, "{args:?} left a file");
    }
}

#[test]
fn run_refuses_a_file_named_for_the_other_width() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let wide = write(dir.path(), "tokens.u32", &[1, 0, 0, 0, 2, 0, 0, 0]);
    let out = optimusc(&["run", "examples/tiny.opt", "--data", &wide, "--steps", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("give --data-dtype u32"), "{stderr}");
}

/// The `run` command tokenize suggests is one a shell runs as printed: a path with a space is quoted.
#[test]
fn the_suggested_run_quotes_paths_a_shell_would_split() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let a = write(dir.path(), "a.txt", b"Hello world, hello again");
    let prefix = dir.path().join("out put");
    let out = optimusc(&["tokenize", &a, "-o", &text(&prefix)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains(&format!("--data '{}.u16'", prefix.display())), "{stderr}");
}
