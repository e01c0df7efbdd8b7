//! Golden snapshots of rendered diagnostics: every error code, syntax errors, and bad `--set` overrides.
//!
//! Each case also asserts the exact list of error codes, so a real regression (a lost, extra or
//! renumbered error) fails even when the snapshots are updated blindly. The source of each case is stored
//! as the snapshot's description, next to its rendering.

mod common;

use optimus::diag::{Diagnostic, render_plain};
use optimus::elab::Override;
use optimus::front::{check_source, decode};

/// A small valid header: a model, sizes, and one input of token ids (`tokens: i32[2, 4]`).
macro_rules! prelude {
    () => {
        "model m\nconfig {\n  hidden = 8\n  seq = 4\n  batch = 2\n}\ninput tokens: i32[batch, seq]\n"
    };
}

fn overrides(sets: &[(&str, &str)]) -> Vec<Override> {
    sets.iter().map(|(n, v)| Override { name: (*n).to_string(), value: (*v).to_string() }).collect()
}

/// Checks that every error is complete: a code, a message, and (where the text has something to point at) a
/// primary label inside the source.
fn assert_well_formed(src: &str, diagnostics: &[Diagnostic]) {
    for d in diagnostics.iter().filter(|d| d.is_error()) {
        assert!(d.code.as_str().starts_with('E') && d.code.as_str().len() == 5, "bad code {:?}", d.code);
        assert!(!d.message.is_empty(), "{} has no message", d.code);
        for l in &d.labels {
            assert!(l.span.start <= l.span.end && l.span.end as usize <= src.len(), "{} label outside source", d.code);
        }
        let unlabelled_ok = d.code == "E0301" && !src.contains("config") && !src.contains("model");
        assert!(unlabelled_ok || d.primary_span().is_some(), "{} `{}` has no primary label", d.code, d.message);
    }
}

/// Checks `src`, asserts the model is rejected with exactly the error codes `codes` (in order), and renders.
fn render(src: &str, sets: &[(&str, &str)], codes: &[&str]) -> String {
    let checked = check_source(src, &overrides(sets));
    let found: Vec<&str> = checked.diagnostics.iter().filter(|d| d.is_error()).map(|d| d.code.as_str()).collect();
    assert_eq!(found, codes, "error codes for:\n{src}\n{}", render_plain("model.opt", src, &checked.diagnostics));
    assert!(checked.model.is_none(), "a model with errors must not be returned");
    assert_well_formed(src, &checked.diagnostics);
    render_plain("model.opt", src, &checked.diagnostics)
}

/// `golden!(name, source, [codes])` or `golden!(name, source, sets [(name, value)], [codes])`: one snapshot test.
macro_rules! golden {
    ($name:ident, $src:expr, [$($code:literal),* $(,)?]) => {
        golden!($name, $src, sets [], [$($code),*]);
    };
    ($name:ident, $src:expr, sets [$(($k:literal, $v:literal)),* $(,)?], [$($code:literal),* $(,)?]) => {
        #[test]
        fn $name() {
            let src: &str = $src;
            let rendered = render(src, &[$(($k, $v)),*], &[$($code),*]);
            insta::with_settings!({ description => src, omit_expression => true }, {
                insta::assert_snapshot!(rendered);
            });
        }
    };
}

// ---- E0001: syntax errors ----------------------------------------------------------------------

golden!(syntax_missing_paren, concat!(prelude!(), "forward {\n  x = gelu(tokens\n  output y = x\n}\n"), ["E0001"]);
golden!(syntax_missing_paren_at_end, "model m\nlayer fc = linear(8, 8\n", ["E0001"]);
golden!(syntax_missing_equals, "model m\nconfig {\n  hidden 768\n}\n", ["E0001"]);
golden!(syntax_stray_token, "model m\nlayer fc = linear(8, 8))\n", ["E0001"]);
golden!(syntax_stray_word, "model m\nlayer fc = linear(8, 8) bias\n", ["E0001"]);
golden!(syntax_stray_brace, "model m\nconfig { a = 1 }\n}\n", ["E0001"]);
golden!(syntax_unterminated_block, "model m\nblock Mlp {\n  layer fc = linear(8, 8)\n", ["E0001"]);
golden!(syntax_bad_number_exponent, "model m\nconfig {\n  eps = 1e\n}\n", ["E0001"]);
golden!(syntax_bad_number_two_points, "model m\nconfig {\n  eps = 1.2.3\n}\n", ["E0001"]);
golden!(
    syntax_bad_number_trailing_underscore,
    "model m\nconfig {\n  hidden = 768_\n}\ninput x: i32[2]\nforward {\n  output y = x\n}\n",
    ["E0001"]
);
golden!(syntax_bad_number_suffix, "model m\nconfig {\n  hidden = 768px\n}\n", ["E0001"]);
golden!(syntax_unterminated_string, "model m(checkpoint_prefix: \"transformer.)\nforward {}\n", ["E0001"]);
golden!(syntax_missing_operand, concat!(prelude!(), "forward {\n  output y = 1 +\n}\n"), ["E0001"]);
golden!(syntax_missing_comma, "model m\nlayer fc = linear(8 8)\n", ["E0001"]);
golden!(syntax_missing_bracket, "model m\ninput tokens: i32[2, 4\nforward {}\n", ["E0001"]);
golden!(syntax_missing_dims, "model m\ninput tokens: i32\n", ["E0001"]);
golden!(syntax_missing_name, "model\n", ["E0001"]);
golden!(syntax_reserved_word, "model m\nlayer true = linear(8, 8)\n", ["E0001"]);
golden!(syntax_bad_character, concat!(prelude!(), "forward {\n  output y = tokens @ tokens\n}\n"), ["E0001"]);
golden!(syntax_double_equals, concat!(prelude!(), "forward {\n  output y == tokens\n}\n"), ["E0001"]);
golden!(syntax_statement_expected, concat!(prelude!(), "forward {\n  (tokens)\n}\n"), ["E0001"]);
golden!(syntax_stray_top_level, "model m\nx = 3\n", ["E0001"]);
golden!(
    syntax_errors_in_several_declarations,
    "model m\nlayer a = linear(8, 8\nlayer b = linear(8 8)\nblock C {\n  layer d = linear(8, 8)\n\nforward {\n  output y = 1 +\n}\n",
    ["E0001", "E0001", "E0001"]
);

// ---- E0002: input too deep or too long -----------------------------------------------------------

golden!(nesting_too_deep, &format!("model m\nconfig {{\n  a = {}1{}\n}}\n", "(".repeat(70), ")".repeat(70)), ["E0002"]);
golden!(minus_signs_too_deep, &format!("model m\nconfig {{\n  a = {}1\n}}\n", "-".repeat(70)), ["E0002"]);
golden!(
    expression_too_long,
    &format!("model m\nconfig {{\n  a = {}1\n  b = a + c\n}}\nforward {{}}\n", "1 +\n".repeat(1001)),
    ["E0002", "E0101", "E0401"]
);

