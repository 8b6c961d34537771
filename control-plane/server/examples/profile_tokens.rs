//! Where the time of one tokenization goes (developer tool:
//! `cargo run --release -p kvgate-server --example profile_tokens`).
use std::time::Instant;

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use kvgate_server::tokens::{PromptTokenizer, SegmentRef, TokenCacheConfig, chain_hashes};

fn main() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.tools/models/deepseek-v3");
    let pt = PromptTokenizer::from_dir(&dir, TokenCacheConfig { verify_every: 0, ..Default::default() }).unwrap();
    let words = ["the", "kv", "cache", "router", "prefix", "token", "block", "worker", "latency", "12345"];
    let text = |n: usize, off: usize| {
        let mut s = String::new();
        for i in 0..n {
            s.push_str(words[(i * 7 + off) % 10]);
            s.push(if i % 13 == 0 { '\n' } else { ' ' });
        }
        s
    };
    let mut msgs = vec![serde_json::json!({"role":"system","content": text(6000, 0)})];
    msgs.push(serde_json::json!({"role":"user","content": text(30, 1)}));
    let run = |msgs: &[serde_json::Value], label: &str, reps: usize| {
        let bytes: Vec<Vec<u8>> = msgs.iter().map(|m| serde_json::to_vec(m).unwrap()).collect();
        let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        let h = chain_hashes(b"", &refs);
        let segs: Vec<SegmentRef<'_>> =
            bytes.iter().zip(&h).map(|(b, h)| SegmentRef { chain_hash: *h, message_json: b, elided: false }).collect();
        let t = Instant::now();
        let mut last = None;
        for _ in 0..reps {
            last = Some(pt.chat(b"", &segs).unwrap());
        }
        let r = last.unwrap();
        println!(
            "{label}: {:.1} us ({:?}, {} ids, {} bytes encoded)",
            t.elapsed().as_secs_f64() * 1e6 / reps as f64,
            r.outcome,
            r.ids.len(),
            r.encoded_bytes
        );
    };
    run(&msgs, "miss", 1);
    run(&msgs, "full hit", 200);
    for i in 0..5 {
        let mut m = msgs.clone();
        m.push(serde_json::json!({"role":"assistant","content": text(50, i + 2)}));
        m.push(serde_json::json!({"role":"user","content": text(30, i + 3)}));
        run(&m, "new turn", 1);
    }
    let tk = pt.inner();
    let s = text(80, 4);
    let t = Instant::now();
    let mut n = 0;
    for _ in 0..200 {
        n = tk.encode(&s).unwrap().len();
    }
    println!("encode {} bytes ({n} ids): {:.1} us", s.len(), t.elapsed().as_secs_f64() * 1e6 / 200.0);
    if std::env::var_os("PROFILE_SHORT").is_some() {
        let t = Instant::now();
        for _ in 0..20000 {
            n = tk.encode(&s).unwrap().len();
        }
        println!("short x20000: {:.1} us", t.elapsed().as_secs_f64() * 1e6 / 20000.0);
    }
    let t = Instant::now();
    for _ in 0..200 {
        n = tk.encode("<｜Assistant｜>").unwrap().len();
    }
    println!("encode suffix ({n} ids): {:.1} us", t.elapsed().as_secs_f64() * 1e6 / 200.0);
}
