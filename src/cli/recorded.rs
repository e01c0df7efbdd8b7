//! The training flags a checkpoint records, so that `--resume` continues the same run without them: the
//! data files, the optimizer and its settings, the schedule, clipping, the seed, accumulation, the
//! `--set` values and the precision (and, as defaults only, --steps and the validation flags). A resumed run takes every
//! recorded flag its command line leaves out, and refuses one it gives with another value (exit 2,
//! naming both) unless `--allow-changes`.

use super::Failure;
use super::run::RunArgs;
use clap::parser::ValueSource;
use std::collections::BTreeMap;
use std::ffi::OsString;

/// Flags that define the training: a resumed run that gives another value is refused. These are its
/// data, seed, accumulation, config values and precision; [`TRAINING_ONLY`] are the others.
const DEFINING_DATA: [&str; 10] =
    ["data", "data_dtype", "shuffle", "segments", "labels", "objective", "seed", "accum", "set", "precision"];

/// The defining flags that only set up training (the optimizer, its schedule, clipping): a run of an
/// inference plan refuses them.
pub const TRAINING_ONLY: [&str; 11] = [
    "lr",
    "lr_schedule",
    "warmup_steps",
    "min_lr",
    "clip_grad_norm",
    "optimizer",
    "weight_decay",
    "momentum",
    "beta1",
    "beta2",
    "eps",
];

/// Whether `id` is a flag that defines the training.
fn is_defining(id: &str) -> bool {
    DEFINING_DATA.contains(&id) || TRAINING_ONLY.contains(&id)
}

/// The training-only flags `args`' command line gave, as spelled there (`--lr`).
pub fn training_only_given(args: &RunArgs) -> Vec<String> {
    TRAINING_ONLY.iter().filter(|id| args.given.contains_key(**id)).map(|id| flag(id)).collect()
}

/// Flags a resumed run takes from the checkpoint when it gives none, and may change freely.
const DEFAULTED: &[&str] = &["steps", "val_data", "val_segments", "val_labels", "eval_every", "eval_batches"];

/// The flags of each kind given on a command line, by argument id: their values as typed.
pub type GivenFlags = BTreeMap<String, Vec<String>>;

/// The recorded kinds of flags that `matches` (of `optimusc run`) has from the command line.
pub fn given_flags(matches: &clap::ArgMatches) -> GivenFlags {
    let mut given = GivenFlags::new();
    for &id in DEFINING_DATA.iter().chain(&TRAINING_ONLY).chain(DEFAULTED) {
        if matches.value_source(id) != Some(ValueSource::CommandLine) {
            continue;
        }
        let raw = matches.get_raw(id).map(|values| values.map(|v| v.to_string_lossy().into_owned()).collect());
        given.insert(id.to_string(), raw.unwrap_or_default());
    }
    given
}

/// `optimusc run`'s flags alone, for parsing a run's command line again.
#[derive(clap::Parser, Debug)]
#[command(no_binary_name = true)]
struct RunLine {
    #[command(flatten)]
    args: RunArgs,
}

fn flag(id: &str) -> String {
    format!("--{}", id.replace('_', "-"))
}

/// `--flag v` for each of the values.
fn flag_words(id: &str, values: &[String]) -> Vec<OsString> {
    values.iter().flat_map(|v| [OsString::from(flag(id)), OsString::from(v)]).collect()
}

/// What a flag's values parse to, as text, with the defaults the run resolves later resolved (the weight
/// decay of the optimizer the checkpoint was trained with, f32, a decay floor of 0): two spellings of
/// one value (`3e-3`, `0.003`), and a default given explicitly (`--weight-decay 0.01` under AdamW,
/// `--precision f32`), compare equal.
fn parsed(args: &RunArgs, id: &str, values: &[String], recorded: &GivenFlags) -> Option<String> {
    let mut words = vec![args.input.clone().into_os_string()];
    if let Some(optimizer) = recorded.get("optimizer").filter(|_| id != "optimizer") {
        words.extend(flag_words("optimizer", optimizer));
    }
    words.extend(flag_words(id, values));
    let mut run = <RunLine as clap::Parser>::try_parse_from(words).ok()?.args;
    run.optimizer.weight_decay = Some(run.optimizer.settings().weight_decay);
    run.target.precision = Some(run.target.precision.unwrap_or(super::PrecisionArg::F32));
    run.min_lr = Some(run.min_lr.unwrap_or(0.0));
    Some(format!("{run:?}"))
}

