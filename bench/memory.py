"""Bytes per rank and step time of data parallelism, fastpar's ZeRO stages, torch's DDP,
ZeroRedundancyOptimizer and FSDP2, with and without activation recomputation; each row a job
of its own (the same model and data), so one row's peak never hides another's.

    python bench/memory.py                    # the default plan: 34 jobs, ~7 min on 2 cores
    python bench/memory.py --quick            # mlp dp 2: dp, zero1, zero3(-nopf), fsdp2, +- full
    python bench/memory.py --plan all --layouts dp4 --variants zero1,zero3 --json out.json
    python bench/memory.py --tiny --quick     # tiny sizes: the test suite's smoke run
    python bench/memory.py --gpt8x512 --plan all --models gpt --layouts dp4 --recompute none \
        --variants dp,ddp,fsdp2,zero1,zero2,zero3,zero3-nopf   # beside FSDP2 (issue 43)

Models (AdamW, float32; every dp rank takes its own rows, the same in every row):
  mlp          ``blocks`` of ``x + fc2(tanh(fc1(x)))`` (h -> 4h -> h) on x (batch, seq, h), MSE;
               at tp > 1 fc1 is a fastpar.nn.ColumnParallelLinear and fc2 a RowParallelLinear
  gpt          fastpar.models.GPT, gpt_loss; dropout 0, so CPU attention (SDPA's flash kernel)
               keeps only its output and logsumexp
  gpt-dropout  the same with dropout DROPOUT: attention takes the math kernel and keeps its
               (B, nh, T, T) probabilities and mask, what selective recompute is for
Layouts: ``dpN`` or ``tpAxdpB`` (fastpar.init(tp=A); DDP, FSDP2 and ZeRO over the dp group).
Variants:
  dp           fastpar.DataParallel + torch.optim.AdamW (ZeRO-0: the baseline row)
  ddp          torch DistributedDataParallel + AdamW (gloo)
  torch-zero   torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
  fsdp2        torch.distributed.fsdp.fully_shard on each block, then on the root (its docs'
               recipe; runs on CPU/gloo in torch 2.13; mesh: the dp group) + AdamW
  zero1/2/3    fastpar.optim.DistributedOptimizer(AdamW, stage=1/2/3), no DataParallel
  zero3-nopf   zero3 with prefetch=False: each block gathered when used (one block's
               parameters fewer held, the gathers not overlapped): ZeRO-3 at FSDP2's memory
Recompute: ``none``; ``full``: each block keeps only its input (fastpar.nn.recompute of the
block's body, as GPTBlock does: around the block's call, ZeRO-3's and FSDP2's hooks would run
again in backward); ``selective`` (the GPTs only): each attention core.

Measured per rank in one step (the last warm-up step; the timed steps run without hooks),
sampled at each block's forward (after a ZeRO-3 / FSDP2 gather), at the start of each block's
backward, and after forward, backward and the optimizer step:
  params grads optim bufs   each category's peak: the tensors the runtime owns, each storage
        once, in its first category (fastpar.training.memory's count, as fastpar.train
        reports it). bufs: communication storage that is neither params nor grads: fastpar's
        DataParallel buckets, ZeRO-2/3's reduce-scatter staging (GradReducer.peak_staging, as
        fastpar.train reports it, counted in every sample: where the dp group's collectives go
        to shm, dp symmetric rows of at most 1 MiB, kept; otherwise one run's (dp x piece)
        tensor that lives only while its run is reduced, so an upper bound; the pieces are
        reduced straight into the master gradient), DDP's buckets (sizes from its logging
        data); FSDP2's all-gather and
        reduce-scatter buffers are not visible from Python ("-"), its gathered parameters are
  state  model state: the largest sum of the four at one sample
  act    what autograd saved in the forward, each storage once, the input once, parameters as
        gathered at the time left out; ``pred``: mlp 4 rows (h + 4h/tp) per block (full: 4 rows
        h), gpt memory_plan's layer_activations + stage_input_bytes (none with dropout)
  held   malloc's bytes in use (glibc mallinfo2, every arena and mmap'd chunk) less what they
        were before the model was built, plus the pages of this rank's slots of fastpar's
        symmetric segments in memory (``comm.symmetric.resident_bytes``: ZeRO's and
        DataParallel's buffers there, ZeRO-3's float32 masters; not the shm communicators' own
        segments, 4 MiB a rank and group), the largest sum at a sample:
        everything the training holds at those points, visible to Python or not (FSDP2's and
        gloo's buffers too), so the engines compare at the same memory here; transients
        between samples are not seen. (``heap`` in the JSON: malloc's part alone.)
  RSS PSS   peak RSS (getrusage) and peak PSS (/proc/self/smaps_rollup at the samples)
The table shows the largest rank's bytes (MiB); the median over ranks of each rank's median
step time (``step ms``) and of its fastest step (``best ms``: other jobs on a shared machine
only add time, so the ratios and the targets use it; ``--repeat``: the fastest round's row);
``x base``: best ms over the ``dp`` row's without recompute of the same model and layout;
``load``: the 1-minute load average as the job ended (how shared the machine was). Below it:
whether every row trained the same (rank 0's losses), then issue 21's targets wherever the
rows they compare were measured.
"""

