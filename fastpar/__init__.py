"""fastpar: Megatron-style data, tensor and pipeline parallelism for PyTorch.

    import fastpar
    topo = fastpar.init(tp=2, pp=2)      # under mpirun, torchrun, or a single process
    ...
    fastpar.shutdown()
"""

from fastpar.runtime import init, is_initialized, shutdown, topology
from fastpar.topology import Grid, Topology
from fastpar.version import __version__

__all__ = ["Grid", "Topology", "__version__", "init", "is_initialized", "shutdown", "topology"]
from fastpar import nn  # noqa: E402
from fastpar.parallelize import parallelize  # noqa: E402
from fastpar.state_dict import full_state_dict, load_full_state_dict  # noqa: E402

__all__ += ["full_state_dict", "load_full_state_dict", "nn", "parallelize"]
