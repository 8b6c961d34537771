//! Sends sequential Pick requests with a ~`words`-word system prompt and a
//! new question each time to a running control plane, for profiling it
//! (`perf record -p <pid>`): `cargo run --release -p kvgate-server --example
//! pick_load -- 127.0.0.1:50051 bench 80000 500`.

use kvgate_server::router_client::RouterClient;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a: Vec<String> = std::env::args().collect();
    let (addr, model) = (&a[1], &a[2]);
    let words: usize = a[3].parse().unwrap();
    let n: usize = a[4].parse().unwrap();
    let system = kvgate_bench_support::words(7, words);
    let mut c = RouterClient::connect(format!("http://{addr}")).await.unwrap();
    let t = std::time::Instant::now();
    for i in 0..n {
        let msgs = [
            serde_json::json!({"role": "system", "content": system}),
            serde_json::json!({"role": "user", "content": format!("Question {i}?")}),
        ];
        let req = kvgate_server::chat_pick_request(model, "", &msgs, None);
        c.pick(req).await.unwrap();
    }
    println!("{n} picks in {:?} ({:?} each)", t.elapsed(), t.elapsed() / n as u32);
}