/// The words of this process's `run` command line (after the subcommand).
fn run_words() -> Vec<OsString> {
    let words: Vec<OsString> = std::env::args_os().skip(1).collect();
    let start = words.iter().position(|w| w == "run").map_or(0, |k| k + 1);
    words[start..].to_vec()
}

/// For a run with `--resume`: the run with every flag the checkpoint recorded that this command line
/// does not give, after refusing a given defining flag whose value differs from the recorded one
/// (unless `--allow-changes`). Without `--resume`, or for a checkpoint that recorded no flags (or
/// cannot be opened: `--resume` reports that), the run as it is.
pub fn with_recorded_flags(args: &RunArgs) -> Result<RunArgs, Failure> {
    let Some(path) = &args.checkpoint.resume else { return Ok(args.clone()) };
    let Ok(checkpoint) = optimus::io::shards::Checkpoint::open(path) else { return Ok(args.clone()) };
    // A checkpoint of another model differs in everything: say that first, before its flags are
    // compared or taken.
    let trained_model = &checkpoint.manifest().model;
    if let Some(model) = model_name(&args.input).filter(|model| model != trained_model) {
        return Err(super::resume::another_model(&checkpoint, &model));
    }
    let recorded: GivenFlags = serde_json::from_value(checkpoint.training()["flags"].clone()).unwrap_or_default();
    let trained = Trained { config: &checkpoint.training()["config"], files: &checkpoint.training()["files"] };
    let (fixed, changes): (Vec<_>, Vec<_>) =
        changed_flags(args, &recorded, trained).into_iter().partition(|(id, _)| FIXED.contains(&id.as_str()));
    if !fixed.is_empty() {
        let fixed: Vec<String> = fixed.into_iter().map(|(_, change)| change).collect();
        return Err(Failure::usage(format!(
            "--resume: `{}` was trained with other settings: {}; the seed, --accum and --optimizer give its state \
             its meaning and must be those it was trained with (drop the flags; --allow-changes does not change them)",
            checkpoint.dir().display(),
            fixed.join(", ")
        )));
    }
    let changes: Vec<String> = changes.into_iter().map(|(_, change)| change).collect();
    if !changes.is_empty() && !args.checkpoint.allow_changes {
        return Err(Failure::usage(format!(
            "--resume: `{}` was trained with other settings: {}; drop the flags to continue as it was trained, \
             or add --allow-changes to change them on purpose",
            checkpoint.dir().display(),
            changes.join(", ")
        )));
    }
    let recorded_sets = recorded.get("set").map(|sets| sets_not_given(args, sets)).unwrap_or_default();
    let mut missing: Vec<(&String, &Vec<String>)> = recorded
        .iter()
        .filter(|(id, _)| is_defining(id) || DEFAULTED.contains(&id.as_str()))
        .filter(|(id, _)| !args.given.contains_key(*id))
        .collect();
    // A --set given anew keeps the checkpoint's values of the other names.
    let set_id = "set".to_string();
    if args.given.contains_key("set") && !recorded_sets.is_empty() {
        missing.push((&set_id, &recorded_sets));
    }
    if missing.is_empty() {
        return Ok(args.clone());
    }
    // A data file the checkpoint trained on is read where it was then, whatever the working directory.
    let missing: Vec<(&String, Vec<String>)> = missing
        .into_iter()
        .map(|(id, values)| match trained_file(trained.files, id) {
            Some(file) => (id, vec![file.path.display().to_string()]),
            None => (id, values.clone()),
        })
        .collect();
    let mut words = run_words();
    for (id, values) in &missing {
        words.extend(flag_words(id, values));
    }
    let line = <RunLine as clap::Parser>::try_parse_from(words)
        .map_err(|e| Failure::usage(format!("--resume: the flags the checkpoint recorded do not parse: {e}")))?;
    let mut resumed = line.args;
    resumed.given = args.given.clone();
    for (id, values) in &missing {
        resumed.given.entry((*id).clone()).or_default().extend(values.iter().cloned());
    }
    let taken: Vec<String> = missing.iter().map(|(id, values)| format!("{} {}", flag(id), values.join(" "))).collect();
    if optimus::runtime::launch::detect().is_none_or(|launch| launch.rank == 0) {
        eprintln_safe!("note: --resume: continuing with the checkpoint's {}", taken.join(", "));
    }
    Ok(resumed)
}

