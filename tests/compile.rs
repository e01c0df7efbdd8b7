//! The sharding compiler against the design (shared/design/2d-parallelism.md §3, §5, §6): SUMMA and
//! Megatron communication volumes, memory per device, golden plans, divisibility errors, determinism,
//! an acceptance sweep over every example, and the `compile` / `inspect` command line.

use optimus::diag::Diagnostic;
use optimus::elab::Override;
use optimus::front::check_source;
use optimus::ir::{Model, Scalar};
use optimus::plan::report::{CommEntry, Report, render_text, report};
use optimus::plan::{Instr, Layouts, Mesh, Mode, Plan, Strategy};
use optimus::shard::{Target, compile};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

// ---- helpers ----------------------------------------------------------------------------------------

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}

/// The text of `examples/<name>.opt`.
fn example(name: &str) -> String {
    let path = examples_dir().join(format!("{name}.opt"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn overrides(sets: &[(&str, &str)]) -> Vec<Override> {
    sets.iter().map(|(k, v)| Override { name: (*k).to_string(), value: (*v).to_string() }).collect()
}

/// Checks a model source that must be valid.
fn checked(text: &str, sets: &[(&str, &str)]) -> Model {
    let c = check_source(text, &overrides(sets));
    let errors: Vec<&Diagnostic> = c.diagnostics.iter().filter(|d| d.is_error()).collect();
    assert!(errors.is_empty(), "the model should check with {sets:?}: {errors:?}");
    c.model.expect("a model without errors")
}

fn target(strategy: Strategy, rows: u64, cols: u64, mode: Mode) -> Target {
    Target::plain(Mesh::new(rows, cols), strategy, mode)
}

/// Checks and compiles `examples/<name>.opt`, returning the compiler's answer.
fn try_compile(name: &str, sets: &[(&str, &str)], t: Target) -> Result<Plan, Vec<Diagnostic>> {
    let text = example(name);
    let model = checked(&text, sets);
    compile(&model, &format!("examples/{name}.opt"), &text, t)
}

/// Checks and compiles `examples/<name>.opt`, which must succeed.
fn plan(name: &str, sets: &[(&str, &str)], t: Target) -> Plan {
    try_compile(name, sets, t).unwrap_or_else(|d| {
        let codes: Vec<_> = d.iter().map(|d| format!("{}: {}", d.code, d.message)).collect();
        panic!("{name} {sets:?} should compile for {} {} {:?}: {codes:#?}", t.strategy.name(), t.mesh, t.mode)
    })
}

/// An integer config value of a plan (after overrides).
fn config(plan: &Plan, name: &str) -> u64 {
    match plan.config.iter().find(|(n, _)| n == name) {
        Some((_, Scalar::Int(v))) => u64::try_from(*v).expect("a positive config value"),
        other => panic!("config `{name}` is not an integer: {other:?}"),
    }
}

/// An integer config value of a checked model, if it has one.
fn model_config(model: &Model, name: &str) -> Option<u64> {
    model.config.iter().find(|c| c.name == name).and_then(|c| match c.value {
        Scalar::Int(v) => u64::try_from(v).ok(),
        _ => None,
    })
}

/// The transformer dimensions of a GPT-style plan.
#[derive(Clone, Copy, Debug)]
struct Dims {
    batch: u64,
    seq: u64,
    hidden: u64,
    ffn: u64,
    layers: u64,
}

impl Dims {
    fn of(plan: &Plan) -> Dims {
        Dims {
            batch: config(plan, "batch"),
            seq: config(plan, "seq"),
            hidden: config(plan, "hidden"),
            ffn: config(plan, "ffn"),
            layers: config(plan, "layers"),
        }
    }

    /// M = b * s: the rows of every linear's input.
    fn rows(self) -> u64 {
        self.batch * self.seq
    }

    /// The four linears of layer `l` as (scope, K, N) for C[M, N] = A[M, K] B[K, N].
    fn linears(self, l: u64) -> [(String, u64, u64); 4] {
        let (h, f) = (self.hidden, self.ffn);
        [
            (format!("h.{l}.attn.c_attn"), h, 3 * h),
            (format!("h.{l}.attn.c_proj"), h, h),
            (format!("h.{l}.mlp.c_fc"), h, f),
            (format!("h.{l}.mlp.c_proj"), f, h),
        ]
    }
}

/// Whether a communication entry belongs to the backward pass (by the reason the compiler gives).
fn is_backward(c: &CommEntry) -> bool {
    c.origin.reason.contains("backward")
}

/// The SUMMA broadcasts and reduces of the linear at `scope`: the entries of that scope whose kind is
/// broadcast or reduce and whose reason names a SUMMA product. Bias-gradient all-reduces and the
/// LayerNorm statistics are not SUMMA collectives and are left out.
fn summa<'r>(r: &'r Report, scope: &str) -> Vec<&'r CommEntry> {
    r.communication
        .iter()
        .filter(|c| c.origin.scope == scope)
        .filter(|c| c.kind == "broadcast" || c.kind == "reduce")
        .filter(|c| c.origin.reason.contains("SUMMA"))
        .collect()
}

fn elements(entries: &[&CommEntry]) -> u64 {
    entries.iter().map(|c| c.elements).sum()
}

/// The root of the collective behind a report entry.
fn root(plan: &Plan, c: &CommEntry) -> Option<u64> {
    match &plan.program[c.instruction] {
        Instr::Collective { collective, .. } => collective.root,
        other => panic!("report entry {} is not a collective: {other:?}", c.instruction),
    }
}

/// `--set` overrides.
type Sets = &'static [(&'static str, &'static str)];

/// Optimus configurations on which every split divides: (example, overrides, q).
const OPTIMUS_CASES: &[(&str, Sets, u64)] = &[
    ("tiny", &[], 2),
    ("tiny", &[("batch", "6"), ("heads", "6"), ("hidden", "48")], 3),
    ("tiny", &[], 4),
    (
        "gpt2",
        &[("layers", "2"), ("batch", "4"), ("seq", "64"), ("context", "64"), ("hidden", "128"), ("heads", "4")],
        2,
    ),
    ("gpt2", &[("layers", "1"), ("batch", "3"), ("seq", "32"), ("context", "32"), ("hidden", "96"), ("heads", "6")], 3),
    (
        "gpt2",
        &[("layers", "2"), ("batch", "8"), ("seq", "128"), ("context", "128"), ("hidden", "256"), ("heads", "8")],
        4,
    ),
    ("gpt2_manual_attention", &[("layers", "1"), ("seq", "32"), ("hidden", "64")], 2),
];

// ---- a. SUMMA communication equals the design's formulas ----------------------------------------

/// The elements one SUMMA linear C[M,N] = A[M,K] B[K,N] moves a device in one pass, on q x q: §3's
/// (MK + KN)/q, the A and B blocks, where the weight has at most as many input features as output
/// ones. A weight with more (fc2, K = 4h > N = h) is stored across the mesh: its products keep the
/// wider activation (A forward, dX backward) in place and move the narrower one, (MN + KN)/q.
fn summa_pass(m: u64, k: u64, n: u64, q: u64) -> u64 {
    (m * k.min(n) + k * n) / q
}

/// Whether each (kind, group) of a product's collectives runs once per SUMMA step, roots 0..q-1.
fn roots_cover_the_steps(plan: &Plan, product: &[&CommEntry], q: u64, case: &str) {
    let mut kinds: Vec<(&str, &str)> = product.iter().map(|c| (c.kind.as_str(), c.group.as_str())).collect();
    kinds.sort_unstable();
    kinds.dedup();
    assert!(!kinds.is_empty(), "{case}: no collectives");
    for (kind, group) in kinds {
        let roots: Vec<_> =
            product.iter().filter(|c| c.kind == kind && c.group == group).map(|c| root(plan, c)).collect();
        let expected: Vec<_> = (0..q).map(Some).collect();
        assert_eq!(roots, expected, "{case}: {kind} ({group}) roots");
    }
}

/// §3: one SUMMA linear moves [`summa_pass`] elements per device forward (q row broadcasts of A
/// blocks and q column broadcasts of B blocks; for a weight across the mesh, q column broadcasts of
/// its blocks and q row reduces of the output's) and twice that backward (dX = dY W^T by ABT, dW =
/// X^T dY by ATB). The forward figures are checked in an infer plan and again in the forward half of
/// a train plan; the roots of each collective kind run over 0..q-1.
#[test]
fn summa_linear_payload_matches_the_formula() {
    for &(name, sets, q) in OPTIMUS_CASES {
        let infer = plan(name, sets, target(Strategy::Optimus, q, q, Mode::Infer));
        let train = plan(name, sets, target(Strategy::Optimus, q, q, Mode::Train));
        let (ri, rt) = (report(&infer), report(&train));
        let d = Dims::of(&infer);
        let m = d.rows();
        for l in 0..d.layers {
            for (scope, k, n) in d.linears(l) {
                let case = format!("{name} {sets:?} q={q} {scope} (M={m} K={k} N={n})");
                let forward = summa_pass(m, k, n, q);
                let (kinds, product) = if k > n {
                    (["broadcast", "reduce"], "SUMMA AB (reduced)")
                } else {
                    (["broadcast"; 2], "SUMMA AB step")
                };

                let fwd = summa(&ri, &scope);
                assert_eq!(fwd.len() as u64, 2 * q, "{case}: 2q collectives in the forward");
                assert!(fwd.iter().all(|c| kinds.contains(&c.kind.as_str()) && !is_backward(c)), "{case}: {fwd:#?}");
                assert!(fwd.iter().all(|c| c.origin.reason.contains(product)), "{case}: {fwd:#?}");
                assert_eq!(elements(&fwd), forward, "{case}: forward payload");
                roots_cover_the_steps(&infer, &fwd, q, &case);

                let all = summa(&rt, &scope);
                let (bwd, fwd_t): (Vec<&CommEntry>, Vec<&CommEntry>) = all.iter().partition(|c| is_backward(c));
                assert_eq!(elements(&fwd_t), forward, "{case}: forward payload in the train plan");
                assert!(fwd_t.iter().all(|c| c.instruction < train.memory.forward_end), "{case}: forward order");
                assert!(bwd.iter().all(|c| c.instruction >= train.memory.forward_end), "{case}: backward order");
                assert_eq!(elements(&bwd), 2 * forward, "{case}: backward payload, twice the forward's");
                let abt: Vec<_> = bwd.iter().filter(|c| c.origin.reason.contains("SUMMA ABT")).copied().collect();
                let atb: Vec<_> = bwd.iter().filter(|c| c.origin.reason.contains("SUMMA ATB")).copied().collect();
                assert_eq!(abt.len() + atb.len(), bwd.len(), "{case}: backward is ABT (dX) and ATB (dW) only");
                for (what, product) in [("ABT", &abt), ("ATB", &atb)] {
                    assert_eq!(product.len() as u64, 2 * q, "{case}: {what} has 2q collectives");
                    roots_cover_the_steps(&train, product, q, &format!("{case} {what}"));
                    assert_eq!(elements(product), forward, "{case}: {what} payload");
                }
            }
        }
    }
}

/// §3, per transformer layer (QKV, out-projection, fc1, fc2; ffn = 4h), with fc2's weight across the
/// mesh: forward (4bsh + 12h^2)/q and forward + backward (12bsh + 36h^2)/q, where §3's scheme moves
/// (7bsh + 12h^2)/q and (21bsh + 36h^2)/q (fc2 moving its 4h-wide input). Only the SUMMA collectives
/// of those four linears count.
#[test]
fn summa_layer_payload_matches_the_formula() {
    for &(name, sets, q) in OPTIMUS_CASES {
        let infer = plan(name, sets, target(Strategy::Optimus, q, q, Mode::Infer));
        let train = plan(name, sets, target(Strategy::Optimus, q, q, Mode::Train));
        let (ri, rt) = (report(&infer), report(&train));
        let d = Dims::of(&infer);
        assert_eq!(d.ffn, 4 * d.hidden, "{name}: the per-layer formula assumes ffn = 4h");
        let (bsh, h2) = (d.rows() * d.hidden, d.hidden * d.hidden);
        for l in 0..d.layers {
            let layer =
                |r: &Report| -> u64 { d.linears(l).iter().map(|(scope, _, _)| elements(&summa(r, scope))).sum() };
            let case = format!("{name} {sets:?} q={q} layer {l}");
            assert_eq!(layer(&ri), (4 * bsh + 12 * h2) / q, "{case}: forward (4bsh + 12h^2)/q");
            assert_eq!(layer(&rt), (12 * bsh + 36 * h2) / q, "{case}: forward + backward (12bsh + 36h^2)/q");
        }
    }
}

/// Linears that read one input with their weights in place take one SUMMA product together: each
/// step broadcasts the input's block once for all of them, and so do their weight gradients (dW = X^T
/// dY broadcasts X). BERT's query, key and value (h -> h) move 3 h^2/q of weights and M h/q of input a
/// forward pass, where three products would move 3(Mh + h^2)/q; their dX each weight's blocks and the
/// summed partial once (the three are only added, with the residual's gradient), (Mh + 3h^2)/q, and
/// their dW the input once beside their partial gradients, (Mh + 3h^2)/q. The forward's shared
/// broadcasts are the query's (`inspect` traces each weight's own to its linear).
#[test]
fn linears_of_one_input_broadcast_it_once() {
    let sets = [("layers", "1"), ("hidden", "64"), ("heads", "4"), ("seq", "16"), ("batch", "4"), ("vocab", "100")];
    for q in [2, 4] {
        let (m, h) = (4 * 16, 64);
        let scope = |name: &str| format!("bert.encoder.layer.0.attention.self.{name}");
        for mode in [Mode::Infer, Mode::Train] {
            let r = report(&plan("bert", &sets, target(Strategy::Optimus, q, q, mode)));
            let case = format!("bert on {q}x{q}, {mode:?}");
            let forward: Vec<u64> = ["query", "key", "value"]
                .iter()
                .map(|n| elements(&summa(&r, &scope(n)).into_iter().filter(|c| !is_backward(c)).collect::<Vec<_>>()))
                .collect();
            assert_eq!(
                forward,
                [(m * h + h * h) / q, h * h / q, h * h / q],
                "{case}: the query's broadcasts the input"
            );
            let all: u64 = ["query", "key", "value"].iter().map(|n| elements(&summa(&r, &scope(n)))).sum();
            let backward = if mode == Mode::Train { 2 * (m * h + 3 * h * h) / q } else { 0 };
            assert_eq!(all, (m * h + 3 * h * h) / q + backward, "{case}: forward and backward");
        }
    }
}

/// `--layouts paper`: every weight and table in place, each SUMMA linear moving its input's and its
/// weight's blocks, (MK + KN)/q a pass in 2q broadcasts forward, twice that backward; per layer §3's
/// (7bsh + 12h^2)/q forward and (21bsh + 36h^2)/q a step. Nothing is transposed across the diagonal,
/// and the plan records the choice (a plan of the default layouts has no such field, as before).
#[test]
fn the_papers_layouts_move_what_section_3_gives() {
    for &(name, sets, q) in OPTIMUS_CASES {
        let paper = |mode| Target { layouts: Layouts::Paper, ..target(Strategy::Optimus, q, q, mode) };
        let (infer, train) = (plan(name, sets, paper(Mode::Infer)), plan(name, sets, paper(Mode::Train)));
        let (ri, rt) = (report(&infer), report(&train));
        let d = Dims::of(&infer);
        let (bsh, h2) = (d.rows() * d.hidden, d.hidden * d.hidden);
        let m = d.rows();
        for l in 0..d.layers {
            for (scope, k, n) in d.linears(l) {
                let case = format!("{name} {sets:?} q={q} {scope} (M={m} K={k} N={n})");
                let fwd = summa(&ri, &scope);
                assert_eq!(fwd.len() as u64, 2 * q, "{case}: 2q collectives in the forward");
                assert!(fwd.iter().all(|c| c.kind == "broadcast"), "{case}: broadcasts only: {fwd:#?}");
                assert_eq!(elements(&fwd), (m * k + k * n) / q, "{case}: forward (MK + KN)/q");
                assert_eq!(elements(&summa(&rt, &scope)), 3 * (m * k + k * n) / q, "{case}: a step 3(MK + KN)/q");
            }
            let layer =
                |r: &Report| -> u64 { d.linears(l).iter().map(|(scope, _, _)| elements(&summa(r, scope))).sum() };
            let case = format!("{name} {sets:?} q={q} layer {l}");
            assert_eq!(layer(&ri), (7 * bsh + 12 * h2) / q, "{case}: forward (7bsh + 12h^2)/q");
            assert_eq!(layer(&rt), (21 * bsh + 36 * h2) / q, "{case}: forward + backward (21bsh + 36h^2)/q");
        }
        for (r, mode) in [(&ri, "infer"), (&rt, "train")] {
            assert!(r.communication.iter().all(|c| c.kind != "transpose"), "{name} {sets:?} q={q} {mode}: a transpose");
        }
        let json = serde_json::to_value(&train).expect("a plan serializes");
        assert_eq!(json["layouts"], "paper", "{name}: the plan records its layouts");
        let auto = plan(name, sets, target(Strategy::Optimus, q, q, Mode::Train));
        let json = serde_json::to_value(&auto).expect("a plan serializes");
        assert!(json.get("layouts").is_none(), "{name}: the default layouts are left out of the plan file");
    }
}

// ---- b. Megatron: two all-reduces of [b, s, h] per layer each way -------------------------------

/// §5: per transformer layer, 2 all-reduces of b*s*h elements in the forward (the partial outputs of
/// the row-parallel out-projection and fc2) and 2 more in the backward (the partial dX of the
/// column-parallel QKV and fc1). Counted: all-reduce entries whose origin scope is `h.L` or inside it
/// (`h.L.…`) and whose payload is exactly b*s*h elements; forward and backward are told apart by the
/// plan's `forward_end`. The backward ones are attributed to the LayerNorm that consumes dX.
#[test]
fn megatron_all_reduces_per_layer() {
    let cases: &[(&str, Sets, u64)] = &[
        ("tiny", &[], 2),
        ("tiny", &[], 4),
        ("gpt2", &[("layers", "2"), ("seq", "64"), ("hidden", "96"), ("heads", "6")], 3),
        ("gpt2", &[("layers", "3"), ("seq", "64"), ("hidden", "128"), ("heads", "8")], 8),
    ];
    for &(name, sets, p) in cases {
        let infer = plan(name, sets, target(Strategy::Megatron, 1, p, Mode::Infer));
        let train = plan(name, sets, target(Strategy::Megatron, 1, p, Mode::Train));
        let (ri, rt) = (report(&infer), report(&train));
        let d = Dims::of(&infer);
        let bsh = d.rows() * d.hidden;
        for l in 0..d.layers {
            let prefix = format!("h.{l}.");
            let in_layer = |c: &&CommEntry| {
                c.kind == "all_reduce"
                    && c.elements == bsh
                    && (c.origin.scope == format!("h.{l}") || c.origin.scope.starts_with(&prefix))
            };
            let case = format!("megatron 1x{p} {name} {sets:?} layer {l}");

            let fwd: Vec<&CommEntry> = ri.communication.iter().filter(in_layer).collect();
            assert_eq!(fwd.len(), 2, "{case}: forward all-reduces of b*s*h: {fwd:#?}");
            let scopes: BTreeSet<&str> = fwd.iter().map(|c| c.origin.scope.as_str()).collect();
            let expected: BTreeSet<String> = [format!("h.{l}.attn.c_proj"), format!("h.{l}.mlp.c_proj")].into();
            assert_eq!(scopes, expected.iter().map(String::as_str).collect(), "{case}: row-parallel linears");
            assert!(fwd.iter().all(|c| c.group == "row"), "{case}: over the 1 x p row");

            let all: Vec<&CommEntry> = rt.communication.iter().filter(in_layer).collect();
            let (f, b): (Vec<&CommEntry>, Vec<&CommEntry>) =
                all.iter().partition(|c| c.instruction < train.memory.forward_end);
            assert_eq!(f.len(), 2, "{case}: forward all-reduces in the train plan: {f:#?}");
            assert_eq!(b.len(), 2, "{case}: backward all-reduces of b*s*h: {b:#?}");
            assert!(b.iter().all(|c| c.origin.reason.contains("linear_grad_input")), "{case}: dX sums: {b:#?}");
            let f_bytes: u64 = f.iter().map(|c| c.bytes).sum();
            assert_eq!(f_bytes, 2 * bsh * 4, "{case}: f32 payload");
        }
        // Nothing else of that size travels inside a layer: the 2 forward + 2 backward are all.
        let inside = rt.communication.iter().filter(|c| c.origin.scope.starts_with("h.")).filter(|c| c.elements >= bsh);
        assert_eq!(inside.count() as u64, 4 * d.layers, "megatron 1x{p} {name}: 4 big all-reduces per layer");
    }
}

// ---- c. memory: 2D beats 1D at equal device counts ------------------------------------------------

/// §6: at equal device counts, a q x q optimus plan needs less memory per device than a 1 x q^2
/// megatron plan, in peak bytes and in activations kept for backward, on GPT-2-shaped configs
/// (hidden 768, sequence 1024, two layers; 16 heads where 16 devices must divide them). The 2D
/// activations are the single-device ones divided by p (within 1% for the few tiny statistics).
#[test]
fn optimus_uses_less_memory_than_megatron() {
    let cases: &[(Sets, u64)] = &[(&[("layers", "2")], 2), (&[("layers", "2"), ("heads", "16")], 4)];
    for &(sets, q) in cases {
        let p = q * q;
        let two_d_plan = plan("gpt2", sets, target(Strategy::Optimus, q, q, Mode::Train));
        let one_d_plan = plan("gpt2", sets, target(Strategy::Megatron, 1, p, Mode::Train));
        let (two_d, one_d) = (&two_d_plan.memory, &one_d_plan.memory);
        let single = plan("gpt2", sets, target(Strategy::None, 1, 1, Mode::Train)).memory;
        let case = format!("gpt2 {sets:?}, {p} devices");
        assert!(
            two_d.peak_bytes < one_d.peak_bytes,
            "{case}: optimus peak {} >= megatron peak {}",
            two_d.peak_bytes,
            one_d.peak_bytes
        );
        assert!(
            two_d.activations_kept_for_backward < one_d.activations_kept_for_backward,
            "{case}: optimus activations {} >= megatron {}",
            two_d.activations_kept_for_backward,
            one_d.activations_kept_for_backward
        );
        let scaled = two_d.activations_kept_for_backward * p;
        let whole = single.activations_kept_for_backward;
        assert!(scaled.abs_diff(whole) * 100 < whole, "{case}: 2D activations x p = {scaled}, one device {whole}");
        // 1D keeps the [b, s, h] tensors whole, so it cannot divide activations by p.
        assert!(one_d.activations_kept_for_backward * p > whole * 11 / 10, "{case}: megatron divides less than p");
        // Weights: 12h^2/p per layer for both methods (the four linear weight matrices of each layer).
        let h = config(&two_d_plan, "hidden");
        for (what, pl) in [("optimus", &two_d_plan), ("megatron", &one_d_plan)] {
            for l in 0..config(pl, "layers") {
                let prefix = format!("h.{l}.");
                let weights: u64 = pl
                    .params
                    .iter()
                    .filter(|w| w.name.starts_with(&prefix) && w.name.ends_with(".weight") && w.shape.len() == 2)
                    .map(|w| pl.buffer(w.buffer).elements())
                    .sum();
                assert_eq!(weights, 12 * h * h / p, "{case}: {what} layer {l} weights per device");
            }
        }
    }
}

// ---- d. golden plans ------------------------------------------------------------------------------

fn tiny_plan(strategy: Strategy, rows: u64, cols: u64, mode: Mode) -> Plan {
    plan("tiny", &[], target(strategy, rows, cols, mode))
}

#[test]
fn golden_inspect_tiny_optimus_2x2_train() {
    let p = tiny_plan(Strategy::Optimus, 2, 2, Mode::Train);
    insta::assert_snapshot!(render_text(&p, &report(&p)));
}

#[test]
fn golden_inspect_tiny_megatron_1x2_train() {
    let p = tiny_plan(Strategy::Megatron, 1, 2, Mode::Train);
    insta::assert_snapshot!(render_text(&p, &report(&p)));
}

#[test]
fn golden_inspect_tiny_none_1x1_infer() {
    let p = tiny_plan(Strategy::None, 1, 1, Mode::Infer);
    insta::assert_snapshot!(render_text(&p, &report(&p)));
}

/// A kernel as `name(field=value, ...)`, its fields as in the plan's JSON.
fn kernel_text(kernel: &optimus::plan::Kernel) -> String {
    let value = serde_json::to_value(kernel).expect("kernels serialise");
    let object = value.as_object().expect("a kernel is a JSON object");
    let name = object.get("kind").and_then(|k| k.as_str()).unwrap_or("?").to_string();
    let fields: Vec<String> = object.iter().filter(|(k, _)| *k != "kind").map(|(k, v)| format!("{k}={v}")).collect();
    if fields.is_empty() { name } else { format!("{name}({})", fields.join(", ")) }
}

/// One line per kernel or collective (frees left out): scope, what runs, and the per-device shapes.
fn structure(plan: &Plan) -> String {
    let mut out = String::new();
    let shape = |b: optimus::plan::BufferId| format!("{:?}", plan.buffer(b).shape);
    let scope = |o: u32| plan.origins.get(o as usize).map_or("?", |o| o.scope.as_str());
    let instrs = plan.program.iter().filter(|i| !matches!(i, Instr::Free { .. }));
    for (n, instr) in instrs.enumerate() {
        let line = match instr {
            Instr::Kernel { kernel, inputs, output, origin, .. } => {
                let ins: Vec<String> = inputs.iter().map(|&b| shape(b)).collect();
                format!("{:<16} {} {} -> {}", scope(*origin), kernel_text(kernel), ins.join(" "), shape(*output))
            }
            Instr::Collective { collective: c, origin, .. } => {
                let root = c.root.map_or(String::new(), |r| format!(" root {r}"));
                format!(
                    "{:<16} collective {} {}{root} {} -> {}",
                    scope(*origin),
                    c.kind.name(),
                    c.group.name(),
                    shape(c.send),
                    shape(c.recv)
                )
            }
            Instr::Wait { recv, .. } => format!("wait {}", shape(*recv)),
            Instr::Free { .. } => continue,
        };
        let _ = writeln!(out, "{n:>4} {}", line.trim_end());
    }
    out
}

/// The 2x2 train plan of tiny.opt, one line per instruction. Reviewed by hand: every SUMMA has q = 2
/// steps with roots 0 then 1, LayerNorm statistics are row all-reduces of [b/q, s, 1], and the
/// vocabulary of 101 is padded to 102 (51 rows of the table per device).
#[test]
fn golden_structure_tiny_optimus_2x2_train() {
    let p = tiny_plan(Strategy::Optimus, 2, 2, Mode::Train);
    let padded: Vec<(u64, u64)> = p.padding.iter().map(|p| (p.logical, p.padded)).collect();
    assert_eq!(padded, [(101, 102)], "tiny's prime vocabulary is padded to divide 2");
    insta::assert_snapshot!(structure(&p));
}

// ---- e. divisibility and mesh diagnostics ----------------------------------------------------------

/// tiny.opt with each config line `old` replaced by `new` (each `old` must occur once).
fn tiny_with(edits: &[(&str, &str)]) -> String {
    let mut text = example("tiny");
    for (old, new) in edits {
        assert_eq!(text.matches(old).count(), 1, "`{old}` must occur once in tiny.opt");
        text = text.replace(old, new);
    }
    text
}

/// Compiles a source that must check but must not shard; returns the diagnostics.
fn must_fail(text: &str, t: Target) -> Vec<Diagnostic> {
    let model = checked(text, &[]);
    match compile(&model, "tiny.opt", text, t) {
        Ok(_) => panic!("expected {} {} to be rejected", t.strategy.name(), t.mesh),
        Err(d) => d,
    }
}

/// The E0602 whose primary label covers exactly the config line `line` (trimmed), with its help.
fn e0602_at<'d>(text: &str, diagnostics: &'d [Diagnostic], line: &str) -> &'d Diagnostic {
    diagnostics
        .iter()
        .filter(|d| d.code == "E0602")
        .find(|d| d.primary_span().is_some_and(|s| &text[s.range()] == line))
        .unwrap_or_else(|| {
            let labels: Vec<_> =
                diagnostics.iter().map(|d| (d.code, d.primary_span().map(|s| &text[s.range()]))).collect();
            panic!("no E0602 labelled `{line}`; got {labels:?}")
        })
}

