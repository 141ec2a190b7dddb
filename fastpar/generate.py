"""Run a model: ``python -m fastpar.generate --hf-model DIR --tp 2 --prompt TEXT`` (the
command: ``fastpar.generation.cli``; the function is ``fastpar.generate``, from
``fastpar.generation``)."""

import sys
import types

from fastpar.generation.cli import main
from fastpar.generation import generate as _generate


class _Callable(types.ModuleType):
    """Importing this module makes ``fastpar.generate`` the module (Python sets the package's
    attribute), so the module calls through to the function: ``fastpar.generate(...)`` works either
    way."""

    def __call__(self, *args, **kwargs):
        return _generate(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable

if __name__ == "__main__":
    sys.exit(main())
