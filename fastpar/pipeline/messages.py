"""What travels between pipeline stages: a header (direction, microbatch, destination stage, and
each tensor's dtype, shape, requires_grad and whether it was scattered over tp) ahead of the
payload, or an abort message that says the sender gave up; and the errors of the pipeline's
``Channels`` (``fastpar/pipeline/channels.py``). The bytes travel on ``fastpar.comm.transport``.

Header layout (int64 words): ``[magic, direction, mb, stage, n, is_tuple (2: abort), then per
tensor: dtype code (0: none), requires_grad, scattered, ndim, *shape]``; an abort carries
``[..., 0, 2, nbytes, reason bytes]``.
"""

from __future__ import annotations

import torch

from fastpar.comm.engines.dtypes import CODE, dtype_of
from fastpar.comm.transport.base import BACKWARD, FORWARD, HEADER_MAX

ACTIVATION, GRADIENT = FORWARD, BACKWARD  # each direction on its own lane of the transport
WHAT = ("activation", "gradient")
_MAGIC = 0x46505032  # "FPP2"


class P2PError(RuntimeError):
    """A pipeline message went wrong: a mismatch with the schedule, or a peer that died."""


class P2PTimeout(P2PError, TimeoutError):
    """A pipeline wait ran past the job's timeout."""


def spec_of(values) -> tuple:
    """What a message says of its tensors: ``((dtype, shape, requires_grad) or None, ...)``."""
    values = values if isinstance(values, (tuple, list)) else (values,)
    return tuple(None if v is None else (v.dtype, tuple(v.shape), bool(v.requires_grad))
                 for v in values)


def describe(spec) -> str:
    def one(e):
        return "none" if e is None else f"{str(e[0]).removeprefix('torch.')} {list(e[1])}"
    return ", ".join(one(e) for e in spec) if len(spec) != 1 else one(spec[0])


def same_shapes(a, b) -> bool:
    """Specs agree on every present tensor's dtype and shape (requires_grad may differ)."""
    return len(a) == len(b) and all(
        x is None or y is None or (x[0] == y[0] and x[1] == y[1]) for x, y in zip(a, b))


def encode(direction: int, mb: int, stage: int, values, is_tuple: bool,
            scattered: list[bool]) -> torch.Tensor:
    words = [_MAGIC, direction, mb, stage, len(values), int(is_tuple)]
    for v, cut in zip(values, scattered):
        if v is None:
            words += [0, 0, 0, 0]
            continue
        if v.dtype not in CODE:
            raise P2PError(f"fastpar p2p: cannot send a {v.dtype} tensor between stages")
        words += [CODE[v.dtype], int(v.requires_grad), int(cut), v.dim(), *v.shape]
    if len(words) > HEADER_MAX:
        raise P2PError(f"fastpar p2p: a message of {len(values)} tensors needs a header of "
                       f"{len(words)} words, more than {HEADER_MAX}; send fewer tensors")
    return torch.tensor(words, dtype=torch.int64)


_ABORT = 2  # word 5 of a header: this message says the sender gave up (no payload)


def encode_abort(reason: str) -> torch.Tensor:
    data = reason.encode()[:8 * (HEADER_MAX - 8)]
    data += b"\0" * (-len(data) % 8)
    words = torch.frombuffer(bytearray(data), dtype=torch.int64) if data else \
        torch.empty(0, dtype=torch.int64)
    head = torch.tensor([_MAGIC, -1, -1, -1, 0, _ABORT, len(data)], dtype=torch.int64)
    return torch.cat([head, words])


def abort_reason(header: torch.Tensor) -> str | None:
    """The reason of an abort message, ``None`` for a normal one."""
    if header.numel() < 7 or int(header[5]) != _ABORT:
        return None
    n = int(header[6])
    return header[7:7 + (n + 7) // 8].numpy().tobytes()[:n].decode(errors="replace").rstrip("\0")


def decode(header: torch.Tensor):
    """``(direction, mb, stage, is_tuple, [(dtype, shape, requires_grad, scattered) or None])``"""
    w = header.tolist()
    if not w or w[0] != _MAGIC:
        raise P2PError(f"fastpar p2p: a message without fastpar's header arrived (first word "
                       f"{w[0] if w else None!r}); is something else sending on this channel?")
    direction, mb, stage, n, is_tuple = w[1:6]
    entries, i = [], 6
    for _ in range(n):
        code, grad, cut, ndim = w[i:i + 4]
        shape = tuple(w[i + 4:i + 4 + ndim])
        i += 4 + ndim
        entries.append(None if code == 0 else (dtype_of(code), shape, bool(grad), bool(cut)))
    return direction, mb, stage, bool(is_tuple), entries
