//! The sharding rules as data: one row per (operator, strategy) giving the layouts the operator asks
//! for its operands in, the layout of its result, and the product it computes, as patterns over the
//! two tensor-parallel mesh axes. This table is the one place where optimus and megatron differ; the
//! rules in `rules.rs` read their row and instantiate it for a node's rank and weight.
//!
//! A pattern names one symbolic placement per tensor-parallel axis (rows, then columns): replicated,
//! a pending sum, the batch split, the last dimension split, a weight's dimension 0 or 1 split, and so
//! on ([`Sym`]). The data-parallel axis is not in the table: `data.rs` fills it in for every layout a
//! rule creates, from the value's role (batch, shared or summed). A new strategy is new rows; a new
//! tensor-parallel axis is a new column of the patterns.

use super::layout::{COLUMN_AXIS, DEPTH_AXIS, Layout, Placement, ROW_AXIS};
use optimus_plan::Strategy;

/// The operator families whose layouts depend on the strategy. The operands of each row are listed
/// in the order given here. Element-wise operators, add, mul, reshape, transpose, select, rotary, the
/// batched matmul and the bias and table gradients are not in the table: they take their operands
/// in the layouts those already have (or derive theirs from a parameter's stored layout), under
/// every strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operator {
    /// y = x W: operands (x, W).
    Linear,
    /// logits = x E^T with E a (tied) embedding table [rows, width]: operands (x, E).
    LinearTied,
    /// dX = dY W^T: operands (dY, W as stored).
    LinearGradInput,
    /// dX = dY E of a tied linear: operands (dY, E as stored).
    LinearGradInputTied,
    /// dW = X^T dY, in the weight's layout: operands (x, dY).
    LinearGradWeight,
    /// dE = dY^T X of a tied linear, in the table's layout: operands (x, dY).
    LinearGradWeightTied,
    /// A row lookup: operands (ids, table).
    Embedding,
    /// Rows 0..seq of a position table: operands (table).
    PositionEmbedding,
    /// LayerNorm and RMSNorm, forward and backward (the backward works in the forward's layouts):
    /// operands (x, gamma); dY is laid out as x.
    Norm,
    /// Attention, forward and backward: operands (q, k, v, or the fused qkv); dY is laid out as the
    /// output.
    Attention,
    /// Cross-entropy, forward and backward: operands (logits, targets).
    CrossEntropy,
}

impl Operator {
    /// Every operator of the table.
    pub const ALL: [Operator; 11] = [
        Operator::Linear,
        Operator::LinearTied,
        Operator::LinearGradInput,
        Operator::LinearGradInputTied,
        Operator::LinearGradWeight,
        Operator::LinearGradWeightTied,
        Operator::Embedding,
        Operator::PositionEmbedding,
        Operator::Norm,
        Operator::Attention,
        Operator::CrossEntropy,
    ];
}

/// The strategies that have rows of their own. One device (`Strategy::None`) runs the 2D rules on a
/// 1 x 1 mesh, where every split is whole.
pub const STRATEGIES: [Strategy; 3] = [Strategy::Optimus, Strategy::Megatron, Strategy::ThreeD];

/// A placement along one tensor-parallel axis, symbolically: [`Sym::place`] makes it a [`Placement`]
/// for a node's rank and weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Sym {
    /// Every member of the axis holds the whole extent.
    Rep,
    /// Each member holds a term of a pending sum.
    Partial,
    /// An activation's batch (dimension 0) split; replicated when it has no batch dimension.
    Batch,
    /// The batch split within each block of the rows' split (3D's depth axis, which splits the batch
    /// after the rows have): a factor split of dimension 0 over the rows' parts.
    BatchInner,
    /// An activation's last dimension split.
    Last,
    /// A weight's or table's dimension 0 (its input features, or its rows) split.
    Dim0,
    /// A weight's or table's dimension 1 split.
    Dim1,
    /// A weight's output features (dimension 1) split as the weight is: for a fused (3, heads, head)
    /// output, its heads factor.
    Out,
    /// An activation's last dimension split as the weight's output features are ([`Sym::Out`]).
    OutLast,
    /// An activation's last dimension split into whole heads: for a fused (3, heads, head) input, its
    /// heads factor.
    Heads,
}

