"""A decode step captured as a CUDA graph: launched as one graph instead of a few hundred kernels
from Python, what bounds a small batch's decode on a GPU.

    graph = DecodeGraph(step, x)     # captures step(x) (x: the (B, 1) token ids), after warm-up
    logits = graph(x_next)           # copies the ids in, replays, returns the output buffer

``step`` must run in fixed shapes and read every other input from buffers updated in place
(``fastpar.nn.kv_cache.KVCache.prepare_static``: positions, the slot, the mask), as
``fastpar.generate(..., decode="cuda_graph")`` arranges. The warm-up runs the step twice on a
side stream with the first step's own inputs (its cache writes are the step's own, so running it
again changes nothing), as torch's capture requires.
"""

from __future__ import annotations

import torch


class DecodeGraph:
    def __init__(self, step, x: torch.Tensor):
        if x.device.type != "cuda":
            raise ValueError(f"a CUDA graph needs CUDA tensors, got {x.device}")
        self.x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(self.x)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = step(self.x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x)
        self.graph.replay()
        return self.out
