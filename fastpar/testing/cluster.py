"""A multi-host cluster on one Linux machine, made of namespaces, for tests of jobs that span hosts.

    from fastpar.testing.cluster import NamespaceCluster, cluster_unavailable
    with NamespaceCluster(hosts=2, rate="1gbit") as c:  # root; else cluster_unavailable()
        c.run(1, ["hostname"]).stdout                     # "h1\\n"
        c.mpirun(["python", "-c", "..."], ppn=2)          # mpirun -hosts h0,h1 -ppn 2, from h0
        c.torchrun(["script.py"], nproc_per_node=2)      # one torchrun agent per host

    python -m fastpar.testing.cluster --hosts 2 --rate 1gbit -- mpirun -np 4 -ppn 2 python ...

**What a host is.** Host i has its own hostname (UTS namespace, ``hostnames[i]``, default
``h<i>``), network namespace (``eth0`` at ``10.77.0.<i+1>/24``, default route via the switch's
``10.77.0.254``), mount namespace (a private tmpfs on ``/dev/shm``, ``/etc/hosts`` listing
``localhost``, ``h0`` .. ``h<N-1>``, their addresses and its own hostname) and IPC namespace. All
hosts share one pid namespace whose pid 1 reaps orphans, so that mpirun in one host can enter
another (a process may only ``setns`` into its own pid namespace or a descendant). Its ``/proc``
is that namespace's. The switch is a bridge in a network namespace of its own; each host's
``eth0`` is one end of a veth pair whose other end is on the bridge. With ``rate``, a ``tbf``
qdisc shapes every ``eth0``'s egress.

**No footprint.** Every namespace is held by a process (none is bind-mounted), the holders die
with the harness (PR_SET_PDEATHSIG), and the veths and bridge live only inside the namespaces.
Killing the cluster's pid 1 ends every process in every host. ``close()`` (on leaving the
``with``, on an exception, KeyboardInterrupt) kills the holders; a SIGKILLed harness takes them
with it. The files the hosts need are bind-mounted, then unlinked before ``__enter__`` returns.

**MPI across hosts.** Commands in a host get ``HYDRA_LAUNCHER=ssh`` and ``HYDRA_LAUNCHER_EXEC``
set to ``cluster_ssh`` (beside this file), which enters the named host with nsenter, and
``HYDRA_IFACE=eth0`` so the proxies dial mpiexec over the hosts' network. Run mpirun from a host
(h0 by ``c.mpirun``): the pids in ``FASTPAR_CLUSTER`` are the cluster's own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

if __package__:
    from . import _netns
    from ._link import tbf_burst, throughput  # noqa: F401 (part of this module's interface)
else:                       # run as a file (scripts/cluster.sh): no `import fastpar`, no torch
    import _netns
    from _link import tbf_burst, throughput  # noqa: F401

SUBNET = "10.77.0"          # private, /24; the switch is .254
GATEWAY = f"{SUBNET}.254"
IFACE = "eth0"
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_ssh")
# What a command in a host needs to find the others over eth0 (MPICH's netmods, gloo, Hydra).
NET_ENV = {"GLOO_SOCKET_IFNAME": IFACE, "UCX_NET_DEVICES": IFACE, "FI_TCP_IFACE": IFACE,
           "HYDRA_IFACE": IFACE, "HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": LAUNCHER}


def cluster_unavailable() -> str | None:
    """None when a NamespaceCluster can be made here, else the reason (for ``pytest.skip``)."""
    return _netns.unavailable()


class NamespaceCluster:
    """``hosts`` namespaced hosts joined by one switch; see the module docstring."""

    def __init__(self, hosts: int = 2, *, rate: str | None = None,
                 hostnames: list[str] | None = None):
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be 1..250, got {hosts}")
        if hostnames is not None and len(hostnames) != hosts:
            raise ValueError(f"{len(hostnames)} hostnames for {hosts} hosts")
        if rate is not None:
            tbf_burst(rate)
        self.n, self.rate = hosts, rate
        self.names = [f"h{i}" for i in range(hosts)]
        self.hostnames = list(hostnames) if hostnames else list(self.names)
        self._init = None            # unshare: the switch's netns, the cluster's pid namespace
        self.reaper = None           # its child, pid 1 of the cluster (pid here)
        self._hosts = []             # nsenter -p: each forks one host holder into the cluster
        self.pids = []               # holders' pids here (for nsenter from this namespace)
        self.inner_pids = []         # the same pids inside the cluster (for cluster_ssh)

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    # -- life --------------------------------------------------------------------------------
    def __enter__(self) -> NamespaceCluster:
        reason = cluster_unavailable()
        if reason:
            raise RuntimeError(reason)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        py = [sys.executable, "-I", "-S", "-c", _netns.REAPER]
        self._init = _netns.spawn(["unshare", "--net", "--pid", "--fork", "--kill-child", "--", *py])
        self.reaper = reaper = _netns.child_of(self._init, "the cluster's pid 1")
        for i in range(self.n):
            p = _netns.spawn(["nsenter", "-t", str(reaper), "-p", "--", "unshare", "--uts",
                              "--net", "--mount", "--ipc", "--mount-proc", "--", "sleep", "inf"])
            self._hosts.append(p)
            pid = _netns.child_of(p, f"host {i}'s holder")
            _netns.wait_exec(pid, "sleep")
            self.pids.append(pid)
            self.inner_pids.append(_netns.inner_pid(pid))
        veths = "".join(f"ip link add sw{i} type veth peer name {IFACE} netns {pid}\n"
                        f"ip link set sw{i} master br0 up\n" for i, pid in enumerate(self.pids))
        _netns.sh(reaper, f"ip link set lo up\nip link add br0 type bridge\n"
                          f"ip addr add {GATEWAY}/24 dev br0\nip link set br0 up\n{veths}",
                  "the switch", net_only=True)
        tmp = tempfile.mkdtemp(prefix="fastpar-cluster-")
        try:
            # No DNS server is reachable from a host: the resolver fails at once on 127.0.0.1
            # (an IPv6 lookup of h1 would otherwise wait out the machine's nameserver).
            resolv = os.path.join(tmp, "resolv.conf")
            with open(resolv, "w") as f:
                f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            os.chmod(resolv, 0o644)
            for i, pid in enumerate(self.pids):
                hosts_file = os.path.join(tmp, f"hosts.{i}")
                with open(hosts_file, "w") as f:
                    f.write(self._hosts_file(i))
                os.chmod(hosts_file, 0o644)
                _netns.sh(pid, self._host_script(i, hosts_file, resolv),
                          f"host {i} ({self.names[i]})")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _hosts_file(self, i: int) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        for j in range(self.n):
            names = [self.names[j]]
            unique = self.hostnames.count(self.hostnames[j]) == 1
            if self.hostnames[j] not in names and (unique or j == i):
                names.append(self.hostnames[j])
            lines.append(f"{self.address(j)} {' '.join(names)}")
        return "\n".join(lines) + "\n"

    def _host_script(self, i: int, hosts_file: str, resolv: str) -> str:
        shape = ""
        if self.rate:
            shape = (f"tc qdisc add dev {IFACE} root tbf rate {self.rate} "
                     f"burst {tbf_burst(self.rate)} latency 50ms\n")
        return (f"hostname {self.hostnames[i]}\nip link set lo up\n"
                f"ip addr add {self.address(i)}/24 dev {IFACE}\nip link set {IFACE} up\n"
                f"ip route add default via {GATEWAY}\n{shape}"
                f"mount -t tmpfs -o mode=1777 tmpfs /dev/shm\n"
                f"mount --bind {hosts_file} /etc/hosts\n"
                f"mount --bind {resolv} /etc/resolv.conf\n")

    def close(self) -> None:
        """Kill the cluster's pid 1, and so every process in every host; the holders then reap
        their children and exit (killed after 5 s). Idempotent."""
        grace = 0.0
        if self.reaper is not None and self._init is not None and self._init.poll() is None:
            _netns.kill_pid(self.reaper)
            grace = 5.0
        for p in [self._init, *self._hosts]:
            _netns.kill(p, grace=grace)
        self._init, self._hosts, self.reaper = None, [], None

    # -- commands ----------------------------------------------------------------------------
    def env(self, extra: dict | None = None) -> dict:
        """os.environ, the network settings (NET_ENV), FASTPAR_CLUSTER for cluster_ssh, extra
        (a variable given as None there is removed)."""
        table = {}
        for i, pid in enumerate(self.inner_pids):
            for name in (self.names[i], self.address(i), self.hostnames[i]):
                table.setdefault(name, pid)
        env = {**os.environ, **NET_ENV,
               "FASTPAR_CLUSTER": " ".join(f"{k}={v}" for k, v in table.items())}
        env.update(extra or {})
        return {k: v for k, v in env.items() if v is not None}

    def popen(self, i: int, argv: list[str], *, env: dict | None = None, cwd: str | None = None,
              new_session: bool = True, **kw) -> subprocess.Popen:
        """Start ``argv`` in host i (by default in a session of its own: killpg ends it all)."""
        if not self.pids:
            raise RuntimeError("cluster: not started (use `with NamespaceCluster(...) as c`)")
        return subprocess.Popen(_netns.enter(self.pids[i], list(argv), cwd=cwd),
                                env=self.env(env), preexec_fn=_netns.die_with_parent,
                                start_new_session=new_session, **kw)

    def run(self, i: int, argv: list[str], *, env: dict | None = None, timeout: float = 60.0,
            cwd: str | None = None, input: str | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` in host i; text output captured. On timeout its whole process group is
        killed and subprocess.TimeoutExpired raised."""
        p = self.popen(i, argv, env=env, cwd=cwd, text=True, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE,
                       stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL)
        return _finish(p, argv, timeout, input)

    def mpirun(self, argv: list[str], *, ppn: int = 1, hosts: list[str] | None = None,
               np: int | None = None, env: dict | None = None,
               timeout: float = 120.0) -> subprocess.CompletedProcess:
        """``mpirun -hosts h0,h1,.. -ppn P -np (P x hosts) argv`` started in host 0."""
        hosts = hosts or self.names
        mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
        if not os.path.exists(mpirun):
            mpirun = shutil.which("mpirun") or "mpirun"
        cmd = [mpirun, "-hosts", ",".join(hosts), "-ppn", str(ppn),
               "-np", str(np or ppn * len(hosts)), *argv]
        return self.run(0, cmd, env=env, timeout=timeout)

    def torchrun(self, argv: list[str], *, nproc_per_node: int = 1, port: int = 29400,
                 env: dict | None = None, timeout: float = 120.0) -> list:
        """One ``torch.distributed.run`` agent per host, rendezvous at h0's address; a
        CompletedProcess per host (all killed if one runs past ``timeout``)."""
        procs = []
        for i in range(self.n):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.n}",
                   f"--node-rank={i}", f"--nproc-per-node={nproc_per_node}",
                   f"--master-addr={self.address(0)}", f"--master-port={port}", *argv]
            procs.append(self.popen(i, cmd, env=env, text=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL))
        try:
            return [_finish(p, p.args, timeout, None) for p in procs]
        finally:
            for p in procs:
                _killpg(p)