/// What a [`Sym`] means for one node: its rank and the splits the rule reads from the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// The index of the activations' last dimension.
    pub last: usize,
    /// Whether the activations have a batch dimension (dimension 0).
    pub batch: bool,
    /// How the weight's output features are split: [`Sym::Out`] on the weight (dimension 1).
    pub out: Placement,
    /// The last dimension viewed as (outer, heads, inner), whose heads [`Sym::Heads`] splits.
    pub heads: (u64, u64),
    /// Parts of the mesh rows, which [`Sym::BatchInner`] splits within.
    pub rows: u64,
}

impl Dims {
    /// Activations of rank `last + 1` with a batch dimension, a contiguous output split and heads.
    pub fn new(last: usize) -> Dims {
        Dims { last, batch: true, out: Placement::shard(1), heads: (1, 1), rows: 1 }
    }
}

/// Moves a shard of one dimension to another dimension index, keeping its factor view.
pub fn on_dim(p: Placement, dim: usize) -> Placement {
    match p {
        Placement::Shard { outer, inner, .. } => Placement::shard_factor(dim, outer, inner),
        other => other,
    }
}

/// `layout` with each split moved to the dimension `dim_of` gives for its own.
pub fn layout_on_dims(layout: Layout, dim_of: impl Fn(usize) -> usize) -> Layout {
    let mut moved = layout;
    for p in &mut moved.0 {
        if let Some(d) = p.dim() {
            *p = on_dim(*p, dim_of(d));
        }
    }
    moved
}

/// Where dimension `d` goes when `dim0` and `dim1` are swapped (a transpose, either way).
pub fn swapped(d: usize, dim0: usize, dim1: usize) -> usize {
    if d == dim0 {
        dim1
    } else if d == dim1 {
        dim0
    } else {
        d
    }
}

impl Sym {
    /// The placement this symbol stands for on a node with dimensions `dims`.
    pub fn place(self, dims: &Dims) -> Placement {
        match self {
            Sym::Rep => Placement::Replicate,
            Sym::Partial => Placement::Partial,
            Sym::Batch if dims.batch => Placement::shard(0),
            Sym::Batch => Placement::Replicate,
            Sym::BatchInner if dims.batch => Placement::shard_factor(0, dims.rows, 1),
            Sym::BatchInner => Placement::Replicate,
            Sym::Last => Placement::shard(dims.last),
            Sym::Dim0 => Placement::shard(0),
            Sym::Dim1 => Placement::shard(1),
            Sym::Out => on_dim(dims.out, 1),
            Sym::OutLast => on_dim(dims.out, dims.last),
            Sym::Heads => Placement::shard_factor(dims.last, dims.heads.0, dims.heads.1),
        }
    }
}

/// The layout of one operand or of the result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pattern {
    /// One symbolic placement per tensor-parallel axis: (rows, columns).
    Axes(Sym, Sym),
    /// One symbolic placement per axis of a 3D cube: (rows, columns, depth).
    Axes3(Sym, Sym, Sym),
    /// A parameter's layout as it is stored (chosen where the parameter was first used).
    Stored,
    /// Follows from the operands' layouts, as the rule's documentation says (the loss of
    /// cross-entropy is a pending sum over the axes that split the batch).
    Derived,
}

impl Pattern {
    /// The layout over the tensor-parallel axes (replicated over the data axis) for a node with
    /// dimensions `dims`: `stored` for [`Pattern::Stored`], `None` for [`Pattern::Derived`].
    pub fn layout(self, dims: &Dims, stored: Layout) -> Option<Layout> {
        match self {
            Pattern::Axes(rows, cols) => Some(Layout::new(rows.place(dims), cols.place(dims))),
            Pattern::Axes3(rows, cols, depth) => {
                Some(Layout::new(rows.place(dims), cols.place(dims)).with(DEPTH_AXIS, depth.place(dims)))
            }
            Pattern::Stored => Some(stored),
            Pattern::Derived => None,
        }
    }

    /// The symbol along tensor-parallel `axis`, if this pattern names one.
    pub fn along(self, axis: usize) -> Option<Sym> {
        match (self, axis) {
            (Pattern::Axes(rows, _) | Pattern::Axes3(rows, _, _), ROW_AXIS) => Some(rows),
            (Pattern::Axes(_, cols) | Pattern::Axes3(_, cols, _), COLUMN_AXIS) => Some(cols),
            (Pattern::Axes3(_, _, depth), DEPTH_AXIS) => Some(depth),
            _ => None,
        }
    }
}

