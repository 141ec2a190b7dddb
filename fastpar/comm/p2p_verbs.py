"""Megatron's module-level P2P verbs: each acts on the job's latest open
``fastpar.comm.p2p.Channels`` (``CommState.channels``, set by the ``Channels`` constructor), and
raises ``RuntimeError`` when the job has none. Imported from ``fastpar.comm.p2p``."""

from __future__ import annotations

from fastpar.comm.p2p_messages import SendHandle


def _last():
    """The job's latest open ``Channels``."""
    from fastpar.comm.state import current

    channels = current().channels
    if channels is None or channels.closed:
        raise RuntimeError("fastpar p2p: no open Channels in this job; build one with "
                           "fastpar.comm.p2p.Channels(group) (a Pipeline builds its own)")
    return channels


def send_forward(values, *, mb: int, stage: int) -> SendHandle:
    return _last().send_forward(values, mb=mb, stage=stage)


def recv_forward(*, mb: int, stage: int):
    return _last().recv_forward(mb=mb, stage=stage)


def send_backward(grads, *, mb: int, stage: int, expect=None) -> SendHandle:
    return _last().send_backward(grads, mb=mb, stage=stage, expect=expect)


def recv_backward(*, mb: int, stage: int, expect=None):
    return _last().recv_backward(mb=mb, stage=stage, expect=expect)


def send_forward_recv_backward(values, **kwargs):
    return _last().send_forward_recv_backward(values, **kwargs)


def send_backward_recv_forward(grads, **kwargs):
    return _last().send_backward_recv_forward(grads, **kwargs)
