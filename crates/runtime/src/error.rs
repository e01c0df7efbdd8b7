//! Errors of the runtime, as data: [`KernelError`] for what a kernel finds wrong with its operands,
//! [`StorageError`] for a device's storage, and [`RuntimeError`] at the boundary between the executor
//! and a backend. Their messages (in the user's terms, naming buffers and operands) are rendered by
//! `Display`, the same whichever backend runs.

use super::comm::CommError;
#[cfg(feature = "cuda")]
use super::cuda::DeviceError;
use optimus_plan::BufferId;
use optimus_plan::Kernel;
use optimus_plan::rotary::RotaryError;
use optimus_plan::shapes::ShapeError;
use optimus_plan::tensor::TensorError;
use optimus_plan::types::DType;

/// `Ok` when `ok` holds, else the error `error` makes (the typed `ensure` of the runtime's checks).
pub fn require<E>(ok: bool, error: impl FnOnce() -> E) -> Result<(), E> {
    if ok { Ok(()) } else { Err(error()) }
}

/// The sizes of a batched product `out[l] = a[l] b[l]` from its three shapes, each
/// `[leading..., rows, columns]`: (the leading dimensions, m, k, n), or why the shapes do not multiply.
/// Every backend's batched matmul checks its operands here.
pub fn batched_product<'s>(
    a: &'s [u64],
    b: &[u64],
    out: &[u64],
) -> Result<(&'s [u64], usize, usize, usize), KernelError> {
    let (la, m, k) = optimus_plan::shapes::batch_matrix(a, "A")?;
    let (lb, k2, n) = optimus_plan::shapes::batch_matrix(b, "B")?;
    let (lo, m2, n2) = optimus_plan::shapes::batch_matrix(out, "the output")?;
    require(la == lb && la == lo, || KernelError::LeadingDimensions {
        a: la.to_vec(),
        b: lb.to_vec(),
        out: lo.to_vec(),
    })?;
    require(k == k2 && m == m2 && n == n2, || KernelError::Product { lhs: [m, k], rhs: [k2, n], out: [m2, n2] })?;
    Ok((la, m, k, n))
}

/// Why an operand's elements cannot be read as a kernel reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementError {
    /// Elements of type `found` where the kernel reads `want`.
    Type { want: DType, found: DType },
    /// bf16 elements where a kernel reads f32 (bf16 buffers are widened before a kernel reads them).
    Unwidened,
}

impl std::fmt::Display for ElementError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            ElementError::Type { want, found } => TensorError::ElementType { want, found }.fmt(f),
            ElementError::Unwidened => f.write_str(
                "expected an f32 tensor, found bf16 (bf16 buffers are widened to f32 before a kernel reads them)",
            ),
        }
    }
}

impl From<TensorError> for ElementError {
    fn from(e: TensorError) -> ElementError {
        let TensorError::ElementType { want, found } = e;
        ElementError::Type { want, found }
    }
}

