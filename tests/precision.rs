//! bf16 mixed precision (`--precision bf16`): which buffers are bf16 and which stay float32, that
//! activation memory and communication bytes halve, that bf16 training tracks float32 training on
//! several meshes, that `verify --precision bf16` passes, and that the Cast kernel rounds correctly.

mod common;

use optimus::front::check_source;
use optimus::plan::init::mix64;
use optimus::plan::report::report;
use optimus::plan::tensor::Tensor;
use optimus::plan::types::DType;
use optimus::plan::{Coords, Instr, Kernel, MemoryOptions, Mesh, Mode, Plan, Precision, Role, Strategy};
use optimus::runtime::exec::{RunConfig, RunOutput};
use optimus::runtime::local::run;
use optimus::runtime::settings::KernelContext;
use optimus::runtime::view::TensorViews;
use optimus::runtime::view::{Shape, ViewMut, ViewMutData};
use optimus::shard::{Target, compile};
use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

fn plan(mesh: (u64, u64), strategy: Strategy, precision: Precision) -> Plan {
    let file = "examples/tiny.opt";
    let source = std::fs::read_to_string(file).expect("example exists");
    let model = check_source(&source, &[]).model.expect("example checks");
    let memory = MemoryOptions { precision, ..MemoryOptions::DEFAULT };
    let target = Target { memory, ..Target::plain(Mesh::new(mesh.0, mesh.1), strategy, Mode::Train) };
    match compile(&model, file, &source, target) {
        Ok(p) => p,
        Err(d) => panic!("compile failed: {}", optimus::diag::render_plain(file, &source, &d)),
    }
}

fn buffer_dtype(plan: &Plan, id: optimus::plan::BufferId) -> DType {
    plan.buffer(id).dtype
}

#[test]
fn bf16_plans_keep_master_weights_gradients_and_optimizer_state_in_f32() {
    let p = plan((2, 2), Strategy::Optimus, Precision::Bf16);
    assert_eq!(p.precision, Precision::Bf16);
    for param in &p.params {
        assert_eq!(buffer_dtype(&p, param.buffer), DType::F32, "{}", param.name);
        assert_eq!(buffer_dtype(&p, param.grad.expect("a gradient")), DType::F32, "{} gradient", param.name);
        for &s in &param.state {
            assert_eq!(buffer_dtype(&p, s), DType::F32, "{} state", param.name);
        }
    }
    let activations: Vec<_> = p.buffers.iter().filter(|b| b.role == Role::Activation).collect();
    assert!(activations.iter().filter(|b| b.dtype == DType::Bf16).count() > 10, "activations are bf16");
    // What stays float32 among the temporaries: statistics ([rows, 1] or [rows, 2]), the loss, and the
    // float32 sums of SUMMA's accumulating products.
    let temporaries = p.buffers.iter().filter(|b| matches!(b.role, Role::Activation | Role::Workspace));
    for b in temporaries.filter(|b| !b.name.ends_with(".summa_sum")) {
        if b.dtype == DType::F32 {
            assert!(b.shape.last().is_none_or(|&last| last <= 2), "`{}` {:?} is float32", b.name, b.shape);
        }
    }
}

#[test]
fn each_weight_is_cast_once_per_step_and_each_gradient_once() {
    let p = plan((2, 2), Strategy::Optimus, Precision::Bf16);
    let casts: Vec<(&Vec<_>, _)> = p
        .program
        .iter()
        .filter_map(|i| match i {
            Instr::Kernel { kernel: Kernel::Cast, inputs, output, .. } => Some((inputs, *output)),
            _ => None,
        })
        .collect();
    for param in &p.params {
        let from = casts.iter().filter(|(ins, _)| ins.first() == Some(&param.buffer)).count();
        assert_eq!(from, 1, "`{}` is cast to bf16 once", param.name);
        let into = casts.iter().filter(|(_, out)| Some(*out) == param.grad).count();
        assert_eq!(into, 1, "`{}`'s gradient is cast into float32 once", param.name);
    }
    // Besides, each float32 SUMMA sum is cast once into its bf16 output.
    let summa_sums = p.buffers.iter().filter(|b| b.name.ends_with(".summa_sum")).count();
    assert!(summa_sums > 0);
    assert_eq!(casts.len(), 2 * p.params.len() + summa_sums);
    // The float32 plan has no casts at all.
    let f32_plan = plan((2, 2), Strategy::Optimus, Precision::F32);
    assert!(!f32_plan.program.iter().any(|i| matches!(i, Instr::Kernel { kernel: Kernel::Cast, .. })));
}

