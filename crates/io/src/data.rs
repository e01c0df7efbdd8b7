//! Token data for training: nanoGPT-style files of little-endian u16 or u32 token ids, and random batches.
//!
//! Step k, sequence r of a batch reads the seq + 1 tokens that start at (k * batch + r) * seq, wrapping
//! at the end of the file; the input is the first seq of them and the target the last seq, so every
//! target is the token that follows its input. With [`Order::Shuffled`] the file's whole windows
//! (seq + 1 tokens, seq apart) are read in a seeded order that changes every epoch: row k * batch + r
//! is window `permuted(i)` of epoch e, for e and i its quotient and remainder by the number of
//! windows. The order is a pure function of the seed, the epoch and the row, so a resumed run reads
//! exactly what an uninterrupted one would.

use super::files::{FileError, open_regular};
use memmap2::Mmap;
use optimus_plan::init::mix64;
use optimus_plan::tensor::Tensor;
use optimus_plan::text::shape_text;
use optimus_plan::types::DType;
use optimus_plan::{Plan, PlanInput};
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

/// The order in which a run reads its token file's windows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Order {
    /// One after another from the start, wrapping at the end of the file.
    #[default]
    Sequential,
    /// Every whole window once per epoch, in an order drawn from `seed` and the epoch.
    Shuffled { seed: u64 },
}

/// Why token data cannot be opened or read for a model; every message names the file or the model.
#[derive(Debug)]
pub enum DataError {
    /// The file cannot be opened, or is not a regular file.
    File(FileError),
    /// The file holds no token.
    Empty { path: String },
    /// The file's `len` bytes are not a whole number of tokens.
    Ragged { path: String, len: u64, dtype: TokenDtype },
    /// The file cannot be mapped into memory.
    Map { path: String, source: std::io::Error },
    /// A token id at token index `offset` is not below the vocabulary size.
    OutsideVocab { path: String, token: u32, offset: u64, vocab: u64 },
    /// A vocabulary larger than i32 token ids can number.
    VocabTooLarge { vocab: u64 },
    /// The model lacks integer `tokens` and `targets` inputs of one [batch, seq] shape; `inputs` lists
    /// those it has.
    Inputs { model: String, inputs: String },
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataError::File(e) => write!(f, "{e}"),
            DataError::Empty { path } => write!(f, "token data `{path}` is empty"),
            DataError::Ragged { path, len, dtype } => write!(
                f,
                "token data `{path}` has {len} bytes, not a whole number of {}-byte {dtype:?} tokens",
                dtype.size()
            ),
            DataError::Map { path, source } => write!(f, "cannot map token data `{path}`: {source}"),
            DataError::OutsideVocab { path, token, offset, vocab } => write!(
                f,
                "token data `{path}`: token {token} at offset {offset} (token index) is not below the vocabulary \
                 size {vocab}"
            ),
            DataError::VocabTooLarge { vocab } => {
                write!(f, "a vocabulary of {vocab} tokens does not fit i32 token ids")
            }
            DataError::Inputs { model, inputs } => write!(
                f,
                "token data feeds two integer inputs, `tokens` and `targets` (or `labels`), each [batch, seq], but \
                 model `{model}` has inputs {inputs}"
            ),
        }
    }
}

impl std::error::Error for DataError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DataError::File(e) => Some(e),
            DataError::Map { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<FileError> for DataError {
    fn from(e: FileError) -> DataError {
        DataError::File(e)
    }
}

/// The element type of a token file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenDtype {
    U16,
    U32,
}

impl TokenDtype {
    /// How files and flags name it: `u16`, `u32`.
    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U16 => "u16",
            TokenDtype::U32 => "u32",
        }
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    /// The id that marks an ignored position in a label file: the largest value of the dtype (65535 for
    /// u16, 0xFFFFFFFF for u32), never a token id of a vocabulary that fits the file.
    pub fn ignore_id(self) -> u32 {
        match self {
            TokenDtype::U16 => u32::from(u16::MAX),
            TokenDtype::U32 => u32::MAX,
        }
    }
}

/// A token file, memory-mapped: a step reads only the pages its windows touch, so a 100 GB file opens
/// as fast as a small one. Clones share the mapping.
///
/// Like every memory-mapped data loader, this assumes nobody truncates the file while it is mapped:
/// reading a page past the new end would raise SIGBUS. Files that are only appended to, or replaced by
/// renaming, are safe (the mapping keeps the old file's pages).
#[derive(Clone, Debug)]
pub struct TokenData {
    path: String,
    dtype: TokenDtype,
    bytes: Arc<Mmap>,
}

impl TokenData {
    /// Maps the file. Anything but a regular file (a device, FIFO, socket or directory) is refused before
    /// it is opened; an empty file, or one whose length is not a whole number of tokens, is an error.
    pub fn open(path: &Path, dtype: TokenDtype) -> Result<TokenData, DataError> {
        let shown = path.display().to_string();
        let (file, len) = open_regular(path, "token data")?;
        if len == 0 {
            return Err(DataError::Empty { path: shown });
        }
        if len % dtype.size() as u64 != 0 {
            return Err(DataError::Ragged { path: shown, len, dtype });
        }
        // SAFETY: the map is read-only and the file is not truncated while mapped (see the type's docs).
        let map = unsafe { Mmap::map(&file) }.map_err(|source| DataError::Map { path: shown.clone(), source })?;
        Ok(TokenData { path: shown, dtype, bytes: Arc::new(map) })
    }