// ---- E0004: literals out of range ------------------------------------------------------------------

golden!(
    integer_literal_too_large,
    concat!(prelude!(), "layer fc = linear(hidden, 99999999999999999999999)\nforward {\n  output y = fc(tokens)\n}\n"),
    ["E0004"]
);
golden!(
    float_literal_too_large,
    "model m\nconfig {\n  eps = 1e999\n  half = eps / 2\n}\ninput x: f32[2]\nforward {\n  output y = x * half\n}\n",
    ["E0004"]
);

// ---- E0101 / E0102: unknown names ------------------------------------------------------------------

golden!(
    unknown_name_suggests,
    concat!(prelude!(), "layer wte = embedding(10, hiden)\nforward {\n  output y = wte(tokenz)\n}\n"),
    ["E0101", "E0101"]
);
golden!(
    unknown_name_later_config,
    "model m\nconfig {\n  ffn = 4 * hidden\n  hidden = 8\n}\ninput x: f32[2, ffn]\nforward {\n  output y = x\n}\n",
    ["E0101"]
);
golden!(
    input_not_visible_in_block,
    concat!(
        prelude!(),
        "block B {\n  forward(x) {\n    return tokens\n  }\n}\nlayer b = B()\nforward {\n  output y = b(tokens)\n}\n"
    ),
    ["E0101"]
);
golden!(unknown_element_type, "model m\ninput x: f23[2, 4]\nforward {\n  output y = x\n}\n", ["E0101"]);
golden!(
    unknown_tied_layer,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer head = linear(hidden, 10, tied: wtee)\nforward {\n  output y = head(wte(tokens))\n}\n"
    ),
    ["E0101"]
);
/// A letter that is not ASCII where a name goes is said to be that, beside the parser's expectation.
#[test]
fn a_name_with_a_letter_that_is_not_ascii_says_names_are_ascii() {
    let src = "model m\nconfig {\n  h\u{ef}dden = 32\n}\n";
    let shown = render(src, &[], &["E0001"]);
    assert!(shown.contains("`\u{ef}` is not ASCII: names are ASCII letters, digits and `_`"), "{shown}");
    // Other syntax errors are not told about ASCII.
    let shown = render("model m\nconfig {\n  hidden 32\n}\n", &[], &["E0001"]);
    assert!(!shown.contains("ASCII"), "{shown}");
}

/// A `tied` path naming a layer whose own declaration failed says nothing more: the layer is declared,
/// and the failure is already reported (a second error called it undeclared and suggested another).
#[test]
fn a_tied_path_to_a_failed_layer_adds_no_error() {
    let src = concat!(
        prelude!(),
        "block E {\n  layer wte = embedding(10, hidden, padding_idx: 12)\n  forward(x) {\n    return wte(x)\n  }\n}\n",
        "layer emb = E()\nlayer head = linear(hidden, 10, tied: \"emb.wte\")\n",
        "forward {\n  output y = head(emb(tokens))\n}\n"
    );
    let shown = render(src, &[], &["E0202"]);
    assert!(shown.contains("`padding_idx` must name one of the 10 rows"), "{shown}");
}

golden!(
    unknown_operator_suggests,
    concat!(prelude!(), "layer wte = embedding(10, hidden)\nforward {\n  output y = gleu(wte(tokens))\n}\n"),
    ["E0102"]
);
golden!(
    unknown_layer_kind,
    concat!(prelude!(), "layer norm = layer_norm(hidden)\nforward {\n  output y = norm(tokens)\n}\n"),
    ["E0102"]
);
golden!(
    checkpoint_needs_a_block,
    concat!(prelude!(), "layer l = checkpoint linear(hidden, hidden)\nforward {\n  output y = l(tokens)\n}\n"),
    ["E0102"]
);
golden!(
    repeat_needs_block,
    concat!(prelude!(), "layer h = repeat(2) linear(hidden, hidden)\nforward {\n  output y = h(tokens)\n}\n"),
    ["E0102"]
);
golden!(
    repeat_without_block,
    concat!(prelude!(), "layer h = repeat(2)\nforward {\n  output y = h(tokens)\n}\n"),
    ["E0102"]
);

// ---- E0103 / E0104: argument lists -------------------------------------------------------------------

golden!(
    too_many_arguments,
    concat!(prelude!(), "layer wte = embedding(10, hidden, 0.02, 5, 1)\nforward {\n  output y = wte(tokens)\n}\n"),
    ["E0103"]
);
golden!(
    padding_index_outside_the_table,
    concat!(prelude!(), "layer wte = embedding(10, hidden, padding_idx: 10)\nforward {\n  output y = wte(tokens)\n}\n"),
    ["E0202"]
);
golden!(
    missing_argument,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer fc = linear(hidden)\nforward {\n  output y = fc(wte(tokens))\n}\n"
    ),
    ["E0103"]
);
golden!(
    block_missing_argument,
    concat!(
        prelude!(),
        "block Mlp(width) {\n  layer fc = linear(hidden, width)\n  forward(x) {\n    return fc(x)\n  }\n}\nlayer mlp = Mlp()\nforward {\n  output y = mlp(tokens)\n}\n"
    ),
    ["E0103"]
);
golden!(
    block_forward_argument_count,
    concat!(
        prelude!(),
        "block Pair {\n  forward(a, b) {\n    return a\n  }\n}\nlayer p = Pair()\nforward {\n  output y = p(tokens)\n}\n"
    ),
    ["E0103"]
);
golden!(
    attention_missing_heads,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer qkv = linear(hidden, 3 * hidden)\nforward {\n  output y = self_attention(qkv(wte(tokens)))\n}\n"
    ),
    ["E0103"]
);
golden!(model_option_unnamed, "model m(\"transformer.\")\ninput x: f32[2]\nforward {\n  output y = x\n}\n", ["E0103"]);
golden!(
    unknown_keyword,
    concat!(prelude!(), "layer fc = linear(hidden, 8, biass: false)\nforward {\n  output y = fc(tokens)\n}\n"),
    ["E0104"]
);
golden!(
    keyword_given_twice,
    concat!(prelude!(), "layer fc = linear(hidden, 8, in: 8)\nforward {\n  output y = fc(tokens)\n}\n"),
    ["E0104"]
);
golden!(
    unknown_model_option,
    "model m(checkpoint_prefx: \"transformer.\")\ninput x: f32[2]\nforward {\n  output y = x\n}\n",
    ["E0104"]
);

// ---- E0105 / E0106: definitions ----------------------------------------------------------------------

