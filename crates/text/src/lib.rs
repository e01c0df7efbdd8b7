//! Text for optimus: tokenizers (GPT-2's byte-level BPE built in, any Hugging Face `tokenizer.json`)
//! and corpora read in pieces that tokenize exactly as the whole text would, in bounded memory.

pub mod corpus;
pub mod hub;

use sha2::{Digest, Sha256};
use std::fmt;
use std::path::{Path, PathBuf};

/// Why text could not be tokenized or read.
#[derive(Debug)]
pub enum TextError {
    /// A `tokenizer.json` that could not be read or parsed.
    TokenizerFile { path: PathBuf, reason: String },
    /// A tokenizer named neither `gpt2` nor a file.
    UnknownTokenizer { name: String },
    /// No end-of-text token could be found, and none was named.
    NoEndOfText { tokenizer: String },
    /// The end-of-text token named is not in the vocabulary.
    UnknownToken { tokenizer: String, token: String },
    /// The tokenizer failed on some text.
    Encode { reason: String },
    /// Ids that cannot be turned back into text.
    Decode { reason: String },
    /// A corpus file that could not be read.
    Read { path: PathBuf, reason: String },
    /// A corpus file whose text is not UTF-8.
    NotUtf8 { path: PathBuf, offset: u64 },
    /// A JSON Lines corpus line without a string `text` field.
    BadJsonLine { path: PathBuf, line: u64, reason: String },
    /// Text with no place to split it for this long (see [`corpus::MAX_PIECE`]).
    NoBreak { path: PathBuf, offset: u64, bytes: usize },
}

impl fmt::Display for TextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TextError::TokenizerFile { path, reason } => {
                write!(f, "cannot load the tokenizer `{}`: {reason}", path.display())
            }
            TextError::UnknownTokenizer { name } => write!(
                f,
                "unknown tokenizer `{name}`: give `gpt2` (GPT-2's byte-level BPE, built in) or the path of a \
                 Hugging Face tokenizer.json"
            ),
            TextError::NoEndOfText { tokenizer } => write!(
                f,
                "the tokenizer {tokenizer} has no end-of-text token that optimusc knows (<|endoftext|>, \
                 <|end_of_text|>, </s>, [SEP], <eos>); name the token that separates documents with --eot TOKEN"
            ),
            TextError::UnknownToken { tokenizer, token } => {
                write!(f, "`{token}` is not a token of the tokenizer {tokenizer}")
            }
            TextError::Encode { reason } => write!(f, "the tokenizer failed: {reason}"),
            TextError::Decode { reason } => write!(f, "cannot turn these ids into text: {reason}"),
            TextError::Read { path, reason } => write!(f, "cannot read `{}`: {reason}", path.display()),
            TextError::NotUtf8 { path, offset } => {
                write!(f, "`{}` is not UTF-8 text: invalid bytes at byte {offset}", path.display())
            }
            TextError::BadJsonLine { path, line, reason } => {
                write!(
                    f,
                    "`{}` line {line}: {reason} (a .jsonl corpus has one {{\"text\": ...}} object per line)",
                    path.display()
                )
            }
            TextError::NoBreak { path, offset, bytes } => write!(
                f,
                "`{}` has {bytes} bytes from byte {offset} without a line break or a space before a letter or \
                 digit, where a long text can be split without changing its tokens",
                path.display()
            ),
        }
    }
}

impl std::error::Error for TextError {}

/// The end-of-text tokens looked for, in order, when none is named.
const END_OF_TEXT_NAMES: &[&str] = &["<|endoftext|>", "<|end_of_text|>", "</s>", "[SEP]", "<eos>"];

