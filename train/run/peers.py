"""A process of a train.qlora run dies (killed, crashed) during a step: the survivors' collectives fail; they find
which rank went (its pid gone on this host, or the only other one) and stop with one line (PeerLost), printed by
the lowest rank still running."""
from __future__ import annotations

import os
import socket
import sys
import time

import torch

from train.recipe.lifecycle import SIGNALS, process_alive

PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo's words for it
PEER_EXIT_S = 3.0  # how long a peer whose connection closed may take to be seen gone


class PeerLost(Exception):
    """Another process of the run went away during a step (killed, crashed). The survivors cannot save: the step's
    collectives are broken, and under FSDP, ZeRO-3 or tensor parallelism part of the state died with it; what is
    saved is the last checkpoint. report: this process prints the line (the lowest rank still running)."""

    def __init__(self, who: str, step: int, steps: int, last_checkpoint: str | None, report: bool):
        super().__init__(f"{who} during step {step} of {steps}; the other processes cannot finish that step "
                         "without it and stopped without saving")
        self.last_checkpoint, self.report = last_checkpoint, report


def roster(accelerator) -> list[tuple[str, int]]:
    """(host, pid) of every rank, to name the one that dies (one gather, when the loop starts)."""
    from accelerate.utils import gather_object

    return gather_object([(socket.gethostname(), os.getpid())]) if accelerator.num_processes > 1 else []


def peer_lost(error: Exception, peers: list, accelerator, step: int, steps: int,
              last_checkpoint: str | None) -> PeerLost | None:
    """PeerLost when `error` (raised by a collective) means a process of the run is gone, else None. The dead rank is
    named when it was on this host (its pid is gone) or is the only other one; else 'a peer process was lost'."""
    if len(peers) < 2:
        return None
    SIGNALS.ignore_until_exit()  # the launcher SIGTERMs the survivors: let them say what happened first
    rank = accelerator.process_index
    looks_lost = isinstance(error, torch.distributed.DistError) or any(words in str(error) for words in PEER_LOSS)
    host, deadline = socket.gethostname(), time.monotonic() + (PEER_EXIT_S if looks_lost else 0)
    while True:
        gone = [r for r, (where, pid) in enumerate(peers)
                if r != rank and where == host and process_alive(pid) is False]
        if gone or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if not (gone or looks_lost):
        return None
    if gone:
        who = ", ".join(f"rank {r} (pid {peers[r][1]})" for r in gone) + " died"
    elif len(peers) == 2:
        gone, who = [1 - rank], f"rank {1 - rank} was lost"
    else:
        who = "a peer process was lost"
    report = min(set(range(len(peers))) - set(gone)) == rank
    if report and not accelerator.is_local_main_process:
        print(file=sys.stderr, flush=True)  # end the line of the dead process's progress bar
    return PeerLost(who, step, steps, last_checkpoint, report)
