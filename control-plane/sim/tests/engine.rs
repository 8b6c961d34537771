//! The engine's batching and timing.

use kvgate_sim::engine::{Engine, EngineConfig, Output, Request};
use kvgate_sim::timing::{OperatingPoint, Timing};

fn engine(max_num_seqs: usize, num_blocks: usize) -> Engine {
    Engine::new(EngineConfig {
        max_num_seqs,
        max_num_batched_tokens: 8192,
        num_blocks,
        block_size: 32,
        timing: Timing::H200_LLAMA70B_FP8,
        host: Default::default(),
        kv_transfer_ms_per_token: 0.0,
    })
}

/// Calibration points of the H200 preset (REFERENCE-RESULTS.md §A): ~26 ms
/// inter-token latency at 20 running requests, ~52 ms near 60.
#[test]
fn h200_preset_matches_the_doks_inter_token_latencies() {
    let t = Timing::preset("h200-llama70b-fp8").unwrap();
    assert!((t.step_ms(20, 0, 0.5) - 26.0).abs() < 0.01);
    assert!((t.step_ms(60, 0, 0.5) - 52.0).abs() < 0.01);
    // Dynamo's mocker: prefill of 1,000 tokens and decode at 50 % fill.
    let m = Timing::preset("dynamo-mocker").unwrap();
    let prefill = 4.21e-7 * 1e6 + 0.01518 * 1000.0 + 16.5;
    let decode = -25.74 * 0.25 + 54.01 * 0.5 + 5.74;
    assert!((m.step_ms(1, 1000, 0.5) - (prefill + decode)).abs() < 1e-9);
    assert!(Timing::preset("tpu").is_none());
}

fn run_to_end(e: &mut Engine) -> (f64, Vec<(f64, Output)>) {
    let mut now = 0.0;
    let mut log = Vec::new();
    for _ in 0..100_000 {
        if e.is_idle() {
            break;
        }
        let s = e.step();
        now += s.ms;
        log.extend(s.outputs.into_iter().map(|o| (now, o)));
    }
    (now, log)
}

#[test]
fn one_request_prefills_then_decodes() {
    let mut e = engine(64, 1000);
    e.submit(Request { id: 1, prompt: (0..1000).collect(), max_tokens: 10 });
    let (end, log) = run_to_end(&mut e);
    let tokens: Vec<_> = log.iter().filter(|(_, o)| matches!(o, Output::Token { .. })).collect();
    assert_eq!(tokens.len(), 10);
    // First token after one prefill step of 1,000 tokens: 13 + 80 ms.
    assert!((tokens[0].0 - 93.0).abs() < 1e-9, "ttft {}", tokens[0].0);
    // Then one decode step each: 13 + 0.65 ms.
    assert!((tokens[1].0 - tokens[0].0 - 13.65).abs() < 1e-9);
    assert!((end - (93.0 + 9.0 * 13.65)).abs() < 1e-6);
    assert!(matches!(log.last().unwrap().1, Output::Finished { id: 1 }));
    assert_eq!(e.pool().free_blocks(), 1000, "all blocks back");
}

#[test]
fn a_repeated_prompt_hits_the_prefix_cache() {
    let mut e = engine(64, 1000);
    e.submit(Request { id: 1, prompt: (0..1000).collect(), max_tokens: 2 });
    run_to_end(&mut e);
    e.submit(Request { id: 2, prompt: (0..1000).collect(), max_tokens: 2 });
    let (_, log) = run_to_end(&mut e);
    let Some((t, Output::Token { cached_tokens, .. })) = log.first() else { panic!() };
    assert_eq!(*cached_tokens, 992, "31 full blocks of 32 (the last token is always computed)");
    assert!((t - (13.0 + 0.08 * 8.0)).abs() < 1e-9, "only 8 tokens to prefill: {t}");
    assert_eq!(e.pool().hits_tokens, 992);
}

#[test]
fn running_is_bounded_by_max_num_seqs_and_everything_finishes() {
    let mut e = engine(64, 100_000);
    for id in 0..100 {
        e.submit(Request { id, prompt: (0..100).map(|t| t + id as u32 * 1000).collect(), max_tokens: 20 });
    }
    e.step();
    assert_eq!((e.num_running(), e.num_waiting()), (64, 36));
    let (_, log) = run_to_end(&mut e);
    let finished = log.iter().filter(|(_, o)| matches!(o, Output::Finished { .. })).count();
    assert_eq!(finished, 100);
    assert_eq!(e.pool().free_blocks(), 100_000);
}