/// What a checkpoint records of the model and data it was trained with.
#[derive(Clone, Copy)]
struct Trained<'c> {
    /// The config values, by name.
    config: &'c serde_json::Value,
    /// The data files' fingerprints, by flag id (`data`, `segments`, `labels`); null in checkpoints
    /// written before they were recorded.
    files: &'c serde_json::Value,
}

/// The flags that name a data file the training reads.
pub const DATA_FILE_FLAGS: [&str; 3] = ["data", "segments", "labels"];

/// The fingerprint a checkpoint recorded of the data file of flag `id`, if it recorded one.
fn trained_file(files: &serde_json::Value, id: &str) -> Option<optimus::io::fingerprint::Fingerprint> {
    DATA_FILE_FLAGS.contains(&id).then(|| serde_json::from_value(files[id].clone()).ok()).flatten()
}

/// Whether the data file given for flag `id` is the one the checkpoint trained on, by its contents
/// (so `./data.u16`, an absolute path and a copy elsewhere are all that file); `None` where the
/// checkpoint recorded no fingerprint of it or the file given cannot be read (it is then compared as
/// text, and reading it fails later with its own error).
fn same_data_file(files: &serde_json::Value, id: &str, given: &[String]) -> Option<bool> {
    let trained = trained_file(files, id)?;
    let path = given.last()?;
    let mine = optimus::io::fingerprint::fingerprint(std::path::Path::new(path), "data").ok()?;
    Some(mine.same_contents(&trained))
}

/// The name of the model at `input` (a model file's `model NAME`, or a plan's), where it can be read;
/// whatever cannot be is reported when the run compiles or reads it.
fn model_name(input: &std::path::Path) -> Option<String> {
    if super::names_a_plan(input) {
        return optimus::io::plan_file::read_plan(input).ok().map(|plan| plan.model);
    }
    let bytes = optimus::io::files::read_bounded(input, "model", optimus::io::files::MODEL_SOURCE_LIMIT).ok()?;
    let text = String::from_utf8(bytes).ok()?;
    let (file, _) = optimus::syntax::parser::parse(&text).ok()?;
    Some(file.model?.name.name)
}

/// Defining flags that not even `--allow-changes` changes: the checkpoint's state means nothing without them.
const FIXED: [&str; 3] = ["seed", "accum", "optimizer"];

/// The name of a `--set NAME=VALUE`.
fn set_name(set: &str) -> &str {
    set.split_once('=').map_or(set, |(name, _)| name).trim()
}

/// The value of a `--set NAME=VALUE`.
fn set_value(set: &str) -> &str {
    set.split_once('=').map_or("", |(_, value)| value).trim()
}

/// A `--set` value as the JSON value a checkpoint records for it (a number read as one, else text), so
/// that two spellings of one value (`8`, `8.0`; `1e-5`, `0.00001`) compare equal.
fn set_json(value: &str) -> serde_json::Value {
    serde_json::from_str(value).unwrap_or_else(|_| serde_json::Value::String(value.to_string()))
}

