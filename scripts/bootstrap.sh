#!/usr/bin/env bash
# Installs everything the project needs into ./.venv (Python 3.11+), pinned by constraints.txt.
# Idempotent: a second run only checks. torch resolves to the CPU wheel pinned in constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "gonka-node needs Python >= 3.11")'
  "$PY" -m venv .venv
fi
stamp=.venv/.gonka-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
  # The machine's pip config lists extra local indexes; their "Location ... is ignored" notes are noise.
  .venv/bin/python -m pip install --quiet -c constraints.txt -e '.[dev]' 2> >(grep -v '^WARNING: Location' >&2)
  echo "$want" >"$stamp"
fi
