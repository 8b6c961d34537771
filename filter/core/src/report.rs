//! The completion-report queue of one Envoy worker thread.
//!
//! Requests push their report when they end; the root context's timer takes
//! a batch when no `Report` call is in flight. A failed call puts its batch
//! back at the front, so reports survive a control-plane restart; beyond
//! `max_queue` the oldest are dropped and counted.
//!
//! | operation | cost |
//! |---|---|
//! | [`ReportQueue::push`] | O(1) amortized |
//! | [`ReportQueue::take_batch`] | O(batch) + encoding |
//! | [`ReportQueue::failed`] | O(batch) |

use std::collections::VecDeque;

use kvgate_protocol::pb;
use prost::Message as _;

/// Reports waiting to be sent.
#[derive(Debug)]
pub struct ReportQueue {
    queue: VecDeque<pb::CompletionReport>,
    in_flight: Option<(u32, Vec<pb::CompletionReport>)>,
    max_queue: usize,
    max_batch: usize,
    dropped: u64,
}

impl ReportQueue {
    /// An empty queue.
    pub fn new(max_queue: usize, max_batch: usize) -> Self {
        Self { queue: VecDeque::new(), in_flight: None, max_queue, max_batch: max_batch.max(1), dropped: 0 }
    }

    /// Adds a report; returns how many old reports were dropped for it.
    pub fn push(&mut self, r: pb::CompletionReport) -> u64 {
        self.queue.push_back(r);
        self.trim()
    }

    fn trim(&mut self) -> u64 {
        let mut n = 0;
        while self.queue.len() > self.max_queue {
            self.queue.pop_front();
            n += 1;
        }
        self.dropped += n;
        n
    }

    /// Reports waiting (not counting a batch in flight).
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Nothing waiting.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Reports dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// A call is in flight.
    pub fn busy(&self) -> bool {
        self.in_flight.is_some()
    }

    /// The next batch, encoded, when nothing is in flight and reports wait.
    /// Call [`Self::sent`] with the call's token, or [`Self::failed`].
    pub fn take_batch(&mut self, reporter_id: &str) -> Option<(Vec<u8>, usize)> {
        if self.in_flight.is_some() || self.queue.is_empty() {
            return None;
        }
        let n = self.queue.len().min(self.max_batch);
        let reports: Vec<pb::CompletionReport> = self.queue.drain(..n).collect();
        let batch = pb::CompletionReportBatch { reporter_id: reporter_id.into(), reports };
        let bytes = batch.encode_to_vec();
        self.in_flight = Some((0, batch.reports));
        Some((bytes, n))
    }

    /// The batch taken last is in flight under `token`.
    pub fn sent(&mut self, token: u32) {
        if let Some((t, _)) = self.in_flight.as_mut() {
            *t = token;
        }
    }

    /// The call `token` succeeded.
    pub fn acked(&mut self, token: u32) -> bool {
        if self.in_flight.as_ref().is_some_and(|(t, _)| *t == token) {
            self.in_flight = None;
            return true;
        }
        false
    }

    /// The call `token` (or the dispatch, with `None`) failed: its batch goes
    /// back to the front. Returns how many reports were dropped for room.
    pub fn failed(&mut self, token: Option<u32>) -> u64 {
        let matches = match (token, self.in_flight.as_ref()) {
            (None, Some(_)) => true,
            (Some(t), Some((ft, _))) => t == *ft,
            _ => false,
        };
        if !matches {
            return 0;
        }
        if let Some((_, batch)) = self.in_flight.take() {
            for r in batch.into_iter().rev() {
                self.queue.push_front(r);
            }
        }
        // Keep the newest.
        let mut n = 0;
        while self.queue.len() > self.max_queue {
            self.queue.pop_front();
            n += 1;
        }
        self.dropped += n;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(id: &str) -> pb::CompletionReport {
        pb::CompletionReport { request_id: id.into(), ..Default::default() }
    }

    #[test]
    fn batches_retry_and_bound() {
        let mut q = ReportQueue::new(4, 2);
        for i in 0..3 {
            q.push(r(&i.to_string()));
        }
        let (bytes, n) = q.take_batch("node/0").unwrap();
        assert_eq!(n, 2);
        let b = pb::CompletionReportBatch::decode(bytes.as_slice()).unwrap();
        assert_eq!(b.reporter_id, "node/0");
        assert_eq!(b.reports.iter().map(|r| r.request_id.as_str()).collect::<Vec<_>>(), ["0", "1"]);
        q.sent(7);
        assert!(q.take_batch("x").is_none(), "one call at a time");
        assert_eq!(q.failed(Some(8)), 0, "other token");
        assert_eq!(q.failed(Some(7)), 0);
        assert_eq!(q.len(), 3);
        // Overflow drops the oldest.
        q.push(r("3"));
        assert_eq!(q.push(r("4")), 1);
        assert_eq!(q.dropped(), 1);
        let (bytes, _) = q.take_batch("x").unwrap();
        let b = pb::CompletionReportBatch::decode(bytes.as_slice()).unwrap();
        assert_eq!(b.reports[0].request_id, "1");
        q.sent(9);
        assert!(q.acked(9));
        assert!(!q.busy());
        assert_eq!(q.len(), 2);
    }
}
