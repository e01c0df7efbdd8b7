//! BERT's masking of a token file (`optimusc mask-data`): the masked inputs and the labels of masked
//! language modelling, written as two token files of the input's dtype.
//!
//! Each position is chosen with probability 15%; a chosen position is replaced by the mask id with
//! probability 80%, by a random token id (uniform over the vocabulary) with probability 10%, and kept
//! with probability 10%, as Hugging Face's DataCollatorForLanguageModeling does. Its label is the
//! original token; every other position's label is the ignore id of the dtype (65535 for u16, 0xFFFFFFFF
//! for u32). The draws at position i are a counter-based hash of (seed, i), so the output depends on
//! the seed and the file alone.

use super::data::{TokenData, TokenDtype};
use optimus_plan::init::mix64;
use std::fmt;
use std::path::{Path, PathBuf};

/// Why a token file cannot be masked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MaskError {
    /// `--mask-id` is not a token id of the vocabulary.
    MaskIdOutside { mask_id: u32, vocab: u64 },
    /// The mask id is the dtype's ignore id (or past it), which labels reserve.
    MaskIdIsIgnore { mask_id: u32, dtype: TokenDtype },
    /// The vocabulary reaches the dtype's ignore id, which labels reserve.
    VocabTooLarge { vocab: u64, dtype: TokenDtype },
    /// The token file holds the ignore id itself, at token index `offset`.
    HoldsIgnoreId { path: String, dtype: TokenDtype, offset: u64 },
    /// A token at `offset` is not below `--vocab`.
    OutsideVocab { path: String, token: u32, offset: u64, vocab: u64 },
}

impl fmt::Display for MaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MaskError::MaskIdOutside { mask_id, vocab } => {
                write!(f, "--mask-id {mask_id} is outside the vocabulary of {vocab} tokens (ids 0..{vocab})")
            }
            MaskError::MaskIdIsIgnore { mask_id, dtype } => {
                let wider = match dtype {
                    TokenDtype::U16 => ", or a u32 token file (--data-dtype u32) for ids this large",
                    TokenDtype::U32 => "",
                };
                write!(
                    f,
                    "--mask-id {mask_id} is not below {}, the value that marks ignored labels in {dtype:?} files; \
                     give the tokenizer's mask id{wider}",
                    dtype.ignore_id()
                )
            }
            MaskError::VocabTooLarge { vocab, dtype } => {
                let advice = match dtype {
                    TokenDtype::U16 => "use --data-dtype u32",
                    TokenDtype::U32 => "no token file holds a vocabulary this large",
                };
                write!(
                    f,
                    "a vocabulary of {vocab} tokens does not fit {} files, whose largest value {} marks ignored \
                     labels; {advice}",
                    dtype.name(),
                    dtype.ignore_id()
                )
            }
            MaskError::HoldsIgnoreId { path, dtype, offset } => write!(
                f,
                "token data `{path}` holds {} at offset {offset} (token index), the value that marks ignored labels \
                 in {dtype:?} files",
                dtype.ignore_id()
            ),
            MaskError::OutsideVocab { path, token, offset, vocab } => {
                write!(
                    f,
                    "token data `{path}`: token {token} at offset {offset} (token index) is not below --vocab {vocab}"
                )
            }
        }
    }
}

impl std::error::Error for MaskError {}

/// How many positions each rule touched.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MaskCounts {
    pub positions: u64,
    /// Positions chosen for prediction (their label is the original token).
    pub chosen: u64,
    /// Chosen positions replaced by the mask id.
    pub masked: u64,
    /// Chosen positions replaced by a random token.
    pub random: u64,
    /// Chosen positions kept as they are.
    pub kept: u64,
}

/// The masked token file and the label file, as bytes of the input's dtype.
#[derive(Clone, Debug)]
pub struct Masked {
    pub inputs: Vec<u8>,
    pub labels: Vec<u8>,
    pub counts: MaskCounts,
    /// The vocabulary random replacements were drawn from.
    pub vocab: u64,
}

