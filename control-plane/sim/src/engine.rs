//! One simulated engine: vLLM's continuous batching over the block pool.
//!
//! Each [`Engine::step`], as vLLM V1's scheduler:
//! 1. gives every running request that finished its prefill one decode
//!    token;
//! 2. spends what is left of `max_num_batched_tokens` on prefill chunks of
//!    running requests still prefilling (chunked prefill), oldest first;
//! 3. while budget and seats (`max_num_seqs`) remain, admits waiting
//!    requests in arrival order, each with its first chunk. A request's
//!    cache lookup sees the blocks of every chunk scheduled before it in
//!    the same step: vLLM registers the hashes of the blocks a step will
//!    compute when it allocates them (`KVCacheManager.allocate_slots`), so
//!    siblings that arrive together share one computation of their prefix;
//! 4. takes the timing model's time for that mix, and reports first tokens
//!    and completions at the step's end time.
//!
//! A request whose prompt KV was computed by a prefill worker and received
//! over a KV connector ([`Engine::submit_transferred`], the decode side of
//! disaggregated serving) is admitted with every prompt token but the last
//! already in its blocks: they are stored in the prefix cache (with their
//! `BlockStored` events, as vLLM caches received blocks), and its prefill
//! computes only the last token. The transfer's duration is the server's
//! to wait before submitting ([`crate::engine::EngineConfig::kv_transfer_ms_per_token`]).
//!
//! If a decode token needs a block and none is free, the newest running
//! request is preempted (freed and re-queued at the front), as vLLM does,
//! and nothing is admitted in that step.
//! Generated tokens are deterministic (a function of the request and
//! position), so output text is reproducible.
//!
//! Cost per step: O(running requests + admitted prompt blocks).

use std::collections::VecDeque;

use crate::pool::{BlockPool, CacheEvent, Seq};
use crate::timing::{StepShape, Timing};

/// Engine limits (vLLM's flags).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    /// `--max-num-seqs`.
    pub max_num_seqs: usize,
    /// `--max-num-batched-tokens` (per step).
    pub max_num_batched_tokens: usize,
    /// KV blocks.
    pub num_blocks: usize,
    /// `--block-size`.
    pub block_size: usize,
    /// Step timing.
    pub timing: Timing,
    /// Host tier (KV offloading), off by default.
    pub host: HostTier,
    /// Time to receive one token's KV from a prefill worker, ms (KV bytes
    /// per token over the link's bandwidth): the decode side of a
    /// disaggregated request waits this × the tokens it does not hold
    /// before it is submitted. 0 = instantaneous.
    pub kv_transfer_ms_per_token: f64,
}

/// A host-memory KV tier (vLLM's CPU offloading connector, LMCache): evicted
/// device blocks go there, and a prompt that continues its device hit there
/// loads them back instead of recomputing them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct HostTier {
    /// Blocks it holds; 0 = no host tier.
    pub blocks: usize,
    /// Time to load one token's KV back into device memory, ms (KV bytes per
    /// token over host-to-device bandwidth). The step that admits the
    /// request takes it on top of its compute: loads are charged as a stall,
    /// an upper bound of vLLM's asynchronous loads.
    pub load_ms_per_token: f64,
}

/// A request as the engine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Caller's id.
    pub id: u64,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: usize,
}

/// Something that happened to a request during a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Output {
    /// A token was generated (the first one ends the prefill).
    Token {
        /// Request id.
        id: u64,
        /// The token.
        token: u32,
        /// Index among the generated tokens (0 = first).
        index: usize,
        /// Prompt tokens that were prefix-cache hits (reported with every token).
        cached_tokens: usize,
    },
    /// The request generated its last token.
    Finished {
        /// Request id.
        id: u64,
    },
}

#[derive(Debug)]
struct Running {
    req: Request,
    seq: Seq,
    prefilled: usize,
    generated: usize,
    cached_tokens: usize,
}

/// The result of one step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Step {
    /// Simulated milliseconds the step took (0 when idle).
    pub ms: f64,
    /// Outputs, in order.
    pub outputs: Vec<Output>,
    /// Cache events of the step (vLLM publishes them as one batch).
    pub events: Vec<CacheEvent>,
    /// Prefill tokens computed.
    pub prefill_tokens: usize,
    /// Decode tokens generated.
    pub decode_tokens: usize,
    /// Context tokens the step's decoding requests attended over (prompt
    /// and generated tokens before each one's new token).
    pub decode_context_tokens: usize,
    /// Requests admitted from the waiting queue in this step (for the
    /// queue-time metric).
    pub admitted: Vec<u64>,
}

