//! Calibrated hardware profiles: `simulate` costs kernels and collectives by a profile's `[measured]`
//! section exactly as documented (hand-computed from the plan), devices sharing one engine add up,
//! bad sections are refused, and `optimusc calibrate --quick` writes a profile `simulate` reads.

use optimus::cost::{Hardware, Options, simulate};
use optimus::plan::report::kernel_flops;
use optimus::plan::{Buffer, Instr, Mesh, Mode, Plan, Strategy};
use optimus::shard::Target;
use std::process::Command;

const TINY: &str = include_str!("../examples/tiny.opt");

fn plan(mesh: Mesh, strategy: Strategy, mode: Mode) -> Plan {
    let checked = optimus::front::check_source(TINY, &[]);
    let Some(model) = checked.model else { panic!("tiny.opt does not check") };
    let target = Target::plain(mesh, strategy, mode);
    match optimus::shard::compile(&model, "tiny", TINY, target) {
        Ok(plan) => plan,
        Err(e) => panic!("tiny.opt does not compile for {mesh}: {e:?}"),
    }
}

/// A profile whose kernels cost `launch_us` plus bytes at 1 GB/s plus FLOPs at 10 GFLOP/s (MatMul
/// 100 GFLOP/s), and whose broadcasts cost 7 us plus 2 ns a byte on any mesh.
fn measured_profile(shared: bool, dispatch_us: f64, launch_us: f64) -> Hardware {
    let text = format!(
        r#"
name = "measured"
[device]
name = "test cpu"
memory_gb = 16.0
memory_bandwidth_gb_s = 1.0
achievable_bandwidth = 1.0
achievable_compute = 1.0
[device.peak_tflops]
f32 = 0.1
[intra_node]
gpus_per_node = 64
bandwidth_gb_s = 1.0
latency_us = 1.0
[inter_node]
nic_bandwidth_gb_s = 1.0
latency_us = 1.0
[measured]
runtime = "cpu"
threads = 2
shared_engine = {shared}
overlap = false
[[measured.dispatch]]
devices = 4
us = {dispatch_us}
[measured.kernels.default]
launch_us = {launch_us}
gb_s = 1.0
gflop_s = 10.0
[measured.kernels.MatMul]
launch_us = {launch_us}
gb_s = 1.0
gflop_s = 100.0
[[measured.collectives]]
kind = "broadcast"
members = 2
devices = 4
alpha_us = 7.0
ns_per_byte = 2.0
[measured.host_copies]
copy_out_gb_s = 2.0
copy_in_gb_s = 4.0
add_gb_s = 8.0
"#
    );
    match Hardware::parse(&text, "measured") {
        Ok(hw) => hw,
        Err(e) => panic!("{e}"),
    }
}

/// Seconds of every kernel of one device by the profile's formula, and the number of kernels.
fn kernel_seconds(plan: &Plan, launch_us: f64) -> (f64, usize) {
    let mut total = 0.0;
    let mut count = 0;
    for instr in &plan.program {
        let Instr::Kernel { kernel, inputs, output, .. } = instr else { continue };
        let ins: Vec<&Buffer> = inputs.iter().map(|&b| plan.buffer(b)).collect();
        let out = plan.buffer(*output);
        let bytes = (ins.iter().map(|b| b.bytes()).sum::<u64>() + out.bytes()) as f64;
        let rate = if matches!(kernel, optimus::plan::Kernel::MatMul { .. }) { 100e9 } else { 10e9 };
        total += launch_us * 1e-6 + bytes / 1e9 + kernel_flops(kernel, &ins, out) as f64 / rate;
        count += 1;
    }
    (total, count)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-12)
}

