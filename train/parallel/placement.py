"""One path from the flags to a placed model, for train.qlora and train.eval alike (place_model), and the one line
that says how the processes share it (layout_text).

The order: the whole model (LoRA on) sliced over its tensor-parallel group -> the blockwise patch on the slices ->
FSDP2 shards; for training then the optimizer (it must see the shards) -> DeepSpeed ZeRO-3's engine or DDP.
"""
from __future__ import annotations

from typing import Callable

from train.errors import UserError, one_line
from train.parallel import deepspeed, fsdp
from train.parallel.layout import Layout


def slice_model(model, size: int, tp_group) -> None:
    """Slice `model`'s layers over its tensor-parallel group (patches.tensor_parallel), in place."""
    from patches.tensor_parallel import tensor_parallel

    try:
        tensor_parallel(model, tp_group)
    except ValueError as error:
        raise UserError(f"cannot split the model over --tensor_parallel {size}: {one_line(error)}") from None


def place_model(model, args, layout: Layout, *, patch: Callable | None = None, optimize: Callable | None = None,
                accelerator=None, zero3=None):
    """`model`, loaded whole on every process, placed in this process's `layout`:
    1. sliced over its tensor-parallel group (--tensor_parallel);
    2. `patch(model)`: the blockwise patch goes on the slices (training's, with its block sizes; evaluation's, for
       --sequence_parallel);
    3. sharded with FSDP2 (--fsdp; --fsdp_cpu_offload where args has it): over every process, or under TP over the
       ranks holding the same slices.
    Training passes `optimize` (the placed model -> (optimizer, scheduler)) and its `accelerator`: the model then goes
    to DeepSpeed ZeRO-3's engine (`zero3`: a DeepSpeed launch), which partitions it and steps the optimizer, or, with
    neither FSDP nor TP, is wrapped in DDP by accelerate (FSDP reduces gradients itself; under TP DDP would average
    different slices). Returns (model, optimizer, scheduler); the last two None without `optimize` (evaluation)."""
    if layout.tensor_parallel > 1:
        slice_model(model, layout.tensor_parallel, layout.tp_group)
    if patch is not None:
        patch(model)
    if layout.fsdp:  # None without TP: every process
        fsdp.shard_model(model, cpu_offload=getattr(args, "fsdp_cpu_offload", False), group=layout.tp_data_group)
    if optimize is None:
        return model, None, None
    optimizer, scheduler = optimize(model)
    if zero3:  # the scheduler, built on the optimizer, drives the engine's param groups
        model = deepspeed.initialize(model, optimizer, args, zero3, layout.world)
    elif layout.fsdp or layout.tensor_parallel > 1:
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, scheduler


def layout_text(layout: Layout, model, *, cpu_offload: bool = False, zero3=None) -> str:
    """How the processes share the placed `model`, each split or sharding in use as "; ..." ("" for plain data
    parallelism): the part of the line train.qlora and train.eval print about the layout. The shares are the main
    process's (this process's, called there)."""
    parts = []
    if layout.sequence_parallel > 1:
        parts.append(f"sequences split {layout.sequence_parallel} ways ({layout.mode})")
    if layout.tensor_parallel > 1:
        parts.append(f"layers split {layout.tensor_parallel} ways (tensor parallel)")
    if layout.fsdp:
        share, where = 100 * fsdp.local_share(model), " in host memory" if cpu_offload else ""
        parts.append(f"FSDP2 over {layout.world} process(es), the main one holding {share:.1f}% of the weights{where}"
                     if layout.tensor_parallel == 1 else
                     f"FSDP2 over the {layout.world // layout.tensor_parallel} process(es) holding each slice, the "
                     f"main one holding {share:.1f}% of its slices{where}")
    if zero3:
        parts.append(f"DeepSpeed ZeRO-3 over {layout.world} process(es), the main one holding "
                     f"{100 * deepspeed.local_share(model):.1f}% of the weights"
                     + (" in host memory" if zero3.offload_param else "")
                     + (", its optimizer state in host memory" if zero3.offload_optimizer else ""))
    return "".join(f"; {part}" for part in parts)
