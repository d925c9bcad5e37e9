#!/usr/bin/env bash
# Mutation testing (mutmut) of the modules where a silent bug costs money or trust, each against its
# fast unit tests, once the project's mypy has refused the mutants it can (type_check_command below).
# Not part of CI: 85 CPU-minutes for every part (stop 29's whole run on the idle two-core machine:
# 45 min 13 s of wall time; the round engine 33.1 of those CPU-minutes). Results and timings:
# docs/benchmarks.md "Mutation testing".
#
#   bash scripts/mutation.sh                 # every module below
#   bash scripts/mutation.sh codecs follow   # some of them
#   MUTANTS='*ǁauthenticate__* *ǁsubmit__*' bash scripts/mutation.sh rounds   # some functions of one module
#
# mutmut lives in its own throwaway venv (.mutation/venv, pinned below), so the project's pinned tree
# is untouched; that venv sees the project's packages (torch, web3, ...) through a .pth file, but not
# the project's editable install, so the tests import the mutated copy that mutmut writes. Each module
# runs in its own scratch copy of the tree (.mutation/runs/NAME), $MUTATION_JOBS (default 2) worker processes, one torch
# thread; $MUTATION_LANES (default 2) parts run at once (lane() below).
# Per module it prints the score (killed, timeouts counted as killed, over all mutants) and the
# wall time, and writes .mutation/report/NAME.txt: the summary and the diff of every surviving mutant.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${MUTATION_DIR:-$ROOT/.mutation}
MUTMUT=mutmut==3.8.1
# Worker processes per module (mutmut --max-children). Two: on a machine shared with other jobs, a second
# worker takes its share of the cores (measured: docs/benchmarks.md); one torch thread each.
JOBS=${MUTATION_JOBS:-2}
# Parts run at once (see lane() below).
LANES=${MUTATION_LANES:-2}