golden!(
    duplicate_layer,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer wte = embedding(20, hidden)\nforward {\n  output y = wte(tokens)\n}\n"
    ),
    ["E0105"]
);
golden!(
    duplicate_block,
    concat!(
        prelude!(),
        "block B {\n  forward(x) {\n    return x\n  }\n}\nblock B {\n  forward(x) {\n    return x\n  }\n}\nlayer b = B()\nforward {\n  output y = b(tokens)\n}\n"
    ),
    ["E0105"]
);
golden!(
    duplicate_config,
    "model m\nconfig {\n  hidden = 8\n  hidden = 16\n}\ninput x: f32[hidden]\nforward {\n  output y = x\n}\n",
    ["E0105"]
);
golden!(
    duplicate_input_and_output,
    concat!(prelude!(), "input tokens: i32[batch]\nforward {\n  output y = tokens\n  output y = tokens\n}\n"),
    ["E0105", "E0105"]
);
golden!(
    second_forward,
    concat!(prelude!(), "forward {\n  output y = tokens\n}\nforward {\n  output z = tokens\n}\n"),
    ["E0105"]
);
golden!(
    duplicate_block_parameter_named_in_the_call,
    "model m\ninput x: f32[4]\nblock B(d, d) {\n  forward(x) {\n    return x\n  }\n}\nlayer b = B(d: 4)\nforward {\n  output y = b(x)\n}\n",
    ["E0105"]
);
golden!(
    duplicate_block_parameter_given_by_position,
    "model m\ninput x: f32[4]\nblock B(d, d) {\n  forward(x) {\n    return x\n  }\n}\nlayer b = B(4, 8)\nforward {\n  output y = b(x)\n}\n",
    ["E0105"]
);
golden!(
    duplicate_forward_parameter,
    "model m\ninput x: f32[4]\nblock B {\n  forward(x, x) {\n    return x\n  }\n}\nlayer b = B()\nforward {\n  output y = b(x, x)\n}\n",
    ["E0105"]
);
golden!(
    duplicate_forward_parameter_in_a_block_never_called,
    "model m\ninput x: f32[4]\nblock B(d) {\n  forward(x, y, x) {\n    return y\n  }\n}\nforward {\n  output y = x\n}\n",
    ["E0105"]
);
golden!(model_named_twice, "model a\nmodel b\ninput x: f32[2]\nforward {\n  output y = x\n}\n", ["E0105"]);
golden!(
    block_named_like_builtin,
    "model m\ninput x: f32[2]\nblock gelu {\n  forward(x) {\n    return x\n  }\n}\nforward {\n  output y = x\n}\n",
    ["E0105"]
);
golden!(
    block_contains_itself,
    concat!(
        prelude!(),
        "block Layer {\n  layer inner = Layer()\n  forward(x) {\n    return inner(x)\n  }\n}\nlayer l = Layer()\nforward {\n  output y = l(tokens)\n}\n"
    ),
    ["E0106"]
);
golden!(
    blocks_contain_each_other,
    concat!(
        prelude!(),
        "block A {\n  layer b = B()\n  forward(x) {\n    return b(x)\n  }\n}\nblock B {\n  layer a = A()\n  forward(x) {\n    return a(x)\n  }\n}\nlayer a = A()\nforward {\n  output y = a(tokens)\n}\n"
    ),
    ["E0106"]
);

// ---- E0107: kinds of value -----------------------------------------------------------------------------

golden!(
    tensor_plus_number,
    concat!(prelude!(), "layer wte = embedding(10, hidden)\nforward {\n  output y = wte(tokens) + 1\n}\n"),
    ["E0107"]
);
golden!(
    layer_used_as_value,
    concat!(prelude!(), "layer wte = embedding(10, hidden)\nforward {\n  output y = wte\n}\n"),
    ["E0107"]
);
golden!(layer_kind_called_in_forward, concat!(prelude!(), "forward {\n  output y = linear(tokens)\n}\n"), ["E0107"]);
golden!(
    token_ids_into_layernorm,
    concat!(prelude!(), "layer ln = layernorm(hidden)\nforward {\n  output y = ln(tokens)\n}\n"),
    ["E0107"]
);
golden!(output_not_a_tensor, concat!(prelude!(), "forward {\n  output y = hidden\n}\n"), ["E0107"]);
golden!(
    wrong_argument_kind,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nforward {\n  output y = dropout(wte(tokens), p: \"high\")\n}\n"
    ),
    ["E0107"]
);

// ---- E0201: shapes ----------------------------------------------------------------------------------------

golden!(
    shape_mismatch_add,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer up = linear(hidden, 16)\nforward {\n  x = wte(tokens)\n  output y = up(x) + x\n}\n"
    ),
    ["E0201"]
);
golden!(
    shape_mismatch_linear_input,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer fc = linear(16, hidden)\nforward {\n  output y = fc(wte(tokens))\n}\n"
    ),
    ["E0201"]
);
golden!(
    shape_mismatch_matmul,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer up = linear(hidden, 16)\nforward {\n  x = wte(tokens)\n  output y = matmul(x, up(x))\n}\n"
    ),
    ["E0201"]
);
golden!(
    shape_mismatch_cross_entropy,
    concat!(
        prelude!(),
        "input targets: i32[batch]\nlayer wte = embedding(10, hidden)\nforward {\n  output loss = cross_entropy(wte(tokens), targets)\n}\n"
    ),
    ["E0201"]
);
golden!(
    cross_entropy_of_scalar_logits,
    "model m\ninput s: f32[]\ninput t: i32[]\nforward {\n  output loss = cross_entropy(s, t)\n}\n",
    ["E0201"]
);
golden!(
    shape_mismatch_reshape,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nforward {\n  output y = reshape(wte(tokens), [batch, seq, 3])\n}\n"
    ),
    ["E0201"]
);
golden!(
    sequence_longer_than_position_table,
    concat!(prelude!(), "layer wpe = position_embedding(2, hidden)\nforward {\n  output y = wpe(tokens)\n}\n"),
    ["E0201"]
);
golden!(
    heads_do_not_divide_width,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer qkv = linear(hidden, 3 * hidden)\nforward {\n  output y = self_attention(qkv(wte(tokens)), heads: 3)\n}\n"
    ),
    ["E0201"]
);
golden!(
    rotary_odd_head_size,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer fc = linear(hidden, 12)\nforward {\n  output y = rotary(fc(wte(tokens)), heads: 4)\n}\n"
    ),
    ["E0201"]
);
golden!(
    rotary_heads_do_not_divide_width,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nforward {\n  output y = rotary(wte(tokens), heads: 3)\n}\n"
    ),
    ["E0201"]
);
golden!(
    kv_heads_do_not_divide_heads,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer kv = linear(hidden, 6)\nforward {\n  x = wte(tokens)\n  output y = self_attention(x, kv(x), kv(x), heads: 4, kv_heads: 3)\n}\n"
    ),
    ["E0201"]
);
golden!(
    kv_width_is_not_kv_heads_times_head,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nforward {\n  x = wte(tokens)\n  output y = self_attention(x, x, x, heads: 4, kv_heads: 2)\n}\n"
    ),
    ["E0201"]
);
golden!(
    fused_qkv_with_fewer_kv_heads,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer qkv = linear(hidden, 3 * hidden)\nforward {\n  output y = self_attention(qkv(wte(tokens)), heads: 4, kv_heads: 2)\n}\n"
    ),
    ["E0201"]
);
golden!(
    repeated_block_changes_shape,
    concat!(
        prelude!(),
        "block Up {\n  layer fc = linear(hidden, 16)\n  forward(x) {\n    return fc(x)\n  }\n}\nlayer wte = embedding(10, hidden)\nlayer h = repeat(2) Up()\nforward {\n  output y = h(wte(tokens))\n}\n"
    ),
    ["E0201"]
);
golden!(
    tied_table_wrong_shape,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer head = linear(hidden, 12, tied: wte)\nforward {\n  output y = head(wte(tokens))\n}\n"
    ),
    ["E0201"]
);

