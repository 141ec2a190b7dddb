"""fastpar: Megatron-style data, tensor and pipeline parallelism for PyTorch.

    import fastpar
    topo = fastpar.init(tp=2, pp=2)      # under mpirun, torchrun, or a single process
    model = fastpar.parallelize(model)   # tensor-parallel, in place
    ...
    fastpar.shutdown()
"""

import torch as _torch

from fastpar.version import __version__, check_torch

check_torch(_torch.__version__)  # before anything that needs a newer torch is imported

from fastpar import backend as _backend  # noqa: E402
from fastpar import nn  # noqa: E402
from fastpar import optim  # noqa: E402
from fastpar.data_parallel import DataParallel  # noqa: E402
from fastpar.grid import Grid, Topology  # noqa: E402
from fastpar.nn.quantized import quantize_weights  # noqa: E402
from fastpar.parallelize import parallelize  # noqa: E402
from fastpar.runtime import init, is_initialized, shutdown, topology  # noqa: E402
from fastpar.state_dict import full_state_dict, load_full_state_dict  # noqa: E402

__all__ = ["DataParallel", "Grid", "Topology", "__version__", "full_state_dict", "init",
           "is_initialized", "load_full_state_dict", "nn", "optim", "parallelize",
           "quantize_weights", "shutdown", "topology"]

_backend.register()  # dist.init_process_group("fastpar") from here on

# Subpackages reachable as attributes (``fastpar.pipeline.Pipeline``) without importing them
# all at ``import fastpar``: each is imported at its first use (kernels needs Triton, models
# and training pull in more than a layer library needs).
_LAZY = ("comm", "data_parallel", "generation", "kernels", "models", "pipeline", "pruning",
         "runtime", "testing", "training")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"fastpar.{name}")
    if name == "generate":  # the function (python -m fastpar.generate is the command), lazily
        import importlib

        return importlib.import_module("fastpar.generation").generate
    if name == "prune":  # the function (python -m fastpar.prune is the command), lazily
        import importlib

        return importlib.import_module("fastpar.pruning").prune
    raise AttributeError(f"module 'fastpar' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"generate", "prune"})
