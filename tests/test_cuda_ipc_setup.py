"""The CUDA IPC communicator's policy and setup protocol, without a GPU.

- ``policy.ipc_limit``: the size table by (compute capability, world size, link), as a pure
  function; ``cuda_ipc.size_limit``/``link_kind``: the link found from every rank's GPU facts.
- ``CudaIpcCommunicator.create``/``close`` on 3 real processes (gloo) with the native calls
  replaced at their boundary (``cuda_ipc.Driver``) by a fake that records what it is asked and
  can fail any step on one rank: every rank must fall back together, name the rank that failed,
  release everything it took, never free its region before every peer unmapped it, and unmap on
  the device it mapped on.
- The torch.distributed backend's maker (``fastpar/backend/cuda.py``): the same protocol over
  the backend's own gloo, its collective close and its one-rank drop.
- CUDA symmetric tensors (``symmetric._cuda_symmetric``) through the same exchange
  (``ipc_exchange.PeerMaps``) and the same fake driver, on CPU memory: every peer's address, the
  two-barrier teardown, and every rank a plain tensor when one rank cannot export or open.

The kernels themselves are tested on a GPU (tests/test_cuda_ipc.py).
"""

import time

import pytest
import torch

from fastpar.comm.engines import cuda_ipc
from fastpar.comm.policy import IPC_DEFAULT_MAX_BYTES, ipc_limit
from tests.multirank import run_ranks

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.quick
@pytest.mark.parametrize("cap, world, link, want, words", [
    # vLLM's table, sm90 (H100/H200) with NVLink: every listed size, odd worlds round up
    ((9, 0), 2, "nvlink", 64 * MiB, "vLLM's table for sm90 at 2 GPUs"),
    ((9, 0), 3, "nvlink", 32 * MiB, "at 4 GPUs"),
    ((9, 0), 4, "nvlink", 32 * MiB, "up to 32 MiB"),
    ((9, 0), 5, "nvlink", 512 * KiB, "at 6 GPUs"),
    ((9, 0), 6, "nvlink", 512 * KiB, "up to 512 KiB"),
    ((9, 0), 8, "nvlink", 256 * KiB, "up to 256 KiB"),
    ((10, 0), 2, "nvlink", 2 * MiB, "sm100"),
    ((10, 0), 8, "nvlink", 1 * MiB, "sm100"),
    # not in the table: vLLM's default size
    ((8, 0), 8, "nvlink", IPC_DEFAULT_MAX_BYTES, "vLLM's default"),
    ((8, 9), 2, "pcie", IPC_DEFAULT_MAX_BYTES, "PCIe"),
    # PCIe only: 2 GPUs yes, more no
    ((9, 0), 2, "pcie", 64 * MiB, "2 GPUs over PCIe"),
    ((9, 0), 3, "pcie", 0, "PCIe only"),
    ((8, 0), 4, "pcie", 0, "PCIe only"),
    # one GPU shared (testing): the table still applies
    ((9, 0), 4, "same_gpu", 32 * MiB, "one GPU"),
    # off
    ((9, 0), 2, "none", 0, "no P2P access"),
    ((7, 5), 2, "nvlink", 0, "older than sm80"),
    ((9, 0), 1, "nvlink", 0, "outside 2..8"),
    ((9, 0), 9, "nvlink", 0, "outside 2..8"),
])
def test_ipc_limit_table(cap, world, link, want, words):
    limit, reason = ipc_limit(cap, world, link)
    assert limit == want, (cap, world, link, reason)
    assert words in reason, reason


@pytest.mark.quick
def test_ipc_limit_rejects_unknown_link():
    with pytest.raises(ValueError, match="nvlink.*'infiniband'"):
        ipc_limit((9, 0), 2, "infiniband")


class LinkDriver:
    """Answers ``link(a, b)`` from a table {(a, b): (access, atomics)}."""

    def __init__(self, pairs):
        self.pairs = pairs

    def link(self, a, b):
        return self.pairs[(min(a, b), max(a, b))]


