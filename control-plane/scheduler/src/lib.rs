//! # kvgate-scheduler
//!
//! Routing policies behind one trait, and the load tracking they share.
//! Synchronous: the control plane calls [`Policy::pick`] with candidates built
//! from the index (overlap) and the [`LoadTracker`] (load).
//!
//! | module | what |
//! |---|---|
//! | [`policy`] | [`Policy`] trait, [`Candidate`], [`Load`], [`RequestView`], [`Decision`] |
//! | [`load`] | [`LoadTracker`]: predicted load from request lifecycles, fused with heartbeats |
//! | `prefixes` | the prompts in flight as one tree of shared prefixes, by worker: what [`LoadTracker`] shares are read from |
//! | [`fair_queue`] | [`FairQueue`]: requests held while the fleet is saturated; priorities, deficit round robin between tenants, deadlines |
//! | [`kv`] | `kv`: cache overlap + load, queueing modelled (the default) |
//! | [`approx`] | `approx`: text prefixes learned from its own decisions |
//! | [`least_load`] | `least_load` |
//! | [`round_robin`] | `round_robin` |
//! | [`random`] | `random` |
#![warn(missing_docs)]

pub mod approx;
pub mod fair_queue;
pub mod kv;
pub mod least_load;
pub mod load;
pub mod persistence;
pub mod policy;
mod prefixes;
pub mod random;
pub mod round_robin;

pub use approx::{ApproxConfig, ApproxPolicy};
pub use fair_queue::{FairQueue, FairQueueConfig, Refused, Ticket};
pub use kv::{CostUnit, KvConfig, KvPolicy};
pub use least_load::LeastLoadPolicy;
pub use load::{InflightShare, LifecycleError, LoadTracker, Measured, SHARED_PROMPT_BLOCKS};
pub use persistence::LoadPersistence;
pub use policy::{Candidate, Decision, EngineTiming, Load, Policy, Reason, RequestView};
pub use random::RandomPolicy;
pub use round_robin::RoundRobinPolicy;

/// The routing modes, switchable per model at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// [`KvPolicy`].
    Kv,
    /// [`ApproxPolicy`].
    Approx,
    /// [`LeastLoadPolicy`].
    LeastLoad,
    /// [`RoundRobinPolicy`].
    RoundRobin,
    /// [`RandomPolicy`].
    Random,
}

impl Mode {
    /// Every mode.
    pub const ALL: [Mode; 5] = [Mode::Kv, Mode::Approx, Mode::LeastLoad, Mode::RoundRobin, Mode::Random];

    /// The mode's name in configuration, metrics and `PickResponse.mode`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kv => "kv",
            Self::Approx => "approx",
            Self::LeastLoad => "least_load",
            Self::RoundRobin => "round_robin",
            Self::Random => "random",
        }
    }

    /// A new policy of this mode with default settings.
    pub fn policy(self) -> Box<dyn Policy> {
        match self {
            Self::Kv => Box::new(KvPolicy::default()),
            Self::Approx => Box::new(ApproxPolicy::default()),
            Self::LeastLoad => Box::new(LeastLoadPolicy),
            Self::RoundRobin => Box::new(RoundRobinPolicy::default()),
            Self::Random => Box::new(RandomPolicy),
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|m| m.name() == s).ok_or_else(|| {
            format!("unknown routing mode {s:?} (expected kv, approx, least_load, round_robin or random)")
        })
    }
}
