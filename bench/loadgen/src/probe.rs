//! Readings taken beside the load: host CPU (`/proc/stat`), CPU of each
//! process of the stack (`/proc/PID/stat`), and the workers' vLLM
//! `/metrics` (prefix cache counters, running and waiting requests).

use std::net::SocketAddr;

use kvgate_testkit::http_request;

/// Busy and total jiffies of the whole host.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostCpu {
    busy: u64,
    total: u64,
}

impl HostCpu {
    /// Reads `/proc/stat` (zeros where it cannot be read).
    pub fn read() -> Self {
        let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else { return Self::default() };
        let v: Vec<u64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
        let total: u64 = v.iter().take(8).sum();
        // idle + iowait are not busy.
        let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
        HostCpu { busy: total.saturating_sub(idle), total }
    }

    /// Busy share of all cores between `earlier` and `self`, 0–1.
    pub fn since(&self, earlier: &HostCpu) -> f64 {
        let t = self.total.saturating_sub(earlier.total);
        if t == 0 { 0.0 } else { self.busy.saturating_sub(earlier.busy) as f64 / t as f64 }
    }
}

/// CPU seconds (user + system) a process has used so far.
pub fn process_cpu_s(pid: u32) -> f64 {
    kvgate_bench_support::process_cpu_ns(pid) as f64 / 1e9
}

/// The counters and gauges of one worker's `/metrics` that the report uses.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkerMetrics {
    /// `vllm:prefix_cache_queries_total` (tokens).
    pub queries: f64,
    /// `vllm:prefix_cache_hits_total` (tokens).
    pub hits: f64,
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:num_requests_waiting`.
    pub waiting: f64,
    /// `vllm:time_to_first_token_seconds_sum` (the engine's own TTFT, from
    /// the request's arrival at the worker; simulated seconds).
    pub ttft_sum_s: f64,
    /// `vllm:time_to_first_token_seconds_count`.
    pub ttft_count: f64,
    /// `vllm:inter_token_latency_seconds_sum` (simulated seconds).
    pub itl_sum_s: f64,
    /// `vllm:inter_token_latency_seconds_count`.
    pub itl_count: f64,
    /// `vllm:kv_cache_usage_perc` (a fraction).
    pub kv_usage: f64,
    /// `vllm:request_queue_time_seconds_sum` (arrival to the first step
    /// that schedules the request; simulated seconds).
    pub queue_sum_s: f64,
    /// `vllm:request_queue_time_seconds_count`.
    pub queue_count: f64,
    /// `kvgate_sim_decode_context_tokens`: context tokens the last
    /// decoding step's requests attended over (the simulator only).
    pub decode_context: Option<f64>,
}

/// Parses the series the report uses from Prometheus text.
pub fn parse_metrics(text: &str) -> WorkerMetrics {
    let mut m = WorkerMetrics::default();
    for s in kvgate_testkit::prom::samples(text) {
        let v = s.value;
        match s.name {
            "vllm:prefix_cache_queries_total" => m.queries += v,
            "vllm:prefix_cache_hits_total" => m.hits += v,
            "vllm:num_requests_running" => m.running += v,
            "vllm:num_requests_waiting" => m.waiting += v,
            "vllm:time_to_first_token_seconds_sum" => m.ttft_sum_s += v,
            "vllm:time_to_first_token_seconds_count" => m.ttft_count += v,
            "vllm:inter_token_latency_seconds_sum" => m.itl_sum_s += v,
            "vllm:inter_token_latency_seconds_count" => m.itl_count += v,
            "vllm:kv_cache_usage_perc" => m.kv_usage += v,
            "vllm:request_queue_time_seconds_sum" => m.queue_sum_s += v,
            "vllm:request_queue_time_seconds_count" => m.queue_count += v,
            "kvgate_sim_decode_context_tokens" => *m.decode_context.get_or_insert(0.0) += v,
            _ => {}
        }
    }
    m
}

/// Scrapes one worker (None when it does not answer).
pub fn scrape(worker: SocketAddr) -> Option<WorkerMetrics> {
    let r = http_request(worker, "GET", "/metrics", &[], b"").ok()?;
    (r.status == 200).then(|| parse_metrics(&String::from_utf8_lossy(&r.body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_metrics_are_read_by_name_whatever_the_labels() {
        let text = "# HELP x\nvllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0\n\
                    vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 1000.0\n\
                    vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 900.0\n\
                    vllm:prefix_cache_hits_total_other 5\n\
                    vllm:time_to_first_token_seconds_bucket{le=\"0.5\",model_name=\"m\"} 7\n\
                    vllm:time_to_first_token_seconds_sum{model_name=\"m\"} 2.5\n\
                    vllm:time_to_first_token_seconds_count{model_name=\"m\"} 8\n\
                    vllm:inter_token_latency_seconds_sum{model_name=\"m\"} 0.5\n\
                    vllm:inter_token_latency_seconds_count{model_name=\"m\"} 20\n\
                    vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n\
                    vllm:request_queue_time_seconds_sum{model_name=\"m\"} 0.1\n\
                    vllm:request_queue_time_seconds_count{model_name=\"m\"} 8\n";
        assert_eq!(
            parse_metrics(text),
            WorkerMetrics {
                queries: 1000.0,
                hits: 900.0,
                running: 3.0,
                waiting: 1.0,
                ttft_sum_s: 2.5,
                ttft_count: 8.0,
                itl_sum_s: 0.5,
                itl_count: 20.0,
                kv_usage: 0.25,
                queue_sum_s: 0.1,
                queue_count: 8.0,
                decode_context: None,
            }
        );
    }

    #[test]
    fn cpu_readings_move_forward() {
        let a = HostCpu::read();
        let mut x = 0u64;
        for i in 0..50_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        assert!(x != 1);
        let b = HostCpu::read();
        let share = b.since(&a);
        assert!((0.0..=1.0).contains(&share), "{share}");
        assert!(process_cpu_s(std::process::id()) > 0.0);
    }
}
