"""Evaluation in the training layout: the ranks of a sequence-parallel group score and decode each sequence together,
each holding its shard, so evaluating at the trained length takes no more memory per device than a training step.

- `split_loss`: a sequence's mean token loss, the ranks' shares summed (patches.sequence_parallel.group_loss); equal
  to one process's to float rounding.
- `split_greedy`: greedy decoding without a KV cache. Each new token is the argmax of the last position's logits from
  a split forward over the prompt and the tokens so far; the rank holding that position computes its logits alone
  (`logits_to_keep`) and the group takes its token (a max over the ranks, the others offering -1). One split forward
  per new token: answers are a few tokens, and a forward's memory is a training step's without the backward. A split
  KV cache would make each new token cheaper but needs a cache sharded like the sequence; at a few tokens per answer
  the forwards cost little.

Every rank of the group calls each function with the same global inputs (the same prompts and documents).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SplitEval:
    """Where a sequence is split: this rank's sequence-parallel group and its mode ("ring" | "ulysses")."""

    group: object
    mode: str = "ring"


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
    """Greedy continuation of equal-length prompts [B, L] -> new tokens [B, max_new_tokens], on every rank."""
    tokens = prompts
    for _ in range(max_new_tokens):
        n = tokens.shape[1]
        where = _shard_positions(n, split, tokens.device)
        holder = (where == n - 1).nonzero()
        keep = torch.tensor([int(holder[0]) if len(holder) else 0], device=tokens.device)
        logits = _split_forward(model, tokens, split, logits_to_keep=keep).logits[:, -1]
        choice = logits.argmax(-1) if len(holder) else torch.full(logits.shape[:1], -1, device=logits.device)
        dist.all_reduce(choice, op=dist.ReduceOp.MAX, group=split.group)
        tokens = torch.cat([tokens, choice[:, None]], dim=1)
    return tokens[:, prompts.shape[1]:]
