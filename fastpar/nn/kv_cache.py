"""The key/value cache of generation: each attention layer's keys and values of every token seen
so far, preallocated for the batch and the longest sequence, this rank's KV heads only.

    cache = KVCache(attentions, batch=8, max_len=512, dtype=torch.float32, device=dev)
    cache.begin(positions, valid)      # before each forward: the new tokens' positions (B, T)
    ...                                #   and which of the B x (start + T) slots hold tokens
    cache.close()                      # the layers run without a cache again

Layout: per layer ``k``, ``v`` of (B, kv heads / tp, max_len, head dim): tensor parallelism
splits the heads, so a rank keeps only the keys and values of its own heads and nothing about
the cache crosses ranks. Slot ``s`` of a row is the row's ``s``-th token, padding included: a
left-padded batch keeps its pads in the slots before each prompt and masks them out
(``valid``), so every row writes its new tokens to the same slots at every step.

A forward under a cache (``ParallelSelfAttention`` reads its ``kv_cache``) writes its tokens'
keys and values at slots ``start .. start + T - 1`` and attends over slots ``0 .. start + T -
1``: causal among the new tokens, and only to valid slots; rope and learned positions use
``positions`` (a padded row's count of real tokens before each one), as Hugging Face's
``generate`` does. A pad's query sees only itself, so no row of the attention is empty.
"""

from __future__ import annotations

import torch


class KVCache:
    """One model's cache over ``attentions`` (its ``ParallelSelfAttention`` modules, in order),
    attached to them until ``close``."""

    def __init__(self, attentions, *, batch: int, max_len: int, dtype, device):
        self.attentions = list(attentions)
        self.batch, self.max_len = batch, max_len
        self.k, self.v = [], []
        for attn in self.attentions:
            shape = (batch, attn.local_kv_heads, max_len, attn.head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=device))
        self.start = 0  # slots already filled
        self.positions = self.mask = None
        self.static = False  # the last step was a fixed-shape one (prepare_static)
        self._valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        for index, attn in enumerate(self.attentions):
            attn.kv_cache = (self, index)

    @property
    def nbytes(self) -> int:
        """This rank's cache memory."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def begin(self, positions: torch.Tensor, valid: torch.Tensor, rows: slice | None = None):
        """The next forward's tokens: ``positions`` (B, T) and ``valid`` (B, T), whether each is
        a real token (False: padding), of the cache's ``rows`` (default all: a pipeline's
        microbatch is a slice of them). Builds the mask (B, 1, T, start + T) every layer uses.
        Every row slice of a step writes the same slots: ``advance`` after the last."""
        rows = slice(0, self.batch) if rows is None else rows
        B, T = positions.shape
        if B != len(range(self.batch)[rows]):
            raise ValueError(f"KVCache: {B} rows given for rows {rows} of a cache of "
                             f"{self.batch}")
        if self.start + T > self.max_len:
            raise ValueError(f"KVCache: {self.start} + {T} tokens exceed the cache's "
                             f"{self.max_len} slots")
        end = self.start + T
        self._rows = rows
        self._valid[rows, self.start:end] = valid.to(torch.bool)
        slots = torch.arange(end, device=positions.device)
        mine = torch.arange(self.start, end, device=positions.device)
        causal = slots[None, :] <= mine[:, None]  # (T, end)
        mask = causal[None] & self._valid[rows, None, :end]  # (B, T, end)
        mask |= slots[None, None, :] == mine[None, :, None]  # each token sees itself
        self.positions, self.mask = positions, mask[:, None]
        self._writing = (self.start, end)
        self.static = False

    def store(self, index: int, k: torch.Tensor, v: torch.Tensor):
        """Layer ``index``'s new keys and values (B, kv heads, T, hd) into their slots; returns
        every slot's so far."""
        start, end = self._writing
        rows = self._rows
        self.k[index][rows, :, start:end] = k
        self.v[index][rows, :, start:end] = v
        return self.k[index][rows, :, :end], self.v[index][rows, :, :end]

    def prepare_static(self, positions: torch.Tensor, slot: int) -> None:
        """A decode step of the whole batch in fixed shapes (what a CUDA graph captures): its
        one token per row at ``slot``, ``positions`` (B, 1). The step's tensors (positions,
        the slot, the mask over every slot) are buffers updated in place, and the layers then
        write with ``index_copy_`` and attend over all ``max_len`` slots (``store_static``)."""
        if getattr(self, "static_mask", None) is None:
            dev = self._valid.device
            self.static_positions = torch.zeros(self.batch, 1, dtype=torch.long, device=dev)
            self.static_slot = torch.zeros(1, dtype=torch.long, device=dev)
            self.static_mask = torch.zeros(self.batch, 1, 1, self.max_len, dtype=torch.bool,
                                           device=dev)
            self._slots = torch.arange(self.max_len, device=dev)
        if slot >= self.max_len:
            raise ValueError(f"KVCache: slot {slot} is past the cache's {self.max_len}")
        self._valid[:, slot] = True
        self.static_positions.copy_(positions)
        self.static_slot.fill_(slot)
        self.static_mask.copy_((self._valid & (self._slots <= slot))[:, None, None, :])
        self.static, self.positions, self._writing = True, self.static_positions, (slot, slot + 1)

    def store_static(self, index: int, k: torch.Tensor, v: torch.Tensor):
        """``store`` of a static step: every slot's keys and values, the new ones written."""
        self.k[index].index_copy_(2, self.static_slot, k)
        self.v[index].index_copy_(2, self.static_slot, v)
        return self.k[index], self.v[index]

    def advance(self) -> None:
        """The forward is done: its slots are filled."""
        self.start = self._writing[1]

    def close(self) -> None:
        for attn in self.attentions:
            attn.kv_cache = None
        self.k, self.v = [], []
