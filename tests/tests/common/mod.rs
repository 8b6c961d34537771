//! Support shared by the process-level tests: a fleet of real processes
//! (nats-server, `kvgate sim` workers, a `kvgate relay` beside each, and
//! `kvgate serve`), all on 127.0.0.1, stopped (by PID) when dropped.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvgate_testkit::{
    Envoy, NatsServer, Proc, RelaySpec, envoy_validate, free_port, http_request, render_kvgate_envoy, wait_for_tcp,
};
use serde_json::Value;

/// The served model name.
pub const MODEL: &str = "deepseek-v3";
/// Tokens per KV block in these tests.
pub const BLOCK: u64 = 16;

pub fn tokenizer_dir() -> PathBuf {
    std::env::var_os("KVGATE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| kvgate_testkit::repo_root().join(".tools/models/deepseek-v3"))
}

pub fn kvgate(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    c.args(args);
    c
}

/// `kvgate` with these arguments.
pub fn kvgate_args(args: &[String]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvgate"));
    c.args(args);
    c
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

/// Extra settings of a fleet.
#[derive(Default)]
pub struct FleetOpts<'a> {
    /// NATS user and password.
    pub auth: Option<(&'a str, &'a str)>,
    /// More arguments for `kvgate serve`.
    pub serve_args: &'a [&'a str],
    /// More arguments for every `kvgate relay`.
    pub relay_args: &'a [&'a str],
    /// More `--flag value` pairs for every `kvgate sim` (replacing the
    /// fleet's own value of that flag).
    pub sim_args: &'a [&'a str],
    /// Data-parallel ranks per simulated server (0 or 1: none); each rank
    /// is a worker `w<i>/dp<r>` of the control plane.
    pub data_parallel_size: u32,
    /// Each worker's role (`prefill`, `decode`, `both`) for its relay's
    /// `--role`; missing or "" = the relay's default.
    pub roles: &'a [&'a str],
    /// A `kvgate pd-sidecar` in front of every `decode` or `both` worker: its address
    /// is the worker's endpoint (in `http` and in the relay's heartbeats).
    pub pd_sidecar: bool,
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
    /// Each worker's simulated engine (its `http` entry, or the engine
    /// behind its P/D sidecar).
    pub engines: Vec<SocketAddr>,
    /// The P/D sidecars (`FleetOpts::pd_sidecar`).
    pub sidecars: Vec<Proc>,
    /// The arguments each process was started with (to start it again):
    /// `procs[2w]` is sim `w`, `procs[2w + 1]` its relay, the last one the
    /// control plane.
    args: Vec<Vec<String>>,
    dir: PathBuf,
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
        Self::start_opts(dir, workers, speedup, FleetOpts { auth, serve_args, ..Default::default() })
    }

    /// The most general start.
    pub fn start_opts(dir: &Path, workers: usize, speedup: &str, opts: FleetOpts<'_>) -> Fleet {
        let FleetOpts { auth, serve_args, relay_args, sim_args: extra_sim_args, data_parallel_size, roles, pd_sidecar } =
            opts;
        let (mut engines, mut sidecars) = (Vec::new(), Vec::new());
        let dp = data_parallel_size.max(1);
        let mut args: Vec<Vec<String>> = Vec::new();
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
            // The worker picks and holds its ports itself and names them
            // (`kvgate_testkit::spawn_sim`): no test running beside can take
            // one between the pick and the bind.
            let mut sim_args: Vec<String> = [
                "sim",
                "--workers",
                "1",
                "--tokenizer-dir",
                tk,
                "--http-port",
                "0",
                "--zmq-port",
                "any",
                "--block-size",
                "16",
                "--num-blocks",
                "4096",
                "--speedup",
                speedup,
                "--data-parallel-size",
                &dp.to_string(),
            ]
            .iter()
            .map(|a| (*a).to_owned())
            .collect();
            for pair in extra_sim_args.chunks(2) {
                match sim_args.iter().position(|a| a == pair[0]) {
                    Some(i) if pair.len() == 2 => sim_args[i + 1] = pair[1].to_owned(),
                    _ => sim_args.extend(pair.iter().map(|a| (*a).to_owned())),
                }
            }
            let (sim, bound) = kvgate_testkit::spawn_sim(&format!("sim-{w}"), kvgate_args(&sim_args), dir)
                .unwrap_or_else(|e| panic!("sim-{w}: {e:#}"));
            procs.push(sim);
            let (hp, zp) = (bound.http.port(), bound.zmq_port.expect("the sim publishes KV events"));
            // A restart binds the same ports (its relay names them).
            for (flag, port) in [("--http-port", hp), ("--zmq-port", zp)] {
                if let Some(i) = sim_args.iter().position(|a| a == flag) {
                    sim_args[i + 1] = port.to_string();
                }
            }
            // The relay announces the engine's batch limit.
            let max_num_seqs = sim_args
                .iter()
                .position(|a| a == "--max-num-seqs")
                .and_then(|i| sim_args.get(i + 1)?.parse().ok())
                .unwrap_or(64);
            args.push(sim_args);
            let engine = bound.http;
            engines.push(engine);
            let role = roles.get(w).copied().unwrap_or("");
            let addr = if pd_sidecar && (role == "decode" || role == "both") {
                let front: SocketAddr = ([127, 0, 0, 1], free_port().unwrap()).into();
                let (listen, decode) = (front.to_string(), engine.to_string());
                let a = ["pd-sidecar", "--listen", &listen, "--decode", &decode, "--prefill-timeout-ms", "5000"];
                sidecars.push(Proc::spawn(&format!("pd-sidecar-{w}"), kvgate(&a), dir).unwrap());
                wait_for_tcp(front, Duration::from_secs(30)).unwrap();
                front
            } else {
                engine
            };
            http.push(addr);
            let worker = format!("w{w}");
            let spec = RelaySpec {
                zmq_port: zp,
                worker: addr,
                worker_id: &worker,
                nats_url: &nats_url,
                model: MODEL,
                block_size: 16,
                max_num_seqs,
                heartbeat_ms: 100,
                data_parallel_size: dp,
            };
            let rm: SocketAddr = ([127, 0, 0, 1], free_port().unwrap()).into();
            let mut relay_a = spec.args();
            // The engine's metrics, behind a sidecar too.
            if let Some(i) = relay_a.iter().position(|a| a == "--metrics-url") {
                relay_a[i + 1] = format!("http://{engine}/metrics");
            }
            if !role.is_empty() {
                relay_a.extend(["--role".to_owned(), role.to_owned()]);
            }
            relay_a.extend(["--listen-metrics".to_owned(), rm.to_string()]);
            relay_a.extend(relay_args.iter().map(|a| (*a).to_owned()));
            relay_metrics.push(rm);
            procs.push(Proc::spawn(&format!("relay-{w}"), kvgate_args(&relay_a), dir).unwrap());
            args.push(relay_a);
        }
        let mut serve_a: Vec<String> = [
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
            "127.0.0.1:0",
            "--listen-admin",
            "127.0.0.1:0",
            "--replica-id",
            "cp-e2e",
        ]
        .iter()
        .map(|a| (*a).to_owned())
        .collect();
        serve_a.extend(serve_args.iter().map(|a| (*a).to_owned()));
        let (serve, addrs) = kvgate_testkit::spawn_serve("serve", kvgate_args(&serve_a), dir).unwrap();
        procs.push(serve);
        // A restart binds the same addresses (Envoy's configuration names them).
        for (flag, addr) in [("--listen-grpc", addrs.grpc), ("--listen-admin", addrs.admin)] {
            if let Some(i) = serve_a.iter().position(|a| a == flag) {
                serve_a[i + 1] = addr.to_string();
            }
        }
        args.push(serve_a);
        let (grpc, admin) = (addrs.grpc.to_string(), addrs.admin.to_string());
        let fleet = Fleet {
            nats,
            procs,
            http,
            grpc: grpc.parse().unwrap(),
            admin: admin.parse().unwrap(),
            relay_metrics,
            engines,
            sidecars,
            args,
            dir: dir.to_owned(),
        };
        wait_for_tcp(fleet.admin, Duration::from_secs(30)).unwrap();
        // A backstop, not a bound: on a loaded 2-core machine the relays'
        // first heartbeats and snapshots can take a while.
        until(120, "every worker live in the control plane", || {
            fleet.workers()[MODEL]
                .as_array()
                .is_some_and(|a| a.len() == workers * dp as usize && a.iter().all(|w| w["live"] == true))
        });
        fleet
    }

    /// `/admin/workers` of the control plane.
    pub fn workers(&self) -> Value {
        // Null while the control plane is down (a fault test kills it).
        http_request(self.admin, "GET", "/admin/workers", &[], b"")
            .ok()
            .and_then(|r| serde_json::from_slice(&r.body).ok())
            .unwrap_or_default()
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
        self.worker(w)["device_blocks"].as_u64().unwrap_or(0)
    }

    /// The control plane's Prometheus text.
    pub fn metrics(&self) -> String {
        String::from_utf8(http_request(self.admin, "GET", "/metrics", &[], b"").unwrap().body).unwrap()
    }

    /// Index of sim `w`, relay `w` and the control plane in `procs`.
    pub fn sim(w: usize) -> usize {
        2 * w
    }

    /// See [`Fleet::sim`].
    pub fn relay(w: usize) -> usize {
        2 * w + 1
    }

    /// See [`Fleet::sim`].
    pub fn serve(&self) -> usize {
        self.procs.len() - 1
    }

    /// Kills process `i` (SIGKILL, by its PID) and reaps it: its sockets are
    /// closed when this returns.
    pub fn kill(&mut self, i: usize) {
        self.procs[i].kill();
    }

    /// Sends process `i` the SIGKILL of [`Fleet::kill`] and returns at once,
    /// so that a test timing what the control plane notices of a death does
    /// not time the kernel's teardown too. The process is reaped when it is
    /// restarted or the fleet dropped.
    pub fn signal_kill(&mut self, i: usize) {
        self.procs[i].signal_kill();
    }

    /// Starts process `i` again with the same arguments (same ports).
    pub fn restart(&mut self, i: usize) {
        self.procs[i].kill();
        let name = format!("{}-{i}-again", self.args[i][0]);
        self.procs[i] = Proc::spawn(&name, kvgate_args(&self.args[i]), &self.dir).unwrap();
    }

    /// Sends a signal (`STOP`, `CONT`) to process `i`, by its PID.
    pub fn signal(&self, i: usize, sig: &str) {
        let ok = Command::new("kill").arg(format!("-{sig}")).arg(self.procs[i].pid().to_string()).status().unwrap();
        assert!(ok.success(), "kill -{sig}");
    }

    /// The simulator's own view of worker `w`'s cache (`/kvgate/sim/cache`).
    pub fn engine_blocks(&self, w: usize) -> Option<u64> {
        let r = http_request(self.http[w], "GET", "/kvgate/sim/cache", &[], b"").ok()?;
        let v: Value = serde_json::from_slice(&r.body).ok()?;
        v["cached_blocks"].as_u64()
    }

    /// Worker `w`'s entry in `/admin/workers`.
    pub fn worker(&self, w: usize) -> Value {
        let id = format!("w{w}");
        self.workers()[MODEL]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["id"] == id.as_str()).cloned())
            .unwrap_or_default()
    }

    /// Real Envoy with the kvgate filter (configuration `filter`) in front
    /// of this fleet, its configuration validated first.
    pub fn envoy(&self, filter: &Value) -> Envoy {
        let config = self.dir.join("envoy.yaml");
        let yaml = render_kvgate_envoy(0, 0, &self.http, &[self.grpc], &filter.to_string()).unwrap();
        std::fs::write(&config, yaml).unwrap();
        envoy_validate(&config).unwrap();
        Envoy::start(&config, &self.dir).unwrap()
    }

    /// Every process still runs.
    pub fn check(&mut self) {
        for p in self.procs.iter_mut().chain(&mut self.sidecars) {
            p.ensure_running().unwrap();
        }
    }
}

/// The value of one Prometheus sample line `name{labels} value`.
pub fn prom(text: &str, series: &str) -> Option<f64> {
    kvgate_testkit::prom::value(text, series)
}
