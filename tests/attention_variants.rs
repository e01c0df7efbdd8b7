//! Rotary position embeddings and grouped-query attention: the CPU kernels against direct formulas
//! (rotary against Hugging Face's `rotate_half` written out in f64, grouped-query attention against
//! ordinary attention over key/value heads repeated heads / kv_heads times), their backward passes
//! against finite differences, and tiny Llama-like models whose sharded plans `optimusc verify` checks
//! against one device on every strategy.

mod common;

use optimus::plan::tensor::Tensor;
use optimus::plan::{Kernel, Mesh};
use std::process::Command;

mod cpu_kernel;
use cpu_kernel::eval;

type R = Result<(), String>;

/// A small deterministic generator of values in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn tensor(&mut self, shape: &[u64]) -> Tensor {
        let n = shape.iter().product::<u64>() as usize;
        Tensor::from_f32(shape, (0..n).map(|_| self.next()).collect())
    }
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.f32().expect("f32 tensor").to_vec()
}

/// Every |got - want| within `tol` (absolute).
fn close(got: &[f32], want: &[f64], tol: f64) -> R {
    if got.len() != want.len() {
        return Err(format!("{} values, expected {}", got.len(), want.len()));
    }
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if (f64::from(g) - w).abs() > tol {
            return Err(format!("element {i}: {g} vs {w} (tolerance {tol})"));
        }
    }
    Ok(())
}

/// Every |got - want| within `tol` relative to the largest |want| (at least 1).
fn close_rel(got: &[f32], want: &[f64], tol: f64) -> R {
    let scale = want.iter().fold(1.0f64, |m, w| m.max(w.abs()));
    close(got, want, tol * scale)
}

/// sum(dy * f(x)) differentiated by central differences in each element of x.
fn numeric_grad(x: &Tensor, dy: &[f32], f: impl Fn(&Tensor) -> Result<Tensor, String>) -> Result<Vec<f64>, String> {
    let base = vals(x);
    let h = 1e-2f32;
    let mut grad = Vec::with_capacity(base.len());
    for i in 0..base.len() {
        let at = |delta: f32| -> Result<f64, String> {
            let mut v = base.clone();
            v[i] += delta;
            let y = f(&Tensor::from_f32(&x.shape, v))?;
            Ok(vals(&y).iter().zip(dy).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum())
        };
        grad.push((at(h)? - at(-h)?) / (2.0 * f64::from(h)));
    }
    Ok(grad)
}

// ---- rotary ---------------------------------------------------------------------------------------

/// Hugging Face Llama, written out: inv_freq = 1 / theta ** (arange(0, d, 2).float() / d) and
/// freqs = pos.float() * inv_freq in float32; emb = cat(freqs, freqs); the result is
/// x cos(emb) + rotate_half(x) sin(emb), with rotate_half(x) = cat(-x2, x1) per head. The products are taken in f64. The float32
/// power is the correctly rounded one (torch's float32 pow is within one ulp of it).
fn rotary_reference(x: &[f32], shape: &[u64], heads: usize, theta: f64) -> Vec<f64> {
    let (seq, width) = (shape[shape.len() - 2] as usize, shape[shape.len() - 1] as usize);
    let d = width / heads;
    let power = |i: usize| (theta as f32 as f64).powf(f64::from((2 * i) as f32 / d as f32)) as f32;
    let inv_freq: Vec<f32> = (0..d / 2).map(|i| 1.0f32 / power(i)).collect();
    let mut out = vec![0.0f64; x.len()];
    for (row, (xr, yr)) in x.chunks(width).zip(out.chunks_mut(width)).enumerate() {
        let pos = (row % seq) as f32;
        for (xh, yh) in xr.chunks(d).zip(yr.chunks_mut(d)) {
            for j in 0..d {
                let angle = f64::from(pos * inv_freq[j % (d / 2)]);
                let rotated = if j < d / 2 { -f64::from(xh[j + d / 2]) } else { f64::from(xh[j - d / 2]) };
                yh[j] = f64::from(xh[j]) * angle.cos() + rotated * angle.sin();
            }
        }
    }
    out
}

#[test]
fn rotary_matches_hugging_face_rotate_half() -> R {
    let mut rng = Rng(1);
    for (shape, heads, theta) in
        [(vec![2u64, 5, 12], 3u64, 10000.0), (vec![7, 8], 2, 500000.0), (vec![2, 3, 4, 16], 4, 10000.0)]
    {
        let x = rng.tensor(&shape);
        let want = rotary_reference(&vals(&x), &shape, heads as usize, theta);
        let got = eval(&Kernel::Rotary { heads, theta }, &[&x], &shape)?;
        close(&vals(&got), &want, 1e-6).map_err(|e| format!("{shape:?} heads {heads}: {e}"))?;
    }
    Ok(())
}

