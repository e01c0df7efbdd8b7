//! A corpus read in pieces of about a megabyte, each cut where the pre-tokenizers of GPT-2, Llama 3 and
//! BERT always cut anyway, so that tokenizing the pieces one by one gives the ids of the whole text and a
//! 10 GB corpus takes megabytes of memory.
//!
//! A plain file is one document; in a `.jsonl` file each line's `"text"` is one. A long text is cut
//! only at one of two kinds of places, both where no pre-token can straddle:
//!
//! - after a line break that has a character other than white space on both sides (`x\nB`): GPT-2's
//!   and Llama 3's patterns end a pre-token at that line break whatever follows it, and BERT's splits
//!   on white space;
//! - before a space that follows a character other than white space and precedes an ASCII letter or
//!   digit (`x yz`): the space starts the next pre-token in all three.
//!
//! Tokenizers that add a marker at the start of every text they are given (SentencePiece's `▁`, a
//! byte-level `add_prefix_space`) see each piece as a text of its own, so a corpus longer than a piece
//! gets one marker per piece; such tokenizers give the whole text's ids only for texts under a piece.

use super::TextError;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// The size a piece is cut at, where a place to cut it is found.
pub const PIECE: usize = 1 << 20;

/// The most text read without a place to cut it before the corpus is refused.
pub const MAX_PIECE: usize = 64 << 20;

/// One piece of a corpus, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The text (never empty).
    pub text: String,
    /// Whether the piece starts a document (the separator goes before it, but before the first).
    pub starts_document: bool,
    /// Bytes of the corpus read once this piece was cut, over all its files.
    pub bytes_read: u64,
}

/// How a corpus file holds its documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    /// The whole file is one document.
    Text,
    /// One JSON object per line, its `text` field one document.
    JsonLines,
}

impl Format {
    fn of(path: &Path) -> Format {
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("jsonl")) { Format::JsonLines } else { Format::Text }
    }
}

/// The files of a corpus and their total size.
#[derive(Debug, Clone)]
pub struct Corpus {
    files: Vec<(PathBuf, u64)>,
}

impl Corpus {
    /// Checks that every file is a readable regular file and takes its size.
    pub fn open(paths: &[PathBuf]) -> Result<Corpus, TextError> {
        let files = paths
            .iter()
            .map(|path| {
                let read_error = |reason: String| TextError::Read { path: path.clone(), reason };
                let meta = std::fs::metadata(path).map_err(|e| read_error(e.to_string()))?;
                if !meta.is_file() {
                    return Err(read_error("not a regular file".into()));
                }
                File::open(path).map_err(|e| read_error(e.to_string()))?;
                Ok((path.clone(), meta.len()))
            })
            .collect::<Result<_, _>>()?;
        Ok(Corpus { files })
    }

    /// Bytes in all the files.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|(_, len)| len).sum()
    }

    /// The pieces of every document of every file, in order.
    pub fn pieces(&self) -> Pieces<'_> {
        self.pieces_of_size(PIECE)
    }

    /// [`Corpus::pieces`], cut at about `size` bytes (for tests of the cutting).
    pub fn pieces_of_size(&self, size: usize) -> Pieces<'_> {
        Pieces { corpus: self, size: size.max(1), file: 0, open: None, done_before: 0, failed: false }
    }
}

/// The file being read.
struct OpenFile {
    reader: BufReader<File>,
    format: Format,
    /// Bytes read from the file so far.
    read: u64,
    /// Text read and not yet cut (plain text only).
    pending: Vec<u8>,
    /// Where `pending` starts in the file.
    pending_at: u64,
    /// Whether the next piece of a plain file starts its document.
    at_start: bool,
    /// Lines read (JSON Lines only).
    line: u64,
    /// Pieces of the current JSON line's text still to hand out, last first.
    queued: Vec<String>,
}

/// The iterator of [`Corpus::pieces`]; it stops after the first error.
pub struct Pieces<'c> {
    corpus: &'c Corpus,
    size: usize,
    file: usize,
    open: Option<OpenFile>,
    /// Bytes of the files before the current one.
    done_before: u64,
    failed: bool,
}

impl Iterator for Pieces<'_> {
    type Item = Result<Piece, TextError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        let next = self.next_piece();
        if matches!(next, Some(Err(_))) {
            self.failed = true;
        }
        next
    }
}

