//! Limits the command line must report cleanly: sizes past what a plan can address (at the config values
//! behind them, never as an internal error), repeats too large to build, floods of diagnostics (fast, and
//! printed only in part), and NaN weights given to `run`.

mod common;

use optimus::diag::{Diagnostic, MAX_SHOWN_DIAGNOSTICS, render_capped_to};
use optimus::elab::Override;
use optimus::front::check_source;
use optimus::plan::tensor::Tensor;
use optimus::plan::text::printable;
use optimus::plan::{Mesh, Mode, Strategy};
use optimus::shard::{Target, compile};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A fresh, empty directory for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("limits").join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    dir
}

/// Asserts a run failed with exit status 1, with no internal error and no panic.
fn assert_clean_failure(out: &Output) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("E0699") && !err.contains("internal error") && !err.contains("panicked"), "{err}");
}

// ---- sizes past what a plan can address ----------------------------------------------------------

#[test]
fn compile_with_a_vocabulary_of_2_pow_40_is_a_diagnostic_at_the_config_value() {
    let dir = scratch("vocab");
    let plan = dir.join("p.json");
    let plan_arg = plan.to_string_lossy();
    let out =
        optimusc(&["compile", "examples/gpt2.opt", "--set", "vocab=1099511627776", "--mesh", "1x1", "-o", &plan_arg]);
    assert_clean_failure(&out);
    let err = stderr(&out);
    assert!(err.contains("error[E0202]: parameter `wte.weight` is too large"), "{err}");
    assert!(err.contains("vocab × hidden = 1,099,511,627,776 × 768 = 844,424,930,131,968 elements"), "{err}");
    assert!(err.contains("`vocab` is set to 1099511627776 by `--set`"), "{err}");
    assert!(!plan.exists(), "no plan may be written");
}

#[test]
fn giant_sizes_fail_cleanly_in_every_command() {
    let commands: [&[&str]; 3] = [
        &["check"],
        &["compile", "--mesh", "2x2", "-o", "-"],
        &["simulate", "--hardware", "dgx-a100", "--mesh", "2x2"],
    ];
    let sets = ["hidden=9223372036854775800", "context=4611686018427387904", "batch=1099511627776", "seq=4294967296"];
    for command in commands {
        for set in sets {
            let mut args = command.to_vec();
            args.extend(["examples/gpt2.opt", "--set", set]);
            let out = optimusc(&args);
            assert_clean_failure(&out);
            assert!(stderr(&out).contains("error[E"), "{args:?}: {}", stderr(&out));
        }
    }
}

#[test]
fn a_parameter_too_large_is_named_by_its_full_path_once_for_all_copies() {
    let source = std::fs::read_to_string("examples/tiny.opt").expect("example exists");
    let overrides = [Override { name: "hidden".to_string(), value: i64::MAX.to_string() }];
    let checked = check_source(&source, &overrides);
    let rendered = optimus::diag::render_plain("tiny.opt", &source, &checked.diagnostics);
    assert!(rendered.contains("error[E0202]: parameter `h.0.attn.c_proj.weight` is too large"), "{rendered}");
    assert!(rendered.contains("error[E0202]: parameter `h.0.ln_1.weight` is too large"), "{rendered}");
    assert!(!rendered.contains("parameter `c_proj.weight`"), "{rendered}");
    // `repeat(2)` makes a second copy of each declaration: it is not reported again.
    assert!(!rendered.contains("`h.1."), "{rendered}");
}

#[test]
fn padding_past_the_limit_is_reported_by_the_shard_pass() {
    // vocab × hidden fits (1,099,511,627,712 elements) but padding vocab to a multiple of 4 does not.
    let source = std::fs::read_to_string("examples/tiny.opt").expect("example exists");
    let sets = [("vocab", "11453246122"), ("hidden", "96"), ("batch", "1"), ("seq", "1")];
    let overrides: Vec<Override> =
        sets.iter().map(|(n, v)| Override { name: n.to_string(), value: v.to_string() }).collect();
    let model = check_source(&source, &overrides).model.expect("the unpadded model fits");
    let target = Target::plain(Mesh::new(1, 4), Strategy::Megatron, Mode::Train);
    let Err(diagnostics) = compile(&model, "tiny.opt", &source, target) else {
        panic!("padding pushes wte past the limit; the compile must fail")
    };
    let rendered = optimus::diag::render_plain("tiny.opt", &source, &diagnostics);
    let codes: Vec<&str> = diagnostics.iter().map(|d| d.code.as_str()).collect();
    assert_eq!(codes, ["E0202"], "{rendered}");
    assert!(rendered.contains("parameter `wte.weight` padded for the mesh is too large"), "{rendered}");
    assert!(rendered.contains("`vocab` is set to 11453246122 by `--set`"), "{rendered}");
    assert!(rendered.contains("[11453246122, 96] up to [11453246124, 96]"), "{rendered}");
}

