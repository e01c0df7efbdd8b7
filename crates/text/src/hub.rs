//! The tokenizer files Hugging Face's `AutoTokenizer.from_pretrained` reads from a model folder:
//! `tokenizer.json` and `tokenizer_config.json`. A `tokenizer.json` that was loaded is written back as
//! it was read; GPT-2's, built in as tiktoken's ranks, is made as Hugging Face's own GPT-2 tokenizer
//! is: byte-level BPE over the same vocabulary, with the merges that build each token, in rank order.

use super::TextError;
use std::collections::HashMap;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer as HfTokenizer};

/// The character byte-level BPE writes for each byte: printable Latin-1 bytes stand for themselves, and
/// the others (controls, space, soft hyphen...) for the characters from U+0100 on, in byte order.
pub fn byte_characters() -> [char; 256] {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let code = if printable(b as u32) {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

/// `bytes` written in byte-level BPE's characters.
fn as_characters(bytes: &[u8], table: &[char; 256]) -> String {
    bytes.iter().map(|&b| table[b as usize]).collect()
}

/// The two tokens whose merge makes `token` (of rank `rank`): byte-pair encoding of its bytes with only
/// the merges of lower rank, which leaves two parts.
fn merge_of(token: &[u8], rank: u32, ranks: &HashMap<Vec<u8>, u32>) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut parts: Vec<Vec<u8>> = token.iter().map(|&b| vec![b]).collect();
    while parts.len() > 2 {
        let best = (0..parts.len() - 1)
            .filter_map(|i| {
                let joined = [parts[i].as_slice(), parts[i + 1].as_slice()].concat();
                ranks.get(&joined).filter(|&&r| r < rank).map(|&r| (r, i))
            })
            .min()?;
        let right = parts.remove(best.1 + 1);
        parts[best.1].extend(right);
    }
    match parts.as_slice() {
        [a, b] => Some((a.clone(), b.clone())),
        _ => None,
    }
}

/// GPT-2's tokenizer as Hugging Face's `tokenizer.json`, from the bytes of each token id (the last,
/// `end_of_text`, a special token).
pub fn gpt2_tokenizer_json(token_bytes: &[Vec<u8>], end_of_text: &str) -> Result<String, TextError> {
    let table = byte_characters();
    let ranks: HashMap<Vec<u8>, u32> = token_bytes.iter().enumerate().map(|(r, t)| (t.clone(), r as u32)).collect();
    let mut vocab = Vocab::default();
    let mut merges = Vec::new();
    for (rank, token) in token_bytes.iter().enumerate() {
        vocab.insert(as_characters(token, &table), rank as u32);
        if token.len() > 1 {
            let (a, b) = merge_of(token, rank as u32, &ranks).ok_or_else(|| TextError::Encode {
                reason: format!("GPT-2 token {rank} is not the merge of two tokens of lower rank"),
            })?;
            merges.push((as_characters(&a, &table), as_characters(&b, &table)));
        }
    }
    vocab.insert(end_of_text.to_string(), token_bytes.len() as u32);
    let failed = |e: Box<dyn std::error::Error + Send + Sync>| TextError::Encode { reason: e.to_string() };
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(failed)?;
    let mut tokenizer = HfTokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, true, true)));
    tokenizer.add_special_tokens(&[AddedToken::from(end_of_text.to_string(), true)]);
    tokenizer.to_string(false).map_err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_has_its_own_character_and_printable_ones_stand_for_themselves() {
        let table = byte_characters();
        let distinct: std::collections::HashSet<char> = table.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!((table[b'A' as usize], table[b' ' as usize], table[b'\n' as usize]), ('A', 'Ġ', 'Ċ'));
    }

    #[test]
    fn the_built_in_gpt2_as_tokenizer_json_encodes_as_tiktoken() -> Result<(), TextError> {
        let gpt2 = crate::Tokenizer::gpt2()?;
        let json = gpt2.hugging_face_json()?;
        let dir = tempfile::tempdir().map_err(|e| TextError::Encode { reason: e.to_string() })?;
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json).map_err(|e| TextError::Encode { reason: e.to_string() })?;
        let again = crate::Tokenizer::from_file(&path)?;
        let text = "Hello world! It's naïve — 東京 🙂\n\n  tabs\there 12345";
        assert_eq!(again.encode(text)?, gpt2.encode(text)?);
        assert_eq!((again.vocab_size(), again.end_of_text()), (50257, Some(("<|endoftext|>", 50256))));
        Ok(())
    }
}