/// How a product multiplies its operands' local blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProductKind {
    /// C = A B by SUMMA: A broadcast along the rows, B along the columns, accumulated.
    SummaAb,
    /// C = A B^T by SUMMA: B broadcast along the columns, partial products reduced along the rows.
    SummaAbt,
    /// C = A^T B by SUMMA: A broadcast along the rows, partial products reduced along the columns.
    SummaAtb,
    /// C = A B^T by SUMMA keeping B in place: A broadcast along the columns, partial products reduced
    /// along the rows; C has A's rows over the mesh columns and B's rows over the mesh rows.
    SummaAbtKeepingB,
    /// C = A B by SUMMA keeping B in place, for an A whose columns lie over the mesh rows: A broadcast
    /// along the rows, partial products reduced along the columns.
    SummaAbKeepingB,
    /// C = A^T B by SUMMA for an A whose rows lie over the mesh columns: A broadcast along the rows, B
    /// along the columns, accumulated.
    SummaAtbAccumulated,
    /// C = A B^T by SUMMA for a B laid across the mesh (its rows over the mesh columns, its columns over
    /// the rows): A broadcast along the rows, B along the columns, accumulated.
    SummaAbtAccumulated,
    /// C = A B by SUMMA for a B laid across the mesh: B broadcast along the columns, partial products
    /// reduced along the rows.
    SummaAbReduced,
    /// C = A^T B by SUMMA moving B: B broadcast along the rows, partial products reduced along the
    /// columns; C comes out laid across the mesh (A's columns over the mesh columns, B's over the rows).
    SummaAtbMovingB,
    /// C = A B by SUMMA keeping in place a B laid across the mesh: A broadcast along the columns,
    /// partial products reduced along the rows; C has B's columns over the mesh rows and A's rows over
    /// the mesh columns.
    SummaAbKeepingBAcross,
    /// C = A B^T by SUMMA keeping in place a B laid across the mesh, for an A whose columns lie over the
    /// mesh rows: A broadcast along the rows, partial products reduced along the columns; C has A's rows
    /// over the mesh rows.
    SummaAbtKeepingBAcross,
    /// C = A^T B by SUMMA for a C laid across the mesh and a B whose columns lie over the mesh rows: A
    /// broadcast along the columns, B along the rows, accumulated where C is stored.
    SummaAtbAccumulatedAcross,
    /// One local matmul of the blocks (a split contracted dimension leaves the result partial).
    Local { transpose_a: bool, transpose_b: bool },
    /// 3D: one local matmul of the gathered blocks into a pending sum over mesh axis `axis` (which
    /// splits the contracted dimension), reduce-scattered over that axis into the output's layout.
    Scattered { transpose_a: bool, transpose_b: bool, axis: usize },
}

/// The product a row computes: its kind, which operands are A and B, and what it is called in the
/// plan's reasons.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Product {
    pub kind: ProductKind,
    /// Indices into the row's operands.
    pub a: usize,
    pub b: usize,
    pub what: &'static str,
}

/// When a case of a row applies. The cases of a row are tried in order; the last always applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum When {
    Always,
    /// The input's last dimension is already split along the columns (megatron's row-parallel linear).
    InputSplit,
    /// The stored weight is split along the columns on dimension 0 (a row-parallel weight).
    WeightSplitIn,
    /// The stored weight is split along the columns on another dimension (a column-parallel weight).
    WeightSplitOut,
    /// The embedding table is split on its rows (tied to a linear, or large).
    VocabParallel,
    /// A tied head's input has fewer tokens (per batch-splitting replica) than its table has rows, on
    /// a mesh with more than one row: moving the tokens' blocks instead of the table's costs less.
    FewTokens,
    /// The logits (or their gradient) lie with the vocabulary over the mesh rows and the batch over the
    /// columns, as a tied head that keeps its table in place makes them.
    VocabOnRows,
    /// A tied head moves less with its table laid across a square mesh (transposed across the grid's
    /// diagonal): its products then move token and table blocks, never logits.
    TableAcross,
    /// The weight is (or, at its first use, will be) stored laid across a square mesh: its output
    /// features over the mesh rows, its input features over the columns. Chosen for a weight with more
    /// input features than output ones (an MLP's down projection), so that its three products keep the
    /// wide activation in place and move the narrow one.
    WeightAcross,
    /// So few tokens that moving their blocks costs less than moving the weight's (a decoding step,
    /// or training a wide model on a small batch): the weight, stored in place, stays; the input moves,
    /// laid with its features over the mesh rows (one transpose of its block, which dW reads again),
    /// and dX comes out so laid (one transpose back).
    WeightStays,
    /// As [`When::WeightStays`], for a weight stored across the mesh: the input moves as it lies, and
    /// the output comes out laid across (one transpose of its block back).
    WeightStaysAcross,
}

