"""The GPT's configuration: sizes and choices (``GPTConfig``), their check against a tp size
(``GPTConfig.validate``), and the named presets (``PRESETS``). Plain data; imports nothing of
fastpar. The model built from it is in ``gpt.py``.

    cfg = dataclasses.replace(PRESETS["small"], layers=8)
    cfg.validate(tp=2)          # ValueError naming every number that does not fit
"""

from __future__ import annotations

import dataclasses

RECOMPUTE = ("none", "selective", "full")  # GPTConfig.recompute, --recompute
MLPS = ("swiglu", "gelu", "gelu_tanh")  # GPTConfig.mlp (gelu_tanh: GPT-2's "gelu_new")
ROPE_SCALINGS = ("linear", "llama3")  # GPTConfig.rope_scaling["rope_type"], besides None


@dataclasses.dataclass
class GPTConfig:
    """Sizes and choices of the model. ``kv_heads=None``: as many as ``heads`` (MHA; fewer is
    grouped-query attention). ``ffn_hidden=None``: ``4 * hidden`` for gelu; for swiglu
    ``8/3 * hidden`` rounded up to a multiple of 8 (about the parameters of the gelu MLP).
    ``bias``: biases in every linear layer and in LayerNorm (the head never has one).
    ``dropout``: on the embedding output, the attention probabilities and both residual
    branches. ``recompute``: what backward recomputes instead of keeping, "none", "selective"
    (each attention core: softmax, dropout, @ v) or "full" (each block keeps only its input).
    ``moe_experts`` > 0: Mixture-of-Experts blocks (``fastpar.nn.MoE``, ``moe_top_k`` experts
    per token, ``ffn_size`` wide each, ``mlp``'s activation) in place of the MLP in every
    ``moe_every``-th block (blocks moe_every, 2 moe_every, ...: 1 = every block, 2 = every other
    from the second); ``moe_capacity``: None dropless, else the capacity factor;
    ``moe_aux_coef`` / ``moe_z_coef``: the router losses' weights in the training loss.
    ``context_parallel``: None, or "ring" / "ulysses": each rank of the cp group holds a slice
    of every sequence (``fastpar.nn.context``'s layout) and attention runs over the whole of
    it by that method; no parameter changes (a layout choice, like ``sequence_parallel``)."""

    vocab_size: int = 256  # byte-level
    seq_len: int = 64
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    mlp: str = "swiglu"  # "swiglu" | "gelu" | "gelu_tanh"
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    positions: str = "rope"  # "rope" | "learned"
    tie_embeddings: bool = False
    sequence_parallel: bool = False
    overlap: bool | None = None  # the parallel linear layers' (None: their policy decides)
    dropout: float = 0.0
    bias: bool = False
    rope_base: float = 10000.0
    init_std: float = 0.02
    recompute: str = "none"  # "none" | "selective" | "full"
    moe_experts: int = 0  # 0: dense MLPs
    moe_top_k: int = 2
    moe_every: int = 1
    moe_capacity: float | None = None
    moe_aux_coef: float = 1e-2
    moe_z_coef: float = 1e-3
    context_parallel: str | None = None  # None | "ring" | "ulysses"
    # What Hugging Face architectures add (fastpar.models.hf maps their configs here):
    head_dim: int | None = None  # None: hidden / heads (Qwen3 sets its own)
    qkv_bias: bool = False  # biases on q, k, v even without ``bias`` (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Qwen3)
    norm_eps: float | None = None  # None: the norm's default (RMSNorm 1e-6, LayerNorm 1e-5)
    rope_scaling: dict | None = None  # None, {"rope_type": "linear"|"llama3", ...}
    max_positions: int | None = None  # learned positions' rows (None: seq_len)

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_size(self) -> int:
        """Each attention head's width: ``head_dim``, else ``hidden / heads``."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def position_rows(self) -> int:
        """Rows of the learned position table: ``max_positions``, else ``seq_len``."""
        return self.max_positions if self.max_positions is not None else self.seq_len

    def is_moe(self, block: int) -> bool:
        """Whether block ``block`` (1 .. layers) is a Mixture-of-Experts block."""
        return self.moe_experts > 0 and block % self.moe_every == 0

    @property
    def moe_blocks(self) -> list[int]:
        return [i for i in range(1, self.layers + 1) if self.is_moe(i)]

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.mlp != "swiglu":
            return 4 * self.hidden
        return -(-self.hidden // 3) * 8  # ceil(8/3 * hidden / 8) * 8

    def inference(self) -> GPTConfig:
        """This model as it runs whole sequences without training (generation, evaluation):
        no sequence or context parallelism, recomputation or dropout."""
        return dataclasses.replace(self, sequence_parallel=False, context_parallel=None,
                                   recompute="none", dropout=0.0)

    def validate(self, tp: int = 1, ep: int = 1, cp: int = 1,
                 replicated_kv: bool = False) -> None:
        """``ValueError`` naming the numbers of everything that does not fit ``tp`` ranks, an
        expert-parallel group of ``ep`` and a context-parallel group of ``cp``.
        ``replicated_kv``: KV heads fewer than tp (tp a multiple of them) are replicated
        (``fastpar.nn.replicated_heads``: inference only, as generation runs)."""
        bad = []
        for name in ("vocab_size", "seq_len", "layers", "hidden", "heads", "kv_heads",
                     "ffn_hidden"):
            value = getattr(self, name)
            if (value is not None or name not in ("kv_heads", "ffn_hidden")) and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                bad.append(f"{name} must be a positive integer, got {value!r}")
        for name, allowed in (("mlp", MLPS), ("norm", ("rmsnorm", "layernorm")),
                              ("positions", ("rope", "learned")),
                              ("recompute", RECOMPUTE)):
            if getattr(self, name) not in allowed:
                bad.append(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0.0 <= self.dropout < 1.0:
            bad.append(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.init_std > 0 or not self.rope_base > 0:
            bad.append(f"init_std {self.init_std} and rope_base {self.rope_base} must be > 0")
        for name in ("moe_experts", "moe_top_k", "moe_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or \
                    value < (0 if name == "moe_experts" else 1):
                least = "non-negative" if name == "moe_experts" else "positive"
                bad.append(f"{name} must be a {least} integer, got {value!r}")
        for name in ("head_dim", "max_positions"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                bad.append(f"{name} must be a positive integer or None, got {value!r}")
        if self.norm_eps is not None and not self.norm_eps > 0:
            bad.append(f"norm_eps must be > 0 or None, got {self.norm_eps!r}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in \
                ROPE_SCALINGS:
            bad.append(f"rope_scaling's rope_type must be one of {ROPE_SCALINGS}, got "
                       f"{self.rope_scaling.get('rope_type')!r}")
        if self.max_positions is not None and self.max_positions < self.seq_len:
            bad.append(f"seq_len {self.seq_len} is longer than max_positions "
                       f"{self.max_positions}")
        if self.context_parallel not in (None, "ring", "ulysses"):
            bad.append(f"context_parallel must be None, 'ring' or 'ulysses', got "
                       f"{self.context_parallel!r}")
        if self.moe_capacity is not None and not self.moe_capacity > 0:
            bad.append(f"moe_capacity must be positive or None (dropless), got "
                       f"{self.moe_capacity!r}")
        if not (self.moe_aux_coef >= 0 and self.moe_z_coef >= 0):
            bad.append(f"moe_aux_coef {self.moe_aux_coef} and moe_z_coef {self.moe_z_coef} must "
                       f"be >= 0")
        if bad:
            raise ValueError("GPTConfig: " + "; ".join(bad))
        kv, ffn = self.num_kv_heads, self.ffn_size
        if self.head_dim is None and self.hidden % self.heads:
            bad.append(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        elif self.positions == "rope" and self.head_size % 2:
            got = (f"head_dim {self.head_dim}" if self.head_dim is not None else
                   f"hidden {self.hidden} / heads {self.heads} = {self.head_size}")
            bad.append(f"rope needs an even head dim, got {got}")
        if self.heads % kv:
            bad.append(f"heads {self.heads} is not divisible by kv_heads {kv}")
        for name, value in (("heads", self.heads), ("kv_heads", kv), ("vocab_size",
                            self.vocab_size), ("ffn_hidden", ffn)):
            if name == "kv_heads" and replicated_kv and value % tp and tp % value == 0:
                continue  # each KV head on tp / kv_heads ranks
            if value % tp:
                bad.append(f"{name} {value} is not divisible by tp {tp}")
        if self.sequence_parallel and self.seq_len % tp:
            bad.append(f"seq_len {self.seq_len} is not divisible by tp {tp} (sequence_parallel)")
        if cp > 1:
            if self.seq_len % (2 * cp):
                bad.append(f"seq_len {self.seq_len} is not divisible by 2 x cp = {2 * cp} (each "
                           "context-parallel rank holds two equal chunks of every sequence)")
            if self.context_parallel == "ulysses" and (self.heads // tp) % cp:
                bad.append(f"heads {self.heads} / tp {tp} = {self.heads // tp} per tp rank are "
                           f"not divisible by cp {cp} (Ulysses shards the heads over cp)")
        if self.moe_experts:
            if self.moe_top_k > self.moe_experts:
                bad.append(f"moe_top_k {self.moe_top_k} is larger than moe_experts "
                           f"{self.moe_experts}")
            if self.moe_experts % ep:
                bad.append(f"moe_experts {self.moe_experts} is not divisible by ep {ep}")
            if not self.moe_blocks:
                bad.append(f"moe_every {self.moe_every} is larger than layers {self.layers}: no "
                           f"block would be a Mixture-of-Experts block")
            if self.sequence_parallel and tp > 1:
                bad.append("Mixture-of-Experts blocks do not take sequence_parallel at tp > 1 "
                           "yet (each tp rank would route other tokens through replicated "
                           "experts)")
            if self.mlp == "gelu_tanh":
                bad.append("Mixture-of-Experts blocks take mlp 'gelu' or 'swiglu', not "
                           "'gelu_tanh'")
        elif ep > 1:
            bad.append(f"ep {ep} needs Mixture-of-Experts blocks (moe_experts > 0)")
        if bad:
            raise ValueError("GPTConfig: " + "; ".join(bad))

    def flops_per_token(self) -> float:
        """Forward and backward FLOPs per token that MFU counts: ``6 N + 12 L H T`` (the
        trainer's MFU and the planner's; recomputation is not useful work, so not counted). H:
        the attention's width, heads x head size (the hidden size unless ``head_dim`` says)."""
        return 6 * self.num_params() + 12 * self.layers * self.heads * self.head_size * \
            self.seq_len

    def num_params(self) -> int:
        """Parameters of the serial model, the tied output weight (a copy) counted once."""
        h, v, ffn, b = self.hidden, self.vocab_size, self.ffn_size, int(self.bias)
        q_dim, kv_dim = self.heads * self.head_size, self.num_kv_heads * self.head_size
        norm = h * (2 if self.norm == "layernorm" and self.bias else 1)
        qkv_b = int(self.bias or self.qkv_bias)
        attn = 2 * h * q_dim + 2 * h * kv_dim + qkv_b * (q_dim + 2 * kv_dim) + b * h + \
            (2 * self.head_size if self.qk_norm else 0)
        mlp = (3 * h * ffn + b * (2 * ffn + h)) if self.mlp == "swiglu" else \
            (2 * h * ffn + b * (ffn + h))
        # a MoE block: a bias-free router and moe_experts bias-free MLPs
        moe = h * self.moe_experts + self.moe_experts * (3 if self.mlp == "swiglu" else 2) * h * ffn
        embedding = v * h + (self.position_rows * h if self.positions == "learned" else 0)
        head = norm + (0 if self.tie_embeddings else v * h)
        moes = len(self.moe_blocks)
        return embedding + self.layers * (2 * norm + attn) + (self.layers - moes) * mlp + \
            moes * moe + head


PRESETS = {
    # ~0.12 M parameters: trains in seconds on a CPU.
    "tiny": GPTConfig(seq_len=64, layers=2, hidden=64, heads=4, kv_heads=2),
    # ~3.0 M parameters: the demo of `mpirun -np 4 python -m fastpar.train --tp 2 --pp 2`.
    "small": GPTConfig(seq_len=128, layers=4, hidden=256, heads=8, kv_heads=4),
}
