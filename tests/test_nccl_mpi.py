"""The nccl_mpi engine's glue, without a GPU: the MPI bootstrap of the NCCL unique id and what
every call hands NCCL (pointers, counts, dtype and op codes, root, stream).

NCCL itself is replaced at its boundary (the ``cupy.cuda.nccl`` module) by ``FakeNccl``, which
reads and writes the memory behind the pointers it is given and reduces over the group's MPI
communicator: a wrong pointer, count, dtype or op code gives a wrong result here. 3 ranks under
mpirun (the launch tests/test_cuda_ipc_setup.py makes), two groups at once (the world and global
ranks [0, 2]). The real NCCL runs in
tests/test_cuda_ipc.py on a GPU machine.
"""

import ctypes
import importlib.util

import pytest
import torch

from fastpar.comm import policy
from fastpar.comm.engines import nccl_mpi
from fastpar.comm.policy import GroupFacts, choose
from tests.multirank import run_ranks

_CODES = {0: torch.int8, 1: torch.uint8, 2: torch.int32, 4: torch.int64, 6: torch.float16,
          7: torch.float32, 8: torch.float64, 9: torch.bfloat16}
_OPS = {0: "sum", 1: "prod", 2: "max", 3: "min"}


def _view(ptr, count, code):
    dtype = _CODES[code]
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


class FakeNccl:
    """``cupy.cuda.nccl`` as far as NcclMpiCommunicator uses it, over ``transport`` (the MPI
    communicator of the group: the fake's only way to reach the peers)."""

    NCCL_FLOAT32 = 7  # one name present, the others from nccl.h's values

    def __init__(self, transport):
        self.transport = transport
        self.created = []
        self.calls = []

    def get_unique_id(self):
        import secrets

        return tuple(secrets.token_bytes(8))

    def NcclCommunicator(self, ndev, uid, rank):  # noqa: N802 - CuPy's name
        fake = self

        class Comm:
            def _everyone(self, t):
                return [torch.tensor(v, dtype=torch.float64)
                        for v in fake.transport.allgather(t.double().tolist())]

            def allReduce(self, send, recv, count, code, op, stream):  # noqa: N802
                fake.calls.append(("allReduce", count, code, op, stream))
                parts = self._everyone(_view(send, count, code))
                red = {"sum": lambda s: s.sum(0), "max": lambda s: s.max(0).values,
                       "min": lambda s: s.min(0).values, "prod": lambda s: s.prod(0)}
                _view(recv, count, code).copy_(red[_OPS[op]](torch.stack(parts)))

            def allGather(self, send, recv, count, code, stream):  # noqa: N802
                fake.calls.append(("allGather", count, code, stream))
                parts = self._everyone(_view(send, count, code).clone())
                _view(recv, count * ndev, code).copy_(torch.cat(parts))

            def reduceScatter(self, send, recv, count, code, op, stream):  # noqa: N802
                fake.calls.append(("reduceScatter", count, code, op, stream))
                parts = self._everyone(_view(send, count * ndev, code))
                assert _OPS[op] == "sum"
                _view(recv, count, code).copy_(torch.stack(parts).sum(0)[
                    rank * count:(rank + 1) * count])

            def bcast(self, buf, count, code, root, stream):
                fake.calls.append(("bcast", count, code, root, stream))
                parts = self._everyone(_view(buf, count, code))
                _view(buf, count, code).copy_(parts[root])

            def destroy(self):
                fake.calls.append(("destroy",))

        fake.created.append((ndev, uid, rank))
        return Comm()