def _killpg(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _finish(p, argv, timeout, input) -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(input, timeout=timeout)
    except BaseException:
        _killpg(p)
        p.communicate()
        raise
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="cluster.sh", description="Run a command in host h0 of a namespaced cluster on "
        "this machine (root), then tear it down. No command: a shell in h0.")
    ap.error = lambda msg: ap.exit(2, f"{ap.prog}: error: {msg} (see --help)\n")   # one line
    ap.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    ap.add_argument("--rate", help="shape every host's eth0 egress, e.g. 1gbit (default: off)")
    ap.add_argument("--host", type=int, default=0, help="host the command runs in (default 0)")
    ap.add_argument("--measure", action="store_true",
                    help="print the TCP rate from h0 to h1 (64 MiB, one stream) instead")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not 1 <= args.hosts <= 250:
        ap.error(f"--hosts must be 1..250, got {args.hosts}")
    if not 0 <= args.host < args.hosts:
        ap.error(f"--host {args.host} is not one of the {args.hosts} hosts")
    if args.rate:
        try:
            tbf_burst(args.rate)
        except ValueError as e:
            ap.error(str(e))
    if reason := cluster_unavailable():
        ap.exit(2, f"{ap.prog}: error: {reason}\n")
    # SIGTERM and SIGHUP unwind like Ctrl-C, so the with-block tears down.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    if args.measure and (cmd or args.hosts < 2):
        ap.error("--measure takes no command and needs --hosts >= 2")
    with NamespaceCluster(args.hosts, rate=args.rate) as c:
        if args.measure:
            bps = throughput(c, 0, 1)
            print(f"h0 -> h1: {bps / 1e9:.3f} Gbit/s (rate {args.rate or 'unshaped'})")
            return 0
        shell = cmd or [os.environ.get("SHELL", "/bin/sh")]
        p = c.popen(args.host, shell, new_session=False)   # keeps the terminal
        try:
            while True:
                try:
                    return p.wait()
                except KeyboardInterrupt:   # Ctrl-C reached the command too (same terminal)
                    if p.poll() is None and not cmd:
                        continue            # an interactive shell handles its own Ctrl-C
                    raise
        finally:
            _killpg(p)
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
