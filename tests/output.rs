//! Output files: `optimus::io::output::write_file` and `check_writable` on new paths, regular files,
//! links, devices, FIFOs, standard output and directories, stale and planted temporary files, and
//! interruption, through the library and through `optimusc compile -o`.

use optimus::io::output::{TEMP_MARK, check_writable, remove_in_progress_temp_files, write_file};
use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError, mpsc};
use std::time::{Duration, Instant};

/// Library tests that write take this lock: the interruption test removes every temporary file the
/// process has in progress, which must not be another test's.
static WRITING: Mutex<()> = Mutex::new(());

fn writing() -> MutexGuard<'static, ()> {
    WRITING.lock().unwrap_or_else(PoisonError::into_inner)
}

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("optimusc-output-").tempdir().expect("a scratch directory")
}

/// Names in `dir` that look like our temporary files.
fn temp_files(dir: &Path) -> Vec<String> {
    let names = fs::read_dir(dir).expect("listing a scratch directory");
    names.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.contains(TEMP_MARK)).collect()
}

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/tiny.opt")
}

/// `optimusc compile examples/tiny.opt --mesh 2x2 -o OUTPUT`, standard output piped.
fn compile_to(output: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .arg("compile")
        .arg(tiny())
        .args(["--mesh", "2x2", "-o"])
        .arg(output)
        .stdin(Stdio::null())
        .output()
        .expect("optimusc runs")
}

fn is_plan_json(bytes: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(bytes).is_ok_and(|v| v.get("format_version").is_some())
}

fn mkfifo(path: &Path) {
    let made = Command::new("mkfifo").arg(path).status().expect("mkfifo runs");
    assert!(made.success(), "mkfifo {} failed", path.display());
}

/// Whether this process may write where permissions say it may not (root): then such cases are moot.
fn ignores_permissions(dir: &Path) -> bool {
    let locked = dir.join("locked");
    fs::create_dir(&locked).expect("a directory");
    fs::set_permissions(&locked, fs::Permissions::from_mode(0o555)).expect("making it read-only");
    let privileged = fs::write(locked.join("probe"), b"x").is_ok();
    let _ = fs::remove_file(locked.join("probe"));
    let _ = fs::set_permissions(&locked, fs::Permissions::from_mode(0o755));
    let _ = fs::remove_dir(&locked);
    privileged
}

// ---- regular files and links ----------------------------------------------------------------------

#[test]
fn a_new_path_is_written_and_no_temporary_file_stays() {
    let _lock = writing();
    let dir = scratch();
    let path = dir.path().join("new.json");
    write_file(&path, b"{\"a\": 1}").expect("writing a new file");
    assert_eq!(fs::read(&path).expect("reading it back"), b"{\"a\": 1}");
    assert_eq!(temp_files(dir.path()), Vec::<String>::new());
}

#[test]
fn an_existing_file_is_replaced_by_a_new_one_with_its_permissions() {
    let _lock = writing();
    let dir = scratch();
    let path = dir.path().join("plan.json");
    fs::write(&path, b"old contents, longer than the new").expect("an existing file");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).expect("setting its mode");
    let old_inode = fs::metadata(&path).expect("metadata").ino();
    write_file(&path, b"new").expect("replacing it");
    let meta = fs::metadata(&path).expect("metadata");
    assert_eq!(fs::read(&path).expect("reading it back"), b"new");
    assert_eq!(meta.permissions().mode() & 0o7777, 0o640);
    assert_ne!(meta.ino(), old_inode, "the file must be replaced by a rename, not rewritten in place");
}

#[test]
fn a_symlink_stays_and_its_target_is_written() {
    let _lock = writing();
    let dir = scratch();
    let real = dir.path().join("real.json");
    let link = dir.path().join("link.json");
    fs::write(&real, b"old").expect("the target");
    symlink("real.json", &link).expect("a link");
    write_file(&link, b"new").expect("writing through the link");
    assert!(fs::symlink_metadata(&link).expect("metadata").file_type().is_symlink(), "the link must stay a link");
    assert_eq!(fs::read(&real).expect("reading the target"), b"new");
    assert_eq!(temp_files(dir.path()), Vec::<String>::new());
}

#[test]
fn a_chain_of_links_writes_the_last_target_in_its_own_directory() {
    let _lock = writing();
    let dir = scratch();
    let elsewhere = dir.path().join("elsewhere");
    fs::create_dir(&elsewhere).expect("a second directory");
    let real = elsewhere.join("real.json");
    fs::write(&real, b"old").expect("the final target");
    symlink(&real, dir.path().join("b.json")).expect("second link");
    symlink("b.json", dir.path().join("a.json")).expect("first link");
    write_file(&dir.path().join("a.json"), b"new").expect("writing through two links");
    assert_eq!(fs::read(&real).expect("reading the target"), b"new");
    for name in ["a.json", "b.json"] {
        let meta = fs::symlink_metadata(dir.path().join(name)).expect("metadata");
        assert!(meta.file_type().is_symlink(), "{name} must stay a link");
    }
    assert_eq!(temp_files(dir.path()), Vec::<String>::new());
    assert_eq!(temp_files(&elsewhere), Vec::<String>::new());
}

