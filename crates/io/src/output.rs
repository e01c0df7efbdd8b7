//! The one way optimusc writes an output file (plans, checkpoints, DOT graphs, SVG plots).
//!
//! [`write_file`] decides what a path names before writing to it:
//!
//! - a regular file, or a path that does not exist yet, in an existing directory: the bytes go to a
//!   temporary file created exclusively, under an unpredictable name, in the same directory
//!   (`.NAME.optimusc-PID-RANDOM.tmp`), are synced, and the temporary file is renamed over the
//!   target. Readers see the old file or the new one, never a part. An existing file keeps its
//!   permissions; a new one gets the usual defaults (0666 less the umask).
//! - a symbolic link (or a chain of them): the link stays, and the file it finally names is written as
//!   above, with its temporary file in that file's own directory. A link to nothing is refused: we
//!   never create a file at a place the user did not name.
//! - standard output or error (`-`, `/dev/stdout`, `/dev/fd/1`, `/proc/self/fd/1`, ...): written to the
//!   process's own stream, whatever it is (terminal, pipe or redirected file), never reopened by name
//!   (so a redirected file is appended to, not overwritten from its start).
//! - any other existing file that is not a regular file (a device such as `/dev/full` or `/dev/null`,
//!   a FIFO, a socket), and any path through `/dev/fd/` or `/proc/`: opened for writing in place,
//!   never created, truncated or replaced. A FIFO waits for a reader, as `echo > fifo` does.
//! - a directory: an error naming it.
//!
//! Temporary files of ours left by a killed run are removed by the next write to the same target,
//! unless the process named in them is still alive. SIGINT, SIGTERM and SIGHUP during a write remove
//! the temporary file and end the process with status 130. [`check_writable`] tells before a long
//! run whether its output could be written, and leaves nothing behind.

use std::fmt;
use std::fs::{self, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, Once, PoisonError};

/// What separates the target's name from the writer's PID in our temporary files' names.
pub const TEMP_MARK: &str = ".optimusc-";

/// Exit status after an interrupted write (as a shell reports SIGINT).
const INTERRUPTED_STATUS: i32 = 130;

/// Temporary files being written now, removed by the signal handler.
static IN_PROGRESS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Installs the signal handler once per process.
static HANDLER: Once = Once::new();

/// Signals received so far (SIGINT, SIGTERM or SIGHUP).
static SIGNALS: AtomicU32 = AtomicU32::new(0);

/// While set, the first signal asks a training loop to stop after its current step (see
/// [`graceful_stop`]) instead of exiting; this is what it prints.
static GRACEFUL: Mutex<Option<String>> = Mutex::new(None);

/// Why an output file could not be written, naming the path the user gave.
#[derive(Debug)]
pub struct OutputError {
    path: PathBuf,
    reason: String,
    kind: Option<io::ErrorKind>,
}

impl OutputError {
    fn new(path: &Path, reason: impl Into<String>) -> Self {
        OutputError { path: path.to_path_buf(), reason: reason.into(), kind: None }
    }

    fn io(path: &Path, error: &io::Error) -> Self {
        OutputError { path: path.to_path_buf(), reason: plain_message(error), kind: Some(error.kind()) }
    }

    /// The path the user named.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What went wrong, without the path: `No space left on device (os error 28)`.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The operating system's error kind, when the failure came from it.
    pub fn kind(&self) -> Option<io::ErrorKind> {
        self.kind
    }

    /// The same error, naming the path the user gave instead of the file written.
    fn relabel(mut self, path: &Path) -> Self {
        self.path = path.to_path_buf();
        self
    }

    /// Adds which file was really written, when a link led elsewhere.
    fn through(mut self, target: &Path) -> Self {
        if target != self.path {
            self.reason = format!("{} (writing `{}`, which it links to)", self.reason, target.display());
        }
        self
    }
}

impl fmt::Display for OutputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot write `{}`: {}", self.path.display(), self.reason)
    }
}

impl std::error::Error for OutputError {}

/// Where the bytes for a path go.
#[derive(Debug)]
enum Destination {
    Stdout,
    Stderr,
    /// An existing file that is not a regular file, or an open descriptor: written where it is.
    InPlace(PathBuf),
    /// A regular or new file, replaced through a temporary sibling; `None` permissions for a new file.
    Replace {
        target: PathBuf,
        permissions: Option<Permissions>,
    },
}

/// Writes `bytes` to `path` as the module documentation describes; the error names `path`.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<(), OutputError> {
    write_with(path, &mut |out: &mut dyn Write| out.write_all(bytes))
}

/// [`write_file`] for contents that `content` writes as it produces them (through a buffer), so that
/// a large text need not be built in memory first. A regular file is still replaced whole or not at
/// all; a stream or device may have received part of it when `content` fails.
pub fn write_with(path: &Path, content: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>) -> Result<(), OutputError> {
    write_replacing(path, Durability::Synced, content)
}