/// Why `bytes` are not even the shape of a `tokenizer.json` (JSON, an object, with a `model`), so that
/// a file of another kind is called that, not met with the tokenizer parser's words.
fn check_tokenizer_json(bytes: &[u8]) -> Result<(), String> {
    // The top level's keys alone: the values are checked as JSON but never built into a tree (a Llama 3
    // tokenizer.json is 9 MB, which `tokenizers` parses again).
    let object: std::collections::HashMap<String, serde::de::IgnoredAny> = match serde_json::from_slice(bytes) {
        Ok(object) => object,
        Err(e) if e.is_data() => return Err("it is JSON but not an object, as a tokenizer.json is".into()),
        Err(e) => return Err(format!("it is not JSON ({e}); a tokenizer.json is")),
    };
    if !object.contains_key("model") {
        return Err("it has no `model`, so it is not a Hugging Face tokenizer.json".into());
    }
    Ok(())
}

/// GPT-2's end-of-text token and id.
const GPT2_END_OF_TEXT: (&str, u32) = ("<|endoftext|>", 50256);

/// GPT-2's vocabulary: 50,000 merges, 256 bytes and the end-of-text token.
const GPT2_VOCAB: u32 = 50257;

/// White space runs of at least this many bytes are cut before their last character for GPT-2's
/// built-in BPE ([`gpt2_pieces`]): tiktoken's pattern takes such a run, when text follows it, with a
/// lookahead that backtracks one character at a time (`\s+(?!\S)`), and its matcher runs out of stack
/// from about a million characters on.
const LONG_SPACE_RUN: usize = 1 << 16;

/// `text` cut before the last character of every white space run of at least [`LONG_SPACE_RUN`] bytes
/// that other text follows, so that tiktoken's pattern never backtracks through a long run: in the
/// whole text the run but its last character is one pre-token (`\s+(?!\S)`), as it is at the end of a
/// piece (`\s++$`, which needs no backtracking), and the last character starts the next pre-token
/// either way (the pattern has no lookbehind). So the pieces' ids, one after another, are the text's.
fn gpt2_pieces(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let (mut start, mut run) = (0usize, None::<usize>);
    for (at, c) in text.char_indices() {
        if c.is_whitespace() {
            run.get_or_insert(at);
            continue;
        }
        let Some(begin) = run.take() else { continue };
        if at - begin >= LONG_SPACE_RUN {
            let last = text[..at].chars().next_back().map_or(at, |c| at - c.len_utf8());
            pieces.push(&text[start..last]);
            start = last;
        }
    }
    pieces.push(&text[start..]);
    pieces
}

enum Engine {
    /// GPT-2's BPE (tiktoken's `r50k_base`), encoding text as ordinary text (tiktoken's
    /// `encode_ordinary`: a literal `<|endoftext|>` in the text is seven ordinary tokens).
    Gpt2(tiktoken_rs::CoreBPE),
    /// A Hugging Face tokenizer, encoding as `encode(text, add_special_tokens=False)`, and the
    /// `tokenizer.json` it was read from.
    HuggingFace(Box<tokenizers::Tokenizer>, String),
}

/// A tokenizer, with what the token files it makes record: its name, vocabulary size and the token that
/// separates documents.
pub struct Tokenizer {
    engine: Engine,
    name: String,
    vocab: u32,
    end_of_text: Option<(String, u32)>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer").field("name", &self.name).field("vocab", &self.vocab).finish_non_exhaustive()
    }
}

/// The files [`Tokenizer::hub_files`] names, in its order.
pub const HUB_FILES: [&str; 2] = ["tokenizer.json", "tokenizer_config.json"];

/// The largest tokenizer.json read: Hugging Face's largest vocabularies (256k tokens with their
/// merges) take tens of megabytes.
const MAX_TOKENIZER_BYTES: u64 = 1 << 30;

