//! The Plan: one SPMD program for every device of a mesh, with buffers, kernels, collectives and frees.
//!
//! Every device runs the same instruction list. What differs per device (i, j) is only what the
//! layouts imply: which block of each tensor it holds, which member of a group is the root, and the
//! offsets of kernels that look at logical indices (vocabulary ranges, dropout masks).

pub mod init;
pub mod layout;
pub mod logical;
pub mod memory;
pub mod overlap;
pub mod phases;
pub mod pipeline;
pub mod pipeline_cut;
pub mod placement;
pub mod reason;
pub mod report;
pub mod rotary;
pub mod shapes;
pub mod span;
pub mod stages;
pub mod stores;
pub mod tensor;
pub mod text;
pub mod types;
pub mod verify;

use crate::layout::{COLUMN_AXIS, DATA_AXIS, DEPTH_AXIS, Layout, MESH_AXES, Placement, ROW_AXIS};
use crate::span::Span;
use crate::types::{DType, Init, Scalar};
use serde::{Deserialize, Serialize};

pub use reason::{Reason, ReasonKind, Statistic, SummaPart, SummaProduct};

/// Bumped whenever the JSON format changes incompatibly.
/// Version 2 added `kv_heads` to the attention kernels. Version 3: cross-entropy ignores targets equal to [`IGNORE_INDEX`] (`CrossEntropyCount`, and the
/// count of targets not ignored as an operand of `CrossEntropyLoss` and `CrossEntropyGrad`).
/// Version 4: each reason is a [`Reason`], a kind (`summa` with its product and step, ...) beside the text,
/// so that tools read what an instruction is instead of parsing its text.
pub const FORMAT_VERSION: u32 = 4;

/// The target id cross-entropy ignores, as PyTorch's `ignore_index` default: a position whose target is
/// -100 adds nothing to the loss, gets a zero gradient, and is not counted in the mean.
pub const IGNORE_INDEX: i32 = -100;

/// How the model is split over devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// 2D: weights and activations split over a q x q mesh with SUMMA products.
    Optimus,
    /// 1D tensor parallelism over 1 x p devices.
    Megatron,
    /// 2.5D (Tesseract): d depth layers of a q x q SUMMA grid, the batch split over the layers and
    /// the weights replicated over them (their gradients summed over the depth).
    Tesseract,
    /// 3D: a q x q x q cube (rows, columns, depth); every product gathers its operands over two axes,
    /// multiplies locally and reduce-scatters over the third, and nothing is replicated.
    #[serde(rename = "3d")]
    ThreeD,
    /// One device.
    None,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Optimus => "optimus",
            Strategy::Megatron => "megatron",
            Strategy::Tesseract => "tesseract",
            Strategy::ThreeD => "3d",
            Strategy::None => "none",
        }
    }

    /// Why the strategy cannot use `mesh`, or `None` where it can: the one rule the compiler applies to
    /// a target and the verifier to a plan read from a file.
    pub fn mesh_problem(self, mesh: Mesh) -> Option<String> {
        let Mesh { rows, cols, data, depth } = mesh;
        match self {
            _ if rows == 0 || cols == 0 => Some("a mesh needs at least one row and one column".to_string()),
            _ if data == 0 => Some("a mesh needs at least one data-parallel replica".to_string()),
            _ if depth == 0 => Some("a mesh needs at least one depth layer".to_string()),
            Strategy::Optimus | Strategy::Megatron | Strategy::None if depth != 1 => Some(format!(
                "only the tesseract and 3d strategies have a depth axis; the {} strategy cannot use a depth of {depth}",
                self.name()
            )),
            Strategy::ThreeD if rows != cols || cols != depth => {
                Some(format!("the 3d strategy needs a q x q x q cube, not {depth}x{rows}x{cols}"))
            }
            Strategy::Optimus | Strategy::Tesseract if rows != cols => {
                Some(format!("the {} strategy needs a square q x q mesh, not {rows}x{cols}", self.name()))
            }
            Strategy::Megatron if rows != 1 => {
                Some(format!("the megatron strategy takes a 1 x p mesh, not {rows}x{cols}"))
            }
            Strategy::None if rows * cols != 1 => {
                Some(format!("the none strategy runs each replica on one device (1x1), not {rows}x{cols}"))
            }
            _ => None,
        }
    }
}

/// Which forward activations the backward pass recomputes instead of keeping (`compile --recompute`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation the backward pass reads.
    #[default]
    None,
    /// Keep only each checkpointed block's input; recompute the block's forward before its backward.
    Layers,
    /// Recompute only what is cheap to recompute and large to keep (attention scores and
    /// probabilities, GELU and SiLU outputs, RMSNorm outputs, gating products), as Korthikanti et al. 2022.
    Selective,
}

impl Recompute {
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Layers => "layers",
            Recompute::Selective => "selective",
        }
    }
}

