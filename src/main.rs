//! The `optimusc` command line: the only place that prints.

use clap::{Parser, Subcommand, ValueEnum};
use optimus::check::{Checked, check_source, decode};
use optimus::diag::{self, group_digits};
use optimus::elab::Override;
use std::path::PathBuf;
use std::process::ExitCode;

/// optimusc: compile transformer models described in .opt files into 2D-parallel (Optimus) programs.
#[derive(Parser, Debug)]
#[command(name = "optimusc", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Parse, elaborate and shape-check a model; print its parameter count or precise errors.
    ///
    /// Exit status: 0 if the model is valid, 1 if it has errors, 2 on usage errors.
    Check {
        /// The model file (.opt).
        model: PathBuf,
        /// Override a config value, e.g. `--set layers=2`. Repeatable.
        #[arg(long = "set", value_name = "NAME=VALUE")]
        set: Vec<Override>,
        /// Also print an intermediate form to standard output.
        #[arg(long, value_enum)]
        emit: Option<Emit>,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Emit {
    /// The typed logical graph, one operator per line.
    Ir,
}

/// Stack size for the worker thread: deep but legal inputs must never overflow it.
const STACK_BYTES: usize = 256 * 1024 * 1024;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let worker = std::thread::Builder::new().stack_size(STACK_BYTES).spawn(move || run(cli));
    match worker.map(|h| h.join()) {
        Ok(Ok(code)) => code,
        _ => {
            eprintln!("error: internal compiler error (please report it with the input that caused it)");
            ExitCode::from(101)
        }
    }
}

fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Check { model, set, emit } => check(&model, &set, emit),
    }
}

/// Reads a model file; prints an error and returns `None` if it cannot be read.
fn read_model(path: &PathBuf) -> Option<Vec<u8>> {
    match std::fs::read(path) {
        Ok(bytes) => Some(bytes),
        Err(e) => {
            eprintln!("error: cannot read `{}`: {e}", path.display());
            None
        }
    }
}

fn check(path: &PathBuf, overrides: &[Override], emit: Option<Emit>) -> ExitCode {
    let Some(bytes) = read_model(path) else { return ExitCode::from(1) };
    let name = path.display().to_string();
    let (source, bad_utf8) = decode(&name, bytes);
    if let Some(d) = bad_utf8 {
        diag::render_stderr(&source.name, &source.text, &[d]);
        return ExitCode::from(1);
    }
    let Checked { model, diagnostics } = check_source(&source.text, overrides);
    diag::render_stderr(&source.name, &source.text, &diagnostics);
    let errors = diagnostics.iter().filter(|d| d.is_error()).count();
    let Some(model) = model.filter(|_| errors == 0) else {
        eprintln!("error: {name}: {errors} error{} found", if errors == 1 { "" } else { "s" });
        return ExitCode::from(1);
    };
    if let Some(Emit::Ir) = emit {
        print!("{}", optimus::ir::print::print_model(&model, &source.text));
    }
    println!(
        "{name}: model {} checks: {} parameters in {} tensors, {} operators",
        model.name,
        group_digits(model.parameter_count()),
        model.params.len(),
        model.graph.node_count()
    );
    ExitCode::SUCCESS
}
