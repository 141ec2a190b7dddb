"""Print a schedule's action lists as a text timeline, with its bubble in the timeline and in
theory::

    python -m fastpar.pipeline show --pp 4 --microbatches 8 --schedule 1f1b
    python -m fastpar.pipeline show --pp 4 --microbatches 8 --schedule zb
    python -m fastpar.pipeline show --pp 4 --microbatches 8 --schedule interleaved \\
        --virtual-stages 2 --actions

Marks: digits forward of that microbatch (mod 10), lowercase letters its full backward (two
units), uppercase letters its input gradient, ``w`` a weight gradient, ``.`` idle; with more than
one chunk per rank a ``chunk`` row under each rank names the chunk. An invalid configuration
prints ``fastpar.pipeline: <why>`` to stderr and exits 2.
"""

from __future__ import annotations

import sys

from fastpar.pipeline.schedules import (SCHEDULES, bubble_formula, compile_schedule,
                                        theoretical_bubble)
from fastpar.pipeline.timeline import render


def main(argv: list[str] | None = None) -> int:
    from fastpar.runtime.cli import Parser

    parser = Parser(prog="python -m fastpar.pipeline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print a schedule's action lists as a timeline")
    show.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    show.add_argument("--microbatches", type=int, required=True)
    show.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES))
    show.add_argument("--virtual-stages", type=int, default=1,
                      help="model chunks per rank (interleaved needs >= 2; default 1)")
    show.add_argument("--actions", action="store_true", help="also print the raw action lists")
    args = parser.parse_args(argv)
    pp, m, v = args.pp, args.microbatches, args.virtual_stages
    try:
        lists = compile_schedule(args.schedule, pp, m, v)
        theory = theoretical_bubble(args.schedule, pp, m, v)
    except ValueError as exc:
        show.error(str(exc))
    text, bubble = render(lists)
    print(f"{args.schedule}: pp {pp}, {m} microbatches, {v} chunk{'s' * (v > 1)} per rank "
          f"(forward 1 unit, backward 2, input gradient 1, weight gradient 1)")
    print(text)
    print(f"bubble: {bubble:.3f} in this timeline, {theory:.3f} in theory "
          f"({bubble_formula(args.schedule, v)}, p={pp} m={m} v={v}; equal stage times, "
          f"B = 2F, I = W = F)")
    if args.actions:
        for r, acts in enumerate(lists):
            print(f"rank {r}: {' '.join(map(str, acts))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
