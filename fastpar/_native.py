"""Loads the native extension ``fastpar._C`` and says what it holds.

fastpar works without it (every native op has a standard-engine fallback), but never silently:
``status()`` carries the import error, and ``python -m fastpar info`` prints it.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def status() -> dict:
    """``{"built": bool, "cuda": bool, "info": {...}, "error": str | None}``."""
    try:
        import torch
        from fastpar import _C  # noqa: F401  (registers torch.ops.fastpar.*)

        raw = torch.ops.fastpar.build_info()
    except Exception as exc:  # noqa: BLE001 - any failure to load is reported, not raised
        return {"built": False, "cuda": False, "info": {},
                "error": f"{type(exc).__name__}: {exc}"}
    info = dict(item.split("=", 1) for item in raw.split(";") if "=" in item)
    return {"built": True, "cuda": info.get("cuda") == "1", "info": info, "error": None}


def available() -> bool:
    return status()["built"]


def require(what: str) -> None:
    """Raise a clear error when ``what`` needs the extension and it is not there."""
    st = status()
    if not st["built"]:
        raise RuntimeError(f"{what} needs the native extension fastpar._C, which failed to load "
                           f"({st['error']}); rebuild with `pip install --no-build-isolation -e .`")
