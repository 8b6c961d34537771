//! DeepSeek-V3's three split regexes on plain ASCII text, without a regex
//! engine: the pieces Oniguruma gives for
//!
//! 0. `\p{N}{1,3}`
//! 1. `[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+`
//! 2. `[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
//!
//! applied in turn as `Split` stages with behaviour `Isolated` (each stage
//! splits every piece of the one before into matches and the text between
//! them).
//!
//! # Why
//!
//! The regex engine was the largest share of the control plane's CPU left in
//! tokenizing a new chat turn (~12 % of the process in the DOKS profile),
//! and a chat turn is mostly plain ASCII.
//!
//! # Where it applies
//!
//! Only to text whose every byte is printable ASCII, tab, line feed or
//! carriage return ([`covered`]). On that alphabet the Unicode classes are
//! small and certain: `\p{N}` is `0-9`, `\p{L}` is `A-Za-z`, `\p{M}` and the
//! CJK ranges are empty, `\p{P}` ∪ `\p{S}` is ASCII punctuation (all 32), and
//! `\s` is space, tab, LF and CR. Any other byte (another control character,
//! any non-ASCII character) and the caller uses the regex engine.
//!
//! # Algorithm
//!
//! Stage 0 cuts runs of digits into groups of three from the left; stage 1
//! matches nothing; stage 2 tries, at each position from the left, the
//! alternatives in order, each with the result its backtracking gives:
//! `\s*[\r\n]+` ends after the last line break of the whitespace run,
//! `\s+(?!\S)` is the run less its last character when a non-space follows
//! (the whole run at the end of the text), `\s+` the whole run.
//! Equality with Oniguruma is tested exhaustively on short strings over a
//! representative alphabet and on generated long ones.
//!
//! # Complexity
//!
//! O(text): each byte is looked at a bounded number of times (a whitespace
//! run twice).

/// Whether the scanner covers `text`: printable ASCII, tab, LF, CR only.
pub fn covered(text: &str) -> bool {
    text.bytes().all(|b| (0x20..0x7f).contains(&b) || matches!(b, b'\t' | b'\n' | b'\r'))
}

/// Calls `piece` with each piece of `text` (which must be [`covered`]) in
/// order, as the three stages give them; empty pieces are never passed.
pub fn split(text: &str, piece: &mut dyn FnMut(&str)) {
    // Stage 1 matches nothing in ASCII, so each piece of stage 0 goes to
    // stage 2 as it is.
    isolate(text, digit_group, &mut |p| isolate(p, match_at, piece));
}

/// One `Isolated` split stage: `matcher(bytes, i)` is the end of the match
/// starting at `i`, if one does (leftmost first, never empty); the matches
/// and the text between them go to `piece` in order.
fn isolate(text: &str, matcher: fn(&[u8], usize) -> Option<usize>, piece: &mut dyn FnMut(&str)) {
    let b = text.as_bytes();
    let mut at = 0;
    let mut i = 0;
    while i < b.len() {
        match matcher(b, i) {
            Some(end) => {
                if i > at {
                    piece(text.get(at..i).unwrap_or_default());
                }
                piece(text.get(i..end).unwrap_or_default());
                at = end;
                i = end;
            }
            None => i += 1,
        }
    }
    if at < b.len() {
        piece(text.get(at..).unwrap_or_default());
    }
}

/// Stage 0, `\p{N}{1,3}`: up to three digits.
fn digit_group(b: &[u8], i: usize) -> Option<usize> {
    let digits = b.iter().skip(i).take(3).take_while(|c| c.is_ascii_digit()).count();
    (digits > 0).then_some(i + digits)
}

fn letter(c: Option<u8>) -> bool {
    c.is_some_and(|c| c.is_ascii_alphabetic())
}

fn punct(c: Option<u8>) -> bool {
    c.is_some_and(|c| c.is_ascii_punctuation())
}

fn space(c: Option<u8>) -> bool {
    matches!(c, Some(b' ' | b'\t' | b'\n' | b'\r'))
}

fn line_break(c: Option<u8>) -> bool {
    matches!(c, Some(b'\n' | b'\r'))
}