/// The facts about a node that the guards of its row read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    pub input_split: bool,
    /// The stored weight's placement along the columns.
    pub weight_cols: Option<Placement>,
    pub vocab_parallel: bool,
    pub few_tokens: bool,
    pub vocab_on_rows: bool,
    pub table_across: bool,
    pub weight_across: bool,
    pub weight_stays: bool,
}

impl When {
    pub fn holds(self, facts: &Facts) -> bool {
        match self {
            When::Always => true,
            When::InputSplit => facts.input_split,
            When::WeightSplitIn => matches!(facts.weight_cols, Some(Placement::Shard { dim: 0, .. })),
            When::WeightSplitOut => matches!(facts.weight_cols, Some(Placement::Shard { dim, .. }) if dim != 0),
            When::VocabParallel => facts.vocab_parallel,
            When::FewTokens => facts.few_tokens,
            When::VocabOnRows => facts.vocab_on_rows,
            When::TableAcross => facts.table_across,
            When::WeightAcross => facts.weight_across,
            When::WeightStays => facts.weight_stays && !facts.weight_across,
            When::WeightStaysAcross => facts.weight_stays && facts.weight_across,
        }
    }
}

/// One case of a row: when it applies, the operands' layouts, the result's, and the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Case {
    pub when: When,
    pub operands: &'static [Pattern],
    pub output: Pattern,
    pub product: Option<Product>,
}

/// The rule of one operator under one strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    pub operator: Operator,
    pub strategy: Strategy,
    /// Tried in order; the last applies always.
    pub cases: &'static [Case],
}

impl Rule {
    /// The first case whose guard holds (the last when none does).
    pub fn case(&self, facts: &Facts) -> Option<&'static Case> {
        self.cases.iter().find(|c| c.when.holds(facts)).or(self.cases.last())
    }
}

/// The row of `operator` under `strategy` (one device, and each depth layer of a tesseract mesh, read
/// optimus's rows: the depth axis splits the batch as the data axis does, see `data.rs`).
pub fn rule(operator: Operator, strategy: Strategy) -> Option<&'static Rule> {
    let strategy = match strategy {
        Strategy::None | Strategy::Tesseract => Strategy::Optimus,
        s => s,
    };
    RULES.iter().find(|r| r.operator == operator && r.strategy == strategy)
}

use Pattern::{Axes, Axes3, Derived, Stored};
use Sym::{Batch, BatchInner, Dim0, Dim1, Heads, Last, Out, OutLast, Partial, Rep};

const fn product(kind: ProductKind, a: usize, b: usize, what: &'static str) -> Option<Product> {
    Some(Product { kind, a, b, what })
}

const fn always(operands: &'static [Pattern], output: Pattern, product: Option<Product>) -> Case {
    Case { when: When::Always, operands, output, product }
}

const fn case(when: When, operands: &'static [Pattern], output: Pattern, product: Option<Product>) -> Case {
    Case { when, operands, output, product }
}

const fn row(operator: Operator, strategy: Strategy, cases: &'static [Case]) -> Rule {
    Rule { operator, strategy, cases }
}

const LOCAL: ProductKind = ProductKind::Local { transpose_a: false, transpose_b: false };
const LOCAL_AT: ProductKind = ProductKind::Local { transpose_a: true, transpose_b: false };
const LOCAL_BT: ProductKind = ProductKind::Local { transpose_a: false, transpose_b: true };
const WHOLE: Pattern = Axes(Rep, Rep);

use Operator as Op;
use ProductKind::{
    SummaAb, SummaAbKeepingB, SummaAbKeepingBAcross, SummaAbReduced, SummaAbt, SummaAbtAccumulated, SummaAbtKeepingB,
    SummaAbtKeepingBAcross, SummaAtb, SummaAtbAccumulated, SummaAtbAccumulatedAcross, SummaAtbMovingB,
};

/// A tied table laid across the mesh: its rows (the vocabulary) over the mesh columns, its width over
/// the rows, so that device (t, j) holds block (t, j) of its transpose.
const ACROSS: Pattern = Axes(Dim1, Dim0);
/// A weight stored laid across the mesh: its output features over the mesh rows, its input features
/// over the columns, so that device (t, j) holds block (j, t) of the weight (block (t, j) of its
/// transpose).
const WEIGHT_ACROSS: Pattern = Axes(Out, Dim0);
use Strategy::{Megatron, Optimus, ThreeD};

