#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs the Python tree and the anvil node (npm),
# then runs every test, the chain tests a second time against a real anvil node.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
if [ ! -x node_modules/.bin/anvil ]; then
  # --ignore-scripts: the package's postinstall only re-links the binary the platform package already ships.
  npm install --no-audit --no-fund --ignore-scripts --silent
fi
export PATH="$PWD/node_modules/.bin:$PATH"
.venv/bin/ruff check .
.venv/bin/python scripts/gen_proto.py --check
.venv/bin/python scripts/build_contracts.py --check
.venv/bin/python -m pytest "$@"
