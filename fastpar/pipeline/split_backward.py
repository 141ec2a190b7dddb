"""A stage's backward split in two, exactly, on its autograd graph: the input gradient now (``I``,
to be sent upstream at once), the weight gradients later (``W``, filling the pipeline's bubble).

The graph of one microbatch splits into the nodes that lie on a path from the stage outputs to
the stage inputs (the *input path*: ``I`` must run them) and the rest, which lead only to
parameters. For every parameter, walking up from its ``AccumulateGrad`` node to the first
input-path nodes finds its *boundaries* (``AddmmBackward`` of a Linear), and the outputs whose
gradient reaches it without crossing the input path. ``I`` runs the input-gradient backward and
records each boundary's incoming gradient (a node pre-hook; a boundary runs anyway, being on the
input path, but computes only its input-path outputs: for a Linear ``dx``, not ``dW``).

``W`` groups parameters that share a boundary (a weight used twice, a shared bias) and, per
group, takes the gradient from the group's boundaries to its parameters. Where one boundary lies
below another in the group (a Linear applied twice, a recurrence), a pre-hook replaces whatever
reaches the lower one by the gradient ``I`` recorded for it, so nothing is counted twice. For
ordinary layers a group is one Linear's ``weight`` and ``bias`` and ``W`` runs only its ``dW``.
The result equals a plain backward for any structure: weights used twice or tied within the
stage, weights used outside their module (attention's ``out_proj``), in-place updates,
recurrences, tuple outputs.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


class SplitBackward:
    """One microbatch's split backward: ``input_grads()`` (I), then ``weight_grads()`` (W).

    outputs, grads: the stage outputs that require grad and their gradients (``None`` for a
    scalar loss); inputs: the stage inputs that require grad; params: the trainable
    parameters whose gradients W must produce."""

    def __init__(self, outputs, grads, inputs, params):
        self.outputs, self.grads, self.inputs = list(outputs), list(grads), list(inputs)
        self.groups: list = []  # [(params, boundary nodes, output indices)]
        self.captured: dict = {}  # boundary node -> its incoming gradients, recorded by I
        self._plan(params)

    def _plan(self, params) -> None:
        input_nodes = {get_gradient_edge(x).node for x in self.inputs}
        out_index = defaultdict(list)  # output node -> indices into self.outputs
        for i, o in enumerate(self.outputs):
            out_index[o.grad_fn].append(i)
        parents: dict = defaultdict(list)  # node -> its parents
        on_path: dict = {}
        # Iterative post-order walk from the outputs: a node is on the input path when it is an
        # input's AccumulateGrad or one of its children is on the path.
        stack = [(n, False) for n in out_index if n is not None]
        seen = set()
        while stack:
            node, done = stack.pop()
            if done:
                on_path[node] = node in input_nodes or any(
                    on_path.get(child, False) for child, _ in node.next_functions
                    if child is not None)
                continue
            if node in seen:
                continue
            seen.add(node)
            stack.append((node, True))
            for child, _ in node.next_functions:
                if child is not None:
                    parents[child].append(node)
                    if child not in seen:
                        stack.append((child, False))
        # Each parameter's boundaries and free outputs, then groups of parameters that share one.
        owner: dict = {}  # boundary node or ("out", i) -> group id
        members: list = []  # group id -> [params, boundary nodes, output indices]
        for p in params:
            acc = get_gradient_edge(p).node
            if acc not in seen:
                continue  # not used by this microbatch
            bounds, outs = set(), set()
            walk, visited = [acc], {acc}
            while walk:
                node = walk.pop()
                outs.update(out_index.get(node, ()))
                for parent in parents.get(node, ()):
                    if on_path[parent]:
                        bounds.add(parent)
                    elif parent not in visited:
                        visited.add(parent)
                        walk.append(parent)
            keys = list(bounds) + [("out", i) for i in outs]
            ids = {owner[k] for k in keys if k in owner}
            gid = min(ids) if ids else len(members)
            if not ids:
                members.append([[], set(), set()])
            for other in ids - {gid}:  # merge groups joined by this parameter
                members[gid][0] += members[other][0]
                members[gid][1] |= members[other][1]
                members[gid][2] |= members[other][2]
                members[other] = None
            members[gid][0].append(acc)
            members[gid][1] |= bounds
            members[gid][2] |= outs
            for k in list(members[gid][1]) + [("out", i) for i in members[gid][2]]:
                owner[k] = gid
        self.groups = [tuple(m) for m in members if m is not None]

    def input_grads(self) -> list:
        """I: the gradient of every input (``None`` where it gets none); records each
        boundary's incoming gradient for ``weight_grads``."""
        if not self.inputs:
            return []
        hooks = [node.register_prehook(self._recorder(node))
                 for _, bounds, _ in self.groups for node in bounds]
        try:
            return list(torch.autograd.grad(self.outputs, self.inputs, self.grads,
                                            retain_graph=True, allow_unused=True))
        finally:
            for h in hooks:
                h.remove()

    def _recorder(self, node):
        def record(grad_outputs):
            self.captured[node] = grad_outputs
        return record

    def weight_grads(self) -> None:
        """W: accumulate every parameter's gradient (``.grad``), then drop the graph."""
        for accs, bounds, outs in self.groups:
            heads, grads, clamps = [], [], []
            for node in bounds:
                incoming = self.captured.get(node)
                if incoming is None:
                    continue  # no gradient reached it
                for k, g in enumerate(incoming):
                    if g is not None:
                        heads.append(GradientEdge(node, k))
                        grads.append(g)
                # what reaches this boundary from another one above it is already in
                # ``incoming``: replace, do not add
                clamps.append(node.register_prehook(lambda _, saved=incoming: saved))
            for i in outs:
                o, g = self.outputs[i], self.grads[i]
                heads.append(get_gradient_edge(o))
                grads.append(torch.ones_like(o) if g is None else g)
            try:
                if heads:
                    dws = torch.autograd.grad(heads, [GradientEdge(a, 0) for a in accs], grads,
                                              retain_graph=True, allow_unused=True)
                    for acc, dw in zip(accs, dws):
                        if dw is not None:
                            p = acc.variable
                            if p.grad is None:
                                p.grad = dw
                            else:
                                p.grad.add_(dw)  # in place: no new buffer per microbatch
            finally:
                for h in clamps:
                    h.remove()
        self.outputs = self.grads = self.inputs = None
        self.groups = []
        self.captured.clear()
