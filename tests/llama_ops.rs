//! The Llama operators: `rms_norm` (as Hugging Face's `LlamaRMSNorm`) and the element-wise product
//! `a * b` / `mul(a, b)` of the SwiGLU gate. Their CPU kernels against the formulas and finite
//! differences; a whole model's gradients against finite differences of its loss (through autodiff,
//! including `y * y`, whose two gradient contributions must add up); and a tiny Llama-style model that
//! verifies on every strategy.

mod common;

use optimus::front::check_source;
use optimus::plan::tensor::Tensor;
use optimus::plan::{Instr, Kernel, Mesh, Mode, Plan, ReasonKind, Strategy};
use optimus::runtime::exec::RunConfig;
use optimus::runtime::settings::{OptimizerKind, OptimizerSettings};
use optimus::shard::{Target, compile};
use std::collections::BTreeMap;
use std::process::Command;

mod cpu_kernel;
use cpu_kernel::eval;

type R = Result<(), String>;

/// Deterministic uniforms in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| scale * self.next()).collect()
    }

    fn tensor(&mut self, shape: &[u64], scale: f32) -> Tensor {
        let n = shape.iter().product::<u64>() as usize;
        Tensor::from_f32(shape, self.values(n, scale))
    }
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.f32().map(<[f32]>::to_vec).unwrap_or_default()
}

/// Every |got - want| <= tol * max(1, |want|).
fn close(got: &[f32], want: &[f64], tol: f64) -> R {
    if got.len() != want.len() {
        return Err(format!("{} values, want {}", got.len(), want.len()));
    }
    for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
        if (f64::from(g) - w).abs() > tol * w.abs().max(1.0) {
            return Err(format!("element {k}: got {g}, want {w}"));
        }
    }
    Ok(())
}

/// Every |got - want| <= tol * max |want| (gradients against finite differences).
fn close_rel(got: &[f32], want: &[f64], tol: f64) -> R {
    let scale = want.iter().fold(1e-3f64, |m, w| m.max(w.abs()));
    let got64: Vec<f64> = got.iter().map(|&g| f64::from(g)).collect();
    for (k, (g, w)) in got64.iter().zip(want).enumerate() {
        if (g - w).abs() > tol * scale {
            return Err(format!("element {k}: got {g}, finite differences give {w} (scale {scale})"));
        }
    }
    Ok(())
}

/// d/dx of sum(dy * f(x)) by central differences of the (f32) kernel chain `f`.
fn numeric_grad(x: &Tensor, dy: &[f32], f: impl Fn(&Tensor) -> Result<Tensor, String>) -> Result<Vec<f64>, String> {
    let xv = vals(x);
    let h = 1e-2f32;
    let weighted = |t: &Tensor| vals(t).iter().zip(dy).map(|(&y, &w)| f64::from(y) * f64::from(w)).sum::<f64>();
    let mut grad = Vec::with_capacity(xv.len());
    for k in 0..xv.len() {
        let (mut plus, mut minus) = (xv.clone(), xv.clone());
        plus[k] += h;
        minus[k] -= h;
        let up = weighted(&f(&Tensor::from_f32(&x.shape, plus.clone()))?);
        let down = weighted(&f(&Tensor::from_f32(&x.shape, minus.clone()))?);
        grad.push((up - down) / f64::from(plus[k] - minus[k]));
    }
    Ok(grad)
}

// ---- RMSNorm kernels -------------------------------------------------------------------------------

const EPS: f64 = 1e-6;

/// RMSNorm of [rows, n] through the plan's kernels: the row sums of squares, then the normalisation.
fn rms_norm(x: &Tensor, w: &Tensor) -> Result<Tensor, String> {
    let (rows, n) = (x.shape[0], x.shape[1]);
    let sq = eval(&Kernel::RowSquareSum, &[x], &[rows, 1])?;
    eval(&Kernel::RmsNormApply { n, eps: EPS }, &[x, &sq, w], &x.shape)
}

/// (dx, dw) of RMSNorm through the backward kernels.
fn rms_norm_grads(dy: &Tensor, x: &Tensor, w: &Tensor) -> Result<(Tensor, Tensor), String> {
    let (rows, n) = (x.shape[0], x.shape[1]);
    let sq = eval(&Kernel::RowSquareSum, &[x], &[rows, 1])?;
    let dot = eval(&Kernel::RmsNormGradSum, &[dy, x, w], &[rows, 1])?;
    let dx = eval(&Kernel::RmsNormGradInput { n, eps: EPS }, &[dy, x, w, &sq, &dot], &x.shape)?;
    let dw = eval(&Kernel::RmsNormGradWeight { n, eps: EPS }, &[dy, x, &sq], &[n])?;
    Ok((dx, dw))
}

