#!/usr/bin/env bash
# Collects criterion's estimates (median, ns per iteration) of the routing
# benches into bench/results/routing-criterion.json with commit and machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/target/criterion"
out="$root/bench/results/routing-criterion.json"
rows=$(for group in ingest lookup pick; do
    for dir in "$group"/*/; do
        id=$(basename "$dir")
        [ -f "$dir/new/estimates.json" ] || continue
        tokens=${id%%_tokens*}; workers=${id#*tokens/}; workers=${id##*tokens_}; workers=${workers%%_workers}
        jq -c --arg g "$group" --arg id "$id" --arg t "$tokens" --arg w "$workers" \
            '{bench: $g, case: $id, tokens: ($t | if . == "8k" then 8192 elif . == "100k" then 100000 else . end), workers: ($w|tonumber), median_ns: .median.point_estimate, ci_low_ns: .median.confidence_interval.lower_bound, ci_high_ns: .median.confidence_interval.upper_bound}' \
            "$dir/new/estimates.json"
    done
done | jq -s '.')
commit=$(git -C "$root" rev-parse --short HEAD)
machine="$(uname -m) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
jq -n --argjson rows "$rows" --arg commit "$commit" --arg machine "$machine" \
    '{rows: $rows, block_size: 16, commit: $commit, machine: $machine,
      note: "cargo bench -p kvgate-scheduler --bench routing; ingest = BlockStored of the whole prompt + its BlockRemoved; lookup = find_matches; pick = hashing + find_matches + candidates + kv policy"}' > "$out"
jq -r '.rows[] | [.bench, .case, (.median_ns/1000 | tostring | .[0:8]) + " us"] | @tsv' "$out" | column -t
echo "wrote ${out#"$root"/}"
