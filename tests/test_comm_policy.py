"""The engine policy as a table: (op, device, facts, bytes, dtype) -> engine, no devices needed."""

import pytest
import torch

from fastpar.comm.policy import GroupFacts, choose

pytestmark = pytest.mark.quick  # every test here: the quick tier

CPU1 = GroupFacts(size=1, same_host=True)
CPU = GroupFacts(size=4, same_host=True)
CPU_SPAN = GroupFacts(size=4, same_host=False)
CPU_NONATIVE = GroupFacts(size=4, same_host=True, native=False)
GPU_IPC = GroupFacts(size=4, same_host=True, ipc_ready=True, ipc_max_bytes=8 << 20,
                     pg_backend="nccl")
GPU_NOIPC = GroupFacts(size=4, same_host=True, ipc_ready=False, pg_backend="nccl")
# 2 hosts x 2 ranks, host sub-groups made, MPI-launched; and the groups hier cannot serve
HIER = GroupFacts(size=4, same_host=False, per_host=(2, 2), hier_ready=True, mpi=True)
HIER_TORCHRUN = GroupFacts(size=4, same_host=False, per_host=(2, 2), hier_ready=True)
UNEVEN = GroupFacts(size=4, same_host=False, per_host=(3, 1), hier_ready=False, mpi=True)
ONE_EACH = GroupFacts(size=2, same_host=False, per_host=(1, 1), mpi=True)
NO_SPLIT = GroupFacts(size=4, same_host=False, per_host=(2, 2), hier_ready=False, mpi=True)
GPU_SPAN = GroupFacts(size=8, same_host=False, ipc_ready=True, ipc_max_bytes=8 << 20,
                      pg_backend="nccl")

F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64