/// [`write_with`] for a file that can be made again (a compiled plan): replaced whole or not at all
/// like any other, but not synced to disk before the rename, which on a slow disk costs more than
/// writing it. After a power failure it may be missing or empty, never partly written.
pub fn write_regenerable(
    path: &Path,
    content: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
) -> Result<(), OutputError> {
    write_replacing(path, Durability::Regenerable, content)
}

/// Whether a replaced file is synced to disk before it takes its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Durability {
    Synced,
    Regenerable,
}

fn write_replacing(
    path: &Path,
    durability: Durability,
    content: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
) -> Result<(), OutputError> {
    install_interrupt_cleanup();
    match destination(path)? {
        Destination::Stdout => write_stream(path, &mut io::stdout().lock(), content),
        Destination::Stderr => write_stream(path, &mut io::stderr().lock(), content),
        Destination::InPlace(target) => {
            write_in_place(&target, content).map_err(|e| OutputError::io(path, &e).through(&target))
        }
        Destination::Replace { target, permissions } => {
            replace(&target, permissions, durability, content).map_err(|e| e.relabel(path).through(&target))
        }
    }
}

/// Runs `content` into `sink` through a buffer, and flushes it.
fn buffered(sink: &mut dyn Write, content: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>) -> io::Result<()> {
    let mut out = io::BufWriter::with_capacity(1 << 16, sink);
    content(&mut out)?;
    out.flush()
}

/// Whether `path` names the process's standard output, where a command should not also print its
/// summary.
pub fn is_standard_output(path: &Path) -> bool {
    matches!(standard_stream(path), Some(Destination::Stdout))
}

/// Whether [`write_file`] sends `path` to standard error (`/dev/stderr` and its other names).
pub fn is_standard_error(path: &Path) -> bool {
    matches!(standard_stream(path), Some(Destination::Stderr))
}

/// Tells whether [`write_file`] could write `path`, without writing it or leaving anything behind:
/// the directory must exist and take new files, a path must not be a directory or a link to nothing.
pub fn check_writable(path: &Path) -> Result<(), OutputError> {
    match destination(path)? {
        Destination::Stdout | Destination::Stderr => Ok(()),
        Destination::InPlace(target) => open_in_place(&target).map_err(|e| OutputError::io(path, &e).through(&target)),
        Destination::Replace { target, .. } => probe_directory(&target).map_err(|e| e.relabel(path).through(&target)),
    }
}

/// Removes every temporary file being written now; returns how many were removed.
///
/// The signal handler calls this; a part of the program with its own handler should call it too.
pub fn remove_in_progress_temp_files() -> usize {
    let paths = IN_PROGRESS.lock().unwrap_or_else(PoisonError::into_inner);
    paths.iter().filter(|p| fs::remove_file(p).is_ok()).count()
}

/// Installs (once per process) the SIGINT/SIGTERM/SIGHUP handler that removes the temporary files
/// being written and exits with status 130; during a [`graceful_stop`], the first signal only asks the
/// training loop to stop. Another handler installed earlier is left in place.
pub fn install_interrupt_cleanup() {
    HANDLER.call_once(|| {
        // An error means the program already has a handler; that one is responsible for exiting.
        let _ = ctrlc::set_handler(|| {
            let first = SIGNALS.fetch_add(1, Ordering::SeqCst) == 0;
            let graceful = GRACEFUL.lock().unwrap_or_else(PoisonError::into_inner).clone();
            if let (true, Some(message)) = (first, graceful) {
                if !message.is_empty() {
                    let _ = writeln!(io::stderr(), "{message}");
                }
                return;
            }
            remove_in_progress_temp_files();
            let _ = writeln!(io::stderr(), "interrupted");
            std::process::exit(INTERRUPTED_STATUS);
        });
    });
}

/// From now on, the first SIGINT/SIGTERM/SIGHUP prints `message` (nothing if it is empty) and is only
/// recorded, for a loop that polls [`stop_requested`] to finish its work and exit; a second one exits at
/// once, as before.
pub fn graceful_stop(message: &str) {
    install_interrupt_cleanup();
    *GRACEFUL.lock().unwrap_or_else(PoisonError::into_inner) = Some(message.to_string());
}

/// Whether a signal asked the process to stop (see [`graceful_stop`]).
pub fn stop_requested() -> bool {
    SIGNALS.load(Ordering::SeqCst) > 0
}

/// The exit status of a run stopped by a signal: 130, as a shell reports SIGINT.
pub fn interrupted_status() -> u8 {
    INTERRUPTED_STATUS as u8
}