// ---- E0202 / E0203: sizes and arithmetic ----------------------------------------------------------------

golden!(
    rotary_theta_not_positive,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nforward {\n  output y = rotary(wte(tokens), heads: 2, theta: -1.0)\n}\n"
    ),
    ["E0202"]
);

golden!(
    size_not_positive,
    concat!(prelude!(), "layer wte = embedding(0, hidden)\nforward {\n  output y = wte(tokens)\n}\n"),
    ["E0202"]
);
golden!(
    repeat_count_out_of_range,
    concat!(
        prelude!(),
        "block B {\n  forward(x) {\n    return x\n  }\n}\nlayer h = repeat(1000000000) B()\nforward {\n  output y = h(tokens)\n}\n"
    ),
    ["E0202"]
);
golden!(
    dropout_probability_out_of_range,
    concat!(prelude!(), "layer wte = embedding(10, hidden)\nforward {\n  output y = dropout(wte(tokens), p: 1.5)\n}\n"),
    ["E0202"]
);
golden!(
    index_out_of_range,
    concat!(prelude!(), "layer wte = embedding(10, hidden)\nforward {\n  output y = select(wte(tokens), 1, 9)\n}\n"),
    ["E0202"]
);
golden!(
    axis_out_of_range,
    concat!(prelude!(), "layer wte = embedding(10, hidden)\nforward {\n  output y = transpose(wte(tokens), 0, 5)\n}\n"),
    ["E0202"]
);
golden!(
    tensor_too_large,
    "model m\nconfig {\n  big = 4000000000\n}\ninput x: f32[big, big, big]\nforward {\n  output y = x\n}\n",
    ["E0202"]
);
golden!(
    parameter_too_large_in_nested_blocks_named_by_its_path,
    "model m\nconfig {\n  big = 2000000\n}\ninput x: f32[2, big]\nblock Inner {\n  layer fc = linear(big, big)\n  forward(x) {\n    return fc(x)\n  }\n}\nblock Outer {\n  layer inner = Inner()\n  forward(x) {\n    return inner(x)\n  }\n}\nlayer h = repeat(2) Outer()\nforward {\n  output y = h(x)\n}\n",
    ["E0202"]
);
golden!(
    hidden_past_plan_limit,
    concat!(
        "model m\nconfig {\n  hidden = 4000000\n  seq = 4\n  batch = 2\n}\ninput x: f32[batch, seq, hidden]\n",
        "layer fc = linear(hidden, hidden)\nforward {\n  output y = fc(x)\n}\n"
    ),
    ["E0202"]
);
golden!(
    product_overflows_u64,
    "model m\nconfig {\n  big = 5000000000\n}\ninput x: f32[2, big]\nlayer fc = linear(big, [big, 2])\nforward {\n  output y = fc(x)\n}\n",
    ["E0202"]
);
golden!(
    division_not_whole,
    "model m\nconfig {\n  hidden = 768\n  heads = 5\n  head = hidden / heads\n}\ninput x: f32[head]\nforward {\n  output y = x\n}\n",
    ["E0203"]
);
golden!(
    division_by_zero,
    "model m\nconfig {\n  zero = 0\n  a = 8 / zero\n}\ninput x: f32[a]\nforward {\n  output y = x\n}\n",
    ["E0203"]
);
golden!(
    integer_overflow,
    "model m\nconfig {\n  big = 9223372036854775807\n  bigger = big * 2\n}\ninput x: f32[bigger]\nforward {\n  output y = x\n}\n",
    ["E0203"]
);
golden!(
    sqrt_of_negative,
    "model m\nconfig {\n  s = sqrt(0 - 4)\n}\ninput x: f32[2]\nforward {\n  output y = x * s\n}\n",
    ["E0203"]
);
golden!(
    string_arithmetic,
    "model m\nconfig {\n  name = \"gpt\"\n  n = name * 2\n}\ninput x: f32[2]\nforward {\n  output y = x\n}\n",
    ["E0107"]
);

// ---- E0301 / E0302: --set -------------------------------------------------------------------------------

const GPT2: &str = include_str!("../examples/gpt2.opt");

golden!(set_unknown_name, GPT2, sets[("layerz", "2")], ["E0301"]);
golden!(set_eps_negative_zero_reported_once, GPT2, sets[("eps", "-0.0")], ["E0202"]);
golden!(
    set_unknown_name_with_two_config_blocks,
    "model m\nconfig { a = 1 }\nconfig { b = 2 }\ninput x: f32[4]\nforward {\n  output y = x\n}\n",
    sets[("c", "1")],
    ["E0301"]
);
golden!(
    set_unknown_name_no_config,
    "model m\ninput x: f32[2]\nforward {\n  output y = x\n}\n",
    sets[("layers", "2")],
    ["E0301"]
);
golden!(set_not_an_integer, GPT2, sets[("layers", "two")], ["E0302"]);
golden!(set_integer_too_large, GPT2, sets[("layers", "99999999999999999999")], ["E0302"]);
golden!(set_not_a_number, GPT2, sets[("pdrop", "lots")], ["E0302"]);
golden!(set_not_finite, GPT2, sets[("eps", "inf")], ["E0302"]);
golden!(set_integer_leading_underscore, GPT2, sets[("layers", "_1")], ["E0302"]);
golden!(set_number_leading_underscore, GPT2, sets[("eps", "_1")], ["E0302"]);
golden!(set_number_trailing_underscore, GPT2, sets[("eps", "1_")], ["E0302"]);

