//! One served model: its routing state, tokenizer and per-model
//! histograms.

use kvgate_tokenize::prompt::{PromptTokenizer, TokenCacheConfig};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};

use kvgate_index::Index;
use kvgate_protocol::BlockSize;
use parking_lot::{Mutex, RwLock};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use crate::config::{Config, ModelSettings};
use crate::error::StartError;
use crate::metrics::{Metrics, ModelLabel};
use crate::model::ModelState;

/// One served model.
#[derive(Debug)]
pub struct Model {
    /// Its name.
    pub name: String,
    /// Routing state.
    pub state: Mutex<ModelState>,
    /// Its block index, shared with `state`: Picks look their prompt up
    /// here before they take `state`'s lock.
    pub(crate) index: Arc<RwLock<Index>>,
    pub(crate) block_size: BlockSize,
    /// The mode looks prompts up in the index (`kv`): Picks of other modes
    /// skip the lookup. A Pick that read it while the mode switched looks
    /// up under the model's lock ([`ModelState::pick_found`]).
    pub(crate) looks_up: AtomicBool,
    /// Tokenizer, when configured.
    pub tokenizer: Option<PromptTokenizer>,
    pub(crate) pick_seconds: Histogram,
    pub(crate) overlap_ratio: Histogram,
    pub(crate) event_lag_seconds: Histogram,
    pub(crate) ingest_hold_seconds: Histogram,
    /// How far behind its event stream is processed (see
    /// [`crate::model::stream_delay`]), as last judged: exported, and read
    /// by Picks without the lock.
    pub(crate) stream_delay_seconds: Gauge<f64, AtomicU64>,
    /// Overload protection is on (Picks go through the admission queue;
    /// without it they skip a hold of the lock).
    pub(crate) admission: bool,
}

impl Model {
    /// Loads model `m` (its tokenizer and self-test), the `i`-th of
    /// `config` (for its random seed).
    pub(crate) fn load(config: &Config, m: &ModelSettings, i: usize, metrics: &Metrics) -> Result<Model, StartError> {
        let tokenizer = match &m.tokenizer_dir {
            Some(dir) => {
                let cache = TokenCacheConfig {
                    budget_tokens: config.token_cache_tokens,
                    verify_every: config.tokenize_verify_every,
                };
                let t = PromptTokenizer::from_dir(dir, cache)
                    .map_err(|source| StartError::Tokenizer { model: m.routing.name.clone(), source })?;
                tracing::info!(
                    model = %m.routing.name,
                    self_test = t.self_test_result(),
                    fast_encoder = t.inner().uses_fast_encoder(),
                    paragraphs = t.inner().encodes_by_paragraph(),
                    "tokenizer loaded"
                );
                Some(t)
            }
            None => None,
        };
        let label = ModelLabel { model: m.routing.name.clone() };
        let state = ModelState::new(m.routing.clone(), 0x6b76_6761_7465 ^ i as u64);
        Ok(Model {
            name: m.routing.name.clone(),
            index: state.shared_index(),
            block_size: m.routing.block_size,
            looks_up: AtomicBool::new(m.routing.mode == kvgate_scheduler::Mode::Kv),
            state: Mutex::new(state),
            tokenizer,
            pick_seconds: metrics.global.pick_seconds.get_or_create_owned(&label),
            overlap_ratio: metrics.global.overlap_ratio.get_or_create_owned(&label),
            event_lag_seconds: metrics.global.event_lag_seconds.get_or_create_owned(&label),
            ingest_hold_seconds: metrics.global.ingest_hold_seconds.get_or_create_owned(&label),
            stream_delay_seconds: metrics.global.stream_delay_seconds.get_or_create_owned(&label),
            admission: m.routing.overload.is_some(),
        })
    }
}
