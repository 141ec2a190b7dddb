"""Run a model: ``python -m fastpar.generate --hf-model DIR --tp 2 --prompt TEXT`` (the
command: ``fastpar.generation.cli``; the function is ``fastpar.generate``, from
``fastpar.generation``)."""

import sys

from fastpar.generation.cli import main
from fastpar.generation import generate
from fastpar.runtime.cli import callable_module

callable_module(__name__, generate)  # importing this module leaves fastpar.generate(...) working

if __name__ == "__main__":
    sys.exit(main())
