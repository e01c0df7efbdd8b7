//! The windows an evaluation reads from a token file: every token after the first is predicted exactly
//! once, each with as much context before it as the window and the stride allow (Hugging Face's
//! sliding-window perplexity: windows `stride` apart, each counting only the targets the ones before it
//! did not).

use super::data::{DataError, TokenData};
use optimus_plan::IGNORE_INDEX;
use optimus_plan::tensor::Tensor;
use std::fmt;

/// One window: tokens `start .. start + seq` predict targets `start + 1 .. start + seq + 1`, of which
/// the first `skip` were counted by an earlier window and are ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub start: u64,
    pub skip: u64,
}

/// Why a file cannot be evaluated with these windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WindowError {
    /// Fewer tokens than one window reads.
    TooShort { tokens: u64, seq: u64 },
    /// A stride of 0, or longer than the window (tokens between windows would never be predicted).
    Stride { stride: u64, seq: u64 },
}

impl fmt::Display for WindowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WindowError::TooShort { tokens, seq } => write!(
                f,
                "the file has {tokens} tokens, and one window reads seq + 1 = {} (its tokens and the next one)",
                seq + 1
            ),
            WindowError::Stride { stride, seq } => {
                write!(f, "--stride {stride} must be between 1 and seq = {seq}, so that every token is predicted")
            }
        }
    }
}

impl std::error::Error for WindowError {}

/// The windows over a file of `tokens` tokens: starts 0, stride, 2 stride, ... while a whole window
/// fits, then one window ending at the file's end if targets remain; together they count every target
/// 1 .. tokens - 1 once.
pub fn windows(tokens: u64, seq: u64, stride: u64) -> Result<Vec<Window>, WindowError> {
    if stride == 0 || stride > seq {
        return Err(WindowError::Stride { stride, seq });
    }
    if seq == 0 || tokens < seq + 1 {
        return Err(WindowError::TooShort { tokens, seq });
    }
    // The last target counted so far (targets are numbered by their token index; 0 is never one).
    let mut counted = 0u64;
    let mut out = Vec::new();
    let mut start = 0u64;
    while start + seq < tokens {
        out.push(Window { start, skip: counted.saturating_sub(start) });
        counted = start + seq;
        start += stride;
    }
    if counted < tokens - 1 {
        let start = tokens - 1 - seq;
        out.push(Window { start, skip: counted - start });
    }
    Ok(out)
}

/// Targets each window counts (those it does not skip).
pub fn counted(window: &Window, seq: u64) -> u64 {
    seq - window.skip
}

/// The `tokens` and `targets` of batch `step` (`batch` windows from `step * batch`): skipped targets and
/// every position of a row past the last window are [`IGNORE_INDEX`] (such rows read token 0).
pub fn window_batch(
    data: &TokenData,
    windows: &[Window],
    step: u64,
    (batch, seq): (u64, u64),
    vocab: u64,
) -> Result<(Tensor, Tensor), DataError> {
    let cells = (batch * seq) as usize;
    let (mut tokens, mut targets) = (vec![0i32; cells], vec![IGNORE_INDEX; cells]);
    for row in 0..batch {
        let Some(window) = windows.get((step * batch + row) as usize) else { continue };
        let read = data.window(window.start, seq + 1, vocab)?;
        for t in 0..seq {
            let at = (row * seq + t) as usize;
            tokens[at] = read[t as usize];
            if t >= window.skip {
                targets[at] = read[t as usize + 1];
            }
        }
    }
    Ok((Tensor::from_i32(&[batch, seq], tokens), Tensor::from_i32(&[batch, seq], targets)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every target 1 .. tokens - 1 is counted exactly once, and each window's counted targets are its last.
    fn covers_once(tokens: u64, seq: u64, stride: u64) {
        let ws = windows(tokens, seq, stride).expect("windows");
        let mut times = vec![0u32; tokens as usize];
        for w in &ws {
            assert!(w.start + seq < tokens && w.skip < seq, "{w:?}");
            for target in w.start + 1 + w.skip..=w.start + seq {
                times[target as usize] += 1;
            }
        }
        assert!(times[1..].iter().all(|&n| n == 1), "{tokens} {seq} {stride}: {times:?}");
        assert_eq!(ws.iter().map(|w| counted(w, seq)).sum::<u64>(), tokens - 1);
    }

    #[test]
    fn windows_predict_every_token_once_for_any_length_and_stride() {
        for tokens in [9, 10, 11, 17, 100, 101] {
            for stride in 1..=8 {
                covers_once(tokens, 8, stride);
            }
        }
        assert_eq!(windows(17, 8, 8), Ok(vec![Window { start: 0, skip: 0 }, Window { start: 8, skip: 0 }]));
        // A tail shorter than a stride: one more window, ending at the file's end, counts only the rest.
        assert_eq!(windows(20, 8, 8).map(|w| w[2]), Ok(Window { start: 11, skip: 5 }));
    }

    #[test]
    fn short_files_and_bad_strides_are_errors() {
        assert_eq!(windows(8, 8, 8), Err(WindowError::TooShort { tokens: 8, seq: 8 }));
        assert_eq!(windows(100, 8, 0), Err(WindowError::Stride { stride: 0, seq: 8 }));
        assert_eq!(windows(100, 8, 9), Err(WindowError::Stride { stride: 9, seq: 8 }));
    }
}
