//! Session affinity: a session key (the filter's session header) → the
//! worker its conversation was last routed to, for a sliding TTL. A pick
//! keeps a pinned session on its worker unless that worker is gone,
//! excluded or saturated; then the policy chooses and the pin moves with the
//! conversation. Replicas learn each other's pins from the in-flight events
//! they already share.
//!
//! ```text
//! pin(key, worker, now)   key ─▶ (worker, now + ttl); the expiry queue gets (now + ttl, key)
//! get(key, now)           the worker while now < expiry
//! expire(now)             pops the queue's head while due; an entry refreshed since is kept
//! ```
//!
//! | operation | cost |
//! |---|---|
//! | `pin`, `get` | O(1) expected (one hash lookup; `pin` one queue push) |
//! | `expire` | O(entries due), amortized O(1) per `pin` |
//! | memory | ≤ `max` keys; the queue holds one entry per `pin` within a TTL (refreshes of a live key are coalesced: at most one per second per key) |

use std::collections::{HashMap, VecDeque};

use kvgate_index::WorkerIdx;

/// Longest session key kept (bytes); longer keys are ignored (the filter
/// does not forward them either).
pub const MAX_KEY_BYTES: usize = 256;

/// Settings of session affinity, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionConfig {
    /// Off by default: a pin overrides the policy's choice.
    pub enabled: bool,
    /// A session's pin lapses this long after its last request.
    pub ttl_ms: u64,
    /// Most sessions pinned at once; new sessions beyond it are not pinned
    /// (counted) until older ones lapse.
    pub max: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self { enabled: false, ttl_ms: 600_000, max: 1_000_000 }
    }
}

#[derive(Debug, Clone, Copy)]
struct Pin {
    worker: WorkerIdx,
    expires_ms: u64,
    /// Expiry of this key's newest entry in the queue.
    queued_ms: u64,
}

/// The pinned sessions of one model.
#[derive(Debug, Default)]
pub struct Sessions {
    config: SessionConfig,
    pins: HashMap<Box<str>, Pin>,
    queue: VecDeque<(u64, Box<str>)>,
    /// Sessions not pinned because `max` were.
    pub refused: u64,
}

impl Sessions {
    /// An empty table.
    pub fn new(config: SessionConfig) -> Self {
        Self { config, ..Self::default() }
    }

    /// Whether pins are kept and honoured.
    pub fn enabled(&self) -> bool {
        self.config.enabled
    }

    /// Sessions pinned now (some may be due for expiry).
    pub fn len(&self) -> usize {
        self.pins.len()
    }

    /// No session pinned.
    pub fn is_empty(&self) -> bool {
        self.pins.is_empty()
    }

    /// The worker `key` is pinned to, if the pin is live.
    pub fn get(&self, key: &str, now_ms: u64) -> Option<WorkerIdx> {
        if !self.config.enabled || key.is_empty() {
            return None;
        }
        self.pins.get(key).filter(|p| now_ms < p.expires_ms).map(|p| p.worker)
    }

    /// Pins `key` to `worker` until `now + ttl` (a new pin, a refresh or a
    /// move). Ignored when off, for an empty or oversized key, and for a new
    /// key when `max` sessions are pinned.
    pub fn pin(&mut self, key: &str, worker: WorkerIdx, now_ms: u64) {
        if !self.config.enabled || key.is_empty() || key.len() > MAX_KEY_BYTES {
            return;
        }
        self.expire(now_ms);
        let expires_ms = now_ms.saturating_add(self.config.ttl_ms);
        if let Some(p) = self.pins.get_mut(key) {
            p.worker = worker;
            p.expires_ms = expires_ms;
            // One queue entry per second of refreshes is enough: an entry
            // found early is pushed again at the key's current expiry.
            if expires_ms >= p.queued_ms.saturating_add(1000) {
                p.queued_ms = expires_ms;
                self.queue.push_back((expires_ms, key.into()));
            }
            return;
        }
        if self.pins.len() >= self.config.max {
            self.refused += 1;
            return;
        }
        self.pins.insert(key.into(), Pin { worker, expires_ms, queued_ms: expires_ms });
        self.queue.push_back((expires_ms, key.into()));
    }

    /// Drops the pins whose TTL lapsed.
    pub fn expire(&mut self, now_ms: u64) {
        while let Some((due, _)) = self.queue.front() {
            if *due > now_ms {
                break;
            }
            let Some((due, key)) = self.queue.pop_front() else { break };
            match self.pins.get_mut(&key) {
                Some(p) if p.expires_ms <= now_ms => {
                    self.pins.remove(&key);
                }
                // Refreshed since, and its newest queue entry is older than
                // its expiry (coalesced refreshes): queue it again.
                Some(p) if p.queued_ms <= due => {
                    p.queued_ms = p.expires_ms;
                    let at = p.expires_ms;
                    self.queue.push_back((at, key));
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(ttl_ms: u64, max: usize) -> Sessions {
        Sessions::new(SessionConfig { enabled: true, ttl_ms, max })
    }

    #[test]
    fn a_pin_lasts_its_ttl_after_the_last_request() {
        let mut s = on(10_000, 10);
        let w = WorkerIdx(3);
        s.pin("a", w, 0);
        assert_eq!(s.get("a", 9_999), Some(w));
        assert_eq!(s.get("a", 10_000), None);
        // Refreshed at 8 s: lives until 18 s, across the first entry's due time.
        s.pin("a", w, 8_000);
        s.expire(12_000);
        assert_eq!(s.get("a", 17_999), Some(w));
        s.expire(18_000);
        assert!(s.is_empty());
    }

    #[test]
    fn frequent_refreshes_are_coalesced_and_still_expire() {
        let mut s = on(5_000, 10);
        for t in 0..2_000u64 {
            s.pin("k", WorkerIdx(1), t * 10);
        }
        assert!(s.queue.len() <= 5, "one entry per second of refreshes: {}", s.queue.len());
        assert_eq!(s.get("k", 19_990 + 4_999), Some(WorkerIdx(1)));
        s.expire(19_990 + 5_000);
        assert!(s.is_empty() && s.queue.is_empty());
    }

    #[test]
    fn a_move_repins_and_off_ignores_everything() {
        let mut s = on(1_000, 10);
        s.pin("a", WorkerIdx(1), 0);
        s.pin("a", WorkerIdx(2), 10);
        assert_eq!(s.get("a", 20), Some(WorkerIdx(2)));
        let mut off = Sessions::new(SessionConfig { enabled: false, ..SessionConfig::default() });
        off.pin("a", WorkerIdx(1), 0);
        assert_eq!((off.get("a", 1), off.len()), (None, 0));
    }

    #[test]
    fn bounded_empty_and_oversized_keys_are_not_pinned() {
        let mut s = on(1_000, 2);
        s.pin("", WorkerIdx(1), 0);
        s.pin(&"x".repeat(MAX_KEY_BYTES + 1), WorkerIdx(1), 0);
        assert!(s.is_empty());
        s.pin("a", WorkerIdx(1), 0);
        s.pin("b", WorkerIdx(1), 0);
        s.pin("c", WorkerIdx(1), 0);
        assert_eq!((s.len(), s.refused, s.get("c", 1)), (2, 1, None));
        // Once the others lapse there is room again.
        s.pin("c", WorkerIdx(1), 1_000);
        assert_eq!((s.len(), s.get("c", 1_001)), (1, Some(WorkerIdx(1))));
    }
}