#[test]
fn set_accepts_underscores_between_digits() {
    for (name, value) in
        [("layers", "1_2"), ("layers", "-0_1"), ("hidden", "7__68"), ("eps", "0.000_01"), ("eps", "1_0e-5")]
    {
        let checked = check_source(GPT2, &overrides(&[(name, value)]));
        let bad_value = checked.diagnostics.iter().any(|d| d.code == "E0302");
        assert!(!bad_value, "--set {name}={value}: {}", render_plain("model.opt", GPT2, &checked.diagnostics));
    }
}
golden!(set_size_zero, GPT2, sets[("hidden", "0")], ["E0202"]);
golden!(set_heads_not_dividing, GPT2, sets[("heads", "5")], ["E0203"]);
golden!(set_sequence_too_long, GPT2, sets[("seq", "2048")], ["E0201"]);
golden!(
    set_tensor_too_large,
    GPT2,
    sets [("hidden", "3000000000"), ("vocab", "3000000000")],
    ["E0202", "E0202", "E0202", "E0202", "E0202", "E0202"]
);
golden!(set_vocab_past_plan_limit, GPT2, sets[("vocab", "1099511627776")], ["E0202"]);
golden!(set_batch_past_plan_limit, GPT2, sets[("batch", "1099511627776")], ["E0202", "E0202"]);
golden!(set_layers_past_instance_limit, GPT2, sets[("layers", "100000")], ["E0402"]);
golden!(set_two_problems, GPT2, sets [("layers", "x"), ("hiden", "64")], ["E0301", "E0302"]);

// ---- E0401 / E0402: structure and limits ------------------------------------------------------------------

golden!(empty_file, "", ["E0401"]);
golden!(no_outputs, concat!(prelude!(), "forward {\n  x = tokens\n}\n"), ["E0401"]);
golden!(
    block_without_forward,
    concat!(
        prelude!(),
        "block B {\n  layer fc = linear(hidden, hidden)\n}\nlayer b = B()\nforward {\n  output y = b(tokens)\n}\n"
    ),
    ["E0401"]
);
golden!(
    block_forward_without_return,
    concat!(
        prelude!(),
        "block B {\n  forward(x) {\n    y = x\n  }\n}\nlayer b = B()\nforward {\n  output y = b(tokens)\n}\n"
    ),
    ["E0401"]
);
golden!(
    output_inside_block,
    concat!(
        prelude!(),
        "block B {\n  forward(x) {\n    output z = x\n    return x\n  }\n}\nlayer b = B()\nforward {\n  output y = b(tokens)\n}\n"
    ),
    ["E0401"]
);
golden!(return_in_model_forward, concat!(prelude!(), "forward {\n  output y = tokens\n  return y\n}\n"), ["E0401"]);

/// 300 blocks, each containing the next: deeper than the 256 levels of block instances allowed.
fn deep_blocks() -> String {
    let mut src = String::from("model m\ninput x: f32[2]\n");
    for i in 0..300 {
        src.push_str(&format!("block B{i} {{ layer l = B{}() forward(x) {{ return l(x) }} }}\n", i + 1));
    }
    src.push_str("block B300 { forward(x) { return x } }\nlayer b = B0()\nforward {\n  output y = b(x)\n}\n");
    src
}

golden!(blocks_nested_too_deep, &deep_blocks(), ["E0402"]);

golden!(forwards_multiplying_calls_past_the_evaluation_limit, &common::forwards_multiplying_calls(), ["E0402"]);

/// A reshape to 65 dimensions and an input of 65: past the 64 a tensor may have (a shape of millions once
/// took 40 s and gigabytes to print its type back).
fn shapes_of_65_dimensions() -> String {
    let ones = vec!["1"; 65].join(", ");
    format!("model m\ninput x: f32[4]\ninput w: f32[{ones}]\nforward {{\n  output y = reshape(x, [{ones}])\n}}\n")
}

golden!(shapes_past_the_rank_limit, &shapes_of_65_dimensions(), ["E0402", "E0402"]);

// ---- name resolution: every forward, called or not ---------------------------------------------------------

golden!(
    unknown_names_in_a_block_never_used,
    concat!(
        prelude!(),
        "block Unused(dim) {\n  layer fc = linear(dim, dim)\n  forward(x) {\n    y = fc(x) + bias\n    return gleu(y)\n  }\n}\nforward {\n  output y = tokens\n}\n"
    ),
    ["E0101", "E0102"]
);
golden!(
    input_in_a_block_never_called,
    concat!(
        prelude!(),
        "block B {\n  layer fc = linear(hidden, hidden)\n  forward(x) {\n    return fc(tokens)\n  }\n}\nlayer b = B()\nforward {\n  output y = tokens\n}\n"
    ),
    ["E0101"]
);
golden!(
    unknown_layer_kind_in_a_block_never_used,
    concat!(
        prelude!(),
        "block B {\n  layer fc = lineer(hidden, hidden)\n  forward(x) {\n    return fc(x)\n  }\n}\nforward {\n  output y = tokens\n}\n"
    ),
    ["E0102"]
);
golden!(
    statement_after_return,
    concat!(
        prelude!(),
        "block B {\n  forward(x) {\n    return x\n    y = gelu(z)\n    return y\n  }\n}\nlayer b = B()\nforward {\n  output y = b(tokens)\n}\n"
    ),
    ["E0401", "E0101"]
);
golden!(
    block_with_two_forwards,
    concat!(
        prelude!(),
        "block B {\n  forward(x) {\n    return x\n  }\n  forward(x, y) {\n    return y\n  }\n}\nlayer b = B()\nforward {\n  output y = b(tokens)\n}\n"
    ),
    ["E0105"]
);
golden!(
    block_never_called_without_return,
    concat!(prelude!(), "block B {\n  forward(x) {\n    output z = x\n  }\n}\nforward {\n  output y = tokens\n}\n"),
    ["E0401", "E0401"]
);
// Name resolution suggests `width`; elaboration, which no longer knows the failed `width`, would not: the name is
// still reported once, by name resolution only.
golden!(
    unknown_name_reported_once,
    concat!(
        "model m\nconfig {\n  width = 8 / 0\n}\ninput x: f32[2]\nblock B {\n  forward(h) {\n    return h * widht\n  }\n}\n",
        "layer a = B()\nlayer b = B()\nforward {\n  output y = b(a(x))\n}\n"
    ),
    ["E0203", "E0101"]
);

// ---- fixed cascades and missing checks ------------------------------------------------------------------------

