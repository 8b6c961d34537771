# kvgate — the two commands are `make demo` (the main job) and `make test`
# (everything). Both install what they need into .tools/ first (idempotent).
SHELL := /bin/bash
.DEFAULT_GOAL := help
.PHONY: help setup test soak bench-vllm demo lint wasm proto proto-check fuzz wasm-profile bench-index bench-routing bench-relay bench-cp bench-scale bench-sim bench-gateway bench-doks bench-calibration bench-workloads bench-cache-pressure bench-fanout bench-aiperf bench-pd bench-pd-heavy dashboard report clean-tools

help:
	@echo "make demo   - the main job: short DOKS multi-turn sweep, kvgate vs round robin vs sglang-router (~6 min)"
	@echo "make bench-doks - the full DOKS sweep (7 levels x 5 modes, ~35 min) -> bench/results/doks-multiturn.json"
	@echo "make bench-workloads - Workato long prefix, shared-prefix groups, Mooncake replay (~35 min)"
	@echo "make bench-fanout - agent fan-out bursts on a new long prefix: kvgate vs round robin vs approx vs NVIDIA Dynamo (~20 min)"
	@echo "make bench-aiperf - a second client: aiperf and kvgate-bench on the same requests, how far their TTFT and ITL agree (~15 min)"
	@echo "make bench-pd     - disaggregated prefill/decode: aggregated kv vs disaggregated 1:3 and 2:2 vs conditional, long inputs (~25 min)"
	@echo "make bench-pd-heavy - the same on a prefill-heavy workload (a new 8K-100K document per request) on the vllm-v1 preset (~25 min)"
	@echo "make bench-cache-pressure - tenants' prefixes 3x the KV cache: kvgate vs sglang-router vs NVIDIA Dynamo (~60 min)"
	@echo "make dashboard - live dashboard on http://127.0.0.1:8090/: kv, round robin, sglang under one slider"
	@echo "make report - rewrite the .md/.html/.svg reports of bench/results/*.json from the JSON"
	@echo "make test   - install tools, lint, build the Wasm target, run all tests"
	@echo "make bench-vllm - real vLLM: kv vs round robin vs sglang-router on two CPU engines -> bench/results/vllm.json"
	@echo "make soak   - 10-minute chaos soak under load (faults at random times) -> bench/results/chaos-soak.json"
	@echo "make setup  - install Envoy, nats-server, tokenizer, wasm target into .tools/"
	@echo "make lint   - rustfmt --check and clippy -D warnings (native and wasm32)"
	@echo "make wasm   - build the filter for wasm32-wasip1 (target/wasm32-wasip1/wasm/kvgate_filter.wasm)"
	@echo "make proto  - regenerate protocol/src/gen (and the tonic code of the server and the endpoint picker) from the .proto files"
	@echo "make fuzz   - run every cargo-fuzz target briefly (FUZZ_SECS=30)"
	@echo "make wasm-profile - measure size/speed of Wasm profile choices"
	@echo "make bench-index - kvgate index vs dynamo-kv-router 1.6.1 on the Mooncake trace"
	@echo "make bench-relay - relay decode+publish throughput (blocks/s, one core)"
	@echo "make bench-sim - simulator scale: 8 workers x 64 streams on one core, CPU use"
	@echo "make bench-cp - control plane Pick latency/throughput (8K/100K tokens, 10/100 workers, cold/warm)"
	@echo "make bench-scale - the control plane as a process: 100/1,000 workers x 40K blocks over NATS, 1 M block ops/s, open-loop gRPC Picks beside the transport's floor (health checks); 1/2/4 replicas"
	@echo "make bench-gateway - added latency and Envoy CPU of the filter + control plane vs plain Envoy (8K/100K tokens)"
	@echo "make bench-calibration - does the control plane learn each engine preset's timing, and follow a slowdown"
	@echo "make bench-routing - criterion: ingest, lookup, pick (8K/100K tokens, 10/100/1000 workers)"

setup:
	@scripts/setup.sh

test: setup
	@scripts/test.sh

# Real vLLM (two engines on this machine): kv vs round robin vs sglang-router,
# bench/results/vllm.json (~5 min).
bench-vllm: setup
	cargo build -q --release -p kvgate -p kvgate-bench
	cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
	set -a; . .tools/env; set +a; target/release/kvgate-bench vllm $(ARGS)

# The chaos soak (10 min; KVGATE_SOAK_SECS, KVGATE_SOAK_SEED): faults at
# random times under load; requests, failures and RSS in bench/results/chaos-soak.json.
soak: setup
	cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
	set -a; . .tools/env; set +a; cargo nextest run -p kvgate-e2e --test faults --run-ignored only --no-capture chaos_soak

demo: setup
	@scripts/demo.sh $(ARGS)

# The full DOKS sweep (7 levels x 5 modes, ~35 min): bench/results/doks-multiturn.json.
bench-doks: setup
	cargo build -q --release -p kvgate -p kvgate-bench
	cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
	set -a; . .tools/env; set +a; target/release/kvgate-bench doks $(ARGS)

# Engine-timing calibration on every fleet preset (~25 min):
# bench/results/calibration.json and bench/results/calibration/*.svg.
bench-calibration: setup
	cargo build -q --release -p kvgate -p kvgate-bench
	cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
	set -a; . .tools/env; set +a; target/release/kvgate-bench calibration $(ARGS)