#[test]
fn bf16_halves_activation_memory_and_product_communication() {
    for (mesh, strategy) in [((2, 2), Strategy::Optimus), ((1, 4), Strategy::Megatron)] {
        let (a, b) = (plan(mesh, strategy, Precision::F32), plan(mesh, strategy, Precision::Bf16));
        let (ra, rb) = (report(&a), report(&b));
        let (ma, mb) = (&ra.memory.plan, &rb.memory.plan);
        assert_eq!(
            (ma.parameters, ma.gradients, ma.optimizer_state),
            (mb.parameters, mb.gradients, mb.optimizer_state)
        );
        // Kept activations halve, up to the float32 statistics of LayerNorm and cross-entropy.
        let kept = mb.activations_kept_for_backward as f64 / ma.activations_kept_for_backward as f64;
        assert!((0.5..0.56).contains(&kept), "{mesh:?}: kept activations {kept:.3} of float32's");
        assert!(mb.peak_bytes < ma.peak_bytes, "{mesh:?}: peak {} vs {}", mb.peak_bytes, ma.peak_bytes);
        // Every collective moves the same elements; those of products and activations in half the bytes.
        assert_eq!(ra.communication.len(), rb.communication.len());
        let mut halved = 0;
        for (x, y) in ra.communication.iter().zip(&rb.communication) {
            assert_eq!((x.kind.as_str(), x.elements), (y.kind.as_str(), y.elements));
            if matches!(x.kind.as_str(), "broadcast" | "reduce" | "all_gather" | "reduce_scatter") {
                assert_eq!(y.bytes * 2, x.bytes, "{mesh:?}: {} at instruction {}", x.kind, x.instruction);
                halved += 1;
            } else {
                assert!(y.bytes == x.bytes || y.bytes * 2 == x.bytes, "{mesh:?}: {}", x.kind);
            }
        }
        let total = |r: &optimus::plan::report::Report| r.communication.iter().map(|c| c.bytes).sum::<u64>() as f64;
        let ratio = total(&rb) / total(&ra);
        assert!((0.5..0.56).contains(&ratio), "{mesh:?}: bf16 moves {ratio:.3} of float32's bytes");
        assert!(halved > 0 || strategy == Strategy::Megatron);
    }
}

fn train(plan: &Plan, steps: u64) -> RunOutput {
    let config = RunConfig { timeout: Duration::from_secs(60), ..RunConfig::new(3, steps, common::adamw()) };
    run(plan, &config, &common::pattern_batches(plan, 2), &BTreeMap::new(), &|_| {}).expect("run succeeds")
}

#[test]
fn bf16_training_tracks_float32_on_several_meshes() {
    let meshes = [
        ((1, 1), Strategy::None),
        ((2, 2), Strategy::Optimus),
        ((4, 4), Strategy::Optimus),
        ((1, 4), Strategy::Megatron),
    ];
    let reference = train(&plan((1, 1), Strategy::None, Precision::F32), 8);
    for (mesh, strategy) in meshes {
        let out = train(&plan(mesh, strategy, Precision::Bf16), 8);
        for (r, s) in reference.steps.iter().zip(&out.steps) {
            let (r, s) = (r.loss.expect("loss"), s.loss.expect("loss"));
            assert!(((r - s) / r).abs() < 1e-2, "{mesh:?} step loss {s} vs float32 {r}");
        }
        let (first, last) = (out.steps[0].loss.expect("loss"), out.steps[7].loss.expect("loss"));
        assert!(last < first, "{mesh:?}: bf16 training lowers the loss ({first} -> {last})");
        // Master weights come back as float32 values that are not all bf16-representable (the updates
        // are applied in float32).
        let w = out.params.get("h.0.mlp.c_fc.weight").expect("a weight");
        let values = w.f32().expect("float32 weights");
        assert!(values.iter().any(|&x| optimus::runtime::bf16::widen_one(optimus::runtime::bf16::round(x)) != x));
    }
}

fn optimusc(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs")
}

#[test]
fn verify_passes_in_bf16_against_the_float32_single_device_model() {
    for (mesh, strategy) in [("2x2", "optimus"), ("4x4", "optimus"), ("1x4", "megatron")] {
        let out = optimusc(&[
            "verify",
            "examples/tiny.opt",
            "--mesh",
            mesh,
            "--strategy",
            strategy,
            "--precision",
            "bf16",
            "--tolerance",
            "2e-2",
        ]);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{mesh} {strategy}: {stdout}{stderr}");
        assert!(stdout.contains("verified: the plan computes what one device computes"), "{stdout}");
    }
}