/// The number format of activations, products and communication (`compile --precision`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in float32.
    #[default]
    F32,
    /// bf16 activations, products and collectives with float32 accumulation; float32 master weights,
    /// optimizer state, normalisation statistics, softmax and loss.
    Bf16,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }
}

/// How the compiler lays out the weights of SUMMA products (`compile --layouts`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layouts {
    /// Per linear, what moves least: a weight that narrows its input laid across the mesh, a tied
    /// head's table across the mesh or in place by the token count, a weight kept in place over few
    /// tokens (see `docs/architecture.md`).
    #[default]
    Auto,
    /// The paper's (§3 of `2d-parallelism.md`, what the authors' code runs): every weight and table
    /// stored in place, input features over the mesh rows, and every product moving both operands.
    Paper,
}

impl Layouts {
    pub fn name(self) -> &'static str {
        match self {
            Layouts::Auto => "auto",
            Layouts::Paper => "paper",
        }
    }
}

/// The memory levers of a compilation: what to recompute (`None`: what the model marks `checkpoint`)
/// and the precision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MemoryOptions {
    pub recompute: Option<Recompute>,
    pub precision: Precision,
    /// ZeRO stage over the data-parallel axis: 0, or 1 (optimizer state and master weights sharded).
    pub zero: u8,
}

impl MemoryOptions {
    /// No recomputation beyond the model's own marks, float32.
    pub const DEFAULT: MemoryOptions = MemoryOptions { recompute: None, precision: Precision::F32, zero: 0 };
}

/// Training (forward, backward, optimizer step) or inference (forward only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Train,
    Infer,
}

/// A device mesh: `data` replicas of `depth` layers of a rows x cols tensor-parallel grid (written
/// DATAxROWSxCOLS, DATAxDEPTHxROWSxCOLS, or without the leading sizes that are 1; a Tesseract mesh
/// always shows its depth). Device (d, k, i, j) has rank ((d * depth + k) * rows + i) * cols + j, so
/// the devices of one replica, and of one depth layer, are consecutive ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Mesh {
    pub rows: u64,
    pub cols: u64,
    /// Data-parallel replicas of the rows x cols mesh.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub data: u64,
    /// Depth layers of the rows x cols grid in each replica (Tesseract's d; 1 otherwise).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub depth: u64,
}

fn one() -> u64 {
    1
}

fn is_one(n: &u64) -> bool {
    *n == 1
}

impl Mesh {
    /// One replica of a rows x cols mesh.
    pub const fn new(rows: u64, cols: u64) -> Mesh {
        Mesh { rows, cols, data: 1, depth: 1 }
    }

    /// This mesh with `depth` layers of its rows x cols grid.
    pub const fn with_depth(self, depth: u64) -> Mesh {
        Mesh { depth, ..self }
    }

    /// This mesh's tensor-parallel shape replicated `data` times.
    pub const fn with_data(self, data: u64) -> Mesh {
        Mesh { data, ..self }
    }

    pub fn devices(self) -> u64 {
        self.rows * self.cols * self.data * self.depth
    }

    /// Devices of one replica (the tensor-parallel mesh, every depth layer of it).
    pub fn replica_devices(self) -> u64 {
        self.rows * self.cols * self.depth
    }

    /// Sizes of the mesh axes, indexed as layouts index them (rows, columns, replicas).
    pub fn axes(self) -> [u64; MESH_AXES] {
        let mut sizes = [1; MESH_AXES];
        sizes[ROW_AXIS] = self.rows;
        sizes[COLUMN_AXIS] = self.cols;
        sizes[DATA_AXIS] = self.data;
        sizes[DEPTH_AXIS] = self.depth;
        sizes
    }

    /// Size of a communication group (a mirror group's off the diagonal: on it, a device is alone).
    pub fn group_size(self, group: Group) -> u64 {
        match group {
            Group::World => self.devices(),
            Group::Mirror => 2.min(self.rows * self.cols),
            Group::Row | Group::Column | Group::Data | Group::Depth => self.axes()[group.axis().unwrap_or(0)],
        }
    }

    /// Size of the group of `group` that the device at `coords` belongs to: [`Mesh::group_size`], but
    /// for a device on the diagonal, alone in its mirror group.
    pub fn group_size_at(self, group: Group, coords: Coords) -> u64 {
        match group {
            Group::Mirror => group.member_ranks(coords, self).len() as u64,
            _ => self.group_size(group),
        }
    }

    /// The coordinates of the device with `rank`.
    pub fn coords_of(self, rank: u64) -> Coords {
        let (cols, rows, depth) = (self.cols.max(1), self.rows.max(1), self.depth.max(1));
        let layer = rank / (cols * rows);
        Coords::new(rank / cols % rows, rank % cols, layer / depth).at_depth(layer % depth)
    }