#[test]
fn rms_norm_is_w_x_over_the_root_mean_square() -> R {
    let mut rng = Rng(1);
    let (x, w) = (rng.tensor(&[5, 8], 3.0), rng.tensor(&[8], 1.5));
    let (xv, wv) = (vals(&x), vals(&w));
    let want: Vec<f64> = xv
        .chunks(8)
        .flat_map(|row| {
            let mean_square = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / 8.0;
            let inv = 1.0 / (mean_square + EPS).sqrt();
            row.iter().zip(&wv).map(move |(&v, &g)| f64::from(g) * f64::from(v) * inv).collect::<Vec<_>>()
        })
        .collect();
    close(&vals(&rms_norm(&x, &w)?), &want, 1e-6)?;
    // A zero row stays zero (eps keeps the division finite).
    let zeros = Tensor::from_f32(&[1, 4], vec![0.0; 4]);
    close(&vals(&rms_norm(&zeros, &Tensor::from_f32(&[4], vec![1.0; 4]))?), &[0.0; 4], 0.0)
}

#[test]
fn rms_norm_grads_match_finite_differences() -> R {
    let mut rng = Rng(2);
    let (x, w, dy) = (rng.tensor(&[4, 8], 2.0), rng.tensor(&[8], 1.5), rng.tensor(&[4, 8], 1.0));
    let (dx, dw) = rms_norm_grads(&dy, &x, &w)?;
    let weights = vals(&dy);
    close_rel(&vals(&dx), &numeric_grad(&x, &weights, |x| rms_norm(x, &w))?, 2e-3)?;
    close_rel(&vals(&dw), &numeric_grad(&w, &weights, |w| rms_norm(&x, w))?, 2e-3)
}

/// Splits [rows, n] into two [rows, n / 2] halves along the last dimension.
fn halves(t: &Tensor) -> [Tensor; 2] {
    let n = *t.shape.last().unwrap_or(&1) as usize;
    let v = vals(t);
    let half = |h: usize| {
        let data = v.chunks(n).flat_map(|r| r[h * n / 2..(h + 1) * n / 2].to_vec()).collect();
        let mut shape = t.shape.clone();
        if let Some(last) = shape.last_mut() {
            *last /= 2;
        }
        Tensor::from_f32(&shape, data)
    };
    [half(0), half(1)]
}

fn join(a: &Tensor, b: &Tensor) -> Vec<f64> {
    let n = *a.shape.last().unwrap_or(&1) as usize;
    vals(a).chunks(n).zip(vals(b).chunks(n)).flat_map(|(x, y)| [x, y].concat()).map(f64::from).collect()
}

/// What a plan does where the last dimension is split over two devices: local row statistics summed
/// (the all-reduce), then local kernels, give the unsplit results.
#[test]
fn rms_norm_split_in_two_halves_equals_the_whole() -> R {
    let mut rng = Rng(3);
    let n = 8u64;
    let (x, w, dy) = (rng.tensor(&[3, 8], 2.0), rng.tensor(&[8], 1.5), rng.tensor(&[3, 8], 1.0));
    let whole = rms_norm(&x, &w)?;
    let (whole_dx, whole_dw) = rms_norm_grads(&dy, &x, &w)?;
    let ([x0, x1], [w0, w1], [dy0, dy1]) = (halves(&x), halves(&w), halves(&dy));
    let rows = [3u64, 1];
    let sum = |a: Tensor, b: Tensor| eval(&Kernel::Add, &[&a, &b], &rows);
    let sq = sum(eval(&Kernel::RowSquareSum, &[&x0], &rows)?, eval(&Kernel::RowSquareSum, &[&x1], &rows)?)?;
    let apply = Kernel::RmsNormApply { n, eps: EPS };
    let (y0, y1) = (eval(&apply, &[&x0, &sq, &w0], &x0.shape)?, eval(&apply, &[&x1, &sq, &w1], &x1.shape)?);
    close(&vals(&whole), &join(&y0, &y1), 1e-6)?;
    let dot = sum(
        eval(&Kernel::RmsNormGradSum, &[&dy0, &x0, &w0], &rows)?,
        eval(&Kernel::RmsNormGradSum, &[&dy1, &x1, &w1], &rows)?,
    )?;
    let input = Kernel::RmsNormGradInput { n, eps: EPS };
    let dx0 = eval(&input, &[&dy0, &x0, &w0, &sq, &dot], &x0.shape)?;
    let dx1 = eval(&input, &[&dy1, &x1, &w1, &sq, &dot], &x1.shape)?;
    close(&vals(&whole_dx), &join(&dx0, &dx1), 1e-5)?;
    let weight = Kernel::RmsNormGradWeight { n, eps: EPS };
    let dw0 = vals(&eval(&weight, &[&dy0, &x0, &sq], &[4])?);
    let dw1 = vals(&eval(&weight, &[&dy1, &x1, &sq], &[4])?);
    close(&vals(&whole_dw), &[dw0, dw1].concat().into_iter().map(f64::from).collect::<Vec<_>>(), 1e-6)
}

