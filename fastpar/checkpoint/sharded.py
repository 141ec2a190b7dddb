"""Sharded checkpoints: each rank writes its own pieces at once, async if asked, and any layout
loads them by reading only its slices.

    ckpt = ShardedCheckpointer()                     # collective: its own gloo group
    ckpt.save("runs/a", step, pipe, opt, meta=meta)  # collective; async_save=True returns early
    ckpt.wait()                                      # the previous save committed (or raises)
    index = ckpt.load("runs/a", pipe, opt)           # any tp / pp / dp / ZeRO stage
    index["step"], index["meta"]

On disk (``fastpar.checkpoint.store`` for the directory protocol)::

    runs/a/step_00000100/rank_00003.safetensors   the pieces rank 3 wrote (plain safetensors)
    runs/a/step_00000100/index.json               written last, by rank 0:
        {"format": "fastpar-sharded-v1", "step", "world", "meta",
         "tensors": {"model" | "optimizer": {name: {"shape", "dtype",
                     "pieces": [{"file", "key", "offsets", "sizes", "sha256"}]}}},
         "files": {file: {"bytes", "rank"}}, "optimizer_scalars": {kind: value}}

Save, on every rank: the pieces it holds (``holdings``) are described and all-gathered (who
writes what, cached per layout: ``writers.assign``); it writes its share into its own file
inside the step's ``.tmp-`` directory (``files.write``: hashed as written, fsynced); the files'
records are all-gathered; rank 0 writes ``index.json`` and publishes the directory, then tells
every rank the outcome. A failure anywhere (a full disk, a read-only directory) raises on every
rank. ``async_save=True`` copies the pieces into a staging buffer (kept between saves) and does
the rest on a background thread, over this object's own gloo group so that it never meets the
training's collectives; the next ``save``, ``wait`` or ``close`` re-raises its error. With
``hold=True`` there is no staging copy: the writer reads the live tensors, and the caller holds
off changing them until ``wait_for_reads()`` (the trainer: until its next optimizer step; the
commit goes on behind it).

Load, on every rank: the index is read (JSON: nothing is unpickled); the file sizes are checked
and every piece's sha256 verified, each by one rank (the bytes spread over the ranks), the
outcome shared; the names, shapes and dtypes are compared with this layout's; then each of
this rank's pieces (``holdings``: the same code as save) is filled from the saved boxes it
intersects, reading those slices only, and must be covered exactly once. Afterwards the
parameters are published from the masters and the dp replicas compare digests.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
import time

import torch
import torch.distributed as dist

from fastpar.checkpoint import files, loading, store, writers
from fastpar.checkpoint.boxes import numel, range_boxes, shift
from fastpar.checkpoint.holdings import model_pieces, optimizer_pieces
from fastpar.checkpoint.loading import FORMAT
from fastpar.runtime import is_initialized, topology

KEEP = store.KEEP
ALIGN = 64  # bytes: each staged piece starts aligned for any dtype


class CheckpointError(RuntimeError):
    """A sharded save failed on some rank (raised on every rank)."""


def _said(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def _described(pieces, world: int) -> dict:
    """What ``inspect`` says of any checkpoint whose meta does not (the index's
    ``written_by``): the layout that wrote it (fastpar's topology, else the world size) and the
    weights' dtype(s) (rank 0's)."""
    if is_initialized():
        t = topology()
        layout = {"tp": t.tp_size, "pp": t.pp_size, "dp": t.dp_size, "cp": t.cp_size}
    else:
        layout = {"world": world}
    dtypes = sorted({str(p.data.dtype).replace("torch.", "") for p in pieces})
    return {"layout": layout, "dtype": ", ".join(dtypes) or "?"}


class ShardedCheckpointer:
    """Saves and loads sharded checkpoints for one job; see the module docstring.

    ``group``: the gloo group its collectives use; None creates one over the world (collective),
    with the topology's timeout, so that the async writer never meets the training's
    collectives."""

    def __init__(self, group=None):
        self.dist = dist.is_available() and dist.is_initialized()
        if self.dist:
            if group is None:
                from fastpar.runtime import is_initialized, topology
                from fastpar.runtime.rendezvous import as_timedelta

                timeout = as_timedelta(topology().timeout) if is_initialized() else None
                group = dist.new_group(backend="gloo", timeout=timeout)
            self.group = group
            self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        else:
            self.group, self.rank, self.world = None, 0, 1
        nonce = [f"{os.getpid()}-{time.time_ns()}"]
        if self.dist:
            dist.broadcast_object_list(nonce, src=dist.get_global_rank(self.group, 0),
                                       group=self.group)
        self.nonce = nonce[0]
        self._thread: threading.Thread | None = None
        self._read = threading.Event()  # the save in flight reads the live tensors no more
        self._read.set()
        self._error: BaseException | None = None
        self._assigned = None  # (every rank's digest of its pieces, this rank's ranges)
        self._described: dict = {}  # what the last save says of itself (_described)
        self._staging: torch.Tensor | None = None
        self._copied = None  # a GPU staging copy's event, until the writer has waited on it
        self._staged = None  # the same event, until the trainer's stream has waited on it
        self.last_path: str | None = None
        self.write_cpu_s = 0.0  # CPU time the last save's file took this rank (bench/)
        self.read_wait_s = 0.0  # how long the last wait_for_reads() blocked (bench/)

    # ---- collectives over this object's group ---------------------------------------------

    def _all(self, obj) -> list:
        if not self.dist:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _raise_any(self, outcomes: list, what: str, kind=None) -> None:
        """Raise on every rank if any rank failed: the ranks that did, grouped by message."""
        bad = {}
        for r, e in enumerate(outcomes):
            if e:
                bad.setdefault(e, []).append(r)
        if not bad:
            return
        if len(bad) == 1 and len(next(iter(bad.values()))) == self.world > 1:
            said = f"(every rank) {next(iter(bad))}"
        elif len(bad) == 1 and self.world == 1:
            said = next(iter(bad))
        else:
            said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} "
                             f"{','.join(map(str, rs))}: {e}" for e, rs in list(bad.items())[:4])
        raise (kind or CheckpointError)(f"{what}: {said}")

    def _agree(self, what: str, fn, kind=None):
        """``fn()`` on every rank; if it raises anywhere, raise on every rank (one exchange)."""
        out, problem = None, None
        try:
            out = fn()
        except Exception as exc:
            problem = _said(exc)
        self._raise_any(self._all(problem), what, kind)
        return out

    # ---- save -------------------------------------------------------------------------------

    def save(self, root: str, step: int, model, opt=None, *, meta: dict,
             keep: int | None = KEEP, async_save: bool = False, hold: bool = False,
             optimizer_state: bool = True) -> str | None:
        """Write checkpoint ``root/step_{step:08d}`` (collective). Returns its path, or None
        when ``async_save`` (``wait()`` returns it once committed). An async save copies the
        pieces into a staging buffer first, unless ``hold``: then the writer reads them where
        they lie and the caller must not change the model's weights or the optimizer until
        ``wait_for_reads()`` returns (``fastpar.train`` waits before its next optimizer step,
        so the write overlaps that step's forward and backward, with no copy and no extra
        memory); a held piece changed meanwhile fails the save. ``opt`` None: the model's
        weights alone (its parameters); ``optimizer_state=False``: the optimizer's weights of
        record (ZeRO's or bf16's float32 masters) without its state (an export's
        checkpoint)."""
        self.wait()
        root = os.fspath(root)
        if int(step) < 0 or (keep is not None and int(keep) < 1):
            raise ValueError(f"save needs step >= 0 and keep >= 1 (or None), got step {step}, "
                             f"keep {keep}")
        problem, digest, scalars, pieces = None, None, {}, []
        try:
            if self.rank == 0:
                os.makedirs(root, exist_ok=True)
                store.clean(root)  # leftovers of interrupted saves: nobody writes there now
                store.check_new(root, step)
                json.dumps(meta)
            pieces = model_pieces(model, opt, saving=True)
            self._described = _described(pieces, self.world)  # index["written_by"]
            if opt is not None and optimizer_state:
                opt_pieces, scalars = optimizer_pieces(model, opt)
                pieces += opt_pieces
            held = writers.describe(pieces)
            digest = hashlib.sha256(repr(held).encode()).hexdigest()
        except (OSError, ValueError, TypeError, RuntimeError) as exc:
            problem = _said(exc)
        everyone = self._all((problem, digest, scalars))
        self._raise_any([e[0] for e in everyone], f"saving step {step}")
        digests = [e[1] for e in everyone]
        if self._assigned is None or self._assigned[0] != digests:  # new pieces: assign them
            every = self._all(held)
            mine = self._agree(f"assigning the writes of step {step}", lambda: (
                writers.check(every), writers.assign(every, self.rank))[1])
            self._assigned = (digests, mine)
        items = self._items(pieces, self._assigned[1])
        problem = None
        if async_save and not hold:
            try:
                items = self._stage(items)
            except (RuntimeError, ValueError) as exc:  # reported in the write's exchange
                problem = _said(exc)
        scalars = next((s for _, _, s in everyone if s), {})
        versions = [d._version for *_, d in items] if hold else None
        job = (root, step, items, meta, scalars, keep, problem, versions)
        if not async_save:
            return self._write(*job)
        self._error = None
        # held: the writer reads the live tensors until its file is written; staged: the
        # copies hold it all (a GPU's once their event has passed on the trainer's stream)
        self._staged = None if hold else self._copied
        if hold:
            self._read.clear()
        self._thread = threading.Thread(target=self._background, args=job, daemon=True,
                                        name=f"fastpar-checkpoint-{step}")
        self._thread.start()
        return None

    @staticmethod
    def _items(pieces, ranges) -> list[tuple]:
        """``[(section, name, shape, serial box, data (n,))]`` this rank writes."""
        items = []
        for i, lo, hi in ranges:
            p = pieces[i]
            for start, box in range_boxes(p.box[1], lo, hi):
                a = lo - p.lo + start
                items.append((p.section, p.name, p.shape, shift(box, p.box[0]),
                              p.data[a:a + numel(box[1])]))
        return items

    def _stage(self, items) -> list[tuple]:
        """Copies of the items' data in one host buffer (each piece ``ALIGN``-aligned), reused
        by the next save of the same size. From a GPU: pinned memory, copies queued on a side
        stream; the writer waits for them (``_write``) while training goes on."""
        sizes = [d.numel() * d.element_size() for *_, d in items]
        starts, at = [], 0
        for n in sizes:
            starts.append(at)
            at += -(-n // ALIGN) * ALIGN
        cuda = any(d.is_cuda for *_, d in items)
        if self._staging is None or self._staging.numel() != at:
            self._staging = torch.empty(at, dtype=torch.uint8, pin_memory=cuda)
        stream = torch.cuda.Stream() if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream())
        staged = []
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for (section, name, shape, box, d), n, a in zip(items, sizes, starts):
                view = self._staging[a:a + n]
                view.copy_(d.detach().reshape(-1).view(torch.uint8), non_blocking=cuda)
                staged.append((section, name, shape, box, view.view(d.dtype)))
        self._copied = stream.record_event() if cuda else None
        return staged

    def _background(self, *job) -> None:
        # Not reniced: the trainer waits for this thread before its next optimizer step (or
        # save), and a low-priority writer on a busy machine would then stall it longer.
        try:
            self._write(*job)
        except BaseException as exc:  # re-raised by the next save / wait on the main thread
            self._error = exc

    def _write(self, root, step, items, meta, scalars, keep, problem=None, versions=None):
        tmp = os.path.join(root, f".tmp-{store.step_name(step)}-{self.nonce}")
        fname = f"rank_{self.rank:05d}.safetensors"
        record = None
        cpu = time.thread_time()
        try:
            if problem is None:
                if self._copied is not None:
                    self._copied.synchronize()  # the staging copies from the GPU have landed
                    self._copied = None
                os.makedirs(tmp, exist_ok=True)
                if items:
                    record = self._write_file(os.path.join(tmp, fname), items)
                if versions is not None and versions != [d._version for *_, d in items]:
                    problem = ("the model or optimizer changed during a held save (hold=True: "
                               "wait_for_reads() before changing them)")
        except Exception as exc:
            problem = _said(exc)
        self._read.set()  # the rest (the exchanges, rank 0's index and rename) reads nothing
        self.write_cpu_s = time.thread_time() - cpu  # this rank's file: hashing and copies
        everyone = self._all((problem, record))
        path, problem = None, None
        if self.rank == 0:
            try:
                if any(e[0] for e in everyone):
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    records = [e[1] for e in everyone]
                    missing = writers.missing_files(tmp, records)
                    if missing:
                        raise OSError(f"{missing}: is {root} on a file system every rank "
                                      "shares?")
                    index = writers.index(FORMAT, step, self.world, meta, scalars, records)
                    index["written_by"] = self._described
                    store.write_file(os.path.join(tmp, "index.json"),
                                     json.dumps(index, separators=(",", ":")).encode())
                    path = store.publish(root, tmp, step, keep)
            except Exception as exc:
                problem = _said(exc)
                shutil.rmtree(tmp, ignore_errors=True)
        outcome = self._all((problem, path))
        final = os.path.join(root, store.step_name(step))
        self._raise_any([e[0] for e in everyone], f"writing checkpoint {final}")
        self._raise_any([outcome[0][0]] + [None] * (self.world - 1),
                        f"committing checkpoint {final}")
        self.last_path = outcome[0][1]
        return self.last_path

    def _write_file(self, path: str, items) -> dict:
        keys = [f"{sec}/{name}@{','.join(map(str, box[0]))}" for sec, name, _, box, _ in items]
        out = files.write(path, [(k, d, box[1]) for k, (_, _, _, box, d) in zip(keys, items)],
                          {"format": FORMAT, "rank": self.rank})
        return {"file": os.path.basename(path), "bytes": out["bytes"], "pieces": [
            (sec, name, shape, files.dtype_name(d.dtype), box, k, out["sha256"][k])
            for k, (sec, name, shape, box, d) in zip(keys, items)]}

    def wait_for_reads(self) -> None:
        """Block until the save in flight no longer reads the model and optimizer: a held
        save's file is written; a staged save read them into its copies before returning
        (from a GPU: the current stream is made to wait for the copies, the host does not).
        Its commit may still be going on, and its errors come from ``wait()``. What a caller
        waits for before changing them (``fastpar.train``: before its optimizer step)."""
        t0 = time.perf_counter()
        if self._staged is not None:  # later work on this stream waits for the staging copies
            torch.cuda.current_stream().wait_event(self._staged)
            self._staged = None
        self._read.wait()
        self.read_wait_s = time.perf_counter() - t0

    def wait(self) -> str | None:
        """Block until the async save in flight (if any) has committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self.last_path

    def close(self) -> str | None:
        """``wait()``, then free the staging buffer."""
        try:
            return self.wait()
        finally:
            self._staging = None

    # ---- load -------------------------------------------------------------------------------

    def load(self, path, model, opt) -> dict:
        """Fill ``model``'s weights and ``opt``'s state from a sharded checkpoint saved under
        any layout (collective); returns its index (``step``, ``meta``, ...). Raises
        ValueError on every rank, naming what is wrong, for a damaged checkpoint or one of
        another model. A model-only checkpoint leaves the optimizer as it is; ``opt`` None
        loads the weights alone, whatever else the checkpoint holds."""
        self.wait()
        path = os.fspath(path)
        directory, index = self._agree(f"checkpoint {path} is incomplete or corrupt",
                                       lambda: loading.open_index(path), ValueError)
        self._agree(f"checkpoint {directory} is corrupt (sha256 of its pieces)", lambda: (
            loading.raise_if(loading.verify_share(directory, index, self.rank, self.world))),
            ValueError)

        def targets():
            pieces = model_pieces(model, opt)
            kinds = sorted({n.rsplit(":", 1)[1] for n in index["tensors"]["optimizer"]})
            if kinds and opt is not None:  # opt None: the weights alone (generation)
                pieces += optimizer_pieces(model, opt, kinds=kinds,
                                           scalars=index.get("optimizer_scalars", {}))[0]
            return pieces
        pieces = self._agree(f"checkpoint {directory} does not fit this optimizer", targets,
                             ValueError)
        expected = {}
        for held in self._all(sorted({(p.section, p.name, tuple(p.shape),
                                       files.dtype_name(p.dtype)) for p in pieces})):
            expected.update({(s, n): (shape, d) for s, n, shape, d in held})
        differ = loading.compare(expected, index, sections=("model", "optimizer")
                                 if opt is not None else ("model",))
        if differ:  # the same on every rank: no exchange needed
            raise ValueError(f"checkpoint {directory} does not fit this model: "
                             + "; ".join(differ))
        self._agree(f"reading {directory}", lambda: loading.fill(directory, index, pieces),
                    ValueError)
        loading.refresh_params(opt)
        digests = self._all(loading.replica_digest(model, opt))
        loading.raise_if(loading.replicas_differ(digests), f"after loading {directory} the "
                         "replicas of one shard differ")
        return index
