//! Feeding every input of a model from data: each input's role comes from its name, and each role
//! from one source (the token file, the segment file, the label file, or the seed).
//!
//! | names                        | role        | source                                                          |
//! |------------------------------|-------------|-----------------------------------------------------------------|
//! | `tokens`                     | token ids   | `--data` (or drawn from the seed)                               |
//! | `targets`, `labels`          | targets     | causal: the next token of `--data`; mlm: `--labels`             |
//! | `segments`, `token_type_ids` | token types | `--segments` (drawn: sentence A then B, or zeros)               |
//!
//! Sequence r of batch k reads the files at offset o = (k * batch + r) * seq (wrapping at the end of
//! the token file): tokens[t] = data[o + t]; under the causal objective targets[t] = data[o + t + 1];
//! segments[t] = segments_file[o + t]; MLM labels[t] = labels_file[o + t] (not shifted), where the
//! token file's ignore id (65535 in u16 files, 0xFFFFFFFF in u32 ones) becomes
//! [`IGNORE_INDEX`](optimus_plan::IGNORE_INDEX), which cross-entropy leaves out of its mean.

use super::data::{DataError, Order, TokenData, check_vocab, dtype_of, input_list, random_batch};
use optimus_plan::init::mix64;
use optimus_plan::tensor::Tensor;
use optimus_plan::{IGNORE_INDEX, Plan, PlanInput};
use std::collections::BTreeMap;
use std::fmt;

/// What a model input holds, known from its name (see the module's table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Tokens,
    Targets,
    Segments,
}

impl Role {
    /// The role of an input named `name`, if it has one.
    pub fn of(name: &str) -> Option<Role> {
        match name {
            "tokens" => Some(Role::Tokens),
            "targets" | "labels" => Some(Role::Targets),
            "segments" | "token_type_ids" => Some(Role::Segments),
            _ => None,
        }
    }
}

/// What the targets of a training step are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Objective {
    /// Next-token prediction: the targets are the tokens shifted by one.
    #[default]
    Causal,
    /// Masked language modelling: the targets are labels read from their own file, not shifted, with
    /// ignored positions.
    Mlm,
}

/// Where every input of each step comes from.
#[derive(Clone, Debug)]
pub struct Sources {
    /// The token file, or `None` to draw every input from `seed`.
    pub tokens: Option<TokenData>,
    /// The token-type file (`--segments`), aligned with the tokens.
    pub segments: Option<TokenData>,
    /// The MLM label file (`--labels`), aligned with the tokens.
    pub labels: Option<TokenData>,
    pub objective: Objective,
    pub seed: u64,
    /// The order the token file's windows are read in (the aligned files follow it).
    pub order: Order,
}

