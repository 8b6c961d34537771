//! `FairQueue`: requests held while every worker is saturated, released in
//! priority order and, within a priority, fairly between tenants.
//!
//! # Algorithm
//!
//! One class per priority (higher first). Within a class, deficit round
//! robin (Shreedhar & Varghese) over the tenants that have requests
//! waiting: the tenant at the front of the ring may release its oldest
//! request when its deficit covers the request's cost (its prompt tokens);
//! otherwise it gains a quantum and goes to the back. A tenant whose queue
//! empties leaves the ring and forgets its deficit. Over time each backlogged
//! tenant gets the same share of prompt tokens, whatever its arrival rate,
//! so a tenant that floods the gateway waits behind its own requests, not in
//! front of everybody else's.
//!
//! Every request has a deadline (`max_wait_ms` after it arrived); one past
//! it is expired, and the queue is bounded (`max_queued`): the caller
//! answers both with 429.
//!
//! # Complexity
//!
//! | operation | cost |
//! |---|---|
//! | `push` | O(log P) for P priorities, amortized O(1) otherwise |
//! | `pop` | O(T · ⌈cost / quantum⌉) worst case for T tenants in the class; amortized O(1) per released request when quantum ≥ typical cost |
//! | `expire` | O(expired + tenants) (each tenant's queue is in deadline order) |
//! | `cancel` | O(queued) |

use std::collections::{BTreeMap, HashMap, VecDeque};

/// Settings of the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FairQueueConfig {
    /// Most requests held at once; one more is refused.
    pub max_queued: usize,
    /// Longest a request is held before it is expired.
    pub max_wait_ms: u64,
    /// Cost credited to a tenant per round (prompt tokens).
    pub quantum: u64,
}

impl Default for FairQueueConfig {
    fn default() -> Self {
        Self { max_queued: 1024, max_wait_ms: 5_000, quantum: 8192 }
    }
}

/// A held request's handle.
pub type Ticket = u64;

#[derive(Debug)]
struct Waiter {
    ticket: Ticket,
    cost: u64,
    deadline_ms: u64,
}

#[derive(Debug, Default)]
struct Tenant {
    waiters: VecDeque<Waiter>,
    deficit: u64,
}

#[derive(Debug, Default)]
struct Class {
    ring: VecDeque<Box<str>>,
    tenants: HashMap<Box<str>, Tenant>,
}

impl Class {
    /// Releases one request by deficit round robin.
    fn pop(&mut self, quantum: u64) -> Option<Ticket> {
        // Each turn either releases or adds a quantum; a cost of c needs at
        // most ⌈c / quantum⌉ turns per tenant.
        let quantum = quantum.max(1);
        loop {
            let name = self.ring.front()?.clone();
            let Some(t) = self.tenants.get_mut(&name) else {
                self.ring.pop_front();
                continue;
            };
            let Some(head) = t.waiters.front() else {
                self.tenants.remove(&name);
                self.ring.pop_front();
                continue;
            };
            if t.deficit >= head.cost {
                t.deficit -= head.cost;
                let ticket = head.ticket;
                t.waiters.pop_front();
                if t.waiters.is_empty() {
                    self.tenants.remove(&name);
                    self.ring.pop_front();
                }
                return Some(ticket);
            }
            t.deficit += quantum;
            self.ring.rotate_left(1);
        }
    }
}

/// Why a request was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// `max_queued` requests are already held.
    #[error("admission queue full")]
    Full,
}

/// Requests held while the fleet is saturated (see the module comment).
#[derive(Debug, Default)]
pub struct FairQueue {
    config: FairQueueConfig,
    classes: BTreeMap<u8, Class>,
    len: usize,
    next: Ticket,
}

impl FairQueue {
    /// An empty queue.
    pub fn new(config: FairQueueConfig) -> Self {
        Self { config, ..Self::default() }
    }

    /// Its settings.
    pub fn config(&self) -> &FairQueueConfig {
        &self.config
    }

    /// Requests held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Nothing held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Requests held per tenant (for metrics), sorted by tenant.
    pub fn by_tenant(&self) -> Vec<(String, usize)> {
        let mut out: BTreeMap<&str, usize> = BTreeMap::new();
        for c in self.classes.values() {
            for (name, t) in c.tenants.iter().filter(|(_, t)| !t.waiters.is_empty()) {
                *out.entry(name).or_default() += t.waiters.len();
            }
        }
        out.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
    }

