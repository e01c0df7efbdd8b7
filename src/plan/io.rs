//! Reading and writing plans: deterministic JSON, written atomically so that a failure leaves no file.

use super::{FORMAT_VERSION, Plan};
use std::io::Write;
use std::path::Path;

/// Serialises a plan (compact, deterministic JSON) and writes it via a temporary file and a rename.
pub fn write_plan(plan: &Plan, path: &Path) -> std::io::Result<()> {
    let json = serde_json::to_vec(plan).map_err(std::io::Error::other)?;
    write_atomically(path, &json)
}

/// Writes bytes to `path` through a temporary sibling, so readers never see a partial file.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "plan".into());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

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
