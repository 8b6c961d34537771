//! NATS subjects (ARCHITECTURE §5).
//!
//! | subject | payload | publisher → subscriber |
//! |---|---|---|
//! | `<prefix>.kv.<model>.<worker>` | `KvEventBatch` | relay → control planes |
//! | `<prefix>.hb.<model>.<worker>` | `WorkerHeartbeat` | relay → control planes |
//! | `<prefix>.snap.<model>.<worker>` | `SnapshotRequest` → `SnapshotChunk`s on the reply inbox | control plane → relay |
//! | `<prefix>.inflight.<model>` | `InflightBatch` | control plane ↔ control planes |
//!
//! The prefix defaults to [`DEFAULT_PREFIX`] (`kvgate.v1`); a different one
//! lets several kvgate installations share a NATS cluster.
//!
//! ## Encoding names into tokens
//!
//! Model names contain `/` and `.` (`meta-llama/Llama-3.1-70B-Instruct`), and
//! worker ids contain `.` and `:` (`10.0.0.7:8000`); `.` separates subject
//! tokens and `*`, `>` and white space are special. [`encode_token`] keeps
//! `A–Z a–z 0–9 -` and writes every other byte of the UTF-8 name as `_`
//! followed by two upper-case hex digits (`_` itself is `_5F`); the empty name
//! is the token `_`. The encoding is injective and [`decode_token`] inverts
//! it, rejecting any token `encode_token` cannot produce, so every name has
//! exactly one subject. Example: `meta-llama/Llama-3.1-70B` →
//! `meta-llama_2FLlama-3_2E1-70B`.
//!
//! Cost: O(len(name)) per encode or decode; one allocation per subject.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

/// The default subject prefix.
pub const DEFAULT_PREFIX: &str = "kvgate.v1";

/// What went wrong with a subject, token or prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubjectError {
    /// The prefix is empty, has an empty token or a character outside
    /// `A–Z a–z 0–9 - _`.
    BadPrefix(String),
    /// A token that [`encode_token`] cannot produce.
    BadToken(String),
    /// The subject does not start with this namespace's prefix.
    WrongPrefix(String),
    /// The subject names no kind this module knows, or has the wrong number
    /// of tokens for its kind.
    UnknownShape(String),
}

impl fmt::Display for SubjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadPrefix(p) => write!(
                f,
                "subject prefix {p:?} is invalid: it must be dot-separated non-empty tokens of A-Z a-z 0-9 - _"
            ),
            Self::BadToken(t) => write!(f, "subject token {t:?} is not a valid encoded name"),
            Self::WrongPrefix(s) => write!(f, "subject {s:?} is outside this kvgate prefix"),
            Self::UnknownShape(s) => write!(f, "subject {s:?} is not a kvgate subject"),
        }
    }
}

impl core::error::Error for SubjectError {}

fn passes_through(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-'
}

/// Appends the subject token for `name` to `out`.
pub fn encode_token_into(name: &str, out: &mut String) {
    if name.is_empty() {
        out.push('_');
        return;
    }
    for &b in name.as_bytes() {
        if passes_through(b) {
            out.push(char::from(b));
        } else {
            out.push('_');
            out.push(hex_digit(b >> 4));
            out.push(hex_digit(b & 0x0F));
        }
    }
}

/// The subject token for `name`.
pub fn encode_token(name: &str) -> String {
    let mut s = String::with_capacity(name.len() + 8);
    encode_token_into(name, &mut s);
    s
}

/// Upper-case hex digit of a nibble (`n < 16`).
fn hex_digit(n: u8) -> char {
    char::from_digit(u32::from(n), 16).unwrap_or('0').to_ascii_uppercase()
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// The name a token encodes; an error for any token [`encode_token`] cannot
/// produce (lower-case hex, an escaped pass-through byte, invalid UTF-8, ...).
pub fn decode_token(token: &str) -> Result<String, SubjectError> {
    let bad = || SubjectError::BadToken(String::from(token));
    if token == "_" {
        return Ok(String::new());
    }
    if token.is_empty() {
        return Err(bad());
    }
    let mut bytes = Vec::with_capacity(token.len());
    let mut it = token.bytes();
    while let Some(b) = it.next() {
        if passes_through(b) {
            bytes.push(b);
        } else if b == b'_' {
            let hi = it.next().and_then(hex_value).ok_or_else(bad)?;
            let lo = it.next().and_then(hex_value).ok_or_else(bad)?;
            let v = (hi << 4) | lo;
            if passes_through(v) {
                return Err(bad());
            }
            bytes.push(v);
        } else {
            return Err(bad());
        }
    }
    String::from_utf8(bytes).map_err(|_| bad())
}

/// What a subject is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SubjectKind {
    /// `KvEventBatch` of one worker.
    KvEvents,
    /// `WorkerHeartbeat` of one worker.
    Heartbeat,
    /// `SnapshotRequest` to one worker's relay.
    Snapshot,
    /// `InflightBatch` of one model.
    Inflight,
}

