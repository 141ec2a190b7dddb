"""``fastpar.generate``: prefill, then decode with a KV cache, on a fastpar GPT at any tp size.

    topo = fastpar.init(tp=2)                         # mpirun -np 2 python run.py
    model = fastpar.models.GPT(cfg)                   # or gpt_layers' modules, HF weights in
    out = fastpar.generate(model, input_ids, max_new_tokens=64, attention_mask=mask,
                           eos_token_id=2, temperature=0.0)
    out.sequences                                     # (B, T + new), as Hugging Face's generate
    out.new_tokens                                    # each row's new ids, through its end token

Per step every rank of the tp group runs the layers on the new token of each row (the prompt
at the first step): what crosses ranks is the layers' own tensor parallelism (two all-reduces of
B x hidden per block, through ``fastpar.comm``'s lowest-latency engine for the size) and one
all-gather of the last position's logits shards (B x V/tp); keys and values stay on the rank
of their heads (``fastpar.nn.kv_cache``). Every rank then picks the same token.

A batch of prompts of different lengths is left-padded (``attention_mask`` 0 on the pads, as a
tokenizer with ``padding_side="left"`` gives it): positions count each row's real tokens, the
pads are masked out of attention, and every row's next token is at the last column.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from fastpar.comm.collectives import all_gather
from fastpar.generation.graphs import DecodeGraph
from fastpar.generation.sampling import Sampler
from fastpar.generation.stages import Stage, stage_of
from fastpar.nn.kv_cache import KVCache
from fastpar.runtime import group_size


@dataclasses.dataclass
class Generation:
    """What ``generate`` returns: ``sequences`` (B, T + steps) the prompts and new tokens, a
    finished row padded with ``pad_token_id`` after its end token as Hugging Face pads it;
    ``new_tokens`` each row's new ids through its end token; timings in seconds; the cache's
    bytes on this rank."""

    sequences: torch.Tensor
    new_tokens: list[list[int]]
    prefill_s: float
    decode_s: float
    decode_steps: int
    kv_cache_bytes: int

    @property
    def decode_ms_per_token(self) -> float:
        return 1e3 * self.decode_s / max(self.decode_steps, 1)


def _check_mask(mask: torch.Tensor) -> None:
    """Left padding only: each row's zeros all before its ones, and at least one token."""
    if mask.dtype == torch.bool:
        mask = mask.long()
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("attention_mask must hold 0 (padding) and 1 (tokens)")
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise ValueError("attention_mask has padding after a token: pad prompts on the left "
                         "(tokenizer.padding_side = 'left') so that every row ends at the last "
                         "column")
    if (mask.sum(dim=1) == 0).any():
        raise ValueError("attention_mask has a row without any token")


