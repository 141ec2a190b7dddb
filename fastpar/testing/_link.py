"""Link shaping and measuring for ``fastpar.testing.cluster``: tbf's bucket for a rate, and the
TCP rate between two hosts. Standard library only (no torch).

    python fastpar/testing/cluster.py --rate 1gbit --measure    # h0 -> h1, 64 MiB, one stream
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def tbf_burst(rate: str) -> int:
    """Bytes of tbf's bucket for ``rate``: 2 ms of traffic (timer slack at 1000 Hz), and at
    least two 64 KiB GSO packets (a veth passes them whole; a packet above the bucket drops)."""
    m = _RATE.match(rate)
    if not m:
        raise ValueError(f"rate {rate!r} is not a tc rate like 1gbit, 100mbit, 500kbit")
    bytes_per_s = float(m.group(1)) * _UNIT[m.group(2)] / 8
    return max(128 * 1024, int(bytes_per_s * 0.002))


# A TCP receiver and sender for throughput(): the receiver prints bytes and seconds from the
# first byte to EOF.
_RECV = """
import socket, sys, time
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
c, _ = s.accept()
n, t0 = len(c.recv(1 << 20)), time.perf_counter()
while b := c.recv(1 << 20):
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
_SEND = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
buf, left = bytes(1 << 20), int(sys.argv[3])
while left > 0:
    left -= c.send(buf[:left])
c.close()
"""


def throughput(c, src: int, dst: int, nbytes: int = 64 << 20,
               port: int = 5201) -> float:
    """Bits per second of one TCP stream from host ``src`` to host ``dst`` of ``c`` (a
    ``NamespaceCluster``)."""
    py = [sys.executable, "-I", "-S", "-c"]
    recv = c.popen(dst, [*py, _RECV, str(port)], text=True, stdout=subprocess.PIPE)
    try:
        if recv.stdout.readline().strip() != "ready":
            raise RuntimeError(f"cluster: the receiver in {c.names[dst]} did not start")
        sent = c.run(src, [*py, _SEND, c.address(dst), str(port), str(nbytes)], timeout=120)
        if sent.returncode != 0:
            raise RuntimeError(f"cluster: the sender failed: {sent.stderr.strip()}")
        n, seconds = recv.stdout.readline().split()
    finally:
        _killpg(recv)
        recv.wait()
    return int(n) * 8 / float(seconds)


def _killpg(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