    /// The rank of the device at `coords`.
    pub fn rank_of(self, coords: Coords) -> u64 {
        ((coords.d() * self.depth + coords.k()) * self.rows + coords.i()) * self.cols + coords.j()
    }

    /// Every device's coordinates, in rank order.
    pub fn all_coords(self) -> impl Iterator<Item = Coords> {
        (0..self.devices()).map(move |rank| self.coords_of(rank))
    }
}

impl Mesh {
    /// The mesh in words: its grid, with its depth layers and replicas where it has more than one
    /// ("2 replicas of 2 depth layers of a 2x2 grid").
    pub fn parts(self) -> String {
        let mut words = format!("a {}x{} grid", self.rows, self.cols);
        if self.depth != 1 {
            words = format!("{} depth layers of {words}", self.depth);
        }
        if self.data != 1 {
            words = format!("{} replicas of {words}", self.data);
        }
        words
    }
}

impl std::fmt::Display for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.data != 1 {
            write!(f, "{}x", self.data)?;
        }
        if self.depth != 1 {
            write!(f, "{}x", self.depth)?;
        }
        write!(f, "{}x{}", self.rows, self.cols)
    }
}

/// A device's position on the mesh, one coordinate per mesh axis: the row index i, the column index j,
/// the replica index d and the depth index k.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Coords(pub [u64; MESH_AXES]);

/// Written `[i, j]`, `[i, j, d]` on a replica other than the first, and `[i, j, d, k]` on a depth
/// layer other than the first.
impl Serialize for Coords {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let written = if self.k() != 0 {
            &self.0[..]
        } else if self.d() != 0 {
            &self.0[..=DATA_AXIS]
        } else {
            &self.0[..DATA_AXIS]
        };
        written.serialize(serializer)
    }
}

impl Coords {
    pub fn new(i: u64, j: u64, d: u64) -> Coords {
        let mut c = [0; MESH_AXES];
        c[ROW_AXIS] = i;
        c[COLUMN_AXIS] = j;
        c[DATA_AXIS] = d;
        Coords(c)
    }

    /// The row index.
    pub fn i(self) -> u64 {
        self.0[ROW_AXIS]
    }

    /// The column index.
    pub fn j(self) -> u64 {
        self.0[COLUMN_AXIS]
    }

    /// The data-parallel replica index.
    pub fn d(self) -> u64 {
        self.0[DATA_AXIS]
    }

    /// The depth index (Tesseract's depth layer).
    pub fn k(self) -> u64 {
        self.0[DEPTH_AXIS]
    }

    /// The device across the grid's diagonal: (j, i), in the same replica and depth layer.
    pub fn mirrored(mut self) -> Coords {
        self.0.swap(ROW_AXIS, COLUMN_AXIS);
        self
    }

    /// These coordinates on depth layer `k`.
    pub fn at_depth(mut self, k: u64) -> Coords {
        self.0[DEPTH_AXIS] = k;
        self
    }

    /// The file-name form: `i-j`, `d-i-j` on a replica other than the first, and `d-k-i-j` on a depth
    /// layer other than the first.
    pub fn file_stem(self) -> String {
        if self.k() != 0 {
            format!("{}-{}-{}-{}", self.d(), self.k(), self.i(), self.j())
        } else if self.d() == 0 {
            format!("{}-{}", self.i(), self.j())
        } else {
            format!("{}-{}-{}", self.d(), self.i(), self.j())
        }
    }

    /// Whether the coordinates lie on `mesh`.
    pub fn on(self, mesh: Mesh) -> bool {
        self.0.iter().zip(mesh.axes()).all(|(c, size)| *c < size)
    }

    /// Whether this is the first device (0, 0) of the first replica.
    pub fn is_origin(self) -> bool {
        self == Coords::default()
    }
}

impl std::fmt::Display for Coords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({}, {}", self.i(), self.j())?;
        if self.k() != 0 {
            write!(f, ", depth {}", self.k())?;
        }
        if self.d() != 0 {
            write!(f, ", replica {}", self.d())?;
        }
        write!(f, ")")
    }
}

/// Index of a buffer in [`Plan::buffers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BufferId(pub u32);

/// What a buffer holds, for memory accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Parameter,
    Gradient,
    OptimizerState,
    Input,
    /// A forward activation (kept for backward when it is still live there).
    Activation,
    /// A backward value or a communication / statistics temporary.
    Workspace,
    /// A key/value cache of a decoding plan: kept from one step to the next (zeros at first), written
    /// in place by [`Kernel::CacheWrite`], never in checkpoints.
    Cache,
}

/// A per-device buffer: the block of a logical tensor that each device holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    pub id: BufferId,
    pub name: String,
    pub dtype: DType,
    /// The logical tensor's shape (after vocabulary padding).
    pub logical_shape: Vec<u64>,
    pub layout: Layout,
    /// The block each device holds.
    pub shape: Vec<u64>,
    pub role: Role,
}