#[test]
fn a_link_to_nothing_is_refused_and_nothing_is_created() {
    let _lock = writing();
    let dir = scratch();
    let link = dir.path().join("dangling.json");
    symlink("missing.json", &link).expect("a dangling link");
    let error = write_file(&link, b"x").expect_err("a dangling link is refused").to_string();
    assert!(
        error.contains("dangling.json") && error.contains("missing.json") && error.contains("does not exist"),
        "{error}"
    );
    assert!(!dir.path().join("missing.json").exists());
    assert!(check_writable(&link).is_err());
}

#[test]
fn a_directory_is_an_error_naming_it() {
    let _lock = writing();
    let dir = scratch();
    let error = write_file(dir.path(), b"x").expect_err("a directory is refused").to_string();
    assert!(error.contains(&dir.path().display().to_string()) && error.contains("is a directory"), "{error}");
    let checked = check_writable(dir.path()).expect_err("a directory is refused").to_string();
    assert!(checked.contains("is a directory"), "{checked}");
}

#[test]
fn a_missing_directory_is_an_error_naming_it() {
    let _lock = writing();
    let dir = scratch();
    let path = dir.path().join("no-such-dir").join("plan.json");
    let error = write_file(&path, b"x").expect_err("a missing directory is refused").to_string();
    assert!(error.contains("no-such-dir`") && error.contains("does not exist"), "{error}");
    assert!(!dir.path().join("no-such-dir").exists());
}

#[test]
fn a_link_planted_at_the_old_temporary_name_is_not_followed() {
    let _lock = writing();
    let dir = scratch();
    let victim = dir.path().join("victim.txt");
    fs::write(&victim, b"precious").expect("an unrelated file");
    let old_style = dir.path().join(format!(".plan.json.tmp-{}", std::process::id()));
    symlink(&victim, &old_style).expect("a planted link");
    write_file(&dir.path().join("plan.json"), b"plan").expect("writing the plan");
    assert_eq!(fs::read(&victim).expect("reading the unrelated file"), b"precious");
    assert_eq!(fs::read(dir.path().join("plan.json")).expect("reading the plan"), b"plan");
}

#[test]
fn a_stale_temporary_file_of_a_dead_writer_is_removed_and_a_live_ones_kept() {
    let _lock = writing();
    let dir = scratch();
    let mut gone = Command::new("true").spawn().expect("a short-lived process");
    let dead_pid = gone.id();
    gone.wait().expect("it ends");
    let stale = dir.path().join(format!(".plan.json{TEMP_MARK}{dead_pid}-abcdefghij.tmp"));
    let live = dir.path().join(format!(".plan.json{TEMP_MARK}{}-klmnopqrst.tmp", std::process::id()));
    fs::write(&stale, b"left by a killed run").expect("a stale temporary file");
    fs::write(&live, b"being written").expect("a live temporary file");
    write_file(&dir.path().join("plan.json"), b"plan").expect("writing the plan");
    assert!(!stale.exists(), "the dead writer's temporary file must be removed");
    assert!(live.exists(), "a live writer's temporary file must be kept");
}

// ---- check_writable -------------------------------------------------------------------------------

#[test]
fn check_writable_accepts_good_paths_and_leaves_nothing_behind() {
    let _lock = writing();
    let dir = scratch();
    check_writable(&dir.path().join("weights.safetensors")).expect("a new file in an existing directory");
    fs::write(dir.path().join("old.safetensors"), b"old").expect("an existing file");
    check_writable(&dir.path().join("old.safetensors")).expect("an existing file");
    check_writable(Path::new("/dev/null")).expect("a device");
    let left: Vec<String> = fs::read_dir(dir.path())
        .expect("listing")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, vec!["old.safetensors".to_string()]);
    assert_eq!(fs::read(dir.path().join("old.safetensors")).expect("reading"), b"old");
}

#[test]
fn check_writable_names_a_missing_directory() {
    let dir = scratch();
    let error =
        check_writable(&dir.path().join("absent/weights.safetensors")).expect_err("no such directory").to_string();
    assert!(error.contains("absent`") && error.contains("does not exist"), "{error}");
}

