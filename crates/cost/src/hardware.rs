//! Hardware profiles: one TOML file per cluster, built in (`hardware/*.toml`, embedded in the binary)
//! or written by users and loaded by path.
//!
//! The format, in decimal units (1 GB/s = 1e9 B/s, 1 TFLOP/s = 1e12 FLOP/s):
//!
//! ```toml
//! name = "my-cluster"
//! description = "free text"
//!
//! [device]
//! name = "GPU model"
//! memory_gb = 16.0                # memory per device
//! memory_bandwidth_gb_s = 448.0
//! achievable_bandwidth = 0.8      # fraction of the bandwidth kernels reach, in (0, 1]
//! achievable_compute = 0.7        # fraction of peak FLOP/s matrix products reach, in (0, 1]
//! kernel_launch_us = 5.0          # optional, default 0
//!
//! [device.peak_tflops]            # peak matrix FLOP/s by element type; f32 is required,
//! f32 = 11.2                      # a missing f16 or bf16 is costed at the f32 rate
//! f16 = 89.2
//!
//! [intra_node]
//! gpus_per_node = 4
//! bandwidth_gb_s = 12.0           # per GPU, each direction
//! latency_us = 10.0
//!
//! [inter_node]
//! nic_bandwidth_gb_s = 12.5       # per node, shared by its GPUs
//! latency_us = 5.0
//! nics_per_node = 1               # optional, default 1; one per GPU (as DGX): gpus_per_node
//!
//! [collectives]                   # optional
//! algorithm = "auto"              # ring, tree (hierarchical across nodes), or auto (the faster)
//!
//! [measured]                      # optional: written by `optimusc calibrate` (see cost::calibration)
//! runtime = "cpu"
//! threads = 2
//! shared_engine = true            # the node's devices share one engine: kernels queue one by one
//! overlap = false                 # the runtime does not overlap communication with compute
//! [measured.kernels.MatMul]       # per kernel kind, and `default`
//! launch_us = 12.0
//! gflop_s = 180.0
//! [measured.single_thread_kernels.MatMul]  # optional: the same on one thread (meshes of >= threads devices)
//! launch_us = 6.0
//! gflop_s = 95.0
//! [[measured.collectives]]        # per kind, group size and devices of the mesh
//! kind = "broadcast"
//! members = 4
//! devices = 16
//! alpha_us = 40.0
//! ns_per_byte = 0.3
//! ```

use super::calibration::MeasuredProblem;
use optimus_plan::types::DType;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The built-in profiles: (name, TOML text).
pub const BUILTIN: [(&str, &str); 3] = [
    ("frontera-rtx5000", include_str!("../../../hardware/frontera-rtx5000.toml")),
    ("dgx-a100", include_str!("../../../hardware/dgx-a100.toml")),
    ("dgx-h100", include_str!("../../../hardware/dgx-h100.toml")),
];

/// A cluster: identical nodes of identical devices.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub device: Device,
    pub intra_node: IntraNode,
    pub inter_node: InterNode,
    #[serde(default)]
    pub collectives: Collectives,
    /// What `optimusc calibrate` measured of this machine's runtime; when present, kernels and
    /// collectives are costed by it rather than by peaks and links.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<super::calibration::Measured>,
}

/// One accelerator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Device {
    pub name: String,
    pub memory_gb: f64,
    pub memory_bandwidth_gb_s: f64,
    pub achievable_bandwidth: f64,
    pub achievable_compute: f64,
    #[serde(default)]
    pub kernel_launch_us: f64,
    pub peak_tflops: PeakTflops,
}

/// Peak matrix-product rates by element type.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeakTflops {
    pub f32: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub f16: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16: Option<f64>,
}

/// The links between devices of one node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IntraNode {
    pub gpus_per_node: u64,
    pub bandwidth_gb_s: f64,
    pub latency_us: f64,
}

/// The network between nodes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterNode {
    pub nic_bandwidth_gb_s: f64,
    pub latency_us: f64,
    /// NICs that share `nic_bandwidth_gb_s` (1: one NIC for the node's GPUs; gpus_per_node: one per
    /// GPU, as DGX has). A flow leaving a node uses one NIC per member of its group there.
    #[serde(default = "one")]
    pub nics_per_node: u64,
}

fn one() -> u64 {
    1
}

/// How collectives are run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Collectives {
    #[serde(default)]
    pub algorithm: super::collective::Algorithm,
}

/// A point-to-point link in the alpha-beta model: time = latency + bytes / bandwidth.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Bytes per second, each direction.
    pub bandwidth: f64,
    /// Seconds per message.
    pub latency: f64,
}

