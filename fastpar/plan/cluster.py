"""The machine a plan is for: hosts, ranks per host, one device's speeds and memory, and the
links between ranks, as a small JSON file (``--cluster``), flags, or a calibration
(``calibrate.py``).

    cluster = Cluster.load("a100.json")          # ValueError naming the bad field and value
    cluster.gemm_time(m, n, k)                    # seconds of one (m, k) x (k, n) product
    cluster.link("inter").time("all_reduce", 4, nbytes)

The file (every field but ``gemm``, ``attention`` and the links' ``engine`` is required)::

    {"name": "dgx-a100", "device": "cuda", "hosts": 4, "ranks_per_host": 8,
     "peak_flops": 312e12, "memory_bytes": 80e9, "membw_Bps": 2.0e12,
     "gemm": {"efficiency": 0.7, "points": [[m, n, k, flop_per_s], ...]},
     "attention": {"efficiency": 0.5, "points": [[tokens, head_dim, flop_per_s], ...],
                   "causal_skip": true},
     "intra": {"alpha_s": 5e-6, "busbw_Bps": 2.4e11, "engine": "nccl"},
     "inter": {"alpha_s": 1e-5, "busbw_Bps": 2.0e11, "engine": "nccl"}}

A GEMM's rate is the measured point nearest its shape (distance in log m, log n, log k), or
``peak_flops x efficiency`` where nothing was measured; attention's likewise by (tokens,
head dim). ``intra`` is one rank's bus bandwidth inside a host (nccl-tests' busbw: a ring
collective of S bytes over n ranks takes ``steps x alpha + factor(n) x S / busbw``); ``inter``
is one host's bandwidth to the others (all its NICs together), which the host's ranks share
when they send at once. (Files of earlier calibrations with busy peers' waits, a link's
``busy_p2p`` or ``busy_ring`` or the host's ``sync_s`` and ``sync_ratio``, are refused: the
planner no longer models them, docs/planner.md; calibrate again.)
``"rates_per_core": true`` (what ``--calibrate`` writes on a CPU): the GEMM, attention and
memory rates are one core's (measured on one thread: several threads on a loaded machine wait
for each other), and each of a host's ranks gets ``cpus / ranks_per_host`` cores of the
``host`` entry's ``cpus``. ``"host": {"block_s",
"end_s", "tensor_s", "cpus"}`` (``--calibrate`` on a CPU): host time beyond the math, per
block and per embedding or head layer for a microbatch's forward and backward, per parameter
tensor for a step's clip and AdamW, measured by one process; with more ranks than ``cpus`` on
a host each takes ``ranks / cpus`` times as long. ``"trainer": {"model", "block_s": [a, b], "end_s": [a, b], "step_s", "zb_s":
[block, ends], "recompute_s": [a, b]}`` (``--calibrate`` with a model,
``training.fit.trainer_fit``; ``zb_s`` and ``recompute_s`` optional): the trainer's own step measured for that model
(``model_signature``), which replaces the rates for its layers' own work (``costs.fitted``;
docs/design.md, "The trainer fit"): a ``TrainerFit``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing

# Dense bf16 peaks by device name (a substring of torch.cuda.get_device_name): the MFU the
# trainer reports and the peak a GPU calibration assumes.
_PEAKS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12),
          ("A10", 125e12), ("V100", 125e12))


def model_signature(cfg, esize: int) -> str:
    """What a trainer fit depends on: the layers' shapes, kinds and element size (not their
    count, the recompute, tp or cp, which the planner varies and scales for)."""
    return (f"V{cfg.vocab_size}.T{cfg.seq_len}.h{cfg.hidden}.nh{cfg.heads}.kv{cfg.num_kv_heads}"
            f".f{cfg.ffn_size}.{cfg.mlp}.{cfg.norm}.{cfg.positions}.bias{int(cfg.bias)}"
            f".tie{int(cfg.tie_embeddings)}.drop{cfg.dropout:g}"
            f".moe{cfg.moe_experts}x{cfg.moe_top_k}/{cfg.moe_every}c{cfg.moe_capacity}.e{esize}")


class TrainerFit(typing.NamedTuple):
    """The trainer's own step measured on one rank for one model
    (``training.fit.trainer_fit``): a layer's forward and backward take a + b n seconds per
    microbatch of n tokens (``block``, and ``end`` for the embedding and head together), a
    step's host work ``step`` seconds beyond them; zb's split backward takes ``zb`` = (a
    block's, the ends') seconds more per microbatch; full recompute takes a block
    ``recompute`` = (a, b) more per microbatch of n tokens: None where it was not measured (a
    file from before it was), and the planner keeps the rate model's recomputed forward."""

    model: str  # model_signature
    block: tuple
    end: tuple
    step: float
    zb: tuple = (0.0, 0.0)
    recompute: tuple | None = None


