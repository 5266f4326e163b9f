"""Blockwise (flash-style) attention in pure torch: memory O(N), never O(N x N).

`blockwise_attention(q, k, v, ...)` computes softmax attention block by block with an online softmax
(running max / running sum), in a custom autograd Function that saves only q, k, v, the output and one
logsumexp per query row; backward recomputes each block's probabilities from that logsumexp
(FlashAttention-2 style). Causal, sliding-window, padding, packed-document (segment) masks and ALiBi are
built per block from O(N) inputs, and blocks that the masks fully exclude are skipped without tensor work.
The block plan and the per-block math are `bpt.engine`'s (shared with ring attention); this module holds the
public API, the fused-kernel dispatch and the single-device autograd Function; `bpt.attention_inputs` checks and
casts the inputs (for ring attention too).
Cases torch's fused F.scaled_dot_product_attention handles without a mask go there instead (see
`_sdpa_handles` for the rule and the measurements behind it), and so does a decoded token (one query, no gradient)
with padding or a window, with its one row of mask (`_one_query_handles`).

Semantics shared by every path:
- Queries are aligned to the END of the keys: query i sits at key position p = Nk - Nq + i (KV-cache
  decoding, Nq < Nk, works).
- Key j is visible to the query at position p iff
    causal:          j <= p
    sliding_window:  p - j < sliding_window        (one-sided, as in transformers; without `causal`
                                                    later keys stay visible)
    padding_mask:    padding_mask[b, j]
    segment_ids:     segment_ids[b, p] == segment_ids[b, j]
- Score: s = scale * q.k ; softcap: s = softcap * tanh(s / softcap) ; ALiBi: s += slope_h * (j - p) ;
  key_bias: s += key_bias[b, h, j] (the same for every query: e.g. ALiBi on absolute key positions, rounded
  as a model rounds it; the per-query part of ALiBi cancels in the softmax).
- Dropout (training): out = (dropout(softmax(s))) @ v, as stock models apply nn.Dropout to the attention
  probabilities: each probability is zeroed with probability `dropout` and survivors are scaled by
  1 / (1 - dropout); the softmax normaliser counts every probability. On the blockwise path each block's
  keep-mask is drawn from its own generator seeded by (dropout_seed, block), so backward replays it
  exactly; the SDPA path uses SDPA's own dropout.
- Attention sinks: sinks [Hq] is a learned logit per query head that joins every row's softmax normaliser
  as a virtual key with value 0 (gpt-oss `s_aux`): p_j = exp(s_j) / (exp(sink_h) + sum_k exp(s_k)), out =
  sum_j p_j v_j, so the probabilities sum to less than 1. The sink starts each row's running max / sum
  (m = sink, l = 1): no extra pass. Its gradient is d sink_h = -sum over rows (and batch) of
  exp(sink_h - lse) * rowsum(dO * O). Always the blockwise path (SDPA has no sinks).
- A query row with no visible key (a left-padded query) computes what the stock kernel named by `empty_rows`
  computes (bpt.engine.empty_rows): "zeros" (SDPA's: exact zeros, zero gradients; the default), "uniform"
  (eager's additive mask: the mean of every value, softmax's gradient at that uniform point reaching q and k) or
  "uniform_values" (eager with masked_fill: the same output, gradient to v only) or "uniform_fused" (a float
  mask in a fused kernel: the same output, backward's rounded logsumexp giving every key probability 1). With
  sinks such a row attends only to its sink: output 0, a finite logsumexp (the sink), and zero q/k/v gradients,
  as in stock.
- Precision (the rules stock SDPA follows): under autocast, q/k/v are first cast to the autocast dtype
  (SDPA is on autocast's lower-precision list, so stock attention sees the same inputs). The blockwise
  path then runs with autocast off and computes scores, softmax statistics and accumulators in fp32
  (fp64 for fp64 inputs): never less exact than a fused kernel. The output has the (cast) inputs' dtype.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from bpt.engine import (AttentionSpec, SinkGrad, Workspace, autocast_off, backward_rows, backward_step,
                        block_mask_args, check_empty_rows, dropout_keep_mask, empty_rows_backward_step,
                        empty_rows_of, fill_empty_rows, finish_rows, forward_step, host_reads_allowed, make_plan,
                        scaled_query_rows, sink_rows, start_rows)
from bpt import attention_once
from bpt.attention_inputs import autocast_inputs, validate_inputs
from bpt.head_groups import head_grouped_attention
from bpt.varlen import documents, varlen_available, varlen_causal

__all__ = ["blockwise_attention", "segment_ids_from_position_ids"]

_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------


def blockwise_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    padding_mask: Tensor | None = None,
    segment_ids: Tensor | None = None,
    sliding_window: int | None = None,
    alibi_slopes: Tensor | None = None,
    key_bias: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout: float = 0.0,
    dropout_seed: int | None = None,
    q_block: int = 1024,
    kv_block: int = 1024,
    compile: bool | None = None,
    empty_rows: str = "zeros",
    head_groups: Callable[[], int] | None = None,
) -> Tensor:
    """Attention over q [B, Hq, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] -> [B, Hq, Nq, Dv].

    Hq must be a multiple of Hkv (GQA / MQA; K/V are never repeated in memory). padding_mask [B, Nk]
    (True / nonzero = real key), segment_ids [B, Nk] (packed documents), alibi_slopes [Hq], key_bias
    [B, Hq, Nk] (finite, no gradient; not together with alibi_slopes: it replaces them), sinks [Hq] (one
    learned sink logit per query head, may require grad; forces the blockwise path). See the
    module docstring for the exact masking and scoring rules. q_block / kv_block: tokens per block of
    the blockwise path (memory ~ B * Hq * q_block * kv_block scores per block). compile: torch.compile
    the per-block math (None = only on CUDA, see bpt.compile). dropout: probability of dropping each
    attention probability (pass it only in training); dropout_seed: the seed of the keep-masks (None: drawn
    from torch's default generator, so torch.manual_seed makes runs repeatable). empty_rows: the stock kernel's
    rule for rows with no visible key, one of bpt.engine.EMPTY_ROWS (module docstring). head_groups: on the fused
    path in training, torch's flash kernel with its backward run for `head_groups()` groups of key / value heads in
    turn (asked when backward runs; a divisor of Hkv, or a multiple splitting each one's query heads;
    bpt.head_groups): one group's workspace at a time, the same gradients. None: SDPA, whichever fused kernel torch
    picks.
    """
    q, k, v = autocast_inputs(q, k, v)
    validate_inputs(q, k, v, scale, padding_mask, segment_ids, sliding_window, alibi_slopes, softcap,
                    q_block, kv_block, compile, key_bias, dropout, sinks)
    check_empty_rows(empty_rows)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    needs_blockwise = key_bias is not None or sinks is not None  # SDPA takes neither
    if not needs_blockwise and _sdpa_handles(q, k, v, causal, padding_mask, segment_ids, sliding_window,
                                             alibi_slopes, softcap):
        return _sdpa(q, k, v, scale, causal, dropout, head_groups)
    if not needs_blockwise and _one_query_handles(q, k, v, padding_mask, segment_ids, alibi_slopes, softcap, dropout,
                                                  empty_rows):
        return _one_query_sdpa(q, k, v, scale, padding_mask, sliding_window)
    if not needs_blockwise and _varlen_handles(q, k, v, causal, padding_mask, segment_ids, sliding_window,
                                               alibi_slopes, softcap, dropout):
        layout = documents(segment_ids, q.shape[0], q.shape[2], q.device)
        if layout is not None:
            return varlen_causal(q, k, v, scale, layout, sliding_window)
    if dropout and dropout_seed is None:
        dropout_seed = int(torch.randint(2 ** 62, (), dtype=torch.int64))
    return _blockwise(q, k, v, scale=scale, causal=causal, padding_mask=padding_mask,
                      segment_ids=segment_ids, sliding_window=sliding_window, alibi_slopes=alibi_slopes,
                      softcap=softcap, q_block=q_block, kv_block=kv_block, compile=compile, key_bias=key_bias,
                      dropout=float(dropout), dropout_seed=int(dropout_seed or 0), sinks=sinks, empty_rows=empty_rows)


def segment_ids_from_position_ids(position_ids: Tensor) -> Tensor:
    """[B, N] position ids -> [B, N] int64 segment ids, starting at 0 in each row.

    A new segment starts wherever position_ids[t] != position_ids[t-1] + 1 (transformers' rule for
    packed sequences, e.g. [0 1 2 0 1 0 1 2 3] -> [0 0 0 1 1 2 2 2 2]).
    """
    if not isinstance(position_ids, Tensor) or position_ids.dim() != 2:
        raise ValueError("position_ids must be a [batch, seq] tensor, got "
                         f"{getattr(position_ids, 'shape', type(position_ids))}")
    if position_ids.is_floating_point() or position_ids.is_complex():
        raise ValueError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    pos = position_ids.long()
    starts = torch.ones_like(pos, dtype=torch.bool)  # [B, N]
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return starts.long().cumsum(1) - 1


# ----------------------------------------------------------------------------------------------------
# Fused-kernel fast path
# ----------------------------------------------------------------------------------------------------

# Why dispatch on CPU too (dev box: 2-core AVX-512 EPYC, torch 2.13, fp32, B=1, Hq=8, Hkv=4, D=64,
# N=8192, causal, forward+backward, 1 thread, CPU seconds, min of 2 interleaved runs; peak RSS above the
# inputs in a fresh process). For scale, one head's N x N fp32 scores alone are 256 MiB.
#   SDPA (aten _scaled_dot_product_flash_attention_for_cpu)    3.6 s   102 MiB
#   blockwise q_block = kv_block = 256                          4.2 s   103 MiB
#                                  512                          4.9 s   118 MiB
#                                  1024                         5.0 s   182 MiB
#                                  2048                         6.0 s   397 MiB
# The CPU kernel takes GQA natively (enable_gqa: no repeat_interleave, dk/dv come back with Hkv heads;
# repeating K/V by hand peaked at 151 MiB) and is picked for fp32/bf16/fp16/fp64 and any head_dim.
# On CUDA, SDPA silently falls back to its O(N^2) math kernel when no fused kernel accepts the inputs,
# so it is used only where torch's own predicates say a fused one (flash, cuDNN, memory-efficient) does.


def _sdpa_handles(q, k, v, causal, padding_mask, segment_ids, window, slopes, softcap) -> bool:
    """True when F.scaled_dot_product_attention computes exactly this case, fused and in O(N) memory."""
    if padding_mask is not None or segment_ids is not None or window is not None:
        return False
    if slopes is not None or softcap is not None:
        return False
    nq, nk, d = q.shape[2], k.shape[2], q.shape[3]
    if nq == 0 or nk == 0 or v.shape[-1] != d:
        return False
    # SDPA's is_causal aligns queries to the START of the keys; that matches ours only when Nq == Nk
    # (or Nq == 1: the last position sees every key).
    if causal and nq != nk and nq != 1:
        return False
    gqa = q.shape[1] != k.shape[1]
    if gqa and not _SDPA_HAS_GQA:
        return False
    if q.device.type == "cpu":
        return True
    if q.is_cuda:
        return _cuda_fused_kernel_applies(q, k, v, causal and nq > 1, gqa)
    return False  # other backends: not measured


def _one_query_handles(q, k, v, padding_mask, segment_ids, slopes, softcap, dropout, empty_rows) -> bool:
    """One query per row and no gradient (decoding with padding and / or a window): its scores are one row of Nk,
    so SDPA with an explicit boolean mask computes it in O(N), with no loop over key blocks. Under torch.compile
    such a loop specialises on the number of keys, which a static cache's decoding grows by one per token: a graph
    per decoded token (measured: 8 graphs for 12 left-padded tokens, where stock makes 2)."""
    if q.shape[2] != 1 or segment_ids is not None or slopes is not None or softcap is not None or dropout:
        return False
    if empty_rows != "zeros" or torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return v.shape[-1] == q.shape[-1] and (q.shape[1] == k.shape[1] or _SDPA_HAS_GQA)


def _one_query_sdpa(q, k, v, scale, padding_mask, window):
    """The single query sits at position Nk - 1 (the end of the keys): every key is causally visible, the window
    keeps the last `window`, padding drops its own; a row with no visible key is zeros (empty_rows "zeros")."""
    nk = k.shape[2]
    visible = torch.ones(q.shape[0], nk, dtype=torch.bool, device=q.device)
    if window is not None:
        visible = visible & (torch.arange(nk, device=q.device) > nk - 1 - window)
    if padding_mask is not None:
        visible = visible & (padding_mask != 0)
    mask = visible[:, None, None, :]
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **gqa)
    return torch.where(mask.any(-1, keepdim=True), out, out.new_zeros(()))


def _varlen_handles(q, k, v, causal, padding_mask, segment_ids, window, slopes, softcap, dropout) -> bool:
    """True for packed documents and / or a sliding window, causal, on CUDA in 16-bit, where torch says its flash
    kernel takes these inputs: torch's variable-length flash attention computes it (bpt/varlen.py)."""
    if segment_ids is None and window is None:
        return False
    if not causal or padding_mask is not None or slopes is not None or softcap is not None or dropout:
        return False
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[2] != k.shape[2]:
        return False
    if not host_reads_allowed():  # the document lengths are read on the host (tracing, full-graph compile: no)
        return False
    if v.shape[-1] != q.shape[-1] or not varlen_available():
        return False
    from torch.backends import cuda

    params = cuda.SDPAParams(q, k, v, None, 0.0, True, q.shape[1] != k.shape[1])
    return cuda.flash_sdp_enabled() and cuda.can_use_flash_attention(params, False)


def _cuda_fused_kernel_applies(q, k, v, is_causal: bool, gqa: bool) -> bool:
    """Whether one of SDPA's fused CUDA kernels accepts these inputs, asked of torch itself."""
    from torch.backends import cuda

    params = cuda.SDPAParams(q, k, v, None, 0.0, is_causal, gqa)
    checks = (cuda.flash_sdp_enabled, cuda.can_use_flash_attention), \
        (cuda.cudnn_sdp_enabled, cuda.can_use_cudnn_attention), \
        (cuda.mem_efficient_sdp_enabled, cuda.can_use_efficient_attention)
    return any(enabled() and can_use(params, False) for enabled, can_use in checks)


def _ONE_GROUP() -> int:
    return 1


def _sdpa(q, k, v, scale, causal, dropout, head_groups=None):
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    is_causal = causal and q.shape[2] > 1
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if head_groups is None and attention_once.current() is not None:  # a checkpointed layer: the kernel whose
        head_groups = _ONE_GROUP                                        # results its forward can keep
    if head_groups is not None and training and not dropout:
        out = head_grouped_attention(q, k, v, scale=scale, is_causal=is_causal, groups=head_groups)
        if out is not None:
            return out
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout, **gqa)