golden!(
    integer_tensor_scaled,
    concat!(prelude!(), "forward {\n  output y = tokens * 2\n  output z = 0.5 * tokens\n  output w = tokens / 2\n}\n"),
    ["E0107", "E0107", "E0107"]
);
golden!(
    matmul_dtype_mismatch,
    concat!(
        prelude!(),
        "input a: f32[2, 4, hidden]\ninput b: f16[2, hidden, 4]\nforward {\n  output y = matmul(a, b)\n}\n"
    ),
    ["E0201"]
);
golden!(
    attention_dtype_mismatch,
    concat!(
        prelude!(),
        "input a: f32[2, 4, hidden]\ninput b: bf16[2, 4, hidden]\nforward {\n  output y = self_attention(a, b, b, heads: 2)\n}\n"
    ),
    ["E0201"]
);
golden!(
    layernorm_eps_not_positive,
    concat!(
        prelude!(),
        "input x: f32[2, hidden]\nlayer ln = layernorm(hidden, eps: -1)\nforward {\n  output y = ln(x)\n}\n"
    ),
    ["E0202"]
);
golden!(
    rms_norm_eps_not_positive,
    concat!(
        prelude!(),
        "input x: f32[2, hidden]\nlayer norm = rms_norm(hidden, eps: 0)\nforward {\n  output y = norm(x)\n}\n"
    ),
    ["E0202"]
);
golden!(
    rms_norm_eps_not_a_number,
    concat!(
        prelude!(),
        "input x: f32[2, hidden]\nlayer norm = rms_norm(hidden, eps: \"small\")\nforward {\n  output y = norm(x)\n}\n"
    ),
    ["E0107"]
);
golden!(
    shape_mismatch_mul,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer up = linear(hidden, 16)\nforward {\n  x = wte(tokens)\n  output y = up(x) * x\n}\n"
    ),
    ["E0201"]
);
golden!(
    shape_mismatch_mul_call,
    concat!(
        prelude!(),
        "layer wte = embedding(10, hidden)\nlayer up = linear(hidden, 16)\nforward {\n  x = wte(tokens)\n  output y = mul(x, up(x))\n}\n"
    ),
    ["E0201"]
);
golden!(token_ids_times_token_ids, concat!(prelude!(), "forward {\n  output y = tokens * tokens\n}\n"), ["E0107"]);
golden!(
    block_missing_argument_used_by_default,
    concat!(
        prelude!(),
        "block Mlp(dim, width = 4 * dim) {\n  layer fc = linear(dim, width)\n  forward(x) {\n    return fc(x)\n  }\n}\nlayer mlp = Mlp()\nlayer wte = embedding(10, hidden)\nforward {\n  output y = mlp(wte(tokens))\n}\n"
    ),
    ["E0103"]
);
golden!(
    input_named_like_config,
    concat!(prelude!(), "input seq: f32[batch, 4, hidden]\nforward {\n  output y = gelu(seq)\n}\n"),
    ["E0105"]
);
golden!(
    layer_named_like_input,
    concat!(
        prelude!(),
        "input x: f32[batch, seq, hidden]\nlayer x = linear(hidden, hidden)\nforward {\n  output y = x(x)\n  output z = x\n}\n"
    ),
    ["E0105"]
);
golden!(
    block_layer_named_like_config_used_as_a_tensor,
    concat!(
        prelude!(),
        "input x: f32[batch, seq, hidden]\nblock B {\n  layer batch = linear(hidden, hidden)\n  forward(h) {\n    return batch(h) + batch\n  }\n}\nlayer b = B()\nforward {\n  output y = b(x)\n}\n"
    ),
    ["E0107"]
);
golden!(
    linear_orientation_unknown,
    concat!(
        prelude!(),
        "layer fc = linear(hidden, hidden, orientation: \"rows\")\nforward {\n  output y = fc(tokens)\n}\n"
    ),
    ["E0107"]
);
golden!(
    linear_orientation_with_tied,
    concat!(
        prelude!(),
        "layer wte = embedding(16, hidden)\nlayer head = linear(hidden, 16, tied: wte, orientation: \"out_in\")\nforward {\n  output y = head(wte(tokens))\n}\n"
    ),
    ["E0103"]
);
golden!(
    model_linear_orientation_unknown,
    "model m(linear_orientation: \"nn.Linear\")\ninput x: f32[4]\nforward {\n  output y = x\n}\n",
    ["E0107"]
);
golden!(
    input_in_layer_arguments,
    concat!(
        prelude!(),
        "input x: f32[batch, seq, hidden]\nlayer fc = linear(x, 4)\nforward {\n  output y = fc(x)\n}\n"
    ),
    ["E0107"]
);
golden!(
    attention_heads_do_not_match_factors,
    concat!(
        prelude!(),
        "input x: f32[batch, seq, 16]\nlayer qkv = linear(16, [3, 2, 8])\nforward {\n  output y = self_attention(qkv(x), heads: 4)\n}\n"
    ),
    ["E0201"]
);
golden!(softmax_of_a_scalar, concat!(prelude!(), "input x: f32[]\nforward {\n  output y = softmax(x)\n}\n"), ["E0201"]);
golden!(set_heads_zero, GPT2, sets[("heads", "0")], ["E0203"]);

/// Checks a model that must check without any diagnostic.
fn assert_checks(src: &str) {
    let checked = check_source(src, &[]);
    assert!(checked.diagnostics.is_empty(), "{}", render_plain("model.opt", src, &checked.diagnostics));
    assert!(checked.model.is_some(), "no model for:\n{src}");
}

#[test]
fn repeat_compares_sizes_not_labels() {
    // `L(4)` labels its result `dim`, the input's last dimension is labelled `hidden`: the same size.
    assert_checks(concat!(
        "config { hidden = 4 }\nblock L(dim) {\n  layer fc = linear(dim, dim)\n  forward(x) { return fc(x) }\n}\n",
        "layer h = repeat(2) L(4)\ninput x: f32[3, hidden]\nforward { output y = h(x) }\n"
    ));
    // A fused self_attention's result is factored (heads, head); its input is not.
    assert_checks(concat!(
        "config { hidden = 4 }\nblock A {\n  layer qkv = linear(hidden, [3, 2, 2])\n",
        "  forward(x) { return self_attention(qkv(x), heads: 2) }\n}\n",
        "layer a = repeat(2) A()\ninput x: f32[3, hidden]\nforward { output y = a(x) }\n"
    ));
}

#[test]
fn a_file_larger_than_the_old_parser_limit_parses() {
    // 4 MiB of `;` took about 150 million grammar-rule calls; the limit was 50 million.
    let src = format!("input x: f32[2]\nforward {{ output y = x }}\n{}", ";".repeat(4 << 20));
    let checked = check_source(&src, &[]);
    let codes: Vec<&str> = checked.diagnostics.iter().map(|d| d.code.as_str()).collect();
    assert_eq!(codes, Vec::<&str>::new());
    assert!(checked.model.is_some());
}

// ---- E0003: bytes that are not UTF-8 ------------------------------------------------------------------------

