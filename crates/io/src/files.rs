//! Opening user-named input files safely: regular files only, checked before they are opened, and small
//! text inputs read with a size bound.
//!
//! A device (`/dev/zero`, `/dev/urandom`) never ends, so reading it in full exhausts memory; opening a
//! FIFO for reading blocks until a writer appears. Both are refused from the file's metadata, which
//! `std::fs::metadata` reads without opening the file (and after following symlinks, so a link to a
//! regular file is fine).

use std::fmt;
use std::fs::{File, FileType};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The most bytes a model source (`.opt`) may hold.
pub const MODEL_SOURCE_LIMIT: u64 = 64 << 20;

/// The most bytes a hardware profile (`.toml`) may hold.
pub const HARDWARE_PROFILE_LIMIT: u64 = 64 << 20;

/// Why a user-named input could not be read; every message begins "cannot read" and names the input:
/// `what` it is ("token data") and its path, or the path alone when `what` is empty.
#[derive(Debug)]
pub enum FileError {
    /// The operating system refused to look at, open or read the file.
    Unreadable { what: &'static str, path: PathBuf, source: std::io::Error },
    /// Something other than a regular file: `kind` says what ("a directory", "a FIFO (named pipe)").
    NotRegular { what: &'static str, path: PathBuf, kind: &'static str },
    /// A file of `size` bytes, above the `limit` for this input.
    TooLarge { what: &'static str, path: PathBuf, size: u64, limit: u64 },
}

impl FileError {
    /// [`FileError::Unreadable`] of the input, for `map_err`.
    fn unreadable(what: &'static str, path: &Path) -> impl Fn(std::io::Error) -> FileError {
        move |source| FileError::Unreadable { what, path: path.to_path_buf(), source }
    }
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FileError::Unreadable { what, path, source } => write!(f, "cannot read {}: {source}", named(what, path)),
            FileError::NotRegular { what, path, kind } => {
                write!(f, "cannot read {}: it is {kind}, not a regular file", named(what, path))
            }
            FileError::TooLarge { what, path, size, limit } => write!(
                f,
                "cannot read {}: it has {size} bytes, more than the limit of {} MiB",
                named(what, path),
                limit >> 20
            ),
        }
    }
}

impl std::error::Error for FileError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            FileError::Unreadable { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Opens `path` for reading if it is a regular file, returning the file and its length in bytes.
/// `what` names the input in errors ("token data"); an empty `what` names the path alone.
pub fn open_regular(path: &Path, what: &'static str) -> Result<(File, u64), FileError> {
    let cannot = FileError::unreadable(what, path);
    let before = std::fs::metadata(path).map_err(&cannot)?;
    refuse_special(before.file_type(), path, what)?;
    let file = File::open(path).map_err(&cannot)?;
    // The path may have been replaced between the two looks; what counts is the file now open.
    let opened = file.metadata().map_err(&cannot)?;
    refuse_special(opened.file_type(), path, what)?;
    Ok((file, opened.len()))
}

/// Reads a regular file of at most `limit` bytes in full; `what` as for [`open_regular`].
pub fn read_bounded(path: &Path, what: &'static str, limit: u64) -> Result<Vec<u8>, FileError> {
    let (file, len) = open_regular(path, what)?;
    let too_big = |size: u64| FileError::TooLarge { what, path: path.to_path_buf(), size, limit };
    if len > limit {
        return Err(too_big(len));
    }
    // The file may grow while it is read: read one byte past the limit to notice.
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(limit + 1).read_to_end(&mut bytes).map_err(FileError::unreadable(what, path))?;
    if bytes.len() as u64 > limit {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// "token data `x.bin`", or "`x.bin`" when `what` is empty.
fn named(what: &str, path: &Path) -> String {
    if what.is_empty() { format!("`{}`", path.display()) } else { format!("{what} `{}`", path.display()) }
}

/// An error naming what `path` is, unless it is a regular file.
fn refuse_special(file_type: FileType, path: &Path, what: &'static str) -> Result<(), FileError> {
    if file_type.is_file() {
        return Ok(());
    }
    Err(FileError::NotRegular { what, path: path.to_path_buf(), kind: kind_name(file_type) })
}

/// "a directory", "a character device", ... for anything that is not a regular file.
fn kind_name(file_type: FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if file_type.is_char_device() {
            return "a character device";
        }
        if file_type.is_block_device() {
            return "a block device";
        }
        if file_type.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if file_type.is_socket() {
            return "a socket";
        }
    }
    if file_type.is_dir() { "a directory" } else { "a special file" }
}
