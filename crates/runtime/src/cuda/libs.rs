//! Finding the CUDA libraries under their real names. cudarc (built against CUDA 12.6, loading libraries
//! at run time) opens `libcublas.so`, `libnvrtc.so` and `libnccl.so`, or the CUDA-12 sonames; a machine
//! with only CUDA 13 runtimes (`libcublas.so.13`, `libnvrtc.so.13`) or only NCCL's soname
//! (`libnccl.so.2`, as the `nvidia-nccl` wheels ship it) has none of those names. Then this module makes a
//! private folder of links under the names cudarc asks for, puts it first on `LD_LIBRARY_PATH`, and
//! starts the same command again (the dynamic loader reads `LD_LIBRARY_PATH` only at start).
//!
//! Whatever is in that folder runs inside optimusc before `main`, so nobody else may be able to put
//! anything there: it is `cuda-libs` in this user's cache folder (`~/.cache/optimus`), used only when it
//! is a real folder of the effective user that nobody else may write, else a fresh `mkdtemp` folder; and
//! only libraries in folders owned by root or by this user, that nobody else may write, are linked.

use super::private::{cache_base, is_trusted_library, private_folder};
use std::path::{Path, PathBuf};

/// Set in the restarted process, so that it never restarts again.
const RESTARTED: &str = "OPTIMUS_CUDA_LIBRARY_LINKS";

/// A library cudarc loads: its plain name and the sonames to look for, newest first.
struct Wanted {
    stem: &'static str,
    sonames: &'static [&'static str],
    present: fn() -> bool,
}

fn wanted() -> [Wanted; 3] {
    [
        Wanted {
            stem: "libcublas",
            sonames: &["libcublas.so.13", "libcublas.so.12"],
            // SAFETY: only tries to open the library.
            present: || unsafe { cudarc::cublas::sys::is_culib_present() },
        },
        Wanted {
            stem: "libnvrtc",
            sonames: &["libnvrtc.so.13", "libnvrtc.so.12"],
            // SAFETY: as above.
            present: || unsafe { cudarc::nvrtc::sys::is_culib_present() },
        },
        Wanted {
            stem: "libnccl",
            sonames: &["libnccl.so.2"],
            // SAFETY: as above.
            present: || unsafe { cudarc::nccl::sys::is_culib_present() },
        },
    ]
}

/// Folders where CUDA libraries live: `LD_LIBRARY_PATH`, the toolkit's, the system's, and the lib
/// folders of NVIDIA's Python wheels (`site-packages/nvidia/*/lib`) of the Pythons found under
/// /usr, /usr/local and /opt.
fn search_folders() -> Vec<PathBuf> {
    let mut folders: Vec<PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .collect();
    let cuda_home = std::env::var("CUDA_HOME").unwrap_or_else(|_| "/usr/local/cuda".into());
    for sub in ["lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"] {
        folders.push(Path::new(&cuda_home).join(sub));
    }
    folders.extend(
        ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/local/lib"].map(PathBuf::from),
    );
    for root in ["/usr/lib", "/usr/local/lib", "/opt"] {
        folders.extend(wheel_lib_folders(Path::new(root), 4));
    }
    folders
}

/// `nvidia/*/lib` folders inside `site-packages` or `dist-packages` at most `depth` levels below `root`.
fn wheel_lib_folders(root: &Path, depth: usize) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if !path.is_dir() {
            continue;
        }
        let name = entry.file_name();
        if name == "site-packages" || name == "dist-packages" {
            let Ok(packages) = std::fs::read_dir(path.join("nvidia")) else { continue };
            found.extend(packages.flatten().map(|p| p.path().join("lib")).filter(|p| p.is_dir()));
        } else if depth > 0 {
            found.extend(wheel_lib_folders(&path, depth - 1));
        }
    }
    found
}

/// The first file named one of `sonames` in `folders` that may be trusted (see [`is_trusted_library`]).
fn find(sonames: &[&str], folders: &[PathBuf]) -> Option<PathBuf> {
    sonames.iter().find_map(|name| folders.iter().map(|f| f.join(name)).find(|p| p.is_file() && is_trusted_library(p)))
}

