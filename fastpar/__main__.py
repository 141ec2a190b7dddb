"""``python -m fastpar <command>``; commands: info, plan, checkpoint (inspect | export)."""

import sys


def main() -> int:
    commands = {"info": "fastpar.info", "plan": "fastpar.plan.cli",
                "checkpoint": "fastpar.checkpoint.__main__"}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print("usage: python -m fastpar info [--tp N --pp N] [--json]\n"
              "       python -m fastpar plan (--preset NAME | model flags | --hf-config FILE) "
              "(--ranks N | --hosts H --ranks-per-host R) [--cluster FILE] [--calibrate] ...\n"
              "       python -m fastpar checkpoint inspect|export ...", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(commands[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
