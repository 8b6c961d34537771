#!/usr/bin/env bash
# Installs NVIDIA Dynamo 1.6.1, the benchmark's closest peer (issue #23),
# idempotently into the project's ignored folder .tools/:
#
#   .tools/dynamo/                  Python 3.11 venv: ai-dynamo-runtime 1.6.1 and
#                                   ai-dynamo 1.6.1 (--no-deps, see
#                                   scripts/dynamo/requirements.txt; ~700 MB)
#   .tools/models/dynamo-mocker/    what Dynamo's mocker and frontend read of a
#                                   model: the test tokenizer, the repository's
#                                   chat template and a config.json (no weights)
#
# A second run checks the stamps and does nothing. Runs after scripts/setup.sh
# (the tokenizer).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tools="$root/.tools"
say() { echo "setup-dynamo: $*"; }

req="$root/scripts/dynamo/requirements.txt"
want=$( (cat "$req"; echo "ai-dynamo==1.6.1") | sha256sum | cut -d' ' -f1)
venv="$tools/dynamo"
stamp="$venv/.kvgate-requirements"
py=${KVGATE_PYTHON311:-python3}
"$py" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null ||
    { echo "setup-dynamo: $py is not Python 3.11 (set KVGATE_PYTHON311)" >&2; exit 1; }

if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    say "creating $venv and installing Dynamo 1.6.1 from PyPI (~700 MB)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps ai-dynamo==1.6.1
    "$venv/bin/python" -c 'import dynamo.frontend, dynamo.mocker' ||
        { echo "setup-dynamo: Dynamo installed but does not import" >&2; exit 1; }
    echo "$want" > "$stamp"
fi

tk="$tools/models/deepseek-v3"
template="$root/control-plane/models/deepseek-v3/chat_template.jinja"
model="$tools/models/dynamo-mocker"
[ -f "$tk/tokenizer.json" ] || { echo "setup-dynamo: no tokenizer in $tk (run scripts/setup.sh first)" >&2; exit 1; }
mwant=$(cat "$0" "$tk/tokenizer.json" "$tk/tokenizer_config.json" "$template" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$model/.kvgate-build" 2>/dev/null)" != "$mwant" ]; then
    say "writing $model"
    rm -rf "$model"
    mkdir -p "$model"
    cp "$tk/tokenizer.json" "$tk/tokenizer_config.json" "$model/"
    cp "$template" "$model/chat_template.jinja"
    # The shape of a small Llama; only the context length and the vocabulary
    # matter to the mocker (it has no weights). DeepSeek-V3's context length.
    cat > "$model/config.json" <<'JSON'
{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "hidden_size": 128,
  "intermediate_size": 256,
  "num_attention_heads": 4,
  "num_hidden_layers": 2,
  "num_key_value_heads": 2,
  "head_dim": 32,
  "max_position_embeddings": 163840,
  "vocab_size": 129283,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16"
}
JSON
    echo "$mwant" > "$model/.kvgate-build"
fi
say "ready: $venv, $model"