def _facts(devices, visible=("u0", "u1", "u2", "u3"), cap=(9, 0)):
    return [{"index": d, "uuid": visible[d], "visible": list(visible), "capability": cap}
            for d in devices]


@pytest.mark.quick
@pytest.mark.parametrize("devices, pairs, link, limit", [
    ([0, 0, 0], {}, "same_gpu", 32 * MiB),
    ([0, 1], {(0, 1): (True, True)}, "nvlink", 64 * MiB),
    ([0, 1], {(0, 1): (True, False)}, "pcie", 64 * MiB),
    ([0, 1, 2], {(0, 1): (True, True), (0, 2): (True, True), (1, 2): (True, False)}, "pcie", 0),
    ([0, 1], {(0, 1): (False, False)}, "none", 0),
])
def test_size_limit_from_every_ranks_facts(devices, pairs, link, limit):
    driver = LinkDriver(pairs)
    assert cuda_ipc.link_kind(_facts(devices), driver)[0] == link
    assert cuda_ipc.size_limit(_facts(devices), driver)[0] == limit


@pytest.mark.quick
def test_size_limit_off_when_ranks_see_different_gpus():
    # Each rank sees only its own GPU as device 0 (a per-rank CUDA_VISIBLE_DEVICES).
    facts = [{"index": 0, "uuid": u, "visible": [u], "capability": (9, 0)} for u in ("a", "b")]
    limit, reason = cuda_ipc.size_limit(facts, LinkDriver({}))
    assert limit == 0 and "CUDA_VISIBLE_DEVICES differs" in reason


@pytest.mark.quick
def test_describe_says_what_each_world_size_would_get(monkeypatch):
    """What `python -m fastpar info` prints about cuda_ipc, on a pretend 2-GPU sm90 NVLink
    machine (the CUDA facts come through the driver; torch.cuda's device count is patched)."""
    class TwoGpus(LinkDriver):
        def facts(self, device):
            return _facts([device.index], visible=("u0", "u1"))[0]

    monkeypatch.setattr(cuda_ipc._native, "status", lambda: {"cuda": True})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("FASTPAR_SHARED_GPU", raising=False)
    driver = TwoGpus({(0, 1): (True, True)})
    lines = cuda_ipc.describe((2, 4), driver=driver)
    assert lines[0].startswith("2 ranks: on, sm90, 2 ranks, NVLink between every pair: up to "
                               "64 MiB"), lines
    assert lines[1] == "4 ranks: not on this machine (2 GPUs)", lines
    monkeypatch.setenv("FASTPAR_SHARED_GPU", "1")  # 4 ranks on 2 GPUs: some share one
    assert cuda_ipc.describe((4,), driver=driver)[0].startswith("4 ranks: on, sm90, 4 ranks, "
                                                                "NVLink")
    driver.pairs = {(0, 1): (True, False)}
    assert "PCIe only: off" in cuda_ipc.describe((4,), driver=driver)[0]
    monkeypatch.setenv("FASTPAR_CUDA_IPC", "0")
    assert cuda_ipc.describe(driver=driver) == ["off: FASTPAR_CUDA_IPC=0"]


# ------------------------------------------------------------------ over processes (fake driver)

SYMMETRIC_OFFSET = 512


