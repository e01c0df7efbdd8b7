//! Finding the CUDA libraries under their real names. cudarc (built against CUDA 12.6, loading libraries
//! at run time) opens `libcublas.so`, `libnvrtc.so` and `libnccl.so`, or the CUDA-12 sonames; a machine
//! with only CUDA 13 runtimes (`libcublas.so.13`, `libnvrtc.so.13`) or only NCCL's soname
//! (`libnccl.so.2`, as the `nvidia-nccl` wheels ship it) has none of those names. Then this module makes a
//! private folder of links under the names cudarc asks for, puts it first on `LD_LIBRARY_PATH`, and
//! starts the same command again (the dynamic loader reads `LD_LIBRARY_PATH` only at start).

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

/// The first file named one of `sonames` in `folders`.
fn find(sonames: &[&str], folders: &[PathBuf]) -> Option<PathBuf> {
    sonames.iter().find_map(|name| folders.iter().map(|f| f.join(name)).find(|p| p.is_file()))
}

/// Where cudarc cannot open a library it needs but the machine has it under a real name: links the real
/// names into a private folder and starts this command again with that folder on `LD_LIBRARY_PATH`
/// (this call then does not return). Otherwise returns, and the probe says what is missing.
pub fn restart_with_links_if_needed() {
    if std::env::var_os(RESTARTED).is_some() {
        return;
    }
    let missing: Vec<Wanted> = wanted().into_iter().filter(|w| !(w.present)()).collect();
    if missing.is_empty() {
        return;
    }
    let folders = search_folders();
    let links: Vec<(&str, PathBuf)> =
        missing.iter().filter_map(|w| Some((w.stem, find(w.sonames, &folders)?))).collect();
    if links.is_empty() {
        return;
    }
    let Some(dir) = link_folder(&links) else { return };
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let joined = if path.is_empty() { dir.display().to_string() } else { format!("{}:{path}", dir.display()) };
    let Ok(exe) = std::env::current_exe() else { return };
    use std::os::unix::process::CommandExt;
    let error = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", joined)
        .env(RESTARTED, &dir)
        .exec();
    eprintln!("warning: could not restart with the CUDA libraries linked in {}: {error}", dir.display());
}

/// A folder of this user's holding `lib*.so` links to the real files, or `None` if it cannot be made. Each
/// link is made under a name of this process's and renamed into place, so that processes started
/// together (the ranks of one `mpirun`) never see a half-made link.
fn link_folder(links: &[(&str, PathBuf)]) -> Option<PathBuf> {
    let user = std::env::var("USER").unwrap_or_else(|_| "user".into());
    let dir = std::env::temp_dir().join(format!("optimus-cuda-libs-{user}"));
    std::fs::create_dir_all(&dir).ok()?;
    for (stem, target) in links {
        let link = dir.join(format!("{stem}.so"));
        let fresh = dir.join(format!("{stem}.so.{}", std::process::id()));
        let _ = std::fs::remove_file(&fresh);
        std::os::unix::fs::symlink(target, &fresh).ok()?;
        std::fs::rename(&fresh, &link).ok()?;
    }
    Some(dir)
}
