//! Why a plan instruction exists: a structured kind that tools read (the simulator finds SUMMA steps by
//! it, never by parsing text), and the text people read (`inspect`, the verifier's messages).

use serde::{Deserialize, Serialize};

/// The reason an instruction exists. In a plan file the kind's fields sit beside the text:
/// `{"kind": "summa", "product": "ab", "step": 2, "steps": 4, "part": "broadcast_a",
/// "text": "linear: SUMMA AB step 2 of 4: broadcast A block along the row"}`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Reason {
    #[serde(flatten)]
    pub kind: ReasonKind,
    pub text: String,
    /// For the backward pass's copy of a forward instruction: the block instance it recomputes
    /// (`h.3`). The kind is the forward instruction's; the text starts `recompute of BLOCK: `.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute: Option<String>,
}

/// What kind of work an instruction does, as far as tools that read the plan need to know.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ReasonKind {
    /// One part of step `step` (1 to `steps`) of a SUMMA product on a q x q mesh (`steps` = q): the
    /// step's broadcasts have root `step - 1` in their group.
    Summa { product: SummaProduct, step: u64, steps: u64, part: SummaPart },
    /// A matrix product with no communication: on one device, Megatron's column- and row-parallel
    /// linears, and a SUMMA product on a 1 x 1 mesh.
    LocalProduct,
    /// Any other operator's kernel on this device's blocks, with no communication (embeddings, bias,
    /// element-wise operators, attention, applying a normalisation, the loss and their backwards).
    Compute,
    /// Pending sums summed over a mesh axis: an all-reduce, or a reduce-scatter when `scatter`.
    PartialSum { scatter: bool },
    /// Blocks of a value gathered over a mesh axis.
    Gather,
    /// A value's block sent to the device across the grid's diagonal, whose block comes back: the
    /// value's row and column splits swap.
    Transpose,
    /// This device's block of a value that it holds whole (no communication).
    Slice,
    /// Row statistics of a normalisation or of cross-entropy: the local part, and its sum (or max) over
    /// the mesh axes that split the rows.
    Statistics { of: Statistic },
    /// The squared global gradient norm: each device's sum of squares, and its all-reduce.
    GradientNorm,
    /// An optimizer step on this device's shard of a parameter.
    Optimizer,
    /// A conversion between float32 and bf16: a master weight's bf16 copy, a gradient's float32 copy, a
    /// SUMMA product's float32 sum rounded once.
    Cast,
    /// The sum of the gradients of bucket `bucket` over the data-parallel replicas: an all-reduce, or
    /// under ZeRO-1 a reduce-scatter (gradients are summed in buckets, each issued as soon as its
    /// gradients are complete, so that the sums can overlap the rest of the backward pass).
    DataParallelGradient { bucket: u32 },
}

/// Which SUMMA product a step belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SummaProduct {
    /// C = A B: A broadcast along the row, B along the column, accumulated in place.
    Ab,
    /// C = A B^T: B broadcast along the column, the partial product reduced along the row.
    Abt,
    /// C = A^T B: A broadcast along the row, the partial product reduced along the column.
    Atb,
    /// C = A B^T with B kept in place: A broadcast along the column, the partial product reduced along
    /// the row, so that C comes out with A's rows over the mesh columns and B's over the mesh rows (a
    /// tied head's logits when the tokens are fewer than the vocabulary's rows).
    AbtKeepingB,
    /// C = A B with B kept in place, for an A whose columns lie over the mesh rows (the logits'
    /// gradient as `AbtKeepingB` lays it out): A broadcast along the row, the partial product reduced
    /// along the column.
    AbKeepingB,
    /// C = A^T B for an A whose rows lie over the mesh columns: A broadcast along the row and B along
    /// the column, accumulated in place.
    AtbAccumulated,
    /// C = A B^T for a B laid across the mesh (its rows over the mesh columns, its columns over the
    /// mesh rows: a tied table transposed across the grid's diagonal): A broadcast along the row and B
    /// along the column, accumulated in place. Neither moves C.
    AbtAccumulated,
    /// C = A B for a B laid across the mesh (as [`SummaProduct::AbtAccumulated`]'s): B broadcast along
    /// the column, the partial product reduced along the row.
    AbReduced,
    /// C = A^T B with B moving: B broadcast along the row, the partial product reduced along the
    /// column, so that C comes out laid across the mesh (a tied table's gradient, never moving logits).
    AtbMovingB,
    /// C = A B keeping in place a B laid across the mesh (a weight stored so): A broadcast along the
    /// column, the partial product reduced along the row, so that C comes out with B's columns over the
    /// mesh rows and A's rows over the mesh columns (a decoding step's product of few tokens, which
    /// moves their blocks instead of the weight's).
    AbKeepingBAcross,
    /// C = A B^T keeping in place a B laid across the mesh, for an A whose columns lie over the mesh
    /// rows (an output gradient transposed across the diagonal): A broadcast along the row, the partial
    /// product reduced along the column, so that C comes out with A's rows over the mesh rows (dX of a
    /// weight stored across the mesh, over a small training batch).
    AbtKeepingBAcross,
    /// C = A^T B accumulated in place where C is laid across the mesh, for a B whose columns lie over
    /// the mesh rows: A broadcast along the column and B along the row (dW of a weight stored across
    /// the mesh, over a small training batch).
    AtbAccumulatedAcross,
}

