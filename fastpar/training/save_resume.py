"""The main job's checkpoints: save, refuse to overwrite, resume under any layout.

    ckpts = Checkpoints(writer, pipe, setup, sched, run_identity(cfg, args, steps, topo),
                        steps, directory="ckpt", sync=False, hold=True, lead=rank == 0)
    start = ckpts.resume("ckpt")     # weights, optimizer, LR schedule; returns the step
    ckpts.check_directory(start)     # before training: never overwrite a later step
    ckpts.save(step)                 # collective; every rank writes its pieces
    ckpts.finish()                   # the save in flight committed

They take the state they save (the stages, the optimizer set-up, the scheduler, the step), not
the trainer. A checkpoint is sharded (``fastpar.checkpoint``):
every rank writes the pieces it owns, in the background unless ``--sync-save``, and any tp /
pp / dp / ZeRO stage of the same model loads it reading only its slices; the serial layout of
earlier releases (``fastpar.checkpoint.serial``) still loads, and ``python -m
fastpar.checkpoint export`` writes it. The metadata records the model, the data stream (seed,
global batch), the layout it was saved under and the learning-rate schedule, and a resume checks
each against this run. A ``--dtype bfloat16`` run saves its float32 master weights and float32
optimizer state, so it resumes exactly, and a checkpoint loads under either dtype (a bf16
model takes the masters rounded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

from fastpar.checkpoint import loading, serial, store
from fastpar.optim import DistributedOptimizer, MasterWeights
from fastpar.state_dict import full_state_dict, load_full_state_dict
from fastpar.training.args import lr_at, lr_schedule
from fastpar.training.serial_optimizer import load_serial_optimizer_state, swapped


def run_identity(cfg, args, steps: int, topo) -> dict:
    """What a checkpoint says of the run that saved it, and a resume checks: the model, the
    data stream (seed, global batch), the learning-rate schedule, the layout, the dtype."""
    return {"model": dataclasses.asdict(cfg), "seed": args.seed,
            "global_batch": args.global_batch, "schedule": lr_schedule(args, steps),
            "layout": {"tp": topo.tp_size, "pp": topo.pp_size, "dp": topo.dp_size,
                       "cp": topo.cp_size, "zero": args.zero},
            "dtype": args.dtype}


class Checkpoints:
    """The main job's checkpoints of the state they save: this rank's stages (``pipe``), the
    optimizer set-up (``setup``: its optimizer, ``gathered()``), the LR scheduler, and the data
    position (the step: the batches are a function of (seed, step)). ``writer``: the
    ``ShardedCheckpointer`` (None: no ``--save`` or ``--resume``); ``identity``:
    ``run_identity``; ``steps``: the run's length; ``directory``: ``--save``; ``sync``:
    ``--sync-save``; ``hold``: the writer reads the state where it lies (CPU); ``lead``: this
    rank says what happens."""

    def __init__(self, writer, pipe, setup, sched, identity: dict, steps: int,
                 directory: str | None, sync: bool, hold: bool, lead: bool):
        self.writer, self.pipe, self.setup, self.sched = writer, pipe, setup, sched
        self.identity, self.steps, self.directory = identity, steps, directory
        self.sync, self.hold, self.lead = sync, hold, lead
        self.said = None  # the last save the log has announced as committed

    def meta(self) -> dict:
        """The metadata of a checkpoint saved now: the run's identity and the scheduler."""
        return {**self.identity, "scheduler": scheduler_state(self.sched)}

    def save(self, step: int) -> None:
        """Collective: every rank writes its pieces of step ``step`` (``fastpar.checkpoint``);
        an async save returns once they are staged, and the previous one must have
        committed."""
        self.finish()  # the previous save, if any, committed (or its error raised)
        t0 = time.perf_counter()
        # async: on the CPU the writer reads the weights and optimizer state where they lie
        # while the next step's forward and backward run (the trainer waits before its
        # optimizer step); on a GPU they are first copied to a host staging buffer
        path = self.writer.save(self.directory, step, self.pipe, self.setup.opt,
                                meta=self.meta(), async_save=not self.sync, hold=self.hold)
        if self.lead:
            took = time.perf_counter() - t0
            if path is not None:
                print(f"[fastpar.train] saved step {step} to {path} ({took:.2f} s)", flush=True)
            else:
                print(f"[fastpar.train] saving step {step} in the background (set up in "
                      f"{took:.2f} s)", flush=True)

    def wait_for_reads(self) -> None:
        """Before an optimizer step: an async save has read the weights and the state (its
        commit goes on; the next save or ``finish`` waits for it). Nothing without a writer."""
        if self.writer is not None:
            self.writer.wait_for_reads()

    def finish(self) -> None:
        """Wait for the save in flight, if any (collective outcome: it raises on every
        rank)."""
        if self.writer is None:
            return
        path = self.writer.wait()
        if path is not None and path != self.said and self.lead and not self.sync:
            print(f"[fastpar.train] saved {path} (written in the background)", flush=True)
        self.said = path

    def check_directory(self, start: int) -> None:
        """Before training, not at the first save: checkpoints this run would have to
        overwrite (a finished run's) are an error; checkpoints are never overwritten."""
        if not self.directory or not os.path.isdir(self.directory):
            return
        later = [store.step_name(s) for s in sorted(store.step_dirs(self.directory))
                 if s > start]
        if later:
            raise ValueError(f"--save {self.directory} already holds checkpoints past step "
                             f"{start} ({', '.join(later[:3])}"
                             f"{', ...' if len(later) > 3 else ''}): resume from it (--resume "
                             f"{self.directory}) or save elsewhere")

    def check_meta(self, meta: dict, path: str, step: int) -> None:
        """The checkpoint is of this model, data stream and run length; else ValueError."""
        if meta.get("weights"):  # python -m fastpar.quantize's
            raise ValueError(f"checkpoint {path} holds {meta['weights']['format']} weights "
                             "(python -m fastpar.quantize): quantized models run (generate, "
                             "evaluate) but do not train; resume the float checkpoint")
        saved, mine = meta.get("model", {}), self.identity["model"]
        # may change on resume (context_parallel: cp shards no parameter)
        free = ("sequence_parallel", "overlap", "dropout", "recompute", "context_parallel")
        diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in mine.items()
                if k not in free and saved.get(k) != v]
        if diff:
            raise ValueError(f"checkpoint {path} was saved from a different model: "
                             + "; ".join(diff))
        data = [f"{k}: checkpoint {meta.get(k)!r}, this run {self.identity[k]!r}"
                for k in ("seed", "global_batch") if meta.get(k) != self.identity[k]]
        # the batches are a function of (seed, step) and the global batch: at step 0 (a
        # pruned model's checkpoint) none has been drawn, so any stream continues it
        if data and step > 0:
            raise ValueError(f"checkpoint {path} was trained on another data stream: "
                             + "; ".join(data) + " (pass the same --seed and --global-batch)")
        if step > self.steps:
            raise ValueError(f"checkpoint {path} is at step {step}, past --steps {self.steps}")

    def resume(self, where: str) -> int:
        """Load a checkpoint saved under any layout of the same model (sharded, or the serial
        format of earlier releases); returns its step, where the run continues."""
        directory = store.step_dir_of(where)
        weights_only = False  # a pruned model's: the optimizer and its schedule start fresh
        if store.record_of(directory) == "index.json":
            _, index = loading.read_index(directory)
            meta, step = index["meta"], int(index["step"])
            self.check_meta(meta, directory, step)
            self.writer.load(directory, self.pipe, self.setup.opt)  # its slices, verified
            weights_only = not index["tensors"]["optimizer"]
        else:
            meta, step = self.resume_serial(directory)
        opt, sched = self.setup.opt, self.sched
        sched.load_state_dict({**sched.state_dict(), **meta.get("scheduler", {})})
        # This run's flags make the schedule (the same flags: the checkpoint's, bit for bit):
        # the next step runs at this schedule's rate, and so do the ones after it.
        schedule = self.identity["schedule"]
        sched.base_lrs = [schedule["lr"]] * len(opt.param_groups)
        sched._last_lr = [lr_at(schedule, step)] * len(opt.param_groups)
        for group, lr in zip(opt.param_groups, sched.get_last_lr()):
            group["lr"] = lr
        if self.lead:
            lay = meta.get("layout", {})
            print(f"[fastpar.train] resumed {directory} at step {step} (saved under tp "
                  f"{lay.get('tp')} pp {lay.get('pp')} dp {lay.get('dp')} cp "
                  f"{lay.get('cp', 1)})", flush=True)
            if weights_only:
                print(f"[fastpar.train] note: {directory} holds weights only (no optimizer "
                      "state): the optimizer starts fresh", flush=True)
            # a pruned model's checkpoint has no schedule to change from: this run's starts
            if ("schedule" in meta or not weights_only) and \
                    (note := schedule_change(schedule, meta.get("schedule"), step)) is not None:
                print(f"[fastpar.train] note: {note}", flush=True)
        return step

    def resume_serial(self, directory: str) -> tuple[dict, int]:
        """A serial-layout checkpoint (``fastpar.checkpoint.serial``): read whole on every
        rank, each rank keeps its shards."""
        c = serial.load(directory)
        self.check_meta(c.meta, c.path, c.step)
        model, opt = self.setup.model, self.setup.opt
        with self.setup.gathered():
            expected = {k: tuple(v.shape) for k, v in full_state_dict(model).items()}
        serial.check_model_shapes(expected, c.model, c.path)
        # ZeRO-3: loaded into the gathered parameters, then into the masters; bf16 without
        # ZeRO: the float32 masters exact, the bf16 weights rounded from them
        with self.setup.gathered(), masters_in_place(opt):
            load_full_state_dict(model, c.model)
            load_serial_optimizer_state(self.pipe, opt, c.optimizer,
                                        c.meta.get("optimizer_scalars", {}))
        return c.meta, c.step


