#!/usr/bin/env bash
# Measures the `wasm` build profile's choices: builds the protocol crate's
# wasm_probe module (filter-side hot paths: block hashing of a 100K-token
# prompt, segment hashing and PickRequest encoding of a 400 KB body) under
# each variant, and records the module size and the median time per call in
# wasmtime, all variants interleaved in one process. Writes bench/results/wasm-profile.json and prints a table.
# Speeds are ratios within one run: Envoy runs V8, not wasmtime, so read the
# absolute times as indicative only.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

venv="$root/.tools/venv-bench"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import wasmtime' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "wasmtime==50.0.1"
fi

# name | opt-level | lto | codegen-units | panic | simd128
# (simd128 comes from .cargo/config.toml; "off" overrides those rustflags)
variants=(
    "chosen:2:fat:1:abort:on"
    "no-simd:2:fat:1:abort:off"
    "opt-3:3:fat:1:abort:on"
    "opt-s:s:fat:1:abort:on"
    "opt-z:z:fat:1:abort:on"
    "no-lto:3:false:16:abort:on"
    "unwind:3:fat:1:unwind:on"
)
out="$root/bench/results/wasm-profile.json"
mods="$root/target/wasm-profile"
mkdir -p "$mods"
args=()
meta="[]"
for v in "${variants[@]}"; do
    IFS=: read -r name opt lto cgu panic simd <<<"$v"
    flags="-C target-feature=+simd128"
    [ "$simd" = off ] && flags="-C target-feature=-simd128"
    CARGO_TARGET_WASM32_WASIP1_RUSTFLAGS="$flags" CARGO_PROFILE_WASM_OPT_LEVEL=$opt CARGO_PROFILE_WASM_LTO=$lto CARGO_PROFILE_WASM_CODEGEN_UNITS=$cgu \
    CARGO_PROFILE_WASM_PANIC=$panic \
        cargo build -q --profile wasm --target wasm32-wasip1 -p kvgate-wasm-probe
    cp "$root/target/wasm32-wasip1/wasm/kvgate_wasm_probe.wasm" "$mods/$name.wasm"
    args+=("$name=$mods/$name.wasm")
    meta=$(jq -c --arg n "$name" --arg o "$opt" --arg l "$lto" --argjson c "$cgu" --arg p "$panic" --arg simd "$simd" \
        --argjson s "$(stat -c %s "$mods/$name.wasm")" \
        '. + [{variant: $n, opt_level: $o, lto: $l, codegen_units: $c, panic: $p, simd128: $simd, size_bytes: $s}]' <<<"$meta")
done
timing=$("$venv/bin/python" scripts/wasm_profile.py "${args[@]}")
tmp=$(mktemp)
jq -c --argjson t "$timing" 'map(. + {timing: $t[.variant]})' <<<"$meta" > "$tmp"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
machine="$(uname -m) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
jq --arg commit "$commit" --arg machine "$machine" --arg runtime "wasmtime $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("wasmtime"))')" \
    '{variants: ., commit: $commit, machine: $machine, runtime: $runtime,
      inputs: "block hash: 100,000 tokens, block size 32; segment hash and PickRequest encode: 400,000 bytes in 40 messages"}' \
    "$tmp" > "$out"
rm -f "$tmp"
jq -r '.variants as $v | ($v[0]) as $c |
  ["variant","opt","lto","cgu","panic","simd128","size KB","size/chosen","block hash us","ratio","segment hash us","ratio","pick encode us","ratio"],
  ($v[] | [.variant, .opt_level, .lto, (.codegen_units|tostring), .panic, .simd128, ((.size_bytes/1024*10|round)/10|tostring),
     ((.size_bytes/$c.size_bytes*100|round)/100|tostring),
     (.timing.block_hash_100k_tokens_us|tostring), ((.timing.block_hash_100k_tokens_us/$c.timing.block_hash_100k_tokens_us*100|round)/100|tostring),
     (.timing.segment_hash_400kb_us|tostring), ((.timing.segment_hash_400kb_us/$c.timing.segment_hash_400kb_us*100|round)/100|tostring),
     (.timing.pick_encode_400kb_us|tostring), ((.timing.pick_encode_400kb_us/$c.timing.pick_encode_400kb_us*100|round)/100|tostring)])
  | @tsv' "$out" | column -t -s $'\t'
echo "wrote ${out#"$root"/} (commit $commit)"
