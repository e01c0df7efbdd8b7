//! Metrics logs and plots end to end: `optimusc run --log` appends exactly the records `--json` prints,
//! a bad log path is refused before anything runs, and `optimusc plot` draws a log or says what is wrong.

mod common;

use optimus::io::metrics::parse_metrics;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn optimusc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

fn scratch(name: &str) -> PathBuf {
    let dir = common::process_dir("metrics-cli");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    let _ = std::fs::remove_file(&path);
    path
}

fn text(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}"))).collect()
}

/// A 4-step run of the tiny model on the example paragraph, validated after every second update,
/// with `extra` flags.
fn tiny_run(extra: &[&str]) -> Output {
    let mut args = vec![
        "run",
        "examples/tiny.opt",
        "--set",
        "vocab=333",
        "--steps",
        "4",
        "--data",
        "examples/data/paragraph.u16",
        "--val-data",
        "examples/data/paragraph.u16",
        "--eval-every",
        "2",
    ];
    args.extend_from_slice(extra);
    let out = optimusc(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    out
}

/// `--log /dev/stdout` (and `-`) with standard output redirected to a file (`> file`, not appending): the
/// records and the run's own lines all reach the file, none written over another (a log that opened the
/// name again wrote at the end of the file while the run's own output overwrote it from the start).
#[test]
fn a_log_to_standard_output_adds_to_the_redirected_file() {
    for name in ["/dev/stdout", "-"] {
        let redirected = scratch("stdout.txt");
        let file = std::fs::File::create(&redirected).expect("create");
        let status = Command::new(env!("CARGO_BIN_EXE_optimusc"))
            .args(["run", "examples/tiny.opt", "--set", "vocab=333", "--steps", "4"])
            .args(["--data", "examples/data/paragraph.u16", "--log", name])
            .stdout(file)
            .stderr(std::process::Stdio::null())
            .status()
            .expect("optimusc runs");
        assert!(status.success(), "{name}");
        let written = std::fs::read_to_string(&redirected).expect("read");
        let records: Vec<_> = written.lines().filter(|l| l.starts_with('{')).collect();
        assert_eq!(records.len(), 4, "{name}: one record a step: {written}");
        assert!(records.iter().all(|r| serde_json::from_str::<serde_json::Value>(r).is_ok()), "{name}: {written}");
        for step in 0..4 {
            assert!(written.contains(&format!("step {step}: loss")), "{name}: the run's own lines are kept: {written}");
        }
        assert!(!Path::new("-").exists(), "no file named `-`");
    }
}

#[test]
fn log_appends_the_records_json_prints_and_a_second_run_continues_it() {
    let log = scratch("appended.jsonl");
    let first = tiny_run(&["--json", "--log", text(&log)]);
    let printed = json_lines(&String::from_utf8_lossy(&first.stdout));
    assert_eq!(printed.len(), 4 + 2, "4 step records and 2 validation records");
    let logged = json_lines(&std::fs::read_to_string(&log).expect("log written"));
    assert_eq!(logged, printed, "the log holds exactly the --json records");

    let second = tiny_run(&["--json", "--log", text(&log)]);
    let printed_again = json_lines(&String::from_utf8_lossy(&second.stdout));
    let logged = json_lines(&std::fs::read_to_string(&log).expect("log kept"));
    assert_eq!(logged.len(), 2 * printed.len(), "the second run appends, never truncates");
    assert_eq!(logged[..printed.len()], printed[..]);
    assert_eq!(logged[printed.len()..], printed_again[..]);
}

/// A log whose last line was cut short (a killed run) gets that line ended before the next run's
/// records, which stay lines of their own.
#[test]
fn a_log_cut_short_is_continued_on_a_new_line() {
    let log = scratch("cut-short.jsonl");
    std::fs::write(&log, "{\"step\":0,\"loss\":1.0}\n{\"step\":5,\"lo").expect("write");
    let run = tiny_run(&["--json", "--log", text(&log)]);
    let printed = json_lines(&String::from_utf8_lossy(&run.stdout));
    let written = std::fs::read_to_string(&log).expect("log kept");
    let lines: Vec<&str> = written.lines().collect();
    assert_eq!(lines[..2], ["{\"step\":0,\"loss\":1.0}", "{\"step\":5,\"lo"], "{written}");
    assert_eq!(json_lines(&lines[2..].join("\n")), printed, "{written}");
}

#[test]
fn log_works_without_json() {
    let log = scratch("quiet.jsonl");
    let out = tiny_run(&["--log", text(&log)]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("step 3: loss"), "plain lines on stdout: {stdout}");
    let logged = json_lines(&std::fs::read_to_string(&log).expect("log written"));
    let steps: Vec<u64> =
        logged.iter().filter(|r| r.get("loss").is_some()).filter_map(|r| r["step"].as_u64()).collect();
    assert_eq!(steps, vec![0, 1, 2, 3]);
    let val: Vec<u64> =
        logged.iter().filter(|r| r.get("val_loss").is_some()).filter_map(|r| r["step"].as_u64()).collect();
    assert_eq!(val, vec![1, 3]);
    for record in logged.iter().filter(|r| r.get("loss").is_some()) {
        for field in ["lr", "tokens_per_s", "elapsed_s"] {
            assert!(record[field].is_number(), "{field} in {record}");
        }
    }
}

#[test]
fn a_log_that_cannot_be_written_is_a_usage_error_before_the_run() {
    let dir = scratch("a-directory");
    std::fs::create_dir_all(&dir).expect("dir");
    let missing = scratch("no-such-dir").join("run.jsonl");
    for (path, says) in [(text(&missing), "does not exist"), (text(&dir), "directory")] {
        let out = optimusc(&["run", "examples/tiny.opt", "--steps", "2", "--json", "--log", path]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{path}: {stderr}");
        assert!(stderr.contains("--log") && stderr.contains(says), "{path}: {stderr}");
        assert!(out.stdout.is_empty(), "nothing ran: {}", String::from_utf8_lossy(&out.stdout));
    }
    assert!(!missing.exists());
}

#[test]
fn plot_draws_training_validation_and_throughput_curves() {
    let log = scratch("plotted.jsonl");
    tiny_run(&["--log", text(&log)]);
    let svg = scratch("curves.svg");
    let out = optimusc(&["plot", text(&log), "-o", text(&svg)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let drawn = std::fs::read_to_string(&svg).expect("SVG written");
    assert!(drawn.trim_start().starts_with("<svg") && drawn.trim_end().ends_with("</svg>"), "{drawn:.200}");
    for label in ["training loss", "validation loss", "tokens/s", "step", "throughput"] {
        assert!(drawn.contains(label), "the SVG has no `{label}`");
    }
    assert!(drawn.contains("<polyline"), "curves are drawn as lines");
    assert!(drawn.contains("<circle"), "validation losses are marked");
}

#[test]
fn a_step_logged_again_takes_its_latest_values() {
    let log = "{\"step\": 0, \"loss\": 5.0, \"tokens_per_s\": 100}\n\
               {\"step\": 1, \"loss\": 4.0, \"tokens_per_s\": 100}\n\
               {\"profile\": {\"devices\": []}}\n\
               \n\
               {\"step\": 1, \"loss\": 3.5, \"tokens_per_s\": 200}\n\
               {\"step\": 1, \"val_loss\": 3.9}\n\
               {\"step\": 2, \"loss\": null, \"tokens_per_s\": 300}\n";
    let metrics = parse_metrics(log.as_bytes()).expect("a valid log");
    assert_eq!(metrics.loss.into_iter().collect::<Vec<_>>(), vec![(0, 5.0), (1, 3.5)]);
    assert_eq!(metrics.val_loss.into_iter().collect::<Vec<_>>(), vec![(1, 3.9)]);
    assert_eq!(metrics.tokens_per_s.into_iter().collect::<Vec<_>>(), vec![(0, 100.0), (1, 200.0), (2, 300.0)]);
}

/// A log's last record cut short (a killed run) is skipped; a record cut short before others is still
/// an error naming its line.
#[test]
fn only_a_last_record_cut_short_is_skipped() {
    let metrics = parse_metrics("{\"step\": 0, \"loss\": 1.0}\n{\"step\": 1, \"los".as_bytes()).expect("skipped");
    assert_eq!(metrics.loss.into_iter().collect::<Vec<_>>(), vec![(0, 1.0)]);
    let error =
        parse_metrics("{\"step\": 0, \"lo\n{\"step\": 1, \"loss\": 2.0}\n".as_bytes()).expect_err("in the middle");
    assert!(error.to_string().contains("line 1"), "{error}");
}

/// Values near the ends of f64 (a diverged run) make finite axes: the plot is drawn, and soon (an axis
/// range of -1e308 to 1e308 used to make `plot` spin forever).
#[test]
fn plot_draws_values_near_the_ends_of_the_float_range() {
    let cases = [
        (
            "extremes.jsonl",
            "{\"step\": 0, \"loss\": 1e308, \"tokens_per_s\": 1.7e308}\n{\"step\": 1, \"loss\": -1e308, \"tokens_per_s\": 1}\n",
        ),
        (
            "largest.jsonl",
            "{\"step\": 0, \"loss\": 1.7976931348623157e308, \"tokens_per_s\": 1.7976931348623157e308}\n",
        ),
    ];
    for (name, contents) in cases {
        let log = scratch(name);
        std::fs::write(&log, contents).expect("write log");
        let svg = scratch(&format!("{name}.svg"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_optimusc"))
            .args(["plot", text(&log), "-o", text(&svg)])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("optimusc starts");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait") {
                break Some(status);
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let status = status.unwrap_or_else(|| panic!("{name}: plot still running after 60 s"));
        assert!(status.success(), "{name}: {status}");
        let drawn = std::fs::read_to_string(&svg).expect("SVG written");
        assert!(drawn.contains("</svg>"), "{name}");
        // Labels of such values are short (1.00e307), not hundreds of digits.
        assert!(drawn.contains("e307") && !drawn.contains("0000000000"), "{name}");
    }
}

/// Records with something to plot that cannot be drawn (no whole-number step, a throughput below zero)
/// are left out, and the note says how many and why.
#[test]
fn plot_says_which_records_it_leaves_out() {
    let log = scratch("left-out.jsonl");
    let lines = [
        "{\"step\": 0, \"loss\": 4.0, \"tokens_per_s\": -5}",
        "{\"step\": 1, \"loss\": 3.5, \"tokens_per_s\": 900}",
        "{\"step\": -1, \"loss\": 2}",
        "{\"step\": 1.5, \"loss\": 2}",
        "{\"loss\": 3}",
        "{\"note\": \"nothing to plot\"}",
    ];
    std::fs::write(&log, lines.join("\n")).expect("write log");
    let svg = scratch("left-out.svg");
    let out = optimusc(&["plot", text(&log), "-o", text(&svg)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("left out 3 records with a loss or throughput but no whole-number `step`"), "{stderr}");
    assert!(stderr.contains("left out 1 `tokens_per_s` below zero"), "{stderr}");
    assert!(stderr.contains("training losses: 2, validation losses: 0, throughputs: 1"), "{stderr}");
}

#[test]
fn plot_errors_name_the_problem_and_write_nothing() {
    let svg = scratch("never.svg");
    let cases = [
        ("not-object.jsonl", "{\"step\": 0, \"loss\": 4}\n[1, 2]\n", "line 2: expected a JSON object"),
        ("not-json.jsonl", "{\"step\": 0, \"loss\": 4}\n\n{\"step\": 1, \"loss\": }\n", "line 3, column"),
        ("nothing.jsonl", "{\"profile\": {}}\n{\"step\": 1}\n", "has 2 records but none with a whole-number `step`"),
        (
            "misspelled.jsonl",
            "{\"step\": 0, \"los\": 4.2}\n{\"step\": 1, \"los\": 4.1}\n",
            "(the fields it has: `los`, `step`)",
        ),
        ("empty.jsonl", "", "no record to plot"),
    ];
    for (name, contents, says) in cases {
        let log = scratch(name);
        std::fs::write(&log, contents).expect("write log");
        let out = optimusc(&["plot", text(&log), "-o", text(&svg)]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(stderr.contains(says), "{name}: {stderr}");
        assert!(!svg.exists(), "{name}: no SVG after a failure");
    }
    let out = optimusc(&["plot", text(&scratch("missing.jsonl")), "-o", text(&svg)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read metrics log"));
    let log = scratch("kept.jsonl");
    std::fs::write(&log, "{\"step\": 0, \"loss\": 4}\n").expect("write log");
    let out = optimusc(&["plot", text(&log)]);
    assert_eq!(out.status.code(), Some(2), "-o is required");
    let out = optimusc(&["plot", text(&log), "-o", text(&log)]);
    assert_eq!(out.status.code(), Some(2), "the log is never overwritten by its plot");
    assert_eq!(std::fs::read_to_string(&log).expect("log kept"), "{\"step\": 0, \"loss\": 4}\n");
}
