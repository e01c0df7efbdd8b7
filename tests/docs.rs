//! The documentation works as written: every command in a ```sh fence of README.md and docs/*.md runs
//! with the built `optimusc` and exits 0 (after any shrink the doc states next to it), or is skipped by
//! a named rule; and docs/diagnostics.md documents exactly the error codes the source uses.
//!
//! A doc states a shrink in an HTML comment right before the fence it applies to:
//! `<!-- test: shrink "--steps 100" to "--steps 3" -->` replaces the first text in every command of
//! that fence, and `<!-- test: prints "991.117 ms" "3.42 GiB" -->` says that what the fence's commands
//! print (standard output and error together) holds each quoted text: the figures a page quotes from a
//! command are what the command prints now. Commands run in a fresh directory per doc (so later commands see the files earlier
//! ones wrote), holding a copy of `examples/`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// README.md and every docs/*.md, by path relative to the repository.
fn doc_files() -> Vec<String> {
    let mut docs: Vec<String> = std::fs::read_dir(root().join("docs"))
        .expect("the docs folder")
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    docs.sort();
    docs.insert(0, "README.md".to_string());
    docs
}

// ---- extracting commands --------------------------------------------------------------------------

/// One command line of a ```sh fence (continuation lines joined, comment removed).
struct DocCommand {
    line: usize,
    text: String,
    /// The texts the output of this command's fence must hold, on the fence's last command.
    prints: Vec<String>,
    /// Whether this is the last command of its fence.
    ends_fence: bool,
}

/// Text a doc replaces in the commands of its next fence when the test runs them: (from, to).
type Shrink = (String, String);

/// The commands of every ```sh fence of a doc, with the shrinks stated before each fence applied; a
/// shrink that changes no command of its fence, or comes before another kind of fence, is an error.
fn sh_commands(text: &str) -> Result<Vec<DocCommand>, String> {
    let mut commands = Vec::new();
    for fence in fences(text) {
        let shrinks: Vec<Shrink> = fence
            .notes
            .iter()
            .filter_map(|note| note.strip_prefix("<!-- test: shrink "))
            .map(parse_shrink)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("line {}: {e}", fence.line))?;
        if fence.info != "sh" {
            if !shrinks.is_empty() {
                return Err(format!("line {}: a shrink before a `{}` fence, not an sh one", fence.line, fence.info));
            }
            continue;
        }
        let mut fence_commands = joined_lines(fence.line + 1, &fence.body);
        let prints: Vec<String> = fence
            .notes
            .iter()
            .filter_map(|note| note.strip_prefix("<!-- test: prints "))
            .map(parse_prints)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("line {}: {e}", fence.line))?
            .concat();
        match fence_commands.last_mut() {
            Some(last) => (last.prints, last.ends_fence) = (prints, true),
            None if !prints.is_empty() => return Err(format!("line {}: `prints` before an empty fence", fence.line)),
            None => {}
        }
        for (from, to) in &shrinks {
            let hits = fence_commands.iter_mut().filter(|c| c.text.contains(from.as_str()));
            let changed = hits.map(|c| c.text = c.text.replacen(from.as_str(), to, 1)).count();
            if changed == 0 {
                return Err(format!("line {}: the shrink of `{from}` changes no command of its fence", fence.line));
            }
        }
        commands.extend(fence_commands);
    }
    Ok(commands)
}

/// The command lines of a fence body starting at line `first`: comments removed, lines ending in `\`
/// joined to the next, blank lines dropped.
fn joined_lines(first: usize, body: &[String]) -> Vec<DocCommand> {
    let mut commands = Vec::new();
    let mut partial: Option<DocCommand> = None;
    for (offset, raw) in body.iter().enumerate() {
        let code = strip_comment(raw).trim();
        let joined = match partial.take() {
            Some(p) => {
                DocCommand { line: p.line, text: format!("{} {code}", p.text), prints: Vec::new(), ends_fence: false }
            }
            None => DocCommand { line: first + offset, text: code.to_string(), prints: Vec::new(), ends_fence: false },
        };
        if let Some(head) = joined.text.strip_suffix('\\') {
            partial = Some(DocCommand {
                line: joined.line,
                text: head.trim_end().to_string(),
                prints: Vec::new(),
                ends_fence: false,
            });
        } else if !joined.text.is_empty() {
            commands.push(joined);
        }
    }
    commands
}

