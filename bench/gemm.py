"""GEMM kernels on one device: fastpar's Triton ``kernels.linear`` against torch's
``F.linear`` (cuBLAS on a GPU), the fused epilogue against F.linear then the activation, and the
cost of cutting one GEMM into k pieces along the tokens (what the overlapped layers do).

    python bench/gemm.py                              # GPU: bf16, 1024..8192
    python bench/gemm.py --sizes 256,512 --json out.json    # CPU: torch only (see --triton)

Square problems M = N = K (tokens x in -> out); each point a median over reps, timed with CUDA
events on a GPU. Columns: TFLOP/s of each, triton/torch (>1: Triton faster), the fused GELU
epilogue against the unfused pair, and chunked/whole - 1 for k = 2 and 4 (the chunking
overhead). On CPU Triton runs only through its interpreter (``TRITON_INTERPRET=1``, very slow):
its columns are skipped unless ``--triton`` is given.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from fastpar.runtime.cli import Parser

WARMUP, REPS = 3, 10


def timer(device):
    if device.type == "cuda":
        def run(fn, reps):
            times = []
            for _ in range(WARMUP):
                fn()
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)
    else:
        def run(fn, reps):
            for _ in range(WARMUP):
                fn()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
    return run


def chunked(x, w, k):
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    bounds = [x.shape[0] * i // k for i in range(k + 1)]
    for a, b in zip(bounds, bounds[1:]):
        torch.mm(x[a:b], w.t(), out=out[a:b])
    return out


def main():
    parser = Parser(description=__doc__)
    parser.add_argument("--sizes", default=None, help="M=N=K values (default: GPU 1024,2048,"
                        "4096,8192; CPU 256,512)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--triton", action="store_true",
                        help="on CPU, time the Triton kernel too (interpreter: very slow)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    sizes = [int(s) for s in (args.sizes or ("1024,2048,4096,8192" if gpu else "256,512"))
             .split(",")]
    use_triton = gpu or args.triton
    kernels = None
    if use_triton:
        if not gpu:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from fastpar import kernels
    run = timer(device)
    records = []
    print(f"# GEMM M=N=K on {device.type} ({torch.cuda.get_device_name() if gpu else 'CPU'}), "
          f"{dtype}, median of {args.reps}")
    print(f"{'size':>6} {'torch TF/s':>11} {'triton TF/s':>12} {'triton/torch':>13} "
          f"{'fused gelu':>11} {'k=2 cost':>9} {'k=4 cost':>9}")
    for n in sizes:
        x = torch.randn(n, n, dtype=dtype, device=device)
        w = torch.randn(n, n, dtype=dtype, device=device) / n ** 0.5
        b = torch.randn(n, dtype=dtype, device=device)
        flops = 2 * n ** 3
        rec = {"size": n, "dtype": str(dtype).replace("torch.", ""), "device": device.type}
        rec["torch_s"] = run(lambda: F.linear(x, w), args.reps)
        for k in (2, 4):
            rec[f"chunks{k}_s"] = run(lambda k=k: chunked(x, w, k), args.reps)
            rec[f"chunks{k}_cost"] = rec[f"chunks{k}_s"] / rec["torch_s"] - 1
        rec["torch_tflops"] = flops / rec["torch_s"] / 1e12
        line = f"{n:>6} {rec['torch_tflops']:>11.2f}"
        if kernels is not None:
            rec["triton_s"] = run(lambda: kernels.linear(x, w), args.reps)
            rec["triton_tflops"] = flops / rec["triton_s"] / 1e12
            rec["triton_vs_torch"] = rec["torch_s"] / rec["triton_s"]
            fused = run(lambda: kernels.linear(x, w, b, activation="gelu"), args.reps)
            unfused = run(lambda: F.gelu(F.linear(x, w, b)), args.reps)
            rec["fused_gelu_vs_unfused"] = unfused / fused
            line += (f" {rec['triton_tflops']:>12.2f} {rec['triton_vs_torch']:>12.2f}x "
                     f"{rec['fused_gelu_vs_unfused']:>10.2f}x")
        else:
            line += f" {'-':>12} {'-':>13} {'-':>11}"
        line += f" {rec['chunks2_cost']:>+8.1%} {rec['chunks4_cost']:>+8.1%}"
        print(line, flush=True)
        records.append(rec)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
