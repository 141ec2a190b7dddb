"""Pipeline parallelism: a model cut into stages over the pp group, run by a schedule compiled
to per-rank action lists that are validated on the host before anything runs.

    pipe = fastpar.pipeline.Pipeline(layers, loss_fn=F.cross_entropy, schedule="1f1b",
                                     microbatches=8)
    loss = pipe.step(inputs, targets)
    pipe = fastpar.pipeline.from_hf("llama-dir", microbatches=8)   # a Hugging Face causal LM

    python -m fastpar.pipeline show --pp 4 --microbatches 8 --schedule zb
"""

from fastpar.pipeline.actions import Action
from fastpar.pipeline.hf import from_hf
from fastpar.pipeline.pipe import Pipeline
from fastpar.pipeline.schedules import SCHEDULES, compile_schedule, theoretical_bubble
from fastpar.pipeline.validator import ScheduleError, validate

__all__ = ["SCHEDULES", "Action", "Pipeline", "ScheduleError", "compile_schedule", "from_hf",
           "theoretical_bubble", "validate"]
