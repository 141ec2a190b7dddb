#!/usr/bin/env bash
# A cluster of namespaced hosts on this machine (root): runs a command in host h0 with MPICH's
# Hydra wired to reach the others (HYDRA_LAUNCHER=ssh, HYDRA_LAUNCHER_EXEC, HYDRA_IFACE=eth0),
# then tears everything down. No command: a shell in h0.
#   scripts/cluster.sh --hosts 2 --rate 1gbit -- mpirun -hosts h0,h1 -np 4 -ppn 2 python -m fastpar.train --tp 2 --pp 2
#   scripts/cluster.sh --rate 1gbit --measure      # TCP rate h0 -> h1
# Flags: --hosts N (2), --rate R (tc rate, e.g. 1gbit; default unshaped), --host I (0), --measure.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py=python3
# The harness runs as a file: it imports no torch, so the cluster is up in well under a second.
export PATH="$(dirname "$py"):$PATH" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" "$root/fastpar/testing/cluster.py" "$@"
