"""``python -m fastpar.prune``: prune a trainer checkpoint or a Hugging Face directory
(``fastpar.prune``) and save the smaller model as a checkpoint the trainer resumes and as a
Hugging Face directory.

    python -m fastpar.prune --resume runs/a --heads 0.5 --mlp 0.25 --save runs/pruned
    mpirun -np 2 python -m fastpar.prune --hf-model llama-dir --tp 2 --heads 0.25 \\
        --by activations --data notes/ --save runs/pruned --save-hf llama-pruned
    mpirun -np 2 python -m fastpar.train --resume runs/pruned --tp 2 --steps 200   # recovery

The world is tp ranks (``--tp``, default 1). ``--by activations`` measures ``--batches``
batches of ``--batch-size`` windows of ``--data`` (the model's tokenizer; a trainer preset's
bytes default to the trainer's corpus) of ``--seq-len`` tokens. ``--save CKPT``: a weights-only
sharded checkpoint at step 0 with the pruned config (and a Hugging Face model's source);
``python -m fastpar.train --resume CKPT`` trains it at any layout from a fresh optimizer and
learning-rate schedule. ``--save-hf DIR``: the Hugging Face directory of a Hugging Face model
(``fastpar.checkpoint.hf_export``; its config.json with the new head counts, ``head_dim`` and
``intermediate_size``); fastpar's own GPT (a ``--preset`` run) has no Hugging Face form.
An error every rank sees is one line from rank 0 and exit status 2.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import torch

import fastpar
from fastpar.checkpoint import loading
from fastpar.checkpoint.hf_export import export_hf
from fastpar.checkpoint.sharded import ShardedCheckpointer
from fastpar.hf_files import SafetensorsReader
from fastpar.models.config import GPTConfig
from fastpar.models.hf import WINDOW, hf_config, read_hf_config, window
from fastpar.models.hf_weights import load_layer
from fastpar.pruning.selection import BY, counts
from fastpar.pruning.structured import empty_gpt, kept_units, pruned_model
from fastpar.runtime.cli import Parser, on_lead, run_command
from fastpar.state_dict import full_state_dict
from fastpar.training.data import Sampler
from fastpar.training.hf_run import text_corpus

PROG = "python -m fastpar.prune"


def parser() -> Parser:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_model_source()
    p.add_argument("--heads", type=float, default=0.0, metavar="F",
                   help="the fraction of attention heads (whole KV groups under GQA) to remove")
    p.add_argument("--mlp", type=float, default=0.0, metavar="F",
                   help="the fraction of MLP channels to remove")
    p.add_argument("--by", choices=BY, default="magnitude",
                   help="the importance score (default magnitude; fastpar.pruning.importance)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--data", metavar="PATH", help="--by activations: the calibration text")
    p.add_argument("--data-field", default="text", help="the text field of --data's JSON lines")
    p.add_argument("--batches", type=int, default=4, help="calibration batches (default 4)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default 8)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence, the pruned config's (default: the checkpoint's; "
                        f"a Hugging Face model's context up to {WINDOW})")
    p.add_argument("--seed", type=int, default=0, help="calibration windows, --by random")
    p.add_argument("--save", metavar="CKPT", help="write the pruned model as a checkpoint")
    p.add_argument("--save-hf", metavar="DIR", help="write it as a Hugging Face directory")
    return p


def check(args) -> None:
    """The flags against each other and the file system (ValueError, before anything runs)."""
    for name in ("tp", "batches", "batch_size", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if not (args.heads or args.mlp):
        raise ValueError("--heads and --mlp are both 0: nothing to remove")
    if not (args.save or args.save_hf):
        raise ValueError("nothing would be written: pass --save CKPT and/or --save-hf DIR")
    if args.data and args.by != "activations":
        raise ValueError(f"--data is the calibration text of --by activations, not --by "
                         f"{args.by}")
    for flag, path in (("--save", args.save), ("--save-hf", args.save_hf)):
        if path and os.path.exists(path) and not (os.path.isdir(path) and not os.listdir(path)):
            raise ValueError(f"{flag} {path} exists and is not an empty directory; not "
                             "overwritten")


def load_source(args, topo, ckpt) -> tuple:
    """``(GPT at tp, float32, source meta)`` of ``--hf-model`` or ``--resume``: each rank reads
    its shards. The meta holds what the pruned checkpoint carries over (a Hugging Face model's
    ``"hf"``: its config, dtype and directory)."""
    group = topo.tp_group
    if args.hf_model:
        raw = read_hf_config(args.hf_model)
        cfg, info = hf_config(raw, seq_len=window(raw, args.seq_len))
        refuse_gpt2_heads(info.model_type, args.heads)
        refuse_quantized(args.hf_model, getattr(info, "weights", None))
        model = empty_gpt(cfg, group, device=topo.device)
        reader = SafetensorsReader(args.hf_model)
        for i, layer in enumerate(model):
            load_layer(layer, i, cfg, info, reader)
        return model, {"hf": {"config": info.config, "dtype": info.dtype,
                              "files": os.path.abspath(args.hf_model)}}
    directory, index, meta = loading.trainer_checkpoint(args.resume)
    refuse_quantized(directory, meta.get("weights"))
    cfg = dataclasses.replace(GPTConfig(**meta["model"]), sequence_parallel=False,
                              context_parallel=None, recompute="none")
    if args.seq_len:  # learned positions keep their table's rows
        rows = cfg.position_rows if cfg.positions == "learned" else cfg.max_positions
        cfg = dataclasses.replace(cfg, seq_len=args.seq_len, max_positions=rows)
    if meta.get("hf"):
        refuse_gpt2_heads(meta["hf"]["config"]["model_type"], args.heads)
    model = empty_gpt(cfg, group, device=topo.device, dtype=loading.stored_dtype(index))
    ckpt.load(directory, model, None)
    return model.float(), {"hf": meta["hf"]} if meta.get("hf") else {}


def refuse_gpt2_heads(model_type: str, heads: float) -> None:
    if model_type == "gpt2" and heads:
        raise ValueError(f"--heads {heads:g}: GPT-2's attention is n_embd wide (its config has "
                         "no head_dim), so its heads cannot be removed; prune --mlp only")


def refuse_quantized(path: str, weights: dict | None) -> None:
    if weights:
        raise ValueError(f"{path} holds quantized weights ({weights}): prune the float model, "
                         "then quantize the pruned one")


def hf_fields(config: dict, cfg: GPTConfig) -> dict:
    """A Hugging Face config with the pruned sizes (GPT-2: ``n_inner``; Llama's family: the
    head counts, ``head_dim``, ``intermediate_size``)."""
    if config["model_type"] == "gpt2":
        return {**config, "n_inner": cfg.ffn_size}
    return {**config, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_size, "intermediate_size": cfg.ffn_size}


def calibration(args, cfg: GPTConfig, topo, source: dict) -> list[torch.Tensor] | None:
    """``--batches`` token batches (B, T) for ``--by activations`` (None otherwise): windows of
    the training split of ``--data`` (or the trainer's byte corpus) drawn by ``--seed``."""
    if args.by != "activations":
        return None
    files = (source.get("hf") or {}).get("files")
    corpus = text_corpus(args.data, args.data_field, files, cfg, topo, "--by activations")
    sampler = Sampler(corpus.train, cfg.seq_len, args.batch_size, args.seed)
    return [sampler.batch(i)[0] for i in range(args.batches)]


def save(args, small, meta: dict, ckpt, lead: bool) -> None:
    """``--save`` (collective) and ``--save-hf`` (rank 0 exports the checkpoint, or a
    weights-only one written beside DIR first)."""
    path = None
    if args.save:
        path = ckpt.save(args.save, 0, small, None, meta=meta)
        if lead:
            print(f"fastpar.prune: saved {path} (python -m fastpar.train --resume {args.save} "
                  "trains it at any layout)", flush=True)
    if not args.save_hf:
        return
    tmp = None
    if path is None:
        tmp = f"{os.path.abspath(args.save_hf).rstrip(os.sep)}.fastpar-weights"
        if lead:  # a killed run's leftovers (the save's first exchange waits for this)
            shutil.rmtree(tmp, ignore_errors=True)
        path = ckpt.save(tmp, 0, small, None, meta=meta, keep=1)

    def export():
        out = export_hf(path, args.save_hf)
        print(f"fastpar.prune: saved a Hugging Face model to {args.save_hf}: "
              f"{len(out['files'])} files, {out['bytes'] / 2**20:.2f} MiB", flush=True)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    on_lead(f"--save-hf {args.save_hf}", export)


def main(argv=None) -> int:
    """Errors the same on every rank (bad flags, a model it cannot prune) are one line, from
    the first rank."""
    return run_command(PROG, run, parser().parse_args(argv))


def run(args) -> int:
    check(args)
    topo = fastpar.init(tp=args.tp)
    if topo.dp_size != 1:
        raise ValueError(f"{topo.world_size} ranks for --tp {args.tp}: pruning runs one model, "
                         f"launch as many ranks as --tp")
    lead = topo.rank == 0
    ckpt = ShardedCheckpointer()
    model, source = load_source(args, topo, ckpt)
    if args.save_hf and "hf" not in source:
        raise ValueError(f"--save-hf {args.save_hf}: {args.resume} is fastpar's own GPT (a "
                         "--preset run), which has no Hugging Face form; --save writes it as a "
                         "checkpoint")
    counts(model.cfg, args.heads, args.mlp, topo.tp_size)  # errors before the calibration
    data = calibration(args, model.cfg, topo, source)
    full = full_state_dict(model)
    kept = kept_units(model, args.heads, args.mlp, args.by, data, seed=args.seed, full=full)
    small = pruned_model(model, kept, full)
    before, after = model.cfg, small.cfg
    if lead:
        print(f"fastpar.prune: {args.resume or args.hf_model}: by {args.by}, each of "
              f"{before.layers} blocks keeps heads {after.heads} of {before.heads} (kv_heads "
              f"{after.num_kv_heads} of {before.num_kv_heads}) and MLP channels "
              f"{after.ffn_size} of {before.ffn_size}; {before.num_params() / 1e6:.3f} M -> "
              f"{after.num_params() / 1e6:.3f} M parameters", flush=True)
    meta = {"model": dataclasses.asdict(after),
            "pruned": {**kept.record(), "source": os.path.abspath(args.resume or args.hf_model)},
            "layout": {"tp": topo.tp_size, "pp": 1, "dp": 1, "cp": 1, "zero": 0},
            "dtype": "float32"}
    if "hf" in source:
        meta["hf"] = {**source["hf"], "config": hf_fields(source["hf"]["config"], after)}
    save(args, small, meta, ckpt, lead)
    ckpt.close()
    fastpar.shutdown()
    return 0
