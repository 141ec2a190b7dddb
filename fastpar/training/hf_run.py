"""What a run of the main job does for a Hugging Face model (``--hf-model``, ``--hf-config``),
beside fastpar's own GPT: its data, tokenized by the model's tokenizer (``load_data``), and its
export at the end (``save_hf``). The model itself is built by ``models.hf_weights.hf_layers``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch

from fastpar.checkpoint.hf_export import export_hf
from fastpar.training.data import builtin_corpus, load_corpus
from fastpar.training.tokens import tokenized_corpus


def load_data(args, cfg, topo, hf_info, model_dir=None):
    """The corpus: ``--data`` tokenized by a Hugging Face model's tokenizer (rank 0 first: it
    builds the token cache the others then read; its error raised on every rank), else bytes
    (``--data`` or the stdlib), which the model's vocabulary must hold. ``model_dir``: the
    tokenizer's directory (None: ``--hf-model``, or ``--hf-config``'s)."""
    if not (args.data and hf_info is not None):
        if cfg.vocab_size < 256:  # the byte-level corpus: token ids are bytes
            raise ValueError(f"the model's vocabulary of {cfg.vocab_size} tokens is smaller "
                             "than the byte-level corpus' 256; give --data (tokenized by the "
                             "model's tokenizer)")
        return load_corpus(args.data, cfg.seq_len) if args.data else builtin_corpus()
    model_dir = model_dir or args.hf_model or os.path.dirname(os.path.abspath(args.hf_config))
    lead = topo.rank == 0

    def made():
        return tokenized_corpus(args.data, model_dir, cfg.seq_len, cfg.vocab_size,
                                args.data_field, lead=lead, progress=not args.no_progress)
    corpus, problem = None, None
    wait = _long_wait()  # collective: before rank 0 starts the long work
    if lead:
        try:
            corpus = made()
        except Exception as exc:  # noqa: BLE001 - every rank raises it, none waits on
            problem = f"--data {args.data}: {type(exc).__name__}: {exc}"
    said = [problem]
    torch.distributed.broadcast_object_list(said, src=0, group=wait)
    torch.distributed.destroy_process_group(wait)
    if said[0]:
        raise ValueError(said[0])
    return corpus if lead else made()


def text_corpus(data: str | None, field: str, tokenizer_dir: str | None, cfg, topo, what: str):
    """The corpus a command scores or calibrates a model on (``evaluate``, ``prune``):
    ``data`` tokenized by the tokenizer in ``tokenizer_dir`` (a Hugging Face model's: ``data``
    is then required) or as bytes (``data``, else the trainer's corpus), as ``load_data``
    makes it for the trainer."""
    if tokenizer_dir and not data:
        raise ValueError(f"{what} on a Hugging Face model needs its text: pass --data PATH (the "
                         "default corpus is bytes, the trainer presets' tokens)")
    args = argparse.Namespace(data=data, hf_model=tokenizer_dir, hf_config=None,
                              data_field=field, no_progress=True)
    return load_data(args, cfg, topo, {} if tokenizer_dir else None)


def _long_wait():
    """A gloo group of the world whose timeout is a day: the other ranks wait there while rank
    0 tokenizes a corpus or writes a model, work that may take longer than --timeout."""
    import datetime

    return torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(days=1))


def save_hf(trainer) -> None:
    """``--save-hf DIR``: the weights of record saved as a model-only sharded checkpoint beside
    DIR (collective), then written by rank 0 as a Hugging Face directory, one tensor at a time
    (``checkpoint.hf_export``); every rank raises if it failed."""
    args, lead = trainer.args, trainer.topo.rank == 0
    tmp = f"{os.path.abspath(args.save_hf).rstrip(os.sep)}.fastpar-weights"
    t0 = time.perf_counter()
    if lead:  # a killed run's leftovers (the save's first exchange waits for this)
        shutil.rmtree(tmp, ignore_errors=True)
    trainer.ckpt.save(tmp, trainer.steps, trainer.pipe, trainer.setup.opt,
                      meta=trainer.checkpoints.meta(), keep=1, optimizer_state=False)
    problem = None
    wait = _long_wait()
    if lead:
        try:
            out = export_hf(tmp, args.save_hf, args.save_hf_shard_mb << 20)
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"[fastpar.train] saved a Hugging Face model to {args.save_hf}: "
                  f"{len(out['files'])} files, {out['bytes'] / 2**20:.2f} MiB, one tensor at "
                  f"a time (peak {out['peak_bytes'] / 2**20:.2f} MiB) in "
                  f"{time.perf_counter() - t0:.2f} s", flush=True)
        except Exception as exc:  # noqa: BLE001 - every rank raises it; the weights stay
            problem = (f"--save-hf {args.save_hf}: {type(exc).__name__}: {exc}; the trained "
                       f"weights are kept in {tmp} (python -m fastpar.checkpoint export --hf "
                       f"DIR {tmp})")
    said = [problem]
    torch.distributed.broadcast_object_list(said, src=0, group=wait)
    torch.distributed.destroy_process_group(wait)
    if said[0]:
        raise ValueError(said[0])
