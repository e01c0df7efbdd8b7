//! Words for syntax errors: what the parser expected where it stopped, what it found there, and the
//! unclosed bracket or malformed number that most likely caused it. No grammar rule name reaches the user.

use optimus_plan::span::Span;

/// Keywords in the order they are listed to the user.
const KEYWORDS: [&str; 9] = ["model", "config", "input", "block", "layer", "forward", "repeat", "output", "return"];
/// Punctuation in the order it is listed to the user.
const PUNCTUATION: [&str; 10] = [")", "]", "}", ",", "=", ":", "(", "[", "{", "\""];

/// What the parser would have accepted at one position, grouped into things a user recognises.
#[derive(Default)]
struct Wanted {
    punctuation: Vec<String>,
    keywords: Vec<String>,
    operator: bool,
    minus: bool,
    paren: bool,
    bracket: bool,
    string_or_bool: bool,
    number: bool,
    name: bool,
}

impl Wanted {
    /// Records one literal the grammar tried; `in_word` drops characters that would only extend the previous token.
    fn literal(&mut self, token: &str, in_word: bool) {
        match token {
            " " | "\t" | "\r" | "\n" | "#" | ";" => {}
            "+" | "*" | "/" => self.operator = true,
            "-" => self.minus = true,
            "(" => self.paren = true,
            "[" => self.bracket = true,
            "\"" | "true" | "false" => self.string_or_bool = true,
            "_" if !in_word => self.name = true,
            "." | "e" | "E" | "_" => {}
            t if KEYWORDS.contains(&t) => push_unique(&mut self.keywords, t),
            t => push_unique(&mut self.punctuation, t),
        }
    }

    fn range(&mut self, start: char, in_word: bool) {
        if in_word {
            return;
        }
        if start.is_ascii_digit() {
            self.number = true;
        } else {
            self.name = true;
        }
    }

    /// The phrases, most specific first: punctuation, operators, then expressions, names and keywords.
    fn phrases(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let expression = self.string_or_bool || (self.number && self.name);
        let mut punctuation: Vec<&String> = self.punctuation.iter().collect();
        punctuation.sort_by_key(|p| PUNCTUATION.iter().position(|q| q == p).unwrap_or(PUNCTUATION.len()));
        out.extend(punctuation.iter().map(|p| format!("`{p}`")));
        if self.paren && !expression {
            out.push("`(`".to_string());
        }
        if self.bracket && !expression {
            out.push("`[`".to_string());
        }
        if self.operator || (self.minus && !expression) {
            out.push("an operator".to_string());
        }
        let statement = self.keywords.iter().any(|k| k == "output" || k == "return");
        if expression {
            out.push("an expression".to_string());
        } else if statement {
            out.push("a statement (`name = ...`, `output name = ...` or `return ...`)".to_string());
        } else {
            if self.number {
                out.push("a number".to_string());
            }
            if self.name {
                out.push("a name".to_string());
            }
        }
        let mut keywords: Vec<&String> =
            self.keywords.iter().filter(|k| !(statement && (*k == "output" || *k == "return"))).collect();
        keywords.sort_by_key(|k| KEYWORDS.iter().position(|q| q == k).unwrap_or(KEYWORDS.len()));
        out.extend(keywords.iter().map(|k| format!("`{k}`")));
        out
    }
}