/// Where cudarc cannot open a library it needs but the machine has it under a real name: links the real
/// names into a private folder and starts this command again with that folder on `LD_LIBRARY_PATH`
/// (this call then does not return). Otherwise returns, and the probe says what is missing; a restart
/// that could not be made is returned as a warning to show.
pub fn restart_with_links_if_needed() -> Option<String> {
    if std::env::var_os(RESTARTED).is_some() {
        return None;
    }
    let missing: Vec<Wanted> = wanted().into_iter().filter(|w| !(w.present)()).collect();
    if missing.is_empty() {
        return None;
    }
    let folders = search_folders();
    let links: Vec<(&str, PathBuf)> =
        missing.iter().filter_map(|w| Some((w.stem, find(w.sonames, &folders)?))).collect();
    if links.is_empty() {
        return None;
    }
    let dir = link_folder(&links)?;
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let joined = if path.is_empty() { dir.display().to_string() } else { format!("{}:{path}", dir.display()) };
    let exe = std::env::current_exe().ok()?;
    use std::os::unix::process::CommandExt;
    let error = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", joined)
        .env(RESTARTED, &dir)
        .exec();
    Some(format!("could not restart with the CUDA libraries linked in {}: {error}", dir.display()))
}

/// A private folder of this user's holding `lib*.so` links to the real files, or `None` if it cannot be
/// made. Each link is made under a name of this process's and renamed into place, so that processes
/// started together (the ranks of one `mpirun`) never see a half-made link.
fn link_folder(links: &[(&str, PathBuf)]) -> Option<PathBuf> {
    let shared = cache_base().and_then(|base| private_folder(&base.join("cuda-libs")));
    let dir = match shared {
        Some(dir) => dir,
        // A fresh folder of mode 0700 that no one else can have made; kept, since the restarted process
        // loads from it for its whole life.
        None => tempfile::Builder::new().prefix("optimus-cuda-libs-").tempdir().ok()?.keep(),
    };
    links_into(&dir, links)
}

/// Makes the links in `dir` (a folder [`private_folder`] accepted).
fn links_into(dir: &Path, links: &[(&str, PathBuf)]) -> Option<PathBuf> {
    let dir = private_folder(dir)?;
    for (stem, target) in links {
        let link = dir.join(format!("{stem}.so"));
        let fresh = dir.join(format!("{stem}.so.{}", std::process::id()));
        let _ = std::fs::remove_file(&fresh);
        std::os::unix::fs::symlink(target, &fresh).ok()?;
        std::fs::rename(&fresh, &link).ok()?;
    }
    Some(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn links_go_only_into_a_private_folder() -> Result<(), String> {
        let base = tempfile::tempdir().map_err(|e| e.to_string())?;
        let target = base.path().join("libreal.so.13");
        std::fs::write(&target, b"x").map_err(|e| e.to_string())?;
        let links = [("libreal", target.clone())];
        let private = base.path().join("private");
        let made = links_into(&private, &links).ok_or("a fresh folder takes the links")?;
        assert_eq!(std::fs::read_link(made.join("libreal.so")).map_err(|e| e.to_string())?, target);
        let planted = base.path().join("planted");
        std::fs::create_dir(&planted).map_err(|e| e.to_string())?;
        std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o777)).map_err(|e| e.to_string())?;
        assert!(links_into(&planted, &links).is_none(), "a folder anyone may write is refused");
        assert!(std::fs::read_dir(&planted).map_err(|e| e.to_string())?.next().is_none(), "and left untouched");
        let link = base.path().join("link");
        std::os::unix::fs::symlink(&planted, &link).map_err(|e| e.to_string())?;
        assert!(links_into(&link, &links).is_none(), "a symlinked folder is refused");
        Ok(())
    }

    #[test]
    fn libraries_in_folders_others_may_write_are_not_found() -> Result<(), String> {
        let base = tempfile::tempdir().map_err(|e| e.to_string())?;
        let open = base.path().join("open");
        std::fs::create_dir(&open).map_err(|e| e.to_string())?;
        std::fs::write(open.join("libcublas.so.13"), b"x").map_err(|e| e.to_string())?;
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).map_err(|e| e.to_string())?;
        assert_eq!(find(&["libcublas.so.13"], std::slice::from_ref(&open)), None);
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).map_err(|e| e.to_string())?;
        assert_eq!(find(&["libcublas.so.13"], std::slice::from_ref(&open)), Some(open.join("libcublas.so.13")));
        Ok(())
    }
}
