//! From one cell's records to one result row, in simulated time.
//!
//! - Latencies are of requests *started* inside the measurement window,
//!   measured at the client, multiplied by the speedup (simulated time, the
//!   time an H200 fleet would take). The gateway's own wall-clock overhead is
//!   multiplied too, which only ever counts against the gateway.
//! - ITL per request is `(e2e - ttft) / (output tokens - 1)`, as genai-perf
//!   computes it; percentiles are over requests.
//! - Throughput counts requests *completed* inside the window.
//! - Hit rate is what the engines reported to the clients: the sum of
//!   `usage.prompt_tokens_details.cached_tokens` over the sum of prompt
//!   tokens, of the requests started in the window (the oracle's basis; it
//!   exists for every frontend, Dynamo's too). The workers' own
//!   `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over
//!   the window is `engine_hit_rate`: vLLM counts a lookup each time it
//!   tries to schedule a waiting request, so with requests waiting it
//!   weighs them by how often they were retried, not by their tokens.
//! - The oracle hit rate is what one infinite cache shared by every worker
//!   would hit on the same requests: a later turn can reuse the previous
//!   turn's prompt and output, a first turn its starter (after the first
//!   conversation on that starter), whole blocks only, never the last token.
//! - Load skew: at every 250 ms sample, the busiest worker's in-flight
//!   requests (running + waiting) over the mean; reported as the mean over
//!   samples, and the p95 of the spread (busiest − idlest).

use serde::{Deserialize, Serialize};

use crate::runner::{CellRun, Record};

/// The DOKS demo's SLO: TTFT at most 600 ms and time per output token at
/// most 60 ms.
pub const SLO_TTFT_MS: f64 = 600.0;
pub const SLO_ITL_MS: f64 = 60.0;

/// The levels the rows ran, ascending.
pub fn levels(rows: &[Row]) -> Vec<usize> {
    let mut v: Vec<usize> = rows.iter().map(|r| r.concurrency).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The modes of the rows, in order of first appearance.
pub fn modes(rows: &[Row]) -> Vec<&str> {
    let mut v: Vec<&str> = Vec::new();
    for r in rows {
        if !v.contains(&r.mode.as_str()) {
            v.push(&r.mode);
        }
    }
    v
}

/// One row of a result file (the shape issue #8 fixes, plus context).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    pub mode: String,
    /// The level: concurrency (closed loop) or requests per second (open).
    #[serde(rename = "rate_or_concurrency", alias = "concurrency")]
    pub concurrency: usize,
    pub ttft_p50_ms: f64,
    #[serde(default)]
    pub ttft_p90_ms: f64,
    pub ttft_p95_ms: f64,
    pub ttft_p99_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p95_ms: f64,
    pub itl_p99_ms: f64,
    pub e2e_p50_s: f64,
    pub e2e_p95_s: f64,
    pub e2e_p99_s: f64,
    pub output_tok_per_s: f64,
    pub rps: f64,
    pub hit_rate: f64,
    pub oracle_hit_rate: f64,
    /// The workers' own prefix-cache hit rate over the window (`None`
    /// without worker metrics).
    #[serde(default)]
    pub engine_hit_rate: Option<f64>,
    pub errors: usize,
    /// Requests a router sent to a worker for a prefix it believed cached
    /// there, of which the engine then reported less ([`mispredicted`]);
    /// `None` for routers that do not say what they believed.
    #[serde(default)]
    pub mispredicted: Option<usize>,
    /// Requests routed for a believed cached prefix (the denominator).
    #[serde(default)]
    pub predicted: Option<usize>,
    /// Later turns of a conversation that a router sent to another worker
    /// than the turn before ([`moved`]): each leaves the worker holding its
    /// history and recomputes it. `None` for routers that do not say where
    /// they sent a request.
    #[serde(default)]
    pub moved: Option<usize>,
    /// Later turns whose turn before went to a known worker (the
    /// denominator).
    #[serde(default)]
    pub follow_ups: Option<usize>,
    /// Mean TTFT at the client (ms, simulated time).
    #[serde(default)]
    pub ttft_mean_ms: f64,
    /// Mean TTFT the workers measured themselves, from each request's
    /// arrival at the worker (`vllm:time_to_first_token_seconds`, ms,
    /// simulated time). The difference to `ttft_mean_ms` is the frontend's
    /// share: the gateway or router on the way in and the first chunk on
    /// the way out, multiplied by the speedup like everything else.
    #[serde(default)]
    pub worker_ttft_mean_ms: f64,
    /// Requests started in the window (latency sample size).
    pub requests: usize,
    pub mean_prompt_tokens: f64,
    pub load_skew_mean: f64,
    /// NaN when the router reports no in-flight view (written as `null`).
    #[serde(deserialize_with = "nan_if_null")]
    pub inflight_spread_p95: f64,
    pub max_waiting: f64,
    /// Host CPU busy during the window (0–1) and whether it stayed below the
    /// validity threshold.
    pub host_cpu: f64,
    pub valid: bool,
    /// CPU seconds per wall second, per process role.
    pub cpu_by_role: Vec<(String, f64)>,
    /// When the cell ran several times (`--repeats`), each run's own row;
    /// this row is then their median ([`median_row`]). Empty for one run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repeats: Vec<Row>,
}

