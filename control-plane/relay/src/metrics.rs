//! Load of the engine, read from vLLM's Prometheus `/metrics` text.
//!
//! | metric | field |
//! |---|---|
//! | `vllm:num_requests_running` | `running` (summed over label sets) |
//! | `vllm:num_requests_waiting` | `waiting` |
//! | `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`) | `kv_usage`, a fraction |
//! | `vllm:cache_config_info{block_size="…", num_gpu_blocks="…"}` | `block_size`, `capacity_blocks` |
//! | `vllm:request_prefill_time_seconds_{sum,count}`, `vllm:request_prefill_kv_computed_tokens_sum`, `vllm:inter_token_latency_seconds_{sum,count}` | `counters` (running totals, summed over label sets) |
//!
//! A server with several data-parallel ranks labels each rank's series
//! `engine="<rank>"`: [`parse_vllm_metrics`] given a rank reads that rank's
//! series and those without an `engine` label (older vLLM), and skips the
//! other ranks'.
//!
//! Cost: O(text length). Malformed lines are ignored; a missing metric is `None`.

use kvgate_protocol::pb;

/// What one scrape found.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineLoad {
    /// Requests running.
    pub running: Option<u32>,
    /// Requests waiting.
    pub waiting: Option<u32>,
    /// KV-cache usage in [0, 1].
    pub kv_usage: Option<f32>,
    /// Tokens per block.
    pub block_size: Option<u32>,
    /// KV blocks on the device.
    pub capacity_blocks: Option<u64>,
    /// The request-timing histograms' totals; `None` when the text has no
    /// prefill-time histogram (an older vLLM).
    pub counters: Option<pb::EngineCounters>,
}

fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let mut rest = labels;
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim_start_matches(',').trim();
        let after = &rest[eq + 2..];
        let end = after.find('"')?;
        if key == name {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
    None
}

/// Parses vLLM's `/metrics` text: the whole server's load (`rank` None), or
/// one data-parallel rank's.
pub fn parse_vllm_metrics(text: &str, rank: Option<u32>) -> EngineLoad {
    let rank = rank.map(|r| r.to_string());
    let mut load = EngineLoad::default();
    // Inter-token times count only beside the prefill histogram (they
    // serve to read its clock).
    let mut itl = (0.0, 0u64);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = match line.rsplit_once(' ') {
            Some((s, v)) => (s.trim(), v.trim()),
            None => continue,
        };
        let Ok(value) = value.parse::<f64>() else { continue };
        if !value.is_finite() {
            continue;
        }
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => (n, l.trim_end_matches('}')),
            None => (series, ""),
        };
        if let (Some(r), Some(engine)) = (rank.as_deref(), label(labels, "engine"))
            && engine != r
        {
            continue;
        }
        let add = |slot: &mut Option<u32>| *slot = Some(slot.unwrap_or(0).saturating_add(value.max(0.0) as u32));
        match name {
            "vllm:num_requests_running" => add(&mut load.running),
            "vllm:num_requests_waiting" => add(&mut load.waiting),
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                load.kv_usage = Some((value as f32).clamp(0.0, 1.0));
            }
            "vllm:request_prefill_time_seconds_sum" => counters(&mut load).prefill_seconds += value.max(0.0),
            "vllm:request_prefill_time_seconds_count" => counters(&mut load).prefill_requests += whole(value),
            "vllm:request_prefill_kv_computed_tokens_sum" => {
                counters(&mut load).prefill_computed_tokens += whole(value);
            }
            "vllm:inter_token_latency_seconds_sum" => itl.0 += value.max(0.0),
            "vllm:inter_token_latency_seconds_count" => itl.1 += whole(value),
            "vllm:cache_config_info" => {
                load.block_size = label(labels, "block_size").and_then(|v| v.parse().ok()).or(load.block_size);
                load.capacity_blocks =
                    label(labels, "num_gpu_blocks").and_then(|v| v.parse().ok()).or(load.capacity_blocks);
            }
            _ => {}
        }
    }
    if let Some(c) = load.counters.as_mut() {
        (c.itl_seconds, c.itl_count) = itl;
    }
    load
}

fn counters(load: &mut EngineLoad) -> &mut pb::EngineCounters {
    load.counters.get_or_insert_with(pb::EngineCounters::default)
}

/// A count or token sum as a whole number (never negative).
fn whole(v: f64) -> u64 {
    v.max(0.0).round() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_metrics() {
        let text = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny-llama"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.25
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="128",num_cpu_blocks="None"} 1.0
vllm:prefix_cache_queries_total{engine="0"} 1234.0
garbage line
vllm:num_requests_waiting{engine="1"} NaN
"#;
        let l = parse_vllm_metrics(text, None);
        assert_eq!(l.running, Some(5));
        assert_eq!(l.waiting, Some(1));
        assert_eq!(l.kv_usage, Some(0.25));
        assert_eq!(l.block_size, Some(32));
        assert_eq!(l.capacity_blocks, Some(128));
        assert_eq!(l.counters, None);
        assert_eq!(parse_vllm_metrics("", None), EngineLoad::default());
    }

    /// The request-timing histograms of vLLM 0.32's exposition: their sums
    /// and counts over label sets; inter-token times only beside the
    /// prefill histogram.
    #[test]
    fn reads_the_request_timing_histograms() {
        let text = r#"# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 3.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.75
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:request_prefill_time_seconds_sum{engine="1",model_name="m"} 0.25
vllm:request_prefill_time_seconds_count{engine="1",model_name="m"} 1.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 5120.0
vllm:request_prefill_kv_computed_tokens_sum{engine="1",model_name="m"} 880.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 2.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} NaN
"#;
        let c = parse_vllm_metrics(text, None).counters;
        let want = pb::EngineCounters {
            prefill_seconds: 1.0,
            prefill_requests: 5,
            prefill_computed_tokens: 6000,
            itl_seconds: 2.5,
            itl_count: 100,
        };
        assert_eq!(c, Some(want));
        let r1 = parse_vllm_metrics(text, Some(1)).counters;
        assert_eq!(r1.map(|c| (c.prefill_requests, c.prefill_computed_tokens, c.itl_count)), Some((1, 880, 0)));
        // Inter-token times alone are no counters.
        let itl = "vllm:inter_token_latency_seconds_sum 2.5\nvllm:inter_token_latency_seconds_count 100\n";
        assert_eq!(parse_vllm_metrics(itl, None).counters, None);
    }

    #[test]
    fn reads_one_data_parallel_rank() {
        let text = r#"vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="90"} 1.0
"#;
        let r1 = parse_vllm_metrics(text, Some(1));
        assert_eq!((r1.running, r1.waiting, r1.kv_usage, r1.capacity_blocks), (Some(2), Some(4), Some(0.5), Some(90)));
        let r0 = parse_vllm_metrics(text, Some(0));
        assert_eq!((r0.running, r0.waiting, r0.kv_usage, r0.capacity_blocks), (Some(3), None, Some(0.25), Some(100)));
        // A rank the server does not label: nothing of the others.
        assert_eq!(parse_vllm_metrics(text, Some(5)).running, None);
        // Series without an engine label (older vLLM) count for every rank.
        assert_eq!(parse_vllm_metrics("vllm:num_requests_running 7\n", Some(3)).running, Some(7));
    }
}
