//! Input gradients summed through a tree of additions: a block whose input feeds several linears, their
//! outputs (through GELU or not) and the input itself added in a random tree, trains on a mesh as on
//! one device (`optimusc verify`), and every linear's input gradient of the tree takes one reduce a
//! SUMMA step together, whatever the tree's shape and order, with many tokens (products moving the
//! weights) or few (products keeping each weight in place), and in 3D.

mod common;

use common::optimusc;
use serde_json::Value;
use std::path::Path;

/// A small deterministic generator (64-bit LCG), so that every run tests the same trees.
struct Draw(u64);

impl Draw {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// One branch of the tree: a linear of the block's input, through GELU or not; the same linear may
/// appear twice.
fn branch(d: &mut Draw, linears: usize) -> String {
    let linear = format!("l{}(x)", d.below(linears));
    if d.below(2) == 0 { format!("gelu({linear}, approx: \"tanh\")") } else { linear }
}

/// The block's forward expression: its terms added in a random binary tree.
fn random_tree(d: &mut Draw, mut terms: Vec<String>) -> String {
    while terms.len() > 1 {
        let i = d.below(terms.len());
        let a = terms.remove(i);
        let j = d.below(terms.len());
        let b = terms.remove(j);
        terms.push(format!("({a} + {b})"));
    }
    terms.pop().unwrap_or_default()
}

/// examples/tiny.opt with its MLP replaced by a block of `linears` hidden -> hidden linears whose
/// outputs `forward` combines, then a projection; returns the model's text.
fn model_with(forward: &str, linears: usize) -> String {
    let tiny = std::fs::read_to_string("examples/tiny.opt").expect("examples/tiny.opt");
    let start = tiny.find("block Mlp {").expect("the MLP block");
    let end = start + tiny[start..].find("\n}\n").expect("its end") + 3;
    let layers: String = (0..linears).map(|i| format!("  layer l{i} = linear(hidden, hidden)\n")).collect();
    let block = format!(
        "block Mlp {{\n{layers}  layer c_proj = linear(hidden, hidden)\n\n  forward(x) {{\n    return c_proj({forward})\n  }}\n}}\n"
    );
    format!("{}{block}{}", &tiny[..start], &tiny[end..])
}

/// The collectives of a compiled plan's MLPs (`inspect --json`'s communication entries).
fn mlp_collectives(plan: &Path) -> Vec<Value> {
    let inspected = optimusc(&["inspect", plan.to_str().expect("utf-8 path"), "--json"]);
    assert!(inspected.status.success(), "{}", String::from_utf8_lossy(&inspected.stderr));
    let report: Value = serde_json::from_slice(&inspected.stdout).expect("inspect's JSON");
    let communication = report["communication"].as_array().expect("communication");
    let in_mlp = |c: &&Value| c["origin"]["scope"].as_str().is_some_and(|s| s.contains(".mlp."));
    communication.iter().filter(in_mlp).cloned().collect()
}

/// How many of `collectives` are of a kind in `kinds` and give a reason that `reason` accepts.
fn count(collectives: &[Value], kinds: &[&str], reason: impl Fn(&str) -> bool) -> usize {
    let kind_listed = |c: &&Value| kinds.iter().any(|k| c["kind"] == *k);
    collectives.iter().filter(kind_listed).filter(|c| c["origin"]["reason"].as_str().is_some_and(&reason)).count()
}

/// The linears of the block that `forward` calls exactly once (l0, l1, ...).
fn linears_called_once(forward: &str, linears: usize) -> usize {
    (0..linears).filter(|i| forward.matches(&format!("l{i}(x)")).count() == 1).count()
}

#[test]
fn random_trees_of_linears_of_one_input_verify_and_reduce_their_input_gradients_once() {
    let mut d = Draw(20_261_129);
    let dir = common::scratch("summed-gradients", "trees");
    for case in 0..12 {
        let linears = 2 + d.below(3);
        let mut terms: Vec<String> = (0..2 + d.below(3)).map(|_| branch(&mut d, linears)).collect();
        if d.below(2) == 0 {
            terms.push("x".to_string());
        }
        let forward = random_tree(&mut d, terms);
        let path = dir.join(format!("case-{case}.opt"));
        std::fs::write(&path, model_with(&forward, linears)).expect("the model");
        let model = path.to_str().expect("utf-8 path");
        // Every fourth case in 3D (2x2x2: local products, each reduce-scattered once); else optimus
        // on 2x2 or 4x4, every other case wide with few tokens, so that each weight stays in place
        // and its products move the tokens' blocks instead (the products keeping B in place).
        let three_d = case % 4 == 0;
        let q: u64 = if case % 3 == 2 { 4 } else { 2 };
        let (mesh, strategy) = if three_d { ("2x2x2".to_string(), "3d") } else { (format!("{q}x{q}"), "optimus") };
        let few_tokens = case % 2 == 1;
        let mut sets = vec!["heads=4".to_string()];
        if few_tokens {
            sets.extend(["hidden=512".to_string(), format!("batch={q}"), format!("seq={}", 8 / q)]);
        }
        let set_args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s.as_str()]).collect();
        let what = format!("case {case} on {mesh} ({sets:?}): c_proj({forward})");

        let verify =
            [&["verify", model, "--mesh", &mesh, "--strategy", strategy, "--steps", "2"][..], &set_args].concat();
        let out = optimusc(&verify);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("verified"),
            "{what}\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );

        let plan = dir.join(format!("case-{case}.json"));
        let target = ["compile", model, "--mesh", &mesh, "--strategy", strategy];
        let compile = [&target[..], &["-o", plan.to_str().expect("utf-8")], &set_args].concat();
        let compiled = optimusc(&compile);
        assert!(compiled.status.success(), "{what}\n{}", String::from_utf8_lossy(&compiled.stderr));
        let text = std::fs::read_to_string(&plan).expect("the plan");
        assert_eq!(text.contains("(B in place)"), few_tokens, "{what}: weights in place exactly with few tokens");
        let collectives = mlp_collectives(&plan);
        // Each of the two layers: c_proj's dX, and the tree's terms summed into one, a reduce each a
        // SUMMA step (in 3D one reduce-scatter); one product for every term would reduce per term.
        let reductions_each = if three_d { 1 } else { q as usize };
        let reduced = count(&collectives, &["reduce", "reduce_scatter"], |r| r.contains("dX = dY W^T"));
        assert_eq!(reduced, 2 * 2 * reductions_each, "{what}");
        if three_d {
            continue;
        }
        // Forward, with few tokens: only the inputs' blocks move, each step's broadcast once for the
        // block's linears of x and once for c_proj (a broadcast per linear were they not shared).
        if few_tokens {
            let forward_broadcasts = count(&collectives, &["broadcast"], |r| r.starts_with("linear"));
            assert_eq!(forward_broadcasts, 2 * 2 * q as usize, "{what}: forward broadcasts");
        }
        // The weight gradients of linears called once (each its parameter's whole gradient) share X's
        // broadcasts, with many tokens or few.
        let shared_dw = count(&collectives, &["broadcast"], |r| r.contains("sharing X's broadcasts"));
        assert_eq!(shared_dw > 0, linears_called_once(&forward, linears) > 1, "{what}: dW sharing X");
    }
}
