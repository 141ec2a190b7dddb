"""The engines: one module each, holding its communicator (what the engine owns per group:
segments, sub-communicators, buffers) and its adapter (how it runs each collective, what it
can do, how its communicator is made and closed). Which engine serves a call is
``comm/policy.py``'s decision; ``comm/routing.py`` holds the one table of names to adapters,
and ``CommState`` the one table of (engine, group) -> communicator.

- local (a group of one): ``base.py`` ``Local``, no communicator;
- gloo, nccl: ``torch_dist.py`` ``Torch``, the process group itself;
- mpi: ``mpi.py`` ``Mpi``, an MPI sub-communicator;
- shm: ``shm.py`` ``Shm``, ``ShmCommunicator`` (its segment: ``segments.py``; its errors:
  ``native_errors.py``);
- cuda_ipc: ``cuda_ipc.py`` ``CudaIpc``, ``CudaIpcCommunicator`` (its handle exchange:
  ``ipc_exchange.py``);
- nccl_mpi: ``nccl_mpi.py`` ``NcclMpi``, ``NcclMpiCommunicator``;
- hier: ``hierarchical.py`` ``Hier``, ``HierCommunicator`` (shm within a host, mpi or torch
  across).

Adding an engine: its module here (a communicator and an adapter) and one rule in
``policy.py`` (plus its name in ``routing.ADAPTERS``).
"""
