//! Where a training plan's instructions fall along the model: before the first repeated layer, in
//! each repeated layer (`h.3`), or after the last. The pipeline's simulator groups these pieces into
//! stages to time them, and [`crate::pipeline_cut`] groups them to give each stage its own program.

use crate::phases::StepPhases;
use crate::{BufferId, Instr, Plan};
use std::collections::HashMap;

/// The repeated layer a scope is inside: `h.3.attn.c_attn` is in `h.3` (the scope up to its first
/// all-digit part after the first).
pub fn layer_of(scope: &str) -> Option<&str> {
    let mut end = 0;
    for (i, part) in scope.split('.').enumerate() {
        end += part.len() + usize::from(i > 0);
        if i > 0 && !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            return Some(&scope[..end]);
        }
    }
    None
}

/// The scope of an instruction ("" for waits, frees and unscoped ones).
pub fn scope_of<'p>(plan: &'p Plan, instr: &Instr) -> &'p str {
    let origin = match instr {
        Instr::Kernel { origin, .. } | Instr::Collective { origin, .. } => *origin,
        Instr::Free { .. } | Instr::Wait { .. } => return "",
    };
    plan.origins.get(origin as usize).map_or("", |o| o.scope.as_str())
}

/// The pieces of a plan's forward and backward passes: piece 0 runs before the first repeated layer,
/// piece k (1..=L) is layer k - 1 of `layers`, piece L + 1 runs after the last.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstructionPieces {
    /// The repeated layers' names (`h.3`), in forward order.
    pub layers: Vec<String>,
    /// Each instruction's piece; 0 for the update's instructions (from `updates_begin`). Frees and
    /// waits get a piece by the same scope rules as the rest, which says little: a cut that runs them
    /// places them by the buffers they name.
    pub piece_of: Vec<usize>,
    /// The first backward instruction (the memory plan's end of the forward pass).
    pub forward_end: usize,
    /// The first instruction of the update (the gradient norm or the first optimizer step).
    pub updates_begin: usize,
}

impl InstructionPieces {
    /// The piece after the last repeated layer (the head's).
    pub fn tail(&self) -> usize {
        self.layers.len() + 1
    }
}

/// Which piece each forward and backward instruction belongs to. In the forward pass an instruction
/// outside the repeated layers belongs to the first piece until a layer has run, and to the last after;
/// in the backward pass the other way round, unless its scope's first part was placed in the forward
/// pass (`ln_f`, `wte`).
pub fn instruction_pieces(plan: &Plan) -> InstructionPieces {
    let phases = StepPhases::of(plan);
    // The memory plan's end of the forward pass is the first backward instruction (the phases' is
    // where the loss is written, which a plan may do late).
    let (forward_end, updates_begin) = (plan.memory.forward_end.min(phases.updates_begin()), phases.updates_begin());
    let mut assigner = Assigner::default();
    let mut piece_of: Vec<usize> = Vec::with_capacity(plan.program.len());
    // Each origin's layer piece, found once (None inside: an origin outside the repeated layers).
    let mut layer_piece: Vec<Option<Option<usize>>> = vec![None; plan.origins.len()];
    // The piece of each buffer's last writer so far (`usize::MAX`: the head's, after the layers).
    let mut writer_piece: Vec<Option<usize>> = vec![None; plan.buffers.len()];
    for (i, instr) in plan.program.iter().enumerate() {
        if i >= updates_begin {
            piece_of.push(0);
            continue;
        }
        let forward = i < forward_end;
        let origin = match instr {
            Instr::Kernel { origin, .. } | Instr::Collective { origin, .. } => Some(*origin as usize),
            Instr::Free { .. } | Instr::Wait { .. } => None,
        };
        let scope = scope_of(plan, instr);
        let layer = match origin.and_then(|o| layer_piece.get_mut(o)) {
            Some(slot) => *slot.get_or_insert_with(|| layer_of(scope).map(|l| assigner.layer_piece(l))),
            None => None,
        };
        let piece = match layer {
            Some(piece) => {
                assigner.inside_layer(forward);
                piece
            }
            // An unscoped backward instruction that only reads what the head's pieces wrote (a loss's
            // sum over the mesh that the plan placed late) stays with the head.
            None if !forward && scope.is_empty() && reads_only_tail(instr, &writer_piece) => usize::MAX,
            None => assigner.outside_layers(scope, forward),
        };
        piece_of.push(piece);
        for_each_written(instr, |b| {
            if let Some(slot) = writer_piece.get_mut(b.0 as usize) {
                *slot = Some(piece);
            }
        });
    }
    let tail = assigner.layers.len() + 1;
    for piece in &mut piece_of {
        if *piece == usize::MAX {
            *piece = tail;
        }
    }
    InstructionPieces { layers: assigner.layers, piece_of, forward_end, updates_begin }
}