impl Buffer {
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }

    pub fn bytes(&self) -> u64 {
        self.elements() * self.dtype.bytes()
    }
}

/// A device-dependent offset: `coordinate(axis) * block`, or 0 when `axis` is `None`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Offset {
    pub axis: Option<u8>,
    pub block: u64,
}

impl Offset {
    pub const ZERO: Offset = Offset { axis: None, block: 0 };

    /// The offset on the device at `coords` (saturating: the verifier bounds it for any plan that runs).
    pub fn at(self, coords: Coords) -> u64 {
        match self.axis {
            Some(axis) => coords.0.get(usize::from(axis)).copied().unwrap_or(0).saturating_mul(self.block),
            None => 0,
        }
    }
}

/// Local computations. Shapes come from the buffers; "rows" means all leading dimensions flattened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Kernel {
    /// out (+)= op(A) op(B) on matrices made by flattening each operand's leading dimensions.
    MatMul {
        transpose_a: bool,
        transpose_b: bool,
        accumulate: bool,
    },
    /// Batched product over the last two dimensions (leading dimensions equal).
    BatchedMatMul,
    /// out = x + b, b broadcast over the last dimension.
    BiasAdd,
    Add,
    /// out = a * b element-wise.
    Mul,
    Scale {
        factor: f64,
    },
    Gelu {
        approximate: bool,
    },
    /// y = x * sigmoid(x).
    Silu,
    /// (dy, x) -> dy * (s + x s (1 - s)), s = sigmoid(x).
    SiluGrad,
    /// (dy, x) -> dx
    GeluGrad {
        approximate: bool,
    },
    Softmax,
    /// (dy, y) -> dx
    SoftmaxGrad,
    CausalMask,
    CausalMaskGrad,
    /// Drops elements with probability p by a counter-based generator keyed on (seed, key, logical index).
    Dropout {
        p: f64,
        key: u32,
    },
    /// Applies the same mask as `Dropout` with the same key.
    DropoutGrad {
        p: f64,
        key: u32,
    },
    /// Copy with a new shape (same element order).
    Reshape,
    Transpose {
        dim0: u8,
        dim1: u8,
    },
    Select {
        dim: u8,
        index: u64,
    },
    SelectGrad {
        dim: u8,
        index: u64,
    },
    /// Local multi-head attention over `heads` query heads and `kv_heads` key/value heads (query head
    /// h reads kv head h / (heads / kv_heads)); fused input is [.., seq, (3, heads, head)].
    Attention {
        heads: u64,
        kv_heads: u64,
        causal: bool,
        fused: bool,
    },
    /// (dy, operands..) -> gradient of operand `wrt` (for k and v summed over the query heads sharing
    /// each kv head).
    AttentionGrad {
        heads: u64,
        kv_heads: u64,
        causal: bool,
        fused: bool,
        wrt: u8,
    },
    /// Rotary position embedding of each of `heads` local heads of x [.., seq, heads * head]; the
    /// position of a row is its index along the sequence dimension (second to last), which must be
    /// whole on the device.
    Rotary {
        heads: u64,
        theta: f64,
    },
    /// (x, position) -> [`Kernel::Rotary`] with the rows' positions counted from `position` (an i32
    /// [1] input: the position of the first row of the step), as a decoding step needs.
    RotaryAt {
        heads: u64,
        theta: f64,
    },
    /// (dy) -> dx: dy rotated by the opposite angles.
    RotaryGrad {
        heads: u64,
        theta: f64,
    },
    /// (ids, table) -> rows; ids outside [offset, offset + table rows) give zeros when `masked`.
    EmbeddingLookup {
        offset: Offset,
        masked: bool,
    },
    /// (ids, dy) -> d table: scatter-add of dy rows whose id falls in this device's rows; the rows of
    /// the padding id (a global id) get nothing.
    EmbeddingGrad {
        offset: Offset,
        masked: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        padding: Option<u64>,
    },
    /// (table) -> out[.., p, :] = table[p, :] for p < seq.
    PositionLookup,
    /// (table, position) -> out[.., p, :] = table[position + p, :] for p < seq (`position` an i32 [1]
    /// input); a position past the table is an error.
    PositionLookupAt,
    /// (dy) -> d table: sums dy over leading dimensions into rows 0..seq; other rows zero.
    PositionGrad,
    /// (x [.., seq, parts * w], position) -> cache [.., context, w], in place: for every leading index,
    /// rows position..position + seq of the cache take chunk `part` of x's last dimension (cut into
    /// `parts` equal chunks: the keys or the values of a fused (3, heads, head) qkv block, whose local
    /// heads are contiguous within each chunk). The other rows keep what they held.
    CacheWrite {
        part: u8,
        parts: u8,
    },
    /// (q, k cache [.., context, kv_heads * d], v cache, position) -> y [.., seq, heads * d]: causal
    /// attention of the seq query rows, at positions position..position + seq, over the cache rows up
    /// to each query's own position (the cache already holds this step's keys and values). With
    /// `fused`, q is chunk 0 of a fused [.., seq, (3, heads, head)] block. Query head h reads kv head
    /// h / (heads / kv_heads).
    CachedAttention {
        heads: u64,
        kv_heads: u64,
        fused: bool,
    },
    /// (x) -> [rows, 1]: local sum over the last dimension.
    RowSum,
    /// (x, sum) -> [rows, 1]: local sum of (x - sum / n)^2, n the full normalised size.
    RowCenteredSquareSum {
        n: u64,
    },
    /// (x, sum, sqsum, gamma, beta) -> y.
    LayerNormApply {
        n: u64,
        eps: f64,
    },
    /// (dy, x, gamma, sum, sqsum) -> [rows, 2]: local sums of dy*gamma and dy*gamma*xhat.
    LayerNormGradSums {
        n: u64,
        eps: f64,
    },
    /// (dy, x, gamma, sum, sqsum, gradsums) -> dx.
    LayerNormGradInput {
        n: u64,
        eps: f64,
    },
    /// (dy, x, sum, sqsum) -> [last]: sum over rows of dy * xhat.
    LayerNormGradWeight {
        n: u64,
        eps: f64,
    },
    /// (x) -> [rows, 1]: local sum of x^2 over the last dimension (RMSNorm statistics).
    RowSquareSum,
    /// (x, sqsum, weight) -> y = weight * x * r, r = 1 / sqrt(sqsum / n + eps).
    RmsNormApply {
        n: u64,
        eps: f64,
    },
    /// (dy, x, weight) -> [rows, 1]: local sum of dy * weight * x.
    RmsNormGradSum,
    /// (dy, x, weight, sqsum, gradsum) -> dx = r * weight * dy - r^3 / n * x * gradsum.
    RmsNormGradInput {
        n: u64,
        eps: f64,
    },
    /// (dy, x, sqsum) -> [last]: sum over rows of dy * x * r.
    RmsNormGradWeight {
        n: u64,
        eps: f64,
    },
    /// (x) -> [last]: sum over rows.
    SumToLast,
    /// (logits) -> [rows, 1]: max over this device's valid vocabulary columns.
    CrossEntropyMax {
        offset: Offset,
        valid: u64,
    },
    /// (logits, targets, max) -> [rows, 2]: target logit if the target is local (else 0), and the
    /// sum of exp(logit - max) over valid columns. A row whose target is [`IGNORE_INDEX`] gets (0, sum).
    CrossEntropyStats {
        offset: Offset,
        valid: u64,
    },
    /// (targets) -> [1]: how many of this device's targets are not [`IGNORE_INDEX`] (as f32); summed
    /// over the devices holding other batch rows, it is the divisor of the mean.
    CrossEntropyCount,
    /// (max, stats, targets, counted) -> scalar: sum over the rows not ignored of
    /// (max + ln(sumexp) - target logit) / max(counted, 1).
    CrossEntropyLoss,
    /// (logits, targets, max, stats, dloss, counted) -> dlogits = (softmax - onehot) * dloss / max(counted, 1)
    /// on rows not ignored; 0 on ignored rows and on padding.
    CrossEntropyGrad {
        offset: Offset,
        valid: u64,
    },
    Fill {
        value: f64,
    },
    /// (x) -> x in the output's element type (float32 <-> bf16, rounding to nearest even), e.g. the
    /// bf16 copy of a float32 master weight, or a bf16 gradient into its float32 gradient buffer.
    Cast,
    /// (x) -> this device's block of x along `axis` for the given placement.
    SliceShard {
        axis: u8,
        placement: Placement,
    },
    /// (grads..) -> [1]: the sum of the squares of the gradient elements this device owns: an input
    /// replicated along a mesh axis counts only on that axis's first member, so that the sum over all
    /// devices counts every logical element once (padding elements of gradients are zero).
    GradSquareSum,
    /// (param, grad, state1, state2) -> param, in place: SGD with momentum or AdamW, chosen at run time.
    OptimizerStep,
}

