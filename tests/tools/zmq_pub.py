"""A real libzmq (pyzmq) PUB socket that publishes captured vLLM frames, as
vLLM's publisher does, for the relay's end-to-end tests.

Usage: zmq_pub.py bind|connect ENDPOINT CAPTURE.raw.jsonl [WARMUP_S] [SKIP_SEQS]

CAPTURE lines are {"frames_hex": [topic, seq, payload]}. SKIP_SEQS is a
comma list of line numbers not to send (to make gaps). Exits when done.
"""
import json
import sys
import time

import zmq

mode, endpoint, capture = sys.argv[1:4]
warmup = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
skip = {int(x) for x in sys.argv[5].split(",") if x} if len(sys.argv) > 5 else set()

ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub.setsockopt(zmq.SNDHWM, 100000)
(pub.bind if mode == "bind" else pub.connect)(endpoint)
time.sleep(warmup)  # let the subscription reach us (ZMQ's slow joiner)
sent = 0
with open(capture) as f:
    for i, line in enumerate(f):
        if i in skip:
            continue
        frames = [bytes.fromhex(x) for x in json.loads(line)["frames_hex"]]
        pub.send_multipart(frames)
        sent += 1
        time.sleep(0.002)
time.sleep(0.3)
pub.close(linger=2000)
ctx.term()
print(f"sent {sent}", flush=True)