#[test]
fn a_repeat_too_large_to_build_is_refused_after_one_copy() {
    let start = Instant::now();
    let out = optimusc(&["check", "examples/gpt2.opt", "--set", "layers=100000"]);
    assert_clean_failure(&out);
    let err = stderr(&out);
    assert!(err.contains("error[E0402]: `repeat(100000)` would make more than 500,000"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
}

#[test]
fn forwards_whose_calls_multiply_stop_at_the_evaluation_limit_in_check_and_compile() {
    let dir = scratch("nested_calls");
    let path = dir.join("nested.opt");
    std::fs::write(&path, common::forwards_multiplying_calls()).expect("writes");
    let path = path.to_string_lossy();
    for command in [vec!["check", &path], vec!["compile", &path, "--mesh", "1x1", "--mode", "infer", "-o", "-"]] {
        let start = Instant::now();
        let out = optimusc(&command);
        assert_clean_failure(&out);
        let err = stderr(&out);
        assert!(
            err.contains("error[E0402]: elaborating the model evaluates more than 20,000,000 expressions"),
            "{err}"
        );
        // About a second in the test profile, where without the limit it ran for hours.
        assert!(start.elapsed() < Duration::from_secs(60), "{command:?} took {:?}", start.elapsed());
    }
}

// ---- floods of diagnostics ---------------------------------------------------------------------------

/// A model whose config reads `count` names that are defined nowhere.
fn unknown_names(count: usize) -> String {
    let mut src = String::from("model m\nconfig {\n");
    for k in 0..count {
        src.push_str(&format!("  a{k} = missing{k}\n"));
    }
    src.push_str("}\ninput x: f32[2]\nforward {\n  output y = x\n}\n");
    src
}

#[test]
fn two_hundred_thousand_unknown_names_check_quickly_and_print_in_part() {
    let src = unknown_names(200_000);
    let start = Instant::now();
    let checked = check_source(&src, &[]);
    let errors = checked.diagnostics.iter().filter(|d| d.is_error()).count();
    assert_eq!(errors, 200_000);
    let mut out = codespan_reporting::term::termcolor::Buffer::no_color();
    render_capped_to(&mut out, "flood.opt", &src, &checked.diagnostics, MAX_SHOWN_DIAGNOSTICS).expect("renders");
    let elapsed = start.elapsed();
    let text = String::from_utf8_lossy(out.as_slice()).into_owned();
    assert_eq!(text.matches("error[E0101]").count(), MAX_SHOWN_DIAGNOSTICS);
    assert!(text.ends_with("error: 199,950 more errors not shown\n"), "{}", &text[text.len().saturating_sub(300)..]);
    assert!(text.len() < 64 * 1024, "{} bytes", text.len());
    // A few seconds in the test profile; the bound leaves room for a loaded machine.
    assert!(elapsed < Duration::from_secs(60), "took {elapsed:?}");
}

#[test]
fn the_command_line_prints_fifty_errors_and_counts_them_all() {
    let dir = scratch("flood");
    let path = dir.join("flood.opt");
    std::fs::write(&path, unknown_names(2_000)).expect("writes");
    let out = optimusc(&["check", &path.to_string_lossy()]);
    assert_clean_failure(&out);
    let err = stderr(&out);
    assert_eq!(err.matches("error[E0101]").count(), 50, "{err}");
    assert!(err.contains("error: 1,950 more errors not shown"), "{err}");
    assert!(err.trim_end().ends_with("2000 errors found"), "{err}");
}

#[test]
fn warnings_left_out_are_counted_apart_from_errors() {
    let warning = Diagnostic::warning(optimus::diag::Code::E0101, "w");
    let error = Diagnostic::error(optimus::diag::Code::E0101, "e");
    let all = [error.clone(), warning.clone(), error, warning.clone(), warning];
    let mut out = codespan_reporting::term::termcolor::Buffer::no_color();
    render_capped_to(&mut out, "m.opt", "", &all, 2).expect("renders");
    let text = String::from_utf8_lossy(out.as_slice()).into_owned();
    assert!(text.ends_with("error: 1 more error and 2 more warnings not shown\n"), "{text}");
}

#[test]
fn printable_escapes_control_and_reordering_characters_only() {
    assert_eq!(printable("h.0.attn.c_attn.weight"), "h.0.attn.c_attn.weight");
    assert!(matches!(printable("plain"), std::borrow::Cow::Borrowed(_)));
    assert_eq!(printable("a\u{1b}[31mb\n"), "a\\u{1b}[31mb\\u{a}");
    assert_eq!(printable("x\u{202e}y"), "x\\u{202e}y");
    assert_eq!(printable("ünïcödé"), "ünïcödé");
}

// ---- NaN weights given to `run` -----------------------------------------------------------------------

/// Writes every parameter of tiny.opt, with one NaN in `wte.weight`, and returns the file's path.
fn tiny_weights_with_a_nan(dir: &Path) -> PathBuf {
    let source = std::fs::read_to_string("examples/tiny.opt").expect("example exists");
    let model = check_source(&source, &[]).model.expect("tiny checks");
    let target = Target::plain(Mesh::new(1, 1), Strategy::None, Mode::Train);
    let plan = compile(&model, "tiny.opt", &source, target).expect("tiny compiles");
    let params: BTreeMap<String, Tensor> = plan
        .params
        .iter()
        .map(|p| {
            let n = p.shape.iter().product::<u64>() as usize;
            let mut values = vec![0.01f32; n];
            if p.name == "wte.weight" {
                values[5] = f32::NAN;
            }
            (p.name.clone(), Tensor::from_f32(&p.shape, values))
        })
        .collect();
    let path = dir.join("nan.safetensors");
    optimus::io::save_checkpoint(&path, &plan, &params).expect("saves");
    path
}

#[test]
fn run_refuses_nan_weights_unless_allowed() {
    let dir = scratch("run_nan");
    let weights = tiny_weights_with_a_nan(&dir);
    let weights = weights.to_string_lossy();
    let out = optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--weights", &weights]);
    let err = stderr(&out);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("tensor `wte.weight` holds NaN at element 5"), "{err}");
    let out =
        optimusc(&["run", "examples/tiny.opt", "--steps", "1", "--weights", &weights, "--allow-non-finite-weights"]);
    let err = stderr(&out);
    assert!(!err.contains("holds NaN"), "{err}");
    // Allowed in, the NaN reaches the loss: the run stops before any update and names the parameter.
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("the parameter `wte.weight` already held a NaN or an infinity"), "{err}");
}