# name | module | its fast unit tests | mutants to run (fnmatch globs of mutmut's names; empty: all)
MODULES=(
  # The aggregator parts first: the slowest, the most often re-run.
  # The round engine against its server-less unit tests (engine_kit.py: a real store and the embedded
  # chain, deployed once in the fork server and inherited by every mutant's run): every function but a
  # shard's close, which only the two-shard rounds reach (its own part, so that the engine's other
  # mutants do not also run those). Acceptance (acceptance.py) against the acceptance tests only.
  "rounds-engine|gonka_node/aggregator/rounds.py|tests/gonka_node/aggregator/test_engine_accept.py tests/gonka_node/aggregator/test_engine_close.py tests/gonka_node/aggregator/test_engine_lifecycle.py tests/gonka_node/aggregator/test_deferred_checks.py|*ǁtick__mutmut_* *ǁclose__mutmut_* *ǁ_close_sync__mutmut_* *ǁ_own_vote__mutmut_* *ǁ_everyone_submitted__mutmut_* *ǁ_signin_closed__mutmut_* *ǁ_revealed_seed__mutmut_* *ǁ_note_close_failure__mutmut_* *ǁ_report_closed__mutmut_* *ǁ_closing_inputs__mutmut_* *ǁ_prev_outer_state__mutmut_* *ǁ_prev_residual__mutmut_* *ǁ_open_next__mutmut_* *ǁreward_tree__mutmut_* *ǁrun__mutmut_* *.x__tx_bytes__mutmut_* *ǁ_eager_bases__mutmut_* *ǁ__init____mutmut_* *ǁstart__mutmut_* *ǁ_resume_or_open__mutmut_* *ǁbase_path__mutmut_* *ǁglobal_path__mutmut_* *ǁglobal_sha256__mutmut_* *ǁ_open_after__mutmut_* *ǁ_commit__mutmut_* *ǁ_activate__mutmut_* *ǁ_warm_members__mutmut_*"
  # Finalizing, with the object-store publisher that only the publishing tests configure (a real S3
  # server: its own part, so that the engine's other survivors do not start one too).
  "rounds-publish|gonka_node/aggregator/rounds.py|tests/gonka_node/aggregator/test_engine_accept.py tests/gonka_node/aggregator/test_engine_close.py tests/gonka_node/aggregator/test_engine_lifecycle.py tests/gonka_node/aggregator/test_deferred_checks.py tests/gonka_node/aggregator/test_publish.py|*ǁ_finish__mutmut_*"
  # Where the close goes sharded or not, and a shard's close of its fragment: only the two-shard rounds
  # (engine_kit, in-process, beside one aggregator's close of the same round) reach both branches.
  # (test_shard_replay: the verifier's replay, the only close of a shard with a model; test_openings: the
  # unsharded close of a top-k round, the only one handed openings.)
  "rounds-shard|gonka_node/aggregator/rounds.py|tests/gonka_node/aggregator/test_shard_round.py tests/gonka_node/aggregator/test_shard_replay.py tests/gonka_node/aggregator/test_openings.py|*ǁ_compute__mutmut_* *ǁ_close_fragment__mutmut_*"
  # close.py: compute_outcome and its checks on constructed rounds (no chain), with a micro model for
  # the replay, the scores and the held-out losses (a mutant's fastest tests run first, so only one that
  # the model-free tests miss pays for the micro-model closes), and the top-k rounds' closes, the only
  # ones that judge a host on its opened residual (test_openings).
  "close|gonka_node/aggregator/close.py|tests/gonka_node/aggregator/test_close_units.py tests/gonka_node/aggregator/test_units.py tests/gonka_node/aggregator/test_close_model.py tests/gonka_node/aggregator/test_openings.py|"
  # The close's wait for the top-k openings (only a challenged top-k round reaches it).
  "rounds-openings|gonka_node/aggregator/rounds.py|tests/gonka_node/aggregator/test_openings.py tests/gonka_node/aggregator/test_open_residual.py|*ǁ_await_openings__mutmut_* *ǁ_members_now__mutmut_*"
  "rounds|gonka_node/aggregator/acceptance.py|tests/gonka_node/aggregator/test_engine_accept.py tests/gonka_node/aggregator/test_deferred_checks.py|"
  # The epoch context's codec per round and the log's clock (engine_types.py; the clock's own test is
  # among the close tests).
  "engine-types|gonka_node/aggregator/engine_types.py|tests/gonka_node/aggregator/test_engine_accept.py tests/gonka_node/aggregator/test_engine_lifecycle.py tests/gonka_node/aggregator/test_engine_close.py|*ǁcodec_for__mutmut_* *.x_clock_text__mutmut_*"
  # The checks a receipt no longer waits for (decode, shape, finiteness, norm, sketch), drained by a pool.
  "deferred|gonka_node/aggregator/deferred.py|tests/gonka_node/aggregator/test_deferred_checks.py tests/gonka_node/aggregator/test_engine_accept.py|"
  "replay|gonka_node/aggregator/replay.py|tests/gonka_node/aggregator/test_replay_verdict.py tests/gonka_node/aggregator/test_replay_pick.py tests/gonka_node/aggregator/test_units.py tests/gonka_node/aggregator/test_close_model.py|"
  # The top-k replay: who is challenged and on which chunks, the verdict on an opening, and its pieces
  # (the residual's commitment, the payload check, the sample; the signed opening record).
  "challenges|gonka_node/aggregator/challenges.py|tests/gonka_node/aggregator/test_openings.py tests/gonka_node/aggregator/test_open_residual.py tests/gonka_node/test_residual_sample.py|"
  "opened|gonka_node/aggregator/opened_replay.py|tests/gonka_node/aggregator/test_openings.py|"
  "residual|training/residual_commit.py|tests/training/test_residual_commit.py tests/gonka_node/test_opening.py|"
  "diloco|training/diloco.py|tests/training/test_diloco.py tests/training/test_diloco_edges.py|"
  "codecs|training/codec*.py|tests/training/test_codecs.py tests/training/test_fuzz_codecs.py tests/training/test_codec_contract.py tests/training/test_codec_refusals.py tests/training/test_residual_commit.py|"
  "envelope|gonka_node/core/envelope.py|tests/gonka_node/test_envelope.py tests/gonka_node/test_fuzz_envelope.py tests/gonka_node/test_envelope_edges.py|"
  "merkle|chain/merkle.py|tests/chain/test_merkle.py tests/chain/test_merkle_refusals.py|"
  "follow|gonka_node/host/follow.py|tests/gonka_node/host/test_follow.py|"
)

