"""Pipeline traces from hand-built records: the exact bubble, a Chrome trace that round-trips
through JSON, and a PNG parsed back here with zlib (pixel colors at known spans)."""

import json
import struct
import zlib

import pytest

from fastpar.pipeline import compile_schedule
from fastpar.pipeline import trace
from fastpar.pipeline.timeline import render, simulate

pytestmark = pytest.mark.quick  # every test here: the quick tier

T0 = 100.0  # perf_counter is never 0: everything is drawn relative to the earliest start
# Two ranks, times in quarters of a second (exact in binary), makespan 5 s.
# busy: rank 0 F 1 + B 2 = 3 s, rank 1 F 1 + B 2 = 3 s -> bubble = 1 - 6 / (2 * 5) = 0.4
RECORDS = [
    [(T0 + 0.0, T0 + 1.0, "F", 0, 0), (T0 + 1.0, T0 + 1.25, "SF", 0, 0),
     (T0 + 3.0, T0 + 5.0, "B", 0, 0)],
    [(T0 + 0.0, T0 + 1.25, "RF", 0, 0), (T0 + 1.25, T0 + 2.25, "F", 0, 0),
     (T0 + 2.25, T0 + 4.25, "B", 0, 0), (T0 + 4.25, T0 + 4.5, "SB", 0, 0)],
]


def test_bubble_is_exact_and_counts_p2p_as_idle():
    assert trace.measured_bubble(RECORDS) == pytest.approx(0.4, rel=1e-12)
    compute_only = [[r for r in row if r[2] in trace.COMPUTE] for row in RECORDS]
    assert trace.measured_bubble(compute_only) == pytest.approx(0.4, rel=1e-12)
    # the receive on rank 1 as compute instead: 1.25 s more busy -> 1 - 7.25 / 10
    as_compute = [RECORDS[0], [(s, e, "I" if k == "RF" else k, mb, c)
                               for s, e, k, mb, c in RECORDS[1]]]
    assert trace.measured_bubble(as_compute) == pytest.approx(0.275, rel=1e-12)
    assert trace.measured_bubble([]) == 0.0
    assert trace.measured_bubble([[], []]) == 0.0


def test_bubble_counts_an_empty_rank_as_idle():
    one = [[(0.0, 2.0, "F", 0, 0), (2.0, 4.0, "W", 0, 0)]]
    assert trace.measured_bubble(one) == 0.0
    assert trace.measured_bubble(one + [[]]) == pytest.approx(0.5, rel=1e-12)


def test_bad_records_are_rejected_naming_rank_and_record():
    with pytest.raises(ValueError, match="rank 1 record 0.*'X'"):
        trace.measured_bubble([[], [(0.0, 1.0, "X", 0, 0)]])
    with pytest.raises(ValueError, match="rank 0 record 1 \\(B2\\).*before"):
        trace.chrome_trace([[(0.0, 1.0, "F", 2, 0), (3.0, 2.0, "B", 2, 0)]], meta={})