/// E0602's help: the meshes of the strategy, up to the stated bound, on which the model compiles.
fn mesh_help(strategy: Strategy, meshes: &str) -> String {
    format!("meshes up to 64 devices on which this model compiles with the {} strategy: {meshes}", strategy.name())
}

/// Each split dimension that does not divide the mesh gives E0602 at the config line that defines it,
/// with the meshes that would work in its help; every error is E0602 and nothing panics.
#[test]
fn indivisible_dimensions_point_at_their_config_lines() {
    let optimus4 = target(Strategy::Optimus, 4, 4, Mode::Train);
    let megatron4 = target(Strategy::Megatron, 1, 4, Mode::Train);
    // (config edits, target, the config lines that must be blamed, expected help)
    type Case<'a> = (&'a [(&'a str, &'a str)], Target, &'a [&'a str], &'a str);
    let batch: &[(&str, &str)] = &[("batch   = 8", "batch   = 6")];
    let heads: &[(&str, &str)] = &[("heads   = 8", "heads   = 2")];
    let ffn: &[(&str, &str)] = &[("ffn     = 4 * hidden", "ffn     = 2 * hidden + 6")];
    // heads divides hidden, so a hidden size that does not divide the mesh brings heads along.
    let hidden: &[(&str, &str)] = &[("hidden  = 32", "hidden  = 18"), ("heads   = 8", "heads   = 6")];
    let cases: &[Case] = &[
        (batch, optimus4, &["batch   = 6"], "1x1, 2x2"),
        (heads, optimus4, &["heads   = 2"], "1x1, 2x2"),
        (ffn, optimus4, &["ffn     = 2 * hidden + 6"], "1x1, 2x2"),
        (hidden, optimus4, &["hidden  = 18", "heads   = 6"], "1x1, 2x2"),
        (heads, megatron4, &["heads   = 2"], "1x1, 1x2"),
        (ffn, megatron4, &["ffn     = 2 * hidden + 6"], "1x1, 1x2"),
        (hidden, megatron4, &["hidden  = 18", "heads   = 6"], "1x1, 1x2, 1x3, 1x6"),
    ];
    for &(edits, t, blamed, help) in cases {
        let text = tiny_with(edits);
        let diagnostics = must_fail(&text, t);
        let case = format!("{edits:?} on {} {}", t.strategy.name(), t.mesh);
        assert!(diagnostics.iter().all(|d| d.code == "E0602"), "{case}: {diagnostics:#?}");
        for line in blamed {
            let d = e0602_at(&text, &diagnostics, line);
            let name = line.split_whitespace().next().unwrap_or_default();
            assert!(d.message.contains(&format!("`{name}`")), "{case}: message names `{name}`: {}", d.message);
            let expected = mesh_help(t.strategy, help);
            assert_eq!(d.help.as_deref(), Some(expected.as_str()), "{case}: help for {line}");
        }
        // The batch is not split by megatron, so it is never blamed there.
        if t.strategy == Strategy::Megatron {
            assert!(
                diagnostics.iter().all(|d| !d.message.contains("`batch`")),
                "{case}: megatron replicates the batch"
            );
        }
    }
}

