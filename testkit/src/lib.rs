//! Support for kvgate's end-to-end tests: real processes (Envoy, nats-server)
//! on 127.0.0.1, started by PID and killed by PID when dropped, plus small
//! blocking clients (a NATS protocol client, an HTTP/1.1 client) and
//! self-identifying HTTP upstreams.
//!
//! Tools are found through the variables `scripts/setup.sh` writes to
//! `.tools/env` (`KVGATE_ENVOY`, `KVGATE_NATS_SERVER`), else in `.tools/bin/`.
//! A missing tool is an error that says to run `scripts/setup.sh` (the
//! Makefile does): tests never skip silently.

use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};

pub mod http;
pub mod nats;
pub mod prom;
pub mod vllm;

pub use http::{HttpResponse, http_request};
pub use nats::{NatsClient, NatsMsg};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Path of a tool installed by `scripts/setup.sh`.
pub fn tool(env_var: &str, name: &str) -> Result<PathBuf> {
    let path =
        std::env::var_os(env_var).map(PathBuf::from).unwrap_or_else(|| repo_root().join(".tools/bin").join(name));
    ensure!(path.exists(), "{name} not found at {} ({env_var}); run scripts/setup.sh (make test does)", path.display());
    Ok(path)
}

/// The shared vectors and traces: `$KVGATE_SHARED_DIR`, else `<repo>/../shared`.
/// A missing folder is an error: the vectors are the contract.
pub fn shared_dir() -> Result<PathBuf> {
    let dir = std::env::var_os("KVGATE_SHARED_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("../shared"));
    ensure!(dir.join("vectors").is_dir(), "shared vectors not found at {} (set KVGATE_SHARED_DIR)", dir.display());
    Ok(dir)
}

/// Bytes of a hex string.
pub fn unhex(s: &str) -> Result<Vec<u8>> {
    ensure!(s.len().is_multiple_of(2), "odd-length hex string");
    (0..s.len()).step_by(2).map(|i| Ok(u8::from_str_radix(&s[i..i + 2], 16)?)).collect()
}

/// Path of a real vLLM 0.32 capture (`inst0`, `relay1`, ...).
pub fn capture_path(name: &str) -> Result<PathBuf> {
    Ok(shared_dir()?.join(format!("vectors/vllm-kv-events/real-0.32-cpu/{name}.raw.jsonl")))
}

/// The ZMQ frames of every message of a real capture, in order.
pub fn capture_frames(name: &str) -> Result<Vec<Vec<Vec<u8>>>> {
    let text = std::fs::read_to_string(capture_path(name)?)?;
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l)?;
            let frames = v["frames_hex"].as_array().ok_or_else(|| anyhow!("no frames_hex"))?;
            frames.iter().map(|f| unhex(f.as_str().ok_or_else(|| anyhow!("frame is not a string"))?)).collect()
        })
        .collect()
}

