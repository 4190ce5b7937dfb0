#!/usr/bin/env bash
# Run the test suite; a run that collects no tests (pytest exit code 5) is a failure, not a pass.
set -uo pipefail
python="${1:-python}"
shift || true
# The slowest tests are listed at the end, so the suite's time stays visible in every run.
"$python" -m pytest --durations=30 "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing the run" >&2
  exit 1
fi
exit "$status"