impl Hardware {
    /// A built-in profile by name, or a profile file by path.
    pub fn load(name_or_path: &str) -> Result<Hardware, HardwareError> {
        if let Some((_, text)) = BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
            return Hardware::parse(text, name_or_path);
        }
        let path = Path::new(name_or_path);
        if path.exists() || name_or_path.contains(['/', '\\']) || name_or_path.ends_with(".toml") {
            return Hardware::from_path(path);
        }
        Err(HardwareError::Unknown { name: name_or_path.to_string() })
    }

    /// A profile file: a regular file of at most 64 MiB of UTF-8 text.
    pub fn from_path(path: &Path) -> Result<Hardware, HardwareError> {
        let limit = optimus_io::files::HARDWARE_PROFILE_LIMIT;
        let bytes =
            optimus_io::files::read_bounded(path, "hardware profile", limit).map_err(HardwareError::Unreadable)?;
        let text = String::from_utf8(bytes)
            .map_err(|e| HardwareError::NotText { path: path.to_path_buf(), why: e.utf8_error() })?;
        Hardware::parse(&text, &path.display().to_string())
    }

    /// Parses and validates a profile; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Hardware, HardwareError> {
        let invalid = |problem| HardwareError::Invalid { origin: origin.to_string(), problem };
        let hw: Hardware =
            toml::from_str(text).map_err(|e| invalid(ProfileProblem::Syntax(e.to_string().trim().to_string())))?;
        hw.validate().map_err(invalid)?;
        Ok(hw)
    }

    fn validate(&self) -> Result<(), ProfileProblem> {
        let d = &self.device;
        let positive = [
            ("device.memory_bandwidth_gb_s", d.memory_bandwidth_gb_s),
            ("device.peak_tflops.f32", d.peak_tflops.f32),
            ("device.peak_tflops.f16", d.peak_tflops.f16.unwrap_or(1.0)),
            ("device.peak_tflops.bf16", d.peak_tflops.bf16.unwrap_or(1.0)),
            ("intra_node.bandwidth_gb_s", self.intra_node.bandwidth_gb_s),
            ("inter_node.nic_bandwidth_gb_s", self.inter_node.nic_bandwidth_gb_s),
        ];
        if let Some((field, value)) = positive.into_iter().find(|&(_, v)| !is_rate(v)) {
            return Err(ProfileProblem::NotPositive { field, value });
        }
        let fractions = [
            ("device.achievable_bandwidth", d.achievable_bandwidth),
            ("device.achievable_compute", d.achievable_compute),
        ];
        if let Some((field, value)) = fractions.into_iter().find(|&(_, v)| !(v > 0.0 && v <= 1.0)) {
            return Err(ProfileProblem::NotFraction { field, value });
        }
        let latencies = [
            ("device.kernel_launch_us", d.kernel_launch_us),
            ("intra_node.latency_us", self.intra_node.latency_us),
            ("inter_node.latency_us", self.inter_node.latency_us),
        ];
        if let Some((field, value)) = latencies.into_iter().find(|&(_, v)| !is_fixed_cost(v)) {
            return Err(ProfileProblem::Negative { field, value });
        }
        if self.inter_node.nics_per_node == 0 {
            return Err(ProfileProblem::NoneOf("inter_node.nics_per_node"));
        }
        if self.intra_node.gpus_per_node == 0 {
            return Err(ProfileProblem::NoneOf("intra_node.gpus_per_node"));
        }
        if !(MEMORY_GB_RANGE.0..=MEMORY_GB_RANGE.1).contains(&d.memory_gb) {
            return Err(ProfileProblem::MemoryOutOfRange { value: d.memory_gb });
        }
        self.measured.as_ref().map_or(Ok(()), |m| m.validate().map_err(ProfileProblem::Measured))
    }

    /// Device memory in bytes.
    pub fn memory_bytes(&self) -> u64 {
        (self.device.memory_gb * 1e9) as u64
    }

    /// Peak matrix-product FLOP/s for an element type (f32's rate for types without their own).
    pub fn peak_flops(&self, dtype: DType) -> f64 {
        let p = &self.device.peak_tflops;
        let tflops = match dtype {
            DType::F16 => p.f16.unwrap_or(p.f32),
            DType::Bf16 => p.bf16.unwrap_or(p.f32),
            _ => p.f32,
        };
        tflops * 1e12
    }

    /// The link between two devices of one node.
    pub fn intra_link(&self) -> Link {
        Link { bandwidth: self.intra_node.bandwidth_gb_s * 1e9, latency: self.intra_node.latency_us * 1e-6 }
    }

    /// The network as one device sees it: its share of the node's NIC bandwidth, since every device
    /// of an SPMD program communicates at once.
    pub fn inter_link(&self) -> Link {
        self.inter_link_shared(self.intra_node.gpus_per_node)
    }

    /// The network as one of `streams` concurrent flows leaving a node sees it: the NIC bandwidth over
    /// the flows, and never more than the device's own link to the NIC.
    pub fn inter_link_shared(&self, streams: u64) -> Link {
        let share = self.inter_node.nic_bandwidth_gb_s * 1e9 / streams.max(1) as f64;
        let share = share.min(self.intra_node.bandwidth_gb_s * 1e9);
        Link { bandwidth: share, latency: self.inter_node.latency_us * 1e-6 }
    }
}

