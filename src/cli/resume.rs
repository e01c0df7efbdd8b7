//! The checkpoint flags of `optimusc run`: periodic sharded checkpoints, resuming from the latest one
//! (on any mesh), and what an interrupted run says about resuming.

use super::Failure;
use super::run::RunArgs;
use optimus::io::shards::{Checkpoint, CheckpointFolder, lock_checkpoint_dir};
use optimus::plan::{Mode, Plan};
use optimus::runtime::exec::Checkpointing;
use std::path::PathBuf;
use std::sync::Arc;

/// Checkpoint flags; all optional.
#[derive(clap::Args, Debug, Clone)]
pub struct CheckpointArgs {
    /// Write checkpoints into DIR/step-NNNNNNNN (one safetensors file per device plus a manifest; see
    /// docs/training.md): after every --checkpoint-every-th update, after the last one, and when the run
    /// is interrupted (Ctrl-C or SIGTERM finish the current step first). A checkpoint appears only once
    /// complete, so a run killed at any moment leaves the previous one intact.
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint after every C-th update (at least 1; default: only after the last update).
    #[arg(long, value_name = "C", value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_every: Option<u64>,
    /// Keep only the newest K checkpoints in --checkpoint-dir (at least 1; default: keep all).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    pub keep: Option<u64>,
    /// Continue from a checkpoint: a checkpoint directory, or a --checkpoint-dir (its latest complete
    /// checkpoint). Parameters, optimizer state, the step (hence the schedule and the data position) come
    /// from it; the model may run on another mesh or strategy. --steps stays the total: a run resumed
    /// after update 3 runs steps 3 .. --steps - 1. --seed, --accum, --optimizer and the batch must be those
    /// of the run that wrote it. Without --checkpoint-dir, checkpoints go on into the folder of the
    /// checkpoint resumed; a folder holding checkpoints of later updates is refused.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// With --resume: let flags given on the command line differ from those the checkpoint recorded (the
    /// data files, the optimizer's settings, the schedule, clipping, --set values, --precision). Without it, a
    /// resumed run takes every recorded flag it does not give (each --set name it does not set) and refuses
    /// one it gives with another value. The seed, --accum, --optimizer and the batch shape must match always.
    #[arg(long, requires = "resume")]
    pub allow_changes: bool,
}

/// What the checkpoint flags ask of a run.
pub struct Resumption {
    pub checkpoints: Option<Checkpointing>,
    pub resume: Option<Arc<Checkpoint>>,
    pub start_step: u64,
}

/// Checks the checkpoint flags against the plan and the other flags, and opens the checkpoint to
/// resume from.
pub fn resumption(args: &RunArgs, plan: &Plan) -> Result<Resumption, Failure> {
    let flags = &args.checkpoint;
    if flags.checkpoint_dir.is_none()
        && flags.resume.is_none()
        && (flags.checkpoint_every.is_some() || flags.keep.is_some())
    {
        return Err(Failure::usage("--checkpoint-every and --keep need --checkpoint-dir DIR (or --resume)".into()));
    }
    if plan.mode != Mode::Train && (flags.checkpoint_dir.is_some() || flags.resume.is_some()) {
        return Err(Failure::usage(
            "checkpoints hold training state; this plan infers (compile it with --mode train)".into(),
        ));
    }
    if flags.resume.is_some() && args.weights.is_some() {
        return Err(Failure::usage(
            "--resume loads the weights of its checkpoint; give either --resume or --weights, not both".into(),
        ));
    }
    let training = training_record(args, plan);
    let resume = match &flags.resume {
        Some(path) => Some(Arc::new(open_to_resume(path, args, &training)?)),
        None => None,
    };
    let start_step = resume.as_ref().map_or(0, |c| c.step());
    let mut folder = checkpoint_folder(flags, resume.as_deref());
    if let Some(Err(why)) = folder.as_deref().map(check_checkpoint_dir) {
        if flags.checkpoint_dir.is_some() {
            return Err(why);
        }
        // The folder of the resumed checkpoint, implied: a read-only one means no checkpoints, not an error.
        eprintln_safe!("warning: no checkpoints will be written: {}; give --checkpoint-dir DIR", why.message);
        folder = None;
    }
    let mut lock = None;
    if let Some(dir) = &folder {
        check_no_later_checkpoints(dir, start_step)?;
        // Under mpirun rank 0 commits every checkpoint, and holds the folder for the run.
        if optimus::runtime::launch::detect().is_none_or(|launch| launch.rank == 0) {
            lock = Some(lock_checkpoint_dir(dir).map_err(|e| Failure::usage(format!("--checkpoint-dir: {e}")))?);
        }
    }
    let checkpoints = folder.map(|dir| Checkpointing {
        every: flags.checkpoint_every,
        sink: Arc::new(CheckpointFolder { dir, keep: flags.keep, training: training.clone(), lock }),
    });
    Ok(Resumption { checkpoints, resume, start_step })
}