import ctypes
import ctypes.util
import dataclasses
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

torch.set_num_threads(1)

from fastpar.models import GPTConfig  # noqa: E402
from fastpar.runtime.cli import Parser  # noqa: E402

SIZES = {  # per rank; "full" is the default, "tiny" (--tiny) the smoke run's
    "full": {"hidden": 512, "blocks": 4, "batch": 4, "seq": 128, "gpt_batch": 4,
             "gpt": GPTConfig(seq_len=256, layers=4, hidden=256, heads=8), "warmup": 2,
             "steps": 5},
    # issue 43's comparison with FSDP2: 8 blocks of hidden 512 (gpt, 4 x 128 tokens per rank)
    "gpt8x512": {"hidden": 512, "blocks": 4, "batch": 4, "seq": 128, "gpt_batch": 4,
                 "gpt": GPTConfig(seq_len=128, layers=8, hidden=512, heads=8), "warmup": 2,
                 "steps": 4},
    "tiny": {"hidden": 32, "blocks": 4, "batch": 2, "seq": 8, "gpt_batch": 2,
             "gpt": GPTConfig(seq_len=16, layers=2, hidden=32, heads=4), "warmup": 2,
             "steps": 1},
}
MODELS, RECOMPUTE = ("mlp", "gpt", "gpt-dropout"), ("none", "selective", "full")
DROPOUT = 0.1  # gpt-dropout's: attention then keeps its probabilities (the math kernel)
LAYOUTS = ("dp2", "dp4", "tp2xdp2")
VARIANTS = ("dp", "ddp", "torch-zero", "fsdp2", "zero1", "zero2", "zero3", "zero3-nopf")
PLANS = {
    "default": [("mlp", "dp2", v, r) for v in VARIANTS for r in ("none", "full")]
    + [("mlp", lay, v, "none") for lay in ("dp4", "tp2xdp2") for v in VARIANTS]
    + [(m, "dp2", "dp", r) for m in MODELS[1:] for r in RECOMPUTE],
    "quick": [("mlp", "dp2", v, r) for v in ("dp", "zero1", "zero3", "zero3-nopf", "fsdp2")
              for r in ("none", "full")],
}
CATS = ("params", "grads", "optimizer", "buffers")
MiB = 2**20


def parse_layout(name: str):
    """``"dp4"`` -> (1, 4), ``"tp2xdp2"`` -> (2, 2); None if malformed."""
    m = re.fullmatch(r"(?:tp(\d+)x)?dp(\d+)", name)
    return (int(m.group(1) or 1), int(m.group(2))) if m else None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def heap_bytes() -> int:
    """Bytes malloc has handed out and not taken back, every arena and every mmap'd chunk
    (glibc's mallinfo2): torch's CPU tensors and whatever C++ allocates (gloo's buffers too)."""
    m = _LIBC.mallinfo2()
    return m.uordblks + m.hblkhd


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- the worker: one (model, layout, variant, recompute) on this rank ----------------------