TABLE = [
    # op, device, facts, bytes, dtype, expected engine, words in the reason
    ("all_reduce", "cpu", CPU1, 4096, F32, "local", "one rank"),
    ("all_reduce", "cuda", GroupFacts(size=1, same_host=True), 4096, F32, "local", "one rank"),
    ("all_reduce", "cpu", CPU, 4096, F32, "shm", "one host"),
    ("all_reduce", "cpu", CPU, 64 << 20, BF16, "shm", "one host"),
    ("all_gather", "cpu", CPU, 4096, I64, "shm", "one host"),
    ("broadcast", "cpu", CPU, 4096, torch.uint8, "shm", "one host"),
    ("all_reduce", "cpu", CPU, 4096, I64, "gloo", "int64"),
    ("reduce_scatter", "cpu", CPU, 4096, torch.int32, "gloo", "int32"),
    ("all_reduce", "cpu", CPU_SPAN, 4096, F32, "gloo", "spans hosts"),
    ("all_reduce", "cpu", CPU_NONATIVE, 4096, F32, "gloo", "fastpar._C"),
    ("all_reduce", "cuda", GPU_IPC, 4096, BF16, "cuda_ipc", "within one node"),
    ("all_reduce", "cuda", GPU_IPC, 8 << 20, F32, "cuda_ipc", "within one node"),
    ("all_reduce", "cuda", GPU_IPC, (8 << 20) + 16, F32, "nccl", "exceeds"),
    ("all_reduce", "cuda", GPU_IPC, 4100, F32, "nccl", "multiple of 16"),
    ("all_reduce", "cuda", GPU_IPC, 4096, torch.float64, "nccl", "float64"),
    ("all_gather", "cuda", GPU_IPC, 4096, F32, "nccl", "all_reduce only"),
    ("all_reduce", "cuda", GPU_NOIPC, 4096, F32, "nccl", "P2P"),
    ("all_reduce", "cuda", GPU_SPAN, 4096, F32, "nccl", "spans nodes"),
    # across hosts: hierarchical from HIER_MIN_BYTES, else one flat call (MPI where launched)
    ("all_reduce", "cpu", HIER, 64 << 10, F32, "hier", "2 hosts x 2 ranks: shm within each "
                                                       "host, mpi across"),
    ("reduce_scatter", "cpu", HIER, 16 << 20, BF16, "hier", "gloo across"),
    ("all_reduce", "cpu", HIER, (4 << 20) - 4, F32, "hier", "mpi across"),
    ("all_reduce", "cpu", HIER, 4 << 20, F32, "hier", "gloo across"),
    ("all_gather", "cpu", HIER_TORCHRUN, 1 << 20, F32, "hier", "gloo across"),
    ("all_reduce", "cpu", HIER, 4092, F32, "mpi", "below 64 KiB"),
    ("all_reduce", "cpu", HIER, 4096, F32, "mpi", "below 64 KiB"),  # flat MPI wins below
    ("all_reduce", "cpu", HIER, (64 << 10) - 4, F32, "mpi", "below 64 KiB"),
    ("all_reduce", "cpu", HIER_TORCHRUN, 4096, F32, "hier", "gloo across"),  # not flat gloo
    ("all_reduce", "cpu", HIER, 2048, BF16, "gloo", "below 4 KiB"),
    ("all_reduce", "cpu", HIER_TORCHRUN, 2048, F32, "gloo", "below 4 KiB"),
    ("broadcast", "cpu", HIER, 1 << 20, F32, "mpi", "broadcast is flat"),
    ("all_reduce", "cpu", HIER, 1 << 20, I64, "mpi", "not torch.int64"),
    ("all_reduce", "cpu", UNEVEN, 1 << 20, F32, "mpi", "3 + 1 of its ranks (uneven)"),
    ("all_reduce", "cpu", ONE_EACH, 1 << 20, F32, "mpi", "one of its ranks per host"),
    ("all_reduce", "cpu", NO_SPLIT, 1 << 20, F32, "mpi", "no host sub-groups"),
    ("all_reduce", "cuda", GroupFacts(size=4, same_host=False, per_host=(2, 2), hier_ready=True,
                                      pg_backend="nccl"), 1 << 20, F32, "nccl", "spans nodes"),
    # all_to_all moves bytes: shm for every dtype on one host, one flat call across hosts
    ("all_to_all", "cpu", CPU1, 4096, F32, "local", "one rank"),
    ("all_to_all", "cpu", CPU, 4096, torch.bool, "shm", "one host"),
    ("all_to_all", "cpu", CPU, 64 << 20, I64, "shm", "one host"),
    ("all_to_all", "cpu", CPU_NONATIVE, 4096, F32, "gloo", "fastpar._C"),
    ("all_to_all", "cpu", HIER, 1 << 20, BF16, "mpi", "all_to_all is flat"),
    ("all_to_all", "cpu", HIER_TORCHRUN, 1 << 20, F32, "gloo", "all_to_all is flat"),
    ("all_to_all", "cuda", GPU_IPC, 4096, F32, "nccl", "all_reduce only"),
]


@pytest.mark.parametrize("op, device, facts, nbytes, dtype, engine, why", TABLE)
def test_policy_table(op, device, facts, nbytes, dtype, engine, why):
    choice = choose(op, device, facts, nbytes, dtype)
    assert choice.engine == engine, choice
    assert why in choice.reason, choice


def test_reduce_ops_each_engine_lacks():
    assert choose("all_reduce", "cuda", GPU_IPC, 4096, F32, reduce_op="max").engine == "nccl"
    assert choose("all_reduce", "cpu", CPU, 4096, F32, reduce_op="max").engine == "shm"
    assert choose("all_reduce", "cpu", CPU, 4096, F32, reduce_op="min").engine == "gloo"
    assert choose("broadcast", "cpu", CPU, 4096, F32, reduce_op="min").engine == "shm"