#[test]
fn one_device_steps_are_the_sum_of_the_fitted_kernel_costs() {
    for mode in [Mode::Train, Mode::Infer] {
        let p = plan(Mesh::new(1, 1), Strategy::None, mode);
        let sim = simulate(&p, &measured_profile(true, 3.0, 5.0), &Options::default());
        let (expected, kernels) = kernel_seconds(&p, 5.0);
        assert!(close(sim.step_time_s, expected), "{mode:?}: {} against {expected}", sim.step_time_s);
        assert!(close(sim.overhead_s, 5e-6 * kernels as f64), "launch costs: {}", sim.overhead_s);
        assert!(!sim.overlap, "the profile says the runtime does not overlap");
    }
}

/// Inference plans take the profile's `@infer` fits (`calibrate` fits inference runs' kernels apart:
/// they write memory still in cache); training plans keep the training fits.
#[test]
fn inference_plans_use_the_inference_fits() {
    let base = measured_profile(false, 0.0, 5.0);
    let Some(mut measured) = base.measured.clone() else { panic!("a measured section") };
    for kind in ["default", "MatMul"] {
        let Some(fit) = measured.kernels.get(kind).copied() else { panic!("no {kind} fit") };
        let faster = optimus::cost::calibration::KernelFit { launch_us: 2.0, ..fit };
        measured.kernels.insert(optimus::cost::calibration::inference_key(kind), faster);
    }
    let hw = Hardware { measured: Some(measured), ..base };
    for (mode, launch_us) in [(Mode::Infer, 2.0), (Mode::Train, 5.0)] {
        let p = plan(Mesh::new(1, 1), Strategy::None, mode);
        let sim = simulate(&p, &hw, &Options::default());
        let (expected, _) = kernel_seconds(&p, launch_us);
        assert!(close(sim.step_time_s, expected), "{mode:?}: {} against {expected}", sim.step_time_s);
    }
}

#[test]
fn devices_sharing_an_engine_add_up_and_trade_launch_for_dispatch() {
    let p = plan(Mesh::new(2, 2), Strategy::Optimus, Mode::Train);
    let (launch, dispatch) = (5.0, 3.0);
    let (one_device, kernels) = kernel_seconds(&p, launch);
    let work = one_device - launch * 1e-6 * kernels as f64;
    let shared = simulate(&p, &measured_profile(true, dispatch, launch), &Options::default());
    let expected_compute = 4.0 * (work + dispatch * 1e-6 * kernels as f64);
    assert!(close(shared.compute_s, expected_compute), "{} against {expected_compute}", shared.compute_s);
    let alone = simulate(&p, &measured_profile(false, dispatch, launch), &Options::default());
    assert!(close(alone.compute_s, one_device), "own engines: one device's kernels, {}", alone.compute_s);
}

#[test]
fn devices_running_their_own_kernels_cost_single_thread_fits_on_the_engines_threads() {
    // The profile's 2 threads, 4 devices: every device thread runs its own kernels, two at once, at the
    // single-thread fits (here three times the pool's costs), with the same dispatch.
    let p = plan(Mesh::new(2, 2), Strategy::Optimus, Mode::Train);
    let (launch, dispatch) = (5.0, 3.0);
    let mut hw = measured_profile(true, dispatch, launch);
    let pool = hw.measured.as_ref().map(|m| m.kernels.clone()).unwrap_or_default();
    let slower = |f: &optimus::cost::calibration::KernelFit| optimus::cost::calibration::KernelFit {
        launch_us: f.launch_us,
        gb_s: f.gb_s.map(|r| r / 3.0),
        gflop_s: f.gflop_s.map(|r| r / 3.0),
        samples: f.samples,
        cached_bytes: f.cached_bytes,
        cached_gb_s: f.cached_gb_s.map(|r| r / 3.0),
    };
    if let Some(m) = hw.measured.as_mut() {
        m.single_thread_kernels = pool.iter().map(|(k, f)| (k.clone(), slower(f))).collect();
    }
    let (one_device, kernels) = kernel_seconds(&p, launch);
    let work = one_device - launch * 1e-6 * kernels as f64;
    let expected_compute = 4.0 / 2.0 * 3.0 * work + 4.0 * dispatch * 1e-6 * kernels as f64;
    let sim = simulate(&p, &hw, &Options::default());
    assert!(close(sim.compute_s, expected_compute), "{} against {expected_compute}", sim.compute_s);
    // One device keeps the pool's fits.
    let one = simulate(&plan(Mesh::new(1, 1), Strategy::None, Mode::Train), &hw, &Options::default());
    assert!(close(one.compute_s, kernel_seconds(&plan(Mesh::new(1, 1), Strategy::None, Mode::Train), launch).0));
}

