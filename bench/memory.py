"""Peak memory per rank and step time of data parallelism and its ZeRO stages, each variant in
a job of its own (the same model and data), so one variant's peak never hides another's.

    python bench/memory.py                                  # dp 2: every variant, a table
    python bench/memory.py --world 4 --variants dp,zero1,zero3 --json bench/out/memory.json

Model: ``BLOCKS`` MLP blocks ``x + fc2(tanh(fc1(x)))`` (h -> 4h -> h) and AdamW; every rank
takes its own ``BATCH`` rows. Variants:
  dp           fastpar.DataParallel + torch.optim.AdamW (ZeRO-0)
  ddp          torch DistributedDataParallel + AdamW (gloo)
  torch-zero   torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
  zero1/2/3    fastpar.optim.DistributedOptimizer(AdamW, stage=1/2/3), no DataParallel
Per rank: peak RSS (``getrusage``: every page the process touched, shared ones included) and
peak PSS (``/proc/self/smaps_rollup`` sampled after forward, backward and step: shared pages
divided among the processes mapping them, so a symmetric segment counts once over the group).
The table shows the largest rank's peaks (MiB) and the median step time; model state (P
parameter bytes) is printed above it for reading the rows: DataParallel holds P + G + 2P of
AdamW state, ZeRO-1 P + G + 3P / dp.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

torch.set_num_threads(1)

from fastpar.runtime.cli import Parser  # noqa: E402

HIDDEN, BLOCKS, BATCH = 768, 4, 32  # 4 blocks of 768 -> 3072 -> 768: 18.9 M parameters
WARMUP, STEPS = 2, 6
VARIANTS = "dp,ddp,torch-zero,zero1,zero2,zero3"
MiB = 2**20


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(variant: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import fastpar

    topo = fastpar.init()

    class Block(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):
            return x + self.fc2(torch.tanh(self.fc1(x)))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(HIDDEN) for _ in range(BLOCKS)])
    params = sum(p.numel() for p in model.parameters())
    kw = {"lr": 1e-4, "weight_decay": 0.01}
    if variant == "dp":
        model = fastpar.DataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), **kw)
    elif variant in ("ddp", "torch-zero"):
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=topo.dp_group)
        if variant == "ddp":
            opt = torch.optim.AdamW(model.parameters(), **kw)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                          process_group=topo.dp_group, **kw)
    else:
        stage = int(variant[-1])
        extra = {"stage": stage} if stage > 1 else {}
        if stage == 3:
            extra["module"] = model
        opt = fastpar.optim.DistributedOptimizer(model.parameters(), torch.optim.AdamW,
                                                 **extra, **kw)
    gen = torch.Generator().manual_seed(1 + topo.dp_rank)
    peak_pss, times = pss_bytes(), []
    for step in range(WARMUP + STEPS):
        x, y = (torch.randn(BATCH, HIDDEN, generator=gen) for _ in range(2))
        dist.barrier()
        t0 = time.perf_counter()
        out = model(x)
        peak_pss = max(peak_pss, pss_bytes())
        F.mse_loss(out, y).backward()
        peak_pss = max(peak_pss, pss_bytes())
        opt.step()
        peak_pss = max(peak_pss, pss_bytes())
        opt.zero_grad(set_to_none=True)
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
    rec = {"variant": variant, "rank": topo.rank, "dp": topo.dp_size, "params": params,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "peak_pss_mib": peak_pss / MiB, "step_ms": 1e3 * statistics.median(times)}
    rows = [None] * topo.world_size
    dist.all_gather_object(rows, rec)
    if topo.rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    fastpar.shutdown()


def main() -> None:
    p = Parser(description=__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--variants", default=VARIANTS)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help="internal: run one variant on this rank")
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    table = []
    for variant in args.variants.split(","):
        cmd = [mpirun, "-np", str(args.world), sys.executable, os.path.abspath(__file__),
               "--worker", variant]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{variant}: failed\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
            continue
        rows = json.loads(line[7:])
        table.append({"variant": variant, "dp": rows[0]["dp"], "params": rows[0]["params"],
                      "peak_rss_mib": max(r["peak_rss_mib"] for r in rows),
                      "peak_pss_mib": max(r["peak_pss_mib"] for r in rows),
                      "step_ms": statistics.median(r["step_ms"] for r in rows), "ranks": rows})
    if table:
        n = table[0]["params"]
        print(f"model: {n / 1e6:.1f} M parameters, P = {4 * n / MiB:.0f} MiB float32; "
              f"dp {args.world}, peaks of the largest rank")
    print(f"{'variant':<12} {'peak RSS MiB':>13} {'peak PSS MiB':>13} {'step ms':>9}")
    for r in table:
        print(f"{r['variant']:<12} {r['peak_rss_mib']:>13.0f} {r['peak_pss_mib']:>13.0f} "
              f"{r['step_ms']:>9.1f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"config": {"hidden": HIDDEN, "blocks": BLOCKS, "batch": BATCH,
                                  "world": args.world, "steps": STEPS}, "rows": table}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
