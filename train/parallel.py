"""How the processes of a run share the work: data parallel over groups of `--sequence_parallel N` processes,
each group splitting its sequences N ways (patches.sequence_parallel; ring or Ulysses attention).

Ranks g*N .. g*N+N-1 form sequence-parallel group g: they read the same rows (data rank g of W / N) and each
computes a shard of every sequence. With N = 1 this is plain data parallelism (DDP over every process).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from train.errors import UserError


def launched_world_size() -> int:
    """Processes in this launch, from the launcher's environment (1 without a launcher); readable before any
    process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class Layout:
    world: int  # processes in the run
    rank: int
    sequence_parallel: int  # N: processes per sequence
    mode: str  # "ring" | "ulysses"
    group: object = None  # this rank's sequence-parallel process group (None when N = 1)

    @property
    def data_rank(self) -> int:
        return self.rank // self.sequence_parallel

    @property
    def data_world(self) -> int:
        return self.world // self.sequence_parallel


def check_layout(args, world: int | None = None) -> None:
    """UserError (before any model is loaded) when --sequence_parallel cannot split this launch."""
    world = launched_world_size() if world is None else world
    n = args.sequence_parallel
    if n == 1:
        return
    if not args.bpt:
        raise UserError("--sequence_parallel needs the blockwise patch (drop --no_bpt)")

    if world % n:
        raise UserError(f"--sequence_parallel {n} must divide the number of processes ({world}); launch a multiple "
                        f"of {n} processes with accelerate launch --num_processes")


def make_layout(accelerator, args) -> Layout:
    """This rank's place in the run; creates the sequence-parallel process groups (every rank creates every
    group, as torch.distributed requires)."""
    world, rank, n = accelerator.num_processes, accelerator.process_index, args.sequence_parallel
    check_layout(args, world)
    group = None
    if n > 1:
        from patches.sequence_parallel import sequence_parallel_group

        group = sequence_parallel_group(n)
    return Layout(world=world, rank=rank, sequence_parallel=n, mode=args.sp_mode, group=group)
