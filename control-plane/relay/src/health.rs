//! The engine's health from the relay's probes (its `/health`, and its
//! `/metrics` scrape), as a small state machine with no clock of its own.
//!
//! | state | entered when | the control plane |
//! |---|---|---|
//! | `Unknown` | nothing probed yet | routes on heartbeats alone |
//! | `Healthy` | a probe succeeded | routes |
//! | `Unhealthy` | a probe failed, or has gone unanswered for the overdue time | no new request; blocks kept |
//! | `Down` | probes failed for `down_after_ms` without a success | no new request; the relay cleared its mirror |
//!
//! A change of state is reported so that the runtime sends a heartbeat at
//! once instead of at its next tick: a killed engine leaves rotation within
//! one probe interval. A hung engine (or one whose process takes seconds to
//! be torn down: its socket accepts and nothing answers) leaves it when its
//! probe is overdue, before the probe's own timeout; the overdue probe
//! counts as failed only when that timeout ends it, so it does not bring
//! `Down` nearer.

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
        self.set(next)
    }

    /// A probe has gone unanswered for the overdue time: a healthy (or not
    /// yet probed) engine turns unhealthy until a probe answers. Failures
    /// and the time to `Down` are left to the probe's own result.
    pub fn on_overdue(&mut self) -> Change {
        match self.state {
            Health::Unknown | Health::Healthy => self.set(Health::Unhealthy),
            Health::Unhealthy | Health::Down => Change::None,
        }
    }

    fn set(&mut self, next: Health) -> Change {
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

    /// One probe event: answered (ok or not) at ms, or overdue.
    #[derive(Clone, Copy)]
    enum Ev {
        Probe(bool, u64),
        Overdue,
    }

    /// name, events, state after, changes reported, failures after.
    type OverdueCase<'a> = (&'a str, &'a [Ev], Health, &'a [Change], u32);

    fn run(t: &mut HealthTracker, evs: &[Ev]) -> Vec<Change> {
        evs.iter()
            .map(|e| match *e {
                Ev::Probe(ok, at) => t.on_probe(ok, at),
                Ev::Overdue => t.on_overdue(),
            })
            .collect()
    }

    #[test]
    fn overdue_probes() {
        use Ev::{Overdue, Probe};
        use Health::{Down, Healthy, Unhealthy};
        let cases: &[OverdueCase<'_>] = &[
            (
                "overdue: unhealthy before the timeout",
                &[Probe(true, 0), Overdue],
                Unhealthy,
                &[Change::To(Healthy), Change::To(Unhealthy)],
                0,
            ),
            (
                "a slow answer: healthy again, no failure counted",
                &[Probe(true, 0), Overdue, Probe(true, 600)],
                Healthy,
                &[Change::To(Healthy), Change::To(Unhealthy), Change::To(Healthy)],
                0,
            ),
            (
                "overdue then timed out: one failure, no second change",
                &[Probe(true, 0), Overdue, Probe(false, 1250)],
                Unhealthy,
                &[Change::To(Healthy), Change::To(Unhealthy), Change::None],
                1,
            ),
            ("not yet probed: overdue is unhealthy", &[Overdue], Unhealthy, &[Change::To(Unhealthy)], 0),
            (
                "overdue does not bring down nearer",
                &[Probe(true, 0), Overdue, Overdue, Probe(false, 1250), Overdue, Probe(false, 2500)],
                Unhealthy,
                &[Change::To(Healthy), Change::To(Unhealthy), Change::None, Change::None, Change::None, Change::None],
                2,
            ),
            (
                "down stays down when overdue",
                &[Probe(false, 0), Probe(false, 2000), Overdue],
                Down,
                &[Change::To(Unhealthy), Change::To(Down), Change::None],
                2,
            ),
        ];
        for (name, evs, end, changes, failures) in cases {
            let mut t = HealthTracker::new(2000);
            assert_eq!(&run(&mut t, evs), changes, "{name}");
            assert_eq!(t.state(), *end, "{name}");
            assert_eq!(t.failures(), *failures, "{name}");
        }
    }

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