/// The same problem given with `--set` points at the config entry it overrides.
#[test]
fn indivisible_override_points_at_the_config_entry() {
    let text = example("tiny");
    let model = checked(&text, &[("batch", "7")]);
    let d = compile(&model, "tiny.opt", &text, target(Strategy::Optimus, 2, 2, Mode::Infer)).expect_err("7 / 2");
    assert_eq!(d.len(), 1, "{d:#?}");
    assert_eq!(d[0].code, "E0602");
    let span = d[0].primary_span().expect("a primary label");
    assert!(text[span.range()].starts_with("batch"), "label at the batch entry: {:?}", &text[span.range()]);
    assert!(d[0].labels.iter().any(|l| l.primary && l.message.contains("7 is not a multiple of 2")), "{d:#?}");
    assert_eq!(d[0].help.as_deref(), Some(mesh_help(Strategy::Optimus, "1x1").as_str()));
}

/// Meshes a strategy cannot use: E0601 with help, for optimus off the square, megatron off 1 x p, and
/// none on more than one device.
#[test]
fn wrong_mesh_shapes_give_e0601() {
    let text = example("tiny");
    let model = checked(&text, &[]);
    for (strategy, rows, cols) in [
        (Strategy::Optimus, 2, 3),
        (Strategy::Optimus, 1, 4),
        (Strategy::Megatron, 2, 2),
        (Strategy::Megatron, 4, 1),
        (Strategy::None, 2, 2),
        (Strategy::Optimus, 0, 0),
    ] {
        for mode in [Mode::Train, Mode::Infer] {
            let t = target(strategy, rows, cols, mode);
            let d = compile(&model, "tiny.opt", &text, t).expect_err("a mesh the strategy cannot use");
            assert_eq!(d.len(), 1, "{} {rows}x{cols}: {d:#?}", strategy.name());
            assert_eq!(d[0].code, "E0601", "{} {rows}x{cols}", strategy.name());
            assert!(d[0].help.as_deref().is_some_and(|h| h.contains("--mesh")), "{d:#?}");
        }
    }
}