class Block(nn.Module):
    """``x + fc2(tanh(fc1(x)))``, h -> 4h -> h; tp > 1: column then row parallel."""

    def __init__(self, h: int, tp: int, recompute: bool):
        super().__init__()
        if tp == 1:
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        else:
            import fastpar

            self.fc1 = fastpar.nn.ColumnParallelLinear(h, 4 * h, seed=1)
            self.fc2 = fastpar.nn.RowParallelLinear(4 * h, h, seed=2)
        self.recompute = recompute

    def forward(self, x):
        if self.recompute:  # the body, not the module: its hooks (ZeRO-3, FSDP2) run once
            from fastpar.nn import recompute
            return recompute(self._forward, x)
        return self._forward(x)

    def _forward(self, x):  # (B, T, h) -> (B, T, 4h/tp) -> (B, T, h)
        return x + self.fc2(torch.tanh(self.fc1(x)))


def build(model: str, tp: int, recompute: str, size: dict):
    """(module, its blocks, batch(gen) -> (input, target), loss_fn, activation prediction)."""
    if model.startswith("gpt"):
        from fastpar.models import GPT, GPTBlock, gpt_loss
        from fastpar.plan.memory import layer_activations, stage_input_bytes

        cfg = dataclasses.replace(size["gpt"], recompute=recompute,
                                  dropout=DROPOUT if model == "gpt-dropout" else 0.0)
        b = size["gpt_batch"]
        module = GPT(cfg, seed=0)
        # the plan leaves out dropout's masks and the probabilities its attention kernel keeps
        pred = None if cfg.dropout else stage_input_bytes(cfg, tp, 0, b, 4) + sum(
            layer_activations(cfg, tp, i, b, 4) for i in range(cfg.layers + 2))

        def batch(gen):  # tokens and targets (B, T) int64
            return tuple(torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen)
                         for _ in range(2))
        return module, [m for m in module if isinstance(m, GPTBlock)], batch, gpt_loss, pred
    h, n, rows = size["hidden"], size["blocks"], size["batch"] * size["seq"]
    torch.manual_seed(0)
    module = nn.Sequential(*[Block(h, tp, recompute == "full") for _ in range(n)])
    pred = n * rows * 4 * (h if recompute == "full" else h + 4 * h // tp)

    def batch(gen):  # x, y (B, T, h)
        return tuple(torch.randn(size["batch"], size["seq"], h, generator=gen)
                     for _ in range(2))
    return module, list(module), batch, nn.functional.mse_loss, pred


def wrap(variant: str, module, blocks, topo):
    """(model to call, optimizer, {category: tensors} now, extra buffer bytes now, visible)."""
    import fastpar
    from fastpar.training.memory import owned

    kw = {"lr": 1e-4, "weight_decay": 0.01}
    if variant == "dp":
        model = fastpar.DataParallel(module)
        opt = torch.optim.AdamW(model.parameters(), **kw)
        return model, opt, lambda: owned(model.parameters(), opt, model.reducer), \
            lambda: 0, True
    if variant in ("ddp", "torch-zero"):
        model = nn.parallel.DistributedDataParallel(module, process_group=topo.dp_group)
        if variant == "ddp":
            opt = state_of = torch.optim.AdamW(model.parameters(), **kw)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                          process_group=topo.dp_group, **kw)
            state_of = opt.optim  # the local optimizer over this rank's shard holds the state
        # DDP's buckets live in its C++ reducer (gradient_as_bucket_view=False: beside .grad)
        sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
        buckets = sum(int(s) for s in sizes.split(",") if s.strip())
        return model, opt, lambda: owned(model.parameters(), state_of), lambda: buckets, True
    if variant == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(topo.dp_group, "cpu")
        for b in blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(module, mesh=mesh)
        opt = torch.optim.AdamW(module.parameters(), **kw)
        sharded = list(module.parameters())  # DTensors; a unit in use shows its gathered ones
        return module, opt, lambda: owned([*module.parameters(), *sharded], opt), \
            lambda: 0, False
    stage = int(variant[4])
    opt = fastpar.optim.DistributedOptimizer(module.parameters(), torch.optim.AdamW,
                                             stage=stage, module=module if stage == 3 else None,
                                             prefetch=variant != "zero3-nopf", **kw)
    staging = (lambda: opt.grads.peak_staging) if opt.grads is not None else (lambda: 0)
    return module, opt, lambda: owned(module.parameters(), opt), staging, True


