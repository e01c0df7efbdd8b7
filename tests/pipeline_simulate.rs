//! `optimusc simulate --pipeline`: a whole-model plan cut into pipeline stages accounts for every
//! instruction once, one stage is the plain simulation, the bubble is never below the schedule's
//! formula, the stages hold every parameter (a tied one twice), 1F1B keeps at most P micro-batches on
//! the first stage where GPipe keeps them all, and bad flags are clear errors.

mod common;

use common::SHARED_CPU;
use optimus::cost::search::Source;
use optimus::cost::staged::{Pipeline, PipelineSimulation, simulate_pipeline};
use optimus::cost::{Hardware, Options, simulate};
use optimus::plan::pipeline::Schedule;
use optimus::plan::{Mesh, Mode, Plan, Strategy};
use optimus::shard::Target;
use std::path::PathBuf;
use std::process::Command;

fn example(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples").join(name)
}

fn dgx() -> Hardware {
    Hardware::load("dgx-a100").unwrap_or_else(|e| panic!("{e}"))
}

/// GPT-2 with `layers` layers and a small batch, compiled for `mesh` with `strategy`.
fn gpt2(layers: u64, mesh: Mesh, strategy: Strategy) -> Plan {
    let text = std::fs::read_to_string(example("gpt2.opt")).unwrap_or_else(|e| panic!("gpt2.opt: {e}"));
    let overrides: Vec<_> = [format!("layers={layers}"), "batch=4".to_string(), "seq=256".to_string()]
        .iter()
        .map(|s| s.parse().unwrap_or_else(|e| panic!("{s}: {e:?}")))
        .collect();
    let source = Source { name: "gpt2.opt", text: &text, overrides: &overrides };
    let target = Target::plain(mesh, strategy, Mode::Train);
    source.compile(target, &[]).unwrap_or_else(|e| panic!("{mesh} {strategy:?}: {e}"))
}

fn pipelined(plan: &Plan, stages: u64, schedule: Schedule, micro_batches: u64) -> PipelineSimulation {
    let pipeline = Pipeline { stages, schedule, micro_batches };
    simulate_pipeline(plan, &dgx(), &Options::default(), pipeline).unwrap_or_else(|e| panic!("{pipeline:?}: {e}"))
}

fn meshes() -> Vec<(Mesh, Strategy)> {
    vec![
        (Mesh::new(1, 1), Strategy::None),
        (Mesh::new(2, 2), Strategy::Optimus),
        (Mesh::new(1, 2), Strategy::Megatron),
        (Mesh::new(1, 2).with_data(2), Strategy::Megatron),
    ]
}

#[test]
fn one_stage_and_one_micro_batch_is_the_plain_simulation_without_replicas() {
    for (mesh, strategy) in meshes() {
        let plan = gpt2(4, mesh, strategy);
        let plain = simulate(&plan, &dgx(), &Options::default());
        let one = pipelined(&plan, 1, Schedule::OneFOneB, 1);
        let close = (one.step_time_s - plain.step_time_s).abs() <= 1e-9 * plain.step_time_s;
        assert!(close, "{mesh}: {} against {}", one.step_time_s, plain.step_time_s);
        assert_eq!(one.bubble_fraction, 0.0);
        assert_eq!(one.devices, mesh.devices());
        // Idle shares never print as -0.0%: one stage idles exactly nothing, with any micro-batches.
        for m in [1, 3, 4] {
            let t = pipelined(&plan, 1, Schedule::OneFOneB, m);
            for share in [t.bubble_fraction, t.bottleneck_bubble_fraction] {
                assert!(share == 0.0 && share.is_sign_positive(), "{mesh} m={m}: {share:e}");
            }
        }
    }
}