impl SummaProduct {
    /// The name the reason text uses.
    pub fn name(self) -> &'static str {
        match self {
            SummaProduct::Ab => "AB",
            SummaProduct::Abt => "ABT",
            SummaProduct::Atb => "ATB",
            SummaProduct::AbtKeepingB => "ABT (B in place)",
            SummaProduct::AbKeepingB => "AB (B in place)",
            SummaProduct::AtbAccumulated => "ATB (accumulated)",
            SummaProduct::AbtAccumulated => "ABT (accumulated)",
            SummaProduct::AbReduced => "AB (reduced)",
            SummaProduct::AtbMovingB => "ATB (B moving)",
            SummaProduct::AbKeepingBAcross => "AB (B across, in place)",
            SummaProduct::AbtKeepingBAcross => "ABT (B across, in place)",
            SummaProduct::AtbAccumulatedAcross => "ATB (accumulated across)",
        }
    }
}

/// The part of a SUMMA step an instruction is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SummaPart {
    /// Broadcast of the step's A block along the mesh row.
    BroadcastA,
    /// Broadcast of the step's B block along the mesh column.
    BroadcastB,
    /// The local product into a partial block (AB^T, A^T B).
    Multiply,
    /// The local product added into the output block (AB).
    MultiplyAccumulate,
    /// The reduction of the partial C block to the step's root (AB^T along the row, A^T B along the column).
    ReduceC,
}

/// Whose row statistics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Statistic {
    /// LayerNorm's sum and centred sum of squares.
    LayerNorm,
    /// The two row sums of LayerNorm's backward.
    LayerNormGrad,
    /// RMSNorm's sum of squares.
    RmsNorm,
    /// The row sum of RMSNorm's backward.
    RmsNormGrad,
    /// Cross-entropy's row max, target logit and sum of exponentials, and the count of targets not ignored.
    CrossEntropy,
}

impl Reason {
    /// The one way the lowering makes a reason: its kind and the text that says it in words.
    pub fn new(kind: ReasonKind, text: impl Into<String>) -> Reason {
        Reason { kind, text: text.into(), recompute: None }
    }

    /// Part `part` of step `step` of `steps` of a SUMMA `product` computing `what` ("linear"); the text
    /// follows from the kind: `linear: SUMMA AB step 2 of 4: broadcast A block along the row`.
    pub fn summa_step(what: &str, product: SummaProduct, step: u64, steps: u64, part: SummaPart) -> Reason {
        let text = format!("{what}: SUMMA {} step {step} of {steps}: {}", product.name(), part.text(product));
        Reason::new(ReasonKind::Summa { product, step, steps, part }, text)
    }

    /// The reason of the backward pass's copy of this forward instruction, recomputing block `unit`.
    pub fn recomputed(&self, unit: &str) -> Reason {
        Reason {
            kind: self.kind.clone(),
            text: format!("recompute of {unit}: {}", self.text),
            recompute: Some(unit.to_string()),
        }
    }
}

impl SummaPart {
    /// The words for this part of a step of `product`.
    fn text(self, product: SummaProduct) -> &'static str {
        match (self, product) {
            (
                SummaPart::BroadcastA,
                SummaProduct::AbtKeepingB | SummaProduct::AbKeepingBAcross | SummaProduct::AtbAccumulatedAcross,
            ) => "broadcast A block along the column",
            (SummaPart::BroadcastA, _) => "broadcast A block along the row",
            (SummaPart::BroadcastB, SummaProduct::AtbMovingB | SummaProduct::AtbAccumulatedAcross) => {
                "broadcast B block along the row"
            }
            (SummaPart::BroadcastB, _) => "broadcast B block along the column",
            (SummaPart::Multiply, _) => "multiply",
            (SummaPart::MultiplyAccumulate, _) => "multiply-accumulate",
            (
                SummaPart::ReduceC,
                SummaProduct::Atb
                | SummaProduct::AbKeepingB
                | SummaProduct::AtbMovingB
                | SummaProduct::AbtKeepingBAcross,
            ) => "reduce C block along the column",
            (SummaPart::ReduceC, _) => "reduce C block along the row",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Reason, ReasonKind, Statistic, SummaPart, SummaProduct};

