#!/usr/bin/env bash
# `make demo`: the main job. Brings up the whole local stack on 127.0.0.1,
# runs multi-turn conversations through it, prints what it measured, and
# tears it down (only the processes it started, by PID). Real readings only.
#
# The stack: nats-server; a simulated fleet of 3 vLLM workers (`kvgate sim`,
# h200-llama70b-fp8 timing) with a `kvgate relay` beside each (ZMQ KV events
# -> NATS); the control plane (`kvgate serve`); Envoy 1.40 with the kvgate
# filter (envoy/kvgate.yaml); and, for comparison, a second Envoy whose
# worker cluster balances round robin with no filter. The same conversations
# (different text for each side, so that neither warms the other's cache)
# run through both, 6 at a time, 4 turns each.
#
# The full benchmark (concurrency sweeps, peers, reports) is issue #8.
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

ports() { # n: the first of n consecutive free ports
    python3 - "$1" <<'PY'
import socket, sys
n = int(sys.argv[1])
for _ in range(200):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
    if p + n > 65535:
        continue
    ok = True
    for q in range(p, p + n):
        t = socket.socket()
        try:
            t.bind(("127.0.0.1", q))
        except OSError:
            ok = False
        t.close()
    if ok:
        print(p); break
PY
}

echo "== building kvgate (release) and the filter (wasm32-wasip1)"
cargo build -q --release -p kvgate
cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
kvgate="$root/target/release/kvgate"
wasm="$root/target/wasm32-wasip1/wasm/kvgate_filter.wasm"
tok="$KVGATE_TOKENIZER_DIR"
workers=3

nats_port=$(free_port); nats_mon=$(free_port)
echo "== nats-server on 127.0.0.1:$nats_port"
"$KVGATE_NATS_SERVER" -a 127.0.0.1 -p "$nats_port" -m "$nats_mon" -js -sd "$run/jetstream" >"$run/nats.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$nats_mon/healthz" 10

http0=$(ports $workers); zmq0=$(ports $((2 * workers)))
echo "== kvgate sim: $workers workers (h200-llama70b-fp8), HTTP 127.0.0.1:$http0.., ZMQ :$zmq0.."
"$kvgate" sim --workers $workers --tokenizer-dir "$tok" --http-port "$http0" --zmq-port "$zmq0" \
    --block-size 16 --timing h200-llama70b-fp8 >"$run/sim.log" 2>&1 &
pids+=($!)
endpoints=()
for i in $(seq 0 $((workers - 1))); do
    h=$((http0 + i)); z=$((zmq0 + 2 * i))
    wait_http "http://127.0.0.1:$h/health" 30
    endpoints+=("127.0.0.1:$h")
    "$kvgate" relay --zmq-endpoint "tcp://*:$z" --zmq-connect "tcp://127.0.0.1:$z" \
        --replay-endpoint "tcp://127.0.0.1:$((z + 1))" --nats-url "nats://127.0.0.1:$nats_port" \
        --model deepseek-v3 --endpoint "127.0.0.1:$h" --worker-id "w$i" \
        --metrics-url "http://127.0.0.1:$h/metrics" --block-size 16 --max-num-seqs 64 \
        --heartbeat-ms 500 >"$run/relay-$i.log" 2>&1 &
    pids+=($!)
done

grpc=$(free_port); cp_admin=$(free_port)
echo "== kvgate serve: gRPC 127.0.0.1:$grpc, admin :$cp_admin"
"$kvgate" serve --model deepseek-v3 --tokenizer-dir "$tok" --block-size 16 \
    --nats-url "nats://127.0.0.1:$nats_port" --listen-grpc "127.0.0.1:$grpc" \
    --listen-admin "127.0.0.1:$cp_admin" --replica-id demo >"$run/serve.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$cp_admin/healthz" 30
for _ in $(seq 1 100); do
    live=$(curl -fsS "http://127.0.0.1:$cp_admin/admin/workers" | jq '[.["deepseek-v3"][]? | select(.live)] | length')
    [ "$live" = "$workers" ] && break
    sleep 0.2
done
echo "   live workers: $live of $workers"

