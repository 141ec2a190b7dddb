"""Host identity (``runtime.hostid``) and the rendezvous address of a job that spans hosts."""

import os
import socket

import pytest

from fastpar.runtime import hostid, rendezvous
from tests.multirank import run_ranks


@pytest.mark.quick
def test_identity_is_host_name_kernel_and_shm_mount(monkeypatch):
    monkeypatch.delenv("FASTPAR_HOST_ID", raising=False)
    ident = hostid.host_id()
    name, boot, dev = ident.split("/")
    assert name == socket.gethostname()
    assert boot == hostid.boot_id()[:8] and boot != "unknown"
    st = os.stat("/dev/shm")
    assert dev == f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    monkeypatch.setenv("FASTPAR_HOST_ID", "rack3-node7")
    assert hostid.host_id() == "rack3-node7"


@pytest.mark.quick
def test_labels_and_description():
    ids = ["h0/aa/0:1", "h0/aa/0:1", "h1/aa/0:2", "h1/aa/0:2"]
    assert hostid.labels(ids) == {"h0/aa/0:1": "h0", "h1/aa/0:2": "h1"}
    assert hostid.describe(ids) == "h0: ranks 0-1; h1: ranks 2-3"
    # one host name, two /dev/shm: the name alone does not tell them apart
    same = ["node/aa/0:1", "node/aa/0:2", "node/aa/0:1"]
    assert hostid.labels(same) == {"node/aa/0:1": "node/aa/0:1", "node/aa/0:2": "node/aa/0:2"}
    assert hostid.describe(same) == "node/aa/0:1: ranks 0,2; node/aa/0:2: ranks 1"


@pytest.mark.quick
def test_spanning_job_never_rendezvous_on_loopback(monkeypatch):
    for var in ("FASTPAR_MASTER_ADDR", "FASTPAR_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(rendezvous, "_outgoing_address", lambda peer="": None)  # no route
    monkeypatch.setattr(rendezvous, "first_interface_address", lambda: None)  # nor any other
    assert rendezvous._routable_address(False) == "127.0.0.1"  # one host: loopback is fine
    with pytest.raises(RuntimeError) as err:
        rendezvous._routable_address(True, "h0: ranks 0-1; h1: ranks 2-3")
    msg = str(err.value)
    assert "spans hosts (h0: ranks 0-1; h1: ranks 2-3)" in msg and "no default route" in msg
    assert "FASTPAR_SOCKET_IFNAME=<interface>" in msg
    monkeypatch.setenv("FASTPAR_SOCKET_IFNAME", "lo")  # an interface that is loopback: refused
    with pytest.raises(RuntimeError, match="127.0.0.1, the loopback"):
        rendezvous._routable_address(True, "h0: ranks 0-1; h1: ranks 2-3")
    assert rendezvous._routable_address(False) == "127.0.0.1"
    monkeypatch.setenv("FASTPAR_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(ValueError, match=r"FASTPAR_SOCKET_IFNAME=nosuch0: no interface .*lo"):
        rendezvous._routable_address(True)
    monkeypatch.setenv("FASTPAR_MASTER_ADDR", "10.1.2.3")  # the user's word wins
    assert rendezvous._routable_address(True) == "10.1.2.3"


@pytest.mark.quick
def test_gloo_interface_for_spanning_jobs(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("FASTPAR_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(rendezvous, "_outgoing_address", lambda peer="": "127.0.0.1")
    monkeypatch.setattr(rendezvous, "first_interface_address", lambda: None)
    assert rendezvous.gloo_interface("10.0.0.1", spans_hosts=True) is None  # only loopback
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("FASTPAR_SOCKET_IFNAME", "lo")
    rendezvous.gloo_interface("10.0.0.1", spans_hosts=False)  # one host: gloo's default
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert rendezvous.gloo_interface("10.0.0.1", spans_hosts=True) == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")  # the user's setting stays
    rendezvous.gloo_interface("10.0.0.1", spans_hosts=True)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine"
    assert rendezvous.interface_of("127.0.0.1") == "lo"


def body_info_hosts(hosts, tp):
    import fastpar
    from fastpar import info

    rank = int(os.environ.get("PMI_RANK") or os.environ.get("RANK") or 0)
    os.environ["FASTPAR_HOST_ID"] = hosts[rank]
    topo = fastpar.init(tp=tp, timeout=60)
    rep = info.report(topo)
    return info.format_report(rep) if rep else None


def test_info_shows_hosts_and_warns_on_tp_across_hosts():
    text = run_ranks(4, body_info_hosts, hosts=["n0", "n0", "n1", "n1"], tp=2).values()[0]
    assert "hosts: n0 (ranks 0, 1); n1 (ranks 2, 3)" in text
    assert "WARNING" not in text
    assert "2 hosts x 2 ranks: shm within each host, mpi across" in text  # the world's engine
    text = run_ranks(4, body_info_hosts, hosts=["n0", "n1", "n0", "n1"], tp=2).values()[0]
    assert "hosts: n0 (ranks 0, 2); n1 (ranks 1, 3)" in text
    assert "WARNING: tp group [0, 1] spans hosts n0, n1" in text
    assert "WARNING: tp group [2, 3] spans hosts n0, n1" in text
