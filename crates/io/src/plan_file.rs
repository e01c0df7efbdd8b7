//! Reading and writing plans: deterministic JSON, written atomically so that a failure leaves no file.

use crate::output::OutputError;
use optimus_plan::{FORMAT_VERSION, Plan};
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Why a plan file could not be read or written; every message names the file.
#[derive(Debug)]
pub enum PlanFileError {
    /// The plan could not be turned into JSON.
    Serialize { path: PathBuf, source: serde_json::Error },
    /// Writing the file failed.
    Write(OutputError),
    /// The operating system refused to look at or open the file.
    Unreadable { path: PathBuf, source: std::io::Error },
    /// A directory, device, pipe or socket where a plan file was expected.
    NotAFile { path: PathBuf, directory: bool },
    /// A file of `bytes` bytes, more than [`MAX_PLAN_BYTES`].
    TooLarge { path: PathBuf, bytes: u64 },
    /// A plan of another format version (`None`: the file names none).
    Version { path: PathBuf, found: Option<u64> },
    /// Valid JSON, but not an object (an array, a number, `null`...).
    NotAnObject { path: PathBuf },
    /// The JSON could not be read or parsed as a plan; its category says which.
    Parse { path: PathBuf, source: serde_json::Error },
}

impl fmt::Display for PlanFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanFileError::Serialize { path, source } => {
                write!(f, "cannot serialise the plan for `{}`: {source}", path.display())
            }
            PlanFileError::Write(e) => write!(f, "{e}"),
            PlanFileError::Unreadable { path, source } => write!(f, "cannot read `{}`: {source}", path.display()),
            PlanFileError::NotAFile { path, directory } => {
                let what = if *directory { "a directory" } else { "not a regular file (a device, pipe or socket)" };
                write!(f, "`{}` is {what}; a plan is a JSON file written by `optimusc compile`", path.display())
            }
            PlanFileError::TooLarge { path, bytes } => write!(
                f,
                "`{}` is {bytes} bytes, more than the {MAX_PLAN_BYTES} bytes a plan may have; it is not a plan \
                 written by `optimusc compile`",
                path.display()
            ),
            PlanFileError::Version { path, found: Some(found) } => write!(
                f,
                "`{}` has plan format version {found}, but this optimusc reads version {FORMAT_VERSION}; recompile \
                 the model",
                path.display()
            ),
            PlanFileError::Version { path, found: None } => write!(
                f,
                "`{}` is not a plan: it has no `format_version` number (a plan is the JSON object `optimusc \
                 compile` writes, and this optimusc reads version {FORMAT_VERSION})",
                path.display()
            ),
            PlanFileError::NotAnObject { path } => write!(
                f,
                "`{}` is not a plan: it is JSON but not an object (a plan is the JSON object `optimusc compile` \
                 writes)",
                path.display()
            ),
            PlanFileError::Parse { path, source } => match source.classify() {
                serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                    write!(f, "`{}` is not a plan (invalid JSON: {source})", path.display())
                }
                serde_json::error::Category::Io => write!(f, "cannot read `{}`: {source}", path.display()),
                serde_json::error::Category::Data => write!(f, "`{}` is not a valid plan: {source}", path.display()),
            },
        }
    }
}

impl std::error::Error for PlanFileError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PlanFileError::Serialize { source, .. } | PlanFileError::Parse { source, .. } => Some(source),
            PlanFileError::Write(e) => Some(e),
            PlanFileError::Unreadable { source, .. } => Some(source),
            PlanFileError::NotAFile { .. }
            | PlanFileError::TooLarge { .. }
            | PlanFileError::Version { .. }
            | PlanFileError::NotAnObject { .. } => None,
        }
    }
}

/// Serialises a plan (compact, deterministic JSON) and writes it with [`crate::output::write_regenerable`].
pub fn write_plan(plan: &Plan, path: &Path) -> Result<(), PlanFileError> {
    // Streamed to the file as it is produced: a large plan's text (8 MB for GPT-3 on 8x8) is never
    // held in memory whole. A plan can be compiled again, so it is not synced to disk (replaced whole
    // or not at all all the same). A serialization error is kept apart from the writer's own.
    let mut failed: Option<serde_json::Error> = None;
    let written = crate::output::write_regenerable(path, &mut |out| {
        // A concrete buffer in front of the writer, so that the serializer's many small writes inline.
        let mut out = std::io::BufWriter::with_capacity(1 << 16, out);
        serde_json::to_writer(&mut out, plan).map_err(|e| {
            // The writer's own failure keeps its kind (a closed pipe is no error on standard output).
            let io = std::io::Error::new(e.io_error_kind().unwrap_or(std::io::ErrorKind::Other), e.to_string());
            failed = Some(e);
            io
        })?;
        std::io::Write::flush(&mut out)
    });
    match (written, failed) {
        (_, Some(source)) if !source.is_io() => Err(PlanFileError::Serialize { path: path.to_path_buf(), source }),
        (result, _) => result.map_err(PlanFileError::Write),
    }
}