impl Kernel {
    /// The kernel's kind, as its variant is spelled (`MatMul`, `AttentionGrad`): what profiles and
    /// calibrated fits name it by.
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::MatMul { .. } => "MatMul",
            Kernel::BatchedMatMul => "BatchedMatMul",
            Kernel::BiasAdd => "BiasAdd",
            Kernel::Add => "Add",
            Kernel::Mul => "Mul",
            Kernel::Scale { .. } => "Scale",
            Kernel::Gelu { .. } => "Gelu",
            Kernel::Silu => "Silu",
            Kernel::SiluGrad => "SiluGrad",
            Kernel::GeluGrad { .. } => "GeluGrad",
            Kernel::Softmax => "Softmax",
            Kernel::SoftmaxGrad => "SoftmaxGrad",
            Kernel::CausalMask => "CausalMask",
            Kernel::CausalMaskGrad => "CausalMaskGrad",
            Kernel::Dropout { .. } => "Dropout",
            Kernel::DropoutGrad { .. } => "DropoutGrad",
            Kernel::Reshape => "Reshape",
            Kernel::Transpose { .. } => "Transpose",
            Kernel::Select { .. } => "Select",
            Kernel::SelectGrad { .. } => "SelectGrad",
            Kernel::Attention { .. } => "Attention",
            Kernel::AttentionGrad { .. } => "AttentionGrad",
            Kernel::Rotary { .. } => "Rotary",
            Kernel::RotaryGrad { .. } => "RotaryGrad",
            Kernel::RotaryAt { .. } => "RotaryAt",
            Kernel::PositionLookupAt => "PositionLookupAt",
            Kernel::CacheWrite { .. } => "CacheWrite",
            Kernel::CachedAttention { .. } => "CachedAttention",
            Kernel::EmbeddingLookup { .. } => "EmbeddingLookup",
            Kernel::EmbeddingGrad { .. } => "EmbeddingGrad",
            Kernel::PositionLookup => "PositionLookup",
            Kernel::PositionGrad => "PositionGrad",
            Kernel::RowSum => "RowSum",
            Kernel::RowCenteredSquareSum { .. } => "RowCenteredSquareSum",
            Kernel::LayerNormApply { .. } => "LayerNormApply",
            Kernel::LayerNormGradSums { .. } => "LayerNormGradSums",
            Kernel::LayerNormGradInput { .. } => "LayerNormGradInput",
            Kernel::LayerNormGradWeight { .. } => "LayerNormGradWeight",
            Kernel::RowSquareSum => "RowSquareSum",
            Kernel::RmsNormApply { .. } => "RmsNormApply",
            Kernel::RmsNormGradSum => "RmsNormGradSum",
            Kernel::RmsNormGradInput { .. } => "RmsNormGradInput",
            Kernel::RmsNormGradWeight { .. } => "RmsNormGradWeight",
            Kernel::SumToLast => "SumToLast",
            Kernel::CrossEntropyMax { .. } => "CrossEntropyMax",
            Kernel::CrossEntropyStats { .. } => "CrossEntropyStats",
            Kernel::CrossEntropyCount => "CrossEntropyCount",
            Kernel::CrossEntropyLoss => "CrossEntropyLoss",
            Kernel::CrossEntropyGrad { .. } => "CrossEntropyGrad",
            Kernel::Fill { .. } => "Fill",
            Kernel::Cast => "Cast",
            Kernel::SliceShard { .. } => "SliceShard",
            Kernel::GradSquareSum => "GradSquareSum",
            Kernel::OptimizerStep => "OptimizerStep",
        }
    }

    /// The kind with the fields that choose another code path rather than scale the work
    /// (`Gelu(approximate=false)`, `Attention(causal=true, fused=true)`): what a calibrated profile
    /// keys its fits by. Sizes, rates, keys and offsets are left out.
    pub fn flavor(&self) -> String {
        let flags: Vec<(&str, bool)> = match *self {
            Kernel::MatMul { transpose_a, transpose_b, accumulate } => {
                vec![("transpose_a", transpose_a), ("transpose_b", transpose_b), ("accumulate", accumulate)]
            }
            Kernel::Gelu { approximate } | Kernel::GeluGrad { approximate } => vec![("approximate", approximate)],
            Kernel::Attention { causal, fused, .. } | Kernel::AttentionGrad { causal, fused, .. } => {
                vec![("causal", causal), ("fused", fused)]
            }
            Kernel::CachedAttention { fused, .. } => vec![("fused", fused)],
            Kernel::EmbeddingLookup { masked, .. } | Kernel::EmbeddingGrad { masked, .. } => vec![("masked", masked)],
            _ => Vec::new(),
        };
        if flags.is_empty() {
            return self.name().to_string();
        }
        let fields: Vec<String> = flags.iter().map(|(key, value)| format!("{key}={value}")).collect();
        format!("{}({})", self.name(), fields.join(", "))
    }
}

