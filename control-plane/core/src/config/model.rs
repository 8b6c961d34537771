//! Validation of one `[[models]]` entry: block size, mode, tokenizer, `kv`
//! weights, static workers, allowed endpoints, timeouts.

use std::net::SocketAddr;

use kvgate_protocol::BlockSize;
use kvgate_scheduler::{CostUnit, FairQueueConfig, KvConfig, Mode};

use super::{
    ConfigError, ModelSettings, RawDisaggregation, RawKv, RawModel, RawOverload, RawSession, RawWorker, err, weight,
};
use crate::endpoints::EndpointRule;
use crate::model::{DisaggConfig, ModelConfig, SessionConfig};

/// Validates `models[i]`.
pub(super) fn validate(i: usize, m: RawModel) -> Result<ModelSettings, ConfigError> {
    let f = |name: &str| format!("models[{i}].{name}");
    if m.name.is_empty() {
        return Err(err(f("name"), "", "must not be empty"));
    }
    let bs = m.block_size.ok_or_else(|| err(f("block_size"), "<missing>", "required (tokens per KV block)"))?;
    let block_size = BlockSize::new(bs).map_err(|_| err(f("block_size"), bs, "must be > 0"))?;
    let mode_s = m.mode.unwrap_or_else(|| "kv".into());
    let mode: Mode = mode_s.parse().map_err(|e: String| err(f("mode"), &mode_s, e))?;
    if let Some(dir) = &m.tokenizer_dir
        && !dir.join("tokenizer.json").is_file()
    {
        return Err(err(f("tokenizer_dir"), dir.display(), "no tokenizer.json in this directory"));
    }
    let kv = kv_config(&f, m.kv.clone().unwrap_or_default())?;
    let static_workers = static_workers(i, m.workers)?;
    let inflight_ttl_ms = m.inflight_ttl_ms.unwrap_or(600_000);
    if inflight_ttl_ms < 1000 {
        return Err(err(f("inflight_ttl_ms"), inflight_ttl_ms, "must be ≥ 1000"));
    }
    let mut allowed_endpoints = Vec::new();
    for (j, e) in m.allowed_endpoints.iter().enumerate() {
        let rule = EndpointRule::parse(e).map_err(|why| err(format!("models[{i}].allowed_endpoints[{j}]"), e, why))?;
        allowed_endpoints.push(rule);
    }
    let session = session_config(&f, m.session.clone().unwrap_or_default())?;
    let overload = overload_config(&f, m.overload.clone().unwrap_or_default())?;
    let disaggregation = disagg_config(&f, m.disaggregation.clone().unwrap_or_default())?;
    let index_shards = m.index_shards.unwrap_or(1);
    if !(1..=64).contains(&index_shards) {
        return Err(err(f("index_shards"), index_shards, "must be between 1 and 64"));
    }
    let suspect_ms = m.suspect_ms.unwrap_or(3000);
    if !(100..=600_000).contains(&suspect_ms) {
        return Err(err(f("suspect_ms"), suspect_ms, "must be between 100 and 600000"));
    }
    Ok(ModelSettings {
        routing: ModelConfig {
            name: m.name,
            block_size,
            mode,
            kv,
            learn_timing: m.kv.as_ref().and_then(|k| k.learn_timing).unwrap_or(true),
            fading_load: m.kv.as_ref().and_then(|k| k.fading_load).unwrap_or(true),
            default_output_tokens: m.default_output_tokens.unwrap_or(256),
            static_workers,
            heartbeat_timeout_ms: m.heartbeat_timeout_ms.unwrap_or(0),
            inflight_ttl_ms,
            suspect_after_failures: m.suspect_after_failures.unwrap_or(2),
            suspect_ms,
            allowed_endpoints,
            session,
            overload,
            disaggregation,
            index_shards,
        },
        tokenizer_dir: m.tokenizer_dir,
    })
}

/// The `kv` weights: each `kv.<name>` in the file, else the default;
/// finite, ≥ 0.
fn kv_config(f: &dyn Fn(&str) -> String, k: RawKv) -> Result<KvConfig, ConfigError> {
    let d = KvConfig::default();
    let unit = match &k.unit {
        None => d.unit,
        Some(u) => u.parse().map_err(|e: String| err(f("kv.unit"), u, e))?,
    };
    macro_rules! w {
        ($name:ident) => {
            weight(f(concat!("kv.", stringify!($name))), k.$name, d.$name)?
        };
    }
    let kv = KvConfig {
        unit,
        prefill_ms_per_token: w!(prefill_ms_per_token),
        decode_ms_per_seq: w!(decode_ms_per_seq),
        ttft_weight: w!(ttft_weight),
        overlap_weight: w!(overlap_weight),
        pending_weight: w!(pending_weight),
        decode_weight: w!(decode_weight),
        host_hit_weight: w!(host_hit_weight),
        inflight_hit_weight: w!(inflight_hit_weight),
        inflight_wait_weight: w!(inflight_wait_weight),
        queue_penalty_blocks: w!(queue_penalty_blocks),
        tie_epsilon: w!(tie_epsilon),
        temperature: w!(temperature),
        fallbacks: k.fallbacks.unwrap_or(d.fallbacks),
    };
    if kv.unit == CostUnit::Time && kv.prefill_ms_per_token <= 0.0 {
        return Err(err(f("kv.prefill_ms_per_token"), kv.prefill_ms_per_token, "must be > 0 with unit = \"time\""));
    }
    if kv.host_hit_weight > 1.0 {
        return Err(err(f("kv.host_hit_weight"), kv.host_hit_weight, "must be in [0, 1]"));
    }
    if kv.inflight_hit_weight > 1.0 {
        return Err(err(f("kv.inflight_hit_weight"), kv.inflight_hit_weight, "must be in [0, 1]"));
    }
    if kv.inflight_wait_weight > 1.0 {
        return Err(err(f("kv.inflight_wait_weight"), kv.inflight_wait_weight, "must be in [0, 1]"));
    }
    Ok(kv)
}

