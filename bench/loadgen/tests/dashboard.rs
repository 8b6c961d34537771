//! The live dashboard in a real browser: two real stacks (Envoy + kvgate in
//! kv mode, and in round_robin mode) under the dashboard's load, its page
//! served on 127.0.0.1 and opened in headless Chromium (Debian's, installed
//! by scripts/setup.sh). The test moves the slider through the page (the
//! page's `?concurrency=` sets it and posts the change, as a drag does),
//! reads the rendered DOM, and takes a screenshot.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvgate_bench::dashboard::{Live, serve};
use kvgate_bench::stack::{FleetSpec, Frontend, Stack};
use kvgate_bench::workload::Doks;

/// Runs headless Chromium on `url` with `extra` flags; returns its stdout.
/// Bounded: killed after 90 s.
fn chromium(dir: &Path, url: &str, extra: &[&str]) -> String {
    let bin = kvgate_testkit::tool("KVGATE_CHROMIUM", "chromium").unwrap();
    let profile = dir.join(format!("profile-{}", extra.len()));
    let out_file = dir.join(format!("chromium-{}.out", extra.len()));
    let mut cmd = Command::new(bin);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1320,1000",
        // Virtual time runs while no fetch is pending: about six polls.
        "--virtual-time-budget=6000",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(extra)
    .arg(url)
    .stdin(Stdio::null())
    .stdout(std::fs::File::create(&out_file).unwrap())
    .stderr(std::fs::File::create(dir.join("chromium.err")).unwrap());
    let mut child = cmd.spawn().unwrap();
    let t = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "chromium: {status}");
            break;
        }
        if t.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish in 90 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::read_to_string(out_file).unwrap()
}

#[test]
fn the_dashboard_renders_every_mode_and_its_slider_sets_the_load() {
    let dir = kvgate_testkit::scratch_dir("dashboard").unwrap();
    let mut fleet = FleetSpec { num_blocks: 4_000, ..FleetSpec::doks(25.0, 8) };
    if std::env::var_os("KVGATE_BIN").is_none() {
        fleet.kvgate = kvgate_testkit::repo_root().join("target/debug/kvgate");
    }
    let modes = ["kv", "round_robin"];
    let stacks: Vec<Stack> =
        modes.iter().map(|m| Stack::start(&dir.join(m), &fleet, &Frontend::Kvgate((*m).into())).unwrap()).collect();
    let workload = Doks { starter_words: (500, 700), output_tokens: (40, 80), ..Doks::default() };
    let live = Live::new(
        modes.iter().zip(&stacks).map(|(m, s)| ((*m).to_owned(), s.front)).collect(),
        2,
        8,
        25.0,
        Duration::from_secs(30),
        workload,
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (tx, rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = rt.spawn(serve(listener, live.clone(), stopped(rx.clone())));
    let driver = rt.spawn(live.clone().drive(stopped(rx.clone())));

    // Both modes answer through their own stack.
    let t = Instant::now();
    while !live.snapshot().modes.iter().all(|m| m.requests >= 2) {
        assert!(t.elapsed() < Duration::from_secs(60), "no requests: {:?}", live.snapshot());
        std::thread::sleep(Duration::from_millis(200));
    }
    let s = live.snapshot();
    for m in &s.modes {
        assert_eq!(m.errors, 0, "{m:?}");
        assert!(m.ttft_p50_ms.is_some_and(|t| t > 0.0) && m.output_tok_per_s > 0.0, "{m:?}");
    }

    // The API: a bad body is a precise 400 and changes nothing.
    let r = kvgate_testkit::http_request(addr, "POST", "/api/concurrency", &[], b"{\"users\": 3}").unwrap();
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(live.concurrency(), 2);

    // The page, with the slider moved to 5 by the page's own script.
    let dom = chromium(&dir, &format!("http://{addr}/?concurrency=5"), &["--dump-dom"]);
    assert_eq!(live.concurrency(), 5, "the page posted the slider's value");
    for m in modes {
        let row =
            dom.split(&format!("<tr data-mode=\"{m}\">")).nth(1).unwrap_or_else(|| panic!("no row for {m}: {dom}"));
        let requests: usize = row
            .split("<td class=\"requests\">")
            .nth(1)
            .and_then(|r| r.split('<').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{m}: no request count in {row}"));
        assert!(requests >= 2, "{m}: {requests}");
        assert!(dom.matches(&format!("<polyline data-mode=\"{m}\"")).count() >= 5, "a line per chart for {m}: {dom}");
    }
    assert!(dom.contains("id=\"conc\"") && dom.contains("max=\"8\""), "the slider: {dom}");
    // The load follows: the new users start.
    let t = Instant::now();
    while !live.snapshot().modes.iter().all(|m| m.users == 5) {
        assert!(t.elapsed() < Duration::from_secs(60), "{:?}", live.snapshot());
        std::thread::sleep(Duration::from_millis(100));
    }

    // The screenshot.
    let shot = dir.join("dashboard.png");
    chromium(&dir, &format!("http://{addr}/"), &[&format!("--screenshot={}", shot.display())]);
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(png.len() > 20_000, "a page with tables and charts, not a blank one: {} bytes", png.len());
    println!("screenshot: {}", shot.display());

    let _ = tx.send(true);
    rt.block_on(async {
        let _ = server.await;
        let _ = driver.await;
    });
    rt.shutdown_timeout(Duration::from_secs(2));
    for mut s in stacks {
        s.check().unwrap();
    }
}