impl Kernel {
    /// Whether the kernel reads its output's previous contents (it accumulates into it). Every other
    /// kernel writes each element of its output, so a backend need not clear the output first.
    pub fn reads_its_output(&self) -> bool {
        matches!(self, Kernel::MatMul { accumulate: true, .. } | Kernel::CacheWrite { .. })
    }
}

/// Communication groups: the devices whose coordinates differ along one mesh axis only (a mesh row, a
/// mesh column, the replicas of one tensor-parallel position), a device and its mirror across the grid's
/// diagonal, or all devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Group {
    /// One mesh row of one replica: j varies.
    Row,
    /// One mesh column of one replica: i varies.
    Column,
    /// The same tensor-parallel position (i, j) in every replica: d varies.
    Data,
    /// The same grid position (i, j) in every depth layer of one replica: k varies.
    Depth,
    World,
    /// A device and its mirror across the diagonal of a square grid: (i, j) and (j, i), in one replica
    /// and depth layer; a device on the diagonal is alone. Only a [`CollectiveKind::Transpose`] uses it.
    Mirror,
}

impl Group {
    /// Every kind of group.
    pub const ALL: [Group; 6] = [Group::Row, Group::Column, Group::Data, Group::Depth, Group::World, Group::Mirror];

    /// The group whose members differ along mesh `axis` (axis 0 = i varies = a column).
    pub fn along(axis: usize) -> Group {
        match axis {
            ROW_AXIS => Group::Column,
            COLUMN_AXIS => Group::Row,
            DEPTH_AXIS => Group::Depth,
            _ => Group::Data,
        }
    }

