"""Structured pruning: a smaller GPT of the same architecture, whole attention heads (whole KV
groups under GQA) and MLP channels removed by an importance score.

    small = fastpar.prune(model, heads=0.5, mlp=0.25, by="magnitude")   # structured.py
    python -m fastpar.prune --resume runs/a --heads 0.5 --mlp 0.25 --save runs/pruned   # cli.py

The scores and their definitions: ``importance.py``; the counts, the choice and the cut of the
weights: ``selection.py``.
"""

from fastpar.pruning.selection import Kept
from fastpar.pruning.structured import prune

__all__ = ["Kept", "prune"]
