//! A data file's identity, so that a resumed run reads the file its checkpoint trained on: where it is
//! (its canonical path, whatever the working directory), its size, and a SHA-256 of samples of its
//! contents. A token file may hold many gigabytes; the samples (the whole file up to 8 MiB, else 64
//! evenly spaced blocks of 64 KiB, the first and the last among them) read at most 4 MiB of it, and
//! tell apart any two files that differ in size or in a sampled block: another corpus, another
//! tokenizer, another shuffle of the same documents.

use super::files::{FileError, open_regular};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Files up to this size are hashed whole.
const WHOLE_LIMIT: u64 = 8 << 20;
/// Blocks sampled from a larger file.
const SAMPLES: u64 = 64;
/// Bytes of each sampled block.
const BLOCK: u64 = 64 << 10;

/// What identifies a data file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// The canonical path when the file was read.
    pub path: PathBuf,
    pub bytes: u64,
    /// SHA-256 of the sampled blocks, in hexadecimal.
    pub sampled_sha256: String,
}

impl Fingerprint {
    /// Whether `other` holds the same contents (wherever it lies).
    pub fn same_contents(&self, other: &Fingerprint) -> bool {
        self.bytes == other.bytes && self.sampled_sha256 == other.sampled_sha256
    }
}

/// The fingerprint of the regular file at `path`; `what` names it in errors ("token data").
pub fn fingerprint(path: &Path, what: &'static str) -> Result<Fingerprint, FileError> {
    let (mut file, bytes) = open_regular(path, what)?;
    let cannot = |source| FileError::Unreadable { what, path: path.to_path_buf(), source };
    let canonical = std::fs::canonicalize(path).map_err(cannot)?;
    let mut hasher = Sha256::new();
    let mut block = vec![0u8; BLOCK as usize];
    for (start, len) in samples(bytes) {
        file.seek(SeekFrom::Start(start)).map_err(cannot)?;
        let mut left = len;
        while left > 0 {
            let take = left.min(BLOCK) as usize;
            file.read_exact(&mut block[..take]).map_err(cannot)?;
            hasher.update(&block[..take]);
            left -= take as u64;
        }
    }
    let sampled_sha256 = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(Fingerprint { path: canonical, bytes, sampled_sha256 })
}

/// The (start, length) of each sampled range of a file of `bytes` bytes.
fn samples(bytes: u64) -> Vec<(u64, u64)> {
    if bytes <= WHOLE_LIMIT {
        return vec![(0, bytes)];
    }
    let last = bytes - BLOCK;
    (0..SAMPLES).map(|k| (last * k / (SAMPLES - 1), BLOCK)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_cover_a_small_file_whole_and_a_large_one_from_its_first_to_its_last_block() {
        assert_eq!(samples(0), vec![(0, 0)]);
        assert_eq!(samples(WHOLE_LIMIT), vec![(0, WHOLE_LIMIT)]);
        let large = 3 * WHOLE_LIMIT + 7;
        let ranges = samples(large);
        assert_eq!(ranges.len() as u64, SAMPLES);
        assert_eq!(ranges[0], (0, BLOCK));
        assert_eq!(ranges[ranges.len() - 1], (large - BLOCK, BLOCK));
        assert!(ranges.windows(2).all(|w| w[0].0 + BLOCK <= w[1].0), "{ranges:?}");
    }

    #[test]
    fn a_copy_elsewhere_is_the_same_and_one_changed_byte_or_length_is_not() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (a, b, c) = (dir.path().join("a.u16"), dir.path().join("b.u16"), dir.path().join("c.u16"));
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&a, &data).expect("written");
        std::fs::write(&b, &data).expect("written");
        let mut changed = data.clone();
        changed[50_000] ^= 1;
        std::fs::write(&c, &changed).expect("written");
        let (fa, fb, fc) = (fingerprint(&a, "data"), fingerprint(&b, "data"), fingerprint(&c, "data"));
        let (fa, fb, fc) = (fa.expect("read"), fb.expect("read"), fc.expect("read"));
        assert!(fa.same_contents(&fb) && fa.path != fb.path);
        assert!(!fa.same_contents(&fc));
        std::fs::write(&c, &data[..data.len() - 2]).expect("written");
        assert!(!fa.same_contents(&fingerprint(&c, "data").expect("read")));
    }
}
