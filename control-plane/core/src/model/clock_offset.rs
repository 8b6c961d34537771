//! A relay's clock offset from this process's clock, learned from its
//! heartbeats' send stamps: the least (processing − send) difference. A
//! backlog only adds to the difference, so the least is the offset plus the
//! quickest delivery. Liveness and the stream's delay read send times moved
//! to this process's clock by it.
//!
//! The least is taken over the current and the previous window of
//! [`WINDOW_MS`] of processing time, so a value is forgotten 5–10 minutes
//! after it was seen (at the second turn of a window after it): a relay clock stepped back (an NTP step) or drifting
//! slow would otherwise read as a delay for ever, and shed every Pick of a
//! fleet of one relay. A relay that restarts (a new epoch, perhaps on
//! another host's clock) starts afresh. The cost: a backlog that lasts longer
//! than a window is, after it, taken for the relay's clock (the stream's
//! delay reads low; liveness compares relays with each other and does not
//! change).
//!
//! | operation | cost |
//! |---|---|
//! | `observe` | O(1) |

/// Processing time per window of the least difference, ms.
pub const WINDOW_MS: u64 = 300_000;

/// One relay's clock offset (ms, this process's clock − the relay's).
#[derive(Debug, Clone, Default)]
pub struct ClockOffset {
    /// The relay's epoch the offset was learned in.
    epoch: u64,
    /// The current window: processing time / [`WINDOW_MS`]. Every relay's
    /// windows turn at the same moments, so a backlog that each absorbs
    /// moves all their offsets alike and leaves liveness, which compares
    /// relays' send times, as it was.
    window: u64,
    /// The least difference of the current window.
    current: Option<i64>,
    /// The least difference of the window before it.
    previous: Option<i64>,
}

impl ClockOffset {
    /// A heartbeat of relay epoch `epoch`, stamped `stamp_ms` by the relay's
    /// clock, processed at `now_ms`. Returns the offset to move its stamps
    /// by.
    pub fn observe(&mut self, epoch: u64, stamp_ms: i64, now_ms: u64) -> i64 {
        let window = now_ms / WINDOW_MS;
        if epoch != self.epoch || self.current.is_none() {
            *self = Self { epoch, window, current: None, previous: None };
        } else if window != self.window {
            // After a whole window without heartbeats nothing is kept.
            self.previous = if self.window.checked_add(1) == Some(window) { self.current } else { None };
            self.current = None;
            self.window = window;
        }
        let sample = i64::try_from(now_ms).unwrap_or(i64::MAX).saturating_sub(stamp_ms);
        let current = self.current.map_or(sample, |c| c.min(sample));
        self.current = Some(current);
        self.previous.map_or(current, |p| p.min(current))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RELAY: i64 = 1_700_000_000_000;

    /// (epoch, the relay's stamp − `RELAY`, processing time, offset − `RELAY`'s).
    fn run(steps: &[(u64, i64, u64, i64)]) {
        let mut o = ClockOffset::default();
        for (i, &(epoch, stamp, now, want)) in steps.iter().enumerate() {
            let got = o.observe(epoch, RELAY + stamp, now) + RELAY;
            assert_eq!(got, want, "step {i}: {:?}", steps[i]);
        }
    }

    #[test]
    fn the_least_difference_is_the_offset_and_a_backlog_does_not_raise_it() {
        // Delivered in 5 ms, then 2 ms, then 3 s behind: the offset stays
        // at the quickest.
        run(&[(1, 0, 5, 5), (1, 1_000, 1_002, 2), (1, 2_000, 5_000, 2), (1, 3_000, 6_000, 2)]);
    }

    #[test]
    fn a_clock_stepped_back_is_forgotten_within_two_windows() {
        let w = WINDOW_MS as i64;
        // The relay's clock steps back 5 s at 1,000 ms: its heartbeats read
        // 5 s late until the 2 ms difference is two windows old.
        run(&[
            (1, 0, 2, 2),
            (1, 1_000 - 5_000, 1_002, 2),
            (1, w - 5_000, w as u64 + 2, 2),
            (1, 2 * w - 5_000, 2 * w as u64 + 1, 5_001),
            (1, 2 * w + 10 - 5_000, 2 * w as u64 + 12, 5_001),
        ]);
    }

    #[test]
    fn a_new_epoch_or_a_long_silence_starts_afresh() {
        let w = WINDOW_MS as i64;
        run(&[
            (1, 0, 2, 2),
            // A restart on a host whose clock is 3 s behind.
            (2, 1_000 - 3_000, 1_010, 3_010),
            (2, 2_000 - 3_000, 2_004, 3_004),
            // Nothing for two windows, then a stamp 1 s further back.
            (2, 2 * w + 3_000 - 4_000, 2 * w as u64 + 3_020, 4_020),
        ]);
    }

    #[test]
    fn no_stamp_overflows() {
        let mut o = ClockOffset::default();
        assert_eq!(o.observe(1, i64::MIN, u64::MAX), i64::MAX);
        assert_eq!(o.observe(1, i64::MAX, 0), -i64::MAX);
    }
}
