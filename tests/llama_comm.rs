//! Communication per Llama decoder layer against the formulas of docs/llama.md: SUMMA broadcasts and
//! reduces of the seven bias-free linears on optimus q x q, and Megatron's four all-reduces of b*s*h on
//! 1 x p, with grouped-query attention (kv_heads < heads) and rotary embeddings adding nothing.

use optimus::elab::Override;
use optimus::front::check_source;
use optimus::plan::report::{CommEntry, Report, report};
use optimus::plan::{Mesh, Mode, Plan, Strategy};
use optimus::shard::{Target, compile};

/// A reduced Llama: (heads, kv_heads, hidden, ffn, batch, seq).
type Config = (u64, u64, u64, u64, u64, u64);

fn plan(c: Config, strategy: Strategy, mesh: (u64, u64), mode: Mode) -> Plan {
    let (heads, kv_heads, hidden, ffn, batch, seq) = c;
    let text = std::fs::read_to_string("examples/llama.opt").expect("example");
    let sets = [
        ("vocab", 500),
        ("layers", 2),
        ("context", seq),
        ("seq", seq),
        ("batch", batch),
        ("heads", heads),
        ("kv_heads", kv_heads),
        ("hidden", hidden),
        ("ffn", ffn),
    ];
    let overrides: Vec<Override> =
        sets.iter().map(|(n, v)| Override { name: n.to_string(), value: v.to_string() }).collect();
    let model = check_source(&text, &overrides).model.expect("the reduced Llama checks");
    let target = Target::plain(Mesh::new(mesh.0, mesh.1), strategy, mode);
    match compile(&model, "examples/llama.opt", &text, target) {
        Ok(p) => p,
        Err(d) => panic!("{c:?} on {mesh:?}: {:?}", d.iter().map(|d| &d.message).collect::<Vec<_>>()),
    }
}

fn in_layer(r: &Report, l: u64) -> impl Iterator<Item = &CommEntry> {
    let prefix = format!("model.layers.{l}.");
    r.communication.iter().filter(move |c| c.origin.scope.starts_with(&prefix))
}

/// Elements of the SUMMA broadcasts and reduces of layer `l`.
fn summa_elements(r: &Report, l: u64) -> u64 {
    in_layer(r, l)
        .filter(|c| (c.kind == "broadcast" || c.kind == "reduce") && c.origin.reason.contains("SUMMA"))
        .map(|c| c.elements)
        .sum()
}

/// The forward SUMMA payload of one linear C[M, N] = A[M, K] B[K, N] per device on q x q: the A and B
/// blocks, (MK + KN)/q, where K <= N; a weight with more input features than output ones is stored
/// across the mesh and moves the output's blocks instead of the input's, (MN + KN)/q.
fn summa_linear(m: u64, k: u64, n: u64, q: u64) -> u64 {
    (m * k.min(n) + k * n) / q
}

/// The SUMMA payload of one layer's seven linears per device, each alone: M = b*s rows, q_proj and
/// o_proj (h -> h), k_proj and v_proj (h -> kv, across the mesh where kv < h), gate_proj and up_proj
/// (h -> f), down_proj (f -> h, across); kv = kv_heads * h / heads. The backward moves twice this.
fn summa_each(c: Config, q: u64) -> u64 {
    let (heads, kv_heads, h, f, b, s) = c;
    let (m, kv) = (b * s, kv_heads * h / heads);
    let linears = [(h, h), (h, h), (h, kv), (h, kv), (h, f), (h, f), (f, h)];
    linears.iter().map(|&(k, n)| summa_linear(m, k, n, q)).sum()
}

/// The input broadcasts that linears of one input with their weights in place share, in elements
/// per device and pass (each step's input block is broadcast once for them all, forward and in dW):
/// up_proj's with gate_proj's, and k_proj's and v_proj's with q_proj's where kv = h (all three in place).
fn shared(c: Config, q: u64) -> u64 {
    let (heads, kv_heads, h, _, b, s) = c;
    let shared_by_attention = if kv_heads == heads { 2 } else { 0 };
    (shared_by_attention + 1) * b * s * h / q
}