class Meter:
    """Peaks of the model state by category, of its sum at one sample, and of PSS."""

    def __init__(self, tensors, extra):
        from fastpar.training.memory import storage_bytes

        self.count, self.tensors, self.extra = storage_bytes, tensors, extra
        self.peak, self.total, self.pss = dict.fromkeys(CATS, 0), 0, 0
        self.heap_base, self.heap = heap_bytes(), 0  # the worker sets the base before its build
        self.held = 0

    def sample(self, *_) -> None:
        from fastpar.comm import symmetric

        heap = heap_bytes() - self.heap_base  # first: nothing made yet
        self.heap = max(self.heap, heap)
        self.held = max(self.held, heap + symmetric.resident_bytes())
        now = self.count(self.tensors())
        now["buffers"] += self.extra()
        for k in CATS:
            self.peak[k] = max(self.peak[k], now[k])
        self.total = max(self.total, sum(now.values()))
        self.pss = max(self.pss, pss_bytes())

    def hooks(self, blocks) -> list:
        """Samples inside forward and backward; registered after ZeRO-3's and FSDP2's hooks,
        so a block's pre-hook sees it gathered, and its output's grad hook sees the gather
        that starts its backward."""
        from fastpar.data_parallel.reducer import tensors_in

        def post(module, args, out):
            self.sample()
            for t in tensors_in(out):
                if t.requires_grad:
                    t.register_hook(self.sample)
        return [h for b in blocks for h in (b.register_forward_pre_hook(self.sample),
                                            b.register_forward_hook(post))]


class Saved:
    """Bytes autograd saves inside ``hooks()``: each storage once, the input's once, leaving
    out the parameters as they are at the moment (a ZeRO-3 or FSDP2 gather allocates them per
    use, so the pipeline's count, which fixes them at its start, does not fit here)."""

    def __init__(self, params, inputs):
        self.params = params
        self.seen = {t.untyped_storage().data_ptr() for t in inputs}
        self.bytes = sum(t.untyped_storage().nbytes() for t in inputs)

    def pack(self, t):
        s = t.untyped_storage()
        # a DTensor (FSDP2's sharded parameter) is never saved: its unit computes with the
        # gathered plain tensors
        if s.data_ptr() not in self.seen and s.data_ptr() not in {
                p.untyped_storage().data_ptr() for p in self.params()
                if not hasattr(p, "to_local")}:
            self.seen.add(s.data_ptr())
            self.bytes += s.nbytes()
        return t.detach()  # not t: an output saved by its own node would be a cycle

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def worker(job: str, size: dict) -> None:
    import torch.distributed as dist

    import fastpar
    from fastpar.optim.zero_grads import staging_bytes
    from fastpar.optim.zero_stage3 import module_units

    model_name, layout, variant, recompute = job.split(",")
    tp, dp = parse_layout(layout)
    topo = fastpar.init(tp=tp)
    heap_base = heap_bytes()
    module, blocks, batch, loss_fn, pred = build(model_name, tp, recompute, size)
    units = sorted((sum(p.numel() * p.element_size() for p in ps)
                    for _, ps, _ in module_units(module)), reverse=True)
    n_params = sum(p.numel() for p in module.parameters())
    model, opt, tensors, extra, visible = wrap(variant, module, blocks, topo)
    meter = Meter(tensors, extra)
    meter.heap_base = heap_base
    state_pred = None
    held = None  # ZeRO-3's gather units held at once (one in use, one prefetched)
    if variant.startswith("zero3"):  # float32: master shard, Adam's m and v, master gradient
        # (16 s), the largest gather units held at once, the staging, and the one float32
        # NaN every released parameter shows
        held = sum(units[:1 if variant == "zero3-nopf" else 2])
        state_pred = 16 * sum(f.shard for f in opt.flat) + held + staging_bytes(
            opt.flat, dp, opt.grads.symmetric) + 4
    gen = torch.Generator().manual_seed(1 + topo.dp_rank)
    # dropout: every row draws the same masks. Seeding the "tp" stream here matters: one first
    # made inside a recompute region is not restored for its recompute (other masks in backward)
    fastpar.nn.random.seed(2)
    times, losses, act = [], [], 0
    for step in range(size["warmup"] + size["steps"]):
        x, y = batch(gen)
        measured = step == size["warmup"] - 1
        hooks = meter.hooks(blocks) if measured else []
        saved = Saved(model.parameters, [x]) if measured else None
        dist.barrier()
        t0 = time.perf_counter()
        if saved is not None:
            with saved.hooks():
                out = model(x)
            act = saved.bytes
        else:
            out = model(x)
        loss = loss_fn(out, y)
        losses.append(loss.item())
        if measured:
            meter.sample()
        loss.backward()
        if measured:
            meter.sample()
        opt.step()
        if measured:
            meter.sample()
        opt.zero_grad(set_to_none=True)
        if step >= size["warmup"]:
            times.append(time.perf_counter() - t0)
        for h in hooks:
            h.remove()
    rec = {"rank": topo.rank, "tp": tp, "dp": dp, "n_params": n_params,
           "two_units": sum(units[:2]), "units_held": held,
           **{k: meter.peak[k] for k in CATS},
           "buffers_visible": visible, "state": meter.total, "activations": act,
           "act_pred": pred, "state_pred": state_pred, "heap": meter.heap,
           "held": meter.held,
           "losses": losses, "peak_pss_mib": meter.pss / MiB,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "step_ms": 1e3 * statistics.median(times), "best_ms": 1e3 * min(times)}
    rows = [None] * topo.world_size
    dist.all_gather_object(rows, rec)
    if topo.rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    fastpar.shutdown()