/// The end of the match of stage 2's regex that starts at `i`, if one does.
fn match_at(b: &[u8], i: usize) -> Option<usize> {
    let at = |k: usize| b.get(k).copied();
    let run = |mut k: usize, class: fn(Option<u8>) -> bool| {
        while class(at(k)) {
            k += 1;
        }
        k
    };
    let c = at(i);
    // [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+
    if punct(c) && letter(at(i + 1)) {
        return Some(run(i + 1, letter));
    }
    // [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+ : the optional character is a
    // digit, space or tab here; without it, a letter run.
    if matches!(c, Some(b'0'..=b'9' | b' ' | b'\t')) && letter(at(i + 1)) {
        return Some(run(i + 1, letter));
    }
    if letter(c) {
        return Some(run(i, letter));
    }
    //  ?[\p{P}\p{S}]+[\r\n]*
    let p = if c == Some(b' ') && punct(at(i + 1)) { i + 1 } else { i };
    if punct(at(p)) {
        return Some(run(run(p, punct), line_break));
    }
    let w = run(i, space);
    if w == i {
        return None;
    }
    // \s*[\r\n]+ : \s* gives back up to the run's last line break.
    if let Some(last) = (i..w).rev().find(|&k| line_break(at(k))) {
        return Some(last + 1);
    }
    // \s+(?!\S), then \s+.
    if w == b.len() || w - i == 1 { Some(w) } else { Some(w - 1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATTERNS: [&str; 3] = [
        "\\p{N}{1,3}",
        "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ];

    /// The pieces Oniguruma gives (the reference: the encoder's own
    /// regex path).
    fn reference(res: &[onig::Regex], level: usize, text: &str, out: &mut Vec<String>) {
        crate::fast::split_with(res, level, text, &mut |p| out.push(p.to_owned()));
    }

    fn ours(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        split(text, &mut |p| out.push(p.to_owned()));
        out
    }

    fn regexes() -> Vec<onig::Regex> {
        PATTERNS.iter().map(|p| onig::Regex::new(p).unwrap()).collect()
    }

    #[test]
    fn the_patterns_are_the_ones_the_encoder_recognizes() {
        assert_eq!(PATTERNS, crate::fast::PARAGRAPH_SAFE_SPLITS);
    }

    #[test]
    fn the_alphabet_is_printable_ascii_tab_and_line_breaks() {
        assert!(covered("Hello, world!\n\tx = 1;\r\n~"));
        assert!(!covered("caf\u{e9}"));
        assert!(!covered("a\u{b}b"));
        assert!(!covered("\u{0}"));
        assert!(!covered("\u{7f}"));
    }

    /// Every string of up to five characters over an alphabet with one of
    /// each class the regexes tell apart (and the pairs that matter: space
    /// and tab, LF and CR, two letters and digits for runs).
    #[test]
    fn short_strings_split_as_oniguruma_splits_them() {
        let res = regexes();
        let alphabet: Vec<char> = "aZ0 \t\n\r.$_".chars().collect();
        let mut s = String::new();
        let mut checked = 0;
        fn go(res: &[onig::Regex], alphabet: &[char], s: &mut String, left: usize, checked: &mut usize) {
            let mut want = Vec::new();
            reference(res, 0, s, &mut want);
            assert_eq!(ours(s), want, "{s:?}");
            *checked += 1;
            if left == 0 {
                return;
            }
            for &c in alphabet {
                s.push(c);
                go(res, alphabet, s, left - 1, checked);
                s.pop();
            }
        }
        go(&res, &alphabet, &mut s, 5, &mut checked);
        assert!(checked > 100_000, "{checked}");
    }

    /// Every covered character alone, after a letter, after a space and
    /// before a letter: each class boundary of all 98 characters.
    #[test]
    fn each_covered_character_splits_as_oniguruma_splits_it() {
        let res = regexes();
        let chars: Vec<char> = (0x20u8..0x7f).chain([b'\t', b'\n', b'\r']).map(char::from).collect();
        for &c in &chars {
            for s in [
                format!("{c}"),
                format!("a{c}"),
                format!(" {c}"),
                format!("{c}a"),
                format!("{c}{c}a"),
                format!("1{c}1"),
            ] {
                let mut want = Vec::new();
                reference(&res, 0, &s, &mut want);
                assert_eq!(ours(&s), want, "{s:?}");
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]
        /// Long mixed text: words, numbers, code, markdown, whitespace runs.
        #[test]
        fn long_text_splits_as_oniguruma_splits_it(
            parts in proptest::collection::vec(proptest::prop_oneof![
                "[a-zA-Z]{1,12}",
                "[0-9]{1,9}",
                "[ \t]{1,6}",
                "[\r\n]{1,3}",
                "[ \t\r\n]{1,8}",
                "[!-/:-@\\[-`{-~]{1,4}",
                "[ -~]{1,20}",
            ], 0..40)
        ) {
            let text: String = parts.concat();
            let mut want = Vec::new();
            reference(&regexes(), 0, &text, &mut want);
            proptest::prop_assert_eq!(ours(&text), want, "{:?}", text);
        }
    }
}
