//! The crate graph keeps the architecture (docs/architecture.md): each workspace crate depends only on
//! the crates below it, the plan crate on no compiler, runtime or command-line crate, and no library
//! crate prints but where the architecture allows it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The workspace's library crates, from the ground floor up, with the workspace crates each may use.
const LAYERS: &[(&str, &[&str])] = &[
    ("plan", &[]),
    ("compiler", &["optimus-plan"]),
    ("runtime", &["optimus-plan"]),
    ("io", &["optimus-plan"]),
    ("cost", &["optimus-plan", "optimus-compiler", "optimus-io"]),
    ("text", &[]),
];

/// Outside crates that belong to one layer only: (crate, the only workspace crate that may use it).
const OWNED_DEPENDENCIES: &[(&str, &str)] = &[
    ("pest", "compiler"),
    ("pest_derive", "compiler"),
    ("petgraph", "compiler"),
    ("codespan-reporting", "compiler"),
    ("cudarc", "runtime"),
    ("mpi", "runtime"),
    ("faer", "runtime"),
    ("safetensors", "io"),
    ("memmap2", "io"),
    ("tiktoken-rs", "text"),
    ("tokenizers", "text"),
];

/// Every dependency a manifest names, normal, dev and build alike.
fn dependencies(manifest: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(manifest).unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
    let value: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
    let mut names = BTreeSet::new();
    for section in ["dependencies", "dev-dependencies", "build-dependencies"] {
        if let Some(table) = value.get(section).and_then(toml::Value::as_table) {
            names.extend(table.keys().cloned());
        }
    }
    names
}

#[test]
fn every_crate_depends_only_on_the_crates_below_it() {
    let members: Vec<String> = std::fs::read_dir(root().join("crates"))
        .expect("crates/")
        .map(|entry| entry.expect("an entry").file_name().to_string_lossy().into_owned())
        .collect();
    for member in &members {
        assert!(LAYERS.iter().any(|(name, _)| name == member), "crates/{member} is not placed in LAYERS");
    }
    for (name, allowed) in LAYERS {
        let used = dependencies(&root().join("crates").join(name).join("Cargo.toml"));
        let workspace: Vec<&String> = used.iter().filter(|d| d.starts_with("optimus")).collect();
        for dependency in workspace {
            assert!(
                allowed.contains(&dependency.as_str()),
                "optimus-{name} depends on {dependency}, which is not below it (allowed: {allowed:?})"
            );
        }
    }
}

#[test]
fn outside_crates_stay_in_their_layer() {
    for (name, _) in LAYERS {
        let used = dependencies(&root().join("crates").join(name).join("Cargo.toml"));
        for (dependency, owner) in OWNED_DEPENDENCIES {
            assert!(
                !used.contains(*dependency) || owner == name,
                "optimus-{name} depends on {dependency}, which belongs to optimus-{owner} alone"
            );
        }
    }
    let plan = dependencies(&root().join("crates/plan/Cargo.toml"));
    let expected: BTreeSet<String> = ["serde", "serde_json"].into_iter().map(String::from).collect();
    assert_eq!(plan, expected, "the plan crate is the ground floor: serde alone");
}

/// The files of `dir` (recursively) ending in `.rs`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Library files allowed to print: MPI's last words before it ends the job, and the opt-in start-up trace.
/// (Files under a crate's `examples/` are programs, not library code, and may print.)
const MAY_PRINT: &[&str] = &["crates/runtime/src/mpi.rs", "crates/runtime/src/startup.rs"];

#[test]
fn only_the_command_line_prints() {
    let mut files = Vec::new();
    rust_files(&root().join("crates"), &mut files);
    let mut printing = Vec::new();
    for file in files {
        let relative = file.strip_prefix(root()).expect("under the root").to_string_lossy().replace('\\', "/");
        // A crate's examples are programs of their own (benchmarks), not library code.
        let example = relative.split('/').nth(2) == Some("examples");
        if MAY_PRINT.contains(&relative.as_str()) || relative.ends_with("_tests.rs") || example {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("readable");
        let library = text.split("#[cfg(test)]").next().unwrap_or_default();
        for (number, line) in library.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            if ["println!", "eprintln!", "print!(", "eprint!(", "dbg!("].iter().any(|m| code.contains(m)) {
                printing.push(format!("{relative}:{}: {}", number + 1, line.trim()));
            }
        }
    }
    assert!(printing.is_empty(), "library code that prints (only the CLI may):\n{}", printing.join("\n"));
}