/// The deterministic token a request generates at `index`.
pub fn output_token(id: u64, index: usize) -> u32 {
    let mut z = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (index as u64).wrapping_add(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    // Avoid the special tokens at the bottom of the vocabulary.
    1_000 + (z % 100_000) as u32
}

/// One engine.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    pool: BlockPool,
    waiting: VecDeque<Request>,
    running: Vec<Running>,
    vocab: Vec<u32>,
    slowdown: f64,
    /// Requests submitted with their prompt's KV received from a prefill
    /// worker, until admitted.
    transferred: std::collections::HashSet<u64>,
}

impl Engine {
    /// An idle engine.
    pub fn new(config: EngineConfig) -> Self {
        Self {
            pool: BlockPool::new(config.num_blocks, config.block_size).with_host(config.host.blocks),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            vocab: Vec::new(),
            slowdown: 1.0,
            transferred: std::collections::HashSet::new(),
        }
    }

    /// Generates only these token ids (the token at `index` of request `id`
    /// is `vocab[output_token(id, index) % vocab.len()]`), so that a server
    /// that streams the matching words makes a next turn whose prompt
    /// re-tokenizes to the ids the engine cached, as with a real model.
    /// Empty (the default): [`output_token`] itself.
    pub fn set_output_vocab(&mut self, vocab: Vec<u32>) {
        self.vocab = vocab;
    }

    fn token(&self, id: u64, index: usize) -> u32 {
        let t = output_token(id, index);
        match self.vocab.len() {
            0 => t,
            n => self.vocab[t as usize % n],
        }
    }

    /// Multiplies every later step's time by `factor` (> 0, finite;
    /// otherwise ignored): a fleet that changed speed (another engine
    /// version, throttling) for the calibration benchmark. Returns whether
    /// it was taken.
    pub fn set_slowdown(&mut self, factor: f64) -> bool {
        let ok = factor.is_finite() && factor > 0.0;
        if ok {
            self.slowdown = factor;
        }
        ok
    }

    /// The step-time multiplier.
    pub fn slowdown(&self) -> f64 {
        self.slowdown
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The block pool (for metrics).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Queues a request.
    pub fn submit(&mut self, req: Request) {
        self.waiting.push_back(req);
    }

    /// Queues a request whose prompt KV, all but the last token, a prefill
    /// worker computed and sent: admitted, it holds those tokens at once
    /// and computes only the last one.
    pub fn submit_transferred(&mut self, req: Request) {
        self.transferred.insert(req.id);
        self.waiting.push_back(req);
    }

    /// Prompt tokens of `prompt` this engine holds in device memory now
    /// (whole leading blocks, keeping one token to compute).
    pub fn cached_prefix_tokens(&self, prompt: &[u32]) -> usize {
        self.pool.cached_prefix_tokens(prompt)
    }

    /// Drops a request (the client went away), freeing its blocks. Returns
    /// whether it was queued or running.
    pub fn abort(&mut self, id: u64) -> bool {
        if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
            self.waiting.remove(i);
            self.transferred.remove(&id);
            return true;
        }
        if let Some(i) = self.running.iter().position(|r| r.req.id == id) {
            let r = self.running.remove(i);
            self.pool.free(r.seq);
            return true;
        }
        false
    }