#[test]
fn verify_defaults_to_a_bf16_tolerance_for_a_bf16_plan_and_says_which() {
    let verify = |extra: &[&str]| {
        let mut args = vec!["verify", "examples/tiny.opt", "--mesh", "2x2", "--set", "layers=1"];
        args.extend_from_slice(extra);
        let out = optimusc(&args);
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    };
    let (passed, text) = verify(&["--precision", "bf16"]);
    assert!(passed && text.contains("tolerance 2e-2"), "{text}");
    // A tolerance given is the one used: bf16 rounding is well above float32's 1e-4.
    let (passed, text) = verify(&["--precision", "bf16", "--tolerance", "1e-4"]);
    assert!(!passed && text.contains("tolerance 1e-4") && text.contains("FAILED"), "{text}");
    let (passed, text) = verify(&[]);
    assert!(passed && text.contains("tolerance 1e-4"), "{text}");
}

/// Llama at hidden 64 with 2 x 4 tokens: bf16 rounding on so few tokens puts some gradients near or
/// past 2e-2 from float32 (the RMSNorm weight's at seed 0, 2.09e-2 on 2x2, where one device in bf16 is
/// 1.17e-2 away). By default verify also runs one device in bf16 and allows three times its
/// difference; a tolerance given is the bound alone, with no third run.
#[test]
fn verify_in_bf16_allows_a_tiny_batch_what_one_device_in_bf16_differs_by() {
    let verify = |seed: &str, extra: &[&str]| {
        let mut args = vec![
            "verify",
            "examples/llama.opt",
            "--mesh",
            "2x2",
            "--set",
            "vocab=256",
            "--set",
            "layers=2",
            "--set",
            "heads=4",
            "--set",
            "kv_heads=2",
            "--set",
            "hidden=64",
            "--set",
            "ffn=128",
            "--set",
            "batch=2",
            "--set",
            "seq=4",
            "--set",
            "context=16",
            "--precision",
            "bf16",
            "--recompute",
            "selective",
            "--seed",
            seed,
        ];
        args.extend_from_slice(extra);
        let out = optimusc(&args);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), stdout.into_owned(), stderr.into_owned())
    };
    for seed in ["0", "4"] {
        let (passed, stdout, stderr) = verify(seed, &[]);
        assert!(passed, "seed {seed}: {stdout}{stderr}");
        assert!(stderr.contains("within 3 times that run's own difference"), "{stderr}");
        let lines: Vec<&str> = stdout.lines().filter(|l| l.contains("(worst of")).collect();
        assert_eq!(lines.len(), 4, "{stdout}");
        assert!(lines.iter().all(|l| l.contains("one device in bf16: ")), "{stdout}");
    }
    let (_, stdout, stderr) = verify("0", &["--tolerance", "2e-2"]);
    assert!(!stdout.contains("one device in bf16") && !stderr.contains("one device in bf16"), "{stdout}{stderr}");
}

#[test]
fn compile_and_inspect_report_bf16() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("plan.json");
    let path = path.to_str().expect("a UTF-8 path");
    let out = optimusc(&["compile", "examples/tiny.opt", "--mesh", "2x2", "--precision", "bf16", "-o", path]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(path).expect("the plan");
    assert!(text.contains("\"precision\":\"bf16\""), "the plan records its precision");
    let out = optimusc(&["inspect", path]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("bf16 precision"));
    // A plan compiled in bf16 refuses a conflicting flag at run time, like the other compile flags.
    let out = optimusc(&["run", path, "--precision", "f32", "--steps", "1"]);
    assert!(!out.status.success());
}

