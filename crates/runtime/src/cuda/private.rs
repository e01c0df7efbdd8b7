//! Folders and files that only this user can have made: what the kernel cache and the CUDA library links
//! trust. A folder is used only if it is a real folder (not a symlink), owned by the effective user and
//! writable by nobody else; a library is linked only from a folder owned by root or by this user that
//! nobody else may write.

use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

/// The effective user id of this process.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether `meta` belongs to this user and nobody else may write it.
fn own_and_closed(meta: &fs::Metadata) -> bool {
    meta.uid() == euid() && meta.mode() & 0o022 == 0
}

/// Whether `dir` is a real folder of this user that nobody else may write.
pub fn is_private_folder(dir: &Path) -> bool {
    fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir() && own_and_closed(&m))
}

/// Whether `path` is a regular file (not a symlink) of this user that nobody else may write.
pub fn is_own_file(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_file() && own_and_closed(&m))
}

/// `dir`, created with mode 0700 where missing, if it then is a private folder.
pub fn private_folder(dir: &Path) -> Option<PathBuf> {
    fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).ok()?;
    is_private_folder(dir).then(|| dir.to_path_buf())
}

/// This user's cache folder for optimus: `$OPTIMUS_CACHE_DIR`, else `$XDG_CACHE_HOME/optimus`, else
/// `~/.cache/optimus` (not created here).
pub fn cache_base() -> Option<PathBuf> {
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("OPTIMUS_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("optimus")))
        .or_else(|| env("HOME").map(|d| d.join(".cache").join("optimus")))
}

/// Whether a library may be loaded from `file`: the file (after links) and the folder holding it belong
/// to root or to this user and nobody else may write them.
pub fn is_trusted_library(file: &Path) -> bool {
    let trusted = |m: &fs::Metadata| (m.uid() == 0 || m.uid() == euid()) && m.mode() & 0o022 == 0;
    let Ok(real) = fs::canonicalize(file) else { return false };
    let folder_ok = real.parent().is_some_and(|d| fs::metadata(d).is_ok_and(|m| m.is_dir() && trusted(&m)));
    folder_ok && fs::metadata(&real).is_ok_and(|m| m.is_file() && trusted(&m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_closed_folders_of_this_user_are_private() -> Result<(), String> {
        let base = tempfile::tempdir().map_err(|e| e.to_string())?;
        let made = private_folder(&base.path().join("a/b")).ok_or("a fresh folder is private")?;
        let mode = fs::metadata(&made).map_err(|e| e.to_string())?.mode() & 0o777;
        assert_eq!(mode, 0o700);
        let open = base.path().join("open");
        fs::create_dir(&open).map_err(|e| e.to_string())?;
        fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).map_err(|e| e.to_string())?;
        assert!(private_folder(&open).is_none(), "a folder others may write");
        let link = base.path().join("link");
        std::os::unix::fs::symlink(&made, &link).map_err(|e| e.to_string())?;
        assert!(private_folder(&link).is_none(), "a symlink to a private folder");
        Ok(())
    }

    #[test]
    fn libraries_are_trusted_only_in_closed_folders() -> Result<(), String> {
        let base = tempfile::tempdir().map_err(|e| e.to_string())?;
        let closed = private_folder(&base.path().join("closed")).ok_or("private")?;
        let lib = closed.join("libx.so.1");
        fs::write(&lib, b"x").map_err(|e| e.to_string())?;
        fs::set_permissions(&lib, fs::Permissions::from_mode(0o644)).map_err(|e| e.to_string())?;
        assert!(is_trusted_library(&lib));
        let open = base.path().join("open");
        fs::create_dir(&open).map_err(|e| e.to_string())?;
        let planted = open.join("libx.so.1");
        fs::write(&planted, b"x").map_err(|e| e.to_string())?;
        fs::set_permissions(&open, fs::Permissions::from_mode(0o1777)).map_err(|e| e.to_string())?;
        assert!(!is_trusted_library(&planted), "a library in a folder anyone may write");
        fs::set_permissions(&lib, fs::Permissions::from_mode(0o666)).map_err(|e| e.to_string())?;
        assert!(!is_trusted_library(&lib), "a library anyone may write");
        Ok(())
    }
}
