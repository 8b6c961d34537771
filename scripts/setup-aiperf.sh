#!/usr/bin/env bash
# Installs aiperf 0.13.0 (NVIDIA's benchmark client, PyPI), the benchmark's
# second client (issue #23), idempotently into the project's ignored folder:
#
#   .tools/aiperf/    Python venv with aiperf==0.13.0 and its dependencies
#                     (~1 GB; transformers without PyTorch, for the tokenizer)
#
# aiperf reads the tokenizer from the local directory scripts/setup.sh
# prepares (.tools/models/deepseek-v3); nothing is fetched from a model hub.
# A second run checks the stamp and does nothing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.tools/aiperf"
want="aiperf==0.13.0"
stamp="$venv/.kvgate-requirements"
py=${KVGATE_PYTHON311:-python3}
"$py" -c 'import sys; assert sys.version_info[:2] >= (3, 10)' 2>/dev/null ||
    { echo "setup-aiperf: $py is older than Python 3.10 (set KVGATE_PYTHON311)" >&2; exit 1; }

if [ ! -x "$venv/bin/aiperf" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup-aiperf: creating $venv and installing $want from PyPI (~1 GB)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$want"
    "$venv/bin/aiperf" --version >/dev/null 2>&1 || "$venv/bin/python" -c 'import aiperf' ||
        { echo "setup-aiperf: aiperf installed but does not start" >&2; exit 1; }
    echo "$want" > "$stamp"
fi
