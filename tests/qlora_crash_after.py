"""`python tests/qlora_crash_after.py STEP <train.qlora flags>`: train.qlora whose processes exit 3 right after
checkpoint-STEP is written, as a crash after a save would leave the run. For runs under `accelerate launch`, where a
test cannot patch the processes itself: the patch is applied here, in each process (train.run.loop has no test
hooks)."""
from __future__ import annotations

import sys

from train.recipe.lifecycle import exit_process
from train.run import command, loop

STEP = int(sys.argv.pop(1))
save_checkpoint = loop.save_checkpoint


def save_then_crash(accelerator, model, optimizer, scheduler, args, step, *rest):
    path = save_checkpoint(accelerator, model, optimizer, scheduler, args, step, *rest)
    if step == STEP:
        print(f"crashing after step {step}", file=sys.stderr, flush=True)
        sys.exit(3)
    return path


loop.save_checkpoint = save_then_crash
exit_process(command.main())