#[test]
fn measured_collectives_cost_their_copies_on_a_shared_engine_and_alpha_beta_otherwise() {
    let p = plan(Mesh::new(2, 2), Strategy::Optimus, Mode::Train);
    let report = optimus::plan::report::report(&p);
    let broadcasts: Vec<u64> = report
        .communication
        .iter()
        .filter(|c| matches!(&p.program[c.instruction], Instr::Collective { collective, .. } if collective.kind == optimus::plan::CollectiveKind::Broadcast))
        .map(|c| c.bytes)
        .collect();
    assert!(!broadcasts.is_empty(), "a 2x2 optimus plan broadcasts");
    let bytes: u64 = broadcasts.iter().sum();
    let time = |sim: &optimus::cost::Simulation| -> f64 {
        sim.communication.iter().filter(|c| c.kind == "broadcast").map(|c| c.time_s).sum()
    };
    let own = simulate(&p, &measured_profile(false, 0.0, 0.0), &Options::default());
    let expected = broadcasts.len() as f64 * 7e-6 + bytes as f64 * 2e-9;
    assert!(close(time(&own), expected), "alpha-beta: {} against {expected}", time(&own));
    let shared = simulate(&p, &measured_profile(true, 3.0, 0.0), &Options::default());
    let expected = bytes as f64 * 2e-9 + broadcasts.len() as f64 * 4.0 * 3e-6;
    assert!(close(time(&shared), expected), "copies and dispatch: {} against {expected}", time(&shared));
    // With a rendezvous fit, collectives cost it in place of the dispatch; kernels keep the dispatch.
    let met = simulate(&p, &with_rendezvous(measured_profile(true, 3.0, 0.0), 11.0), &Options::default());
    let expected = bytes as f64 * 2e-9 + broadcasts.len() as f64 * 4.0 * 11e-6;
    assert!(close(time(&met), expected), "copies and rendezvous: {} against {expected}", time(&met));
    assert!(close(met.compute_s, shared.compute_s), "kernels: {} against {}", met.compute_s, shared.compute_s);
}

/// `hw` with a rendezvous cost of `us` per collective and device on 4 devices.
fn with_rendezvous(mut hw: Hardware, us: f64) -> Hardware {
    if let Some(m) = hw.measured.as_mut() {
        m.rendezvous = vec![optimus::cost::calibration::DispatchFit { devices: 4, us }];
    }
    hw
}

#[test]
fn bad_measured_sections_are_refused_with_the_field() {
    let good = toml_of(&with_rendezvous(measured_profile(true, 1.0, 1.0), 2.0));
    let cases = [
        ("[measured.kernels.default]\nlaunch_us = 1.0\ngb_s = 1.0\ngflop_s = 10.0\nsamples = 0\n", "", "`default`"),
        ("gb_s = 1.0\ngflop_s = 100.0", "gb_s = -1.0\ngflop_s = 100.0", "MatMul.gb_s"),
        ("devices = 4\nus = 1.0", "devices = 4\nus = -1.0", "measured.dispatch"),
        ("devices = 4\nus = 2.0", "devices = 1\nus = 2.0", "measured.rendezvous"),
        ("members = 2\ndevices = 4", "members = 2\ndevices = 1", "collectives"),
        ("copy_in_gb_s = 4.0", "copy_in_gb_s = 0.0", "host_copies.copy_in_gb_s"),
        ("runtime = \"cpu\"", "runtime = \"abacus\"", "`measured.runtime` is `abacus`"),
    ];
    for (from, to, named) in cases {
        assert!(good.contains(from), "the profile has `{from}`:\n{good}");
        let bad = good.replacen(from, to, 1);
        match Hardware::parse(&bad, "bad.toml") {
            Ok(_) => panic!("accepted a profile with `{to}`"),
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains(named) && e.contains("bad.toml"), "{e}");
            }
        }
    }
}

