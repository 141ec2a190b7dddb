"""Prune a model: ``python -m fastpar.prune --resume CKPT --heads 0.5 --mlp 0.25 --save OUT``
(the command: ``fastpar.pruning.cli``; the function is ``fastpar.prune``, from
``fastpar.pruning``)."""

import sys
import types

from fastpar.pruning.cli import main
from fastpar.pruning import prune as _prune


class _Callable(types.ModuleType):
    """Importing this module makes ``fastpar.prune`` the module (Python sets the package's
    attribute), so the module calls through to the function: ``fastpar.prune(...)`` works either
    way."""

    def __call__(self, *args, **kwargs):
        return _prune(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable

if __name__ == "__main__":
    sys.exit(main())