/// Where the run writes checkpoints: --checkpoint-dir, or, for a run that resumes without it, the
/// folder of the checkpoint it resumes (so that the resumed run's updates are kept too).
fn checkpoint_folder(flags: &CheckpointArgs, resume: Option<&Checkpoint>) -> Option<PathBuf> {
    if let Some(dir) = &flags.checkpoint_dir {
        return Some(dir.clone());
    }
    let folder = resume?.dir().parent()?;
    Some(if folder.as_os_str().is_empty() { PathBuf::from(".") } else { folder.to_path_buf() })
}

/// A run that starts after update `start_step` must not write into a folder holding checkpoints of
/// later updates: its own would mix with them, and `--resume DIR` would then continue the other run.
fn check_no_later_checkpoints(dir: &std::path::Path, start_step: u64) -> Result<(), Failure> {
    let later: Vec<u64> = optimus::io::shards::complete_checkpoints(dir)
        .into_iter()
        .map(|(step, _)| step)
        .filter(|&step| step > start_step)
        .collect();
    let Some(&last) = later.last() else { return Ok(()) };
    let from = if start_step == 0 { "from the start".to_string() } else { format!("from update {start_step}") };
    Err(Failure::usage(format!(
        "checkpoint folder `{}` holds {} checkpoint(s) of later updates (up to update {last}) than this run, which \
         starts {from}, would write: give it another --checkpoint-dir{}",
        dir.display(),
        later.len(),
        resume_advice(dir)
    )))
}

/// The rest of the advice for a folder of later checkpoints: resume from the latest, from the one before
/// it when the latest cannot be read, or, when none can be, why.
fn resume_advice(dir: &std::path::Path) -> String {
    use optimus::io::shards::CheckpointError;
    match Checkpoint::open(dir) {
        Ok(_) => format!(", resume from the latest (`--resume {}`), or remove them", dir.display()),
        Err(CheckpointError::LatestUnreadable { earlier: Some(earlier), source, .. }) => format!(
            ", resume from an earlier one (`--resume {}`: the latest cannot be read, {source}), or remove them",
            earlier.display()
        ),
        Err(e) => format!(" or remove them (the latest cannot be resumed: {e})"),
    }
}

/// Whether checkpoints could be written under `dir`, told before step 0 rather than at the first
/// checkpoint: it must be a directory that takes new files, or, when it does not exist yet, its nearest
/// existing ancestor must be. Nothing is created or left behind here (the run then creates DIR and
/// locks it).
fn check_checkpoint_dir(dir: &std::path::Path) -> Result<(), Failure> {
    let refuse = |why: String| Failure::usage(format!("--checkpoint-dir `{}` {why}", dir.display()));
    if dir.exists() && !dir.is_dir() {
        return Err(refuse("exists and is not a directory".into()));
    }
    if let Some((path, what)) = optimus::io::shards::foreign_step_entry(dir) {
        return Err(refuse(format!(
            "holds {what} named as a checkpoint, `{}`: a checkpoint of that step would not replace it; move it away",
            path.display()
        )));
    }
    let existing = dir.ancestors().find(|a| a.as_os_str().is_empty() || a.exists()).unwrap_or(dir);
    let existing = if existing.as_os_str().is_empty() { std::path::Path::new(".") } else { existing };
    if !existing.is_dir() {
        return Err(refuse(format!("cannot be created: `{}` is not a directory", existing.display())));
    }
    // Our own probe file (not tempfile's, whose errors name the probe rather than the folder).
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let probe = existing.join(format!(".optimus-checkpoint-probe-{}-{nanos}", std::process::id()));
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(file) => {
            drop(file);
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => {
            let what = if existing == dir { "cannot take new files" } else { "cannot be created" };
            Err(refuse(format!("{what}: no new file can be made in `{}` ({e})", existing.display())))
        }
    }
}

