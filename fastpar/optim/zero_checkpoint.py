"""Checkpoints of ``DistributedOptimizer``: the per-rank shard, and the consolidated state in
the flat order every stage and dp size shares (so a state saved at ZeRO-1 dp 2 loads at ZeRO-3
dp 4: ``FlatGroup.unshard`` / ``FlatGroup.local`` move between them)."""

from __future__ import annotations

import copy

import torch

from fastpar import comm


class CheckpointMixin:
    """The state-dict methods; ``self`` is a ``DistributedOptimizer``."""

    def _layout(self) -> list:
        return [[(r.lo, r.hi) for r in f.runs] for f in self.flat]

    def state_dict(self) -> dict:
        """This rank's shard: the inner optimizer's state dict and the masters; loads back only
        at the same dp size and runs (stage) (``consolidated_state_dict`` moves between them)."""
        return {"dp_size": self.dp_size, "dp_rank": self.dp_rank,
                "numels": [f.numel for f in self.flat], "runs": self._layout(),
                "masters": [f.master.detach().clone() for f in self.flat],
                "inner": self.inner.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Inverse of ``state_dict`` (same dp size, rank and runs, same parameters); the masters
        are restored and the parameters set from them (collective)."""
        got = (state_dict["dp_size"], state_dict["dp_rank"], list(state_dict["numels"]),
               state_dict.get("runs", self._layout()))
        want = (self.dp_size, self.dp_rank, [f.numel for f in self.flat], self._layout())
        if got != want:
            raise ValueError(f"DistributedOptimizer.load_state_dict: saved at dp_size "
                             f"{got[0]}, dp_rank {got[1]} with flat groups of {got[2]} elements "
                             f"in runs {got[3]}; this optimizer has dp_size {want[0]}, dp_rank "
                             f"{want[1]}, {want[2]} in runs {want[3]}; use "
                             "consolidated_state_dict() to change dp size or stage")
        self.inner.load_state_dict(copy.deepcopy(state_dict["inner"]))  # steps mutate it
        self._set_masters(list(state_dict["masters"]), sharded=True)

    def _gather_flat(self, f, shard: torch.Tensor) -> torch.Tensor:
        """``(numel,)``: every rank's ``(shard,)`` tensor joined in flat order (collective)."""
        return f.unshard(comm.all_gather(shard.detach().contiguous(), group=self.group))

    @torch.no_grad()
    def consolidated_state_dict(self) -> dict:
        """The full, unsharded state, identical on every rank (collective): per flat group the
        master weights and each per-element state tensor as ``(numel,)`` in flat order, the
        scalar state (Adam's ``step``) as is, and the hyper-parameters. Independent of dp and of
        the stage; plain tensors, lists and numbers, so ``torch.load(weights_only=True)``
        reads it."""
        inner = self.inner.state_dict()
        state = {}
        for i, f in enumerate(self.flat):
            st = {}
            for key, value in inner["state"].get(i, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == f.master.shape \
                        and value.dim() == 1:
                    value = self._gather_flat(f, value)
                st[key] = value.clone() if isinstance(value, torch.Tensor) else value
            state[i] = st
        masters = [self._gather_flat(f, f.master).clone() for f in self.flat]
        return {"numels": [f.numel for f in self.flat], "masters": masters, "state": state,
                "param_groups": inner["param_groups"]}

    @torch.no_grad()
    def load_consolidated_state_dict(self, state_dict: dict) -> None:
        """Take this rank's shard of a ``consolidated_state_dict`` saved at any dp size and
        stage (the same parameters, in the same order); masters and parameters are set."""
        numels = [f.numel for f in self.flat]
        if list(state_dict["numels"]) != numels:
            raise ValueError(f"DistributedOptimizer.load_consolidated_state_dict: saved flat "
                             f"groups of {list(state_dict['numels'])} elements, this optimizer "
                             f"has {numels} (a different model or parameter order)")
        state = {}
        for i, f in enumerate(self.flat):
            st = {}
            for key, value in state_dict["state"].get(i, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == (f.numel,) \
                        and value.dim() == 1 and key != "step":
                    value = f.local(value.to(f.master.device))
                elif isinstance(value, torch.Tensor):
                    value = value.clone()  # torch keeps it as is: the caller's dict stays intact
                st[key] = value
            state[i] = st
        self.inner.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
        self._set_masters(list(state_dict["masters"]), sharded=False)

    @torch.no_grad()
    def master_weights(self) -> dict:
        """``{param: its float32 master, whole}`` (collective over the dp group): the weights
        of record of a bf16 model (a float32 model's masters equal its parameters)."""
        out = {}
        for f in self.flat:
            full = self._gather_flat(f, f.master)
            for p, a, b in zip(f.params, f.offsets, f.offsets[1:]):
                out[p] = full[a:b].view(p.shape)
        return out

    @torch.no_grad()
    def load_master_weights(self, values: dict) -> None:
        """Set the masters from whole values, ``{param: tensor}`` for every parameter held
        (e.g. a bf16 model's float32 initial weights), and the parameters from them (rounded
        to their dtype). Local: every dp rank passes the same values."""
        self._set_masters([torch.cat([values[p].reshape(-1) for p in f.params])
                           for f in self.flat], sharded=False)

    def _set_masters(self, masters: list[torch.Tensor], sharded: bool) -> None:
        for f, m in zip(self.flat, masters):
            m = m.to(device=f.master.device, dtype=f.master.dtype)
            f.master.copy_(m if sharded else f.local(m))
        self.refresh_params()

    def refresh_params(self) -> None:
        """The parameters from the masters, after the masters were set from outside (a
        checkpoint load): collective over the dp group."""
        self._publish()
        self._reduced = False
