"""The process layout of every run: one (dp, sp, tp) rank grid and its process groups, built in one function.

rank = (dp_index * sp + sp_index) * tp + tp_index (tp innermost): a tensor-parallel group is tp consecutive ranks
(they hold the same tokens), a sequence-parallel group the sp ranks of one data group with the same tp_index (strided
by tp; consecutive when tp is 1), a same-slices group every rank with that tp_index (across sp and dp). With sp = tp
= 1 this is plain data parallelism. `mesh_groups` is the only place in bpt, patches and train that creates process
groups (tests/test_house.py holds it to that); the layouts users know are views of it: `tensor_parallel_group`,
`sequence_parallel_group` (patches.trainer's groups), train.parallel's `make_layout`.

Pure torch.distributed: nothing here knows transformers.
"""
from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist


class MeshGroups(NamedTuple):
    """This rank's groups in the grid; None for an axis of size 1 (unless asked for one-rank groups)."""
    sp: object  # the sequence-parallel group
    tp: object  # the tensor-parallel group
    same_slices: object  # the ranks holding the same tensor-parallel slices (data parallel under TP)


def mesh_ranks(world: int, sp: int, tp: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """The (dp, sp, tp) layout's groups, as rank lists in the order every rank creates them: (sequence-parallel
    groups, tensor-parallel groups, same-slices groups)."""
    if sp < 1 or tp < 1 or world % (sp * tp):
        raise ValueError(f"sp {sp} x tp {tp} must divide the {world} processes")
    dp = world // (sp * tp)
    sp_groups = [[(d * sp + s) * tp + t for s in range(sp)] for d in range(dp) for t in range(tp)]
    tp_groups = [list(range(first, first + tp)) for first in range(0, world, tp)]
    slice_groups = [list(range(t, world, tp)) for t in range(tp)]  # the same tp_index across sp and dp
    return sp_groups, tp_groups, slice_groups


def mesh_groups(sp: int, tp: int, *, one_rank_groups: bool = False) -> MeshGroups:
    """This rank's (sequence-parallel group, tensor-parallel group, same-slices group) in the layout of `mesh_ranks`;
    None for an axis of size 1 (the same-slices group too when tp is 1), or with `one_rank_groups` a group of this
    rank alone for a sequence axis of size 1. Every rank must call it with the same sizes: every rank creates every
    group (torch.distributed requires it), the sp groups first, then the tp groups, then the same-slices groups."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sp_groups, tp_groups, slice_groups = mesh_ranks(world, sp, tp)

    def mine(rank_lists):
        found = None
        for ranks in rank_lists:
            created = dist.new_group(ranks)
            if rank in ranks:
                found = created
        return found

    sp_group = mine(sp_groups) if sp > 1 or one_rank_groups else None
    tp_group, slice_group = (mine(tp_groups), mine(slice_groups)) if tp > 1 else (None, None)
    return MeshGroups(sp_group, tp_group, slice_group)


def tensor_parallel_group(size: int):
    """This rank's tensor-parallel group: the world split into groups of `size` consecutive ranks (tp innermost), and
    its data-parallel group (the ranks holding the same slices: rank % size equal). Every rank must call it (every
    rank creates every group). Returns (tp_group, dp_group); with sequence parallelism as well: `mesh_groups`."""
    if size < 2:
        raise ValueError(f"tensor-parallel groups need at least 2 ranks, got {size}")
    return tuple(mesh_groups(1, size)[1:])


def sequence_parallel_group(size: int):
    """This rank's group when the world splits into groups of `size` consecutive ranks (g*size .. g*size+size-1):
    the sequence axis of the grid without tensor parallelism (size 1: this rank alone). Every rank must call it:
    every rank creates every group."""
    world = dist.get_world_size()
    if size < 1 or world % size:
        raise ValueError(f"sequence-parallel groups of {size} must divide the {world} processes")
    return mesh_groups(size, 1, one_rank_groups=True).sp