#[test]
fn rms_norm_kernels_refuse_bad_inputs() {
    let x = Tensor::from_f32(&[2, 3], vec![1.0; 6]);
    let sq = Tensor::from_f32(&[2, 1], vec![3.0; 2]);
    let w = Tensor::from_f32(&[3], vec![1.0; 3]);
    assert!(eval(&Kernel::RmsNormApply { n: 0, eps: EPS }, &[&x, &sq, &w], &[2, 3]).is_err(), "n = 0");
    let short = Tensor::from_f32(&[2], vec![1.0; 2]);
    assert!(eval(&Kernel::RmsNormApply { n: 3, eps: EPS }, &[&x, &sq, &short], &[2, 3]).is_err(), "weight size");
    assert!(eval(&Kernel::RmsNormGradSum, &[&x, &x], &[2, 1]).is_err(), "too few inputs");
}

// ---- the element-wise product ------------------------------------------------------------------------

#[test]
fn mul_multiplies_elementwise_and_its_grads_match_finite_differences() -> R {
    let mut rng = Rng(4);
    let (a, b, dy) = (rng.tensor(&[3, 5], 2.0), rng.tensor(&[3, 5], 2.0), rng.tensor(&[3, 5], 1.0));
    let want: Vec<f64> = vals(&a).iter().zip(vals(&b)).map(|(&x, y)| f64::from(x) * f64::from(y)).collect();
    close(&vals(&eval(&Kernel::Mul, &[&a, &b], &[3, 5])?), &want, 1e-7)?;
    // The backward is the same kernel: da = dy * b, db = dy * a.
    let weights = vals(&dy);
    let da = eval(&Kernel::Mul, &[&dy, &b], &[3, 5])?;
    close_rel(&vals(&da), &numeric_grad(&a, &weights, |a| eval(&Kernel::Mul, &[a, &b], &[3, 5]))?, 1e-3)?;
    let db = eval(&Kernel::Mul, &[&dy, &a], &[3, 5])?;
    close_rel(&vals(&db), &numeric_grad(&b, &weights, |b| eval(&Kernel::Mul, &[&a, b], &[3, 5]))?, 1e-3)?;
    let mismatched = Tensor::from_f32(&[3, 4], vec![1.0; 12]);
    if eval(&Kernel::Mul, &[&a, &mismatched], &[3, 5]).is_ok() {
        return Err("a product of mismatched shapes must fail".into());
    }
    Ok(())
}

// ---- a whole model against finite differences of its loss ---------------------------------------------

/// A small model using every new piece: rms_norm, a bias-free SwiGLU (`*`), and `mul(y, y)`, whose
/// gradient with respect to y has two contributions that autodiff must add.
const GATED: &str = r#"model gated

config {
  vocab  = 11
  seq    = 4
  batch  = 2
  hidden = 8
  ffn    = 12
}

input tokens:  i32[batch, seq]
input targets: i32[batch, seq]

layer wte  = embedding(vocab, hidden, std: 0.5)
layer norm = rms_norm(hidden, eps: 0.00001)
layer gate = linear(hidden, ffn, bias: false, std: 0.5)
layer up   = linear(hidden, ffn, bias: false, std: 0.5)
layer down = linear(ffn, hidden, bias: false, std: 0.5)
layer head = linear(hidden, vocab, bias: false, std: 0.5)

forward {
  x = wte(tokens)
  h = norm(x)
  y = x + down(silu(gate(h)) * up(h))
  output loss = cross_entropy(head(mul(y, y) * 0.5 + y), targets)
}
"#;

