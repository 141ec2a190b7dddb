"""The main job's checkpoints: save, refuse to overwrite, resume under any layout.

    from fastpar.training import save_resume
    save_resume.check_save_dir(trainer)    # before training: never overwrite a later step
    save_resume.resume(trainer, "ckpt")    # weights, optimizer, LR schedule, step
    save_resume.save(trainer, step)        # collective; every rank writes its pieces

``trainer`` is a ``fastpar.training.trainer.Trainer``. A checkpoint is sharded (``fastpar.checkpoint``):
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


from fastpar.training.args import lr_at, lr_schedule


def run_meta(t) -> dict:
    return {"model": dataclasses.asdict(t.cfg), "seed": t.args.seed,
            "global_batch": t.args.global_batch, "scheduler": scheduler_state(t.sched),
            "schedule": lr_schedule(t.args, t.steps),
            "layout": {"tp": t.topo.tp_size, "pp": t.topo.pp_size, "dp": t.topo.dp_size,
                       "cp": t.topo.cp_size, "zero": t.args.zero},
            "dtype": t.args.dtype}


def save(t, step: int) -> None:
    """Collective: every rank writes its pieces of step ``step`` (``fastpar.checkpoint``); an
    async save returns once they are staged, and the previous one must have committed."""
    finish_saves(t)  # the previous save, if any, committed (or its error raised)
    t0 = time.perf_counter()
    # async: on the CPU the writer reads the weights and optimizer state where they lie while
    # the next step's forward and backward run (the trainer waits before its optimizer step);
    # on a GPU they are first copied to a host staging buffer
    path = t.ckpt.save(t.args.save, step, t.pipe, t.opt, meta=run_meta(t),
                       async_save=not t.args.sync_save, hold=t.topo.device.type == "cpu")
    if t.topo.rank == 0:
        took = time.perf_counter() - t0
        if path is not None:
            print(f"[fastpar.train] saved step {step} to {path} ({took:.2f} s)", flush=True)
        else:
            print(f"[fastpar.train] saving step {step} in the background (set up in "
                  f"{took:.2f} s)", flush=True)


def finish_saves(t) -> None:
    """Wait for the save in flight, if any (collective outcome: it raises on every rank)."""
    path = t.ckpt.wait()
    if path is not None and path != t.ckpt_said and t.topo.rank == 0 and not t.args.sync_save:
        print(f"[fastpar.train] saved {path} (written in the background)", flush=True)
    t.ckpt_said = path


def check_save_dir(t) -> None:
    """Before training, not at the first save: checkpoints this run would have to overwrite
    (a finished run's) are an error; checkpoints are never overwritten."""
    save = t.args.save
    if not save or not os.path.isdir(save):
        return
    from fastpar.checkpoint import store

    later = [store.step_name(s) for s in sorted(store.step_dirs(save)) if s > t.start]
    if later:
        raise ValueError(f"--save {save} already holds checkpoints past step {t.start} "
                         f"({', '.join(later[:3])}{', ...' if len(later) > 3 else ''}): "
                         f"resume from it (--resume {save}) or save elsewhere")


def check_meta(t, meta: dict, path: str, step: int) -> None:
    """The checkpoint is of this model, data stream and run length; else ValueError."""
    saved = meta.get("model", {})
    mine = dataclasses.asdict(t.cfg)
    # may change on resume (context_parallel: cp shards no parameter)
    free = ("sequence_parallel", "overlap", "dropout", "recompute", "context_parallel")
    diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in mine.items()
            if k not in free and saved.get(k) != v]
    if diff:
        raise ValueError(f"checkpoint {path} was saved from a different model: "
                         + "; ".join(diff))
    data = [f"{k}: checkpoint {meta.get(k)!r}, this run {v!r}"
            for k, v in (("seed", t.args.seed), ("global_batch", t.args.global_batch))
            if meta.get(k) != v]
    if data:  # the batches are a function of (seed, step) and the global batch
        raise ValueError(f"checkpoint {path} was trained on another data stream: "
                         + "; ".join(data) + " (pass the same --seed and --global-batch)")
    if step > t.steps:
        raise ValueError(f"checkpoint {path} is at step {step}, past --steps {t.steps}")


def resume(t, where: str) -> None:
    """Continue from a checkpoint saved under any layout of the same model (sharded, or the
    serial format of earlier releases)."""
    from fastpar.checkpoint import loading, store

    directory = store.step_dir_of(where)
    if store.record_of(directory) == "index.json":
        _, index = loading.read_index(directory)
        meta, step = index["meta"], int(index["step"])
        check_meta(t, meta, directory, step)
        t.ckpt.load(directory, t.pipe, t.opt)  # each rank reads its slices, verified
    else:
        meta, step = _resume_serial(t, directory)
    t.sched.load_state_dict({**t.sched.state_dict(), **meta["scheduler"]})
    # This run's flags make the schedule (the same flags: the checkpoint's, bit for bit): the
    # next step runs at this schedule's rate, and so do the ones after it.
    schedule = lr_schedule(t.args, t.steps)
    t.sched.base_lrs = [schedule["lr"]] * len(t.opt.param_groups)
    t.sched._last_lr = [lr_at(schedule, step)] * len(t.opt.param_groups)
    for group, lr in zip(t.opt.param_groups, t.sched.get_last_lr()):
        group["lr"] = lr
    t.start = step
    if t.topo.rank == 0:
        lay = meta.get("layout", {})
        print(f"[fastpar.train] resumed {directory} at step {step} (saved under tp "
              f"{lay.get('tp')} pp {lay.get('pp')} dp {lay.get('dp')} cp {lay.get('cp', 1)})",
              flush=True)
        if (note := schedule_change(t, meta.get("schedule"), step)) is not None:
            print(f"[fastpar.train] note: {note}", flush=True)


def _resume_serial(t, directory: str) -> tuple[dict, int]:
    """A serial-layout checkpoint (``fastpar.checkpoint.serial``): read whole on every rank,
    each rank keeps its shards."""
    import fastpar
    from fastpar.checkpoint import serial as ckpt
    from fastpar.training.serial_optimizer import load_serial_optimizer_state

    c = ckpt.load(directory)
    check_meta(t, c.meta, c.path, c.step)
    with t.gathered():
        expected = {k: tuple(v.shape) for k, v in fastpar.full_state_dict(t.model).items()}
    ckpt.check_model_shapes(expected, c.model, c.path)
    # ZeRO-3: loaded into the gathered parameters, then into the masters; bf16 without ZeRO:
    # the float32 masters exact, the bf16 weights rounded from them
    with t.gathered(), masters_in_place(t.opt):
        fastpar.load_full_state_dict(t.model, c.model)
        load_serial_optimizer_state(t.pipe, t.opt, c.optimizer,
                                    c.meta.get("optimizer_scalars", {}))
    return c.meta, c.step


def schedule_change(t, saved: dict | None, step: int) -> str | None:
    """What changes in the learning rate when this run's --lr, --steps, --warmup or
    --min-lr-ratio differ from the checkpoint's (None: nothing changes)."""
    schedule = lr_schedule(t.args, t.steps)
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
    from fastpar.optim import DistributedOptimizer, MasterWeights
    from fastpar.training.serial_optimizer import swapped

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