/// `"FROM" to "TO" -->` from a shrink comment.
fn parse_shrink(rest: &str) -> Result<Shrink, String> {
    let body = rest.trim().strip_suffix("-->").ok_or("a shrink comment ends with `-->`")?.trim();
    let (from, to) = body.split_once("\" to \"").ok_or("write: shrink \"FROM\" to \"TO\"")?;
    let from = from.strip_prefix('"').ok_or("FROM is quoted")?;
    let to = to.strip_suffix('"').ok_or("TO is quoted")?;
    Ok((from.to_string(), to.to_string()))
}

/// `"A" "B" -->` from a prints comment: the quoted texts.
fn parse_prints(rest: &str) -> Result<Vec<String>, String> {
    let body = rest.trim().strip_suffix("-->").ok_or("a prints comment ends with `-->`")?.trim();
    let texts: Vec<String> = body.split('"').skip(1).step_by(2).map(str::to_string).collect();
    if texts.is_empty() || body.matches('"').count() != 2 * texts.len() {
        return Err("write: prints \"TEXT\" \"TEXT\" ...".into());
    }
    Ok(texts)
}

/// The line without a `#` comment (a `#` that starts a word outside quotes).
fn strip_comment(line: &str) -> &str {
    let (mut single, mut double, mut previous) = (false, false, ' ');
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && previous.is_whitespace() => return &line[..i],
            _ => {}
        }
        previous = c;
    }
    line
}

/// Shell words: quotes removed, `$NAME` and `${NAME}` outside single quotes replaced from `vars`
/// (unquoted values split into words, as the shell does); with the names of variables not set, which
/// expand to nothing.
fn words(text: &str, vars: &BTreeMap<String, String>) -> Result<(Vec<String>, Vec<String>), String> {
    let mut out = Vec::new();
    let mut unset = Vec::new();
    let mut word: Option<String> = None;
    let (mut single, mut double) = (false, false);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '$' if !single && chars.peek().is_some_and(|n| n.is_ascii_alphabetic() || *n == '_' || *n == '{') => {
                let braced = chars.next_if_eq(&'{').is_some();
                let mut name = String::new();
                while let Some(n) = chars.next_if(|n| n.is_ascii_alphanumeric() || *n == '_') {
                    name.push(n);
                }
                if braced && chars.next() != Some('}') {
                    return Err(format!("unclosed ${{{name}"));
                }
                let value = vars.get(&name).map_or("", String::as_str);
                if !vars.contains_key(&name) {
                    unset.push(name);
                }
                if double {
                    word.get_or_insert_with(String::new).push_str(value);
                } else {
                    let mut parts = value.split_whitespace().peekable();
                    while let Some(part) = parts.next() {
                        word.get_or_insert_with(String::new).push_str(part);
                        if parts.peek().is_some() {
                            out.extend(word.take());
                        }
                    }
                }
            }
            c if c.is_whitespace() && !single && !double => out.extend(word.take()),
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    if single || double {
        return Err("unbalanced quotes".to_string());
    }
    out.extend(word);
    Ok((out, unset))
}

/// What a command line means, given the variables the doc set before it: a command that would run
/// must not use a variable the doc never set.
fn interpret(text: &str, vars: &BTreeMap<String, String>) -> Result<Kind, String> {
    let (words, unset) = words(text, vars)?;
    match classify(&words)? {
        Kind::Run(_) if !unset.is_empty() => Err(format!("uses ${} before the doc sets it", unset.join(", $"))),
        kind => Ok(kind),
    }
}

// ---- deciding what to do with each command -------------------------------------------------------

/// A command the test cannot run here, and why.
struct SkipRule {
    why: &'static str,
    applies: fn(&[String]) -> bool,
}

const SKIP_RULES: &[SkipRule] = &[
    SkipRule { why: "MPI launcher (mpirun, srun): needs MPI and several processes", applies: is_mpi_launch },
    SkipRule { why: "GPU (--backend cuda): needs a CUDA device", applies: uses_cuda },
    SkipRule { why: "cargo build: the test runs the binary cargo built for it", applies: is_cargo_build },
    SkipRule { why: "scripts/test.sh: the whole suite, which includes this test", applies: is_test_suite },
    SkipRule { why: "scripts/hf_compare.sh: installs PyTorch (5.6 GB) from PyPI", applies: is_hf_compare },
    SkipRule {
        why: "scripts/bench_vs_torch.sh, bench_gpu.sh, bench_simulate.py: benchmarks (minutes), not tests",
        applies: is_benchmark,
    },
    SkipRule {
        why: "python3/printf writing an input file for a diagnostics.md example",
        applies: writes_example_input,
    },
];

