"""The zigzag layout of ring attention (bpt.sequence_parallel.ring): a global sequence of N tokens padded at its end to
2W * c tokens (c = ceil(N / 2W)) and cut into 2W chunks; rank r of W holds chunks r and 2W-1-r, so under a causal
mask every rank does the same work. These convert between the global and a rank's layout."""
from __future__ import annotations

import torch
from torch import Tensor


def chunk_ids(rank: int, world: int) -> tuple[int, int]:
    return rank, 2 * world - 1 - rank


def zigzag_shard(x: Tensor, dim: int, rank: int, world: int, *, pad_value=0) -> Tensor:
    """Global tensor -> rank's zigzag shard along dim: chunks rank and 2W-1-rank of the sequence padded with
    pad_value at its end to a multiple of 2W (local length 2 * ceil(N / 2W))."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    n = x.shape[dim]
    c = -(-n // (2 * world))
    pad = 2 * world * c - n
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_full(shape, pad_value)], dim)
    a, b = chunk_ids(rank, world)
    return torch.cat([x.narrow(dim, a * c, c), x.narrow(dim, b * c, c)], dim)


def zigzag_unshard(shards: list[Tensor] | tuple[Tensor, ...], dim: int, seq_len: int | None = None) -> Tensor:
    """Every rank's shard (in rank order) -> the global tensor along dim, cut to seq_len (the inverse of
    zigzag_shard)."""
    world = len(shards)
    n = shards[0].shape[dim]
    if world == 0 or n % 2 or any(s.shape != shards[0].shape for s in shards):
        raise ValueError("zigzag_unshard needs one shard per rank, all of one shape, even along dim")
    c = n // 2
    chunks: list[Tensor | None] = [None] * (2 * world)
    for rank, shard in enumerate(shards):
        a, b = chunk_ids(rank, world)
        chunks[a], chunks[b] = shard.narrow(dim, 0, c), shard.narrow(dim, c, c)
    out = torch.cat(chunks, dim)
    return out if seq_len is None else out.narrow(dim, 0, seq_len)


def zigzag_positions(local_len: int, rank: int, world: int, device=None) -> Tensor:
    """Global positions [local_len] (int64) of a rank's zigzag shard."""
    if local_len % 2:
        raise ValueError(f"a zigzag shard has an even length, got {local_len}")
    c = local_len // 2
    a, b = chunk_ids(rank, world)
    return torch.cat([torch.arange(a * c, a * c + c, device=device), torch.arange(b * c, b * c + c, device=device)])
