"""The command line of `python -m train.qlora`: flags, the checks that need neither torch nor transformers
(train.run.quick_checks), then the run (train.run.qlora) or the plan (train.run.plan); every way out is one line and
an exit status.

Importing torch and transformers takes seconds (10-20 on a busy 2-core machine), so this module imports neither
before the flags and the quick checks have passed: a mistake there is refused within a second or two.
"""
from __future__ import annotations

import sys

from train.errors import SharedUserError, UserError
from train.recipe.args import Args, parse_args
from train.recipe.lifecycle import (SIGNALS, Interrupted, close_process_group, interrupted_message, leave,
                                    silence_library_noise, stopped_message)
from train.run.quick_checks import quick_checks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = None
    silence_library_noise()
    with SIGNALS.mode(graceful=False):
        try:
            args = parse_args(argv)
            if not args.plan:
                quick_checks(args)
        except UserError as error:
            return leave(f"error: {error}", 2)
        except Interrupted as stop:
            return leave(interrupted_message(stop, args, argv), stop.exit_code)
        return _run(args, argv)


def _run(args: Args, argv: list[str]) -> int:
    from train.recipe import checkpoint
    from train.run import loop
    from train.run.peers import PeerLost
    from train.run.plan import PlanFailed, print_plan
    from train.run.qlora import run

    try:
        if args.plan:  # a simulated step of this run, printed; nothing loaded, no training
            print_plan(args)
            return 0
        run(args)
        close_process_group()
    except UserError as error:
        return leave(f"error: {error}", 2, peers_leaving=isinstance(error, SharedUserError))
    except PlanFailed as error:
        return leave(f"error: {error}", 1)
    except (checkpoint.SaveFailed, PeerLost) as error:  # a dead process: the lowest rank alive prints
        return leave(stopped_message(str(error), error.last_checkpoint, args, argv), 1, here=error.report)
    except loop.TrainingDiverged as error:
        return leave(f"error: {error}", 1)
    except Interrupted as stop:
        if args.plan:  # nothing trains in a plan, so nothing was or could be saved
            return leave(f"error: {plan_stopped(stop)}", stop.exit_code)
        return leave(interrupted_message(stop, args, argv), stop.exit_code)
    return 0


def plan_stopped(stop: Interrupted) -> str:
    import signal

    return f"the plan was stopped by {signal.Signals(stop.signum).name}; nothing was trained or written"
