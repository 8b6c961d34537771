#!/usr/bin/env bash
# Everything `make test` runs, in order: formatting and lints, the Wasm build
# of the filter-side crates, then every test (unit, property, vector, drift,
# and end-to-end with real Envoy and nats-server) under cargo-nextest, whose
# summary is the last thing printed. Usage: scripts/test.sh [--lint-only]
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "$0")/env.sh"
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

step() { echo; echo "== $*"; }

step "rustfmt"
cargo fmt --all -- --check

step "clippy (native, all targets)"
cargo clippy --workspace --all-targets --quiet -- -D warnings

step "clippy (wasm32-wasip1, filter-side crates)"
cargo clippy --target wasm32-wasip1 -p kvgate-protocol --quiet -- -D warnings

[ "${1:-}" = "--lint-only" ] && exit 0

step "build for wasm32-wasip1 (release)"
cargo build --release --target wasm32-wasip1 -p kvgate-protocol --quiet

step "tests"
profile=default
[ -n "${CI:-}" ] && profile=ci
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --profile "$profile" --no-fail-fast
else
    echo "(cargo-nextest not installed: using cargo test)"
    cargo test --workspace --no-fail-fast
fi