#[test]
fn check_writable_rejects_a_read_only_directory() {
    let dir = scratch();
    if ignores_permissions(dir.path()) {
        eprintln!("skipped: this process writes regardless of permissions (root)");
        return;
    }
    let locked = dir.path().join("read-only");
    fs::create_dir(&locked).expect("a directory");
    fs::set_permissions(&locked, fs::Permissions::from_mode(0o555)).expect("making it read-only");
    let error = check_writable(&locked.join("w.safetensors")).expect_err("a read-only directory").to_string();
    let _ = fs::set_permissions(&locked, fs::Permissions::from_mode(0o755));
    assert!(error.contains("read-only`") && error.contains("Permission denied"), "{error}");
}

// ---- interruption ---------------------------------------------------------------------------------

/// Removing the in-progress temporary files (what the SIGINT handler does) mid-write leaves no
/// temporary file and no half-written target. A CLI version would need a write slow enough to catch
/// (see `sigint_while_writing_a_fifo_exits_130` for the handler's exit).
#[test]
fn removing_in_progress_temp_files_mid_write_leaves_nothing() {
    let _lock = writing();
    let dir = scratch();
    let target = dir.path().join("big.bin");
    let big = vec![7u8; 256 << 20];
    let writer = {
        let target = target.clone();
        std::thread::spawn(move || write_file(&target, &big))
    };
    let start = Instant::now();
    let mut removed = 0;
    while removed == 0 && !writer.is_finished() && start.elapsed() < Duration::from_secs(30) {
        if !temp_files(dir.path()).is_empty() {
            removed = remove_in_progress_temp_files();
        }
    }
    let result = writer.join().expect("the writer thread");
    assert_eq!(temp_files(dir.path()), Vec::<String>::new());
    if removed > 0 {
        assert!(result.is_err(), "a write whose temporary file vanished must fail");
        assert!(!target.exists(), "no partial target may appear");
    } else {
        eprintln!("the write finished before its temporary file was seen; only the cleanup was checked");
        assert_eq!(fs::metadata(&target).expect("the target").len(), 256 << 20);
    }
}

#[test]
fn sigint_while_writing_a_fifo_exits_130() {
    let dir = scratch();
    let fifo = dir.path().join("plan.fifo");
    mkfifo(&fifo);
    let (started, writer_started) = mpsc::channel();
    let (finish, may_finish) = mpsc::channel::<()>();
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            let mut pipe = fs::File::open(&fifo).expect("opening the FIFO for reading");
            let mut first = [0u8; 1024];
            pipe.read_exact(&mut first).expect("the first bytes of the plan");
            let _ = started.send(());
            // The plan is larger than a pipe's buffer: until we read on, the writer blocks.
            let _ = may_finish.recv_timeout(Duration::from_secs(30));
        })
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .arg("compile")
        .arg(tiny())
        .args(["--mesh", "2x2", "-o"])
        .arg(&fifo)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("optimusc starts");
    writer_started.recv_timeout(Duration::from_secs(30)).expect("optimusc starts writing the FIFO");
    let sent = Command::new("kill").args(["-INT", &child.id().to_string()]).status().expect("kill runs");
    assert!(sent.success());
    let output = wait_output(&mut child);
    let _ = finish.send(());
    reader.join().expect("the reader thread");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
}

/// Waits at most 30 s for a child, killing it if it takes longer.
fn wait_output(child: &mut std::process::Child) -> Output {
    let start = Instant::now();
    while child.try_wait().expect("waiting").is_none() {
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("optimusc did not end after SIGINT");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut stderr = Vec::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = pipe.read_to_end(&mut stderr);
    }
    Output { status: child.wait().expect("its status"), stdout: Vec::new(), stderr }
}

// ---- devices, FIFOs and standard output through the CLI -------------------------------------------

#[test]
fn compile_to_dev_full_fails_and_leaves_the_device() {
    let full = Path::new("/dev/full");
    if !fs::metadata(full).is_ok_and(|m| m.file_type().is_char_device()) {
        eprintln!("skipped: no /dev/full here");
        return;
    }
    let output = compile_to(full);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot write `/dev/full`: No space left on device"), "{stderr}");
    let meta = fs::symlink_metadata(full).expect("/dev/full is still there");
    assert!(meta.file_type().is_char_device(), "/dev/full must stay a character device");
}

#[test]
fn compile_to_a_fifo_writes_it_in_place() {
    let dir = scratch();
    let fifo = dir.path().join("plan.fifo");
    mkfifo(&fifo);
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || fs::read(&fifo).expect("reading the FIFO"))
    };
    let output = compile_to(&fifo);
    let plan = reader.join().expect("the reader thread");
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(is_plan_json(&plan), "the FIFO must carry the whole plan");
    assert!(fs::symlink_metadata(&fifo).expect("metadata").file_type().is_fifo(), "the FIFO must stay a FIFO");
}