/// Whether every buffer `instr` reads was last written by the head's pieces (and it reads one).
fn reads_only_tail(instr: &Instr, writer_piece: &[Option<usize>]) -> bool {
    let reads: &[crate::BufferId] = match instr {
        Instr::Kernel { inputs, .. } => inputs,
        Instr::Collective { collective, .. } => std::slice::from_ref(&collective.send),
        Instr::Free { .. } | Instr::Wait { .. } => &[],
    };
    !reads.is_empty() && reads.iter().all(|b| writer_piece.get(b.0 as usize).copied().flatten() == Some(usize::MAX))
}

/// Calls `visit` with the buffer an instruction writes.
fn for_each_written(instr: &Instr, mut visit: impl FnMut(crate::BufferId)) {
    match instr {
        Instr::Kernel { output, .. } => visit(*output),
        Instr::Collective { collective, .. } => visit(collective.recv),
        Instr::Wait { recv, .. } => visit(*recv),
        Instr::Free { .. } => {}
    }
}

/// The walk's state: the layers met so far and where the pieces outside them went.
#[derive(Default)]
struct Assigner {
    layers: Vec<String>,
    index: HashMap<String, usize>,
    named: HashMap<String, usize>,
    seen_forward: bool,
    seen_backward: bool,
}

impl Assigner {
    fn layer_piece(&mut self, layer: &str) -> usize {
        if let Some(&k) = self.index.get(layer) {
            return k + 1;
        }
        self.layers.push(layer.to_string());
        self.index.insert(layer.to_string(), self.layers.len() - 1);
        self.layers.len()
    }

    /// Notes that an instruction of a repeated layer ran in the forward (or backward) pass.
    fn inside_layer(&mut self, forward: bool) {
        if forward {
            self.seen_forward = true;
        } else {
            self.seen_backward = true;
        }
    }

    /// The piece of an instruction outside the repeated layers with scope `scope`; `forward` says
    /// which pass it is in. The last piece's index is only known at the end: `usize::MAX` stands for
    /// it until then.
    ///
    /// A backward instruction goes with the forward pass of its scope, or of the longest enclosing
    /// scope the forward pass met: Llama's `model.embed_tokens` (before the layers) and `model.norm`
    /// (after them) share their first name, and keying by that name alone put the final norm's backward
    /// with the embedding, on the first stage, which an interleaved schedule could not order.
    fn outside_layers(&mut self, scope: &str, forward: bool) -> usize {
        if forward {
            let piece = if self.seen_forward { usize::MAX } else { 0 };
            if !scope.is_empty() {
                self.named.entry(scope.to_string()).or_insert(piece);
            }
            return piece;
        }
        let enclosing = std::iter::successors(Some(scope), |s| s.rsplit_once('.').map(|(head, _)| head));
        match enclosing.filter(|s| !s.is_empty()).find_map(|s| self.named.get(s)) {
            Some(&piece) => piece,
            None if self.seen_backward => 0,
            None => usize::MAX,
        }
    }
}

/// The parameter each buffer belongs to, by buffer id: every parameter's block, gradient and state, and
/// the buffers that the program from instruction `from` on writes them from (a gradient's bf16 sum over
/// the replicas before its cast): walked backwards from the end, an instruction that writes a
/// parameter's buffer gives its operands to that parameter, unless they have one already.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParameterOwners(Vec<Option<usize>>);

impl ParameterOwners {
    pub fn of_plan(plan: &Plan, from: usize) -> ParameterOwners {
        let mut owners = ParameterOwners(vec![None; plan.buffers.len()]);
        for (k, p) in plan.params.iter().enumerate() {
            for b in std::iter::once(p.buffer).chain(p.grad).chain(p.state.iter().copied()) {
                owners.claim(b, k);
            }
        }
        for instr in plan.program.get(from..).unwrap_or_default().iter().rev() {
            match instr {
                Instr::Kernel { inputs, output, .. } => {
                    if let Some(p) = owners.of(*output) {
                        inputs.iter().for_each(|&input| owners.claim(input, p));
                    }
                }
                Instr::Collective { collective, .. } => {
                    if let Some(p) = owners.of(collective.recv) {
                        owners.claim(collective.send, p);
                    }
                }
                Instr::Free { .. } | Instr::Wait { .. } => {}
            }
        }
        owners
    }

