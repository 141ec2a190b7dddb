#!/usr/bin/env bash
# On a machine with a GPU and no network (the workplace's H200): build the CUDA parts, run the
# GPU-marked tests and the GPU benchmarks, print a summary. Budget: under 5 minutes.
#   bash tests/gpu_check.sh            (output also lands in $OUT, when set)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fastpar-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
PY=${PYTHON:-python3}
declare -a rows
failed=0
step() {  # step NAME TIMEOUT CMD...: run, record pass/fail and seconds
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name"
  timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  rows+=("$(printf '%-28s %-6s %4ss' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" $((SECONDS - t0)))")
  [ $rc = 0 ] || failed=1
  return $rc
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device visible to $PY: this script is for a GPU machine (nothing was run)"
  exit 2
fi
step build 240 env FASTPAR_CUDA=1 $PY setup.py build_ext --inplace
step info 60 $PY -m fastpar info
step cuda-compile-tests 120 $PY -m pytest -q tests/test_cuda_compile.py
step gpu-tests 240 $PY -m pytest -q -rs -m gpu tests
step train-gpu-bf16 120 $PY -m fastpar.train --preset tiny --steps 30 --dtype bfloat16 \
    --no-progress --plot "$OUT/train_loss.png" --metrics "$OUT/train.jsonl"
LAUNCH="mpirun -np"
command -v mpirun >/dev/null || LAUNCH="$PY -m torch.distributed.run --standalone --nproc-per-node"
for n in 2 4; do
  step "bench-cuda_ipc-np$n" 120 env FASTPAR_SHARED_GPU=1 $LAUNCH $n $PY bench/collectives.py \
      --backends cuda_ipc --ops all_reduce -b 16 -e 8M -f 4 --dtype bfloat16 --check \
      --json "$OUT/cuda_ipc_np$n.json"
done
echo; echo "=== summary (one GPU shared by all ranks: this measures the protocol, not NVLink)"
printf '%s\n' "${rows[@]}"
[ $failed = 0 ] && echo "all steps passed" || echo "SOME STEPS FAILED"
exit $failed
