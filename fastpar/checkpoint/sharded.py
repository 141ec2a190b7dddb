"""Sharded checkpoints: each rank writes its own pieces at once, async if asked, and any layout
loads them by reading only its slices.

    ckpt = ShardedCheckpointer()                     # collective: its own gloo group
    ckpt.save("runs/a", step, pipe, opt, meta=meta)  # collective; async_save=True returns early
    ckpt.wait()                                      # the previous save committed (or raises)
    step, meta = ckpt.load("runs/a", pipe, opt)      # any tp / pp / dp / ZeRO stage

On disk (``fastpar.checkpoint.store`` for the directory protocol)::

    runs/a/step_00000100/rank_00003.safetensors   the pieces rank 3 wrote (plain safetensors)
    runs/a/step_00000100/index.json               written last, by rank 0:
        {"format": "fastpar-sharded-v1", "step", "world", "meta",
         "tensors": {"model" | "optimizer": {name: {"shape", "dtype",
                     "pieces": [{"file", "key", "offsets", "sizes", "sha256"}]}}},
         "files": {file: {"bytes", "rank"}}, "optimizer_scalars": {kind: value}}

Save, on every rank: the pieces it holds (``holdings``) are described and all-gathered (the
plan, cached per layout: ``plan.assign``); it writes its share into its own file inside the
step's ``.tmp-`` directory (``files.write``: hashed as written, fsynced); the files' records
are all-gathered; rank 0 writes ``index.json`` and publishes the directory, then tells every
rank the outcome. A failure anywhere (a full disk, a read-only directory) raises on every
rank. ``async_save=True`` copies the pieces into a staging buffer (kept between saves) and does
the rest on a background thread, over this object's own gloo group so that it never meets the
training's collectives; the next ``save``, ``wait`` or ``close`` re-raises its error. With
``hold=True`` there is no staging copy: the writer reads the live tensors, and the caller holds
off changing them until ``wait()`` (the trainer: until its next optimizer step).

Load, on every rank: the index is read (JSON: nothing is unpickled); the file sizes are checked
and every piece's sha256 verified, each by one rank (the bytes spread over the ranks), the
outcome shared; the names, shapes and dtypes are compared with this layout's; then each of
this rank's pieces (``holdings``: the same code as save) is filled from the saved boxes it
intersects, reading those slices only, and must be covered exactly once. Afterwards the
parameters are published from the masters and the dp replicas compare digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time

import torch
import torch.distributed as dist

from fastpar.checkpoint import files, loading, plan, store
from fastpar.checkpoint.boxes import numel, range_boxes, shift
from fastpar.checkpoint.holdings import keyed_tensors, model_pieces, optimizer_pieces
from fastpar.checkpoint.loading import FORMAT

KEEP = 3


class CheckpointError(RuntimeError):
    """A sharded save or load failed on some rank (raised on every rank)."""


class ShardedCheckpointer:
    """Saves and loads sharded checkpoints for one job; see the module docstring."""

    def __init__(self, group=None):
        self.dist = dist.is_available() and dist.is_initialized()
        if self.dist:
            # its own communicator: the async writer's collectives never meet the training's
            self.group = group if group is not None else dist.new_group(backend="gloo")
            self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        else:
            self.group, self.rank, self.world = None, 0, 1
        nonce = [f"{os.getpid()}-{time.time_ns()}"]
        if self.dist:
            dist.broadcast_object_list(nonce, src=dist.get_global_rank(self.group, 0),
                                       group=self.group)
        self.nonce = nonce[0]
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._plan = None  # (layout signature, this rank's ranges)
        self._staging: torch.Tensor | None = None
        self.last_path: str | None = None
        self.write_cpu_s = 0.0  # CPU time the last save's file took this rank (bench/)

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

    # ---- save -------------------------------------------------------------------------------

    def save(self, root: str, step: int, model, opt, *, meta: dict, keep: int | None = KEEP,
             async_save: bool = False, hold: bool = False) -> str | None:
        """Write checkpoint ``root/step_{step:08d}`` (collective). Returns its path, or None
        when ``async_save`` (``wait()`` returns it once committed). An async save copies the
        pieces into a staging buffer first, unless ``hold``: then the writer reads them where
        they lie and the caller must not change the model's weights or the optimizer until
        ``wait()`` returns (``fastpar.train`` waits before its next optimizer step, so the
        write overlaps that step's forward and backward, with no copy and no extra memory)."""
        self.wait()
        root = os.fspath(root)
        problem = None
        if self.rank == 0:
            try:
                os.makedirs(root, exist_ok=True)
                store.clean(root)  # leftovers of interrupted saves: nobody writes there now
                store.check_new(root, step)
                json.dumps(meta)
            except (OSError, ValueError, TypeError) as exc:
                problem = str(exc)
        pieces = model_pieces(model, opt)
        opt_pieces, scalars = optimizer_pieces(model, opt)
        pieces += opt_pieces
        held = plan.describe(pieces)
        digest = hashlib.sha256(repr(held).encode()).hexdigest()
        everyone = self._all((problem, digest, scalars))
        self._raise_any([e[0] for e in everyone], f"saving step {step}")
        digests = [e[1] for e in everyone]
        if self._plan is None or self._plan[0] != digests:  # the layout is new: plan it
            layout = self._all(held)
            plan.check(layout)
            self._plan = (digests, plan.assign(layout, self.rank))
        items = self._items(pieces, self._plan[1])
        if async_save and not hold:
            items = self._stage(items)
        scalars = next((s for _, _, s in everyone if s), {})
        job = (root, step, items, meta, scalars, keep)
        if not async_save:
            return self._write(*job)
        self._error = None
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
        """Copies of the items' data in one host buffer, reused by the next save of the same
        size (an async save's training may change the originals at once)."""
        sizes = [d.numel() * d.element_size() for *_, d in items]
        total = sum(sizes)
        if self._staging is None or self._staging.numel() != total:
            self._staging = torch.empty(total, dtype=torch.uint8)
        staged, at = [], 0
        for (section, name, shape, box, d), n in zip(items, sizes):
            view = self._staging[at:at + n]
            view.copy_(d.detach().reshape(-1).view(torch.uint8))
            staged.append((section, name, shape, box, view.view(d.dtype)))
            at += n
        return staged

    def _background(self, *job) -> None:
        # Not reniced: the trainer waits for this thread before its next optimizer step (or
        # save), and a low-priority writer on a busy machine would then stall it longer.
        try:
            self._write(*job)
        except BaseException as exc:  # re-raised by the next save / wait on the main thread
            self._error = exc

    def _write(self, root, step, items, meta, scalars, keep) -> str:
        tmp = os.path.join(root, f".tmp-{store.step_name(step)}-{self.nonce}")
        fname = f"rank_{self.rank:05d}.safetensors"
        record, problem = None, None
        cpu = time.thread_time()
        try:
            os.makedirs(tmp, exist_ok=True)
            if items:
                keys = [f"{sec}/{name}@{','.join(map(str, box[0]))}"
                        for sec, name, _, box, _ in items]
                out = files.write(os.path.join(tmp, fname),
                                  [(k, d, box[1]) for k, (_, _, _, box, d) in zip(keys, items)],
                                  {"format": FORMAT, "rank": self.rank})
                record = {"file": fname, "bytes": out["bytes"], "pieces": [
                    (sec, name, shape, str(d.dtype).removeprefix("torch."), box, k,
                     out["sha256"][k]) for k, (sec, name, shape, box, d) in zip(keys, items)]}
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        self.write_cpu_s = time.thread_time() - cpu  # this rank's file: hashing and copies
        everyone = self._all((problem, record))
        path, problem = None, None
        if self.rank == 0:
            try:
                if any(e[0] for e in everyone):
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    index = self._index(step, meta, scalars, [e[1] for e in everyone])
                    store.write_file(os.path.join(tmp, "index.json"),
                                     json.dumps(index, indent=1).encode())
                    path = store.publish(root, tmp, step, keep)
            except Exception as exc:
                problem = f"{type(exc).__name__}: {exc}"
                shutil.rmtree(tmp, ignore_errors=True)
        outcome = self._all((problem, path))
        final = os.path.join(root, store.step_name(step))
        self._raise_any([e[0] for e in everyone], f"writing checkpoint {final}")
        self._raise_any([outcome[0][0]] + [None] * (self.world - 1),
                        f"committing checkpoint {final}")
        self.last_path = outcome[0][1]
        return self.last_path

    def _index(self, step, meta, scalars, records) -> dict:
        tensors = {"model": {}, "optimizer": {}}
        file_info = {}
        for rank, rec in enumerate(records):
            if rec is None:
                continue
            file_info[rec["file"]] = {"bytes": rec["bytes"], "rank": rank}
            for sec, name, shape, dtype, box, key, digest in rec["pieces"]:
                entry = tensors[sec].setdefault(name, {"shape": list(shape), "dtype": dtype,
                                                       "pieces": []})
                entry["pieces"].append({"file": rec["file"], "key": key,
                                        "offsets": list(box[0]), "sizes": list(box[1]),
                                        "sha256": digest})
        for sec in tensors:
            tensors[sec] = dict(sorted(tensors[sec].items()))
            for entry in tensors[sec].values():
                entry["pieces"].sort(key=lambda p: p["offsets"])
        return {"format": FORMAT, "step": int(step), "world": self.world, "meta": meta,
                "optimizer_scalars": scalars, "tensors": tensors, "files": file_info}

    def wait(self) -> str | None:
        """Block until the async save in flight (if any) has committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self.last_path

    close = wait

    # ---- load -------------------------------------------------------------------------------

    def load(self, path, model, opt) -> dict:
        """Fill ``model``'s weights and ``opt``'s state from a sharded checkpoint saved under
        any layout (collective); returns its index (``step``, ``meta``, ...). Raises on every
        rank, naming what is wrong, for a damaged checkpoint or one of another model."""
        self.wait()
        directory = index = problem = None
        try:
            directory, index = loading.read_index(path)
            problem = "; ".join(loading.check_files(directory, index)) or None
        except (OSError, ValueError) as exc:
            problem = str(exc)
        self._raise_any(self._all(problem), f"checkpoint {directory or path} is incomplete or "
                        "corrupt", ValueError)
        found = loading.verify_share(directory, index, self.rank, self.world)
        self._raise_any(self._all("; ".join(found) or None), f"checkpoint {directory} is "
                        "corrupt (sha256 of its pieces)", ValueError)
        kinds = sorted({n.rsplit(":", 1)[1] for n in index["tensors"]["optimizer"]})
        pieces = model_pieces(model, opt)
        opt_pieces, _ = optimizer_pieces(model, opt, kinds=kinds,
                                         scalars=index.get("optimizer_scalars", {}))
        pieces += opt_pieces
        expected = {}
        for held in self._all(sorted({(p.section, p.name, tuple(p.shape),
                                       files.dtype_name(p.dtype)) for p in pieces})):
            expected.update({(s, n): (shape, d) for s, n, shape, d in held})
        differ = loading.compare(expected, index)
        if differ:
            raise ValueError(f"checkpoint {directory} does not fit this model: "
                             + "; ".join(differ))
        problem = None
        try:
            with torch.no_grad():
                loading.fill(directory, index, pieces)
        except (OSError, ValueError, RuntimeError) as exc:
            problem = str(exc)
        self._raise_any(self._all(problem), f"reading {directory}", ValueError)
        publish(opt)
        self._check_replicas(model, opt, directory)
        return index

    def _check_replicas(self, model, opt, directory) -> None:
        """Ranks that hold the same shards (the same keys and boxes: dp replicas of a tp/pp
        shard, whatever the groups) hold the same bytes after a load."""
        if not self.dist:
            return
        shards = repr(sorted((key, box) for key, _, _, box in keyed_tensors(model)))
        seen = self._all((shards, replica_digest(model, opt)))
        by_shard = {}
        for rank, (shard, d) in enumerate(seen):
            by_shard.setdefault(shard, {}).setdefault(d, []).append(rank)
        split = [list(groups.values()) for groups in by_shard.values() if len(groups) > 1]
        if split:
            raise CheckpointError(f"after loading {directory} the replicas of one shard differ: "
                                  + "; ".join(" vs ".join(f"ranks {r}" for r in groups)
                                              for groups in split[:3]))


def publish(opt) -> None:
    """The parameters from the masters just loaded (ZeRO: collective over dp)."""
    from fastpar.optim import DistributedOptimizer, MasterWeights

    if isinstance(opt, DistributedOptimizer):
        opt._publish()
        opt._reduced = False
    elif isinstance(opt, MasterWeights):
        opt._copy_back()


def replica_digest(model, opt) -> str:
    """sha256 of every tensor this rank holds whole (a released ZeRO-3 parameter is not)."""
    import hashlib

    from fastpar.optim import DistributedOptimizer

    released = isinstance(opt, DistributedOptimizer) and opt.sharded is not None
    h = hashlib.sha256()
    for key, t, _, _ in keyed_tensors(model):
        if released and t.requires_grad:
            continue
        h.update(key.encode())
        h.update(files._bytes(t.detach().contiguous().reshape(-1), 0,
                              t.numel() * t.element_size()))
    return h.hexdigest()
