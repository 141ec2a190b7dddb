"""Tensor- and expert-parallel modules (Megatron-LM style) built on ``fastpar.comm``'s autograd
collectives.

    import fastpar
    topo = fastpar.init(tp=2)
    mlp = fastpar.nn.ParallelMLP(1024, 4096, activation="swiglu", seed=0)   # group: topo.tp_group
    loss = fastpar.nn.vocab_parallel_cross_entropy(logits_shard, target)
    y = fastpar.nn.recompute(block, h)      # keep only h; recompute block's forward in backward
    moe = fastpar.nn.MoE(1024, 2816, num_experts=8, top_k=2, group=ep_group)   # experts over ep

Every layer holds this rank's slice of the serial module's weights drawn from the same seed.
"""

from fastpar.nn import random
from fastpar.nn.attention import ParallelSelfAttention
from fastpar.nn.cross_entropy import vocab_parallel_cross_entropy
from fastpar.nn.embedding import VocabParallelEmbedding
from fastpar.nn.linear import ColumnParallelLinear, RowParallelLinear
from fastpar.nn.mlp import ParallelMLP
from fastpar.nn.moe import MoE, with_aux_loss
from fastpar.nn.norm import LayerNorm, RMSNorm
from fastpar.nn.recomputation import recompute
from fastpar.nn.sharding import ShardedModule

__all__ = ["ColumnParallelLinear", "LayerNorm", "MoE", "ParallelMLP", "ParallelSelfAttention",
           "RMSNorm", "RowParallelLinear", "ShardedModule", "VocabParallelEmbedding", "random",
           "recompute", "vocab_parallel_cross_entropy", "with_aux_loss"]
