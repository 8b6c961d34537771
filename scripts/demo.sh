#!/usr/bin/env bash
# `make demo`: the main job. Brings up the parts of the local stack that
# exist, on 127.0.0.1, shows what they do, and tears them down (only the
# processes it started, by PID). It prints real readings only: parts that do
# not exist yet are named as missing, never simulated.
#
# Today: nats-server, Envoy 1.40 with the local bootstrap (override_host
# worker cluster), the KV event relay fed with real captured vLLM events
# through a real libzmq publisher, and the kvgate CLI. The simulator's HTTP
# side, control plane, filter and benchmark join as their issues land (see
# README "Status").
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "$0")/env.sh"

run="$root/.run/demo-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$run"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { # url, seconds
    for _ in $(seq 1 $(($2 * 10))); do
        curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "demo: $1 did not answer" >&2
    return 1
}

echo "== building kvgate"
cargo build -q -p kvgate
kvgate="$root/target/debug/kvgate"

nats_port=$(free_port); nats_mon=$(free_port)
echo "== nats-server on 127.0.0.1:$nats_port (monitoring :$nats_mon)"
"$KVGATE_NATS_SERVER" -a 127.0.0.1 -p "$nats_port" -m "$nats_mon" -js -sd "$run/jetstream" >"$run/nats.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$nats_mon/healthz" 10
echo "   healthz: $(curl -fsS "http://127.0.0.1:$nats_mon/healthz")"

listen=$(free_port); admin=$(free_port)
echo "== Envoy 1.40 on 127.0.0.1:$listen (admin :$admin)"
python3 - "$root/envoy/local.yaml" "$run/envoy.yaml" "$listen" "$admin" <<'PY'
import sys
src, dst, listen, admin = sys.argv[1:]
text = open(src).read()
# No workers yet: the simulated fleet arrives with its issue.
for k, v in {"LISTEN_PORT": listen, "ADMIN_PORT": admin, "WORKER_ENDPOINTS": "        []"}.items():
    text = text.replace("${" + k + "}", v)
open(dst, "w").write(text)
PY
"$KVGATE_ENVOY" --mode validate --disable-hot-restart -l warn -c "$run/envoy.yaml" | sed 's/^/   /'
"$KVGATE_ENVOY" --disable-hot-restart --concurrency 1 -l warn -c "$run/envoy.yaml" >"$run/envoy.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$admin/ready" 20
echo "   ready: $(curl -fsS "http://127.0.0.1:$admin/ready")"
code=$(curl -s -o "$run/resp.txt" -w '%{http_code}' -X POST "http://127.0.0.1:$listen/v1/chat/completions" \
    -H 'content-type: application/json' -d '{"model":"demo","messages":[{"role":"user","content":"hi"}]}')
echo "   POST /v1/chat/completions through Envoy -> HTTP $code ($(head -c 80 "$run/resp.txt")): no workers in the cluster yet"

echo "== kvgate relay: real vLLM 0.32 KV events (captured) -> libzmq PUB -> relay -> NATS"
shared=${KVGATE_SHARED_DIR:-$root/../shared}
capture="$shared/vectors/vllm-kv-events/real-0.32-cpu/inst1.raw.jsonl"
if [ -f "$capture" ]; then
    zmq_port=$(free_port); relay_metrics=$(free_port)
    "$kvgate" relay --zmq-endpoint "tcp://127.0.0.1:$zmq_port" --nats-url "nats://127.0.0.1:$nats_port" \
        --model tiny-llama --endpoint 127.0.0.1:8101 --block-size 32 \
        --listen-metrics "127.0.0.1:$relay_metrics" >"$run/relay.log" 2>&1 &
    pids+=($!)
    wait_http "http://127.0.0.1:$relay_metrics/metrics" 10
    "$KVGATE_PYTHON" "$root/tests/tools/zmq_pub.py" connect "tcp://127.0.0.1:$zmq_port" "$capture" --warmup 0.5 | sed 's/^/   publisher: /'
    sleep 0.5
    curl -fsS "http://127.0.0.1:$relay_metrics/metrics" | grep -E '^kvgate_relay_(messages|batches_published|blocks_stored|blocks_removed|mirror_blocks|gaps|restarts)' \
        | sed -E 's/\{[^}]*\}//; s/^/   /'
    echo "   NATS: $(curl -fsS "http://127.0.0.1:$nats_mon/varz" | jq -c '{in_msgs, in_bytes}')"
else
    echo "   (skipped: $capture not found; set KVGATE_SHARED_DIR)"
fi

echo "== kvgate: block hashes of 64 token ids at block size 32 (Dynamo-compatible xxh3)"
seq -s, 1 64 | "$kvgate" hash --block-size 32 | jq -c '{full_blocks, sequence_hashes}' | sed 's/^/   /'
echo "== kvgate: NATS subjects for meta-llama/Llama-3.1-70B-Instruct on worker 10.0.0.7:8000"
"$kvgate" subject --model meta-llama/Llama-3.1-70B-Instruct --worker 10.0.0.7:8000 | sed 's/^/   /'

cat <<EOT

== not running yet (each arrives with its issue; nothing is faked here)
   simulated vLLM fleet's HTTP side (#4), control plane (#6),
   Proxy-Wasm filter (#7), benchmark and reports (#8)

logs and configs: $run
stopping what this demo started (PIDs ${pids[*]})
EOT
