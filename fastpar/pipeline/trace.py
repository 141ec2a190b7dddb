"""Measured pipeline timelines: the bubble, a Chrome trace and a PNG, from per-rank records.

The executor records, on every rank, one ``(start_s, end_s, kind, mb, chunk)`` per action it
runs (``time.perf_counter()`` seconds, aligned across ranks by the caller); rank 0 gathers
``records_per_rank[rank]`` and calls ``write``::

    write("runs/step3.json", records_per_rank, meta={"schedule": "1f1b", "pp": 4, ...})
    # -> runs/step3.json (open in https://ui.perfetto.dev or chrome://tracing), runs/step3.png

Kinds: compute ``F`` forward, ``B`` full backward, ``I`` input-gradient backward, ``W``
weight-gradient; p2p ``SF``/``SB`` send activation/gradient, ``RF``/``RB`` receive them (a
receive's span is the time spent waiting plus copying). ``chunk`` is the rank's local virtual
stage index. Only compute is busy time:

    makespan = max(end) - min(start)                       over all ranks
    bubble   = 1 - sum_r sum_{compute} (end - start) / (n_ranks * makespan)

The PNG is written here with zlib + struct (no plotting library): ranks as rows, time as
columns, one filled rectangle per action colored by kind (``COLORS``), a legend at the bottom
and a 3x5 bitmap font for the title and rank labels.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

from fastpar.pipeline.actions import COMPUTE

P2P = ("SF", "SB", "RF", "RB")

WHITE = (255, 255, 255)
COLORS = {  # kind -> RGB in the PNG; idle is WHITE
    "F": (66, 133, 244),  # blue
    "B": (52, 168, 83),  # green
    "I": (251, 188, 5),  # amber
    "W": (171, 71, 188),  # purple
    **{kind: (200, 200, 200) for kind in P2P},  # light grey: sending or waiting
}


def _checked(records_per_rank) -> list[list[tuple[float, float, str, int, int]]]:
    """The records as tuples, after checking each kind and that no span ends before it starts."""
    out = []
    for rank, records in enumerate(records_per_rank):
        row = []
        for i, rec in enumerate(records):
            start, end, kind, mb, chunk = rec
            if kind not in COLORS:
                raise ValueError(f"rank {rank} record {i}: unknown kind {kind!r}; expected one "
                                 f"of {', '.join(COLORS)}")
            if end < start:
                raise ValueError(f"rank {rank} record {i} ({kind}{mb}): ends at {end} before it "
                                 f"starts at {start}")
            row.append((float(start), float(end), kind, int(mb), int(chunk)))
        out.append(row)
    return out


def _window(records_per_rank) -> tuple[float, float]:
    """``(t0, makespan)``: the earliest start and latest end - earliest start, over all ranks."""
    starts = [r[0] for row in records_per_rank for r in row]
    if not starts:
        return 0.0, 0.0
    return min(starts), max(r[1] for row in records_per_rank for r in row) - min(starts)


def measured_bubble(records_per_rank) -> float:
    """Idle fraction ``1 - busy / (n_ranks * makespan)``, busy = time in F/B/I/W summed over
    ranks (sends and receive waits count as idle). 0.0 with no records or a zero makespan."""
    recs = _checked(records_per_rank)
    _, makespan = _window(recs)
    if makespan <= 0:
        return 0.0
    busy = sum(end - start for row in recs for start, end, kind, _, _ in row if kind in COMPUTE)
    return 1.0 - busy / (len(recs) * makespan)


def action_name(kind: str, mb: int, chunk: int) -> str:
    """``F3``, ``RB3``; chunk shown when nonzero: ``F3.c1``."""
    return f"{kind}{mb}" + (f".c{chunk}" if chunk else "")


def chrome_trace(records_per_rank, *, meta: dict) -> dict:
    """A Chrome Trace Event Format object: process 0 "fastpar pipeline", thread ``r`` =
    "rank r", one complete ("X") event per record with ts/dur in microseconds from the earliest
    start. ``otherData`` holds ``meta`` plus ``measured_bubble`` (unless meta already has it)."""
    recs = _checked(records_per_rank)
    t0, _ = _window(recs)
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                           "args": {"name": "fastpar pipeline"}}]
    for rank in range(len(recs)):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"sort_index": rank}})
    for rank, row in enumerate(recs):
        for start, end, kind, mb, chunk in row:
            events.append({"name": action_name(kind, mb, chunk),
                           "cat": "compute" if kind in COMPUTE else "p2p", "ph": "X",
                           "pid": 0, "tid": rank, "ts": round((start - t0) * 1e6, 3),
                           "dur": round((end - start) * 1e6, 3),
                           "args": {"mb": mb, "chunk": chunk}})
    other = {"measured_bubble": measured_bubble(recs), **meta}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


# --- PNG ------------------------------------------------------------------------------------
# 3x5 glyphs: five rows top to bottom, one octal digit each (bit 4 = left column).
_FONT = {
    "0": "75557", "1": "26227", "2": "71747", "3": "71717", "4": "55711", "5": "74717",
    "6": "74757", "7": "71111", "8": "75757", "9": "75717", "A": "25755", "B": "65656",
    "C": "34443", "D": "65556", "E": "74647", "F": "74644", "G": "34553", "H": "55755",
    "I": "72227", "J": "11152", "K": "55655", "L": "44447", "M": "57755", "N": "65555",
    "O": "25552", "P": "65644", "Q": "25563", "R": "65655", "S": "34216", "T": "72222",
    "U": "55557", "V": "55552", "W": "55775", "X": "55255", "Y": "55222", "Z": "71247",
    " ": "00000", ".": "00002", ",": "00024", ":": "02020", "-": "00700", "+": "02720",
    "=": "07070", "%": "51245", "(": "12221", ")": "42224", "/": "11244", "_": "00007",
    "?": "71302",
}
_SCALE = 2  # font pixels per glyph pixel: glyphs are 6x10, advancing 8 px
WIDTH, ROW, LEFT, RIGHT, TOP, BOTTOM = 1200, 40, 64, 16, 28, 36  # px
BAR = 30  # px of a row's 40 that hold its actions; the rest is a gap
_BLACK, _FRAME = (0, 0, 0), (215, 215, 215)


class _Canvas:
    """An RGB image as a bytearray, with the three drawing operations the timeline needs."""

    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.px = bytearray(bytes(WHITE) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, rgb: tuple) -> None:
        """Fill columns [x0, x1) of rows [y0, y1), clipped to the image."""
        x0, x1 = max(x0, 0), min(x1, self.width)
        if x1 <= x0:
            return
        line = bytes(rgb) * (x1 - x0)
        for y in range(max(y0, 0), min(y1, self.height)):
            at = (y * self.width + x0) * 3
            self.px[at:at + len(line)] = line

    def text(self, x: int, y: int, s: str, rgb: tuple = _BLACK) -> int:
        """Draw ``s`` (upper-cased) with its top-left at (x, y); returns the x after it."""
        for ch in s.upper():
            for row, digit in enumerate(_FONT.get(ch, _FONT["?"])):
                for col in range(3):
                    if int(digit, 8) & (4 >> col):
                        self.rect(x + col * _SCALE, y + row * _SCALE, x + (col + 1) * _SCALE,
                                  y + (row + 1) * _SCALE, rgb)
            x += 4 * _SCALE
        return x

    def png(self) -> bytes:
        """PNG bytes: IHDR (8-bit RGB), one zlib IDAT of rows each led by filter byte 0, IEND."""
        def chunk(tag: bytes, data: bytes) -> bytes:
            crc = zlib.crc32(tag + data) & 0xFFFFFFFF
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)

        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.px[y * stride:(y + 1) * stride])
                       for y in range(self.height))
        ihdr = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 6))
                + chunk(b"IEND", b""))


def x_of(t: float, t0: float, makespan: float) -> int:
    """The pixel column of time ``t`` (plot spans columns [LEFT, WIDTH - RIGHT))."""
    return LEFT + round((t - t0) / (makespan or 1.0) * (WIDTH - LEFT - RIGHT))


def row_top(rank: int) -> int:
    """The first pixel row of ``rank``'s bar."""
    return TOP + rank * ROW + (ROW - BAR) // 2


