"""Ring attention on torch's fused attention kernel: one kernel call per rectangle of (query rows, key rows) a ring
step computes, partial outputs merged by their logsumexp.

Where no mask but causality applies (no padding mask, packed documents, window, ALiBi, softcap or sinks), every
(query chunk, key chunk) pair of the zigzag layout (bpt.sequence_parallel.ring) is either hidden, fully visible, or
causal on its diagonal (the same global positions): shapes torch's fused kernel takes. Per ring step the visible
pairs are joined into as few rectangles as the layout allows (`step_calls`: under causality one call per step, three
on the rank's own shard; without it one), so the kernel launches grow with the ring's hops, not with the tokens.

Forward: each call returns its rows' output and logsumexp; the rows' running output (fp32, the accumulation dtype)
and logsumexp are merged as the online softmax merges blocks:
    lse = logaddexp(lse_a, lse_b),  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).
Backward: the fused backward of every call, given the GLOBAL output and logsumexp of its rows (so its probabilities
and rowsum(dO * O) are the whole row's): dQ accumulates locally, the shard's dK / dV in an fp32 accumulator that
travels one hop behind its shard as in the blockwise ring. With a head-group rule (bpt.head_groups' arithmetic) the
backward runs a group of query heads at a time, to hold one group's kernel workspace.

Kernels: on a CPU `aten._scaled_dot_product_flash_attention_for_cpu` (any float dtype, grouped-query heads taken as
they are); on CUDA `aten._scaled_dot_product_flash_attention` where torch's own predicate
(`torch.backends.cuda.can_use_flash_attention`) accepts the inputs. Elsewhere `fused_ring_applies` says no and the
ring keeps the blockwise engine. Padding past the true length (`seq_len`) is cut off each call: real tokens are a
prefix of each shard, so a call sees only the real rows and keys; pad rows output zeros and get no gradient.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from bpt import attention_once
from bpt.engine import autocast_off

aten = torch.ops.aten

__all__ = ["fused_ring_applies", "fused_ring_attention", "step_calls"]


def fused_ring_applies(q: Tensor, k: Tensor, v: Tensor, causal: bool, c: int, masked: bool) -> bool:
    """Whether the fused path computes this ring call: no mask but causality (`masked` False), and torch's fused
    kernel takes this rank's shards: q [B, Hq, 2c, D], k / v [B, Hkv, 2c, D] (on CUDA asked of torch, for the causal
    diagonal pair [c x c] and the whole shard)."""
    if masked or v.shape[-1] != q.shape[-1]:
        return False
    if q.device.type == "cpu":
        return True
    if not q.is_cuda:
        return False
    from torch.backends import cuda

    if not cuda.flash_sdp_enabled():
        return False
    gqa = q.shape[1] != k.shape[1]
    shapes = [(q, k, v, False)] + ([(q[:, :, :c], k[:, :, :c], v[:, :, :c], True)] if causal else [])
    return all(cuda.can_use_flash_attention(cuda.SDPAParams(a, b, d, None, 0.0, is_causal, gqa), False)
               for a, b, d, is_causal in shapes)


def step_calls(rank_starts: tuple[int, int], src_starts: tuple[int, int], c: int, seq_len: int,
               causal: bool) -> list[tuple[int, int, int, int, bool]]:
    """The kernel calls of one ring step: (r0, r1, j0, j1, is_causal), rows r0:r1 of this rank's shard against keys
    j0:j1 of the source's shard (local indices; chunk 0 at 0:c, chunk 1 at c:2c), cut to the real tokens.

    rank_starts / src_starts: the global position of each shard's two chunks. A pair is hidden when causality puts
    every key after every query, causal on the diagonal (the same positions), else fully visible. Fully visible pairs
    sharing a key chunk become one call over both query chunks, those sharing a query chunk one over both key chunks.
    Real tokens are those before seq_len, a prefix of each shard (the later chunk is padded first)."""
    real = lambda starts, i: min(c, max(0, seq_len - starts[i]))  # noqa: E731  real tokens of chunk i
    rows = [real(rank_starts, 0), real(rank_starts, 1)]
    keys = [real(src_starts, 0), real(src_starts, 1)]
    full, diagonal = set(), []
    for qc in (0, 1):
        for kc in (0, 1):
            if not rows[qc] or not keys[kc]:
                continue
            p0, k0 = rank_starts[qc], src_starts[kc]
            if causal and k0 > p0:
                continue  # chunks are aligned: every key after every query
            if causal and k0 == p0:
                diagonal.append((qc, kc))
            else:
                full.add((qc, kc))
    span = lambda sizes, i: (i * c, i * c + sizes[i])  # noqa: E731
    both = lambda sizes: (0, sizes[0] + (sizes[1] if sizes[0] == c else 0))  # noqa: E731  a prefix of the shard
    calls = []
    if len(full) == 4:
        calls.append((*both(rows), *both(keys), False))
        full.clear()
    for kc in (0, 1):
        if {(0, kc), (1, kc)} <= full:
            calls.append((*both(rows), *span(keys, kc), False))
            full -= {(0, kc), (1, kc)}
    for qc in (0, 1):
        if {(qc, 0), (qc, 1)} <= full:
            calls.append((*span(rows, qc), *both(keys), False))
            full -= {(qc, 0), (qc, 1)}
    calls += [(*span(rows, qc), *span(keys, kc), False) for qc, kc in sorted(full)]
    calls += [(*span(rows, qc), *span(keys, kc), True) for qc, kc in diagonal]
    return calls


def fused_ring_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, ring,
                         head_groups: Callable[[], int] | None = None) -> Tensor:
    """q [B, Hq, n, D], k / v [B, Hkv, n, D] (this rank's zigzag shards, n = 2c) -> [B, Hq, n, D]. ring: the call's
    `bpt.sequence_parallel.ring._Ring` (ranks, chunk geometry, true length, exchange). head_groups: asked when
    backward runs, how many groups of query heads its kernel calls take in turn (None: all at once)."""
    return _FusedRing.apply(q, k, v, scale, causal, ring, head_groups)


def _calls(ring, src: int, causal: bool):
    return step_calls(ring.chunk_starts(ring.rank), ring.chunk_starts(src), ring.c, ring.seq_len, causal)


def _wait(works) -> None:
    for work in works:
        work.wait()


# ----------------------------------------------------------------------------------------------------
# The kernels
# ----------------------------------------------------------------------------------------------------


def _kernel_forward(q, k, v, scale: float, is_causal: bool):
    """-> (out [B, Hq, Nq, D], logsumexp [B, Hq, Nq], what the CUDA backward needs of the forward)."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        return out, lse, None
    out, lse, cum_q, cum_k, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal,
                                                                                              False, scale=scale)
    return out, lse[..., :q.shape[2]], (cum_q, cum_k, seed, offset)  # what a dense call returns, as head_groups keeps