    /// The path, as given.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The element type.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// The number of tokens in the file.
    pub fn len(&self) -> u64 {
        (self.bytes.len() / self.dtype.size()) as u64
    }

    /// Never true: [`TokenData::open`] rejects empty files.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The token at `index` modulo the file's length.
    pub fn token(&self, index: u64) -> u32 {
        let size = self.dtype.size();
        let at = (index % self.len()) as usize * size;
        match self.bytes.get(at..at + size) {
            Some(&[a, b]) => u32::from(u16::from_le_bytes([a, b])),
            Some(&[a, b, c, d]) => u32::from_le_bytes([a, b, c, d]),
            _ => 0,
        }
    }

    /// A warning when the file holds fewer tokens than one step reads. Step k reads the batch * seq + 1
    /// consecutive tokens from k * batch * seq (each sequence's seq + 1 window overlaps the next by one);
    /// a shorter file makes the windows of a single step wrap around it, so the model sees the same
    /// tokens several times in one batch.
    pub fn shortfall_warning(&self, batch: u64, seq: u64) -> Option<String> {
        let step_reads = u128::from(batch) * u128::from(seq) + 1;
        (u128::from(self.len()) < step_reads).then(|| {
            format!(
                "token data `{}` holds {} tokens, fewer than the {step_reads} one step reads \
                 ({batch} sequences x {seq} tokens, plus 1 for the last target), so every step wraps \
                 around the file and trains on repeated tokens",
                self.path,
                self.len()
            )
        })
    }

    /// The windows of seq + 1 tokens, seq apart, that fit whole in the file: what one shuffled epoch
    /// reads (0 when the file is shorter than one window; a shuffled run then reads in order).
    pub fn windows(&self, seq: u64) -> u64 {
        self.len().saturating_sub(1).checked_div(seq).unwrap_or(0)
    }

    /// Where sequence `row` of step `step` starts, in `order`.
    pub fn window_start(&self, order: Order, step: u64, batch: u64, row: u64, seq: u64) -> u64 {
        let global = u128::from(step) * u128::from(batch) + u128::from(row);
        let windows = u128::from(self.windows(seq));
        match order {
            Order::Shuffled { seed } if windows > 0 => {
                let (epoch, index) = ((global / windows) as u64, (global % windows) as u64);
                permuted(index, windows as u64, seed, epoch) * seq
            }
            _ => (global * u128::from(seq) % u128::from(self.len())) as u64,
        }
    }

    /// The pass over the file (0 for the first) that step `step`'s last sequence belongs to, so a new
    /// epoch is counted from the step in which it begins: shuffled, the epoch of its window; in order,
    /// how many times the reading has wrapped past the file's end when that sequence starts.
    pub fn epoch(&self, order: Order, step: u64, batch: u64, seq: u64) -> u64 {
        let last_row = u128::from(step) * u128::from(batch) + u128::from(batch.saturating_sub(1));
        let windows = u128::from(self.windows(seq));
        let epoch = match order {
            Order::Shuffled { .. } if windows > 0 => last_row / windows,
            _ => last_row * u128::from(seq) / u128::from(self.len()),
        };
        u64::try_from(epoch).unwrap_or(u64::MAX)
    }

    /// `tokens` and `targets` of step `step`, each i32 [batch, seq], read in `order`; a token id >=
    /// `vocab` is an error.
    pub fn batch(
        &self,
        order: Order,
        step: u64,
        (batch, seq): (u64, u64),
        vocab: u64,
    ) -> Result<BTreeMap<String, Tensor>, DataError> {
        check_vocab(vocab)?;
        let capacity = batch.saturating_mul(seq).min(1 << 24) as usize;
        let (mut tokens, mut targets) = (Vec::with_capacity(capacity), Vec::with_capacity(capacity));
        for r in 0..batch {
            let start = self.window_start(order, step, batch, r, seq);
            let window = self.window(start, seq + 1, vocab)?;
            tokens.extend_from_slice(&window[..window.len() - 1]);
            targets.extend_from_slice(&window[1..]);
        }
        Ok(pair(batch, seq, tokens, targets))
    }

    /// `count` tokens from `start` (wrapping), each checked against the vocabulary.
    pub(crate) fn window(&self, start: u64, count: u64, vocab: u64) -> Result<Vec<i32>, DataError> {
        (0..count)
            .map(|t| {
                let offset = (start + t) % self.len();
                let token = self.token(offset);
                if u64::from(token) >= vocab {
                    return Err(DataError::OutsideVocab { path: self.path.clone(), token, offset, vocab });
                }
                Ok(token as i32)
            })
            .collect()
    }
}