def schedule_change(schedule: dict, saved: dict | None, step: int) -> str | None:
    """What changes in the learning rate when this run's schedule (``lr_schedule``: --lr,
    --steps, --warmup, --min-lr-ratio) differs from the checkpoint's (None: nothing
    changes)."""
    now = lr_at(schedule, step)
    if saved is None:
        return (f"the checkpoint does not record its learning-rate schedule; this run's (lr "
                f"{schedule['lr']:g}, warm-up {schedule['warmup']}, decay to step "
                f"{schedule['steps']}) gives step {step} a rate of {now:.3g}")
    saved = {**schedule, **saved}  # a key the checkpoint lacks: unchanged
    if saved == schedule:
        return None
    changed = ", ".join(f"{k} {saved[k]:g} -> {schedule[k]:g}" for k in schedule
                        if saved[k] != schedule[k])
    return (f"the learning-rate schedule changes ({changed}): at step {step} the rate "
            f"goes from {lr_at(saved, step):.3g} to {now:.3g}")


def masters_in_place(opt):
    """Where the weights of record are: ``opt``'s float32 masters for a bf16 run
    (``fastpar.optim.MasterWeights``, or ZeRO's masters: collective over dp), else the
    parameters themselves. Inside, each parameter's ``.data`` is its master."""
    if isinstance(opt, MasterWeights):
        return opt.masters_as_params()
    if isinstance(opt, DistributedOptimizer) and any(
            f.master.dtype != f.params[0].dtype for f in opt.flat if f.params):
        masters = opt.master_weights()
        params = list(masters)
        return swapped(params, [masters[p] for p in params])
    return contextlib.nullcontext()


def scheduler_state(sched) -> dict:
    """The LR scheduler's JSON-able state (LambdaLR keeps its lambdas out of it)."""
    return {k: v for k, v in sched.state_dict().items()
            if isinstance(v, (int, float, list, bool, type(None)))}