# ----------------------------------------------------------------------------------------------------
# Blockwise path
# ----------------------------------------------------------------------------------------------------


def _blockwise(q, k, v, *, scale, causal, padding_mask, segment_ids, sliding_window, alibi_slopes,
               softcap, q_block, kv_block, compile, key_bias=None, dropout=0.0, dropout_seed=0,
               sinks=None, empty_rows="zeros") -> Tensor:
    """The blockwise path, always (no fused-kernel dispatch). Inputs already validated."""
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    spec = AttentionSpec.of(q, k, scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap,
                            q_block=q_block, kv_block=kv_block, compile=compile, offset=nk - nq, dropout=dropout,
                            dropout_seed=dropout_seed, empty_rows=empty_rows)
    if padding_mask is not None and padding_mask.dtype != torch.bool:
        padding_mask = padding_mask != 0
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(spec.acc_dtype).view(hkv, hq // hkv)  # [Hkv, G]
    if key_bias is not None:  # takes the slopes' place (see bpt.engine.block_mask_args)
        alibi_slopes = key_bias.to(spec.acc_dtype).reshape(b, hkv, hq // hkv, nk)  # [B, Hkv, G, Nk]
    return _BlockwiseAttention.apply(q, k, v, padding_mask, segment_ids, alibi_slopes, sinks, spec)


class _BlockwiseAttention(torch.autograd.Function):
    """The bpt.engine loop on one device: every query block against its planned key blocks."""

    @staticmethod
    @autocast_off
    def forward(ctx, q, k, v, padding_mask, segment_ids, slopes, sinks, spec: AttentionSpec):
        b, hq, nq, d = q.shape
        hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
        bh, g = b * hkv, spec.groups
        q3 = q.reshape(bh, g, nq, d)  # query heads grouped under their kv head
        k3 = k.reshape(bh, nk, d)
        v3 = v.reshape(bh, nk, dv)
        plan = make_plan(spec, b, nq, nk, padding_mask, segment_ids)
        out = q.new_empty(b, hq, nq, dv)
        out3 = out.view(bh, g, nq, dv)
        acc_dtype = spec.acc_dtype
        lse = q.new_empty(bh, g, nq, dtype=acc_dtype)  # per-row logsumexp, +inf for empty rows (no sinks)
        sinks3 = sink_rows(sinks, b, hkv, g, acc_dtype)  # [BH, G, 1] or None
        work = Workspace(enabled=not spec.use_compile)
        for i0, i1, blocks in plan:
            qs = scaled_query_rows(q3, i0, i1, spec)  # [BH, R, D], R = G * bq
            m, l, acc = start_rows(q, bh, g, i1 - i0, dv, acc_dtype, sinks3)  # [BH, R], [BH, R], [BH, R, Dv]
            for blk in blocks:
                shape = (bh, qs.shape[1], blk.j1 - blk.j0)
                forward_step(qs, k3[:, blk.j0:blk.j1], v3[:, blk.j0:blk.j1], m, l, acc, work.get("s", shape, qs),
                             dropout_keep_mask(spec, i0, blk.j0, shape, qs),
                             *block_mask_args(spec, b, i0, i1, blk, padding_mask, segment_ids, slopes),
                             use_compile=spec.use_compile)
            finish_rows(m, l, acc, out3, lse, i0, i1)
        if spec.empty_rows != "zeros":
            fill_empty_rows(out3, lse, v3.sum(1, dtype=acc_dtype), nk, spec.empty_rows)  # sum of v: [BH, Dv]
        ctx.save_for_backward(q3, k3, v3, out, lse, padding_mask, segment_ids, slopes, sinks)
        ctx.spec, ctx.plan, ctx.shapes = spec, plan, (q.shape, k.shape, v.shape)
        return out

    @staticmethod
    @once_differentiable
    @autocast_off
    def backward(ctx, dout):
        q3, k3, v3, out, lse, padding_mask, segment_ids, slopes, sinks = ctx.saved_tensors
        spec, plan = ctx.spec, ctx.plan
        q_shape, k_shape, v_shape = ctx.shapes
        bh, g, nq, d = q3.shape
        nk, dv_dim = k3.shape[1], v3.shape[-1]
        b = q_shape[0]
        do3 = dout.reshape(bh, g, nq, dv_dim)
        o3 = out.view(bh, g, nq, dv_dim)
        acc_dtype = spec.acc_dtype
        dq = torch.zeros(q3.shape, dtype=acc_dtype, device=q3.device)  # [BH, G, Nq, D]
        dk = torch.zeros(k3.shape, dtype=acc_dtype, device=k3.device)  # [BH, Nk, D]
        dv = torch.zeros(v3.shape, dtype=acc_dtype, device=v3.device)  # [BH, Nk, Dv]
        sink_grad = None if sinks is None else SinkGrad(sinks, b, k_shape[1], g, acc_dtype)
        work = Workspace(enabled=not spec.use_compile)
        # Rows with no visible key that stock's rule gives gradients ([BH, G, Nq] bool), or None. Looked for once
        # per call where the data may be read; traced, an all-False mask adds exact zeros.
        empty_all = None if spec.empty_rows == "zeros" else empty_rows_of(lse)
        if empty_all is not None and host_reads_allowed() and not bool(empty_all.any()):
            empty_all = None
        for i0, i1, blocks in plan:
            empty = None if empty_all is None else empty_all[:, :, i0:i1].reshape(bh, -1)  # [BH, R]
            if empty is not None and host_reads_allowed() and not bool(empty.any()):
                empty = None
            if not blocks and empty is None:
                continue  # rows with no visible key: O = 0, so zero gradients (the sink's too)
            qs = scaled_query_rows(q3, i0, i1, spec)  # [BH, R, D]
            dob, neg_lse, neg_delta = backward_rows(do3, o3, lse, i0, i1, acc_dtype)  # [BH, R, Dv], [BH, R] x 2
            if sink_grad is not None:
                sink_grad.add_rows(neg_lse, neg_delta)
            dqb = torch.zeros((bh, qs.shape[1], d), dtype=acc_dtype, device=q3.device)  # [BH, R, D]
            for blk in blocks:
                shape = (bh, qs.shape[1], blk.j1 - blk.j0)
                backward_step(qs, k3[:, blk.j0:blk.j1], v3[:, blk.j0:blk.j1], dob, neg_lse, neg_delta,
                              dqb, dk[:, blk.j0:blk.j1], dv[:, blk.j0:blk.j1],
                              work.get("s", shape, qs), work.get("ds", shape, qs),
                              dropout_keep_mask(spec, i0, blk.j0, shape, qs),
                              *block_mask_args(spec, b, i0, i1, blk, padding_mask, segment_ids, slopes),
                              use_compile=spec.use_compile)
            if empty is not None:  # stock's uniform softmax over every key
                for j0 in range(0, nk, spec.kv_block):
                    j1 = min(j0 + spec.kv_block, nk)
                    empty_rows_backward_step(qs, k3[:, j0:j1], v3[:, j0:j1], dob, neg_delta, empty, nk, dqb,
                                             dk[:, j0:j1], dv[:, j0:j1], spec.softcap, spec.empty_rows)
            dq[:, :, i0:i1] = dqb.view(bh, g, i1 - i0, d)
        dq.mul_(spec.scale)  # s = (scale * q) . k
        dtype = q3.dtype
        dsinks = None if sink_grad is None else sink_grad.total()  # [Hq]
        return (dq.view(q_shape).to(dtype), dk.view(k_shape).to(dtype), dv.view(v_shape).to(dtype),
                None, None, None, dsinks, None)
