#!/usr/bin/env bash
# The main job on a fresh clone: sets up what it needs, then runs it on 4 local ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec mpirun -np 4 python -m fastpar info --tp 2 --pp 2 "$@"
