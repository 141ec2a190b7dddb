#!/usr/bin/env bash
# On a machine with a GPU and no network (the workplace's H200): build the CUDA parts, run every
# GPU-marked test and the GPU benchmarks, print a summary. Exits non-zero if any step fails or
# any GPU test was skipped. Budget: under 5 minutes on one H200. (The nvcc compile tests are
# CPU-side and run in CI: tests/test_cuda_compile.py.)
#   bash tests/gpu_check.sh            (logs and JSON also land in $OUT, when set)
# What runs: the build with CUDA; `fastpar info` (the cuda_ipc decision and why);
# tests/test_cuda_ipc.py (cuda_ipc at 2, 3 and 4 processes on the one GPU:
# bitwise sweeps with each algorithm forced, 300 calls in flight, graph capture and replay,
# side streams, views, symmetric tensors, two groups, a setup failure on one rank, re-init;
# expandable segments; a skipped call under a short timeout; nccl_mpi in one process); the
# Triton GEMM compiled (tests/test_kernels.py) and benchmarked against cuBLAS with the cost of
# cutting a GEMM into 2 and 4 pieces (bench/gemm.py); the quantized collectives' int8 Triton
# kernels compiled and compared bit for bit with fastpar.comm.quant on the CPU
# (tests/test_quant_kernels.py: blocks 16 to 65536, a million elements); comm.all_to_all_v_device
# on NCCL with torch's sync debug mode set to error (tests/test_comm_alltoall.py, one rank: no
# device-to-host sync in the device-counts path); the torch.distributed backend "fastpar" with
# CUDA tensors, alone (its NCCL) and as "cpu:fastpar,cuda:nccl" (tests/test_backend.py, one
# rank), and its CUDA IPC all-reduce behind dist.all_reduce (two ranks on the one GPU); a
# Hugging Face Llama at tp 2 on the GPU against Hugging Face's own forward (tests/test_hf_models.py);
# generation at tp 2 and pp 2 on the GPU against Hugging Face's generate (tests/test_generate.py)
# and one generation through python -m fastpar.generate, and with int8 weights; the quantized
# weights' Triton GEMM against float64 (tests/test_quantized_weights.py); a bf16 training run; the all_reduce latency benchmark 16 B..8 MiB in bf16 at 2 and 4 processes
# (cuda_ipc beside gloo, the engine it falls back to on a shared GPU; nccl and nccl_mpi say why
# they cannot run when the ranks share one GPU: NCCL wants one GPU per rank).
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
  rows+=("$(printf '%-28s %-8s %4ss' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" $((SECONDS - t0)))")
  [ $rc = 0 ] || failed=1
  return $rc
}
no_skips() {  # a skipped GPU test is not a pass here
  if grep -Eq '[0-9]+ skipped' "$OUT/$1.log"; then
    echo "$1: some GPU tests were skipped (see -rs above): counted as a failure"
    rows+=("$(printf '%-28s %-8s' "$1-no-skips" FAIL)")
    failed=1
  fi
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device visible to $PY: this script is for a GPU machine (nothing was run)"
  exit 2
fi
step build 240 env FASTPAR_CUDA=1 $PY setup.py build_ext --inplace
step info 60 env FASTPAR_SHARED_GPU=1 $PY -m fastpar info
step gpu-tests-cuda-ipc 300 $PY -m pytest -q -rs -m gpu tests/test_cuda_ipc.py \
    && no_skips gpu-tests-cuda-ipc
# the int8 codec's kernels: some 50 small compiles (dtypes, tiles, specialisations), bitwise
step gpu-tests-quant 150 $PY -m pytest -q -rs -m gpu tests/test_quant_kernels.py \
    && no_skips gpu-tests-quant
# the Triton kernels compiled (one tile: every shape and epilogue would compile every autotune
# candidate), the GPU tests of the other files
step gpu-tests-other 240 env FASTPAR_TRITON_AUTOTUNE=0 $PY -m pytest -q -rs -m gpu tests \
    --ignore=tests/test_cuda_ipc.py --ignore=tests/test_quant_kernels.py \
    && no_skips gpu-tests-other
step bench-gemm 120 $PY bench/gemm.py --json "$OUT/gemm.json"
# one generation through the command on the GPU (a small Llama with its own tokenizer)
step generate-gpu 120 bash -c "$PY -c 'from tests.test_generate import _model_with_tokenizer as m; \
m(\"$OUT/gen-model\")' && $PY -m fastpar.generate --hf-model $OUT/gen-model --prompt 'def main(' \
    --max-new-tokens 16 --json $OUT/generate.json && $PY -m fastpar.generate --hf-model \
    $OUT/gen-model --prompt 'def main(' --max-new-tokens 16 --weights int8 --json $OUT/generate-int8.json"
step train-gpu-bf16 120 $PY -m fastpar.train --preset tiny --steps 30 --dtype bfloat16 \
    --no-progress --plot "$OUT/train_loss.png" --metrics "$OUT/train.jsonl"
# ZeRO-3 per unit on the device: gather buffers' storage resized there, a reduction per backward
# (one rank: two sharing a GPU would put NCCL on one device twice)
step train-gpu-zero3 120 $PY -m fastpar.train --preset tiny --steps 20 --zero 3 \
    --dtype bfloat16 --no-progress --plot "" --metrics "$OUT/train_zero3.jsonl"
LAUNCH="mpirun -np"
command -v mpirun >/dev/null || LAUNCH="$PY -m torch.distributed.run --standalone --nproc-per-node"
for n in 2 4; do
  step "bench-allreduce-np$n" 150 env FASTPAR_SHARED_GPU=1 $LAUNCH $n $PY bench/collectives.py \
      --backends cuda_ipc,gloo,nccl,nccl_mpi --ops all_reduce -b 16 -e 8M -f 2 --dtype bfloat16 \
      --check --json "$OUT/allreduce_np$n.json"
done
echo; echo "=== summary (one GPU shared by all ranks: this measures the protocol, not NVLink)"
printf '%s\n' "${rows[@]}"
[ $failed = 0 ] && echo "all steps passed" || echo "SOME STEPS FAILED"
exit $failed
