"""Prune a model: ``python -m fastpar.prune --resume CKPT --heads 0.5 --mlp 0.25 --save OUT``
(the command: ``fastpar.pruning.cli``; the function is ``fastpar.prune``, from
``fastpar.pruning``)."""

import sys

from fastpar.pruning.cli import main
from fastpar.pruning import prune
from fastpar.runtime.cli import callable_module

callable_module(__name__, prune)  # importing this module leaves fastpar.prune(...) working

if __name__ == "__main__":
    sys.exit(main())
