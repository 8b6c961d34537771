"""Times the wasm_probe modules of several build variants in wasmtime
(Cranelift), interleaved: every round calls every export of every variant
once, so that machine noise hits all variants alike. Prints one JSON object
per variant (name -> median microseconds per call).

Usage: wasm_profile.py NAME=MODULE.wasm ...
"""
import json
import statistics
import sys
import time

import wasmtime

TOKENS = 100_000        # a 100K-token prompt
TEXT = 400_000          # ~400 KB of message bytes (a 100K-token body)
MESSAGES = 40
ROUNDS = 60
CALLS = [("block_hash_100k_tokens_us", "probe_block_hash", 32),
         ("segment_hash_400kb_us", "probe_segment_hash", MESSAGES),
         ("pick_encode_400kb_us", "probe_pick_encode", MESSAGES)]


def main() -> None:
    engine = wasmtime.Engine()
    mods = {}
    for arg in sys.argv[1:]:
        name, path = arg.split("=", 1)
        store = wasmtime.Store(engine)
        linker = wasmtime.Linker(engine)
        linker.define_wasi()
        store.set_wasi(wasmtime.WasiConfig())
        inst = linker.instantiate(store, wasmtime.Module.from_file(engine, path))
        ex = inst.exports(store)
        ex["probe_setup"](store, TOKENS, TEXT)
        mods[name] = (store, ex)
    samples = {n: {k: [] for k, _, _ in CALLS} for n in mods}
    outputs = {}
    for r in range(ROUNDS + 3):
        for name, (store, ex) in mods.items():
            for key, export, arg in CALLS:
                f = ex[export]
                t = time.perf_counter_ns()
                out = f(store, arg)
                dt = (time.perf_counter_ns() - t) / 1000
                if r >= 3:  # the first rounds warm up
                    samples[name][key].append(dt)
                outputs.setdefault(name, {})[key] = out
    # Every variant must compute the same results.
    first = next(iter(outputs.values()))
    assert all(o == first for o in outputs.values()), outputs
    print(json.dumps({n: {k: round(statistics.median(v), 1) for k, v in s.items()} for n, s in samples.items()}))


if __name__ == "__main__":
    main()