/// vLLM admits a waiting request only with a chunk of the step's token
/// budget: 100 prompts of 200 tokens and 8,192 tokens per step admit 40
/// whole prompts and the first 192 tokens of a 41st.
#[test]
fn admission_stops_when_the_step_budget_is_spent() {
    let mut e = engine(64, 100_000);
    for id in 0..100 {
        e.submit(Request { id, prompt: (0..200).map(|t| t + id as u32 * 1000).collect(), max_tokens: 20 });
    }
    let s = e.step();
    assert_eq!((e.num_running(), e.num_waiting()), (41, 59));
    assert_eq!(s.prefill_tokens, 8192);
    assert_eq!(s.admitted.len(), 41);
}

/// Siblings that arrive together with a new shared prefix compute it once:
/// vLLM registers a block's hash when it schedules the block's tokens, so
/// the second request scheduled in the same step (or a later one) finds
/// the first one's blocks as cached, although they are still being computed.
#[test]
fn siblings_arriving_together_compute_their_shared_prefix_once() {
    for prefix_len in [4_000u32, 20_000] {
        let mut e = engine(64, 100_000);
        let prefix: Vec<u32> = (0..prefix_len).collect();
        for id in 0..8u64 {
            let mut prompt = prefix.clone();
            prompt.extend((0..100).map(|t| 1_000_000 + t + id as u32 * 1000));
            e.submit(Request { id, prompt, max_tokens: 4 });
        }
        let mut prefill = 0;
        let mut cached = std::collections::HashMap::new();
        for _ in 0..100 {
            if e.is_idle() {
                break;
            }
            let s = e.step();
            prefill += s.prefill_tokens;
            for o in s.outputs {
                if let Output::Token { id, index: 0, cached_tokens, .. } = o {
                    cached.insert(id, cached_tokens);
                }
            }
        }
        assert!(e.is_idle());
        // The prefix once, then each sibling's suffix and the partial block
        // before it (the prefix does not end on a block boundary).
        let full = (prefix_len as usize / 32) * 32;
        assert_eq!(prefill, prefix_len as usize + 100 + 7 * (prefix_len as usize - full + 100), "prefix {prefix_len}");
        assert_eq!(cached[&0], 0);
        for id in 1..8 {
            assert_eq!(cached[&id], full, "sibling {id} of prefix {prefix_len}");
        }
    }
}

#[test]
fn a_full_cache_preempts_and_still_finishes() {
    // 40 blocks of 32 tokens; 8 requests of 4 blocks each generating 3 blocks.
    let mut e = engine(8, 40);
    for id in 0..8 {
        e.submit(Request { id, prompt: (0..120).map(|t| t + id as u32 * 1000).collect(), max_tokens: 96 });
    }
    let (_, log) = run_to_end(&mut e);
    let finished = log.iter().filter(|(_, o)| matches!(o, Output::Finished { .. })).count();
    assert_eq!(finished, 8);
    assert_eq!(e.pool().free_blocks(), 40);
}

/// The `vllm-v1` roofline (Llama-3.1-8B BF16 on H100 SXM) at the points its
/// module comment names, and the A100 preset slower on both resources.
#[test]
fn vllm_v1_presets_follow_their_roofline() {
    use kvgate_sim::timing::StepShape;
    let t = Timing::preset("vllm-v1").unwrap();
    let mut cold = StepShape::default();
    cold.add_chunk(0, 7_000);
    let ms = t.step_time(&cold);
    assert!((ms - 262.0).abs() < 0.02 * 262.0, "cold 7K prefill: {ms} ms");
    let decode = StepShape { decode_seqs: 60, decode_context_tokens: 60 * 6_000, ..StepShape::default() };
    let ms = t.step_time(&decode);
    assert!((ms - 31.0).abs() < 0.03 * 31.0, "60 decodes at 6K context: {ms} ms");
    // Attention: the same 1,000 new tokens cost more after 30K of context.
    let mut late = StepShape::default();
    late.add_chunk(30_000, 1_000);
    let mut early = StepShape::default();
    early.add_chunk(0, 1_000);
    assert!(t.step_time(&late) > 1.5 * t.step_time(&early));
    let a100 = Timing::preset("vllm-v1-a100").unwrap();
    assert!(a100.step_time(&cold) > 2.5 * t.step_time(&cold), "prefill is compute-bound");
    assert!(a100.step_time(&decode) > 1.8 * t.step_time(&decode), "decode is bandwidth-bound");
    assert_eq!(t.first_token_overhead_ms(), 30.0);
    for name in Timing::PRESETS {
        assert!(Timing::preset(name).is_some(), "{name}");
    }
}