    /// Requests running (`vllm:num_requests_running`).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting (`vllm:num_requests_waiting`).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Computes the next prefill chunk of running request `k` within
    /// `budget` and the free blocks, registering the blocks it fills; the
    /// chunk that completes the prompt samples the first token.
    fn prefill_chunk(&mut self, k: usize, budget: &mut usize, step: &mut Step, shape: &mut StepShape) {
        let first = self.token(self.running[k].req.id, 0);
        let bs = self.config.block_size.max(1);
        let room = self.pool.free_blocks() * bs;
        let r = &mut self.running[k];
        let left = r.req.prompt.len() - r.prefilled;
        // Tokens that fit: the budget, and the held blocks' free slots plus
        // the free blocks (a chunk is all or nothing, never half-appended).
        let slack = r.seq.blocks() * bs - r.seq.len();
        let n = left.min(*budget).min(slack + room);
        if n == 0 {
            return;
        }
        let chunk = r.req.prompt[r.prefilled..r.prefilled + n].to_vec();
        if !self.pool.extend(&mut r.seq, &chunk) {
            return;
        }
        shape.add_chunk(r.prefilled, n);
        r.prefilled += n;
        *budget -= n;
        step.prefill_tokens += n;
        if r.prefilled == r.req.prompt.len() {
            // The step that completes the prefill samples the first token.
            if self.pool.extend(&mut r.seq, &[first]) {
                step.outputs.push(Output::Token {
                    id: r.req.id,
                    token: first,
                    index: 0,
                    cached_tokens: r.cached_tokens,
                });
                r.generated = 1;
            }
        }
    }

    /// Runs one step.
    pub fn step(&mut self) -> Step {
        let mut step = Step::default();
        let mut shape = StepShape::default();
        // 1. Decode tokens for requests past their prefill.
        let mut budget = self.config.max_num_batched_tokens;
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() {
            let (id, generated) = (self.running[i].req.id, self.running[i].generated);
            let token = self.token(id, generated);
            let r = &mut self.running[i];
            if r.prefilled < r.req.prompt.len() || budget == 0 {
                i += 1;
                continue;
            }
            if !self.pool.extend(&mut r.seq, &[token]) {
                // Out of blocks: preempt the newest request and retry.
                if let Some(victim) = self.running.pop() {
                    self.pool.free(victim.seq);
                    self.waiting.push_front(victim.req);
                    preempted = true;
                }
                continue;
            }
            budget -= 1;
            step.decode_tokens += 1;
            shape.decode_context_tokens += r.req.prompt.len() + r.generated;
            step.outputs.push(Output::Token {
                id: r.req.id,
                token,
                index: r.generated,
                cached_tokens: r.cached_tokens,
            });
            r.generated += 1;
            i += 1;
        }
        // 2. Prefill chunks of running requests, oldest first.
        for k in 0..self.running.len() {
            if budget == 0 {
                break;
            }
            self.prefill_chunk(k, &mut budget, &mut step, &mut shape);
        }
        // 3. Admission with a first chunk each (vLLM admits none in a step
        //    that preempted); prefixes found in the host tier are loaded.
        let mut loaded_tokens = 0;
        while !preempted && budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(req) = self.waiting.front() else { break };
            // Reserve the prompt plus one block of headroom for decoding.
            let Ok(seq) = self.pool.admit_prefix(&req.prompt) else { break };
            let Some(req) = self.waiting.pop_front() else { break };
            let mut seq = seq;
            let mut cached = seq.hit_tokens + seq.loaded_tokens;
            loaded_tokens += seq.loaded_tokens;
            // Received from a prefill worker: all but the last token, with
            // no compute (admit_prefix checked that the blocks are free).
            let upto = req.prompt.len().saturating_sub(1);
            if self.transferred.remove(&req.id)
                && upto > cached
                && self.pool.extend(&mut seq, &req.prompt[cached..upto])
            {
                cached = upto;
            }
            step.admitted.push(req.id);
            self.running.push(Running { req, prefilled: cached, generated: 0, cached_tokens: cached, seq });
            let k = self.running.len() - 1;
            self.prefill_chunk(k, &mut budget, &mut step, &mut shape);
        }
        // Completions.
        let mut k = 0;
        while k < self.running.len() {
            if self.running[k].generated >= self.running[k].req.max_tokens.max(1) {
                let done = self.running.remove(k);
                step.outputs.push(Output::Finished { id: done.req.id });
                self.pool.free(done.seq);
            } else {
                k += 1;
            }
        }
        if step.decode_tokens + step.prefill_tokens > 0 {
            shape.decode_seqs = step.decode_tokens;
            step.decode_context_tokens = shape.decode_context_tokens;
            shape.kv_fill = self.pool.usage();
            step.ms = self.config.timing.step_time(&shape) * self.slowdown;
        }
        step.ms += loaded_tokens as f64 * self.config.host.load_ms_per_token.max(0.0) * self.slowdown;
        step.events = self.pool.take_events();
        step
    }
}
