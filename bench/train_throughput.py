"""Training throughput of the main job (``fastpar.train``): its overhead at one rank against a
plain PyTorch loop of the same model and work, and tokens/s of every parallel layout the world fits.

    python bench/train_throughput.py                                   # 1 rank: fastpar vs plain
    python bench/train_throughput.py --preset tiny --steps 10 --json out.json
    mpirun -np 4 python bench/train_throughput.py --layouts all        # + every layout of 4 ranks
    mpirun -np 2 python bench/train_throughput.py --layouts tp2,pp2,dp2+zero --steps 5
    mpirun -np 4 python bench/train_throughput.py --layouts tp2-pp2 --engines default,gloo \
        --repeats 3                                # the main job: our engines against gloo

Overhead (one process; under N > 1 ranks, a child of rank 0): ``fastpar``,
``Trainer(...).train_step(step)`` (Pipeline + DataParallel + clip + AdamW + LambdaLR, as
``python -m fastpar.train`` runs it) against ``plain``, ``fastpar.models.GPT`` (the same weights:
``seed``) trained by hand on the same batch (``Sampler.batch(step)``), cut into the same
microbatches (gradient accumulation, each loss scaled by 1/m, ``F.cross_entropy``),
``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW`` with the same hyper-parameters and
``LambdaLR``. Both take step ``i`` in turn (the first of the pair alternates) so drift on a
shared machine hits both alike; after the warm-up the table shows the median step time.
``fastpar / plain`` is tokens/s over tokens/s (target >= 0.95); ``loss diff`` is the largest
|loss difference| over the steps, a check that both did the same work (float32 rounding only:
about 1e-6).

Layouts (under a launcher with N > 1 ranks): each (tp, pp) whose degrees divide N and fit the
model and batch, dp = N / (tp x pp), and with ``+zero`` (ZeRO-1) where dp > 1, one after another
in this process (a Trainer, its steps, ``fastpar.shutdown()``). Each step starts from a barrier;
its time is the slowest rank's; the table shows the median, the loss after the last step (the
same for every layout up to float32 rounding) and ``vs 1 rank``: tokens/s over the 1-rank
fastpar's. Every rank first joins the job (``fastpar.init``: MPI starts on all ranks together;
with MPICH here, a rank that reached MPI_Init 10 s after the others could hang the job); then
rank 0 measures the 1-rank reference in a child process, a job of its own
(``FASTPAR_LAUNCHER=single``) on all the CPUs rank 0 had before init bound it, while the other
ranks wait in a barrier (blocked, not spinning), which must not time out (``--timeout`` s).

Engines (``--engines default,gloo``): each layout once per engine setting, ``default`` being the
policy's choice and any other name forced for collectives and pipeline P2P alike (as
``FASTPAR_COMM_BACKEND`` does), the settings taken in turn and, with ``--repeats R``, R rounds
in alternating order; the table shows each one's median over all its steps and ``vs first``,
its tokens/s over the first setting's (``default`` against ``gloo``: whether our engines make
the job faster than torch's).

Threads: one intra-op thread per process by default (``THREADS``, ``--threads``), as the other
benches: at 4 ranks on the 2-core development machine the ranks already share cores, and on that
machine, shared with other jobs, 2 threads at 1 rank made steps 2-4x slower than 1 (an OpenMP
thread waits for a peer the scheduler has taken away). So ``vs 1 rank`` is a scaling figure
(ideally min(ranks, CPUs)x). ``--threads 2`` gives the 1-rank run both cores of an idle machine.
More ranks than CPUs share cores, and the header says so: such numbers measure
oversubscription, not the layout.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastpar
from fastpar.runtime.cli import Parser
from fastpar.runtime.launcher import launched_world_size
from fastpar.training.args import lr_lambda, model_config
from fastpar.training.args import parse_args as trainer_args
from fastpar.training.trainer import Trainer

# Configuration.
PRESET, GLOBAL_BATCH, SCHEDULE, SEED = "small", 16, "1f1b", 0
WARMUP, STEPS = 3, 15
TARGET = 0.95  # fastpar's tokens/s at 1 rank, as a fraction of the plain loop's
THREADS = 1  # intra-op threads per process (see the docstring)
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args():
    p = Parser(description=__doc__)
    p.add_argument("--preset", default=PRESET, choices=["tiny", "small"])
    p.add_argument("--global-batch", type=int, default=GLOBAL_BATCH, help="sequences per step")
    p.add_argument("--microbatches", type=int, default=None,
                   help="per step (default: fastpar.train's, 2 x pp)")
    p.add_argument("--schedule", default=SCHEDULE, choices=["gpipe", "1f1b", "zb"])
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--steps", type=int, default=STEPS, help="timed steps per variant / layout")
    p.add_argument("--layouts", default="all",
                   help="under N > 1 ranks: 'all', 'none', or a comma list such as "
                        "tp2-pp2,dp4,tp2-dp2+zero (dp may be left out)")
    p.add_argument("--engines", default="default",
                   help="comma list: 'default' (the policy) and/or engine names forced for the "
                        "whole job (gloo, shm, mpi), each layout measured under each")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over the engines, in alternating order (noise)")
    p.add_argument("--threads", type=int, default=THREADS, help="intra-op threads per process")
    p.add_argument("--timeout", type=float, default=300.0, help="fastpar.init's, in seconds")
    p.add_argument("--json", help="write the records to this path (rank 0)")
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.threads < 1 or args.repeats < 1:
        p.error(f"--steps, --threads and --repeats must be >= 1 and --warmup >= 0, got "
                f"{args.steps}, {args.threads}, {args.repeats} and {args.warmup}")
    from fastpar.comm.policy import ENGINES

    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines if e != "default" and e not in ENGINES]
    if unknown or not args.engines:
        p.error(f"--engines: {unknown or 'nothing'} not among default, {', '.join(ENGINES)}")
    return args


def argv_for(args, tp=1, pp=1, zero=False) -> list:
    """fastpar.train's command line for one layout; --steps sets the LR schedule's length."""
    argv = ["--preset", args.preset, "--tp", str(tp), "--pp", str(pp), "--global-batch",
            str(args.global_batch), "--schedule", args.schedule, "--seed", str(args.seed),
            "--steps", str(args.warmup + args.steps), "--timeout", str(args.timeout),
            "--no-progress", "--plot", ""]
    if args.microbatches:
        argv += ["--microbatches", str(args.microbatches)]
    return argv + (["--zero"] if zero else [])


def layout_name(tp, pp, dp, zero) -> str:
    parts = [f"{k}{v}" for k, v in (("tp", tp), ("pp", pp), ("dp", dp)) if v > 1]
    return ("-".join(parts) or "serial") + ("+zero" if zero else "")


class PlainLoop:
    """The reference: the trainer's model, batch, microbatches and optimizer, in plain PyTorch."""

    def __init__(self, trainer):
        from fastpar.models import GPT

        a = trainer.args
        self.sampler, self.m, self.clip = trainer.sampler, trainer.microbatches, a.clip
        self.model = GPT(trainer.cfg, seed=a.seed)  # tp = 1: the serial model, same weights
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=a.lr, betas=(0.9, 0.95),
                                     weight_decay=a.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(a, trainer.steps))

    def train_step(self, step: int) -> tuple:
        x, y = self.sampler.batch(step)  # (B, T) int64 each
        total = torch.zeros(())
        for xm, ym in zip(x.chunk(self.m), y.chunk(self.m)):  # (B/m, T)
            logits = self.model(xm)  # (B/m, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1), ym.flatten())
            (loss / self.m).backward()  # accumulate: the batch's mean over m microbatches
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip) \
            if self.clip > 0 else torch.tensor(float("nan"))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return total.item() / self.m, float(norm)


