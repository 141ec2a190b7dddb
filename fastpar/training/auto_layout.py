"""``fastpar.train --layout auto``: the planner chooses the job's layout.

    mpirun -np 4 python -m fastpar.train --layout auto                      # quick calibration
    mpirun -np 4 python -m fastpar.train --layout auto --cluster c.json     # fastpar plan --calibrate's

Every rank joins the job as it was launched (``fastpar.init()``: tp 1, pp 1), which tells the
world and which ranks share a host; rank 0 builds the cluster (``--cluster FILE``, its hosts
and ranks per host replaced by the job's; else a quick calibration of this host: GEMMs,
attention and a copy on rank 0, the all-reduce of every rank over the world, a few seconds),
runs the planner's pruned search for the two fastest layouts that fit the model, batch and
dtype the flags give, and broadcasts its choice, so every rank trains the same layout; then the
job is shut down and the trainer joins it again at that layout. Rank 0 prints the choice, its
predicted step time and the runner-up.

Why a file or a fresh measurement, not a cached one picked up by itself: a calibration is of
one machine under one load; a file the user names is a choice they made (``fastpar plan
--calibrate --cluster FILE`` writes one), a stale one found in the working directory is not.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

def job_shape(hosts: tuple, world: int) -> tuple[int, int]:
    """``(hosts, ranks per host)`` from every rank's host identity; ValueError when the hosts
    hold different numbers of ranks or a host's ranks are not consecutive (the planner's grid
    puts tp fastest, inside a host)."""
    if not hosts:
        return 1, world
    order = list(dict.fromkeys(hosts))
    per = world // len(order)
    if any(hosts.count(h) != per for h in order) or \
            any(hosts[r] != order[r // per] for r in range(world)):
        raise ValueError(f"--layout auto: the {world} ranks are not {len(order)} hosts of "
                         "equal, consecutive ranks; give the layout flags instead")
    return len(order), per


def quick_cluster(cfg, hosts: int, ranks_per_host: int, link_points: list, link_ranks: int,
                  engine: str):
    """This host's speeds, measured now (``plan.calibrate``'s GEMM sweep, attention and
    copy, on this process), with the all-reduce points every rank measured."""
    from fastpar.plan import calibrate
    from fastpar.plan.cluster import Cluster, Link
    from fastpar.plan.fitting import fit

    device = torch.device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's rates (Cluster.rates_per_core)
    try:
        gemm = calibrate.gemm_points(device, torch.float32, reps=5, budget_s=0.3)
        attn = calibrate.attention_points(device, torch.float32)
        membw = calibrate.memory_bandwidth(device)
    finally:
        torch.set_num_threads(threads)
    block, end, tensor = calibrate.host_overheads(cfg, reps=10)
    alpha, busbw = fit(link_ranks, link_points)
    return Cluster(name="quick calibration (fastpar.train --layout auto)", device="cpu",
                   hosts=hosts, ranks_per_host=ranks_per_host,
                   peak_flops=max(p[-1] for p in gemm),
                   memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") /
                   ranks_per_host, membw_Bps=membw, intra=Link(alpha, busbw, engine),
                   inter=None, gemm_points=tuple(gemm), attention_points=tuple(attn),
                   rates_per_core=True, overhead_block_s=block, overhead_end_s=end,
                   overhead_tensor_s=tensor, cpus_per_host=len(os.sched_getaffinity(0)))


def best_layouts(args, cfg, cluster, dtype):
    """The planner's two fastest layouts that fit, as its predictions (or a ValueError naming
    why none does)."""
    from fastpar.plan.search import search

    result = search(cfg, cluster, args.global_batch, dtype=dtype, top=2)
    ranked = [p for p in result.ranked if args.quantize_weights is None or p.layout.zero == 3]
    if not ranked:
        why = f"{len(result.dropped)} cannot run, {len(result.too_big) + result.over_state} " \
              "over memory"
        raise ValueError(f"--layout auto: no layout of {cluster.ranks} ranks fits the model "
                         f"and --global-batch {args.global_batch} ({why}); see python -m "
                         "fastpar plan")
    return ranked


def choose_layout(args) -> tuple[argparse.Namespace, list[str]]:
    """``args`` with the planner's layout in its layout flags, and the lines that say why
    (collective: every rank calls it; the job is shut down on return)."""
    import torch.distributed as dist

    import fastpar
    from fastpar import comm
    from fastpar.plan import calibrate
    from fastpar.plan.cluster import Cluster
    from fastpar.training.args import model_config

    topo = fastpar.init(timeout=args.timeout)
    try:
        hosts, per_host = job_shape(tuple(topo.hosts), topo.world_size)
        cluster = None
        if args.cluster:
            cluster = Cluster.load(args.cluster).with_ranks(hosts, per_host)
            cluster.link("inter") if hosts > 1 else None
            source = f"cluster file {args.cluster}"
        elif hosts > 1:
            raise ValueError(f"--layout auto on {hosts} hosts needs --cluster FILE with an "
                             "'inter' link (python -m fastpar plan --calibrate --inter-gbps ...)")
        else:  # every rank: the world's all-reduce; rank 0 then the rest
            points, engine = calibrate.link_points(topo, comm, sizes=calibrate.LINK_SIZES[:5],
                                                   reps=8, budget_s=0.3)
            source = "a quick calibration of this host; --cluster FILE takes a saved one"
        choice = [None]
        if topo.rank == 0:
            dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
            cfg = dataclasses.replace(model_config(args), recompute="none",
                                      context_parallel=None)
            if cluster is None:
                cluster = quick_cluster(cfg, hosts, per_host, points, topo.world_size, engine)
            try:
                best = best_layouts(args, cfg, cluster, dtype)
                choice = [(best[0].layout, [say(p, i) for i, p in enumerate(best)], source)]
            except ValueError as exc:
                choice = [str(exc)]
        if topo.world_size > 1:
            dist.broadcast_object_list(choice, src=0)
    finally:
        fastpar.shutdown()
    if isinstance(choice[0], str):
        raise ValueError(choice[0])
    lay, lines, source = choice[0]
    chosen = argparse.Namespace(**vars(args))
    chosen.tp, chosen.pp, chosen.cp, chosen.cp_type = lay.tp, lay.pp, lay.cp, "ring"
    chosen.schedule, chosen.virtual_stages = lay.schedule, lay.virtual_stages
    chosen.microbatches, chosen.zero, chosen.recompute = lay.microbatches, lay.zero, \
        lay.recompute
    chosen.ep = lay.ep
    return chosen, [f"[fastpar.train] --layout auto ({source}): " + lines[0]] + lines[1:]


def say(pred, place: int) -> str:
    lay = pred.layout
    what = (f"tp {lay.tp} x pp {lay.pp} x dp {lay.dp}" + (f" x cp {lay.cp}" if lay.cp > 1
                                                            else "") +
            f", ZeRO-{lay.zero}, recompute {lay.recompute}, {lay.schedule}" +
            (f" v{lay.virtual_stages}" if lay.virtual_stages > 1 else "") +
            f", {lay.microbatches} microbatches")
    if place == 0:
        return (f"chose {lay.name} ({what}): predicted {pred.step_time_s * 1e3:.1f} ms per "
                f"step, {pred.memory_total / 2**20:.0f} MiB on its fullest rank")
    return (f"[fastpar.train]   runner-up {lay.name}: predicted "
            f"{pred.step_time_s * 1e3:.1f} ms")