impl Tokenizer {
    /// `gpt2` (built in) or the path of a Hugging Face `tokenizer.json`.
    pub fn load(name: &str) -> Result<Tokenizer, TextError> {
        if name == "gpt2" {
            return Tokenizer::gpt2();
        }
        let path = Path::new(name);
        if !path.exists() {
            if name.contains(['/', '.']) {
                let reason =
                    "there is no such file; give `gpt2` (built in) or the path of a Hugging Face tokenizer.json"
                        .to_string();
                return Err(TextError::TokenizerFile { path: path.to_path_buf(), reason });
            }
            return Err(TextError::UnknownTokenizer { name: name.to_string() });
        }
        Tokenizer::from_file(path)
    }

    /// GPT-2's byte-level BPE, built in.
    pub fn gpt2() -> Result<Tokenizer, TextError> {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| TextError::Encode { reason: e.to_string() })?;
        let (eot, id) = GPT2_END_OF_TEXT;
        Ok(Tokenizer {
            engine: Engine::Gpt2(bpe),
            name: "gpt2".into(),
            vocab: GPT2_VOCAB,
            end_of_text: Some((eot.into(), id)),
        })
    }

    /// A Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer, TextError> {
        let error = |reason: String| TextError::TokenizerFile { path: path.to_path_buf(), reason };
        // Not read unless a regular file of a sensible size: a FIFO would block the read forever.
        let meta = std::fs::metadata(path).map_err(|e| error(e.to_string()))?;
        if !meta.is_file() {
            return Err(error("it is not a regular file (a directory, a FIFO or a device)".into()));
        }
        if meta.len() > MAX_TOKENIZER_BYTES {
            return Err(error(format!(
                "it is {} bytes, more than the {MAX_TOKENIZER_BYTES} a tokenizer.json may have",
                meta.len()
            )));
        }
        let bytes = std::fs::read(path).map_err(|e| error(e.to_string()))?;
        check_tokenizer_json(&bytes).map_err(error)?;
        let hf = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| error(format!("it is not a Hugging Face tokenizer.json that optimusc can read ({e})")))?;
        let vocab = hf.get_vocab(true).values().max().map_or(0, |&id| id.saturating_add(1));
        if vocab == 0 {
            return Err(error("its vocabulary is empty: it has no token to make".into()));
        }
        let end_of_text =
            END_OF_TEXT_NAMES.iter().find_map(|&name| hf.token_to_id(name).map(|id| (name.to_string(), id)));
        let text = String::from_utf8(bytes.clone())
            .map_err(|_| TextError::TokenizerFile { path: path.to_path_buf(), reason: "not UTF-8".into() })?;
        let digest = Sha256::digest(&bytes);
        let short: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
        Ok(Tokenizer {
            engine: Engine::HuggingFace(Box::new(hf), text),
            name: format!("{} (sha256 {short}…)", path.display()),
            vocab,
            end_of_text,
        })
    }

    /// How the tokenizer is named in messages and sidecars: `gpt2`, or its file with a digest.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// One more than the largest token id: the vocabulary a model must have to take these tokens.
    pub fn vocab_size(&self) -> u32 {
        self.vocab
    }

    /// The token that ends a document, and its id, if the tokenizer has one optimusc knows.
    pub fn end_of_text(&self) -> Option<(&str, u32)> {
        self.end_of_text.as_ref().map(|(name, id)| (name.as_str(), *id))
    }

    /// The id of the token written `token` (a special token such as `</s>`).
    pub fn token_id(&self, token: &str) -> Result<u32, TextError> {
        let unknown = || TextError::UnknownToken { tokenizer: self.name.clone(), token: token.to_string() };
        match &self.engine {
            Engine::Gpt2(_) if token == GPT2_END_OF_TEXT.0 => Ok(GPT2_END_OF_TEXT.1),
            Engine::Gpt2(bpe) => match bpe.encode_with_special_tokens(token).as_slice() {
                [id] => Ok(*id),
                _ => Err(unknown()),
            },
            Engine::HuggingFace(hf, _) => hf.token_to_id(token).ok_or_else(unknown),
        }
    }

    /// The token that separates documents: `named` if given, else [`Tokenizer::end_of_text`].
    pub fn separator(&self, named: Option<&str>) -> Result<u32, TextError> {
        match named {
            Some(token) => self.token_id(token),
            None => self.end_of_text().map(|(_, id)| id).ok_or(TextError::NoEndOfText { tokenizer: self.name.clone() }),
        }
    }

    /// The ids of `text`, as ordinary text (no special tokens added around it).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        match &self.engine {
            Engine::Gpt2(bpe) => {
                Ok(gpt2_pieces(text).into_iter().flat_map(|piece| bpe.encode_ordinary(piece)).collect())
            }
            Engine::HuggingFace(hf, _) => hf
                .encode_fast(text, false)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|e| TextError::Encode { reason: e.to_string() }),
        }
    }

    /// The text of `ids` (special tokens included, as text). Bytes that do not make whole UTF-8
    /// characters (a sequence cut inside one) become U+FFFD, as Hugging Face's `decode` does.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        match &self.engine {
            Engine::Gpt2(bpe) => {
                let bytes = bpe.decode_bytes(ids).map_err(|e| TextError::Decode { reason: e.to_string() })?;
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Engine::HuggingFace(hf, _) => {
                hf.decode(ids, false).map_err(|e| TextError::Decode { reason: e.to_string() })
            }
        }
    }

    /// The tokenizer as Hugging Face's `tokenizer.json`: the file it was read from, or GPT-2's made from
    /// its ranks (see [`hub`]).
    pub fn hugging_face_json(&self) -> Result<String, TextError> {
        match &self.engine {
            Engine::HuggingFace(_, text) => Ok(text.clone()),
            Engine::Gpt2(bpe) => {
                let (eot, id) = GPT2_END_OF_TEXT;
                let tokens = (0..id)
                    .map(|rank| bpe.decode_bytes(&[rank]).map_err(|e| TextError::Decode { reason: e.to_string() }))
                    .collect::<Result<Vec<_>, _>>()?;
                hub::gpt2_tokenizer_json(&tokens, eot)
            }
        }
    }

    /// The files `AutoTokenizer.from_pretrained` reads from a model folder: `tokenizer.json` and a
    /// `tokenizer_config.json` naming the end-of-text token and the longest sequence (`context`).
    pub fn hub_files(&self, context: Option<u64>) -> Result<Vec<(&'static str, String)>, TextError> {
        let mut config =
            serde_json::json!({"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": false});
        if let Some((eot, _)) = self.end_of_text() {
            config["eos_token"] = eot.into();
            // GPT-2 starts texts with its end-of-text token too; others have a beginning of their own.
            if eot == GPT2_END_OF_TEXT.0 {
                config["bos_token"] = eot.into();
            }
        }
        if let Some(context) = context {
            config["model_max_length"] = context.into();
        }
        let config = serde_json::to_string_pretty(&config).map_err(|e| TextError::Encode { reason: e.to_string() })?;
        let [tokenizer, tokenizer_config] = HUB_FILES;
        Ok(vec![(tokenizer, self.hugging_face_json()?), (tokenizer_config, format!("{config}\n"))])
    }

    /// The ids of each text, tokenized in parallel, in order.
    pub fn encode_all(&self, texts: &[String]) -> Result<Vec<Vec<u32>>, TextError> {
        use rayon::prelude::*;
        texts.par_iter().map(|text| self.encode(text)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tokenizer_path_that_is_missing_a_directory_or_a_fifo_is_refused_without_reading_it() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let fifo = dir.path().join("fifo.json");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success());
        let mut cases = vec![(dir.path().to_path_buf(), "not a regular file")];
        if made {
            cases.push((fifo, "not a regular file"));
        }
        cases.push((dir.path().join("nope.json"), "no such file"));
        for (path, needle) in cases {
            let name = path.to_str().expect("a UTF-8 path");
            let error = Tokenizer::load(name).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(error.contains(needle) && error.contains(name), "{name}: {error}");
        }
        let error = Tokenizer::load("nope").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("unknown tokenizer `nope`"), "{error}");
    }

    #[test]
    fn gpt2_encodes_as_tiktoken_and_decodes_back() -> Result<(), TextError> {
        let gpt2 = Tokenizer::gpt2()?;
        // "Hello world" is [15496, 995] in every GPT-2 tokenizer.
        assert_eq!(gpt2.encode("Hello world")?, vec![15496, 995]);
        let text = "naïve café — 東京\n\n  tabs\there <|endoftext|>";
        assert_eq!(gpt2.decode(&gpt2.encode(text)?)?, text);
        // A literal end-of-text marker in a corpus is ordinary text, not the separator.
        assert!(!gpt2.encode("<|endoftext|>")?.contains(&50256));
        assert_eq!(gpt2.separator(None)?, 50256);
        assert_eq!(gpt2.vocab_size(), 50257);
        Ok(())
    }

    /// Long white space runs are cut for GPT-2 where no pre-token straddles the cut: runs of every kind
    /// just past the cutting length, before letters, digits, marks, other white space or the end, give
    /// tiktoken's ids of the uncut text; and a run of millions, which tiktoken's pattern alone cannot
    /// take (its matcher runs out of stack), gives ids that decode to the text.
    #[test]
    fn long_white_space_runs_give_the_uncut_texts_ids() -> Result<(), TextError> {
        let gpt2 = Tokenizer::gpt2()?;
        let Engine::Gpt2(bpe) = &gpt2.engine else { panic!("the built-in GPT-2 is tiktoken's") };
        let runs = [" ", "\n", "\u{a0}", " \u{a0}", "\n\n\t", "\u{3000}"];
        let after = ["x", " word", "7", "!", "\u{a0}x", "\n\nend", ""];
        for run in runs {
            let long = run.repeat(LONG_SPACE_RUN / run.len() + 3);
            for tail in after {
                let text = format!("a{long}{tail}");
                let pieces = gpt2_pieces(&text);
                assert_eq!(pieces.concat(), text);
                assert_eq!(pieces.len(), if tail.trim().is_empty() { 1 } else { 2 }, "{run:?} before {tail:?}");
                assert_eq!(gpt2.encode(&text)?, bpe.encode_ordinary(&text), "{run:?} before {tail:?}");
            }
        }
        let text = format!("{}x{}", " ".repeat(3 << 20), "\n".repeat(3 << 20));
        let ids = gpt2.encode(&text)?;
        assert_eq!(gpt2.decode(&ids)?, text);
        Ok(())
    }

    /// A file that is not a tokenizer.json is called what it is (not JSON, not an object, no model),
    /// and a tokenizer without a vocabulary is refused, not let write a corpus of no tokens.
    #[test]
    fn a_file_that_is_not_a_tokenizer_says_why() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let cases = [
            ("{\"a\": ", "it is not JSON"),
            ("[1, 2]", "JSON but not an object"),
            ("null", "JSON but not an object"),
            ("\"model\"", "JSON but not an object"),
            ("{\"a\": 1}", "has no `model`"),
            ("{\"model\": 4}", "not a Hugging Face tokenizer.json that optimusc can read"),
            ("{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}}", "vocabulary is empty"),
        ];
        for (i, (text, needle)) in cases.into_iter().enumerate() {
            let path = dir.path().join(format!("t{i}.json"));
            std::fs::write(&path, text).expect("write");
            let error = Tokenizer::from_file(&path).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(error.contains(needle) && error.contains("cannot load the tokenizer"), "{text}: {error}");
        }
    }

    #[test]
    fn an_unknown_tokenizer_or_token_is_an_error_that_says_what_to_give() -> Result<(), TextError> {
        let error = Tokenizer::load("/nonexistent/tokenizer.json").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("give `gpt2`"), "{error}");
        let error = Tokenizer::gpt2()?.separator(Some("<|nope|>")).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("not a token"), "{error}");
        Ok(())
    }
}