    /// Holds a request of `tenant` at `priority` (higher first) costing
    /// `cost` (its prompt tokens), until [`FairQueue::pop`] releases it or
    /// its deadline passes.
    pub fn push(&mut self, tenant: &str, priority: u8, cost: u64, now_ms: u64) -> Result<Ticket, Refused> {
        if self.len >= self.config.max_queued {
            return Err(Refused::Full);
        }
        self.next += 1;
        let ticket = self.next;
        let class = self.classes.entry(priority).or_default();
        let t = match class.tenants.get_mut(tenant) {
            Some(t) => t,
            None => {
                class.ring.push_back(tenant.into());
                class.tenants.entry(tenant.into()).or_default()
            }
        };
        t.waiters.push_back(Waiter { ticket, cost, deadline_ms: now_ms.saturating_add(self.config.max_wait_ms) });
        self.len += 1;
        Ok(ticket)
    }

    /// Releases the next request: highest priority first, deficit round
    /// robin between the tenants of that priority.
    pub fn pop(&mut self) -> Option<Ticket> {
        let quantum = self.config.quantum;
        while let Some(mut entry) = self.classes.last_entry() {
            match entry.get_mut().pop(quantum) {
                Some(t) => {
                    if entry.get().tenants.is_empty() {
                        entry.remove();
                    }
                    self.len -= 1;
                    return Some(t);
                }
                None => {
                    entry.remove();
                }
            }
        }
        None
    }

    /// Removes the requests whose deadline has passed; returns them.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Ticket> {
        let mut out = Vec::new();
        for class in self.classes.values_mut() {
            for t in class.tenants.values_mut() {
                while t.waiters.front().is_some_and(|w| w.deadline_ms <= now_ms) {
                    if let Some(w) = t.waiters.pop_front() {
                        out.push(w.ticket);
                    }
                }
            }
            class.tenants.retain(|_, t| !t.waiters.is_empty());
            let tenants = &class.tenants;
            class.ring.retain(|name| tenants.contains_key(name));
        }
        self.classes.retain(|_, c| !c.tenants.is_empty());
        self.len -= out.len();
        out
    }

    /// Removes a held request (its caller gave up); returns whether it was
    /// held.
    pub fn cancel(&mut self, ticket: Ticket) -> bool {
        for class in self.classes.values_mut() {
            for t in class.tenants.values_mut() {
                if let Some(i) = t.waiters.iter().position(|w| w.ticket == ticket) {
                    t.waiters.remove(i);
                    self.len -= 1;
                    return true;
                }
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(max_queued: usize) -> FairQueue {
        FairQueue::new(FairQueueConfig { max_queued, max_wait_ms: 1_000, quantum: 1_000 })
    }

    fn drain(q: &mut FairQueue, names: &HashMap<Ticket, &'static str>) -> Vec<&'static str> {
        std::iter::from_fn(|| q.pop()).map(|t| names[&t]).collect()
    }

    #[test]
    fn a_flooding_tenant_waits_behind_its_own_requests() {
        let mut q = queue(1_000);
        let mut names = HashMap::new();
        for _ in 0..100 {
            names.insert(q.push("big", 0, 1_000, 0).unwrap(), "big");
        }
        for _ in 0..10 {
            names.insert(q.push("small", 0, 1_000, 0).unwrap(), "small");
        }
        let order = drain(&mut q, &names);
        let last_small = order.iter().rposition(|n| *n == "small").unwrap();
        assert!(last_small < 21, "small's 10 requests alternate with big's: {order:?}");
        assert_eq!(order.len(), 110);
        assert!(q.is_empty());
    }

    #[test]
    fn shares_are_in_prompt_tokens_not_requests() {
        let mut q = queue(1_000);
        let mut names = HashMap::new();
        for _ in 0..20 {
            names.insert(q.push("long", 0, 4_000, 0).unwrap(), "long");
            names.insert(q.push("short", 0, 500, 0).unwrap(), "short");
        }
        let first: Vec<_> = drain(&mut q, &names).into_iter().take(18).collect();
        let long = first.iter().filter(|n| **n == "long").count();
        // 4,000-token requests get one turn in ~8 of the 500-token ones.
        assert!((1..=3).contains(&long), "{first:?}");
    }

    #[test]
    fn higher_priority_first_then_bounded_expired_and_cancelled() {
        let mut q = queue(3);
        let low = q.push("a", 0, 10, 0).unwrap();
        let high = q.push("b", 5, 10, 10).unwrap();
        let other = q.push("a", 0, 10, 20).unwrap();
        assert_eq!(q.push("c", 9, 10, 20), Err(Refused::Full));
        assert_eq!(q.pop(), Some(high));
        assert!(q.cancel(other));
        assert!(!q.cancel(other));
        assert_eq!(q.by_tenant(), vec![("a".to_owned(), 1)]);
        let late = q.push("d", 1, 10, 500).unwrap();
        assert_eq!(q.expire(999), Vec::<Ticket>::new());
        assert_eq!(q.expire(1_000), vec![low], "held past max_wait_ms");
        assert_eq!(q.len(), 1);
        assert_eq!(q.pop(), Some(late));
        assert_eq!((q.pop(), q.len()), (None, 0));
    }
}
