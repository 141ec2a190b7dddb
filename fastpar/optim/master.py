"""``fastpar.optim.MasterWeights``: a low-precision model stepped on full-precision master weights.

    pipe = build_model()                                 # float32, as initialised
    opt = fastpar.optim.MasterWeights(pipe.parameters(), torch.optim.AdamW, lr=3e-4)
    pipe.to(torch.bfloat16)                              # compute in bf16 (masters stay float32)
    model = fastpar.DataParallel(pipe, reduce_dtype=torch.float32)
    loss_fn(model(x), y).backward()                      # bf16 grads, reduced over dp in fp32
    fastpar.optim.clip_grad_norm_(pipe, 1.0)             # optional, on the model's grads
    opt.step(); sched.step(); opt.zero_grad()

Each step, for every trainable parameter ``p`` (bf16) and its master ``m`` (float32)::

    m.grad = float32(p.grad)          # exact: every bf16 value is a float32 value
    inner.step()                      # AdamW on the masters: fp32 weights and fp32 state
    p = bf16(m)                       # round to nearest even, once per step

so an update below bf16's resolution (|dw| < 2^-9 |w|) accumulates in ``m`` instead of being lost,
and the inner optimizer's state (``exp_avg``, ``exp_avg_sq``) is float32. The arguments are
``DistributedOptimizer``'s, in its order (``params, optimizer_cls, **kwargs``): the same wrapper
shape as ZeRO's, which keeps float32 masters of its own dp slice, so the two layouts step the
same way. Built before the model is cast (as above), the masters are the float32 initial weights
themselves; built after, they are the bf16 weights widened.

``param_groups``, ``state`` and ``defaults`` are the inner optimizer's (over the masters, in the
parameters' order), so ``torch.optim.lr_scheduler`` drives it; ``state_dict`` /
``load_state_dict`` are the inner optimizer's too, and ``masters_as_params()`` lets the serial
checkpoint code read and write the masters where the parameters are (``fastpar.training``).
"""

from __future__ import annotations

import contextlib

import torch

from fastpar.optim.inner import InnerOptimizerView


class MasterWeights(InnerOptimizerView, torch.optim.Optimizer):
    """``optimizer_cls`` over full-precision copies of ``params``; see the module docstring.

    ``params``: an iterable of tensors (one hyper-parameter group; frozen ones are skipped).
    ``master_dtype``: the masters' and so the optimizer state's dtype (default ``float32``).
    ``kwargs`` go to ``optimizer_cls(masters, **kwargs)``."""

    def __init__(self, params, optimizer_cls, *, master_dtype: torch.dtype = torch.float32,
                 **kwargs):
        # torch.optim.Optimizer.__init__ is not called (as in DistributedOptimizer): the
        # param_groups are the inner optimizer's, over the masters.
        params = list(params)
        if any(isinstance(p, dict) for p in params):
            raise TypeError("MasterWeights takes an iterable of tensors; per-group options "
                            "(dicts) are not supported")
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError("MasterWeights: params must be tensors")
        if not (isinstance(master_dtype, torch.dtype) and master_dtype.is_floating_point):
            raise ValueError(f"master_dtype must be a floating torch.dtype, got {master_dtype!r}")
        seen, self.params = set(), []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        if not self.params:
            raise ValueError("MasterWeights got no trainable parameters")
        self.master_dtype = master_dtype
        with torch.no_grad():
            # Always a copy, even of a parameter that has the master dtype now: the model is
            # usually cast after this (see the module docstring).
            self.masters = [p.detach().to(master_dtype, copy=True).requires_grad_(True)
                            for p in self.params]
        self._master = {id(p): m for p, m in zip(self.params, self.masters)}
        self.optimizer_cls, self.kwargs = optimizer_cls, dict(kwargs)
        self.inner = optimizer_cls(self.masters, **kwargs)

    # ---- what torch.optim.Optimizer users read (param_groups, state, defaults: the inner ones) --

    def add_param_group(self, param_group) -> None:
        raise NotImplementedError("MasterWeights holds one group; build it with every parameter")

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        """The master of parameter ``p``."""
        return self._master[id(p)]

    def __repr__(self) -> str:
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in self.params})
        return (f"MasterWeights({self.optimizer_cls.__name__}, {len(self.params)} params "
                f"({', '.join(dtypes)}), masters {str(self.master_dtype).replace('torch.', '')})")

    # ---- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Masters take the parameters' gradients (widened), the inner optimizer steps them,
        and each parameter becomes its master rounded to the parameter's dtype."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad = None  # as torch.optim skips a parameter without a gradient
            elif m.grad is None:
                m.grad = p.grad.to(m.dtype, copy=True)
            else:
                m.grad.copy_(p.grad)
        self.inner.step()
        self._copy_back()
        return loss

    def refresh_params(self) -> None:
        """The parameters from the masters (rounded), after the masters were set from outside
        (a checkpoint load)."""
        self._copy_back()

    @torch.no_grad()
    def _copy_back(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.copy_(m)  # round to nearest even

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The parameters' gradients (and the masters' copies)."""
        for t in [*self.params, *self.masters]:
            if t.grad is None:
                continue
            if set_to_none:
                t.grad = None
            else:
                t.grad.detach_().zero_()

    # ---- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The inner optimizer's (its state is the masters', float32); the masters themselves
        are weights: save them through ``masters_as_params()``."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)

    @contextlib.contextmanager
    def masters_as_params(self):
        """For the duration, each parameter's ``.data`` is its master, so whatever reads or
        writes the model's weights (``fastpar.full_state_dict``, ``load_full_state_dict``) reads
        or writes the masters; afterwards the parameters are their masters rounded again."""
        old = [p.data for p in self.params]
        try:
            for p, m in zip(self.params, self.masters):
                p.data = m.data
            yield
        finally:
            for p, o in zip(self.params, old):
                p.data = o
            self._copy_back()
