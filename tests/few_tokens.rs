//! Few tokens (a decoding step, a small training batch of a wide model): linears keep their weights
//! where they are stored and move the tokens' blocks instead, wherever that moves less. Each linear's
//! traffic equals its closed formula; generation on such meshes gives one device's tokens and logits,
//! and training one device's gradients and updates.

use optimus::elab::Override;
use optimus::front::check_source;
use optimus::plan::report::report;
use optimus::plan::{Layouts, Mesh, Mode, Plan, Strategy};
use optimus::shard::{Target, compile};
use serde_json::Value;
use std::process::Command;

/// GPT-2 with one layer of `hidden`, `batch` sequences of `seq` on a q x q mesh: a decoding step (one
/// position, caches of 24) in inference, or a training step.
fn gpt2_plan(hidden: u64, tokens: (u64, u64), q: u64, mode: Mode) -> Plan {
    gpt2_plan_laid(hidden, tokens, q, mode, Layouts::Auto)
}

/// [`gpt2_plan`] with its products laid out as `layouts` says.
fn gpt2_plan_laid(hidden: u64, (batch, seq): (u64, u64), q: u64, mode: Mode, layouts: Layouts) -> Plan {
    let file = "examples/gpt2.opt";
    let source = std::fs::read_to_string(file).expect("the example");
    let values = [("layers", 1), ("hidden", hidden), ("heads", 4), ("vocab", 512), ("context", 24), ("pdrop", 0)];
    let overrides: Vec<Override> = values
        .iter()
        .chain(&[("batch", batch), ("seq", seq)])
        .map(|(name, value)| Override { name: name.to_string(), value: value.to_string() })
        .collect();
    let model = check_source(&source, &overrides).model.expect("the model checks");
    let model = match mode {
        Mode::Infer => optimus::decode::with_cache(&model, 24).expect("GPT-2 decodes with a cache"),
        Mode::Train => model,
    };
    let target = Target { layouts, ..Target::plain(Mesh::new(q, q), Strategy::Optimus, mode) };
    compile(&model, file, &source, target)
        .unwrap_or_else(|d| panic!("{}", optimus::diag::render_plain(file, &source, &d)))
}

/// Elements a device sends or receives in the SUMMA steps of the linear at `scope`.
fn moved_by(plan: &Plan, scope: &str) -> u64 {
    let r = report(plan);
    r.communication
        .iter()
        .filter(|c| c.origin.scope == scope && c.origin.reason.contains("SUMMA"))
        .map(|c| c.elements)
        .sum()
}

/// Elements a device sends or receives in transposes across the diagonal (traced to the layer that
/// made the value they move, not to the linear that asks for it).
fn transposed(plan: &Plan) -> u64 {
    report(plan).communication.iter().filter(|c| c.kind == "transpose").map(|c| c.elements).sum()
}

/// Where a linear C[T, N] = X[T, K] W[K, N] keeps its weight, per device on q x q, and what that costs in elements.
#[derive(Clone, Copy, Debug)]
enum Weight {
    /// §3's SUMMA: the tokens' blocks and the weight's, (TK + KN)/q.
    Moves,
    /// The weight stays: the input's block transposed (TK/q^2), its blocks broadcast (TK/q), the
    /// partial outputs reduced (TN/q).
    Stays,
    /// The weight stays, stored across the mesh (K > N): the input's blocks broadcast (TK/q), the
    /// partial outputs reduced (TN/q), the output's block transposed back (TN/q^2).
    StaysAcross,
}

/// The elements of a linear's SUMMA steps, and of its transpose.
fn elements(way: Weight, (t, k, n): (u64, u64, u64), q: u64) -> (u64, u64) {
    match way {
        Weight::Moves => ((t * k + k * n) / q, 0),
        Weight::Stays => ((t * k + t * n) / q, t * k / (q * q)),
        Weight::StaysAcross => ((t * k + t * n) / q, t * n / (q * q)),
    }
}

/// One GPT-2 layer's four linears in a decoding step: the wide ones (c_attn, c_fc, and the MLP's
/// second, stored across the mesh) keep their weights in place; the attention's output projection,
/// whose weight block is small next to a collective's start-up on these meshes, moves it.
#[test]
fn a_decoding_step_moves_the_tokens_blocks_where_the_weights_blocks_are_larger() {
    for (hidden, batch, q) in [(256, 4, 2), (256, 8, 2), (512, 8, 4)] {
        let plan = gpt2_plan(hidden, (batch, 1), q, Mode::Infer);
        let (t, h) = (batch, hidden);
        let linears = [
            ("h.0.attn.c_attn", (t, h, 3 * h), Weight::Stays),
            ("h.0.attn.c_proj", (t, h, h), Weight::Moves),
            ("h.0.mlp.c_fc", (t, h, 4 * h), Weight::Stays),
            ("h.0.mlp.c_proj", (t, 4 * h, h), Weight::StaysAcross),
        ];
        let case = format!("hidden {hidden} batch {batch} on {q}x{q}");
        for (scope, dims, way) in linears {
            assert_eq!(moved_by(&plan, scope), elements(way, dims, q).0, "{case}: {scope} {way:?}");
        }
        let transposes: u64 = linears.iter().map(|&(_, dims, way)| elements(way, dims, q).1).sum();
        assert_eq!(transposed(&plan), transposes, "{case}: the transposes of three linears");
        // Against §3's way for every linear, the step moves a fraction of the weights.
        let all_moving: u64 = linears.iter().map(|&(_, dims, _)| elements(Weight::Moves, dims, q).0).sum();
        let moved: u64 = linears.iter().map(|&(scope, _, _)| moved_by(&plan, scope)).sum::<u64>() + transposes;
        assert!(moved * 2 < all_moving, "{case}: {moved} elements against {all_moving}");
    }
}

