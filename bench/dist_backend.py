"""The torch.distributed backend "fastpar" beside gloo, in one job: every rank holds a fastpar
group, a gloo group and fastpar.comm over the world, so each line of the table runs the same
call on the same ranks.

    mpirun -np 2 python bench/dist_backend.py                      # ops 4 KB - 64 MB, programs
    mpirun -np 4 python bench/dist_backend.py --programs "" -b 4K -e 16M --json out.json
    mpirun -np 2 python bench/dist_backend.py --ops "" --programs hf

Ops (``--ops``): ``dist.<op>`` on the fastpar group and on the gloo group, and the same call
through ``fastpar.comm`` (the engines without torch.distributed: the backend's own overhead
is ``dist fastpar`` over ``comm``); each point the slowest rank's median of ``-n`` calls, as
bench/collectives.py measures. Programs (``--programs``), each a step or token time on
fastpar, on gloo and (``1 proc``) in one process doing the whole batch alone while the others
wait: a DDP step of an MLP 4096 x 4096 x 3 (batch 8 per rank), an FSDP2 step of the same, a
DTensor tensor-parallel MLP step (Colwise, Rowwise; hidden 4096, batch 8), and Hugging Face
transformers' own tensor-parallel greedy ``generate`` of a Llama made from a config (hidden
512, 4 layers, 48 new tokens) at batch 1 and 8: tokens/s. Ratios are ``gloo / fastpar``
(above 1: fastpar faster).
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import fastpar
from fastpar import comm
from fastpar.runtime.cli import Parser

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
PROGRAMS = ("ddp", "fsdp2", "dtensor", "hf")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def slowest(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def timed(call, iters: int, group) -> float:
    """Seconds per call: the slowest rank's median of ``iters`` calls after warm-up."""
    for _ in range(max(2, iters // 10)):
        call()
    dist.barrier(group=group)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return slowest(statistics.median(times), group)


def op_call(op, how, x, out, group, n):
    """One call of ``op`` by ``how`` ("fastpar" / "gloo": torch.distributed on that group;
    "comm": fastpar.comm on the world)."""
    if how == "comm":
        return {"all_reduce": lambda: comm.all_reduce(x),
                "all_gather": lambda: comm.all_gather(x, out=out),
                "reduce_scatter": lambda: comm.reduce_scatter(out, out=x),
                "broadcast": lambda: comm.broadcast(x, src=0),
                "all_to_all": lambda: comm.all_to_all(x, out=out)}[op]
    return {"all_reduce": lambda: dist.all_reduce(x, group=group),
            "all_gather": lambda: dist.all_gather_into_tensor(out, x, group=group),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(x, out, group=group),
            "broadcast": lambda: dist.broadcast(x, src=0, group=group),
            "all_to_all": lambda: dist.all_to_all_single(out, x, group=group)}[op]


def bench_ops(args, groups, rank, n) -> list[dict]:
    rows = []
    size = parse_size(args.b)
    while size <= parse_size(args.e):
        count = size // 4
        for op in args.ops:
            per = count - count % n if op in ("all_to_all", "reduce_scatter") else count
            if per == 0:
                continue
            x = torch.full((per,), float(rank + 1))
            out = torch.empty(per * n if op == "all_gather" else per)
            if op == "reduce_scatter":  # x: this rank's block, out: the input of n blocks
                x, out = torch.empty(per // n), torch.ones(per)
            iters = args.n if size < (8 << 20) else max(5, args.n // 5)
            row = {"op": op, "bytes": size, "ranks": n}
            for how in ("fastpar", "gloo", "comm"):
                row[f"{how}_us"] = 1e6 * timed(op_call(op, how, x, out, groups[how], n), iters,
                                               groups["gloo"])
            row["gloo_over_fastpar"] = row["gloo_us"] / row["fastpar_us"]
            row["fastpar_over_comm"] = row["fastpar_us"] / row["comm_us"]
            rows.append(row)
            if rank == 0:
                print(f"{op:<15}{size:>10}{row['fastpar_us']:>12.1f}{row['gloo_us']:>12.1f}"
                      f"{row['comm_us']:>12.1f}{row['gloo_over_fastpar']:>10.1f}"
                      f"{row['fastpar_over_comm']:>10.2f}", flush=True)
        size *= args.f
    return rows


def mlp(width: int, depth: int = 3):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def step_time(model, params, steps, group, rows=8, width=4096) -> float:
    opt = torch.optim.SGD(params, lr=1e-3)
    x = torch.randn(rows, width)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return timed(step, steps, group)


def program(name, how, group, args, rank, n) -> float:
    """Seconds per step of ``name`` on ``group``."""
    from torch.distributed.device_mesh import DeviceMesh

    if name == "ddp":
        model = mlp(4096)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        return step_time(ddp, ddp.parameters(), args.steps, group)
    mesh = DeviceMesh.from_group(group, "cpu")
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = mlp(4096)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return step_time(model, model.parameters(), args.steps, group)
    if name == "dtensor":
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        model = mlp(4096, depth=2)
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return step_time(model, model.parameters(), args.steps, group)
    raise ValueError(name)


def hf_model(path: str | None = None, tp: int = 1):
    """The bench's Llama: made from its config (seeded), or loaded from ``path`` with
    transformers' own tensor parallelism over ``tp`` ranks of the default group."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1408,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=256, tie_word_embeddings=False)
    if path is None:
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()
    return LlamaForCausalLM.from_pretrained(path, tp_plan="auto", tp_size=tp,
                                            dtype=torch.float32).eval()


def generate_time(model, batch: int, tokens: int) -> float:
    """Seconds per generated token of greedy ``generate`` at ``batch`` (16-token prompts)."""
    ids = torch.randint(5, 2000, (batch, 16), generator=torch.Generator().manual_seed(1))
    model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                         pad_token_id=0)
    assert out.shape[1] == 16 + tokens
    return (time.perf_counter() - t0) / tokens


def bench_programs(args, groups, rank, n) -> list[dict]:
    rows = []
    for name in (p for p in args.programs if p != "hf"):
        row = {"program": name, "ranks": n}
        for how in ("fastpar", "gloo"):
            row[f"{how}_ms"] = 1e3 * program(name, how, groups[how], args, rank, n)
        one = None
        if rank == 0:  # the whole batch in this process alone; the others wait at the barrier
            model = mlp(4096, depth=2 if name == "dtensor" else 3)
            one = single_step(model, 8 if name == "dtensor" else 8 * n, args.steps)
        row["one_process_ms"] = 1e3 * shared(one, groups["gloo"])
        row["gloo_over_fastpar"] = row["gloo_ms"] / row["fastpar_ms"]
        rows.append(row)
        show(row, rank)
    return rows


def bench_hf(args, rank, n, tmp) -> list[dict]:
    """transformers sizes its mesh from the default group: each backend gets the default group
    in turn (file:// rendezvous in ``tmp``, shared by the ranks)."""
    from fastpar.backend import served

    if rank == 0:
        hf_model().save_pretrained(f"{tmp}/llama")
    rows = []
    for batch in (1, 8):
        row = {"program": f"hf generate batch {batch}", "ranks": n}
        for how in ("fastpar", "gloo"):
            dist.init_process_group(how, init_method=f"file://{tmp}/rdv-{how}-{batch}",
                                    rank=rank, world_size=n)
            dist.barrier()
            row[f"{how}_ms"] = 1e3 * slowest(
                generate_time(hf_model(f"{tmp}/llama", n), batch, args.tokens), None)
            if how == "fastpar":
                row["fastpar_all_reduces_on_shm"] = served().get("allreduce", {}).get("shm", 0)
            dist.barrier()
            dist.destroy_process_group()
        if rank == 0:
            row["one_process_ms"] = 1e3 * generate_time(hf_model(), batch, args.tokens)
        row["gloo_over_fastpar"] = row["gloo_ms"] / row["fastpar_ms"]
        rows.append({**row, **{k.replace("_ms", "_tokens_per_s"): batch * 1e3 / row[k]
                               for k in ("fastpar_ms", "gloo_ms", "one_process_ms") if k in row}})
        show(row, rank)
    return rows


def shared(value, group):
    """Rank 0's ``value`` on every rank."""
    held = [value]
    dist.broadcast_object_list(held, src=0, group=group)
    return held[0]


def show(row, rank):
    if rank == 0:
        print(f"{row['program']:<22}{row['fastpar_ms']:>12.2f}{row['gloo_ms']:>12.2f}"
              f"{row.get('one_process_ms', float('nan')):>12.2f}"
              f"{row['gloo_over_fastpar']:>10.2f}", flush=True)


def single_step(model, rows, steps) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(rows, 4096)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated; '' for none")
    p.add_argument("--programs", default=",".join(PROGRAMS), help="comma-separated; '' for none")
    p.add_argument("-b", default="4K", help="smallest message (bytes, K, M)")
    p.add_argument("-e", default="64M", help="largest message")
    p.add_argument("-f", type=int, default=4, help="size factor")
    p.add_argument("-n", type=int, default=100, help="timed calls per point")
    p.add_argument("--steps", type=int, default=5, help="timed steps per program")
    p.add_argument("--tokens", type=int, default=48, help="new tokens per generate")
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args()
    args.ops = [o for o in args.ops.split(",") if o]
    args.programs = [o for o in args.programs.split(",") if o]
    for name in args.ops + args.programs:
        if name not in OPS + PROGRAMS:
            p.error(f"unknown op or program {name!r}; expected some of {', '.join(OPS + PROGRAMS)}")
    topo = fastpar.init()
    rank, n = topo.rank, topo.world_size
    groups = {"fastpar": dist.new_group(backend="fastpar"), "gloo": dist.new_group(backend="gloo"),
              "comm": None}
    result = {"ranks": n, "ops": [], "programs": []}
    if args.ops:
        if rank == 0:
            print(f"{'op':<15}{'bytes':>10}{'fastpar us':>12}{'gloo us':>12}{'comm us':>12}"
                  f"{'gloo/fp':>10}{'fp/comm':>10}")
        result["ops"] = bench_ops(args, groups, rank, n)
    if args.programs and rank == 0:
        print(f"\n{'program':<22}{'fastpar ms':>12}{'gloo ms':>12}{'1 proc ms':>12}"
              f"{'gloo/fp':>10}")
    if set(args.programs) - {"hf"}:
        result["programs"] = bench_programs(args, groups, rank, n)
    tmp = shared(tempfile.mkdtemp(prefix="fastpar-bench-") if rank == 0 else None,
                 groups["gloo"])
    fastpar.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    if "hf" in args.programs:
        result["programs"] += bench_hf(args, rank, n, tmp)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