setup_venv() {
  bash scripts/bootstrap.sh
  local venv=$WORK/venv
  if [ ! -x "$venv/bin/mutmut" ]; then
    rm -rf "$venv"
    .venv/bin/python -m venv "$venv"
    # -c: the packages both trees share (pytest, rich, ...) stay at the project's pinned versions.
    "$venv/bin/python" -m pip install --quiet -c constraints.txt "$MUTMUT" 2> >(grep -v '^WARNING: Location' >&2)
  fi
  local site project_site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  project_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # A plain path line: the project's site-packages come after mutmut's own, and its .pth files (the
  # editable install's import hook among them) are not run.
  echo "$project_site" >"$site/gonka-project.pth"
  # The project's mypy over the clean tree, into a cache every part's type check starts from (each its
  # own copy: two lanes check different mutated modules at once). Seconds when the tree's own cache is
  # warm, a minute or two from nothing; it also fails the run early on a tree CI's mypy would refuse.
  rm -rf "$WORK/mypy-cache"
  if [ -d .mypy_cache ]; then cp -r .mypy_cache "$WORK/mypy-cache"; fi
  .venv/bin/mypy --cache-dir "$WORK/mypy-cache"
}

prepare_run() {  # name module tests
  local dir=$WORK/runs/$1
  rm -rf "$dir"
  mkdir -p "$dir"
  tar -C "$ROOT" --exclude=__pycache__ --exclude=.hypothesis -cf - training chain gonka_node proto tests pyproject.toml \
    | tar -C "$dir" -xf -
  cp -r "$WORK/mypy-cache" "$dir/.mypy_cache"
  local mutated
  mutated=$(cd "$dir" && shopt -s failglob && echo $2)  # a glob (training/codec*.py): the files, as mutants/ holds them
  {
    echo "[mutmut]"
    # Every package is copied into mutants/ (the tests import across them); only `only_mutate` changes.
    echo "source_paths ="
    for p in training chain gonka_node proto; do echo "    $p"; done
    echo "only_mutate = $2"
    echo "pytest_add_cli_args_test_selection ="
    for t in $3; do echo "    $t"; done
    # Calls to the module's logger are not mutated: they write the operator's log and do nothing else (no
    # argument of ours has a side effect), so each of their ~8 mutants survived every covering test, and
    # in the round engine those were a fifth of the mutants and most of the time.
    echo "do_not_mutate_patterns ="
    echo '    ^\s*log\.(debug|info|warning|error|exception)\('
    # grpc and torch are not fork-safe once used: fork each mutant from a server that only imported them.
    echo "process_isolation = forkserver"
    # A mutant that hangs a test (a server that never answers) fails it after 60 s instead of 300 s.
    # The last pytest run's JUnit report: what failed when mutmut says only "Failed to run clean test".
    # No unraisable-exception plugin: at the end of every run it calls gc.collect() twice over the whole heap
    # (torch, web3, the chain): ~1 s of each mutant's ~2 s of pytest overhead (measured in a forked run).
    # (No xdist: the project's pytest-xdist plugin is seen through the .pth line, and each run is one process.)
    printf 'pytest_add_cli_args =\n    --hypothesis-profile=mutation\n    --timeout=60\n    -p\n    no:unraisableexception\n    -p\n    no:xdist\n    --junitxml=%s\n' "$dir/last-run.xml"
    echo "timeout_multiplier = 5.0"
    # A mutant the project's mypy refuses is "caught by type check" and its tests are not run: CI runs
    # the same mypy, so that bug could never land. scripts/mutation_types.py drops the errors of the
    # mutated file's layout (mutmut runs it in mutants/, hence the absolute paths but for the files).
    echo "type_check_command ="
    for w in "$WORK/venv/bin/python" "$ROOT/scripts/mutation_types.py" mypy --config-file "$dir/pyproject.toml" \
      --cache-dir "$dir/.mypy_cache" $mutated; do echo "    $w"; done
  } >"$dir/setup.cfg"
  # (pyproject.toml has no [tool.mutmut] section, so mutmut reads setup.cfg.) In the scratch copy only:
  # a hypothesis profile without shrinking, since the first failing example already kills the mutant.
  cat >>"$dir/tests/conftest.py" <<'PY'


from hypothesis import Phase, settings as _mutation_settings  # noqa: E402  (added by scripts/mutation.sh)

_mutation_settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate])