// ---- f. determinism ---------------------------------------------------------------------------------

/// Compiling the same model twice gives byte-identical JSON, in one process and across two runs of
/// the command.
#[test]
fn plans_are_deterministic() {
    for t in [target(Strategy::Optimus, 4, 4, Mode::Train), target(Strategy::Megatron, 1, 4, Mode::Train)] {
        let a = serde_json::to_vec(&plan("gpt2", &[], t)).expect("serialise");
        let b = serde_json::to_vec(&plan("gpt2", &[], t)).expect("serialise");
        assert!(a == b, "{} {}: two compiles differ", t.strategy.name(), t.mesh);
        assert!(a.len() > 1000, "a real plan");
    }
    let dir = TempDir::new("determinism");
    let model = examples_dir().join("tiny.opt");
    let mut outputs = Vec::new();
    for run in 0..2 {
        let out = dir.path().join(format!("plan{run}.json"));
        let r = optimusc(&[path_str(&model), "--mesh", "4x4", "-o", path_str(&out)], "compile");
        assert_eq!(r.status.code(), Some(0), "{}", String::from_utf8_lossy(&r.stderr));
        outputs.push(std::fs::read(&out).expect("the plan was written"));
    }
    assert!(outputs[0] == outputs[1], "two runs of optimusc compile wrote different plans");
}