/// Why the data flags cannot feed a model, or a batch cannot be read; a message about the flags
/// names the flag to add or drop. `flag` is the flags' prefix (`""` for training, `"val-"` for
/// validation).
#[derive(Debug)]
pub enum SourceError {
    /// `--labels` given for the causal objective, whose targets come from the token file.
    LabelsWithCausal { flag: String },
    /// `--segments` or `--labels` (`name`) without the token file they are aligned with.
    AlignedWithoutData { flag: String, name: &'static str },
    /// `--objective mlm` without its label file.
    MlmWithoutLabels { flag: String },
    /// An aligned file (given by `file_flag`) whose length differs from the token file's.
    Misaligned { file_flag: String, file: String, len: u64, data_flag: String, data: String, data_len: u64 },
    /// The token data or the model's `tokens` and `targets` inputs.
    Data(DataError),
    /// An input fed from data as `role` that is not an integer [batch, seq] tensor; `inputs` lists the
    /// model's.
    InputShape { input: String, role: Role, model: String, inputs: String },
    /// An input holding token types while only a token file is given.
    NoSegments { input: String, flag: String },
    /// `--segments` for a model without a token-type input; `inputs` lists the model's.
    UnusedSegments { flag: String, model: String, inputs: String },
    /// An input whose name gives it no role.
    NoRole { input: String, model: String },
    /// The model has no positive integer `vocab` config value.
    NoVocab,
    /// A label at token index `offset` that is neither a token id nor the ignore id.
    Label { path: String, label: u32, offset: u64, vocab: u64, ignore: u32 },
    /// A token type at token index `offset` beyond i32, or (`types`: the model's `types` config value)
    /// not below the model's number of types.
    Segment { path: String, value: u32, offset: u64, types: Option<u64> },
    /// Nothing in the batch feeds this input.
    Unfed { input: String },
}

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceError::LabelsWithCausal { flag } => write!(
                f,
                "--{flag}labels are the targets of --objective mlm; the causal objective predicts the next token of \
                 --{flag}data"
            ),
            SourceError::AlignedWithoutData { flag, name } => {
                write!(f, "--{flag}{name} is aligned with a token file: give --{flag}data FILE as well")
            }
            SourceError::MlmWithoutLabels { flag } => write!(
                f,
                "--objective mlm reads its targets from a label file: give --{flag}labels FILE \
                 (`optimusc mask-data` writes one)"
            ),
            SourceError::Misaligned { file_flag, file, len, data_flag, data, data_len } => write!(
                f,
                "{file_flag} `{file}` holds {len} tokens but {data_flag} `{data}` holds {data_len}: the files are \
                 read position by position, so they must be the same length"
            ),
            SourceError::Data(e) => write!(f, "{e}"),
            SourceError::InputShape { input, role, model, inputs } => write!(
                f,
                "input `{input}` is fed from data as the {}, so it must be an integer [batch, seq] tensor like \
                 `tokens`; model `{model}` has inputs {inputs}",
                role_name(*role)
            ),
            SourceError::NoSegments { input, flag } => write!(
                f,
                "input `{input}` holds token types, and nothing feeds it: give --{flag}segments FILE \
                 (token type ids aligned with --{flag}data, same dtype)"
            ),
            SourceError::UnusedSegments { flag, model, inputs } => write!(
                f,
                "--{flag}segments feeds an input named `segments` or `token_type_ids`, and model `{model}` has none \
                 (its inputs are {inputs})"
            ),
            SourceError::NoRole { input, model } => write!(
                f,
                "input `{input}` of model `{model}` has no data source: optimusc feeds inputs by name, `tokens` \
                 (--data), `targets` or `labels` (the next token, or --labels with --objective mlm), `segments` or \
                 `token_type_ids` (--segments); rename it to one of these"
            ),
            SourceError::NoVocab => {
                f.write_str("the model has no positive integer config value `vocab`, which token data needs")
            }
            SourceError::Label { path, label, offset, vocab, ignore } => write!(
                f,
                "label file `{path}`: label {label} at offset {offset} (token index) is neither below the \
                 vocabulary size {vocab} nor the ignore id {ignore}"
            ),
            SourceError::Segment { path, value, offset, types: Some(types) } => write!(
                f,
                "segment file `{path}`: token type {value} at offset {offset} (token index) is not below the \
                 model's `types` ({types})"
            ),
            SourceError::Segment { path, value, offset, types: None } => {
                write!(f, "segment file `{path}`: token type {value} at offset {offset} (token index) does not fit i32")
            }
            SourceError::Unfed { input } => write!(f, "no data for input `{input}`"),
        }
    }
}

impl std::error::Error for SourceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SourceError::Data(e) => Some(e),
            _ => None,
        }
    }
}

impl From<DataError> for SourceError {
    fn from(e: DataError) -> SourceError {
        SourceError::Data(e)
    }
}

impl Sources {
    /// Checks the files against each other and the objective: segments and labels come with a token
    /// file, hold as many tokens as it does and have its dtype; labels are given exactly with `mlm`.
    /// `flag` prefixes the flag names (`""` for training, `"val-"` for validation).
    pub fn new(
        tokens: Option<TokenData>,
        segments: Option<TokenData>,
        labels: Option<TokenData>,
        objective: Objective,
        seed: u64,
        flag: &str,
    ) -> Result<Sources, SourceError> {
        if objective == Objective::Causal && labels.is_some() {
            return Err(SourceError::LabelsWithCausal { flag: flag.to_string() });
        }
        match &tokens {
            None => {
                for (given, name) in [(segments.is_some(), "segments"), (labels.is_some(), "labels")] {
                    if given {
                        return Err(SourceError::AlignedWithoutData { flag: flag.to_string(), name });
                    }
                }
            }
            Some(data) => {
                if objective == Objective::Mlm && labels.is_none() {
                    return Err(SourceError::MlmWithoutLabels { flag: flag.to_string() });
                }
                for (file, name) in [(&segments, "segments"), (&labels, "labels")] {
                    if let Some(file) = file {
                        check_aligned(data, file, &format!("--{flag}{name}"), &format!("--{flag}data"))?;
                    }
                }
            }
        }
        Ok(Sources { tokens, segments, labels, objective, seed, order: Order::Sequential })
    }