/// The one output writer, under the name earlier callers used.
pub use crate::output::write_file as write_atomically;

/// The largest plan file read (1 GiB): far above any compiled plan, far below what would exhaust memory.
pub const MAX_PLAN_BYTES: u64 = 1 << 30;

/// Reads a plan, streaming: refuses anything but a regular file of at most [`MAX_PLAN_BYTES`] before
/// opening it, parses straight into the typed plan (no intermediate JSON tree), and reports another
/// format version as such even when the rest of the file does not parse.
pub fn read_plan(path: &Path) -> Result<Plan, PlanFileError> {
    let file = open_plan_file(path)?;
    let reader = std::io::BufReader::new(file.take(MAX_PLAN_BYTES + 1));
    let version_error = |found| PlanFileError::Version { path: path.to_path_buf(), found };
    match serde_json::from_reader::<_, Plan>(reader) {
        Ok(plan) if plan.format_version == FORMAT_VERSION => Ok(plan),
        Ok(plan) => Err(version_error(Some(u64::from(plan.format_version)))),
        Err(source) => Err(match read_version(path) {
            Some(version) if version != Some(u64::from(FORMAT_VERSION)) => version_error(version),
            None if source.is_data() => PlanFileError::NotAnObject { path: path.to_path_buf() },
            _ => PlanFileError::Parse { path: path.to_path_buf(), source },
        }),
    }
}

/// Opens `path` only if it is a regular file within the size cap (a FIFO, a device such as
/// /dev/zero or a directory is refused without opening it, so nothing blocks or reads forever).
fn open_plan_file(path: &Path) -> Result<std::fs::File, PlanFileError> {
    let cannot = |source| PlanFileError::Unreadable { path: path.to_path_buf(), source };
    let metadata = std::fs::metadata(path).map_err(cannot)?;
    check_plan_metadata(path, &metadata)?;
    let file = std::fs::File::open(path).map_err(cannot)?;
    let opened = file.metadata().map_err(cannot)?;
    check_plan_metadata(path, &opened)?;
    Ok(file)
}

fn check_plan_metadata(path: &Path, metadata: &std::fs::Metadata) -> Result<(), PlanFileError> {
    let kind = metadata.file_type();
    if !kind.is_file() {
        return Err(PlanFileError::NotAFile { path: path.to_path_buf(), directory: kind.is_dir() });
    }
    if metadata.len() > MAX_PLAN_BYTES {
        return Err(PlanFileError::TooLarge { path: path.to_path_buf(), bytes: metadata.len() });
    }
    Ok(())
}

/// Only `format_version`, every other field skipped without being kept.
#[derive(serde::Deserialize)]
struct VersionProbe {
    #[serde(default)]
    format_version: Option<serde_json::Value>,
}

/// The file's `format_version` (`Some(None)`: absent or not a number), or `None` when the file is not
/// a JSON object at all (serde would read a struct from an array too, so the first byte is looked at).
fn read_version(path: &Path) -> Option<Option<u64>> {
    let file = open_plan_file(path).ok()?;
    let mut reader = std::io::BufReader::new(file.take(MAX_PLAN_BYTES + 1));
    if !starts_an_object(&mut reader) {
        return None;
    }
    let probe: VersionProbe = serde_json::from_reader(reader).ok()?;
    Some(probe.format_version.as_ref().and_then(serde_json::Value::as_u64))
}

/// Whether the first byte after any JSON whitespace is `{`; the bytes looked at stay in the reader.
fn starts_an_object(reader: &mut impl std::io::BufRead) -> bool {
    loop {
        let Ok(buffer) = reader.fill_buf() else { return false };
        let Some(&first) = buffer.first() else { return false };
        if !matches!(first, b' ' | b'\t' | b'\n' | b'\r') {
            return first == b'{';
        }
        reader.consume(1);
    }
}
