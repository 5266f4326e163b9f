"""Ulysses sequence parallelism: all-to-all from sequence-split to head-split, full-sequence attention per head.

Layout (contiguous). A global sequence of N tokens is padded at its END to N_pad = W * S tokens, S = ceil(N / W),
and rank r of a group of W ranks holds tokens [r * S, (r + 1) * S) (the last rank(s) hold the padding; with
N = 5, W = 4 rank 3 holds only padding). `sequence_shard` / `sequence_unshard` / `sequence_positions` convert
between the layouts; every per-token tensor that is sharded (hidden states, q / k / v, labels, dO) is sharded
this way. Every rank has the same local length S, so communication shapes never depend on N.

Uneven lengths: pass the true global length as `seq_len` (default: the length of the global padding_mask /
segment_ids when given, else W * S). After the all-to-all each rank holds its heads for all N_pad tokens, cuts
them to the first seq_len tokens and runs `blockwise_attention` on exactly the unpadded sequence; the output is
padded back with zeros. So rows past seq_len output exact zeros, pad tokens get exact zero q / k / v gradients
(their dO is ignored), and the real tokens see exactly what `blockwise_attention` on one device computes,
whatever the pad tokens hold.

Algorithm. Query heads are split into W contiguous groups of Hl = Hq / W heads (Hq must divide by W); rank r
gets query heads [r * Hl, (r + 1) * Hl) and the key/value heads those query heads use (query head h uses kv head
h // (Hq / Hkv), as in blockwise_attention). When Hkv divides by W that is a plain split of Hkv / W kv heads per
rank. When it does not (MQA, or few KV heads: Hkv < W), a kv head is sent to every rank whose query heads use it,
and only to those (each rank receives the contiguous range of kv heads it needs, so a kv head is copied to at
most ceil(Hq / Hkv / Hl) + 1 ranks, W / Hkv of them when Hkv divides W); if a rank's query heads do not use its kv
heads in equal consecutive groups (e.g. Hq = 12, Hkv = 3, W = 4: rank 1 has query heads 3, 4, 5 -> kv heads
0, 1, 1), its kv heads are repeated locally to one per query head. The kv gradients of the copies are summed
on the owning rank by the backward of the same all-to-all.

One forward call makes two collectives: one all_to_all_single carrying q, k and v together (flattened, with
per-rank split sizes) and one for the output. The custom autograd Function `_AllToAll` has the inverse
all-to-all (input and output splits swapped) as its backward, so backward makes two collectives as well and
never differentiates through c10d. Every rank of the group must call forward and backward in the same order.

Side inputs:
- per-token (padding_mask [B, N], segment_ids [B, N], key_bias [B, Hq, N]): the GLOBAL tensors, identical on
  every rank, of length seq_len or N_pad (cut to seq_len). Global positions are implicit (token t sits at
  position t), so causal / sliding-window / ALiBi / packing masks are exact across ranks. `gather_sequence`
  builds a global tensor from every rank's local shard (one all_gather) when only the shard is at hand.
- per-head (alibi_slopes [Hq], sinks [Hq], key_bias's head dim): global; each rank uses its heads' entries.
  sinks may require grad: each rank's sinks.grad then holds its own heads' share (over all tokens) and zeros
  elsewhere, so summing sinks.grad over the group (as is done for every parameter replicated across a
  sequence-parallel group, e.g. the q / k / v projections) gives the exact gradient.
Not supported (raise ValueError): dropout > 0 (each rank would draw its heads' keep-masks from its own seed:
not reproducible against one device), and Hq not divisible by W (use ring attention, bpt.sequence_parallel.ring).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from bpt.attention import blockwise_attention
from bpt.attention_inputs import autocast_inputs
from bpt.sequence_parallel import traffic

__all__ = ["ulysses_attention", "sequence_shard", "sequence_unshard", "sequence_positions", "gather_sequence",
           "kv_head_ranges"]


# ----------------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------------


def _shard_len(n: int, world: int) -> int:
    return -(-n // world)


def sequence_shard(x: Tensor, dim: int, rank: int, world: int, *, pad_value=0) -> Tensor:
    """Global tensor -> rank's contiguous shard along dim: tokens [rank * S, (rank + 1) * S) of the sequence
    padded with pad_value at its end to W * S tokens, S = ceil(N / W)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    n = x.shape[dim]
    s = _shard_len(n, world)
    pad = world * s - n
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_full(shape, pad_value)], dim)
    return x.narrow(dim, rank * s, s)