// ---- g. acceptance sweep ------------------------------------------------------------------------------

/// The dimensions a strategy splits `parts` ways, from the config: batch (optimus only), heads (and
/// kv_heads), hidden and the MLP width. A config without one of these names does not constrain.
fn divides(model: &Model, strategy: Strategy, parts: u64) -> bool {
    let names: &[&str] = match strategy {
        Strategy::Optimus => &["batch", "heads", "kv_heads", "hidden", "ffn"],
        _ => &["heads", "kv_heads", "hidden", "ffn"],
    };
    names.iter().filter_map(|n| model_config(model, n)).all(|v| v % parts == 0)
}

/// One acceptance compile: succeeds exactly when the split dimensions divide, else fails with E0602
/// only; a plan has the requested target, gradients for every parameter in train mode (none in infer
/// mode), and the communication its strategy implies.
fn accept(name: &str, text: &str, model: &Model, t: Target) -> bool {
    let parts = t.mesh.rows.max(t.mesh.cols);
    let expect_ok = divides(model, t.strategy, parts);
    let case = format!("{name} {} {} {:?}", t.strategy.name(), t.mesh, t.mode);
    match compile(model, &format!("examples/{name}.opt"), text, t) {
        Ok(p) => {
            assert!(expect_ok, "{case}: compiled although a split dimension does not divide {parts}");
            assert_eq!((p.mesh, p.strategy, p.mode), (t.mesh, t.strategy, t.mode), "{case}");
            assert!(!p.program.is_empty() && !p.params.is_empty(), "{case}: an empty plan");
            let with_grads = p.params.iter().filter(|p| p.grad.is_some()).count();
            let expected = if t.mode == Mode::Train { p.params.len() } else { 0 };
            assert_eq!(with_grads, expected, "{case}: parameters with gradients");
            assert_eq!(p.outputs.iter().filter(|o| o.is_loss).count(), 1, "{case}: one loss output");
            let r = report(&p);
            let has = |kind: &str| r.communication.iter().any(|c| c.kind == kind);
            match (t.strategy, parts) {
                (_, 1) => assert!(r.communication.is_empty(), "{case}: one device communicates"),
                // Forward SUMMA products (AB) only broadcast; ABT and ATB (the backward, a tied head) reduce.
                (Strategy::Optimus, _) if t.mode == Mode::Infer => assert!(has("broadcast"), "{case}: SUMMA"),
                (Strategy::Optimus, _) => assert!(has("broadcast") && has("reduce"), "{case}: SUMMA"),
                _ => assert!(has("all_reduce") && !has("broadcast"), "{case}: 1D all-reduces"),
            }
            assert!(p.memory.peak_bytes >= p.memory.parameters + p.memory.optimizer_state, "{case}: peak");
            true
        }
        Err(d) => {
            assert!(!expect_ok, "{case}: should compile: {d:#?}");
            assert!(!d.is_empty() && d.iter().all(|d| d.code == "E0602"), "{case}: {d:#?}");
            false
        }
    }
}

