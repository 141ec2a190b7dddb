"""Checkpoint save and load: the gathered serial format against the sharded one, sync and async.

    mpirun -np 4 python bench/checkpoint.py          # tiny GPT and a 20x+ larger one
    mpirun -np 4 python bench/checkpoint.py --models big --json bench/out/checkpoint.json

For each model, a trainer at ``--save-layout`` (default tp 2 x pp 2) builds the model and
AdamW (``fastpar.training.trainer.Trainer``), takes a step so the optimizer has state, and measures:
  gathered save   the serial layout gathered on every rank, rank 0 writing it (the format
                  before sharding: full_state_dict + serial_optimizer_state +
                  fastpar.checkpoint.serial.save)
  sharded save    every rank writes its pieces (ShardedCheckpointer.save, synchronous)
  async stall     what an async save costs the training: save() returning plus how much
                  longer the next training step takes while the pieces are written behind it,
                  against a plain step just before it (median over ``--repeat`` pairs, the
                  kinds alternating); "staged" copies the pieces to a staging buffer first
                  (the first such save, allocating the buffer, is timed apart),
                  "held" writes them where they lie and the step waits for the write before
                  its optimizer update (what fastpar.train does on the CPU); "none" pairs two
                  plain steps alike: the stall the step's own variation reads as (the floor);
                  "blocked": the part the training waited on (save() returning + the step's
                  wait_for_reads), the rest being the writer's competition for the machine
  load            both formats, at the saved layout; then a second trainer (the same
                  processes) at ``--load-layout`` (default dp 4 with ZeRO-1) saves its own
                  checkpoint and loads it ("load 2") and the first layout's ("resharded"),
                  alternating, ``--repeat`` times each: the fastest of each (the median in
                  the JSON)
Times are the slowest rank's; a synchronous sharded save is the median of ``--repeat`` (the
gathered save is timed once: it takes seconds at the larger model). Rank 0's
extra memory during a save is its resident set sampled every millisecond by a thread, peak
minus the level before the save (the largest over the rounds): the gathered format holds
the whole model and optimizer state there (twice: tensors and serialised bytes), the sharded
one its own pieces (sync: nothing more; async: the staging copy). The table also gives the
checkpoint's bytes over the save time against the disk's rate (a ``--disk-mib`` write + fsync
into the same directory, measured first).

Targets (issue 22): rank 0's peak during a save no more than its own shards + staging; the
async stall at most 10% of a synchronous save; load at a new layout no slower than at the
saved one (the same target layout loading its own checkpoint).
"""

import json
import os
import shutil
import statistics
import tempfile
import threading
import time

import torch

torch.set_num_threads(1)

from fastpar.runtime.cli import Parser  # noqa: E402

MODELS = {  # name -> the trainer's model flags
    "tiny": ["--preset", "tiny"],
    "big": ["--preset", "tiny", "--layers", "8", "--hidden", "384", "--heads", "8",
            "--kv-heads", "4"],
}
SAVE_LAYOUT, LOAD_LAYOUT = "--tp 2 --pp 2", "--zero 1"
MiB = 2**20


