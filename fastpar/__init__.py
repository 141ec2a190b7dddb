"""fastpar: Megatron-style data, tensor and pipeline parallelism for PyTorch.

    import fastpar
    topo = fastpar.init(tp=2, pp=2)      # under mpirun, torchrun, or a single process
    model = fastpar.parallelize(model)   # tensor-parallel, in place
    ...
    fastpar.shutdown()
"""

from fastpar import nn
from fastpar.parallelize import parallelize
from fastpar.runtime import init, is_initialized, shutdown, topology
from fastpar.state_dict import full_state_dict, load_full_state_dict
from fastpar.topology import Grid, Topology
from fastpar.version import __version__

__all__ = ["Grid", "Topology", "__version__", "full_state_dict", "init", "is_initialized",
           "load_full_state_dict", "nn", "parallelize", "shutdown", "topology"]