/// Chosen positions out of 2^24 (15%).
const CHOSEN: u64 = (0.15 * (1u64 << 24) as f64) as u64;

/// The two files `mask-data` writes for `prefix`: `PREFIX.tokens.bin` (the masked inputs, for `--data`)
/// and `PREFIX.labels.bin` (for `--labels`).
pub fn output_paths(prefix: &Path) -> (PathBuf, PathBuf) {
    let with = |suffix: &str| {
        let mut name = prefix.as_os_str().to_os_string();
        name.push(suffix);
        PathBuf::from(name)
    };
    (with(".tokens.bin"), with(".labels.bin"))
}

/// Masks `data` with `mask_id`, drawing from `seed`. The vocabulary is `vocab`, or without it the largest
/// of the file's ids and the mask id, plus one. Errors: a mask id or token id outside the vocabulary,
/// a token equal to the ignore id, a vocabulary the dtype cannot hold.
pub fn mask_tokens(data: &TokenData, mask_id: u32, vocab: Option<u64>, seed: u64) -> Result<Masked, MaskError> {
    let dtype = data.dtype();
    let ignore = dtype.ignore_id();
    if mask_id >= ignore {
        return Err(MaskError::MaskIdIsIgnore { mask_id, dtype });
    }
    let largest = check_tokens(data, vocab)?;
    let vocab = vocab.unwrap_or_else(|| u64::from(largest.max(mask_id)) + 1);
    if u64::from(mask_id) >= vocab {
        return Err(MaskError::MaskIdOutside { mask_id, vocab });
    }
    if vocab > u64::from(ignore) {
        return Err(MaskError::VocabTooLarge { vocab, dtype });
    }
    let mut counts = MaskCounts { positions: data.len(), ..MaskCounts::default() };
    let bytes = usize::try_from(data.len()).unwrap_or(usize::MAX).saturating_mul(dtype.size());
    let (mut inputs, mut labels) = (Vec::with_capacity(bytes), Vec::with_capacity(bytes));
    let base = mix64(seed ^ 0x6d61_736b_5f64_6174);
    for i in 0..data.len() {
        let token = data.token(i);
        let draw = mix64(base ^ mix64(i));
        let (input, label) = if draw >> 40 < CHOSEN {
            counts.chosen += 1;
            let action = mix64(draw);
            let input = match action % 10 {
                0..=7 => {
                    counts.masked += 1;
                    mask_id
                }
                8 => {
                    counts.random += 1;
                    (mix64(action) % vocab) as u32
                }
                _ => {
                    counts.kept += 1;
                    token
                }
            };
            (input, token)
        } else {
            (token, ignore)
        };
        push(&mut inputs, dtype, input);
        push(&mut labels, dtype, label);
    }
    Ok(Masked { inputs, labels, counts, vocab })
}

/// The largest token id of the file, after checking every id: below `vocab` when given, and never the
/// ignore id (a label could not tell it from an ignored position).
fn check_tokens(data: &TokenData, vocab: Option<u64>) -> Result<u32, MaskError> {
    let ignore = data.dtype().ignore_id();
    let mut largest = 0;
    for i in 0..data.len() {
        let token = data.token(i);
        if token == ignore {
            return Err(MaskError::HoldsIgnoreId { path: data.path().to_string(), dtype: data.dtype(), offset: i });
        }
        if let Some(vocab) = vocab.filter(|&v| u64::from(token) >= v) {
            return Err(MaskError::OutsideVocab { path: data.path().to_string(), token, offset: i, vocab });
        }
        largest = largest.max(token);
    }
    Ok(largest)
}

fn push(out: &mut Vec<u8>, dtype: TokenDtype, value: u32) {
    match dtype {
        TokenDtype::U16 => out.extend_from_slice(&(value as u16).to_le_bytes()),
        TokenDtype::U32 => out.extend_from_slice(&value.to_le_bytes()),
    }
}