fn is_mpi_launch(words: &[String]) -> bool {
    matches!(words.first().map(String::as_str), Some("mpirun" | "srun"))
}

fn uses_cuda(words: &[String]) -> bool {
    words.windows(2).any(|w| w[0] == "--backend" && w[1] == "cuda") || words.iter().any(|w| w == "--backend=cuda")
}

fn is_cargo_build(words: &[String]) -> bool {
    words.len() >= 2 && words[0] == "cargo" && words[1] == "build"
}

fn is_test_suite(words: &[String]) -> bool {
    words == ["bash", "scripts/test.sh"]
}

fn is_hf_compare(words: &[String]) -> bool {
    words.first().is_some_and(|w| w == "bash") && words.get(1).is_some_and(|w| w == "scripts/hf_compare.sh")
}

fn is_benchmark(words: &[String]) -> bool {
    words.first().is_some_and(|w| w == "bash")
        && words.get(1).is_some_and(|w| w == "scripts/bench_vs_torch.sh" || w == "scripts/bench_gpu.sh")
        || words.first().is_some_and(|w| w == "python3")
            && words.get(1).is_some_and(|w| w == "scripts/bench_simulate.py")
}

fn writes_example_input(words: &[String]) -> bool {
    let writer = matches!(words.first().map(String::as_str), Some("python3" | "printf"));
    let into_opt = words.windows(2).any(|w| w[0] == ">" && w[1].ends_with(".opt"));
    writer && into_opt
}

/// What a command line of a doc is.
enum Kind {
    /// `NAME=VALUE` or `export NAME=VALUE`: remembered for later `$NAME`.
    Assignment(String, String),
    /// `optimusc ARGS`, `target/release/optimusc ARGS` or `cargo run --release -- ARGS`.
    Run(Vec<String>),
    Skip(&'static str),
}

fn classify(words: &[String]) -> Result<Kind, String> {
    let words = words.strip_prefix(&["export".to_string()]).unwrap_or(words);
    // Leading environment assignments (`RAYON_NUM_THREADS=1 mpirun ...`) do not change what runs.
    let program_at = words.iter().position(|w| !is_assignment(w)).unwrap_or(words.len());
    if program_at == words.len() {
        return match words {
            [one] => {
                let (name, value) = one.split_once('=').unwrap_or((one.as_str(), ""));
                Ok(Kind::Assignment(name.to_string(), value.to_string()))
            }
            _ => Err("several assignments on one line".to_string()),
        };
    }
    let command = &words[program_at..];
    if let Some(rule) = SKIP_RULES.iter().find(|r| (r.applies)(command)) {
        return Ok(Kind::Skip(rule.why));
    }
    let args = match command.first().map(String::as_str) {
        Some("optimusc" | "target/release/optimusc" | "target/debug/optimusc") => &command[1..],
        Some("cargo") if command.get(1).is_some_and(|w| w == "run") => {
            let dashes = command.iter().position(|w| w == "--").ok_or("`cargo run` without `--`")?;
            &command[dashes + 1..]
        }
        _ => return Err("neither an optimusc command nor covered by a skip rule in tests/docs.rs".to_string()),
    };
    if let Some(shell) = args.iter().find(|w| matches!(w.as_str(), ">" | ">>" | "<" | "|" | "&&" | "||" | ";")) {
        return Err(format!("uses `{shell}`, which the test does not run through a shell"));
    }
    Ok(Kind::Run(args.to_vec()))
}

fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty()
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !name.starts_with(|c: char| c.is_ascii_digit())
    })
}

// ---- running ------------------------------------------------------------------------------------

/// Copies `from` into `to`, recursively.
fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

/// What happened to every command of the docs.
#[derive(Default)]
struct Tally {
    ran: usize,
    skipped: BTreeMap<&'static str, usize>,
    problems: Vec<String>,
}

