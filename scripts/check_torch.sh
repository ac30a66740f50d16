#!/usr/bin/env bash
# The test suite under one torch release, in its own venv:
#   scripts/check_torch.sh VERSION [pytest args]
#   scripts/check_torch.sh 2.11.0              # the non-slow tests (-q -m "not slow")
#   scripts/check_torch.sh 2.11.0 -q -m slow   # any pytest arguments instead
# The venv (TORCH_VENVS/VERSION, default .torch-venvs/VERSION, git-ignored) is made on the first
# run and reused while pyproject.toml is unchanged; the project is installed editable into it.
# Exits with pytest's code: 5 (no test collected) fails like any other non-zero code.
set -euo pipefail

usage() {
  echo "usage: $0 TORCH_VERSION [pytest args]   e.g. $0 2.11.0 -q -m slow" >&2
  exit 2
}
[ $# -ge 1 ] || usage
version=$1
shift
# A pip version (2.11.0, 2.11.0+cpu): anything else is a misplaced pytest argument or a typo.
[[ $version =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?(\+[A-Za-z0-9.]+)?$ ]] || usage
[ $# -gt 0 ] || set -- -q -m "not slow"

cd "$(dirname "$0")/.."
venv=${TORCH_VENVS:-.torch-venvs}/$version
stamp="torch==$version $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ "$(cat "$venv/.installed" 2>/dev/null || true)" != "$stamp" ]; then
  "$venv/bin/python" -m pip install -q "torch==$version" -e ".[dev]"
  echo "$stamp" >"$venv/.installed"
fi
exec "$venv/bin/python" -m pytest "$@"
