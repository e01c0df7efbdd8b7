//! Pieces of the command line shared by several commands: target flags, loading and compiling models,
//! and writing to standard output.

pub mod run;
pub mod simulate;
pub mod verify;

use clap::ValueEnum;
use optimus::check::{Checked, Source, check_source, decode};
use optimus::diag;
use optimus::elab::Override;
use optimus::plan::{Mesh, Mode, Plan, Strategy};
use std::path::Path;

/// Flags that say what to compile a model for.
#[derive(clap::Args, Debug, Clone)]
pub struct TargetArgs {
    /// The device mesh, ROWSxCOLS: QxQ for optimus, 1xP for megatron, 1x1 for none.
    #[arg(long, default_value = "1x1", value_parser = parse_mesh)]
    pub mesh: Mesh,
    /// How to split the model: optimus (2D, SUMMA), megatron (1D tensor parallel) or none (one device).
    #[arg(long, value_enum, default_value_t = StrategyArg::Optimus)]
    pub strategy: StrategyArg,
    /// train: forward, backward and optimizer step; infer: forward only.
    #[arg(long, value_enum, default_value_t = ModeArg::Train)]
    pub mode: ModeArg,
    /// Override a config value, e.g. `--set batch=16`. Repeatable.
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub set: Vec<Override>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StrategyArg {
    Optimus,
    Megatron,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    Train,
    Infer,
}

impl TargetArgs {
    pub fn target(&self) -> optimus::shard::Target {
        optimus::shard::Target {
            mesh: self.mesh,
            strategy: match self.strategy {
                StrategyArg::Optimus => Strategy::Optimus,
                StrategyArg::Megatron => Strategy::Megatron,
                StrategyArg::None => Strategy::None,
            },
            mode: match self.mode {
                ModeArg::Train => Mode::Train,
                ModeArg::Infer => Mode::Infer,
            },
        }
    }
}

pub fn parse_mesh(s: &str) -> Result<Mesh, String> {
    let bad = || format!("expected ROWSxCOLS such as 4x4 or 1x8, found `{s}`");
    let (r, c) = s.split_once(['x', 'X']).ok_or_else(bad)?;
    let rows: u64 = r.trim().parse().map_err(|_| bad())?;
    let cols: u64 = c.trim().parse().map_err(|_| bad())?;
    if rows == 0 || cols == 0 || rows > 1024 || cols > 1024 {
        return Err(format!("mesh sides must be between 1 and 1024, found `{s}`"));
    }
    Ok(Mesh { rows, cols })
}

/// Reads a model file (a regular file of at most 64 MiB); prints an error and returns `None` if it
/// cannot be read.
pub fn read_model(path: &Path) -> Option<Vec<u8>> {
    let limit = optimus::io::files::MODEL_SOURCE_LIMIT;
    match optimus::io::files::read_bounded(path, "", limit) {
        Ok(bytes) => Some(bytes),
        Err(e) => {
            eprintln!("error: {e}");
            None
        }
    }
}

/// Reads and checks a model, printing diagnostics; returns the model and its source on success.
pub fn load_checked(path: &Path, overrides: &[Override]) -> Option<(optimus::ir::Model, Source)> {
    let bytes = read_model(path)?;
    let name = path.display().to_string();
    let (source, bad_utf8) = decode(&name, bytes);
    if let Some(d) = bad_utf8 {
        diag::render_stderr(&source.name, &source.text, &[d]);
        eprintln!("error: {name}: 1 error found");
        return None;
    }
    let Checked { model, diagnostics } = check_source(&source.text, overrides);
    diag::render_stderr(&source.name, &source.text, &diagnostics);
    let errors = diagnostics.iter().filter(|d| d.is_error()).count();
    match model {
        Some(model) if errors == 0 => Some((model, source)),
        _ => {
            eprintln!("error: {name}: {errors} error{} found", if errors == 1 { "" } else { "s" });
            None
        }
    }
}

/// Checks and compiles a model for a target, printing diagnostics on failure.
pub fn compile_model(path: &Path, target: &TargetArgs) -> Option<Plan> {
    compile_for(path, &target.set, target.target())
}

/// Checks and compiles a model for an explicit target.
pub fn compile_for(path: &Path, overrides: &[Override], target: optimus::shard::Target) -> Option<Plan> {
    let (model, source) = load_checked(path, overrides)?;
    match optimus::shard::compile(&model, &source.name, &source.text, target) {
        Ok(plan) => Some(plan),
        Err(diagnostics) => {
            diag::render_stderr(&source.name, &source.text, &diagnostics);
            eprintln!("error: {}: cannot compile for a {} mesh; no plan written", source.name, target.mesh);
            None
        }
    }
}

/// A plan from a `.json` plan file, or compiled from a `.opt` model with the target flags.
pub fn plan_from(path: &Path, target: &TargetArgs) -> Option<Plan> {
    let is_plan = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"));
    if !is_plan {
        return compile_model(path, target);
    }
    let plan = match optimus::plan::io::read_plan(path) {
        Ok(plan) => plan,
        Err(e) => {
            eprintln!("error: {e}");
            return None;
        }
    };
    match optimus::plan::verify::verify(&plan) {
        Ok(()) => Some(plan),
        Err(errors) => {
            eprintln!("error: `{}` failed verification:", path.display());
            for e in errors.iter().take(20) {
                eprintln!("  {e}");
            }
            None
        }
    }
}

/// Writes to standard output; a closed pipe (`optimusc ... | head`) ends the output quietly.
pub fn stdout(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written = out.write_all(text.as_bytes()).and_then(|()| out.flush());
    if let Some(e) = written.err().filter(|e| e.kind() != std::io::ErrorKind::BrokenPipe) {
        eprintln!("error: cannot write to standard output: {e}");
    }
}
