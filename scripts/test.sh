#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs the Python tree and the anvil node (npm),
# and Debian's chromium + chromium-driver when missing (the explorer's browser test), then runs every
# test, the chain tests a second time against a real anvil node.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
if [ ! -x node_modules/.bin/anvil ]; then
  # --ignore-scripts: the package's postinstall only re-links the binary the platform package already ships.
  npm install --no-audit --no-fund --ignore-scripts --silent
fi
export PATH="$PWD/node_modules/.bin:$PATH"
# The explorer's browser test drives Debian's headless Chromium through its WebDriver; install both
# when missing (as root: CI and fresh machines), quietly, and only then.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
  else
    echo "scripts/test.sh: chromium and chromium-driver are missing and this is not root: the explorer's browser test skips" >&2
  fi
fi
.venv/bin/ruff check .
.venv/bin/mypy  # pyproject.toml [tool.mypy]: training, chain, gonka_node, scripts
.venv/bin/python scripts/gen_proto.py --check
.venv/bin/python scripts/build_contracts.py --check
# Three worker processes (pytest-xdist) on the two cores, each taking whole files, so that a file's
# shared fixtures (a deployed chain, a trained model) are built once: about half of the suite's wall
# time in one process was waiting (process start-ups, sign-in and voting windows, round deadlines),
# which the other workers fill (docs/benchmarks.md "The test suite"). xdist hands out the files with
# the most tests first, which spreads the slow end-to-end files (one to four tests each) over the run
# (a run that started them all at once failed two tests: docs/benchmarks.md). `-n 0` after this
# script's name runs it in one process.
.venv/bin/python -m pytest -n "${GONKA_TEST_WORKERS:-3}" --dist loadfile "$@"