def body_glue():
    import torch.distributed as dist

    import fastpar
    from fastpar.comm.engines.nccl_mpi import NcclMpiCommunicator
    from fastpar.comm.engines.mpi import Mpi
    from fastpar.comm.state import current

    topo = fastpar.init(timeout=60)
    st = current()
    sub = dist.new_group([0, 2])
    groups = {"world": (dist.group.WORLD, [0, 1, 2])}
    if topo.rank in (0, 2):
        groups["pair"] = (sub, [0, 2])
    out = {}
    for name, (group, ranks) in groups.items():
        mpi = st.communicator(Mpi, group, ranks, None)  # the group's, as the engine gets it
        fake = FakeNccl(mpi)
        comm = NcclMpiCommunicator(mpi, torch.device("cpu"), nccl=fake, stream_of=lambda t: 77)
        n, me = len(ranks), ranks.index(topo.rank)
        ok = []
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            def data(r, k=5):
                return (torch.arange(k * n) % 7 + 10 * r + 1).to(dtype)

            x = data(me)
            comm.all_reduce(x, "sum")
            ok.append(torch.equal(x, sum(data(ranks.index(r)) for r in ranks)))
            x = data(me)
            comm.all_reduce(x, "max")
            ok.append(torch.equal(x, data(n - 1)))
            inp = data(me, 3)
            out_t = torch.empty(3 * n * n, dtype=dtype)
            comm.all_gather(inp, out_t)
            ok.append(torch.equal(out_t, torch.cat([data(p, 3) for p in range(n)])))
            block = out_t[me * 3 * n:(me + 1) * 3 * n]  # the in-place form: inp is out's block
            block.copy_(data(me, 3) * 2)
            comm.all_gather(block, out_t)
            ok.append(torch.equal(out_t, torch.cat([data(p, 3) * 2 for p in range(n)])))
            inp = data(me)
            shard = torch.empty(5, dtype=dtype)
            comm.reduce_scatter(inp, shard, "sum")
            total = sum(data(p) for p in range(n))
            ok.append(torch.equal(shard, total[me * 5:(me + 1) * 5]))
            x = data(me)
            comm.broadcast(x, n - 1)
            ok.append(torch.equal(x, data(n - 1)))
        comm.close()
        out[name] = {"ok": ok, "created": [[c[0], list(c[1]), c[2]] for c in fake.created],
                     "streams": sorted({c[-1] for c in fake.calls if len(c) > 1}),
                     "codes": sorted({c[2] for c in fake.calls if len(c) > 2}),
                     "destroyed": fake.calls[-1] == ("destroy",)}
    fastpar.shutdown()
    return out


@pytest.fixture(scope="module")
def glue():
    return run_ranks(3, body_glue, timeout=240).values()


def test_every_call_reaches_nccl_with_the_right_arguments(glue):
    for rank, out in enumerate(glue):
        for name, g in out.items():
            assert all(g["ok"]), (rank, name, g["ok"])
            assert g["streams"] == [77], g  # torch's current stream, as given
            assert g["codes"] == [4, 7, 9], g  # int64, float32 (CuPy's name), bfloat16
            assert g["destroyed"]
    assert set(glue[1]) == {"world"} and set(glue[0]) == set(glue[2]) == {"world", "pair"}


def test_the_unique_id_goes_over_mpi_from_group_rank_0(glue):
    for name, ranks in (("world", [0, 1, 2]), ("pair", [0, 2])):
        created = [glue[r][name]["created"] for r in ranks]
        assert all(len(c) == 1 for c in created)
        sizes = [c[0][0] for c in created]
        uids = [tuple(c[0][1]) for c in created]
        assert sizes == [len(ranks)] * len(ranks)
        assert [c[0][2] for c in created] == list(range(len(ranks)))  # group ranks
        assert len(set(uids)) == 1, uids  # one id per group ...
    assert glue[0]["world"]["created"][0][1] != glue[0]["pair"]["created"][0][1]  # ... each its own


@pytest.mark.quick
def test_unavailable_says_why():
    assert "launch with mpirun" in nccl_mpi.unavailable(mpi_launched=False)
    why = nccl_mpi.unavailable()
    if importlib.util.find_spec("cupy") is None:
        assert "CuPy" in why and "fastpar[gpu]" in why
    else:
        assert why is None or why == "no CUDA device" or "CuPy" in why


@pytest.mark.quick
def test_policy_refuses_nccl_mpi_with_the_reason():
    f32 = torch.float32
    ready = GroupFacts(size=2, same_host=True, pg_backend="nccl", nccl_mpi="")
    assert choose("all_reduce", "cuda", ready, 64, f32, forced="nccl_mpi").engine == "nccl_mpi"
    assert choose("all_gather", "cuda", ready, 64, torch.bfloat16,
                  forced="nccl_mpi").engine == "nccl_mpi"
    for facts, device, dtype, words in (
            (GroupFacts(size=2, same_host=True, nccl_mpi="CuPy is missing"), "cuda", f32,
             "CuPy is missing"),
            (ready, "cpu", f32, "needs CUDA tensors"),
            (ready, "cuda", torch.complex64, "cannot carry torch.complex64")):
        with pytest.raises(ValueError, match=words):
            choose("all_reduce", device, facts, 64, dtype, forced="nccl_mpi")
    # never chosen unforced
    assert choose("all_reduce", "cuda", ready, 64, f32).engine != "nccl_mpi"
    assert "nccl_mpi" in policy.ENGINES
