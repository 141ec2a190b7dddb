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