class FakeDriver:
    """The native boundary, faked on CPU: allocations are numbers, handles name their owner,
    and the 'kernel' is a gloo all_reduce of the CPU tensor over the group (so the probe really
    checks a sum). ``fail`` names a method that raises on this rank; ``bad_sum`` corrupts this
    rank's probe; ``timed_out`` is what ``error()`` reports. ``log`` records (time, call, args)
    of the calls that succeeded."""

    def __init__(self, rank, group, fail=None, bad_sum=False):
        self.rank, self.group, self.fail, self.bad_sum = rank, group, fail, bad_sum
        self.timed_out = ""
        self.log = []
        self.next_ptr = 1 << 20

    def _call(self, name, *args):  # a call that fails took nothing: it is not logged
        if self.fail == name:
            raise RuntimeError(f"injected {name} failure")
        self.log.append((time.monotonic(), name, args))

    def facts(self, device):
        self._call("facts")
        return {"index": 0, "uuid": "gpu0", "visible": ["gpu0"], "capability": (9, 0)}

    def link(self, a, b):
        raise AssertionError("one GPU: no link to ask about")

    def meta_size(self):
        return 4096

    def alloc(self, nbytes, device):
        self._call("alloc", nbytes)
        self.next_ptr += 1 << 30
        return self.next_ptr

    def free(self, ptr, device):
        self._call("free", ptr)

    def export(self, ptr, device):
        self._call("export", ptr)
        return [self.rank, ptr]

    def export_tensor(self, t):  # the tensor lies SYMMETRIC_OFFSET bytes into its allocation
        self._call("export_tensor", t.numel())
        return [self.rank, t.data_ptr()], SYMMETRIC_OFFSET

    def open(self, handle, device):
        self._call("open", tuple(handle), str(device))
        return 7_000_000 + handle[0]

    def close(self, base, device):
        self._call("close", base, str(device))

    def init(self, signals, buffers, rank, world, nbytes, global_ranks, timeout, device):
        self._call("init", tuple(signals), nbytes, tuple(global_ranks), timeout)
        return 99

    def set_timeout(self, ctx, timeout):
        self._call("set_timeout", ctx, timeout)

    def all_reduce(self, ctx, t, algo):
        self._call("all_reduce", algo)
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)
        if self.bad_sum:
            t.add_(1)

    def error(self, ctx):
        return self.timed_out

    def dispose(self, ctx):
        self._call("dispose", ctx)

    def synchronize(self, device):
        self._call("synchronize")


def body_setup_protocol():
    import torch.distributed as dist

    import fastpar
    from fastpar.comm.engines.cuda_ipc import CudaIpcCommunicator
    from fastpar.comm.state import current

    topo = fastpar.init(timeout=60)
    rank, world = topo.rank, topo.world_size
    group = dist.group.WORLD
    ranks = list(range(world))
    out = {}

    def run(name, timed_out="", **fault):
        mine = fault if rank == 1 else {}  # the fault, on global rank 1 only
        driver = FakeDriver(rank, group, **mine)
        comm, why = CudaIpcCommunicator.create(group, ranks, rank, torch.device("cpu"),
                                               timeout=12.5, driver=driver)
        if rank == 1:
            driver.timed_out = timed_out  # a launch after setup timed out, on rank 1
        closed = None
        if comm is not None:
            x = torch.full((8,), float(rank + 1))
            comm.all_reduce(x)
            assert x.tolist() == [world * (world + 1) / 2] * 8
            assert comm.error() == (timed_out if rank == 1 else "")
            try:
                comm.close()
            except RuntimeError as exc:
                closed = str(exc)
        calls = [(t, c, list(a)) for t, c, a in driver.log]
        everyone = [None] * world
        dist.all_gather_object(everyone, calls, group=group)
        out[name] = {"ok": comm is not None, "why": why, "closed": closed, "calls": calls,
                     "all_calls": everyone}

    run("healthy")
    for step in ("facts", "alloc", "export", "open", "init"):
        run(f"fail-{step}", fail=step)
    run("bad-probe", bad_sum=True)
    run("timed-out-at-close", timed_out="fastpar cuda_ipc all_reduce on global ranks [...] "
        "timed out (injected)")

    out["backend"] = backend_maker(rank, world, group)

    # Setting the communicator up inside a CUDA graph capture is refused before it begins.
    real = torch.cuda.is_available, torch.cuda.is_current_stream_capturing
    torch.cuda.is_available = torch.cuda.is_current_stream_capturing = lambda: True
    try:
        current().communicator(cuda_ipc.CudaIpc, group, ranks, torch.device("cuda", 0))
        out["capture"] = None
    except RuntimeError as exc:
        out["capture"] = str(exc)
    finally:
        torch.cuda.is_available, torch.cuda.is_current_stream_capturing = real
    fastpar.shutdown()
    return out


