//! # kvgate-bench-support
//!
//! What every benchmark of kvgate shares, and nothing else: the provenance
//! of a result (commit and machine, written into every JSON under
//! `bench/results/`), percentiles through `hdrhistogram` (one
//! implementation for every benchmark), deterministic English-like prompt
//! text, and a process's CPU time from `/proc`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's root (this crate is `bench/support`).
pub fn repo_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().and_then(Path::parent).unwrap_or(here).to_path_buf()
}

/// Quantiles of a set of samples, through an HDR histogram with three
/// significant digits (0.1 % relative precision): values are recorded in
/// thousandths of their unit, so any unit (µs, ms, s) keeps its precision.
#[derive(Debug, Clone)]
pub struct Samples {
    /// `None` only if the histogram could not be made (it always can with
    /// 3 significant digits): then nothing is recorded.
    h: Option<hdrhistogram::Histogram<u64>>,
}

impl Default for Samples {
    fn default() -> Self {
        Self::new()
    }
}

impl Samples {
    /// No samples yet.
    pub fn new() -> Self {
        Self { h: hdrhistogram::Histogram::new(3).ok() }
    }

    /// Records one value (negative and non-finite values are skipped).
    pub fn record(&mut self, v: f64) {
        if let Some(h) = self.h.as_mut()
            && v.is_finite()
            && v >= 0.0
        {
            let _ = h.record((v * 1000.0).round() as u64);
        }
    }

    /// Values recorded.
    pub fn len(&self) -> u64 {
        self.h.as_ref().map_or(0, |h| h.len())
    }

    /// Whether none was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `q` quantile (0–1); NaN when empty.
    pub fn quantile(&self, q: f64) -> f64 {
        match &self.h {
            Some(h) if !h.is_empty() => h.value_at_quantile(q.clamp(0.0, 1.0)) as f64 / 1000.0,
            _ => f64::NAN,
        }
    }

    /// The mean; NaN when empty.
    pub fn mean(&self) -> f64 {
        match &self.h {
            Some(h) if !h.is_empty() => h.mean() / 1000.0,
            _ => f64::NAN,
        }
    }
}

impl FromIterator<f64> for Samples {
    fn from_iter<I: IntoIterator<Item = f64>>(iter: I) -> Self {
        let mut s = Self::new();
        for v in iter {
            s.record(v);
        }
        s
    }
}

/// The `q` quantile (0–1) of `values`; NaN when empty.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    values.iter().copied().collect::<Samples>().quantile(q)
}

/// On-CPU nanoseconds (user + system) a process has used so far, threads
/// that have exited included (`/proc/<pid>/stat`, clock ticks of
/// `getconf CLK_TCK`, 100 if unknown); 0 when it cannot be read.
pub fn process_cpu_ns(pid: u32) -> u64 {
    static TICK_NS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let tick_ns = *TICK_NS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse::<u64>().ok())
            .filter(|&hz| hz > 0)
            .map_or(10_000_000, |hz| 1_000_000_000 / hz)
    });
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0 };
    // Fields after the command name, which may itself hold spaces or ')':
    // the rest starts at field 3 (state); utime is field 14, stime field 15.
    let Some((_, rest)) = stat.rsplit_once(')') else { return 0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    (ticks(11) + ticks(12)) * tick_ns
}

/// Whether a virtio-balloon device's feature bits (its sysfs `features`: one
/// character per bit, bit 0 first) include free page reporting (bit 5,
/// `VIRTIO_BALLOON_F_REPORTING`).
fn reports_free_pages(features: &str) -> bool {
    features.trim().as_bytes().get(5) == Some(&b'1')
}

/// Whether this machine is a VM that hands the pages its kernel frees back
/// to its host: a process's new memory then faults in the host too (on a
/// Firecracker VM, ~2.7 ms per MiB against ~0.4: docs/DECISIONS.md), which
/// moves any number that allocates.
fn returns_free_pages() -> bool {
    let Ok(devices) = std::fs::read_dir("/sys/bus/virtio/drivers/virtio_balloon") else { return false };
    devices.flatten().any(|d| std::fs::read_to_string(d.path().join("features")).is_ok_and(|f| reports_free_pages(&f)))
}

/// Provenance of a benchmark result: the short commit of `HEAD` (with
/// `-dirty` when tracked code has changes) and the machine (arch, cores,
/// CPU, and whether it returns freed memory to a host).
pub fn provenance() -> (String, String) {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(repo_root())
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    let mut commit = git(&["rev-parse", "--short", "HEAD"]);
    // Results of earlier runs (bench/results/) and prose (Markdown: READMEs,
    // docs/) do not make the code dirty: a README written while a long run
    // goes on labelled its results "-dirty" though the code was the commit's.
    let changed =
        git(&["status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results", ":(exclude)*.md"]);
    if !changed.is_empty() {
        commit.push_str("-dirty");
    }
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("")
        .trim()
        .to_owned();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let mut machine = format!("{} {} cores, {}", std::env::consts::ARCH, cores, cpu);
    if returns_free_pages() {
        machine.push_str(", VM returning freed pages to its host (virtio-balloon free page reporting)");
    }
    (commit, machine)
}

/// Deterministic English-like text of `n` words (benchmark prompts).
pub fn words(seed: u64, n: usize) -> String {
    const W: &[&str] = &[
        "the",
        "kv",
        "cache",
        "router",
        "prefix",
        "token",
        "block",
        "worker",
        "latency",
        "throughput",
        "envoy",
        "filter",
        "model",
        "request",
        "stream",
        "prompt",
        "system",
        "user",
        "assistant",
        "tool",
        "answer",
        "question",
        "gateway",
        "cluster",
        "endpoint",
        "header",
        "hash",
        "index",
        "radix",
        "tree",
        "load",
        "decode",
        "prefill",
        "batch",
        "memory",
        "gpu",
        "h200",
        "vllm",
        "nats",
        "event",
        "relay",
        "snapshot",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::with_capacity(n * 7);
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(if i % 17 == 0 { '.' } else { ' ' });
            if i % 17 == 0 {
                out.push(' ');
            }
        }
        out.push_str(W[(x % W.len() as u64) as usize]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_keep_three_significant_digits_in_any_unit() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert!((quantile(&v, 0.5) - 500.0).abs() <= 0.5);
        assert!((quantile(&v, 0.99) - 990.0).abs() <= 1.0);
        let small: Vec<f64> = v.iter().map(|x| x / 1e3).collect();
        assert!((quantile(&small, 0.5) - 0.5).abs() <= 0.001);
        assert!(quantile(&[], 0.5).is_nan());
        let s: Samples = [f64::NAN, -1.0, 2.0].into_iter().collect();
        assert_eq!((s.len(), s.quantile(1.0)), (1, 2.0));
    }

    /// The balloon of the Firecracker VM these results were measured on
    /// (stats, deflate on OOM, reporting; version 1), and without reporting.
    #[test]
    fn free_page_reporting_is_bit_five() {
        let firecracker = "0110010100000000000000000000000010000000000000000000000000000000\n";
        assert!(reports_free_pages(firecracker));
        assert!(!reports_free_pages("0110000100000000000000000000000010000000000000000000000000000000"));
        assert!(!reports_free_pages("0110"));
        assert!(!reports_free_pages(""));
    }
}