impl SubjectKind {
    /// The subject token of this kind.
    pub const fn token(self) -> &'static str {
        match self {
            Self::KvEvents => "kv",
            Self::Heartbeat => "hb",
            Self::Snapshot => "snap",
            Self::Inflight => "inflight",
        }
    }

    fn from_token(t: &str) -> Option<Self> {
        match t {
            "kv" => Some(Self::KvEvents),
            "hb" => Some(Self::Heartbeat),
            "snap" => Some(Self::Snapshot),
            "inflight" => Some(Self::Inflight),
            _ => None,
        }
    }

    /// Whether subjects of this kind end with a worker token.
    pub const fn has_worker(self) -> bool {
        !matches!(self, Self::Inflight)
    }
}

/// A subject taken apart by [`Subjects::parse`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedSubject {
    /// What the subject is for.
    pub kind: SubjectKind,
    /// The decoded model name.
    pub model: String,
    /// The decoded worker id (kinds with a worker only).
    pub worker: Option<String>,
}

/// Builds and parses the subjects of one kvgate namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
}

impl Default for Subjects {
    fn default() -> Self {
        Self { prefix: String::from(DEFAULT_PREFIX) }
    }
}

impl Subjects {
    /// A namespace under `prefix` (dot-separated tokens of `A–Z a–z 0–9 - _`).
    pub fn new(prefix: &str) -> Result<Self, SubjectError> {
        let ok = !prefix.is_empty()
            && prefix
                .split('.')
                .all(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        if ok { Ok(Self { prefix: String::from(prefix) }) } else { Err(SubjectError::BadPrefix(String::from(prefix))) }
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn build(&self, kind: SubjectKind, model: Option<&str>, worker: Option<&str>, tail: Option<&str>) -> String {
        let mut s = String::with_capacity(self.prefix.len() + 64);
        s.push_str(&self.prefix);
        s.push('.');
        s.push_str(kind.token());
        if let Some(m) = model {
            s.push('.');
            encode_token_into(m, &mut s);
        }
        if let Some(w) = worker {
            s.push('.');
            encode_token_into(w, &mut s);
        }
        if let Some(t) = tail {
            s.push('.');
            s.push_str(t);
        }
        s
    }

    /// Subject of one worker's subjects of `kind` (not for [`SubjectKind::Inflight`],
    /// which has no worker: use [`Subjects::inflight`]).
    pub fn worker_subject(&self, kind: SubjectKind, model: &str, worker: &str) -> String {
        self.build(kind, Some(model), kind.has_worker().then_some(worker), None)
    }

    /// `<prefix>.kv.<model>.<worker>`.
    pub fn kv_events(&self, model: &str, worker: &str) -> String {
        self.worker_subject(SubjectKind::KvEvents, model, worker)
    }

    /// `<prefix>.hb.<model>.<worker>`.
    pub fn heartbeat(&self, model: &str, worker: &str) -> String {
        self.worker_subject(SubjectKind::Heartbeat, model, worker)
    }

    /// `<prefix>.snap.<model>.<worker>`.
    pub fn snapshot(&self, model: &str, worker: &str) -> String {
        self.worker_subject(SubjectKind::Snapshot, model, worker)
    }

    /// `<prefix>.inflight.<model>`.
    pub fn inflight(&self, model: &str) -> String {
        self.build(SubjectKind::Inflight, Some(model), None, None)
    }

    /// Wildcard for every subject of `kind`, all models: `<prefix>.<kind>.>`.
    pub fn all(&self, kind: SubjectKind) -> String {
        self.build(kind, None, None, Some(">"))
    }

    /// Wildcard for every subject of `kind` for one model:
    /// `<prefix>.<kind>.<model>.*` (or the exact subject for `Inflight`).
    pub fn model(&self, kind: SubjectKind, model: &str) -> String {
        self.build(kind, Some(model), None, kind.has_worker().then_some("*"))
    }

    /// Takes a concrete subject of this namespace apart.
    pub fn parse(&self, subject: &str) -> Result<ParsedSubject, SubjectError> {
        let rest = subject
            .strip_prefix(self.prefix.as_str())
            .and_then(|r| r.strip_prefix('.'))
            .ok_or_else(|| SubjectError::WrongPrefix(String::from(subject)))?;
        let shape = || SubjectError::UnknownShape(String::from(subject));
        let mut parts = rest.split('.');
        let kind = parts.next().and_then(SubjectKind::from_token).ok_or_else(shape)?;
        let model = decode_token(parts.next().ok_or_else(shape)?)?;
        let worker = if kind.has_worker() { Some(decode_token(parts.next().ok_or_else(shape)?)?) } else { None };
        if parts.next().is_some() {
            return Err(shape());
        }
        Ok(ParsedSubject { kind, model, worker })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn examples() {
        assert_eq!(encode_token("meta-llama/Llama-3.1-70B"), "meta-llama_2FLlama-3_2E1-70B");
        assert_eq!(encode_token("10.0.0.7:8000"), "10_2E0_2E0_2E7_3A8000");
        assert_eq!(encode_token(""), "_");
        assert_eq!(encode_token("a_b"), "a_5Fb");
        assert_eq!(encode_token("é"), "_C3_A9");
        let s = Subjects::default();
        assert_eq!(s.kv_events("m/x", "w"), "kvgate.v1.kv.m_2Fx.w");
        assert_eq!(s.heartbeat("m", "w"), "kvgate.v1.hb.m.w");
        assert_eq!(s.snapshot("m", "w"), "kvgate.v1.snap.m.w");
        assert_eq!(s.inflight("m.1"), "kvgate.v1.inflight.m_2E1");
        assert_eq!(s.all(SubjectKind::KvEvents), "kvgate.v1.kv.>");
        assert_eq!(s.model(SubjectKind::Heartbeat, "m"), "kvgate.v1.hb.m.*");
        assert_eq!(s.model(SubjectKind::Inflight, "m"), "kvgate.v1.inflight.m");
    }

    #[test]
    fn rejects_non_canonical_tokens() {
        for t in ["", "_41", "_2f", "_2", "a.b", "a*", "a>", "a b", "_FF", "x_"] {
            assert!(decode_token(t).is_err(), "{t:?} must be rejected");
        }
    }

    #[test]
    fn prefixes_are_validated() {
        assert!(Subjects::new("acme.kvgate").is_ok());
        for p in ["", ".", "a..b", "a.", "a b", "a.*", "a.>"] {
            assert_eq!(Subjects::new(p), Err(SubjectError::BadPrefix(p.into())));
        }
    }

    #[test]
    fn parse_rejects_foreign_subjects() {
        let s = Subjects::default();
        assert!(matches!(s.parse("other.kv.m.w"), Err(SubjectError::WrongPrefix(_))));
        assert!(matches!(s.parse("kvgate.v1.zz.m.w"), Err(SubjectError::UnknownShape(_))));
        assert!(matches!(s.parse("kvgate.v1.kv.m"), Err(SubjectError::UnknownShape(_))));
        assert!(matches!(s.parse("kvgate.v1.kv.m.w.x"), Err(SubjectError::UnknownShape(_))));
        assert!(matches!(s.parse("kvgate.v1.inflight.m.w"), Err(SubjectError::UnknownShape(_))));
        assert!(matches!(s.parse("kvgate.v1.kv.m._41"), Err(SubjectError::BadToken(_))));
        assert!(matches!(s.parse("kvgate.v1x.kv.m.w"), Err(SubjectError::WrongPrefix(_))));
    }

    proptest! {
        #[test]
        fn token_roundtrip_and_charset(name in ".{0,40}") {
            let t = encode_token(&name);
            prop_assert!(!t.is_empty());
            prop_assert!(t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
            prop_assert_eq!(decode_token(&t).unwrap(), name);
        }

        #[test]
        fn encoding_is_injective(a in ".{0,12}", b in ".{0,12}") {
            prop_assert_eq!(a == b, encode_token(&a) == encode_token(&b));
        }

        #[test]
        fn decode_never_panics_and_roundtrips(t in "[A-Za-z0-9_.*> -]{0,16}") {
            if let Ok(name) = decode_token(&t) {
                prop_assert_eq!(encode_token(&name), t);
            }
        }

        #[test]
        fn subjects_roundtrip(model in ".{0,20}", worker in ".{0,20}") {
            let s = Subjects::new("acme.kv-gate").unwrap();
            for kind in [SubjectKind::KvEvents, SubjectKind::Heartbeat, SubjectKind::Snapshot] {
                let subj = s.worker_subject(kind, &model, &worker);
                prop_assert_eq!(subj.split('.').count(), 5);
                let p = s.parse(&subj).unwrap();
                prop_assert_eq!(p, ParsedSubject { kind, model: model.clone(), worker: Some(worker.clone()) });
            }
            let p = s.parse(&s.inflight(&model)).unwrap();
            prop_assert_eq!(p, ParsedSubject { kind: SubjectKind::Inflight, model: model.clone(), worker: None });
        }
    }
}