def backend_maker(rank, world, group):
    """The torch.distributed backend's maker (``fastpar/backend/cuda.py``): the same protocol
    over the backend's own gloo (a c10d Backend that is no registered group), as the extension
    calls it: ``maker(device index)``, then ``owner.close()`` (the group's shutdown) or
    ``owner.drop()`` (an abort)."""
    import datetime
    import os

    import torch.distributed as dist

    from fastpar.backend.cuda import REFUSED, ipc_maker

    store = dist.PrefixStore("backend-ipc/", dist.distributed_c10d._get_default_store())
    gloo = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=60))
    ranks = list(range(world))
    out = {}
    for name, fault, end in (("healthy", {}, "close"), ("aborted", {}, "drop"),
                             ("fail-open", {"fail": "open"}, None)):
        driver = FakeDriver(rank, group, **(fault if rank == 1 else {}))
        made = ipc_maker(gloo, ranks, rank, 12.5, driver, "cpu")(0)
        if made is not REFUSED:
            getattr(made[3], end)()
        out[name] = {"made": None if made is REFUSED else list(made[:3]),
                     "calls": _names(driver.log),
                     "opened_on": sorted({a[1] for _, c, a in driver.log if c == "open"})}
    os.environ["FASTPAR_CUDA_IPC"] = "0"
    driver = FakeDriver(rank, group)
    out["off"] = {"refused": ipc_maker(gloo, ranks, rank, 12.5, driver, "cpu")(0) is REFUSED,
                  "calls": _names(driver.log)}
    del os.environ["FASTPAR_CUDA_IPC"]
    return out


def _names(calls):
    return [c for _, c, _ in calls]


@pytest.fixture(scope="module")
def protocol():
    return run_ranks(3, body_setup_protocol, timeout=240).values()


def test_healthy_setup_and_teardown_order(protocol):
    for rank, out in enumerate(protocol):
        h = out["healthy"]
        assert h["ok"] and h["why"] is None and h["closed"] is None
        names = _names(h["calls"])
        assert names[:4] == ["facts", "alloc", "export", "open"], names
        # the region = signal block + the table's size (sm90, 3 ranks: the 4-GPU entry)
        assert h["calls"][1][2] == [4096 + 32 * MiB]
        init = h["calls"][names.index("init")][2]
        # global ranks; the probe's timeout (a quarter of the job's), then the job's own
        assert init[2:] == [[0, 1, 2], 12.5 / 4], init
        assert h["calls"][names.index("set_timeout")][2] == [99, 12.5]
        at = names.index("set_timeout")  # right after the 4 probe launches
        assert names[at - 4:at] == ["all_reduce"] * 4, names
        # every peer's handle opened once, none of its own; closed on the device it was
        # opened on, after the context is disposed; freed last
        opens = [a for _, c, a in h["calls"] if c == "open"]
        assert sorted(a[0][0] for a in opens) == [p for p in range(3) if p != rank]
        closes = [a for _, c, a in h["calls"] if c == "close"]
        assert sorted(a[0] for a in closes) == sorted(7_000_000 + a[0][0] for a in opens)
        assert all(a[1] == "cpu" for a in opens + closes)
        tail = names[names.index("synchronize"):]
        assert tail == ["synchronize", "dispose", "close", "close", "free"], tail
    # No rank frees its region before every rank has unmapped every peer's.
    everyone = protocol[0]["healthy"]["all_calls"]
    last_close = max(t for calls in everyone for t, c, _ in calls if c == "close")
    first_free = min(t for calls in everyone for t, c, _ in calls if c == "free")
    assert last_close < first_free