/// The recorded `--set`s whose names this command line does not set.
fn sets_not_given(args: &RunArgs, recorded: &[String]) -> Vec<String> {
    let given: Vec<&str> =
        args.given.get("set").map(|sets| sets.iter().map(|s| set_name(s)).collect()).unwrap_or_default();
    recorded.iter().filter(|set| !given.contains(&set_name(set))).cloned().collect()
}

/// The `--set`s given that change a config value the checkpoint was trained with: one it set otherwise,
/// or one it left to the model file (its recorded config says which value that was, where it has one).
fn changed_sets(given: &[String], recorded: &[String], trained_config: &serde_json::Value) -> Vec<String> {
    let mut changes = Vec::new();
    // The last `--set` of a name is the one that counts, as in compiling.
    let last: Vec<&String> = given
        .iter()
        .enumerate()
        .filter(|(i, set)| !given[i + 1..].iter().any(|later| set_name(later) == set_name(set)))
        .map(|(_, set)| set)
        .collect();
    for set in last {
        let (name, value) = (set_name(set), set_value(set));
        if trained_config.is_object() && trained_config[name].is_null() {
            // Not a config value of the model: compiling says so, with the names it has.
            continue;
        }
        let theirs = recorded.iter().rev().find(|r| set_name(r) == name);
        let trained = Some(&trained_config[name]).filter(|v| !v.is_null());
        let same = |other: &serde_json::Value| super::weights_config::same_number(&set_json(value), other);
        let (unchanged, had) = match (theirs, trained) {
            (Some(theirs), _) => (same(&set_json(set_value(theirs))), theirs.clone()),
            (None, Some(trained)) => (same(trained), format!("{name}={trained}")),
            (None, None) => (false, format!("{name} as the model file sets it")),
        };
        if !unchanged {
            changes.push(format!("--set {name}={value} (the checkpoint has {had})"));
        }
    }
    changes
}

/// The defining flags given on this command line with another value than the checkpoint recorded,
/// each with its flag's id.
fn changed_flags(args: &RunArgs, recorded: &GivenFlags, trained: Trained) -> Vec<(String, String)> {
    let mut changes = Vec::new();
    if let Some(given) = args.given.get("set").filter(|_| !recorded.is_empty() || !trained.config.is_null()) {
        let sets = changed_sets(given, recorded.get("set").map_or(&[][..], Vec::as_slice), trained.config);
        changes.extend(sets.into_iter().map(|change| ("set".to_string(), change)));
    }
    for (id, theirs) in recorded.iter().filter(|(id, _)| is_defining(id) && id.as_str() != "set") {
        let Some(mine) = args.given.get(id) else { continue };
        match same_data_file(trained.files, id, mine) {
            Some(true) => continue,
            Some(false) => {
                let file = trained_file(trained.files, id).map(|f| f.path.display().to_string());
                changes.push((
                    id.clone(),
                    format!(
                        "{} {} (another file than the checkpoint's `{}`)",
                        flag(id),
                        mine.join(" "),
                        file.unwrap_or_else(|| theirs.join(" "))
                    ),
                ));
                continue;
            }
            None => {}
        }
        if parsed(args, id, mine, recorded) != parsed(args, id, theirs, recorded) {
            changes.push((
                id.clone(),
                format!("{} {} (the checkpoint has {})", flag(id), mine.join(" "), theirs.join(" ")),
            ));
        }
    }
    if recorded.is_empty() {
        return changes;
    }
    for (id, mine) in args.given.iter().filter(|(id, _)| is_defining(id) && id.as_str() != "set") {
        if !recorded.contains_key(id) && parsed(args, id, mine, recorded) != parsed(args, id, &[], recorded) {
            changes.push((id.clone(), format!("{} {} (the checkpoint has the default)", flag(id), mine.join(" "))));
        }
    }
    changes
}