/// JSON has no NaN: `serde_json` writes it as `null`; read back as NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Quantiles: the one implementation every benchmark uses (hdrhistogram).
pub use kvgate_bench_support::quantile;

/// Shared tokens an ideal shared cache could serve for a request of
/// `prompt` tokens that can reuse `reusable` tokens, in whole blocks, never
/// the whole prompt (vLLM always computes the last token).
pub fn block_hit(reusable: u64, prompt: u64, block: u64) -> u64 {
    let cap = prompt.saturating_sub(1).min(reusable);
    cap / block.max(1) * block.max(1)
}

/// What an ideal shared cache could have reused, per workload.
#[derive(Clone, Copy)]
pub enum Oracle<'a> {
    /// DOKS conversations: `[s]` is the number of prompt tokens two first
    /// turns on starter `s` share; later turns reuse the previous turn.
    Doks(&'a [u64]),
    /// Request-level workloads: a request can reuse the longest run of
    /// leading segments that a request started before it also had, in
    /// proportion of its words (record `conv` is the request number).
    Prefixes(&'a crate::workload::Requests),
}

/// The prefix oracle: (reusable tokens, prompt tokens) of the `ok` records,
/// the history being every record in start order.
fn prefix_oracle(records: &[Record], ok: &[&&Record], wl: &crate::workload::Requests, block: u64) -> (u64, u64) {
    use std::collections::{HashMap, HashSet};
    let mut order: Vec<&Record> = records.iter().collect();
    order.sort_by(|a, b| a.start.total_cmp(&b.start));
    let mut seen: HashSet<u64> = HashSet::new();
    let mut reusable: HashMap<u64, u64> = HashMap::new();
    for r in order {
        let Some(req) = wl.request(r.conv) else { continue };
        let segs: Vec<_> = req.segments().copied().collect();
        let total: usize = segs.iter().map(|s| s.words).sum();
        let (mut chain, mut shared, mut matching) = (0xCBF2_9CE4_8422_2325u64, 0usize, true);
        for s in &segs {
            chain = crate::workload::mix(chain, s.id);
            if matching && seen.contains(&chain) {
                shared += s.words;
            } else {
                matching = false;
            }
            seen.insert(chain);
        }
        if r.error.is_none() && total > 0 {
            let tokens = (r.prompt_tokens as f64 * shared as f64 / total as f64) as u64;
            reusable.entry(r.conv).or_insert(tokens);
        }
    }
    ok.iter().fold((0, 0), |(h, p), r| {
        (h + block_hit(reusable.get(&r.conv).copied().unwrap_or(0), r.prompt_tokens, block), p + r.prompt_tokens)
    })
}

/// (routed for a believed cached prefix, of which the engine reported less)
/// over the `ok` records that carry a kvgate route, `None` when none does.
///
/// `kv` says how many prompt blocks it found cached on the chosen worker
/// (whether the prefix or load decided): wrong when the engine reported a
/// whole block fewer or less. `approx` believes
/// the worker still holds the request's learned text prefix: with a
/// request-level workload that is the prefix shared with earlier requests,
/// estimated as [`prefix_oracle`] does; wrong when the engine reported less
/// than half of it (the estimate is per word, not per token).
fn mispredicted(ok: &[&&Record], oracle: Oracle<'_>, block: u64) -> Option<(usize, usize)> {
    let routed: Vec<_> = ok.iter().filter_map(|r| r.route.as_ref().map(|x| (r, x))).collect();
    if routed.is_empty() {
        return None;
    }
    let (mut believed, mut wrong) = (0, 0);
    for (r, route) in routed {
        // The fewest cached tokens that would have proved the router right.
        let at_least = match route.reason.as_str() {
            "approx" => match oracle {
                Oracle::Prefixes(wl) => (shared_prefix_tokens(r, wl) / 2).max(1),
                Oracle::Doks(_) => 1,
            },
            _ if route.matched_blocks > 0 => (u64::from(route.matched_blocks) - 1) * block + 1,
            _ => continue,
        };
        believed += 1;
        if r.cached_tokens < at_least {
            wrong += 1;
        }
    }
    Some((believed, wrong))
}

/// (later turns whose turn before went to a known worker, of which the
/// router sent to another worker) over the `ok` records, `None` when no
/// record carries a route. A turn's worker is the one its route names,
/// whether the prefix or load decided; the turn before is looked up among
/// every record, inside the window or not.
fn moved(records: &[Record], ok: &[&&Record]) -> Option<(usize, usize)> {
    fn named(r: &Record) -> Option<&str> {
        r.route.as_ref().map(|x| x.worker.as_str()).filter(|w| !w.is_empty())
    }
    let worker: std::collections::HashMap<(u64, usize), &str> =
        records.iter().filter_map(|r| Some(((r.conv, r.turn), named(r)?))).collect();
    if worker.is_empty() {
        return None;
    }
    let pairs = ok.iter().filter(|r| r.turn > 0).filter_map(|r| {
        let here = named(r)?;
        let before = *worker.get(&(r.conv, r.turn - 1))?;
        Some(here != before)
    });
    Some(pairs.fold((0, 0), |(n, m), moved| (n + 1, m + usize::from(moved))))
}

/// The request's tokens before its last segment (what it can share with
/// earlier requests of a request-level workload), by its share of words.
fn shared_prefix_tokens(r: &Record, wl: &crate::workload::Requests) -> u64 {
    let Some(req) = wl.request(r.conv) else { return 0 };
    let words: Vec<usize> = req.segments().map(|s| s.words).collect();
    let (total, last) = (words.iter().sum::<usize>(), words.last().copied().unwrap_or(0));
    if total == 0 { 0 } else { (r.prompt_tokens as f64 * (total - last) as f64 / total as f64) as u64 }
}

/// The DOKS oracle: (reusable tokens, prompt tokens) of the `ok` records.
fn doks_oracle(records: &[Record], ok: &[&&Record], starter_shared: &[u64], block: u64) -> (u64, u64) {
    let mut by_conv = std::collections::HashMap::new();
    for r in records.iter().filter(|r| r.error.is_none()) {
        by_conv.insert((r.conv, r.turn), (r.prompt_tokens, r.completion_tokens));
    }
    // When each starter was first sent.
    let mut first_use = std::collections::HashMap::new();
    for r in records.iter().filter(|r| r.turn == 0) {
        let t = first_use.entry(r.starter).or_insert(f64::INFINITY);
        *t = f64::min(*t, r.start);
    }
    let first_start = |s: usize| first_use.get(&s).copied().unwrap_or(f64::INFINITY);
    let (mut oracle_hits, mut prompt_sum) = (0u64, 0u64);
    for r in ok {
        let reusable = if r.turn == 0 {
            if first_start(r.starter) < r.start { starter_shared.get(r.starter).copied().unwrap_or(0) } else { 0 }
        } else {
            by_conv.get(&(r.conv, r.turn - 1)).map_or(0, |(p, c)| (p + c).saturating_sub(1))
        };
        oracle_hits += block_hit(reusable, r.prompt_tokens, block);
        prompt_sum += r.prompt_tokens;
    }

    (oracle_hits, prompt_sum)
}

/// Summarizes `run`.
/// One tenant's requests started in the measured window (the overload cell).
#[derive(Debug, Clone, serde::Serialize)]
pub struct TenantRow {
    /// Mode.
    pub mode: String,
    /// Level (requests/s).
    pub rate_or_concurrency: usize,
    /// `x-tenant-id`.
    pub tenant: &'static str,
    /// Simulated ms.
    pub ttft_p50_ms: f64,
    /// Simulated ms.
    pub ttft_p95_ms: f64,
    /// Served.
    pub admitted: usize,
    /// Answered 429.
    pub rejected_429: usize,
    /// Failed otherwise.
    pub other_errors: usize,
}

/// Per tenant, in tenant order: TTFT of the served requests, served, 429s.
pub fn by_tenant(mode: &str, level: usize, run: &CellRun, speedup: f64) -> Vec<TenantRow> {
    let w0 = run.windows.warmup.as_secs_f64();
    let w1 = w0 + run.windows.measure.as_secs_f64();
    let mut names: Vec<&'static str> = run.records.iter().filter_map(|r| r.tenant).collect();
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .map(|tenant| {
            let inside: Vec<_> =
                run.records.iter().filter(|r| r.tenant == Some(tenant) && r.start >= w0 && r.start < w1).collect();
            let ttft: Vec<f64> =
                inside.iter().filter(|r| r.error.is_none()).filter_map(|r| r.ttft).map(|t| t * speedup * 1e3).collect();
            let rejected = inside.iter().filter(|r| r.error.as_deref().is_some_and(|e| e.contains("HTTP 429"))).count();
            let failed = inside.iter().filter(|r| r.error.is_some()).count();
            TenantRow {
                mode: mode.to_owned(),
                rate_or_concurrency: level,
                tenant,
                ttft_p50_ms: kvgate_bench_support::quantile(&ttft, 0.5),
                ttft_p95_ms: kvgate_bench_support::quantile(&ttft, 0.95),
                admitted: inside.len() - failed,
                rejected_429: rejected,
                other_errors: failed - rejected,
            }
        })
        .collect()
}

pub fn summarize(
    mode: &str,
    concurrency: usize,
    run: &CellRun,
    speedup: f64,
    block: u64,
    oracle: Oracle<'_>,
    cpu_limit: f64,
) -> Row {
    let w0 = run.windows.warmup.as_secs_f64();
    let w1 = w0 + run.windows.measure.as_secs_f64();
    let sim_s = run.windows.measure.as_secs_f64() * speedup;
    let inside: Vec<_> = run.records.iter().filter(|r| r.start >= w0 && r.start < w1).collect();
    let ok: Vec<_> = inside.iter().filter(|r| r.error.is_none()).collect();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft).map(|t| t * speedup * 1e3).collect();
    let itl: Vec<f64> = ok
        .iter()
        .filter(|r| r.completion_tokens > 1)
        .filter_map(|r| r.ttft.map(|t| (r.e2e - t) / (r.completion_tokens - 1) as f64 * speedup * 1e3))
        .collect();
    let e2e: Vec<f64> = ok.iter().map(|r| r.e2e * speedup).collect();
    let done: Vec<_> =
        run.records.iter().filter(|r| r.error.is_none() && r.start + r.e2e >= w0 && r.start + r.e2e < w1).collect();
    let out_tokens: u64 = done.iter().map(|r| r.completion_tokens).sum();

    // The oracle, over requests started inside the window.
    let (oracle_hits, prompt_sum) = match oracle {
        Oracle::Doks(starter_shared) => doks_oracle(&run.records, &ok, starter_shared, block),
        Oracle::Prefixes(wl) => prefix_oracle(&run.records, &ok, wl, block),
    };

    let predictions = mispredicted(&ok, oracle, block);
    let moves = moved(&run.records, &ok);

    let (m0, m1) = &run.metrics;
    let (dh, dq) =
        m0.iter().zip(m1).fold((0.0, 0.0), |(h, q), (a, b)| (h + b.hits - a.hits, q + b.queries - a.queries));
    let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
    let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let (ts, tn) = m0
        .iter()
        .zip(m1)
        .fold((0.0, 0.0), |(s, n), (a, b)| (s + b.ttft_sum_s - a.ttft_sum_s, n + b.ttft_count - a.ttft_count));
    let ttft_mean = if ttft.is_empty() { 0.0 } else { ttft.iter().sum::<f64>() / ttft.len() as f64 };
    let mut skews = Vec::new();
    let mut spreads = Vec::new();
    let mut max_waiting: f64 = 0.0;
    for s in &run.samples {
        let n = s.inflight.len().max(1) as f64;
        let mean = s.inflight.iter().sum::<f64>() / n;
        let max = s.inflight.iter().copied().fold(0.0, f64::max);
        let min = s.inflight.iter().copied().fold(f64::INFINITY, f64::min);
        if mean > 0.0 {
            skews.push(max / mean);
        }
        spreads.push(max - min);
        max_waiting = s.waiting.iter().copied().fold(max_waiting, f64::max);
    }
    let wall = run.windows.measure.as_secs_f64().max(1e-9);
    let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
    Row {
        mode: mode.to_owned(),
        concurrency,
        ttft_p50_ms: r3(quantile(&ttft, 0.50)),
        ttft_p90_ms: r3(quantile(&ttft, 0.90)),
        ttft_p95_ms: r3(quantile(&ttft, 0.95)),
        ttft_p99_ms: r3(quantile(&ttft, 0.99)),
        itl_p50_ms: r3(quantile(&itl, 0.50)),
        itl_p95_ms: r3(quantile(&itl, 0.95)),
        itl_p99_ms: r3(quantile(&itl, 0.99)),
        e2e_p50_s: r3(quantile(&e2e, 0.50)),
        e2e_p95_s: r3(quantile(&e2e, 0.95)),
        e2e_p99_s: r3(quantile(&e2e, 0.99)),
        output_tok_per_s: r3(out_tokens as f64 / sim_s),
        rps: r3(done.len() as f64 / sim_s),
        hit_rate: r3(if prompt > 0 { cached as f64 / prompt as f64 } else { 0.0 }),
        engine_hit_rate: (dq > 0.0).then(|| r3(dh / dq)),
        oracle_hit_rate: r3(if prompt_sum > 0 { oracle_hits as f64 / prompt_sum as f64 } else { 0.0 }),
        errors: inside.len() - ok.len(),
        mispredicted: predictions.map(|p| p.1),
        predicted: predictions.map(|p| p.0),
        moved: moves.map(|m| m.1),
        follow_ups: moves.map(|m| m.0),
        ttft_mean_ms: r3(ttft_mean),
        worker_ttft_mean_ms: r3(if tn > 0.0 { ts / tn * 1e3 } else { 0.0 }),
        requests: inside.len(),
        mean_prompt_tokens: r3(if ok.is_empty() {
            0.0
        } else {
            ok.iter().map(|r| r.prompt_tokens as f64).sum::<f64>() / ok.len() as f64
        }),
        load_skew_mean: r3(if skews.is_empty() { 1.0 } else { skews.iter().sum::<f64>() / skews.len() as f64 }),
        // No samples (a peer's engines have no vLLM metrics): 0, not NaN.
        inflight_spread_p95: r3(if spreads.is_empty() { 0.0 } else { quantile(&spreads, 0.95) }),
        max_waiting,
        host_cpu: r3(run.host_cpu),
        valid: run.host_cpu < cpu_limit,
        cpu_by_role: run.cpu_by_role.iter().map(|(r, s)| (r.clone(), r3(s / wall))).collect(),
        repeats: Vec::new(),
    }
}