def test_chrome_trace_round_trips_and_is_in_microseconds():
    records = [RECORDS[0], RECORDS[1] + [(T0 + 4.5, T0 + 4.75, "I", 3, 1),
                                         (T0 + 4.75, T0 + 5.0, "W", 3, 1)]]
    meta = {"schedule": "1f1b", "pp": 2, "microbatches": 1, "virtual_stages": 1,
            "theoretical_bubble": 0.5}
    obj = json.loads(json.dumps(trace.chrome_trace(records, meta=meta)))
    events = obj["traceEvents"]
    names = {(e["tid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == [
        "fastpar pipeline"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == sum(map(len, records))
    assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] == 0 for e in spans)
    by_name = {(e["tid"], e["name"]): e for e in spans}
    assert set(by_name) == {(0, "F0"), (0, "SF0"), (0, "B0"), (1, "RF0"), (1, "F0"), (1, "B0"),
                            (1, "SB0"), (1, "I3.c1"), (1, "W3.c1")}
    f = by_name[(1, "F0")]
    assert (f["ts"], f["dur"], f["cat"], f["args"]) == (1.25e6, 1e6, "compute",
                                                        {"mb": 0, "chunk": 0})
    assert by_name[(1, "RF0")]["cat"] == by_name[(0, "SF0")]["cat"] == "p2p"
    assert by_name[(1, "W3.c1")]["args"] == {"mb": 3, "chunk": 1}
    other = obj["otherData"]
    assert {k: other[k] for k in meta} == meta
    assert other["measured_bubble"] == pytest.approx(trace.measured_bubble(records))


def read_png(path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes), checking every chunk's CRC and each row's filter."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks = 8, []
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        tag, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF, tag
        chunks.append((tag, body))
        at += 12 + length
    assert [t for t, _ in chunks][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color, comp, filt, interlace) == (8, 2, 0, 0, 0)  # 8-bit RGB
    raw = zlib.decompress(b"".join(body for tag, body in chunks if tag == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == stride * height
    rows = [raw[y * stride:(y + 1) * stride] for y in range(height)]
    assert all(row[0] == 0 for row in rows)
    return width, height, [row[1:] for row in rows]


def pixel(rows, x: int, y: int) -> tuple:
    return tuple(rows[y][3 * x:3 * x + 3])


def at_time(rows, rank: int, t: float, t0: float = T0, makespan: float = 5.0) -> tuple:
    """The color in the middle of ``rank``'s bar at time ``t``."""
    return pixel(rows, trace.x_of(t, t0, makespan), trace.row_top(rank) + trace.BAR // 2)


def test_png_parses_back_with_kind_colors(tmp_path):
    records = [RECORDS[0], RECORDS[1] + [(T0 + 4.5, T0 + 4.75, "I", 3, 1),
                                         (T0 + 4.75, T0 + 5.0, "W", 3, 1)]]
    path = tmp_path / "t.png"
    trace.write_png(path, records, title="1f1b pp=2")
    width, height, rows = read_png(path)
    assert width == trace.WIDTH == 1200
    assert height == trace.TOP + 2 * trace.ROW + trace.BOTTOM
    c = trace.COLORS
    assert at_time(rows, 0, T0 + 0.5) == c["F"]
    assert at_time(rows, 0, T0 + 1.125) == c["SF"]
    assert at_time(rows, 0, T0 + 2.1) == trace.WHITE  # rank 0 idles from 1.25 to 3
    assert at_time(rows, 0, T0 + 4.0) == c["B"]
    assert at_time(rows, 1, T0 + 0.6) == c["RF"]
    assert at_time(rows, 1, T0 + 1.75) == c["F"]
    assert at_time(rows, 1, T0 + 3.25) == c["B"]
    assert at_time(rows, 1, T0 + 4.375) == c["SB"]
    assert at_time(rows, 1, T0 + 4.625) == c["I"]
    assert at_time(rows, 1, T0 + 4.875) == c["W"]
    # the 1-px separator: the last column of rank 1's F (before its B) is white
    mid = trace.row_top(1) + trace.BAR // 2
    x_end = trace.x_of(T0 + 2.25, T0, 5.0)
    assert pixel(rows, x_end - 1, mid) == trace.WHITE and pixel(rows, x_end, mid) == c["B"]
    assert len({c["F"], c["B"], c["I"], c["W"], c["SF"], trace.WHITE}) == 6
    # text: the rank label left of the plot and the title above it are drawn in black
    label = [pixel(rows, x, y) for x in range(trace.LEFT) for y in range(trace.row_top(0),
                                                                          trace.row_top(0) + 30)]
    assert (0, 0, 0) in label
    assert (0, 0, 0) in {pixel(rows, x, y) for x in range(width) for y in range(trace.TOP)}
    # the legend shows every color below the rows
    legend = {pixel(rows, x, y) for x in range(width) for y in range(height - trace.BOTTOM,
                                                                     height)}
    assert {c["F"], c["B"], c["I"], c["W"], c["SF"]} <= legend
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as img:
        assert img.size == (width, height) and img.mode == "RGB"
        assert img.getpixel((trace.x_of(T0 + 0.5, T0, 5.0), trace.row_top(0) + 15)) == c["F"]


def test_write_puts_json_and_png_side_by_side(tmp_path):
    meta = {"schedule": "gpipe", "pp": 2, "microbatches": 1, "virtual_stages": 1,
            "theoretical_bubble": 0.5}
    out = trace.write(tmp_path / "runs" / "step.json", RECORDS, meta=meta)
    assert out == {"json": str(tmp_path / "runs" / "step.json"),
                   "png": str(tmp_path / "runs" / "step.png"), "bubble": out["bubble"]}
    assert out["bubble"] == pytest.approx(0.4, rel=1e-12)
    obj = json.loads((tmp_path / "runs" / "step.json").read_text())
    assert obj["otherData"]["schedule"] == "gpipe"
    assert obj["otherData"]["measured_bubble"] == pytest.approx(out["bubble"])
    assert read_png(tmp_path / "runs" / "step.png")[:2] == (1200, trace.TOP + 2 * trace.ROW
                                                            + trace.BOTTOM)
    other = trace.write(str(tmp_path / "step.trace"), RECORDS, meta={})
    assert other["png"] == str(tmp_path / "step.trace.png")
    assert (tmp_path / "step.trace").exists() and (tmp_path / "step.trace.png").exists()


def records_from_simulation(spans) -> list[list[tuple[float, float, str, int, int]]]:
    """``timeline.simulate``'s ``[[(start_unit, end_unit, action)]]`` as trace records, one unit
    being one second."""
    return [[(float(s), float(e), a.kind, a.mb, a.chunk) for s, e, a in row] for row in spans]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulated_schedule_matches_the_text_timeline(tmp_path, name):
    lists = compile_schedule(name, 4, 6)
    records = records_from_simulation(simulate(lists))
    assert [len(row) for row in records] == [12] * 4  # F and B of 6 microbatches per rank
    assert trace.measured_bubble(records) == pytest.approx(render(lists)[1], rel=1e-12)
    out = trace.write(tmp_path / f"{name}.json", records, meta={"schedule": name, "pp": 4})
    width, _, rows = read_png(tmp_path / f"{name}.png")
    makespan = max(e for row in records for _, e, *_ in row)
    s, e, kind, _, _ = records[3][0]  # the last stage's first forward
    assert at_time(rows, 3, (s + e) / 2, t0=0.0, makespan=makespan) == trace.COLORS[kind]
    assert out["bubble"] == pytest.approx(trace.measured_bubble(records))