def _microbatches(requested, batch: int, pp: int) -> int:
    if requested is None:  # as many as stages, where the batch divides evenly
        return max(m for m in range(1, min(pp, batch) + 1) if batch % m == 0)
    if not isinstance(requested, int) or requested < 1 or batch % requested:
        raise ValueError(f"microbatches must be a positive integer dividing the batch of "
                         f"{batch} rows, got {requested!r}")
    return requested


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask=None,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, eos_token_id=None, ignore_eos: bool = False,
             pad_token_id: int | None = None, on_tokens=None,
             microbatches: int | None = None, decode: str = "dynamic") -> Generation:
    """Generate up to ``max_new_tokens`` tokens after each row of ``input_ids`` (B, T) on
    ``model``: a fastpar GPT (every layer here), or a ``fastpar.generation.Stages`` (this rank's
    pipeline stage). Collective over the model's tp and pp groups: call it on every rank with
    the same arguments; every rank returns the same tokens and timings (the first stage's; the
    cache's bytes are each rank's own). A failure on one stage aborts its neighbours' waits
    (``Channels.abandon``): build the ``Stages`` again after one. ``eos_token_id``: an id or
    a list of ids that end a row (unless ``ignore_eos``: then every row gets all
    ``max_new_tokens``); generation stops when every row has ended (under a pipeline, at most
    one step later: the first stage learns it a step behind). Sampling: ``Sampler``'s
    arguments. ``on_tokens(step, tokens, rows)``: called with each step's ids of batch rows
    ``rows`` (a slice: a pipeline's microbatch) as they are chosen, on the ranks that choose
    them and on the first stage as they arrive (streaming); where they are chosen it may return
    a bool tensor of those rows to end there (a stop string). ``microbatches``: how many slices
    of the batch a pipeline's stages work on at once (default: pp, where it divides the
    batch). ``decode``: "dynamic" (each step attends over the slots filled so far), "static"
    (fixed shapes: every slot, masked, buffers updated in place) or "cuda_graph" (the static
    step captured once as a CUDA graph and replayed: CUDA, one pipeline stage). The model runs
    in eval mode and is put back."""
    stage = stage_of(model)
    cfg = stage.cfg
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, tokens) with at least one token, got shape "
                         f"{tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if T + max_new_tokens > cfg.position_rows:
        raise ValueError(f"a prompt of {T} tokens and {max_new_tokens} new ones exceed the "
                         f"model's context of {cfg.position_rows} positions")
    mask = torch.ones(B, T, dtype=torch.long) if attention_mask is None else attention_mask
    _check_mask(mask)
    M = _microbatches(microbatches, B, stage.count)
    if decode not in ("dynamic", "static", "cuda_graph"):
        raise ValueError(f"decode must be 'dynamic', 'static' or 'cuda_graph', got {decode!r}")
    some = stage.embedding or stage.head or stage.blocks[0]
    if decode == "cuda_graph" and next(some.parameters()).device.type != "cuda":
        raise ValueError("decode='cuda_graph' needs the model on a CUDA device")
    if decode != "dynamic" and (stage.count > 1 or M > 1):
        raise ValueError(f"decode={decode!r} runs one pipeline stage (pp 1) on the whole batch "
                         f"(one microbatch); this model has {stage.count} stages, the batch "
                         f"{M} microbatches")
    if decode == "cuda_graph" and any(b.moe for b in stage.blocks):
        raise ValueError("decode='cuda_graph' cannot capture MoE blocks (their routing reads "
                         "counts on the host); use decode='dynamic'")
    ends = set() if ignore_eos or eos_token_id is None else (
        {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id})
    pad = pad_token_id if pad_token_id is not None else (min(ends) if ends else 0)
    run = _Run(stage, input_ids, mask, max_new_tokens, M, ends, pad,
               Sampler(temperature, top_k, top_p, seed), on_tokens, decode)
    layers = [m for m in (stage.embedding, *stage.blocks, stage.head) if m is not None]
    modes = [(m, m.training) for layer in layers for m in layer.modules()]
    for layer in layers:
        layer.eval()
    ok = False
    try:
        with torch.no_grad():
            run.all_steps()
        ok = True
    except BaseException as exc:
        if stage.channels is not None:  # the neighbours fail now, not at the timeout
            stage.channels.abandon(exc)
        raise
    finally:
        run.close(ok)
        for m, training in modes:
            m.training = training
    return run.result(input_ids)