#[test]
fn rotary_matches_hugging_face_at_positions_into_the_thousands() -> R {
    // At position 4000 the angle of the fastest pair is 4000 rad: its float32 rounding (2.4e-4) must be
    // Hugging Face's, or the rotation is off far beyond 1e-6.
    let mut rng = Rng(2);
    let shape = [1u64, 4096, 64];
    let x = rng.tensor(&shape);
    let want = rotary_reference(&vals(&x), &shape, 1, 10000.0);
    let got = eval(&Kernel::Rotary { heads: 1, theta: 10000.0 }, &[&x], &shape)?;
    close(&vals(&got), &want, 1e-6)
}

#[test]
fn rotary_backward_is_the_inverse_rotation_and_matches_finite_differences() -> R {
    let mut rng = Rng(3);
    let shape = [2u64, 6, 8];
    let (x, dy) = (rng.tensor(&shape), rng.tensor(&shape));
    let (forward, backward) =
        (Kernel::Rotary { heads: 2, theta: 100.0 }, Kernel::RotaryGrad { heads: 2, theta: 100.0 });
    let analytic = eval(&backward, &[&dy], &shape)?;
    let numeric = numeric_grad(&x, &vals(&dy), |x| eval(&forward, &[x], &shape))?;
    close_rel(&vals(&analytic), &numeric, 1e-3)?;
    // A rotation's transpose is its inverse: backward(forward(x)) = x.
    let round_trip = eval(&backward, &[&eval(&forward, &[&x], &shape)?], &shape)?;
    close(&vals(&round_trip), &vals(&x).iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), 1e-6)
}

#[test]
fn rotary_refuses_an_odd_head_size_or_heads_that_do_not_divide() {
    let x = Tensor::from_f32(&[2, 6], vec![0.0; 12]);
    assert!(eval(&Kernel::Rotary { heads: 2, theta: 10.0 }, &[&x], &[2, 6]).is_err(), "head size 3");
    assert!(eval(&Kernel::Rotary { heads: 4, theta: 10.0 }, &[&x], &[2, 6]).is_err(), "4 heads of 6");
    assert!(eval(&Kernel::Rotary { heads: 3, theta: 10.0 }, &[&x], &[2, 6]).is_ok());
}

// ---- grouped-query attention ----------------------------------------------------------------------

/// k or v [batch, seq, kv_heads * d] with each head repeated `group` times: [batch, seq, heads * d].
fn repeat_kv(t: &Tensor, kv_heads: usize, group: usize) -> Tensor {
    let width = *t.shape.last().expect("rank") as usize;
    let d = width / kv_heads;
    let v = vals(t);
    let repeated: Vec<f32> = v
        .chunks(width)
        .flat_map(|row| (0..kv_heads * group).flat_map(move |h| row[(h / group) * d..][..d].to_vec()))
        .collect();
    let mut shape = t.shape.clone();
    *shape.last_mut().expect("rank") = (width * group) as u64;
    Tensor::from_f32(&shape, repeated)
}

/// The sum over each kv head's `group` repeated heads of a [.., heads * d] gradient.
fn sum_groups(g: &[f32], heads: usize, kv_heads: usize, d: usize) -> Vec<f64> {
    let group = heads / kv_heads;
    g.chunks(heads * d)
        .flat_map(|row| {
            (0..kv_heads * d).map(move |c| {
                let (kv, e) = (c / d, c % d);
                (0..group).map(|r| f64::from(row[(kv * group + r) * d + e])).sum::<f64>()
            })
        })
        .collect()
}

/// Shapes of a grouped-query case: [batch, seq, heads * d] for q, [batch, seq, kv_heads * d] for k, v.
struct Gqa {
    batch: u64,
    seq: u64,
    heads: u64,
    kv_heads: u64,
    d: u64,
}

impl Gqa {
    fn q_shape(&self) -> [u64; 3] {
        [self.batch, self.seq, self.heads * self.d]
    }

    fn kv_shape(&self) -> [u64; 3] {
        [self.batch, self.seq, self.kv_heads * self.d]
    }
}