def _kernel_backward(dout, q, k, v, out, lse, scale: float, is_causal: bool, extras):
    """-> (dq, dk, dv) of one call, from the rows' global output and logsumexp (no dropout). extras: the CUDA
    forward's (cum_seq_q, cum_seq_k, seed, offset) of the first call (a dense call's, the same for every call)."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, is_causal,
                                                                         scale=scale)
    cum_q, cum_k, seed, offset = extras
    return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2],
                                                             k.shape[2], 0.0, is_causal, seed, offset,
                                                             scale=scale)[:3]


def _merge(acc: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """Fold one call's rows (out [B, H, R, D], lse [B, H, R]) into the running acc [B, H, R, D] / acc_lse [B, H, R]
    (views of the whole shard's, in the accumulation dtype), in place."""
    lse = lse.to(acc_lse.dtype)
    total = torch.logaddexp(acc_lse, lse)
    acc.mul_(torch.exp(acc_lse - total).unsqueeze(-1))
    acc.addcmul_(out, torch.exp(lse - total).unsqueeze(-1))  # no fp32 copy of out
    acc_lse.copy_(total)


def _head_slices(groups: int, hq: int, hkv: int) -> list[tuple[slice, slice]]:
    """(query heads, their key / value heads) of each of `groups` groups: a divisor of Hkv splits the key / value
    heads, a multiple of Hkv dividing Hq splits each one's query heads too."""
    if groups <= 1:
        return [(slice(None), slice(None))]
    if hkv % groups and (groups % hkv or hq % groups):
        raise ValueError(f"ring attention: {groups} head groups neither divide the {hkv} key / value heads nor split "
                         f"each one's query heads ({hq} query heads)")
    per_q, per_kv = hq // groups, max(1, hkv // groups)
    per_group = max(1, groups // hkv)  # groups per key / value head
    return [(slice(i * per_q, (i + 1) * per_q), slice(i // per_group * per_kv, i // per_group * per_kv + per_kv))
            for i in range(groups)]


def _ring_forward(q, k, v, scale: float, causal: bool, ring):
    """The ring's forward: every hop's calls merged into the rows' output and logsumexp -> (out [B, Hq, n, Dv] in
    q's dtype, lse [B, Hq, n] in the accumulation dtype, what the CUDA backward needs of a forward call)."""
    b, hq, n, _ = q.shape
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    acc = q.new_zeros(b, hq, n, v.shape[-1], dtype=acc_dtype)  # running output of every row
    acc_lse = q.new_full((b, hq, n), float("-inf"), dtype=acc_dtype)
    started = [False, False]  # chunk's rows hold a call's result already
    shard, extras = [k.contiguous(), v.contiguous()], None
    for step in range(ring.world):
        incoming, works = ring.exchange(shard) if step + 1 < ring.world else (None, [])  # overlaps compute
        ks, vs = shard
        for r0, r1, j0, j1, is_causal in _calls(ring, (ring.rank - step) % ring.world, causal):
            out, lse, made = _kernel_forward(q[:, :, r0:r1], ks[:, :, j0:j1], vs[:, :, j0:j1], scale, is_causal)
            extras = extras or made
            chunks = range(r0 // ring.c, (r1 - 1) // ring.c + 1)
            if not any(started[i] for i in chunks):  # the rows' first result: taken as it is
                acc[:, :, r0:r1].copy_(out)
                acc_lse[:, :, r0:r1].copy_(lse)
            else:
                _merge(acc[:, :, r0:r1], acc_lse[:, :, r0:r1], out, lse)
            del out, lse
            for i in chunks:
                started[i] = True
        _wait(works)
        shard = incoming
    # [B, N, H, D] in memory, as the fused kernel returns its output: its rows' slices are what its backward takes
    out = q.new_empty(b, n, hq, v.shape[-1]).transpose(1, 2)
    out.copy_(acc)  # rows past the true length stayed 0 (their logsumexp -inf: no call reads it)
    return out, acc_lse, extras


# ----------------------------------------------------------------------------------------------------
# Autograd Function
# ----------------------------------------------------------------------------------------------------


class _FusedRing(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, q, k, v, scale, causal, ring, head_groups):
        # a checkpointed layer's recompute takes what its forward kept (bpt.attention_once): no kernel, no exchange.
        # Every rank decides alike (the keep rule weighs the same shapes against the same device), so none waits.
        running = attention_once.current()
        kept = running[0].take((q, k, v)) if running is not None and running[1] else None
        out, lse, extras = kept if kept is not None else _ring_forward(q, k, v, scale, causal, ring)
        if running is not None and not running[1]:
            running[0].keep((q, k, v), (out, lse, extras))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal, ctx.ring, ctx.head_groups, ctx.extras = scale, causal, ring, head_groups, extras
        return out

    @staticmethod
    @once_differentiable
    @autocast_off
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, causal = ctx.ring, ctx.scale, ctx.causal
        acc_dtype = lse.dtype
        heads = _head_slices(ctx.head_groups() if ctx.head_groups else 1, q.shape[1], k.shape[1])
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        shard, grads = [k.contiguous(), v.contiguous()], None
        for step in range(ring.world):
            # K/V for the next step and the previous step's accumulator to its next holder, both in flight
            outgoing = (shard if step + 1 < ring.world else []) + ([] if grads is None else grads)
            incoming, works = ring.exchange(outgoing)
            ks, vs = shard
            dk = torch.zeros(ks.shape, dtype=acc_dtype, device=ks.device)
            dv = torch.zeros(vs.shape, dtype=acc_dtype, device=vs.device)
            for r0, r1, j0, j1, is_causal in _calls(ring, (ring.rank - step) % ring.world, causal):
                rows, cols = slice(r0, r1), slice(j0, j1)
                for qh, kh in heads:
                    parts = _kernel_backward(dout[:, qh, rows], q[:, qh, rows], ks[:, kh, cols], vs[:, kh, cols],
                                             out[:, qh, rows], lse[:, qh, rows].contiguous(), scale, is_causal,
                                             ctx.extras)
                    dq[:, qh, rows].add_(parts[0])
                    dk[:, kh, cols].add_(parts[1])
                    dv[:, kh, cols].add_(parts[2])
                    del parts  # one call's gradients alive at a time
            _wait(works)
            if grads is not None:  # the accumulator of this step's shard, from the previous rank
                dk.add_(incoming[-2])
                dv.add_(incoming[-1])
                incoming = incoming[:-2]
            grads, shard = [dk, dv], incoming
        if ring.world > 1:  # the last accumulator goes home: rank r + 1 owns the shard rank r held last
            received, works = ring.exchange(grads)
            _wait(works)
            grads = received
        dk, dv = grads
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
