"""What activation recomputation costs in step time and saves in activations, on the GPT, with
the variants interleaved step by step in one process: separate jobs on a shared machine vary
between themselves by more than recomputation costs (bench/memory.py's rows, each its own job,
give the memory; this gives the ratios).

    python bench/recompute.py                          # dropout 0 and 0.1, 12 rounds
    python bench/recompute.py --dropout 0.1 --rounds 20 --json out.json

One process, one intra-op thread, ``fastpar.init()`` (tp 1). The model: ``fastpar.models.GPT``
(4 layers, hidden 256, 8 heads, 4 x 256 tokens: bench/memory.py's gpt), forward and backward of
``gpt_loss`` per step. Variants, each its own model from the same seed on the same batch:

* ``none``, ``selective``, ``full``: ``GPTConfig.recompute`` (fastpar.nn.recompute; selective
  with attention dropout on the CPU runs ``dropout_attention``);
* ``torch-full``, ``torch-selective`` (dropout 0 only): ``torch.utils.checkpoint`` (non-reentrant,
  the standard engine) around each block's body or each attention core of the ``none`` model.
  With dropout its recompute would draw other masks (fastpar's "tp" stream is forked inside the
  region, and torch restores only its own generators), so those rows are left out there.

Every variant's loss and gradients are compared with ``none``'s before timing (float32: within
1e-5 relative; the recompute variants of fastpar equal none's bitwise but selective with
dropout, whose kernels differ). Each round runs one step of every variant in turn after
``--warmup`` rounds; a variant's ``min`` and ``median`` step times over the rounds and their
ratios to ``none``'s are the result. ``saved``: the bytes autograd keeps from forward to backward
in one step (each storage once, parameters left out), for the activations each variant keeps.
"""

import json
import statistics
import time

import torch

import fastpar
from fastpar.runtime.cli import Parser

MODES = ("none", "selective", "full")
SIZES = {"full": {"seq_len": 256, "layers": 4, "hidden": 256, "heads": 8},  # memory.py's gpt
         "tiny": {"seq_len": 16, "layers": 2, "hidden": 32, "heads": 4}}  # the suite's smoke run
BATCH = 4


def build(mode: str, dropout: float, size: dict, seed: int = 0):
    """The GPT with ``mode``'s recomputation; ``torch-*``: the none model with
    ``torch.utils.checkpoint`` around each block's body or attention core."""
    from torch.utils.checkpoint import checkpoint

    from fastpar.models import GPT, GPTBlock, GPTConfig

    ours = mode if mode in MODES else "none"
    cfg = GPTConfig(**size, dropout=dropout, recompute=ours)
    model = GPT(cfg, seed=seed)
    for block in model.modules():
        if not isinstance(block, GPTBlock):
            continue
        if mode == "torch-full":
            body = block._forward
            block._forward = lambda h, body=body: checkpoint(body, h, use_reentrant=False)
        elif mode == "torch-selective":
            core = block.attn._core
            block.attn._core = lambda q, k, v, core=core: checkpoint(core, q, k, v,
                                                                      use_reentrant=False)
    return model


def step(model, tokens, saved=None):
    """One forward and backward; ``saved``: a list that gets the bytes autograd kept."""
    from fastpar.models import gpt_loss

    model.zero_grad(set_to_none=True)
    fastpar.nn.random.seed(1)  # every variant draws the same dropout masks
    torch.manual_seed(1)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = set()

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            saved.append(s.nbytes())
        return t
    t0 = time.perf_counter()
    if saved is None:
        loss = gpt_loss(model(tokens[:, :-1]), tokens[:, 1:])
    else:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = gpt_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return time.perf_counter() - t0, loss.detach()


def run(dropout: float, rounds: int, warmup: int, size: dict) -> list[dict]:
    modes = MODES + (("torch-selective", "torch-full") if dropout == 0 else ())
    models = {m: build(m, dropout, size) for m in modes}
    tokens = torch.randint(256, (BATCH, size["seq_len"] + 1),
                           generator=torch.Generator().manual_seed(3))
    rows, ref = {}, None
    for m, model in models.items():
        saved = []
        _, loss = step(model, tokens, saved)
        grads = [p.grad.clone() for p in model.parameters()]
        if ref is None:
            ref = (loss, grads)
        worst = max([((loss - ref[0]).abs() / ref[0].abs()).item()] + [
            ((g - r).norm() / r.norm().clamp_min(1e-30)).item() for g, r in zip(grads, ref[1])])
        if worst > 1e-5:
            raise SystemExit(f"{m} at dropout {dropout}: loss or a gradient differs from none's "
                             f"by {worst:.2e} (relative): a wrong recompute")
        rows[m] = {"dropout": dropout, "variant": m, "saved_bytes": sum(saved),
                   "check": worst, "times": []}
    for r in range(warmup + rounds):
        for m, model in models.items():
            t, _ = step(model, tokens)
            if r >= warmup:
                rows[m]["times"].append(t)
    base = rows["none"]
    for row in rows.values():
        row["min_ms"] = 1e3 * min(row["times"])
        row["median_ms"] = 1e3 * statistics.median(row["times"])
        row["min_vs_none"] = row["min_ms"] / (1e3 * min(base["times"]))
        row["median_vs_none"] = row["median_ms"] / (1e3 * statistics.median(base["times"]))
    return list(rows.values())


def main() -> None:
    p = Parser(description=__doc__)
    p.add_argument("--dropout", default="0,0.1", help="comma list of dropout rates")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a tiny GPT (the suite's smoke run)")
    p.add_argument("--json", help="write the rows to this path")
    args = p.parse_args()
    rates = [float(x) for x in args.dropout.split(",")]
    p.check(all(0 <= r < 1 for r in rates), f"--dropout: rates in [0, 1), got {rates}")
    p.check(args.rounds >= 1 and args.warmup >= 0,
            f"--rounds >= 1 and --warmup >= 0, got {args.rounds} and {args.warmup}")
    size = SIZES["tiny" if args.tiny else "full"]
    torch.set_num_threads(1)
    fastpar.init()
    rows = []
    print(f"{'dropout':>7} {'variant':<16} {'saved MiB':>9} {'min ms':>8} {'x none':>6} "
          f"{'median ms':>9} {'x none':>6}")
    for rate in rates:
        for row in run(rate, args.rounds, args.warmup, size):
            rows.append(row)
            print(f"{rate:>7} {row['variant']:<16} {row['saved_bytes'] / 2**20:>9.1f} "
                  f"{row['min_ms']:>8.1f} {row['min_vs_none']:>6.2f} {row['median_ms']:>9.1f} "
                  f"{row['median_vs_none']:>6.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {"rounds": args.rounds, "warmup": args.warmup, "model": size,
                                  "batch": BATCH}, "rows": rows}, f, indent=1)
    fastpar.shutdown()


if __name__ == "__main__":
    main()
