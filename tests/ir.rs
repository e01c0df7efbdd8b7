//! IR snapshots of every example (gpt3 at two layers) and the parameter counts of the full-size models.

use optimus::elab::Override;
use optimus::front::check_source;
use optimus::ir::Model;
use optimus::ir::print::print_model;

/// Every example in examples/; a new example must get a snapshot here.
const EXAMPLES: [&str; 7] = ["bert", "gpt2", "gpt2_manual_attention", "gpt3", "llama", "tiny", "tinyllama"];

fn example_source(name: &str) -> String {
    let path = format!("{}/examples/{name}.opt", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"))
}

/// Checks an example with `--set` overrides; it must produce a model and no diagnostics at all.
fn check_example(name: &str, sets: &[(&str, &str)]) -> (Model, String) {
    let source = example_source(name);
    let overrides: Vec<Override> =
        sets.iter().map(|(n, v)| Override { name: (*n).to_string(), value: (*v).to_string() }).collect();
    let checked = check_source(&source, &overrides);
    assert!(checked.diagnostics.is_empty(), "{name} has diagnostics: {:?}", checked.diagnostics);
    let model = checked.model.unwrap_or_else(|| panic!("{name} did not produce a model"));
    (model, source)
}

fn ir_of(name: &str, sets: &[(&str, &str)]) -> String {
    let (model, source) = check_example(name, sets);
    print_model(&model, &source)
}

#[test]
fn every_example_has_a_snapshot() {
    let dir = format!("{}/examples", env!("CARGO_MANIFEST_DIR"));
    let mut found: Vec<String> = std::fs::read_dir(&dir)
        .expect("examples/ is readable")
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".opt").map(str::to_string))
        .collect();
    found.sort();
    assert_eq!(found, EXAMPLES, "examples/ changed: add or remove its IR snapshot in tests/ir.rs");
}

#[test]
fn gpt2_ir() {
    insta::assert_snapshot!(ir_of("gpt2", &[]));
}

#[test]
fn gpt3_two_layers_ir() {
    insta::assert_snapshot!(ir_of("gpt3", &[("layers", "2")]));
}

#[test]
fn bert_ir() {
    insta::assert_snapshot!(ir_of("bert", &[]));
}

#[test]
fn llama_two_layers_ir() {
    insta::assert_snapshot!(ir_of("llama", &[("layers", "2")]));
}

#[test]
fn tinyllama_two_layers_ir() {
    insta::assert_snapshot!(ir_of("tinyllama", &[("layers", "2")]));
}

#[test]
fn tiny_ir() {
    insta::assert_snapshot!(ir_of("tiny", &[]));
}

#[test]
fn gpt2_manual_attention_ir() {
    insta::assert_snapshot!(ir_of("gpt2_manual_attention", &[]));
}

#[test]
fn parameter_counts_at_defaults() {
    let count = |name: &str| check_example(name, &[]).0.parameter_count();
    assert_eq!(count("gpt2"), 124_439_808);
    assert_eq!(count("bert"), 335_174_458);
    assert_eq!(count("gpt3"), 174_604_259_328);
    // Llama: 2 * vocab * hidden (embedding, untied head) + hidden (final norm) + per layer
    // hidden * (2 * hidden + 2 * kv_heads * head) (q, o, k, v) + 3 * hidden * ffn + 2 * hidden (norms).
    assert_eq!(count("llama"), 8_030_261_248);
    assert_eq!(count("tinyllama"), 1_100_048_384);
}

#[test]
fn overrides_change_the_model() {
    let (model, _) = check_example("gpt3", &[("layers", "2")]);
    let layers = model.config.iter().find(|c| c.name == "layers").expect("gpt3 has `layers`");
    assert!(layers.overridden);
    assert_eq!(layers.value, optimus::plan::types::Scalar::Int(2));
    // Two of the 96 layers: the embeddings and final norm are shared, each layer holds 12 * 12288^2 + 13 * 12288.
    let per_layer: u128 = 12 * 12288 * 12288 + 13 * 12288;
    let full = check_example("gpt3", &[]).0.parameter_count();
    assert_eq!(full - model.parameter_count(), 94 * per_layer);
}

/// A factored dimension's factors multiply to its size, in every node of every example and of a fused
/// attention whose qkv projection is factored otherwise than (3, heads, head) (whose result once kept
/// the factors (2, 4) on a dimension of 16).
#[test]
fn factored_dimensions_multiply_to_their_size() {
    let fused = "model m\ninput x: f32[2, 4, 16]\nlayer q = linear(16, [6, 2, 4])\nforward {\n  output y = self_attention(q(x), heads: 2)\n}\n";
    let mut models: Vec<(String, Model)> = ["tiny", "gpt2", "gpt2_manual_attention", "llama", "tinyllama", "bert"]
        .iter()
        .map(|name| (name.to_string(), check_example(name, &[]).0))
        .collect();
    let checked = check_source(fused, &[]);
    models.push(("fused (6, 2, 4)".to_string(), checked.model.expect("the fused model checks")));
    for (name, model) in &models {
        for node in model.graph.node_weights() {
            for dim in node.ty.shape.iter().filter(|d| !d.factors.is_empty()) {
                let product: u64 = dim.factors.iter().map(|f| f.size).product();
                assert_eq!(product, dim.size, "{name}: {:?} of {:?}", dim, node.op);
            }
        }
    }
}
