//! The event-stream synchronization of one worker: which of its relay's
//! batches are applied, skipped, held or answered with a snapshot. One
//! decision function, [`StreamSync::accept`], serves live batches and the
//! batches held while a snapshot was under way.
//!
//! ```text
//! Unknown ──batch relay_seq 1, or heartbeat relay_seq 0──▶ Synced(epoch, seq)
//! Unknown ──any other batch / heartbeat──▶ Snapshotting (batches held)
//! Synced  ──batch seq+1──▶ apply          ──batch ≤ seq──▶ duplicate, skipped
//! Synced  ──gap, new relay epoch, heartbeat ahead of seq──▶ Snapshotting
//! Snapshotting ──snapshot (epoch, seq)──▶ Synced(epoch, seq), held batches accepted in order
//! any ──snapshot claimed for applying (ticket)──▶ Snapshotting (a new ticket; one applying under an older ticket stops)
//! Snapshotting ──about to be asked for (or waiting its turn)──▶ Snapshotting, held batches dropped (the snapshot covers them), clock restarted
//! Snapshotting ──failed / timed out──▶ Unknown (retried on the next message)
//! Snapshotting ──more than MAX_HELD batches──▶ Snapshotting afresh (the one under way is too old)
//! ```
//!
//! Costs: every transition is O(1) but the snapshot's, which hands back
//! the held batches (moved, not copied).

use kvgate_protocol::pb;

/// Largest number of batches held per worker while its snapshot is under
/// way; one more restarts the snapshot.
pub const MAX_HELD: usize = 16_384;

/// Where a worker's stream stands.
#[derive(Debug)]
pub enum StreamSync {
    /// Nothing known: the next message decides.
    Unknown,
    /// A snapshot was asked for; batches are held until it arrives.
    Snapshotting {
        /// Batches received meanwhile, in arrival order.
        held: Vec<pb::KvEventBatch>,
        /// When it was asked for (monotonic ms).
        started_ms: u64,
        /// Names this snapshot: one applied in pieces goes on only while
        /// the ticket is still the worker's.
        ticket: u64,
    },
    /// Every batch up to `seq` of relay epoch `epoch` is applied.
    Synced {
        /// The relay's epoch (a new one is a relay restart).
        epoch: u64,
        /// The last applied `relay_seq`.
        seq: u64,
    },
    /// A configured worker without a relay: its batches (if any) are
    /// applied as they come.
    Static,
}

/// Why a snapshot is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resync {
    /// The first message of a worker started mid-stream.
    Unknown,
    /// A `relay_seq` was skipped.
    Gap,
    /// The relay restarted (new epoch).
    Epoch,
    /// Too many batches were held during a snapshot.
    Overflow,
}

/// What to do with one batch.
#[derive(Debug, PartialEq)]
pub enum Accept {
    /// Apply it to the index (the state has advanced to it).
    Apply(pb::KvEventBatch),
    /// Already applied (same or older `relay_seq`): skip.
    Duplicate,
    /// Held until the snapshot under way arrives.
    Held,
    /// Ask for a snapshot; this batch is the first one held for it.
    Resync(Resync, pb::KvEventBatch),
}

impl StreamSync {
    /// Decides one batch, moving the state along.
    pub fn accept(&mut self, batch: pb::KvEventBatch) -> Accept {
        match self {
            Self::Static => Accept::Apply(batch),
            Self::Unknown if batch.relay_seq == 1 => {
                *self = Self::Synced { epoch: batch.relay_epoch, seq: 1 };
                Accept::Apply(batch)
            }
            Self::Unknown => Accept::Resync(Resync::Unknown, batch),
            Self::Snapshotting { held, .. } if held.len() < MAX_HELD => {
                held.push(batch);
                Accept::Held
            }
            Self::Snapshotting { .. } => Accept::Resync(Resync::Overflow, batch),
            Self::Synced { epoch, .. } if batch.relay_epoch != *epoch => Accept::Resync(Resync::Epoch, batch),
            Self::Synced { seq, .. } if batch.relay_seq <= *seq => Accept::Duplicate,
            Self::Synced { seq, .. } if batch.relay_seq != *seq + 1 => Accept::Resync(Resync::Gap, batch),
            Self::Synced { seq, .. } => {
                *seq = batch.relay_seq;
                Accept::Apply(batch)
            }
        }
    }

    /// A heartbeat announcing the relay's `(epoch, seq)`: whether a
    /// snapshot is needed. A first heartbeat at seq 0 means the relay has
    /// published nothing yet: the worker is in sync with nothing to apply.
    pub fn heartbeat(&mut self, epoch: u64, seq: u64) -> Option<Resync> {
        match self {
            Self::Unknown if seq == 0 => {
                *self = Self::Synced { epoch, seq: 0 };
                None
            }
            Self::Unknown => Some(Resync::Unknown),
            Self::Synced { epoch: e, .. } if *e != epoch => Some(Resync::Epoch),
            Self::Synced { seq: s, .. } if seq > *s => Some(Resync::Gap),
            _ => None,
        }
    }