def summary(seconds: list, tokens: int) -> dict:
    ms = [s * 1e3 for s in seconds]
    step = statistics.median(ms)
    return {"step_ms": step, "step_ms_min": min(ms), "step_ms_max": max(ms),
            "tokens_per_s": tokens / (step / 1e3)}


def measure_serial(args, threads: int) -> list:
    """fastpar's step against the plain loop, this process being the whole (1-rank) job."""
    torch.set_num_threads(threads)
    try:
        trainer = Trainer(trainer_args(argv_for(args)))
        runs = [("fastpar", trainer), ("plain", PlainLoop(trainer))]
        times, losses = {n: [] for n, _ in runs}, {n: [] for n, _ in runs}
        for step in range(args.warmup + args.steps):
            for name, run in runs if step % 2 == 0 else runs[::-1]:
                start = time.perf_counter()
                loss, _ = run.train_step(step)
                elapsed = time.perf_counter() - start
                losses[name].append(loss)
                if step >= args.warmup:
                    times[name].append(elapsed)
        cfg, m = trainer.cfg, trainer.microbatches
    finally:
        fastpar.shutdown()
    diff = max(abs(a - b) for a, b in zip(losses["fastpar"], losses["plain"]))
    return [{"section": "overhead", "variant": name, "layout": "serial", "tp": 1, "pp": 1,
             "dp": 1, "zero": False, "microbatches": m, "world_size": 1, "threads": threads,
             "params": cfg.num_params(), "final_loss": losses[name][-1], "loss_diff_max": diff,
             **summary(times[name], args.global_batch * cfg.seq_len)} for name in times]