    /// Whether the tokens are drawn from the seed (no `--data`): random tokens, for checking a plan and
    /// measuring speed, not for training a model.
    pub fn drawn_from_seed(&self) -> bool {
        self.tokens.is_none()
    }

    /// Checks that every input of `plan` has a role and a source, and that they are integer tensors of
    /// the same [batch, seq] shape; returns (batch, seq).
    pub fn check(&self, plan: &Plan, flag: &str) -> Result<(u64, u64), SourceError> {
        let (batch, seq) = super::data::check_inputs(plan)?;
        for input in &plan.inputs {
            let role = Role::of(&input.name).ok_or_else(|| no_role(plan, input))?;
            let integer = dtype_of(plan, input).is_some_and(optimus_plan::types::DType::is_integer);
            if !integer || input.shape != [batch, seq] {
                return Err(SourceError::InputShape {
                    input: input.name.clone(),
                    role,
                    model: plan.model.clone(),
                    inputs: input_list(plan),
                });
            }
            if role == Role::Segments && self.tokens.is_some() && self.segments.is_none() {
                return Err(SourceError::NoSegments { input: input.name.clone(), flag: flag.to_string() });
            }
        }
        if self.segments.is_some() && !plan.inputs.iter().any(|i| Role::of(&i.name) == Some(Role::Segments)) {
            return Err(SourceError::UnusedSegments {
                flag: flag.to_string(),
                model: plan.model.clone(),
                inputs: input_list(plan),
            });
        }
        Ok((batch, seq))
    }

    /// The logical inputs of batch `step` (see the module's docs for the windows).
    /// The pass over the token file (0 for the first) that batch `step` starts in; `None` without a
    /// token file or with a plan that takes no tokens.
    pub fn epoch(&self, plan: &Plan, step: u64) -> Option<u64> {
        let (batch, seq) = self.check(plan, "").ok()?;
        Some(self.tokens.as_ref()?.epoch(self.order, step, batch, seq))
    }

    /// What an epoch is for this run's token file, for a note: its name, and how it is read.
    pub fn epoch_text(&self, plan: &Plan, epoch: u64) -> Option<String> {
        let (_, seq) = self.check(plan, "").ok()?;
        let data = self.tokens.as_ref()?;
        let windows = data.windows(seq);
        Some(match self.order {
            Order::Shuffled { .. } if windows > 0 => format!(
                "`{}` ({windows} windows of {} tokens, in the order drawn for epoch {})",
                data.path(),
                seq + 1,
                epoch + 1
            ),
            _ => format!(
                "`{}` ({} tokens): the reading wrapped past its end and goes on from its start{}",
                data.path(),
                data.len(),
                if windows > 0 { "; --shuffle reads every window once per epoch in a new order" } else { "" }
            ),
        })
    }

    pub fn batch(&self, plan: &Plan, step: u64) -> Result<BTreeMap<String, Tensor>, SourceError> {
        let (batch, seq) = self.check(plan, "")?;
        let vocab = vocab(plan)?;
        check_vocab(vocab)?;
        let mut by_role: BTreeMap<&str, Tensor> = BTreeMap::new();
        match &self.tokens {
            Some(data) => {
                let shifted = data.batch(self.order, step, (batch, seq), vocab)?;
                for (name, tensor) in shifted {
                    by_role.insert(if name == "tokens" { "tokens" } else { "next" }, tensor);
                }
                if let Some(labels) = &self.labels {
                    let values = aligned(labels, self.order, step, (batch, seq), |t, at| label(labels, t, at, vocab))?;
                    by_role.insert("labels", Tensor::from_i32(&[batch, seq], values));
                }
                if let Some(segments) = &self.segments {
                    let types = token_types(plan);
                    let values =
                        aligned(segments, self.order, step, (batch, seq), |t, at| segment(segments, t, at, types))?;
                    by_role.insert("segments", Tensor::from_i32(&[batch, seq], values));
                }
            }
            None => {
                for (name, tensor) in random_batch(self.seed, step, batch, seq, vocab) {
                    by_role.insert(if name == "tokens" { "tokens" } else { "next" }, tensor);
                }
                let labels = random_labels(self.seed, step, batch, seq, vocab);
                by_role.insert("labels", Tensor::from_i32(&[batch, seq], labels));
                let two_sentences = token_types(plan).is_some_and(|t| t >= 2);
                by_role.insert("segments", drawn_segments(batch, seq, two_sentences));
            }
        }
        let mut inputs = BTreeMap::new();
        for input in &plan.inputs {
            let key = match (Role::of(&input.name), self.objective) {
                (Some(Role::Tokens), _) => "tokens",
                (Some(Role::Targets), Objective::Causal) => "next",
                (Some(Role::Targets), Objective::Mlm) => "labels",
                (Some(Role::Segments), _) => "segments",
                (None, _) => return Err(no_role(plan, input)),
            };
            let tensor = by_role.get(key).ok_or_else(|| SourceError::Unfed { input: input.name.clone() })?;
            inputs.insert(input.name.clone(), tensor.clone());
        }
        Ok(inputs)
    }
}

