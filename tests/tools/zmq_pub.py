"""A real libzmq (pyzmq) PUB socket that publishes captured vLLM frames, as
vLLM's publisher does, for the relay's end-to-end tests; optionally a ROUTER
replay socket that answers like vLLM >= 0.30 (DEALER request ["", start_seq]
-> ["", topic, seq, payload] per buffered batch, then ["", "", ff*8, ""]).

Usage: zmq_pub.py bind|connect ENDPOINT CAPTURE.raw.jsonl
                  [--warmup S] [--skip N,N] [--replay ENDPOINT] [--linger S]

CAPTURE lines are {"frames_hex": [topic, seq, payload]}; --skip names line
numbers not published live (they stay available to replay).
"""
import argparse
import json
import threading
import time

import zmq

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["bind", "connect"])
ap.add_argument("endpoint")
ap.add_argument("capture")
ap.add_argument("--warmup", type=float, default=1.0)
ap.add_argument("--skip", default="")
ap.add_argument("--replay")
ap.add_argument("--linger", type=float, default=0.3)
ap.add_argument("--range", default="", help="A:B publishes only lines A..B-1")
ap.add_argument("--replay-from", type=int, default=0,
                help="the replay buffer holds only lines from this one on (a gap beyond it cannot be replayed)")
args = ap.parse_args()
skip = {int(x) for x in args.skip.split(",") if x}
lo, hi = (int(x) for x in args.range.split(":")) if args.range else (0, 1 << 30)
msgs = [[bytes.fromhex(x) for x in json.loads(line)["frames_hex"]] for line in open(args.capture)]

ctx = zmq.Context()
done = threading.Event()


def serve_replay(endpoint):
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while not done.is_set():
        if not poller.poll(50):
            continue
        frames = router.recv_multipart()
        if len(frames) != 3:
            continue
        ident, _, start = frames
        start = int.from_bytes(start, "big")
        for topic, seq, payload in msgs[args.replay_from:]:
            if int.from_bytes(seq, "big") >= start:
                router.send_multipart([ident, b"", topic, seq, payload])
        router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
    router.close(linger=0)


if args.replay:
    t = threading.Thread(target=serve_replay, args=(args.replay,), daemon=True)
    t.start()

pub = ctx.socket(zmq.PUB)
pub.setsockopt(zmq.SNDHWM, 100000)
(pub.bind if args.mode == "bind" else pub.connect)(args.endpoint)
time.sleep(args.warmup)  # let the subscription reach us (ZMQ's slow joiner)
sent = 0
for i, frames in enumerate(msgs):
    if i in skip or not lo <= i < hi:
        continue
    pub.send_multipart(frames)
    sent += 1
    time.sleep(0.002)
time.sleep(args.linger)
done.set()
pub.close(linger=2000)
time.sleep(0.1)
ctx.term()
print(f"sent {sent}", flush=True)
