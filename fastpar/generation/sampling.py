"""Choosing the next token from the logits: greedy, or sampled under temperature, top-k and
top-p, by a seeded stream that every rank and every layout draws alike.

    pick = Sampler(temperature=0.8, top_k=50, top_p=0.95, seed=1)
    tokens = pick(logits)                  # (B, V) float -> (B,) int64

Sampling draws one uniform number per row per step from a CPU generator (whatever the device),
and takes the first token whose cumulative probability (float64) passes it: the same logits give
the same tokens on every rank, and logits that differ by roundoff (another tp size) give the
same tokens unless a draw falls within that roundoff of a boundary.
"""

from __future__ import annotations

import torch


class Sampler:
    """``temperature`` 0: greedy (argmax; the lowest index on a tie). Otherwise the logits are
    divided by the temperature, cut to the ``top_k`` largest (None or 0: all) and then to the
    smallest set whose probability reaches ``top_p`` (None or 1: all), as Hugging Face's
    warpers do in that order."""

    def __init__(self, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature, self.top_k, self.top_p = temperature, top_k or None, top_p
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        draws = torch.rand(logits.shape[0], generator=self.generator, dtype=torch.float64)
        scores = logits.detach().to("cpu", torch.float64) / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            ordered, order = scores.sort(dim=-1, descending=True)
            mass = ordered.softmax(dim=-1).cumsum(dim=-1)
            drop = mass - ordered.softmax(dim=-1) >= self.top_p  # the mass before it suffices
            ordered = ordered.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
        cumulative = scores.softmax(dim=-1).cumsum(dim=-1)
        cumulative[:, -1] = 1.0  # roundoff cannot leave a draw past the last token
        picked = torch.searchsorted(cumulative, draws[:, None], right=True).squeeze(-1)
        return picked.clamp(max=scores.shape[-1] - 1).to(logits.device)
