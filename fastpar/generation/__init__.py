"""Running models: generation with a KV cache on a fastpar GPT at any tp size.

    out = fastpar.generate(model, input_ids, max_new_tokens=64, eos_token_id=2)
    out = fastpar.generate(Stages(gpt_layers(cfg), cfg), ...)   # under pp: this rank's stage

    python -m fastpar.generate --hf-model llama-dir --tp 2 --prompt "Once upon a time"
"""

from fastpar.generation.loop import Generation, generate
from fastpar.generation.sampling import Sampler
from fastpar.generation.stages import Stages

__all__ = ["Generation", "Sampler", "Stages", "generate"]