    /// Asks for a snapshot: batches are held from now on, starting with
    /// `first` when given.
    pub fn start_snapshot(&mut self, now_ms: u64, first: Option<pb::KvEventBatch>, ticket: u64) {
        *self = Self::Snapshotting { held: first.into_iter().collect(), started_ms: now_ms, ticket };
    }

    /// A snapshot is about to be applied under `ticket`: batches are held
    /// until it is (from now, if none were), and one being applied under an
    /// older ticket stops ([`StreamSync::ticket`]).
    pub fn claim_snapshot(&mut self, now_ms: u64, ticket: u64) {
        match self {
            Self::Snapshotting { ticket: t, .. } => *t = ticket,
            _ => self.start_snapshot(now_ms, None, ticket),
        }
    }

    /// The ticket of the snapshot under way, if one is.
    pub fn ticket(&self) -> Option<u64> {
        match self {
            Self::Snapshotting { ticket, .. } => Some(*ticket),
            _ => None,
        }
    }

    /// The snapshot under way is about to be asked for, or waits its turn
    /// to be: every batch held so far reached this side before the request
    /// will, so the relay's answer covers it, and it is dropped; the
    /// snapshot's clock (its timeout) restarts. Returns how many batches
    /// were dropped (`None`: no snapshot under way).
    pub fn snapshot_asking(&mut self, now_ms: u64) -> Option<usize> {
        match self {
            Self::Snapshotting { held, started_ms, .. } => {
                let n = held.len();
                held.clear();
                *started_ms = now_ms;
                Some(n)
            }
            _ => None,
        }
    }

    /// The snapshot at `(epoch, seq)` was applied: synced there. Returns the
    /// held batches, to be passed to [`StreamSync::accept`] in order.
    pub fn snapshot_applied(&mut self, epoch: u64, seq: u64) -> Vec<pb::KvEventBatch> {
        match std::mem::replace(self, Self::Synced { epoch, seq }) {
            Self::Snapshotting { held, .. } => held,
            _ => Vec::new(),
        }
    }

    /// The snapshot failed or timed out: back to unknown, so that the next
    /// message asks again. Returns whether one was under way.
    pub fn snapshot_failed(&mut self) -> bool {
        if matches!(self, Self::Snapshotting { .. }) {
            *self = Self::Unknown;
            true
        } else {
            false
        }
    }

    /// A snapshot is wanted (asked for, waiting its turn or being applied).
    pub fn wants_snapshot(&self) -> bool {
        matches!(self, Self::Snapshotting { .. })
    }

    /// The snapshot under way was asked for before `now_ms - timeout_ms`.
    pub fn snapshot_stale(&self, now_ms: u64, timeout_ms: u64) -> bool {
        matches!(self, Self::Snapshotting { started_ms, .. } if now_ms.saturating_sub(*started_ms) > timeout_ms)
    }

    /// A configured worker without a relay.
    pub fn is_static(&self) -> bool {
        matches!(self, Self::Static)
    }