/// What a checkpoint records about the run that wrote it (the runtime adds the step and the data
/// position); the fields under `must_match` must be the same in a run that resumes from it.
fn training_record(args: &RunArgs, plan: &Plan) -> serde_json::Value {
    let batch = optimus::io::check_inputs(plan).ok();
    // The config values the weights were trained with: --weights, generate --resume and --resume's
    // `--set` check compare them.
    let config: serde_json::Map<String, serde_json::Value> =
        plan.config.iter().map(|(name, value)| (name.clone(), serde_json::json!(value))).collect();
    serde_json::json!({
        "model": plan.model,
        "source": plan.source,
        "config": config,
        "mesh": plan.mesh.to_string(),
        "strategy": plan.strategy.name(),
        "steps": args.steps,
        "data": args.data.as_ref().map(|p| p.display().to_string()),
        "segments": args.inputs.segments.as_ref().map(|p| p.display().to_string()),
        "labels": args.inputs.labels.as_ref().map(|p| p.display().to_string()),
        "objective": format!("{:?}", args.inputs.objective).to_lowercase(),
        "lr": args.optimizer.lr,
        "lr_schedule": format!("{:?}", args.lr_schedule).to_lowercase(),
        "warmup_steps": args.warmup_steps,
        "min_lr": args.min_lr,
        "clip_grad_norm": args.clip_grad_norm,
        "files": data_fingerprints(args),
        "flags": args.given,
        "must_match": {
            "seed": args.seed,
            "accum": args.accum,
            "optimizer": format!("{:?}", args.optimizer.optimizer).to_lowercase(),
            "batch": batch.map(|b| b.0),
            "seq": batch.map(|b| b.1),
        },
    })
}

/// The fingerprints of the data files the run trains on, by flag id: a resumed run reads them where they
/// were and checks that they still hold what they held. A file that cannot be read is left out (reading
/// it fails the run with its own error).
fn data_fingerprints(args: &RunArgs) -> serde_json::Map<String, serde_json::Value> {
    data_files(args)
        .into_iter()
        .filter_map(|(id, path)| {
            let print = optimus::io::fingerprint::fingerprint(path?, "data").ok()?;
            Some((id.to_string(), serde_json::to_value(print).ok()?))
        })
        .collect()
}

