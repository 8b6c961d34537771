//! How far behind the event stream is processed: each heartbeat's delay is
//! its processing time minus its send time on this process's clock (the
//! relay's stamp moved by the relay's learned offset, see
//! [`super::clock_offset`]), i.e. how much later than the relay's fastest
//! heartbeat of the last minutes it was processed. KV events and heartbeats share one
//! ordered stream, so a backlog delays every heartbeat alike; the stream's
//! delay is the least heartbeat delay of the last whole window of
//! processing time, which one relay whose clock drifts cannot raise.
//!
//! | operation | cost |
//! |---|---|
//! | `observe` | O(1) |
//! | `delay_ms` | O(1) |

/// Processing time over which the least heartbeat delay is taken, ms.
pub const WINDOW_MS: u64 = 1000;

/// The stream's delay, judged per window of processing time.
#[derive(Debug, Clone, Default)]
pub struct StreamDelay {
    /// Start of the window being gathered (processing time, ms).
    start_ms: u64,
    /// The least delay seen in it.
    least_ms: Option<u64>,
    /// The least delay of the last whole window that saw a heartbeat.
    judged_ms: u64,
}

impl StreamDelay {
    /// A heartbeat processed at `now_ms`, `delay_ms` after it was sent.
    pub fn observe(&mut self, delay_ms: u64, now_ms: u64) {
        if now_ms.saturating_sub(self.start_ms) >= WINDOW_MS {
            if let Some(least) = self.least_ms {
                self.judged_ms = least;
            }
            self.start_ms = now_ms;
            self.least_ms = None;
        }
        self.least_ms = Some(self.least_ms.map_or(delay_ms, |l| l.min(delay_ms)));
    }

    /// The stream's delay as last judged, ms (0 until a window closes).
    pub fn delay_ms(&self) -> u64 {
        self.judged_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_delay_of_a_closed_window_is_the_streams() {
        let mut d = StreamDelay::default();
        // Window [1000, 2000): one relay's drifting clock says 900 ms, the
        // others 5 and 7.
        for (delay, at) in [(900, 1000), (5, 1300), (7, 1600)] {
            d.observe(delay, at);
        }
        assert_eq!(d.delay_ms(), 0, "the first window is still open");
        d.observe(2000, 2000);
        assert_eq!(d.delay_ms(), 5);
        // A backlog: every heartbeat of the next window late.
        for at in [2300, 2600, 2900] {
            d.observe(1500, at);
        }
        d.observe(1400, 3000);
        assert_eq!(d.delay_ms(), 1500);
    }

    #[test]
    fn a_window_without_heartbeats_keeps_the_last_judgement() {
        let mut d = StreamDelay::default();
        d.observe(800, 1000);
        d.observe(800, 2100);
        assert_eq!(d.delay_ms(), 800);
        // Nothing processed for 5 s, then one heartbeat: the judgement is
        // the window that held the 2100 one.
        d.observe(3, 7200);
        assert_eq!(d.delay_ms(), 800);
        d.observe(3, 8300);
        assert_eq!(d.delay_ms(), 3);
    }
}
