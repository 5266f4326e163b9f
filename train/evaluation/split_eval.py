"""Evaluation in the training layout (train.parallel's (dp, sp, tp) layout): the data-parallel groups share out the
prompts and documents, and the ranks of a sequence-parallel group score and decode each sequence together, each
holding its shard, so evaluating at the trained length takes no more memory per device than a training step and
spreads like training over the groups.

- `spread`: work items (batches of prompts, one scoring forward each) dealt round-robin over the data-parallel
  groups, each run by one group, the results gathered to every rank in the items' order: the same results as one
  process running them all (the same batches, so the same arithmetic). Under weights sharded over every rank (FSDP,
  ZeRO-3: `lockstep`) each forward is a collective of all ranks, so every group runs as many items (the last share
  padded with a repeat whose result is dropped) and decoding keeps the ranks' forwards in step (`split_greedy`'s
  `synced`, generate's `synced_gpus`). Tensor-parallel slices are collectives of one group only: no padding.
- `split_loss`: a sequence's mean token loss, the ranks' shares summed (patches.sequence_parallel.group_loss); equal
  to one process's to float rounding.
- `split_greedy`: greedy decoding without a KV cache. Each new token is the argmax of the last position's logits from
  a split forward over the prompt and the tokens so far; the rank holding that position computes its logits alone
  (`logits_to_keep`) and the group takes its token (a max over the ranks, the others offering -1). One split forward
  per new token: answers are a few tokens, and a forward's memory is a training step's without the backward. A split
  KV cache would make each new token cheaper but needs a cache sharded like the sequence; at a few tokens per answer
  the forwards cost little.

Every rank calls each function with the same global inputs (the same prompts and documents).
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SplitEval:
    """How this rank takes part in an evaluation: its sequence-parallel group (None: every sequence whole on each
    rank) and mode ("ring" | "ulysses"), its data-parallel group's index among `data_world`, and whether the weights
    are sharded over every rank (`lockstep`). `done` counts what this rank evaluated ({"prompts": n, "forwards": n})."""

    group: object = None
    mode: str = "ring"
    data_rank: int = 0
    data_world: int = 1
    lockstep: bool = False
    done: Counter = field(default_factory=Counter, compare=False)

    @staticmethod
    def of(layout, lockstep: bool = False) -> "SplitEval | None":
        """The evaluation split of a train.parallel.layout.Layout; None for one process (nothing to split)."""
        if layout.world == 1:
            return None
        return SplitEval(layout.group if layout.sequence_parallel > 1 else None, layout.mode, layout.data_rank,
                         layout.data_world, lockstep)


def spread(split: SplitEval | None, items: list, fn, what: str = "forwards", count=lambda item: 1) -> list:
    """[fn(item) for item in items] with the items dealt round-robin over the data-parallel groups (item i to group
    i % data_world), the results (picklable) gathered on every rank in the items' order. Every rank calls it with the
    same items. split.done[what] adds count(item) for each item this rank ran (repeats excluded)."""
    if split is None or split.data_world == 1:
        results = []
        for item in items:
            results.append(fn(item))
            if split is not None:
                split.done[what] += count(item)
        return results
    first, step = split.data_rank, split.data_world
    rounds = -(-len(items) // step) if split.lockstep else len(range(first, len(items), step))
    mine = {}
    for r in range(rounds):
        i = first + r * step
        if i < len(items):
            mine[i] = fn(items[i])
            split.done[what] += count(items[i])
        else:  # every rank must take part in every forward of sharded weights: a repeat, its result dropped
            fn(items[-1])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged = {i: result for part in gathered for i, result in part.items()}
    return [merged[i] for i in range(len(items))]


def work_done(split: SplitEval | None) -> list[dict] | None:
    """Every rank's split.done, by rank (a collective: every rank calls it); None without a split."""
    if split is None:
        return None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(split.done))
    return gathered


def _shard_positions(n: int, split: SplitEval, device) -> torch.Tensor:
    """This rank's global token indices along the split sequence (-1 for padding): where each local token came from."""
    from bpt.sequence_parallel import sequence_shard, zigzag_shard

    shard = zigzag_shard if split.mode == "ring" else sequence_shard
    rank, world = dist.get_rank(split.group), dist.get_world_size(split.group)
    return shard(torch.arange(n, device=device), 0, rank, world, pad_value=-1)


def _split_forward(model, input_ids: torch.Tensor, split: SplitEval, labels: torch.Tensor | None = None, **kwargs):
    from patches.sequence_parallel import sequence_parallel_attention, shard_batch

    labels = input_ids if labels is None else labels
    local, context = shard_batch({"input_ids": input_ids, "labels": labels}, split.group, split.mode)
    if "logits_to_keep" in kwargs:  # decoding: no loss
        local.pop("shift_labels"), local.pop("num_items_in_batch")
    with sequence_parallel_attention(model, context):
        return model(**local, **kwargs)


@torch.no_grad()
def split_loss(model, input_ids: torch.Tensor, split: SplitEval, labels: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token loss of input_ids [B, N] (labels as for the model: unshifted, -100 not counted; default every
    token), on every rank of the group."""
    from patches.sequence_parallel import group_loss

    return group_loss(_split_forward(model, input_ids, split, labels).loss, split.group)


@torch.no_grad()
def split_greedy(model, prompts: torch.Tensor, max_new_tokens: int, split: SplitEval) -> torch.Tensor:
    """Greedy continuation of equal-length prompts [B, L] -> new tokens [B, max_new_tokens], on every rank of the
    group. Under `split.lockstep` the ranks go on forwarding (the same sequence again, the result dropped) until every
    rank has its tokens, as generate's synced_gpus does: groups decoding answers of other lengths stay in step."""
    tokens = prompts
    for step in itertools.count() if split.lockstep else range(max_new_tokens):
        mine = step < max_new_tokens
        if split.lockstep:
            more = torch.tensor([int(mine)], device=tokens.device)
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if not more.item():
                break
        n = tokens.shape[1]
        where = _shard_positions(n, split, tokens.device)
        holder = (where == n - 1).nonzero()
        keep = torch.tensor([int(holder[0]) if len(holder) else 0], device=tokens.device)
        logits = _split_forward(model, tokens, split, logits_to_keep=keep).logits[:, -1]
        choice = logits.argmax(-1) if len(holder) else torch.full(logits.shape[:1], -1, device=logits.device)
        dist.all_reduce(choice, op=dist.ReduceOp.MAX, group=split.group)
        if mine:
            tokens = torch.cat([tokens, choice[:, None]], dim=1)
    return tokens[:, prompts.shape[1]:]
