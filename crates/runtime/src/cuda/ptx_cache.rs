//! NVRTC's output (PTX, or machine code for the GPU's own architecture) kept on disk between runs, so
//! that a run starts without compiling the kernels again (about 3 s for NVRTC and as long again for
//! ptxas, once per device of a mesh).
//!
//! An entry is named by a SHA-256 of everything it depends on (the source, the target architecture,
//! the kind of output, the compile options, NVRTC's version) and ends with a line holding the SHA-256
//! of what precedes it, so a truncated or altered entry is recompiled, never loaded. The folder is
//! `$OPTIMUS_CACHE_DIR/ptx`, else `$XDG_CACHE_HOME/optimus/ptx`, else `~/.cache/optimus/ptx`; it is
//! created private (mode 0700), and a folder or entry that is a symlink, belongs to another user, or
//! that others may write is not used. `OPTIMUS_PTX_CACHE=off` turns the cache off.

use super::error::DeviceError;
use super::kernels::{SOURCE, compile_cubin_for, compile_ptx_for};
use super::private::{cache_base, is_own_file, is_private_folder as private_folder, private_folder as make_private};
use cudarc::nvrtc::Ptx;
use sha2::{Digest, Sha256};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The marker of the checksum line that ends an entry.
const CHECKSUM: &str = "\n// optimus-ptx-sha256 ";

/// Entries of machine code end with this marker and the checksum.
const BINARY_CHECKSUM: &[u8] = b"\n// optimus-cubin-sha256 ";

/// Entries larger than this are not read (the PTX of every kernel is a few MB).
const MAX_ENTRY: u64 = 64 << 20;

/// The PTX of the kernels for `arch`, from the cache when an earlier run compiled it.
pub fn compile_ptx_cached(arch: &'static str) -> Result<Ptx, DeviceError> {
    compile_ptx_cached_in(cache_dir().as_deref(), arch)
}

/// As [`compile_ptx_cached`], with the cache in `dir` (`None`: compile, keep nothing).
pub fn compile_ptx_cached_in(dir: Option<&Path>, arch: &'static str) -> Result<Ptx, DeviceError> {
    let Some(dir) = dir.filter(|d| private_folder(d)) else { return compile_ptx_for(arch) };
    let path = dir.join(format!("{}.ptx", entry_key(arch)));
    if let Some(text) = read_entry(&path) {
        return Ok(Ptx::from_src(text));
    }
    let ptx = compile_ptx_for(arch)?;
    // The cache only saves time: a run whose entry cannot be written goes on without it.
    let _ = write_entry(dir, &path, &ptx.to_src());
    Ok(ptx)
}

/// The machine code of the kernels for `sm_{sm}`, from the cache when an earlier run compiled it.
pub fn compile_cubin_cached(sm: u32) -> Result<Vec<u8>, DeviceError> {
    compile_cubin_cached_in(cache_dir().as_deref(), sm)
}

/// As [`compile_cubin_cached`], with the cache in `dir` (`None`: compile, keep nothing).
pub fn compile_cubin_cached_in(dir: Option<&Path>, sm: u32) -> Result<Vec<u8>, DeviceError> {
    let Some(dir) = dir.filter(|d| private_folder(d)) else { return compile_cubin_for(sm) };
    let path = dir.join(format!("{}.cubin", entry_key(&format!("sm_{sm} cubin"))));
    if let Some(image) = read_binary_entry(&path) {
        return Ok(image);
    }
    let image = compile_cubin_for(sm)?;
    let mut entry = image.clone();
    entry.extend_from_slice(BINARY_CHECKSUM);
    entry.extend_from_slice(hex(&Sha256::digest(&image)).as_bytes());
    entry.push(b'\n');
    // As for PTX, an entry that cannot be written only costs the next run the compile.
    let _ = write_bytes(dir, &path, &entry);
    Ok(image)
}

/// The machine code of a binary entry, if it is a regular file of this user whose checksum matches.
fn read_binary_entry(path: &Path) -> Option<Vec<u8>> {
    let stored = read_own_file(path)?;
    let at = stored.windows(BINARY_CHECKSUM.len()).rposition(|w| w == BINARY_CHECKSUM)?;
    let (image, sum) = (&stored[..at], &stored[at + BINARY_CHECKSUM.len()..]);
    (sum.strip_suffix(b"\n")? == hex(&Sha256::digest(image)).as_bytes()).then(|| image.to_vec())
}

/// The contents of a regular file of this user that nobody else may write, if not too large.
fn read_own_file(path: &Path) -> Option<Vec<u8>> {
    let size = fs::symlink_metadata(path).ok()?.len();
    (is_own_file(path) && size <= MAX_ENTRY).then(|| fs::read(path).ok()).flatten()
}

/// The cache folder this user's runs share, created if missing (`None` when turned off or unusable).
fn cache_dir() -> Option<PathBuf> {
    if std::env::var("OPTIMUS_PTX_CACHE").is_ok_and(|v| v == "off") {
        return None;
    }
    make_private(&cache_base()?.join("ptx"))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// NVRTC's version, (0, 0) where it cannot be loaded (the compile then fails with the reason).
fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: only opens the library; nvrtcVersion writes two ints through valid pointers.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    }
    (major, minor)
}

/// What an entry's PTX depends on, hashed.
fn entry_key(arch: &str) -> String {
    let (major, minor) = nvrtc_version();
    let mut hash = Sha256::new();
    for part in [SOURCE, arch, "fmad=false", &format!("nvrtc {major}.{minor}"), env!("CARGO_PKG_VERSION")] {
        hash.update(part.as_bytes());
        hash.update([0]);
    }
    hex(&hash.finalize())
}

/// The PTX of an entry, if it is a regular file of this user whose checksum line matches its text.
fn read_entry(path: &Path) -> Option<String> {
    let stored = String::from_utf8(read_own_file(path)?).ok()?;
    let (text, sum) = stored.rsplit_once(CHECKSUM)?;
    (sum.trim_end() == hex(&Sha256::digest(text.as_bytes()))).then(|| text.to_string())
}

/// Writes an entry whole or not at all (a temporary file in the folder, renamed into place).
fn write_entry(dir: &Path, path: &Path, text: &str) -> std::io::Result<()> {
    let mut entry = text.as_bytes().to_vec();
    entry.extend_from_slice(format!("{CHECKSUM}{}\n", hex(&Sha256::digest(text.as_bytes()))).as_bytes());
    write_bytes(dir, path, &entry)
}

/// Writes a file whole or not at all (a temporary file in the folder, renamed into place).
fn write_bytes(dir: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = tempfile::NamedTempFile::new_in(dir)?;
    file.write_all(bytes)?;
    file.as_file().sync_all()?;
    file.persist(path).map_err(|e| e.error)?;
    Ok(())
}
