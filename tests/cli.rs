//! The `optimusc check` command line, run as a process: exit codes, output format, and robustness against
//! hostile inputs (every one must end with 0 or 1 within seconds: never a panic, a signal or a hang).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Longest any one run may take; the slowest input here takes well under a second.
const LIMIT: Duration = Duration::from_secs(20);

/// What one run of the binary produced.
struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Run {
    fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}

/// Reads a child's pipe on its own thread, so a child writing a lot never blocks on a full pipe.
fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// Waits for a child at most [`LIMIT`]; kills it and fails the test if it takes longer.
fn wait_or_kill(child: &mut Child, what: &str) -> ExitStatus {
    let start = Instant::now();
    loop {
        match child.try_wait().expect("waiting for optimusc") {
            Some(status) => return status,
            None if start.elapsed() > LIMIT => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("optimusc {what} did not finish within {LIMIT:?}");
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Runs `optimusc` with arguments and extra environment variables.
fn run_env(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut command = Command::new(env!("CARGO_BIN_EXE_optimusc"));
    command.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn().expect("optimusc starts");
    let (out, err) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let status = wait_or_kill(&mut child, &args.join(" "));
    Run { status, stdout: out.join().expect("stdout reader"), stderr: err.join().expect("stderr reader") }
}

fn run(args: &[&str]) -> Run {
    run_env(args, &[])
}

/// A model file under the system temporary directory, removed when dropped.
struct TempModel {
    path: PathBuf,
}

impl TempModel {
    fn new(tag: &str, bytes: &[u8]) -> TempModel {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("optimusc-cli-{}-{n}-{tag}.opt", std::process::id()));
        std::fs::write(&path, bytes).expect("writing a temporary model");
        TempModel { path }
    }

    fn path(&self) -> &str {
        self.path.to_str().expect("temporary paths are UTF-8")
    }
}

impl Drop for TempModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn example(name: &str) -> String {
    examples().join(format!("{name}.opt")).to_str().expect("UTF-8 path").to_string()
}

// ---- success --------------------------------------------------------------------------------------

#[test]
fn every_example_checks_and_prints_its_parameter_count() {
    let expected = [
        ("gpt2", "124,439,808 parameters"),
        ("bert", "335,174,458 parameters"),
        ("gpt3", "174,604,259,328 parameters"),
        ("tiny", "parameters"),
        ("gpt2_manual_attention", "parameters"),
    ];
    for (name, count) in expected {
        let r = run(&["check", &example(name)]);
        assert_eq!(r.code(), Some(0), "{name}: {}", r.stderr);
        assert!(r.stdout.contains(count), "{name}: expected `{count}` in {:?}", r.stdout);
        assert!(r.stdout.contains(&format!("model {name} checks")), "{name}: {:?}", r.stdout);
        assert!(r.stderr.is_empty(), "{name} printed to stderr: {}", r.stderr);
    }
}

#[test]
fn small_gpt2_with_overrides_checks() {
    let sets = ["layers=2", "hidden=64", "heads=4", "vocab=333", "context=32", "seq=16", "batch=4"];
    let mut args = vec!["check".to_string(), example("gpt2")];
    for s in sets {
        args.push("--set".to_string());
        args.push(s.to_string());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let r = run(&args);
    assert_eq!(r.code(), Some(0), "{}", r.stderr);
    // wte 333x64 + wpe 32x64 + 2 layers of (12 * 64^2 + 13 * 64) + ln_f 2 * 64.
    let expected = 333 * 64 + 32 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64;
    assert_eq!(expected, 123_456);
    assert!(r.stdout.contains("123,456 parameters"), "{}", r.stdout);
}

#[test]
fn emit_ir_prints_the_graph() {
    let r = run(&["check", &example("tiny"), "--emit", "ir"]);
    assert_eq!(r.code(), Some(0), "{}", r.stderr);
    assert!(r.stdout.starts_with("model tiny"), "{}", r.stdout);
    assert!(r.stdout.contains("%0 = input tokens : i32[batch="), "{}", r.stdout);
    assert!(r.stdout.contains("output loss = "), "{}", r.stdout);
}

// ---- errors -----------------------------------------------------------------------------------------

const BROKEN: &str = "model m\nconfig {\n  hidden = 8\n}\ninput x: f32[2, hidden]\nlayer fc = linear(hiden, 4)\nforward {\n  output y = fc(x)\n}\n";

#[test]
fn errors_exit_1_with_file_line_col_and_a_label() {
    let file = TempModel::new("broken", BROKEN.as_bytes());
    let r = run(&["check", file.path()]);
    assert_eq!(r.code(), Some(1), "{}", r.stderr);
    assert!(r.stdout.is_empty(), "nothing on stdout on failure: {}", r.stdout);
    assert!(r.stderr.contains(&format!("{}:6:19", file.path())), "{}", r.stderr);
    assert!(r.stderr.contains("error[E0101]: unknown name `hiden`"), "{}", r.stderr);
    assert!(r.stderr.contains("6 │ layer fc = linear(hiden, 4)"), "{}", r.stderr);
    assert!(r.stderr.contains("^^^^^ not defined"), "{}", r.stderr);
    assert!(r.stderr.contains("help: did you mean `hidden`?"), "{}", r.stderr);
    assert!(r.stderr.contains("1 error found"), "{}", r.stderr);
}

#[test]
fn syntax_errors_exit_1_with_a_location() {
    let file = TempModel::new("syntax", b"model m\nlayer fc = linear(8, 8\n");
    let r = run(&["check", file.path()]);
    assert_eq!(r.code(), Some(1), "{}", r.stderr);
    assert!(r.stderr.contains(&format!("{}:2:23", file.path())), "{}", r.stderr);
    assert!(r.stderr.contains("expected `)`, `,` or an operator, found the end of the file"), "{}", r.stderr);
}

#[test]
fn several_errors_are_counted() {
    let src = "model m\nconfig {\n  a = b\n}\nlayer x = lineer(1, 2)\nforward {}\n";
    let file = TempModel::new("several", src.as_bytes());
    let r = run(&["check", file.path()]);
    assert_eq!(r.code(), Some(1), "{}", r.stderr);
    assert_eq!(r.stderr.matches("error[E").count(), 3, "{}", r.stderr);
    assert!(r.stderr.contains("3 errors found"), "{}", r.stderr);
}

#[test]
fn missing_file_exits_1_with_a_clear_message() {
    let path = std::env::temp_dir().join(format!("optimusc-cli-{}-does-not-exist.opt", std::process::id()));
    let path = path.to_str().expect("UTF-8 path");
    let r = run(&["check", path]);
    assert_eq!(r.code(), Some(1), "{}", r.stderr);
    assert!(r.stderr.contains(&format!("error: cannot read `{path}`")), "{}", r.stderr);
}

#[test]
fn directory_instead_of_file_exits_1() {
    let r = run(&["check", examples().to_str().expect("UTF-8 path")]);
    assert_eq!(r.code(), Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("error: cannot read"), "{}", r.stderr);
}

#[test]
fn bad_set_values_exit_1_and_name_the_valid_names() {
    let r = run(&["check", &example("gpt2"), "--set", "layerz=2"]);
    assert_eq!(r.code(), Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("error[E0301]"), "{}", r.stderr);
    assert!(r.stderr.contains("valid names: vocab, context, seq, batch, layers"), "{}", r.stderr);
    assert!(r.stderr.contains("did you mean `layers`?"), "{}", r.stderr);
    let r = run(&["check", &example("gpt2"), "--set", "layers=two"]);
    assert_eq!(r.code(), Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("error[E0302]: bad value for `--set layers`: `two` is not an integer"), "{}", r.stderr);
}

// ---- usage errors -------------------------------------------------------------------------------------

#[test]
fn usage_errors_exit_2() {
    let cases: [&[&str]; 6] = [
        &["frobnicate"],
        &["check", &example("tiny"), "--frobnicate"],
        &["check", &example("tiny"), "--set", "layers"],
        &["check", &example("tiny"), "--emit", "assembly"],
        &["check"],
        &[],
    ];
    for args in cases {
        let r = run(args);
        assert_eq!(r.code(), Some(2), "{args:?}: {}", r.stderr);
        assert!(!r.stderr.is_empty(), "{args:?} printed no usage error");
    }
    let r = run(&["check", &example("tiny"), "--set", "layers"]);
    assert!(r.stderr.contains("expected NAME=VALUE"), "{}", r.stderr);
}

/// A negative number or a fraction given to an integer flag is a usage error that says the flag takes
/// digits only, rather than clap calling `-1` an unknown flag and suggesting `-- -1`; a negative value
/// for a flag of real numbers reaches that flag's own check; a range with both bounds is still in
/// clap's words.
#[test]
fn a_negative_or_fractional_integer_flag_says_what_it_takes() {
    let model = example("tiny");
    let cases: [(&[&str], &str); 5] = [
        (&["compile", &model, "--mesh", "1x1", "-o", "p.json", "--max-context", "-3"], "'-3' for '--max-context"),
        (&["run", "plan.json", "--warmup-steps=-1"], "'-1' for '--warmup-steps"),
        (&["run", "plan.json", "--seed", ""], "'' for '--seed"),
        (&["generate", "plan.json", "--max-new-tokens", "2.5"], "'2.5' for '--max-new-tokens"),
        (&["verify", &model, "--mesh", "2x2", "--steps", "-2"], "'-2' for '--steps"),
    ];
    for (args, value) in cases {
        let r = run(args);
        assert_eq!(r.code(), Some(2), "{args:?}: {}", r.stderr);
        assert!(
            r.stderr.contains(value) && r.stderr.contains("digits only (no sign, no decimal point)"),
            "{args:?}: {}",
            r.stderr
        );
        assert!(!r.stderr.contains("tip:"), "{args:?}: {}", r.stderr);
    }
    let r = run(&["plan", &model, "--devices", "4", "--top", "0"]);
    assert!(r.code() == Some(2) && r.stderr.contains("0 is not in 1..=100000"), "{}", r.stderr);
    let r = run(&["run", "plan.json", "--eval-batches", "1000001"]);
    assert!(r.code() == Some(2) && r.stderr.contains("1000001 is not in 1..=1000000"), "{}", r.stderr);
    let r = run(&["run", "plan.json", "--lr", "-1"]);
    assert!(r.code() == Some(2) && r.stderr.contains("must be a finite number >= 0, not `-1`"), "{}", r.stderr);
}

/// A count below its least value (`--steps 0`) is a usage error that says the least the flag takes,
/// on every command whose count has no upper bound, rather than clap's "0 is not in
/// 1..18446744073709551615".
#[test]
fn a_count_below_its_least_says_the_least() {
    let model = example("tiny");
    let cases: [(&[&str], &str); 7] = [
        (&["run", "plan.json", "--steps", "0"], "'0' for '--steps <STEPS>'"),
        (&["run", "plan.json", "--eval-every", "0"], "'0' for '--eval-every <E>'"),
        (&["run", "plan.json", "--checkpoint-every", "0"], "'0' for '--checkpoint-every <C>'"),
        (&["run", "plan.json", "--keep", "0"], "'0' for '--keep <K>'"),
        (&["verify", &model, "--mesh", "1x1", "--steps", "0"], "'0' for '--steps <STEPS>'"),
        (&["compile", &model, "--mesh", "1x1", "-o", "p.json", "--max-context", "0"], "'0' for '--max-context <N>'"),
        (&["mask-data", "tokens.u16", "-o", "masked", "--vocab", "0"], "'0' for '--vocab <V>'"),
    ];
    for (args, value) in cases {
        let r = run(args);
        assert_eq!(r.code(), Some(2), "{args:?}: {}", r.stderr);
        assert!(r.stderr.contains(&format!("invalid value {value}: give at least 1")), "{args:?}: {}", r.stderr);
        assert!(!r.stderr.contains("is not in"), "{args:?}: {}", r.stderr);
    }
}

/// A failure's trailer restates the mesh as the strategy read it (a 3d cube with its depth of 1), and
/// verify does not blame the mesh for an error in the model.
#[test]
fn a_failed_compile_names_the_mesh_it_read_and_only_that() {
    let tiny = example("tiny");
    let plan = std::env::temp_dir().join(format!("optimus-trailer-{}.json", std::process::id()));
    let plan = plan.to_str().expect("a UTF-8 path");
    for (mesh, shown) in [("2x2", "1x2x2"), ("1x2x3", "1x2x3"), ("2x1x2x3", "2x1x2x3")] {
        let r = run(&["compile", &tiny, "--strategy", "3d", "--mesh", mesh, "-o", plan]);
        assert_eq!(r.code(), Some(1), "{}", r.stderr);
        assert!(r.stderr.contains(&format!("cannot compile for a {shown} mesh")), "{mesh}: {}", r.stderr);
    }
    let r = run(&["verify", &tiny, "--set", "heads=3", "--mesh", "1x1", "--strategy", "none"]);
    assert_eq!(r.code(), Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("error[E0") && !r.stderr.contains("for the mesh"), "{}", r.stderr);
}

/// A kernel pool of tens of thousands of threads (minutes to start, deaf to signals meanwhile) is
/// refused at once.
#[test]
fn a_kernel_pool_past_a_thousand_threads_is_refused() {
    let r = run_env(&["check", &example("tiny")], &[("RAYON_NUM_THREADS", "20000")]);
    assert_eq!(r.code(), Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("RAYON_NUM_THREADS=20000 asks for more than 1024 kernel threads"), "{}", r.stderr);
    let r = run_env(&["check", &example("tiny")], &[("RAYON_NUM_THREADS", "3")]);
    assert_eq!(r.code(), Some(0), "{}", r.stderr);
}

/// Standard error a pipe whose reader is gone (`optimusc ... 2>&1 | head -1`): the command runs to its
/// own exit status, not a panic on the failed write (101, "failed printing to stderr").
#[test]
fn a_closed_standard_error_ends_no_command_in_a_panic() {
    let tiny = example("tiny");
    let plan = std::env::temp_dir().join(format!("optimus-closed-stderr-{}.json", std::process::id()));
    let plan = plan.to_str().expect("a UTF-8 path").to_string();
    let cases: [(&[&str], i32); 4] = [
        (&["check", &tiny, "--set", "eps=0"], 1),
        (&["compile", &tiny, "--mesh", "3x3", "-o", &plan], 1),
        (&["run", &tiny, "--steps", "2"], 0),
        (&["run", &tiny, "--steps", "-2"], 2),
    ];
    for (args, expected) in cases {
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        let status = Command::new(env!("CARGO_BIN_EXE_optimusc"))
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(writer)
            .status()
            .expect("optimusc runs");
        assert_eq!(status.code(), Some(expected), "{args:?}");
    }
    let _ = std::fs::remove_file(&plan);
}

// ---- plain output ---------------------------------------------------------------------------------------

#[test]
fn output_is_plain_text_without_a_terminal() {
    let file = TempModel::new("plain", BROKEN.as_bytes());
    for env in [&[("NO_COLOR", "1")][..], &[][..], &[("TERM", "xterm-256color"), ("CLICOLOR_FORCE", "1")][..]] {
        let r = run_env(&["check", file.path()], env);
        assert_eq!(r.code(), Some(1));
        assert!(r.stderr.contains("error[E0101]"), "{}", r.stderr);
        assert!(!r.stderr.contains('\u{1b}'), "escape codes with {env:?}: {:?}", r.stderr);
    }
}

/// On a terminal (a pseudo-terminal from `script`, util-linux's, in every Debian), diagnostics are in
/// colour unless `NO_COLOR` is set to something or `TERM` is empty or `dumb`: an empty `NO_COLOR` is
/// unset, as no-color.org and language.md say.
#[test]
fn colour_on_a_terminal_follows_no_color_and_term() {
    let file = TempModel::new("terminal", BROKEN.as_bytes());
    let command = format!("'{}' check '{}'", env!("CARGO_BIN_EXE_optimusc"), file.path());
    let cases = [
        (&[("NO_COLOR", "")][..], true),
        (&[("NO_COLOR", "1")], false),
        (&[("TERM", "dumb")], false),
        (&[("TERM", "")], false),
    ];
    for (env, coloured) in cases {
        let mut script = Command::new("script");
        script.args(["-qec", &command, "/dev/null"]).stdin(Stdio::null()).env("TERM", "xterm-256color");
        script.env_remove("NO_COLOR");
        for (k, v) in env {
            script.env(k, v);
        }
        let out = script.output().expect("script runs");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("E0101"), "{env:?}: {text}");
        assert_eq!(text.contains('\u{1b}'), coloured, "{env:?}: {text:?}");
    }
}

// ---- robustness -------------------------------------------------------------------------------------------

/// Runs `check` on bytes and returns the run; it must end with 0 or 1 (not 101, not a signal) in time.
fn survives(tag: &str, bytes: &[u8], extra: &[&str]) -> Run {
    let file = TempModel::new(tag, bytes);
    let mut args = vec!["check", file.path()];
    args.extend_from_slice(extra);
    let r = run(&args);
    assert!(matches!(r.code(), Some(0 | 1)), "{tag}: exit {:?}\n{}", r.status, tail(&r.stderr));
    assert!(
        !r.stderr.contains("internal compiler error") && !r.stderr.contains("panicked"),
        "{tag}: {}",
        tail(&r.stderr)
    );
    if r.code() == Some(1) {
        assert!(r.stderr.contains("error"), "{tag}: exit 1 without an error message");
    }
    r
}

/// The end of a long output, for failure messages.
fn tail(s: &str) -> &str {
    let start = s.len().saturating_sub(2000);
    let start = (start..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(s.len());
    &s[start..]
}

fn in_forward(expression: &str) -> Vec<u8> {
    format!("model m\ninput x: f32[2]\nforward {{\n  output y = {expression}\n}}\n").into_bytes()
}

#[test]
fn non_utf8_file() {
    let r = survives("non-utf8", b"model m\xff\xfe\ninput x: f32[2]\n", &[]);
    assert_eq!(r.code(), Some(1));
    assert!(r.stderr.contains("error[E0003]: the file is not valid UTF-8"), "{}", r.stderr);
    assert!(r.stderr.contains(":1:8"), "{}", r.stderr);
}

#[test]
fn non_utf8_file_is_counted_like_other_errors() {
    let r = survives("non-utf8-counted", b"config { a = 1 }\n# caf\xe9\n", &[]);
    assert_eq!(r.code(), Some(1));
    assert!(r.stderr.contains("error[E0003]"), "{}", r.stderr);
    assert!(r.stderr.trim_end().ends_with("-non-utf8-counted.opt: 1 error found"), "{}", r.stderr);
}

#[test]
fn empty_file() {
    let r = survives("empty", b"", &[]);
    assert_eq!(r.code(), Some(1));
    assert!(r.stderr.contains("error[E0401]"), "{}", r.stderr);
}

#[test]
fn deeply_nested_parentheses() {
    let r = survives("parens", &in_forward(&format!("{}x{}", "(".repeat(100_000), ")".repeat(100_000))), &[]);
    assert!(r.stderr.contains("error[E0002]: brackets are nested more than 64 deep"), "{}", tail(&r.stderr));
}

#[test]
fn deeply_nested_brackets() {
    let r = survives("brackets", &in_forward(&format!("{}x{}", "[".repeat(100_000), "]".repeat(100_000))), &[]);
    assert!(r.stderr.contains("error[E0002]"), "{}", tail(&r.stderr));
}

#[test]
fn deeply_nested_braces() {
    let r = survives("braces", format!("model m\nforward {}\n", "{".repeat(100_000)).as_bytes(), &[]);
    assert!(r.stderr.contains("error[E0002]"), "{}", tail(&r.stderr));
}

#[test]
fn very_long_sum() {
    let r = survives("sum", &in_forward(&vec!["1"; 100_000].join("+")), &[]);
    assert!(r.stderr.contains("error[E0002]: expression has 99999 operators"), "{}", tail(&r.stderr));
}

#[test]
fn very_long_chain_of_minus_signs() {
    let r = survives("minus", &in_forward(&format!("{}1", "-".repeat(100_000))), &[]);
    assert!(r.stderr.contains("error[E0002]"), "{}", tail(&r.stderr));
    survives("minus-spaced", &in_forward(&format!("{}1", "- ".repeat(100_000))), &[]);
}

#[test]
fn integer_literal_too_large_for_any_type() {
    let src = "model m\ninput x: f32[99999999999999999999999]\nforward {\n  output y = x\n}\n";
    let r = survives("big-literal", src.as_bytes(), &[]);
    assert!(r.stderr.contains("error[E0004]: integer literal is too large"), "{}", r.stderr);
    assert_eq!(r.stderr.matches("error[E").count(), 1, "one error, no cascade: {}", r.stderr);
}

#[test]
fn huge_repeat_count() {
    let src = "model m\ninput x: f32[2]\nblock B {\n  forward(x) {\n    return x\n  }\n}\nlayer h = repeat(1000000000) B()\nforward {\n  output y = h(x)\n}\n";
    let r = survives("repeat", src.as_bytes(), &[]);
    assert!(r.stderr.contains("error[E0202]: `repeat` needs a count from 1 to 100000"), "{}", r.stderr);
}

#[test]
fn set_values_that_do_not_fit() {
    let gpt2 = std::fs::read(example("gpt2")).expect("gpt2 example");
    let cases: [(&str, &[&str], &str); 4] = [
        ("layers-overflow", &["--set", "layers=99999999999999999999"], "E0302"),
        ("hidden-zero", &["--set", "hidden=0"], "E0202"),
        ("hidden-overflow", &["--set", "hidden=4611686018427387904"], "E0203"),
        ("tensor-overflow", &["--set", "hidden=3000000000", "--set", "vocab=3000000000"], "E0202"),
    ];
    for (tag, sets, code) in cases {
        let r = survives(tag, &gpt2, sets);
        assert_eq!(r.code(), Some(1), "{tag}");
        assert!(r.stderr.contains(&format!("error[{code}]")), "{tag}: {}", r.stderr);
    }
}

#[test]
fn set_values_at_the_limits() {
    let gpt2 = std::fs::read(example("gpt2")).expect("gpt2 example");
    survives("max-i64", &gpt2, &["--set", &format!("batch={}", i64::MAX)]);
    survives("min-i64", &gpt2, &["--set", &format!("batch={}", i64::MIN)]);
}

/// Warnings are printed once per command, however many times it compiles the model: verify compiles it
/// for the mesh and for one device, generate for its prefill and its decoding steps, simulate checks it
/// before compiling.
#[test]
fn each_warning_is_printed_once_per_command() {
    let model = TempModel::new(
        "warned",
        b"config { vocab = 16; hidden = 8; batch = 2; seq = 8; context = 8 }\n\
          input tokens: i32[batch, seq]\ninput targets: i32[batch, seq]\ninput mask: f32[batch, seq]\n\
          layer wte = embedding(vocab, hidden)\nlayer head = linear(hidden, vocab)\nlayer spare = linear(hidden, hidden)\n\
          forward { output loss = cross_entropy(head(wte(tokens)), targets) }\n",
    );
    let path = model.path();
    let commands: [&[&str]; 5] = [
        &["check", path],
        &["verify", path, "--mesh", "2x2", "--steps", "1"],
        &["generate", path, "--prompt-ids", "1,2,3", "--max-new-tokens", "2"],
        &["simulate", path, "--hardware", "dgx-a100"],
        &["plan", path, "--devices", "4", "--hardware", "dgx-a100"],
    ];
    for args in commands {
        let r = run(args);
        assert_eq!(r.code(), Some(0), "{args:?}: {}", r.stderr);
        for code in ["warning[W0001]", "warning[W0002]"] {
            assert_eq!(r.stderr.matches(code).count(), 1, "{args:?} prints {code} once:\n{}", r.stderr);
        }
    }
}

/// An output that is an input unchanged is in the plan (it had been left out without a word), and an
/// output of integers, which the runtimes cannot return, is refused by compile (E0107), not at run time.
#[test]
fn an_input_as_an_output_is_kept_and_an_integer_output_is_refused() {
    let passthrough = TempModel::new("passthrough", b"input x: f32[4, 8]\nforward { output y = x }\n");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let plan = dir.path().join("plan.json");
    let plan = plan.to_str().expect("a UTF-8 path");
    let r = run(&["compile", passthrough.path(), "--mode", "infer", "-o", plan]);
    assert_eq!(r.code(), Some(0), "{}", r.stderr);
    let written: serde_json::Value = serde_json::from_slice(&std::fs::read(plan).expect("the plan")).expect("JSON");
    let outputs = written["outputs"].as_array().expect("outputs");
    assert_eq!(outputs.len(), 1, "{outputs:?}");
    assert_eq!(outputs[0]["name"], "y");
    let inputs = written["inputs"].as_array().expect("inputs");
    assert_eq!(inputs.len(), 1, "{inputs:?}");
    assert_eq!(outputs[0]["buffer"], inputs[0]["buffer"], "the output is the input's buffer");

    let integers = TempModel::new(
        "integer-output",
        b"config { vocab = 16; hidden = 8 }\ninput tokens: i32[4, 8]\ninput targets: i32[4, 8]\n\
          layer wte = embedding(vocab, hidden)\nlayer head = linear(hidden, vocab)\n\
          forward {\n  output loss = cross_entropy(head(wte(tokens)), targets)\n  output echo = targets\n}\n",
    );
    assert_eq!(run(&["check", integers.path()]).code(), Some(0), "the language allows it");
    let r = run(&["compile", integers.path(), "--mesh", "2x2", "-o", plan]);
    assert_eq!(r.code(), Some(1), "{}", r.stderr);
    assert!(r.stderr.contains("error[E0107]: output `echo` is an integer tensor"), "{}", r.stderr);
    assert!(r.stderr.contains("this is i32[4, 8]"), "{}", r.stderr);
}
