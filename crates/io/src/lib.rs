//! Files a run reads and writes: safetensors checkpoints of a plan's parameters, and token data.
//!
//! [`checkpoint`] maps a plan's parameters to checkpoint tensors by their `checkpoint` names (with or
//! without the model's `checkpoint_prefix`), so Hugging Face GPT-2 files load unchanged.
//! [`data`] cuts nanoGPT-style token files (flat little-endian u16 or u32 ids) into `tokens` /
//! `targets` batches, or draws random ones from a seed.
//! [`sources`] feeds every model input from data by its role (token ids, targets, token types, MLM labels).
//! [`mask`] writes BERT's masked inputs and labels from a token file (`optimusc mask-data`).
//! [`files`] opens user-named inputs: regular files only, small ones read with a size bound.
//! [`fingerprint`] identifies a data file (its canonical path, size and sampled contents) for `--resume`.
//! [`metrics`] appends the JSON-lines log of a run's records and reads it back as curves.
//! [`shards`] writes and reads sharded training checkpoints (one file per device and a manifest),
//! crash-safe, and readable onto any mesh.
//! [`mapped`] keeps Hugging Face files mapped, and each device reads only its blocks from them.
//! [`pretrained`] reads and writes Hugging Face's `save_pretrained` layout: shards and their index.
//! [`output`] is the one way any output file is written: atomically for files, in place for devices
//! and pipes, never leaving temporary files.
//!
//! Each module reports failures as its own error type, which says what failed (the file, the tensor, the
//! shape expected and found) and whose `Display` is the message a user reads: [`files::FileError`],
//! [`data::DataError`], [`sources::SourceError`], [`mask::MaskError`], [`metrics::MetricsError`],
//! [`plan_file::PlanFileError`], [`checkpoint::WeightsError`] and [`checkpoint::SaveError`],
//! [`pretrained::SaveError`], [`shards::CheckpointError`] and [`output::OutputError`]. The parameter-store
//! traits of `optimus_plan::stores` still carry strings: their implementations here render these errors.

pub mod checkpoint;
pub mod data;
pub mod files;
pub mod fingerprint;
pub mod hf_config;
pub mod mapped;
pub mod mask;
pub mod metrics;
pub mod output;
pub mod plan_file;
pub mod pretrained;
pub mod shards;
pub mod sources;
pub mod windows;

pub use checkpoint::{load_checkpoint, save_checkpoint};
pub use data::{Order, TokenData, TokenDtype, check_inputs, random_batch};
pub use output::{OutputError, check_writable, write_file};