    #[test]
    fn a_summa_step_says_its_product_step_and_part() {
        use SummaPart::{BroadcastA, BroadcastB, ReduceC};
        use SummaProduct::{
            Ab, AbKeepingB, AbKeepingBAcross, AbReduced, Abt, AbtAccumulated, AbtKeepingB, AbtKeepingBAcross, Atb,
            AtbAccumulated, AtbAccumulatedAcross, AtbMovingB,
        };
        let cases = [
            (Ab, [2, 4], BroadcastA, "AB step 2 of 4: broadcast A block along the row"),
            (Atb, [1, 2], ReduceC, "ATB step 1 of 2: reduce C block along the column"),
            (Abt, [3, 3], ReduceC, "ABT step 3 of 3: reduce C block along the row"),
            (AbtKeepingB, [1, 2], BroadcastA, "ABT (B in place) step 1 of 2: broadcast A block along the column"),
            (AbKeepingB, [2, 2], ReduceC, "AB (B in place) step 2 of 2: reduce C block along the column"),
            (AtbAccumulated, [2, 2], BroadcastB, "ATB (accumulated) step 2 of 2: broadcast B block along the column"),
            (AbtAccumulated, [1, 3], BroadcastB, "ABT (accumulated) step 1 of 3: broadcast B block along the column"),
            (AbReduced, [3, 3], ReduceC, "AB (reduced) step 3 of 3: reduce C block along the row"),
            (AtbMovingB, [2, 4], BroadcastB, "ATB (B moving) step 2 of 4: broadcast B block along the row"),
            (
                AbKeepingBAcross,
                [1, 2],
                BroadcastA,
                "AB (B across, in place) step 1 of 2: broadcast A block along the column",
            ),
            (AbKeepingBAcross, [2, 2], ReduceC, "AB (B across, in place) step 2 of 2: reduce C block along the row"),
            (AtbMovingB, [4, 4], ReduceC, "ATB (B moving) step 4 of 4: reduce C block along the column"),
            (
                AbtKeepingBAcross,
                [1, 2],
                BroadcastA,
                "ABT (B across, in place) step 1 of 2: broadcast A block along the row",
            ),
            (
                AbtKeepingBAcross,
                [2, 2],
                ReduceC,
                "ABT (B across, in place) step 2 of 2: reduce C block along the column",
            ),
            (
                AtbAccumulatedAcross,
                [1, 2],
                BroadcastA,
                "ATB (accumulated across) step 1 of 2: broadcast A block along the column",
            ),
            (
                AtbAccumulatedAcross,
                [2, 2],
                BroadcastB,
                "ATB (accumulated across) step 2 of 2: broadcast B block along the row",
            ),
        ];
        for (product, [step, steps], part, text) in cases {
            let reason = Reason::summa_step("tied linear", product, step, steps, part);
            assert_eq!(reason.text, format!("tied linear: SUMMA {text}"));
        }
    }

    #[test]
    fn a_reason_is_json_with_its_kind_beside_its_text_and_reads_back() {
        let r = Reason::summa_step("linear", SummaProduct::Abt, 2, 4, SummaPart::BroadcastB).recomputed("h.3");
        let json = serde_json::to_value(&r).expect("serialize");
        assert_eq!(
            json,
            serde_json::json!({
                "kind": "summa", "product": "abt", "step": 2, "steps": 4, "part": "broadcast_b",
                "text": "recompute of h.3: linear: SUMMA ABT step 2 of 4: broadcast B block along the column",
                "recompute": "h.3",
            })
        );
        assert_eq!(serde_json::from_value::<Reason>(json).expect("deserialize"), r);
        let stats = Reason::new(ReasonKind::Statistics { of: Statistic::RmsNorm }, "RMSNorm statistics");
        let json = serde_json::to_string(&stats).expect("serialize");
        assert_eq!(json, r#"{"kind":"statistics","of":"rms_norm","text":"RMSNorm statistics"}"#);
        assert_eq!(serde_json::from_str::<Reason>(&json).expect("deserialize"), stats);
    }

    #[test]
    fn a_reason_without_a_known_kind_does_not_read() {
        assert!(serde_json::from_str::<Reason>(r#"{"kind":"mystery","text":"x"}"#).is_err());
        assert!(serde_json::from_str::<Reason>(r#"{"text":"x"}"#).is_err());
    }
}