fn toml_of(hw: &Hardware) -> String {
    match toml::to_string(hw) {
        Ok(text) => text,
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn calibrate_writes_a_profile_that_simulate_reads() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("here.toml");
    let bin = env!("CARGO_BIN_EXE_optimusc");
    let samples = dir.path().join("samples.jsonl");
    let out = Command::new(bin)
        .args(["calibrate", "--quick", "--name", "test-host", "-o"])
        .arg(&path)
        .arg("--samples")
        .arg(&samples)
        .output();
    let out = out.expect("optimusc runs");
    assert!(out.status.success(), "calibrate failed: {}", String::from_utf8_lossy(&out.stderr));
    // The raw measurements: a line per timed kernel instruction and per shared-engine run.
    let raw = std::fs::read_to_string(&samples).expect("the samples were written");
    let lines: Vec<serde_json::Value> = raw.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
    let kernels = lines.iter().filter(|l| l["kind"] == "kernel").count();
    let shared: Vec<_> = lines.iter().filter(|l| l["kind"] == "shared").collect();
    assert!(kernels > 100 && kernels + shared.len() == lines.len(), "{kernels} kernel lines of {}", lines.len());
    assert!(lines.iter().filter(|l| l["kind"] == "kernel").all(|l| l["sample"]["seconds"].as_f64() > Some(0.0)));
    assert_eq!(shared.len(), 2, "the quick shared-engine runs, trained and for inference");
    assert!(shared.iter().all(|r| r["measured_s"].as_f64() > Some(0.0) && r["devices"] == 4), "{shared:?}");
    let text = std::fs::read_to_string(&path).expect("the profile was written");
    // How steady the CPU's speed was: its peak measured at the start, after each phase and at the end,
    // said atop the profile and, where the measurements are over 10% apart, warned of.
    let speed = text.lines().find(|l| l.contains("the peak measured")).unwrap_or_else(|| panic!("{text}"));
    let unsteady = speed.contains("changed while it was measured");
    assert!(speed.starts_with("# ") && (unsteady || speed.contains("kept its speed")), "{speed}");
    let times: usize = speed.split("measured ").nth(2).and_then(|t| t.split(' ').next()?.parse().ok()).unwrap_or(0);
    assert!(times >= 5, "{speed}");
    let warned = String::from_utf8_lossy(&out.stderr).contains("warning: calibrate: this machine's speed changed");
    assert_eq!(unsteady, warned, "{speed}");
    let hw = match Hardware::parse(&text, "here.toml") {
        Ok(hw) => hw,
        Err(e) => panic!("{e}\n{text}"),
    };
    assert_eq!(hw.name, "test-host");
    // The profile says which instructions and which library its products were measured with: the
    // fits hold for them, and a profile read on another machine or setting says what it measured.
    let isa = ["avx512 kernels", "avx2 kernels", "baseline kernels"];
    let library = ["products in optimus AVX2", "products in OpenBLAS", "products in faer"];
    assert!(
        isa.iter().any(|i| hw.description.contains(i)) && library.iter().any(|l| hw.description.contains(l)),
        "{}",
        hw.description
    );
    let m = hw.measured.as_ref().expect("a [measured] section");
    let inference = |kind: &str| optimus::cost::calibration::inference_key(kind);
    let kinds = ["MatMul", "default", "LayerNormApply", "Attention"];
    for kind in kinds.iter().map(|k| k.to_string()).chain(kinds.iter().map(|k| inference(k))) {
        let fit = m.kernels.get(&kind).unwrap_or_else(|| panic!("no fit for {kind}:\n{text}"));
        assert!(fit.samples > 0 && (fit.gb_s.is_some() || fit.gflop_s.is_some() || fit.launch_us > 0.0), "{kind}");
        assert!(m.single_thread_kernels.contains_key(&kind), "no one-thread fit for {kind}");
    }
    assert_eq!(m.collectives.len(), 10, "five kinds on two shapes");
    let copies = m.host_copies.expect("host copy rates");
    for rate in [copies.copy_out_gb_s, copies.copy_in_gb_s, copies.add_gb_s] {
        assert!(rate > 0.1 && rate < 1000.0, "a host copy rate of {rate} GB/s:\n{text}");
    }
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tiny.opt");
    let out =
        Command::new(bin).args(["simulate", model, "--mesh", "2x2", "--hardware"]).arg(&path).arg("--json").output();
    let out = out.expect("optimusc runs");
    assert!(out.status.success(), "simulate failed: {}", String::from_utf8_lossy(&out.stderr));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let step = value["step_time_s"].as_f64().unwrap_or(0.0);
    assert!(step > 0.0 && step < 1.0, "a tiny step on this machine: {step} s");
    assert_eq!(value["overlap"], serde_json::Value::Bool(false));
}

#[test]
fn calibrate_refuses_an_unwritable_destination_before_measuring() {
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(["calibrate", "-o", "/nonexistent-dir/here.toml"])
        .output()
        .expect("optimusc runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent-dir/here.toml") && !err.contains("calibrate: kernels"), "{err}");
    // The same for the raw measurements' file.
    let dir = tempfile::tempdir().expect("temporary directory");
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(["calibrate", "--samples", "/nonexistent-dir/samples.jsonl", "-o"])
        .arg(dir.path().join("here.toml"))
        .output()
        .expect("optimusc runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent-dir/samples.jsonl") && !err.contains("calibrate: kernels"), "{err}");
}

