#!/usr/bin/env bash
# Idempotent setup of a fresh clone: .venv, torch (CPU wheel unless one is installed), MPI,
# fastpar with its native extension. Re-running is cheap; the extension is rebuilt only when
# csrc/ or setup.py changed. Use a cluster's own MPI: FASTPAR_SYSTEM_MPI=1 (see docs/multi-host.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { pip install -q --disable-pip-version-check "$@"; }
if ! python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch ${FASTPAR_TORCH:-==2.13.0} (CPU wheel; set FASTPAR_TORCH to change)"
  pip_q "torch${FASTPAR_TORCH:-==2.13.0}"
fi
# transformers: the tests parallelize a model from a library we did not write (tiny, random init).
deps="mpi4py>=4 numpy safetensors tqdm matplotlib pytest>=8 pytest-timeout pytest-xdist>=3.8 expecttest setuptools wheel ninja transformers>=5.24,<6 accelerate"
[ "${FASTPAR_SYSTEM_MPI:-0}" = "1" ] || deps="$deps mpich"
pip_q $deps
# Triton (fastpar.kernels; on CPU its interpreter runs the kernel tests). A CUDA torch brings its
# own pinned triton: keep that one.
python -c "import triton" 2>/dev/null || pip_q "triton${FASTPAR_TRITON:-==3.9.0}"
so=$(ls fastpar/_C*.so 2>/dev/null | head -1 || true)
if [ -z "$so" ] || [ -n "$(find csrc setup.py -newer "$so" -type f | head -1)" ] \
    || ! python -c "import fastpar" 2>/dev/null; then
  echo "[setup] building fastpar and its native extension fastpar._C (about a minute)"
  pip_q --no-build-isolation --no-deps -e .
fi
python -c "import fastpar._native as n, sys; s = n.status(); print('[setup] fastpar._C:', 'built' if s['built'] else 'NOT BUILT: ' + str(s['error'])); sys.exit(0 if s['built'] else 1)"
# Our own bytecode, written now: where PYTHONDONTWRITEBYTECODE is set (this machine's image sets
# it) every process would compile fastpar and the tests again (~0.1 s of CPU each, and the test
# suite starts ~150 of them); Python still reads bytecode that is there, and checks it is fresh.
python -m compileall -q fastpar tests bench >/dev/null