class RssPeak:
    """The resident set's peak above its level at start, sampled by a thread."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self.now()
        self.done = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def run(self):
        while not self.done:
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def stop(self) -> int:
        self.done = True
        self.thread.join()
        return max(self.peak, self.now()) - self.base


def slowest(seconds: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed(fn):
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return slowest(time.perf_counter() - t0), out


def gathered_save(t, root, step):
    import fastpar
    from fastpar.checkpoint import serial
    from fastpar.training.save_resume import masters_in_place
    from fastpar.training.serial_optimizer import serial_optimizer_state

    with t.setup.gathered(), masters_in_place(t.opt):
        weights = fastpar.full_state_dict(t.model)
    tensors, scalars = serial_optimizer_state(t.pipe, t.opt)
    if t.topo.rank == 0:
        serial.save(root, step, model=weights, optimizer=tensors,
                    meta={**t.checkpoints.meta(), "optimizer_scalars": scalars})
    del weights, tensors


def run_layout(args, model, mode, layout, base) -> dict:
    """One trainer at ``layout``: saves (mode "save") and loads; its records, every rank's."""
    import torch.distributed as dist

    import fastpar
    from fastpar.training.args import parse_args
    from fastpar.training.trainer import Trainer

    argv = [*MODELS[model], *layout.split(), "--steps", "10", "--no-progress", "--plot", "",
            "--save", os.path.join(base, "unused"), "--sync-save",
            *(["--data", args.data] if args.data else [])]
    t = Trainer(parse_args(argv))
    rec = {"model": model, "layout": layout, "rank": t.topo.rank, "params": t.cfg.num_params()}
    t.train_step(0)
    directory = os.path.join(base, model)
    gdir, sdir = os.path.join(directory, "gathered"), os.path.join(directory, "sharded")
    reps = args.repeat
    if mode == "save":
        peak = RssPeak()
        rec["gathered_save_s"], _ = timed(lambda: gathered_save(t, gdir, 1))
        rec["gathered_rank0_extra"] = peak.stop()
        syncs, extras = [], []
        for i in range(reps):  # step 1 is kept for the loads; the others are removed
            peak = RssPeak()
            syncs.append(timed(lambda: t.ckpt.save(sdir, 1 + 100 * i, t.pipe, t.opt,
                                                  meta=t.checkpoints.meta(), keep=None))[0])
            extras.append(peak.stop())
            if i:
                _drop_step(t, sdir, 1 + 100 * i)
        rec["sharded_save_s"], rec["sharded_save_all_s"] = statistics.median(syncs), syncs
        rec["sharded_rank0_extra"] = max(extras)
        # staged: the first save allocates the staging buffer (timed apart), the later ones
        # reuse it; held (what the trainer does on the CPU): no copy, the step waits for the
        # write before its update. Each save's step is paired with a plain step just before it,
        # and the kinds alternate, so the machine's drift falls on both sides of a pair.
        rec["staged_first_stage_s"], _ = timed(lambda: t.ckpt.save(
            sdir, 2, t.pipe, t.opt, meta=t.checkpoints.meta(), async_save=True, keep=None))
        t.train_step(2)
        t.ckpt.wait()
        _drop_step(t, sdir, 2)
        # "none": two plain steps, the second in place of a save's: its "stall" is what the
        # step's own variation alone reads as one (the measurement's floor)
        kinds = ("staged", "held", "none")
        pairs = {kind: [] for kind in kinds}
        for i in range(reps):
            for kind in kinds[i % 3:] + kinds[:i % 3]:
                plain, _ = timed(lambda: t.train_step(3))
                step = 3 + 100 * i + kinds.index(kind)
                peak = RssPeak()
                stage = 0.0
                if kind != "none":
                    stage, _ = timed(lambda: t.ckpt.save(sdir, step, t.pipe, t.opt,
                                                         meta=t.checkpoints.meta(),
                                                         async_save=True, keep=None,
                                                         hold=kind == "held"))
                t.ckpt.read_wait_s = 0.0
                during, _ = timed(lambda: t.train_step(step))  # waits before its update
                extra = peak.stop()
                blocked = slowest(t.ckpt.read_wait_s)
                t.ckpt.wait()
                pairs[kind].append((plain, stage, during, extra, blocked))
                if kind != "none":
                    _drop_step(t, sdir, step)
        rec["write_cpu_s"] = slowest(t.ckpt.write_cpu_s)
        rec["step_s"] = statistics.median(p[0] for ps in pairs.values() for p in ps)
        for kind, ps in pairs.items():
            stalls = [stage + max(0.0, during - plain) for plain, stage, during, *_ in ps]
            rec[f"{kind}_stall_s"], rec[f"{kind}_stall_all_s"] = statistics.median(stalls), stalls
            rec[f"{kind}_stage_s"] = statistics.median(p[1] for p in ps)
            rec[f"{kind}_step_during_s"] = statistics.median(p[2] for p in ps)
            rec[f"{kind}_rank0_extra"] = max(p[3] for p in ps)
            # what the training waited on: save() returning + the step's wait for the write
            blocked = [stage + wait for _, stage, _, _, wait in ps]
            rec[f"{kind}_blocked_s"], rec[f"{kind}_blocked_all_s"] = \
                statistics.median(blocked), blocked
        rec["staging_bytes"] = t.ckpt._staging.numel()
        rec["own_bytes"] = sum(p.data.numel() * p.data.element_size() for p in
                               _own_pieces(t))
        rec["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(dp, f))
                                      for dp, _, fs in os.walk(os.path.join(sdir,
                                                                            "step_00000001"))
                                      for f in fs)
        rec["gathered_bytes"] = sum(os.path.getsize(os.path.join(dp, f))
                                    for dp, _, fs in os.walk(gdir) for f in fs)
        loads = {"gathered": [(gdir, "")], "sharded": [(sdir, "")]}
    else:  # this layout's own checkpoints (the same layout), beside the first one's (resharded)
        gown, sown = gdir + "-" + mode, sdir + "-" + mode
        gathered_save(t, gown, 1)
        t.ckpt.save(sown, 1, t.pipe, t.opt, meta=t.checkpoints.meta(), keep=None)
        loads = {"gathered": [(gdir, "_resharded"), (gown, "")],
                 "sharded": [(sdir, "_resharded"), (sown, "")]}
    # the loads alternate (resharded, own, resharded, ...): the fastest of each is its time
    # (other work on the machine only adds), the median beside it
    for fmt, sources in loads.items():
        times = {suffix: [] for _, suffix in sources}
        for i in range(reps):
            for directory, suffix in sources if i % 2 == 0 else sources[::-1]:
                path = os.path.join(directory, "step_00000001")
                load = (lambda: t.checkpoints.resume_serial(path)) if fmt == "gathered" else \
                    (lambda: t.ckpt.load(path, t.pipe, t.opt))
                times[suffix].append(timed(load)[0])
        for suffix, ts in times.items():
            rec[f"{fmt}{suffix}_load_s"] = min(ts)
            rec[f"{fmt}{suffix}_load_median_s"] = statistics.median(ts)
    rows = [None] * t.topo.world_size
    dist.all_gather_object(rows, rec)
    fastpar.shutdown()
    return rows


