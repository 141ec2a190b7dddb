"""Seconds of each piece of one training step on one rank, from the cluster's measured speeds:
the per-layer compute of a microbatch (GEMMs at the layer's shapes, attention, elementwise
traffic), the collectives inside a layer (tp, cp, ep), pipeline sends, and the per-step
gradient reduction and optimizer update. ``step.py`` puts them on the pipeline's timeline.

Per microbatch of b sequences, a rank holds n = b T / cp tokens; h hidden, hd head dim,
q = nh hd, kv = nkv hd, f the MLP width, V the vocabulary, e the element size. A GEMM
(m, k) x (k, n) costs 2 m n k FLOPs at ``cluster.gemm_rate(m, n, k)``; its backward is the
input gradient (m, n) x (n, k) (I) and the weight gradient (n, m) x (m, k) (W), each at its
own shape. Attention's core: 2 T^2 hd FLOPs per head and sequence under a causal mask when
the kernel skips masked blocks (flash), 4 T^2 hd when it does not, a 1/cp share of it per rank,
the backward 2.5 x the forward (five products against two). Elementwise ops (norms, residual
adds, rope, the activation, the loss's softmax; the scores' mask-softmax-dropout where the
kernel materialises them) move their bytes at ``cluster.membw``, twice in backward.
"""

from __future__ import annotations

import dataclasses

from fastpar.models.config import GPTConfig
from fastpar.plan.cluster import Cluster

ATTN_BACKWARD = 2.5  # the core's backward FLOPs over its forward's (flash: 5 matmuls vs 2)
OPTIMIZER_BYTES = 32  # AdamW per element: p, g, m, v read; p, m, v written; the clip's read


@dataclasses.dataclass
class Work:
    """Seconds of one layer for one microbatch: forward, input gradient (I: dgrad, the
    attention backward, elementwise backward, tp collectives of backward, the recompute), and
    weight gradient (W); ``terms`` names every part (for ``--explain``)."""

    f: float = 0.0
    i: float = 0.0
    w: float = 0.0
    terms: dict = dataclasses.field(default_factory=dict)

    def add(self, name: str, phase: str, seconds: float) -> None:
        setattr(self, phase, getattr(self, phase) + seconds)
        self.terms[f"{phase}:{name}"] = self.terms.get(f"{phase}:{name}", 0.0) + seconds

    def own(self, math_only: bool) -> dict:
        """Each phase's seconds but its collectives (and, ``math_only``, but its host
        overhead: what the rate model says of the math alone)."""
        out = {"f": 0.0, "i": 0.0, "w": 0.0}
        for name, t in self.terms.items():
            phase, what = name.split(":", 1)
            if what.startswith(COMM_PREFIXES) or (math_only and what == "host overhead"):
                continue
            out[phase] += t
        return out