def write_png(path, records_per_rank, *, title: str = "") -> None:
    """Draw ranks (rows) x time (columns) to ``path``: each action a rectangle of its kind's
    color with a 1-px white separator at its right edge (when it is at least 2 px wide), p2p
    drawn under compute, idle white; "<title>  bubble x%" on top, a legend and the makespan
    at the bottom."""
    recs = _checked(records_per_rank)
    t0, makespan = _window(recs)
    canvas = _Canvas(WIDTH, TOP + ROW * max(len(recs), 1) + BOTTOM)
    bubble = f"bubble {measured_bubble(recs):.1%}"
    canvas.text(LEFT, 8, f"{title}  {bubble}" if title else bubble)
    for rank, row in enumerate(recs):
        y0 = row_top(rank)
        canvas.text(4, y0 + (BAR - 5 * _SCALE) // 2, f"rank {rank}")
        canvas.rect(LEFT, y0 - 1, WIDTH - RIGHT, y0, _FRAME)  # track edges, outside the bar
        canvas.rect(LEFT, y0 + BAR, WIDTH - RIGHT, y0 + BAR + 1, _FRAME)
        for start, end, kind, _, _ in sorted(row, key=lambda r: (r[2] in COMPUTE, r[0])):
            x0, x1 = x_of(start, t0, makespan), x_of(end, t0, makespan)
            x1 = x1 - 1 if x1 - x0 >= 2 else x0 + 1  # leave the separator column
            canvas.rect(x0, y0, x1, y0 + BAR, COLORS[kind])
    y = TOP + ROW * max(len(recs), 1) + 10
    x = LEFT
    for label, rgb in (("F", COLORS["F"]), ("B", COLORS["B"]), ("I", COLORS["I"]),
                       ("W", COLORS["W"]), ("p2p", COLORS["SF"]), ("idle", WHITE)):
        canvas.rect(x, y, x + 14, y + 14, _BLACK)
        canvas.rect(x + 1, y + 1, x + 13, y + 13, rgb)
        x = canvas.text(x + 20, y + 2, label) + 16
    scale, unit = (1, "s") if makespan >= 1 else (1e3, "ms") if makespan >= 1e-3 else (1e6, "us")
    span = f"0 - {makespan * scale:.4g} {unit}"
    canvas.text(WIDTH - RIGHT - 8 * len(span), y + 2, span)
    Path(path).write_bytes(canvas.png())


def _title(meta: dict) -> str:
    """The PNG title, e.g. ``1f1b pp=4 m=8 v=2 theory 27.3%``, from the keys ``meta`` has."""
    parts = [str(meta["schedule"])] if "schedule" in meta else []
    for key, short in (("pp", "pp"), ("microbatches", "m"), ("virtual_stages", "v")):
        if key in meta:
            parts.append(f"{short}={meta[key]}")
    if isinstance(meta.get("theoretical_bubble"), (int, float)):
        parts.append(f"theory {meta['theoretical_bubble']:.1%}")
    return " ".join(parts)


def write(path, records_per_rank, *, meta: dict) -> dict:
    """Write the Chrome trace to ``path`` and the PNG beside it (``x.json`` -> ``x.png``, any
    other name gets ``.png`` appended), creating parent directories.
    Returns ``{"json": str, "png": str, "bubble": measured bubble}``."""
    recs = _checked(records_per_rank)
    json_path = Path(path)
    png_path = json_path.with_suffix(".png") if json_path.suffix == ".json" else \
        Path(os.fspath(path) + ".png")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    trace = chrome_trace(recs, meta=meta)
    # Each file appears whole or not at all: written beside, then renamed over the old one
    # (a viewer reloading the trace while a step writes never reads half a file).
    tmp = json_path.with_name(f".{json_path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(trace))
    os.replace(tmp, json_path)
    tmp_png = png_path.with_name(f".{png_path.name}.{os.getpid()}.tmp")
    write_png(tmp_png, recs, title=_title(meta))
    os.replace(tmp_png, png_path)
    return {"json": str(json_path), "png": str(png_path), "bubble": measured_bubble(recs)}