/// Every example compiles on optimus 1x1, 2x2, 4x4 and megatron 1x4 in both modes, and on 8x8 / 1x8
/// where its dimensions divide; gpt2's 12 heads make 8-way splits fail with E0602. gpt3 runs with two
/// layers here (the full model is compiled once, below).
#[test]
fn every_example_compiles_on_the_standard_meshes() {
    let mut names: Vec<String> = std::fs::read_dir(examples_dir())
        .expect("examples/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "opt"))
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    names.sort();
    assert!(names.len() >= 5, "examples: {names:?}");
    for name in &names {
        let text = example(name);
        let sets: &[(&str, &str)] = if name == "gpt3" { &[("layers", "2")] } else { &[] };
        let model = checked(&text, sets);
        for mode in [Mode::Train, Mode::Infer] {
            for (strategy, rows, cols) in [
                (Strategy::Optimus, 1, 1),
                (Strategy::Optimus, 2, 2),
                (Strategy::Optimus, 4, 4),
                (Strategy::Megatron, 1, 4),
            ] {
                let t = target(strategy, rows, cols, mode);
                assert!(accept(name, &text, &model, t), "{name} must compile for {} {}", strategy.name(), t.mesh);
            }
            let eight = [target(Strategy::Optimus, 8, 8, mode), target(Strategy::Megatron, 1, 8, mode)];
            for t in eight {
                let ok = accept(name, &text, &model, t);
                if name == "gpt2" {
                    assert!(!ok, "gpt2's 12 heads cannot split 8 ways");
                    let d = compile(&model, "gpt2.opt", &text, t).expect_err("12 heads / 8");
                    assert!(d.iter().any(|d| d.message.contains("`heads` (12)")), "{d:#?}");
                }
            }
        }
    }
}

/// The full 96-layer GPT-3 compiles for training on 8x8 with the per-layer SUMMA volume of §3, fc2's
/// weight across the mesh (see `summa_layer_payload_matches_the_formula`).
#[test]
fn full_gpt3_compiles_on_8x8() {
    let p = plan("gpt3", &[], target(Strategy::Optimus, 8, 8, Mode::Train));
    let d = Dims::of(&p);
    assert_eq!(d.layers, 96);
    let r = report(&p);
    let (bsh, h2) = (d.rows() * d.hidden, d.hidden * d.hidden);
    for l in [0, 47, 95] {
        let layer: u64 = d.linears(l).iter().map(|(scope, _, _)| elements(&summa(&r, scope))).sum();
        assert_eq!(layer, (12 * bsh + 36 * h2) / 8, "gpt3 layer {l}");
    }
}

// ---- h. the command line ------------------------------------------------------------------------------

/// A fresh directory under the system temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!("optimusc-compile-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("creating a temporary directory");
        TempDir(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 paths")
}

/// Runs `optimusc <command> <args>`.
fn optimusc(args: &[&str], command: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .arg(command)
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("running optimusc")
}

/// A model that does not divide the mesh: exit status 1, E0602 on stderr, and no file (not even a
/// temporary one) left behind.
#[test]
fn cli_compile_failure_writes_nothing() {
    let dir = TempDir::new("failure");
    let out = dir.path().join("plan.json");
    let model = examples_dir().join("gpt2.opt");
    let r = optimusc(&[path_str(&model), "--mesh", "8x8", "-o", path_str(&out)], "compile");
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("E0602") && stderr.contains("no plan written"), "{stderr}");
    assert!(!out.exists(), "a failed compile must not write the plan");
    let left: Vec<_> = std::fs::read_dir(dir.path()).expect("the directory").collect();
    assert!(left.is_empty(), "files left behind: {left:?}");

    let r = optimusc(&[path_str(&model), "--mesh", "2x3", "-o", path_str(&out)], "compile");
    assert_eq!(r.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&r.stderr).contains("E0601"));
    assert!(!out.exists(), "a rejected mesh must not write the plan");
}

