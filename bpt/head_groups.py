"""Fused attention whose backward runs a group of key / value heads (or of one's query heads) at a time.

A fused kernel's backward holds a workspace of its own beside the gradients it returns: FlashAttention-2's is an
fp32 dq accumulator [B, Nq, Hq, D], softmax_d [B, Hq, Nq], and with grouped-query heads dk / dv at the query heads'
count [B, Nk, Hq, D] before they are summed down (~32 KiB per token for Llama-3.1-8B; under checkpoint offload, the
largest item at the step's peak). Every head's backward depends on that head alone (and a key / value head's on its
own query heads), so running the backward for some of the heads at a time gives the same gradients while holding
one group's workspace. Where the whole does not fit, the split is by query head (`head_groups_for`): each call sees
one query head and its key / value head (no GQA expansion), and a key / value head's gradients are summed over its
query heads' calls in fp32. The forward is one call over every head, as stock's, and saves what stock's saves (q,
k, v, out, logsumexp): no recompute. Where checkpoint offload spills a recompute's tensors (bpt.host_copies.spilled),
q, k and v wait for the backward on the host, and the copies it fetches take dq, dk and dv. How many groups
is asked when backward runs (inside a checkpointed layer's backward, where the step's peak is), so the path itself
must not depend on what is free: the caller takes it by the inputs' shapes (BPTConfig.attention_head_groups).

The kernels are torch's own: on CUDA its FlashAttention-2 (`aten._scaled_dot_product_flash_attention`, where
torch's `can_use_flash_attention` takes the inputs), on a CPU its flash kernel (what the tests compare against
stock); elsewhere, or when neither applies, `head_grouped_attention` answers None and the caller runs whole SDPA.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from bpt import attention_once, host_copies

aten = torch.ops.aten


def head_groups_for(q_heads: int, kv_heads: int, whole_bytes: int, budget: int) -> int:
    """1 when the whole workspace fits `budget`; else one query head at a time (q_heads groups). A call over one
    query head holds the least: no dk / dv expanded to the query heads, a fp32 dq accumulator of one head, and the
    copies the kernel makes of that head's output and output gradient (a slice of a [B, N, H, D] tensor's heads is
    not contiguous); its key / value head's gradients are summed over its query heads in fp32, the arithmetic
    FlashAttention-2's grouped-query backward does itself (each query head's dk / dv rounded to the inputs' dtype,
    then summed). Where the split is needed the sequence is long, so one head's query tiles still fill the GPU."""
    return 1 if whole_bytes <= budget else q_heads