#[test]
fn the_stages_share_out_every_instruction_and_every_parameter() {
    for (mesh, strategy) in meshes() {
        let plan = gpt2(8, mesh, strategy);
        let one = pipelined(&plan, 1, Schedule::OneFOneB, 1);
        let passes: f64 = one.per_stage.iter().map(|s| s.forward_s + s.backward_s).sum();
        let update: f64 = one.per_stage.iter().map(|s| s.update_s).sum();
        let total_params: u64 = plan.params.iter().map(|p| p.shape.iter().product::<u64>()).sum();
        for stages in [2u64, 4, 8] {
            let s = pipelined(&plan, stages, Schedule::OneFOneB, 8);
            assert_eq!(s.per_stage.len() as u64, stages);
            assert_eq!(s.devices, stages * mesh.devices());
            let compute: f64 = s.per_stage.iter().map(|s| s.forward_s + s.backward_s).sum();
            assert!((compute - passes).abs() <= 1e-9 * passes, "{mesh} P={stages}: {compute} against {passes}");
            // Every stage updates its own parameters (a tied one on both stages that hold it), and each
            // runs the norm's sum over the mesh.
            let updates: f64 = s.per_stage.iter().map(|s| s.update_s).sum();
            assert!(updates >= update * (1.0 - 1e-9), "{mesh} P={stages}: {updates} against {update}");
            let slowest = s.per_stage.iter().map(|s| s.update_s).fold(0.0, f64::max);
            assert!(slowest < update, "{mesh} P={stages}: a stage updates less than the whole model");
            // The tied embedding and LM head: the first and the last stage both hold wte.
            let wte: u64 =
                plan.params.iter().find(|p| p.name.starts_with("wte")).map_or(0, |p| p.shape.iter().product());
            let held: u64 = s.per_stage.iter().map(|s| s.parameters).sum();
            assert_eq!(held, total_params + wte, "{mesh} P={stages}");
            assert!(s.tied_sync_s > 0.0);
            assert!(s.p2p_bytes > 0 && s.p2p_s > 0.0);
            let layers: usize = s.per_stage.iter().map(|st| st.layers.len()).sum();
            assert_eq!(layers as u64, stages);
        }
    }
}

#[test]
fn the_bubble_is_never_below_the_schedules_formula() {
    let plan = gpt2(8, Mesh::new(2, 2), Strategy::Optimus);
    for (stages, m) in [(2u64, 1u64), (2, 8), (4, 4), (4, 16), (8, 8)] {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let s = pipelined(&plan, stages, schedule, m);
            let formula = (stages - 1) as f64 / (m + stages - 1) as f64;
            assert!(s.bubble_fraction >= formula - 1e-9, "{schedule:?} P={stages} m={m}: {}", s.bubble_fraction);
            assert!(s.bubble_fraction < 1.0);
            assert!(s.step_time_s >= s.pipeline_s);
            // The busiest stage idles no more than the stages on average.
            assert!(s.bottleneck_bubble_fraction <= s.bubble_fraction + 1e-12, "{schedule:?} P={stages} m={m}");
        }
        if stages * 2 <= 8 && m % stages == 0 {
            let interleaved = pipelined(&plan, stages, Schedule::Interleaved { chunks: 2 }, m);
            let formula = (stages - 1) as f64 / (2 * m + stages - 1) as f64;
            assert!(interleaved.bubble_fraction >= formula - 1e-9);
            assert_eq!(interleaved.per_stage[0].layers.len(), 2, "two chunks a stage");
        }
    }
}

#[test]
fn one_f_one_b_keeps_at_most_p_micro_batches_where_gpipe_keeps_them_all() {
    let plan = gpt2(8, Mesh::new(1, 2), Strategy::Megatron);
    let (p, m) = (4u64, 12u64);
    let one_f_one_b = pipelined(&plan, p, Schedule::OneFOneB, m);
    let gpipe = pipelined(&plan, p, Schedule::GPipe, m);
    for (s, (a, b)) in one_f_one_b.per_stage.iter().zip(&gpipe.per_stage).enumerate() {
        assert_eq!(a.in_flight, p - s as u64);
        assert_eq!(b.in_flight, m);
        assert!(a.kept_bytes_per_micro_batch > 0);
        assert!(a.peak_bytes < b.peak_bytes, "stage {s}: 1F1B {} against GPipe {}", a.peak_bytes, b.peak_bytes);
    }
    // The same passes, in another order: GPipe's update is no faster.
    assert!(gpipe.step_time_s >= one_f_one_b.step_time_s * (1.0 - 1e-9));
    // More micro-batches shrink the bubble.
    let more = pipelined(&plan, p, Schedule::OneFOneB, 4 * m);
    assert!(more.bubble_fraction < one_f_one_b.bubble_fraction);
    assert!(more.tokens_per_second > one_f_one_b.tokens_per_second);
}