/// The data file of each flag of [`super::recorded::DATA_FILE_FLAGS`], where the run has one.
fn data_files(args: &RunArgs) -> [(&'static str, Option<&std::path::Path>); 3] {
    [
        ("data", args.data.as_deref()),
        ("segments", args.inputs.segments.as_deref()),
        ("labels", args.inputs.labels.as_deref()),
    ]
}

/// The data files this run reads whose contents differ from those the checkpoint trained on (as
/// `--data PATH (...)`), from the fingerprints this run's `training` record already took; nothing for a
/// checkpoint that recorded none.
fn changed_data_files(args: &RunArgs, training: &serde_json::Value, checkpoint: &Checkpoint) -> Vec<String> {
    use optimus::io::fingerprint::Fingerprint;
    let print_of = |files: &serde_json::Value, id: &str| serde_json::from_value::<Fingerprint>(files[id].clone()).ok();
    let mut changed = Vec::new();
    for (id, path) in data_files(args) {
        let Some(trained) = print_of(&checkpoint.training()["files"], id) else { continue };
        let flag = format!("--{id}");
        match (path, print_of(&training["files"], id)) {
            // Unreadable (no fingerprint taken): reading it fails the run with its own error.
            (Some(_), None) => {}
            (_, Some(print)) if print.same_contents(&trained) => {}
            (_, Some(print)) if print.path == trained.path => changed.push(format!(
                "{flag} `{}` changed after the checkpoint trained on it ({} bytes then, {} now, other contents)",
                print.path.display(),
                trained.bytes,
                print.bytes
            )),
            (_, Some(print)) => changed.push(format!(
                "{flag} `{}` ({} bytes) holds other contents than `{}` ({} bytes), the file the checkpoint trained on",
                print.path.display(),
                print.bytes,
                trained.path.display(),
                trained.bytes
            )),
            (None, None) => changed.push(format!("no {flag} (the checkpoint trained on `{}`)", trained.path.display())),
        }
    }
    changed
}

/// Opens the checkpoint to resume from and checks that this run continues it: the same seed,
/// micro-batches, optimizer and batch shape, and steps left to run.
fn open_to_resume(path: &std::path::Path, args: &RunArgs, training: &serde_json::Value) -> Result<Checkpoint, Failure> {
    let checkpoint = Checkpoint::open(path).map_err(|e| Failure::from(format!("--resume: {e}")))?;
    let model = training["model"].as_str().unwrap_or_default();
    if model != checkpoint.manifest().model {
        return Err(another_model(&checkpoint, model));
    }
    let changed = changed_config(&training["config"], &checkpoint.training()["config"]);
    if !changed.is_empty() && !args.checkpoint.allow_changes {
        return Err(Failure::usage(format!(
            "--resume: `{}` was trained with other config values: {}; its weights and optimizer state belong to \
             the model as it was trained (the model file{} or the plan changed since): resume with that model, \
             or add --allow-changes to change it on purpose",
            checkpoint.dir().display(),
            changed.join(", "),
            checkpoint.training()["source"].as_str().map_or(String::new(), |source| format!(" `{source}`"))
        )));
    }
    let changed = changed_data_files(args, training, &checkpoint);
    if !changed.is_empty() && !args.checkpoint.allow_changes {
        return Err(Failure::usage(format!(
            "--resume: `{}` would continue on other data: {}; an uninterrupted run would read what it read: give \
             the files it trained on, or add --allow-changes to change them on purpose",
            checkpoint.dir().display(),
            changed.join("; ")
        )));
    }
    let theirs = &checkpoint.training()["must_match"];
    let mut differences = Vec::new();
    if let Some(fields) = training["must_match"].as_object() {
        for (name, mine) in fields {
            let recorded = &theirs[name];
            if !recorded.is_null() && recorded != mine {
                differences.push(format!("{name} {mine} (the checkpoint has {recorded})"));
            }
        }
    }
    if !differences.is_empty() {
        return Err(Failure::usage(format!(
            "--resume: `{}` was written by a run with other settings: {}; resume with the settings it was trained with",
            checkpoint.dir().display(),
            differences.join(", ")
        )));
    }
    if checkpoint.step() >= args.steps {
        return Err(Failure::usage(format!(
            "--resume: `{}` is after update {}, and --steps {} asks for no more (--steps counts from the start of training)",
            checkpoint.dir().display(),
            checkpoint.step(),
            args.steps
        )));
    }
    Ok(checkpoint)
}

/// The config values in which this run's model (`mine`, as [`training_record`] records it) differs from
/// the one the checkpoint was trained with (`theirs`), as `NAME VALUE (the checkpoint has VALUE)`; a name
/// only one of them has counts too. Nothing for a checkpoint that recorded no config.
fn changed_config(mine: &serde_json::Value, theirs: &serde_json::Value) -> Vec<String> {
    let (Some(mine), Some(theirs)) = (mine.as_object(), theirs.as_object()) else { return Vec::new() };
    let mut changed = Vec::new();
    for (name, value) in mine {
        match theirs.get(name) {
            Some(trained) if super::weights_config::same_number(value, trained) => {}
            Some(trained) => changed.push(format!("{name} {value} (the checkpoint has {trained})")),
            None => changed.push(format!("{name} {value} (the checkpoint's model has no `{name}`)")),
        }
    }
    for name in theirs.keys().filter(|name| !mine.contains_key(*name)) {
        changed.push(format!("no `{name}` (the checkpoint has {})", theirs[name]));
    }
    changed
}

/// The refusal of a checkpoint of another model than the run's `model`, naming the model file it was
/// trained from.
pub(super) fn another_model(checkpoint: &Checkpoint, model: &str) -> Failure {
    Failure::usage(format!(
        "--resume: `{}` is a checkpoint of model `{}`, and this run's model is `{model}`: resume it with the model \
         file it was trained from{}",
        checkpoint.dir().display(),
        checkpoint.manifest().model,
        checkpoint.training()["source"].as_str().map_or(String::new(), |source| format!(" (`{source}`)"))
    ))
}

/// What an interrupted run prints: where its state is and how to go on.
pub fn interrupted_message(
    args: &RunArgs,
    steps_done: u64,
    checkpoint: Option<&std::path::Path>,
    folder: Option<&std::path::Path>,
) -> String {
    match (checkpoint, folder) {
        (Some(path), Some(dir)) => format!(
            "interrupted after {steps_done} of {} updates; the checkpoint is `{}`. To continue, run the same command \
             with `--resume {}` (on any mesh)",
            args.steps,
            path.display(),
            super::shell_word(&dir.display().to_string())
        ),
        (None, Some(dir)) => format!(
            "interrupted after {steps_done} of {} updates, before this run wrote a checkpoint in `{}`: there is \
             nothing of it to resume",
            args.steps,
            dir.display()
        ),
        _ => format!(
            "interrupted after {steps_done} of {} updates; without --checkpoint-dir this run cannot be resumed",
            args.steps
        ),
    }
}
