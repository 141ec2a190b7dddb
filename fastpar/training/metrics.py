"""Training metrics: JSON lines, a human log line, a loss plot.

Usage (rank 0 passes the path, every other rank None and gets a writer that does nothing):

    metrics = MetricsWriter(args.metrics if rank == 0 else None, resume=resumed, resume_step=S)
    metrics.write({"step": 10, "loss": 2.31, "tokens_per_s": 5.1e4, "step_time_s": 0.08,
                   "lr": 3e-4, "grad_norm": 0.9})          # one whole line per record
    print(format_line(record))    # step 10 | loss 2.3100 | 51,000 tok/s | 80.0 ms | lr 3.00e-04 ...
    plot_losses(read_records(args.metrics), args.plot)     # PNG: train and val loss vs step

A fresh run truncates the file; a resumed run appends, after dropping a torn last line and (with
resume_step) the records of steps after the checkpoint it resumed from, which it will redo.
Non-finite floats are written as Python's json writes them (NaN, Infinity).
"""

import json
import math
import os


def _jsonable(obj):
    """json's fallback for one-element tensors and NumPy scalars (a loss left as a tensor)."""
    if callable(getattr(obj, "item", None)):
        numel = obj.numel() if callable(getattr(obj, "numel", None)) else getattr(obj, "size", 1)
        if numel == 1:
            return obj.item()
    raise TypeError(f"metrics record value of type {type(obj).__name__} is not JSON-serialisable")


def read_records(path):
    """The records of a metrics file; a torn (unterminated) last line is ignored."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def _replace_atomically(path, write):
    """write(f) into a temporary file beside path, fsync it, then os.replace it onto path."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                       f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _step_of(line, path, number):
    try:
        return json.loads(line).get("step", 0)
    except ValueError as exc:
        raise ValueError(f"metrics file {path} line {number} is not JSON: {exc}") from exc


class MetricsWriter:
    """Append-only JSON lines; each record is one os.write of one whole line on an O_APPEND fd."""

    def __init__(self, path, *, resume=False, resume_step=None):
        self.path, self._fd = path, None
        if path is None:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        if resume and os.path.isfile(path):
            with open(path, "rb") as f:
                data = f.read()
            keep = data[:data.rfind(b"\n") + 1]  # whole lines only
            if resume_step is not None:
                keep = b"".join(line + b"\n" for i, line in enumerate(keep.split(b"\n")[:-1])
                                if not line.strip() or _step_of(line, path, i + 1) <= resume_step)
            if keep != data:
                _replace_atomically(path, lambda f: f.write(keep))
        elif not resume:
            flags |= os.O_TRUNC
        self._fd = os.open(path, flags, 0o644)

    def write(self, record):
        if self._fd is None:
            return
        line = (json.dumps(record, default=_jsonable) + "\n").encode()
        view = memoryview(line)
        while view:  # one call for any line a regular file accepts whole; loop on a short write
            view = view[os.write(self._fd, view):]

    def close(self):
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"MetricsWriter({self.path!r})"


# (record key, how the log line shows it), in line order.
_FIELDS = (("loss", "loss {:.4f}"), ("val_loss", "val loss {:.4f}"),
           ("tokens_per_s", "{:,.0f} tok/s"), ("step_time_s", "{:.1f} ms"), ("lr", "lr {:.2e}"),
           ("grad_norm", "grad norm {:.3f}"), ("mfu", "MFU {:.1%}"),
           ("moe_aux_loss", "aux {:.4f}"), ("moe_z_loss", "z {:.3f}"),
           ("moe_dropped", "dropped {:,}"))


def format_line(record):
    """The human log line of a record; fields that are absent are left out."""
    parts = [f"step {record['step']}" if "step" in record else "step ?"]
    for key, fmt in _FIELDS:
        if key in record:
            value = record[key] * 1e3 if key == "step_time_s" else record[key]
            parts.append(fmt.format(value))
            if key == "moe_z_loss" and "expert_load_min" in record:
                parts.append(f"expert load {record['expert_load_min']:,}-"
                             f"{record['expert_load_max']:,}")
    return " | ".join(parts)


def _series(records, key):
    pts = [(r["step"], r[key]) for r in records
           if "step" in r and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_losses(records, path, title="fastpar training loss"):
    """A PNG of train loss ("loss") and validation loss ("val_loss") against "step", written
    atomically (a temporary file in the same directory, then os.replace). Returns path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: only plotting needs it
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, label, style in (("loss", "train", "-"), ("val_loss", "validation", "o-")):
        steps, values = _series(records, key)
        if steps:
            ax.plot(steps, values, style, label=f"{label} (last {values[-1]:.4f})", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no loss records", ha="center", va="center", transform=ax.transAxes)
    return _replace_atomically(path, lambda f: fig.savefig(f, format="png"))
