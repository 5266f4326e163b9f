"""How the processes of a run share the work: one (dp, sp, tp) layout. Data parallel over groups of SP x TP
processes; each group reads the same rows (data rank g of W / (SP x TP)), splits its sequences SP ways
(`--sequence_parallel`, patches.sequence_parallel; ring or Ulysses attention) and every layer TP ways
(`--tensor_parallel`, patches.tensor_parallel). The grid and its groups are bpt.mesh's.

rank = (dp_index * SP + sp_index) * TP + tp_index (tp innermost): a tensor-parallel group is TP consecutive ranks
(they hold the same tokens: the same sequence shard); a sequence-parallel group is the SP ranks of one data group with
the same tp_index (strided by TP; consecutive when TP = 1). With SP = TP = 1 this is plain data parallelism (DDP over
every process). Under TP there is no DDP: the ranks holding the same slices (the same tp_index, across sp and dp) sum
their gradients themselves (each sp rank's loss is a share of its sequences' loss, each dp rank's of the step's), or,
with --fsdp, FSDP2 shards those slices over them and reduces their gradients (train.parallel.fsdp).
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
    fsdp: bool = False  # FSDP2 shards the weights (over every process; under TP over tp_data_group)

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
    """UserError (before any model is loaded) when --sequence_parallel / --tensor_parallel cannot split this run."""
    if args.sequence_parallel > 1 and not args.bpt:
        raise UserError("--sequence_parallel needs the blockwise patch (drop --no_bpt)")
    check_mesh(args, world)


def check_mesh(args, world: int | None = None) -> None:
    """UserError (before any model is loaded) when this launch's processes cannot form the (dp, sp, tp) layout that
    args.sequence_parallel / tensor_parallel ask for (training and train.eval alike)."""
    world = launched_world_size() if world is None else world
    check_tensor_parallel_layout(args, world)
    n = args.sequence_parallel
    if n > 1:
        _must_divide(f"--sequence_parallel {n}", n, world)


def _must_divide(what: str, n: int, world: int) -> None:
    if world % n:
        raise UserError(f"{what} must divide the number of processes ({world}); launch a multiple of {n} processes "
                        "with accelerate launch --num_processes")


def check_tensor_parallel_layout(args, world: int) -> None:
    """UserError (before any model is loaded) when --tensor_parallel cannot split this launch or this run."""
    n = args.tensor_parallel
    if n == 1:
        return
    if args.bits == 8:
        raise UserError("--tensor_parallel slices 16-bit and 4-bit bases, not 8-bit ones: use --bits 4 or 16")
    _must_divide(f"--tensor_parallel {n}", n, world)
    sp = args.sequence_parallel
    if sp > 1:
        _must_divide(f"--tensor_parallel {n} x --sequence_parallel {sp}", n * sp, world)


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
    heads, sp = getattr(config, "num_attention_heads", None), args.sequence_parallel
    if sp > 1 and args.sp_mode == "ulysses" and isinstance(heads, int) and (heads // args.tensor_parallel) % sp:
        raise UserError(f"--sp_mode ulysses splits each rank's {heads // args.tensor_parallel} query heads ({heads} / "
                        f"--tensor_parallel {args.tensor_parallel}) over --sequence_parallel {sp}, so they must "
                        f"divide by {sp}; use --sp_mode ring or fewer tensor-parallel ranks")


def make_layout(world: int, rank: int, args) -> Layout:
    """This rank's place in the run; creates the sequence- and tensor-parallel process groups (every rank creates
    every group, as torch.distributed requires: the sp groups, then the tp groups and the same-slices groups)."""
    n, tp = args.sequence_parallel, args.tensor_parallel
    check_mesh(args, world)
    group = tp_group = tp_data_group = None
    if n > 1 or tp > 1:
        from bpt.mesh import mesh_groups

        group, tp_group, tp_data_group = mesh_groups(n, tp)
    return Layout(world=world, rank=rank, sequence_parallel=n, mode=args.sp_mode, group=group,
                  tensor_parallel=tp, tp_group=tp_group, tp_data_group=tp_data_group, fsdp=args.fsdp)


def start_layout(args) -> Layout | None:
    """None for one process; else this process's place in the (dp, sp, tp) layout, the process group first started
    from the launcher's environment (gloo on CPU, NCCL with one GPU per process): for a command without accelerate's
    own start (train.eval)."""
    world = launched_world_size()
    if world == 1:
        return None
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return make_layout(world, dist.get_rank(), args)
