# kvgate — the two commands are `make demo` (the main job) and `make test`
# (everything). Both install what they need into .tools/ first (idempotent).
SHELL := /bin/bash
.DEFAULT_GOAL := help
.PHONY: help setup test demo lint wasm proto proto-check fuzz wasm-profile clean-tools

help:
	@echo "make demo   - start the local stack and run the benchmark (main job)"
	@echo "make test   - install tools, lint, build the Wasm target, run all tests"
	@echo "make setup  - install Envoy, nats-server, tokenizer, wasm target into .tools/"
	@echo "make lint   - rustfmt --check and clippy -D warnings (native and wasm32)"
	@echo "make wasm   - build the Wasm-side crates for wasm32-wasip1 (profile wasm)"
	@echo "make proto  - regenerate filter/protocol/src/gen from the .proto files"
	@echo "make fuzz   - run every cargo-fuzz target briefly (FUZZ_SECS=30)"
	@echo "make wasm-profile - measure size/speed of Wasm profile choices"

setup:
	@scripts/setup.sh

test: setup
	@scripts/test.sh

demo: setup
	@scripts/demo.sh

lint: setup
	@scripts/test.sh --lint-only

wasm: setup
	cargo build --profile wasm --target wasm32-wasip1 -p kvgate-protocol

proto:
	cargo run -q -p kvgate-protocol-codegen

proto-check:
	cargo run -q -p kvgate-protocol-codegen -- --check

fuzz:
	@scripts/fuzz.sh $(or $(FUZZ_SECS),30)

wasm-profile: setup
	@scripts/wasm-profile.sh

clean-tools:
	rm -rf .tools
