"""The trainer fit (``fastpar plan --calibrate`` with a model; docs/design.md, "The trainer
fit"): the real ``Trainer.train_step`` timed on this process for the plan's own model, fitted
per layer and per step. Its own module because it trains: it imports the main job
(``fastpar.train``), which ``fastpar.plan.calibrate`` must not (the trainer's ``--layout auto``
imports that).

    fit = trainer_fit(cfg, membw=cluster.membw_Bps, tensor_s=cluster.overhead_tensor_s)
"""

from __future__ import annotations

import statistics
import time

import torch


def trainer_fit(cfg, membw: float, tensor_s: float, rows: int = 8, steps: int = 16,
                warmup: int = 4, budget_s: float = 0.5) -> tuple | None:
    """The trainer's own step (``fastpar.train.Trainer.train_step``: the pipeline's executor,
    the meters, clip, AdamW, the loss's all-reduce) timed on this process as a one-rank job on
    one thread, for ``cfg``'s layers at 1 and 3 blocks, 1 and ``rows`` rows and 1 and 2
    microbatches; fitted to ``step = S + m (end(n) + L block(n))`` with ``end`` and ``block``
    each ``a + b n`` over a microbatch's n tokens (non-negative least squares on each
    point's fastest step, scaled by the points' median step over fastest). Returns ``Cluster.trainer_fit`` (``S`` less
    the optimizer's share the planner adds by itself), or None inside a job (``--layout auto``
    plans on rank 0 of a running job; it keeps the host overheads alone) or for a model whose
    three blocks would take more than ``budget_s`` a step here (``rows`` is lowered first)."""
    import contextlib
    import dataclasses
    import io

    from fastpar import runtime
    from fastpar.plan.cluster import model_signature

    if runtime.is_initialized():
        return None
    base = dataclasses.replace(cfg, recompute="none", context_parallel=None,
                               sequence_parallel=False)
    one = dataclasses.replace(base, layers=1)
    flops = 6 * one.num_params() * cfg.seq_len  # a row's forward and backward, about
    while rows > 1 and 8 * flops * rows / 20e9 > budget_s:  # 3 blocks, 2 microbatches, at
        rows //= 2                                          # ~20 GFLOP/s on one core
    if 8 * flops * rows / 20e9 > budget_s:
        return None

    def step_s(layers: int, batch: int, microbatches: int) -> float:
        import fastpar
        from fastpar.train import Trainer
        from fastpar.training.args import parse_args

        args = parse_args(["--preset", "tiny", "--global-batch", str(batch), "--microbatches",
                           str(microbatches), "--steps", str(steps), "--clip", "1.0"])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer = Trainer(args, cfg=dataclasses.replace(base, layers=layers))
            try:
                times = []
                for step in range(steps):
                    t0 = time.perf_counter()
                    trainer.train_step(step)
                    times.append(time.perf_counter() - t0)
            finally:
                fastpar.shutdown()
        kept = times[warmup:]
        return min(kept), statistics.median(kept)

    # step = S + m (e0 + e1 n) + m L (b0 + b1 n): least squares over 1 and 2 blocks, 1, rows / 2
    # and rows rows a microbatch, 1 and 2 microbatches (the differences of single points are
    # as noisy as the steps; the fit spreads it)
    points = [(layers, r, m) for layers in (1, 3) for r in sorted({1, max(1, rows // 2), rows})
              for m in (1, 2)]
    design, fastest, ratios = [], [], []
    for layers, r, m in points:
        n = r * cfg.seq_len
        design.append([1.0, m, m * n, m * layers, m * layers * n])
        low, mid = step_s(layers, r * m, m)
        fastest.append(low)
        ratios.append(mid / low)
    # fitted on each point's fastest step (steady where medians jump between runs), then
    # scaled to the median step (what a run's step time reports) by the points' median ratio
    scale = statistics.median(ratios)
    step, e0, e1, b0, b1 = (scale * x for x in _nnls(design, fastest))
    from fastpar.training.memory_plan import layer_tensors

    tensors = sum(len(layer_tensors(one, 1, i, 1)) for i in range(one.layers + 2))
    optimizer = 32 * one.num_params() / membw + tensor_s * tensors  # what predict adds itself
    return (model_signature(cfg, 4), (b0, b1), (e0, e1), max(0.0, step - optimizer))


def _nnls(design: list, y: list) -> list[float]:
    """Least squares with every coefficient >= 0, exactly, for a few columns: the best of the
    unconstrained fits on each subset of the columns whose coefficients are all >= 0."""
    import itertools

    a = torch.tensor(design, dtype=torch.float64)
    b = torch.tensor(y, dtype=torch.float64).unsqueeze(1)
    best, coef = float(b.square().sum()), [0.0] * a.shape[1]
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x = torch.linalg.lstsq(a[:, cols], b).solution.squeeze(1)
            if (x < 0).any():
                continue
            err = float((a[:, cols] @ x - b.squeeze(1)).square().sum())
            if err < best:
                best, coef = err, [0.0] * a.shape[1]
                for j, v in zip(cols, x.tolist()):
                    coef[j] = v
    return coef