/// Index `index` of 0..n under the permutation of 0..n drawn from `seed` and `epoch`: a balanced
/// Feistel network on the smallest even power of two that holds n, walked until it lands below n (a
/// permutation of the larger range restricted to 0..n stays a permutation; fewer than four steps are
/// expected). Constant memory, whatever the number of windows.
fn permuted(index: u64, n: u64, seed: u64, epoch: u64) -> u64 {
    if n <= 1 {
        return 0;
    }
    let bits = (64 - (n - 1).leading_zeros()).max(2).next_multiple_of(2);
    let half = bits / 2;
    let mask = (1u64 << half) - 1;
    let key = mix64(seed ^ mix64(epoch.wrapping_add(0x9E37_79B9_7F4A_7C15)));
    let mut x = index;
    loop {
        let (mut left, mut right) = (x >> half, x & mask);
        for round in 0..4u64 {
            let f = mix64(key ^ mix64(right ^ (round << 56))) & mask;
            (left, right) = (right, left ^ f);
        }
        x = (left << half) | right;
        if x < n {
            return x;
        }
    }
}

/// Random `tokens` and `targets` for step `step`: the token at row r, column t is a counter-based
/// hash of (seed, step, r, t), and targets are the tokens shifted by one (the row has seq + 1 draws).
/// A `vocab` of 0 gives zeros.
pub fn random_batch(seed: u64, step: u64, batch: u64, seq: u64, vocab: u64) -> BTreeMap<String, Tensor> {
    let capacity = batch.saturating_mul(seq).min(1 << 24) as usize;
    let (mut tokens, mut targets) = (Vec::with_capacity(capacity), Vec::with_capacity(capacity));
    let base = mix64(mix64(seed) ^ step);
    for r in 0..batch {
        let row = mix64(base ^ r);
        let window: Vec<i32> =
            (0..=seq).map(|t| mix64(row ^ mix64(t)).checked_rem(vocab).unwrap_or(0) as i32).collect();
        tokens.extend_from_slice(&window[..window.len() - 1]);
        targets.extend_from_slice(&window[1..]);
    }
    pair(batch, seq, tokens, targets)
}

/// (batch, seq) of the plan's `tokens` input, after checking that the plan has integer inputs
/// `tokens` and targets (named `targets` or `labels`) with the same [batch, seq] shape (other inputs are
/// checked by [`Sources::check`](super::sources::Sources::check)).
pub fn check_inputs(plan: &Plan) -> Result<(u64, u64), DataError> {
    let find = |names: &[&str]| plan.inputs.iter().find(|i| names.contains(&i.name.as_str()));
    let fits = match (find(&["tokens"]), find(&["targets", "labels"])) {
        (Some(tokens), Some(targets)) => {
            let integer = [tokens, targets].iter().all(|i| dtype_of(plan, i).is_some_and(DType::is_integer));
            let shaped = tokens.shape.len() == 2 && targets.shape == tokens.shape;
            (integer && shaped).then(|| (tokens.shape[0], tokens.shape[1]))
        }
        _ => None,
    };
    fits.ok_or_else(|| DataError::Inputs { model: plan.model.clone(), inputs: input_list(plan) })
}

/// The plan's inputs as "`tokens`: i32[8, 64], ...", or "none".
pub(crate) fn input_list(plan: &Plan) -> String {
    // An input read in several layouts has an entry for each: list it once.
    let mut listed: Vec<String> = Vec::new();
    for i in &plan.inputs {
        let entry = format!("`{}`: {}{}", i.name, dtype_of(plan, i).map_or("?", DType::name), shape_text(&i.shape));
        if !listed.contains(&entry) {
            listed.push(entry);
        }
    }
    if listed.is_empty() { "none".to_string() } else { listed.join(", ") }
}

pub(crate) fn dtype_of(plan: &Plan, input: &PlanInput) -> Option<DType> {
    plan.buffers.get(input.buffer.0 as usize).map(|b| b.dtype)
}

pub(crate) fn check_vocab(vocab: u64) -> Result<(), DataError> {
    if vocab > 1 << 31 {
        return Err(DataError::VocabTooLarge { vocab });
    }
    Ok(())
}

fn pair(batch: u64, seq: u64, tokens: Vec<i32>, targets: Vec<i32>) -> BTreeMap<String, Tensor> {
    BTreeMap::from([
        ("tokens".to_string(), Tensor::from_i32(&[batch, seq], tokens)),
        ("targets".to_string(), Tensor::from_i32(&[batch, seq], targets)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_epoch_is_a_permutation_and_epochs_differ() {
        for n in [1u64, 2, 3, 5, 16, 17, 1000, 4097] {
            let order = |epoch| (0..n).map(|i| permuted(i, n, 7, epoch)).collect::<Vec<_>>();
            let mut seen = order(0);
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n = {n}");
            if n >= 16 {
                assert_ne!(order(0), order(1), "n = {n}: epochs 0 and 1 read in one order");
                assert_ne!(order(0), (0..n).collect::<Vec<_>>(), "n = {n}: not shuffled");
            }
        }
        assert_ne!(permuted(3, 1000, 1, 0), permuted(3, 1000, 2, 0), "the seed changes the order");
    }
}