    /// The mesh axis along which members differ (`None` for the whole mesh and for mirrors).
    pub fn axis(self) -> Option<usize> {
        match self {
            Group::Row => Some(COLUMN_AXIS),
            Group::Column => Some(ROW_AXIS),
            Group::Data => Some(DATA_AXIS),
            Group::Depth => Some(DEPTH_AXIS),
            Group::World | Group::Mirror => None,
        }
    }

    /// The index of the device at `coords` within its group: its coordinate along the group's axis
    /// (its rank for the whole mesh; 0 or 1 among mirrors, the lower rank first).
    pub fn member_index(self, coords: Coords, mesh: Mesh) -> u64 {
        match self.axis() {
            Some(axis) => coords.0[axis],
            None if self == Group::Mirror => u64::from(coords.i() > coords.j()),
            None => mesh.rank_of(coords),
        }
    }

    /// The ranks of the members of the group that contains the device at `coords`, in member order.
    pub fn member_ranks(self, coords: Coords, mesh: Mesh) -> Vec<u64> {
        match self.axis() {
            Some(axis) => (0..mesh.axes()[axis])
                .map(|m| {
                    let mut c = coords;
                    c.0[axis] = m;
                    mesh.rank_of(c)
                })
                .collect(),
            None if self == Group::Mirror => {
                let (mine, mirror) = (mesh.rank_of(coords), mesh.rank_of(coords.mirrored()));
                let mut ranks = vec![mine.min(mirror), mine.max(mirror)];
                ranks.dedup();
                ranks
            }
            None => (0..mesh.devices()).collect(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Group::Row => "row",
            Group::Column => "column",
            Group::Data => "data",
            Group::Depth => "depth",
            Group::World => "world",
            Group::Mirror => "mirror",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    Broadcast,
    Reduce,
    AllReduce,
    AllGather,
    ReduceScatter,
    /// Over [`Group::Mirror`]: device (i, j) receives the block of device (j, i), which receives its
    /// block; a device on the diagonal keeps its own. A value's row and column placements swap.
    Transpose,
}

impl CollectiveKind {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Reduce => "reduce",
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::Transpose => "transpose",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    Sum,
    Max,
}

/// A collective. `root` is the member index within the group (the column index j for a row group, the
/// row index i for a column group). Broadcast: the root's `send` lands in every member's `recv`.
/// Reduce: the sum of every member's `send` lands in the root's `recv`. All-reduce: in place on `send`
/// (`recv == send`). All-gather / reduce-scatter: along the placement `shard` of the gathered tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Collective {
    pub kind: CollectiveKind,
    pub group: Group,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<ReduceOp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<Placement>,
    pub send: BufferId,
    pub recv: BufferId,
    /// Started here and finished at the [`Instr::Wait`] that names its buffers, running beside the
    /// instructions between (`--overlap`); otherwise it completes here. Between its start and its wait
    /// nothing touches `recv` (but a later collective that sends it) or writes or frees `send` (the
    /// verifier checks it). A device runs its collectives one after another in program order, the same
    /// on every device, so the members of a group meet in one order.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub overlapped: bool,
}

/// One instruction of the SPMD program.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "instr")]
pub enum Instr {
    Kernel {
        kernel: Kernel,
        inputs: Vec<BufferId>,
        output: BufferId,
        origin: u32,
        reason: u32,
    },
    Collective {
        collective: Collective,
        origin: u32,
        reason: u32,
    },
    Free {
        buffer: BufferId,
    },
    /// Waits for the overlapped collective that sends `send` and receives `recv` to finish: after it,
    /// `recv` holds the result and `send` may be written or freed again.
    Wait {
        send: BufferId,
        recv: BufferId,
    },
}

/// Where an instruction came from: the model source text (and layer path) that caused it. Each
/// instruction also names its reason, an index into [`Plan::reasons`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OriginInfo {
    pub span: Span,
    pub line: u32,
    pub col: u32,
    /// Layer path, e.g. `h.3.attn.c_attn`.
    pub scope: String,
}

/// A trainable parameter and where its block, gradient and optimizer state live.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanParam {
    pub name: String,
    pub checkpoint: String,
    /// The model's shape, before padding.
    pub shape: Vec<u64>,
    pub init: Init,
    pub buffer: BufferId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad: Option<BufferId>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state: Vec<BufferId>,
    /// Whether it is a residual projection etc. is already folded into `init`.
    pub role: crate::types::ParamRole,
    /// Checkpoint files hold it transposed (`[out, in]`, as nn.Linear stores weights); `shape` is the model's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub checkpoint_transposed: bool,
}

