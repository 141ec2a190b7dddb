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
from torch import nn

from fastpar.comm.collectives import all_gather
from fastpar.generation.sampling import Sampler
from fastpar.models.gpt import GPTBlock, GPTEmbedding, GPTHead
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


def _parts(model) -> tuple[GPTEmbedding, list[GPTBlock], GPTHead]:
    layers = list(model) if isinstance(model, (nn.Sequential, list, tuple)) else None
    if (not layers or not isinstance(layers[0], GPTEmbedding)
            or not isinstance(layers[-1], GPTHead)
            or not all(isinstance(b, GPTBlock) for b in layers[1:-1])):
        raise TypeError(f"fastpar.generate takes a fastpar GPT (fastpar.GPT, or the list of "
                        f"gpt_layers' modules: embedding, blocks, head), got "
                        f"{type(model).__name__}")
    return layers[0], layers[1:-1], layers[-1]


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


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask=None,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, eos_token_id=None, ignore_eos: bool = False,
             pad_token_id: int | None = None, on_tokens=None) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after each row of ``input_ids`` (B, T) on
    ``model`` (a fastpar GPT; collective over its tp group: call it on every rank with the same
    arguments). ``eos_token_id``: an id or a list of ids that end a row (unless ``ignore_eos``:
    then every row gets all ``max_new_tokens``); generation stops when every row has ended.
    Sampling: ``Sampler``'s arguments. ``on_tokens(step, tokens)``: called with each step's (B,)
    ids as they are chosen (streaming); it may return a (B,) bool tensor of rows to end there
    (a stop string; the same on every rank). The model runs in eval mode and is put back."""
    embedding, blocks, head = _parts(model)
    cfg = embedding.cfg
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, tokens) with at least one token, got shape "
                         f"{tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if T + max_new_tokens > cfg.position_rows:
        raise ValueError(f"a prompt of {T} tokens and {max_new_tokens} new ones exceed the "
                         f"model's context of {cfg.position_rows} positions")
    device = embedding.tok.weight.device
    mask = torch.ones(B, T, dtype=torch.long) if attention_mask is None else attention_mask
    _check_mask(mask)
    mask, input_ids = mask.to(device).long(), input_ids.to(device)
    ends = set() if ignore_eos or eos_token_id is None else (
        {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id})
    pad = pad_token_id if pad_token_id is not None else (min(ends) if ends else 0)
    pick = Sampler(temperature, top_k, top_p, seed)
    dtype = embedding.tok.weight.dtype
    cache = KVCache([b.attn for b in blocks], batch=B, max_len=T + max_new_tokens,
                    dtype=dtype, device=device)
    tp_group = head.out.group
    modes = [m.training for m in model.modules()] if isinstance(model, nn.Module) else None
    for layer in (embedding, *blocks, head):
        layer.eval()
    new = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    tokens, valid, steps, decode_s = input_ids, mask, 0, 0.0
    start = time.perf_counter()
    try:
        with torch.no_grad():
            for step in range(max_new_tokens):
                cache.begin(positions, valid)
                h = embedding(tokens, positions=positions)
                for block in blocks:
                    h = block(h)
                cache.advance()
                shard = head(h[:, -1:]).squeeze(1)  # (B, V/tp)
                logits = shard if group_size(tp_group) == 1 else \
                    all_gather(shard.contiguous(), tp_group, dim=-1)
                chosen = pick(logits.float())
                chosen = torch.where(done, torch.full_like(chosen, pad), chosen)
                new[:, step] = chosen
                ended = on_tokens(step, chosen) if on_tokens is not None else None
                if ended is not None:  # rows the caller ends (a stop string)
                    done |= ended.to(device=device, dtype=torch.bool)
                if ends:
                    done |= torch.isin(chosen, torch.tensor(sorted(ends), device=device))
                now = time.perf_counter()
                if step == 0:
                    prefill_s = now - start
                else:
                    decode_s += now - start
                    steps += 1
                start = now
                if bool(done.all()):
                    break
                tokens, valid = chosen[:, None], torch.ones(B, 1, dtype=torch.long, device=device)
                positions = positions[:, -1:] + 1
    finally:
        cache_bytes = cache.nbytes
        cache.close()
        if modes is not None:
            for m, training in zip(model.modules(), modes):
                m.training = training
    taken = new[:, :step + 1]
    rows = []
    for row in taken.tolist():
        kept = []
        for t in row:
            kept.append(t)
            if t in ends:
                break
        rows.append(kept)
    return Generation(torch.cat([input_ids, taken], dim=1).cpu(), rows, prefill_s, decode_s,
                      steps, cache_bytes)
