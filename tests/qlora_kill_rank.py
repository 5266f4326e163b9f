"""`python tests/qlora_kill_rank.py RANK STEP <train.qlora flags>`: train.qlora whose process of rank RANK kills itself
with SIGKILL as optimizer step STEP begins (the others then wait for it in that step's first collective), as the
kernel's OOM killer or a failed node would: no handler runs, nothing is written. For runs under `accelerate
launch`, where a test cannot patch the processes itself (train.run.loop has no test hooks)."""
from __future__ import annotations

import os
import signal
import sys

from train.recipe.lifecycle import exit_process
from train.run import command, loop

RANK, STEP = int(sys.argv.pop(1)), int(sys.argv.pop(1))
train_step = loop.train_step


def train_step_then_die(model, group, optimizer, scheduler, accelerator, args, step, *rest):
    if step == STEP and accelerator.process_index == RANK:
        os.kill(os.getpid(), signal.SIGKILL)
    return train_step(model, group, optimizer, scheduler, accelerator, args, step, *rest)


loop.train_step = train_step_then_die
exit_process(command.main())
