//! Megatron's communication per transformer layer in training is the same for BERT (separate query,
//! key and value layers, post-LayerNorm) as for GPT-2 (fused q|k|v, pre-LayerNorm): four all-reduces
//! of b*s*h per layer, two forward (attention and MLP outputs) and two backward (the layer input's
//! gradient from q, k and v, and the MLP input's), the partial input gradients that meet in an add
//! summed locally before one reduction, as Megatron-LM does.

use optimus::elab::Override;
use optimus::front::check_source;
use optimus::plan::report::{CommEntry, Report, report};
use optimus::plan::{Mesh, Mode, Strategy};
use optimus::shard::{Target, compile};

const BATCH: u64 = 4;
const SEQ: u64 = 16;
const HIDDEN: u64 = 64;
const LAYERS: u64 = 3;

fn megatron_report(example: &str, p: u64, mode: Mode) -> Report {
    let path = format!("examples/{example}.opt");
    let text = std::fs::read_to_string(&path).expect("example");
    let sets = [
        ("layers", LAYERS),
        ("hidden", HIDDEN),
        ("heads", 4),
        ("ffn", 4 * HIDDEN),
        ("vocab", 500),
        ("seq", SEQ),
        ("context", SEQ),
        ("batch", BATCH),
    ];
    let overrides: Vec<Override> =
        sets.iter().map(|(n, v)| Override { name: n.to_string(), value: v.to_string() }).collect();
    let model = check_source(&text, &overrides).model.expect("the reduced model checks");
    let memory = optimus::plan::MemoryOptions::DEFAULT;
    let target = Target { memory, ..Target::plain(Mesh::new(1, p), Strategy::Megatron, mode) };
    report(&compile(&model, &path, &text, target).unwrap_or_else(|_| panic!("{example} compiles on 1x{p}")))
}

fn in_layer<'r>(r: &'r Report, prefix: &'r str) -> impl Iterator<Item = &'r CommEntry> + 'r {
    r.communication.iter().filter(move |c| c.origin.scope.starts_with(prefix))
}

/// Activation-sized all-reduces of a report.
fn activation_all_reduces(r: &Report) -> Vec<&CommEntry> {
    r.communication.iter().filter(|c| c.kind == "all_reduce" && c.elements == BATCH * SEQ * HIDDEN).collect()
}

#[test]
fn bert_and_gpt2_all_reduce_four_activations_per_layer_in_training() {
    // (example, layer scope prefix, linears of the head after the layers whose input gradient is summed)
    for (example, layer, head_linears) in [("bert", "bert.encoder.layer.", 2), ("gpt2", "h.", 1)] {
        for p in [2u64, 4] {
            let train = megatron_report(example, p, Mode::Train);
            let infer = megatron_report(example, p, Mode::Infer);
            for l in 0..LAYERS {
                let prefix = format!("{layer}{l}.");
                let forward: Vec<_> = in_layer(&infer, &prefix).collect();
                assert_eq!(forward.len(), 2, "{example} 1x{p} layer {l}: attention and MLP outputs: {forward:#?}");
            }
            // The backward pass sums two input gradients per layer (of q|k|v, or q, k and v and the
            // residual, added locally first; and of the MLP), and one per linear of the head.
            let backward = activation_all_reduces(&train).len() - activation_all_reduces(&infer).len();
            let listed = || format!("{:#?}", activation_all_reduces(&train));
            assert_eq!(backward as u64, 2 * LAYERS + head_linears, "{example} 1x{p}: {}", listed());
            // Nothing else of activation size travels.
            let other = train.communication.iter().filter(|c| c.kind != "all_reduce" && c.elements >= BATCH * SEQ);
            assert!(
                other.clone().all(|c| c.origin.scope.starts_with("cls.")),
                "{example}: {:#?}",
                other.collect::<Vec<_>>()
            );
        }
    }
}