def flash_backward_bytes(q: Tensor, k: Tensor) -> int:
    """FlashAttention-2's backward workspace for q [B, Hq, Nq, D], k [B, Hkv, Nk, D] (lengths rounded up to 128,
    the head dim to 32): softmax_d and the fp32 dq accumulator, and dk / dv at the query heads' count under GQA."""
    b, hq, nq, d = q.shape
    nq_r, d_r = -(-nq // 128) * 128, -(-d // 32) * 32
    size = b * hq * nq_r * 4 + b * nq_r * hq * d_r * 4
    if k.shape[1] != hq:
        size += 2 * b * k.shape[2] * hq * d * q.element_size()
    return size


def _flash_applies(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> bool:
    if q.device.type == "cpu":
        return True
    if not q.is_cuda:
        return False
    from torch.backends import cuda

    params = cuda.SDPAParams(q, k, v, None, 0.0, is_causal, q.shape[1] != k.shape[1])
    return cuda.flash_sdp_enabled() and cuda.can_use_flash_attention(params, False)


def head_grouped_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, is_causal: bool,
                           groups: Callable[[], int]) -> Tensor | None:
    """q [B, Hq, N, D], k / v [B, Hkv, N, D] -> [B, Hq, N, D], the backward in `groups()` groups (asked when backward
    runs: what is free then): a divisor of Hkv splits the key / value heads, a multiple of Hkv dividing Hq splits
    each key / value head's query heads too (its dk / dv summed over them in fp32); None where torch's flash kernel
    does not take these inputs."""
    if not _flash_applies(q, k, v, is_causal):
        return None
    return _HeadGroupedAttention.apply(q, k, v, scale, is_causal, groups)


class _HeadGroupedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, is_causal, groups):
        # in a checkpointed layer's recompute, what its forward kept (bpt.attention_once), else the kernel's results
        running = attention_once.current()
        results = running[0].take((q, k, v)) if running is not None and running[1] else None
        if results is None:
            if q.device.type == "cpu":
                results = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
            else:
                results = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:8]
            if running is not None and not running[1]:
                running[0].keep((q, k, v), results)
        if q.device.type == "cpu":
            out, lse = results
            ctx.lengths = ()
            ctx.save_for_backward(*map(host_copies.spilled, (q, k, v)), out, lse)
        else:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset = results
            ctx.lengths = (max_q, max_k)
            ctx.save_for_backward(*map(host_copies.spilled, (q, k, v)), out, lse, cum_q, cum_k, seed, offset)
        ctx.scale, ctx.is_causal, ctx.groups_now = scale, is_causal, groups
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        (q, own_q), (k, own_k), (v, own_v) = map(host_copies.unspilled, saved[:3])
        out, lse, *extras = saved[3:]
        groups, hq, hkv = ctx.groups_now(), q.shape[1], k.shape[1]
        if hkv % groups and (groups % hkv or hq % groups):
            raise ValueError(f"head_grouped_attention: {groups} groups neither divide the {hkv} key / value heads nor "
                             f"split each one's query heads ({hq} query heads)")
        if groups == 1 and not (own_q or own_k or own_v):  # one call over every head: its gradients as the kernel
            return (*_backward_call(ctx, dout, q, k, v, out, lse, extras), None, None, None)  # returns them
        # q, k, v fetched back from the host are this backward's own: a head's gradient takes its place once the
        # head's calls are done. Else dk / dv are made at their first write (with a single key / value head: after
        # the last call, so never beside that call's workspace).
        dq, dk, dv = q if own_q else torch.empty_like(q), None, None
        q_per_group, per_kv = hq // groups, max(1, groups // hkv)  # groups per key / value head
        kv_per_group = max(1, hkv // groups)
        summed = None  # fp32 dk / dv of one key / value head over its query-head groups
        for group in range(groups):
            qs = slice(group * q_per_group, (group + 1) * q_per_group)
            first_kv = group // per_kv * kv_per_group
            ks = slice(first_kv, first_kv + kv_per_group)
            part_q, part_k, part_v = _backward_call(ctx, dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs],
                                                    lse[:, qs].contiguous(), extras)
            dq[:, qs].copy_(part_q)
            if per_kv == 1:
                done = part_k, part_v
            else:  # this key / value head's query heads take per_kv calls: its dk / dv summed over them in fp32
                if group % per_kv == 0:
                    summed = (part_k.float(), part_v.float())
                else:
                    summed[0].add_(part_k)
                    summed[1].add_(part_v)
                done = summed if group % per_kv == per_kv - 1 else None
            del part_q, part_k, part_v  # before the next group's call: one group's parts alive at a time
            if done is not None:
                if dk is None:
                    dk = k if own_k else torch.empty_like(k)
                    dv = v if own_v else torch.empty_like(v)
                dk[:, ks].copy_(done[0])
                dv[:, ks].copy_(done[1])
                done = summed = None
        return dq, dk, dv, None, None, None


def _backward_call(ctx, dout, q, k, v, out, lse, extras) -> tuple[Tensor, Tensor, Tensor]:
    """torch's flash backward over these heads -> (dq, dk, dv)."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, ctx.is_causal,
                                                                         scale=ctx.scale)
    cum_q, cum_k, seed, offset = extras
    return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, *ctx.lengths, 0.0,
                                                             ctx.is_causal, seed, offset, scale=ctx.scale)[:3]