fn optimusc(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().unwrap_or_else(|e| panic!("{e}"));
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn the_command_line_simulates_a_pipeline_and_refuses_contradictions() {
    let model = example("gpt2.opt");
    let model = model.to_str().unwrap_or_default();
    let base = ["simulate", model, "--mesh", "2x2", "--hardware", "dgx-a100", "--set", "layers=4"];
    let (ok, out, err) = optimusc(&[&base[..], &["--pipeline", "2", "--accum", "4"]].concat());
    assert!(ok, "{err}");
    assert!(out.contains("pipeline of 2 stages (1f1b schedule)"), "{out}");
    assert!(out.contains("embedding + h.0"), "{out}");
    assert!(out.contains("+ head"), "{out}");
    let (ok, out, err) = optimusc(&[&base[..], &["--pipeline", "2", "--accum", "4", "--timeline"]].concat());
    assert!(ok, "{err}");
    let rows: Vec<&str> = out.lines().filter(|l| l.trim_start().starts_with("stage ") && l.ends_with('|')).collect();
    assert_eq!(rows.len(), 2, "{out}");
    for row in &rows {
        let chart = row.split('|').nth(1).unwrap_or_default();
        assert_eq!(chart.chars().count(), 100, "{row}");
        // Every micro-batch's forward and backward shows on every stage.
        for k in ['0', '1', '2', '3', 'a', 'b', 'c', 'd'] {
            assert!(chart.contains(k), "{k} missing in {row}");
        }
    }
    // The first stage starts at once; the last waits for the first forward to reach it.
    assert!(rows[0].split('|').nth(1).is_some_and(|c| c.starts_with('0')), "{out}");
    assert!(rows[1].split('|').nth(1).is_some_and(|c| c.starts_with('.')), "{out}");
    let (ok, out, err) = optimusc(&[&base[..], &["--pipeline", "2", "--accum", "4", "--json"]].concat());
    assert!(ok, "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(json["stages"], 2);
    assert_eq!(json["devices"], 8);
    for (flags, expected) in [
        (vec!["--pipeline", "4", "--virtual-stages", "2"], "--virtual-stages 2 is for --pipeline-schedule interleaved"),
        (vec!["--pipeline", "2", "--pipeline-schedule", "interleaved", "--accum", "3"], "not a multiple of 2 stages"),
        (vec!["--pipeline", "5"], "need at least 5 repeated layers"),
        (vec!["--pipeline", "2", "--mode", "infer"], "training plans"),
        (vec!["--pipeline", "2", "--max-batch"], "do not go with --max-batch"),
        (vec!["--pipeline", "0"], "0 is not in 1..="),
        (vec!["--timeline"], "--pipeline"),
    ] {
        let (ok, _, err) = optimusc(&[&base[..], &flags[..]].concat());
        assert!(!ok, "{flags:?} should fail");
        assert!(err.contains(expected), "{flags:?}: {err}");
        assert!(!err.contains("panicked"), "{flags:?}: {err}");
    }
}

/// `--accum` on one stage is the planner's update: the micro steps, with the optimizer and the
/// replicas' gradient sums once.
#[test]
fn accumulation_on_one_stage_is_what_the_planner_scores() {
    use optimus::cost::planner::{self, Config, Parallelism, Request};
    use optimus::plan::{Precision, Recompute};
    let text = std::fs::read_to_string(example("gpt2.opt")).unwrap_or_else(|e| panic!("{e}"));
    let overrides: Vec<_> =
        ["layers=2", "seq=128", "batch=16"].iter().map(|s| s.parse().unwrap_or_else(|e| panic!("{e:?}"))).collect();
    let source = Source { name: "gpt2.opt", text: &text, overrides: &overrides };
    let hw = dgx();
    for (strategy, mesh, data, zero) in [
        (Strategy::Megatron, Mesh::new(1, 2), 2, 0),
        (Strategy::Optimus, Mesh::new(2, 2), 2, 1),
        (Strategy::None, Mesh::new(1, 1), 1, 0),
    ] {
        let config = Config {
            parallelism: Parallelism::tensor(strategy, mesh, data),
            micro_batch: 4,
            accumulation: 16 / (4 * data),
            recompute: Recompute::None,
            precision: Precision::F32,
            zero,
        };
        let options = Options::default();
        let request = Request {
            source: &source,
            devices: mesh.devices() * data,
            hardware: &hw,
            capacity: u64::MAX,
            mode: Mode::Train,
            precisions: &[Precision::F32],
            options,
            max_pipeline: 1,
        };
        let scored = planner::evaluate(&request, &config).unwrap_or_else(|e| panic!("{e}"));
        let plan = planner::compile_candidate(&source, &config, Mode::Train).unwrap_or_else(|e| panic!("{e}"));
        let pipeline = Pipeline { stages: 1, schedule: Schedule::OneFOneB, micro_batches: config.accumulation };
        let sim = simulate_pipeline(&plan, &hw, &options, pipeline).unwrap_or_else(|e| panic!("{e}"));
        let same = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1e-12);
        assert!(
            same(sim.step_time_s, scored.step_time_s),
            "{}: {} against {}",
            config.label(),
            sim.step_time_s,
            scored.step_time_s
        );
        assert!(same(sim.compute_s, scored.compute_s), "{}", config.label());
        assert!(same(sim.data_parallel_s, scored.data_parallel_s), "{}", config.label());
        assert_eq!(sim.tokens_per_step, scored.tokens_per_step);
        // Its memory is the plan's, as the planner and `simulate --accum`'s text give it.
        assert_eq!(sim.peak_bytes_per_device, plan.memory.peak_bytes, "{}", config.label());
        assert_eq!(
            (sim.peak_bytes_per_device, sim.per_stage[0].peak_bytes),
            (scored.peak_bytes_per_device, plan.memory.peak_bytes)
        );
    }
}

/// With stages of nearly equal time (a small vocabulary: embedding and head cost little beside the
/// layers), the busiest stage idles what the formula says, (P - 1) / (V m + P - 1).
#[test]
fn nearly_equal_stages_idle_as_the_formula_says() {
    let text = std::fs::read_to_string(example("gpt2.opt")).unwrap_or_else(|e| panic!("{e}"));
    let overrides: Vec<_> = ["layers=8", "vocab=256", "batch=4", "seq=256"]
        .iter()
        .map(|s| s.parse().unwrap_or_else(|e| panic!("{e:?}")))
        .collect();
    let source = Source { name: "gpt2.opt", text: &text, overrides: &overrides };
    let target = Target::plain(Mesh::new(2, 2), Strategy::Optimus, Mode::Train);
    let plan = source.compile(target, &[]).unwrap_or_else(|e| panic!("{e}"));
    for (schedule, v) in [(Schedule::OneFOneB, 1u64), (Schedule::Interleaved { chunks: 2 }, 2)] {
        for m in [4u64, 8, 16] {
            let s = pipelined(&plan, 4, schedule, m);
            let times: Vec<f64> = s.per_stage.iter().map(|st| st.forward_s + st.backward_s).collect();
            let (low, high) = times.iter().fold((f64::INFINITY, 0.0f64), |(l, h), &t| (l.min(t), h.max(t)));
            assert!(high <= 1.1 * low, "stages should be nearly equal: {times:?}");
            let formula = 3.0 / (v * m + 3) as f64;
            let got = s.bottleneck_bubble_fraction;
            assert!((got - formula).abs() <= 0.03, "{schedule:?} m={m}: {got} against {formula}");
        }
    }
}

/// A CPU profile as `optimusc calibrate` writes one, cut to a default fit: two threads whose devices
/// share one engine.

#[test]
fn stages_sharing_a_cpus_cores_take_their_work_over_those_cores() {
    // Two stages of an optimus 2x2 grid are 8 device threads on 2 cores: the cores do the same work as
    // without a pipeline (no stage has cores of its own), so the step is no shorter than the
    // unpipelined run's with as many micro-batches. Timed as if each stage had the machine, it was half.
    let cpu = Hardware::parse(SHARED_CPU, "test").unwrap_or_else(|e| panic!("{e}"));
    let plan = gpt2(4, Mesh::new(2, 2), Strategy::Optimus);
    let at = |stages| {
        let pipeline = Pipeline { stages, schedule: Schedule::OneFOneB, micro_batches: 4 };
        simulate_pipeline(&plan, &cpu, &Options::default(), pipeline).unwrap_or_else(|e| panic!("{e}"))
    };
    let (alone, two) = (at(1), at(2));
    assert!(
        two.step_time_s >= 0.95 * alone.step_time_s,
        "2 stages {} s against one {} s",
        two.step_time_s,
        alone.step_time_s
    );
    // On a profile whose devices have engines of their own the same pipeline is faster than one stage.
    let gpus = pipelined(&plan, 2, Schedule::OneFOneB, 4);
    let one = pipelined(&plan, 1, Schedule::OneFOneB, 4);
    assert!(gpus.step_time_s < 0.8 * one.step_time_s, "{} against {}", gpus.step_time_s, one.step_time_s);
}

#[test]
fn a_pipeline_on_shared_cores_takes_the_fits_of_all_its_stages_threads() {
    // Two stages of an optimus 2x2 grid: 8 device threads share the cores, so each collective costs the
    // rendezvous fitted on 8 devices, not the one fitted on the stage's 4.
    let with = |four_us: f64, eight_us: f64| {
        let fits = format!(
            "[[measured.rendezvous]]\ndevices = 4\nus = {four_us}\n[[measured.rendezvous]]\ndevices = 8\nus = {eight_us}\n"
        );
        Hardware::parse(&format!("{SHARED_CPU}{fits}"), "test").unwrap_or_else(|e| panic!("{e}"))
    };
    let plan = gpt2(4, Mesh::new(2, 2), Strategy::Optimus);
    let step = |hw: &Hardware, stages| {
        let pipeline = Pipeline { stages, schedule: Schedule::OneFOneB, micro_batches: 4 };
        simulate_pipeline(&plan, hw, &Options::default(), pipeline).unwrap_or_else(|e| panic!("{e}")).step_time_s
    };
    let base = step(&with(5.0, 10.0), 2);
    assert!(close_to(step(&with(50.0, 10.0), 2), base), "the 4-device fit moved a pipeline of 8 threads");
    assert!(step(&with(5.0, 20.0), 2) > base, "the 8-device fit did not move a pipeline of 8 threads");
    // Unpipelined, the grid's 4 threads take the 4-device fit.
    let alone = step(&with(5.0, 10.0), 1);
    assert!(close_to(step(&with(5.0, 20.0), 1), alone) && step(&with(50.0, 10.0), 1) > alone);
}

/// [`SHARED_CPU`] with the host copies `calibrate` measures: out at 2 GB/s, in at 4, sums at 8.
fn shared_cpu_with_host_copies() -> Hardware {
    let text = format!("{SHARED_CPU}[measured.host_copies]\ncopy_out_gb_s = 2.0\ncopy_in_gb_s = 4.0\nadd_gb_s = 8.0\n");
    Hardware::parse(&text, "test").unwrap_or_else(|e| panic!("{e}"))
}

fn close_to(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 + 1e-9 * b.abs()
}

#[test]
fn a_cpu_stage_pays_for_its_host_copies_of_kept_activations_and_gradient_sums() {
    // Each one-device stage copies what a forward pass keeps out (2 GB/s) after it and back in (4 GB/s)
    // before its backward pass, then copies its gradients out and adds them to the sums (8 GB/s): the
    // passes cost exactly that much more than on the same profile without host copy rates.
    let (plain, copying) =
        (Hardware::parse(SHARED_CPU, "test").unwrap_or_else(|e| panic!("{e}")), shared_cpu_with_host_copies());
    let plan = gpt2(4, Mesh::new(1, 1), Strategy::None);
    let at = |hw: &Hardware| {
        let pipeline = Pipeline { stages: 2, schedule: Schedule::OneFOneB, micro_batches: 4 };
        simulate_pipeline(&plan, hw, &Options::default(), pipeline).unwrap_or_else(|e| panic!("{e}"))
    };
    let (without, with) = (at(&plain), at(&copying));
    let gradient_bytes: u64 = plan.params.iter().filter_map(|p| p.grad).map(|g| plan.buffer(g).bytes()).sum();
    let mut gradients_seen = 0u64;
    for (a, b) in without.per_stage.iter().zip(&with.per_stage) {
        let kept = b.kept_bytes_per_micro_batch as f64;
        assert!(kept > 0.0, "stage {} keeps activations", b.stage);
        assert!(
            close_to(b.forward_s - a.forward_s, kept / 2e9),
            "stage {}: {} against {}",
            b.stage,
            b.forward_s,
            a.forward_s
        );
        let gradients = (b.backward_s - a.backward_s - kept / 4e9) / (1.0 / 2e9 + 1.0 / 8e9);
        assert!(
            gradients > 0.0 && (gradients - gradients.round()).abs() < 1e-3,
            "stage {}: {gradients} gradient bytes",
            b.stage
        );
        gradients_seen += gradients.round() as u64;
        assert!(close_to(b.update_s - a.update_s, gradients.round() / 4e9), "the means written back");
    }
    // The tied embedding's gradient is summed on both stages that hold it; every other gradient once.
    let tied =
        plan.params.iter().find(|p| p.name == "wte.weight").and_then(|p| p.grad).map_or(0, |g| plan.buffer(g).bytes());
    assert_eq!(gradients_seen, gradient_bytes + tied);
    assert!(with.step_time_s > without.step_time_s);
}

#[test]
fn an_accumulating_cpu_run_pays_for_its_gradient_sums_once_per_micro_batch() {
    let (plain, copying) =
        (Hardware::parse(SHARED_CPU, "test").unwrap_or_else(|e| panic!("{e}")), shared_cpu_with_host_copies());
    let plan = gpt2(2, Mesh::new(1, 1), Strategy::None);
    let at = |hw: &Hardware, micro_batches| {
        let pipeline = Pipeline { stages: 1, schedule: Schedule::OneFOneB, micro_batches };
        simulate_pipeline(&plan, hw, &Options::default(), pipeline).unwrap_or_else(|e| panic!("{e}")).step_time_s
    };
    let g: u64 = plan.params.iter().filter_map(|p| p.grad).map(|g| plan.buffer(g).bytes()).sum();
    let g = g as f64;
    let expected = 4.0 * (g / 2e9 + g / 8e9) + g / 4e9;
    let (without, with) = (at(&plain, 4), at(&copying, 4));
    assert!(close_to(with - without, expected), "{with} - {without} against {expected}");
    assert!(close_to(at(&copying, 1), at(&plain, 1)), "one micro-batch sums nothing");
    // With two replicas each device also keeps its terms of the sums over the replicas aside every
    // micro-batch (copied out, added, the sum's buffer zeroed): two device threads on two cores.
    let replicated = gpt2(2, Mesh { data: 2, ..Mesh::new(1, 1) }, Strategy::None);
    let at = |hw: &Hardware| {
        let pipeline = Pipeline { stages: 1, schedule: Schedule::OneFOneB, micro_batches: 4 };
        simulate_pipeline(&replicated, hw, &Options::default(), pipeline).unwrap_or_else(|e| panic!("{e}")).step_time_s
    };
    let deferred = 4.0 * (g / 2e9 + g / 8e9 + g / 4e9);
    let (without, with) = (at(&plain), at(&copying));
    assert!(close_to(with - without, expected + deferred), "{with} - {without} against {}", expected + deferred);
}

/// On a profile of our CPU runtime each stage's memory is what its stage program plans under the
/// schedule (`run --pipeline` measures that figure), for every mesh and schedule; on an accelerator's
/// profile it is the in-place estimate, which names no program.
#[test]
fn on_our_cpu_runtimes_profile_each_stage_holds_what_its_program_plans() {
    let cpu = Hardware::parse(SHARED_CPU, "test").unwrap_or_else(|e| panic!("{e}"));
    let schedules = [Schedule::OneFOneB, Schedule::GPipe, Schedule::Interleaved { chunks: 2 }];
    for (mesh, strategy) in meshes() {
        let plan = gpt2(4, mesh, strategy);
        for schedule in schedules {
            let (stages, micro_batches) = (2u64, 4u64);
            let pipeline = Pipeline { stages, schedule, micro_batches };
            let what = format!("{mesh} {schedule:?}");
            let split =
                optimus::cost::staged::balanced_split(&plan, &cpu, &Options::default(), (stages, schedule.chunks()))
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
            let program = optimus::plan::pipeline_cut::cut(&plan, stages, schedule.chunks(), Some(&split))
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let planned = program.memory_plan(schedule, micro_batches).unwrap_or_else(|e| panic!("{what}: {e}"));
            let on_cpu =
                simulate_pipeline(&plan, &cpu, &Options::default(), pipeline).unwrap_or_else(|e| panic!("{what}: {e}"));
            let in_place = pipelined(&plan, stages, schedule, micro_batches);
            for (s, (st, program)) in on_cpu.per_stage.iter().zip(&planned).enumerate() {
                assert_eq!(st.program_memory, Some(*program), "{what} stage {s}");
                assert_eq!((st.peak_bytes, st.in_flight), (program.peak_bytes, program.in_flight), "{what} stage {s}");
                assert_eq!(in_place.per_stage[s].program_memory, None, "{what} stage {s}");
            }
            let most = planned.iter().map(|m| m.peak_bytes).max();
            assert_eq!(Some(on_cpu.peak_bytes_per_device), most, "{what}");
        }
    }
}
