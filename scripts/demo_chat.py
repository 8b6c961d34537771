"""Multi-turn chat conversations against an OpenAI endpoint, measured at the
client: `make demo` runs them through Envoy with the kvgate filter and
through the same Envoy configuration with round robin, on the same simulated
fleet. Standard library only.

Usage: demo_chat.py URL LABEL SEED [--conversations N] [--turns T] [--system-words W] [--max-tokens M]
Prints one JSON line with the label's measurements.
"""
import argparse
import http.client
import json
import random
import statistics
import threading
import time
from urllib.parse import urlparse

WORDS = ("the kv cache router prefix token block worker latency throughput envoy filter model request "
         "stream prompt system user assistant tool answer question gateway cluster endpoint header").split()


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def turn(url, messages, max_tokens):
    u = urlparse(url)
    body = json.dumps({"model": "deepseek-v3", "messages": messages, "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    worker = resp.getheader("x-kvgate-worker") or ""
    ttft, reply, usage = None, [], {}
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        for c in ev.get("choices", []):
            piece = c.get("delta", {}).get("content")
            if piece:
                if ttft is None:
                    ttft = time.monotonic() - t0
                reply.append(piece)
        if ev.get("usage"):
            usage = ev["usage"]
    e2e = time.monotonic() - t0
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": ttft or e2e, "e2e": e2e, "prompt": usage.get("prompt_tokens", 0), "cached": cached,
            "worker": worker, "reply": "".join(reply)}


def conversation(url, seed, turns, words, max_tokens, out, lock):
    rng = random.Random(seed)
    messages = [{"role": "system", "content": text(rng, words)},
                {"role": "user", "content": "Question: " + text(rng, 30)}]
    for t in range(turns):
        r = turn(url, messages, max_tokens)
        r["turn"] = t
        with lock:
            out.append(r)
        messages.append({"role": "assistant", "content": r["reply"]})
        messages.append({"role": "user", "content": "Follow-up: " + text(rng, 30)})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("label")
    ap.add_argument("seed", type=int)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=2800)
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args()
    out, lock = [], threading.Lock()
    threads = [threading.Thread(target=conversation,
                                args=(a.url, a.seed * 1000 + i, a.turns, a.system_words, a.max_tokens, out, lock))
               for i in range(a.conversations)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    ttft = sorted(r["ttft"] * 1000 for r in out)
    later = [r for r in out if r["turn"] > 0]
    q = lambda xs, p: xs[min(len(xs) - 1, int(round((len(xs) - 1) * p)))] if xs else float("nan")
    print(json.dumps({
        "label": a.label, "requests": len(out), "wall_s": round(wall, 2),
        "ttft_p50_ms": round(q(ttft, 0.5), 1), "ttft_p95_ms": round(q(ttft, 0.95), 1),
        "later_turns_ttft_p50_ms": round(q(sorted(r["ttft"] * 1000 for r in later), 0.5), 1),
        "e2e_p50_s": round(q(sorted(r["e2e"] for r in out), 0.5), 2),
        "prompt_tokens": sum(r["prompt"] for r in out), "cached_tokens": sum(r["cached"] for r in out),
        "hit_rate": round(sum(r["cached"] for r in out) / max(1, sum(r["prompt"] for r in out)), 3),
        "later_turns_hit_rate": round(sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later)), 3),
        "workers_seen": sorted({r["worker"] for r in out if r["worker"]}),
    }))


if __name__ == "__main__":
    main()