    /// The parameter (its index in the plan's `params`) that buffer `b` belongs to.
    pub fn of(&self, b: BufferId) -> Option<usize> {
        self.0.get(b.0 as usize).copied().flatten()
    }

    /// Gives `b` to `param` unless it has a parameter already.
    fn claim(&mut self, b: BufferId, param: usize) {
        if let Some(slot @ None) = self.0.get_mut(b.0 as usize) {
            *slot = Some(param);
        }
    }
}

/// A virtual stage's pieces in words: "embedding + h.0..5", "h.6..11", "h.90..95 + head".
pub fn describe_pieces(layers: &[String], pieces: &std::ops::Range<usize>) -> String {
    let count = layers.len();
    let first_layer = pieces.start.max(1);
    let last_layer = pieces.end.saturating_sub(1).min(count);
    let mut text = String::new();
    if pieces.start == 0 {
        text.push_str("embedding + ");
    }
    let name = |piece: usize| layers.get(piece.wrapping_sub(1)).map_or("", String::as_str);
    if first_layer == last_layer {
        text.push_str(name(first_layer));
    } else {
        text.push_str(&layer_range(name(first_layer), name(last_layer)));
    }
    if pieces.end == count + 2 {
        text.push_str(" + head");
    }
    text
}

/// "h.0..11" for layers `h.0` to `h.11` (their common prefix once), else "a..b".
fn layer_range(first: &str, last: &str) -> String {
    match (first.rsplit_once('.'), last.rsplit_once('.')) {
        (Some((prefix, from)), Some((same, to))) if prefix == same => format!("{prefix}.{from}..{to}"),
        _ => format!("{first}..{last}"),
    }
}

/// Splits `layers` repeated layers into `groups` contiguous runs of sizes as equal as possible (the
/// earlier runs one longer): the pieces each run holds, the first run with piece 0 and the last with
/// piece `layers + 1`. Empty when there are fewer layers than runs.
pub fn even_split(layers: usize, groups: usize) -> Vec<std::ops::Range<usize>> {
    if groups == 0 || layers < groups {
        return Vec::new();
    }
    let starts: Vec<usize> = (0..groups).map(|g| g * (layers / groups) + g.min(layers % groups)).collect();
    ranges_of_starts(&starts, layers)
}

/// The pieces of each run of layers, given the first layer of each run (in order, the first 0).
pub fn ranges_of_starts(starts: &[usize], layers: usize) -> Vec<std::ops::Range<usize>> {
    (0..starts.len())
        .map(|g| {
            let from = if g == 0 { 0 } else { starts[g] + 1 };
            let to = if g + 1 == starts.len() { layers + 2 } else { starts[g + 1] + 1 };
            from..to
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_found_by_their_first_numbered_part() {
        assert_eq!(layer_of("h.3.attn.c_attn"), Some("h.3"));
        assert_eq!(layer_of("model.layers.12.mlp"), Some("model.layers.12"));
        assert_eq!(layer_of("encoder.layer.11.output"), Some("encoder.layer.11"));
        assert_eq!(layer_of("h.12"), Some("h.12"));
        assert_eq!(layer_of("ln_f"), None);
        assert_eq!(layer_of("3.x"), None);
        assert_eq!(layer_of(""), None);
    }

    #[test]
    fn a_run_of_layers_names_its_prefix_once() {
        assert_eq!(layer_range("h.0", "h.11"), "h.0..11");
        assert_eq!(layer_range("bert.encoder.layer.3", "bert.encoder.layer.12"), "bert.encoder.layer.3..12");
        assert_eq!(layer_range("enc.5", "dec.0"), "enc.5..dec.0");
        let layers: Vec<String> = (0..4).map(|k| format!("h.{k}")).collect();
        assert_eq!(describe_pieces(&layers, &(0..3)), "embedding + h.0..1");
        assert_eq!(describe_pieces(&layers, &(3..4)), "h.2");
        assert_eq!(describe_pieces(&layers, &(4..6)), "h.3 + head");
    }

    #[test]
    fn even_splits_cover_every_piece_once() {
        assert_eq!(even_split(5, 2), vec![0..4, 4..7]);
        assert_eq!(even_split(4, 4), vec![0..2, 2..3, 3..4, 4..6]);
        assert!(even_split(2, 3).is_empty());
        for (layers, groups) in [(7, 3), (12, 4), (2, 2), (9, 1)] {
            let ranges = even_split(layers, groups);
            assert_eq!(ranges.len(), groups);
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[groups - 1].end, layers + 2);
            assert!(ranges.windows(2).all(|w| w[0].end == w[1].start && w[0].start < w[0].end));
        }
    }
}