/// With `--layouts paper` every linear moves its weight's blocks, as §3 of the design has it, over
/// however few tokens: a decoding step and a small training batch move (T in + in out)/q a device per
/// pass of each linear, three passes in training, and nothing is transposed.
#[test]
fn the_papers_layouts_move_the_weights_over_few_tokens_too() {
    for (hidden, (batch, seq), q, mode) in
        [(256, (4, 1), 2, Mode::Infer), (512, (8, 1), 4, Mode::Infer), (512, (2, 8), 2, Mode::Train)]
    {
        let plan = gpt2_plan_laid(hidden, (batch, seq), q, mode, Layouts::Paper);
        let (t, h) = (batch * seq, hidden);
        let passes = if mode == Mode::Train { 3 } else { 1 };
        let case = format!("hidden {hidden}, {t} tokens on {q}x{q}, {mode:?}");
        for (scope, dims) in [
            ("h.0.attn.c_attn", (t, h, 3 * h)),
            ("h.0.attn.c_proj", (t, h, h)),
            ("h.0.mlp.c_fc", (t, h, 4 * h)),
            ("h.0.mlp.c_proj", (t, 4 * h, h)),
        ] {
            assert_eq!(moved_by(&plan, scope), passes * elements(Weight::Moves, dims, q).0, "{case}: {scope}");
        }
        assert_eq!(transposed(&plan), 0, "{case}: the paper's layouts transpose nothing");
    }
}

/// A training step over 16 tokens of a 512-wide layer on 2x2 (and 32 on 4x4): every linear keeps its
/// weight in place, each moving 3 T (in + out)/q a device. The three whose weights do not narrow
/// (forward: the input's blocks and the partial outputs; dX = dY W^T keeping W: dY's blocks and the
/// partial dX; dW accumulated in place: the forward's transposed input and dY's blocks) transpose their
/// input's block twice (the forward's, and dX's back). The MLP's second, stored across the mesh
/// (forward: the input's blocks and the partial outputs; dX: the transposed dY's blocks and the partial
/// dX, which comes out as the input lies; dW accumulated across: the input's and the transposed dY's
/// blocks) transposes its output's block twice (the forward's back, and dY). §3's way would move
/// 3 (T in + in out)/q each; the weights moving across the mesh, 3 (T out + in out)/q.
#[test]
fn a_small_training_batch_moves_the_tokens_blocks_where_the_weights_blocks_are_larger() {
    for (batch, seq, q) in [(2, 8, 2), (4, 8, 4)] {
        let plan = gpt2_plan(512, (batch, seq), q, Mode::Train);
        let (t, h) = (batch * seq, 512);
        let stays = |k: u64, n: u64| 3 * (t * k + t * n) / q;
        let linears = [
            ("h.0.attn.c_attn", stays(h, 3 * h)),
            ("h.0.attn.c_proj", stays(h, h)),
            ("h.0.mlp.c_fc", stays(h, 4 * h)),
            ("h.0.mlp.c_proj", stays(4 * h, h)),
        ];
        let case = format!("{batch} x {seq} tokens on {q}x{q}");
        for (scope, want) in linears {
            assert_eq!(moved_by(&plan, scope), want, "{case}: {scope}");
        }
        assert_eq!(transposed(&plan), 4 * 2 * t * h / (q * q), "{case}: two transposes of each linear's narrow side");
        // The layer norms' weight and bias gradients are summed where dX was transposed back for them:
        // split over the columns as those vectors are stored, with no gather or scatter to move them.
        let moved_vectors: Vec<_> = report(&plan)
            .communication
            .into_iter()
            .filter(|c| c.origin.scope.starts_with("h.0.") && (c.kind == "all_gather" || c.kind == "reduce_scatter"))
            .collect();
        assert!(moved_vectors.is_empty(), "{case}: {moved_vectors:#?}");
    }
}