/// The training plan of `source` on `mesh` with `strategy`.
fn train_plan(source: &str, mesh: (u64, u64), strategy: Strategy) -> Plan {
    let checked = check_source(source, &[]);
    let model = checked.model.expect("the model checks");
    let target = Target::plain(Mesh::new(mesh.0, mesh.1), strategy, Mode::Train);
    match compile(&model, "model.opt", source, target) {
        Ok(p) => p,
        Err(d) => panic!("compile failed: {}", optimus::diag::render_plain("model.opt", source, &d)),
    }
}

fn gated_plan() -> Plan {
    train_plan(GATED, (1, 1), Strategy::None)
}

/// One step at learning rate 0 from `initial` (the seed's parameters where empty): (loss, params, grads).
type Step = (f64, BTreeMap<String, Tensor>, BTreeMap<String, Tensor>);

fn step(plan: &Plan, initial: &BTreeMap<String, Tensor>) -> Result<Step, String> {
    let frozen = OptimizerSettings {
        kind: OptimizerKind::Sgd,
        lr: 0.0,
        weight_decay: 0.0,
        momentum: 0.0,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    };
    let tokens = Tensor::from_i32(&[2, 4], vec![3, 1, 4, 1, 5, 9, 2, 6]);
    let targets = Tensor::from_i32(&[2, 4], vec![5, 3, 5, 8, 9, 7, 9, 3]);
    let batches = move |_step: u64| {
        Ok(BTreeMap::from([("tokens".to_string(), tokens.clone()), ("targets".to_string(), targets.clone())]))
    };
    let out = optimus::runtime::local::run(plan, &RunConfig::new(5, 1, frozen), &batches, initial, &|_| {})?;
    let loss = out.steps.first().and_then(|s| s.loss).ok_or("no loss")?;
    Ok((f64::from(loss), out.params, out.grads))
}

/// The gradient of every parameter at its largest entries matches central differences of the loss.
#[test]
fn a_gated_model_with_rms_norm_has_the_gradients_of_its_loss() -> R {
    let plan = gated_plan();
    let (_, params, grads) = step(&plan, &BTreeMap::new())?;
    let h = 1e-2f32;
    for name in ["norm.weight", "gate.weight", "up.weight", "down.weight", "wte.weight", "head.weight"] {
        let g = vals(grads.get(name).ok_or(format!("no gradient for {name}"))?);
        let mut order: Vec<usize> = (0..g.len()).collect();
        order.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()));
        // The check below is only meaningful for gradients well above its absolute floor.
        let largest = order.first().map_or(0.0, |&k| g[k].abs());
        if largest < 5e-2 {
            return Err(format!("{name}: the largest gradient is only {largest}; the model is too flat to test"));
        }
        for &k in order.iter().take(3) {
            let loss_at = |delta: f32| -> Result<f64, String> {
                let mut moved = params.clone();
                let p = moved.get_mut(name).ok_or(format!("no parameter {name}"))?;
                let mut v = vals(p);
                v[k] += delta;
                *p = Tensor::from_f32(&p.shape, v);
                Ok(step(&plan, &moved)?.0)
            };
            let numeric = (loss_at(h)? - loss_at(-h)?) / (2.0 * f64::from(h));
            let analytic = f64::from(g[k]);
            if (numeric - analytic).abs() > 2e-2 * analytic.abs().max(1e-2) {
                return Err(format!("{name}[{k}]: autodiff gives {analytic}, finite differences {numeric}"));
            }
        }
    }
    Ok(())
}

// ---- a tiny Llama-style model on every strategy -----------------------------------------------------

const TINY_MLP: &str = "  layer c_fc   = linear(hidden, ffn)\n  \
                        layer c_proj = linear(ffn, hidden, std: 0.02 / sqrt(2 * layers))\n\n  \
                        forward(x) {\n    return dropout(c_proj(gelu(c_fc(x), approx: \"tanh\")), p: pdrop)\n  }";

/// examples/tiny.opt with its MLP block's body replaced by `mlp`.
fn tiny_with_mlp(mlp: &str) -> String {
    let tiny = std::fs::read_to_string("examples/tiny.opt").expect("example");
    assert!(tiny.contains(TINY_MLP), "examples/tiny.opt has the MLP this test rewrites");
    tiny.replace(TINY_MLP, mlp)
}