/// `calibrate --backend cuda` measures a GPU; on a machine or a build without one it says why (exit 1)
/// before measuring anything, and writes nothing.
#[test]
fn calibrating_a_gpu_where_there_is_none_says_why_and_writes_nothing() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let (profile, samples) = (dir.path().join("gpu.toml"), dir.path().join("samples.jsonl"));
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .args(["calibrate", "--backend", "cuda", "--quick", "-o"])
        .arg(&profile)
        .arg("--samples")
        .arg(&samples)
        .output()
        .expect("optimusc runs");
    if out.status.success() {
        // A machine with a GPU: it calibrated.
        assert!(profile.exists() && samples.exists());
        return;
    }
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("error: calibrate --backend cuda:") && err.contains("CUDA"), "{err}");
    assert!(!err.contains("GPU kernels") && !profile.exists() && !samples.exists(), "{err}");
}

/// A kernel kind seen at one size gets no fit of its own (one size says nothing of how its time grows:
/// the next more general fit costs it); seen at two sizes, it gets the line through them.
#[test]
fn a_kernel_kind_is_fitted_only_from_two_sizes_or_more() {
    use optimus::calibrate::{KernelSample, fit_kernels};
    let sample = |kind: &str, bytes: f64, seconds: f64| {
        let fits = vec![kind.to_string()];
        (KernelSample { fits, default: "default".into(), bytes, flops: 0.0, seconds }, false)
    };
    let samples = [sample("Once", 1e6, 1e-3), sample("Twice", 1e6, 1e-3), sample("Twice", 4e6, 3e-3)];
    let fits = fit_kernels(&samples);
    assert!(!fits.contains_key("Once"), "{fits:?}");
    // 1 ms at 1 MB and 3 ms at 4 MB: 1/3 ms plus 2/3 ns a byte, so 5/3 ms at 2 MB.
    let at_2mb = fits.get("Twice").map(|f| f.seconds(2e6, 0.0));
    assert!(at_2mb.is_some_and(|s| (s - 5.0e-3 / 3.0).abs() < 1e-9), "{at_2mb:?}");
    assert!(fits.contains_key("default"), "the default fit takes every size: {fits:?}");
}
