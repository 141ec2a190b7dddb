"""A layout (every choice a run makes: tp x pp x dp x cp x ep, ZeRO, recompute, schedule,
microbatches), its name, the layouts worth trying on a cluster, and why one cannot run.

A name is the choices joined by dots, each token naming itself, in any order::

    tp2.pp2.dp1.zero1.full.1f1b.mb8       tp1.pp4.dp2.interleaved.v2.mb8      tp4.pp1.dp2.cp2

One shell word with no quoting, the same string the table prints (copy a row into
``--explain``). Numbers: tp pp dp cp ep zero mb (microbatches) v (virtual stages); words:
a recompute (none selective full) and a schedule (gpipe 1f1b interleaved zb). Left out: cp1,
ep1, zero0, none, 1f1b, v1 (interleaved: v2), dp the ranks left, mb 2 x pp (the trainer's).
"""

from __future__ import annotations

import dataclasses
import re

from fastpar.models.config import RECOMPUTE, GPTConfig
from fastpar.pipeline.schedules import SCHEDULES, theoretical_bubble

NUMBERS = ("tp", "pp", "dp", "cp", "ep", "zero", "mb", "v")
MICROBATCH_SIZES = (1, 2, 4, 8)  # sequences per microbatch the enumeration tries
VIRTUAL_STAGES = (2, 4)  # chunks per rank the interleaved schedule is tried with


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    zero: int = 0
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1

    @property
    def ranks(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"zero{self.zero}", self.recompute, self.schedule]
        parts += [f"v{self.virtual_stages}"] if self.virtual_stages > 1 else []
        return ".".join(parts + [f"mb{self.microbatches}"])

    def __str__(self) -> str:
        return self.name


def parse(text: str, ranks: int | None = None) -> Layout:
    """A ``Layout`` from its name; ValueError naming the token at fault."""
    got: dict = {}
    for token in (t for t in text.strip().split(".") if t):
        m = re.fullmatch(r"([a-z]+)(\d+)", token)
        if token in RECOMPUTE:
            key, value = "recompute", token
        elif token in SCHEDULES:
            key, value = "schedule", token
        elif m and m.group(1) in NUMBERS:
            key, value = m.group(1), int(m.group(2))
            if value < (0 if key == "zero" else 1) or (key == "zero" and value > 3):
                raise ValueError(f"layout {text!r}: {token} is out of range ("
                                 f"{'zero0..zero3' if key == 'zero' else key + ' >= 1'})")
        else:
            raise ValueError(f"layout {text!r}: unknown token {token!r} (expected tpN ppN dpN "
                             f"cpN epN zeroN mbN vN, {' '.join(RECOMPUTE)}, "
                             f"{' '.join(SCHEDULES)})")
        if key in got:
            raise ValueError(f"layout {text!r}: {key} given twice")
        got[key] = value
    tp, pp, cp = got.get("tp", 1), got.get("pp", 1), got.get("cp", 1)
    if "dp" not in got:
        if ranks is None or ranks % (tp * pp * cp):
            raise ValueError(f"layout {text!r}: no dp given, and tp {tp} x pp {pp} x cp {cp} "
                             f"does not divide the {ranks} ranks")
        got["dp"] = ranks // (tp * pp * cp)
    schedule = got.get("schedule", "1f1b")
    v = got.get("v", 2 if schedule == "interleaved" else 1)
    return Layout(tp=tp, pp=pp, dp=got["dp"], cp=cp, ep=got.get("ep", 1),
                  zero=got.get("zero", 0), recompute=got.get("recompute", "none"),
                  schedule=schedule, virtual_stages=v, microbatches=got.get("mb", 2 * pp))


def model_for(cfg: GPTConfig, lay: Layout) -> GPTConfig:
    """The config the trainer builds for ``lay`` (its recompute and context-parallel flags)."""
    return dataclasses.replace(cfg, recompute=lay.recompute,
                               context_parallel=(cfg.context_parallel or "ring")
                               if lay.cp > 1 else None)