/// Session affinity: a TTL of 1 s to 7 days, at least one session.
fn session_config(f: &dyn Fn(&str) -> String, s: RawSession) -> Result<SessionConfig, ConfigError> {
    let d = SessionConfig::default();
    let ttl_ms = s.ttl_ms.unwrap_or(d.ttl_ms);
    if !(1000..=7 * 86_400_000).contains(&ttl_ms) {
        return Err(err(f("session.ttl_ms"), ttl_ms, "must be between 1000 and 604800000 (7 days)"));
    }
    let max = s.max_sessions.unwrap_or(d.max);
    if max == 0 {
        return Err(err(f("session.max_sessions"), max, "must be > 0"));
    }
    Ok(SessionConfig { enabled: s.enabled.unwrap_or(d.enabled), ttl_ms, max })
}

/// Overload protection: `None` when off; bounds ≥ 1, a wait of 10 ms to
/// 10 minutes.
fn overload_config(f: &dyn Fn(&str) -> String, o: RawOverload) -> Result<Option<FairQueueConfig>, ConfigError> {
    let d = FairQueueConfig::default();
    let max_queued = o.max_queued.unwrap_or(d.max_queued);
    if max_queued == 0 {
        return Err(err(f("overload.max_queued"), max_queued, "must be > 0"));
    }
    let max_wait_ms = o.max_wait_ms.unwrap_or(d.max_wait_ms);
    if !(10..=600_000).contains(&max_wait_ms) {
        return Err(err(f("overload.max_wait_ms"), max_wait_ms, "must be between 10 and 600000"));
    }
    let quantum = o.quantum_tokens.unwrap_or(d.quantum);
    if quantum == 0 {
        return Err(err(f("overload.quantum_tokens"), quantum, "must be > 0"));
    }
    Ok(o.enabled.unwrap_or(false).then_some(FairQueueConfig { max_queued, max_wait_ms, quantum }))
}

/// Disaggregation: a threshold of 1 token or more, a local-prefill time
/// of 1 ms to 10 minutes.
fn disagg_config(f: &dyn Fn(&str) -> String, d: RawDisaggregation) -> Result<DisaggConfig, ConfigError> {
    let def = DisaggConfig::default();
    if d.min_uncached_tokens == Some(0) {
        return Err(err(
            f("disaggregation.min_uncached_tokens"),
            0,
            "must be > 0 (or unset: derived from the learned timing)",
        ));
    }
    let ms = d.max_local_prefill_ms.unwrap_or(def.max_local_prefill_ms);
    if !(1.0..=600_000.0).contains(&ms) {
        return Err(err(f("disaggregation.max_local_prefill_ms"), ms, "must be between 1 and 600000"));
    }
    let stall = d.stall_weight.unwrap_or(def.stall_weight);
    if !(0.0..=1000.0).contains(&stall) {
        return Err(err(f("disaggregation.stall_weight"), stall, "must be between 0 and 1000"));
    }
    Ok(DisaggConfig {
        enabled: d.enabled.unwrap_or(def.enabled),
        min_uncached_tokens: d.min_uncached_tokens,
        max_local_prefill_ms: ms,
        only_if_sooner: d.only_if_sooner.unwrap_or(def.only_if_sooner),
        stall_weight: stall,
        prefill_on_both: d.prefill_on_both.unwrap_or(def.prefill_on_both),
        overflow_to_prefill: d.overflow_to_prefill.unwrap_or(def.overflow_to_prefill),
    })
}

/// Workers routed to without relays: non-empty ids, `ip:port` endpoints.
fn static_workers(i: usize, workers: Vec<RawWorker>) -> Result<Vec<(String, String)>, ConfigError> {
    let mut out = Vec::new();
    for (j, w) in workers.into_iter().enumerate() {
        if w.id.is_empty() {
            return Err(err(format!("models[{i}].workers[{j}].id"), "", "must not be empty"));
        }
        if w.endpoint.parse::<SocketAddr>().is_err() {
            return Err(err(format!("models[{i}].workers[{j}].endpoint"), &w.endpoint, "expected ip:port"));
        }
        out.push((w.id, w.endpoint));
    }
    Ok(out)
}
