"""One rank's file of a sharded checkpoint: safetensors, written as a stream and hashed on the way.

    record = write(path, items)        # items: [(key, data (n,) contiguous, sizes)]
    bad = verify(path, key_offsets)    # re-hash pieces: [(key, sha256)] -> problems found
    with Reader(dir) as r: r.read(file, key, slices)      # only the slice's bytes

The file is a plain safetensors file (``safetensors.safe_open`` opens it; every piece is a
tensor of its box's shape under a key naming the serial tensor and the box's offsets). It is
written directly, not through ``safetensors.torch.save_file``, so that nothing is serialised
into memory first: the header is computed from the pieces' shapes, then each piece's bytes go
to the file from where they lie (the live tensors, or an async save's staging copy), hashed
(sha256) as they go, and the file is fsynced. Reads use ``safe_open(...).get_slice``, which
copies only the requested slice out of the memory-mapped file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import torch

from fastpar.checkpoint.boxes import numel
from fastpar.comm.views import numpy_view

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
NAMES = {v: k for k, v in DTYPES.items()}
BLOCK = 64 << 20  # bytes hashed and written per call (bounds a device piece's host copy)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise ValueError(f"unknown checkpoint dtype {name!r}")
    return dtype


def tensor_bytes(t: torch.Tensor, start: int, stop: int) -> memoryview:
    """Bytes ``[start, stop)`` of a contiguous 1-D tensor, on the host."""
    raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    part = raw[start:stop]
    if part.device.type != "cpu":  # a copy of its own: the view keeps it alive
        return memoryview(part.cpu().numpy()).cast("B")
    # not .numpy(), which would pin a ZeRO-3 gather buffer's storage (see numpy_view); the
    # caller's tensor outlives the view
    return memoryview(numpy_view(part)).cast("B")


def write(path: str, items: list[tuple], metadata: dict | None = None) -> dict:
    """Write a safetensors file of ``items`` and fsync it; returns ``{"bytes": size,
    "sha256": {key: digest}}``. The file must not exist. An item is ``(key, data (n,), sizes)``
    or ``(key, dtype, sizes, make)`` with ``make()`` returning the data when its turn comes (an
    export holds one serial tensor at a time)."""
    header, offset = {}, 0
    for item in items:
        key, sizes = item[0], item[2]
        dtype = item[1] if isinstance(item[1], torch.dtype) else item[1].dtype
        n = numel(sizes) * dtype.itemsize
        header[key] = {"dtype": DTYPES[dtype], "shape": list(sizes),
                       "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digests = {}
    with open(path, "xb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for item in items:
            key, sizes = item[0], item[2]
            data = item[3]() if len(item) > 3 else item[1]
            assert data.dim() == 1 and data.is_contiguous() and data.numel() == numel(sizes) \
                and DTYPES[data.dtype] == header[key]["dtype"], key
            h = hashlib.sha256()
            n = data.numel() * data.element_size()
            for start in range(0, n, BLOCK):
                chunk = tensor_bytes(data, start, min(n, start + BLOCK))
                h.update(chunk)  # hashlib and write release the GIL on large buffers
                f.write(chunk)
            digests[key] = h.hexdigest()
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": 8 + len(head) + offset, "sha256": digests}


def header(path: str) -> tuple[int, dict]:
    """``(data start, header dict)`` of a safetensors file; ValueError if it is not one."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path}: the header claims {n} bytes, the file has {size}")
        try:
            head = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"{path}: the safetensors header is not JSON: {exc}") from exc
    return 8 + n, head


def verify(path: str, pieces: list[tuple[str, str, str, list]]) -> list[str]:
    """Check ``pieces`` ``[(key, sha256, dtype name, sizes)]`` of one file against its header
    (the dtype, shape and byte span the index says) and re-hash their bytes; returns what is
    wrong (empty: all match). Reads each piece's bytes once, in blocks."""
    name = os.path.basename(path)
    try:
        start, head = header(path)
    except (OSError, ValueError) as exc:
        return [str(exc)]
    problems = []
    with open(path, "rb") as f:
        for key, want, dtype, sizes in pieces:
            entry = head.get(key)
            if entry is None:
                problems.append(f"{name} has no piece {key}")
                continue
            a, b = entry.get("data_offsets", (0, -1))
            expect = numel(sizes) * dtype_of(dtype).itemsize
            if entry.get("dtype") != DTYPES[dtype_of(dtype)] or \
                    list(entry.get("shape", ())) != list(sizes) or b - a != expect:
                problems.append(f"{name}: piece {key} is {entry.get('dtype')} "
                                f"{entry.get('shape')} ({b - a} bytes) in the file, the index "
                                f"says {dtype} {list(sizes)}")
                continue
            f.seek(start + a)
            h, left = hashlib.sha256(), b - a
            while left > 0:
                chunk = f.read(min(BLOCK, left))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
            if left:
                problems.append(f"{name}: piece {key} is cut short ({left} bytes missing)")
            elif h.hexdigest() != want:
                problems.append(f"{name}: piece {key} has sha256 {h.hexdigest()[:16]}..., the "
                                f"index says {want[:16]}...")
    return problems


class Reader:
    """Open files of one checkpoint directory once each; read slices of pieces."""

    def __init__(self, directory: str):
        self.directory, self.open = directory, {}

    def read(self, fname: str, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        from safetensors import safe_open

        handle = self.open.get(fname)
        if handle is None:
            handle = self.open[fname] = safe_open(os.path.join(self.directory, fname),
                                                  framework="pt")
        if not index:  # a 0-dim tensor
            return handle.get_tensor(key)
        return handle.get_slice(key)[index]

    def close(self) -> None:
        self.open.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