#[test]
fn grouped_query_attention_is_attention_over_repeated_kv_heads() -> R {
    let mut rng = Rng(4);
    // Sequences past one query tile (64 rows) exercise the tiled path too.
    for g in
        [Gqa { batch: 2, seq: 5, heads: 4, kv_heads: 2, d: 3 }, Gqa { batch: 1, seq: 70, heads: 6, kv_heads: 2, d: 4 }]
    {
        let (q, k, v) = (rng.tensor(&g.q_shape()), rng.tensor(&g.kv_shape()), rng.tensor(&g.kv_shape()));
        let group = (g.heads / g.kv_heads) as usize;
        let (k_rep, v_rep) = (repeat_kv(&k, g.kv_heads as usize, group), repeat_kv(&v, g.kv_heads as usize, group));
        for causal in [true, false] {
            let gqa = Kernel::Attention { heads: g.heads, kv_heads: g.kv_heads, causal, fused: false };
            let mha = Kernel::Attention { heads: g.heads, kv_heads: g.heads, causal, fused: false };
            let got = eval(&gqa, &[&q, &k, &v], &g.q_shape())?;
            let want = eval(&mha, &[&q, &k_rep, &v_rep], &g.q_shape())?;
            let want: Vec<f64> = vals(&want).iter().map(|&x| f64::from(x)).collect();
            close(&vals(&got), &want, 1e-6).map_err(|e| format!("forward causal={causal} seq {}: {e}", g.seq))?;
            // The backward: dq as for the repeated heads, dk and dv summed over each group.
            let dy = rng.tensor(&g.q_shape());
            for wrt in 0..3u8 {
                let shape = if wrt == 0 { g.q_shape() } else { g.kv_shape() };
                let grad = Kernel::AttentionGrad { heads: g.heads, kv_heads: g.kv_heads, causal, fused: false, wrt };
                let got = eval(&grad, &[&dy, &q, &k, &v], &shape)?;
                let mha_grad = Kernel::AttentionGrad { heads: g.heads, kv_heads: g.heads, causal, fused: false, wrt };
                let full = vals(&eval(&mha_grad, &[&dy, &q, &k_rep, &v_rep], &g.q_shape())?);
                let want = if wrt == 0 {
                    full.iter().map(|&x| f64::from(x)).collect()
                } else {
                    sum_groups(&full, g.heads as usize, g.kv_heads as usize, g.d as usize)
                };
                close(&vals(&got), &want, 1e-5).map_err(|e| format!("wrt {wrt} causal={causal}: {e}"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn grouped_query_attention_grads_match_finite_differences() -> R {
    let mut rng = Rng(5);
    let g = Gqa { batch: 2, seq: 4, heads: 4, kv_heads: 2, d: 2 };
    let (q, k, v, dy) =
        (rng.tensor(&g.q_shape()), rng.tensor(&g.kv_shape()), rng.tensor(&g.kv_shape()), rng.tensor(&g.q_shape()));
    let operands = [&q, &k, &v];
    let forward = Kernel::Attention { heads: g.heads, kv_heads: g.kv_heads, causal: true, fused: false };
    for wrt in 0..3u8 {
        let grad = Kernel::AttentionGrad { heads: g.heads, kv_heads: g.kv_heads, causal: true, fused: false, wrt };
        let x = operands[usize::from(wrt)];
        let analytic = eval(&grad, &[&dy, &q, &k, &v], &x.shape)?;
        let numeric = numeric_grad(x, &vals(&dy), |x| {
            let mut ops = operands;
            ops[usize::from(wrt)] = x;
            eval(&forward, &ops, &g.q_shape())
        })?;
        close_rel(&vals(&analytic), &numeric, 2e-3).map_err(|e| format!("wrt {wrt}: {e}"))?;
    }
    Ok(())
}

#[test]
fn grouped_query_attention_refuses_mismatched_heads() {
    let g = Gqa { batch: 1, seq: 3, heads: 4, kv_heads: 2, d: 2 };
    let mut rng = Rng(6);
    let (q, k, v) = (rng.tensor(&g.q_shape()), rng.tensor(&g.kv_shape()), rng.tensor(&g.kv_shape()));
    let with = |heads, kv_heads| Kernel::Attention { heads, kv_heads, causal: true, fused: false };
    assert!(eval(&with(4, 3), &[&q, &k, &v], &g.q_shape()).is_err(), "4 heads over 3 kv heads");
    assert!(eval(&with(4, 1), &[&q, &k, &v], &g.q_shape()).is_err(), "k holds 2 heads, not 1");
    assert!(eval(&with(4, 2), &[&q, &k, &v], &g.q_shape()).is_ok());
    let fused = rng.tensor(&[1, 3, 24]);
    let fused_gqa = Kernel::Attention { heads: 4, kv_heads: 2, causal: true, fused: true };
    assert!(eval(&fused_gqa, &[&fused], &g.q_shape()).is_err(), "a fused input has one kv head per head");
}

// ---- models ---------------------------------------------------------------------------------------

/// examples/tiny.opt with Llama's attention: bias-free q, k and v projections (k and v of `kv_heads`
/// heads), rotary embeddings on q and k, and `heads` / `kv_heads` set as given.
fn llama_like(heads: u64, kv_heads: u64) -> String {
    let tiny = std::fs::read_to_string("examples/tiny.opt").expect("example");
    let attention = "block Attention {
  layer q_proj = linear(hidden, hidden, bias: false)
  layer k_proj = linear(hidden, kv_heads * head, bias: false)
  layer v_proj = linear(hidden, kv_heads * head, bias: false)
  layer c_proj = linear(hidden, hidden, std: 0.02 / sqrt(2 * layers))

  forward(x) {
    q = rotary(q_proj(x), heads: heads, theta: rope_theta)
    k = rotary(k_proj(x), heads: kv_heads, theta: rope_theta)
    y = self_attention(q, k, v_proj(x), heads: heads, kv_heads: kv_heads)
    return dropout(c_proj(y), p: pdrop)
  }
}";
    let start = tiny.find("block Attention {").expect("the attention block");
    let end = start + tiny[start..].find("\n}\n").expect("its end") + 2;
    let text = format!("{}{attention}{}", &tiny[..start], &tiny[end..]);
    let text = text
        .replace("  heads   = 8\n", &format!("  heads   = {heads}\n  kv_heads = {kv_heads}\n  rope_theta = 10000.0\n"));
    assert!(text.contains("kv_heads = ") && text.contains("rotary(q_proj(x)"), "the edits apply");
    text
}

fn write_model(name: &str, text: &str) -> std::path::PathBuf {
    let dir = common::process_dir("attention-variants");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let model = dir.join(name);
    std::fs::write(&model, text).expect("write model");
    model
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

fn verifies(model: &std::path::Path, mesh: &[&str]) {
    let mut args = vec!["verify"];
    args.extend(mesh);
    let (ok, text) = optimusc(&args, model);
    assert!(ok && text.contains("verified"), "{mesh:?}: {text}");
}

#[test]
fn a_llama_like_model_with_grouped_queries_and_rotary_verifies_on_every_strategy() {
    let model = write_model("gqa_8_4.opt", &llama_like(8, 4));
    for mesh in [
        &["--mesh", "2x2"][..],
        &["--mesh", "4x4"],
        &["--mesh", "1x4", "--strategy", "megatron"],
        &["--mesh", "1x1", "--strategy", "none"],
    ] {
        verifies(&model, mesh);
    }
}

#[test]
fn two_kv_heads_of_four_split_two_ways_verify() {
    let model = write_model("gqa_4_2.opt", &llama_like(4, 2));
    for mesh in [&["--mesh", "2x2"][..], &["--mesh", "1x2", "--strategy", "megatron"]] {
        verifies(&model, mesh);
    }
}

#[test]
fn rotary_with_one_kv_head_per_query_head_verifies() {
    let model = write_model("mha_rotary.opt", &llama_like(8, 8));
    for mesh in [&["--mesh", "2x2"][..], &["--mesh", "1x4", "--strategy", "megatron"]] {
        verifies(&model, mesh);
    }
}

#[test]
fn kv_heads_that_a_mesh_cannot_split_name_the_config_line_and_the_meshes_that_work() {
    // 2 kv heads cannot be split 4 ways on a 1x4 megatron mesh (8 query heads could).
    let model = write_model("gqa_8_2.opt", &llama_like(8, 2));
    let plan = model.with_extension("json");
    let plan = plan.to_str().expect("a UTF-8 path");
    let (ok, text) = optimusc(&["compile", "--mesh", "1x4", "--strategy", "megatron", "--output", plan], &model);
    assert!(!ok, "{text}");
    assert!(text.contains("`kv_heads` (2) cannot be split 4 ways"), "{text}");
    assert!(text.contains("kv_heads = 2"), "points at the config line: {text}");
    assert!(text.contains("1x1, 1x2"), "lists the meshes that work: {text}");
}

/// Attention and rotary over [seq, width] (no batch dimension): dimension 0 is the sequence.
const UNBATCHED: &str = "model unbatched
config { vocab = 16; batch = 2; seq = 4; heads = 2; hidden = 8 }
input tokens: i32[batch, seq]
input targets: i32[batch, seq]
layer wte = embedding(vocab, hidden)
layer q = linear(hidden, hidden, bias: false)
layer k = linear(hidden, hidden, bias: false)
layer v = linear(hidden, hidden, bias: false)
layer head = linear(hidden, vocab)
forward {
  x = reshape(wte(tokens), [batch * seq, hidden])
  y = self_attention(rotary(q(x), heads: heads), rotary(k(x), heads: heads), v(x), heads: heads)
  output loss = cross_entropy(reshape(head(y), [batch, seq, vocab]), targets)
}
";

#[test]
fn attention_and_rotary_over_an_unbatched_sequence_keep_it_whole() {
    let model = write_model("unbatched.opt", UNBATCHED);
    verifies(&model, &["--mesh", "1x2", "--strategy", "megatron"]);
    // Optimus splits dimension 0 of activations on mesh axis 0; here that is the sequence, which
    // attention and rotary must gather (the plan verifier refuses a split sequence).
    let plan = model.with_extension("json");
    let (ok, text) = optimusc(&["compile", "--mesh", "2x2", "--output", plan.to_str().expect("UTF-8")], &model);
    assert!(ok, "{text}");
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("JSON");
    let buffers = plan["buffers"].as_array().expect("buffers");
    let mut checked = 0;
    for instr in plan["program"].as_array().expect("program") {
        let kind = instr["kernel"]["kind"].as_str().unwrap_or_default();
        if !["attention", "attention_grad", "rotary", "rotary_grad"].contains(&kind) {
            continue;
        }
        for b in instr["inputs"].as_array().expect("inputs") {
            let layout = &buffers[b.as_u64().expect("an id") as usize]["layout"];
            assert_ne!(layout[0]["dim"], 0, "{kind} reads a split sequence: {layout}");
            checked += 1;
        }
    }
    assert!(checked >= 8, "{checked} operands checked");
}

// ---- the verifier ---------------------------------------------------------------------------------

/// The Llama-like model compiled on a 2x2 optimus mesh (training), as JSON.
fn llama_like_2x2_plan() -> serde_json::Value {
    use optimus::shard::{Target, compile};
    let text = llama_like(8, 4);
    let model = optimus::front::check_source(&text, &[]).model.expect("the model checks");
    let target = Target::plain(Mesh::new(2, 2), optimus::plan::Strategy::Optimus, optimus::plan::Mode::Train);
    let plan = compile(&model, "llama_like.opt", &text, target).expect("compiles on 2x2");
    serde_json::to_value(plan).expect("a plan serialises")
}

/// The verifier's errors after `edit` changes the first kernel of `kind`.
fn errors_after(kind: &str, edit: impl Fn(&mut serde_json::Value)) -> Vec<String> {
    let mut plan = llama_like_2x2_plan();
    let program = plan["program"].as_array_mut().expect("a program");
    let instr = program.iter_mut().find(|i| i["kernel"]["kind"] == kind).expect("a kernel of that kind");
    edit(instr);
    let plan: optimus::plan::Plan = serde_json::from_value(plan).expect("the edit keeps the plan's types");
    optimus::plan::verify::verify(&plan).err().unwrap_or_default()
}

#[test]
fn the_verifier_refuses_hand_edited_rotary_and_grouped_attention_kernels() {
    let refused = |kind: &str, edit: &dyn Fn(&mut serde_json::Value), needle: &str| {
        let errors = errors_after(kind, edit);
        assert!(errors.iter().any(|e| e.contains(needle)), "{kind}: expected `{needle}` in {errors:#?}");
    };
    assert!(errors_after("rotary", |_| {}).is_empty(), "the compiled plan verifies");
    refused("rotary", &|i| i["kernel"]["heads"] = 3.into(), "do not divide the width");
    refused("rotary", &|i| i["kernel"]["heads"] = 16.into(), "even head size");
    refused("rotary", &|i| i["kernel"]["theta"] = (-1.0).into(), "not a positive number");
    refused("attention", &|i| i["kernel"]["kv_heads"] = 3.into(), "cannot be grouped over 3");
    refused("attention", &|i| i["kernel"]["kv_heads"] = 4.into(), "do not match");
    refused("attention_grad", &|i| i["kernel"]["kv_heads"] = 1.into(), "do not match");
}
