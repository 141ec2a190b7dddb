"""What fastpar's command lines share: they answer a user's mistake like a command line, not
like a crash.

    p = Parser(prog="python -m fastpar.train", description=__doc__)
    ...
    args = p.parse_args(argv)
    p.check(args.steps >= 1, f"--steps must be >= 1, got {args.steps}")

A bad flag is one line on standard error, ``<prog>: error: <what> (see --help)``, and exit
status 2, as argparse does, without argparse's usage block (forty flags of it), and from one
rank only: every rank of a launch parses the same command line, so the launcher's rank 0 says
it and the others exit as quietly. ``run_command`` does the same for the errors a command's
body finds every rank alike (a model it cannot run), and ``on_lead`` runs rank 0's long work
(an export) while the others wait without timing out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import types

import torch.distributed as dist

from fastpar.runtime.bootstrap import is_initialized, shutdown, topology


def launch_rank() -> int:
    """This process's rank as the launcher's environment gives it (0 when it gives none: one
    process, or a launcher that leaves it to MPI), read without starting MPI."""
    from fastpar.runtime.launcher import detect

    try:
        return max(detect(os.environ).rank, 0)
    except ValueError:  # conflicting launchers: fastpar.init will say so
        return 0


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if launch_rank() == 0:
            print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr, flush=True)
        raise SystemExit(2)

    def add_model_source(self) -> None:
        """``--resume CKPT`` or ``--hf-model DIR``, one of them required: the model a command
        runs (generate, evaluate, quantize, prune)."""
        src = self.add_mutually_exclusive_group(required=True)
        src.add_argument("--resume", metavar="CKPT",
                         help="a checkpoint of python -m fastpar.train")
        src.add_argument("--hf-model", metavar="DIR", help="a Hugging Face causal-LM directory")

    def check(self, ok: bool, message: str) -> None:
        """``error(message)`` unless ``ok``."""
        if not ok:
            self.error(message)

    def launched_world(self) -> int | None:
        """The ranks this process was launched among, as the launcher's environment says
        (1 alone), without starting MPI: ``None`` where only MPI knows (``fastpar.init`` then
        checks the layout); conflicting launchers are a command-line error."""
        from fastpar.runtime.launcher import detect

        try:
            info = detect(os.environ)
        except ValueError as exc:
            self.error(str(exc))
        world = 1 if info.launcher == "single" else info.world_size
        return world if world > 0 else None


def run_command(prog: str, run, args) -> int:
    """``run(args)``, a command's body, returning its exit status; a ``ValueError`` or
    ``OSError`` (the same on every rank: a model it cannot run, a path that is not there) is one
    line from rank 0, ``<prog>: error: <what>``, and exit status 2, fastpar shut down first."""
    try:
        return run(args)
    except (ValueError, OSError) as exc:
        rank = topology().rank if is_initialized() else launch_rank()
        if rank == 0:
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        if is_initialized():
            shutdown()
        return 2


def on_lead(what: str, fn) -> None:
    """``fn()`` on rank 0 while the other ranks wait for it, a day at most (writing a model
    outlasts the job's collective timeout), over a gloo group of the world made for that; its
    error is raised on every rank as ``ValueError`` naming ``what``. Collective."""
    wait = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1))
    said = [None]
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - every rank raises it
            said[0] = f"{what}: {type(exc).__name__}: {exc}"
    dist.broadcast_object_list(said, src=0, group=wait)
    dist.destroy_process_group(wait)
    if said[0]:
        raise ValueError(said[0])


def callable_module(name: str, fn) -> None:
    """Make module ``name`` (a front door ``python -m fastpar.X`` beside the function
    ``fastpar.X``) call ``fn`` when called: importing the module makes the package's attribute
    the module (Python's rule), and ``fastpar.X(...)`` then still works."""

    class Callable(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return fn(*args, **kwargs)

    sys.modules[name].__class__ = Callable