def host_span(cluster: Cluster, size: int, stride: int) -> tuple[int, int]:
    """``(ranks per host, hosts)`` of a group of ``size`` ranks ``stride`` apart (the grid's
    rank order: tp fastest, then cp, dp, pp)."""
    per_host = max(1, min(size, cluster.ranks_per_host // stride)) if stride <= \
        cluster.ranks_per_host else 1
    return per_host, -(-size // per_host)


def group_time(cluster: Cluster, op: str, nbytes: float, size: int, stride: int) -> float:
    """A collective over a group of the grid: in a host, the intra link; across hosts, the
    hierarchical route: the op over the host's g members, then over the h hosts on a 1/g piece,
    the host's link shared by every rank of the host (all groups of the axis run at once)."""
    if size <= 1:
        return 0.0
    g, h = host_span(cluster, size, stride)
    t = cluster.intra.time(op, g, nbytes)
    if h > 1:
        t += cluster.link("inter").time(op, h, nbytes / g, share=1.0 / cluster.ranks_per_host)
    return t


def tp_exposed(cfg: GPTConfig, cluster: Cluster, tp: int, comm_s: float, gemm_s: float,
               nbytes: int) -> float:
    """What of a tp collective stays on the critical path under the layers' overlap policy
    (``nn.overlap.decide``): all of it, or with k pieces the larger of the last piece's and
    what the k - 1 earlier GEMM pieces could not hide."""
    from fastpar.nn.overlap import decide

    engine = cluster.intra.engine or ("nccl" if cluster.device == "cuda" else "shm")
    d = decide(cfg.overlap, None, tp=tp, device=cluster.device, engine=engine, nbytes=nbytes)
    if not d.enabled:
        return comm_s
    k = d.pieces
    return max(comm_s / k, comm_s - gemm_s * (k - 1) / k)


def _gemm(work: Work, cluster: Cluster, name: str, m: int, n: int, k: int,
          recompute: bool = False) -> float:
    """A linear layer (m tokens, k in, n out): forward, I and W at their shapes."""
    f = cluster.gemm_time(m, n, k)
    work.add(name, "f", f)
    work.add(name, "i", cluster.gemm_time(m, k, n))
    work.add(name, "w", cluster.gemm_time(n, k, m))
    if recompute:
        work.add(f"recompute {name}", "i", f)
    return f


def layer_work(cfg: GPTConfig, cluster: Cluster, *, index: int, tp: int, cp: int, ep: int,
               rows: int, esize: int, causal_skip: bool = True) -> Work:
    """One microbatch of ``rows`` sequences through layer ``index`` (0 embedding, 1..L blocks,
    L + 1 head) on one rank."""
    T, h = cfg.seq_len, cfg.hidden
    hd = cfg.head_size
    n = rows * T // cp
    nh, q, kv, f = cfg.heads // tp, cfg.heads // tp * hd, cfg.num_kv_heads // tp * hd, \
        cfg.ffn_size // tp
    outside = n // tp if cfg.sequence_parallel else n  # tokens outside the tp regions
    membw = cluster.membw
    work = Work()
    act = n * h * esize  # one (n, h) activation: what each tp collective carries
    tp_s = group_time(cluster, "all_reduce", act, tp, 1)
    full = cfg.recompute == "full"
    ov = cluster.overhead_scale * (cluster.overhead_end_s if index in (0, cfg.layers + 1)
                                   else cluster.overhead_block_s)
    if ov:  # host work beyond the math: a third forward, two thirds backward (+ recompute)
        work.add("host overhead", "f", ov / 3)
        work.add("host overhead", "i", ov * (2 + (full and 0 < index <= cfg.layers)) / 3)
    if index == 0:
        work.add("embedding gather", "f", act / membw)
        if tp > 1:
            work.add("tp all-reduce", "f", tp_s)
        return work
    if index == cfg.layers + 1:
        gemm = _gemm(work, cluster, "head", n, cfg.vocab_size // tp, h)
        logits = n * cfg.vocab_size // tp * 4  # the loss's float32 logits
        work.add("norm, loss softmax", "f", (2 * outside * h * esize + 3 * logits) / membw)
        work.add("norm, loss softmax", "i", (4 * outside * h * esize + 2 * logits) / membw)
        if tp > 1:
            work.add("tp all-reduce", "i", tp_exposed(cfg, cluster, tp, tp_s, gemm, act))
            work.add("tp loss all-reduces", "f", 3 * group_time(cluster, "all_reduce", 4 * n,
                                                                 tp, 1))
        return work
    # attention: q, k, v projections, the core, the output projection
    _gemm(work, cluster, "qkv", n, q + 2 * kv, h, full)
    per_seq = (2 if causal_skip else 4) * T * T * hd / cp  # one head, one sequence
    core = rows * nh * per_seq / cluster.attention_rate(T, hd)
    work.add("attention core", "f", core)
    work.add("attention core", "i", ATTN_BACKWARD * core)
    if full or cfg.recompute == "selective":
        work.add("recompute attention core", "i", core)
    if not causal_skip:  # scores materialised: mask, softmax, dropout over (nh, T/cp, T)
        scores = 4 * rows * nh * T * T // cp * esize
        work.add("attention scores", "f", scores / membw)
        work.add("attention scores", "i", 2 * scores / membw)
    o = _gemm(work, cluster, "o_proj", n, h, q, full)
    if cp > 1:
        cp_ring(work, cluster, cp, tp, 2 * rows * (T // cp) * kv * esize, core,
                again=cfg.recompute in ("full", "selective"))
    # the MLP (or the experts)
    if cfg.is_moe(index):
        k = cfg.moe_top_k
        _gemm(work, cluster, "router", n, cfg.moe_experts, h, full)
        mats = 3 if cfg.mlp == "swiglu" else 2
        for j in range(mats):  # experts are whole on every tp rank: n k routed rows
            _gemm(work, cluster, f"experts {j}", n * k, cfg.ffn_size, h, full)
        a2a = group_time(cluster, "all_to_all", n * k * h * esize, ep, tp * cp)
        work.add("ep all-to-all", "f", 2 * a2a)
        work.add("ep all-to-all", "i", 2 * a2a * (2 if full else 1))
        down = 0.0
        width = cfg.ffn_size * k
    else:
        up = 2 * f if cfg.mlp == "swiglu" else f
        _gemm(work, cluster, "mlp up", n, up, h, full)
        down = _gemm(work, cluster, "mlp down", n, h, f, full)
        width = f
    # elementwise: two norms and two residual adds outside the tp regions, rope, activation
    elem = (4 + 6) * outside * h * esize + 2 * n * (q + kv) * esize + \
        (3 if cfg.mlp == "swiglu" else 2) * n * width * esize
    work.add("elementwise", "f", elem / membw)
    work.add("elementwise", "i", (2 + full) * elem / membw)
    if tp > 1:  # two collectives of (n, h) forward (after o_proj, mlp down), two backward
        fwd = tp_exposed(cfg, cluster, tp, tp_s, o, act) + \
            tp_exposed(cfg, cluster, tp, tp_s, down, act)
        work.add("tp collectives", "f", fwd)
        work.add("tp collectives", "i", fwd * (2 if full else 1))
    return work


def cp_ring(work: Work, cluster: Cluster, cp: int, tp: int, step_bytes: float, core: float,
            again: bool) -> None:
    """The exchanges of ``nn.context_ring``'s ring attention in one layer (``core``: the
    attention's forward on this rank, ``step_bytes``: a K/V block): cp - 1 forward, each
    behind a block's attention, cp - 1 K/V and cp dK/dV partial sums backward, and the
    forward's again when ``again`` (full or selective recompute re-run the ring's forward).
    The ring's link is the one its group crosses (``host_span``: across hosts, the inter link
    paces it, at its share of the host's link). A hop is the link's alpha-beta time, exposed
    past the block's attention it travels behind."""
    _, h = host_span(cluster, cp, tp)
    link = cluster.link("inter") if h > 1 else cluster.intra
    share = 1.0 / cluster.ranks_per_host if h > 1 else 1.0  # the host's ranks send at once
    hop = link.time("sendrecv", 2, step_bytes, share=share)
    back = ATTN_BACKWARD * core
    fwd = (cp - 1) * max(0.0, hop - core / cp)
    work.add("cp ring (exposed)", "f", fwd)
    work.add("cp ring (exposed)", "i", (cp - 1) * max(0.0, 2 * hop - back / cp) +
             (fwd if again else 0.0))


COMM_PREFIXES = ("tp ", "cp ", "ep ")  # Work terms that are collectives, not the rank's own
# work


def _host(work: Work) -> float:
    """The rate model's host overhead in ``work`` (every phase)."""
    return sum(t for k, t in work.terms.items() if k.endswith(":host overhead"))


def _math(work: Work) -> float:
    """The rate model's math in ``work``: its own work but the host overhead."""
    return sum(work.own(True).values())


def end_share(fit: tuple, end: Work, ends: list) -> tuple:
    """The part of the fit's end layers (embedding and head together) that is ``end``'s: its
    host part by the rate model's host overhead, its per-token part by its math."""
    a, b = fit
    hosts, maths = sum(map(_host, ends)), sum(map(_math, ends))
    return (a * (_host(end) / hosts if hosts else 0.5),
            b * (_math(end) / maths if maths else 0.5))


def fitted(work: Work, base: Work, fit: tuple, tokens: float, cluster: Cluster,
           again: tuple | None = None, comms: Work | None = None) -> Work:
    """``work`` (one layer at a layout) with its own work replaced by the trainer's measured
    time for the layer (``fit``: seconds ``a + b n`` per microbatch of n tokens, forward and
    backward, at tp 1 without recompute: ``base``'s conditions). The part per token scales by
    the rate model's math at the layout over its math at ``base`` (tp shards the GEMMs; a
    recompute the fit did not measure adds what it runs again); the part per microbatch
    (host: Python, dispatch, autograd) only by the rate model's host overhead at the layout
    over base's (a recomputed forward). Split over f, i and w as the rate model splits the
    layout's own work; the collectives are kept (``comms``'s, when given: the layer under
    full recompute, whose collectives run again, where ``work`` is the layer without).
    ``again``: full recompute's measured extra (``TrainerFit.recompute``, ``a + b n``
    likewise, scaled as the fit), on I (the recompute runs in backward, before the input
    gradients). The fit is one thread's: the per-token part runs at the rank's ``share`` of
    the host's cores (more than one core each: faster), the host part takes
    ``overhead_scale`` as long (ranks outnumbering cores wait for them)."""
    ratio = _math(work) / _math(base) if _math(base) else 1.0
    host = _host(work) / _host(base) if _host(base) else 1.0  # a recomputed forward's host work

    def seconds(ab):
        return cluster.overhead_scale * ab[0] * host + ab[1] * tokens * ratio / cluster.share

    own = work.own(False)
    total = sum(own.values())
    keep = work if comms is None else comms
    out = Work()
    if total:
        for phase, t in own.items():
            if t:
                out.add("measured layer (trainer fit)", phase, seconds(fit) * t / total)
        if again is not None:
            out.add("measured recompute (trainer fit)", "i", seconds(again))
    for name, t in keep.terms.items():
        phase, what = name.split(":", 1)
        if what.startswith(COMM_PREFIXES):
            out.add(what, phase, t)
    return out


def p2p_time(cfg: GPTConfig, cluster: Cluster, *, tp: int, cp: int, dp: int, stage: int,
             rows: int, esize: int):
    """``(seconds, link)``: sending one microbatch's activation (or its gradient) from
    ``stage`` to the next, and the link it crosses (``p2p_link``): (n, h) elements, 1/tp of
    them under scatter-gather (tp > 1 without SP); every rank of the stage sends at once, so
    a send across hosts shares the host's link."""
    n = rows * cfg.seq_len // cp
    nbytes = n * cfg.hidden * esize // (tp if tp > 1 and not cfg.sequence_parallel else 1)
    link, share = p2p_link(cluster, per_stage=tp * cp * dp, stage=stage)
    return link.time("sendrecv", 2, nbytes, share=share), link


def p2p_link(cluster: Cluster, *, per_stage: int, stage: int):
    """``(link, share)``: the level a send from pipeline rank ``stage`` to the next crosses
    (a layout's stages hold ``per_stage`` ranks each; the last rank's next is rank 0) and the
    share of it each sender gets."""
    rph = cluster.ranks_per_host
    nxt = (stage + 1) % cluster_pp(cluster, per_stage)
    if stage * per_stage // rph == nxt * per_stage // rph:
        return cluster.intra, 1.0
    return cluster.link("inter"), 1.0 / min(rph, per_stage)


def cluster_pp(cluster: Cluster, per_stage: int) -> int:
    """The pipeline ranks of a layout whose stages hold ``per_stage`` ranks each."""
    return max(1, cluster.ranks // per_stage)


def reduction_terms(cluster: Cluster, *, zero: int, elements: int, shard: int, tp: int,
                    cp: int, dp: int, esize: int, tensors: int = 0, reductions: int = 1,
                    gathers: int = 1) -> dict:
    """Seconds of the per-step gradient reduction over dp x cp (float32 on every axis) and the
    parameters' all-gather of ZeRO (at ``esize``), after the pipeline's last backward (the
    runtime does not overlap them: which backward is a parameter's last depends on the
    schedule), and of the optimizer update over this rank's ``shard`` of the elements (and the
    host's per-tensor loop over its ``tensors``). ZeRO-2/3 per unit reduce once per microbatch
    (``reductions``) and ZeRO-3 per unit gathers around each forward and backward
    (``gathers``); they overlap the backward in part, which is not counted here."""
    size, stride = dp * cp, tp
    out = {}
    if zero == 0:
        out["dp all-reduce"] = group_time(cluster, "all_reduce", 4 * elements, size, stride)
    else:
        out["dp reduce-scatter"] = reductions * group_time(cluster, "reduce_scatter",
                                                           4 * elements, size, stride)
        out["dp all-gather"] = gathers * group_time(cluster, "all_gather", esize * elements,
                                                    size, stride)
    out["optimizer"] = OPTIMIZER_BYTES * shard / cluster.membw
    if cluster.overhead_tensor_s:  # the clip's and AdamW's loops over this rank's tensors
        out["optimizer host"] = cluster.overhead_scale * cluster.overhead_tensor_s * tensors
    return out
