//! The engine's health from the relay's probes (its `/health`, and its
//! `/metrics` scrape), as a small state machine with no clock of its own.
//!
//! | state | entered when | the control plane |
//! |---|---|---|
//! | `Unknown` | nothing probed yet | routes on heartbeats alone |
//! | `Healthy` | a probe succeeded | routes |
//! | `Unhealthy` | a probe failed | no new request; blocks kept |
//! | `Down` | probes failed for `down_after_ms` without a success | no new request; the relay cleared its mirror |
//!
//! A change of state is reported so that the runtime sends a heartbeat at
//! once instead of at its next tick: a killed engine leaves rotation within
//! one probe interval (plus the probe's own timeout for a hung one).

/// The engine's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Not probed yet (or no probe configured).
    Unknown,
    /// The last probe succeeded.
    Healthy,
    /// The last probe failed; not yet for long.
    Unhealthy,
    /// Probes have failed for the whole `down_after_ms`.
    Down,
}

impl Health {
    /// The wire value.
    pub fn to_pb(self) -> kvgate_protocol::pb::EngineHealth {
        use kvgate_protocol::pb::EngineHealth as E;
        match self {
            Health::Unknown => E::Unspecified,
            Health::Healthy => E::Healthy,
            Health::Unhealthy => E::Unhealthy,
            Health::Down => E::Down,
        }
    }
}

/// What one probe result changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Same state as before.
    None,
    /// A new state (send a heartbeat now).
    To(Health),
}

/// Tracks probe results.
#[derive(Debug, Clone)]
pub struct HealthTracker {
    state: Health,
    failing_since_ms: Option<u64>,
    failures: u32,
    down_after_ms: u64,
}

impl HealthTracker {
    /// A tracker that declares the engine down after `down_after_ms` of
    /// failed probes with no success in between.
    pub fn new(down_after_ms: u64) -> Self {
        Self { state: Health::Unknown, failing_since_ms: None, failures: 0, down_after_ms }
    }

    /// The current state.
    pub fn state(&self) -> Health {
        self.state
    }

    /// Consecutive failed probes.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// One probe's result at `now_ms`.
    pub fn on_probe(&mut self, ok: bool, now_ms: u64) -> Change {
        let next = if ok {
            self.failing_since_ms = None;
            self.failures = 0;
            Health::Healthy
        } else {
            self.failures = self.failures.saturating_add(1);
            let since = *self.failing_since_ms.get_or_insert(now_ms);
            if self.state == Health::Down || now_ms.saturating_sub(since) >= self.down_after_ms {
                Health::Down
            } else {
                Health::Unhealthy
            }
        };
        if next == self.state {
            Change::None
        } else {
            self.state = next;
            Change::To(next)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// name, probes (ok, at ms), state after, changes reported.
    type Case<'a> = (&'a str, &'a [(bool, u64)], Health, &'a [Change]);

    #[test]
    fn transitions() {
        let cases: &[Case<'_>] = &[
            ("first success", &[(true, 0)], Health::Healthy, &[Change::To(Health::Healthy)]),
            ("steady", &[(true, 0), (true, 250)], Health::Healthy, &[Change::To(Health::Healthy), Change::None]),
            (
                "one failure: unhealthy at once",
                &[(true, 0), (false, 250)],
                Health::Unhealthy,
                &[Change::To(Health::Healthy), Change::To(Health::Unhealthy)],
            ),
            (
                "a blip recovers",
                &[(true, 0), (false, 250), (true, 500)],
                Health::Healthy,
                &[Change::To(Health::Healthy), Change::To(Health::Unhealthy), Change::To(Health::Healthy)],
            ),
            (
                "failing for down_after: down",
                &[(true, 0), (false, 250), (false, 1250), (false, 2250)],
                Health::Down,
                &[Change::To(Health::Healthy), Change::To(Health::Unhealthy), Change::None, Change::To(Health::Down)],
            ),
            (
                "a success in between restarts the count",
                &[(false, 0), (true, 1500), (false, 1750), (false, 3000)],
                Health::Unhealthy,
                &[
                    Change::To(Health::Unhealthy),
                    Change::To(Health::Healthy),
                    Change::To(Health::Unhealthy),
                    Change::None,
                ],
            ),
            (
                "down stays down until a success",
                &[(false, 0), (false, 2000), (false, 2250), (true, 9000)],
                Health::Healthy,
                &[Change::To(Health::Unhealthy), Change::To(Health::Down), Change::None, Change::To(Health::Healthy)],
            ),
            (
                "never up: down after the window",
                &[(false, 0), (false, 2000)],
                Health::Down,
                &[Change::To(Health::Unhealthy), Change::To(Health::Down)],
            ),
        ];
        for (name, probes, end, changes) in cases {
            let mut t = HealthTracker::new(2000);
            let got: Vec<Change> = probes.iter().map(|(ok, at)| t.on_probe(*ok, *at)).collect();
            assert_eq!(&got, changes, "{name}");
            assert_eq!(t.state(), *end, "{name}");
        }
    }

    #[test]
    fn failures_are_counted_and_reset() {
        let mut t = HealthTracker::new(2000);
        t.on_probe(false, 0);
        t.on_probe(false, 100);
        assert_eq!(t.failures(), 2);
        t.on_probe(true, 200);
        assert_eq!(t.failures(), 0);
    }
}
