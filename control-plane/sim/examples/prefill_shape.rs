//! What an engine-timed prefill costs on `dynamo-mocker` when prompts share
//! their steps, and which terms a least-squares fit of those times needs to
//! give back the preset's cost of a prompt alone (docs/DECISIONS.md, "Why
//! `dynamo-mocker`'s matched fit reads prefill too convex"). The
//! calibration benchmark's users start spread over its warm-up, and there
//! its cold prompts were measured not to share steps: this shows the
//! mechanism where they do, not the calibration's miss.
//!
//! One engine (the DOKS fleet's limits: 64 seats, 16,384 batched tokens,
//! 11,500 blocks of 32) serves `conversations` closed-loop conversations that
//! open in the same instant: a cold document of
//! 535–7,500 tokens, then 2–4 follow-ups of 15–60 new tokens, 655–1,005
//! tokens out. For each request it records the computed and cached tokens,
//! its prefill time as vLLM times it (from the step that schedules it to
//! its first token), the other requests' prefill in those steps (known here,
//! not to a gateway), and what a gateway sees of it: the prefill the worker
//! did from the request's arrival to its first token, plus what was still
//! to do beside it then.
//!
//! `cargo run --release -p kvgate-sim --example prefill_shape -- [conversations] [first requests]`

use kvgate_sim::engine::{Engine, EngineConfig, HostTier, Output, Request};
use kvgate_sim::timing::Timing;
use std::collections::HashMap;

/// The preset's prefill of `t` tokens in one step, without its fixed part.
fn preset(t: f64) -> f64 {
    0.01518 * t + 4.21e-7 * t * t
}

#[derive(Default)]
struct Open {
    conversation: usize,
    prompt: usize,
    scheduled: Option<f64>,
    /// Prefill tokens of the steps it was in (its own among them).
    step_tokens: f64,
    /// The engine's prefill total when it arrived.
    done_at_arrival: f64,
    output: Vec<u32>,
}

/// Thousands of tokens, the fits' unit.
const K: f64 = 1_000.0;

/// A fit's features of a request.
type Features = fn(&Row) -> Vec<f64>;

/// One request: computed, cached, prefill ms, others' prefill in its
/// steps, the gateway's view of that.
type Row = (f64, f64, f64, f64, f64);

