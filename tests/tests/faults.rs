//! The fault suite: real Envoy with the filter, nats-server, the control
//! plane, and three simulated workers with a relay each, under a bounded
//! closed-loop streaming load. One test per fault. Each asserts:
//!
//! * no request failed, except streams that had already started (response
//!   headers sent) on an engine that was killed;
//! * a dead worker is out of rotation within 1 s (where a worker dies);
//! * after convergence, the control plane's index holds exactly what each
//!   engine holds (the simulator exposes its cache).
//!
//! Each test prints one line `fault: <name> sent=… failed=… …` with the
//! numbers the issue note reports.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvgate_testkit::{Envoy, envoy_validate, render_kvgate_envoy, scratch_dir};
use serde_json::json;

mod common;

use common::{Fleet, FleetOpts, MODEL, until};

const WORKERS: usize = 3;

/// The outcome of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// 200 and the stream ended with `[DONE]`.
    Ok,
    /// Failed after its response headers (a stream already running).
    FailedStreaming,
    /// Failed before any response header (what must never happen).
    FailedBefore,
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    streaming: AtomicU64,
    before: AtomicU64,
    /// Time (since the load started) of each failure before headers, for
    /// the report.
    before_at: Mutex<Vec<(Duration, String)>>,
}

/// A bounded closed-loop streaming load: `clients` threads, each running
/// conversations (a shared system prompt, growing turns) until stopped or
/// `max_per_client` requests.
struct Load {
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
    threads: Vec<JoinHandle<()>>,
}

fn one_request(addr: SocketAddr, body: &[u8]) -> (Outcome, String) {
    let Ok(mut s) = TcpStream::connect(addr) else { return (Outcome::FailedBefore, "connect".into()) };
    let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    if s.write_all(head.as_bytes()).and_then(|()| s.write_all(body)).is_err() {
        return (Outcome::FailedBefore, "write".into());
    }
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    if !text.starts_with("HTTP/1.1 ") {
        return (Outcome::FailedBefore, format!("no response: {text:.200}"));
    }
    if !text.starts_with("HTTP/1.1 200") {
        return (Outcome::FailedBefore, format!("{text:.300}"));
    }
    if text.contains("data: [DONE]") { (Outcome::Ok, String::new()) } else { (Outcome::FailedStreaming, String::new()) }
}

impl Load {
    fn start(addr: SocketAddr, clients: usize, max_per_client: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Tally::default());
        let t0 = Instant::now();
        let threads = (0..clients)
            .map(|c| {
                let (stop, tally) = (stop.clone(), tally.clone());
                std::thread::spawn(move || {
                    let system =
                        format!("You are assistant number {c}. {}", "Answer briefly and precisely. ".repeat(40));
                    let mut turn = 0usize;
                    let mut messages = vec![json!({"role": "system", "content": system})];
                    for i in 0..max_per_client {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        // A new conversation every 4 turns.
                        if turn == 4 {
                            messages.truncate(1);
                            turn = 0;
                        }
                        messages.push(json!({"role": "user", "content": format!("Client {c} question {i}: why?")}));
                        let body =
                            json!({"model": MODEL, "messages": messages, "max_tokens": 24, "stream": true}).to_string();
                        let (o, why) = one_request(addr, body.as_bytes());
                        match o {
                            Outcome::Ok => {
                                tally.ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Outcome::FailedStreaming => {
                                tally.streaming.fetch_add(1, Ordering::Relaxed);
                            }
                            Outcome::FailedBefore => {
                                tally.before.fetch_add(1, Ordering::Relaxed);
                                tally.before_at.lock().unwrap().push((t0.elapsed(), why));
                            }
                        }
                        messages.push(json!({"role": "assistant", "content": format!("Because {i}.")}));
                        turn += 1;
                    }
                })
            })
            .collect();
        Load { stop, tally, threads }
    }

    /// Waits until `n` more requests succeed (the load is flowing).
    fn flowing(&self, n: u64) {
        let base = self.tally.ok.load(Ordering::Relaxed);
        until(60, "the load to flow", || self.tally.ok.load(Ordering::Relaxed) >= base + n);
    }

