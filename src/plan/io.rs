//! Reading and writing plans: deterministic JSON, written atomically so that a failure leaves no file.

use super::{FORMAT_VERSION, Plan};
use crate::io::output::write_file;
use std::path::Path;

/// Serialises a plan (compact, deterministic JSON) and writes it with [`crate::io::output::write_file`].
pub fn write_plan(plan: &Plan, path: &Path) -> Result<(), String> {
    let json =
        serde_json::to_vec(plan).map_err(|e| format!("cannot serialise the plan for `{}`: {e}", path.display()))?;
    write_file(path, &json).map_err(|e| e.to_string())
}

/// The one output writer, under the name earlier callers used.
pub use crate::io::output::write_file as write_atomically;

/// Reads a plan, rejecting other format versions with a clear message.
pub fn read_plan(path: &Path) -> Result<Plan, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    let value: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| format!("`{}` is not a plan (invalid JSON: {e})", path.display()))?;
    let version = value.get("format_version").and_then(serde_json::Value::as_u64);
    if version != Some(u64::from(FORMAT_VERSION)) {
        return Err(format!(
            "`{}` has plan format version {}, but this optimusc reads version {FORMAT_VERSION}; recompile the model",
            path.display(),
            version.map_or("none".to_string(), |v| v.to_string())
        ));
    }
    serde_json::from_value(value).map_err(|e| format!("`{}` is not a valid plan: {e}", path.display()))
}