/// A bias-free SwiGLU MLP body, with `product` as the value its `down` projects.
fn swiglu(product: &str) -> String {
    format!(
        "  layer gate = linear(hidden, ffn, bias: false)\n  layer up   = linear(hidden, ffn, bias: false)\n  \
         layer down = linear(ffn, hidden, bias: false, std: 0.02 / sqrt(2 * layers))\n\n  \
         forward(x) {{\n    return dropout({product}, p: pdrop)\n  }}"
    )
}

/// examples/tiny.opt with RMSNorm for every LayerNorm and a bias-free SwiGLU MLP.
fn tiny_llama() -> String {
    let text = tiny_with_mlp(&swiglu("down(silu(gate(x)) * up(x))"));
    assert!(text.contains("layernorm(hidden, eps: eps)"), "examples/tiny.opt has the norms this test rewrites");
    text.replace("layernorm(hidden, eps: eps)", "rms_norm(hidden, eps: eps)")
}

fn write_model(name: &str, text: &str) -> std::path::PathBuf {
    let dir = common::process_dir("llama-ops");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write model");
    path
}

fn optimusc(args: &[&str], model: &std::path::Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_optimusc"))
        .arg(args[0])
        .arg(model)
        .args(&args[1..])
        .output()
        .expect("optimusc runs");
    let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn a_tiny_llama_verifies_on_every_strategy() {
    let model = write_model("llama.opt", &tiny_llama());
    let meshes: [&[&str]; 4] = [
        &["--mesh", "2x2"],
        &["--mesh", "4x4"],
        &["--mesh", "1x4", "--strategy", "megatron"],
        &["--mesh", "1x1", "--strategy", "none"],
    ];
    for mesh in meshes {
        let args = [&["verify"][..], mesh].concat();
        let (ok, text) = optimusc(&args, &model);
        assert!(ok && text.contains("verified"), "{mesh:?}: {text}");
    }
}

#[test]
fn a_tiny_llama_verifies_with_selective_recompute_and_in_bf16() {
    let model = write_model("llama-levers.opt", &tiny_llama());
    for extra in [&["--recompute", "selective"][..], &["--precision", "bf16", "--tolerance", "2e-2"]] {
        let args = [&["verify", "--mesh", "2x2"][..], extra].concat();
        let (ok, text) = optimusc(&args, &model);
        assert!(ok && text.contains("verified"), "{extra:?}: {text}");
    }
}

/// Sizes that do not divide the mesh are refused, naming the size (the same rule as for any linear).
#[test]
fn a_tiny_llama_whose_ffn_does_not_divide_the_mesh_is_refused() {
    let model = write_model("llama-odd.opt", &tiny_llama());
    let (ok, text) = optimusc(
        &["compile", "--mesh", "1x4", "--strategy", "megatron", "--set", "ffn=126", "-o", "/dev/null"],
        &model,
    );
    assert!(!ok, "ffn = 126 on 4 devices must be refused: {text}");
    assert!(text.contains("126"), "the error names the size: {text}");
}

/// A product with an operand that is a pending sum (a row-parallel linear's output under megatron, a
/// vocabulary-parallel embedding under optimus) sums it first: a product of partial sums is not the
/// product of the sums, and `verify` would see the difference.
#[test]
fn products_of_pending_sums_are_summed_first() {
    let cases = [
        ("partial-times-whole.opt", swiglu("down(silu(gate(x)) * up(x)) * x"), "x = dropout(wte(tokens) + wpe"),
        ("partial-times-partial.opt", swiglu("mul(down(silu(gate(x)) * up(x)), down(up(x)))"), ""),
        ("embedding-product.opt", swiglu("down(silu(gate(x)) * up(x))"), "x = dropout(wte(tokens) * wpe"),
    ];
    for (name, mlp, top) in cases {
        let mut text = tiny_with_mlp(&mlp);
        if !top.is_empty() {
            text = text.replace("x = dropout(wte(tokens) + wpe", top);
        }
        let model = write_model(name, &text);
        for mesh in [&["--mesh", "1x4", "--strategy", "megatron"][..], &["--mesh", "2x2"]] {
            let args = [&["verify"][..], mesh].concat();
            let (ok, out) = optimusc(&args, &model);
            assert!(ok && out.contains("verified"), "{name} {mesh:?}: {out}");
        }
    }
}

/// (kind, group, elements) of every collective that is not a step of a SUMMA product.
fn collectives_outside_products(plan: &Plan) -> Vec<String> {
    let mut found: Vec<String> = plan
        .program
        .iter()
        .filter_map(|instr| match instr {
            Instr::Collective { collective, reason, .. } => {
                let summa =
                    plan.reasons.get(*reason as usize).is_some_and(|r| matches!(r.kind, ReasonKind::Summa { .. }));
                let elements: u64 = plan.buffer(collective.send).shape.iter().product();
                (!summa).then(|| format!("{:?} {:?} {elements}", collective.kind, collective.group))
            }
            _ => None,
        })
        .collect();
    found.sort();
    found
}

/// The SwiGLU gate's operands are split alike (column-parallel under megatron), so the product adds
/// no communication: against a bias-free GELU MLP, megatron's collectives are the same, and optimus's
/// differ only by the SUMMA steps of the extra linear.
#[test]
fn the_swiglu_product_needs_no_communication() {
    let gelu = tiny_with_mlp(
        "  layer c_fc   = linear(hidden, ffn, bias: false)\n  \
         layer c_proj = linear(ffn, hidden, bias: false, std: 0.02 / sqrt(2 * layers))\n\n  \
         forward(x) {\n    return dropout(c_proj(gelu(c_fc(x), approx: \"tanh\")), p: pdrop)\n  }",
    );
    let gated = tiny_with_mlp(&swiglu("down(silu(gate(x)) * up(x))"));
    for (mesh, strategy) in [((1, 4), Strategy::Megatron), ((2, 2), Strategy::Optimus), ((4, 4), Strategy::Optimus)] {
        let (a, b) = (train_plan(&gelu, mesh, strategy), train_plan(&gated, mesh, strategy));
        assert_eq!(collectives_outside_products(&a), collectives_outside_products(&b), "{mesh:?} {strategy:?}");
        if strategy == Strategy::Megatron {
            let count = |p: &Plan| p.program.iter().filter(|i| matches!(i, Instr::Collective { .. })).count();
            assert_eq!(count(&a), count(&b), "megatron: every collective is the same");
        }
    }
}

// ---- the verifier ----------------------------------------------------------------------------------

/// A hand-edited plan is refused: each RMSNorm kernel's normalised size and eps, the operands a
/// backward kernel reads element by element, the product's operand layouts, and input counts.
#[test]
fn the_verifier_refuses_edited_rms_norm_and_product_kernels() {
    let plan = train_plan(&tiny_llama(), (2, 2), Strategy::Optimus);
    let json = serde_json::to_value(&plan).expect("a plan serialises");
    assert!(optimus::plan::verify::verify(&plan).is_ok(), "the compiled plan verifies");
    let refused = |edit: &dyn Fn(&mut serde_json::Value) -> bool, needles: &[&str]| {
        let mut edited = json.clone();
        let program = edited["program"].as_array_mut().expect("a program");
        assert!(
            program.iter_mut().any(|i| i["instr"] == "kernel" && edit(i)),
            "no kernel took the edit for {needles:?}"
        );
        let edited: Plan = serde_json::from_value(edited).expect("the edit keeps the plan's types");
        let errors = optimus::plan::verify::verify(&edited).err().unwrap_or_default();
        assert!(errors.iter().any(|e| needles.iter().all(|n| e.contains(n))), "{needles:?} not in {errors:#?}");
    };
    let set = |kind: &'static str, field: &'static str, value: serde_json::Value| {
        move |i: &mut serde_json::Value| {
            let hit = i["kernel"]["kind"] == kind;
            if hit {
                i["kernel"][field] = value.clone();
            }
            hit
        }
    };
    refused(&set("rms_norm_apply", "n", serde_json::json!(16)), &["rms norm apply", "n = 16", "32 elements"]);
    refused(&set("rms_norm_grad_input", "eps", serde_json::json!(-1.0)), &["rms norm grad input", "eps = -1"]);
    refused(&set("rms_norm_grad_weight", "n", serde_json::json!(64)), &["rms norm grad weight", "n = 64"]);
    // dy and x of a backward kernel swapped for a differently shaped buffer: its row statistic.
    let swap_dy = |i: &mut serde_json::Value| {
        let hit = i["kernel"]["kind"] == "rms_norm_grad_sum";
        if hit {
            i["inputs"][0] = i["output"].clone();
        }
        hit
    };
    refused(&swap_dy, &["rms norm grad sum", "differ"]);
    let one_input = |i: &mut serde_json::Value| {
        let hit = i["kernel"]["kind"] == "mul";
        if hit {
            i["inputs"].as_array_mut().expect("inputs").truncate(1);
        }
        hit
    };
    refused(&one_input, &["mul", "takes 2 inputs, not 1"]);
}