# Cache pressure (~60 min) on the dynamo-mocker preset, kvgate's modes beside
# sglang-router and Dynamo's own frontend and mocker, in a private network
# namespace with only loopback (Dynamo binds 0.0.0.0):
# bench/results/cache-pressure.json. ARGS are added (e.g. --levels 8,16).
BENCH_NETNS = unshare -n sh -c 'ip link set lo up && exec "$$0" "$$@"'
bench-cache-pressure: setup
	cargo build -q --release -p kvgate -p kvgate-bench
	cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
	set -a; . .tools/env; set +a; $(BENCH_NETNS) target/release/kvgate-bench cache-pressure --preset dynamo-mocker \
	  --modes round_robin,approx,kv,sglang_cache_aware,dynamo,dynamo_round_robin --speedup 2 $(ARGS)

# A second client (~15 min): aiperf and kvgate-bench send the same requests to
# fresh stacks of the same mode; bench/results/aiperf.json says how far they
# agree. In a private network namespace: aiperf's services bind sockets, and
# no model hub is reachable (its tokenizer is the local one).
bench-aiperf: setup
	scripts/setup-aiperf.sh
	cargo build -q --release -p kvgate -p kvgate-bench
	cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
	set -a; . .tools/env; set +a; $(BENCH_NETNS) target/release/kvgate-bench aiperf $(ARGS)

# Agent fan-out bursts (~20 min), the same fleet and peers as bench-cache-pressure:
# bench/results/fanout.json.
bench-fanout: setup
	cargo build -q --release -p kvgate -p kvgate-bench
	cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
	set -a; . .tools/env; set +a; $(BENCH_NETNS) target/release/kvgate-bench fanout --preset dynamo-mocker \
	  --modes round_robin,approx,kv,dynamo,dynamo_round_robin --speedup 2 --levels 4,8 --warmup-s 40 --measure-s 120 $(ARGS)

# Disaggregated prefill/decode (~25 min): 4 simulated H200 workers, long inputs;
# bench/results/pd.json (the issue's rows) and pd-sweep.json (the full report).
bench-pd: setup
	cargo build -q --release -p kvgate -p kvgate-bench
	cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
	set -a; . .tools/env; set +a; target/release/kvgate-bench pd $(ARGS)

bench-pd-heavy: setup
	cargo build -q --release -p kvgate -p kvgate-bench
	cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
	set -a; . .tools/env; set +a; target/release/kvgate-bench pd --preset vllm-v1 --documents 0 --levels 20,40 --drain-s 120 --out bench/results/pd-cold-vllm-v1.json $(ARGS)

# The request-level workloads (~35 min): workato-longprefix, prefix-groups, mooncake.
bench-workloads: setup
	cargo build -q --release -p kvgate -p kvgate-bench
	cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
	set -a; . .tools/env; set +a; target/release/kvgate-bench workato --measure-s 120 && \
	  target/release/kvgate-bench groups --measure-s 180 && target/release/kvgate-bench mooncake --measure-s 120

# The live dashboard (Ctrl-C stops it and every stack it started).
dashboard: setup
	cargo build -q --release -p kvgate -p kvgate-bench
	cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm
	set -a; . .tools/env; set +a; target/release/kvgate-bench dashboard $(ARGS)

# Reports (tables, charts, HTML) of every committed sweep, from its JSON.
report:
	cargo build -q --release -p kvgate-bench
	target/release/kvgate-bench report $(wildcard $(addprefix bench/results/,doks-multiturn.json workato-longprefix.json prefix-groups.json mooncake.json))

lint: setup
	@scripts/test.sh --lint-only

wasm: setup
	cargo build --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm

proto:
	cargo run -q -p kvgate-protocol-codegen

proto-check:
	cargo run -q -p kvgate-protocol-codegen -- --check

fuzz:
	@scripts/fuzz.sh $(or $(FUZZ_SECS),30)

wasm-profile: setup
	@scripts/wasm-profile.sh

# Dynamo's crate lives in its own workspace (bench/index-vs-dynamo) so that it
# never enters the default build; it shares target/.
bench-index:
	cd bench/index-vs-dynamo && CARGO_TARGET_DIR=$(CURDIR)/target cargo build --release -q
	target/release/kvgate-bench-index --trace $(or $(KVGATE_SHARED_DIR),../shared)/traces/mooncake/conversation_trace.jsonl \
	    --out bench/results/index-vs-dynamo.json $(BENCH_ARGS)

bench-relay: setup
	set -a; . .tools/env; set +a; cargo bench -p kvgate-relay --bench throughput

bench-sim: setup
	set -a; . .tools/env; set +a; cargo bench -p kvgate-sim --bench scale

bench-cp: setup
	set -a; . .tools/env; set +a; cargo bench -p kvgate-server --bench control_plane

bench-scale: setup
	cargo build --release -q -p kvgate
	set -a; . .tools/env; set +a; cargo bench -p kvgate-server --bench scale -- $(BENCH_ARGS)

bench-gateway: setup
	cargo build --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm --quiet
	@# Build first and let the build's disk writes settle: a run started
	@# right after compiling measured +0.39 instead of +0.28 ms at 8K.
	set -a; . .tools/env; set +a; cargo bench -p kvgate --bench gateway --no-run --quiet && sync && sleep 5 && \
		cargo bench -p kvgate --bench gateway

bench-routing:
	cargo bench -p kvgate-scheduler --bench routing -- --warm-up-time 1 --measurement-time 2
	scripts/collect-criterion.sh

clean-tools:
	rm -rf .tools
