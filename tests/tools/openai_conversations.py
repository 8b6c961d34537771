"""Multi-turn conversations through a gateway with the real OpenAI SDK, for
kvgate's real-engine tests. Each request prints one JSON line:

  {"conv", "turn", "api": "chat"|"completions", "stream", "ok", "started",
   "error", "worker", "reason", "blocks", "prompt_tokens", "cached_tokens"}

"started" is true once the response headers arrived (a stream that fails
after that was already running). "oracle_cached_tokens" is what one
unbounded cache shared by every engine would have held of the prompt (its
leading 32-token blocks seen in any earlier prompt, from vLLM's own
prompt_token_ids), as vLLM counts cached tokens (never the whole prompt). worker/reason/blocks are kvgate's debug
headers. Conversations share long system prompts in groups, so that some
prefixes are common to several conversations.

Usage: openai_conversations.py BASE_URL MODEL --convs N --turns T
       [--concurrency C] [--seed S] [--max-tokens M] [--duration SECONDS]
"""
import argparse
import json
import random
import sys
import threading
import time

import openai

ap = argparse.ArgumentParser()
ap.add_argument("base_url")
ap.add_argument("model")
ap.add_argument("--convs", type=int, default=8)
ap.add_argument("--turns", type=int, default=4)
ap.add_argument("--concurrency", type=int, default=2)
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--max-tokens", type=int, default=16)
ap.add_argument("--duration", type=float, default=0.0, help="> 0: keep starting conversations until then")
args = ap.parse_args()

client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=120)
lock = threading.Lock()
rng = random.Random(args.seed)
BLOCK = 32
seen_blocks = set()
EXTRA = {"return_token_ids": True}
WORDS = ("kv cache prefix routing envoy worker block token engine gateway stream latency "
         "throughput queue batch decode prefill model tenant session").split()


def text(r, n):
    return " ".join(r.choice(WORDS) for _ in range(n))


def oracle(ids, out):
    """Leading blocks of the prompt `ids` seen before, in tokens; then the
    blocks of prompt + output are remembered (an engine caches the blocks
    it decodes too)."""
    if not ids:
        return None
    chain, matched, matching = 0, 0, True
    for b in range(len(ids) // BLOCK):
        chain = hash((chain, tuple(ids[b * BLOCK:(b + 1) * BLOCK])))
        if matching and chain in seen_blocks:
            matched += 1
        else:
            matching = False
    full = list(ids) + list(out or [])
    chain = 0
    for b in range(len(full) // BLOCK):
        chain = hash((chain, tuple(full[b * BLOCK:(b + 1) * BLOCK])))
        seen_blocks.add(chain)
    return min(matched, (len(ids) - 1) // BLOCK) * BLOCK


def emit(rec, ids=None, out=None):
    with lock:
        rec["oracle_cached_tokens"] = oracle(ids, out)
        print(json.dumps(rec), flush=True)


def headers_of(raw):
    h = raw.headers
    return {"worker": h.get("x-kvgate-worker"), "reason": h.get("x-kvgate-reason"), "blocks": h.get("x-kvgate-blocks"),
            "passed_over": h.get("x-kvgate-passed-over")}


def chat_turn(conv, turn, messages, stream):
    rec = {"conv": conv, "turn": turn, "api": "chat", "stream": stream, "ok": False, "started": False}
    try:
        if stream:
            raw = client.chat.completions.with_raw_response.create(
                model=args.model, messages=messages, max_tokens=args.max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body=EXTRA)
            rec["started"] = True
            rec.update(headers_of(raw))
            reply, usage, ids, out = [], None, None, []
            for chunk in raw.parse():
                ids = ids or getattr(chunk, "prompt_token_ids", None)
                if chunk.choices:
                    out.extend(getattr(chunk.choices[0], "token_ids", None) or [])
                if chunk.choices and chunk.choices[0].delta.content:
                    reply.append(chunk.choices[0].delta.content)
                if chunk.usage:
                    usage = chunk.usage
            content = "".join(reply)
        else:
            raw = client.chat.completions.with_raw_response.create(
                model=args.model, messages=messages, max_tokens=args.max_tokens, extra_body=EXTRA)
            rec["started"] = True
            rec.update(headers_of(raw))
            r = raw.parse()
            content, usage = r.choices[0].message.content or "", r.usage
            ids = getattr(r, "prompt_token_ids", None)
            out = getattr(r.choices[0], "token_ids", None) or []
        rec["ok"] = usage is not None
        if usage is not None:
            rec["prompt_tokens"] = usage.prompt_tokens
            d = usage.prompt_tokens_details
            rec["cached_tokens"] = (d.cached_tokens or 0) if d is not None else None
        return content, rec, ids, out
    except Exception as e:  # noqa: BLE001 - every failure is a result
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
        return None, rec, None, None


def completion(conv, prompt):
    rec = {"conv": conv, "turn": 0, "api": "completions", "stream": False, "ok": False, "started": False}
    ids, out = None, None
    try:
        raw = client.completions.with_raw_response.create(
            model=args.model, prompt=prompt, max_tokens=args.max_tokens, extra_body=EXTRA)
        rec["started"] = True
        rec.update(headers_of(raw))
        r = raw.parse()
        ids = getattr(r.choices[0], "prompt_token_ids", None)
        out = getattr(r.choices[0], "token_ids", None) or []
        rec["ok"] = True
        rec["prompt_tokens"] = r.usage.prompt_tokens
        d = r.usage.prompt_tokens_details
        rec["cached_tokens"] = (d.cached_tokens or 0) if d is not None else None
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
        ids, out = None, None
    emit(rec, ids, out)


def conversation(conv, seed):
    r = random.Random(seed)
    group = conv % 3
    system = f"Group {group} reference document. " + text(random.Random(1000 + group + args.seed * 7), 600)
    messages = [{"role": "system", "content": system}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Conversation {conv} turn {turn}: " + text(r, 40)})
        content, rec, ids, out = chat_turn(conv, turn, messages, stream=(turn % 2 == 1))
        emit(rec, ids, out)
        if content is None:
            return
        messages.append({"role": "assistant", "content": content})
    # A completions request on the same document.
    completion(conv, system + " Summary: " + text(r, 20))


def worker(queue):
    while True:
        with lock:
            if not queue:
                return
            conv, seed = queue.pop(0)
        conversation(conv, seed)


def main():
    deadline = time.time() + args.duration
    next_conv = 0
    while True:
        queue = [(c, rng.randrange(1 << 30)) for c in range(next_conv, next_conv + args.convs)]
        next_conv += args.convs
        threads = [threading.Thread(target=worker, args=(queue,)) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if args.duration <= 0 or time.time() >= deadline:
            break
    sys.stdout.flush()


main()