    /// The state's name, a label of `kvgate_worker_streams`.
    pub fn state_name(&self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Snapshotting { .. } => "snapshotting",
            Self::Synced { .. } => "synced",
            Self::Static => "static",
        }
    }

    /// For the admin view.
    pub fn describe(&self) -> String {
        match self {
            Self::Unknown => "unknown".into(),
            Self::Snapshotting { held, .. } => format!("snapshotting ({} buffered)", held.len()),
            Self::Synced { seq, .. } => format!("synced (relay_seq {seq})"),
            Self::Static => "static".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(epoch: u64, seq: u64) -> pb::KvEventBatch {
        pb::KvEventBatch { relay_epoch: epoch, relay_seq: seq, ..Default::default() }
    }

    #[derive(Debug, PartialEq)]
    enum V {
        Apply,
        Duplicate,
        Held,
        Resync(Resync),
    }

    fn verdict(a: Accept) -> V {
        match a {
            Accept::Apply(_) => V::Apply,
            Accept::Duplicate => V::Duplicate,
            Accept::Held => V::Held,
            Accept::Resync(r, _) => V::Resync(r),
        }
    }

    /// (epoch, seq).
    type At = (u64, u64);

    fn synced(s: &StreamSync) -> Option<At> {
        match s {
            StreamSync::Synced { epoch, seq } => Some((*epoch, *seq)),
            _ => None,
        }
    }

    #[test]
    fn batches_by_state() {
        let snap = || StreamSync::Snapshotting { held: Vec::new(), started_ms: 0, ticket: 1 };
        let sync = |e, s| StreamSync::Synced { epoch: e, seq: s };
        // (state, batch (epoch, seq), verdict, synced afterwards)
        let table: Vec<(StreamSync, At, V, Option<At>)> = vec![
            (StreamSync::Unknown, (7, 1), V::Apply, Some((7, 1))),
            (StreamSync::Unknown, (7, 5), V::Resync(Resync::Unknown), None),
            (sync(7, 4), (7, 5), V::Apply, Some((7, 5))),
            (sync(7, 4), (7, 4), V::Duplicate, Some((7, 4))),
            (sync(7, 4), (7, 2), V::Duplicate, Some((7, 4))),
            (sync(7, 4), (7, 6), V::Resync(Resync::Gap), Some((7, 4))),
            (sync(7, 4), (8, 1), V::Resync(Resync::Epoch), Some((7, 4))),
            (sync(7, 4), (6, 5), V::Resync(Resync::Epoch), Some((7, 4))),
            (snap(), (7, 9), V::Held, None),
            (StreamSync::Static, (0, 0), V::Apply, None),
        ];
        for (i, (mut state, (e, s), want, after)) in table.into_iter().enumerate() {
            assert_eq!(verdict(state.accept(batch(e, s))), want, "row {i}");
            assert_eq!(synced(&state), after, "row {i}: state afterwards");
        }
    }

    #[test]
    fn heartbeats_by_state() {
        let table: Vec<(StreamSync, At, Option<Resync>, Option<At>)> = vec![
            (StreamSync::Unknown, (3, 0), None, Some((3, 0))),
            (StreamSync::Unknown, (3, 2), Some(Resync::Unknown), None),
            (StreamSync::Synced { epoch: 3, seq: 2 }, (3, 2), None, Some((3, 2))),
            (StreamSync::Synced { epoch: 3, seq: 2 }, (3, 1), None, Some((3, 2))),
            (StreamSync::Synced { epoch: 3, seq: 2 }, (3, 3), Some(Resync::Gap), Some((3, 2))),
            (StreamSync::Synced { epoch: 3, seq: 2 }, (4, 0), Some(Resync::Epoch), Some((3, 2))),
            (StreamSync::Snapshotting { held: Vec::new(), started_ms: 0, ticket: 1 }, (3, 9), None, None),
            (StreamSync::Static, (0, 9), None, None),
        ];
        for (i, (mut state, (e, s), want, after)) in table.into_iter().enumerate() {
            assert_eq!(state.heartbeat(e, s), want, "row {i}");
            assert_eq!(synced(&state), after, "row {i}: state afterwards");
        }
    }

    #[test]
    fn a_snapshot_hands_back_the_held_batches_which_are_accepted_in_order() {
        let mut s = StreamSync::Unknown;
        let first = match s.accept(batch(1, 5)) {
            Accept::Resync(Resync::Unknown, b) => b,
            other => panic!("{other:?}"),
        };
        s.start_snapshot(10, Some(first), 1);
        for seq in [6, 7, 9] {
            assert_eq!(s.accept(batch(1, seq)), Accept::Held);
        }
        // The snapshot was taken at seq 6: 5 and 6 are in it, 7 applies,
        // 9 is a gap.
        let held = s.snapshot_applied(1, 6);
        let verdicts: Vec<V> = held.into_iter().map(|b| verdict(s.accept(b))).collect();
        assert_eq!(verdicts, [V::Duplicate, V::Duplicate, V::Apply, V::Resync(Resync::Gap)]);
        assert_eq!(synced(&s), Some((1, 7)));
    }

    #[test]
    fn asking_drops_what_the_snapshot_covers_and_restarts_its_clock() {
        let mut s = StreamSync::Unknown;
        assert_eq!(s.snapshot_asking(5), None, "no snapshot wanted");
        assert!(!s.wants_snapshot());
        s.start_snapshot(0, Some(batch(1, 5)), 1);
        assert_eq!(s.accept(batch(1, 6)), Accept::Held);
        assert!(s.snapshot_stale(100, 50));
        // Asked at 100: the two batches arrived before the request, so the
        // relay's answer holds them; the timeout counts from 100.
        assert_eq!(s.snapshot_asking(100), Some(2));
        assert!(s.wants_snapshot());
        assert!(!s.snapshot_stale(140, 50));
        assert!(s.snapshot_stale(151, 50));
        // Held from now on, and accepted after the snapshot as before.
        assert_eq!(s.accept(batch(1, 8)), Accept::Held);
        let held = s.snapshot_applied(1, 7);
        let verdicts: Vec<V> = held.into_iter().map(|b| verdict(s.accept(b))).collect();
        assert_eq!(verdicts, [V::Apply]);
        assert_eq!(synced(&s), Some((1, 8)));
        assert!(!s.wants_snapshot());
    }

    #[test]
    fn holding_is_bounded_and_failures_go_back_to_unknown() {
        let mut s = StreamSync::Unknown;
        s.start_snapshot(0, None, 1);
        for seq in 0..MAX_HELD as u64 {
            assert_eq!(s.accept(batch(1, seq)), Accept::Held);
        }
        assert_eq!(verdict(s.accept(batch(1, 0))), V::Resync(Resync::Overflow));
        assert!(s.snapshot_stale(5_001, 5_000));
        assert!(!s.snapshot_stale(5_000, 5_000));
        assert!(s.snapshot_failed());
        assert!(matches!(s, StreamSync::Unknown));
        assert!(!s.snapshot_failed(), "nothing under way");
    }
}