import gc as _mutation_gc  # noqa: E402  (added by scripts/mutation.sh)
import json as _mutation_json  # noqa: E402
import os as _mutation_os  # noqa: E402

# The tests' durations that mutmut measured (read when the fork server collects: every mutant inherits it).
_MUTATION_DURATIONS: dict[str, float] = (
    _mutation_json.load(open("mutmut-stats.json"))["duration_by_test"] if _mutation_os.path.exists("mutmut-stats.json") else {}
)


def pytest_collection_finish(session: object) -> None:  # (added by scripts/mutation.sh)
    # The fork server collects once, then forks every mutant's run: objects frozen here are never scanned
    # by a child's garbage collections (nor written to, so their pages stay shared instead of copied).
    _mutation_gc.freeze()


def pytest_collection_modifyitems(items: list) -> None:  # (added by scripts/mutation.sh)
    # A mutant's tests fastest first (its run stops at the first failure): mutmut's fork server hands
    # them over in set order, so a mutant that a 0.1 s test kills could otherwise first run 5 s ones.
    if _mutation_os.environ.get("MUTANT_UNDER_TEST", "") not in ("", "stats", "fail"):
        items.sort(key=lambda item: _MUTATION_DURATIONS.get(item.nodeid, float("inf")))
PY
  # The fast aggregator tests share one embedded chain per process (engine_kit.shared_world): build it
  # while the fork server collects, so that each mutant's forked run starts with it deployed (~2 s less).
  cat >>"$dir/tests/gonka_node/aggregator/conftest.py" <<'PY'


import engine_kit as _engine_kit  # noqa: E402  (added by scripts/mutation.sh)

_engine_kit.shared_world()
PY
  echo "$dir"
}

run_module() {  # name module tests globs
  local name=$1 module=$2 tests=$3 globs=$4 dir start end
  dir=$(prepare_run "$name" "$module" "$tests")
  echo "== $name: $module against $tests"
  start=$(date +%s)
  cut -d' ' -f1-3 /proc/loadavg >"$WORK/report/$name.load"
  # shellcheck disable=SC2086  # globs are mutmut name patterns, passed as words
  (cd "$dir" && OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 /usr/bin/time -o "$WORK/report/$name.cpu" -f '%U %S' \
    "$WORK/venv/bin/mutmut" run --max-children "$JOBS" $globs >"$WORK/report/$name.log" 2>&1) \
    || { tail -c 4000 "$WORK/report/$name.log"; failures "$dir/last-run.xml"; return 1; }
  end=$(date +%s)
  cut -d' ' -f1-3 /proc/loadavg >>"$WORK/report/$name.load"
  report "$name" "$module" "$dir" "$globs" $((end - start))
  rm -rf "$dir/.mypy_cache"  # (~130 MB a part)
}

failures() {  # junit.xml: the failed tests of the last pytest run, with the first lines of each failure
  [ -f "$1" ] && "$WORK/venv/bin/python" - "$1" <<'PY'
import sys
import xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).iter("testcase"):
    for bad in [*case.iter("failure"), *case.iter("error")]:
        print(f"FAILED {case.get('classname')}::{case.get('name')}: {bad.get('message', '')[:300]}")
        print("\n".join((bad.text or "").splitlines()[-15:]))
PY
}