#[test]
fn compile_to_dev_stdout_through_a_pipe_gives_only_the_plan() {
    let output = compile_to(Path::new("/dev/stdout"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(is_plan_json(&output.stdout), "standard output must be exactly the plan");
    assert!(stderr.contains("-> /dev/stdout"), "the summary goes to standard error: {stderr}");
}

#[test]
fn compile_to_dash_writes_the_plan_to_standard_output_and_no_file() {
    let dir = scratch();
    let output = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .arg("compile")
        .arg(tiny())
        .args(["--mesh", "2x2", "-o", "-"])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .output()
        .expect("optimusc runs");
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(is_plan_json(&output.stdout), "standard output must be exactly the plan");
    assert!(!dir.path().join("-").exists(), "`-` is standard output, not a file");
}

#[test]
fn compile_to_dev_stdout_redirected_to_a_file_fills_that_file() {
    let dir = scratch();
    let redirected = dir.path().join("stdout.json");
    let file = fs::File::create(&redirected).expect("a file for standard output");
    let status = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .arg("compile")
        .arg(tiny())
        .args(["--mesh", "2x2", "-o", "/dev/stdout"])
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(Stdio::null())
        .status()
        .expect("optimusc runs");
    assert_eq!(status.code(), Some(0));
    assert!(is_plan_json(&fs::read(&redirected).expect("reading the redirected output")));
}

#[test]
fn compile_through_a_symlink_keeps_the_link() {
    let dir = scratch();
    let real = dir.path().join("real.json");
    fs::write(&real, b"old").expect("the target");
    symlink("real.json", dir.path().join("link.json")).expect("a link");
    let output = compile_to(&dir.path().join("link.json"));
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(fs::symlink_metadata(dir.path().join("link.json")).expect("metadata").file_type().is_symlink());
    assert!(is_plan_json(&fs::read(&real).expect("reading the target")));
}

/// An output that cannot be written is a usage error (exit status 2) found before any work, named by
/// its flag, in every command that writes one.
#[test]
fn every_commands_unwritable_output_is_a_usage_error_before_any_work() {
    let dir = scratch();
    let missing = dir.path().join("no-such-dir").join("out");
    let missing = missing.to_str().expect("UTF-8");
    let plan = dir.path().join("plan.json");
    assert!(compile_to(&plan).status.success());
    let log = dir.path().join("log.jsonl");
    fs::write(&log, "{\"step\": 0, \"loss\": 1.0}\n").expect("written");
    let (tiny, plan, log) =
        (tiny(), plan.to_str().expect("UTF-8").to_string(), log.to_str().expect("UTF-8").to_string());
    let tiny = tiny.to_str().expect("UTF-8");
    let cases: [(&[&str], &str); 4] = [
        (&["compile", tiny, "-o", missing], "-o: cannot write"),
        (&["inspect", &plan, "--dot", missing], "--dot: cannot write"),
        (&["simulate", tiny, "--hardware", "dgx-a100", "--sweep", "--plot", missing], "--plot: cannot write"),
        (&["plot", &log, "-o", missing], "-o: cannot write"),
    ];
    for (args, message) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.code() == Some(2) && stderr.contains(message), "{args:?}: {stderr}");
    }
}

/// A plan written to standard output for a reader that stops early (`compile -o - | head`) is no error.
#[test]
fn a_plan_on_standard_output_ends_quietly_when_the_reader_stops() {
    let gpt3 = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/gpt3.opt");
    let mut child = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .arg("compile")
        .arg(&gpt3)
        .args(["--mesh", "8x8", "-o", "-"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("optimusc runs");
    let mut first = [0u8; 16];
    child.stdout.take().expect("piped").read_exact(&mut first).expect("the plan's first bytes");
    let out = child.wait_with_output().expect("optimusc ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !stderr.contains("error"), "{stderr}");
    assert!(first.starts_with(b"{\"format_version"), "{first:?}");
}

/// A path that ends in `/` names a folder even where none exists yet: refused before any work, not
/// after it, when the write fails.
#[test]
fn a_missing_folder_named_with_a_slash_is_refused_before_any_work() {
    let dir = scratch();
    let folder = format!("{}/", dir.path().join("not-yet").display());
    let error = check_writable(Path::new(&folder)).expect_err("a folder is no file").to_string();
    assert!(error.contains("names a directory"), "{error}");
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .arg("compile")
        .arg(tiny())
        .args(["-o", &folder])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && stderr.contains("-o: cannot write"), "{stderr}");
    assert!(!dir.path().join("not-yet").exists());
}
