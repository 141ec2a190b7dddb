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

import json
import os
import re
import shutil
import warnings

RECORDS = ("meta.json", "index.json")  # serial format, sharded format
KEEP = 3  # step directories a save keeps by default (the newest)
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
    if keep is not None:  # the checkpoint is in place: a failure here only leaves more of them
        old = sorted(s for s in step_dirs(root) if s != step)
        for s in old[:max(0, len(old) - (int(keep) - 1))]:
            try:
                remove(os.path.join(root, step_name(s)))
            except OSError as exc:
                warnings.warn(f"could not remove the old checkpoint {step_name(s)}: {exc}",
                              stacklevel=2)
    return final


def step_dir_of(path) -> str:
    """The step directory ``path`` names: itself, or a parent directory's highest complete
    step. Every ``step_*`` directory with its record is complete by construction (renamed into
    place whole), so the highest one is the newest checkpoint even when a crash came between the
    rename and the replacement of ``latest`` (which then names the one before: it is for people
    and tools)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} does not exist or is not a directory")
    if record_of(path):
        return path
    steps = step_dirs(path)
    if not steps:
        latest = os.path.join(path, "latest")
        named = open(latest).read().strip() if os.path.isfile(latest) else None
        raise ValueError(f"no checkpoint in {path!r}: no step_* directory with a "
                         f"{' or '.join(RECORDS)}"
                         + (f" (latest names {named!r})" if named is not None else ""))
    return steps[max(steps)]


def read_record(path, record: str, fmt: str, other: str) -> tuple[str, dict]:
    """``(step directory, its record parsed)``: ``step_dir_of(path)``, the directory's record
    ``record`` ("meta.json" or "index.json") read as JSON and its ``format`` checked; ValueError
    naming ``other`` (how to load the other format) when the directory holds the other one."""
    directory = step_dir_of(path)
    if record_of(directory) != record:
        raise ValueError(f"checkpoint {directory} has no {record}: {other}")
    try:
        with open(os.path.join(directory, record), "rb") as f:
            parsed = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint {directory} is incomplete or corrupt: {record}: "
                         f"{exc}") from exc
    if not isinstance(parsed, dict) or parsed.get("format") != fmt:
        raise ValueError(f"{directory}/{record} is not a {fmt} record")
    return directory, parsed
