"""The native extension is built, loads, and its ops run."""

import subprocess
import sys

import pytest

import torch

from fastpar import _native


@pytest.mark.quick
def test_extension_built_and_reports():
    st = _native.status()
    assert st["built"], st["error"]
    assert st["info"]["version"] == __import__("fastpar").__version__
    assert st["info"]["cuda"] in ("0", "1")
    assert st["cuda"] == (st["info"]["cuda"] == "1")


def test_watchdog_fires_and_disarms():
    _native.require("the watchdog test")  # loads the ops (this test may run alone)
    # Disarmed in time: nothing happens.
    dog = torch.ops.fastpar.watchdog_arm(30.0, "should not fire", 9)
    assert torch.ops.fastpar.watchdog_disarm(dog)
    assert not torch.ops.fastpar.watchdog_disarm(dog)
    # Not disarmed: the process prints the message and exits with the code, even while the
    # main thread is blocked inside a call that holds the GIL.
    code = ("import time, torch, fastpar._C; "
            "torch.ops.fastpar.watchdog_arm(0.2, 'watchdog says bye', 7); time.sleep(30)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7
    assert "watchdog says bye" in proc.stderr


@pytest.mark.quick
def test_watchdog_removes_the_names_of_what_it_maps_under_a_prefix(tmp_path):
    """Firing, the watchdog first removes the name of each file the process maps under
    unlink_prefix (how MPI_Init's shared memory goes when a job never came together), and
    leaves the others."""
    _native.require("the watchdog test")
    doomed, kept = tmp_path / "mpich_x_0", tmp_path / "other"
    code = ("import mmap, time, torch, fastpar._C\n"
            "maps = []\n"
            f"for path in ({str(doomed)!r}, {str(kept)!r}):\n"
            "    with open(path, 'wb+') as f:\n"
            "        f.truncate(4096)\n"
            "        maps.append(mmap.mmap(f.fileno(), 4096))\n"
            f"torch.ops.fastpar.watchdog_arm(0.2, 'bye', 7, {str(tmp_path / 'mpich_')!r})\n"
            "time.sleep(30)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr
    assert not doomed.exists() and kept.exists()
