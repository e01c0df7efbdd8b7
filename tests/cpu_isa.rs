//! `OPTIMUS_CPU_ISA` narrows the CPU kernels' vector instructions and the measured peak, to measure on
//! a wide CPU what a narrower one does: a bad value is a usage error, the profile says which set it
//! measured, and the kernels compute the same bits on every set (their formulas use separate multiplies
//! and adds), which a run with faer's products (not narrowed) shows end to end.

mod common;

use common::{read_weights, scratch, text};
use std::process::{Command, Output};

fn run_with_isa(isa: Option<&str>, args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_optimusc"));
    command.args(args).env("OPTIMUS_BLAS", "faer");
    match isa {
        Some(isa) => command.env("OPTIMUS_CPU_ISA", isa),
        None => command.env_remove("OPTIMUS_CPU_ISA"),
    };
    command.output().expect("optimusc runs")
}

#[test]
fn a_value_that_names_no_instruction_set_is_a_usage_error() {
    let out = run_with_isa(Some("sse9"), &["check", "examples/tiny.opt"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("OPTIMUS_CPU_ISA=\"sse9\": expected avx512, avx2 or baseline"), "{stderr}");
}

/// The CPU runtime's other switches take the values docs/clusters.md lists; a misspelt one, which the
/// runtime would read as unset, is a usage error too (an empty one is unset).
#[test]
fn a_cpu_switch_the_runtime_would_not_read_is_a_usage_error() {
    let check = |variable: &str, value: &str| {
        Command::new(env!("CARGO_BIN_EXE_optimusc"))
            .args(["check", "examples/tiny.opt"])
            .env(variable, value)
            .output()
            .expect("optimusc runs")
    };
    for (variable, value) in
        [("OPTIMUS_DEVICE_KERNELS", "Pool"), ("OPTIMUS_DEVICE_KERNELS", "bogus"), ("OPTIMUS_PIN_DEVICES", "maybe")]
    {
        let out = check(variable, value);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.code() == Some(2) && stderr.contains(&format!("{variable}=\"{value}\": expected")),
            "{stderr}"
        );
    }
    for (variable, value) in
        [("OPTIMUS_DEVICE_KERNELS", "inline"), ("OPTIMUS_DEVICE_KERNELS", ""), ("OPTIMUS_PIN_DEVICES", " Off")]
    {
        assert!(check(variable, value).status.success(), "{variable}={value:?}");
    }
}

#[test]
fn the_profile_measures_the_peak_in_the_capped_set() {
    let out = run_with_isa(Some("baseline"), &["run", "examples/tiny.opt", "--steps", "2", "--profile"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("(baseline multiply-add, as OPTIMUS_CPU_ISA allows)"), "{stderr}");
}

#[test]
fn every_instruction_set_computes_the_same_bits() {
    let dir = scratch("cpu-isa", "runs");
    let model = ["run", "examples/gpt2.opt", "--set", "layers=2", "--set", "hidden=64", "--set", "heads=4"];
    let model = [&model[..], &["--set", "vocab=300", "--set", "seq=32", "--set", "batch=4", "--steps", "3"]].concat();
    let runs: Vec<_> = [None, Some("avx2"), Some("baseline")]
        .into_iter()
        .map(|isa| {
            let weights = dir.join(format!("{}.safetensors", isa.unwrap_or("widest")));
            let args = [&model[..], &["--mesh", "2x2", "--save-weights", text(&weights)]].concat();
            let out = run_with_isa(isa, &args);
            assert!(out.status.success(), "{isa:?}: {}", String::from_utf8_lossy(&out.stderr));
            (isa, read_weights(&weights))
        })
        .collect();
    let (_, widest) = &runs[0];
    assert!(!widest.is_empty());
    for (isa, weights) in &runs[1..] {
        for ((name, x), (_, y)) in widest.iter().zip(weights) {
            let same = x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "{isa:?}: `{name}` differs from the widest set's");
        }
    }
}