/// On `vllm-v1` the engine charges attention over the cached context: a
/// follow-up of 1,000 new tokens after a 30K-token cached history takes
/// longer to its first token than the same 1,000 tokens cold.
#[test]
fn the_engine_charges_attention_over_the_cached_context() {
    let cfg = EngineConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 8192,
        num_blocks: 4_000,
        block_size: 32,
        timing: Timing::preset("vllm-v1").unwrap(),
        host: Default::default(),
        kv_transfer_ms_per_token: 0.0,
    };
    let ttft = |e: &mut Engine| {
        let (_, log) = run_to_end(e);
        log.iter().find(|(_, o)| matches!(o, Output::Token { index: 0, .. })).map(|(t, _)| *t).unwrap()
    };
    let mut e = Engine::new(cfg);
    let history: Vec<u32> = (0..30_720).collect();
    e.submit(Request { id: 1, prompt: history.clone(), max_tokens: 1 });
    run_to_end(&mut e);
    let follow: Vec<u32> = history.iter().copied().chain(100_000..101_000).collect();
    e.submit(Request { id: 2, prompt: follow, max_tokens: 1 });
    let after_history = ttft(&mut e);
    let mut cold = Engine::new(cfg);
    cold.submit(Request { id: 3, prompt: (200_000..201_000).collect(), max_tokens: 1 });
    let alone = ttft(&mut cold);
    assert!(after_history > 1.5 * alone, "{after_history} ms vs {alone} ms");
}

#[test]
fn a_slowdown_scales_every_step() {
    let mut e = engine(64, 1000);
    assert!(!e.set_slowdown(0.0) && !e.set_slowdown(f64::NAN));
    assert!(e.set_slowdown(1.5));
    e.submit(Request { id: 1, prompt: (0..1000).collect(), max_tokens: 2 });
    let (_, log) = run_to_end(&mut e);
    assert!((log[0].0 - 1.5 * 93.0).abs() < 1e-9, "{}", log[0].0);
}

#[test]
fn linear_equivalents_are_the_presets_marginal_costs() {
    let op = OperatingPoint {
        context: 5_000.0,
        chunk: 900.0,
        decode_context: 5_500.0,
        running: 40.0,
        capacity_tokens: 368_000.0,
    };
    let h200 = Timing::preset("h200-llama70b-fp8").unwrap();
    assert_eq!(h200.linear_equivalent(&op), (0.08, 0.65));
    let (p, d) = Timing::preset("vllm-v1").unwrap().linear_equivalent(&op);
    // 0.0325 ms of matmuls + 1.06e-6 ms × 5,450 pairs per token; 0.0325 +
    // 0.0559 × 5.5 ms per decoding request.
    assert!((p - 0.0383).abs() < 0.001 && (d - 0.34).abs() < 0.01, "{p} {d}");
    // The prefill formula's slope at 900 tokens, without its 16.5 ms per
    // step; decode: 40 requests of 5,500 tokens fill 59.8 % of the cache,
    // where the step grows 54.01 − 51.48 × 0.598 = 23.2 ms per unit of
    // fill, and one request adds 1.49 % of it.
    let dm = Timing::preset("dynamo-mocker").unwrap();
    let (p, d) = dm.linear_equivalent(&op);
    assert!((p - (2.0 * 4.21e-7 * 900.0 + 0.01518)).abs() < 1e-12, "{p}");
    assert!((d - 0.347).abs() < 0.001, "{d}");
    // Both are what one more token or request adds to a step.
    let step = |tokens: usize, running: f64| dm.step_ms(1, tokens, running * op.decode_context / op.capacity_tokens);
    assert!(((step(901, 40.0) - step(900, 40.0)) - p).abs() < 1e-6);
    assert!(((step(900, 40.5) - step(900, 39.5)) - d).abs() < 1e-3);
}

