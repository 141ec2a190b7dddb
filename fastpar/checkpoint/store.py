"""The checkpoint directory protocol shared by the serial and the sharded formats.

    runs/a/latest                 "step_00000100\\n": always names a complete checkpoint
    runs/a/step_00000100/         complete: it holds its record (meta.json or index.json)
    runs/a/.tmp-step_...          being written, or left by an interrupted save

A step directory is written under a ``.tmp-`` name, its files and the directory fsynced, then
renamed into place (``publish``), then ``latest`` is replaced (a tmp file, fsync, rename) and
the oldest step directories beyond ``keep`` are removed. An exception, Ctrl-C or a crash at any
point leaves the previous checkpoint and ``latest`` intact; ``clean`` removes the leftovers of
interrupted saves before the next one.
"""

from __future__ import annotations

import os
import re
import shutil

RECORDS = ("meta.json", "index.json")  # serial format, sharded format
STEP_DIR = re.compile(r"step_(\d{8,})")


def step_name(step: int) -> str:
    return f"step_{int(step):08d}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, data: bytes) -> None:
    """Write bytes to a new file and fsync it."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def remove(path: str) -> None:
    """Delete a file or tree; a directory is first renamed to a .tmp- name (atomic), so an
    interrupted delete never leaves a half-deleted step directory under its real name."""
    if os.path.isdir(path) and not os.path.basename(path).startswith(".tmp-"):
        parent, name = os.path.split(path)
        hidden = os.path.join(parent, f".tmp-del-{name}-{os.getpid()}")
        os.rename(path, hidden)
        path = hidden
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def record_of(path: str) -> str | None:
    """The record file of a complete step directory, else None."""
    return next((r for r in RECORDS if os.path.isfile(os.path.join(path, r))), None)


def step_dirs(root: str) -> dict[int, str]:
    """{step: path} of the complete step directories under root."""
    found = {}
    for name in os.listdir(root):
        m = STEP_DIR.fullmatch(name)
        if m and record_of(os.path.join(root, name)):
            found[int(m.group(1))] = os.path.join(root, name)
    return found


def clean(root: str) -> None:
    """Remove what interrupted saves left under root."""
    for name in os.listdir(root):
        if name.startswith(".tmp-") or name.startswith(".latest.tmp-"):
            remove(os.path.join(root, name))


def check_new(root: str, step: int) -> str:
    """The final path of step's directory; ValueError if it exists (never overwritten)."""
    final = os.path.join(root, step_name(step))
    if os.path.lexists(final):
        raise ValueError(f"checkpoint {final} already exists; save step {step} to another "
                         f"directory or delete it first")
    return final


def publish(root: str, tmp: str, step: int, keep: int | None) -> str:
    """Rename the written ``tmp`` directory into place, point ``latest`` at it, prune."""
    final = check_new(root, step)
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(root)
    latest_tmp = os.path.join(root, f".latest.tmp-{os.getpid()}")
    write_file(latest_tmp, f"{step_name(step)}\n".encode())
    os.replace(latest_tmp, os.path.join(root, "latest"))
    fsync_dir(root)
    if keep is not None:
        old = sorted(s for s in step_dirs(root) if s != step)
        for s in old[:max(0, len(old) - (int(keep) - 1))]:
            remove(os.path.join(root, step_name(s)))
    return final


def resolve(path) -> str:
    """A step directory, or a parent directory's ``latest`` (else its highest step)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} does not exist or is not a directory")
    if record_of(path):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        if not STEP_DIR.fullmatch(name):
            raise ValueError(f"checkpoint {latest} names {name!r}, not a step directory")
        return os.path.join(path, name)
    steps = step_dirs(path)
    if not steps:
        raise ValueError(f"no checkpoint in {path!r}: no latest file, no step_* directory with "
                         f"a {' or '.join(RECORDS)}")
    return steps[max(steps)]