impl Pieces<'_> {
    fn next_piece(&mut self) -> Option<Result<Piece, TextError>> {
        loop {
            let (path, len) = self.corpus.files.get(self.file)?.clone();
            let open = match &mut self.open {
                Some(open) => open,
                None => match File::open(&path) {
                    Ok(file) => self.open.insert(OpenFile {
                        reader: BufReader::with_capacity(1 << 16, file),
                        format: Format::of(&path),
                        read: 0,
                        pending: Vec::new(),
                        pending_at: 0,
                        at_start: true,
                        line: 0,
                        queued: Vec::new(),
                    }),
                    Err(e) => return Some(Err(TextError::Read { path, reason: e.to_string() })),
                },
            };
            let base = self.done_before;
            let found = match open.format {
                Format::Text => next_text_piece(open, &path, self.size),
                Format::JsonLines => next_json_piece(open, &path, self.size),
            };
            match found {
                Ok(Some((text, starts_document))) => {
                    return Some(Ok(Piece { text, starts_document, bytes_read: base + open.read }));
                }
                Ok(None) => {
                    self.open = None;
                    self.file += 1;
                    self.done_before += len;
                }
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// Reads into `open.pending` until it holds `want` bytes or the file ends; returns whether it ended.
fn fill(open: &mut OpenFile, path: &Path, want: usize) -> Result<bool, TextError> {
    while open.pending.len() < want {
        let before = open.pending.len();
        let limit = (want - before) as u64;
        let got = (&mut open.reader)
            .take(limit)
            .read_to_end(&mut open.pending)
            .map_err(|e| TextError::Read { path: path.to_path_buf(), reason: e.to_string() })?;
        open.read += got as u64;
        if got == 0 {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The next piece of a plain file, and whether it starts the document; `None` once the file is done.
fn next_text_piece(open: &mut OpenFile, path: &Path, size: usize) -> Result<Option<(String, bool)>, TextError> {
    let mut want = size;
    loop {
        let ended = fill(open, path, want)?;
        if open.pending_at == 0 && open.pending.starts_with(UTF8_BOM) {
            // A byte-order mark marks the file's encoding, not its text (Python's `utf-8-sig`).
            open.pending.drain(..UTF8_BOM.len());
            open.pending_at = UTF8_BOM.len() as u64;
        }
        let cut = if ended { Some(open.pending.len()) } else { last_cut(&open.pending) };
        match cut {
            Some(0) if ended => return Ok(None),
            Some(at) if at > 0 => {
                let rest = open.pending.split_off(at);
                let bytes = std::mem::replace(&mut open.pending, rest);
                let text = String::from_utf8(bytes).map_err(|e| TextError::NotUtf8 {
                    path: path.to_path_buf(),
                    offset: open.pending_at + e.utf8_error().valid_up_to() as u64,
                })?;
                open.pending_at += at as u64;
                let starts = std::mem::replace(&mut open.at_start, false);
                return Ok(Some((text, starts)));
            }
            _ if open.pending.len() >= MAX_PIECE.max(size) => {
                return Err(TextError::NoBreak {
                    path: path.to_path_buf(),
                    offset: open.pending_at,
                    bytes: open.pending.len(),
                });
            }
            _ => want = open.pending.len() + size,
        }
    }
}

/// The next piece of a JSON Lines file: the next non-empty text, cut into pieces as a plain text is.
fn next_json_piece(open: &mut OpenFile, path: &Path, size: usize) -> Result<Option<(String, bool)>, TextError> {
    if let Some(piece) = open.queued.pop() {
        return Ok(Some((piece, false)));
    }
    loop {
        let mut line = Vec::new();
        let got = (&mut open.reader)
            .take(MAX_PIECE as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| TextError::Read { path: path.to_path_buf(), reason: e.to_string() })?;
        if got == 0 {
            return Ok(None);
        }
        open.read += got as u64;
        open.line += 1;
        let bad = |reason: String| TextError::BadJsonLine { path: path.to_path_buf(), line: open.line, reason };
        if line.len() > MAX_PIECE && !line.ends_with(b"\n") {
            return Err(bad(format!("longer than {} MiB", MAX_PIECE >> 20)));
        }
        // A byte order mark (Windows editors write one) is no part of the first line's JSON.
        let line = if open.line == 1 { line.strip_prefix(UTF8_BOM).unwrap_or(&line) } else { &line[..] };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let value: serde_json::Value = serde_json::from_slice(line).map_err(|e| bad(e.to_string()))?;
        let text = value
            .get("text")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| bad("no string `text` field".into()))?;
        if text.is_empty() {
            continue;
        }
        let mut pieces = cut_text(text, size);
        pieces.reverse();
        let first = pieces.pop().unwrap_or_default();
        open.queued = pieces;
        return Ok(Some((first, true)));
    }
}

/// The UTF-8 byte order mark.
const UTF8_BOM: &[u8] = b"\xef\xbb\xbf";

/// `text` cut into pieces of about `size` bytes at the places [`last_cut`] allows (a piece is longer
/// where there is none).
fn cut_text(text: &str, size: usize) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut rest = text.as_bytes();
    while rest.len() > size {
        // Look for the last place to cut within the first `size` bytes, else the first one after.
        let cut = last_cut(&rest[..size]).or_else(|| first_cut(rest));
        let Some(at) = cut.filter(|&at| at > 0 && at < rest.len()) else { break };
        pieces.push(String::from_utf8_lossy(&rest[..at]).into_owned());
        rest = &rest[at..];
    }
    if !rest.is_empty() {
        pieces.push(String::from_utf8_lossy(rest).into_owned());
    }
    pieces
}

/// The last place in `bytes` where a text may be cut (see the module's docs), as the length of the part
/// before it.
fn last_cut(bytes: &[u8]) -> Option<usize> {
    (1..bytes.len()).rev().find(|&at| is_cut(bytes, at))
}

/// The first place in `bytes` where a text may be cut.
fn first_cut(bytes: &[u8]) -> Option<usize> {
    (1..bytes.len()).find(|&at| is_cut(bytes, at))
}

/// Whether the text may be cut before `bytes[at]`: after `x\n` before a character that is not white
/// space, or before ` y` (a space after a character that is not white space, before an ASCII letter or
/// digit). Both places are ASCII bytes, so they never fall inside a character.
fn is_cut(bytes: &[u8], at: usize) -> bool {
    let after_line_break = bytes[at - 1] == b'\n'
        && char_ending_at(bytes, at - 1).is_some_and(|c| !c.is_whitespace())
        && char_starting_at(bytes, at).is_some_and(|c| !c.is_whitespace());
    let before_word = bytes[at] == b' '
        && bytes.get(at + 1).is_some_and(u8::is_ascii_alphanumeric)
        && char_ending_at(bytes, at).is_some_and(|c| !c.is_whitespace());
    after_line_break || before_word
}

/// The character that starts at `bytes[at]`, if a whole one does.
fn char_starting_at(bytes: &[u8], at: usize) -> Option<char> {
    let end = (at + 4).min(bytes.len());
    (at + 1..=end).find_map(|e| std::str::from_utf8(&bytes[at..e]).ok()).and_then(|s| s.chars().next())
}

/// The character that ends just before `bytes[end]`, if a whole one does.
fn char_ending_at(bytes: &[u8], end: usize) -> Option<char> {
    (end.saturating_sub(4)..end)
        .rev()
        .find_map(|s| std::str::from_utf8(&bytes[s..end]).ok())
        .and_then(|s| s.chars().next_back())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tokenizer;
    use std::io::Write;

    fn corpus_of(files: &[(&str, &str)]) -> (tempfile::TempDir, Corpus) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let paths: Vec<PathBuf> = files
            .iter()
            .map(|(name, text)| {
                let path = dir.path().join(name);
                File::create(&path).and_then(|mut f| f.write_all(text.as_bytes())).expect("written");
                path
            })
            .collect();
        let corpus = Corpus::open(&paths).expect("opens");
        (dir, corpus)
    }

    /// Text with every kind of place around a cut: line breaks between words and after punctuation,
    /// CRLF, blank lines, runs of spaces and tabs, digits, contractions and characters of several bytes.
    fn awkward_text() -> String {
        let mut text = String::new();
        for k in 0..400 {
            text.push_str(&format!(
                "Line {k}: it's naïve — 東京 {k}{k}{k}.\nNext\r\nthing  \t double  spaces\n\n\nSo, 12345 apples;\n  x "
            ));
        }
        text
    }

    #[test]
    fn pieces_tokenize_to_the_whole_texts_ids_at_any_piece_size() -> Result<(), TextError> {
        let gpt2 = Tokenizer::gpt2()?;
        let text = awkward_text();
        let whole = gpt2.encode(&text)?;
        let (_dir, corpus) = corpus_of(&[("a.txt", &text)]);
        for size in [7, 64, 1000, 1 << 20] {
            let pieces: Vec<Piece> = corpus.pieces_of_size(size).collect::<Result<_, _>>()?;
            assert_eq!(pieces.iter().map(|p| p.text.as_str()).collect::<String>(), text, "size {size}");
            let mut ids = Vec::new();
            for piece in &pieces {
                ids.extend(gpt2.encode(&piece.text)?);
            }
            assert_eq!(ids, whole, "size {size}: {} pieces", pieces.len());
            assert!(size >= text.len() || pieces.len() > 1);
            assert_eq!(pieces.last().map(|p| p.bytes_read), Some(text.len() as u64));
        }
        Ok(())
    }

    #[test]
    fn files_and_json_lines_are_documents_and_empty_ones_are_skipped() -> Result<(), TextError> {
        let lines = "{\"text\": \"first doc\"}\n\n{\"text\": \"\"}\n{\"text\": \"second doc\", \"id\": 2}\n";
        let (_dir, corpus) = corpus_of(&[("a.txt", "plain file"), ("b.jsonl", lines), ("c.txt", "")]);
        let pieces: Vec<(String, bool)> =
            corpus.pieces().map(|p| p.map(|p| (p.text, p.starts_document))).collect::<Result<_, _>>()?;
        let expected = [("plain file", true), ("first doc", true), ("second doc", true)];
        assert_eq!(pieces, expected.map(|(t, s)| (t.to_string(), s)));
        Ok(())
    }

    #[test]
    fn a_byte_order_mark_at_the_start_of_a_text_file_is_skipped() -> Result<(), TextError> {
        let (_dir, corpus) = corpus_of(&[("bom.txt", "\u{feff}first words\n"), ("late.txt", "a\u{feff}b")]);
        let texts: Vec<String> = corpus.pieces().map(|p| p.map(|p| p.text)).collect::<Result<_, _>>()?;
        assert_eq!(texts, ["first words\n", "a\u{feff}b"], "only a mark that starts a file is skipped");
        Ok(())
    }

    #[test]
    fn a_byte_order_mark_before_the_first_json_line_is_skipped() -> Result<(), TextError> {
        let lines = "\u{feff}{\"text\": \"first\"}\n{\"text\": \"second\"}\n";
        let (_dir, corpus) = corpus_of(&[("bom.jsonl", lines)]);
        let texts: Vec<String> = corpus.pieces().map(|p| p.map(|p| p.text)).collect::<Result<_, _>>()?;
        assert_eq!(texts, ["first", "second"]);
        let (_dir, corpus) = corpus_of(&[("late.jsonl", "{\"text\": \"first\"}\n\u{feff}{\"text\": \"x\"}\n")]);
        let error = corpus.pieces().find_map(Result::err).map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("line 2"), "a mark inside the file is an error: {error}");
        Ok(())
    }

    #[test]
    fn bad_corpora_are_errors_that_say_where() {
        let (_dir, corpus) = corpus_of(&[("bad.jsonl", "{\"text\": \"ok\"}\n{\"txt\": 1}\n")]);
        let error = corpus.pieces().find_map(Result::err).map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("line 2") && error.contains("`text`"), "{error}");
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("latin1.txt");
        std::fs::write(&path, b"caf\xe9 ok").expect("written");
        let error = Corpus::open(&[path]).map(|c| c.pieces().find_map(Result::err).map(|e| e.to_string()));
        let error = error.ok().flatten().unwrap_or_default();
        assert!(error.contains("not UTF-8") && error.contains("byte 3"), "{error}");
        let error = Corpus::open(&[dir.path().to_path_buf()]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("not a regular file"), "{error}");
    }
}
