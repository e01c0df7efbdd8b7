//! The values a plan records: element types, how parameters start and what they are for, and the
//! scalar config values of the language.

use serde::{Deserialize, Serialize};

/// Element types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    I32,
    I64,
    F32,
    F16,
    Bf16,
}

impl DType {
    pub const ALL: [DType; 5] = [DType::I32, DType::I64, DType::F32, DType::F16, DType::Bf16];

    pub fn name(self) -> &'static str {
        match self {
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }

    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    pub fn bytes(self) -> u64 {
        match self {
            DType::I32 | DType::F32 => 4,
            DType::I64 => 8,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    pub fn is_integer(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }
}

/// How a parameter starts, before any checkpoint is loaded.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Init {
    Normal { std: f64 },
    Zeros,
    Ones,
}

/// What a parameter is for, within its layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamRole {
    LinearWeight,
    LinearBias,
    NormWeight,
    NormBias,
    Embedding,
    PositionEmbedding,
}

/// A scalar value of the language.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Scalar {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
}

impl std::fmt::Display for Scalar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scalar::Int(v) => write!(f, "{v}"),
            Scalar::Float(v) => write!(f, "{v:?}"),
            Scalar::Bool(v) => write!(f, "{v}"),
            Scalar::Str(v) => write!(f, "{v:?}"),
        }
    }
}
