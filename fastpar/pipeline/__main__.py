"""``python -m fastpar.pipeline show --pp 4 --microbatches 8 --schedule 1f1b``: every rank's
action list as a text timeline (digits: forward of that microbatch, letters: its backward,
``.``: idle), with the measured-in-simulation and theoretical bubble."""

from __future__ import annotations

import argparse
import sys

from fastpar.pipeline.schedules import SCHEDULES, compile_schedule, theoretical_bubble
from fastpar.pipeline.timeline import render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastpar.pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print a schedule's action lists as a timeline")
    show.add_argument("--pp", type=int, required=True, help="pipeline stages")
    show.add_argument("--microbatches", type=int, required=True)
    show.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    show.add_argument("--actions", action="store_true", help="also print the raw action lists")
    args = parser.parse_args(argv)
    try:
        lists = compile_schedule(args.schedule, args.pp, args.microbatches)
    except ValueError as exc:
        print(f"fastpar.pipeline: {exc}", file=sys.stderr)
        return 2
    text, bubble = render(lists)
    print(f"{args.schedule}: pp {args.pp}, {args.microbatches} microbatches "
          f"(forward 1 unit, backward 2)")
    print(text)
    theory = theoretical_bubble(args.schedule, args.pp, args.microbatches)
    print(f"bubble: {bubble:.3f} in this timeline, {theory:.3f} in theory ((p-1)/(m+p-1))")
    if args.actions:
        for r, acts in enumerate(lists):
            print(f"rank {r}: {' '.join(map(str, acts))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
