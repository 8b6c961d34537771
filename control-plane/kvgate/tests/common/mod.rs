//! Support shared by the process-level tests: a fleet of real processes
//! (nats-server, `kvgate sim` workers, a `kvgate relay` beside each, and
//! `kvgate serve`), all on 127.0.0.1, stopped (by PID) when dropped.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvgate_e2e::{NatsServer, Proc, RelaySpec, free_port, http_request, wait_for_tcp};
use serde_json::Value;

/// The served model name.
pub const MODEL: &str = "deepseek-v3";
/// Tokens per KV block in these tests.
pub const BLOCK: u64 = 16;

pub fn tokenizer_dir() -> PathBuf {
    std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| kvgate_e2e::repo_root().join(".tools/models/deepseek-v3"))
}

pub fn kvgate(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    c.args(args);
    c
}

/// Two consecutive free ports (ZMQ PUB and replay).
pub fn port_pair() -> u16 {
    kvgate_e2e::port_pair().unwrap()
}

pub fn until(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(secs) {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}");
}

/// The running fleet.
pub struct Fleet {
    pub nats: NatsServer,
    pub procs: Vec<Proc>,
    /// Each worker's OpenAI endpoint; worker `i` has id `w{i}`.
    pub http: Vec<SocketAddr>,
    /// The control plane's gRPC address.
    pub grpc: SocketAddr,
    /// The control plane's admin address.
    pub admin: SocketAddr,
    /// Each relay's own /metrics address.
    pub relay_metrics: Vec<SocketAddr>,
}

impl Fleet {
    /// Starts `workers` simulated workers (time sped up `speedup` times)
    /// and waits until the control plane sees them all live.
    pub fn start(dir: &Path, workers: usize, speedup: &str) -> Fleet {
        Self::start_with(dir, workers, speedup, None)
    }

    /// Like [`Fleet::start`]; with `auth`, NATS requires that user and
    /// password and every client finds them in its NATS URL.
    pub fn start_with(dir: &Path, workers: usize, speedup: &str, auth: Option<(&str, &str)>) -> Fleet {
        Self::start_full(dir, workers, speedup, auth, &[])
    }

    /// Like [`Fleet::start_with`], with more arguments for `kvgate serve`.
    pub fn start_full(
        dir: &Path,
        workers: usize,
        speedup: &str,
        auth: Option<(&str, &str)>,
        serve_args: &[&str],
    ) -> Fleet {
        let (nats, nats_url) = match auth {
            Some((u, p)) => {
                let n = NatsServer::start_with_auth(dir, u, p).unwrap();
                let url = format!("nats://{u}:{p}@127.0.0.1:{}", n.port);
                (n, url)
            }
            None => {
                let n = NatsServer::start(dir).unwrap();
                let url = format!("nats://127.0.0.1:{}", n.port);
                (n, url)
            }
        };
        let mut relay_metrics = Vec::new();
        let tk = tokenizer_dir();
        let tk = tk.to_str().unwrap();
        let mut procs: Vec<Proc> = Vec::new();
        let mut http = Vec::new();
        for w in 0..workers {
            let hp = free_port().unwrap();
            let zp = port_pair();
            let (hp_s, zp_s) = (hp.to_string(), zp.to_string());
            let sim = kvgate(&[
                "sim",
                "--workers",
                "1",
                "--tokenizer-dir",
                tk,
                "--http-port",
                &hp_s,
                "--zmq-port",
                &zp_s,
                "--block-size",
                "16",
                "--num-blocks",
                "4096",
                "--speedup",
                speedup,
            ]);
            procs.push(Proc::spawn(&format!("sim-{w}"), sim, dir).unwrap());
            let addr: SocketAddr = ([127, 0, 0, 1], hp).into();
            wait_for_tcp(addr, Duration::from_secs(30)).unwrap();
            http.push(addr);
            let worker = format!("w{w}");
            let spec = RelaySpec {
                zmq_port: zp,
                worker: addr,
                worker_id: &worker,
                nats_url: &nats_url,
                model: MODEL,
                block_size: 16,
                max_num_seqs: 64,
                heartbeat_ms: 100,
            };
            let mut relay = Command::new(env!("CARGO_BIN_EXE_kvgate"));
            let rm: SocketAddr = ([127, 0, 0, 1], free_port().unwrap()).into();
            relay.args(spec.args()).arg("--listen-metrics").arg(rm.to_string());
            relay_metrics.push(rm);
            procs.push(Proc::spawn(&format!("relay-{w}"), relay, dir).unwrap());
        }
        let (gp, ap) = (free_port().unwrap(), free_port().unwrap());
        let (grpc, admin) = (format!("127.0.0.1:{gp}"), format!("127.0.0.1:{ap}"));
        let mut serve = kvgate(&[
            "serve",
            "--model",
            MODEL,
            "--tokenizer-dir",
            tk,
            "--block-size",
            "16",
            "--nats-url",
            &nats_url,
            "--listen-grpc",
            &grpc,
            "--listen-admin",
            &admin,
            "--replica-id",
            "cp-e2e",
        ]);
        serve.args(serve_args);
        procs.push(Proc::spawn("serve", serve, dir).unwrap());
        let fleet =
            Fleet { nats, procs, http, grpc: grpc.parse().unwrap(), admin: admin.parse().unwrap(), relay_metrics };
        wait_for_tcp(fleet.admin, Duration::from_secs(30)).unwrap();
        until(30, "every worker live in the control plane", || {
            fleet.workers()[MODEL].as_array().is_some_and(|a| a.len() == workers && a.iter().all(|w| w["live"] == true))
        });
        fleet
    }

    /// `/admin/workers` of the control plane.
    pub fn workers(&self) -> Value {
        serde_json::from_slice(&http_request(self.admin, "GET", "/admin/workers", &[], b"").unwrap().body).unwrap()
    }

    /// Waits until no request is in flight and every worker's last heartbeat
    /// says nothing runs: a stale "running: 1" is load that the scheduler
    /// weighs against cache overlap (a user's next turn comes seconds
    /// later; a test's comes at once).
    pub fn wait_quiet(&self) {
        until(10, "a quiet fleet", || {
            self.workers()[MODEL]
                .as_array()
                .is_some_and(|ws| ws.iter().all(|w| w["inflight"] == 0 && w["running"] == 0))
        });
    }

    /// Device blocks of worker `w` in the control plane's index.
    pub fn blocks(&self, w: usize) -> u64 {
        self.workers()[MODEL][w]["device_blocks"].as_u64().unwrap_or(0)
    }

    /// The control plane's Prometheus text.
    pub fn metrics(&self) -> String {
        String::from_utf8(http_request(self.admin, "GET", "/metrics", &[], b"").unwrap().body).unwrap()
    }

    /// Every process still runs.
    pub fn check(&mut self) {
        for p in &mut self.procs {
            p.ensure_running().unwrap();
        }
    }
}

/// The value of one Prometheus sample line `name{labels} value`.
pub fn prom(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
}
