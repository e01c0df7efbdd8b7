//! Pipelines that run (`optimusc run --pipeline P`): every schedule, on stages of 1x1, optimus 2x2 and
//! megatron 1x2 grids with and without data-parallel replicas, computes what the unpipelined plan
//! computes with as many accumulated micro-batches (the same losses, final weights and gradients), and
//! each stage keeps the activations its schedule says it does.

use optimus::front::check_source;
use optimus::plan::init::mix64;
use optimus::plan::pipeline::Schedule;
use optimus::plan::pipeline_cut::{PipelineProgram, cut};
use optimus::plan::tensor::Tensor;
use optimus::plan::{MemoryOptions, Mesh, Mode, Plan, Strategy};
use optimus::runtime::exec::{RunConfig, RunOutput};
use optimus::runtime::pipeline::{PipelineOutput, PipelineRun, run_on_threads};
use optimus::runtime::settings::{OptimizerKind, OptimizerSettings};
use optimus::shard::{Target, compile};
use std::collections::BTreeMap;
use std::time::Duration;

/// tiny.opt with `layers` repeated layers, compiled for `mesh`.
fn plan(layers: u64, mesh: Mesh, strategy: Strategy) -> Plan {
    let file = "examples/tiny.opt";
    let source = std::fs::read_to_string(file).expect("example exists");
    let overrides = [format!("layers={layers}").parse().expect("an override")];
    let model = check_source(&source, &overrides).model.expect("example checks");
    let target = Target { mesh, strategy, mode: Mode::Train, memory: MemoryOptions::DEFAULT };
    match compile(&model, file, &source, target) {
        Ok(p) => p,
        Err(d) => panic!("compile failed: {}", optimus::diag::render_plain(file, &source, &d)),
    }
}

fn tokens(plan: &Plan) -> impl Fn(u64) -> Result<BTreeMap<String, Tensor>, String> + Sync + use<> {
    let int = |name: &str| match plan.config.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone()) {
        Some(optimus::plan::types::Scalar::Int(v)) => v as u64,
        other => panic!("config {name} is {other:?}"),
    };
    let (vocab, batch, seq) = (int("vocab"), int("batch"), int("seq"));
    move |index| {
        let mut out = BTreeMap::new();
        for (k, name) in ["targets", "tokens"].iter().enumerate() {
            let ids = (0..batch * seq)
                .map(|n| ((n % 7) * 13 + mix64((index * 8 + k as u64) ^ n) % 5) as i32 % vocab as i32)
                .collect();
            out.insert(name.to_string(), Tensor::from_i32(&[batch, seq], ids));
        }
        Ok(out)
    }
}

fn config(steps: u64, micro_batches: u64, clip: Option<f32>) -> RunConfig {
    let optimizer = OptimizerSettings {
        kind: OptimizerKind::AdamW,
        lr: 3e-3,
        weight_decay: 0.01,
        momentum: 0.9,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    RunConfig {
        timeout: Duration::from_secs(60),
        accumulation: micro_batches,
        clip_grad_norm: clip,
        ..RunConfig::new(7, steps, optimizer)
    }
}

fn unpipelined(plan: &Plan, config: &RunConfig) -> RunOutput {
    optimus::runtime::local::run(plan, config, &tokens(plan), &BTreeMap::new(), &|_| {}).expect("the unpipelined run")
}

fn pipelined(plan: &Plan, program: &PipelineProgram, schedule: Schedule, config: &RunConfig) -> PipelineOutput {
    let pipe = PipelineRun { program, schedule };
    run_on_threads(plan, pipe, config, &tokens(plan), &BTreeMap::new(), &|_| {}).expect("the pipelined run")
}

fn largest_difference(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut worst = 0f32;
    for (name, x) in a {
        let (x, y) = (x.f32().expect("f32"), b[name].f32().expect("f32"));
        assert_eq!(x.len(), y.len(), "{name}");
        for (u, v) in x.iter().zip(y) {
            worst = worst.max((u - v).abs() / (1.0 + u.abs()));
        }
    }
    worst
}

/// The pipelined run equals the unpipelined one: losses per step, final weights and last gradients.
fn assert_same_run(what: &str, want: &RunOutput, got: &RunOutput, tolerance: f32) {
    assert_eq!(want.steps.len(), got.steps.len(), "{what}");
    for (a, b) in want.steps.iter().zip(&got.steps) {
        let (x, y) = (a.loss.expect("a loss"), b.loss.expect("a loss"));
        assert!((x - y).abs() <= tolerance * (1.0 + x.abs()), "{what}: step {} loss {x} vs {y}", a.step);
        let (n, m) = (a.grad_norm.expect("a norm"), b.grad_norm.expect("a norm"));
        assert!((n - m).abs() <= 1e-5 * (1.0 + n), "{what}: step {} gradient norm {n} vs {m}", a.step);
    }
    let params = largest_difference(&want.params, &got.params);
    assert!(params <= tolerance, "{what}: weights differ by {params}");
    let grads = largest_difference(&want.grads, &got.grads);
    assert!(grads <= tolerance, "{what}: gradients differ by {grads}");
}

#[test]
fn every_schedule_on_one_device_stages_equals_accumulation() {
    let plan = plan(4, Mesh::new(1, 1), Strategy::None);
    for (stages, schedule, m) in [
        (2, Schedule::GPipe, 3),
        (2, Schedule::OneFOneB, 4),
        (4, Schedule::OneFOneB, 4),
        (4, Schedule::GPipe, 2),
        (2, Schedule::Interleaved { chunks: 2 }, 4),
    ] {
        let config = config(3, m, None);
        let want = unpipelined(&plan, &config);
        let program = cut(&plan, stages, schedule.chunks(), None).expect("a cut");
        let got = pipelined(&plan, &program, schedule, &config);
        assert_same_run(&format!("{stages} stages {schedule:?} m={m}"), &want, &got.run, 2e-6);
    }
}

#[test]
fn stages_of_meshes_with_replicas_equal_accumulation() {
    for (mesh, strategy, stages, schedule) in [
        (Mesh::new(2, 2), Strategy::Optimus, 2, Schedule::OneFOneB),
        (Mesh::new(1, 2), Strategy::Megatron, 2, Schedule::GPipe),
        (Mesh::new(1, 2).with_data(2), Strategy::Megatron, 2, Schedule::OneFOneB),
        (Mesh::new(2, 2).with_data(2), Strategy::Optimus, 2, Schedule::Interleaved { chunks: 2 }),
        (Mesh::new(1, 1).with_data(2), Strategy::None, 4, Schedule::OneFOneB),
    ] {
        let plan = plan(4, mesh, strategy);
        let config = config(2, 4, Some(0.5));
        let want = unpipelined(&plan, &config);
        let program = cut(&plan, stages, schedule.chunks(), None).expect("a cut");
        let got = pipelined(&plan, &program, schedule, &config);
        assert_same_run(&format!("{strategy:?} {mesh:?} {stages} stages {schedule:?}"), &want, &got.run, 5e-6);
    }
}