/// Decides what `path` names; see the module documentation.
fn destination(path: &Path) -> Result<Destination, OutputError> {
    if let Some(stream) = standard_stream(path) {
        return Ok(stream);
    }
    if names_descriptor(path) {
        return Ok(Destination::InPlace(path.to_path_buf()));
    }
    let entry = match fs::symlink_metadata(path) {
        Ok(entry) => entry,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return new_file(path),
        Err(e) => return Err(OutputError::io(path, &e)),
    };
    let target = if entry.file_type().is_symlink() { link_target(path)? } else { path.to_path_buf() };
    let metadata = fs::metadata(&target).map_err(|e| OutputError::io(path, &e).through(&target))?;
    if metadata.is_dir() {
        return Err(OutputError::new(path, "it is a directory; name a file").through(&target));
    }
    if metadata.is_file() {
        return Ok(Destination::Replace { target, permissions: Some(metadata.permissions()) });
    }
    Ok(Destination::InPlace(target))
}

/// The process's own output streams, by the names Linux gives them (and `-`, standard output by the
/// usual convention, which `export -o -` and `calibrate -o -` document).
fn standard_stream(path: &Path) -> Option<Destination> {
    let text = path.to_str()?;
    match text {
        "-" | "/dev/stdout" | "/dev/fd/1" | "/proc/self/fd/1" => Some(Destination::Stdout),
        "/dev/stderr" | "/dev/fd/2" | "/proc/self/fd/2" => Some(Destination::Stderr),
        _ => None,
    }
}

/// Paths that name open descriptors or kernel files: never replaced, only written in place.
fn names_descriptor(path: &Path) -> bool {
    path.starts_with("/dev/fd") || path.starts_with("/proc")
}

/// A path that does not exist yet: its directory must.
fn new_file(path: &Path) -> Result<Destination, OutputError> {
    // `newdir/` names a folder, even one that does not exist yet: writing it would fail at the end.
    let names_a_folder = path.as_os_str().as_encoded_bytes().ends_with(b"/");
    if path.file_name().is_none() || names_a_folder {
        return Err(OutputError::new(path, "it names a directory, not a file"));
    }
    let dir = directory_of(path);
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(Destination::Replace { target: path.to_path_buf(), permissions: None }),
        Ok(_) => Err(OutputError::new(path, format!("`{}` is not a directory", dir.display()))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Err(OutputError::new(path, format!("directory `{}` does not exist", dir.display())))
        }
        Err(e) => {
            Err(OutputError::new(path, format!("cannot use directory `{}`: {}", dir.display(), plain_message(&e))))
        }
    }
}

/// The file a link finally names; a link to nothing is an error that says where it points.
fn link_target(path: &Path) -> Result<PathBuf, OutputError> {
    fs::canonicalize(path).map_err(|e| {
        if e.kind() != io::ErrorKind::NotFound {
            return OutputError::io(path, &e);
        }
        let points_to = fs::read_link(path).map_or_else(|_| "nothing".to_string(), |p| format!("`{}`", p.display()));
        OutputError::new(
            path,
            format!("it is a symbolic link to {points_to}, which does not exist; write that path directly or remove the link"),
        )
    })
}

