"""fastpar's version and the oldest torch it runs on."""

import re

__version__ = "0.1.0"

# torch 2.5: scaled_dot_product_attention(enable_gqa=) (ParallelSelfAttention's grouped-query
# heads). Keep in step with pyproject.toml's dependency.
MIN_TORCH = (2, 5)


def check_torch(version: str) -> None:
    """``ImportError`` naming both versions when ``version`` (``torch.__version__``) is older than
    ``MIN_TORCH``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ImportError(f"fastpar cannot read the torch version {version!r}")
    if tuple(map(int, match.groups())) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"fastpar needs torch >= {need} (scaled_dot_product_attention with "
                          f"enable_gqa), found torch {version}; pip install 'torch>={need}'")