fn push_unique(list: &mut Vec<String>, item: &str) {
    if !list.iter().any(|i| i == item) {
        list.push(item.to_string());
    }
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Describes the tokens the grammar tried at `pos` as phrases ("`)`", "an operator", "a name").
///
/// `tokens` are pest's expected tokens as displayed: a literal as itself, a character range as `a..z`.
pub(super) fn expected_phrases(source: &str, pos: usize, tokens: &[String]) -> Vec<String> {
    let before = source.get(..pos).unwrap_or(source);
    let in_word = before.chars().next_back().is_some_and(|c| is_word_char(c) || c == '.');
    let phrases = collect(tokens, in_word);
    // After a keyword the only candidates may look like its continuation (`model` then the end of the file);
    // inside an atomic rule they are just that, and the caller falls back to the rule names.
    if phrases.is_empty() && in_word && ends_with_keyword(before) { collect(tokens, false) } else { phrases }
}

/// Whether the text ends with a whole keyword such as `model`.
fn ends_with_keyword(before: &str) -> bool {
    let start = before.rfind(|c: char| !is_word_char(c)).map_or(0, |i| i + 1);
    KEYWORDS.contains(&&before[start..])
}

fn collect(tokens: &[String], in_word: bool) -> Vec<String> {
    let mut wanted = Wanted::default();
    for token in tokens {
        match range_start(token) {
            Some(start) => wanted.range(start, in_word),
            None if token == "BUILTIN_RULE" => {}
            None => wanted.literal(token, in_word),
        }
    }
    wanted.phrases()
}

/// The first character of a displayed character range such as `a..z`.
fn range_start(token: &str) -> Option<char> {
    let mut chars = token.chars();
    let (start, dot1, dot2, _end) = (chars.next()?, chars.next()?, chars.next()?, chars.next()?);
    (dot1 == '.' && dot2 == '.' && chars.next().is_none()).then_some(start)
}

/// Joins phrases as a list: "`,`, `)` or an operator".
pub(super) fn join_phrases(phrases: &[String]) -> String {
    match phrases {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

/// What is at `pos`, for "found ...": a word, one character, the end of the line or of the file.
pub(super) struct Found {
    pub span: Span,
    pub text: String,
    /// Whether it is the end of the line or of the file.
    pub at_end: bool,
    /// The character found, if it is a single non-word character.
    pub symbol: Option<char>,
}

/// Describes the text at a byte offset, skipping spaces (but not line breaks). At the end of the file, the
/// span is moved back to just after the last token, where the missing text belongs.
pub(super) fn found_at(source: &str, pos: usize) -> Found {
    let rest = source.get(pos..).unwrap_or("");
    let skipped = rest.len() - rest.trim_start_matches([' ', '\t', '\r']).len();
    let at = pos + skipped;
    let rest = &rest[skipped..];
    match rest.chars().next() {
        None => {
            let end = trimmed_len(source.get(..pos).unwrap_or(source));
            Found { span: Span::new(end, end), text: "the end of the file".to_string(), at_end: true, symbol: None }
        }
        Some('\n') => {
            Found { span: Span::new(at, at), text: "the end of the line".to_string(), at_end: true, symbol: None }
        }
        Some(c) if is_word_char(c) => {
            let len = rest.find(|c: char| !is_word_char(c)).unwrap_or(rest.len());
            let word = &rest[..len];
            let shown = if word.len() > 40 { format!("{}...", &word[..37]) } else { word.to_string() };
            Found { span: Span::new(at, at + len), text: format!("`{shown}`"), at_end: false, symbol: None }
        }
        Some(c) => {
            let text = if c.is_control() { format!("the character {}", c.escape_default()) } else { format!("`{c}`") };
            Found { span: Span::new(at, at + c.len_utf8()), text, at_end: false, symbol: Some(c) }
        }
    }
}

/// Open brackets and strings at a position, found by scanning the text before it.
pub(super) struct Open {
    /// Unclosed `(`, `[` and `{`, innermost last, with their offsets.
    pub brackets: Vec<(usize, char)>,
    /// Offset of the opening quote of a string that is still open.
    pub string: Option<usize>,
}

/// Scans `source[..pos]` for brackets and strings that are still open, skipping comments.
pub(super) fn open_at(source: &str, pos: usize) -> Open {
    let mut open = Open { brackets: Vec::new(), string: None };
    let mut in_comment = false;
    for (i, c) in source.get(..pos).unwrap_or(source).char_indices() {
        if in_comment {
            in_comment = c != '\n';
        } else if open.string.is_some() {
            if c == '"' || c == '\n' {
                open.string = None;
            }
        } else {
            match c {
                '#' => in_comment = true,
                '"' => open.string = Some(i),
                '(' | '[' | '{' => open.brackets.push((i, c)),
                ')' | ']' | '}' => {
                    open.brackets.pop();
                }
                _ => {}
            }
        }
    }
    open
}

/// The closing bracket for an opening one.
pub(super) fn closer(open: char) -> char {
    match open {
        '(' => ')',
        '[' => ']',
        _ => '}',
    }
}

/// A number literal that the grammar cannot read (`1e`, `1.2.3`, `3x`), with its span.
pub(super) struct BadNumber {
    pub span: Span,
    pub text: String,
}

/// The malformed number nearest before `pos` that could explain a syntax error there, if any.
pub(super) fn malformed_number(source: &str, pos: usize) -> Option<BadNumber> {
    let bytes = source.as_bytes();
    let limit = pos.min(bytes.len());
    let mut best = None;
    let mut i = 0;
    let mut in_comment = false;
    let mut in_string = false;
    while i < limit {
        let b = bytes[i];
        if in_comment || in_string {
            in_comment &= b != b'\n';
            in_string &= b != b'"' && b != b'\n';
            i += 1;
            continue;
        }
        let starts_number = b.is_ascii_digit() && (i == 0 || !is_word_byte(bytes[i - 1]));
        match b {
            b'#' => in_comment = true,
            b'"' => in_string = true,
            _ if starts_number => {
                let (end, bad) = lex_number(bytes, i);
                if bad {
                    best = Some((i, end));
                }
                i = end;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    let (start, end) = best?;
    let gap = source.get(end.min(pos)..pos).unwrap_or("");
    let nearby = !gap.contains('\n') || gap.chars().all(char::is_whitespace);
    nearby.then(|| BadNumber { span: Span::new(start, end), text: source[start..end].to_string() })
}

fn is_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'.'
}

/// Reads a number as the grammar does; returns where the word ends and whether it is malformed.
fn lex_number(bytes: &[u8], start: usize) -> (usize, bool) {
    let digits = |mut i: usize, underscore: bool| {
        while i < bytes.len() && (bytes[i].is_ascii_digit() || (underscore && bytes[i] == b'_')) {
            i += 1;
        }
        i
    };
    let mut i = digits(start, true);
    let plain = !bytes[start..i].contains(&b'_');
    if plain && bytes.get(i) == Some(&b'.') && bytes.get(i + 1).is_some_and(u8::is_ascii_digit) {
        i = digits(i + 1, false);
    }
    if plain && matches!(bytes.get(i), Some(b'e' | b'E')) {
        let sign = usize::from(matches!(bytes.get(i + 1), Some(b'+' | b'-')));
        if bytes.get(i + 1 + sign).is_some_and(u8::is_ascii_digit) {
            i = digits(i + 1 + sign, false);
        }
    }
    if !bytes.get(i).is_some_and(|b| is_word_byte(*b)) {
        return (i, false);
    }
    let mut end = i;
    while end < bytes.len() && is_word_byte(bytes[end]) {
        end += 1;
    }
    (end, true)
}

/// The end of a piece of source text without the whitespace and comments pest lets trail a rule.
pub(super) fn trimmed_len(text: &str) -> usize {
    let mut end = 0;
    let mut in_comment = false;
    let mut in_string = false;
    for (i, c) in text.char_indices() {
        if in_comment {
            in_comment = c != '\n';
            continue;
        }
        if in_string {
            in_string = c != '"' && c != '\n';
        } else if c == '#' {
            in_comment = true;
            continue;
        } else if c == '"' {
            in_string = true;
        } else if c.is_whitespace() {
            continue;
        }
        end = i + c.len_utf8();
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_trailing_space_and_comments() {
        assert_eq!(trimmed_len("a = 1  # one\n  "), 5);
        assert_eq!(trimmed_len("\"a # b\"  "), 7);
        assert_eq!(trimmed_len("x"), 1);
    }

    #[test]
    fn finds_malformed_numbers() {
        let bad = |s: &str| malformed_number(s, s.len()).map(|b| b.text);
        assert_eq!(bad("a = 1e }"), Some("1e".to_string()));
        assert_eq!(bad("a = 1.2.3"), Some("1.2.3".to_string()));
        assert_eq!(bad("a = 1_000.5"), Some("1_000.5".to_string()));
        assert_eq!(bad("a = 1e-5 + 2.5 + 3_000 + ln_1"), None);
        assert_eq!(bad("# 1x\nb = \"2y\""), None);
    }

    #[test]
    fn finds_open_brackets() {
        let open = open_at("f(a, [1, 2], \"(\" # (\n", 21);
        assert_eq!(open.brackets, vec![(1, '(')]);
        assert_eq!(open.string, None);
    }
}
