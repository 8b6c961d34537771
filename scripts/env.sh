# Sourced by the scripts that run kvgate's tools: moves to the repository root
# ($root) and exports what scripts/setup.sh installed (.tools/env).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
set -a
# shellcheck source=/dev/null
source "$root/.tools/env"
set +a
