//! # kvgate-filter-core
//!
//! The logic of kvgate's Proxy-Wasm filter, with no Proxy-Wasm in it: the
//! Wasm shim (`filter/wasm`) forwards Envoy's callbacks here and implements
//! [`Host`] with host calls; tests drive the same code with [`mock::MockHost`].
//!
//! | module | what |
//! |---|---|
//! | [`config`] | plugin configuration, parsed and validated once ([`ConfigError`]: field, value, reason) |
//! | [`json`] | validating borrowed JSON scanner (spans, no tree) |
//! | [`extract`] | the routing fields of an OpenAI request body |
//! | [`pick`] | PickRequest encoding from borrowed spans; PickResponse → header value |
//! | [`filter`] | the per-request state machine and its single failure path |
//! | [`usage`] | `usage` from a bounded tail of the response |
//! | [`report`] | per-thread completion-report queue |
//! | [`retained`] | per-thread table of conversations the control plane retains (message elision) |
//! | [`host`] | the [`Host`] trait, [`Metric`]s, failure [`Cause`]s |
//! | [`mock`] | the recording mock host (feature `mock`, and in tests) |
//!
//! No `unwrap`, `expect`, `panic` or slice indexing outside tests (clippy
//! denies them): every input, however malformed, takes a defined path.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing, clippy::unreachable)
)]
#![warn(missing_docs)]

pub mod config;
pub mod extract;
pub mod filter;
pub mod host;
pub mod json;
#[cfg(any(test, feature = "mock"))]
pub mod mock;
pub mod pick;
pub mod report;
pub mod retained;
pub mod usage;

pub use config::{Config, ConfigError, Disaggregation, FailureMode, Legs};
pub use filter::RequestFilter;
pub use host::{Action, Cause, Host, Metric, MetricKind};
pub use report::ReportQueue;
pub use retained::Retained;
