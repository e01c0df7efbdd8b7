//! Reading and writing plans: deterministic JSON, written atomically so that a failure leaves no file.

use crate::output::write_file;
use optimus_plan::{FORMAT_VERSION, Plan};
use std::io::Read;
use std::path::Path;

/// Serialises a plan (compact, deterministic JSON) and writes it with [`crate::output::write_file`].
pub fn write_plan(plan: &Plan, path: &Path) -> Result<(), String> {
    let json =
        serde_json::to_vec(plan).map_err(|e| format!("cannot serialise the plan for `{}`: {e}", path.display()))?;
    write_file(path, &json).map_err(|e| e.to_string())
}

/// The one output writer, under the name earlier callers used.
pub use crate::output::write_file as write_atomically;

/// The largest plan file read (1 GiB): far above any compiled plan, far below what would exhaust memory.
pub const MAX_PLAN_BYTES: u64 = 1 << 30;

/// Reads a plan, streaming: refuses anything but a regular file of at most [`MAX_PLAN_BYTES`] before
/// opening it, parses straight into the typed plan (no intermediate JSON tree), and reports another
/// format version as such even when the rest of the file does not parse.
pub fn read_plan(path: &Path) -> Result<Plan, String> {
    let file = open_plan_file(path)?;
    let reader = std::io::BufReader::new(file.take(MAX_PLAN_BYTES + 1));
    match serde_json::from_reader::<_, Plan>(reader) {
        Ok(plan) if plan.format_version == FORMAT_VERSION => Ok(plan),
        Ok(plan) => Err(version_error(path, Some(u64::from(plan.format_version)))),
        Err(e) => Err(match read_version(path) {
            Some(version) if version != Some(u64::from(FORMAT_VERSION)) => version_error(path, version),
            _ if e.is_syntax() || e.is_eof() => format!("`{}` is not a plan (invalid JSON: {e})", path.display()),
            _ if e.is_io() => format!("cannot read `{}`: {e}", path.display()),
            _ => format!("`{}` is not a valid plan: {e}", path.display()),
        }),
    }
}

/// Opens `path` only if it is a regular file within the size cap (a FIFO, a device such as
/// /dev/zero or a directory is refused without opening it, so nothing blocks or reads forever).
fn open_plan_file(path: &Path) -> Result<std::fs::File, String> {
    let metadata = std::fs::metadata(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    check_plan_metadata(path, &metadata)?;
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    let opened = file.metadata().map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    check_plan_metadata(path, &opened)?;
    Ok(file)
}

fn check_plan_metadata(path: &Path, metadata: &std::fs::Metadata) -> Result<(), String> {
    let kind = metadata.file_type();
    if !kind.is_file() {
        let what = if kind.is_dir() { "a directory" } else { "not a regular file (a device, pipe or socket)" };
        return Err(format!("`{}` is {what}; a plan is a JSON file written by `optimusc compile`", path.display()));
    }
    if metadata.len() > MAX_PLAN_BYTES {
        return Err(format!(
            "`{}` is {} bytes, more than the {} bytes a plan may have; it is not a plan written by `optimusc compile`",
            path.display(),
            metadata.len(),
            MAX_PLAN_BYTES
        ));
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
/// a JSON object at all.
fn read_version(path: &Path) -> Option<Option<u64>> {
    let file = open_plan_file(path).ok()?;
    let reader = std::io::BufReader::new(file.take(MAX_PLAN_BYTES + 1));
    let probe: VersionProbe = serde_json::from_reader(reader).ok()?;
    Some(probe.format_version.as_ref().and_then(serde_json::Value::as_u64))
}

fn version_error(path: &Path, version: Option<u64>) -> String {
    format!(
        "`{}` has plan format version {}, but this optimusc reads version {FORMAT_VERSION}; recompile the model",
        path.display(),
        version.map_or("none".to_string(), |v| v.to_string())
    )
}