/// A fresh scratch directory under `target/e2e/` (kept after the test for
/// post-mortem logs; `cargo clean` removes it).
pub fn scratch_dir(name: &str) -> Result<PathBuf> {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = repo_root().join("target/e2e").join(format!(
        "{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// A port that was free a moment ago on 127.0.0.1, and that no earlier call
/// in this process handed out.
///
/// It is drawn at random from 10,000 up to the start of the kernel's
/// ephemeral range (`ip_local_port_range`) when that leaves at least 4,096
/// ports: no outgoing connection of any process can then take it before the
/// process it is meant for binds it, as one can with `bind(0)`, which picks
/// from the very range outgoing connections use. A port is free until its
/// process binds it, so the ports handed out are remembered: two calls
/// before either binds (one stack's workers) never get the same one. Prefer
/// port 0 where the process reports what it bound (as [`Envoy::start`] does).
pub fn free_port() -> Result<u16> {
    static PICKS: AtomicU64 = AtomicU64::new(0);
    const FLOOR: u16 = 10_000;
    if let Some(low) = ephemeral_low().filter(|&l| l >= FLOOR + 4096) {
        let span = u64::from(low - FLOOR);
        let keys = std::hash::RandomState::new();
        for _ in 0..64 {
            let n = PICKS.fetch_add(1, Ordering::Relaxed);
            let port = FLOOR + u16::try_from(keys.hash_one(n) % span)?;
            if claim(port, 1) {
                return Ok(port);
            }
        }
    }
    for _ in 0..64 {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        if claim(port, 1) {
            return Ok(port);
        }
    }
    bail!("no free port on 127.0.0.1 that this process has not handed out")
}

/// Claims ports `first .. first + n` for this process when each is free on
/// 127.0.0.1 and none was handed out before.
fn claim(first: u16, n: u16) -> bool {
    static HANDED: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let Some(end) = first.checked_add(n) else {
        return false;
    };
    let mut handed = HANDED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let free = |q: u16| !handed.contains(&q) && TcpListener::bind(("127.0.0.1", q)).is_ok();
    if !(first..end).all(free) {
        return false;
    }
    handed.extend(first..end);
    true
}

/// The low end of the kernel's ephemeral port range, when readable.
fn ephemeral_low() -> Option<u16> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// Two consecutive free ports on 127.0.0.1 (a simulated worker's ZMQ PUB
/// and replay sockets).
pub fn port_pair() -> Result<u16> {
    port_run(2)
}

/// `n` consecutive free ports on 127.0.0.1, the first returned (the event
/// and replay sockets of a simulated worker's data-parallel ranks).
pub fn port_run(n: u16) -> Result<u16> {
    for _ in 0..50 {
        let p = free_port()?;
        if n <= 1 || p.checked_add(1).is_some_and(|q| claim(q, n - 1)) {
            return Ok(p);
        }
    }
    bail!("no {n} consecutive free ports")
}

/// `kvgate relay` beside a simulated worker (`kvgate sim`) on 127.0.0.1
/// whose ZMQ PUB port is `zmq_port` and replay port `zmq_port + D` for D
/// data-parallel ranks (rank r's sockets: those ports + r).
#[derive(Debug, Clone)]
pub struct RelaySpec<'a> {
    /// The worker's ZMQ PUB port.
    pub zmq_port: u16,
    /// The worker's OpenAI address (its endpoint and `/metrics`).
    pub worker: SocketAddr,
    /// Worker id.
    pub worker_id: &'a str,
    /// `nats://…`.
    pub nats_url: &'a str,
    /// Served model name.
    pub model: &'a str,
    /// Tokens per block.
    pub block_size: u32,
    /// The worker's `max_num_seqs`.
    pub max_num_seqs: usize,
    /// Heartbeat interval.
    pub heartbeat_ms: u64,
    /// Data-parallel ranks of the worker (0 or 1: none).
    pub data_parallel_size: u32,
}

impl RelaySpec<'_> {
    /// The arguments after the `kvgate` binary.
    pub fn args(&self) -> Vec<String> {
        let (z, w) = (self.zmq_port, self.worker);
        [
            "relay",
            "--zmq-endpoint",
            &format!("tcp://*:{z}"),
            "--zmq-connect",
            &format!("tcp://127.0.0.1:{z}"),
            "--replay-endpoint",
            &format!("tcp://127.0.0.1:{}", u32::from(z) + self.data_parallel_size.max(1)),
            "--nats-url",
            self.nats_url,
            "--model",
            self.model,
            "--endpoint",
            &w.to_string(),
            "--worker-id",
            self.worker_id,
            "--metrics-url",
            &format!("http://{w}/metrics"),
            "--block-size",
            &self.block_size.to_string(),
            "--max-num-seqs",
            &self.max_num_seqs.to_string(),
            "--heartbeat-ms",
            &self.heartbeat_ms.to_string(),
            "--data-parallel-size",
            &self.data_parallel_size.max(1).to_string(),
        ]
        .iter()
        .map(|a| (*a).to_owned())
        .collect()
    }
}

/// Waits until something accepts TCP connections at `addr`.
pub fn wait_for_tcp(addr: SocketAddr, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "nothing listens on {addr} after {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Processes started through [`Proc`] and not yet stopped: (PID, leads its
/// own process group).
static STARTED: std::sync::Mutex<Vec<(u32, bool)>> = std::sync::Mutex::new(Vec::new());

fn started(update: impl FnOnce(&mut Vec<(u32, bool)>)) {
    if let Ok(mut s) = STARTED.lock() {
        update(&mut s);
    }
}

/// Kills (SIGKILL, by PID or process group) every process this program
/// started through [`Proc`] and has not stopped: for a signal handler, as a
/// program ended by a signal runs no destructors.
pub fn kill_started() {
    let mut all = Vec::new();
    started(|s| all = std::mem::take(s));
    for (pid, group) in all {
        let target = if group { format!("-{pid}") } else { pid.to_string() };
        let _ = Command::new("kill").args(["-s", "KILL", "--", &target]).stderr(Stdio::null()).status();
    }
}

/// A child process that is killed (by its PID) and reaped when dropped.
pub struct Proc {
    name: String,
    child: std::process::Child,
    log: PathBuf,
    /// The process leads its own process group, killed as a whole.
    group: bool,
}

impl Proc {
    /// Starts `cmd` with stdout and stderr to `<dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, dir: &Path) -> Result<Self> {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log)?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {name}: {cmd:?}"))?;
        started(|s| s.push((child.id(), false)));
        Ok(Self { name: name.to_owned(), child, log, group: false })
    }

    /// Like [`Proc::spawn`], in a process group of its own that
    /// [`Proc::kill`] kills as a whole: for programs that start children
    /// (vLLM's API server starts its engine core and workers, which would
    /// otherwise outlive it and keep its ports).
    pub fn spawn_group(name: &str, mut cmd: Command, dir: &Path) -> Result<Self> {
        use std::os::unix::process::CommandExt as _;
        cmd.process_group(0);
        let mut p = Self::spawn(name, cmd, dir)?;
        p.group = true;
        let pid = p.pid();
        started(|s| s.iter_mut().filter(|e| e.0 == pid).for_each(|e| e.1 = true));
        Ok(p)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The log so far (for error messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The exit status if the process has exited (it is then reaped).
    pub fn try_wait(&mut self) -> Result<Option<std::process::ExitStatus>> {
        let status = self.child.try_wait()?;
        if status.is_some() {
            // Reaped: its PID may be handed out again.
            let pid = self.child.id();
            started(|s| s.retain(|e| e.0 != pid));
        }
        Ok(status)
    }

    /// Fails with the log if the process has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        if let Some(status) = self.try_wait()? {
            bail!("{} exited with {status}:\n{}", self.name, self.log());
        }
        Ok(())
    }

    /// Kills the process (SIGKILL to its PID, or to its process group when
    /// started with [`Proc::spawn_group`]) and waits for it.
    pub fn kill(&mut self) {
        self.signal_kill();
        let _ = self.child.wait();
    }

    /// Sends the SIGKILL of [`Proc::kill`] and returns at once: the kernel
    /// may take a while to tear down a process with gigabytes mapped (a
    /// vLLM engine), and its sockets close only then. A test that times
    /// what others notice of a death starts its clock here, not after the
    /// wait. [`Proc::kill`] (or the drop) reaps it.
    pub fn signal_kill(&mut self) {
        let pid = self.child.id();
        started(|s| s.retain(|e| e.0 != pid));
        // Linux does not hand out a PID that is still some group's id, so
        // the group's id names only this group while any member lives.
        if self.group {
            let _ = Command::new("kill")
                .args(["-s", "KILL", "--"])
                .arg(format!("-{}", self.child.id()))
                .stderr(Stdio::null())
                .status();
        }
        let _ = self.child.kill();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The addresses a `kvgate serve` bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeAddrs {
    /// gRPC (Router, endpoint picker).
    pub grpc: SocketAddr,
    /// Admin HTTP.
    pub admin: SocketAddr,
}

/// Starts `cmd` and waits for the whole stderr line that starts with
/// `prefix` (a process's machine-readable report of what it bound); the
/// process and its `key=value` fields.
fn spawn_reporting(name: &str, cmd: Command, dir: &Path, prefix: &str) -> Result<(Proc, Fields)> {
    let mut p = Proc::spawn(name, cmd, dir)?;
    let t = Instant::now();
    loop {
        p.ensure_running()?;
        // Whole lines only: stderr is unbuffered, so a line can be read
        // while half of it is written (a calibration run failed on
        // `kvgate serve: grpc=127.0.0.1`, the port not yet there).
        let log = p.log();
        let whole = log.rsplit_once('\n').map_or("", |(lines, _)| lines);
        if let Some(line) = whole.lines().find(|l| l.starts_with(prefix)) {
            return Ok((p, Fields(line.to_owned())));
        }
        ensure!(t.elapsed() < Duration::from_secs(120), "{name} did not report its addresses:\n{}", p.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A report line's `key=value` fields.
struct Fields(String);

impl Fields {
    /// The value of `key=` ("" when absent).
    fn get(&self, key: &str) -> &str {
        self.0.split_whitespace().find_map(|f| f.strip_prefix(key)?.strip_prefix('=')).unwrap_or_default()
    }

    /// The value of `key=`, parsed.
    fn parse<T: std::str::FromStr>(&self, key: &str) -> Result<T>
    where
        T::Err: std::error::Error + Send + Sync + 'static,
    {
        self.get(key).parse().with_context(|| format!("{key} in {:?}", self.0))
    }
}

/// Starts `kvgate serve` (`cmd`, whose listen flags may name port 0) and
/// reads the addresses it bound from its one machine-readable stderr line
/// (`kvgate serve: grpc=… admin=…`): with port 0 no other process can take
/// the ports between choosing and binding them. The one launcher of the
/// control plane for tests and the benchmark.
pub fn spawn_serve(name: &str, cmd: Command, dir: &Path) -> Result<(Proc, ServeAddrs)> {
    let (p, line) = spawn_reporting(name, cmd, dir, "kvgate serve: grpc=")?;
    let admin = line.parse("admin").context("admin off?")?;
    Ok((p, ServeAddrs { grpc: line.parse("grpc")?, admin }))
}

/// What a one-worker `kvgate sim` bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimAddrs {
    /// The worker's OpenAI HTTP address.
    pub http: SocketAddr,
    /// Its (rank 0's) ZMQ PUB port, when it publishes KV events; its replay
    /// port is this + D for D data-parallel ranks, rank r's sockets + r.
    pub zmq_port: Option<u16>,
}

/// Starts a one-worker `kvgate sim` (`cmd`, with `--http-port 0` and
/// `--zmq-port any` the worker picks and holds its ports itself) and reads
/// what it bound from its machine-readable stderr line (`kvgate sim: worker
/// w0 http=… zmq=… replay=…`, written once every socket is bound). The one
/// launcher of a simulated worker for tests and the benchmark.
pub fn spawn_sim(name: &str, cmd: Command, dir: &Path) -> Result<(Proc, SimAddrs)> {
    let (p, line) = spawn_reporting(name, cmd, dir, "kvgate sim: worker ")?;
    let zmq_port = match line.get("zmq") {
        "off" => None,
        ep => Some(
            ep.rsplit_once(':')
                .and_then(|(_, port)| port.parse().ok())
                .with_context(|| format!("zmq in {:?}", line.0))?,
        ),
    };
    Ok((p, SimAddrs { http: line.parse("http")?, zmq_port }))
}

/// A real nats-server on 127.0.0.1.
pub struct NatsServer {
    /// The process.
    pub proc: Proc,
    /// Client port.
    pub port: u16,
}

impl NatsServer {
    /// Starts nats-server (JetStream enabled, store in `dir`) on a free port.
    pub fn start(dir: &Path) -> Result<Self> {
        for _ in 0..5 {
            if let Ok(s) = Self::start_on(dir, free_port()?) {
                return Ok(s);
            }
        }
        bail!("nats-server did not start")
    }

    /// Starts nats-server on a free port requiring this user and password.
    pub fn start_with_auth(dir: &Path, user: &str, password: &str) -> Result<Self> {
        for _ in 0..5 {
            if let Ok(s) = Self::start_args(dir, free_port()?, &["--user", user, "--pass", password]) {
                return Ok(s);
            }
        }
        bail!("nats-server did not start")
    }

    /// Starts nats-server on `port` (e.g. again after a restart).
    pub fn start_on(dir: &Path, port: u16) -> Result<Self> {
        Self::start_args(dir, port, &[])
    }

    fn start_args(dir: &Path, port: u16, extra: &[&str]) -> Result<Self> {
        let bin = tool("KVGATE_NATS_SERVER", "nats-server")?;
        let mut cmd = Command::new(&bin);
        cmd.args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"]).arg(dir.join("jetstream")).args(extra);
        let mut proc = Proc::spawn(&format!("nats-server-{port}"), cmd, dir)?;
        wait_for_tcp(([127, 0, 0, 1], port).into(), Duration::from_secs(10))?;
        proc.ensure_running()?;
        Ok(Self { proc, port })
    }
}

/// Fills `${NAME}` placeholders; every placeholder must have a value.
pub fn render_template(template: &str, vars: &BTreeMap<&str, String>) -> Result<String> {
    Ok(kvgate_envoy_config::render_template(template, vars)?)
}

/// Renders `envoy/local.yaml` for a listener, an admin port and workers.
pub fn render_local_envoy(listen: u16, admin: u16, workers: &[SocketAddr]) -> Result<String> {
    Ok(kvgate_envoy_config::render_local(listen, admin, workers)?)
}

/// Where the built filter is: `KVGATE_WASM`, else the `wasm` profile's
/// output (`cargo build --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm`,
/// which `make test` runs before the tests).
pub fn filter_wasm() -> Result<PathBuf> {
    let p = std::env::var_os("KVGATE_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/wasm32-wasip1/wasm/kvgate_filter.wasm"));
    ensure!(
        p.exists(),
        "{} not built: run `cargo build --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm` (make test does)",
        p.display()
    );
    Ok(p)
}

/// Renders `envoy/kvgate.yaml` on 127.0.0.1: the listener with the kvgate
/// filter (`filter_config` is its JSON configuration, on one line, without
/// single quotes), the workers and the control plane.
pub fn render_kvgate_envoy(
    listen: u16,
    admin: u16,
    workers: &[SocketAddr],
    control_plane: &[SocketAddr],
    filter_config: &str,
) -> Result<String> {
    render_kvgate_envoy_tls(listen, admin, workers, control_plane, filter_config, None)
}

/// The client side of mutual TLS to the control plane: PEM files this
/// Envoy reads.
#[derive(Debug, Clone)]
pub struct ControlPlaneTls<'a> {
    /// CA of the control plane's server certificate.
    pub ca_file: &'a Path,
    /// This Envoy's client certificate chain.
    pub cert_file: &'a Path,
    /// Its private key.
    pub key_file: &'a Path,
    /// The name checked in the server certificate (sent as SNI).
    pub sni: &'a str,
}

/// [`render_kvgate_envoy`], and with `tls` the control-plane cluster speaks
/// mutual TLS (`envoy/control-plane-tls.yaml`).
pub fn render_kvgate_envoy_tls(
    listen: u16,
    admin: u16,
    workers: &[SocketAddr],
    control_plane: &[SocketAddr],
    filter_config: &str,
    tls: Option<&ControlPlaneTls<'_>>,
) -> Result<String> {
    let boot = kvgate_envoy_config::KvgateBootstrap {
        listen: SocketAddr::from(([127, 0, 0, 1], listen)),
        admin_port: admin,
        workers: workers.to_vec(),
        control_plane: control_plane.to_vec(),
        wasm_path: filter_wasm()?.display().to_string(),
        filter_config: filter_config.to_owned(),
        tls: tls.map(|t| kvgate_envoy_config::ControlPlaneTls {
            ca_file: t.ca_file.display().to_string(),
            cert_file: t.cert_file.display().to_string(),
            key_file: t.key_file.display().to_string(),
            sni: t.sni.to_owned(),
        }),
    };
    Ok(boot.render()?)
}

/// Renders `envoy/endpoint-picker.yaml`: Envoy's ext_proc filter calling
/// kvgate's endpoint picker at `picker`, with these body modes
/// (`FULL_DUPLEX_STREAMED`, `BUFFERED`, `STREAMED`, `NONE`).
pub fn render_picker_envoy(
    listen: u16,
    admin: u16,
    workers: &[SocketAddr],
    picker: SocketAddr,
    request_body_mode: &str,
    response_body_mode: &str,
) -> Result<String> {
    Ok(kvgate_envoy_config::render_picker(listen, admin, workers, picker, request_body_mode, response_body_mode)?)
}

/// FNV-1a of a body: what [`EchoUpstream`] reports as `body_fnv`, so that a
/// test can tell a body arrived byte for byte.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Runs `envoy --mode validate -c <config>`; the error carries Envoy's output.
pub fn envoy_validate(config: &Path) -> Result<()> {
    let out = Command::new(tool("KVGATE_ENVOY", "envoy")?)
        .args(["--mode", "validate", "--disable-hot-restart", "-l", "warn", "-c"])
        .arg(config)
        .output()?;
    ensure!(
        out.status.success(),
        "envoy rejected {}:\n{}{}",
        config.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// A running Envoy.
pub struct Envoy {
    /// The process.
    pub proc: Proc,
    /// Admin address (127.0.0.1), as Envoy bound it.
    pub admin: SocketAddr,
    /// The first listener's address, as Envoy bound it.
    pub listen: SocketAddr,
}

impl Envoy {
    /// Starts Envoy with `config` (one worker thread, no hot restart) and
    /// waits until its admin `/ready` answers 200.
    ///
    /// Render the config with port 0 for the admin and the listener: Envoy
    /// binds them itself, writes the admin address to a file in `dir`, and
    /// the listener's address is read from admin `/listeners`. A port picked
    /// by the test and bound later by Envoy can be taken in between by any
    /// other socket on the machine (a test running beside it, an outgoing
    /// connection's ephemeral port), and Envoy then exits.
    pub fn start(config: &Path, dir: &Path) -> Result<Self> {
        let address_file = dir.join(format!("envoy-admin-address-{}", ADDRESS_FILES.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_file(&address_file);
        let mut cmd = Command::new(tool("KVGATE_ENVOY", "envoy")?);
        cmd.args(["--disable-hot-restart", "--concurrency", "1", "-l", "info", "-c"]).arg(config);
        cmd.arg("--admin-address-path").arg(&address_file);
        let mut proc = Proc::spawn("envoy", cmd, dir)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            proc.ensure_running()?;
            let admin = std::fs::read_to_string(&address_file).ok().and_then(|a| a.trim().parse::<SocketAddr>().ok());
            if let Some(admin) = admin
                && http_request(admin, "GET", "/ready", &[], b"").is_ok_and(|r| r.status == 200)
            {
                let listen = first_listener(admin).with_context(|| format!("envoy's listeners:\n{}", proc.log()))?;
                return Ok(Self { proc, admin, listen });
            }
            ensure!(Instant::now() < deadline, "envoy not ready after 20 s:\n{}", proc.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// One stat value from the admin endpoint (`/stats?filter=`).
    pub fn stat(&self, name: &str) -> Result<u64> {
        let r = http_request(self.admin, "GET", &format!("/stats?filter=^{name}$"), &[], b"")?;
        let body = String::from_utf8_lossy(&r.body);
        for line in body.lines() {
            if let Some(v) = line.strip_prefix(&format!("{name}: ")) {
                return Ok(v.trim().parse()?);
            }
        }
        bail!("stat {name} not found in {body:?}")
    }
}

/// Names the admin address files of Envoys started by this process.
static ADDRESS_FILES: AtomicU64 = AtomicU64::new(0);

/// The address of Envoy's first listener, from admin `/listeners`.
fn first_listener(admin: SocketAddr) -> Result<SocketAddr> {
    let r = http_request(admin, "GET", "/listeners?format=json", &[], b"")?;
    let v: serde_json::Value = serde_json::from_slice(&r.body)?;
    let a = &v["listener_statuses"][0]["local_address"]["socket_address"];
    let ip: std::net::IpAddr = a["address"].as_str().context("no listener address")?.parse()?;
    let port = a["port_value"].as_u64().and_then(|p| u16::try_from(p).ok()).filter(|&p| p != 0);
    Ok(SocketAddr::new(ip, port.context("no bound listener port")?))
}

/// An HTTP server on 127.0.0.1 that answers every request with 200 and a
/// fixed body (e.g. a fake `/metrics`); stops when dropped.
pub struct StaticHttp {
    /// Listening address.
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl StaticHttp {
    /// Serves `body` with `content_type`.
    pub fn start(body: String, content_type: &'static str) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut conn, _)) => {
                        let _ = conn.set_nonblocking(false);
                        let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
                        let mut buf = [0u8; 4096];
                        let _ = conn.read(&mut buf);
                        let _ = write!(
                            conn,
                            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        );
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(Self { addr, stop, thread: Some(thread) })
    }
}

impl Drop for StaticHttp {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An HTTP/1.1 upstream that answers every request with 200 and a JSON body
/// naming itself and echoing the request line and headers; counts requests.
pub struct EchoUpstream {
    /// Its name, returned in the body and the `x-upstream` header.
    pub name: String,
    /// Listening address.
    pub addr: SocketAddr,
    /// Requests served.
    pub served: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EchoUpstream {
    /// Starts one on a free port of 127.0.0.1.
    pub fn start(name: &str) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicU64::new(0));
        let (n, st, sv) = (name.to_owned(), stop.clone(), served.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let (n, sv) = (n.clone(), sv.clone());
                        std::thread::spawn(move || {
                            let _ = serve_echo(conn, &n, &sv);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(Self { name: name.to_owned(), addr, served, stop, thread: Some(thread) })
    }
}

impl Drop for EchoUpstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A chunked request body (trailers, if any, are read and dropped).
fn read_chunked(reader: &mut impl BufRead) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let mut size_line = String::new();
        reader.read_line(&mut size_line)?;
        let size_text = size_line.trim_end().split(';').next().unwrap_or_default();
        let size = usize::from_str_radix(size_text.trim(), 16).with_context(|| format!("chunk size {size_line:?}"))?;
        if size == 0 {
            loop {
                let mut l = String::new();
                if reader.read_line(&mut l)? == 0 || l.trim_end().is_empty() {
                    return Ok(body);
                }
            }
        }
        let start = body.len();
        body.resize(start + size, 0);
        reader.read_exact(&mut body[start..])?;
        let mut crlf = [0u8; 2];
        reader.read_exact(&mut crlf)?;
    }
}

/// Serves HTTP/1.1 keep-alive requests on one connection.
fn serve_echo(conn: TcpStream, name: &str, served: &AtomicU64) -> Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    conn.set_nodelay(true)?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut writer = conn;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line)? == 0 {
            return Ok(());
        }
        let mut headers = Vec::new();
        let mut content_length = 0usize;
        let mut chunked = false;
        loop {
            let mut l = String::new();
            reader.read_line(&mut l)?;
            let l = l.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                let k = k.trim().to_ascii_lowercase();
                if k == "content-length" {
                    content_length = v.trim().parse()?;
                }
                if k == "transfer-encoding" && v.trim().eq_ignore_ascii_case("chunked") {
                    chunked = true;
                }
                headers.push((k, v.trim().to_owned()));
            }
        }
        let body = if chunked {
            read_chunked(&mut reader)?
        } else {
            let mut body = vec![0; content_length];
            reader.read_exact(&mut body)?;
            body
        };
        served.fetch_add(1, Ordering::Relaxed);
        let hdrs: Vec<String> = headers.iter().map(|(k, v)| format!("{:?}:{:?}", k, v)).collect();
        let resp_body = format!(
            "{{\"upstream\":{name:?},\"request\":{:?},\"body_bytes\":{},\"body_fnv\":{},\"headers\":{{{}}}}}",
            request_line.trim_end(),
            body.len(),
            fnv1a(&body),
            hdrs.join(",")
        );
        // One write (with TCP_NODELAY): a response split over several
        // small writes would meet Nagle and delayed ACKs (+40 ms).
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-upstream: {name}\r\ncontent-length: {}\r\n\r\n{resp_body}",
            resp_body.len()
        );
        writer.write_all(resp.as_bytes())?;
        writer.flush()?;
        if headers.iter().any(|(k, v)| k == "connection" && v.eq_ignore_ascii_case("close")) {
            let _ = writer.shutdown(Shutdown::Both);
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_need_every_value() {
        let vars = BTreeMap::from([("A", "1".to_owned())]);
        assert_eq!(render_template("x${A}y", &vars).unwrap(), "x1y");
        assert!(render_template("${B}", &vars).is_err());
        assert!(render_template("${A", &vars).is_err());
    }

    /// Ports handed out before their processes bind them are never handed
    /// out again, alone or in a run (a bench stack asks for ~40 at once; a
    /// repeat crashed a sweep when two simulated workers got one port).
    #[test]
    fn ports_handed_out_are_never_handed_out_again() {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let p = free_port().unwrap();
            assert!(seen.insert(p), "port {p} handed out twice");
            let run = port_run(3).unwrap();
            for q in run..run + 3 {
                assert!(seen.insert(q), "port {q} handed out twice");
            }
        }
    }

    /// What a signal handler relies on: every process started and not yet
    /// stopped is killed, a group with its children; one already stopped is
    /// not in the list (its PID may be reused).
    #[test]
    fn kill_started_kills_what_is_still_running() {
        let dir = std::env::temp_dir().join(format!("kvgate-testkit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut stopped = Proc::spawn("stopped", sleeper(), &dir).unwrap();
        stopped.kill();
        let mut single = Proc::spawn("single", sleeper(), &dir).unwrap();
        let mut group = Proc::spawn_group("group", sleeper(), &dir).unwrap();
        let pids = || STARTED.lock().unwrap().iter().map(|e| e.0).collect::<Vec<_>>();
        assert_eq!(pids(), vec![single.pid(), group.pid()]);
        kill_started();
        assert!(pids().is_empty());
        for p in [&mut single, &mut group] {
            // Killed, not asleep: 30 s is a bound on a lost SIGKILL only.
            let deadline = Instant::now() + Duration::from_secs(30);
            let status = loop {
                if let Some(status) = p.child.try_wait().unwrap() {
                    break status;
                }
                assert!(Instant::now() < deadline, "{} still running", p.name);
                std::thread::sleep(Duration::from_millis(10));
            };
            assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "{status}");
        }
        drop((single, group));
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn sleeper() -> Command {
        let mut c = Command::new("sleep");
        c.arg("600");
        c
    }
}
