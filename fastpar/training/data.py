"""Byte-level training data for `python -m fastpar.train`: a corpus, a pure sampler, fixed
validation batches.

Usage:

    train, val = builtin_corpus() if path is None else load_corpus(path, seq_len)
    sampler = Sampler(train, seq_len, global_batch, seed)
    inputs, targets = sampler.shard(step, topo.dp_rank, topo.dp_size)  # (B / dp, T) int64 each
    evals = val_batches(val, n=4, seq_len=seq_len, batch=8)           # [(inputs, targets), ...]

The vocabulary is the 256 byte values. `Sampler.batch(step)` is a pure function of (seed, step),
so the same seed and global batch give the same tokens under any tp/pp/dp layout, and the data
position of a run is just its step number: steps are counted from 0, so a checkpoint saved after
S steps has consumed `batch(0)` .. `batch(S - 1)` and the resumed run draws `batch(S)` next, with
no sampler state to save.

Corpora are split by bytes: the first 95% is training text, the last 5% validation text. For the
builtin corpus (files in sorted order) the validation text is the tail of the last few files, so
it is mostly code the model never trains on.
"""

import functools
import hashlib
import os
import sys
import sysconfig

import torch

TRAIN_FRACTION = 0.95
SEPARATOR = b"\n\x1c\n"  # between files: newline, ASCII "file separator", newline
BUILTIN_CAP = 16 << 20   # bytes; the whole stdlib of CPython 3.10-3.13 (~11-14 MiB) fits
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib",
                        "__pycache__"})


class Corpus(tuple):
    """(train, val) uint8 tensors that unpack as a pair; .describe() says where they came from."""

    def __new__(cls, train, val, description):
        self = super().__new__(cls, (train, val))
        self.description = description
        return self

    train = property(lambda self: self[0])
    val = property(lambda self: self[1])

    def describe(self):
        return self.description


def _split(data, source, files):
    """Bytes -> Corpus: first TRAIN_FRACTION of the bytes train, the rest validation."""
    cut = int(len(data) * TRAIN_FRACTION)
    # a private copy per call: the cached bytes are immutable, callers may write to the tensors
    full = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8)
    digest = hashlib.sha256(data).hexdigest()[:12]
    text = (f"{source}: {files} files, {len(data):,} bytes (train {cut:,}, val "
            f"{len(data) - cut:,}), sha256 {digest}")
    return Corpus(full[:cut], full[cut:], text)


def _stdlib_files(root):
    """Relative posix paths of the stdlib's *.py files, sorted, without tests and site-packages."""
    found = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        rel = os.path.relpath(here, root)
        for name in names:
            if name.endswith(".py"):
                found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return sorted(found)


@functools.lru_cache(maxsize=2)
def _builtin_bytes(root, cap):
    """(bytes, number of files) of the builtin corpus; cached per process (~50 ms cold)."""
    parts, total = [], 0
    for rel in _stdlib_files(root):
        try:
            with open(os.path.join(root, rel), "rb") as f:
                blob = f.read()
        except OSError:  # unreadable: skipped, the corpus stays deterministic per machine
            continue
        if total + len(blob) + len(SEPARATOR) > cap:
            break  # a deterministic prefix of the sorted list; never a partial file
        parts.append(blob)
        total += len(blob) + len(SEPARATOR)
    return SEPARATOR.join(parts), len(parts)


def builtin_corpus(cap=BUILTIN_CAP):
    """The corpus used when no --data is given: this interpreter's standard library source.

    The *.py files under sysconfig's "stdlib" path, in sorted relative-path order, skipping
    site-packages, test/tests directories, idlelib, __pycache__ and unreadable files, joined by
    SEPARATOR and capped at `cap` bytes (whole files only). Every machine has it without a
    download; it is identical on machines with the same Python build. Built once per process.
    """
    root = sysconfig.get_paths()["stdlib"]
    data, files = _builtin_bytes(root, int(cap))
    version = ".".join(map(str, sys.version_info[:3]))
    corpus = _split(data, f"Python {version} standard library ({root})", files)
    if len(corpus.val) < 2:
        raise ValueError(f"builtin corpus from {root} has only {len(data)} bytes in {files} "
                         f"files; pass --data PATH")
    return corpus


def describe(cap=BUILTIN_CAP):
    """One line on the builtin corpus: files, bytes, Python version, a digest."""
    return builtin_corpus(cap).describe()


def regular_files(path):
    """Every regular file under `path`, recursively, sorted; hidden names (".git") skipped."""
    found = []
    for here, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(here, n) for n in names
                  if not n.startswith(".") and os.path.isfile(os.path.join(here, n))]
    return sorted(found, key=lambda p: os.path.relpath(p, path).replace(os.sep, "/"))


