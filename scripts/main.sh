#!/usr/bin/env bash
# The main job on a fresh clone: sets up what it needs, then trains the small GPT on 4 local ranks
# (tp 2 x pp 2) on the Python standard library's source, and writes the loss plot.
# Extra arguments go to fastpar.train (e.g. --steps 300, --zero, --save ckpt).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
mkdir -p runs
exec mpirun -np 4 python -m fastpar.train --tp 2 --pp 2 --preset small \
    --metrics runs/main.jsonl --plot runs/main_loss.png "$@"
