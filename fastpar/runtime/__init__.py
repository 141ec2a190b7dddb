"""Launch and bootstrap: launcher detection, rendezvous, device choice, process groups."""

from fastpar.runtime.bootstrap import init, is_initialized, job, shutdown, topology
from fastpar.runtime.groups import group_rank, group_size
from fastpar.runtime.job import Job
from fastpar.runtime.launcher import LaunchInfo, detect

__all__ = ["Job", "LaunchInfo", "detect", "group_rank", "group_size", "init", "is_initialized",
           "job", "shutdown", "topology"]
