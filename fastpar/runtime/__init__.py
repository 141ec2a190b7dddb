"""Launch and bootstrap: launcher detection, rendezvous, device choice, process groups."""

from fastpar.runtime.bootstrap import init, is_initialized, on_shutdown, shutdown, topology
from fastpar.runtime.launcher import LaunchInfo, detect

__all__ = ["LaunchInfo", "detect", "init", "is_initialized", "on_shutdown", "shutdown", "topology"]
