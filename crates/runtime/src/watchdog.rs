//! The last resort against a device thread that never returns: once a run has failed and a device
//! has not stopped within a grace period, the run gives it up here, and the command line's main
//! thread, which polls [`abandoned`], reports the failure and ends the process without waiting for it.

use std::sync::Mutex;

static ABANDONED: Mutex<Option<String>> = Mutex::new(None);

/// Records that the run has failed and cannot finish: `message` says why and names the devices that
/// did not stop. The first message is kept.
pub fn abandon(message: String) {
    if let Ok(mut slot) = ABANDONED.lock() {
        slot.get_or_insert(message);
    }
}

/// The message of a run that was given up, if any.
pub fn abandoned() -> Option<String> {
    ABANDONED.lock().ok().and_then(|slot| slot.clone())
}