/// A model input and the buffer (one per layout in use) that receives its block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanInput {
    pub name: String,
    pub shape: Vec<u64>,
    pub buffer: BufferId,
}

/// A model output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanOutput {
    pub name: String,
    pub buffer: BufferId,
    pub is_loss: bool,
    /// The model's shape, where padding (a vocabulary padded to divide the shards) made the buffer
    /// larger; absent otherwise. The padded columns are no part of the output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpadded: Option<Vec<u64>>,
}

/// A dimension padded so that it divides the shard count.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Padding {
    pub tensor: String,
    pub dim: u8,
    pub logical: u64,
    pub padded: u64,
}

/// The compiled program.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub format_version: u32,
    pub model: String,
    pub source: String,
    pub mesh: Mesh,
    pub strategy: Strategy,
    pub mode: Mode,
    pub config: Vec<(String, Scalar)>,
    pub padding: Vec<Padding>,
    pub params: Vec<PlanParam>,
    pub inputs: Vec<PlanInput>,
    pub outputs: Vec<PlanOutput>,
    pub buffers: Vec<Buffer>,
    pub program: Vec<Instr>,
    pub origins: Vec<OriginInfo>,
    /// Why each instruction exists: its kind and its text ("linear: SUMMA AB step 2 of 4: broadcast A
    /// block along the row").
    pub reasons: Vec<Reason>,
    pub memory: memory::MemoryPlan,
    /// Prefix that some checkpoints put before every checkpoint name (`transformer.` for GPT-2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_prefix: Option<String>,
    /// The buffer that holds the squared L2 norm of all gradients, summed over the mesh with each
    /// replicated element counted once (train plans; every optimizer step comes after it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<BufferId>,
    /// The activation recomputation the plan does.
    #[serde(default, skip_serializing_if = "is_default")]
    pub recompute: Recompute,
    /// The precision of its activations, products and communication.
    #[serde(default, skip_serializing_if = "is_default")]
    pub precision: Precision,
    /// The ZeRO stage over the data-parallel axis (0: none; 1: optimizer state and master weights
    /// sharded over the replicas).
    #[serde(default, skip_serializing_if = "is_default")]
    pub zero: u8,
    /// Whether collectives overlap computation ([`overlap::overlap_collectives`], `--overlap`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub overlap: bool,
    /// How the weights of its SUMMA products were laid out (`--layouts`).
    #[serde(default, skip_serializing_if = "is_default")]
    pub layouts: Layouts,
}

/// Whether a value is its type's default (left out of plan files, so older plans read the same).
fn is_default<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
}

impl Plan {
    pub fn buffer(&self, id: BufferId) -> &Buffer {
        &self.buffers[id.0 as usize]
    }

    /// The config value `name` the plan was compiled with, where it is a positive integer (`vocab`,
    /// `context`, `types`, `batch`).
    pub fn positive_config(&self, name: &str) -> Option<u64> {
        match self.config.iter().find(|(n, _)| n == name) {
            Some((_, Scalar::Int(v))) if *v > 0 => Some(v.unsigned_abs()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Coords, Group, Mesh};

    #[test]
    fn a_mirror_group_is_a_device_and_its_mirror_across_the_diagonal_or_a_diagonal_device_alone() {
        let mesh = Mesh::new(3, 3).with_data(2);
        for c in mesh.all_coords() {
            let ranks = Group::Mirror.member_ranks(c, mesh);
            let (mine, mirror) = (mesh.rank_of(c), mesh.rank_of(Coords::new(c.j(), c.i(), c.d())));
            assert_eq!(ranks, if c.i() == c.j() { vec![mine] } else { vec![mine.min(mirror), mine.max(mirror)] });
            assert_eq!(ranks[Group::Mirror.member_index(c, mesh) as usize], mine, "{c}");
            assert_eq!(mesh.group_size_at(Group::Mirror, c), ranks.len() as u64, "{c}");
            assert_eq!(c.mirrored().mirrored(), c);
        }
        assert_eq!(mesh.group_size(Group::Mirror), 2);
    }
}
