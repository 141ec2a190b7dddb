"""The main job's checkpoints: save, refuse to overwrite, resume under any layout.

    from fastpar.training import run_state
    run_state.check_save_dir(trainer)          # before training: never overwrite a later step
    run_state.resume(trainer, "ckpt")          # weights, optimizer, LR schedule, step
    run_state.save(trainer, step)              # collective; rank 0 writes

``trainer`` is a ``fastpar.train.Trainer``. A checkpoint holds the serial layout (safetensors,
``fastpar.training.checkpoint``), so any tp / pp / dp of the same model loads it; its metadata
records the model, the data stream (seed, global batch), the layout it was saved under and the
learning-rate plan, and a resume checks each against this run. A ``--dtype bfloat16`` run saves
its float32 master weights and float32 optimizer state, so it resumes exactly, and a checkpoint
loads under either dtype (a bf16 model takes the masters rounded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from fastpar.training.args import lr_at, lr_plan


def save(t, step: int) -> None:
    """Collective: gather the serial layout of ``t`` (a Trainer), rank 0 writes it atomically."""
    import fastpar
    from fastpar.training import checkpoint as ckpt
    from fastpar.training.state import serial_optimizer_state

    # ZeRO-3: the full parameters of this rank's stage; a bf16 run's weights are its float32
    # masters
    with t.gathered(), masters_in_place(t.opt):
        weights = fastpar.full_state_dict(t.model)
    opt_tensors, scalars = serial_optimizer_state(t.pipe, t.opt)
    if t.topo.rank == 0:
        meta = {"model": dataclasses.asdict(t.cfg), "seed": t.args.seed,
                "global_batch": t.args.global_batch, "optimizer_scalars": scalars,
                "scheduler": scheduler_state(t.sched),
                "schedule": lr_plan(t.args, t.steps),
                "layout": {"tp": t.topo.tp_size, "pp": t.topo.pp_size, "dp": t.topo.dp_size,
                           "zero": t.args.zero},
                "dtype": t.args.dtype}
        path = ckpt.save(t.args.save, step, model=weights, optimizer=opt_tensors, meta=meta)
        print(f"[fastpar.train] saved step {step} to {path}", flush=True)
    torch.distributed.barrier()


def check_save_dir(t) -> None:
    """Before training, not at the first save: checkpoints this run would have to overwrite
    (a finished run's) are an error; checkpoints are never overwritten."""
    save = t.args.save
    if not save or not os.path.isdir(save):
        return
    later = sorted(d for d in os.listdir(save) if d.startswith("step_")
                   and d[5:].isdigit() and int(d[5:]) > t.start)
    if later:
        raise ValueError(f"--save {save} already holds checkpoints past step {t.start} "
                         f"({', '.join(later[:3])}{', ...' if len(later) > 3 else ''}): "
                         f"resume from it (--resume {save}) or save elsewhere")


def resume(t, where: str) -> None:
    """Continue from a checkpoint saved under any layout of the same model."""
    import fastpar
    from fastpar.training import checkpoint as ckpt
    from fastpar.training.state import load_serial_optimizer_state

    c = ckpt.load(where)
    saved = c.meta.get("model", {})
    mine = dataclasses.asdict(t.cfg)
    diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in mine.items()
            if k not in ("sequence_parallel", "overlap", "dropout", "recompute") and saved.get(k) != v]
    if diff:
        raise ValueError(f"checkpoint {c.path} was saved from a different model: "
                         + "; ".join(diff))
    data = [f"{k}: checkpoint {c.meta.get(k)!r}, this run {v!r}"
            for k, v in (("seed", t.args.seed), ("global_batch", t.args.global_batch))
            if c.meta.get(k) != v]
    if data:  # the batches are a function of (seed, step) and the global batch
        raise ValueError(f"checkpoint {c.path} was trained on another data stream: "
                         + "; ".join(data) + " (pass the same --seed and --global-batch)")
    with t.gathered():
        expected = {k: tuple(v.shape) for k, v in fastpar.full_state_dict(t.model).items()}
    ckpt.check_model_shapes(expected, c.model, c.path)
    if c.step > t.steps:
        raise ValueError(f"checkpoint {c.path} is at step {c.step}, past --steps {t.steps}")
    # ZeRO-3: loaded into the gathered parameters, then into the masters; bf16 without ZeRO:
    # the float32 masters exact, the bf16 weights rounded from them
    with t.gathered(), masters_in_place(t.opt):
        fastpar.load_full_state_dict(t.model, c.model)
        load_serial_optimizer_state(t.pipe, t.opt, c.optimizer,
                                    c.meta.get("optimizer_scalars", {}))
    t.sched.load_state_dict({**t.sched.state_dict(), **c.meta["scheduler"]})
    # This run's flags make the plan (the same flags: the checkpoint's plan, bit for bit):
    # the next step, c.step, runs at this plan's rate, and so do the ones after it.
    plan = lr_plan(t.args, t.steps)
    t.sched.base_lrs = [plan["lr"]] * len(t.opt.param_groups)
    t.sched._last_lr = [lr_at(plan, c.step)] * len(t.opt.param_groups)
    for group, lr in zip(t.opt.param_groups, t.sched.get_last_lr()):
        group["lr"] = lr
    t.start = c.step
    if t.topo.rank == 0:
        lay = c.meta.get("layout", {})
        print(f"[fastpar.train] resumed {c.path} at step {c.step} (saved under tp "
              f"{lay.get('tp')} pp {lay.get('pp')} dp {lay.get('dp')})", flush=True)
        if (note := replanned(t, c.meta.get("schedule"), c.step)) is not None:
            print(f"[fastpar.train] note: {note}", flush=True)


def replanned(t, saved: dict | None, step: int) -> str | None:
    """What changes in the learning rate when this run's --lr, --steps, --warmup or
    --min-lr-ratio differ from the checkpoint's (None: nothing changes)."""
    plan = lr_plan(t.args, t.steps)
    now = lr_at(plan, step)
    if saved is None:
        return (f"the checkpoint does not record its learning-rate plan; this run's (lr "
                f"{plan['lr']:g}, warm-up {plan['warmup']}, decay to step {plan['steps']}) "
                f"gives step {step} a rate of {now:.3g}")
    saved = {**plan, **saved}  # a key the checkpoint lacks: unchanged
    if saved == plan:
        return None
    changed = ", ".join(f"{k} {saved[k]:g} -> {plan[k]:g}" for k in plan if saved[k] != plan[k])
    return (f"the learning-rate schedule is replanned ({changed}): at step {step} the rate "
            f"goes from {lr_at(saved, step):.3g} to {now:.3g}")


def masters_in_place(opt):
    """Where the weights of record are: ``opt``'s float32 masters for a bf16 run
    (``fastpar.optim.MasterWeights``, or ZeRO's masters: collective over dp), else the
    parameters themselves. Inside, each parameter's ``.data`` is its master."""
    from fastpar.optim import DistributedOptimizer, MasterWeights
    from fastpar.training.state import swapped

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
