"""Pipeline parallelism: schedules compiled to per-rank action lists and validated on the host.

    python -m fastpar.pipeline show --pp 4 --microbatches 8 --schedule 1f1b

(The executor, P2P channels and ``Pipeline`` module come next; see the pipeline issue.)
"""

from fastpar.pipeline.schedules import (SCHEDULES, Action, ScheduleError, compile_schedule,
                                        theoretical_bubble, validate)

__all__ = ["SCHEDULES", "Action", "ScheduleError", "compile_schedule", "theoretical_bubble",
           "validate"]