#[test]
fn invalid_utf8() {
    let (source, error) = decode("model.opt", b"model m\ninput x: f32[2]\n# caf\xe9\n".to_vec());
    let error = error.expect("invalid UTF-8 must be an error");
    assert_eq!(error.code, "E0003");
    assert_eq!(error.primary_span().map(|s| s.start), Some(29));
    insta::assert_snapshot!(render_plain("model.opt", &source.text, &[error]));
}

/// A binary file is named as one, with no snippet (its "first line" would be noise, or escape
/// sequences for the terminal); a NUL is enough even in valid UTF-8, a control character only beside
/// bytes that are not UTF-8.
#[test]
fn a_binary_file_is_an_error_without_a_snippet() {
    let cases: [(&[u8], usize, &str); 3] = [
        (b"model m\n\x1b[2J\xff\xfe", 8, "0x1b"),
        (b"model m\n\0\0\0", 8, "0x00"),
        (b"\xEF\xBB\xBF\x7f\xc3", 0, "0x7f"),
    ];
    for (bytes, offset, byte) in cases {
        let (source, error) = decode("model.bin", bytes.to_vec());
        let error = error.expect("a binary file must be an error");
        assert_eq!(error.code, "E0003");
        assert!(error.primary_span().is_none());
        let shown = render_plain("model.bin", &source.text, &[error]);
        assert!(shown.contains(&format!("the file is binary, not a model: byte {byte} at offset {offset}")), "{shown}");
        assert!(!shown.contains('\x1b') && !shown.contains("model m"), "{shown}");
    }
    // An escape character in a valid UTF-8 file is left to the parser, which points at it.
    let (_, error) = decode("model.opt", b"model m # \x1b\n".to_vec());
    assert!(error.is_none());
}

#[test]
fn a_leading_byte_order_mark_is_dropped() {
    let (source, error) = decode("model.opt", b"\xEF\xBB\xBFmodel m\n".to_vec());
    assert!(error.is_none());
    assert_eq!(source.text, "model m\n");
    // Only at the start: elsewhere U+FEFF is text like any other.
    let (source, error) = decode("model.opt", "model m\n# \u{feff}\n".as_bytes().to_vec());
    assert!(error.is_none() && source.text.contains('\u{feff}'));
}

// ---- several independent errors in one run -------------------------------------------------------------------

golden!(
    independent_errors_all_reported,
    concat!(
        "model m\nconfig {\n  hidden = 8\n  seq = 4\n  ffn = 4 * hiden\n}\ninput tokens: i32[2, seq]\n",
        "layer wte = embedding(10, hidden)\nlayer fc = linear(hidden, ffn)\nlayer ln = layernorm(hidden, eps: \"small\")\n",
        "forward {\n  x = wte(tokens)\n  y = gleu(x)\n  z = x + wte(tokens, 2)\n  output loss = cross_entropy(x, tokenz)\n}\n"
    ),
    ["E0101", "E0107", "E0102", "E0103", "E0101"]
);

#[test]
fn two_unrelated_errors_are_both_reported() {
    let src = concat!(
        prelude!(),
        "layer a = linear(hidden, 8, bais: true)\nlayer b = embedding(10, hiddn)\nforward {\n  output y = b(tokens)\n}\n"
    );
    let checked = check_source(src, &[]);
    let codes: Vec<&str> = checked.diagnostics.iter().map(|d| d.code.as_str()).collect();
    assert_eq!(codes, ["E0104", "E0101"]);
}

// ---- properties of every syntax error ----------------------------------------------------------------------

/// Broken inputs of every shape: none may leak a grammar rule name into what the user reads.
const BROKEN: &[&str] = &[
    "model",
    "model m(",
    "model m(a:",
    "config",
    "config {",
    "config { a",
    "config { a =",
    "config { a = 1 +",
    "input",
    "input x",
    "input x:",
    "input x: i32",
    "input x: i32[",
    "input x: i32[1,",
    "block",
    "block B",
    "block B(",
    "block B(a,",
    "block B(a =",
    "block B {",
    "block B { layer",
    "block B { forward",
    "layer",
    "layer x",
    "layer x =",
    "layer x = repeat",
    "layer x = repeat(",
    "layer x = repeat(2)",
    "layer x = f(",
    "forward",
    "forward {",
    "forward { output",
    "forward { output y",
    "forward { return",
    "forward { x = [",
    "forward { x = (",
    "forward { x = -",
    "forward { x = f(a:",
    "forward { x = \"s",
    "}",
    ")",
    "]",
    "=",
    "1",
    "@",
    "\u{e9}",
    "model m\n\t\u{1}",
    "layer x = linear(1, 2) )",
    "forward { x = 1 2 }",
];

/// Grammar rule names that must never reach the user.
const RULE_NAMES: &[&str] = &[
    "expr",
    "kw_",
    "ident",
    "primary",
    "call_args",
    "kwarg",
    "config_entry",
    "block_param",
    "forward_params",
    "dim_list",
    "repeat_expr",
    "output_stmt",
    "return_stmt",
    "assign_stmt",
    "EOI",
    "WHITESPACE",
    "COMMENT",
    "literal",
    "infix",
    "ident_char",
];

#[test]
fn syntax_errors_say_what_was_expected_in_words() {
    for src in BROKEN {
        let checked = check_source(src, &[]);
        let errors: Vec<&Diagnostic> = checked.diagnostics.iter().filter(|d| d.is_error()).collect();
        assert!(!errors.is_empty(), "no error for {src:?}");
        assert_well_formed(src, &checked.diagnostics);
        let rendered = render_plain("model.opt", src, &checked.diagnostics);
        let words: Vec<&str> = rendered.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).collect();
        for rule in RULE_NAMES {
            let leaked = words.iter().any(|w| w == rule || (rule.ends_with('_') && w.starts_with(rule)));
            assert!(!leaked, "rule name `{rule}` in the error for {src:?}:\n{rendered}");
        }
        for e in errors.iter().filter(|e| e.code == "E0001") {
            assert!(
                e.message.contains("expected") || e.message.contains("malformed") || e.message.contains("unterminated"),
                "no expectation in {:?} for {src:?}",
                e.message
            );
        }
    }
}

#[test]
fn labels_point_at_the_offending_text() {
    let src = "model m\nconfig {\n  hidden = 768\n}\nlayer fc = linear(hidden, 8, biass: false)\n";
    let checked = check_source(src, &[]);
    let d = checked.diagnostics.iter().find(|d| d.code == "E0104").expect("E0104");
    let span = d.primary_span().expect("primary label");
    assert_eq!(&src[span.range()], "biass");
    let src = "model m\nconfig {\n  a = 1\n  b = 2  # two\n}\n";
    let checked = check_source(src, &[Override { name: "b".into(), value: "x".into() }]);
    let d = checked.diagnostics.iter().find(|d| d.code == "E0302").expect("E0302");
    assert_eq!(&src[d.primary_span().expect("primary label").range()], "2");
}

