//! The Envoy wiring of ARCHITECTURE §4 with the real Envoy 1.40: the worker
//! cluster's `override_host` policy sends a request to the endpoint named in
//! `x-gateway-destination-endpoint` and falls back to least request when the
//! header is absent or names no endpoint of the cluster. This is the
//! mechanism the kvgate filter steers with.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use kvgate_testkit::{
    EchoUpstream, Envoy, HttpResponse, envoy_validate, http_request, render_local_envoy, scratch_dir,
};

struct Stack {
    envoy: Envoy,
    listen: SocketAddr,
    upstreams: Vec<EchoUpstream>,
}

fn start_stack(name: &str) -> Stack {
    let dir = scratch_dir(name).unwrap();
    let upstreams: Vec<EchoUpstream> = (0..3).map(|i| EchoUpstream::start(&format!("w{i}")).unwrap()).collect();
    let addrs: Vec<SocketAddr> = upstreams.iter().map(|u| u.addr).collect();
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, render_local_envoy(0, 0, &addrs).unwrap()).unwrap();
    envoy_validate(&config).unwrap();
    let envoy = Envoy::start(&config, &dir).unwrap();
    Stack { listen: envoy.listen, envoy, upstreams }
}

fn post(stack: &Stack, header: Option<&str>) -> HttpResponse {
    let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let mut headers = vec![("content-type", "application/json")];
    if let Some(h) = header {
        headers.push(("x-gateway-destination-endpoint", h));
    }
    let r = http_request(stack.listen, "POST", "/v1/chat/completions", &headers, body).unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r
}

#[test]
fn local_config_validates() {
    let dir = scratch_dir("validate").unwrap();
    let addrs: Vec<SocketAddr> = vec!["127.0.0.1:9001".parse().unwrap(), "[::1]:9002".parse().unwrap()];
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, render_local_envoy(10000, 10001, &addrs).unwrap()).unwrap();
    envoy_validate(&config).unwrap();
    // And a broken one is rejected (the check can fail).
    std::fs::write(&config, "static_resources: { clusters: [ { name: x, type: NOPE } ] }").unwrap();
    assert!(envoy_validate(&config).is_err());
}

#[test]
fn header_steers_to_the_named_endpoint() {
    let stack = start_stack("steer");
    for (i, u) in stack.upstreams.iter().enumerate() {
        let target = u.addr.to_string();
        for _ in 0..5 {
            let r = post(&stack, Some(&target));
            assert_eq!(r.header("x-upstream"), Some(format!("w{i}").as_str()));
        }
    }
    for u in &stack.upstreams {
        assert_eq!(u.served.load(std::sync::atomic::Ordering::Relaxed), 5, "{}", u.name);
    }
}

#[test]
fn no_header_or_unknown_endpoint_falls_back() {
    let stack = start_stack("fallback");
    let mut seen = BTreeMap::<String, usize>::new();
    for i in 0..30 {
        let header = (i % 2 == 0).then_some("127.0.0.1:1");
        let r = post(&stack, header);
        *seen.entry(r.header("x-upstream").unwrap().to_owned()).or_default() += 1;
    }
    // The least-request fallback spreads the load (30 sequential requests on
    // one upstream out of three would have probability 3 * 3^-30).
    assert!(seen.len() >= 2, "fallback did not spread: {seen:?}");
    assert_eq!(seen.values().sum::<usize>(), 30);
}

#[test]
fn comma_list_uses_the_first_endpoint_of_the_cluster() {
    let stack = start_stack("list");
    let (a, b) = (stack.upstreams[1].addr, stack.upstreams[2].addr);
    let got: BTreeSet<String> =
        (0..6).map(|_| post(&stack, Some(&format!("{a},{b}"))).header("x-upstream").unwrap().to_owned()).collect();
    assert_eq!(got, BTreeSet::from(["w1".to_owned()]));
    assert!(stack.envoy.stat("cluster.workers.upstream_rq_total").unwrap() >= 6);
}