def why_not(cfg: GPTConfig, lay: Layout, ranks: int, global_batch: int) -> str | None:
    """Why the trainer could not run ``lay`` (None: it can), naming the numbers."""
    if lay.ranks != ranks:
        return (f"tp {lay.tp} x cp {lay.cp} x pp {lay.pp} x dp {lay.dp} = {lay.ranks}, not the "
                f"{ranks} ranks")
    try:
        model_for(cfg, lay).validate(lay.tp, lay.ep, lay.cp)
    except ValueError as exc:
        return str(exc).removeprefix("GPTConfig: ")
    stages = lay.pp * lay.virtual_stages
    if stages > cfg.layers + 2:
        return (f"pp {lay.pp} x virtual stages {lay.virtual_stages} = {stages} stages > the "
                f"{cfg.layers + 2} layers (embedding, {cfg.layers} blocks, head)")
    if global_batch % (lay.dp * lay.microbatches):
        return (f"global batch {global_batch} is not divisible by dp {lay.dp} x microbatches "
                f"{lay.microbatches}")
    try:
        theoretical_bubble(lay.schedule, lay.pp, lay.microbatches, lay.virtual_stages)
    except ValueError as exc:
        return f"schedule {lay.schedule}: {exc}"
    if lay.ep > 1 and lay.dp % lay.ep:
        return f"ep {lay.ep} does not divide dp {lay.dp}"
    if cfg.moe_experts and lay.zero:
        return f"zero {lay.zero} with MoE: ZeRO does not shard expert parameters yet"
    if lay.cp > 1 and (cfg.moe_experts or cfg.sequence_parallel):
        return f"cp {lay.cp} with {'MoE' if cfg.moe_experts else 'sequence parallel'}: not " \
               "supported by the trainer"
    if lay.zero and lay.dp * lay.cp == 1:
        return f"zero {lay.zero} shards over dp x cp = 1: nothing to shard (zero0 is this layout)"
    return None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: GPTConfig, ranks: int, ranks_per_host: int, global_batch: int):
    """Every layout worth trying, in a fixed order: tp up to a host's ranks (tp across hosts
    puts a collective per layer on the slow link), cp up to 8 and only on sequences it can
    cut, pp and dp the rest; each ZeRO stage and recompute; gpipe, 1f1b, zb and interleaved
    (v 2, 4) when pp > 1 (at pp 1 they are one schedule: 1f1b); microbatches of 1, 2, 4, 8
    sequences (and the trainer's default 2 x pp)."""
    for tp in divisors(ranks):
        if tp > ranks_per_host:
            continue
        for cp in divisors(ranks // tp):
            if cp > 8 or (cp > 1 and cfg.seq_len % (2 * cp)):
                continue
            for pp in divisors(ranks // (tp * cp)):
                dp = ranks // (tp * cp * pp)
                eps = [e for e in divisors(dp) if cfg.moe_experts % e == 0] \
                    if cfg.moe_experts else [1]
                rows = global_batch // dp if global_batch % dp == 0 else 0
                mbs = sorted({rows // b for b in MICROBATCH_SIZES if rows and rows % b == 0} |
                             ({2 * pp} if rows and rows % (2 * pp) == 0 else set()))
                if not mbs:
                    mbs = [1]  # why_not names the batch that does not divide
                schedules = [("1f1b", 1)] if pp == 1 else \
                    [("gpipe", 1), ("1f1b", 1), ("zb", 1)] + \
                    [("interleaved", v) for v in VIRTUAL_STAGES]
                for ep in eps:
                    for zero in range(4):
                        for recompute in RECOMPUTE:
                            for schedule, v in schedules:
                                for m in mbs:
                                    yield Layout(tp, pp, dp, cp, ep, zero, recompute, schedule,
                                                 v, m)
