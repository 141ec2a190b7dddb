"""The least-squares fits of the calibration: the link's alpha-beta model from its timings
(``fit``) and an exact non-negative least squares for a few columns (``nnls``: the trainer
fit)."""

from __future__ import annotations

import itertools

import torch

from fastpar.plan.cluster import FACTOR, STEPS


def fit(n: int, points: list[tuple[int, float]]) -> tuple[float, float]:
    """``t = STEPS alpha + FACTOR S / busbw`` (alpha >= 0) over (bytes, s), by least squares of
    the relative error: the sizes span 4 KiB .. 16 MiB, and in seconds the largest would
    decide alone (a shaped 1 Gbit/s link: 0.5 ms at 4 KiB, 140 ms at 16 MiB), leaving the
    latency that small messages pay unfitted."""
    a, b = STEPS["all_reduce"](n), FACTOR["all_reduce"](n)
    xs = [(a / t, b * s / t) for s, t in points]  # each row divided by its time
    sxx = sum(x * x for x, _ in xs)
    syy = sum(y * y for _, y in xs)
    sxy = sum(x * y for x, y in xs)
    rx = sum(x for x, _ in xs)  # the right-hand side is 1 in every row
    ry = sum(y for _, y in xs)
    det = sxx * syy - sxy * sxy
    alpha, inv_bw = (rx * syy - ry * sxy) / det, (sxx * ry - sxy * rx) / det
    if alpha < 0:  # latency too small to see: bandwidth alone
        alpha, inv_bw = 0.0, ry / syy
    return alpha, 1.0 / max(inv_bw, 1e-30)


def nnls(design: list, y: list) -> list[float]:
    """Least squares with every coefficient >= 0, exactly, for a few columns: the best of the
    unconstrained fits on each subset of the columns whose coefficients are all >= 0."""
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