/// Runs one doc's commands in order in a fresh directory.
fn run_doc(doc: &str, tally: &mut Tally) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    copy_dir(&root().join("examples"), &dir.path().join("examples")).expect("copying examples/");
    let commands = match sh_commands(&read(&root().join(doc))) {
        Ok(commands) => commands,
        Err(e) => return tally.problems.push(format!("{doc}: {e}")),
    };
    let mut vars = BTreeMap::new();
    // What the commands of the current fence printed, for its `prints` note.
    let mut printed = String::new();
    for command in commands {
        let place = format!("{doc}:{}: `{}`", command.line, command.text);
        match interpret(&command.text, &vars) {
            Ok(Kind::Assignment(name, value)) => {
                vars.insert(name, value);
            }
            Ok(Kind::Skip(why)) => *tally.skipped.entry(why).or_default() += 1,
            Ok(Kind::Run(args)) => {
                tally.ran += 1;
                match run_optimusc(&args, dir.path()) {
                    Ok(output) => printed.push_str(&output),
                    Err(e) => tally.problems.push(format!("{place}: {e}")),
                }
            }
            Err(e) => tally.problems.push(format!("{place}: {e}")),
        }
        for text in command.prints.iter().filter(|t| !printed.contains(t.as_str())) {
            tally
                .problems
                .push(format!("{place}: the doc quotes `{text}`, which its fence's commands no longer print"));
        }
        if command.ends_fence {
            printed.clear();
        }
    }
}

/// Runs optimusc in `dir`; its standard output and error together when it succeeds.
fn run_optimusc(args: &[String], dir: &Path) -> Result<String, String> {
    let started = std::time::Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(args)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot start optimusc: {e}"))?;
    eprintln!("{:>6.1}s optimusc {}", started.elapsed().as_secs_f64(), args.join(" "));
    if output.status.success() {
        let (out, err) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        return Ok(format!("{out}{err}"));
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(15).collect::<Vec<_>>().into_iter().rev().collect();
    Err(format!("exited with {}:\n{}", output.status, tail.join("\n")))
}

#[test]
fn every_documented_command_runs_as_written() {
    let mut tally = Tally::default();
    for doc in doc_files() {
        run_doc(&doc, &mut tally);
    }
    eprintln!("ran {} documented commands; skipped:", tally.ran);
    for (why, count) in &tally.skipped {
        eprintln!("  {count:>3}  {why}");
    }
    assert!(tally.problems.is_empty(), "documented commands that fail:\n\n{}", tally.problems.join("\n\n"));
    assert!(tally.ran >= 10, "expected the docs' commands to be found; ran only {}", tally.ran);
}

// ---- error codes ---------------------------------------------------------------------------------

/// Every `Code::EXXXX` and `Code::WXXXX` the Rust files under `dir` use.
fn codes_in_source(dir: &Path, codes: &mut BTreeSet<String>) {
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(dir).expect("a source folder").filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            codes_in_source(&path, codes);
        } else if path.extension().is_some_and(|e| e == "rs") && !path.ends_with("src/diag.rs") {
            // diag.rs defines every code; the others use them.
            codes.extend(quoted_codes(&read(&path)));
        }
    }
}

/// The error and warning codes a text uses: `Code::E` or `Code::W` and four digits (diagnostics take a
/// `diag::Code`).
fn quoted_codes(text: &str) -> Vec<String> {
    let mut codes = Vec::new();
    for (i, _) in text.match_indices("Code::") {
        let code = &text[i + 6..];
        let lettered = code.starts_with('E') || code.starts_with('W');
        if lettered && code.len() >= 5 && code.as_bytes()[1..5].iter().all(u8::is_ascii_digit) {
            codes.push(code[..5].to_string());
        }
    }
    codes
}

