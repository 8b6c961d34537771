//! kvgate-bench: the whole-system benchmark (issue #8), as a library for its
//! binary and its tests.
//!
//! `kvgate-bench doks` runs the DOKS multi-turn sweep: for every concurrency
//! level and every mode, a fresh stack (see [`stack`]), a warm-up window and
//! a measured window of closed-loop conversations ([`runner`]), one row of
//! results ([`stats`]); then tables ([`report`]) and a JSON file with the
//! commit and machine it ran on.
//!
//! Time: the simulated fleet runs `--speedup` times faster than the wall
//! clock. Windows are given in simulated seconds (the published run's 60 s
//! and 300 s) and every latency and rate is reported in simulated time.

pub mod aiperf;
pub mod calibrate;
pub mod client;
pub mod dashboard;
pub mod html;
pub mod plot;
pub mod probe;
pub mod report;
pub mod runner;
pub mod stack;
pub mod stats;
pub mod vllm_cell;
pub mod workload;
