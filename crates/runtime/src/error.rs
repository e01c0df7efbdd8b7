//! Errors at the boundary between the executor and a backend, as data; their messages (in the
//! user's terms, naming buffers) are rendered by `Display`. Kernel bodies still report strings, which
//! a backend wraps in [`RuntimeError::Kernel`].

use super::comm::CommError;

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
    /// A buffer has no place in the device's storage, or its storage is not as laid out.
    Storage(String),
    /// A kernel failed (its own message).
    Kernel(String),
    /// A collective failed.
    Comm(CommError),
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
            RuntimeError::Storage(message) | RuntimeError::Kernel(message) => f.write_str(message),
            RuntimeError::Comm(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for RuntimeError {}

impl From<CommError> for RuntimeError {
    fn from(e: CommError) -> RuntimeError {
        RuntimeError::Comm(e)
    }
}

impl From<RuntimeError> for String {
    fn from(e: RuntimeError) -> String {
        e.to_string()
    }
}

/// An internal inconsistency of the runtime (a bug, reported rather than panicking).
pub fn unreachable(what: &str) -> RuntimeError {
    RuntimeError::Storage(format!("internal error: expected {what}"))
}
