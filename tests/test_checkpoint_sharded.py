"""Sharded checkpoints (``fastpar.checkpoint``) between every pair of layouts, and every refusal.

One launch per world size (1, 2, 4). Every rank trains the serial ``SerialMLP`` two AdamW steps
(the reference: weights, ``exp_avg``, ``exp_avg_sq``, ``step``), then for each layout (tp, dp,
ZeRO stage, dtype; tp and dp groups built inside the launch, so one world holds tp 1/2/4, dp
1/2/4 and every rank alone) builds ``ParallelMLP`` and its optimizer, loads the reference into
it through the serial path (``load_full_state_dict`` + ``load_serial_optimizer_state``, tested
elsewhere), and saves it sharded. Then every layout loads every checkpoint and the serial state
it then holds (gathered by the serial path) must equal the reference bitwise: weights (float32
masters for bf16 layouts) and optimizer state. The sizes (hidden 6, ffn 12) cut ZeRO ranges
across rows, so flat ranges become several boxes; the tensors behind every async (staged) save
are changed as soon as it returns. Then, at 2 ranks: a truncated file, a flipped byte, a
missing rank's file, a file header whose dtype was edited, an index whose pieces were moved
between tensors and another model's checkpoint are refused on every rank naming what is wrong,
and so are dp replicas that differ after a load; a held save whose tensors change while it
writes fails; a save into a full file system (a 64 KiB tmpfs) and into a read-only one raise
on every rank, synchronously and from an async save at ``wait()``.
"""

import json
import os
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from tests.multirank import ROOT, run_ranks

HIDDEN, FFN = 6, 12


def layouts(world):
    """``(name, tp, dp, stage, dtype)``: every rank alone, then whole-world layouts: at world
    2 every ZeRO stage at each tp; at world 4 (81 pairs rather than 169) ZeRO-2 at tp 2 only
    and bf16 masters through ZeRO-1 at dp 4 (the other combinations ran at world 2)."""
    out = [("solo", 1, 1, 0, "float32")]
    if world < 4:
        out.append(("solo.bf16", 1, 1, 0, "bfloat16"))
    for tp in (1, 2, 4):
        if tp > world:
            continue
        dp = world // tp
        out.append((f"tp{tp}dp{dp}", tp, dp, 0, "float32"))
        if dp > 1:
            stages = (1, 2, 3) if world < 4 else ((1, 3) if tp == 1 else (2, 3))
            out += [(f"tp{tp}dp{dp}.z{s}", tp, dp, s, "float32") for s in stages]
            if world < 4 or tp == 1:
                out.append((f"tp{tp}dp{dp}.z1.bf16", tp, dp, 1, "bfloat16"))
    return out