/// One row for several runs of the same cell: every number the median of
/// the runs' (each metric on its own: a run's p95 is a noisy estimate, and
/// the median of three is not moved by one run's outlier); a count stays a
/// whole number (the lower middle when the runs are even); `valid` only if
/// every run was; what is not a number (the CPU per role) from the first
/// run. The runs are kept in [`Row::repeats`]. One run is returned as it is.
pub fn median_row(mut runs: Vec<Row>) -> anyhow::Result<Row> {
    use serde_json::Value;
    if runs.len() <= 1 {
        return runs.pop().ok_or_else(|| anyhow::anyhow!("a cell without a run"));
    }
    let values = runs.iter().map(serde_json::to_value).collect::<Result<Vec<Value>, _>>()?;
    let Some(Value::Object(first)) = values.first().cloned() else { anyhow::bail!("a row is not an object") };
    let mut out = serde_json::Map::new();
    for (key, v0) in first {
        let all: Vec<&Value> = values.iter().map(|v| v.get(&key).unwrap_or(&Value::Null)).collect();
        let merged = match v0 {
            Value::Bool(_) => Value::Bool(all.iter().all(|v| v.as_bool().unwrap_or(false))),
            Value::Number(_) | Value::Null => {
                let mut nums: Vec<f64> = all.iter().filter_map(|v| v.as_f64()).collect();
                nums.sort_by(f64::total_cmp);
                let whole = all.iter().all(|v| v.is_null() || v.is_u64());
                match nums.len() {
                    0 => Value::Null,
                    n if whole => Value::from(nums[(n - 1) / 2] as u64),
                    n if n % 2 == 1 => Value::from(nums[n / 2]),
                    n => Value::from((nums[n / 2 - 1] + nums[n / 2]) / 2.0),
                }
            }
            other => other,
        };
        out.insert(key, merged);
    }
    let mut row: Row = serde_json::from_value(Value::Object(out))?;
    row.repeats = runs;
    Ok(row)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::probe::WorkerMetrics;
    use crate::runner::{LoadSample, Record, Windows};
    use std::time::Duration;

    /// A plausible row, for the tests of the reports.
    pub(crate) fn row(mode: &str, c: usize) -> Row {
        Row {
            mode: mode.into(),
            concurrency: c,
            ttft_p50_ms: 300.0,
            ttft_p90_ms: 500.0,
            ttft_p95_ms: 600.0,
            ttft_p99_ms: 900.0,
            itl_p50_ms: 30.0,
            itl_p95_ms: 40.0,
            itl_p99_ms: 50.0,
            e2e_p50_s: 25.0,
            e2e_p95_s: 30.0,
            e2e_p99_s: 35.0,
            output_tok_per_s: 2000.0,
            rps: 3.0,
            hit_rate: 0.9,
            oracle_hit_rate: 0.97,
            engine_hit_rate: None,
            errors: 0,
            mispredicted: None,
            predicted: None,
            moved: None,
            follow_ups: None,
            ttft_mean_ms: 350.0,
            worker_ttft_mean_ms: 330.0,
            requests: 100,
            mean_prompt_tokens: 5000.0,
            load_skew_mean: 1.1,
            inflight_spread_p95: 10.0,
            max_waiting: 0.0,
            host_cpu: 0.5,
            valid: true,
            cpu_by_role: vec![],
            repeats: vec![],
        }
    }

    #[test]
    fn repeated_runs_of_a_cell_give_each_metric_its_median() {
        let run = |p95: f64, tok: f64, requests: usize, hit: Option<f64>, valid: bool| Row {
            ttft_p95_ms: p95,
            output_tok_per_s: tok,
            requests,
            engine_hit_rate: hit,
            inflight_spread_p95: f64::NAN,
            valid,
            ..row("kv", 60)
        };
        let runs = vec![
            run(120.0, 2000.0, 300, Some(0.9), true),
            run(100.0, 2100.0, 310, None, true),
            run(900.0, 1900.0, 305, Some(0.8), true),
        ];
        let m = median_row(runs.clone()).unwrap();
        // Each metric on its own: the outlier run's p95 does not count.
        assert_eq!((m.ttft_p95_ms, m.output_tok_per_s, m.requests), (120.0, 2000.0, 305));
        assert!(m.engine_hit_rate.is_some_and(|h| (h - 0.85).abs() < 1e-9), "the runs that measured it");
        assert!(m.inflight_spread_p95.is_nan() && m.valid);
        assert_eq!((m.mode.as_str(), m.concurrency, m.repeats.len()), ("kv", 60, 3));
        // One invalid run makes the cell invalid; an even count of a whole
        // number takes the lower middle.
        let mut four = runs;
        four.push(run(110.0, 2050.0, 320, None, false));
        let m = median_row(four).unwrap();
        assert_eq!((m.ttft_p95_ms, m.requests, m.valid), (115.0, 305, false));
        // One run is itself, with no repeats; none is an error.
        let one = median_row(vec![row("kv", 60)]).unwrap();
        assert!(one.repeats.is_empty() && one.ttft_p95_ms == 600.0);
        assert!(median_row(Vec::new()).is_err());
        // The median row and its runs survive the result file.
        let back: Row = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!((back.repeats.len(), back.ttft_p95_ms), (4, 115.0));
    }

    fn rec(conv: u64, turn: usize, start: f64, ttft: f64, e2e: f64, p: u64, c: u64) -> Record {
        Record {
            conv,
            starter: 0,
            turn,
            start,
            ttft: Some(ttft),
            e2e,
            prompt_tokens: p,
            completion_tokens: c,
            cached_tokens: 0,
            error: None,
            route: None,
            tenant: None,
        }
    }

    #[test]
    fn a_row_with_nan_reads_back_from_its_json() {
        let mut r = row("dynamo", 60);
        r.inflight_spread_p95 = f64::NAN;
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains("\"inflight_spread_p95\":null"), "{text}");
        let back: Row = serde_json::from_str(&text).unwrap();
        assert!(back.inflight_spread_p95.is_nan());
        assert_eq!(back.mode, "dynamo");
    }

    #[test]
    fn a_router_is_wrong_when_the_engine_reported_less_than_it_believed() {
        use crate::client::Route;
        let routed = |reason: &str, matched: u32, cached: u64| Record {
            cached_tokens: cached,
            route: Some(Route { reason: reason.into(), matched_blocks: matched, ..Route::default() }),
            ..rec(0, 0, 0.0, 0.1, 1.0, 1_000, 10)
        };
        let wl = crate::workload::Requests::Groups(crate::workload::Groups::cache_pressure(8.0, 10.0, 10));
        let rs = [
            routed("kv", 10, 320),   // as predicted
            routed("kv", 10, 300),   // a partial block short: right
            routed("load", 10, 288), // a whole block short: wrong, whoever decided
            routed("load", 0, 0),    // no belief
            routed("round_robin", 0, 500),
        ];
        let ok: Vec<&Record> = rs.iter().collect();
        let ok: Vec<&&Record> = ok.iter().collect();
        assert_eq!(mispredicted(&ok, Oracle::Prefixes(&wl), 32), Some((3, 1)));
        // approx believes the shared prefix (~5/6 of this request's words):
        // wrong below half of it.
        let shared = shared_prefix_tokens(&rs[0], &wl);
        assert!((700..=900).contains(&shared), "{shared}");
        let ax = [routed("approx", 0, shared / 2), routed("approx", 0, shared / 2 - 1)];
        let ok: Vec<&Record> = ax.iter().collect();
        let ok: Vec<&&Record> = ok.iter().collect();
        assert_eq!(mispredicted(&ok, Oracle::Prefixes(&wl), 32), Some((2, 1)));
        // A router that does not say what it believed: no count.
        let plain = [rec(0, 0, 0.0, 0.1, 1.0, 1_000, 10)];
        let ok: Vec<&Record> = plain.iter().collect();
        let ok: Vec<&&Record> = ok.iter().collect();
        assert_eq!(mispredicted(&ok, Oracle::Prefixes(&wl), 32), None);
    }

    #[test]
    fn oracle_hits_are_whole_blocks_and_never_the_last_token() {
        assert_eq!(block_hit(100, 1000, 32), 96);
        assert_eq!(block_hit(5000, 1000, 32), 992); // capped at 999 tokens
        assert_eq!(block_hit(31, 1000, 32), 0);
        assert_eq!(block_hit(64, 64, 32), 32);
    }

    #[test]
    fn a_cell_summarizes_in_simulated_time() {
        let windows =
            Windows { warmup: Duration::from_secs(1), measure: Duration::from_secs(2), drain: Duration::from_secs(1) };
        let records = vec![
            // Warm-up: conversation 1's first turn (the starter's first use).
            rec(1, 0, 0.2, 0.05, 0.7, 1000, 100),
            // In the window: conversation 1's second turn, conversation 2's first.
            Record { cached_tokens: 1088, ..rec(1, 1, 1.2, 0.02, 0.5, 1150, 101) },
            rec(2, 0, 1.5, 0.04, 1.0, 1010, 51),
            // Started after the window: not measured.
            rec(2, 1, 3.1, 0.01, 0.1, 1100, 10),
            Record { error: Some("HTTP 503".into()), ..rec(3, 0, 2.0, 0.0, 0.1, 0, 0) },
        ];
        let run = CellRun {
            records,
            samples: vec![
                LoadSample {
                    t: 1.5,
                    inflight: vec![3.0, 1.0, 2.0],
                    waiting: vec![1.0, 0.0, 0.0],
                    kv_usage: vec![0.0; 3],
                    decode_context: vec![],
                },
                LoadSample {
                    t: 2.0,
                    inflight: vec![2.0, 2.0, 2.0],
                    waiting: vec![0.0, 0.0, 0.0],
                    kv_usage: vec![0.0; 3],
                    decode_context: vec![],
                },
            ],
            metrics: (
                vec![
                    WorkerMetrics {
                        queries: 100.0,
                        hits: 50.0,
                        ttft_sum_s: 1.0,
                        ttft_count: 10.0,
                        ..Default::default()
                    };
                    3
                ],
                vec![
                    WorkerMetrics {
                        queries: 1100.0,
                        hits: 950.0,
                        ttft_sum_s: 2.5,
                        ttft_count: 20.0,
                        ..Default::default()
                    };
                    3
                ],
            ),
            host_cpu: 0.5,
            cpu_by_role: vec![("envoy".into(), 0.2)],
            windows,
        };
        let r = summarize("kv", 2, &run, 10.0, 32, Oracle::Doks(&[900]), 0.7);
        assert_eq!((r.requests, r.errors), (3, 1));
        // TTFTs 20 and 40 ms wall -> 200 and 400 ms simulated.
        // Percentiles carry hdrhistogram's precision (3 significant digits).
        let close = |a: f64, b: f64| (a - b).abs() <= b * 1e-3;
        assert!(close(r.ttft_p50_ms, 200.0) && close(r.ttft_p95_ms, 400.0), "{} {}", r.ttft_p50_ms, r.ttft_p95_ms);
        // The client's mean against the workers' own: 3 x 1.5 s over 3 x 10
        // first tokens in the window.
        assert_eq!((r.ttft_mean_ms, r.worker_ttft_mean_ms), (300.0, 150.0));
        // ITL of conversation 1 turn 2: (0.5 - 0.02) / 100 s * 10.
        assert!(close(r.itl_p50_ms, 48.0), "{}", r.itl_p50_ms);
        assert!(close(r.e2e_p95_s, 10.0), "{}", r.e2e_p95_s);
        // Completed inside [1, 3): conv 1 turn 2 (ends 1.7) and conv 2 turn 1 (ends 2.5): 152 tokens in 20 s.
        assert_eq!((r.output_tok_per_s, r.rps), (7.6, 0.1));
        // What the clients were told: 1088 cached of 2160 prompt tokens;
        // the workers' own counters say 0.9.
        assert_eq!(r.hit_rate, (1088.0 / 2160.0 * 1000.0_f64).round() / 1000.0);
        assert_eq!(r.engine_hit_rate, Some(0.9));
        // Oracle: turn 2 reuses 1000 + 100 - 1 -> 1088 of 1150; the first
        // turn of conversation 2 reuses the starter's 900 -> 896 of 1010.
        assert_eq!(r.oracle_hit_rate, ((1088.0 + 896.0) / 2160.0 * 1000.0_f64).round() / 1000.0);
        assert_eq!((r.load_skew_mean, r.inflight_spread_p95, r.max_waiting), (1.25, 2.0, 1.0));
        assert!(r.valid);
        assert_eq!(r.cpu_by_role, vec![("envoy".to_owned(), 0.1)]);
    }

    /// A later turn moved when its route names another worker than the
    /// turn before's, wherever that one started; turns without a route,
    /// or whose turn before has none, are not counted.
    #[test]
    fn later_turns_sent_to_another_worker_are_counted_as_moved() {
        let on = |r: Record, w: &str| Record {
            route: Some(crate::client::Route {
                reason: "kv".into(),
                matched_blocks: 0,
                worker: w.into(),
                passed_over_blocks: 0,
            }),
            ..r
        };
        let records = vec![
            on(rec(1, 0, 0.1, 0.01, 0.5, 100, 10), "w0"),
            on(rec(1, 1, 1.0, 0.01, 0.5, 200, 10), "w0"),
            on(rec(1, 2, 2.0, 0.01, 0.5, 300, 10), "w1"),
            on(rec(2, 0, 1.1, 0.01, 0.5, 100, 10), "w1"),
            on(rec(2, 1, 2.1, 0.01, 0.5, 200, 10), "w2"),
            rec(3, 0, 1.2, 0.01, 0.5, 100, 10),
            on(rec(3, 1, 2.2, 0.01, 0.5, 200, 10), "w2"),
            on(rec(4, 0, 1.3, 0.01, 0.5, 100, 10), "w0"),
            rec(4, 1, 2.3, 0.01, 0.5, 200, 10),
        ];
        let all: Vec<&Record> = records.iter().collect();
        let ok: Vec<&&Record> = all.iter().filter(|r| r.start >= 1.0).collect();
        // Conv 1 turn 1 stayed, turn 2 and conv 2 turn 1 moved; conv 3's
        // turn before and conv 4's own turn carry no route.
        assert_eq!(moved(&records, &ok), Some((3, 2)));
        let unrouted: Vec<Record> = records.into_iter().map(|r| Record { route: None, ..r }).collect();
        assert_eq!(moved(&unrouted, &[]), None);
    }
}