@pytest.mark.parametrize("case, words", [
    ("fail-facts", "checking the GPUs failed (global rank 1: RuntimeError: injected facts"),
    ("fail-alloc", "allocating and exporting the IPC buffer failed (global rank 1: "
                   "RuntimeError: injected alloc"),
    ("fail-export", "allocating and exporting the IPC buffer failed (global rank 1: "
                    "RuntimeError: injected export"),
    ("fail-open", "opening the peers' IPC handles failed (global rank 1: RuntimeError: "
                  "injected open"),
    ("fail-init", "building the IPC context failed (global rank 1: RuntimeError: injected init"),
    ("bad-probe", "the probe all-reduce failed (global rank 1: probe all-reduce "
                  "(torch.float32, algo 1) gave"),
])
def test_a_failure_on_one_rank_makes_every_rank_fall_back(protocol, case, words):
    for rank, out in enumerate(protocol):
        r = out[case]
        assert not r["ok"] and words in r["why"], (rank, r["why"])
        names = _names(r["calls"])
        # whatever was taken is given back: every open closed, every alloc freed
        assert names.count("open") == names.count("close"), names
        assert names.count("alloc") == names.count("free"), names
        assert names.count("init") == names.count("dispose"), names
    # and frees come after every rank's unmapping, as in a normal teardown
    everyone = protocol[0][case]["all_calls"]
    closes = [t for calls in everyone for t, c, _ in calls if c == "close"]
    frees = [t for calls in everyone for t, c, _ in calls if c == "free"]
    if closes and frees:
        assert max(closes) < min(frees)


def test_a_timed_out_communicator_is_not_freed_and_says_why(protocol):
    for rank, out in enumerate(protocol):
        r = out["timed-out-at-close"]
        assert r["ok"]
        names = _names(r["calls"])
        # the group agreed it is unhealthy: peers may still map the regions, so nobody frees
        assert "free" not in names and names.count("close") == 2, names
        if rank == 1:
            assert "timed out (injected)" in r["closed"]
        else:
            assert r["closed"] is None


def test_backend_maker_sets_up_and_releases_over_the_backends_own_gloo(protocol):
    for rank, out in enumerate(protocol):
        b = out["backend"]
        # (context, max_bytes: sm90 at 3 ranks, algo auto), on the device the call names
        assert b["healthy"]["made"] == [99, 32 * MiB, 0], b["healthy"]
        assert b["healthy"]["opened_on"] == ["cpu:0"]
        calls = b["healthy"]["calls"]
        assert calls[calls.index("synchronize"):] == ["synchronize", "dispose", "close",
                                                      "close", "free"], calls
        # an abort: this rank alone releases what uses the region and unmaps the peers', and
        # keeps its own region (a peer may still map it)
        calls = b["aborted"]["calls"]
        assert calls[calls.index("synchronize"):] == ["synchronize", "dispose", "close",
                                                      "close"], calls
        # a failure on rank 1: every rank refuses alike (NCCL serves) and gives back all
        assert b["fail-open"]["made"] is None
        calls = b["fail-open"]["calls"]
        assert calls.count("alloc") == calls.count("free") == 1, calls
        assert calls.count("open") == calls.count("close"), calls
        assert b["off"] == {"refused": True, "calls": []}


def test_setup_inside_a_graph_capture_is_refused(protocol):
    for out in protocol:
        assert "cannot happen inside a CUDA graph capture" in out["capture"]
        assert "global ranks [0, 1, 2]" in out["capture"]


