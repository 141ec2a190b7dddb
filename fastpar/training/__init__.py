"""Single-process pieces of the training job (`python -m fastpar.train`), each its own module:

    fastpar.training.data              byte-level corpus, a sampler that is a pure function of
                                       (seed, step), fixed validation batches
    fastpar.training.metrics           JSON-lines metrics, the human log line, the loss plot
    fastpar.training.serial_optimizer  optimizer state in the serial layout (collective;
                                       resharding)
    fastpar.training.memory            memory per rank by category, measured; the end-of-run
                                       table

The same categories predicted from the layout are the planner's (``fastpar.plan.memory``); the
checkpoints are ``fastpar.checkpoint``'s.

Import the module you need (`from fastpar.training import data`); nothing here imports
safetensors or matplotlib until it is used.
"""

from fastpar.training import data, metrics

__all__ = ["data", "metrics"]