/// The model's vocabulary size, from its `vocab` config value.
pub fn vocab(plan: &Plan) -> Result<u64, SourceError> {
    plan.positive_config("vocab").ok_or(SourceError::NoVocab)
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Tokens => "token ids",
        Role::Targets => "targets",
        Role::Segments => "token types",
    }
}

fn no_role(plan: &Plan, input: &PlanInput) -> SourceError {
    SourceError::NoRole { input: input.name.clone(), model: plan.model.clone() }
}

/// A file aligned with the token file holds as many tokens, of the same dtype.
fn check_aligned(data: &TokenData, file: &TokenData, flag: &str, data_flag: &str) -> Result<(), SourceError> {
    if file.len() != data.len() {
        return Err(SourceError::Misaligned {
            file_flag: flag.to_string(),
            file: file.path().to_string(),
            len: file.len(),
            data_flag: data_flag.to_string(),
            data: data.path().to_string(),
            data_len: data.len(),
        });
    }
    Ok(())
}

/// The `seq` values of each row r of batch `step`, from offset (step * batch + r) * seq (wrapping), each
/// converted by `convert(value, index)`.
fn aligned(
    file: &TokenData,
    order: Order,
    step: u64,
    (batch, seq): (u64, u64),
    convert: impl Fn(u32, u64) -> Result<i32, SourceError>,
) -> Result<Vec<i32>, SourceError> {
    let mut values = Vec::with_capacity(batch.saturating_mul(seq).min(1 << 24) as usize);
    for r in 0..batch {
        let start = file.window_start(order, step, batch, r, seq);
        for t in 0..seq {
            let index = (start + t) % file.len();
            values.push(convert(file.token(index), index)?);
        }
    }
    Ok(values)
}

/// A label: the file's ignore id becomes [`IGNORE_INDEX`]; anything else must be a token id.
fn label(file: &TokenData, value: u32, index: u64, vocab: u64) -> Result<i32, SourceError> {
    let ignore = file.dtype().ignore_id();
    if value == ignore {
        return Ok(IGNORE_INDEX);
    }
    if u64::from(value) >= vocab {
        return Err(SourceError::Label { path: file.path().to_string(), label: value, offset: index, vocab, ignore });
    }
    Ok(value as i32)
}

/// A token type id, as an i32 (the embedding it indexes checks its range).
fn segment(file: &TokenData, value: u32, index: u64, types: Option<u64>) -> Result<i32, SourceError> {
    let error = |types| SourceError::Segment { path: file.path().to_string(), value, offset: index, types };
    if types.is_some_and(|t| u64::from(value) >= t) {
        return Err(error(types));
    }
    i32::try_from(value).map_err(|_| error(None))
}

/// The model's number of token types, from its `types` config value (BERT's), where it has one.
fn token_types(plan: &Plan) -> Option<u64> {
    plan.positive_config("types")
}

/// Labels drawn from the seed (for runs and `verify` without files): each position is ignored with
/// probability 1/2, and otherwise has a random token id, a hash of (seed, step, r, t).
pub fn random_labels(seed: u64, step: u64, batch: u64, seq: u64, vocab: u64) -> Vec<i32> {
    let base = mix64(mix64(seed ^ 0x6d6c_6d5f_6c61_6265) ^ step);
    (0..batch)
        .flat_map(|r| {
            let row = mix64(base ^ r);
            (0..seq).map(move |t| {
                let draw = mix64(row ^ mix64(t));
                if draw & 1 == 0 { IGNORE_INDEX } else { ((draw >> 1) % vocab.max(1)) as i32 }
            })
        })
        .collect()
}

/// Token types without a file: sentence A (0) on the first half of each row and sentence B (1) on the
/// rest when the model's `types` config value allows two, else zeros.
fn drawn_segments(batch: u64, seq: u64, two_sentences: bool) -> Tensor {
    let row = (0..seq).map(|t| i32::from(two_sentences && 2 * t >= seq));
    let values: Vec<i32> = (0..batch).flat_map(|_| row.clone()).collect();
    Tensor::from_i32(&[batch, seq], values)
}
