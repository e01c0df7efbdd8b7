//! Names that come from files, plans and paths never reach the terminal raw: an escape sequence in a
//! model name, a plan's tensor names, a source comment or a file name is printed escaped.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

/// Sets the terminal title and clears the screen, if printed raw.
const HOSTILE: &str = "\u{1b}]0;pwned\u{7}\u{1b}[2J\u{202e}";

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

fn scratch(name: &str) -> PathBuf {
    let dir = common::process_dir("terminal");
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

/// Neither stream holds an escape, a bell or a text-reordering character.
fn assert_terminal_safe(out: &Output, what: &str) {
    for (stream, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        let text = String::from_utf8_lossy(bytes);
        let raw: Vec<char> = text.chars().filter(|&c| matches!(c, '\u{1b}' | '\u{7}' | '\u{202e}')).collect();
        assert!(raw.is_empty(), "{what}: {stream} holds {raw:?}:\n{text}");
    }
}

#[test]
fn a_plan_with_hostile_names_is_inspected_and_run_escaped() {
    let plan_path = scratch("plan.json");
    let plan_arg = plan_path.to_str().expect("utf-8 path");
    let out = optimusc(&["compile", "examples/tiny.opt", "--mesh", "2x2", "-o", plan_arg]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut plan: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&plan_path).expect("plan")).expect("plan JSON");
    plan["model"] = serde_json::Value::String(format!("tiny{HOSTILE}"));
    plan["source"] = serde_json::Value::String(format!("tiny{HOSTILE}.opt"));
    for buffer in plan["buffers"].as_array_mut().expect("buffers") {
        let name = buffer["name"].as_str().expect("name").to_string();
        buffer["name"] = serde_json::Value::String(format!("{name}{HOSTILE}"));
    }
    std::fs::write(&plan_path, serde_json::to_vec(&plan).expect("JSON")).expect("write plan");
    let inspected = optimusc(&["inspect", plan_arg]);
    assert!(inspected.status.success(), "{}", String::from_utf8_lossy(&inspected.stderr));
    assert_terminal_safe(&inspected, "inspect");
    assert!(String::from_utf8_lossy(&inspected.stdout).contains("\\u{1b}"), "the escape is shown, escaped");
    let json = optimusc(&["inspect", plan_arg, "--json"]);
    assert_terminal_safe(&json, "inspect --json");
    serde_json::from_slice::<serde_json::Value>(&json.stdout).expect("inspect --json stays valid JSON");
    // A run that fails names tensors of the plan: they are escaped too.
    let run = optimusc(&["run", plan_arg, "--optimizer", "sgd", "--lr", "1e30", "--steps", "3"]);
    assert_eq!(run.status.code(), Some(1));
    assert_terminal_safe(&run, "run");
}

#[test]
fn a_source_and_a_path_with_escapes_are_shown_escaped() {
    let source = std::fs::read_to_string("examples/tiny.opt").expect("tiny.opt");
    let hostile_source = source.replacen("config {", &format!("# {HOSTILE}\nconfig {{ oops = unknown_name\n"), 1);
    let path = scratch(&format!("model{}.opt", "\u{1b}[2J"));
    std::fs::write(&path, hostile_source).expect("write model");
    let out = optimusc(&["check", path.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown_name"), "the error is still reported");
    assert_terminal_safe(&out, "check");
    let missing = scratch(&format!("missing{HOSTILE}.opt"));
    let out = optimusc(&["check", missing.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(1));
    assert_terminal_safe(&out, "check of a missing file");
}
