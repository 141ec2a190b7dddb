"""Models built from ``fastpar.nn``: a GPT as a list of layers for ``fastpar.pipeline``.

    from fastpar.models import GPT, PRESETS, gpt_layers, gpt_loss
"""

from fastpar.models.config import PRESETS, GPTConfig
from fastpar.models.gpt import (GPT, GPTBlock, GPTEmbedding, GPTHead, gpt_layers, gpt_loss,
                                sum_tied_grads, tied_parameters)

__all__ = ["GPT", "GPTBlock", "GPTConfig", "GPTEmbedding", "GPTHead", "PRESETS", "gpt_layers",
           "gpt_loss", "sum_tied_grads", "tied_parameters"]