    fn finish(mut self) -> (u64, u64, u64, Vec<(Duration, String)>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
        let t = &self.tally;
        (
            t.ok.load(Ordering::Relaxed) + t.streaming.load(Ordering::Relaxed) + t.before.load(Ordering::Relaxed),
            t.streaming.load(Ordering::Relaxed),
            t.before.load(Ordering::Relaxed),
            t.before_at.lock().unwrap().clone(),
        )
    }
}

/// The fleet, Envoy in front of it, and the load.
struct Stack {
    fleet: Fleet,
    envoy: Envoy,
    dir: std::path::PathBuf,
}

fn stack(name: &str, serve_args: &[&str]) -> Stack {
    stack_with(name, serve_args, &[])
}

/// Fast probes, so that a death is seen within one probe; the engine is
/// confirmed down after 1 s of failures.
const RELAY_ARGS: [&str; 6] = ["--health-ms", "100", "--health-timeout-ms", "500", "--down-after-ms", "1000"];

fn stack_with(name: &str, serve_args: &[&str], sim_args: &[&str]) -> Stack {
    stack_opts(name, FleetOpts { relay_args: &RELAY_ARGS, serve_args, sim_args, ..Default::default() })
}

fn stack_opts(name: &str, opts: FleetOpts<'_>) -> Stack {
    let dir = scratch_dir(name).unwrap();
    let fleet = Fleet::start_opts(&dir, WORKERS, "20", opts);
    let filter = json!({"control_plane": {"timeout_ms": 200}, "debug_headers": true, "reports": {"interval_ms": 100}});
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, render_kvgate_envoy(0, 0, &fleet.http, &[fleet.grpc], &filter.to_string()).unwrap())
        .unwrap();
    envoy_validate(&config).unwrap();
    let envoy = Envoy::start(&config, &dir).unwrap();
    Stack { fleet, envoy, dir }
}

/// Starts the stack and the load (3 clients, at most `max` requests each),
/// waits until it flows, and returns the time the fault starts.
fn begin(name: &str, max: usize) -> (Stack, Load, Instant) {
    let s = stack(name, &[]);
    let load = Load::start(s.envoy.listen, 3, max);
    load.flowing(30);
    (s, load, Instant::now())
}

/// A request straight to engine `w` (not through the router), so that it
/// stores blocks of its own: the load's conversations are cached on the
/// other workers, and the router has no reason to send them to a
/// restarted engine.
fn store_on_engine(fleet: &Fleet, w: usize) {
    kvgate_testkit::wait_for_tcp(fleet.http[w], Duration::from_secs(30)).unwrap();
    let text = "A fresh prompt for the restarted engine. ".repeat(20);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}).to_string();
    let r = kvgate_testkit::http_request(
        fleet.http[w],
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        body.as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200);
}

/// Milliseconds from now until worker `w` is out of rotation.
fn out_of_rotation_ms(fleet: &Fleet, w: usize, since: Instant) -> u64 {
    until(10, "the dead worker out of rotation", || fleet.worker(w)["live"] != true);
    since.elapsed().as_millis() as u64
}