/// The forward SUMMA payload of one layer per device: [`summa_each`] less what is [`shared`]. With
/// kv < h < f, as docs/llama.md writes it: [M(4h + 2kv) + 2h^2 + 2h kv + 3hf] / q.
fn summa_forward(c: Config, q: u64) -> u64 {
    summa_each(c, q) - shared(c, q)
}

/// docs/llama.md's closed form, where kv < h < f.
#[test]
fn the_closed_form_is_the_sum_over_the_linears() {
    for &c in CONFIGS {
        let (heads, kv_heads, h, f, b, s) = c;
        let (m, kv) = (b * s, kv_heads * h / heads);
        if kv < h && h < f {
            let closed = (m * (4 * h + 2 * kv) + 2 * h * h + 2 * h * kv + 3 * h * f) / 2;
            assert_eq!(summa_forward(c, 2), closed, "{c:?}");
        }
    }
}

const CONFIGS: &[Config] = &[(8, 4, 64, 96, 4, 16), (8, 2, 128, 192, 4, 8), (4, 4, 64, 160, 8, 8)];

#[test]
fn optimus_layer_payload_matches_the_formula() {
    for &c in CONFIGS {
        for q in [2u64, 4] {
            if c.1 % q != 0 || c.4 % q != 0 {
                continue;
            }
            let infer = report(&plan(c, Strategy::Optimus, (q, q), Mode::Infer));
            let train = report(&plan(c, Strategy::Optimus, (q, q), Mode::Train));
            for l in 0..2 {
                let case = format!("{c:?} q={q} layer {l}");
                assert_eq!(summa_elements(&infer, l), summa_forward(c, q), "{case}: forward");
                // The backward: dW sharing the input's broadcasts as forward; dX of each linear alone but
                // for input gradients only added to each other, whose partials are summed before one
                // reduce a step: gate_proj's and up_proj's (one reduce of M h/q saved), and where kv = h
                // q's, k's and v's (two saved).
                let reduces_saved = if c.0 == c.1 { 3 } else { 1 };
                let summed = reduces_saved * c.4 * c.5 * c.2 / q;
                let train_payload = 3 * summa_each(c, q) - 2 * shared(c, q) - summed;
                assert_eq!(summa_elements(&train, l), train_payload, "{case}: forward + backward");
                // Besides SUMMA, only row statistics and norm-weight gradients travel: no collective
                // moves an activation-sized block for rotary, grouped-query attention or the gate.
                let m = c.4 * c.5;
                let other: Vec<_> = in_layer(&train, l).filter(|e| !e.origin.reason.contains("SUMMA")).collect();
                assert!(other.iter().all(|e| e.elements <= (m / q).max(c.2 / q)), "{case}: {other:#?}");
            }
        }
    }
}

#[test]
fn megatron_all_reduces_four_activations_per_layer() {
    for &c in CONFIGS {
        for p in [2u64, 4] {
            if c.1 % p != 0 {
                continue;
            }
            let (h, m) = (c.2, c.4 * c.5);
            let infer = report(&plan(c, Strategy::Megatron, (1, p), Mode::Infer));
            let train = report(&plan(c, Strategy::Megatron, (1, p), Mode::Train));
            for l in 0..2 {
                let case = format!("{c:?} 1x{p} layer {l}");
                let forward: Vec<_> = in_layer(&infer, l).collect();
                assert_eq!(forward.len(), 2, "{case}: o_proj and down_proj: {forward:#?}");
                assert!(forward.iter().all(|e| e.kind == "all_reduce" && e.elements == m * h), "{case}");
                let all: Vec<_> = in_layer(&train, l).collect();
                assert_eq!(all.len(), 4, "{case}: 2 forward + 2 backward (dX of q|k|v and of gate|up summed locally)");
                assert!(all.iter().all(|e| e.kind == "all_reduce" && e.elements == m * h), "{case}: {all:#?}");
            }
        }
    }
}
