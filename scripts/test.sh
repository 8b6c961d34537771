#!/usr/bin/env bash
# Everything `make test` runs, in order: formatting and lints, the Wasm build
# of the filter-side crates, a check that every fuzz target compiles, then
# every test (unit, property, vector, drift, and end-to-end with real Envoy
# and nats-server) under cargo-nextest, whose summary is the last thing
# printed. Usage: scripts/test.sh [--lint-only]
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
cargo clippy --target wasm32-wasip1 -p kvgate-protocol -p kvgate-filter-core -p kvgate-filter-wasm --quiet -- -D warnings

[ "${1:-}" = "--lint-only" ] && exit 0

step "build the filter for wasm32-wasip1 (profile wasm; the end-to-end tests load it into Envoy)"
cargo build --profile wasm --target wasm32-wasip1 -p kvgate-filter-wasm --quiet
ls -l target/wasm32-wasip1/wasm/kvgate_filter.wasm

step "fuzz targets compile (cargo check on stable; make fuzz runs them)"
# The fuzz crates live outside the workspace (cargo-fuzz's layout), so
# nothing else builds them: a changed API would break them unseen. A crate
# without a lock file starts from the workspace's, so that it resolves the
# same versions.
for manifest in $(find . -path ./target -prune -o -path '*/fuzz/Cargo.toml' -print | sort); do
    dir=$(dirname "$manifest")
    [ -f "$dir/Cargo.lock" ] || cp Cargo.lock "$dir/Cargo.lock"
    echo "$dir"
    cargo check --quiet --manifest-path "$manifest" --bins --target-dir target/fuzz-check
done

step "tests"
profile=default
[ -n "${CI:-}" ] && profile=ci
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --profile "$profile" --no-fail-fast
else
    echo "(cargo-nextest not installed: using cargo test)"
    cargo test --workspace --no-fail-fast
fi
