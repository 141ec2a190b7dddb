"""The user's own text for a Hugging Face model: ``--data PATH`` tokenized with the model
directory's tokenizer (``tokenizer.json``, read offline by the ``tokenizers`` library) into one
token stream, documents joined by the end-of-text token, split into training and validation
tokens as the byte-level corpus is (``data.TRAIN_FRACTION``); ``data.Sampler`` draws its
``--seq-len`` windows from it as from bytes.

    corpus = tokenized_corpus("notes/", "llama-dir", seq_len=512)      # a data.Corpus

PATH: a text file (one document), a directory of them (every regular file, recursively, in
sorted order, each a document), or JSON lines (``*.jsonl``: each line's ``field`` a document).
Tokenizing happens once: the stream is cached next to the data (``PATH.fastpar-tokens-<key>.npy``;
for a directory, inside it), the key a hash of the tokenizer file, the end-of-text id, the field
and every file's path, size and modification time, so a changed file or tokenizer makes a new
one. A directory that cannot be written is tokenized again each run (said once). Progress goes
to stderr on long work.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np
import torch

from fastpar.training.data import TRAIN_FRACTION, Corpus, regular_files

BATCH = 256  # documents per encode_batch call


def tokenizer_of(model_dir: str):
    """``(tokenizers.Tokenizer, end-of-text id, the tokenizer file)`` of a Hugging Face model
    directory; ValueError naming what is missing."""
    from tokenizers import Tokenizer

    file = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(file):
        raise ValueError(f"{model_dir} has no tokenizer.json: --data is tokenized with the "
                         "model's own tokenizer (the byte-level corpus needs no --data)")
    tok = Tokenizer.from_file(file)
    eos = None
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        if eos is None and os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                token = json.load(f).get("eos_token")
            token = token.get("content") if isinstance(token, dict) else token
            eos = tok.token_to_id(token) if token else None
    if eos is None:
        raise ValueError(f"{model_dir}: no end-of-text token (eos_token_id in config.json, or "
                         "eos_token in tokenizer_config.json) to put between documents")
    return tok, int(eos), file


def documents(path: str) -> list[tuple[str, int]]:
    """``(file, size)`` of every file of ``path`` that holds documents, in order."""
    files = regular_files(path) if os.path.isdir(path) else [path]
    return [(f, os.path.getsize(f)) for f in files
            if ".fastpar-tokens-" not in os.path.basename(f)]  # not our own caches


def _texts(file: str, field: str):
    """The documents of one file: its text, or each JSON line's ``field``."""
    if not file.endswith(".jsonl"):
        with open(file, encoding="utf-8", errors="replace") as f:
            yield f.read()
        return
    with open(file, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{file}:{n}: not JSON ({exc})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(f"{file}:{n}: no text field {field!r} (--data-field chooses "
                                 "another)")
            yield record[field]


def cache_path(path: str, tokenizer_file: str, eos: int, field: str) -> str:
    """Where the token stream of ``path`` is cached (see the module docstring)."""
    h = hashlib.sha256()
    with open(tokenizer_file, "rb") as f:
        h.update(f.read())
    h.update(f"{eos}\0{field}".encode())
    for file, size in documents(path):
        h.update(f"\0{os.path.abspath(file)}\0{size}\0{os.stat(file).st_mtime_ns}".encode())
    key = h.hexdigest()[:16]
    if os.path.isdir(path):
        return os.path.join(path, f".fastpar-tokens-{key}.npy")
    return f"{path}.fastpar-tokens-{key}.npy"


def tokenize(path: str, tok, eos: int, field: str, progress: bool) -> np.ndarray:
    """Every document of ``path`` tokenized, each followed by ``eos``: one int32 stream."""
    files = documents(path)
    total = sum(size for _, size in files)
    bar = None
    if progress and total > 8 << 20:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", file=sys.stderr)
    parts = []
    for file, size in files:
        batch = []
        for text in _texts(file, field):
            batch.append(text)
            if len(batch) == BATCH:
                parts.extend(_encode(tok, batch, eos))
                batch = []
        parts.extend(_encode(tok, batch, eos))
        if bar is not None:
            bar.update(size)
    if bar is not None:
        bar.close()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def _encode(tok, texts: list[str], eos: int) -> list[np.ndarray]:
    out = []
    for encoding in tok.encode_batch(texts, add_special_tokens=False) if texts else []:
        ids = np.asarray(encoding.ids, dtype=np.int32)
        out.append(np.append(ids, np.int32(eos)))
    return out


def tokenized_corpus(path: str, model_dir: str, seq_len: int, vocab_size: int,
                     field: str = "text", lead: bool = True, progress: bool = True) -> Corpus:
    """The tokens of ``path`` as a ``data.Corpus`` (int32 train and validation streams).
    Tokenizes (and caches) where no cache is there yet. ``lead``: say what happened.
    """
    tok, eos, file = tokenizer_of(model_dir)
    cached = cache_path(path, file, eos, field)
    if os.path.exists(cached):
        stream, how = np.load(cached), "cached"
    else:
        stream, how = tokenize(path, tok, eos, field, progress and lead), "tokenized"
        try:
            tmp = f"{cached}.tmp-{os.getpid()}.npy"
            np.save(tmp, stream)
            os.replace(tmp, cached)
            how += f", cached at {cached}"
        except OSError as exc:
            if lead:
                print(f"[fastpar.train] note: the tokens of {path} are not cached ({exc}); "
                      "they are tokenized again each run", file=sys.stderr)
    tokens = torch.from_numpy(np.ascontiguousarray(stream))
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise ValueError(f"the tokenizer of {model_dir} gives id {int(tokens.max())}, beyond the "
                         f"model's vocabulary of {vocab_size}")
    cut = int(tokens.numel() * TRAIN_FRACTION)
    train, val = tokens[:cut], tokens[cut:]
    if min(train.numel(), val.numel()) < seq_len + 1:
        raise ValueError(f"--data {path}: {tokens.numel():,} tokens split into train "
                         f"{train.numel():,} + val {val.numel():,}; seq_len {seq_len} needs at "
                         f"least {seq_len + 1} in each")
    docs = len(documents(path))
    return Corpus(train, val, f"{path}: {docs} files, {tokens.numel():,} tokens of {model_dir}'s "
                              f"tokenizer (train {train.numel():,}, val {val.numel():,}; {how})")