kv_listen=$(free_port); kv_admin=$(free_port); rr_listen=$(free_port); rr_admin=$(free_port)
python3 - "$root" "$run" "$kv_listen" "$kv_admin" "$rr_listen" "$rr_admin" "$grpc" "$wasm" "${endpoints[@]}" <<'PY'
import json, sys
root, run, kvl, kva, rrl, rra, grpc, wasm, *eps = sys.argv[1:]
def yaml_eps(addrs):
    return "\n".join("        - endpoint: { address: { socket_address: { address: %s, port_value: %s } } }" % tuple(a.rsplit(":", 1)) for a in addrs)
def fill(text, vals):
    for k, v in vals.items():
        text = text.replace("${" + k + "}", v)
    return text
cfg = json.dumps({"debug_headers": True, "control_plane": {"timeout_ms": 200}})
kv = fill(open(f"{root}/envoy/kvgate.yaml").read(), {"LISTEN_PORT": kvl, "ADMIN_PORT": kva, "WORKER_ENDPOINTS": yaml_eps(eps),
          "CONTROL_PLANE_ENDPOINTS": yaml_eps(["127.0.0.1:" + grpc]), "WASM_PATH": wasm, "FILTER_CONFIG": cfg})
open(f"{run}/envoy-kvgate.yaml", "w").write(kv)
rr = fill(open(f"{root}/envoy/local.yaml").read(), {"LISTEN_PORT": rrl, "ADMIN_PORT": rra, "WORKER_ENDPOINTS": yaml_eps(eps)})
rr = rr.replace("envoy.load_balancing_policies.least_request", "envoy.load_balancing_policies.round_robin") \
       .replace("least_request.v3.LeastRequest", "round_robin.v3.RoundRobin")
open(f"{run}/envoy-rr.yaml", "w").write(rr)
PY
for side in kvgate rr; do
    "$KVGATE_ENVOY" --mode validate --disable-hot-restart -l warn -c "$run/envoy-$side.yaml" >/dev/null
    "$KVGATE_ENVOY" --disable-hot-restart --concurrency 1 -l warn -c "$run/envoy-$side.yaml" \
        --base-id $((RANDOM)) >"$run/envoy-$side.log" 2>&1 &
    pids+=($!)
done
wait_http "http://127.0.0.1:$kv_admin/ready" 30
wait_http "http://127.0.0.1:$rr_admin/ready" 30
echo "== Envoy 1.40 + kvgate filter on 127.0.0.1:$kv_listen; Envoy round robin on :$rr_listen"

echo "== 6 conversations x 4 turns (~3,600-token system prompt, 48 output tokens), 6 at a time, each side"
"$KVGATE_PYTHON" "$root/scripts/demo_chat.py" "http://127.0.0.1:$rr_listen" round_robin 1 | tee "$run/rr.json"
"$KVGATE_PYTHON" "$root/scripts/demo_chat.py" "http://127.0.0.1:$kv_listen" kvgate 2 | tee "$run/kvgate.json"
jq -rs '
  "\n| side | requests | TTFT p50 ms | TTFT p95 ms | later turns TTFT p50 ms | E2E p50 s | prefix hit rate | later turns hit rate |",
  "|---|---|---|---|---|---|---|---|",
  (.[] | "| \(.label) | \(.requests) | \(.ttft_p50_ms) | \(.ttft_p95_ms) | \(.later_turns_ttft_p50_ms) | \(.e2e_p50_s) | \(.hit_rate) | \(.later_turns_hit_rate) |")
' "$run/rr.json" "$run/kvgate.json"
echo
sleep 1.5 # one report interval: the last requests' reports reach the control plane
echo "   filter stats: $(curl -fsS "http://127.0.0.1:$kv_admin/stats?filter=wasmcustom.kvgate.(requests|steered|fallback)" | grep -v ': 0$' | tr '\n' ' ')"
echo "   control plane: $(curl -fsS "http://127.0.0.1:$cp_admin/metrics" | grep -E '^kvgate_reports_total' | sed -E 's/\{model="[^"]*",/{/' | tr '\n' ' ')"

cat <<EOT

logs and configs: $run
stopping what this demo started (PIDs ${pids[*]})
EOT