@pytest.mark.parametrize("forced, device, facts, dtype, ok", [
    ("shm", "cpu", CPU, F32, True),
    ("shm", "cpu", CPU_SPAN, F32, False),
    ("hier", "cpu", HIER, F32, True),
    ("hier", "cpu", CPU, F32, False),
    ("hier", "cpu", UNEVEN, F32, False),
    ("shm", "cuda", GPU_IPC, F32, False),
    ("gloo", "cpu", CPU, I64, True),
    ("mpi", "cpu", CPU, F32, True),
    ("mpi", "cpu", CPU, BF16, False),
    ("nccl", "cpu", CPU, F32, False),
    ("cuda_ipc", "cuda", GPU_IPC, F32, True),
    ("cuda_ipc", "cuda", GPU_NOIPC, F32, False),
])
def test_forced_engine(forced, device, facts, dtype, ok):
    if ok:
        assert choose("all_reduce", device, facts, 4096, dtype, forced=forced).engine == forced
    else:
        with pytest.raises(ValueError, match=f"FASTPAR_COMM_BACKEND={forced} cannot serve"):
            choose("all_reduce", device, facts, 4096, dtype, forced=forced)


def test_unknown_names():
    with pytest.raises(ValueError, match="unknown engine 'smh'"):
        choose("all_reduce", "cpu", CPU, 8, F32, forced="smh")
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        choose("allreduce", "cpu", CPU, 8, F32)


@pytest.mark.parametrize("forced, device, facts, dtype, why", [
    ("shm", "cpu", CPU, torch.bool, None),
    ("mpi", "cpu", CPU, BF16, None),  # bytes: any dtype
    ("gloo", "cpu", CPU, torch.int8, None),
    ("hier", "cpu", HIER, F32, "all_to_all is flat"),
    ("cuda_ipc", "cuda", GPU_IPC, F32, "all_reduce only"),
    ("nccl_mpi", "cuda", GroupFacts(size=4, same_host=True, pg_backend="nccl", nccl_mpi=""), F32,
     "nccl_mpi has no all_to_all"),
])
def test_forced_all_to_all(forced, device, facts, dtype, why):
    if why is None:
        assert choose("all_to_all", device, facts, 4096, dtype, forced=forced).engine == forced
    else:
        with pytest.raises(ValueError, match=why):
            choose("all_to_all", device, facts, 4096, dtype, forced=forced)


def test_quantizes_where_measured_faster():
    """policy.quantizes as a table: across hosts every call but a bfloat16 all_reduce (measured
    0.73x bfloat16's speed); on one host the shm engine from its threshold, CUDA tensors within
    a node never (unmeasured), other engines always; a forced engine always."""
    from fastpar.comm.policy import QUANT_SHM_MIN_BYTES, quantizes

    f32, bf16 = torch.float32, torch.bfloat16

    def q(op, engine, nbytes=16 << 20, dtype=f32, device="cpu", same_host=False, forced=None):
        return quantizes(op, engine, nbytes, dtype, device=device, same_host=same_host,
                         forced=forced)

    assert q("all_reduce", "local", 1 << 30) == (False, "group of one rank: nothing crosses")
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for engine, device in (("hier", "cpu"), ("mpi", "cpu"), ("gloo", "cpu"),
                               ("nccl", "cuda")):
            assert q(op, engine, 16, device=device) == (True, "int8 on the wire"), (op, engine)
            yes, why = q(op, engine, dtype=bf16, device=device)
            assert yes == (op != "all_reduce"), (op, engine, why)
        # CUDA within a node: full precision unless forced
        for engine in ("nccl", "cuda_ipc", "nccl_mpi"):
            yes, why = q(op, engine, device="cuda", same_host=True)
            assert not yes and "CUDA tensors within a node" in why and "unmeasured" in why
            assert q(op, engine, device="cuda", same_host=True, forced=engine)[0]
        assert q(op, "gloo", 16, same_host=True)[0]  # no native build: the torch codec
        assert q(op, "shm", QUANT_SHM_MIN_BYTES, same_host=True)[0]
        yes, why = q(op, "shm", QUANT_SHM_MIN_BYTES - 1, same_host=True)
        assert not yes and "within a host below 1 MiB" in why
        assert q(op, "shm", 16, same_host=True, forced="shm")[0]  # runs what it is asked
    yes, why = q("all_reduce", "hier", dtype=bf16)
    assert not yes and "bfloat16 all_reduce across hosts" in why and "0.73x" in why
    assert q("all_reduce", "hier", dtype=bf16, forced="hier")[0]
    assert q("all_reduce", "shm", dtype=bf16, same_host=True)[0]  # one host: from 1 MiB
