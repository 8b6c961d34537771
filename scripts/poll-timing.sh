#!/usr/bin/env bash
# Polls /admin/timing of every control plane a running `kvgate-bench doks`
# starts under RUN_DIR, so that the prices `kv` routed with can be read over
# the run, not only at its end (the run dir's timing.json). One line per
# poll: `<unix seconds> <cell> <the admin endpoint's JSON>`, appended to OUT.
# Cells run one after another, so only the newest cell's control plane is
# polled (an ended cell's port may be reused by the next one's). Stops by
# itself when no `kvgate-bench` with that run dir is left.
#
#   target/release/kvgate-bench doks --levels 120 --preset vllm-v1 --modes kv \
#       --repeats 3 --run-dir /tmp/diag --out /tmp/diag.json &
#   scripts/poll-timing.sh /tmp/diag /tmp/diag-timing.txt
#
# The polls cost CPU (on a 2-core VM host CPU ~30 -> ~50 %): read the prices
# from such a run, not its latencies. Loopback only; nothing is started.
set -euo pipefail
run_dir=${1:?usage: scripts/poll-timing.sh RUN_DIR OUT [INTERVAL_S]}
out=${2:?usage: scripts/poll-timing.sh RUN_DIR OUT [INTERVAL_S]}
interval=${3:-0.5}
# The run dir whole, not a prefix of another (`/tmp/diag` is not `/tmp/diag2`).
while pgrep -f -- "--run-dir ${run_dir}( |\$)" >/dev/null; do
    # shellcheck disable=SC2012 # cell names are ours: mode-level-repeat
    log=$(ls -t "$run_dir"/*/*/serve.log 2>/dev/null | head -n 1 || true)
    if [ -n "$log" ]; then
        admin=$(grep -o 'admin=127\.0\.0\.1:[0-9]*' "$log" | head -n 1 | cut -d= -f2 || true)
        cell=$(basename "$(dirname "$log")")
        if [ -n "$admin" ] && body=$(curl -sf -m 1 "http://$admin/admin/timing"); then
            printf '%s %s %s\n' "$(date +%s.%N)" "$cell" "$body" >>"$out"
        fi
    fi
    sleep "$interval"
done