/// Waits until the index of every running worker equals what its engine
/// holds (blocks), and returns how long that took.
fn converged(fleet: &Fleet, workers: &[usize], since: Instant) -> u64 {
    let t = Instant::now();
    loop {
        let state: Vec<(usize, Option<u64>, u64)> =
            workers.iter().map(|&w| (w, fleet.engine_blocks(w), fleet.blocks(w))).collect();
        if state.iter().all(|(_, e, i)| *e == Some(*i)) {
            return since.elapsed().as_millis() as u64;
        }
        if t.elapsed() > Duration::from_secs(60) {
            let relays: Vec<String> = workers
                .iter()
                .map(|&w| {
                    kvgate_testkit::http_request(fleet.relay_metrics[w], "GET", "/metrics", &[], b"")
                        .map(|r| {
                            String::from_utf8_lossy(&r.body)
                                .lines()
                                .filter(|l| !l.starts_with('#'))
                                .collect::<Vec<_>>()
                                .join("\n")
                        })
                        .unwrap_or_default()
                })
                .collect();
            panic!(
                "the index never equaled the engines' caches: (worker, engine, index) {state:?}\nworkers: {}\nrelays:\n{}",
                fleet.workers(),
                relays.join("\n--\n")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn report(name: &str, sent: u64, streaming: u64, before: u64, extra: &str) {
    println!("fault: {name} sent={sent} failed_streaming={streaming} failed_before_headers={before} {extra}");
}

fn assert_no_failure_before_headers(name: &str, before: u64, at: &[(Duration, String)]) {
    assert_eq!(before, 0, "{name}: requests failed before their stream started: {at:?}");
}

/// Ends the load, waits until the index equals the engines' caches, prints
/// the fault's line and fails on any request that failed before its stream
/// started. Returns the streams that failed while running.
fn settle(load: Load, fleet: &Fleet, name: &str, workers: &[usize], since: Instant, extra: String) -> u64 {
    let (sent, streaming, before, at) = load.finish();
    let conv_ms = converged(fleet, workers, since);
    report(name, sent, streaming, before, &format!("{extra} converged_ms={conv_ms}"));
    assert_no_failure_before_headers(name, before, &at);
    streaming
}

#[test]
fn engine_killed_with_its_relay_alive() {
    let (mut s, load, t) = begin("fault-engine-kill", 2000);
    s.fleet.signal_kill(Fleet::sim(1));
    let out_ms = out_of_rotation_ms(&s.fleet, 1, t);
    // The relay confirms the death and clears the worker's blocks.
    until(10, "the dead engine's blocks cleared", || s.fleet.blocks(1) == 0);
    let cleared_ms = t.elapsed().as_millis() as u64;
    load.flowing(30);
    settle(load, &s.fleet, "engine_killed", &[0, 2], t, format!("out_of_rotation_ms={out_ms} cleared_ms={cleared_ms}"));
    assert!(out_ms <= 1000, "out of rotation after {out_ms} ms");
    assert_eq!(s.fleet.worker(1)["engine_health"], "down");
}

#[test]
fn a_whole_worker_pod_killed() {
    let (mut s, load, t) = begin("fault-pod-kill", 2000);
    s.fleet.signal_kill(Fleet::relay(1));
    s.fleet.signal_kill(Fleet::sim(1));
    let out_ms = out_of_rotation_ms(&s.fleet, 1, t);
    load.flowing(30);
    settle(load, &s.fleet, "pod_killed", &[0, 2], t, format!("out_of_rotation_ms={out_ms}"));
    assert!(out_ms <= 1000, "out of rotation after {out_ms} ms");
}

#[test]
fn an_engine_restarted_on_the_same_port() {
    let (mut s, load, t) = begin("fault-engine-restart", 2000);
    s.fleet.signal_kill(Fleet::sim(1));
    let out_ms = out_of_rotation_ms(&s.fleet, 1, t);
    until(10, "the dead engine's blocks cleared", || s.fleet.blocks(1) == 0);
    s.fleet.restart(Fleet::sim(1));
    until(30, "the restarted engine back in rotation", || s.fleet.worker(1)["live"] == true);
    let back_ms = t.elapsed().as_millis() as u64;
    // Its new blocks reach the index (the relay sees the new publisher).
    store_on_engine(&s.fleet, 1);
    until(30, "the restarted engine's blocks indexed", || s.fleet.blocks(1) > 0);
    load.flowing(30);
    settle(load, &s.fleet, "engine_restarted", &[0, 1, 2], t, format!("out_of_rotation_ms={out_ms} back_ms={back_ms}"));
    assert!(out_ms <= 1000, "out of rotation after {out_ms} ms");
}

#[test]
fn nats_down_for_10_s() {
    let (mut s, load, t) = begin("fault-nats-down", 4000);
    let port = s.fleet.nats.port;
    s.fleet.nats.proc.kill();
    // Routing goes on on the last index: workers stay live, Picks answer.
    std::thread::sleep(Duration::from_secs(10));
    let live = (0..WORKERS).filter(|&w| s.fleet.worker(w)["live"] == true).count();
    // The filter keeps steering on the last index: wait for ten more
    // steered requests (not ten more answers, which may include requests
    // steered before the count was read).
    let steered_before = s.envoy.stat("wasmcustom.kvgate.steered").unwrap_or(0);
    let steered = || s.envoy.stat("wasmcustom.kvgate.steered").unwrap_or(0) - steered_before;
    until(120, "ten requests steered during the outage", || steered() >= 10);
    let steered_during = steered();
    s.fleet.nats = kvgate_testkit::NatsServer::start_on(&s.dir, port).unwrap();
    load.flowing(30);
    let streaming = settle(
        load,
        &s.fleet,
        "nats_down_10s",
        &[0, 1, 2],
        t,
        format!("live_during={live} steered_during={steered_during}"),
    );
    assert_eq!(streaming, 0, "no engine died");
    assert_eq!(live, WORKERS, "liveness frozen during the outage");
    assert!(steered_during >= 10, "the filter kept steering on the last index");
    s.fleet.check();
}

#[test]
fn control_plane_stopped_for_5_s() {
    let (mut s, load, t) = begin("fault-cp-sigstop", 4000);
    let serve = s.fleet.serve();
    s.fleet.signal(serve, "STOP");
    // The filter fails open (Pick times out): requests keep flowing.
    load.flowing(20);
    std::thread::sleep(Duration::from_secs(5).saturating_sub(t.elapsed()));
    s.fleet.signal(serve, "CONT");
    load.flowing(30);
    let streaming = settle(load, &s.fleet, "control_plane_sigstop_5s", &[0, 1, 2], t, String::new());
    assert_eq!(streaming, 0);
    s.fleet.check();
}

#[test]
fn control_plane_killed_and_restarted() {
    let (mut s, load, t) = begin("fault-cp-kill", 4000);
    let serve = s.fleet.serve();
    s.fleet.kill(serve);
    load.flowing(20);
    s.fleet.restart(serve);
    until(30, "every worker live in the new control plane", || (0..WORKERS).all(|w| s.fleet.worker(w)["live"] == true));
    load.flowing(30);
    let streaming = settle(load, &s.fleet, "control_plane_killed", &[0, 1, 2], t, String::new());
    assert_eq!(streaming, 0);
}

#[test]
fn a_relay_restarted() {
    let (mut s, load, t) = begin("fault-relay-restart", 4000);
    s.fleet.restart(Fleet::relay(1));
    load.flowing(30);
    // The new relay has a new epoch: the control plane takes its snapshot.
    // The relay itself rebuilt its mirror from the engine's replay buffer
    // (it asks for everything from 0 when its event socket connects), so
    // the index equals the engine's cache again.
    until(30, "worker 1 resynced", || s.fleet.worker(1)["sync"].as_str().is_some_and(|x| x.starts_with("synced")));
    let streaming = settle(load, &s.fleet, "relay_restarted", &[0, 1, 2], t, String::new());
    assert_eq!(streaming, 0);
}

/// An engine that hangs for 3 s under load (SIGSTOP: its sockets accept
/// connections and nothing answers, as while the kernel tears down a big
/// killed process). Its health probe times out only after 5 s here; the
/// worker leaves rotation when the probe has been unanswered for 200 ms,
/// keeps its blocks (not confirmed down), and comes back when it answers.
/// Its streams pause and then finish.
#[test]
fn an_engine_that_hangs_for_3_s() {
    let relay_args =
        ["--health-ms", "100", "--health-timeout-ms", "5000", "--health-overdue-ms", "200", "--down-after-ms", "10000"];
    let s = stack_opts("fault-engine-hang", FleetOpts { relay_args: &relay_args, ..Default::default() });
    let load = Load::start(s.envoy.listen, 3, 4000);
    load.flowing(30);
    until(30, "worker 1 holds blocks", || s.fleet.blocks(1) > 0);
    let t = Instant::now();
    s.fleet.signal(Fleet::sim(1), "STOP");
    let out_ms = out_of_rotation_ms(&s.fleet, 1, t);
    std::thread::sleep(Duration::from_secs(3).saturating_sub(t.elapsed()));
    let during = s.fleet.worker(1);
    s.fleet.signal(Fleet::sim(1), "CONT");
    until(30, "the resumed engine back in rotation", || s.fleet.worker(1)["live"] == true);
    let back_ms = t.elapsed().as_millis() as u64;
    load.flowing(30);
    let overdue = relay_count(&s.fleet, 1, "health_overdue_total");
    let extra = format!("out_of_rotation_ms={out_ms} back_ms={back_ms} overdue_probes={overdue}");
    let streaming = settle(load, &s.fleet, "engine_hung_3s", &[0, 1, 2], t, extra);
    assert_eq!(streaming, 0, "a hang that ends loses no stream");
    assert!(out_ms <= 1000, "out of rotation after {out_ms} ms (the probe's timeout is 5,000 ms)");
    assert_eq!(during["engine_health"], "unhealthy", "hung, not confirmed down: {during}");
    assert!(during["device_blocks"].as_u64().unwrap_or(0) > 0, "a hung engine keeps its blocks: {during}");
    assert!(overdue >= 1.0, "the relay counted the overdue probe");
}

/// An engine restarted faster than the relay confirms a death: the relay's
/// event socket reconnects to the new process by itself, the new sequence
/// (from 0) is taken for a restart, and the old blocks are forgotten.
#[test]
fn an_engine_restarted_quickly() {
    let mut s = stack("fault-engine-quick-restart", &[]);
    let load = Load::start(s.envoy.listen, 3, 4000);
    load.flowing(30);
    until(30, "worker 1 holds blocks", || s.fleet.blocks(1) > 0);
    let t = Instant::now();
    s.fleet.restart(Fleet::sim(1));
    store_on_engine(&s.fleet, 1);
    load.flowing(30);
    settle(load, &s.fleet, "engine_restarted_quickly", &[0, 1, 2], t, String::new());
    assert!(s.fleet.blocks(1) > 0, "the new engine's blocks are indexed");
}

// ------------------------------------------------------------- soak --

fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("VmRSS:").map(|v| v.trim().trim_end_matches("kB").trim().to_owned()))
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// RSS (KiB) of every process of the stack, by name.
fn stack_rss(s: &Stack) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    for w in 0..WORKERS {
        m.insert(format!("sim-{w}"), rss_kb(s.fleet.procs[Fleet::sim(w)].pid()).into());
        m.insert(format!("relay-{w}"), rss_kb(s.fleet.procs[Fleet::relay(w)].pid()).into());
    }
    m.insert("control-plane".into(), rss_kb(s.fleet.procs[s.fleet.serve()].pid()).into());
    m.insert("envoy".into(), rss_kb(s.envoy.proc.pid()).into());
    m.insert("nats".into(), rss_kb(s.fleet.nats.proc.pid()).into());
    m
}

/// The chaos soak (`make soak`, 10 minutes; `KVGATE_SOAK_SECS` to change):
/// the stack under load while a fault from the suite's list strikes at a
/// random time every 15–40 s. Reports requests, failures by kind, faults,
/// and every process's RSS at the start and the end, to
/// `bench/results/chaos-soak.json`. Fails on any request that failed
/// before its stream started, or an index that does not converge.
#[test]
#[ignore = "10 minutes: run with make soak"]
fn chaos_soak() {
    let secs: u64 = std::env::var("KVGATE_SOAK_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(600);
    let seed: u64 = std::env::var("KVGATE_SOAK_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    let mut rng = seed | 1;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    println!("soak: {secs} s, seed {seed}");
    let mut s = stack("soak", &[]);
    let load = Load::start(s.envoy.listen, 3, usize::MAX);
    load.flowing(30);
    let rss_start = stack_rss(&s);
    let t0 = Instant::now();
    let mut faults: Vec<serde_json::Value> = Vec::new();
    while t0.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_secs(15 + next(26)));
        if t0.elapsed() >= Duration::from_secs(secs) {
            break;
        }
        let w = next(WORKERS as u64) as usize;
        let at = t0.elapsed().as_secs_f64();
        let kind = match next(6) {
            0 => {
                s.fleet.kill(Fleet::sim(w));
                std::thread::sleep(Duration::from_secs(3 + next(6)));
                s.fleet.restart(Fleet::sim(w));
                "engine_killed_and_restarted"
            }
            1 => {
                s.fleet.kill(Fleet::relay(w));
                s.fleet.kill(Fleet::sim(w));
                std::thread::sleep(Duration::from_secs(3 + next(6)));
                s.fleet.restart(Fleet::sim(w));
                s.fleet.restart(Fleet::relay(w));
                "pod_killed_and_restarted"
            }
            2 => {
                s.fleet.restart(Fleet::relay(w));
                "relay_restarted"
            }
            3 => {
                let port = s.fleet.nats.port;
                s.fleet.nats.proc.kill();
                std::thread::sleep(Duration::from_secs(5 + next(6)));
                s.fleet.nats = kvgate_testkit::NatsServer::start_on(&s.dir, port).unwrap();
                "nats_down"
            }
            4 => {
                let serve = s.fleet.serve();
                s.fleet.signal(serve, "STOP");
                std::thread::sleep(Duration::from_secs(3 + next(3)));
                s.fleet.signal(serve, "CONT");
                "control_plane_sigstop"
            }
            _ => {
                let serve = s.fleet.serve();
                s.fleet.kill(serve);
                std::thread::sleep(Duration::from_secs(1 + next(3)));
                s.fleet.restart(serve);
                "control_plane_killed_and_restarted"
            }
        };
        println!("soak: {at:.0} s: {kind} (worker {w})");
        faults.push(json!({"at_s": at, "fault": kind, "worker": w}));
    }
    // Everything back: every worker live, then the index converges.
    until(60, "every worker live after the soak", || (0..WORKERS).all(|w| s.fleet.worker(w)["live"] == true));
    let rss_end = stack_rss(&s);
    let (sent, streaming, before, at) = load.finish();
    // The index equals what every relay knows (its mirror), exactly. What a
    // relay cannot know is reported, not asserted: after a relay restart
    // whose engine's replay buffer (vLLM keeps 10,000 batches) no longer
    // reaches back to its first batch, the blocks stored before stay
    // unknown (their children are counted as orphan stores) until evicted.
    let t_conv = Instant::now();
    let mirror = |w: usize| -> Option<u64> {
        let body = kvgate_testkit::http_request(s.fleet.relay_metrics[w], "GET", "/metrics", &[], b"").ok()?.body;
        common::prom(
            &String::from_utf8_lossy(&body),
            &format!("kvgate_relay_mirror_blocks{{worker=\"w{w}\",model=\"{MODEL}\"}}"),
        )
        .map(|v| v as u64)
    };
    until(60, "the index to equal every relay's mirror", || (0..WORKERS).all(|w| mirror(w) == Some(s.fleet.blocks(w))));
    let conv_ms = t_conv.elapsed().as_millis() as u64;
    let gap: Vec<serde_json::Value> = (0..WORKERS)
        .map(|w| json!({"worker": w, "engine_blocks": s.fleet.engine_blocks(w), "index_blocks": s.fleet.blocks(w)}))
        .collect();
    let (commit, machine) = kvgate_bench_support::provenance();
    let result = json!({
        "seconds": secs,
        "seed": seed,
        "requests": sent,
        "failed_streaming": streaming,
        "failed_before_headers": before,
        "faults": faults,
        "converged_ms_after_load": conv_ms,
        "engine_vs_index": gap,
        "rss_kb_start": rss_start,
        "rss_kb_end": rss_end,
        "commit": commit,
        "machine": machine,
    });
    let path = kvgate_testkit::repo_root().join("bench/results/chaos-soak.json");
    std::fs::write(&path, serde_json::to_string_pretty(&result).unwrap() + "\n").unwrap();
    println!("soak: {}", serde_json::to_string(&result).unwrap());
    assert_no_failure_before_headers("soak", before, &at);
    s.fleet.check();
}

// ------------------------------------------- event-stream faults --

/// Asks worker `w`'s simulator to inject an event-stream fault into its
/// next batch, and waits until its relay counted it.
fn inject(s: &Stack, w: usize, kind: &str, relay_metric: &str) {
    let before = relay_count(&s.fleet, w, relay_metric);
    let r = kvgate_testkit::http_request(s.fleet.http[w], "POST", &format!("/kvgate/sim/fault?kind={kind}"), &[], b"")
        .unwrap();
    assert_eq!(r.status, 200);
    // The fault rides on the worker's next batch: give it one.
    store_on_engine(&s.fleet, w);
    until(30, "the relay to see the fault", || relay_count(&s.fleet, w, relay_metric) > before);
}

fn relay_count(fleet: &Fleet, w: usize, name: &str) -> f64 {
    let Ok(r) = kvgate_testkit::http_request(fleet.relay_metrics[w], "GET", "/metrics", &[], b"") else { return 0.0 };
    common::prom(
        &String::from_utf8_lossy(&r.body),
        &format!("kvgate_relay_{name}{{worker=\"w{w}\",model=\"{MODEL}\"}}"),
    )
    .unwrap_or(0.0)
}

/// The same batch twice under load: dropped as a duplicate, the worker's
/// blocks kept, and the index still equals every engine's cache.
#[test]
fn a_duplicated_batch_under_load() {
    let (s, load, t) = begin("fault-duplicate", 4000);
    inject(&s, 1, "duplicate", "duplicates_total");
    load.flowing(30);
    let streaming = settle(load, &s.fleet, "duplicated_batch", &[0, 1, 2], t, String::new());
    assert_eq!(streaming, 0);
    assert_eq!(relay_count(&s.fleet, 1, "restarts_total"), 0.0, "a duplicate is not a restart");
}

/// Malformed frames under load: counted and skipped; nothing else changes.
#[test]
fn garbage_frames_under_load() {
    let (s, load, t) = begin("fault-garbage", 4000);
    inject(&s, 1, "garbage", "decode_errors_frames_total");
    load.flowing(30);
    let streaming = settle(load, &s.fleet, "garbage_frames", &[0, 1, 2], t, String::new());
    assert_eq!(streaming, 0);
    assert_eq!(relay_count(&s.fleet, 1, "decode_errors_frames_total"), 2.0);
}

/// A gap the engine's replay buffer no longer covers, under load: the relay
/// clears the worker and resynchronizes from the batches that follow. What
/// the engine stored before the gap cannot be learned again (the engine
/// does not re-announce it), so for that worker the index converges to a
/// subset of the engine's cache, never to blocks the engine does not hold;
/// the other workers' indexes equal their engines'.
#[test]
fn a_gap_beyond_the_replay_buffer_under_load() {
    let (s, load, t) = begin("fault-gap", 4000);
    inject(&s, 1, "gap", "resyncs_total");
    load.flowing(30);
    let streaming = settle(load, &s.fleet, "gap_beyond_replay", &[0, 2], t, String::new());
    assert_eq!(streaming, 0);
    until(30, "worker 1 synced again", || s.fleet.worker(1)["sync"].as_str().is_some_and(|x| x.starts_with("synced")));
    let (index, engine) = (s.fleet.blocks(1), s.fleet.engine_blocks(1).unwrap());
    println!("fault: gap_beyond_replay worker 1: index {index} of the engine's {engine} blocks");
    assert!(index <= engine, "the index claims {index} blocks, the engine holds {engine}");
}

/// A batch over NATS's 1 MiB payload limit under load: a 45,000-block prompt
/// prefilled in one step (the batch that stopped the relay was 40,000
/// blocks, 2.1 MB). The relay splits it; the index equals every engine's
/// cache, that worker's 45,000 blocks included.
#[test]
fn an_oversized_batch_under_load() {
    let sim = ["--num-blocks", "60000", "--max-num-batched-tokens", "1000000", "--max-model-len", "1000000"];
    let s = stack_with("fault-oversized", &[], &sim);
    let load = Load::start(s.envoy.listen, 3, 4000);
    load.flowing(30);
    let t = Instant::now();
    let ids: Vec<u32> = (0..45_000u32 * 16).map(|i| 1_000 + i % 90_000).collect();
    let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 1}).to_string();
    assert!(body.len() > 2_000_000);
    let r = kvgate_testkit::http_request(
        s.fleet.http[1],
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        body.as_bytes(),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    until(60, "the split batches published", || relay_count(&s.fleet, 1, "split_batches_total") > 0.0);
    load.flowing(30);
    let streaming = settle(load, &s.fleet, "oversized_batch", &[0, 1, 2], t, String::new());
    assert_eq!(streaming, 0);
    assert!(s.fleet.blocks(1) >= 45_000, "{} blocks indexed", s.fleet.blocks(1));
    assert_eq!(relay_count(&s.fleet, 1, "publish_errors_total"), 0.0);
}
