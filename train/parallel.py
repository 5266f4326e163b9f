"""How the processes of a run share the work: data parallel over groups of `--sequence_parallel N` processes,
each group splitting its sequences N ways (patches.sequence_parallel; ring or Ulysses attention), or over groups of
`--tensor_parallel N` processes, each group splitting every layer N ways (patches.tensor_parallel).

Ranks g*N .. g*N+N-1 form group g: they read the same rows (data rank g of W / N) and each computes a shard of every
sequence (SP) or a slice of every layer (TP). With N = 1 this is plain data parallelism (DDP over every process).
Under TP there is no DDP: the ranks holding the same slices (rank % N equal) sum their gradients themselves.
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
    tensor_parallel: int = 1  # processes per layer slice set
    tp_group: object = None  # this rank's tensor-parallel group (None when tensor_parallel = 1)
    tp_data_group: object = None  # the ranks holding the same slices as this one (under TP)

    @property
    def copies(self) -> int:
        """Ranks that read the same rows."""
        return self.sequence_parallel * self.tensor_parallel

    @property
    def data_rank(self) -> int:
        return self.rank // self.copies

    @property
    def data_world(self) -> int:
        return self.world // self.copies


def check_layout(args, world: int | None = None) -> None:
    """UserError (before any model is loaded) when --sequence_parallel cannot split this launch."""
    world = launched_world_size() if world is None else world
    check_tensor_parallel_layout(args, world)
    n = args.sequence_parallel
    if n == 1:
        return
    if not args.bpt:
        raise UserError("--sequence_parallel needs the blockwise patch (drop --no_bpt)")

    if world % n:
        raise UserError(f"--sequence_parallel {n} must divide the number of processes ({world}); launch a multiple "
                        f"of {n} processes with accelerate launch --num_processes")


def check_tensor_parallel_layout(args, world: int) -> None:
    """UserError (before any model is loaded) when --tensor_parallel cannot split this launch or this run."""
    n = args.tensor_parallel
    if n == 1:
        return
    for flag, on in (("--sequence_parallel", args.sequence_parallel > 1), ("--fsdp", args.fsdp)):
        if on:
            raise UserError(f"--tensor_parallel does not compose with {flag} yet; drop one of them")
    if args.bits == 8:
        raise UserError("--tensor_parallel slices 16-bit and 4-bit bases, not 8-bit ones: use --bits 4 or 16")
    if world % n:
        raise UserError(f"--tensor_parallel {n} must divide the number of processes ({world}); launch a multiple "
                        f"of {n} processes with accelerate launch --num_processes")


def check_tensor_parallel_model(args, config) -> None:
    """UserError when --tensor_parallel cannot split this model (no plan, head / MLP counts, 4-bit blocks); reads
    the config only (the model is built on the meta device)."""
    if args.tensor_parallel == 1:
        return
    from patches.tensor_parallel import check_tensor_parallel

    try:
        check_tensor_parallel(config, args.tensor_parallel, bits=args.bits)
    except ValueError as error:
        raise UserError(str(error)) from None


def make_layout(accelerator, args) -> Layout:
    """This rank's place in the run; creates the sequence-parallel process groups (every rank creates every
    group, as torch.distributed requires)."""
    world, rank, n = accelerator.num_processes, accelerator.process_index, args.sequence_parallel
    check_layout(args, world)
    group = None
    if n > 1:
        from patches.sequence_parallel import sequence_parallel_group

        group = sequence_parallel_group(n)
    tp_group = tp_data_group = None
    if args.tensor_parallel > 1:
        from patches.tensor_parallel import tensor_parallel_group

        tp_group, tp_data_group = tensor_parallel_group(args.tensor_parallel)
    return Layout(world=world, rank=rank, sequence_parallel=n, mode=args.sp_mode, group=group,
                  tensor_parallel=args.tensor_parallel, tp_group=tp_group, tp_data_group=tp_data_group)