def body_symmetric_setup():
    """CUDA symmetric tensors (``symmetric._cuda_symmetric``) through the same exchange, with the
    fake driver and CPU memory: healthy (every peer's address, then the two-barrier teardown at
    shutdown), and an export or an open failing on global rank 1 (every rank a plain tensor)."""
    import logging

    import torch.distributed as dist

    import fastpar
    from fastpar.comm import symmetric
    from fastpar.comm.state import current

    topo = fastpar.init(timeout=60)
    rank, world = topo.rank, topo.world_size
    ranks = list(range(world))
    said = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("fastpar.comm")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out = {}
    try:
        for case, fault in (("healthy", {}), ("fail-export", {"fail": "export_tensor"}),
                            ("fail-open", {"fail": "open"})):
            st, group = current(), dist.group.WORLD  # a new world after each re-init
            driver = FakeDriver(rank, group, **(fault if rank == 1 else {}))
            del said[:]
            t = symmetric._cuda_symmetric(st, group, ranks, (2, 5), 10, torch.float32,
                                          torch.device("cpu"), driver=driver)
            sym = st.symmetric.get(t.data_ptr())
            r = {"shape": list(t.shape), "own": t.data_ptr(), "slots": sym and sym.slots,
                 "closers": len(st.closers), "said": [m for m in said if "symmetric" in m]}
            fastpar.shutdown()  # the teardown, on every rank
            r["done"] = time.monotonic()
            r["calls"] = [(at, c, list(a)) for at, c, a in driver.log]
            out[case] = r
            topo = fastpar.init(timeout=60)
        everyone = [None] * world
        dist.all_gather_object(everyone, out, group=dist.group.WORLD)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    fastpar.shutdown()
    return everyone


@pytest.fixture(scope="module")
def symmetric_setup():
    return run_ranks(3, body_symmetric_setup, timeout=240).values()[0]  # every rank's, gathered


def test_symmetric_tensor_maps_every_peer_and_tears_down_in_order(symmetric_setup):
    for rank, out in enumerate(symmetric_setup):
        h = out["healthy"]
        assert h["shape"] == [2, 5] and h["said"] == [], h
        # its own tensor, and each peer's at the opened base + the tensor's offset
        assert h["slots"] == [h["own"] if p == rank else 7_000_000 + p + SYMMETRIC_OFFSET
                              for p in range(3)], h["slots"]
        assert h["closers"] >= 1
        names = _names(h["calls"])
        assert names == ["export_tensor", "open", "open", "synchronize", "close", "close"], names
        opens = [a for _, c, a in h["calls"] if c == "open"]
        closes = [a for _, c, a in h["calls"] if c == "close"]
        assert sorted(a[0][0] for a in opens) == [p for p in range(3) if p != rank]
        assert sorted(a[0] for a in closes) == sorted(7_000_000 + a[0][0] for a in opens)
        assert all(a[1] == "cpu" for a in opens + closes)
    # No rank lets go of its tensor (its teardown returns) before every rank has unmapped it.
    last_close = max(t for out in symmetric_setup for t, c, _ in out["healthy"]["calls"]
                     if c == "close")
    assert last_close < min(out["healthy"]["done"] for out in symmetric_setup)


@pytest.mark.parametrize("case, words", [
    ("fail-export", "exporting the tensor's IPC handle failed (global rank 1: RuntimeError: "
                    "injected export_tensor"),
    ("fail-open", "opening the peers' IPC handles failed (global rank 1: RuntimeError: "
                  "injected open"),
])
def test_a_symmetric_setup_failure_on_one_rank_gives_every_rank_a_plain_tensor(
        symmetric_setup, case, words):
    for rank, out in enumerate(symmetric_setup):
        r = out[case]
        assert r["slots"] is None and r["closers"] == 0 and r["shape"] == [2, 5], (rank, r)
        assert len(r["said"]) == 1 and "a plain tensor" in r["said"][0], r["said"]
        assert words in r["said"][0], (rank, r["said"])
        names = _names(r["calls"])
        assert names.count("open") == names.count("close"), names  # every mapping undone
        assert "synchronize" in names, names