def groups(world):
    """``{(tp, dp): (my tp group, my dp group)}``: tp groups of consecutive ranks, dp groups
    of the ranks with the same tp rank (created in the same order on every rank)."""
    import torch.distributed as dist

    rank, out = dist.get_rank(), {}
    singles = [dist.new_group([r]) for r in range(world)]
    out[(1, 1)] = (singles[rank], singles[rank])
    for tp in (1, 2, 4):
        if tp > world:
            continue
        dp = world // tp
        tps = [dist.new_group(list(range(i * tp, (i + 1) * tp))) for i in range(dp)]
        dps = [dist.new_group(list(range(j, world, tp))) for j in range(tp)]
        out[(tp, dp)] = (tps[rank // tp], dps[rank % tp])
    return out


def reference(seed):
    from fastpar.testing import SerialMLP
    from fastpar.training.serial_optimizer import serial_optimizer_state

    torch.manual_seed(seed)
    ser = SerialMLP(HIDDEN, FFN)
    opt = torch.optim.AdamW(ser.parameters(), lr=0.05, weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(2):
        x, y = torch.randn(4, 3, HIDDEN, generator=gen), torch.randn(4, 3, HIDDEN, generator=gen)
        opt.zero_grad()
        F.mse_loss(ser(x), y).backward()
        opt.step()
    weights = {k: v.detach().clone() for k, v in ser.state_dict().items()}
    return weights, *serial_optimizer_state(ser, opt)


def build(layout, grps, seed):
    from fastpar import nn as pnn
    from fastpar.optim import DistributedOptimizer, MasterWeights

    name, tp, dp, stage, dtype = layout
    tp_group, dp_group = grps[(tp, dp)]
    par = pnn.ParallelMLP(HIDDEN, FFN, seed=seed + 7, group=tp_group)
    kw = {"lr": 0.05, "weight_decay": 0.1}
    low = dtype == "bfloat16"
    if stage:
        if low:
            par.to(torch.bfloat16)
        extra = {"module": par} if stage == 3 else {}
        opt = DistributedOptimizer(par.parameters(), torch.optim.AdamW, stage=stage,
                                   group=dp_group, **extra, **kw)
    elif low:
        opt = MasterWeights(par.parameters(), torch.optim.AdamW, **kw)
        par.to(torch.bfloat16)
    else:
        opt = torch.optim.AdamW(par.parameters(), **kw)
    return par, opt


def serial_state(par, opt):
    """(weights of record, optimizer tensors, scalars) in the serial layout."""
    import fastpar
    from fastpar.training.save_resume import masters_in_place
    from fastpar.training.serial_optimizer import serial_optimizer_state

    gathered = opt.gathered() if hasattr(opt, "gathered") else torch.no_grad()
    with gathered, masters_in_place(opt):
        weights = {k: v.float() for k, v in fastpar.full_state_dict(par).items()}
    return weights, *serial_optimizer_state(par, opt)


def put(par, opt, ref):
    """The reference state into a layout, through the serial path."""
    import fastpar
    from fastpar.training.save_resume import masters_in_place
    from fastpar.training.serial_optimizer import load_serial_optimizer_state

    weights, tensors, scalars = ref
    gathered = opt.gathered() if hasattr(opt, "gathered") else torch.no_grad()
    with gathered, masters_in_place(opt):
        fastpar.load_full_state_dict(par, weights)
        load_serial_optimizer_state(par, opt, tensors, scalars)


def same(a: dict, b: dict) -> list[str]:
    return [k for k in sorted(set(a) | set(b))
            if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def scramble(par, opt):
    """Change every value a checkpoint of (par, opt) would hold."""
    from fastpar.checkpoint.holdings import model_pieces, optimizer_pieces

    with torch.no_grad():
        for p in model_pieces(par, opt) + optimizer_pieces(par, opt)[0]:
            p.data.add_(1.0)


def body_matrix(root, seed=11):
    import torch.distributed as dist

    import fastpar
    from fastpar.checkpoint.sharded import ShardedCheckpointer

    topo = fastpar.init(timeout=60)
    world = topo.world_size
    grps = groups(world)
    ref = reference(seed)
    ckpt = ShardedCheckpointer()
    every = layouts(world)
    for i, layout in enumerate(every):
        par, opt = build(layout, grps, seed)
        put(par, opt, ref)
        ckpt.save(os.path.join(root, layout[0]), 1, par, opt, meta={"layout": layout[0]},
                  async_save=i % 2 == 1)  # every other one in the background, staged:
        if i % 2 == 1:  # what it saves is what the tensors held when save() returned
            scramble(par, opt)
    ckpt.wait()
    wrong = []
    for saved in every:
        for layout in every:
            par, opt = build(layout, grps, seed + 100)  # other initial values
            index = ckpt.load(os.path.join(root, saved[0]), par, opt)
            assert index["meta"] == {"layout": saved[0]}
            w, t, s = serial_state(par, opt)
            bad = same(w, ref[0]) + same(t, ref[1]) + ([] if s == ref[2] else ["scalars"])
            if bad:
                wrong.append(f"{saved[0]} -> {layout[0]}: {bad}")
    dist.barrier()
    assert not wrong, wrong
    files = sorted(os.listdir(os.path.join(root, "tp1dp%d.z3" % world, "step_00000001"))) \
        if world > 1 else []
    return {"pairs": len(every) ** 2, "files": files}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_layout_loads_every_checkpoint_bitwise(world, tmp_path):
    root = str(tmp_path)
    values = run_ranks(world, body_matrix, root=root, timeout=240).values()
    n = len(layouts(world))
    assert values[0]["pairs"] == n * n
    if world > 1:  # ZeRO-3 over dp = world: every rank wrote its own file
        assert values[0]["files"] == ["index.json"] + [f"rank_{r:05d}.safetensors"
                                                       for r in range(world)]
    # the index is plain JSON, and each file plain safetensors that safetensors itself opens
    from safetensors import safe_open

    step = os.path.join(root, "tp1dp%d" % world if world > 1 else "solo", "step_00000001")
    with open(os.path.join(step, "index.json")) as f:
        index = json.load(f)
    weight = index["tensors"]["model"]["fc1.weight"]
    assert weight["shape"] == [FFN, HIDDEN] and weight["dtype"] == "float32"
    covered = 0
    for piece in weight["pieces"]:
        with safe_open(os.path.join(step, piece["file"]), "pt") as f:
            covered += f.get_tensor(piece["key"]).numel()
    assert covered == FFN * HIDDEN
    if world == 4:  # no ZeRO, dp 4: the replicas split the writing (every rank has a file)
        assert len(index["files"]) == 4, index["files"]
    if world == 2:
        check_cli(root, tmp_path)


def cli(*args):
    """``python -m fastpar.checkpoint ARGS`` in this process (its ``main``), as a
    ``CompletedProcess``; ``check_cli`` runs the real command line once."""
    import contextlib
    import io

    from fastpar.checkpoint.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def check_cli(root, tmp_path):
    """``inspect`` and ``export`` without ranks: the export of a ZeRO-3 checkpoint (flat ranges,
    two files) equals that of the serial one, bitwise; damage is found and refused."""
    from safetensors.torch import load_file

    got = cli("inspect", os.path.join(root, "tp1dp2.z3"), "--verify", "--tensors")
    assert got.returncode == 0, got.stderr
    for words in ("(fastpar-sharded-v1)", "step 1: written by 2 rank(s)", "2 files",
                  "model: 4 tensors, 162 elements", "optimizer scalars: step 2",
                  "fc1.weight", "(12, 6)", "verified: every piece's sha256 matches"):
        assert words in got.stdout, (words, got.stdout)
    outs = {}
    for name in ("tp1dp2.z3", "solo", "tp2dp1"):
        out = str(tmp_path / f"{name}.safetensors")
        command = ("export", os.path.join(root, name), out, "--optimizer")
        if name == "solo":  # the command line itself, through python -m fastpar
            import sys

            done = subprocess.run([sys.executable, "-m", "fastpar", "checkpoint", *command],
                                  capture_output=True, text=True, timeout=120, cwd=ROOT)
        else:
            done = cli(*command)
        assert done.returncode == 0 and "exported step 1" in done.stdout, done.stderr
        outs[name] = load_file(out)
    assert sorted(outs["solo"]) == ["fc1.bias", "fc1.bias:exp_avg", "fc1.bias:exp_avg_sq",
                                    "fc1.weight", "fc1.weight:exp_avg",
                                    "fc1.weight:exp_avg_sq", "fc2.bias", "fc2.bias:exp_avg",
                                    "fc2.bias:exp_avg_sq", "fc2.weight", "fc2.weight:exp_avg",
                                    "fc2.weight:exp_avg_sq"]
    for name in outs:
        assert not same(outs[name], outs["solo"]), name
    again = cli("export", os.path.join(root, "solo"), str(tmp_path / "solo.safetensors"))
    assert again.returncode == 1 and "exists; not overwritten" in again.stderr
    step = os.path.join(root, "tp1dp2.z3", "step_00000001", "rank_00001.safetensors")
    with open(step, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    bad = cli("inspect", os.path.join(root, "tp1dp2.z3"), "--verify")
    assert bad.returncode == 1 and "DAMAGED: rank_00001.safetensors: piece" in bad.stdout
    bad = cli("export", os.path.join(root, "tp1dp2.z3"), str(tmp_path / "no.safetensors"))
    assert bad.returncode == 1 and "is damaged" in bad.stderr
    assert not os.path.exists(tmp_path / "no.safetensors")


def expect(call, kind, *parts):
    """``call()`` raises ``kind`` with every one of ``parts`` in its message; returns it."""
    try:
        call()
    except kind as exc:
        text = str(exc)
        assert all(p in text for p in parts), (parts, text)
        return text
    raise AssertionError(f"no {kind.__name__} raised (expected {parts})")


def body_refusals(root, full_dir=None, ro_dir=None, seed=5):
    import torch.distributed as dist

    import fastpar
    from fastpar import nn as pnn
    from fastpar.checkpoint.sharded import CheckpointError, ShardedCheckpointer

    topo = fastpar.init(timeout=60)
    ckpt = ShardedCheckpointer()
    world, rank = topo.world_size, topo.rank
    grps = groups(world)
    layout = ("tp1", 1, world, 1, "float32")  # ZeRO-1 over the world: a file per rank
    par, opt = build(layout, grps, seed)
    put(par, opt, reference(seed))
    good = os.path.join(root, "good")
    step = ckpt.save(good, 1, par, opt, meta={})
    said = []

    def damaged(name, change):
        where = os.path.join(root, name)
        if rank == 0:
            shutil.copytree(good, where)
            change(os.path.join(where, "step_00000001"))
        dist.barrier()
        fresh, fopt = build(layout, grps, seed + 1)
        said.append(expect(lambda: ckpt.load(where, fresh, fopt), ValueError, *parts[name]))

    def truncate(d):
        with open(os.path.join(d, "rank_00001.safetensors" if world > 1 else
                               "rank_00000.safetensors"), "r+b") as f:
            f.truncate(100)

    def flip(d):
        fname = "rank_00000.safetensors"
        size = os.path.getsize(os.path.join(d, fname))
        with open(os.path.join(d, fname), "r+b") as f:
            f.seek(size - 3)
            b = f.read(1)
            f.seek(size - 3)
            f.write(bytes([b[0] ^ 0x40]))

    def header_dtype(d):  # the same bytes read as another dtype of the same size
        path = os.path.join(d, "rank_00000.safetensors")
        with open(path, "r+b") as f:
            raw = f.read()
            f.seek(0)
            f.write(raw.replace(b'"dtype":"F32"', b'"dtype":"I32"', 1))

    def swap_pieces(d):  # the index moves exp_avg's pieces under exp_avg_sq and back
        path = os.path.join(d, "index.json")
        with open(path) as f:
            index = json.load(f)
        opt = index["tensors"]["optimizer"]
        a, b = opt["fc1.weight:exp_avg"], opt["fc1.weight:exp_avg_sq"]
        a["pieces"], b["pieces"] = b["pieces"], a["pieces"]
        with open(path, "w") as f:
            json.dump(index, f)

    last = "rank_%05d.safetensors" % (world - 1)
    parts = {"truncated": ["incomplete or corrupt", "has 100 bytes, the index says"],
             "flipped": ["corrupt (sha256 of its pieces)", "rank_00000.safetensors: piece",
                         "the index says"],
             "missing": ["incomplete or corrupt", f"{last} (rank {world - 1}'s part) is missing"],
             "header": ["corrupt (sha256 of its pieces)", "is I32", "the index says float32"],
             "swapped": ["incomplete or corrupt", "optimizer/fc1.weight:exp_avg_sq@",
                         "is listed under optimizer tensor 'fc1.weight:exp_avg'"]}
    damaged("truncated", truncate)
    damaged("flipped", flip)
    damaged("missing", lambda d: os.unlink(os.path.join(d, last)))
    damaged("header", header_dtype)
    damaged("swapped", swap_pieces)
    # replicas that disagree after a load (here rank 1's copy of a weight drifts as the
    # parameters are refreshed from the masters) are named
    from fastpar.checkpoint import loading

    fresh, fopt = build(("dp", 1, world, 0, "float32"), grps, seed + 3)  # dp replicas
    real_refresh = loading.refresh_params

    def drift(o):
        real_refresh(o)
        if rank == 1:
            with torch.no_grad():
                fresh.fc2.bias.add_(1e-3)
    loading.refresh_params = drift
    try:
        said.append(expect(lambda: ckpt.load(good, fresh, fopt), ValueError,
                           "the replicas of one shard differ: ranks 0 vs ranks 1"))
    finally:
        loading.refresh_params = real_refresh
    # a held save (no staging copy) whose tensors change while it writes fails, on every rank
    from fastpar.checkpoint import files

    real = files.write

    def write_while_changing(*args, **kwargs):  # the change lands while the file is written
        scramble(par, opt)
        return real(*args, **kwargs)
    files.write = write_while_changing
    try:
        ckpt.save(os.path.join(root, "held"), 1, par, opt, meta={}, async_save=True, hold=True)
        said.append(expect(ckpt.wait, CheckpointError, "changed during a held save"))
    finally:
        files.write = real
    assert not os.path.exists(os.path.join(root, "held", "step_00000001"))
    # a staged save reads nothing live once save() returns: the tensors may change while its
    # file is still being written (held back here), and it keeps the values of the save
    import threading
    import time

    from fastpar.checkpoint.holdings import model_pieces, optimizer_pieces

    def values(m, o):
        return [p.data.clone() for p in model_pieces(m, o) + optimizer_pieces(m, o)[0]]
    before, gate = values(par, opt), threading.Event()

    def write_late(*args, **kwargs):
        gate.wait(10)
        return real(*args, **kwargs)
    files.write = write_late
    try:
        ckpt.save(os.path.join(root, "staged"), 1, par, opt, meta={}, async_save=True)
        t0 = time.perf_counter()
        ckpt.wait_for_reads()
        waited, writing = time.perf_counter() - t0, not gate.is_set()
        scramble(par, opt)
        gate.set()
        ckpt.wait()
    finally:
        gate.set()
        files.write = real
    assert writing and waited < 5, waited  # it did not wait for the held-back write
    fresh, fopt = build(layout, grps, seed + 4)
    ckpt.load(os.path.join(root, "staged"), fresh, fopt)
    assert all(torch.equal(a, b) for a, b in zip(values(fresh, fopt), before))
    # another model: the same names, other shapes
    other = pnn.ParallelMLP(HIDDEN, 2 * FFN, seed=seed, group=grps[(1, world)][0])
    oopt = torch.optim.AdamW(other.parameters(), lr=0.1)
    said.append(expect(lambda: ckpt.load(good, other, oopt), ValueError,
                       "does not fit this model", "shape or dtype mismatches",
                       f"model:fc1.weight (checkpoint ({FFN}, {HIDDEN}) float32, this run "
                       f"({2 * FFN}, {HIDDEN}) float32)"))
    if full_dir is None:
        return {"said": said}
    # a full file system: a small checkpoint fits, a large one does not
    big = pnn.ParallelMLP(64, 512, seed=seed, group=grps[(1, world)][0])
    bopt = torch.optim.AdamW(big.parameters(), lr=0.1)
    big(torch.randn(2, 64)).sum().backward()
    bopt.step()
    ckpt.save(full_dir, 1, par, opt, meta={})
    said.append(expect(lambda: ckpt.save(full_dir, 2, big, bopt, meta={}), CheckpointError,
                       "writing checkpoint", "step_00000002: (every rank)",
                       "No space left on device"))
    ckpt.save(full_dir, 3, big, bopt, meta={}, async_save=True)  # returns: written behind
    said.append(expect(ckpt.wait, CheckpointError, "writing checkpoint", "step_00000003",
                       "No space left on device"))
    fresh, fopt = build(layout, grps, seed + 2)
    assert ckpt.load(full_dir, fresh, fopt)["step"] == 1  # the last good one
    left = sorted(os.listdir(full_dir))
    # a read-only file system
    said.append(expect(lambda: ckpt.save(ro_dir, 1, par, opt, meta={}), CheckpointError,
                       "writing checkpoint", "step_00000001", "Read-only file system"))
    dist.barrier()
    return {"said": said, "left": left, "step": step}


def _mount_tmpfs(path, options) -> bool:
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
                          capture_output=True, text=True)
    return done.returncode == 0


@pytest.mark.quick
@pytest.mark.parametrize("world", [2])
def test_damaged_or_foreign_checkpoints_and_failed_writes_raise_on_every_rank(world, tmp_path):
    full, ro = str(tmp_path / "full"), str(tmp_path / "ro")
    mounted = [d for d, options in ((full, "size=64k"), (ro, "ro,size=64k"))
               if _mount_tmpfs(d, options)]
    try:
        values = run_ranks(world, body_refusals, root=str(tmp_path),
                           full_dir=full if len(mounted) == 2 else None,
                           ro_dir=ro if len(mounted) == 2 else None, timeout=120).values()
    finally:
        for d in mounted:
            subprocess.run(["umount", d], check=False)
    assert all(v["said"] == values[0]["said"] for v in values)  # every rank, the same words
    if len(mounted) < 2:  # what ran passed; the full and read-only disks need root
        pytest.skip("ENOSPC and EROFS need root to mount a small tmpfs (the damaged and "
                    "foreign checkpoints were checked)")
    assert values[0]["left"] == ["latest", "step_00000001"], values[0]["left"]  # no .tmp-
    assert len(values[0]["said"]) == 11


def body_library_save(root):
    """A model saved through the library: no optimizer, no meta of the caller's."""
    import torch

    import fastpar
    from fastpar.checkpoint.sharded import ShardedCheckpointer

    fastpar.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ckpt = ShardedCheckpointer()
    ckpt.save(root, 3, model, meta={})
    ckpt.close()
    fastpar.shutdown()
    return True


def test_a_model_saved_without_optimizer_says_its_layout_and_dtype(tmp_path):
    import subprocess
    import sys

    root = str(tmp_path / "lib")
    assert run_ranks(2, body_library_save, root=root).values() == [True, True]
    text = subprocess.run([sys.executable, "-m", "fastpar.checkpoint", "inspect", root],
                          capture_output=True, text=True, check=True).stdout
    assert "under tp 1, pp 1, dp 2, cp 1, dtype float32" in text, text
    assert "model: 2 tensors" in text and "optimizer: 0 tensors" in text, text
