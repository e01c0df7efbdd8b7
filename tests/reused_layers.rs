//! A layer applied more than once, in shapes the examples do not have, trains on every strategy as on
//! one device (`optimusc verify`): a sequence-mixing linear applied twice, a linear applied twice
//! before a layer over the sequence, and a widening linear applied to two different values (whose
//! backward pass wants the token ids in a second layout). Each compiled, then failed, before its fix.

mod common;

use common::{optimusc, scratch};
use optimus::plan::Plan;

/// The meshes and strategies each model is verified on.
const MESHES: [(&str, &str); 5] =
    [("optimus", "2x2"), ("optimus", "4x4"), ("tesseract", "2x2x2"), ("megatron", "1x2"), ("3d", "2x2x2")];

/// A model of 24 tokens, hidden 16, batch 8 and 4 positions with `layers` and `forward`'s body.
fn model(name: &str, layers: &str, forward: &str) -> String {
    format!(
        "model {name}\nconfig {{ vocab = 24; hidden = 16; batch = 8; seq = 4 }}\n\
         input tokens: i32[batch, seq]\ninput targets: i32[batch, seq]\n\
         layer emb = embedding(vocab, hidden)\nlayer head = linear(hidden, vocab)\n{layers}\n\
         forward {{\n{forward}\n}}\n"
    )
}

/// Verifies `source` on every mesh of [`MESHES`], plus `extra` ones.
fn verifies_everywhere(name: &str, source: &str, extra: &[(&str, &str)]) {
    common::verifies_on("reused_layers", name, source, &[&MESHES[..], extra].concat());
}

#[test]
fn a_sequence_mixing_linear_applied_twice_verifies() {
    // Its weight gradient is a sum of two pending sums, one of them laid out over the rows: the
    // compiler sliced that one as a pending sum, and the verifier refused its own plan (E0699).
    let source = model(
        "mix_twice",
        "layer s = linear(seq, seq)",
        "  y = transpose(s(s(transpose(emb(tokens), 1, 2))), 1, 2)\n  output loss = cross_entropy(head(y), targets)",
    );
    verifies_everywhere("mix_twice", &source, &[]);
}

#[test]
fn a_linear_applied_twice_before_a_linear_over_the_sequence_verifies() {
    let source = model(
        "twice_then_mix",
        "layer f = linear(hidden, hidden)\nlayer s = linear(seq, seq)",
        "  t = s(transpose(f(f(emb(tokens))), 1, 2))\n  output loss = cross_entropy(head(transpose(t, 1, 2)), targets)",
    );
    verifies_everywhere("twice_then_mix", &source, &[]);
}

#[test]
fn token_ids_wanted_in_a_second_layout_are_read_again_not_communicated() {
    // A widening linear applied to two values: under 3D its backward pass wants the embedding's
    // gradient, so the token ids, in a layout the lookup did not read them in. They were gathered over
    // the row, which the runtimes refuse for integers: the plan compiled and failed on every device.
    let source = model(
        "widen_twice",
        "layer f = linear(hidden, hidden)\nlayer u = linear(hidden, 3 * hidden)\nlayer d = linear(3 * hidden, hidden)",
        "  x = emb(tokens)\n  output loss = cross_entropy(head(d(u(f(x)) + u(x))), targets)",
    );
    verifies_everywhere("widen_twice", &source, &[("3d", "2x2x2x2")]);
    let dir = scratch("reused_layers", "widen_twice_plan");
    let (model, plan) = (dir.join("widen.opt"), dir.join("widen.json"));
    std::fs::write(&model, &source).expect("the model is written");
    let (model, plan_path) = (model.to_string_lossy().into_owned(), plan.to_string_lossy().into_owned());
    let out = optimusc(&["compile", &model, "--strategy", "3d", "--mesh", "2x2x2", "-o", &plan_path]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let plan: Plan = serde_json::from_slice(&std::fs::read(&plan).expect("the plan")).expect("a plan");
    let layouts = plan.inputs.iter().filter(|i| i.name == "tokens").count();
    assert_eq!(layouts, 2, "the token ids are read in the lookup's layout and in the gradient's");
}

/// Token ids selected, reshaped or transposed and then wanted in another layout were gathered or sent
/// across the diagonal, which the runtimes refuse for integers (E0699): a tied head with a second loss
/// on one position's targets (optimus), the targets flattened for a loss while they also feed an
/// embedding (3d). Such a value is now made again from the ids read in the layout that gives it.
#[test]
fn token_ids_derived_by_select_or_reshape_are_derived_again_not_communicated() {
    let cases = [
        (
            "tied_select",
            "layer wte = embedding(vocab, hidden)\nlayer head = linear(hidden, vocab, tied: wte)",
            "  x = wte(tokens)\n  output loss = cross_entropy(head(x), targets) + \
             cross_entropy(head(select(x, 1, 1)), select(targets, 1, 1))",
        ),
        (
            "flattened_targets",
            "layer wte = embedding(vocab, hidden)\nlayer head = linear(hidden, vocab)",
            "  logits = head(wte(tokens) + wte(targets))\n  output loss = \
             cross_entropy(reshape(logits, [batch * seq, vocab]), reshape(targets, [batch * seq]))",
        ),
        (
            "selected_targets",
            "layer wte = embedding(vocab, hidden)\nlayer head = linear(hidden, vocab)",
            "  x = wte(tokens) + wte(targets)\n  output loss = cross_entropy(head(x), targets) + \
             cross_entropy(head(select(x, 1, 1)), select(targets, 1, 1))",
        ),
    ];
    for (name, layers, forward) in cases {
        // `model` declares the embedding and head itself: these cases give their own.
        let source = format!(
            "model {name}\nconfig {{ vocab = 16; hidden = 8; batch = 8; seq = 4 }}\n\
             input tokens: i32[batch, seq]\ninput targets: i32[batch, seq]\n{layers}\nforward {{\n{forward}\n}}\n"
        );
        verifies_everywhere(name, &source, &[("3d", "2x2x2x2")]);
    }
}

/// An input read in two layouts has two entries in the plan: a data error lists it once. (This model
/// declares `tokens` and never reads it, so the plan has `targets` alone, read by the embedding and the
/// loss in two layouts on 3d.)
#[test]
fn an_input_read_in_two_layouts_is_listed_once() {
    let source = "model unused_tokens\nconfig { vocab = 16; hidden = 8; batch = 4; seq = 4 }\n\
        input tokens: i32[batch, seq]\ninput targets: i32[batch, seq]\n\
        layer wte = embedding(vocab, hidden)\nlayer head = linear(hidden, vocab)\n\
        forward {\n  logits = head(wte(targets))\n  output loss = cross_entropy(reshape(logits, [batch * seq, vocab]), \
        reshape(targets, [batch * seq]))\n}\n";
    let path = scratch("reused_layers", "unused_tokens").join("unused_tokens.opt");
    std::fs::write(&path, source).expect("the model is written");
    let out = optimusc(&["verify", &path.to_string_lossy(), "--strategy", "3d", "--mesh", "2x2x2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.matches("`targets`: i32[4, 4]").count(), 1, "{stderr}");
}