fn main() {
    let arg = |i: usize, default: usize| std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(default);
    let (conversations, first) = (arg(1, 30), arg(2, 600));
    let mut engine = Engine::new(EngineConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 16_384,
        num_blocks: 11_500,
        block_size: 32,
        timing: Timing::DynamoMocker,
        host: HostTier::default(),
        kv_transfer_ms_per_token: 0.0,
    });
    let mut rng = fastrand::Rng::with_seed(7);
    let mut next_token = 200_000u32;
    let mut fresh = |n: usize| -> Vec<u32> {
        next_token += n as u32;
        (next_token - n as u32..next_token).collect()
    };
    let mut chats: Vec<(Vec<u32>, usize)> =
        (0..conversations).map(|_| (fresh(rng.usize(535..=7_500)), rng.usize(3..=5))).collect();
    let (mut open, mut ready): (HashMap<u64, Open>, Vec<usize>) = (HashMap::new(), (0..conversations).collect());
    let (mut id, mut now, mut done, mut rows) = (0u64, 0.0, 0.0, Vec::<Row>::new());
    while rows.len() < first {
        for c in ready.drain(..) {
            id += 1;
            engine.submit(Request { id, prompt: chats[c].0.clone(), max_tokens: rng.usize(655..=1_005) });
            let o = Open { conversation: c, prompt: chats[c].0.len(), done_at_arrival: done, ..Open::default() };
            open.insert(id, o);
        }
        let step = engine.step();
        let began = now;
        now += step.ms.max(0.1);
        done += step.prefill_tokens as f64;
        for a in &step.admitted {
            if let Some(o) = open.get_mut(a) {
                o.scheduled = Some(began);
            }
        }
        let firsts: Vec<(u64, usize)> = (step.outputs.iter())
            .filter_map(|o| match *o {
                Output::Token { id, index: 0, cached_tokens, .. } => Some((id, cached_tokens)),
                _ => None,
            })
            .collect();
        for o in open.values_mut().filter(|o| o.scheduled.is_some() && o.output.is_empty()) {
            o.step_tokens += step.prefill_tokens as f64;
        }
        // Still to prefill beside those whose first token came now.
        let beside: f64 = (open.iter())
            .filter(|(k, o)| o.output.is_empty() && !firsts.iter().any(|f| f.0 == **k))
            .map(|(_, o)| (o.prompt - engine.cached_prefix_tokens(&chats[o.conversation].0)) as f64)
            .sum();
        for out in &step.outputs {
            if let Output::Token { id, token, .. } = *out
                && let Some(o) = open.get_mut(&id)
            {
                o.output.push(token);
            }
        }
        for &(k, cached) in &firsts {
            let Some(o) = open.get(&k) else { continue };
            let n = (o.prompt - cached) as f64;
            let seen = (done - o.done_at_arrival - n).max(0.0) + beside;
            rows.push((n, cached as f64, now - o.scheduled.unwrap_or(began), o.step_tokens - n, seen));
        }
        for out in &step.outputs {
            if let Output::Finished { id } = *out
                && let Some(o) = open.remove(&id)
            {
                let chat = &mut chats[o.conversation];
                chat.0.extend_from_slice(&o.output);
                chat.1 -= 1;
                *chat = if chat.1 == 0 {
                    (fresh(rng.usize(535..=7_500)), rng.usize(3..=5))
                } else {
                    (chat.0.iter().copied().chain(fresh(rng.usize(15..=60))).collect(), chat.1)
                };
                ready.push(o.conversation);
            }
        }
    }
    println!(
        "{} requests, {conversations} conversations; prefill from 300 tokens to 2,100 and to 7,600, against the preset's:",
        rows.len()
    );
    let fits: [(&str, Features); 5] = [
        ("1, n, n², n·c", |r| vec![1.0, r.0 / K, (r.0 / K).powi(2), r.0 * r.1 / K / K]),
        ("1, n, n², n·c, S (gateway's)", |r| vec![1.0, r.0 / K, (r.0 / K).powi(2), r.0 * r.1 / K / K, r.4 / K]),
        ("1, n, n², n·c, S, n·S (gateway's)", |r| {
            vec![1.0, r.0 / K, (r.0 / K).powi(2), r.0 * r.1 / K / K, r.4 / K, r.0 * r.4 / K / K]
        }),
        ("1, n, n², n·c, S (true)", |r| vec![1.0, r.0 / K, (r.0 / K).powi(2), r.0 * r.1 / K / K, r.3 / K]),
        ("1, n, n², n·c, S, n·S (true)", |r| {
            vec![1.0, r.0 / K, (r.0 / K).powi(2), r.0 * r.1 / K / K, r.3 / K, r.0 * r.3 / K / K]
        }),
    ];
    for (name, features) in fits {
        let t = least_squares(rows.iter().map(|r| (features(r), r.2)));
        let curve = |n: f64| t[1] * n / K + t[2] * (n / K).powi(2);
        let off = |n: f64| 100.0 * ((curve(n) - curve(300.0)) / (preset(n) - preset(300.0)) - 1.0);
        println!(
            "  {name:<36} rate {:.4} ms/token, growth {:.5} ms/token per 1,000: {:+5.1} %, {:+5.1} %",
            t[1] / K,
            t[2] / K,
            off(2_100.0),
            off(7_600.0)
        );
    }
    println!("  (the preset: rate 0.0152, growth 0.00042)");
}

/// Ordinary least squares by the normal equations (Gauss-Jordan with
/// partial pivoting).
fn least_squares(rows: impl Iterator<Item = (Vec<f64>, f64)>) -> Vec<f64> {
    let (mut a, mut b): (Vec<Vec<f64>>, Vec<f64>) = (Vec::new(), Vec::new());
    for (x, y) in rows {
        if a.is_empty() {
            (a, b) = (vec![vec![0.0; x.len()]; x.len()], vec![0.0; x.len()]);
        }
        for ((row, bi), xi) in a.iter_mut().zip(b.iter_mut()).zip(&x) {
            *bi += xi * y;
            for (aij, xj) in row.iter_mut().zip(&x) {
                *aij += xi * xj;
            }
        }
    }
    let n = b.len();
    for i in 0..n {
        let p = (i..n).max_by(|&x, &y| a[x][i].abs().total_cmp(&a[y][i].abs())).unwrap_or(i);
        a.swap(i, p);
        b.swap(i, p);
        let (pivot, bp) = (a[i].clone(), b[i]);
        let others = a.iter_mut().zip(b.iter_mut()).enumerate().filter(|(r, _)| *r != i);
        for (row, br) in others.map(|(_, x)| x) {
            let f = row[i] / pivot[i];
            for (arc, aic) in row.iter_mut().zip(&pivot) {
                *arc -= f * aic;
            }
            *br -= f * bp;
        }
    }
    (0..n).map(|i| b[i] / a[i][i]).collect()
}