#[test]
fn the_cast_kernel_rounds_to_nearest_even_and_keeps_nan_and_infinities() {
    use optimus::plan::Buffer;
    use optimus::plan::layout::Layout;
    use optimus::runtime::bf16::{widen_one, with_widened};
    let values =
        [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, -0.0];
    let shape = vec![values.len() as u64];
    let meta = |dtype| Buffer {
        id: optimus::plan::BufferId(0),
        name: "x".into(),
        dtype,
        logical_shape: shape.clone(),
        layout: Layout::REPLICATED,
        shape: shape.clone(),
        role: Role::Workspace,
    };
    let (input, output) = (meta(DType::F32), meta(DType::Bf16));
    let inputs = [&input];
    let ctx = KernelContext {
        coords: Coords::new(0, 0, 0),
        mesh: Mesh::new(1, 1),
        seed: 0,
        inputs: &inputs,
        output: &output,
    };
    let x = Tensor::from_f32(&shape, values.to_vec());
    let mut bits = vec![0u16; values.len()];
    let mut out = ViewMut { shape: Shape(&shape), data: ViewMutData::Bf16(&mut bits) };
    let cast = |ins: &[&optimus::runtime::view::View], out: &mut ViewMut| {
        optimus::runtime::cpu::kernels::run_views(&Kernel::Cast, ins, out, &ctx)
    };
    with_widened(&[&x.view()], &mut out, false, cast).expect("the cast runs");
    let got: Vec<f32> = bits.iter().map(|&b| widen_one(b)).collect();
    assert_eq!(got[0], 1.0, "a tie rounds to the even neighbour below");
    assert_eq!(got[1], 1.0 + 2f32.powi(-6), "a tie rounds to the even neighbour above");
    assert!(got[2].is_nan());
    assert_eq!(&got[3..6], &[f32::INFINITY, f32::NEG_INFINITY, f32::INFINITY]);
    assert_eq!(got[6].to_bits(), (-0.0f32).to_bits());
    // And back: bf16 widens to float32 exactly.
    let mut wide = Tensor::from_f32(&shape, vec![0.0; values.len()]);
    let back =
        optimus::runtime::view::View { shape: Shape(&shape), data: optimus::runtime::view::ViewData::Bf16(&bits) };
    with_widened(&[&back], &mut wide.view_mut(), false, cast).expect("the cast runs");
    assert_eq!(wide.f32().expect("f32")[1], 1.0 + 2f32.powi(-6));
}

/// One linear layer (y = x W, a SUMMA AB product on a q x q mesh) with a float32 input. It does not
/// narrow its input, so its weight stays in place: a narrowing one is laid across the mesh, and its
/// forward reduces each step's partial product (rounded to bf16, as the backward's reduced products
/// and Megatron's row-parallel linears are) instead of accumulating.
const SUMMA_MODEL: &str = "model summa
config {
  rows   = 64
  hidden = 512
  out    = 512
}
input x: f32[rows, hidden]
layer fc = linear(hidden, out, bias: false)
forward {
  output y = fc(x)
}
";

fn summa_plan(mesh: u64, precision: Precision) -> Plan {
    let model = check_source(SUMMA_MODEL, &[]).model.expect("the model checks");
    let memory = MemoryOptions { precision, ..MemoryOptions::DEFAULT };
    let strategy = if mesh == 1 { Strategy::None } else { Strategy::Optimus };
    let target = Target { memory, ..Target::plain(Mesh::new(mesh, mesh), strategy, Mode::Infer) };
    match compile(&model, "summa.opt", SUMMA_MODEL, target) {
        Ok(p) => p,
        Err(d) => panic!("compile failed: {}", optimus::diag::render_plain("summa.opt", SUMMA_MODEL, &d)),
    }
}