/// Training with the weights kept in place computes one device's loss, gradients and updates (GPT-2,
/// BERT and grouped-query Llama; 2x2, 4x4, replicas with ZeRO-1 and overlap, tesseract, bf16 with
/// recomputation), as `optimusc verify` checks.
#[test]
fn training_with_the_weights_in_place_verifies_against_one_device() {
    let gpt2 =
        ["examples/gpt2.opt", "--set", "layers=2", "--set", "hidden=512", "--set", "heads=8", "--set", "vocab=512"];
    let gpt2 = [&gpt2[..], &["--set", "context=8", "--set", "seq=8", "--set", "pdrop=0.0"]].concat();
    let llama =
        ["examples/llama.opt", "--set", "layers=2", "--set", "hidden=512", "--set", "heads=8", "--set", "kv_heads=4"];
    let llama =
        [&llama[..], &["--set", "ffn=1024", "--set", "vocab=512", "--set", "seq=8", "--set", "batch=2"]].concat();
    let bert = ["examples/bert.opt", "--set", "layers=2", "--set", "hidden=512", "--set", "heads=8", "--set", "seq=8"];
    let runs: [(&[&str], &[&str]); 7] = [
        (&gpt2, &["--set", "batch=2", "--mesh", "2x2"]),
        (&gpt2, &["--set", "batch=4", "--mesh", "4x4"]),
        (&gpt2, &["--set", "batch=4", "--mesh", "2x2x2", "--zero", "1", "--overlap"]),
        (&gpt2, &["--set", "batch=4", "--mesh", "2x2x2", "--strategy", "tesseract"]),
        (&gpt2, &["--set", "batch=2", "--mesh", "2x2", "--precision", "bf16", "--recompute", "layers"]),
        (&llama, &["--mesh", "2x2"]),
        (&bert, &["--set", "batch=2", "--mesh", "2x2"]),
    ];
    for (model, mesh) in runs {
        let args = [&["verify"][..], model, mesh].concat();
        let out = Command::new(env!("CARGO_BIN_EXE_optimusc")).args(&args).output().expect("optimusc runs");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("verified:"),
            "{args:?}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn records(args: &[&str]) -> Vec<Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc")).args(args).output().expect("optimusc runs");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("JSON")).collect()
}

/// `generate MODEL --set NAME=VALUE... PROMPTS... --max-new-tokens 6 --json`.
fn generate(model: &str, sets: &[(&str, &str)], prompts: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["generate", model].map(String::from).to_vec();
    for (name, value) in sets {
        args.extend(["--set".to_string(), format!("{name}={value}")]);
    }
    args.extend(prompts.iter().map(|p| p.to_string()));
    args.extend(["--max-new-tokens", "6", "--json"].map(String::from));
    args
}

/// Every record's ids and the logit of every generated token.
fn ids_and_logits(rs: &[Value]) -> Vec<(Value, Vec<f64>)> {
    let logits = |r: &Value| r["logits"].as_array().expect("logits").iter().filter_map(Value::as_f64).collect();
    rs.iter().map(|r| (r["ids"].clone(), logits(r))).collect()
}

/// Generation with the weights kept in place (GPT-2 and grouped-query Llama wide enough for it, on
/// 2x2, with replicas, tesseract layers and on 4x4), and with the paper's layouts that move them, gives
/// one device's tokens, and its logits within float32 rounding of the sums' order.
#[test]
fn decoding_with_the_weights_in_place_gives_one_devices_tokens_and_logits() {
    let gpt2 = generate(
        "examples/gpt2.opt",
        &[("layers", "2"), ("heads", "4"), ("vocab", "512"), ("context", "24")],
        &["--prompt-ids", "11,12", "--prompt-ids", "464,268,75,218,3"],
    );
    let llama = generate(
        "examples/llama.opt",
        &[("layers", "2"), ("hidden", "256"), ("heads", "8"), ("kv_heads", "2"), ("ffn", "1024"), ("vocab", "97")],
        &["--set", "context=20", "--prompt-ids", "5,6,7", "--prompt-ids", "9"],
    );
    let (gpt2, llama): (Vec<&str>, Vec<&str>) =
        (gpt2.iter().map(String::as_str).collect(), llama.iter().map(String::as_str).collect());
    let runs: [(&[&str], &str, &[&str]); 6] = [
        (&gpt2, "hidden=256", &["--mesh", "2x2"]),
        (&gpt2, "hidden=256", &["--mesh", "2x2", "--layouts", "paper"]),
        (&gpt2, "hidden=256", &["--mesh", "2x2x2"]),
        (&gpt2, "hidden=256", &["--mesh", "2x2x2", "--strategy", "tesseract"]),
        (&gpt2, "hidden=512", &["--mesh", "4x4"]),
        (&llama, "layers=2", &["--mesh", "2x2"]),
    ];
    for (model, width, mesh) in runs {
        let one = ids_and_logits(&records(&[model, &["--set", width]].concat()));
        let meshed = ids_and_logits(&records(&[model, &["--set", width], mesh].concat()));
        assert_eq!(one.len(), meshed.len(), "{mesh:?}");
        for ((ids, logits), (want_ids, want_logits)) in meshed.iter().zip(&one) {
            assert_eq!(ids, want_ids, "{width} {mesh:?}");
            assert_eq!(logits.len(), want_logits.len(), "{width} {mesh:?}");
            for (got, want) in logits.iter().zip(want_logits) {
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{width} {mesh:?}: logit {got} against {want}"
                );
            }
        }
    }
}
