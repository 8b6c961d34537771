//! The `h200-llama70b-fp8` preset against the DOKS demo
//! (REFERENCE-RESULTS.md §A): one worker of the three, with its third of the
//! conversations, in simulated time (no sockets, deterministic).
//!
//! Workload as published: conversation starters of ~3,750 tokens, 4 turns,
//! every turn resends the history plus a ~60-token follow-up, ~830 output
//! tokens per turn; closed loop; block size 32, max batch 64, 16,384 batched
//! tokens. Conversations stay on their worker (the KV-routed case, ~90 %+
//! prefix hits). 60 s warm-up, then 300 s measured.
//!
//! Published (KV routing): at 60 conversations TTFT p50 249 ms, ITL p50 26 ms;
//! at 180, TTFT p50 472 ms, ITL p50 45 ms; hit rates 91–96 %.

use kvgate_sim::engine::{Engine, EngineConfig, Output, Request, output_token};
use kvgate_sim::timing::Timing;

struct Conv {
    history: Vec<u32>,
    turn: usize,
    pending: Option<(u64, f64)>,
    outputs: Vec<u32>,
    rng: u64,
}

fn next(rng: &mut u64) -> u64 {
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    *rng
}

fn tokens(rng: &mut u64, n: usize) -> Vec<u32> {
    (0..n).map(|_| (next(rng) % 120_000) as u32).collect()
}

/// (TTFT p50 ms, ITL p50 ms, prefix hit rate) for `convs` conversations on one worker.
fn run(convs: usize) -> (f64, f64, f64) {
    let mut engine = Engine::new(EngineConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 16_384,
        num_blocks: 11_500,
        block_size: 32,
        timing: Timing::H200_LLAMA70B_FP8,
        host: Default::default(),
        kv_transfer_ms_per_token: 0.0,
    });
    let seed = 0x9e37_79b9_7f4a_7c15u64 ^ convs as u64;
    // Ten conversation starters, shared by all conversations (as published).
    let mut srng = 0x1234_5678_9abc_def1u64;
    let starters: Vec<Vec<u32>> = (0..10)
        .map(|_| {
            let n = 3_500 + (next(&mut srng) % 500) as usize;
            tokens(&mut srng, n)
        })
        .collect();
    let mut cs: Vec<Conv> = (0..convs)
        .map(|i| {
            let mut rng = seed.wrapping_add(i as u64 * 7919) | 1;
            let s = (next(&mut rng) % 10) as usize;
            Conv { history: starters[s].clone(), turn: 0, pending: None, outputs: Vec::new(), rng }
        })
        .collect();
    let mut t = 0.0f64;
    let mut id = 0u64;
    let (warm, end) = (60_000.0, 360_000.0);
    let mut ttft = Vec::new();
    let mut itl = Vec::new();
    let mut last_token: std::collections::HashMap<u64, f64> = Default::default();
    let mut owner: std::collections::HashMap<u64, usize> = Default::default();
    // Stagger the starts over the first 10 s, as clients ramp up.
    let mut starts: Vec<f64> = (0..convs).map(|i| i as f64 * 10_000.0 / convs as f64).collect();
    let (q0, h0) = (0u64, 0u64);
    let mut counted = (q0, h0, false);
    // A request issued at `s` reaches the engine at `s + overhead`.
    let overhead = Timing::H200_LLAMA70B_FP8.first_token_overhead_ms();
    while t < end {
        for (i, c) in cs.iter_mut().enumerate() {
            if c.pending.is_none() && starts[i] + overhead <= t {
                id += 1;
                let out = 555 + (next(&mut c.rng) % 454) as usize;
                engine.submit(Request { id, prompt: c.history.clone(), max_tokens: out });
                c.pending = Some((id, starts[i]));
                c.outputs.clear();
                owner.insert(id, i);
                starts[i] = f64::INFINITY;
            }
        }
        let step = engine.step();
        if step.ms == 0.0 {
            t += 1.0;
            continue;
        }
        t += step.ms;
        if !counted.2 && t >= warm {
            counted = (engine.pool().queries_tokens, engine.pool().hits_tokens, true);
        }
        for o in step.outputs {
            match o {
                Output::Token { id, token, index, .. } => {
                    let Some(&i) = owner.get(&id) else { continue };
                    let c = &mut cs[i];
                    c.outputs.push(token);
                    if let Some((_, at)) = c.pending
                        && t >= warm
                    {
                        if index == 0 {
                            ttft.push(t - at);
                        } else if let Some(l) = last_token.get(&id) {
                            itl.push(t - l);
                        }
                    }
                    last_token.insert(id, t);
                }
                Output::Finished { id } => {
                    let Some(i) = owner.remove(&id) else { continue };
                    last_token.remove(&id);
                    let c = &mut cs[i];
                    c.pending = None;
                    c.turn += 1;
                    if c.turn >= 4 {
                        // A new conversation.
                        c.turn = 0;
                        c.history = starters[(next(&mut c.rng) % 10) as usize].clone();
                    } else {
                        let outs = std::mem::take(&mut c.outputs);
                        debug_assert!(outs.iter().enumerate().all(|(k, x)| *x == output_token(id, k)));
                        c.history.extend(outs);
                        let f = tokens(&mut c.rng, 60);
                        c.history.extend(f);
                    }
                    starts[i] = t;
                }
            }
        }
    }
    let hit = (engine.pool().hits_tokens - counted.1) as f64 / (engine.pool().queries_tokens - counted.0).max(1) as f64;
    let p50 = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    (p50(&mut ttft), p50(&mut itl), hit)
}

#[test]
fn h200_preset_reproduces_the_doks_operating_points() {
    // 60 conversations over 3 workers → 20 per worker; 180 → 60.
    let (ttft20, itl20, hit20) = run(20);
    let (ttft60, itl60, hit60) = run(60);
    eprintln!("20/worker: TTFT p50 {ttft20:.0} ms, ITL p50 {itl20:.1} ms, hits {:.1} %", hit20 * 100.0);
    eprintln!("60/worker: TTFT p50 {ttft60:.0} ms, ITL p50 {itl60:.1} ms, hits {:.1} %", hit60 * 100.0);
    // Published (KV): 249 ms / 26 ms at 60; 472 ms / 45 ms at 180. The
    // preset must land within ±50 % on TTFT and ±25 % on ITL.
    assert!((125.0..=375.0).contains(&ttft20), "TTFT p50 at 20/worker: {ttft20}");
    assert!((19.5..=32.5).contains(&itl20), "ITL p50 at 20/worker: {itl20}");
    assert!((236.0..=708.0).contains(&ttft60), "TTFT p50 at 60/worker: {ttft60}");
    assert!((33.75..=56.25).contains(&itl60), "ITL p50 at 60/worker: {itl60}");
    assert!(hit20 > 0.85 && hit60 > 0.85, "hit rates {hit20} {hit60}");
}