#[test]
fn summa_products_accumulate_in_float32_and_round_once() {
    use optimus::runtime::bf16::{round, widen_one};
    let p = summa_plan(4, Precision::Bf16);
    // The q = 4 steps accumulate into a float32 sum, cast once into the bf16 output.
    let sum = p.buffers.iter().find(|b| b.name.ends_with(".summa_sum")).expect("a float32 SUMMA sum");
    assert_eq!(sum.dtype, DType::F32);
    let into_sum = p
        .program
        .iter()
        .filter(|i| matches!(i, Instr::Kernel { kernel: Kernel::MatMul { .. }, output, .. } if *output == sum.id));
    assert_eq!(into_sum.count(), 4);
    let casts: Vec<_> = p
        .program
        .iter()
        .filter_map(|i| match i {
            Instr::Kernel { kernel: Kernel::Cast, inputs, output, .. } if inputs == &[sum.id] => Some(*output),
            _ => None,
        })
        .collect();
    assert_eq!(casts.len(), 1, "the sum is rounded into bf16 once");
    assert_eq!(p.buffer(casts[0]).dtype, DType::Bf16);
    // A float32 plan has no such sum: it accumulates into its output.
    assert!(!summa_plan(4, Precision::F32).buffers.iter().any(|b| b.name.ends_with(".summa_sum")));

    // The bf16 product against the exact product of the same operands (the float32 input x and W
    // rounded to bf16), rounded once: every element is that nearest bf16, up to the float32 order of the sum.
    let (rows, hidden, out) = (64usize, 512usize, 512usize);
    let x: Vec<f32> = (0..rows * hidden).map(|k| (mix64(k as u64) >> 40) as f32 / (1u64 << 24) as f32 - 0.3).collect();
    let inputs =
        |_: u64| Ok(BTreeMap::from([("x".to_string(), Tensor::from_f32(&[rows as u64, hidden as u64], x.clone()))]));
    let config = RunConfig { timeout: Duration::from_secs(60), ..RunConfig::new(5, 1, common::adamw()) };
    let run_out = run(&p, &config, &inputs, &BTreeMap::new(), &|_| {}).expect("the bf16 run");
    let y = run_out.outputs.get("y").expect("the output").f32().expect("float values").to_vec();
    let w = run_out.params.get("fc.weight").expect("the weight").f32().expect("float32 weights").to_vec();
    let r = |v: f32| f64::from(widen_one(round(v)));
    let mut exact = vec![0.0f64; rows * out];
    for i in 0..rows {
        for k in 0..hidden {
            let xi = f64::from(x[i * hidden + k]);
            for j in 0..out {
                exact[i * out + j] += xi * r(w[k * out + j]);
            }
        }
    }
    let scale = exact.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let max_error = y.iter().zip(&exact).map(|(&a, &b)| (f64::from(a) - b).abs()).fold(0.0, f64::max) / scale;
    let nearest = y.iter().zip(&exact).filter(|&(&a, &b)| a == widen_one(round(b as f32))).count();
    let share = nearest as f64 / y.len() as f64;
    eprintln!("bf16 SUMMA 4x4: max error {max_error:.3e} of the largest |y|, {share:.4} of elements the nearest bf16");
    assert!(share > 0.99, "only {share:.4} of the elements are the nearest bf16 to the exact product");
    assert!(max_error < 2f64.powi(-8), "max error {max_error:.3e}");
}

/// Records which element type each exchange was handed, and how many bytes.
#[derive(Default)]
struct Recorder {
    bf16_bytes: usize,
    f32_bytes: usize,
}

impl optimus::runtime::backend::Exchanges for Recorder {
    fn f32(&mut self, send: &[f32], recv: &mut [f32]) -> Result<(), optimus::runtime::comm::CommError> {
        self.f32_bytes += 4 * send.len();
        recv.fill(0.0);
        Ok(())
    }

    fn bf16(&mut self, send: &[u16], recv: &mut [u16]) -> Result<(), optimus::runtime::comm::CommError> {
        self.bf16_bytes += 2 * send.len();
        recv.fill(0);
        Ok(())
    }
}

#[test]
fn the_cpu_arena_hands_bf16_collectives_their_bf16_buffers_as_they_are() {
    use optimus::runtime::arena::{HostArena, layout};
    for (mesh, strategy) in [((2, 2), Strategy::Optimus), ((1, 4), Strategy::Megatron)] {
        let p = plan(mesh, strategy, Precision::Bf16);
        let mut arena = HostArena::new(&p, &layout(&p)).expect("the arena");
        let (mut bf16_elements, mut f32_elements) = (0, 0);
        let mut recorder = Recorder::default();
        for instr in &p.program {
            let Instr::Collective { collective: c, .. } = instr else { continue };
            let elements = p.buffer(c.send).shape.iter().product::<u64>() as usize;
            match (p.buffer(c.send).dtype, p.buffer(c.recv).dtype) {
                (DType::Bf16, DType::Bf16) => bf16_elements += elements,
                (DType::F32, DType::F32) => f32_elements += elements,
                other => panic!("a collective between {other:?}"),
            }
            let elementwise = matches!(c.kind, optimus::plan::CollectiveKind::AllReduce);
            arena.exchange(c.send, c.recv, elementwise, &mut recorder).expect("the exchange");
        }
        // Every bf16 collective's payload is 2 bytes an element; only float32 buffers travel as f32.
        assert!(bf16_elements > 0, "{mesh:?}: the plan has bf16 collectives");
        assert_eq!(recorder.bf16_bytes, 2 * bf16_elements, "{mesh:?}");
        assert_eq!(recorder.f32_bytes, 4 * f32_elements, "{mesh:?}");
    }
}
