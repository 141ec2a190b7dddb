#!/usr/bin/env bash
# The test suite on a fresh clone: sets up what it needs, then runs pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k topology -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest "$@"
