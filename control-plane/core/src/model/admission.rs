//! Overload protection: while every live worker is at its running limit, a
//! new request is held in the model's [`FairQueue`] instead of being piled
//! onto an engine's waiting queue, and released as slots free (by priority,
//! then fairly between tenants); past the queue's bound or a request's
//! deadline it is refused (the filter answers 429 with `Retry-After`).
//!
//! ```text
//! admit  ── off, or queue empty and a worker has a free slot ──▶ Go (pick now)
//!        ── otherwise: held ──▶ Wait(ticket)      queue full ──▶ Refuse
//! release(now) ── per free slot ──▶ tickets to pick now; past deadline ──▶ tickets to refuse
//! ```
//!
//! Free slots count what the router knows: per live worker, its running
//! limit (`max_num_seqs` from heartbeats) minus its requests (the larger of
//! the predicted and the measured). A worker whose limit is unknown is never
//! saturated, so fleets without heartbeats never hold a request.
//!
//! | operation | cost |
//! |---|---|
//! | `admit` | O(W) for W workers, plus the queue's push |
//! | `release` | O(W + released + expired) |

use kvgate_scheduler::{FairQueue, Refused, Ticket};

use super::ModelState;

/// What to do with a request now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Pick a worker now.
    Go,
    /// Held: wait until [`ModelState::release`] names this ticket.
    Wait(Ticket),
    /// Refused: the queue is full.
    Refuse,
}

/// Outcomes of the admission queue, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdmissionCounters {
    /// Requests held.
    pub held: u64,
    /// Held requests released to pick.
    pub released: u64,
    /// Held requests refused at their deadline.
    pub expired: u64,
    /// Requests refused because the queue was full.
    pub refused: u64,
}

/// Tickets the adapter must wake: to pick now, or to refuse.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Pick now.
    pub go: Vec<Ticket>,
    /// Past their deadline: refuse.
    pub expired: Vec<Ticket>,
}

impl ModelState {
    /// Free batch slots of the live workers, or `None` when some live worker
    /// has no known running limit (it is never saturated).
    fn free_slots(&self, now_ms: u64) -> Option<u64> {
        let mut free = 0u64;
        for w in self.workers.values().filter(|w| self.live(w, now_ms)) {
            let load = self.tracker.load(w.idx);
            let limit = load.max_running.filter(|l| *l > 0)?;
            free += u64::from(limit.saturating_sub(load.effective_requests()));
        }
        Some(free)
    }

    /// Decides whether a request of `tenant` at `priority` with `cost`
    /// prompt tokens picks now, waits, or is refused.
    pub fn admit(&mut self, tenant: &str, priority: u8, cost: u64, now_ms: u64) -> Admit {
        let Some(queue_empty) = self.held.as_ref().map(FairQueue::is_empty) else { return Admit::Go };
        if queue_empty && self.free_slots(now_ms).is_none_or(|f| f > 0) {
            return Admit::Go;
        }
        let Some(q) = self.held.as_mut() else { return Admit::Go };
        match q.push(tenant, priority, cost, now_ms) {
            Ok(t) => {
                self.admission.held += 1;
                Admit::Wait(t)
            }
            Err(Refused::Full) => {
                self.admission.refused += 1;
                Admit::Refuse
            }
        }
    }

    /// Releases as many held requests as there are free slots (all of them
    /// when a worker's limit is unknown), and expires those past their
    /// deadline.
    pub fn release(&mut self, now_ms: u64) -> Released {
        let free = self.free_slots(now_ms);
        let Some(q) = self.held.as_mut() else { return Released::default() };
        let expired = q.expire(now_ms);
        let mut go = Vec::new();
        while free.is_none_or(|f| (go.len() as u64) < f) {
            let Some(t) = q.pop() else { break };
            go.push(t);
        }
        self.admission.released += go.len() as u64;
        self.admission.expired += expired.len() as u64;
        Released { go, expired }
    }

    /// Forgets a held request whose caller went away.
    pub fn cancel_held(&mut self, ticket: Ticket) {
        if let Some(q) = self.held.as_mut() {
            q.cancel(ticket);
        }
    }

    /// Requests held now, and the queue's counters; `None` when overload
    /// protection is off.
    pub fn admission(&self) -> Option<(usize, AdmissionCounters)> {
        self.held.as_ref().map(|q| (q.len(), self.admission))
    }

    /// `Retry-After` for a refused request: the queue's longest wait.
    pub fn retry_after_ms(&self) -> u32 {
        let ms = self.config.overload.map_or(1000, |o| o.max_wait_ms);
        u32::try_from(ms).unwrap_or(u32::MAX)
    }
}