def read_json(path: str, flag: str):
    """The JSON in ``path``; ValueError naming ``flag`` and the file when it cannot be read or
    is not JSON (the planner's files: --cluster, --hf-config)."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} {path}: not JSON ({exc})") from None


def gpu_peak_flops(name: str) -> float | None:
    """The dense bf16 peak of the GPU called ``name``, or None for one not in the table."""
    return next((peak for key, peak in _PEAKS if key in name), None)


# ring steps and the bytes factor of each collective of S bytes over n ranks (nccl-tests)
STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
         "reduce_scatter": lambda n: n - 1, "all_to_all": lambda n: n - 1,
         "sendrecv": lambda n: 1}
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
          "sendrecv": lambda n: 1.0}


@dataclasses.dataclass(frozen=True)
class Link:
    """Alpha-beta of one hierarchy level: ``alpha_s`` per ring step, ``busbw_Bps``, and the
    engine it was measured on."""

    alpha_s: float
    busbw_Bps: float
    engine: str = ""

    def time(self, op: str, n: int, nbytes: float, share: float = 1.0) -> float:
        """Seconds of ``op`` on ``nbytes`` over ``n`` ranks, at ``share`` of the bandwidth."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return STEPS[op](n) * self.alpha_s + FACTOR[op](n) * nbytes / (self.busbw_Bps * share)


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    device: str  # "cuda" or "cpu": which overlap policy and engines apply
    hosts: int
    ranks_per_host: int
    peak_flops: float  # one device's dense peak at the model's dtype
    memory_bytes: float  # what one rank may use
    membw_Bps: float  # memory bandwidth of one device (elementwise ops, the optimizer step)
    intra: Link
    inter: Link | None
    gemm_efficiency: float = 0.7  # of peak, for shapes no point was measured at
    gemm_points: tuple = ()  # ((m, n, k, flop/s), ...)
    attention_efficiency: float = 0.5
    attention_points: tuple = ()  # ((tokens, head_dim, flop/s), ...)
    causal_skip: bool = True  # the attention kernel skips masked blocks (flash); else 4 T^2 hd
    # the GEMM, attention and memory rates are one core's (a CPU calibration: one thread);
    # each rank gets cpus_per_host / ranks_per_host cores
    rates_per_core: bool = False
    # host time beyond the math (Python, dispatch, autograd; measured on a CPU by
    # calibrate.host_overheads): per block and per end layer (embedding, head) for one
    # microbatch's forward and backward, per parameter tensor for a step's clip + AdamW; one
    # process's, on a core of its own: ranks sharing the host's cpus_per_host cores wait longer
    overhead_block_s: float = 0.0
    overhead_end_s: float = 0.0
    overhead_tensor_s: float = 0.0
    cpus_per_host: int = 0
    # the trainer's own step measured on one rank for one model (training.fit.trainer_fit)
    trainer_fit: TrainerFit | None = None

    def fit_for(self, cfg, esize: int) -> TrainerFit | None:
        """``trainer_fit`` when it was measured on ``cfg``'s model at ``esize``, else None."""
        fit = self.trainer_fit
        return fit if fit is not None and fit.model == model_signature(cfg, esize) else None

    @property
    def share(self) -> float:
        """The measured rates one rank gets, in units of them, when all of its host's ranks
        run: 1, or cores per rank (``rates_per_core``)."""
        if self.rates_per_core and self.cpus_per_host:
            return self.cpus_per_host / self.ranks_per_host
        return 1.0

    @property
    def overhead_scale(self) -> float:
        """How much longer host work takes per rank when all the host's ranks run."""
        return max(1.0, self.ranks_per_host / self.cpus_per_host) if self.cpus_per_host \
            else 1.0

    @property
    def membw(self) -> float:
        """One rank's memory bandwidth (``membw_Bps`` x ``share``)."""
        return self.membw_Bps * self.share

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    def link(self, level: str) -> Link:
        if level == "inter":
            if self.inter is None:
                raise ValueError(f"cluster {self.name!r} has {self.hosts} hosts but no 'inter' "
                                 "link (alpha_s, busbw_Bps)")
            return self.inter
        return self.intra

    def gemm_rate(self, m: float, n: float, k: float) -> float:
        return self.share * (_nearest(self.gemm_points, (m, n, k)) or
                             self.peak_flops * self.gemm_efficiency)

    def gemm_time(self, m: float, n: float, k: float) -> float:
        return 2 * m * n * k / self.gemm_rate(m, n, k) if m * n * k else 0.0

    def attention_rate(self, tokens: float, head_dim: float) -> float:
        return self.share * (_nearest(self.attention_points, (tokens, head_dim)) or
                             self.peak_flops * self.attention_efficiency)

    def with_ranks(self, hosts: int, ranks_per_host: int) -> "Cluster":
        """The same machines with another job's ranks."""
        return dataclasses.replace(self, hosts=hosts, ranks_per_host=ranks_per_host)

    # ---- the file ------------------------------------------------------------------------

    def to_json(self) -> dict:
        out = {"name": self.name, "device": self.device, "hosts": self.hosts,
               "ranks_per_host": self.ranks_per_host, "peak_flops": self.peak_flops,
               "memory_bytes": self.memory_bytes, "membw_Bps": self.membw_Bps,
               "gemm": {"efficiency": self.gemm_efficiency,
                        "points": [list(p) for p in self.gemm_points]},
               "attention": {"efficiency": self.attention_efficiency,
                             "points": [list(p) for p in self.attention_points],
                             "causal_skip": self.causal_skip},
               "intra": dataclasses.asdict(self.intra)}
        if self.rates_per_core:
            out["rates_per_core"] = True
        if self.cpus_per_host:
            out["host"] = {"block_s": self.overhead_block_s, "end_s": self.overhead_end_s,
                           "tensor_s": self.overhead_tensor_s, "cpus": self.cpus_per_host}
        if self.inter is not None:
            out["inter"] = dataclasses.asdict(self.inter)
        if self.trainer_fit is not None:
            fit = self.trainer_fit
            out["trainer"] = {"model": fit.model, "block_s": list(fit.block),
                              "end_s": list(fit.end), "step_s": fit.step, "zb_s": list(fit.zb)}
            if fit.recompute is not None:
                out["trainer"]["recompute_s"] = list(fit.recompute)
        return out

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @classmethod
    def from_json(cls, d: dict, where: str = "cluster") -> "Cluster":
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")

        def num(key, src=d, at=where, positive=True, integer=False):
            if key not in src:
                raise ValueError(f"{at}: missing {key!r}")
            v = src[key]
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
                and (v > 0 if positive else v >= 0) and (not integer or v == int(v))
            if not ok:
                kind = "a positive integer" if integer else \
                    "a number > 0" if positive else "a number >= 0"
                raise ValueError(f"{at}: {key} must be {kind}, got {v!r}")
            return int(v) if integer else float(v)

        def link(key):
            src = d.get(key)
            if src is None:
                return None
            if not isinstance(src, dict):
                raise ValueError(f"{where}: {key} must be an object with alpha_s and busbw_Bps")
            at = f"{where}: {key}"
            dropped(src, at, ("busy_p2p", "busy_ring"))
            return Link(num("alpha_s", src, at, positive=False), num("busbw_Bps", src, at),
                        str(src.get("engine", "")))

        def dropped(src, at, keys):
            old = [k for k in keys if k in src]
            if old:
                raise ValueError(f"{at}: {', '.join(old)}: busy peers' waits, which the planner "
                                 "no longer models (docs/planner.md); remove them, or "
                                 "calibrate again")

        def two(key, src, at, what, optional=False):
            v = src.get(key, [0.0, 0.0] if optional else None)
            if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and
                    math.isfinite(x) and x >= 0 for x in v)):
                raise ValueError(f"{at}: {key} must be two numbers >= 0 ({what}), got {v!r}")
            return tuple(float(x) for x in v)

        def curve(key, width):
            src = d.get(key, {})
            if not isinstance(src, dict):
                raise ValueError(f"{where}: {key} must be an object (efficiency, points)")
            eff = num("efficiency", src, f"{where}: {key}") if "efficiency" in src else \
                {"gemm": 0.7, "attention": 0.5}[key]
            if eff > 1:
                raise ValueError(f"{where}: {key}.efficiency must be at most 1, got {eff}")
            points = src.get("points", [])
            for p in points:
                if not (isinstance(p, list) and len(p) == width and all(
                        isinstance(x, (int, float)) and x > 0 for x in p)):
                    raise ValueError(f"{where}: each {key} point must be {width} positive "
                                     f"numbers, got {p!r}")
            return eff, tuple(tuple(float(x) for x in p) for p in points)

        def host(src):
            if src is None:
                return {}
            if not isinstance(src, dict):
                raise ValueError(f"{where}: host must be an object (block_s, end_s, tensor_s, "
                                 "cpus)")
            at = f"{where}: host"
            dropped(src, at, ("sync_s", "sync_ratio"))
            return {"overhead_block_s": num("block_s", src, at, positive=False),
                    "overhead_end_s": num("end_s", src, at, positive=False),
                    "overhead_tensor_s": num("tensor_s", src, at, positive=False),
                    "cpus_per_host": num("cpus", src, at, integer=True)}

        def trainer(src):
            if src is None:
                return None
            at = f"{where}: trainer"
            if not isinstance(src, dict) or not isinstance(src.get("model"), str):
                raise ValueError(f"{at} must be an object with model, block_s, end_s, step_s")
            per = "seconds per microbatch, per token"
            return TrainerFit(src["model"], two("block_s", src, at, per),
                              two("end_s", src, at, per), num("step_s", src, at, positive=False),
                              two("zb_s", src, at, "seconds per microbatch, a block's and the "
                                  "ends'", optional=True),
                              two("recompute_s", src, at, per) if "recompute_s" in src else None)

        device = d.get("device", "cuda")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"{where}: device must be 'cuda' or 'cpu', got {device!r}")
        ge, gp = curve("gemm", 4)
        ae, ap = curve("attention", 3)
        intra = link("intra")
        if intra is None:
            raise ValueError(f"{where}: missing 'intra' (alpha_s, busbw_Bps)")
        c = cls(name=str(d.get("name", "cluster")), device=device,
                hosts=num("hosts", integer=True), ranks_per_host=num("ranks_per_host",
                                                                     integer=True),
                peak_flops=num("peak_flops"), memory_bytes=num("memory_bytes"),
                membw_Bps=num("membw_Bps"), intra=intra, inter=link("inter"),
                gemm_efficiency=ge, gemm_points=gp, attention_efficiency=ae,
                attention_points=ap,
                causal_skip=bool(d.get("attention", {}).get("causal_skip", True)),
                rates_per_core=bool(d.get("rates_per_core", False)),
                trainer_fit=trainer(d.get("trainer")), **host(d.get("host")))
        if c.hosts > 1:
            c.link("inter")
        return c

    @classmethod
    def load(cls, path: str) -> "Cluster":
        return cls.from_json(read_json(path, "--cluster"), where=f"--cluster {path}")


def _nearest(points, shape) -> float | None:
    """The rate of the measured point nearest ``shape`` in log space (None: no points)."""
    best, rate = math.inf, None
    for p in points:
        d = sum((math.log(a) - math.log(max(b, 1.0))) ** 2 for a, b in zip(p, shape))
        if d < best:
            best, rate = d, p[-1]
    return rate