/// `inspect --json` prints the documented report and `inspect --dot FILE` writes a Graphviz graph.
#[test]
fn cli_inspect_json_and_dot() {
    let dir = TempDir::new("inspect");
    let out = dir.path().join("plan.json");
    let dot = dir.path().join("plan.dot");
    let model = examples_dir().join("tiny.opt");
    let r = optimusc(&[path_str(&model), "--mesh", "2x2", "--mode", "train", "-o", path_str(&out)], "compile");
    assert_eq!(r.status.code(), Some(0), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(out.exists());

    let r = optimusc(&[path_str(&out), "--json", "--dot", path_str(&dot)], "inspect");
    assert_eq!(r.status.code(), Some(0), "{}", String::from_utf8_lossy(&r.stderr));
    let json: serde_json::Value = serde_json::from_slice(&r.stdout).expect("inspect --json prints JSON");
    for key in ["mesh", "strategy", "mode", "flops", "memory", "communication"] {
        assert!(json.get(key).is_some(), "missing top-level `{key}`: {json:#}");
    }
    assert_eq!(json["mesh"], "2x2");
    assert_eq!(json["strategy"], "optimus");
    assert_eq!(json["mode"], "train");
    assert!(json["flops"]["per_device"].as_u64().is_some_and(|f| f > 0), "{:#}", json["flops"]);
    assert!(json["memory"]["peak_bytes"].as_u64().is_some_and(|b| b > 0), "{:#}", json["memory"]);
    let comm = json["communication"].as_array().expect("communication is a list");
    assert!(!comm.is_empty());
    for c in comm {
        for key in ["kind", "group", "elements", "bytes", "origin"] {
            assert!(c.get(key).is_some(), "entry without `{key}`: {c:#}");
        }
        assert_eq!(c["bytes"].as_u64(), c["elements"].as_u64().map(|e| e * 4), "f32 payloads: {c:#}");
        assert!(c["origin"]["reason"].as_str().is_some_and(|r| !r.is_empty()), "{c:#}");
    }
    // The JSON agrees with the library's report of the same plan.
    let p = optimus::io::plan_file::read_plan(&out).expect("the plan reads back");
    assert_eq!(comm.len(), report(&p).communication.len());

    let text = std::fs::read_to_string(&dot).expect("inspect --dot wrote the file");
    assert!(text.starts_with("digraph"), "{}", &text[..text.len().min(80)]);
    assert!(text.contains("broadcast row root 1"), "the graph shows SUMMA broadcasts");
    assert!(text.trim_end().ends_with('}'));
}

/// Every line ending language.md allows ends a comment: the examples with LF, CRLF or CR alone (the old
/// Mac convention, where a comment once ran to the end of the file) check to the same model.
#[test]
fn every_line_ending_ends_a_comment() {
    for name in ["tiny", "gpt2", "llama"] {
        let text = example(name);
        let lf = checked(&text, &[]);
        for ending in ["\r\n", "\r"] {
            let other = checked(&text.replace('\n', ending), &[]);
            assert_eq!(other.graph.node_count(), lf.graph.node_count(), "{name} with {ending:?}");
            assert_eq!(other.params.len(), lf.params.len(), "{name} with {ending:?}");
        }
    }
}

/// Models whose inputs have no batch dimension: on a mesh that splits the batch (replicas, or the grid
/// rows of optimus), a scalar input or an operator reading an input's only dimension as its features,
/// classes or sequence is E0602 naming it, never an internal error; megatron, which keeps the batch
/// whole, compiles what it can, and every one compiles on one device.
#[test]
fn models_without_a_batch_dimension_are_refused_by_name_where_the_mesh_splits_the_batch() {
    let scalar_target = "model m\ninput s: f32[4]\ninput t: i32[]\nforward {\n  output loss = cross_entropy(s, t)\n}\n";
    let sequence = "model m\ninput t: i32[4]\nlayer e = embedding(10, 8)\nlayer p = position_embedding(10, 8)\nlayer fc = linear(8, 10, tied: e)\nforward {\n  output loss = cross_entropy(fc(e(t) + p(t)), t)\n}\n";
    let features = "model m\ninput x: f32[8]\nlayer l = linear(8, 8)\nlayer n = layernorm(8)\nforward {\n  output y = n(l(x))\n}\n";
    let optimus = |data| Target::plain(Mesh::new(2, 2).with_data(data), Strategy::Optimus, Mode::Infer);
    let replicas = Target::plain(Mesh::new(1, 1).with_data(2), Strategy::Optimus, Mode::Infer);
    let megatron = Target::plain(Mesh::new(1, 2), Strategy::Megatron, Mode::Infer);
    let one = Target::plain(Mesh::new(1, 1), Strategy::None, Mode::Infer);
    let cases = [
        (scalar_target, optimus(1), Some("input `t` has no dimension for a 2x2 mesh to split as the batch")),
        (scalar_target, replicas, Some("input `t` has no dimension")),
        (scalar_target, megatron, Some("f32[4] needs a batch dimension besides the classes")),
        (sequence, optimus(2), Some("i32[4] needs a batch dimension besides the sequence")),
        (sequence, megatron, None),
        (features, optimus(1), Some("f32[8] needs a batch dimension besides the features")),
        (features, replicas, Some("f32[8] needs a batch dimension besides the features")),
        (features, megatron, None),
    ];
    for (text, t, expected) in cases.into_iter().chain([scalar_target, sequence, features].map(|s| (s, one, None))) {
        let model = checked(text, &[]);
        let what = format!("{} on {} {}", text.lines().nth(1).unwrap_or(""), t.strategy.name(), t.mesh);
        match (compile(&model, "m.opt", text, t), expected) {
            (Ok(_), None) => {}
            (Err(d), Some(message)) => {
                assert!(d.iter().all(|d| d.code == "E0602"), "{what}: {d:#?}");
                assert!(d.iter().any(|d| d.message.contains(message)), "{what}: {d:#?}");
            }
            (Ok(_), Some(message)) => panic!("{what}: compiled, expected {message}"),
            (Err(d), None) => panic!("{what}: {d:#?}"),
        }
    }
}