def sequence_unshard(shards: list[Tensor] | tuple[Tensor, ...], dim: int, seq_len: int | None = None) -> Tensor:
    """Every rank's shard (in rank order) -> the global tensor along dim, cut to seq_len (the inverse of
    sequence_shard)."""
    if len(shards) == 0 or any(s.shape != shards[0].shape for s in shards):
        raise ValueError("sequence_unshard needs one shard per rank, all of one shape")
    x = torch.cat(list(shards), dim)
    return x if seq_len is None else x.narrow(dim, 0, seq_len)


def sequence_positions(local_len: int, rank: int, world: int, device=None) -> Tensor:
    """Global positions [S] of the tokens of rank's shard (positions >= N are padding)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    return torch.arange(rank * local_len, (rank + 1) * local_len, device=device)


def gather_sequence(x: Tensor, dim: int, *, group=None, seq_len: int | None = None) -> Tensor:
    """Every rank's shard of x (sequence_shard layout, one shape on every rank) -> the global tensor along dim,
    cut to seq_len, on every rank (one all_gather). Meant for per-token side inputs (padding mask, segment or
    position ids): not differentiable."""
    world = dist.get_world_size(group)
    flag = x.dtype == torch.bool  # gloo has no bool all_gather
    src = (x.to(torch.uint8) if flag else x).detach().contiguous()
    parts = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(parts, src, group=group)
    out = sequence_unshard(parts, dim, seq_len)
    return out.bool() if flag else out


def kv_head_ranges(hq: int, hkv: int, world: int) -> list[tuple[int, int]]:
    """For each rank of the head split: the range [a, b) of kv heads its query heads [r*Hq/W, (r+1)*Hq/W) use
    (query head h uses kv head h // (Hq / Hkv))."""
    hl, g = hq // world, hq // hkv
    return [(r * hl // g, ((r + 1) * hl - 1) // g + 1) for r in range(world)]


# ----------------------------------------------------------------------------------------------------
# Communication
# ----------------------------------------------------------------------------------------------------


def _all_to_all(x: Tensor, in_splits: list[int], out_splits: list[int], group) -> Tensor:
    x = x.contiguous()
    rank, size = dist.get_rank(group), x.element_size()
    # bytes leaving this rank: every split but its own
    traffic.add("ulysses_all_to_all", (sum(in_splits) - in_splits[rank]) * size)
    out = x.new_empty(sum(out_splits))
    dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    # the output is read next: the exchange is waited for at once
    traffic.waited(traffic.started("ulysses_all_to_all", {j: n * size for j, n in enumerate(in_splits) if j != rank},
                                   {j: n * size for j, n in enumerate(out_splits) if j != rank}))
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of a 1-D tensor (split sizes in elements); backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x: Tensor, in_splits: list[int], out_splits: list[int], group) -> Tensor:
        ctx.in_splits, ctx.out_splits, ctx.group = in_splits, out_splits, group
        return _all_to_all(x, in_splits, out_splits, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad, ctx.out_splits, ctx.in_splits, ctx.group), None, None, None


# ----------------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------------


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    seq_len: int | None = None,
    padding_mask: Tensor | None = None,
    segment_ids: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    key_bias: Tensor | None = None,
    sinks: Tensor | None = None,
    dropout: float = 0.0,
    head_groups_rule: Callable[[Tensor, Tensor], Callable[[], int] | None] | None = None,
    **attention_kwargs,
) -> Tensor:
    """Self-attention over a sequence sharded contiguously across `group` (see the module docstring).

    q [B, Hq, S, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv]: this rank's LOCAL shard (tokens [rank*S, (rank+1)*S),
    S the same on every rank) -> this rank's output shard [B, Hq, S, Dv]. seq_len: the true global length
    (default: the length of the global padding_mask / segment_ids if given, else W * S). padding_mask
    [B, N], segment_ids [B, N], key_bias [B, Hq, N]: GLOBAL (N = seq_len or W * S), the same on every rank.
    alibi_slopes / sinks [Hq]: global. Other keyword arguments (scale, causal, sliding_window, softcap, q_block,
    kv_block, compile) go to blockwise_attention unchanged. head_groups_rule: (q, k) of the attention this rank
    runs -> blockwise_attention's head_groups (how a fused backward is split; bpt.head_groups), or None. Without an
    initialised process group (or with a group of one rank) this is blockwise_attention on the (cut) local tensors.
    """
    if dropout:
        raise ValueError("ulysses_attention does not support dropout: pass dropout=0.0 (attention dropout is 0 "
                         "in the models trained at long context)")
    if "dropout_seed" in attention_kwargs:
        raise ValueError("ulysses_attention does not support dropout (got dropout_seed)")
    q, k, v = autocast_inputs(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point 4-D tensor [batch, heads, seq, head_dim], got "
                             f"{getattr(t, 'shape', type(t))} {getattr(t, 'dtype', '')}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    if k.shape != (b, hkv, s, d) or v.shape[:3] != (b, hkv, s):
        raise ValueError("ulysses_attention needs q, k, v shards of one batch and one local length, and k, v of "
                         f"one head count and q's head_dim for k: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    if hq % world:
        raise ValueError(f"ulysses_attention splits the {hq} query heads over the {world} ranks of the group, so "
                         f"they must divide by {world}; use ring attention (bpt.sequence_parallel.ring) for this head count")
    padded = world * s
    if seq_len is None:
        given = padding_mask if padding_mask is not None else segment_ids
        known = isinstance(given, Tensor) and given.dim() == 2 and 0 < given.shape[1] <= padded
        seq_len = given.shape[1] if known else padded  # else: a wrong global length is reported below
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 0 < seq_len <= padded:
        raise ValueError(f"seq_len must be an integer in [1, world * local length = {padded}], got {seq_len!r}")
    for name, t in (("padding_mask", padding_mask), ("segment_ids", segment_ids), ("key_bias", key_bias)):
        if t is not None and (not isinstance(t, Tensor) or t.shape[-1] not in (seq_len, padded)):
            raise ValueError(f"{name} must be the GLOBAL tensor (last dim = seq_len {seq_len} or world * local "
                             f"length {padded}), got {getattr(t, 'shape', type(t))}; gather_sequence builds it "
                             "from the local shards")
    cut = lambda t: None if t is None else t[..., :seq_len]  # noqa: E731
    padding_mask, segment_ids, key_bias = cut(padding_mask), cut(segment_ids), cut(key_bias)

    hl = hq // world
    heads = slice(rank * hl, (rank + 1) * hl)
    if alibi_slopes is not None:
        _check_heads("alibi_slopes", alibi_slopes, hq)
        alibi_slopes = alibi_slopes[heads]
    if sinks is not None:
        _check_heads("sinks", sinks, hq)
        sinks = sinks[heads]
    if key_bias is not None:
        if key_bias.dim() != 3 or key_bias.shape[:2] != (b, hq):
            raise ValueError(f"key_bias must be [batch, q_heads, N] = [{b}, {hq}, N], got {tuple(key_bias.shape)}")
        key_bias = key_bias[:, heads]
    options = dict(attention_kwargs, padding_mask=padding_mask, segment_ids=segment_ids,
                   alibi_slopes=alibi_slopes, key_bias=key_bias, sinks=sinks)
    groups = (lambda q, k: None) if head_groups_rule is None else head_groups_rule
    if world == 1:
        q, k, v = q[:, :, :seq_len], k[:, :, :seq_len], v[:, :, :seq_len]
        out = blockwise_attention(q, k, v, head_groups=groups(q, k), **options)
        return F.pad(out, (0, 0, 0, padded - seq_len)) if padded > seq_len else out

    # sequence-split -> head-split: one all-to-all carrying this rank's tokens of every destination's q heads
    # and kv heads ([kv heads, B, S, D + Dv]: k and v side by side), flattened per destination; each piece copied
    # once, straight into the send buffer (the step's peak can sit here at long context)
    ranges = kv_head_ranges(hq, hkv, world)
    dv = v.shape[3]
    q_numel = hl * b * s * d
    kv_numel = [(e - a) * b * s * (d + dv) for a, e in ranges]
    a_r, e_r = ranges[rank]
    n_r = e_r - a_r
    send = q.new_empty(world * q_numel + sum(kv_numel))
    start = 0
    for j, (a, e) in enumerate(ranges):
        send[start:start + q_numel].view(hl, b, s, d).copy_(q[:, j * hl:(j + 1) * hl].transpose(0, 1))
        kv = send[start + q_numel:start + q_numel + kv_numel[j]].view(e - a, b, s, d + dv)
        kv[..., :d].copy_(k[:, a:e].transpose(0, 1))
        kv[..., d:].copy_(v[:, a:e].transpose(0, 1))
        start += q_numel + kv_numel[j]
    recv = _AllToAll.apply(send, [q_numel + x for x in kv_numel], [q_numel + kv_numel[rank]] * world,
                           group).view(world, -1)
    del send, kv
    q_loc = recv[:, :q_numel].reshape(world, hl, b, s, d).permute(2, 1, 0, 3, 4).reshape(b, hl, padded, d)
    kv_loc = recv[:, q_numel:].reshape(world, n_r, b, s, d + dv).permute(2, 1, 0, 3, 4).reshape(
        b, n_r, padded, d + dv)
    # local query head i uses global kv head (rank * hl + i) // G; the kernel needs i // (hl / n_r) for it
    g = hq // hkv
    need = [(rank * hl + i) // g - a_r for i in range(hl)]
    if hl % n_r or need != [i // (hl // n_r) for i in range(hl)]:  # irregular grouping: one kv head per q head
        kv_loc = kv_loc.index_select(1, torch.tensor(need, device=kv_loc.device))
    k_loc, v_loc = kv_loc[:, :, :seq_len, :d], kv_loc[:, :, :seq_len, d:]

    del recv, kv_loc
    q_loc = q_loc[:, :, :seq_len]
    out = blockwise_attention(q_loc, k_loc, v_loc, head_groups=groups(q_loc, k_loc), **options)  # [B, Hl, N, Dv]
    del q_loc, k_loc, v_loc
    if padded > seq_len:
        out = F.pad(out, (0, 0, 0, padded - seq_len))  # rows past seq_len: zeros (their dO is dropped)

    # head-split -> sequence-split
    send = out.reshape(b, hl, world, s, dv).permute(2, 1, 0, 3, 4).reshape(-1)  # [W, Hl, B, S, Dv] flat
    del out
    numel = hl * b * s * dv
    recv = _AllToAll.apply(send, [numel] * world, [numel] * world, group)
    return recv.view(hq, b, s, dv).transpose(0, 1)


def _check_heads(name: str, t, hq: int) -> None:
    if not isinstance(t, Tensor) or t.shape != (hq,):
        raise ValueError(f"{name} must be a [q_heads] = [{hq}] tensor, got {getattr(t, 'shape', type(t))}")