/// The directory a file lives in (`.` for a bare name).
fn directory_of(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// Writes to one of the process's streams.
fn write_stream(
    path: &Path,
    stream: &mut impl Write,
    content: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
) -> Result<(), OutputError> {
    match buffered(stream, content) {
        // The reader stopped reading (`optimusc compile ... -o - | head`): it has all it wanted, as the
        // commands' text output takes a closed pipe too.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        written => written.map_err(|e| OutputError::io(path, &e)),
    }
}

/// Opens an existing file for writing without creating, truncating or replacing it; a FIFO is not
/// opened, since that waits for a reader (its permissions decide later whether it can be written).
fn open_in_place(target: &Path) -> io::Result<()> {
    if fs::metadata(target)?.file_type().is_fifo() {
        return Ok(());
    }
    OpenOptions::new().write(true).open(target).map(drop)
}

/// Writes an existing device, FIFO, socket or open descriptor where it is.
fn write_in_place(target: &Path, content: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>) -> io::Result<()> {
    let mut file = OpenOptions::new().write(true).open(target)?;
    buffered(&mut file, content)
}

/// Replaces a regular (or new) file through an exclusive temporary sibling, synced, then renamed.
fn replace(
    target: &Path,
    permissions: Option<Permissions>,
    durability: Durability,
    content: &mut dyn FnMut(&mut dyn Write) -> io::Result<()>,
) -> Result<(), OutputError> {
    let dir = directory_of(target);
    let name = file_name_text(target)?;
    remove_stale_temp_files(dir, &name);
    let mode = permissions.clone().unwrap_or_else(|| Permissions::from_mode(0o666));
    let mut temp = temp_file(dir, &name, mode).map_err(|e| temp_error(target, dir, &e))?;
    let _registered = Registered::new(temp.path());
    let written = (|| {
        if let Some(exact) = permissions {
            temp.as_file().set_permissions(exact)?;
        }
        buffered(temp.as_file_mut(), content)?;
        if durability == Durability::Synced {
            temp.as_file().sync_all()?;
        }
        Ok(())
    })();
    written.map_err(|e| OutputError::io(target, &e))?;
    temp.persist(target).map_err(|e| OutputError::io(target, &e.error))?;
    if durability == Durability::Synced {
        sync_directory(dir);
    }
    Ok(())
}

/// Proves that a temporary sibling of `target` can be created, and removes it at once.
fn probe_directory(target: &Path) -> Result<(), OutputError> {
    let dir = directory_of(target);
    let name = file_name_text(target)?;
    install_interrupt_cleanup();
    let temp = temp_file(dir, &name, Permissions::from_mode(0o600)).map_err(|e| temp_error(target, dir, &e))?;
    let _registered = Registered::new(temp.path());
    temp.close().map_err(|e| OutputError::io(target, &e))
}

/// Creates `.NAME.optimusc-PID-RANDOM.tmp` in `dir` exclusively (a planted file or link there fails).
fn temp_file(dir: &Path, name: &str, permissions: Permissions) -> io::Result<tempfile::NamedTempFile> {
    let prefix = format!(".{name}{TEMP_MARK}{}-", std::process::id());
    tempfile::Builder::new().prefix(&prefix).suffix(".tmp").rand_bytes(10).permissions(permissions).tempfile_in(dir)
}

fn temp_error(target: &Path, dir: &Path, error: &io::Error) -> OutputError {
    let reason = format!("cannot create a file in directory `{}`: {}", dir.display(), plain_message(error));
    OutputError { path: target.to_path_buf(), reason, kind: Some(error.kind()) }
}

/// A file's name as text (our temporary names are built from it).
fn file_name_text(target: &Path) -> Result<String, OutputError> {
    target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| OutputError::new(target, "it names a directory, not a file"))
}

/// Makes a finished rename durable; a file system that cannot sync directories is not an error.
fn sync_directory(dir: &Path) {
    if let Ok(handle) = fs::File::open(dir) {
        let _ = handle.sync_all();
    }
}

/// Removes our temporary files for `name` in `dir` whose writing process no longer exists.
///
/// Needs `/proc` to tell live processes from dead ones; without it nothing is removed.
fn remove_stale_temp_files(dir: &Path, name: &str) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let prefix = format!(".{name}{TEMP_MARK}");
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)).and_then(writer_pid) else {
            continue;
        };
        if !process_alive(pid) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// The PID in the rest of a temporary name, `PID-RANDOM.tmp`.
fn writer_pid(rest: &str) -> Option<u32> {
    let (pid, random) = rest.split_once('-')?;
    random.ends_with(".tmp").then(|| pid.parse().ok()).flatten()
}

fn process_alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// A temporary file listed in [`IN_PROGRESS`] while it lives.
struct Registered(PathBuf);

impl Registered {
    fn new(path: &Path) -> Self {
        let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        IN_PROGRESS.lock().unwrap_or_else(PoisonError::into_inner).push(path.clone());
        Registered(path)
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut paths = IN_PROGRESS.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = paths.iter().position(|p| *p == self.0) {
            paths.swap_remove(i);
        }
    }
}

/// An I/O error's own message, without the temporary path some libraries append to it.
fn plain_message(error: &io::Error) -> String {
    if let Some(code) = error.raw_os_error() {
        return io::Error::from_raw_os_error(code).to_string();
    }
    let inner = error.get_ref().and_then(|e| std::error::Error::source(e));
    inner.map_or_else(|| error.to_string(), ToString::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_contents_replace_a_file_whole_or_not_at_all() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("plan.json");
        for write in [write_with, write_regenerable] {
            fs::write(&path, b"old").expect("the old file");
            let failed = write(&path, &mut |out: &mut dyn Write| {
                out.write_all(&[b'x'; 100_000])?;
                Err(io::Error::other("the serializer failed"))
            });
            assert!(failed.is_err());
            assert_eq!(fs::read(&path).expect("still there"), b"old", "a failed write leaves the old file");
            let names: Vec<_> = fs::read_dir(dir.path()).expect("listing").collect();
            assert_eq!(names.len(), 1, "no temporary file is left behind");
            write(&path, &mut |out: &mut dyn Write| {
                (0..1000).try_for_each(|k| out.write_all(format!("{k},").as_bytes()))
            })
            .expect("written");
            let text = fs::read_to_string(&path).expect("the new file");
            assert!(text.starts_with("0,1,2,") && text.ends_with("998,999,"), "every piece, in order");
        }
    }
}
