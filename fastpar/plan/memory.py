"""Peak bytes per rank by category, predicted from the layout alone (the main job's model).

    inputs = MemoryInputs(cfg, tp=2, pp=2, dp=1, pp_rank=0, bounds=pipe.bounds,
                          schedule="1f1b", microbatches=4, rows=16, zero=0, dtype=torch.float32)
    predict_memory(inputs)  # {"params": ..., "grads": ..., "optimizer": ..., "activations": ...,
                            #  "buffers": ...}

Symbols (this rank): ``n_i`` the elements of its i-th parameter tensor (the tp shard; layers of
its pipeline chunks, ``bounds`` cut them), ``P = sum n_i``, ``e`` the model's element size (4
float32, 2 bfloat16), ``d`` dp, ``s = sum over runs of ceil(r / d)`` the ZeRO shard (runs of
the flat order, ``r`` elements each: ZeRO-1 one; ZeRO-2/3 each layer, their unit, cut into runs
of at most ``ZERO_RUN_BYTES`` of float32, a tied embedding's copy a run of its own:
``zero_runs``), ``pad16(n)`` ``n`` rounded up to 64 bytes of float32 (DataParallel's bucket
alignment)::

    layout          params   grads                      optimizer          buffers
    fp32            4P       4 sum pad16(n_i) (buckets)  8P                 0
    bf16            2P       2P + 4P (master grads)      12P (masters+m,v)  4 sum pad16(n_i)
    ZeRO-1 fp32     4ds      4ds (flat) + 4s             8s (master: view)  0
    ZeRO-1 bf16     2ds      2P + 4s                     12s                4ds (fp32 flat)
    ZeRO-2/3 step   e ds     max(eP, 4s)                 12s                4d R (*)
    ZeRO-2 unit     e ds     4s + e max r                12s                4(d + a) R (*)
    ZeRO-3 unit     e d W    4s + e max r                12s                4(d + a) R (*)
    error feedback (dp > 1): buffers + 4 sum pad16(n_i) (no ZeRO) or + 4ds (ZeRO)

Granularity (``zero_granularity``): "step" accumulates full gradients over a step's
microbatches (``no_sync``) and ZeRO-3 keeps the stage gathered for the whole step, so their peaks
are the full ones; "unit" reduce-scatters each run as a microbatch's backward completes it, so
the gradients are the float32 master shards plus the ``.grad`` of one run (its r elements, in
the model's dtype), and ZeRO-3 holds ``W``: the largest pair of consecutive units of one chunk
(a unit computing, the next prefetched; one unit without prefetch; every unit, ``d s``, with
``keep_gathered``), a unit's ``d sum ceil(r/d)`` over its runs. The reduce-scatter stages one
run at a time in float32 (``fastpar.optim.zero_grads``): ``R = max ceil(r/d)`` its largest
piece, and from a step's second microbatch on (``a = 1``, unit only) one more piece where the
reduction is added to the earlier ones; (*) where that staging is symmetric memory (CPU ranks
whose dp collectives go to shm: ``symmetric_staging``) a row is at most ``STAGING_ROW_BYTES``,
R = min(max ceil(r/d), 2^18). Adam's ``step`` counters (0-dim) are not counted.

Activations: the bytes autograd saves per microbatch for each layer (``layer_activations``,
the derivation is in docs/design.md), summed over the microbatches in flight: the schedule's
own action list is replayed (a microbatch's bytes are held from its F to its B, or W under
zero-bubble), so 1F1B's first stage holds pp microbatches and GPipe all of them. The loss's own
saved tensors are not counted (``Pipeline`` measures its chunks).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fastpar.models.config import GPTConfig
from fastpar.optim.zero_grads import STAGING_ROW_BYTES
from fastpar.pipeline.schedules import compile_schedule

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")
ALIGN = 16  # DataParallel's buckets start every gradient on 64 bytes: 16 float32 elements
# The trainer's ZeRO-2/3 runs: a unit (a block) cut into runs of at most this many bytes of
# float32 (``training.optimizer`` passes it as ``bucket_mb``), so that a backward holds at most
# about this much unreduced gradient and ZeRO-3 gathers a unit in a few collectives
ZERO_RUN_BYTES = 2**20
# ZeRO-2/3 under a pipeline, where --zero-granularity is auto: per step (at pp 2 x dp 2 ZeRO-3
# per unit held 12% less model state at 1.19x the step time; docs/training.md)
PIPELINE_ZERO_GRANULARITY = "step"


def zero_granularity(zero: int, choice: str, pp: int, schedule: str) -> str:
    """How ZeRO-2/3 gather and reduce: ``choice`` ("unit" or "step", ``--zero-granularity``),
    or for "auto" "unit" at pp 1, ``PIPELINE_ZERO_GRANULARITY`` under a pipeline, "step" under
    zb (its split backward needs the weights from I to W); "step" for ZeRO-1 and no ZeRO
    (nothing to choose)."""
    if zero < 2:
        return "step"
    if choice != "auto":
        return choice
    if schedule == "zb":
        return "step"
    return "unit" if pp == 1 else PIPELINE_ZERO_GRANULARITY


@dataclasses.dataclass(frozen=True)
class MemoryInputs:
    """What the prediction depends on: the model, the grid, the schedule and the options."""

    cfg: GPTConfig
    tp: int
    pp: int
    dp: int  # the gradient-reduction (ZeRO) group: dp, or dp x cp under context parallelism
    pp_rank: int
    bounds: tuple  # layer cuts of the pp * v stages (Pipeline.bounds)
    schedule: str
    microbatches: int
    rows: int  # sequences per step on this dp rank
    zero: int = 0
    dtype: torch.dtype = torch.float32
    virtual_stages: int = 1
    error_feedback: bool = False  # quantized gradients' residuals (float32, one per bucket/run)
    symmetric_staging: bool = False  # ZeRO-2/3's staging in symmetric rows (CPU ranks on shm)
    ep: int = 1  # expert-parallel ranks: a MoE block holds moe_experts / ep experts here
    cp: int = 1  # context-parallel ranks: each holds seq_len / cp tokens of every sequence
    zero_granularity: str = "auto"  # ZeRO-2/3: "unit", "step", or auto (zero_granularity)
    keep_gathered: bool = False  # ZeRO-3 per unit: units gathered from first use to the step
    prefetch: bool = True  # ZeRO-3 per unit: the next unit gathered while one computes

    @property
    def granularity(self) -> str:
        return zero_granularity(self.zero, self.zero_granularity, self.pp, self.schedule)

    def stage_layers(self, chunk: int) -> range:
        s = chunk * self.pp + self.pp_rank
        return range(self.bounds[s], self.bounds[s + 1])


def layer_tensors(cfg: GPTConfig, tp: int, index: int, ep: int = 1) -> list[int]:
    """Elements of each parameter tensor of layer ``index`` (0 the embedding, 1..L the blocks,
    L + 1 the head) on one tp rank (a MoE block: its router and stacked local experts, whole on
    every tp rank, moe_experts / ep of them)."""
    h, v, ffn, b = cfg.hidden, cfg.vocab_size, cfg.ffn_size, cfg.bias
    q, kv = cfg.heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size
    norm = [h, h] if cfg.norm == "layernorm" and b else [h]
    if index == 0:
        return [v // tp * h] + ([cfg.position_rows * h] if cfg.positions == "learned" else [])
    if index == cfg.layers + 1:
        return norm + [v // tp * h]

    def column(out, bias=b):  # weight (out/tp, h) and bias (out/tp)
        return [out // tp * h] + ([out // tp] if bias else [])

    def row(inp):  # weight (h, in/tp) and a replicated bias (h)
        return [h * (inp // tp)] + ([h] if b else [])
    qkv_b = b or cfg.qkv_bias
    attn = column(q, qkv_b) + column(kv, qkv_b) + column(kv, qkv_b) + row(q) + \
        ([cfg.head_size] * 2 if cfg.qk_norm else [])
    mlp = column(ffn) * 2 + row(ffn) if cfg.mlp == "swiglu" else column(ffn) + row(ffn)
    if cfg.is_moe(index):
        local = cfg.moe_experts // ep
        mlp = [cfg.moe_experts * h] + [local * h * ffn] * (3 if cfg.mlp == "swiglu" else 2)
    return norm + attn + norm + mlp


def layer_activations(cfg: GPTConfig, tp: int, index: int, rows: int, esize: int,
                      first: bool = False) -> int:
    """Bytes autograd saves for one microbatch of ``rows`` sequences in layer ``index`` (tp
    rank's share); ``first``: the layer's input is the stage input, counted there. Each term
    is what one op saves (docs/design.md has the table)."""
    n, h, hd = rows * cfg.seq_len, cfg.hidden, cfg.head_size
    q, kv, ffn = cfg.heads // tp * hd, cfg.num_kv_heads // tp * hd, cfg.ffn_size // tp
    m = n // (tp if cfg.sequence_parallel else 1)  # tokens outside the tp regions
    x = 0 if first else m * h * esize  # the layer's input, where it is saved itself
    # A norm (composite rms/layer norm, computed in float32) saves its input in float32 (a
    # bf16 input: a float32 copy, even of the stage input), rstd, and the normalised input
    # before the weight; its output is saved by the linear layers after it (gathered under SP).
    norm = (x if esize == 4 else m * h * 4) + m * 4 + m * h * 4
    norm2 = m * h * 4 + m * 4 + m * h * 4  # a block's second norm: its input is inside
    if cfg.norm == "layernorm":  # native_layer_norm: the input, mean and rstd (not measured)
        norm, norm2 = x + 2 * m * 4, m * h * esize + 2 * m * 4
    out = n * h * esize  # a norm's output, as the next linear layers keep it
    if index == 0:  # the token ids are the stage input; tp > 1 also saves local ids and a mask
        return 0 if tp == 1 else n * (8 + 1)
    if index == cfg.layers + 1:  # the final norm, the projection's input
        return norm + out
    if cfg.recompute == "full":
        return x  # the block's input, kept by the recompute
    rope = cfg.seq_len * hd * esize if cfg.positions == "rope" else 0  # cos, sin (T, hd/2)
    core = (2 * q + 2 * kv) * n * esize + cfg.heads // tp * n * 4  # q, k, v, out, logsumexp
    if cfg.recompute == "selective":
        core = (q + 2 * kv) * n * esize  # recompute keeps q, k, v only
    o_in = q * n * esize  # o_proj's input: the heads joined
    mlp = 4 * ffn * n * esize if cfg.mlp == "swiglu" else 2 * ffn * n * esize
    if cfg.is_moe(index):
        # An estimate at perfectly balanced routing (the padded expert batch grows with the
        # busiest expert): the router's float32 logits and probabilities, the n k routed rows
        # going out, through the experts (their input and ffn-wide intermediates, full width:
        # experts are not tp-sharded) and back, and the gates and indices of the combine.
        k, f = cfg.moe_top_k, cfg.ffn_size
        wide = 4 * f if cfg.mlp == "swiglu" else 2 * f
        mlp = 2 * n * cfg.moe_experts * 4 + n * k * (3 * h * esize + wide * esize + 4 + 3 * 8)
    return norm + norm2 + 2 * out + rope + core + o_in + mlp


def stage_input_bytes(cfg: GPTConfig, tp: int, stage: int, rows: int, esize: int) -> int:
    """What a stage keeps of its input per microbatch: the token ids on stage 0, else the
    activation received (sequence-sharded under SP)."""
    n = rows * cfg.seq_len
    if stage == 0:
        return n * 8
    return n // (tp if cfg.sequence_parallel else 1) * cfg.hidden * esize


def in_flight_peak(inputs: MemoryInputs, per_chunk: list[int]) -> int:
    """Replay this rank's action list: +bytes at each F, - at B (or W); the largest total."""
    actions = _compiled(inputs.schedule, inputs.pp, inputs.microbatches,
                        inputs.virtual_stages)[inputs.pp_rank]
    total = peak = 0
    split = {(a.mb, a.chunk) for a in actions if a.kind == "W"}
    for a in actions:
        if a.kind == "F":
            total += per_chunk[a.chunk]
            peak = max(peak, total)
        elif a.kind == "W" or (a.kind in ("B", "I") and (a.mb, a.chunk) not in split):
            total -= per_chunk[a.chunk]
    return peak


@functools.lru_cache(maxsize=32)
def _compiled(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> tuple:
    """Every rank's validated action list, compiled once for the pp ranks a caller predicts
    in turn (the planner asks for each rank of a layout)."""
    return tuple(tuple(acts) for acts in compile_schedule(schedule, pp, microbatches,
                                                          virtual_stages))


def bucket_runs(tensors: list[int], cap: int = ZERO_RUN_BYTES, alone=()) -> list[int]:
    """Elements of each run of one unit's tensors (in registration order): a new run before
    one that would take the current run past ``cap`` bytes of float32, and around each tensor
    whose index is in ``alone`` (``optim.zero_shards.run_cuts``)."""
    runs, used = [], 0
    for i, n in enumerate(tensors):
        if not runs or i in alone or (i - 1) in alone or (used and used + 4 * n > cap):
            runs.append(0)
            used = 0
        used += 4 * n
        runs[-1] += n
    return runs


def zero_runs(inputs: MemoryInputs, chunk: int) -> list[list[int]]:
    """The ZeRO-2/3 runs of each layer of ``chunk`` on this rank: ``[[r, ...] per layer]``, a
    tied embedding's copy (the embedding's weight, the head's) a run of its own."""
    cfg, out = inputs.cfg, []
    for i in inputs.stage_layers(chunk):
        tensors = layer_tensors(cfg, inputs.tp, i, inputs.ep)
        alone = ()
        if cfg.tie_embeddings and i == 0:
            alone = (0,)
        elif cfg.tie_embeddings and i == cfg.layers + 1:
            alone = (len(tensors) - 1,)
        out.append(bucket_runs(tensors, alone=alone))
    return out


def _pad(n: int, k: int) -> int:
    return -(-n // k) * k


def predict_memory(inputs: MemoryInputs) -> dict[str, int]:
    """Peak bytes per category on this rank (see the module docstring)."""
    out = state_bytes(inputs)
    out["activations"] = activation_bytes(inputs)
    return {k: int(out[k]) for k in CATEGORIES}


def state_bytes(inputs: MemoryInputs) -> dict[str, int]:
    """``predict_memory`` but activations: what the layout alone fixes, without the schedule's
    replay (the planner drops a layout whose state alone is over the budget with this)."""
    cfg, tp, d = inputs.cfg, inputs.tp, inputs.dp
    e = torch.empty((), dtype=inputs.dtype).element_size()
    bf16 = inputs.dtype != torch.float32
    chunks = range(inputs.virtual_stages)
    layers = [i for c in chunks for i in inputs.stage_layers(c)]
    tensors = [n for i in layers for n in layer_tensors(cfg, tp, i, inputs.ep)]
    P = sum(tensors)
    buckets = 4 * sum(_pad(n, ALIGN) for n in tensors)
    if inputs.zero == 0:
        out = {"params": e * P, "grads": (2 + 4) * P if bf16 else buckets,
               "optimizer": 12 * P if bf16 else 8 * P, "buffers": buckets if bf16 else 0}
    else:
        runs = [P] if inputs.zero == 1 else [r for c in chunks for u in zero_runs(inputs, c)
                                             for r in u]
        s = sum(-(-r // d) for r in runs)  # each run padded to a multiple of dp
        flat = 4 * d * s  # a padded flat buffer in float32
        if inputs.zero == 1:
            out = {"params": e * d * s, "grads": (e * P if bf16 else flat) + 4 * s,
                   "optimizer": (12 if bf16 else 8) * s, "buffers": flat if bf16 else 0}
        else:
            row = max(-(-r // d) for r in runs)  # elements of the largest piece
            if inputs.symmetric_staging:  # dp rows of at most STAGING_ROW_BYTES
                row = min(row, STAGING_ROW_BYTES // 4)
            out = {"params": e * d * s, "grads": max(e * P, 4 * s), "optimizer": 12 * s,
                   "buffers": 4 * d * row}
            if inputs.granularity == "unit":
                out["grads"] = 4 * s + e * max(runs)
                out["buffers"] = 4 * (d + (inputs.microbatches > 1)) * row
                if inputs.zero == 3 and not inputs.keep_gathered:
                    out["params"] = e * d * gathered_window(inputs)
    if inputs.error_feedback and d > 1:  # a float32 copy of what the reduction sends
        out["buffers"] += buckets if inputs.zero == 0 else flat
    return {k: int(v) for k, v in out.items()}


def gathered_window(inputs: MemoryInputs) -> int:
    """ZeRO-3 per unit: the most pieces (elements per rank; a gathered unit holds ``d`` times
    its pieces) of units gathered at once: a unit and the next of its chunk (prefetched), or
    one unit without prefetch."""
    d, best = inputs.dp, 0
    for c in range(inputs.virtual_stages):
        sizes = [sum(-(-r // d) for r in u) for u in zero_runs(inputs, c)]
        for k, size in enumerate(sizes):
            pair = size + (sizes[k + 1] if inputs.prefetch and k + 1 < len(sizes) else 0)
            best = max(best, pair)
    return best


def activation_bytes(inputs: MemoryInputs) -> int:
    """The activations' peak: each chunk's bytes per microbatch, replayed over the
    schedule's action list (``in_flight_peak``)."""
    cfg, tp = inputs.cfg, inputs.tp
    e = torch.empty((), dtype=inputs.dtype).element_size()
    chunks = range(inputs.virtual_stages)
    rows = inputs.rows // inputs.microbatches
    if inputs.cp > 1:
        # An estimate under context parallelism: every term with the T/cp tokens of this rank's
        # slice. Ring and Ulysses attention keep other tensors than the serial core (ring: the
        # q, k, v, output and log-sum-exp of the local slice; Ulysses: the head-sharded full
        # sequence), of about the same size; the rope tables are (T/cp, hd/2) after indexing.
        cfg = dataclasses.replace(cfg, seq_len=cfg.seq_len // inputs.cp)
    per_chunk = []
    for c in chunks:
        stage = c * inputs.pp + inputs.pp_rank
        cut = inputs.stage_layers(c)
        per_chunk.append(stage_input_bytes(cfg, tp, stage, rows, e) + sum(
            layer_activations(cfg, tp, i, rows, e, first=stage > 0 and i == cut[0])
            for i in cut))
    return int(in_flight_peak(inputs, per_chunk))