/// Why a hardware profile could not be loaded.
#[derive(Debug)]
pub enum HardwareError {
    /// Neither a built-in profile nor a path.
    Unknown { name: String },
    /// The file could not be read.
    Unreadable(optimus_io::files::FileError),
    /// The file is not UTF-8 text.
    NotText { path: std::path::PathBuf, why: std::str::Utf8Error },
    /// The profile named `origin` is not a valid profile.
    Invalid { origin: String, problem: ProfileProblem },
}

/// What is wrong inside a hardware profile.
#[derive(Clone, Debug, PartialEq)]
pub enum ProfileProblem {
    /// Not TOML of the profile's form (the parser's words).
    Syntax(String),
    NotPositive {
        field: &'static str,
        value: f64,
    },
    NotFraction {
        field: &'static str,
        value: f64,
    },
    Negative {
        field: &'static str,
        value: f64,
    },
    /// A count that must be at least 1 is 0.
    NoneOf(&'static str),
    /// The `[measured]` section's numbers.
    Measured(MeasuredProblem),
    /// `device.memory_gb` outside [`MEMORY_GB_RANGE`].
    MemoryOutOfRange {
        value: f64,
    },
}

/// The rates a profile may give (GB/s, TFLOP/s, GFLOP/s): from a millionth to a billion of its unit,
/// so that no step time it gives is infinite, zero or a 300-digit number.
pub const RATE_RANGE: (f64, f64) = (1e-6, 1e9);

/// The largest fixed cost a profile may give, in microseconds (a thousand seconds).
pub const MAX_FIXED_COST_US: f64 = 1e9;

/// A number as a message shows it: plainly where that is short, else in scientific notation (not
/// 1e300's three hundred digits).
pub fn shown(value: f64) -> String {
    let plain = value == 0.0 || (1e-4..1e9).contains(&value.abs()) || !value.is_finite();
    if plain { value.to_string() } else { format!("{value:e}") }
}

/// Whether `value` is a rate within [`RATE_RANGE`].
pub fn is_rate(value: f64) -> bool {
    (RATE_RANGE.0..=RATE_RANGE.1).contains(&value)
}

/// Whether `value` is a fixed cost in microseconds: from 0 to [`MAX_FIXED_COST_US`].
pub fn is_fixed_cost(value: f64) -> bool {
    (0.0..=MAX_FIXED_COST_US).contains(&value)
}

/// The device memories a profile may give, in GB: a kilobyte to a petabyte (what a plan's bytes and
/// the reports' units can hold).
pub const MEMORY_GB_RANGE: (f64, f64) = (1e-6, 1e6);

impl std::fmt::Display for HardwareError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HardwareError::Unknown { name } => {
                let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
                write!(
                    f,
                    "unknown hardware `{name}`: built-in profiles are {}; or give the path of a .toml profile",
                    names.join(", ")
                )
            }
            HardwareError::Unreadable(why) => write!(f, "{why}"),
            HardwareError::NotText { path, why } => {
                write!(f, "cannot read hardware profile `{}`: not UTF-8 text ({why})", path.display())
            }
            HardwareError::Invalid { origin, problem } => write!(f, "invalid hardware profile `{origin}`: {problem}"),
        }
    }
}

impl std::fmt::Display for ProfileProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProfileProblem::Syntax(why) => f.write_str(why),
            ProfileProblem::NotPositive { field, value } => write!(
                f,
                "`{field}` must be a positive number from {:e} to {:e}, found {}",
                RATE_RANGE.0,
                RATE_RANGE.1,
                shown(*value)
            ),
            ProfileProblem::NotFraction { field, value } => {
                write!(f, "`{field}` must be a fraction in (0, 1], found {value}")
            }
            ProfileProblem::Negative { field, value } => {
                write!(f, "`{field}` must be from 0 to {MAX_FIXED_COST_US:e} (microseconds), found {}", shown(*value))
            }
            ProfileProblem::NoneOf(field) => write!(f, "`{field}` must be at least 1"),
            ProfileProblem::Measured(problem) => write!(f, "{problem}"),
            ProfileProblem::MemoryOutOfRange { value } => write!(
                f,
                "`device.memory_gb` is {value:e}: give a device memory from {:e} GB (a kilobyte) to {:e} GB (a petabyte)",
                MEMORY_GB_RANGE.0, MEMORY_GB_RANGE.1
            ),
        }
    }
}

impl std::error::Error for HardwareError {}