def affinity() -> set:
    """This thread's CPUs (empty where the platform cannot set them)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else set()


def serial_in_child(cpus) -> list:
    """Rank 0 of a bigger job: the overhead section in a child process that is a job of its own,
    on ``cpus``. Not in this process: fastpar numbers a process's inits, and a 1-rank init here
    would leave rank 0's later inits out of step with the other ranks'."""
    bound = affinity()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "serial.json")
        if cpus:
            os.sched_setaffinity(0, cpus)  # this thread's CPUs: the child inherits them
        try:
            subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:],
                            "--layouts", "none", "--json", out],
                           env={**os.environ, "FASTPAR_LAUNCHER": "single"}, check=True)
        finally:
            if cpus:
                os.sched_setaffinity(0, bound)
        with open(out) as f:
            return json.load(f)["records"]


def candidate_layouts(args, world: int) -> tuple:
    """``([(tp, pp, zero)], [skip reasons])``: every (tp, pp) that divides ``world`` and fits."""
    cfg = model_config(trainer_args(argv_for(args)))
    found, skipped = [], []
    for tp in (d for d in range(1, world + 1) if world % d == 0):
        for pp in (d for d in range(1, world // tp + 1) if (world // tp) % d == 0):
            dp, m = world // (tp * pp), args.microbatches or 2 * pp
            why = None
            try:
                cfg.validate(tp)
            except ValueError as exc:
                why = str(exc)
            if why is None and pp > cfg.layers + 2:
                why = f"{cfg.layers + 2} layers (embedding, {cfg.layers} blocks, head) < pp {pp}"
            if why is None and args.global_batch % (dp * m):
                why = f"global batch {args.global_batch} not divisible by dp {dp} x m {m}"
            if why is not None:
                skipped.append(f"{layout_name(tp, pp, dp, False)}: {why}")
                continue
            found += [(tp, pp, False)] + ([(tp, pp, True)] if dp > 1 else [])
    return found, skipped


def chosen_layouts(args, world: int) -> tuple:
    if args.layouts == "none" or world == 1:
        return [], []
    fitting, skipped = candidate_layouts(args, world)
    if args.layouts == "all":
        return fitting, skipped
    chosen = []
    for name in (s.strip() for s in args.layouts.split(",") if s.strip()):
        match = re.fullmatch(r"(?:tp(\d+))?-?(?:pp(\d+))?-?(?:dp(\d+))?(\+zero)?", name)
        if not match or not any(match.groups()[:3]):
            raise SystemExit(f"--layouts: cannot read {name!r} (e.g. tp2-pp2, dp4, tp2-dp2+zero)")
        tp, pp = int(match[1] or 1), int(match[2] or 1)
        if world % (tp * pp) or (match[3] and int(match[3]) != world // (tp * pp)):
            raise SystemExit(f"--layouts: {name} does not fit {world} ranks (tp x pp x dp)")
        chosen.append((tp, pp, bool(match[4])))
    return chosen, []


def measure_layout(args, tp: int, pp: int, zero: bool, threads: int,
                   engine: str = "default") -> dict:
    """One layout over the world: the slowest rank's step times, the last step's loss.
    ``engine``: forced for the job's collectives and P2P (the job reads FASTPAR_COMM_BACKEND
    once, at its first use of fastpar.comm), or ``default``."""
    torch.set_num_threads(threads)  # fastpar.init may lower it to the rank's CPU share
    saved = os.environ.pop("FASTPAR_COMM_BACKEND", None)
    if engine != "default":
        os.environ["FASTPAR_COMM_BACKEND"] = engine
    try:
        trainer = Trainer(trainer_args(argv_for(args, tp, pp, zero)))
    finally:
        os.environ.pop("FASTPAR_COMM_BACKEND", None)
        if saved is not None:
            os.environ["FASTPAR_COMM_BACKEND"] = saved
    try:
        topo, times = trainer.topo, []
        for step in range(args.warmup + args.steps):
            dist.barrier()  # every rank starts the step together
            start = time.perf_counter()
            loss, _ = trainer.train_step(step)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        row = {"section": "layout", "variant": "fastpar", "engine": engine,
               "layout": layout_name(tp, pp, topo.dp_size, zero), "tp": tp, "pp": pp,
               "dp": topo.dp_size, "zero": zero, "microbatches": trainer.microbatches,
               "world_size": topo.world_size, "threads": torch.get_num_threads(),
               "params": trainer.cfg.num_params(), "final_loss": loss,
               "tokens": args.global_batch * trainer.cfg.seq_len, "_seconds": slowest.tolist()}
        trainer.pipe.close()
    finally:
        fastpar.shutdown()
    return row


def measure_engines(args, tp: int, pp: int, zero: bool) -> list:
    """One layout under every ``--engines`` setting, ``--repeats`` rounds in alternating order;
    one row per setting, its steps pooled over the rounds."""
    runs = {e: [] for e in args.engines}
    for rep in range(args.repeats):
        for engine in (args.engines if rep % 2 == 0 else args.engines[::-1]):
            runs[engine].append(measure_layout(args, tp, pp, zero, args.threads, engine))
    rows = []
    for engine, got in runs.items():
        row = dict(got[-1])
        row.update(summary([s for r in got for s in r.pop("_seconds")], row["tokens"]))
        row["repeats"] = len(got)
        rows.append(row)
    for row in rows:
        row["vs_first_engine"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row.pop("_seconds", None)
    return rows


def print_overhead(rows: list, args) -> None:
    f, p = rows
    print(f"# fastpar {fastpar.__version__} train throughput: {args.preset} preset "
          f"({f['params'] / 1e6:.2f} M params), global batch {args.global_batch} = "
          f"{f['tokens_per_s'] * f['step_ms'] / 1e3:.0f} tokens/step in {f['microbatches']} "
          f"microbatches; 1 rank, {f['threads']} thread(s) ({CPUS} CPUs); median of "
          f"{args.steps} interleaved steps after {args.warmup} warm-up")
    print(f"{'variant':>8} {'step(ms)':>9} {'min-max(ms)':>14} {'tokens/s':>9} {'loss':>8}")
    for r in rows:
        spread = f"{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}"
        print(f"{r['variant']:>8} {r['step_ms']:9.1f} {spread:>14} {r['tokens_per_s']:9.0f} "
              f"{r['final_loss']:8.4f}")
    ratio = f["tokens_per_s"] / p["tokens_per_s"]
    print(f"# fastpar / plain tokens/s = {ratio:.3f} (target >= {TARGET}: "
          f"{'met' if ratio >= TARGET else 'missed'}); loss diff max {f['loss_diff_max']:.1e}",
          flush=True)


def print_layouts(rows: list, base, world: int, args) -> None:
    threads = sorted({r["threads"] for r in rows})
    print(f"\n# layouts: {world} ranks on {CPUS} CPUs, {'/'.join(map(str, threads))} "
          f"thread(s) per rank{' (oversubscribed: ranks share cores)' if world > CPUS else ''};"
          f" schedule {args.schedule}; median of {args.steps} steps after {args.warmup} warm-up "
          f"(slowest rank); vs 1 rank: tokens/s over 1-rank fastpar's"
          f"{'' if base else ' (not measured)'}")
    print(f"{'layout':>14} {'engine':>8} {'tp':>3} {'pp':>3} {'dp':>3} {'zero':>5} {'m':>3} "
          f"{'step(ms)':>9} {'min-max(ms)':>14} {'tokens/s':>9} {'loss':>8} {'vs 1 rank':>10} "
          f"{'vs first':>9}")
    for r in rows:
        spread = f"{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}"
        vs = f"{r['vs_1rank']:.2f}x" if r["vs_1rank"] is not None else "-"
        print(f"{r['layout']:>14} {r['engine']:>8} {r['tp']:>3} {r['pp']:>3} {r['dp']:>3} "
              f"{'yes' if r['zero'] else 'no':>5} {r['microbatches']:>3} {r['step_ms']:9.1f} "
              f"{spread:>14} {r['tokens_per_s']:9.0f} {r['final_loss']:8.4f} {vs:>10} "
              f"{r['vs_first_engine']:8.2f}x")


def main() -> int:
    args = parse_args()
    world, lead, serial = launched_world_size(), True, []
    layouts, skipped = chosen_layouts(args, world)  # a bad --layouts fails before any timing
    if world == 1:
        serial = measure_serial(args, args.threads)
        print_overhead(serial, args)
    else:
        cpus = affinity()  # before fastpar.init binds this rank to its share
        lead = fastpar.init(timeout=args.timeout).rank == 0  # MPI starts on all ranks together
        try:
            if lead:
                serial = serial_in_child(cpus)  # it prints the overhead table
            dist.barrier()  # the other ranks wait here meanwhile
        finally:
            fastpar.shutdown()
    rows = [measure_engines(args, tp, pp, zero) for tp, pp, zero in layouts]
    rows = [r for per_layout in rows for r in per_layout]
    base = serial[0]["tokens_per_s"] if serial else None
    for r in rows:
        r["vs_1rank"] = r["tokens_per_s"] / base if base else None
    if not lead:
        return 0
    if rows:
        print_layouts(rows, base, world, args)
    for line in skipped:
        print(f"# skipped {line}")
    if args.json:
        config = {k: getattr(args, k) for k in ("preset", "global_batch", "microbatches",
                                                 "schedule", "seed", "warmup", "steps")}
        env = {"world_size": world, "cpus": CPUS, "torch": torch.__version__,
               "fastpar": fastpar.__version__}
        fastpar_tps, plain_tps = serial[0]["tokens_per_s"], serial[1]["tokens_per_s"]
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"env": env, "config": config, "fastpar_over_plain":
                       fastpar_tps / plain_tps, "records": serial + rows}, f, indent=1)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
