"""What every point-to-point engine shares: the send handle it returns, its two lanes, and the
size of a message header (``fastpar.pipeline.messages`` encodes the headers; the torch engine sends each
in exactly ``HEADER_MAX`` words)."""

from __future__ import annotations

HEADER_MAX = 256  # int64 words
# Two lanes between a pair of ranks, so that the two directions never queue behind each other
# (NCCL has no tags: the torch engine clones the group once per lane; the shm rings tag them).
FORWARD, BACKWARD = 0, 1  # the pipeline's activations and gradients


class SendHandle:
    """A send of a point-to-point engine: ``wait()`` returns once the caller may reuse what it
    sent, bounded by the channel's timeout, and ``is_completed()`` says so without waiting. Each
    engine has its own kind (torch's batched isend works, a send of fastpar's shm rings); this
    base is a send complete already (to this rank itself)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        pass
