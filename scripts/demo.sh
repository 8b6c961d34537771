#!/usr/bin/env bash
# `make demo`: the main job. Builds kvgate, the filter and the benchmark,
# then runs the short DOKS multi-turn sweep (kvgate-bench doks --quick):
# concurrency 60, 120 and 180; kvgate's kv mode, round robin (the same
# gateway with the control plane in round_robin mode) and sglang-router's
# cache_aware policy; each cell on a fresh local stack on 127.0.0.1 (nats-server,
# 3 simulated H200 workers with a relay each, the control plane, Envoy 1.40
# with the filter, or sglang-router), stopped by PID afterwards. Prints the
# tables; about 6 minutes once built.
#
# Flags go to kvgate-bench: `make demo ARGS="--levels 60,80,100,120,140,160,180"`,
# or the full sweep that bench/results/doks-multiturn.json comes from:
# `make bench-doks`. See bench/loadgen/README.md.
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "$0")/env.sh"

echo "== building kvgate and kvgate-bench (release) and the filter (wasm32-wasip1)"
cargo build -q --release -p kvgate -p kvgate-bench
cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
exec "$root/target/release/kvgate-bench" doks --quick "$@"