/// What a kernel finds wrong with its operands or parameters (or the device that runs it).
#[derive(Clone, Debug, PartialEq)]
pub enum KernelError {
    /// A kernel of the plan failed; its error follows the kernel as the plan writes it.
    InKernel { kernel: Box<Kernel>, error: Box<KernelError> },
    /// A shape check failed.
    Shape(ShapeError),
    /// Rotary position embeddings do not fit the tensor.
    Rotary(RotaryError),
    /// An operand's elements cannot be read as the kernel reads them; `operand` names it where known.
    Element { operand: Option<String>, error: ElementError },
    /// An operand holds another number of elements than its shape.
    Holds { what: String, len: usize, shape: Vec<u64> },
    /// An operand holds another number of elements than `want`.
    HoldsCount { what: String, len: usize, want: usize },
    /// A product whose dimensions do not match: op(A) is `lhs`, op(B) `rhs` (rows, columns).
    Product { lhs: [usize; 2], rhs: [usize; 2], out: [usize; 2] },
    /// Batched products whose leading dimensions differ.
    LeadingDimensions { a: Vec<u64>, b: Vec<u64>, out: Vec<u64> },
    /// A matrix block that does not fit the `len` elements of its buffer.
    BlockOutside { rows: usize, cols: usize, stride: usize, start: usize, len: usize },
    /// A scratch matrix of more elements than this machine can count.
    ScratchTooLarge { rows: usize, cols: usize },
    /// A scratch matrix whose memory the allocator refused.
    ScratchAllocation { rows: usize, cols: usize },
    /// An attention scratch smaller than the tile it takes.
    AttentionScratch,
    /// A token id outside the embedding rows [base, base + rows) this device holds.
    TokenOutsideRows { id: i32, base: u64, rows: usize },
    /// A target outside the vocabulary [0, valid) that is not the ignored id.
    TargetOutsideVocabulary { target: i32, valid: u64 },
    /// A drop probability outside [0, 1].
    DropProbability(f64),
    /// A normalisation over no elements.
    EmptyNorm,
    /// An embedding table (or its gradient) that is not [rows, width].
    NotTable { what: String, shape: Vec<u64> },
    /// A position table that cannot give the positions of a [.., seq, width] tensor.
    Positions { table: Vec<u64>, seq: Vec<u64> },
    /// An attention gradient without dy.
    NoAttentionGradient,
    /// The gradient of an attention operand that does not exist.
    NoOperand(usize),
    /// Data movement between operands of different element types.
    ElementTypesDiffer,
    /// An operand whose storage does not hold its shape's elements (data movement).
    CountNotShape,
    /// A transpose between operands of different element types or element counts.
    TransposeOperands,
    /// An embedding or position lookup whose table and output are not of one floating-point type.
    TableAndOutput,
    /// A gradient norm whose inputs and their layouts differ in number.
    InputLayouts,
    /// An optimizer step numbered 0 (steps count from 1).
    StepZero,
    /// A piece of an operand of the bf16 emulation that is not a floating-point block of its shape.
    NotBlock(&'static str),
    /// A piece of rows past the end of an operand (the bf16 emulation).
    NotRows,
    /// A kernel of the bf16 emulation given other operands than it takes.
    Takes { kernel: &'static str, inputs: &'static str },
    /// An output whose layout the plan cannot index, in the plan's words.
    Layout(String),
    /// A kernel a backend does not run (`kernel` names it), and why.
    Unsupported { kernel: &'static str, why: &'static str },
    /// A lock poisoned by a panic on another thread (the message names the lock).
    Poisoned(&'static str),
    /// An inconsistency of the runtime itself (a bug, reported rather than panicking).
    Internal(String),
    /// The GPU (driver, cuBLAS, NVRTC) failed.
    #[cfg(feature = "cuda")]
    Device(DeviceError),
    /// A one-off check's own message.
    Invalid(String),
}

impl KernelError {
    /// A failure of `kernel`, named as the plan writes it.
    pub fn in_kernel(kernel: &Kernel, error: KernelError) -> KernelError {
        KernelError::InKernel { kernel: Box::new(kernel.clone()), error: Box::new(error) }
    }

    /// Operand `what` cannot be read as the kernel reads it.
    pub fn operand(what: &str, error: impl Into<ElementError>) -> KernelError {
        KernelError::Element { operand: Some(what.to_string()), error: error.into() }
    }
}

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelError::InKernel { kernel, error } => write!(f, "{}: {error}", kernel.name()),
            KernelError::Shape(e) => e.fmt(f),
            KernelError::Rotary(e) => e.fmt(f),
            KernelError::Element { operand: Some(what), error } => write!(f, "{what}: {error}"),
            KernelError::Element { operand: None, error } => error.fmt(f),
            KernelError::Holds { what, len, shape } => write!(f, "{what} holds {len} elements, not {shape:?}"),
            KernelError::HoldsCount { what, len, want } => write!(f, "{what} holds {len} elements, not {want}"),
            KernelError::Product { lhs, rhs, out } => {
                write!(f, "cannot multiply {}x{} by {}x{} into {}x{}", lhs[0], lhs[1], rhs[0], rhs[1], out[0], out[1])
            }
            KernelError::LeadingDimensions { a, b, out } => {
                write!(f, "leading dimensions differ: {a:?}, {b:?} and {out:?}")
            }
            KernelError::BlockOutside { rows, cols, stride, start, len } => {
                write!(f, "a {rows}x{cols} block (row stride {stride}) at {start} does not fit in {len} elements")
            }
            KernelError::ScratchTooLarge { rows, cols } => write!(f, "a {rows}x{cols} scratch matrix is too large"),
            KernelError::ScratchAllocation { rows, cols } => {
                write!(f, "cannot allocate a {rows}x{cols} scratch matrix")
            }
            KernelError::AttentionScratch => f.write_str("the attention scratch is too small"),
            KernelError::TokenOutsideRows { id, base, rows } if *id == optimus_plan::IGNORE_INDEX => write!(
                f,
                "token id {id} is the id of positions `cross_entropy` ignores (the masked labels of --objective mlm), \
                 which an embedding cannot look up (its rows here: [{base}, {}))",
                base.saturating_add(*rows as u64)
            ),
            KernelError::TokenOutsideRows { id, base, rows } => write!(
                f,
                "token id {id} is outside this device's embedding rows [{base}, {})",
                base.saturating_add(*rows as u64)
            ),
            KernelError::TargetOutsideVocabulary { target, valid } => write!(
                f,
                "target {target} is outside the vocabulary [0, {valid}) and is not the ignored id {}",
                optimus_plan::IGNORE_INDEX
            ),
            KernelError::DropProbability(p) => write!(f, "the drop probability {p} is not in [0, 1]"),
            KernelError::EmptyNorm => f.write_str("the normalised size is 0"),
            KernelError::NotTable { what, shape } => write!(f, "{what} must be [rows, width], not {shape:?}"),
            KernelError::Positions { table, seq } => write!(f, "a table {table:?} cannot give positions of {seq:?}"),
            KernelError::NoAttentionGradient => f.write_str("expects dy and the attention's operands"),
            KernelError::NoOperand(wrt) => write!(f, "the attention has no operand {wrt}"),
            KernelError::ElementTypesDiffer => f.write_str("the input and output element types differ"),
            KernelError::CountNotShape => f.write_str("a tensor's element count does not match its shape"),
            KernelError::TransposeOperands => {
                f.write_str("the input and output must have the same element type and element count")
            }
            KernelError::TableAndOutput => f.write_str("the table and the output must be both float32 or both bf16"),
            KernelError::InputLayouts => f.write_str("the inputs and their layouts differ in number"),
            KernelError::StepZero => f.write_str("optimizer steps count from 1"),
            KernelError::NotBlock(what) => write!(f, "{what} is not a floating-point block of its shape"),
            KernelError::NotRows => f.write_str("an operand is not whole rows of its shape"),
            KernelError::Takes { kernel, inputs } => write!(f, "{kernel} takes {inputs}"),
            KernelError::Unsupported { kernel, why } => write!(f, "{kernel} {why}"),
            KernelError::Internal(what) => write!(f, "internal error: {what}"),
            #[cfg(feature = "cuda")]
            KernelError::Device(e) => e.fmt(f),
            KernelError::Layout(message) | KernelError::Invalid(message) => f.write_str(message),
            KernelError::Poisoned(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for KernelError {}

impl From<ShapeError> for KernelError {
    fn from(e: ShapeError) -> KernelError {
        KernelError::Shape(e)
    }
}

impl From<RotaryError> for KernelError {
    fn from(e: RotaryError) -> KernelError {
        KernelError::Rotary(e)
    }
}

impl From<ElementError> for KernelError {
    fn from(error: ElementError) -> KernelError {
        KernelError::Element { operand: None, error }
    }
}

impl From<TensorError> for KernelError {
    fn from(e: TensorError) -> KernelError {
        KernelError::from(ElementError::from(e))
    }
}

#[cfg(feature = "cuda")]
impl From<DeviceError> for KernelError {
    fn from(e: DeviceError) -> KernelError {
        KernelError::Device(e)
    }
}

/// For callers whose errors are messages (tests, the command line): the same text.
impl From<KernelError> for String {
    fn from(e: KernelError) -> String {
        e.to_string()
    }
}

/// What is wrong with a device's storage: a buffer without a place, a tensor that does not fit its
/// buffer, or a copy between the host and the device that failed.
#[derive(Clone, Debug, PartialEq)]
pub enum StorageError {
    /// A buffer with no place in this device's storage.
    NoPlace(BufferId),
    /// One of an instruction's buffers with no place (`which` names its role).
    Unplaced(&'static str),
    /// A layout that puts `buffer` past the end of the arena.
    PastEnd { buffer: String },
    /// A tensor of another shape than the buffer it is written to (named where known).
    Misfit { tensor: Vec<u64>, buffer: Vec<u64>, name: Option<String> },
    /// A tensor of another element type than the buffer it is written to (named where known).
    ElementType { name: Option<String> },
    /// A collective on an integer buffer (named where known).
    NotFloat { name: Option<String> },
    /// A collective's blocks lent as other than floating point.
    CollectiveNeedsFloats,
    /// A collective's result of another element type than its receive buffer.
    ResultMismatch,
    /// A host block larger than the GPU buffer it is copied into.
    HostBlockTooLarge,
    /// A GPU buffer shorter than its shape.
    GpuBufferShort,
    /// Storage regions that overlap: words `start..end` begin before `before`.
    Overlap { start: usize, end: usize, before: usize },
    /// A storage region `start..end` past the end of the arena.
    PastArena { start: usize, end: usize },
    /// An inconsistency of the runtime itself: what it expected.
    Unexpected(&'static str),
    /// The arena's GPU allocation of `bytes` failed.
    #[cfg(feature = "cuda")]
    Allocation { bytes: usize, error: cudarc::driver::DriverError },
    /// A GPU copy or wait failed.
    #[cfg(feature = "cuda")]
    Device(DeviceError),
    /// A copy of a buffer between the host and the device failed.
    Transfer(KernelError),
}

impl std::fmt::Display for StorageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StorageError::NoPlace(id) => write!(f, "buffer {} has no place in this device's storage", id.0),
            StorageError::Unplaced(which) => write!(f, "{which} has no place"),
            StorageError::PastEnd { buffer } => write!(f, "the arena layout puts `{buffer}` past its end"),
            StorageError::Misfit { tensor, buffer, name: None } => {
                write!(f, "a {tensor:?} tensor does not fit a {buffer:?} buffer")
            }
            StorageError::Misfit { tensor, buffer, name: Some(name) } => {
                write!(f, "a {tensor:?} tensor does not fit the {buffer:?} buffer `{name}`")
            }
            StorageError::ElementType { name: None } => {
                f.write_str("a tensor's element type does not match its buffer's")
            }
            StorageError::ElementType { name: Some(name) } => {
                write!(f, "a tensor's element type does not match `{name}`'s")
            }
            StorageError::NotFloat { name: None } => f.write_str("only floating-point buffers are communicated"),
            StorageError::NotFloat { name: Some(name) } => {
                write!(f, "only floating-point buffers are communicated, not `{name}`")
            }
            StorageError::CollectiveNeedsFloats => f.write_str("a collective needs floating-point buffers"),
            StorageError::ResultMismatch => f.write_str("a collective's result does not match its buffer"),
            StorageError::HostBlockTooLarge => f.write_str("a host block is larger than its GPU buffer"),
            StorageError::GpuBufferShort => f.write_str("a GPU buffer is shorter than its shape"),
            StorageError::Overlap { start, end, before } => {
                write!(f, "storage regions overlap: words {start}..{end} start before {before}")
            }
            StorageError::PastArena { start, end } => {
                write!(f, "storage region {start}..{end} lies past the end of the arena")
            }
            StorageError::Unexpected(what) => write!(f, "internal error: expected {what}"),
            #[cfg(feature = "cuda")]
            StorageError::Allocation { bytes, error } => write!(
                f,
                "cannot allocate this device's {:.2} GiB on the GPU: {error}",
                *bytes as f64 / (1u64 << 30) as f64
            ),
            #[cfg(feature = "cuda")]
            StorageError::Device(e) => e.fmt(f),
            StorageError::Transfer(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for StorageError {}

/// For callers whose errors are messages (tests, the command line): the same text.
impl From<StorageError> for String {
    fn from(e: StorageError) -> String {
        e.to_string()
    }
}

/// Errors at the boundary between the executor and a backend, and of the executor itself.
#[derive(Clone, Debug, PartialEq)]
pub enum RuntimeError {
    /// An instruction reads a buffer that holds no value (never written, or freed).
    NotAlive { buffer: String },
    /// An optimizer step's buffers are not all alive.
    OptimizerNotAlive,
    /// An optimizer step without its four operands (param, grad, state, state).
    OptimizerOperands,
    /// One instruction both reads and writes a buffer.
    ReadAndWritten { buffer: String },
    /// A gradient holds a NaN or an infinity; its parameter is not updated.
    NonFiniteGradient { grad: String, at: usize, value: f32 },
    /// A parameter or output is not alive at the end of a step (`what` says which).
    NotKept { what: &'static str, name: String },
    /// A tensor loaded into a buffer has another shape.
    Shape { buffer: String, want: Vec<u64>, got: Vec<u64> },
    /// A gradient whose size changed between the micro-batches of one update.
    GradientResized,
    /// A buffer has no place in the device's storage, or its storage is not as laid out.
    Storage(StorageError),
    /// A kernel failed.
    Kernel(KernelError),
    /// A collective failed.
    Comm(CommError),
    /// The instruction described by `instruction` failed.
    Instruction { instruction: String, error: Box<RuntimeError> },
    /// A step's data has no tensor for an input of the plan.
    NoInput { name: String },
    /// A block of a tensor could not be cut or joined for a device, in the plan's words.
    Blocks(String),
    /// The data of a step or a validation batch could not be read, in its own words.
    Data(String),
    /// A checkpoint could not be read or written, in its own words.
    Checkpoint(String),
    /// A parameter (or, with `state`, its optimizer state) not alive when a checkpoint is written.
    CheckpointNotAlive { name: String, state: bool },
    /// Validation of a model without a loss output.
    NoLoss,
    /// A validation batch whose loss was not computed.
    LossNotComputed,
    /// A GPU could not be opened or set up.
    #[cfg(feature = "cuda")]
    Device(DeviceError),
}

impl std::fmt::Display for RuntimeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RuntimeError::NotAlive { buffer } => write!(f, "buffer `{buffer}` is not alive"),
            RuntimeError::OptimizerNotAlive => f.write_str("optimizer buffers are not alive"),
            RuntimeError::OptimizerOperands => f.write_str("optimizer step needs (param, grad, state, state)"),
            RuntimeError::ReadAndWritten { buffer } => {
                write!(f, "`{buffer}` is both read and written by one instruction")
            }
            RuntimeError::NonFiniteGradient { grad, at, value } => write!(
                f,
                "the gradient `{grad}` holds {value} at element {at} of this device's block; the update stops here"
            ),
            RuntimeError::NotKept { what, name } => {
                write!(f, "the plan does not keep {what} `{name}` to the end of a step")
            }
            RuntimeError::Shape { buffer, want, got } => {
                write!(f, "buffer `{buffer}` is {want:?} on each device, not {got:?}")
            }
            RuntimeError::GradientResized => f.write_str("a gradient changed size between micro-batches"),
            RuntimeError::Storage(e) => e.fmt(f),
            RuntimeError::Kernel(e) => e.fmt(f),
            RuntimeError::Comm(e) => e.fmt(f),
            RuntimeError::Instruction { instruction, error } => write!(f, "computing {instruction}: {error}"),
            RuntimeError::NoInput { name } => write!(f, "no data for input `{name}`"),
            RuntimeError::Blocks(message) | RuntimeError::Data(message) | RuntimeError::Checkpoint(message) => {
                f.write_str(message)
            }
            RuntimeError::CheckpointNotAlive { name, state: false } => write!(f, "`{name}` is not alive"),
            RuntimeError::CheckpointNotAlive { name, state: true } => {
                write!(f, "the optimizer state of `{name}` is not alive")
            }
            RuntimeError::NoLoss => f.write_str("the model has no loss output to validate"),
            RuntimeError::LossNotComputed => f.write_str("the loss was not computed"),
            #[cfg(feature = "cuda")]
            RuntimeError::Device(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for RuntimeError {}

impl From<CommError> for RuntimeError {
    fn from(e: CommError) -> RuntimeError {
        RuntimeError::Comm(e)
    }
}

impl From<KernelError> for RuntimeError {
    fn from(e: KernelError) -> RuntimeError {
        RuntimeError::Kernel(e)
    }
}

impl From<StorageError> for RuntimeError {
    fn from(e: StorageError) -> RuntimeError {
        RuntimeError::Storage(e)
    }
}

impl From<TensorError> for RuntimeError {
    fn from(e: TensorError) -> RuntimeError {
        RuntimeError::Kernel(e.into())
    }
}

#[cfg(feature = "cuda")]
impl From<DeviceError> for RuntimeError {
    fn from(e: DeviceError) -> RuntimeError {
        RuntimeError::Device(e)
    }
}

impl From<RuntimeError> for String {
    fn from(e: RuntimeError) -> String {
        e.to_string()
    }
}

/// An internal inconsistency of the runtime (a bug, reported rather than panicking).
pub fn unreachable(what: &'static str) -> RuntimeError {
    RuntimeError::Storage(StorageError::Unexpected(what))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Typed errors print exactly the messages the runtime printed as strings.
    #[test]
    fn messages_read_as_before() {
        let f32_from_ints = ElementError::Type { want: DType::F32, found: DType::I32 };
        let cases = [
            (
                KernelError::in_kernel(&Kernel::Softmax, ShapeError::Operands { want: 1, got: 2 }.into()),
                "Softmax: expects 1 inputs, got 2",
            ),
            (KernelError::operand("x", f32_from_ints), "x: expected a floating-point tensor, found integers"),
            (
                KernelError::operand("the ids", ElementError::Type { want: DType::I32, found: DType::Bf16 }),
                "the ids: expected an integer tensor, found floating point",
            ),
            (
                KernelError::operand("A", ElementError::Type { want: DType::F32, found: DType::Bf16 }),
                "A: expected f32 elements, found bf16",
            ),
            (
                ElementError::Unwidened.into(),
                "expected an f32 tensor, found bf16 (bf16 buffers are widened to f32 before a kernel reads them)",
            ),
            (KernelError::Holds { what: "dy".into(), len: 5, shape: vec![2, 3] }, "dy holds 5 elements, not [2, 3]"),
            (KernelError::Product { lhs: [2, 3], rhs: [4, 5], out: [2, 5] }, "cannot multiply 2x3 by 4x5 into 2x5"),
            (
                KernelError::TokenOutsideRows { id: 9, base: 4, rows: 3 },
                "token id 9 is outside this device's embedding rows [4, 7)",
            ),
            (
                KernelError::TokenOutsideRows { id: -100, base: 0, rows: 16 },
                "token id -100 is the id of positions `cross_entropy` ignores (the masked labels of --objective mlm), \
                 which an embedding cannot look up (its rows here: [0, 16))",
            ),
            (
                KernelError::in_kernel(
                    &optimus_plan::Kernel::Add,
                    KernelError::TokenOutsideRows { id: 9, base: 4, rows: 3 },
                ),
                "Add: token id 9 is outside this device's embedding rows [4, 7)",
            ),
            (
                KernelError::TargetOutsideVocabulary { target: 50, valid: 40 },
                "target 50 is outside the vocabulary [0, 40) and is not the ignored id -100",
            ),
            (KernelError::DropProbability(1.5), "the drop probability 1.5 is not in [0, 1]"),
            (KernelError::Internal("no scratch buffer".into()), "internal error: no scratch buffer"),
            (
                KernelError::Unsupported {
                    kernel: "the optimizer step",
                    why: "is applied by `optimizer_step`, not `run`",
                },
                "the optimizer step is applied by `optimizer_step`, not `run`",
            ),
        ];
        for (error, want) in cases {
            assert_eq!(error.to_string(), want, "{error:?}");
        }
    }

    #[test]
    fn storage_and_runtime_messages_read_as_before() {
        let cases = [
            (
                RuntimeError::Storage(StorageError::NoPlace(BufferId(7))),
                "buffer 7 has no place in this device's storage",
            ),
            (
                RuntimeError::Storage(StorageError::Misfit { tensor: vec![2], buffer: vec![3], name: None }),
                "a [2] tensor does not fit a [3] buffer",
            ),
            (unreachable("one output"), "internal error: expected one output"),
            (
                RuntimeError::Instruction {
                    instruction: "`y` (m.opt:3)".into(),
                    error: Box::new(RuntimeError::NotAlive { buffer: "x".into() }),
                },
                "computing `y` (m.opt:3): buffer `x` is not alive",
            ),
            (
                RuntimeError::CheckpointNotAlive { name: "w".into(), state: true },
                "the optimizer state of `w` is not alive",
            ),
        ];
        for (error, want) in cases {
            assert_eq!(error.to_string(), want, "{error:?}");
        }
    }
}
