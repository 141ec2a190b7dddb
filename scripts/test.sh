#!/usr/bin/env bash
# The test suite on a fresh clone: sets up what it needs, then runs pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k topology -x`.
# `bash scripts/test.sh --quick` runs the quick tier (the tests marked `quick`: every module's
# single-process tests and one multi-rank launch per engine; at most 3 minutes here) for
# iterating; CI and the README's test command run everything.
# FASTPAR_TEST_WORKERS=N runs N pytest-xdist workers, one test module each at a time
# (--dist loadgroup, a group per module, tests/conftest.py). Not the default: on 2 cores the
# suite is CPU-bound and two workers took as long as one (650-715 s against 657-719 s).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ "${1:-}" = "--quick" ]; then
  shift
  set -- -m quick "$@"
fi
workers=${FASTPAR_TEST_WORKERS:-0}
if [ "$workers" = "0" ] || [ "$workers" = "1" ]; then
  exec python -m pytest "$@"
fi
exec python -m pytest -n "$workers" --dist loadgroup --no-loadscope-reorder "$@"
