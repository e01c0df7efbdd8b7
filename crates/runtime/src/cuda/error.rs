//! What the GPU's libraries report, as data: the driver, cuBLAS, NVRTC and NCCL errors (cudarc's own
//! types, wrapped with what was being done), the libraries or GPUs that are missing, and the compiler's
//! log. `Display` gives the messages a user sees.

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;
use cudarc::nccl::result::NcclError;
use cudarc::nvrtc::result::NvrtcError;
use optimus_plan::{Coords, Mesh};

/// A failure of the GPU or of one of its libraries.
#[derive(Clone, Debug, PartialEq)]
pub enum DeviceError {
    /// A driver call failed while doing `during` ("copying to the GPU").
    Driver { during: String, error: DriverError },
    /// Launching the compiled function `function` failed.
    Launch { function: String, error: DriverError },
    /// Loading the compiled function `function` from the module failed.
    Load { function: String, error: DriverError },
    /// A compiled function the runner never loaded.
    NotLoaded(String),
    /// A cuBLAS call failed (`call` names it: "sgemm").
    Blas { call: &'static str, error: CublasError },
    /// cuBLAS could not create a handle.
    BlasHandle(CublasError),
    /// A dimension or stride past what cuBLAS takes (`what` says which).
    BlasRange { what: &'static str, value: usize },
    /// An NVRTC call failed.
    Nvrtc(NvrtcError),
    /// NVRTC could not compile the kernels for `target`; its log.
    Compile { target: String, code: NvrtcError, log: String },
    /// NVRTC failed otherwise (cudarc's own report).
    CompileFailed(cudarc::nvrtc::CompileError),
    /// The kernels' source holds a NUL byte (NVRTC takes a C string).
    NulInSource,
    /// NVRTC compiled no machine code for `sm_{0}`.
    NoMachineCode(u32),
    /// A library that cannot be loaded on this machine; the message says what to install.
    Unavailable(&'static str),
    /// The CUDA driver is installed, but the machine has no GPU.
    NoGpu,
    /// The driver supports an older CUDA than the backend needs (`version` as `cuDriverGetVersion` gives
    /// it: 12060 for 12.6).
    OldDriver { version: i32 },
    /// A mesh with more devices than the machine has GPUs, for NCCL (one GPU per device).
    TooFewGpus { mesh: Mesh, gpus: u64 },
    /// A stream of another context than the one the kernels load into.
    ForeignStream,
    /// An NCCL call failed.
    Nccl(NcclError),
    /// NCCL could not create a group's unique id.
    NcclId(NcclError),
    /// The device at `coords` could not join its NCCL communicator of `group`.
    NcclJoin { coords: Coords, group: &'static str, error: Box<DeviceError> },
    /// A count past what NCCL takes.
    OutOfRange(std::num::TryFromIntError),
    /// A lock poisoned by a panic on another thread (the message names the lock).
    Poisoned(&'static str),
    /// A GPU buffer of `len` elements read as holding `want`.
    ShortBuffer { len: usize, want: usize },
    /// Element `index` read from a GPU buffer of `len` elements.
    IndexOutside { index: usize, len: usize },
}

impl std::fmt::Display for DeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceError::Driver { during, error } => write!(f, "{during}: {error}"),
            DeviceError::Launch { function, error } => write!(f, "launching `{function}`: {error}"),
            DeviceError::Load { function, error } => write!(f, "loading kernel `{function}`: {error}"),
            DeviceError::NotLoaded(function) => write!(f, "kernel `{function}` is not loaded"),
            DeviceError::Blas { call, error } => write!(f, "cuBLAS {call}: {error}"),
            DeviceError::BlasHandle(error) => write!(f, "creating a cuBLAS handle: {error}"),
            DeviceError::BlasRange { what, value } => write!(f, "{what} {value} is too large for cuBLAS"),
            DeviceError::Nvrtc(error) => write!(f, "NVRTC: {error:?}"),
            DeviceError::Compile { target, code, log } => {
                write!(f, "NVRTC failed to compile kernels.cu for {target} ({code:?}):\n{log}")
            }
            DeviceError::CompileFailed(error) => write!(f, "NVRTC failed: {error:?}"),
            DeviceError::NulInSource => f.write_str("kernels.cu holds a NUL byte"),
            DeviceError::NoMachineCode(sm) => write!(f, "NVRTC gave no machine code for sm_{sm}"),
            DeviceError::Unavailable(message) | DeviceError::Poisoned(message) => f.write_str(message),
            DeviceError::OldDriver { version } => write!(
                f,
                "--backend cuda needs a driver for CUDA 12.6 or later, and this machine's supports CUDA {}.{}: \
                 update the NVIDIA driver, or use --backend cpu",
                version / 1000,
                version % 1000 / 10
            ),
            DeviceError::NoGpu => {
                f.write_str("the CUDA driver is installed but this machine has no GPU; use --backend cpu")
            }
            DeviceError::TooFewGpus { mesh, gpus } => write!(
                f,
                "--backend cuda runs one device per GPU: the {mesh} mesh has {} devices and this machine {gpus} \
                 GPUs; run across machines with mpirun or srun (docs/clusters.md)",
                mesh.devices()
            ),
            DeviceError::ForeignStream => f.write_str("the stream belongs to another CUDA context"),
            DeviceError::Nccl(error) => write!(f, "{error:?}"),
            DeviceError::NcclId(error) => write!(f, "NCCL could not create a unique id: {error:?}"),
            DeviceError::NcclJoin { coords, group, error } => {
                write!(f, "device {coords} could not join its NCCL {group} communicator: {error}")
            }
            DeviceError::OutOfRange(error) => write!(f, "{error}"),
            DeviceError::ShortBuffer { len, want } => write!(f, "a buffer of {len} elements holds fewer than {want}"),
            DeviceError::IndexOutside { index, len } => write!(f, "index {index} is outside a buffer of {len}"),
        }
    }
}

impl std::error::Error for DeviceError {}

/// For callers whose errors are messages (tests, the command line): the same text.
impl From<DeviceError> for String {
    fn from(e: DeviceError) -> String {
        e.to_string()
    }
}

/// A driver error while doing `during`.
pub fn driver(during: &str) -> impl Fn(DriverError) -> DeviceError + '_ {
    move |error| DeviceError::Driver { during: during.to_string(), error }
}
