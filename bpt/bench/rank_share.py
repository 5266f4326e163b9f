"""What one rank of the simulated run trains on: the whole sequence, or its shard of an N-way sequence-parallel run.

- `rank_share(spec, model, inputs)` (a context manager): yields a `RankShare` (this rank's model inputs, the block
  its forward and backward run in, what runs after backward). With spec["sequence_parallel"] = N > 1 it joins a
  process group of N ranks of torch's fake backend as rank 0, and shards the global batch as a user's loop does
  (`patches.shard_batch`): the model then runs the real ring / Ulysses attention, whose exchange buffers and
  all-to-all outputs the tracker counts, and `patches.reduce_gradients` sums the trainable gradients over the
  group after backward (its flat buffer counted too).
- `local_tokens(spec)`: tokens per rank of the layout (ring: zigzag, padded to 2N chunks; Ulysses: N shards).
- `rank_links(spec, world)`: rank 0's links to its peers (NVLink in its machine, the network beyond), for the clock
  to price the exchange (bpt.gpusim.exchange).

The fake backend (torch.testing._internal.distributed.fake_pg: "a process group which doesn't actually do any
communication") completes every collective at once without touching data: one rank's memory is simulated, not the
group's timing. Every rank of either layout holds a shard of the same length, so rank 0 stands for all of them
(Ulysses with fewer key / value heads than ranks gives rank 0 its share as torch's kv_head_ranges does).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class RankShare:
    inputs: dict  # the model's keyword arguments on this rank
    attention: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # around forward + backward
    after_backward: Callable[[], None] = lambda: None
    sent_bytes: Callable[[], int] = lambda: 0  # what this rank sent through the sequence-parallel attention
    links: object = None  # bpt.gpusim.exchange.Links of this rank (its group's machines), None: nothing to price

    @property
    def tokens(self) -> int:
        """Tokens of every row on this rank."""
        return self.inputs["input_ids"].numel()


def local_tokens(spec: dict) -> int:
    """Tokens of one sequence on one rank (the batch not counted) of spec's layout."""
    n, world = spec["seq_len"], spec.get("sequence_parallel") or 1
    if world == 1:
        return n
    return 2 * -(-n // (2 * world)) if spec.get("sp_mode", "ring") == "ring" else -(-n // world)


@contextlib.contextmanager
def fake_group(world: int):
    """A default process group of `world` ranks of torch's fake backend, this process rank 0, for the block."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a simulated sequence-parallel step needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def rank_share(spec: dict, model, inputs: dict):
    """The share of `inputs` (the global batch: input_ids, labels) this rank trains on, and the blocks around it."""
    world = spec.get("sequence_parallel") or 1
    if world == 1:
        yield RankShare(inputs)
        return
    from patches import reduce_gradients, sequence_parallel_attention, shard_batch

    from bpt.sequence_parallel import traffic

    with fake_group(world):
        local, context = shard_batch(inputs, None, spec.get("sp_mode", "ring"))
        traffic.reset()
        yield RankShare(local, attention=lambda: sequence_parallel_attention(model, context),
                        after_backward=lambda: reduce_gradients(model, None), sent_bytes=traffic.total,
                        links=rank_links(spec, world))


def rank_links(spec: dict, world: int):
    """Rank 0's links in a group of `world` GPUs laid out spec["gpus_per_machine"] to a machine (default: the
    simulated card's machine, bpt.gpusim.gpus.MACHINES), or None where the device has no machine (the CPU)."""
    from bpt.gpusim.exchange import Links
    from bpt.gpusim.gpus import machine

    box = machine(spec["simulate"], spec.get("gpus_per_machine")) if "simulate" in spec else None
    if box is None:
        return None
    return Links(0, world, box.gpus, box.nvlink_bytes_per_second, box.network_bytes_per_second)


def model_tensors(inputs: dict) -> list[torch.Tensor]:
    """The tensors among a model's keyword arguments (a sharded batch carries ints and flags too)."""
    return [v for v in inputs.values() if isinstance(v, torch.Tensor)]
