#!/usr/bin/env bash
# The test suite on a fresh clone: sets up what it needs, then runs pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k topology -x`.
# Two pytest-xdist workers, one test module each at a time (--dist loadfile: a module's rank
# pools and fixtures stay in one process): the suite spends about a quarter of its time waiting
# (timeouts it tests, peers, launches), which the other worker fills. FASTPAR_TEST_WORKERS=0
# runs it in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
workers=${FASTPAR_TEST_WORKERS:-2}
if [ "$workers" = "0" ]; then
  exec python -m pytest "$@"
fi
exec python -m pytest -n "$workers" --dist loadfile "$@"