report() {  # name module dir globs seconds
  local name=$1 module=$2 dir=$3 globs=$4 secs=$5 out=$WORK/report/$1.txt
  (cd "$dir" && "$WORK/venv/bin/mutmut" results --all true) >"$WORK/report/$name.results"
  "$WORK/venv/bin/python" - "$WORK/report/$name.results" "$name" "$module" "$secs" "$globs" "$WORK/report/$name" >"$out" <<'PY'
import fnmatch, sys
from collections import Counter
path, name, module, secs, globs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5].split()
cpu = sum(float(x) for x in open(sys.argv[6] + ".cpu").read().split()[-2:])  # user + sys, all processes
load = " → ".join(line.split()[0] for line in open(sys.argv[6] + ".load"))
rows = [line.strip().rsplit(": ", 1) for line in open(path, encoding="utf-8") if ": " in line]
rows = [(m, s) for m, s in rows if not globs or any(fnmatch.fnmatch(m, g) for g in globs)]
count = Counter(s for _, s in rows)
typed = count["caught by type check"]
caught = ("killed", "timeout", "caught by type check")
detected = sum(count[s] for s in caught)
score = 100.0 * detected / len(rows) if rows else 0.0
# The tests' own score: over the mutants mypy let through, the share the tests detected.
tested = len(rows) - typed
by_tests = 100.0 * (detected - typed) / tested if tested else 0.0
print(f"{name}: {module}: {len(rows)} mutants, {typed} caught by mypy, {count['killed']} killed, "
      f"{count['timeout']} timeouts, {len(rows) - detected} not detected "
      f"({dict((k, v) for k, v in count.items() if k not in caught)}); score {score:.1f}% "
      f"(tests: {by_tests:.1f}% of {tested}); {secs // 60} min {secs % 60} s (CPU {cpu / 60:.1f} min, load {load})")
for m, s in rows:
    if s not in caught:
        print(f"SURVIVOR {s}: {m}")
PY
  head -1 "$out"
  # Diffs of the survivors only (a module's "no tests" mutants are listed by name above).
  # (`|| true`: a part without survivors is a result, not a failure of the pipeline under pipefail.)
  { grep '^SURVIVOR survived' "$out" || true; } | while read -r _ _ mutant; do
    # </dev/null: `mutmut show` must not read the survivor list this loop reads.
    (cd "$dir" && "$WORK/venv/bin/mutmut" show "$mutant" </dev/null) >>"$out" 2>&1 || true
  done
}

# The parts run in $LANES lanes, each taking the next part of the list when its last one ends (the slowest
# parts are listed first, so the lanes end together): a part's serial stretches (its clean run, the stats
# run, the fork server's imports, the survivors' `mutmut show`) and its workers' waits (a mutant's test
# timing out) leave a core idle that the other lane's workers then use.
next_part() {  # queue-file: prints the index of the next part no lane has taken
  (
    flock 9
    local n
    n=$(cat "$1")
    echo $((n + 1)) >"$1"
    echo "$n"
  ) 9>"$1.lock"
}

lane() {  # queue-file parts...: runs parts off the shared queue until none is left
  local queue=$1 i name module tests globs
  shift
  local parts=("$@")
  while i=$(next_part "$queue") && [ "$i" -lt ${#parts[@]} ]; do
    IFS='|' read -r name module tests globs <<<"${parts[$i]}"
    # A part that fails (its clean run did: a flaky test on a loaded machine) does not stop the others.
    run_module "$name" "$module" "$tests" "${MUTANTS:-$globs}" || echo "$name" >>"$WORK/report/failed"
  done
}

main() {
  mkdir -p "$WORK/report" "$WORK/runs"
  setup_venv
  local want=("$@") line name parts=() queue=$WORK/runs/queue
  for line in "${MODULES[@]}"; do
    name=${line%%|*}
    if [ ${#want[@]} -eq 0 ] || [[ " ${want[*]} " =~ " $name " ]]; then parts+=("$line"); fi
  done
  echo 0 >"$queue"
  rm -f "$WORK/report/failed"
  for ((l = 0; l < LANES; l++)); do lane "$queue" "${parts[@]}" & done
  wait
  echo "== summary"
  for line in "${parts[@]}"; do
    name=${line%%|*}
    [ -f "$WORK/report/$name.txt" ] && head -1 "$WORK/report/$name.txt"
  done
  echo "(reports with the surviving mutants' diffs: $WORK/report/)"
  if [ -s "$WORK/report/failed" ]; then echo "== failed (no score): $(tr '\n' ' ' <"$WORK/report/failed")"; return 1; fi
}

main "$@"