/// With a host tier, a prompt evicted from the device is loaded back: its
/// tokens are reported cached, and its first token costs the load time
/// (6.5 µs per token here) instead of the recompute.
#[test]
fn a_prompt_offloaded_to_host_memory_is_loaded_not_recomputed() {
    let host = kvgate_sim::engine::HostTier { blocks: 1_000, load_ms_per_token: 0.0065 };
    let mut e = Engine::new(EngineConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 8192,
        num_blocks: 100,
        block_size: 32,
        timing: Timing::H200_LLAMA70B_FP8,
        host,
        kv_transfer_ms_per_token: 0.0,
    });
    let first_token = |e: &mut Engine, id: u64, prompt: Vec<u32>| {
        e.submit(Request { id, prompt, max_tokens: 2 });
        let (_, log) = run_to_end(e);
        log.iter()
            .find_map(|(t, o)| match o {
                Output::Token { index: 0, cached_tokens, .. } => Some((*t, *cached_tokens)),
                _ => None,
            })
            .unwrap()
    };
    let doc: Vec<u32> = (0..1_601).collect(); // 50 full blocks and one token
    let (cold, cached) = first_token(&mut e, 1, doc.clone());
    assert_eq!(cached, 0);
    // 3,000 other tokens take most device blocks: the document's tail (evicted
    // first) goes to host memory.
    first_token(&mut e, 2, (10_000..13_000).collect());
    let offloaded = e.pool().host_blocks();
    assert!(offloaded >= 40, "{offloaded}");
    let (warm, cached) = first_token(&mut e, 3, doc);
    assert_eq!(cached, 1_600, "device hit plus blocks loaded back, reported as cached");
    assert!(warm < cold / 4.0, "warm {warm} ms vs cold {cold} ms");
    let load = (offloaded * 32) as f64 * 0.0065;
    assert!(warm >= load, "the load of {offloaded} blocks is charged: {warm} ms");
}

/// The decode side of a disaggregated request: its prompt's KV arrives from
/// a prefill worker, so it computes only the last prompt token, reports the
/// received tokens as cached, and caches the received blocks (with their
/// events) for the next request with that prefix.
#[test]
fn a_transferred_prompt_computes_only_its_last_token() {
    let mut e = engine(64, 1000);
    let prompt: Vec<u32> = (0..1000).collect();
    e.submit_transferred(Request { id: 1, prompt: prompt.clone(), max_tokens: 2 });
    let first = e.step();
    assert_eq!(first.prefill_tokens, 1, "only the last token is computed");
    assert!(first.outputs.iter().any(|o| matches!(o, Output::Token { id: 1, index: 0, cached_tokens: 999, .. })));
    let stored: usize = first
        .events
        .iter()
        .map(|ev| match ev {
            kvgate_sim::pool::CacheEvent::Stored { hashes, .. } => hashes.len(),
            _ => 0,
        })
        .sum();
    assert!(stored >= 999 / 32, "the received blocks are cached and announced ({stored})");
    // The same prompt computed here: the whole prefill.
    let mut cold = engine(64, 1000);
    cold.submit(Request { id: 2, prompt, max_tokens: 2 });
    assert_eq!(cold.step().prefill_tokens, 1000);
}

/// A step reports the context its decoding requests attended over: each
/// one's prompt and the tokens it generated before this one. The
/// calibration's truth takes a decode step's cost from it; KV usage
/// counts more (the blocks of a prompt still in prefill, the unfilled
/// tail of a request's last block).
#[test]
fn a_step_reports_the_context_its_decodes_attended_over() {
    let mut e = engine(64, 1000);
    e.submit(Request { id: 1, prompt: (0..100).collect(), max_tokens: 5 });
    e.submit(Request { id: 2, prompt: (1000..1300).collect(), max_tokens: 5 });
    // The first step prefills both and yields their first tokens: no
    // decode ran yet.
    let first = e.step();
    assert_eq!((first.decode_tokens, first.decode_context_tokens), (0, 0));
    // Then each decode attends over its prompt and its tokens so far.
    let second = e.step();
    assert_eq!(second.decode_tokens, 2);
    assert_eq!(second.decode_context_tokens, (100 + 1) + (300 + 1));
    let third = e.step();
    assert_eq!(third.decode_context_tokens, (100 + 2) + (300 + 2));
    // A prompt in prefill holds blocks but attends as no decode.
    e.submit(Request { id: 3, prompt: (5000..7000).collect(), max_tokens: 5 });
    let fourth = e.step();
    assert_eq!(fourth.decode_context_tokens, (100 + 3) + (300 + 3));
    let held = e.pool().usage() * 1000.0 * 32.0;
    assert!(held > 2_000.0 + 400.0, "KV usage counts the new prompt's blocks: {held} tokens");
}