/// 3D's two activation layouts. `L1`: the batch over the rows and the columns, the features over the
/// depth (the residual stream, the norms' inputs). `L2`: the batch over the rows and, within them, the
/// depth, the features over the columns (attention, the MLP's hidden layer, the logits). A linear on
/// L1 gives L2 and one on L2 gives L1; each gathers its input over the axis that splits its batch
/// besides the rows, gathers its weight over the rows (see `data.rs`), multiplies locally into a
/// pending sum over the axis of the contracted features, and reduce-scatters it over that axis.
const L1: Pattern = Axes3(Batch, Batch, Last);
const L2: Pattern = Axes3(Batch, Last, BatchInner);

const fn scattered(transpose_a: bool, transpose_b: bool, axis: usize) -> ProductKind {
    ProductKind::Scattered { transpose_a, transpose_b, axis }
}

/// The table. Optimus splits activations (batch on the rows, features on the columns) and weights
/// (input features on the rows, output features on the columns) over a q x q mesh and multiplies by
/// SUMMA; megatron splits only along the columns and multiplies locally: a linear is column-parallel
/// on a whole input (output features split) and row-parallel on an input whose features are split
/// (its result a pending sum).
#[rustfmt::skip]
pub const RULES: &[Rule] = &[
    // ---- linear products ----
    // A weight with more input features than output ones is stored across the mesh, so that its products
    // keep the wider activation (the input, or dX) in place: they move the output's and the weight's
    // blocks, T x out + in x out over q a device, where the plain layout moves T x in + in x out.
    // Over fewer tokens than the weight's blocks hold (a decoding step, or a small training batch of a
    // wide model), a linear keeps the weight where it is stored and moves the tokens' blocks (and
    // transposes one of them across the diagonal); its backward rows below keep it too.
    row(Op::Linear, Optimus, &[
        case(When::WeightStaysAcross, &[Axes(Batch, Last), WEIGHT_ACROSS], Axes(OutLast, Batch),
            product(SummaAbKeepingBAcross, 0, 1, "linear, weight across the mesh and in place")),
        case(When::WeightStays, &[Axes(Last, Batch), Axes(Dim0, Out)], Axes(Batch, OutLast),
            product(SummaAbKeepingB, 0, 1, "linear, weight in place")),
        case(When::WeightAcross, &[Axes(Batch, Last), WEIGHT_ACROSS], Axes(Batch, OutLast),
            product(SummaAbReduced, 0, 1, "linear, weight across the mesh")),
        always(&[Axes(Batch, Last), Axes(Dim0, Out)], Axes(Batch, OutLast), product(SummaAb, 0, 1, "linear")),
    ]),
    row(Op::Linear, Megatron, &[
        case(When::InputSplit, &[Axes(Rep, Last), Axes(Rep, Dim0)], Axes(Rep, Partial),
            product(LOCAL, 0, 1, "row-parallel linear")),
        always(&[WHOLE, Axes(Rep, Out)], Axes(Rep, OutLast), product(LOCAL, 0, 1, "column-parallel linear")),
    ]),
    // A tied head over fewer tokens than vocabulary rows keeps the table in place: its forward and its
    // gradients then move token-sized blocks and logit-sized ones, never the table (see 2d-parallelism.md).
    // Where the tokens outnumber the width enough, the table laid across the mesh (one transpose of its
    // block) lets every product move token and table blocks, never logits.
    row(Op::LinearTied, Optimus, &[
        case(When::TableAcross, &[Axes(Batch, Last), ACROSS], Axes(Batch, Last),
            product(SummaAbtAccumulated, 0, 1, "tied linear (logits = X E^T), table across the mesh")),
        case(When::FewTokens, &[Axes(Batch, Last), Axes(Dim0, Dim1)], Axes(Last, Batch),
            product(SummaAbtKeepingB, 0, 1, "tied linear (logits = X E^T), table in place")),
        always(&[Axes(Batch, Last), Axes(Dim0, Dim1)], Axes(Batch, Last),
            product(SummaAbt, 0, 1, "tied linear (logits = X E^T)")),
    ]),
    row(Op::LinearTied, Megatron, &[
        always(&[WHOLE, Axes(Rep, Dim0)], Axes(Rep, Last), product(LOCAL_BT, 0, 1, "tied linear, vocab-parallel")),
    ]),
    row(Op::LinearGradInput, Optimus, &[
        case(When::WeightStaysAcross, &[Axes(OutLast, Batch), Stored], Axes(Batch, Last),
            product(SummaAbtKeepingBAcross, 0, 1, "backward of linear (dX = dY W^T), weight across the mesh and in place")),
        case(When::WeightStays, &[Axes(Batch, OutLast), Stored], Axes(Last, Batch),
            product(SummaAbtKeepingB, 0, 1, "backward of linear (dX = dY W^T), weight in place")),
        case(When::WeightAcross, &[Axes(Batch, OutLast), Stored], Axes(Batch, Last),
            product(SummaAbtAccumulated, 0, 1, "backward of linear (dX = dY W^T), weight across the mesh")),
        always(&[Axes(Batch, OutLast), Stored], Axes(Batch, Last),
            product(SummaAbt, 0, 1, "backward of linear (dX = dY W^T)")),
    ]),
    row(Op::LinearGradInput, Megatron, &[
        case(When::WeightSplitIn, &[WHOLE, Stored], Axes(Rep, Last), product(LOCAL_BT, 0, 1, "backward of linear (dX)")),
        case(When::WeightSplitOut, &[Axes(Rep, OutLast), Stored], Axes(Rep, Partial),
            product(LOCAL_BT, 0, 1, "backward of linear (dX)")),
        always(&[WHOLE, Stored], WHOLE, product(LOCAL_BT, 0, 1, "backward of linear (dX)")),
    ]),
    row(Op::LinearGradInputTied, Optimus, &[
        case(When::TableAcross, &[Axes(Batch, Last), ACROSS], Axes(Batch, Last),
            product(SummaAbReduced, 0, 1, "backward of tied linear (dX = dY E), table across the mesh")),
        case(When::VocabOnRows, &[Axes(Last, Batch), Stored], Axes(Batch, Last),
            product(SummaAbKeepingB, 0, 1, "backward of tied linear (dX = dY E), table in place")),
        always(&[Axes(Batch, Last), Stored], Axes(Batch, Last),
            product(SummaAb, 0, 1, "backward of tied linear (dX = dY E)")),
    ]),
    row(Op::LinearGradInputTied, Megatron, &[
        always(&[Axes(Rep, Last), Stored], Axes(Rep, Partial), product(LOCAL, 0, 1, "backward of linear (dX)")),
    ]),
    row(Op::LinearGradWeight, Optimus, &[
        case(When::WeightStaysAcross, &[Axes(Batch, Last), Axes(OutLast, Batch)], Stored,
            product(SummaAtbAccumulatedAcross, 0, 1, "backward of linear (dW = X^T dY), weight across the mesh and in place")),
        case(When::WeightStays, &[Axes(Last, Batch), Axes(Batch, OutLast)], Stored,
            product(SummaAtbAccumulated, 0, 1, "backward of linear (dW = X^T dY), weight in place")),
        case(When::WeightAcross, &[Axes(Batch, Last), Axes(Batch, OutLast)], Stored,
            product(SummaAtbMovingB, 0, 1, "backward of linear (dW = X^T dY), weight across the mesh")),
        always(&[Axes(Batch, Last), Axes(Batch, OutLast)], Stored,
            product(SummaAtb, 0, 1, "backward of linear (dW = X^T dY)")),
    ]),
    row(Op::LinearGradWeight, Megatron, &[
        case(When::WeightSplitIn, &[Axes(Rep, Last), WHOLE], Stored,
            product(LOCAL_AT, 0, 1, "backward of linear (dW = X^T dY)")),
        case(When::WeightSplitOut, &[WHOLE, Axes(Rep, OutLast)], Stored,
            product(LOCAL_AT, 0, 1, "backward of linear (dW = X^T dY)")),
        always(&[WHOLE, WHOLE], Stored, product(LOCAL_AT, 0, 1, "backward of linear (dW = X^T dY)")),
    ]),
    row(Op::LinearGradWeightTied, Optimus, &[
        case(When::TableAcross, &[Axes(Batch, Last), Axes(Batch, Last)], ACROSS,
            product(SummaAtbMovingB, 1, 0, "backward of tied linear (dE = dY^T X), table across the mesh")),
        case(When::VocabOnRows, &[Axes(Batch, Last), Axes(Last, Batch)], Stored,
            product(SummaAtbAccumulated, 1, 0, "backward of tied linear (dE = dY^T X), table in place")),
        always(&[Axes(Batch, Last), Axes(Batch, Last)], Stored,
            product(SummaAtb, 1, 0, "backward of tied linear (dE = dY^T X)")),
    ]),
    row(Op::LinearGradWeightTied, Megatron, &[
        always(&[WHOLE, Axes(Rep, Last)], Stored, product(LOCAL_AT, 1, 0, "backward of tied linear (dE = dY^T X)")),
    ]),
    // ---- embeddings: a table split on its rows gives pending sums (masked lookups) ----
    row(Op::Embedding, Optimus, &[
        case(When::VocabParallel, &[WHOLE, Axes(Dim0, Dim1)], Axes(Partial, Last), None),
        always(&[Axes(Batch, Rep), Axes(Rep, Dim1)], Axes(Batch, Last), None),
    ]),
    row(Op::Embedding, Megatron, &[
        case(When::VocabParallel, &[WHOLE, Axes(Rep, Dim0)], Axes(Rep, Partial), None),
        always(&[WHOLE, WHOLE], WHOLE, None),
    ]),
    row(Op::PositionEmbedding, Optimus, &[always(&[Axes(Rep, Dim1)], Axes(Batch, Last), None)]),
    row(Op::PositionEmbedding, Megatron, &[always(&[WHOLE], WHOLE, None)]),
    // ---- row statistics: the last dimension split gives partial statistics, all-reduced ----
    row(Op::Norm, Optimus, &[always(&[Axes(Batch, Last), Axes(Rep, Dim0)], Axes(Batch, Last), None)]),
    row(Op::Norm, Megatron, &[always(&[WHOLE, WHOLE], WHOLE, None)]),
    row(Op::Attention, Optimus, &[always(&[Axes(Batch, Heads)], Axes(Batch, Last), None)]),
    row(Op::Attention, Megatron, &[always(&[Axes(Rep, Heads)], Axes(Rep, Last), None)]),
    row(Op::CrossEntropy, Optimus, &[
        case(When::VocabOnRows, &[Axes(Last, Batch), Axes(Rep, Batch)], Derived, None),
        always(&[Axes(Batch, Last), Axes(Batch, Rep)], Derived, None),
    ]),
    row(Op::CrossEntropy, Megatron, &[always(&[Axes(Rep, Last), WHOLE], Derived, None)]),
    // ---- 3D: q x q x q, the two activation layouts L1 and L2 (see above) ----
    row(Op::Linear, ThreeD, &[
        case(When::InputSplit, &[Axes3(Batch, Last, Rep), Axes3(Rep, Dim0, Out)], Axes3(Batch, Batch, OutLast),
            product(scattered(false, false, COLUMN_AXIS), 0, 1, "3D linear (L2 to L1)")),
        always(&[Axes3(Batch, Rep, Last), Axes3(Rep, Out, Dim0)], Axes3(Batch, OutLast, BatchInner),
            product(scattered(false, false, DEPTH_AXIS), 0, 1, "3D linear (L1 to L2)")),
    ]),
    row(Op::LinearTied, ThreeD, &[
        // An input in L2 (BERT's MLM transform) is gathered whole over the columns, so that the logits
        // come out in L2 as cross-entropy takes them, with the vocabulary over the columns.
        case(When::InputSplit, &[Axes3(Batch, Rep, BatchInner), Axes3(Rep, Dim0, Rep)], Axes3(Batch, Last, BatchInner),
            product(LOCAL_BT, 0, 1, "3D tied linear (logits = X E^T) on an input in L2")),
        always(&[Axes3(Batch, Rep, Last), Axes3(Rep, Dim0, Dim1)], Axes3(Batch, Last, BatchInner),
            product(scattered(false, true, DEPTH_AXIS), 0, 1, "3D tied linear (logits = X E^T)")),
    ]),
    row(Op::LinearGradInput, ThreeD, &[
        case(When::WeightSplitIn, &[Axes3(Batch, Rep, OutLast), Stored], L2,
            product(scattered(false, true, DEPTH_AXIS), 0, 1, "backward of 3D linear (dX = dY W^T)")),
        always(&[Axes3(Batch, OutLast, Rep), Stored], L1,
            product(scattered(false, true, COLUMN_AXIS), 0, 1, "backward of 3D linear (dX = dY W^T)")),
    ]),
    row(Op::LinearGradInputTied, ThreeD, &[
        always(&[Axes3(Batch, Last, Rep), Stored], L1,
            product(scattered(false, false, COLUMN_AXIS), 0, 1, "backward of 3D tied linear (dX = dY E)")),
    ]),
    row(Op::LinearGradWeight, ThreeD, &[
        case(When::WeightSplitIn, &[Axes3(Batch, Last, Rep), Axes3(Batch, Rep, OutLast)], Axes3(Partial, Dim0, Out),
            product(LOCAL_AT, 0, 1, "backward of 3D linear (dW = X^T dY)")),
        always(&[Axes3(Batch, Rep, Last), Axes3(Batch, OutLast, Rep)], Axes3(Partial, Out, Dim0),
            product(LOCAL_AT, 0, 1, "backward of 3D linear (dW = X^T dY)")),
    ]),
    row(Op::LinearGradWeightTied, ThreeD, &[
        always(&[Axes3(Batch, Rep, Last), Axes3(Batch, Last, Rep)], Axes3(Partial, Dim0, Dim1),
            product(LOCAL_AT, 1, 0, "backward of 3D tied linear (dE = dY^T X)")),
    ]),
    row(Op::Embedding, ThreeD, &[
        case(When::VocabParallel, &[Axes3(Batch, Rep, Rep), Axes3(Rep, Dim0, Dim1)], Axes3(Batch, Partial, Last), None),
        always(&[Axes3(Batch, Batch, Rep), Axes3(Rep, Rep, Dim1)], L1, None),
    ]),
    row(Op::PositionEmbedding, ThreeD, &[always(&[Axes3(Rep, Rep, Dim1)], L1, None)]),
    row(Op::Norm, ThreeD, &[
        case(When::InputSplit, &[L2, Axes3(Rep, Dim0, Rep)], L2, None),
        always(&[L1, Axes3(Rep, Rep, Dim0)], L1, None),
    ]),
    row(Op::Attention, ThreeD, &[always(&[Axes3(Batch, Heads, BatchInner)], L2, None)]),
    row(Op::CrossEntropy, ThreeD, &[always(&[L2, Axes3(Batch, Rep, BatchInner)], Derived, None)]),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operator_has_exactly_one_row_per_strategy() {
        for operator in Operator::ALL {
            for strategy in STRATEGIES {
                let rows = RULES.iter().filter(|r| r.operator == operator && r.strategy == strategy).count();
                assert_eq!(rows, 1, "{operator:?} under {strategy:?} has {rows} rows");
            }
            assert_eq!(rule(operator, Strategy::None), rule(operator, Strategy::Optimus), "{operator:?}");
        }
        assert_eq!(RULES.len(), Operator::ALL.len() * STRATEGIES.len(), "a row of an unknown strategy");
    }

    #[test]
    fn megatron_rows_never_use_the_row_axis() {
        for r in RULES.iter().filter(|r| r.strategy == Strategy::Megatron) {
            for c in r.cases {
                for p in c.operands.iter().chain([&c.output]) {
                    let rows = p.along(ROW_AXIS);
                    assert!(rows.is_none() || rows == Some(Rep), "{:?}: {p:?} uses the row axis", r.operator);
                }
                let summa = c.product.is_some_and(|p| !matches!(p.kind, ProductKind::Local { .. }));
                assert!(!summa, "{:?}: SUMMA needs the row axis", r.operator);
            }
        }
    }

    #[test]
    fn every_row_ends_with_a_case_that_always_applies_and_its_products_name_operands() {
        for r in RULES {
            assert_eq!(r.cases.last().map(|c| c.when), Some(When::Always), "{:?} {:?}", r.operator, r.strategy);
            let arity = r.cases[0].operands.len();
            for c in r.cases {
                assert_eq!(c.operands.len(), arity, "{:?}: cases of one row take the same operands", r.operator);
                if let Some(p) = c.product {
                    assert!(p.a < arity && p.b < arity && p.a != p.b, "{:?}: {p:?}", r.operator);
                }
            }
        }
    }

    #[test]
    fn symbols_instantiate_for_a_node() {
        let mut dims = Dims::new(2);
        assert_eq!(Axes(Batch, Last).layout(&dims, Layout::REPLICATED), Some(Layout::new(s(0), s(2))));
        dims.out = Placement::shard_factor(1, 3, 8);
        assert_eq!(OutLast.place(&dims), Placement::shard_factor(2, 3, 8));
        assert_eq!(Out.place(&dims), Placement::shard_factor(1, 3, 8));
        dims.batch = false;
        assert_eq!(Batch.place(&dims), Placement::Replicate);
        assert_eq!(Stored.layout(&dims, Layout::new(s(0), s(1))), Some(Layout::new(s(0), s(1))));
        assert_eq!(Derived.layout(&dims, Layout::REPLICATED), None);
    }

    fn s(dim: usize) -> Placement {
        Placement::shard(dim)
    }
}