// ---- warnings ------------------------------------------------------------------------------------

/// Checks `src`, asserts the model is accepted with exactly the warning codes `codes` (in order), and
/// renders them.
fn render_warnings(src: &str, codes: &[&str]) -> String {
    let checked = check_source(src, &[]);
    let rendered = render_plain("model.opt", src, &checked.diagnostics);
    assert!(checked.model.is_some(), "a model with only warnings is accepted:\n{rendered}");
    let found: Vec<&str> = checked.diagnostics.iter().map(|d| d.code.as_str()).collect();
    assert_eq!(found, codes, "warning codes for:\n{src}\n{rendered}");
    assert!(checked.diagnostics.iter().all(|d| !d.is_error() && d.primary_span().is_some()));
    rendered
}

/// `warned!(name, source, [codes])`: one snapshot test of a model accepted with warnings.
macro_rules! warned {
    ($name:ident, $src:expr, [$($code:literal),* $(,)?]) => {
        #[test]
        fn $name() {
            let src: &str = $src;
            let rendered = render_warnings(src, &[$($code),*]);
            insta::with_settings!({ description => src, omit_expression => true }, {
                insta::assert_snapshot!(rendered);
            });
        }
    };
}

warned!(
    an_input_the_forward_never_reads_is_a_warning,
    concat!(
        prelude!(),
        "input mask: f32[batch, seq]\nlayer wte = embedding(16, hidden)\nforward { output y = wte(tokens) }\n"
    ),
    ["W0001"]
);

warned!(
    a_root_layer_never_called_is_a_warning,
    concat!(
        prelude!(),
        "layer wte = embedding(16, hidden)\nlayer spare = linear(hidden, hidden)\nforward { output y = wte(tokens) }\n"
    ),
    ["W0002"]
);

warned!(
    a_block_layer_its_forward_never_calls_is_a_warning,
    concat!(
        prelude!(),
        "block B {\n  layer fc = linear(hidden, hidden)\n  layer extra = layernorm(hidden)\n  forward(x) { return fc(x) }\n}\n",
        "layer wte = embedding(16, hidden)\nlayer b = B()\nforward { output y = b(wte(tokens)) }\n"
    ),
    ["W0002"]
);

/// What is used (read, called, repeated, tied by name, or possibly tied by a path) is never warned of.
#[test]
fn declarations_in_use_are_not_warned_of() {
    let sources = [
        // An embedding used only as a tied head's table.
        concat!(
            prelude!(),
            "input targets: i32[batch, seq]\nlayer wte = embedding(16, hidden)\nlayer head = linear(hidden, 16, bias: false, tied: wte)\n",
            "forward { output loss = cross_entropy(head(wte(tokens)), targets) }\n"
        ),
        // A repeated block and the layers of its forward; an input read only inside an expression.
        concat!(
            prelude!(),
            "block B {\n  layer fc = linear(hidden, hidden)\n  forward(x) { return x + fc(x) }\n}\n",
            "input scale_by: f32[batch, seq, hidden]\nlayer wte = embedding(16, hidden)\nlayer h = repeat(2) B()\n",
            "forward { output y = h(wte(tokens) * scale_by) }\n"
        ),
        // A root embedding tied to by name from inside a block, nested in another.
        concat!(
            prelude!(),
            "layer wte = embedding(16, hidden)\nblock Head {\n  layer dec = linear(hidden, 16, tied: wte)\n",
            "  forward(x) { return dec(x) }\n}\nblock Outer {\n  layer h = Head()\n  forward(x) { return h(x) }\n}\n",
            "layer o = Outer()\nforward { output y = o(wte(tokens)) }\n"
        ),
        // An embedding that a path string may name, though nothing calls it by name.
        concat!(
            prelude!(),
            "layer wte = embedding(16, hidden)\nlayer other = embedding(16, hidden)\n",
            "layer head = linear(hidden, 16, bias: false, tied: \"wte\")\nforward { output y = head(wte(tokens)) }\n"
        ),
    ];
    for src in sources {
        let checked = check_source(src, &[]);
        let rendered = render_plain("model.opt", src, &checked.diagnostics);
        assert!(checked.model.is_some() && checked.diagnostics.is_empty(), "for:\n{src}\n{rendered}");
    }
}

/// A name that reads as something else is not a use: a local assigned before any read hides an input,
/// a value or a call never names a layer or an input (respectively), and a tie from a layer that is
/// never called uses nothing.
#[test]
fn mentions_that_are_not_uses_are_warned_of() {
    let cases: [(&str, &[&str]); 4] = [
        (
            concat!(
                prelude!(),
                "input mask: f32[batch, seq]\nlayer wte = embedding(16, hidden)\nforward {\n  mask = wte(tokens)\n  output y = mask\n}\n"
            ),
            &["W0001"],
        ),
        (
            concat!(
                prelude!(),
                "layer wte = embedding(16, hidden)\nlayer spare = linear(hidden, hidden)\nforward {\n  spare = wte(tokens)\n  output y = spare\n}\n"
            ),
            &["W0002"],
        ),
        (
            concat!(
                prelude!(),
                "input gelu: f32[batch, seq]\nlayer wte = embedding(16, hidden)\nforward { output y = gelu(wte(tokens)) }\n"
            ),
            &["W0001"],
        ),
        (
            concat!(
                prelude!(),
                "input x: f32[batch, seq, hidden]\nlayer wte = embedding(16, hidden)\n",
                "layer head = linear(hidden, 16, tied: wte)\nlayer fc = linear(hidden, hidden)\nforward { output y = fc(x) }\n"
            ),
            &["W0001", "W0002", "W0002"],
        ),
    ];
    for (src, codes) in cases {
        let checked = check_source(src, &[]);
        let rendered = render_plain("model.opt", src, &checked.diagnostics);
        let found: Vec<&str> = checked.diagnostics.iter().map(|d| d.code.as_str()).collect();
        assert_eq!(found, codes, "for:\n{src}\n{rendered}");
    }
}

/// The examples, and every model the docs build on, declare nothing they do not use.
#[test]
fn the_examples_have_no_warnings() {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut checked_files = 0;
    for entry in std::fs::read_dir(&examples).expect("examples/") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|e| e == "opt") {
            let text = std::fs::read_to_string(&path).expect("an example");
            let checked = check_source(&text, &[]);
            let rendered = render_plain(&path.display().to_string(), &text, &checked.diagnostics);
            assert!(checked.model.is_some() && checked.diagnostics.is_empty(), "{}:\n{rendered}", path.display());
            checked_files += 1;
        }
    }
    assert!(checked_files >= 5, "expected the examples to be found");
}