/// The codes with a `## EXXXX: ...` (or `## WXXXX: ...`) section in docs/diagnostics.md.
fn documented_codes(doc: &str) -> BTreeSet<String> {
    doc.lines()
        .filter_map(|l| l.strip_prefix("## "))
        .filter_map(|heading| heading.split_once(':').map(|(code, _)| code))
        .filter(|code| {
            code.len() == 5
                && (code.starts_with('E') || code.starts_with('W'))
                && code[1..].bytes().all(|b| b.is_ascii_digit())
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn every_error_code_in_the_source_is_documented_and_no_other() {
    let mut used = BTreeSet::new();
    codes_in_source(&root().join("src"), &mut used);
    codes_in_source(&root().join("crates"), &mut used);
    let doc = read(&root().join("docs/diagnostics.md"));
    let documented = documented_codes(&doc);
    assert!(used.len() >= 20, "expected the source's error codes to be found: {used:?}");
    let missing: Vec<&String> = used.difference(&documented).collect();
    let stale: Vec<&String> = documented.difference(&used).collect();
    assert!(
        missing.is_empty(),
        "codes used in the source without a `## CODE: ...` section in docs/diagnostics.md: {missing:?}"
    );
    assert!(stale.is_empty(), "codes documented in docs/diagnostics.md that the source no longer uses: {stale:?}");
    let unindexed: Vec<&String> = documented.iter().filter(|c| !doc.contains(&format!("| [{c}](#"))).collect();
    assert!(unindexed.is_empty(), "codes missing from the index table of docs/diagnostics.md: {unindexed:?}");
}

#[test]
fn commands_are_read_as_the_shell_reads_them() {
    let doc = "<!-- test: shrink \"--steps 100\" to \"--steps 2\" -->\n```sh\nP=\"--set a=1 --set b=2\"\noptimusc run x.opt $P \\\n    --steps 100   # train\n```\n```text\noptimusc not a command\n```\n";
    let commands = sh_commands(doc).expect("a well-formed doc");
    let texts: Vec<&str> = commands.iter().map(|c| c.text.as_str()).collect();
    assert_eq!(texts, ["P=\"--set a=1 --set b=2\"", "optimusc run x.opt $P --steps 2"]);
    assert_eq!(commands[1].line, 4, "a command is placed at its first line");
    let stale = "<!-- test: shrink \"--steps 7\" to \"--steps 2\" -->\n```sh\noptimusc run x.opt\n```\n";
    assert!(sh_commands(stale).is_err(), "a shrink that changes nothing is an error");
    let misplaced = "<!-- test: shrink \"a\" to \"b\" -->\n```text\na\n```\n";
    assert!(sh_commands(misplaced).is_err(), "a shrink before a text fence is an error");
    let mut vars = BTreeMap::new();
    let Ok(Kind::Assignment(name, value)) = interpret(&commands[0].text, &vars) else {
        panic!("`P=...` is an assignment")
    };
    vars.insert(name, value);
    let Ok(Kind::Run(args)) = interpret(&commands[1].text, &vars) else { panic!("an optimusc command runs") };
    assert_eq!(args, ["run", "x.opt", "--set", "a=1", "--set", "b=2", "--steps", "2"]);
}

#[test]
fn commands_nobody_can_run_here_are_skipped_only_by_a_rule() {
    let vars = BTreeMap::new();
    let kind = |line: &str| interpret(line, &vars);
    assert!(matches!(kind("RAYON_NUM_THREADS=1 mpirun -np 4 optimusc run t.opt"), Ok(Kind::Skip(_))));
    assert!(matches!(kind("optimusc run plan.json --backend cuda"), Ok(Kind::Skip(_))));
    assert!(matches!(kind("cargo run --release -- check x.opt"), Ok(Kind::Run(args)) if args == ["check", "x.opt"]));
    assert!(kind("curl https://example.com").is_err(), "an unknown program is an error, not a silent skip");
    assert!(kind("optimusc inspect p.json > report.txt").is_err(), "redirections are not silently dropped");
    assert!(kind("optimusc run $UNSET").is_err(), "an unset variable in a command that runs is an error");
    assert!(matches!(kind("export THREADS=$SLURM_CPUS"), Ok(Kind::Assignment(..))), "assignments may use them");
}

// ---- transcripts in docs/diagnostics.md ---------------------------------------------------------

/// A ```text fence of docs/diagnostics.md that starts with `$ optimusc ...`: the command, the output it
/// shows (a `...` line stands for any lines), and the ```opt fence right before it, if any.
struct Transcript {
    line: usize,
    command: String,
    output: Vec<String>,
    input: Option<String>,
}

/// A fenced block of a doc.
struct Fence {
    /// The line of the opening fence.
    line: usize,
    info: String,
    body: Vec<String>,
    /// The HTML comments (`<!-- ... -->`, one a line) between the previous fence and this one.
    notes: Vec<String>,
}

fn fences(text: &str) -> Vec<Fence> {
    let mut fences = Vec::new();
    let mut notes = Vec::new();
    let mut open: Option<Fence> = None;
    for (index, line) in text.lines().enumerate() {
        match (open.take(), line.trim_start().strip_prefix("```")) {
            (None, Some(info)) => {
                let notes = std::mem::take(&mut notes);
                open = Some(Fence { line: index + 1, info: info.trim().to_string(), body: Vec::new(), notes });
            }
            (Some(fence), Some(_)) => fences.push(fence),
            (Some(mut fence), None) => {
                fence.body.push(line.to_string());
                open = Some(fence);
            }
            (None, None) if line.trim_start().starts_with("<!--") => notes.push(line.trim().to_string()),
            (None, None) => {}
        }
    }
    fences
}

fn transcripts(text: &str) -> Vec<Transcript> {
    let fences = fences(text);
    let mut out = Vec::new();
    for (i, fence) in fences.iter().enumerate() {
        let Some(command) = fence.body.first().and_then(|l| l.strip_prefix("$ optimusc ")) else { continue };
        if fence.info != "text" {
            continue;
        }
        let before = i.checked_sub(1).and_then(|b| fences.get(b));
        let input = before.filter(|f| f.info == "opt").map(|f| f.body.join("\n") + "\n");
        let output = fence.body[1..].to_vec();
        out.push(Transcript { line: fence.line, command: command.to_string(), output, input });
    }
    out
}

/// Whether `actual` matches `expected`, where a `...` line of `expected` matches any lines.
fn matches_transcript(expected: &[String], actual: &[String]) -> bool {
    match expected.split_first() {
        None => actual.is_empty(),
        Some((first, rest)) if first.trim() == "..." => {
            (0..=actual.len()).any(|skip| matches_transcript(rest, &actual[skip..]))
        }
        Some((first, rest)) => actual
            .split_first()
            .is_some_and(|(a, more)| a.trim_end() == first.trim_end() && matches_transcript(rest, more)),
    }
}

fn trim_blank_ends(lines: Vec<String>) -> Vec<String> {
    let start = lines.iter().position(|l| !l.trim().is_empty()).unwrap_or(lines.len());
    let end = lines.iter().rposition(|l| !l.trim().is_empty()).map_or(start, |e| e + 1);
    lines[start..end].to_vec()
}

/// Runs a transcript's command; `None` when its input is made by a shell helper the test does not run.
fn replay(t: &Transcript, dir: &Path) -> Option<Result<(), String>> {
    let (args, _) = words(&t.command, &BTreeMap::new()).ok()?;
    let file = args.iter().find(|a| a.ends_with(".opt") && !a.starts_with("examples/"));
    match (file, &t.input) {
        (Some(name), Some(text)) => std::fs::write(dir.join(name), text).expect("writing the example input"),
        (Some(_), None) => return None,
        (None, _) => {}
    }
    let output = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(&args)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()
        .expect("starting optimusc");
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    let actual = trim_blank_ends(text.lines().map(str::to_string).collect());
    let expected = trim_blank_ends(t.output.clone());
    if !matches_transcript(&expected, &actual) {
        return Some(Err(format!("shows:\n{}\nbut prints:\n{}", expected.join("\n"), actual.join("\n"))));
    }
    // An output that reports errors comes with exit status 1, as the page says; any other with 0.
    let wanted = if expected.iter().any(|l| l.starts_with("error")) { 1 } else { 0 };
    match output.status.code() {
        Some(code) if code == wanted => Some(Ok(())),
        other => Some(Err(format!("exits with {other:?}, not {wanted}"))),
    }
}

/// Every example output in docs/diagnostics.md is what the binary prints today for that input.
#[test]
fn diagnostics_examples_show_the_real_output() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    copy_dir(&root().join("examples"), &dir.path().join("examples")).expect("copying examples/");
    let (mut replayed, mut helper_made, mut problems) = (0, 0, Vec::new());
    for t in transcripts(&read(&root().join("docs/diagnostics.md"))) {
        match replay(&t, dir.path()) {
            None => helper_made += 1,
            Some(result) => {
                replayed += 1;
                if let Err(e) = result {
                    problems.push(format!("docs/diagnostics.md:{}: `optimusc {}` {e}", t.line, t.command));
                }
            }
        }
    }
    eprintln!("replayed {replayed} transcripts; {helper_made} take input from a shell helper and were not run");
    assert!(problems.is_empty(), "examples that no longer match:\n\n{}", problems.join("\n\n"));
    assert!(replayed >= 40, "expected the transcripts to be found; replayed {replayed}");
}

#[test]
fn an_ellipsis_line_stands_for_any_lines() {
    let lines = |v: &[&str]| v.iter().map(|s| (*s).to_string()).collect::<Vec<_>>();
    assert!(matches_transcript(&lines(&["a", "...", "d"]), &lines(&["a", "b", "c", "d"])));
    assert!(matches_transcript(&lines(&["a", "...", "d"]), &lines(&["a", "d"])));
    assert!(!matches_transcript(&lines(&["a", "...", "d"]), &lines(&["a", "b"])));
    assert!(!matches_transcript(&lines(&["a", "b"]), &lines(&["a", "b", "c"])), "no unshown trailing lines");
}