# ---- the launcher: every job, then the table and the targets -------------------------------

def plan(args, p) -> list[tuple]:
    """The jobs (model, layout, variant, recompute) of ``--plan``, kept by the filters."""
    pick = {}
    for flag, allowed in (("models", MODELS), ("layouts", None), ("variants", VARIANTS),
                          ("recompute", RECOMPUTE)):
        value = getattr(args, flag)
        if value is None:
            continue
        items = value.split(",")
        bad = [x for x in items if (parse_layout(x) is None if allowed is None
                                    else x not in allowed)]
        p.check(not bad, f"--{flag}: {bad} not among {allowed or 'dpN, tpAxdpB'}")
        pick[flag] = items
    if args.plan == "all":
        jobs = [(m, lay, v, r) for m in pick.get("models", MODELS)
                for lay in pick.get("layouts", LAYOUTS) for v in pick.get("variants", VARIANTS)
                for r in pick.get("recompute", RECOMPUTE)]
    else:
        jobs = [j for j in PLANS[args.plan]
                if all(x in pick.get(flag, [x]) for flag, x in zip(
                    ("models", "layouts", "variants", "recompute"), j))]
    p.check(bool(jobs), f"no job of --plan {args.plan} is left by the filters")
    return jobs


def run_job(job, size_name: str) -> dict | str:
    """One job under mpirun: its row, or why it has none."""
    model, layout, variant, recompute = job
    if model == "mlp" and recompute == "selective":
        return "skipped: selective recomputes attention cores; the mlp has none"
    tp, dp = parse_layout(layout)
    world = tp * dp
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if world > (os.cpu_count() or 1):  # idle MPICH ranks sleep rather than spin
        env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [mpirun, "-np", str(world), sys.executable, os.path.abspath(__file__), "--worker",
           ",".join(job), *([f"--{size_name}"] if size_name != "full" else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "failed: no result within 600 s"
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return f"failed (exit {out.returncode}):\n{out.stdout[-1500:]}\n{out.stderr[-2500:]}"
    ranks = json.loads(line[7:])
    row = {"model": model, "layout": layout, "variant": variant, "recompute": recompute,
           "tp": tp, "dp": dp, "n_params": ranks[0]["n_params"],
           **{k: ranks[0][k] for k in ("two_units", "units_held", "buffers_visible",
                                       "act_pred", "state_pred")}}
    for k in (*CATS, "state", "activations", "heap", "held", "peak_rss_mib", "peak_pss_mib"):
        row[k] = max(r[k] for r in ranks)
    row["step_ms"] = statistics.median(r["step_ms"] for r in ranks)
    row["best_ms"] = statistics.median(r["best_ms"] for r in ranks)
    row["load"] = os.getloadavg()[0]  # the machine's, as the job ended: how shared it was
    row["losses"] = ranks[0]["losses"]  # rank 0's data: the same in every row of a layout
    row["ranks"] = ranks
    return row


def name(row) -> str:
    return row["variant"] + {"none": "", "full": "+rc", "selective": "+sel"}[row["recompute"]]


def with_ratios(rows) -> None:
    """``step_vs_base`` and ``state_vs_base``: over the dp row without recompute of the same
    model and layout (None where that row is missing)."""
    for r in rows:
        base = next((b for b in rows if (b["model"], b["layout"], b["variant"], b["recompute"])
                     == (r["model"], r["layout"], "dp", "none")), None)
        r["step_vs_base"] = r["best_ms"] / base["best_ms"] if base else None
        r["state_vs_base"] = r["state"] / base["state"] if base else None


def agreement(rows) -> list[str]:
    """Every row of a model and layout trains the same model on the same data (rank 0's
    losses, step by step): a recompute row exactly as its variant without (the same kernels
    run again on the same dropout masks; but selective recompute with attention dropout, whose
    core is ``dropout_attention``: the same masks, other kernels), every row within 1e-4 of the
    first (float32 under other reduction orders over a few AdamW steps). A wrong row is far
    off."""
    lines = []
    for key in dict.fromkeys((r["model"], r["layout"]) for r in rows):
        group = [r for r in rows if (r["model"], r["layout"]) == key]
        ref = group[0]["losses"]
        off = {name(r): max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
               for r in group}
        worst = max(off, key=off.get)
        plain = {r["variant"]: r["losses"] for r in group if r["recompute"] == "none"}
        exact = [r for r in group
                 if not (r["recompute"] == "selective" and r["model"] == "gpt-dropout")]
        inexact = [name(r) for r in exact if plain.get(r["variant"], r["losses"]) != r["losses"]]
        ok = off[worst] <= 1e-4 and not inexact
        lines.append(f"{'same losses' if ok else 'LOSSES DIFFER'} {' '.join(key)}: {len(group)} "
                     f"rows, largest relative difference to {name(group[0])} {off[worst]:.1e}"
                     f" ({worst}); recompute rows equal to their variant's"
                     + (f" except {', '.join(inexact)}" if inexact else ""))
    return lines


def table(rows) -> str:
    head = (f"{'model':<11} {'layout':<8} {'variant':<15} {'params':>7} {'grads':>6} "
            f"{'optim':>6} {'bufs':>6} {'state':>7} {'act':>6} {'pred':>6} {'held':>6} "
            f"{'RSS':>6} "
            f"{'PSS':>6} {'step ms':>8} {'best ms':>8} {'x base':>6} {'load':>5}")
    lines = [head]
    for r in rows:
        bufs = f"{r['buffers'] / MiB:>6.1f}" if r["buffers_visible"] else f"{'-':>6}"
        ratio = f"{r['step_vs_base']:>6.2f}" if r["step_vs_base"] is not None else f"{'':>6}"
        pred = f"{r['act_pred'] / MiB:>6.1f}" if r["act_pred"] is not None else f"{'-':>6}"
        lines.append(
            f"{r['model']:<11} {r['layout']:<8} {name(r):<15} {r['params'] / MiB:>7.1f} "
            f"{r['grads'] / MiB:>6.1f} {r['optimizer'] / MiB:>6.1f} {bufs} "
            f"{r['state'] / MiB:>7.1f} {r['activations'] / MiB:>6.1f} "
            f"{pred} {r['held'] / MiB:>6.1f} {r['peak_rss_mib']:>6.0f} "
            f"{r['peak_pss_mib']:>6.0f} "
            f"{r['step_ms']:>8.1f} {r['best_ms']:>8.1f} {ratio} {r['load']:>5.1f}")
    return "\n".join(lines)


def targets(rows) -> list[dict]:
    """Issue 21's targets, wherever the rows they compare were measured: ``{target, where,
    value, limit, met, text}`` (``value <= limit`` is met; bytes or a ratio)."""
    out = []
    find = {(r["model"], r["layout"], r["variant"], r["recompute"]): r for r in rows}

    def check(what, where, value, limit, text):
        out.append({"target": what, "where": where, "value": value, "limit": limit,
                    "met": value <= limit, "text": text})

    def ratio(what, where, a, b, limit, extra=""):
        check(what, where, a["best_ms"] / b["best_ms"], limit,
              f"{a['best_ms']:.0f} / {b['best_ms']:.0f} ms = {a['best_ms'] / b['best_ms']:.2f}"
              f" (limit {limit}){extra}")

    for (model, layout, variant, rc), row in find.items():
        where = f"{model} {layout}" + ("" if rc == "none" else f" {rc} recompute")
        if variant.startswith("zero3"):
            label = "ZeRO-3" + (" without prefetch" if variant == "zero3-nopf" else "")
            z0, z1, f2 = (find.get((model, layout, v, rc)) for v in ("dp", "zero1", "fsdp2"))
            held = row["units_held"]  # the gathered units held at once (1 without prefetch)
            if z0:
                zero0 = sum(z0[k] for k in ("params", "grads", "optimizer"))
                # each gather unit is padded to a multiple of dp elements (16 bytes each: the
                # parameter, Adam's m and v, the gradient); released parameters show one NaN
                pad = row["state_pred"] - 16 * row["n_params"] // row["dp"] - held - \
                    row["buffers"]
                bound = zero0 / row["dp"] + held + row["buffers"] + pad
                check(f"{label} model state <= ZeRO-0's / dp + the layers gathered + buffers",
                      where, row["state"], bound,
                      f"{row['state'] / MiB:.1f} MiB vs {zero0 / MiB:.1f} / {row['dp']} + "
                      f"{held / MiB:.1f} + {row['buffers'] / MiB:.1f} "
                      f"+ {pad} B (padding, the NaN) = {bound / MiB:.1f} MiB")
            if row["state_pred"]:
                err = abs(row["state"] / row["state_pred"] - 1)
                check(f"{label} model state within 5% of the prediction", where, err, 0.05,
                      f"{row['state'] / MiB:.2f} MiB measured, {row['state_pred'] / MiB:.2f} "
                      f"predicted ({100 * err:.1f}% off)")
            if z1:
                ratio(f"{label} step <= 1.3 x ZeRO-1's", where, row, z1, 1.3)
            if f2:
                ratio(f"{label} step <= FSDP2's", where, row, f2, 1.0,
                      f"; held {row['held'] / MiB:.1f} vs {f2['held'] / MiB:.1f} MiB")
                check(f"{label} held <= FSDP2's (the same memory)", where,
                      row["held"] / f2["held"], 1.0,
                      f"{row['held'] / MiB:.1f} vs {f2['held'] / MiB:.1f} MiB = "
                      f"{row['held'] / f2['held']:.2f}")
        if rc != "none" and (model, layout, variant, "none") in find:
            plain = find[(model, layout, variant, "none")]
            ratio(f"{rc} recompute step <= {1.4 if rc == 'full' else 1.1} x none",
                  f"{model} {layout} {variant}", row, plain, 1.4 if rc == "full" else 1.1,
                  f"; activations {row['activations'] / MiB:.1f} vs "
                  f"{plain['activations'] / MiB:.1f} MiB")
        if row["act_pred"] is not None and (rc != "none" or model != "mlp"):
            err = abs(row["activations"] / row["act_pred"] - 1)
            check("activations within 10% of the prediction", f"{model} {layout} {variant} "
                  f"{rc}", err, 0.1, f"{row['activations'] / MiB:.2f} MiB measured, "
                  f"{row['act_pred'] / MiB:.2f} predicted ({100 * err:.1f}% off)")
    return out


def main() -> None:
    p = Parser(description=__doc__)
    p.add_argument("--plan", default="default", choices=("default", "quick", "all"),
                   help="default: mlp at dp2 (every variant, +- full recompute), dp4 and "
                   "tp2xdp2 (every variant); gpt and gpt-dropout at dp2 (dp x none, "
                   "selective, full); quick: mlp dp2 dp/zero1/zero3/zero3-nopf/fsdp2 +- "
                   "full; all: every combination of the filters")
    p.add_argument("--quick", action="store_true", help="--plan quick")
    p.add_argument("--models", default=None, help=f"filter, of {','.join(MODELS)}")
    p.add_argument("--layouts", default=None, help=f"filter, e.g. {','.join(LAYOUTS)}")
    p.add_argument("--variants", default=None, help=f"filter, of {','.join(VARIANTS)}")
    p.add_argument("--recompute", default=None, help=f"filter, of {','.join(RECOMPUTE)}")
    p.add_argument("--repeat", type=int, default=1, help="rounds over the plan (every other "
                   "one in reverse order); a row is its fastest round's")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--gpt8x512", action="store_true",
                   help="gpt of 8 blocks of hidden 512 (issue 43's FSDP2 comparison: "
                        "--models gpt --layouts dp4)")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help="internal: run one job on this rank")
    args = p.parse_args()
    size_name = "tiny" if args.tiny else "gpt8x512" if args.gpt8x512 else "full"
    size = SIZES[size_name]
    if args.worker:
        worker(args.worker, size)
        return
    if args.quick:
        args.plan = "quick"
    p.check(args.repeat >= 1, f"--repeat must be at least 1, got {args.repeat}")
    jobs = plan(args, p)
    done, failed = {}, []
    start = time.perf_counter()
    for rep in range(args.repeat):  # every other round in reverse: drift hits both ends alike
        for job in jobs if rep % 2 == 0 else jobs[::-1]:
            result = run_job(job, size_name)
            if isinstance(result, str):
                if rep == 0 or not result.startswith("skipped"):
                    print(f"{'/'.join(job)}: {result}", flush=True)
                if not result.startswith("skipped"):
                    failed.append(("/".join(job), result))
                continue
            done.setdefault(job, []).append(result)
    rows = []
    for job in jobs:  # the fastest round's row: interference only adds time
        if job in done:
            runs = done[job]
            rows.append(min(runs, key=lambda r: r["best_ms"]))
            rows[-1]["best_ms_rounds"] = [r["best_ms"] for r in runs]
    with_ratios(rows)
    print(f"mlp: {size['blocks']} blocks h {size['hidden']}, rows {size['batch']} x "
          f"{size['seq']} per rank; gpt: {size['gpt'].layers} layers h {size['gpt'].hidden}, "
          f"{size['gpt_batch']} x {size['gpt'].seq_len} tokens per rank (gpt-dropout: "
          f"{DROPOUT}); AdamW, float32; "
          f"MiB per rank (largest rank), {len(jobs)} jobs x {args.repeat} rounds in "
          f"{time.perf_counter() - start:.0f} s")
    print(table(rows))
    same = agreement(rows)
    print("\n".join(same))
    checks = targets(rows)
    for c in checks:
        print(f"{'met    ' if c['met'] else 'NOT MET'} {c['target']} ({c['where']}): "
              f"{c['text']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        cfg = {k: (dataclasses.asdict(v) if k == "gpt" else v) for k, v in size.items()}
        with open(args.json, "w") as fh:
            json.dump({"config": {**cfg, "plan": args.plan, "repeat": args.repeat},
                       "rows": rows, "targets": checks, "agreement": same,
                       "failed": [j for j, _ in failed]}, fh, indent=1)
    if any(line.startswith("LOSSES") for line in same):
        failed.append(("losses", "a row trained differently"))
    if failed:
        raise SystemExit(f"{len(failed)} job(s) failed: {', '.join(j for j, _ in failed)}")


if __name__ == "__main__":
    main()
