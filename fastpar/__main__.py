"""``python -m fastpar <command>``; commands: info, plan, checkpoint (inspect | export).

This front door stands above every layer: it hands the planner the trainer fit that
``plan --calibrate`` runs (the planner itself never imports the trainer). Each command's modules
are imported only when it runs."""

import sys

USAGE = ("usage: python -m fastpar info [--tp N --pp N] [--json]\n"
         "       python -m fastpar plan (--preset NAME | model flags | --hf-config FILE) "
         "(--ranks N | --hosts H --ranks-per-host R) [--cluster FILE] [--calibrate] ...\n"
         "       python -m fastpar checkpoint inspect|export ...")


def run_info(argv) -> int:
    from fastpar import info

    return info.main(argv)


def run_plan(argv) -> int:
    from fastpar.plan import cli
    from fastpar.training.fit import trainer_fit

    return cli.main(argv, fit=trainer_fit)


def run_checkpoint(argv) -> int:
    from fastpar.checkpoint import __main__ as command

    return command.main(argv)


COMMANDS = {"info": run_info, "plan": run_plan, "checkpoint": run_checkpoint}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    return COMMANDS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