class _Run:
    """One ``generate`` call on this rank: the steps, microbatch by microbatch; the first stage
    feeds each microbatch the tokens the last stage chose for it a step before (see the
    module docstring of ``fastpar.generation.stages``)."""

    def __init__(self, stage: Stage, input_ids, mask, steps: int, M: int, ends, pad, pick,
                 on_tokens, decode: str = "dynamic"):
        self.stage, self.steps, self.M, self.pick = stage, steps, M, pick
        self.decode, self.graph = decode, None
        self.ends, self.pad, self.on_tokens = ends, pad, on_tokens
        some = stage.embedding or stage.head or stage.blocks[0]
        self.device = next(some.parameters()).device
        B, T = input_ids.shape
        self.B, self.T = B, T
        self.rows = [slice(i * B // M, (i + 1) * B // M) for i in range(M)]
        self.ids, self.mask = input_ids.to(self.device), mask.to(self.device).long()
        self.positions = (self.mask.cumsum(dim=1) - 1).clamp(min=0)
        self.new = torch.full((B, steps), pad, dtype=torch.long, device=self.device)
        self.done = torch.zeros(B, dtype=torch.bool, device=self.device)
        self.ended_at = torch.full((B,), -1, dtype=torch.long, device=self.device)
        self.end_ids = torch.tensor(sorted(ends), dtype=torch.long, device=self.device)
        self.cache = None
        if stage.blocks:
            dtype = next(stage.blocks[0].parameters()).dtype
            self.cache = KVCache([b.attn for b in stage.blocks], batch=B, max_len=T + steps,
                                 dtype=dtype, device=self.device)
        self.taken = 0  # steps whose tokens the first stage holds for every row
        self.start = time.perf_counter()
        self.prefill_s = self.decode_s = 0.0
        self.ch = stage.channels

    # -- the steps ------------------------------------------------------------------------
    def all_steps(self) -> None:
        st = self.stage
        for t in range(self.steps):
            for m, rows in enumerate(self.rows):
                if st.first:
                    if t > 0 and st.count > 1:
                        self._arrived(t - 1, m, *self.ch.recv_forward(mb=m, stage=st.count))
                    if t > 0 and m == 0 and st.count > 1 and bool(self.done.all()):
                        return self._stop(t)
                    x = self.ids[rows] if t == 0 else self.new[rows, t - 1:t]
                else:
                    x, flag = self.ch.recv_forward(mb=m, stage=st.index)
                    if int(flag[0]):  # the first stage has stopped: pass it on, stop
                        if not st.last:
                            self.ch.send_forward((x, flag), mb=m, stage=st.index + 1)
                        return None
                if t > 0 and self.decode != "dynamic":  # one stage, one microbatch
                    self._arrived(t, m, *self._choose(t, rows, logits=self._static_logits(t, x)))
                    continue
                h = self._forward(t, rows, x)
                if not st.last:
                    flag = torch.zeros(1, dtype=torch.long, device=self.device)
                    self.ch.send_forward((h, flag), mb=m, stage=st.index + 1)
                    continue
                chosen, ended = self._choose(t, rows, h)
                if st.count > 1:
                    self.ch.send_forward((chosen, ended.long()), mb=m, stage=st.count)
                else:
                    self._arrived(t, m, chosen, ended)
            if self.cache is not None:
                self.cache.advance()
            if self.ch is not None:
                if t == 0:  # decode steps carry other shapes than the prefill
                    self.ch.finish_step()
                self.ch.release_completed()
            if st.count == 1 and bool(self.done.all()):
                return None
        if st.first and st.count > 1:  # the last step's tokens, still on their way
            for m in range(self.M):
                self._arrived(self.steps - 1, m, *self.ch.recv_forward(mb=m, stage=st.count))
        return None

    def _stop(self, t: int) -> None:
        """Every row has ended: tell the next stage, take the tokens still on their way."""
        dtype = next(self.stage.embedding.parameters()).dtype
        h = torch.zeros(self.rows[0].stop - self.rows[0].start, 1, self.stage.cfg.hidden,
                        dtype=dtype, device=self.device)
        flag = torch.ones(1, dtype=torch.long, device=self.device)
        self.ch.send_forward((h, flag), mb=0, stage=1)
        for m in range(1, self.M):
            self._arrived(t - 1, m, *self.ch.recv_forward(mb=m, stage=self.stage.count))

    def _forward(self, t: int, rows: slice, x):
        if t == 0:
            positions, valid = self.positions[rows], self.mask[rows]
        else:
            positions = self.positions[rows, -1:] + t
            valid = torch.ones_like(positions)
        if self.cache is not None:
            self.cache.begin(positions, valid, rows=rows)
        return self._layers(x, positions)

    def _layers(self, x, positions):
        """This stage's layers on ``x`` (token ids on the first stage, else hidden states)."""
        st = self.stage
        h = st.embedding(x, positions=positions) if st.first else x
        for block in st.blocks:
            h = block(h)
        return h

    def _logits(self, h) -> torch.Tensor:
        """The last position's full logits (b, V): the head's shards gathered over tp."""
        shard = self.stage.head(h[:, -1:]).squeeze(1)  # (b, V/tp)
        group = self.stage.head.out.group
        return shard if group_size(group) == 1 else all_gather(shard.contiguous(), group, dim=-1)

    def _static_logits(self, t: int, x) -> torch.Tensor:
        """A decode step of the whole batch in fixed shapes: run as it is (``decode="static"``)
        or as a CUDA graph captured at the first (``"cuda_graph"``)."""
        self.cache.prepare_static(self.positions[:, -1:] + t, self.T + t - 1)
        if self.decode == "static":
            return self._step(x)
        if self.graph is None:
            self.graph = DecodeGraph(self._step, x)
        return self.graph(x)

    def _step(self, x) -> torch.Tensor:
        return self._logits(self._layers(x, self.cache.static_positions))

    def _choose(self, t: int, rows: slice, h=None, logits=None):
        """The last stage: the next token of each row of the microbatch, and which rows end."""
        if logits is None:
            logits = self._logits(h)
        chosen = self.pick(logits.float())
        chosen = torch.where(self.done[rows], torch.full_like(chosen, self.pad), chosen)
        ended = torch.isin(chosen, self.end_ids) if self.ends else \
            torch.zeros_like(chosen, dtype=torch.bool)
        said = self.on_tokens(t, chosen, rows) if self.on_tokens is not None else None
        if said is not None:  # rows the caller ends (a stop string)
            ended = ended | said.to(device=chosen.device, dtype=torch.bool)
        self.done[rows] |= ended  # the last stage pads its ended rows from the next step on
        return chosen, ended

    def _arrived(self, t: int, m: int, chosen, ended) -> None:
        """The first stage holds step ``t``'s tokens of microbatch ``m``."""
        rows = self.rows[m]
        self.new[rows, t] = chosen.to(self.device)
        ended = ended.to(self.device, torch.bool)
        fresh = ended & (self.ended_at[rows] < 0)
        self.ended_at[rows] = torch.where(fresh, torch.full_like(self.ended_at[rows], t),
                                          self.ended_at[rows])
        self.done[rows] |= ended
        if self.on_tokens is not None and self.stage.count > 1:
            self.on_tokens(t, chosen, rows)  # streaming on the first stage
        if m == self.M - 1:
            self.taken = t + 1
            now = time.perf_counter()
            if t == 0:
                self.prefill_s = now - self.start
            else:
                self.decode_s = now - self.start - self.prefill_s

    def close(self, ok: bool) -> None:
        if self.cache is not None:
            self.cache_bytes = self.cache.nbytes
            self.cache.close()
        else:
            self.cache_bytes = 0
        if self.ch is not None and ok:  # the next call's prefill carries other shapes
            self.ch.finish_step()

    def result(self, input_ids) -> Generation:
        """The first stage's tokens, on every rank (a broadcast over the pp group): each row's
        through the step it ended; the sequences as wide as the last row still running (a
        pipeline may have run a step more, of padding only)."""
        st = self.stage
        mine = (self.new.cpu(), self.ended_at.cpu(), self.taken, self.prefill_s, self.decode_s)
        if st.count > 1:
            box = [mine if st.first else None]
            dist.broadcast_object_list(box, src=st.leader, group=st.group)
            mine = box[0]
        new, ended_at, taken, prefill_s, decode_s = mine
        stops = [int(e) + 1 if 0 <= e < taken else taken for e in ended_at.tolist()]
        width = max(stops, default=taken)
        rows = [new[i, :n].tolist() for i, n in enumerate(stops)]
        return Generation(torch.cat([input_ids.cpu(), new[:, :width]], dim=1), rows,
                          prefill_s, decode_s, max(taken - 1, 0), self.cache_bytes)