def load_corpus(path, seq_len=None):
    """A text file, or a directory of them (all regular files, recursively, in sorted order,
    joined by SEPARATOR), as raw bytes (UTF-8 or anything else) -> Corpus (train, val).

    With `seq_len`, both splits must hold at least one window of seq_len + 1 bytes.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"corpus path {path!r} does not exist")
    files = regular_files(path) if os.path.isdir(path) else [path]
    parts = []
    for name in files:
        try:
            with open(name, "rb") as f:
                parts.append(f.read())
        except OSError as exc:
            raise ValueError(f"corpus file {name!r} cannot be read: {exc}") from exc
    data = SEPARATOR.join(parts)
    if not any(parts):
        raise ValueError(f"corpus {path!r} is empty ({len(files)} files, {len(data)} bytes)")
    corpus = _split(data, path, len(files))
    need = 2 if seq_len is None else int(seq_len) + 1
    if min(len(corpus.train), len(corpus.val)) < need:
        raise ValueError(
            f"corpus {path!r} is too small: {len(data):,} bytes split into train "
            f"{len(corpus.train):,} + val {len(corpus.val):,}, and seq_len {need - 1} needs at "
            f"least {need} bytes in each (about {int(need / (1 - TRAIN_FRACTION)) + 1:,} bytes "
            f"in all)")
    return corpus


def _check_text(name, text, seq_len):
    if not isinstance(text, torch.Tensor) or text.dim() != 1:
        raise ValueError(f"{name} must be a 1-d tensor of byte values, got "
                         f"{type(text).__name__} {tuple(getattr(text, 'shape', ()))}")
    if seq_len < 1 or text.numel() < seq_len + 1:
        raise ValueError(f"{name} has {text.numel():,} tokens; seq_len {seq_len} needs at least "
                         f"{seq_len + 1} (and seq_len >= 1)")


def _windows(text, starts, seq_len):
    """Rows text[s : s + seq_len + 1] -> (inputs, targets), each (len(starts), seq_len) int64."""
    rows = text[starts[:, None] + torch.arange(seq_len + 1)].long()  # (R, T + 1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def mix_seed(seed, step):
    """A 63-bit generator seed from (seed, step): a hash, so nearby pairs give unrelated streams."""
    digest = hashlib.blake2b(f"fastpar.data:{int(seed)}:{int(step)}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


class Sampler:
    """Random windows of `train`: batch(step) is a pure function of (seed, step).

    Each step draws `global_batch` window starts uniformly from a torch.Generator seeded by
    mix_seed(seed, step) (never the global RNG); row i is train[s_i : s_i + seq_len + 1], split
    into inputs (the first seq_len bytes) and targets (the same window shifted by one).
    """

    def __init__(self, train, seq_len, global_batch, seed):
        self.seq_len, self.global_batch, self.seed = int(seq_len), int(global_batch), int(seed)
        _check_text("training text", train, self.seq_len)
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        self.train = train

    def __repr__(self):
        return (f"Sampler(tokens={self.train.numel():,}, seq_len={self.seq_len}, "
                f"global_batch={self.global_batch}, seed={self.seed})")

    def starts(self, step):
        """The global batch's window starts for `step`: (global_batch,) int64."""
        gen = torch.Generator(device="cpu").manual_seed(mix_seed(self.seed, step))
        high = self.train.numel() - self.seq_len  # starts in [0, n - T - 1]: the window fits
        return torch.randint(0, high, (self.global_batch,), generator=gen)

    def batch(self, step):
        """The whole global batch of `step`: (inputs, targets), each (global_batch, seq_len)."""
        return _windows(self.train, self.starts(step), self.seq_len)

    def shard(self, step, dp_rank, dp_size):
        """Rows [dp_rank * B / dp_size, (dp_rank + 1) * B / dp_size) of batch(step)."""
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size {dp_size})")
        if self.global_batch % dp_size:
            raise ValueError(f"global_batch {self.global_batch} is not divisible by dp_size "
                             f"{dp_size}")
        rows = self.global_batch // dp_size
        starts = self.starts(step)[dp_rank * rows:(dp_rank + 1) * rows]
        return _windows(self.train, starts, self.seq_len)


def val_batches(val, n, seq_len, batch):
    """A fixed list of `n` validation batches (inputs, targets), each (batch, seq_len) int64.

    The n * batch windows start at evenly spaced offsets across `val` (no randomness), so every
    rank and every layout evaluates the same tokens.
    """
    seq_len, n, batch = int(seq_len), int(n), int(batch)
    _check_text("validation text", val, seq_len)
    if n < 1 or batch < 1:
        raise ValueError(f"val_batches needs n >= 1 and batch >= 1, got n {n}, batch {batch}")
    last = val.numel() - seq_len - 1  # the last start whose window fits
    starts = torch.linspace(0, last, n * batch, dtype=torch.float64).round().long()
    return [_windows(val, s, seq_len) for s in starts.split(batch)]
