#!/usr/bin/env bash
# Run the test suite; a run that collects no tests (pytest exit code 5) is a failure, not a pass.
#
# The tests run in AGENTICSTATE_TEST_WORKERS processes (pytest-xdist; default 2, 0 runs them
# in this one): most of the suite waits on fsyncs, subprocesses and servers, so on 2 cores
# workers overlap those waits. Each test file runs whole in one worker
# (--dist loadfile), so a module's fixtures (a private server, a browser, a docs build) start
# once, as in a run without workers; each worker starts its own session servers on free
# ports in its own temporary directory (tests/conftest.py).
set -uo pipefail
python="${1:-python}"
shift || true
workers="${AGENTICSTATE_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != "0" ]; then
  parallel=(-n "$workers" --dist loadfile)
fi
# The slowest tests are listed at the end, so the suite's time stays visible in every run.
"$python" -m pytest "${parallel[@]}" --durations=30 "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing the run" >&2
  exit 1
fi
exit "$status"
