"""The main job: train a GPT with tensor, pipeline and data parallelism, the same as one process.

    mpirun -np 4 python -m fastpar.train --tp 2 --pp 2              # dp = world / (tp x pp)
    python -m fastpar.train --preset tiny --steps 100                # one process, serial
    mpirun -np 4 python -m fastpar.train --tp 2 --pp 2 --save ckpt --save-every 50
    mpirun -np 2 python -m fastpar.train --resume ckpt               # any other layout
    mpirun -np 4 python -m fastpar.train --cp 2 --cp-type ulysses --pp 2   # context parallel
    mpirun -np 4 python -m fastpar.train --layout auto --cluster c.json   # the planner chooses

Each step: the global batch (a pure function of (seed, step): ``fastpar.training.data``) is cut
into dp slices; ``DataParallel(Pipeline(gpt_layers(cfg)))`` runs the microbatches through the
stages (tp inside each layer) and averages the gradients over dp (x cp; ``--zero N``: a ZeRO-N
``DistributedOptimizer`` reduce-scatters them instead; stages 2 and 3 at pp 1 per unit, each
block's gradients as its backward finishes and ZeRO-3's block gathered around its forward and
backward, under a pipeline once per step with the stage gathered: ``--zero-granularity``, see
docs/design.md); tied embedding gradients are summed over
the first and last stage; under ``--cp N`` each sequence is split over the cp ranks, which see
the same rows (``fastpar.nn.context``'s layout; attention by ``--cp-type`` ring or ulysses), and
gradients are averaged over dp x cp; the gradients are clipped by the serial model's global norm; AdamW
steps. The initial weights depend only on ``--seed``, so every layout starts from the serial
model and, up to float32 rounding, follows the same loss curve. ``--dtype bfloat16`` computes in
bf16 and reduces gradients in float32 on every axis; AdamW steps float32 master weights with
float32 state (``fastpar.optim.MasterWeights``; with ``--zero`` the ZeRO optimizer's own).

Rank 0 shows a progress bar and a line every ``--log-every`` steps, validation loss every
``--val-every``, JSON lines with ``--metrics``, and a loss plot at the end (``--plot``).
Checkpoints (``--save``) are sharded: every rank writes its own pieces (in the background unless
``--sync-save``) and any layout reloads them (``fastpar.checkpoint``; ``python -m
fastpar.checkpoint export`` writes the serial layout).
"""

from __future__ import annotations

import sys

import fastpar
from fastpar import runtime
from fastpar.runtime import failures
from fastpar.training.args import parse_args
from fastpar.training.trainer import Trainer

__all__ = ["main"]


def main(argv=None) -> int:
    args = parse_args(argv, description=__doc__)
    try:
        Trainer(args).run()
    except Exception as exc:  # noqa: BLE001 - said in one line (FASTPAR_DEBUG=1: the traceback)
        if failures.debug():
            raise  # the traceback, and under MPI fastpar's hook aborts the whole job
        end_job_with(exc)
    # Only after success: on Ctrl-C the KeyboardInterrupt must reach fastpar's hook, which
    # aborts the whole job (a peer may sit in a collective that would otherwise wait for this
    # rank until the timeout); shutdown would remove that hook first.
    fastpar.shutdown()
    return 0


def end_job_with(exc: Exception) -> None:
    """A run that failed: one rank says the error in one line (a failure every rank sees: rank
    0; else the first rank to count one in the job's store), the others, which mostly hit the
    same one, say nothing (``runtime.failures``); then the whole job ends with status 1, under
    MPI at once (a peer may be waiting in a collective for this rank)."""
    topo = runtime.topology() if runtime.is_initialized() else None
    spoke = failures.speaks(exc, topo.store if topo is not None else None,
                            "fastpar/train/failed")
    rank = topo.rank if topo is not None else None
    where = f" on rank {rank}" if rank is not None and topo.world_size > 1 else ""
    words = (f"python -m fastpar.train: error{where}: {type(exc).__name__}: {exc} "
             f"(FASTPAR_DEBUG=1 shows the traceback)\n")
    if spoke:
        print(words, end="", file=sys.stderr, flush=True)
    if topo is not None and topo.mpi_comm is not None and topo.world_size > 1:
        failures.abort_mpi_job(topo.mpi_comm, 1, spoke, words)
    if topo is not None and topo.world_size == 1:
        # no peer waits: end the job's threads (gloo's, a checkpointer's group) before the
        # interpreter's teardown, which otherwise may meet one still running and abort (134)
        try:
            runtime.shutdown()
        except Exception:  # noqa: BLE001 - the run failed already; exit with its status
            pass
    raise SystemExit(1)


if __name__ == "__main__":
    raise SystemExit(main())
