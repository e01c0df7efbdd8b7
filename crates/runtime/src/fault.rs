//! Fault injection for testing failure handling: `OPTIMUS_INJECT_FAULT=KIND:DEVICE:STEP` makes the
//! device with row-major index DEVICE fail at the start of step STEP (0-based). KIND is `error` (a
//! returned error), `panic`, `hang` (stops talking to its peers) or `kill` (SIGKILL to its process).
//! Unset, it costs one environment lookup per run.

use std::time::Duration;

/// An injected failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub kind: FaultKind,
    pub device: u64,
    pub step: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    Error,
    Panic,
    Hang,
    Kill,
}

/// A malformed `OPTIMUS_INJECT_FAULT`, or the failure an injected fault causes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultError {
    /// The variable's value is not KIND:DEVICE:STEP.
    Malformed(String),
    /// The injected error, at this step.
    Injected { step: u64 },
    /// An injected hang that ended (after a day).
    HangEnded,
    /// An injected kill that left the process running.
    NotKilled,
}

impl std::fmt::Display for FaultError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FaultError::Malformed(text) => {
                write!(f, "OPTIMUS_INJECT_FAULT is `{text}`, not KIND:DEVICE:STEP (KIND error, panic, hang or kill)")
            }
            FaultError::Injected { step } => write!(f, "injected error at step {step}"),
            FaultError::HangEnded => f.write_str("injected hang ended"),
            FaultError::NotKilled => f.write_str("injected kill did not kill the process"),
        }
    }
}

impl std::error::Error for FaultError {}

/// The fault requested by the environment, if any; a malformed value is an error.
pub fn from_env() -> Result<Option<Fault>, FaultError> {
    match std::env::var("OPTIMUS_INJECT_FAULT") {
        Ok(v) if !v.is_empty() => parse(&v).map(Some),
        _ => Ok(None),
    }
}

/// Parses `KIND:DEVICE:STEP`.
pub fn parse(text: &str) -> Result<Fault, FaultError> {
    let bad = || FaultError::Malformed(text.to_string());
    let mut parts = text.split(':');
    let kind = match parts.next() {
        Some("error") => FaultKind::Error,
        Some("panic") => FaultKind::Panic,
        Some("hang") => FaultKind::Hang,
        Some("kill") => FaultKind::Kill,
        _ => return Err(bad()),
    };
    let mut number = || parts.next().and_then(|p| p.parse::<u64>().ok()).ok_or_else(bad);
    let (device, step) = (number()?, number()?);
    Ok(Fault { kind, device, step })
}

impl Fault {
    /// Fails as configured if this is the chosen device and step.
    pub fn trigger(&self, device: u64, step: u64) -> Result<(), FaultError> {
        if (device, step) != (self.device, self.step) {
            return Ok(());
        }
        match self.kind {
            FaultKind::Error => Err(FaultError::Injected { step }),
            FaultKind::Panic => panic!("injected panic at step {step}"),
            FaultKind::Hang => {
                std::thread::sleep(Duration::from_secs(24 * 3600));
                Err(FaultError::HangEnded)
            }
            FaultKind::Kill => {
                let pid = std::process::id().to_string();
                let _ = std::process::Command::new("kill").args(["-KILL", &pid]).status();
                std::thread::sleep(Duration::from_secs(60));
                Err(FaultError::NotKilled)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        assert_eq!(parse("panic:2:1"), Ok(Fault { kind: FaultKind::Panic, device: 2, step: 1 }));
        assert!(parse("boom:1:1").is_err());
        assert!(parse("error:x:1").is_err());
        assert!(parse("error:1").is_err());
        let malformed = parse("boom:1:1").expect_err("no such kind").to_string();
        assert_eq!(
            malformed,
            "OPTIMUS_INJECT_FAULT is `boom:1:1`, not KIND:DEVICE:STEP (KIND error, panic, hang or kill)"
        );
    }

    #[test]
    fn triggers_only_at_its_device_and_step() {
        let fault = Fault { kind: FaultKind::Error, device: 1, step: 2 };
        assert!(fault.trigger(0, 2).is_ok());
        assert!(fault.trigger(1, 1).is_ok());
        assert_eq!(fault.trigger(1, 2), Err(FaultError::Injected { step: 2 }));
        assert_eq!(FaultError::Injected { step: 2 }.to_string(), "injected error at step 2");
    }
}
