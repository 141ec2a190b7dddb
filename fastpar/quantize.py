"""``python -m fastpar.quantize``: a model saved with its linear layers' weights as int8 or int4.

    python -m fastpar.quantize --resume runs/ckpt --weights int4 --save runs/ckpt-int4
    python -m fastpar.quantize --hf-model llama-dir --weights int8 --save runs/llama-int8 \\
        --save-hf llama-int8
    mpirun -np 2 python -m fastpar.generate --resume runs/ckpt-int4 --tp 2 --prompt "def "

The model (a trainer checkpoint, or a Hugging Face directory fastpar learns) is built at
``--tp`` (world = tp; one process is enough: the quantized model is the same at every tp) and
quantized by ``fastpar.quantize_weights``. ``--save CKPT``: a sharded checkpoint of it (the
source checkpoint's meta, and ``"weights": {"format", "group_size"}``) that
``python -m fastpar.generate`` and ``python -m fastpar.evaluate`` load at any tp (``--resume``),
resharded exactly; inference only (the trainer refuses it). ``--save-hf DIR``: a Hugging Face
directory (Llama-family models) whose config.json carries ``quantization_config`` (fastpar's
format: ``"quant_method": "fastpar"``) and whose tensors are each linear's ``qweight``,
``scales`` (and ``offsets``), which fastpar's ``--hf-model`` reads; transformers itself does not
know the format (export a float model for it).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys

import torch
from torch import nn

import fastpar
from fastpar.checkpoint import loading
from fastpar.checkpoint.hf_export import export_hf
from fastpar.checkpoint.sharded import ShardedCheckpointer
from fastpar.hf_files import SafetensorsReader
from fastpar.models.config import GPTConfig
from fastpar.models.gpt import gpt_layers
from fastpar.models.hf import hf_config, read_hf_config
from fastpar.models.hf_weights import hf_layers
from fastpar.nn.quantized import quantized_meta
from fastpar.runtime.cli import Parser, on_lead, run_command


def parser() -> Parser:
    p = Parser(prog="python -m fastpar.quantize", description=__doc__.split("\n\n")[0])
    p.add_model_source()
    p.add_argument("--weights", choices=("int8", "int4"), required=True)
    p.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="input columns per scale (default: 128 int8, 64 int4)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--save", metavar="CKPT", help="write a sharded checkpoint here")
    p.add_argument("--save-hf", metavar="DIR", help="write a Hugging Face directory here")
    return p


def source(args) -> tuple[nn.Module, dict]:
    """``(the model under the trainer checkpoint's keys, the meta a checkpoint of it
    carries)``: this rank's tp shards of ``--resume`` or ``--hf-model``."""
    if args.hf_model:
        cfg, info = hf_config(read_hf_config(args.hf_model))
        layers = hf_layers(cfg, info, SafetensorsReader(args.hf_model))
        meta = {"model": dataclasses.asdict(cfg),
                "hf": {"config": info.config, "dtype": info.dtype,
                       "files": os.path.abspath(args.hf_model)}}
        return nn.Sequential(*[make() for make in layers]), meta
    directory, _, meta = loading.trainer_checkpoint(args.resume)
    meta = dict(meta)
    if meta.get("weights"):
        raise ValueError(f"{directory} is quantized already ({meta['weights']['format']})")
    model = nn.Sequential(*[make() for make in gpt_layers(GPTConfig(**meta["model"]))])
    ShardedCheckpointer().load(directory, model, None)
    meta.pop("scheduler", None)  # a trainer's: the quantized model is not trained further
    return model, meta


def main(argv=None) -> int:
    return run_command("python -m fastpar.quantize", run, parser().parse_args(argv))


def run(args) -> int:
    if not (args.save or args.save_hf):
        raise ValueError("nothing to write: pass --save CKPT and/or --save-hf DIR")
    if args.save_hf and os.path.exists(args.save_hf) and os.listdir(args.save_hf):
        raise ValueError(f"--save-hf {args.save_hf} exists and is not empty; not overwritten")
    topo = fastpar.init(tp=args.tp)
    if topo.tp_size != topo.world_size:
        raise ValueError(f"launch exactly --tp {args.tp} ranks, not {topo.world_size}")
    lead = topo.rank == 0
    with torch.device(topo.device):
        model, meta = source(args)
    if args.save_hf and "hf" not in meta:
        raise ValueError(f"--save-hf needs a Hugging Face model: {args.resume} is fastpar's "
                         "own GPT (a --preset run); --save writes it as a checkpoint")
    meta["layout"] = {"tp": topo.tp_size, "pp": 1, "dp": 1, "cp": 1, "zero": 0}
    before = sum(t.nbytes for t in model.state_dict().values())
    fastpar.quantize_weights(model, args.weights, args.group_size)
    meta["weights"] = quantized_meta(model)
    after = sum(t.nbytes for t in model.state_dict().values())
    if lead:
        print(f"fastpar.quantize: {args.weights} (group {meta['weights']['group_size']}): "
              f"rank 0's weights {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB",
              flush=True)
    writer = ShardedCheckpointer()
    if args.save:
        writer.save(args.save, 0, model, meta=meta, keep=1)
        if lead:
            print(f"fastpar.quantize: saved {args.save}", flush=True)
    if args.save_hf:
        tmp = f"{os.path.abspath(args.save_hf).rstrip(os.sep)}.fastpar-weights"
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        writer.save(tmp, 0, model, meta=meta, keep=1)

        def export():
            out = export_hf(tmp, args.save_hf)
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"fastpar.quantize: saved {args.save_hf} ({len(out['files'])} files, "
                  f"{out['bytes'] / 2**20:.1f} MiB)", flush=True)
        on_lead(f"--save-hf {args.save_hf}", export)
    fastpar.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