def _drop_step(t, directory: str, step: int) -> None:
    """Remove ``step``'s checkpoint once every rank is past it (collective; the disk holds a
    few checkpoints, not dozens)."""
    import torch.distributed as dist

    from fastpar.checkpoint.store import step_name

    dist.barrier()
    if t.topo.rank == 0:
        shutil.rmtree(os.path.join(directory, step_name(step)), ignore_errors=True)
    dist.barrier()


def _own_pieces(t):
    from fastpar.checkpoint.holdings import model_pieces, optimizer_pieces

    return model_pieces(t.pipe, t.opt) + optimizer_pieces(t.pipe, t.opt)[0]


def disk_rate(directory: str, nbytes: int = 256 * MiB) -> float:
    """Bytes per second of one large write + fsync into ``directory``."""
    path = os.path.join(directory, "disk-rate.bin")
    block = os.urandom(MiB)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // MiB):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    rate = nbytes / (time.perf_counter() - t0)
    os.unlink(path)
    return rate


def main() -> None:
    p = Parser(description=__doc__)
    p.add_argument("--models", default="tiny,big")
    p.add_argument("--save-layout", default=SAVE_LAYOUT)
    p.add_argument("--load-layout", default=LOAD_LAYOUT)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir; "
                   "every rank must see it)")
    p.add_argument("--data", default=None, help="the trainer's --data (default: its stdlib "
                   "corpus; a small text file starts faster)")
    p.add_argument("--disk-mib", type=int, default=256, help="size of the disk-rate probe")
    p.add_argument("--repeat", type=int, default=5, help="rounds of each timed save and load "
                   "(the saves' medians, the loads' fastest)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    p.check(args.repeat >= 1, f"--repeat must be at least 1, got {args.repeat}")
    lead = int(os.environ.get("PMI_RANK", os.environ.get("RANK", "0"))) == 0
    base = args.dir or os.path.join(tempfile.gettempdir(), "fastpar-bench-checkpoint")
    if lead:
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
        rate = disk_rate(base, args.disk_mib * MiB)
        print(f"disk: {rate / MiB:.0f} MiB/s ({args.disk_mib} MiB write + fsync into {base})",
              flush=True)
    table = []
    for model in args.models.split(","):
        saved = run_layout(args, model, "save", args.save_layout, base)
        loaded = run_layout(args, model, "load", args.load_layout, base)
        r0 = saved[0]
        table.append({**{k: v for k, v in r0.items() if k != "rank"},
                      "world": len(saved), "rank0_own_bytes": r0["own_bytes"],
                      **{f"load_{other}_{fmt}{m}_s": loaded[0][f"{fmt}{suffix}_load{m}_s"]
                         for other, suffix in (("other", ""), ("resharded", "_resharded"))
                         for fmt in ("gathered", "sharded") for m in ("", "_median")},
                      "load_layout": args.load_layout,
                      "disk_bytes_per_s": rate if lead else None})
    if not lead:
        return
    shutil.rmtree(base, ignore_errors=True)
    print(f"save and load at {args.save_layout}; at {args.load_layout} (load 2): its own "
          "checkpoint and, resharding, the first layout's")
    print(f"{'model':<6} {'params':>8} {'ckpt MiB':>8} {'format':<9} {'save s':>7} "
          f"{'disk %':>6} {'rank0 +MiB':>10} {'load s':>7} {'load 2 s':>8} "
          f"{'resharded':>9}")
    for r in table:
        mb = r["checkpoint_bytes"] / MiB
        for fmt in ("gathered", "sharded"):
            save = r[f"{fmt}_save_s"]
            print(f"{r['model']:<6} {r['params'] / 1e6:>7.2f}M {mb:>8.1f} {fmt:<9} {save:>7.3f} "
                  f"{100 * r['checkpoint_bytes'] / save / r['disk_bytes_per_s']:>5.0f}% "
                  f"{r[f'{fmt}_rank0_extra'] / MiB:>10.1f} {r[f'{fmt}_load_s']:>7.3f} "
                  f"{r[f'load_other_{fmt}_s']:>8.3f} {r[f'load_resharded_{fmt}_s']:>9.3f}")
        for kind in ("staged", "held"):
            stall = r[f"{kind}_stall_s"] / r["sharded_save_s"]
            first = (f" (the first, allocating the buffer: {r['staged_first_stage_s']:.3f} s)"
                     if kind == "staged" else "")
            print(f"{'':<6} async {kind}: save() returns in {r[f'{kind}_stage_s']:.3f} s{first}, "
                  f"step {r['step_s']:.3f} s -> {r[f'{kind}_step_during_s']:.3f} s while "
                  f"writing; stall {r[f'{kind}_stall_s']:.3f} s = {100 * stall:.0f}% of a sync "
                  f"save (target <= 10%), of which blocked {r[f'{kind}_blocked_s']:.3f} s = "
                  f"{100 * r[f'{kind}_blocked_s'] / r['sharded_save_s']:.0f}%; "
                  f"rank 0 +{r[f'{kind}_rank0_extra'] / MiB:.1f} MiB")
        print(f"{'':<6} (two plain steps, paired alike: the second longer by "
              f"{r['none_stall_s']:.3f} s = {100 * r['none_stall_s'] / r['sharded_save_s']:.0f}%"
              f" of a sync save, the step's own variation: the floor of these stalls)")
        print(f"{'':<6} sharded loads, median of {args.repeat}: {r['sharded_load_median_s']:.3f}"
              f" s; at {args.load_layout}: its own {r['load_other_sharded_median_s']:.3f} s, "
              f"resharded {r['load_resharded_sharded_median_s']:.3f} s")
        print(f"{'':<6} rank 0 owns {r['rank0_own_bytes'] / MiB:.1f} MiB of pieces, staging "
              f"buffer {r['staging_bytes'] / MiB:.1f} MiB; writing a rank's file costs "
              f"{r['write_cpu_s']:.3f} CPU-s (hashing, copies into the page cache), which "
              f"{r['world']} ranks on {os.cpu_count()} cores cannot hide behind compute")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"world": table[0]["world"], "save_layout": args.save_layout,
                       "load_layout": args.load_layout, "rows": table}, fh, indent=1)


if __name__ == "__main__":
    main()
