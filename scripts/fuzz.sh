#!/usr/bin/env bash
# Short runs of every cargo-fuzz target (nightly toolchain, installed by rustup
# on these machines; cargo-fuzz is installed into .tools/cargo on first use).
# Usage: scripts/fuzz.sh [seconds per target, default 30]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-30}
if [ ! -x "$root/.tools/cargo/bin/cargo-fuzz" ]; then
    echo "fuzz: installing cargo-fuzz into .tools/cargo"
    cargo install cargo-fuzz --locked --root "$root/.tools/cargo"
fi
export PATH="$root/.tools/cargo/bin:$PATH"
for dir in $(find "$root" -path "$root/target" -prune -o -path '*/fuzz/Cargo.toml' -print | xargs -n1 dirname | sort); do
    crate=$(dirname "$dir")
    for target in $(cd "$crate" && cargo +nightly fuzz list); do
        echo "== fuzz ${crate#"$root"/} $target (${secs}s)"
        log="$root/target/fuzz/$target.log"
        mkdir -p "$(dirname "$log")"
        if ! (cd "$crate" && cargo +nightly fuzz run "$target" --target-dir "$root/target/fuzz" -- \
            -max_total_time="$secs" -max_len=4096 >"$log" 2>&1); then
            grep -E "panicked|SUMMARY|Test unit written" -A3 "$log" >&2 || tail -20 "$log" >&2
            echo "fuzz: $target found a failure (log: $log)" >&2
            exit 1
        fi
        grep -E "^Done [0-9]+ runs" "$log" || tail -1 "$log"
    done
done
