"""Blockwise (flash-style) attention in pure torch: memory O(N), never O(N x N).

`blockwise_attention(q, k, v, ...)` computes softmax attention block by block with an online softmax
(running max / running sum), in a custom autograd Function that saves only q, k, v, the output and one
logsumexp per query row; backward recomputes each block's probabilities from that logsumexp
(FlashAttention-2 style). Causal, sliding-window, padding, packed-document (segment) masks and ALiBi are
built per block from O(N) inputs, and blocks that the masks fully exclude are skipped without tensor work.
Cases torch's fused F.scaled_dot_product_attention handles without a mask go there instead (see
`_sdpa_handles` for the rule and the measurements behind it).

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
- A query row with no visible key outputs exact zeros and gets zero gradients (stock kernels may give
  NaN or garbage there; models ignore those rows, e.g. left-padded queries). With sinks such a row attends
  only to its sink: output 0 as well, a finite logsumexp (the sink), and zero q/k/v gradients.
- Precision (the rules stock SDPA follows): under autocast, q/k/v are first cast to the autocast dtype
  (SDPA is on autocast's lower-precision list, so stock attention sees the same inputs). The blockwise
  path then runs with autocast off and computes scores, softmax statistics and accumulators in fp32
  (fp64 for fp64 inputs): never less exact than a fused kernel. The output has the (cast) inputs' dtype.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from bpt.compile import compilable, should_compile

__all__ = ["blockwise_attention", "segment_ids_from_position_ids"]

# Hidden scores are set to a finite minimum (not -inf) before the row max, and their probabilities to
# exactly 0 after the exp. Before exp, shifted scores are clamped at _EXP_FLOOR: torch's vectorised CPU
# exp takes a ~15x slower path for inputs below about -87 (measured: 2M elements 1.8 ms, 26-90 ms with
# half of them at -90, -200, finfo.min; 8 ms at -inf). exp(-80) = 2e-35 is nothing next to the row
# max's exp(0) = 1, so the clamp changes no result beyond rounding.
_HIDDEN = torch.finfo(torch.float32).min
_EXP_FLOOR = -80.0
_MAX_INIT = torch.finfo(torch.float32).min  # running-max start: finite, so no inf - inf

_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class _Spec:
    """Non-tensor options of one call (shared by forward and backward)."""

    scale: float
    causal: bool
    window: int | None
    softcap: float | None
    q_block: int
    kv_block: int
    offset: int  # key position of query 0 = Nk - Nq
    acc_dtype: torch.dtype  # fp32, or fp64 for fp64 inputs
    groups: int  # query heads per key/value head
    use_compile: bool
    dropout: float = 0.0
    dropout_seed: int = 0

    @classmethod
    def of(cls, q: Tensor, k: Tensor, *, scale, causal, sliding_window, softcap, q_block, kv_block, compile,
           offset: int, **dropout) -> "_Spec":
        """The spec of a call on q [B, Hq, Nq, D], k [B, Hkv, Nk, D] (validated inputs); scale None = 1 / sqrt(D)."""
        return cls(scale=float(q.shape[-1] ** -0.5 if scale is None else scale), causal=bool(causal),
                   window=sliding_window, softcap=None if softcap is None else float(softcap), q_block=q_block,
                   kv_block=kv_block, offset=offset, acc_dtype=torch.promote_types(q.dtype, torch.float32),
                   groups=q.shape[1] // k.shape[1], use_compile=should_compile(compile, q), **dropout)


@dataclass(frozen=True)
class _KVBlock:
    """One key/value block to visit for a query block, and which masks it needs."""

    j0: int
    j1: int
    causal: bool  # the causal rule hides part of this block
    window: bool  # the sliding-window rule hides part of this block
    padding: bool  # some key of this block is padding (in some batch row)
    segments: bool  # query and key segments differ somewhere in this block


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
    from torch's default generator, so torch.manual_seed makes runs repeatable).
    """
    q, k, v = _autocast_inputs(q, k, v)
    _validate(q, k, v, scale, padding_mask, segment_ids, sliding_window, alibi_slopes, softcap,
              q_block, kv_block, compile, key_bias, dropout, sinks)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    needs_blockwise = key_bias is not None or sinks is not None  # SDPA takes neither
    if not needs_blockwise and _sdpa_handles(q, k, v, causal, padding_mask, segment_ids, sliding_window,
                                             alibi_slopes, softcap):
        return _sdpa(q, k, v, scale, causal, dropout)
    if dropout and dropout_seed is None:
        dropout_seed = int(torch.randint(2 ** 62, (), dtype=torch.int64))
    return _blockwise(q, k, v, scale=scale, causal=causal, padding_mask=padding_mask,
                      segment_ids=segment_ids, sliding_window=sliding_window, alibi_slopes=alibi_slopes,
                      softcap=softcap, q_block=q_block, kv_block=kv_block, compile=compile, key_bias=key_bias,
                      dropout=float(dropout), dropout_seed=int(dropout_seed or 0), sinks=sinks)


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


def _autocast_inputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Cast q, k, v the way autocast casts SDPA's inputs (a no-op outside autocast).

    Needed because models mix dtypes under autocast: RoPE multiplies the bf16 projections by fp32
    cos/sin, so q and k arrive in fp32 next to a bf16 v. Like autocast, fp64 tensors are left alone.
    """
    device_type = q.device.type
    if not (torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in (q, k, v))


def _autocast_off(fn):
    """Run a forward / backward with autocast off on its first tensor's device: the blockwise path
    chooses every dtype itself, and an enclosing autocast (in forward, or around a backward call)
    must not recast its matmuls to low precision."""
    @functools.wraps(fn)
    def wrapper(ctx, first: Tensor, *args):
        with torch.autocast(device_type=first.device.type, enabled=False):
            return fn(ctx, first, *args)

    return wrapper


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------


def _validate(q, k, v, scale, padding_mask, segment_ids, window, slopes, softcap, q_block, kv_block,
              compile, key_bias=None, dropout=0.0, sinks=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, heads, seq, head_dim], got "
                             f"{getattr(t, 'shape', type(t))}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them, or run "
                         "under torch.autocast, which casts them as it casts SDPA's inputs")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, hq, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError("k and v must agree in batch, heads and length: "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[3] != d:
        raise ValueError(f"q and k head_dim differ: q {tuple(q.shape)}, k {tuple(k.shape)}")
    hkv, nk = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    for name, size in (("q_block", q_block), ("kv_block", kv_block)):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a number or None, got {scale!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be an integer >= 1 or None, got {window!r}")
    if compile not in (None, True, False):
        raise ValueError(f"compile must be True, False or None (auto), got {compile!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    for name, t in (("padding_mask", padding_mask), ("segment_ids", segment_ids)):
        _check_side_input(name, t, (b, nk), "[batch, kv_len]", q, floating=False)
    if segment_ids is not None and q.shape[2] > nk:
        raise ValueError(f"segment_ids need q_len <= kv_len (queries are the last keys), got "
                         f"{q.shape[2]} > {nk}")
    _check_side_input("alibi_slopes", slopes, (hq,), "[q_heads] (one slope per query head)", q, floating=True)
    _check_side_input("key_bias", key_bias, (b, hq, nk), "[batch, q_heads, kv_len]", q, floating=True)
    _check_side_input("sinks", sinks, (hq,), "[q_heads] (one sink logit per query head)", q, floating=True)
    if key_bias is not None:
        if slopes is not None:
            raise ValueError("pass alibi_slopes or key_bias, not both (fold the slopes into key_bias)")
        if key_bias.requires_grad:
            raise ValueError("key_bias gets no gradient from blockwise_attention; pass key_bias.detach()")


def _check_side_input(name: str, t, shape: tuple[int, ...], meaning: str, q: Tensor, *, floating: bool):
    """Shape, device and dtype kind of an optional O(N) input (None passes)."""
    if t is None:
        return
    if not isinstance(t, Tensor) or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be a {meaning} = {list(shape)} tensor, got {getattr(t, 'shape', type(t))}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if floating and not t.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if not floating and (t.is_floating_point() or t.is_complex()):
        raise ValueError(f"{name} must be a bool or integer tensor, got {t.dtype}")


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


def _cuda_fused_kernel_applies(q, k, v, is_causal: bool, gqa: bool) -> bool:
    """Whether one of SDPA's fused CUDA kernels accepts these inputs, asked of torch itself."""
    from torch.backends import cuda

    params = cuda.SDPAParams(q, k, v, None, 0.0, is_causal, gqa)
    checks = (cuda.flash_sdp_enabled, cuda.can_use_flash_attention), \
        (cuda.cudnn_sdp_enabled, cuda.can_use_cudnn_attention), \
        (cuda.mem_efficient_sdp_enabled, cuda.can_use_efficient_attention)
    return any(enabled() and can_use(params, False) for enabled, can_use in checks)


def _sdpa(q, k, v, scale, causal, dropout):
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    is_causal = causal and q.shape[2] > 1
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout, **gqa)


# ----------------------------------------------------------------------------------------------------
# Blockwise path
# ----------------------------------------------------------------------------------------------------


def _blockwise(q, k, v, *, scale, causal, padding_mask, segment_ids, sliding_window, alibi_slopes,
               softcap, q_block, kv_block, compile, key_bias=None, dropout=0.0, dropout_seed=0,
               sinks=None) -> Tensor:
    """The blockwise path, always (no fused-kernel dispatch). Inputs already validated."""
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    spec = _Spec.of(q, k, scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap,
                    q_block=q_block, kv_block=kv_block, compile=compile, offset=nk - nq, dropout=dropout,
                    dropout_seed=dropout_seed)
    if padding_mask is not None and padding_mask.dtype != torch.bool:
        padding_mask = padding_mask != 0
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(spec.acc_dtype).view(hkv, hq // hkv)  # [Hkv, G]
    if key_bias is not None:  # takes the slopes' place (see _add_alibi_)
        alibi_slopes = key_bias.to(spec.acc_dtype).reshape(b, hkv, hq // hkv, nk)  # [B, Hkv, G, Nk]
    return _BlockwiseAttention.apply(q, k, v, padding_mask, segment_ids, alibi_slopes, sinks, spec)


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    @_autocast_off
    def forward(ctx, q, k, v, padding_mask, segment_ids, slopes, sinks, spec: _Spec):
        b, hq, nq, d = q.shape
        hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
        bh, g = b * hkv, spec.groups
        q3 = q.reshape(bh, g, nq, d)  # query heads grouped under their kv head
        k3 = k.reshape(bh, nk, d)
        v3 = v.reshape(bh, nk, dv)
        plan = _make_plan(spec, b, nq, nk, padding_mask, segment_ids)
        out = q.new_empty(b, hq, nq, dv)
        out3 = out.view(bh, g, nq, dv)
        acc_dtype = spec.acc_dtype
        lse = q.new_empty(bh, g, nq, dtype=acc_dtype)  # per-row logsumexp, +inf for empty rows (no sinks)
        sink3 = _sink_rows(sinks, b, hkv, g, acc_dtype)  # [BH, G, 1] or None
        work = _Workspace(enabled=not spec.use_compile)
        for i0, i1, blocks in plan:
            rows = g * (i1 - i0)
            qs = _scaled_rows(q3, i0, i1, spec)  # [BH, R, D], R = G * bq
            if sink3 is None:
                m = q.new_full((bh, rows), _MAX_INIT, dtype=acc_dtype)  # running max
                l = q.new_zeros((bh, rows), dtype=acc_dtype)  # running sum of exp
            else:  # the sink is a virtual first key: exp(sink - m) = 1 with m = sink
                m = sink3.expand(bh, g, i1 - i0).reshape(bh, rows).clone()
                l = q.new_ones((bh, rows), dtype=acc_dtype)
            acc = q.new_zeros((bh, rows, dv), dtype=acc_dtype)  # running sum of p @ v
            for blk in blocks:
                shape = (bh, rows, blk.j1 - blk.j0)
                _forward_step(qs, k3[:, blk.j0:blk.j1], v3[:, blk.j0:blk.j1], m, l, acc, work.get("s", shape, qs),
                              _dropout_keep(spec, i0, blk.j0, shape, qs),
                              *_mask_args(spec, b, i0, i1, blk, padding_mask, segment_ids, slopes),
                              use_compile=spec.use_compile)
            out_b, lse_b = _finish_rows(m, l, acc)
            out3[:, :, i0:i1] = out_b.view(bh, g, i1 - i0, dv)
            lse[:, :, i0:i1] = lse_b.view(bh, g, i1 - i0)
        ctx.save_for_backward(q3, k3, v3, out, lse, padding_mask, segment_ids, slopes, sinks)
        ctx.spec, ctx.plan, ctx.shapes = spec, plan, (q.shape, k.shape, v.shape)
        return out

    @staticmethod
    @once_differentiable
    @_autocast_off
    def backward(ctx, dout):
        q3, k3, v3, out, lse, padding_mask, segment_ids, slopes, sinks = ctx.saved_tensors
        spec, plan = ctx.spec, ctx.plan
        q_shape, k_shape, v_shape = ctx.shapes
        bh, g, nq, d = q3.shape
        dv_dim = v3.shape[-1]
        b = q_shape[0]
        do3 = dout.reshape(bh, g, nq, dv_dim)
        o3 = out.view(bh, g, nq, dv_dim)
        acc_dtype = spec.acc_dtype
        dq = torch.zeros(q3.shape, dtype=acc_dtype, device=q3.device)  # [BH, G, Nq, D]
        dk = torch.zeros(k3.shape, dtype=acc_dtype, device=k3.device)  # [BH, Nk, D]
        dv = torch.zeros(v3.shape, dtype=acc_dtype, device=v3.device)  # [BH, Nk, Dv]
        sink3 = _sink_rows(sinks, b, k_shape[1], g, acc_dtype)  # [BH, G, 1] or None
        dsink = None if sink3 is None else torch.zeros((bh, g), dtype=acc_dtype, device=q3.device)  # [BH, G]
        work = _Workspace(enabled=not spec.use_compile)
        for i0, i1, blocks in plan:
            if not blocks:
                continue  # rows with no visible key: O = 0, so zero gradients (the sink's too)
            rows = g * (i1 - i0)
            qs = _scaled_rows(q3, i0, i1, spec)  # [BH, R, D]
            dob = _rows(do3, i0, i1, acc_dtype)  # [BH, R, Dv]
            neg_delta = -(dob * _rows(o3, i0, i1, acc_dtype)).sum(-1)  # [BH, R], delta = rowsum(dO * O)
            neg_lse = -lse[:, :, i0:i1].reshape(bh, rows)
            if dsink is not None:  # d sink = -sum_rows p_sink * delta, p_sink = exp(sink - lse)
                p_sink = (sink3 + neg_lse.view(bh, g, i1 - i0)).exp_()  # [BH, G, bq]
                dsink.add_((p_sink * neg_delta.view(bh, g, i1 - i0)).sum(-1))
            dqb = torch.zeros((bh, rows, d), dtype=acc_dtype, device=q3.device)
            for blk in blocks:
                shape = (bh, rows, blk.j1 - blk.j0)
                _backward_step(qs, k3[:, blk.j0:blk.j1], v3[:, blk.j0:blk.j1], dob, neg_lse, neg_delta,
                               dqb, dk[:, blk.j0:blk.j1], dv[:, blk.j0:blk.j1],
                               work.get("s", shape, qs), work.get("ds", shape, qs),
                               _dropout_keep(spec, i0, blk.j0, shape, qs),
                               *_mask_args(spec, b, i0, i1, blk, padding_mask, segment_ids, slopes),
                               use_compile=spec.use_compile)
            dq[:, :, i0:i1] = dqb.view(bh, g, i1 - i0, d)
        dq.mul_(spec.scale)  # s = (scale * q) . k
        dtype = q3.dtype
        dsinks = None if dsink is None else dsink.view(b, -1).sum(0).to(sinks.dtype)  # [Hq]
        return (dq.view(q_shape).to(dtype), dk.view(k_shape).to(dtype), dv.view(v_shape).to(dtype),
                None, None, None, dsinks, None)


def _sink_rows(sinks: Tensor | None, b: int, hkv: int, g: int, dtype: torch.dtype) -> Tensor | None:
    """sinks [Hq] -> [BH, G, 1] in dtype (query head h = kv head * G + group index), or None."""
    if sinks is None:
        return None
    return sinks.detach().to(dtype).view(1, hkv, g).expand(b, hkv, g).reshape(b * hkv, g, 1)


def _rows(x3: Tensor, i0: int, i1: int, dtype: torch.dtype) -> Tensor:
    """[BH, G, N, E] -> rows i0:i1 of every group as [BH, G * (i1 - i0), E] in dtype."""
    blk = x3[:, :, i0:i1]
    return blk.to(dtype).reshape(blk.shape[0], -1, blk.shape[-1])


def _scaled_rows(q3: Tensor, i0: int, i1: int, spec: _Spec) -> Tensor:
    """Query rows i0:i1 times scale, [BH, G * bq, D] in the accumulation dtype (a fresh copy)."""
    blk = q3[:, :, i0:i1]
    return (blk.to(spec.acc_dtype) * spec.scale).reshape(blk.shape[0], -1, blk.shape[-1])


def _finish_rows(m: Tensor, l: Tensor, acc: Tensor) -> tuple[Tensor, Tensor]:
    """Running stats -> (output rows [BH, R, Dv], logsumexp [BH, R]); empty rows give 0 and +inf.

    With sinks l >= exp(sink - m) > 0, so no row is empty: a row with no visible key gives acc / 1 = 0
    and lse = sink (finite); backward's hidden-score masking keeps its q/k/v gradients zero.
    """
    empty = l == 0
    out = acc / l.masked_fill(empty, 1.0).unsqueeze(-1)
    # +inf makes backward's exp(s - lse) exactly 0 on empty rows, hence zero gradients there.
    lse = (m + l.log()).masked_fill_(empty, float("inf"))
    return out, lse


# ----------------------------------------------------------------------------------------------------
# Block plan: which kv blocks each query block visits (host-side, from index ranges and O(N) stats)
# ----------------------------------------------------------------------------------------------------


def _make_plan(spec: _Spec, b: int, nq: int, nk: int, padding_mask, segment_ids, q_segment_ids=None):
    """-> [(i0, i1, [_KVBlock, ...]) per query block].

    q_segment_ids [B, Nq]: the queries' own segment ids, for callers (bpt.sequence_parallel.ring) whose queries are not the
    last keys; None = segment_ids[:, offset:].
    """
    qb, kb, off, window = spec.q_block, spec.kv_block, spec.offset, spec.window
    pad_stats = _block_min_max(padding_mask, kb) if padding_mask is not None else None
    seg_k = _block_min_max(segment_ids, kb) if segment_ids is not None else None
    if segment_ids is not None and q_segment_ids is None:
        q_segment_ids = segment_ids[:, off:]
    seg_q = _block_min_max(q_segment_ids, qb) if segment_ids is not None else None
    plan = []
    for i0 in range(0, nq, qb):
        i1 = min(i0 + qb, nq)
        p0, p1 = i0 + off, i1 + off  # key positions of this block's first / past-last query
        lo = 0 if window is None else max(0, p0 - window + 1)  # first key any row may see
        hi = min(nk, p1) if spec.causal else nk  # past the last key any row may see
        blocks = []
        for j0 in range(lo - lo % kb, hi, kb):
            j1 = min(j0 + kb, nk)
            causal = spec.causal and j1 - 1 > p0
            windowed = window is not None and p1 - 1 - j0 >= window
            padding = segments = False
            if pad_stats is not None:
                lo_pad, hi_pad = pad_stats
                if not any(row[j0 // kb] for row in hi_pad):
                    continue  # every key of the block is padding, in every batch row
                padding = not all(row[j0 // kb] for row in lo_pad)
            if seg_k is not None:
                visible, segments = _segment_overlap(seg_q, i0 // qb, seg_k, j0 // kb)
                if not visible:
                    continue
            blocks.append(_KVBlock(j0, j1, causal, windowed, padding, segments))
        plan.append((i0, i1, blocks))
    return plan


def _block_min_max(x: Tensor, block: int) -> tuple[list, list]:
    """[B, N] -> per-block (min, max) as nested lists [B][ceil(N / block)] (one host sync)."""
    n = x.shape[1]
    if n == 0:
        return [[] for _ in range(x.shape[0])], [[] for _ in range(x.shape[0])]
    x = x.long()
    pad = -n % block
    if pad:  # repeat the last value: it changes no block's min / max
        x = torch.cat([x, x[:, -1:].expand(-1, pad)], dim=1)
    x = x.view(x.shape[0], -1, block)  # [B, nblocks, block]
    stats = torch.stack([x.amin(-1), x.amax(-1)]).tolist()
    return stats[0], stats[1]


def _segment_overlap(seg_q, qi: int, seg_k, kj: int) -> tuple[bool, bool]:
    """(may any pair share a segment, is a segment mask needed) for query block qi x key block kj.

    Disjoint [min, max] ranges prove no query/key pair shares a segment (for any id order); one single
    shared id on both sides proves every pair does.
    """
    (q_min, q_max), (k_min, k_max) = seg_q, seg_k
    visible = needs_mask = False
    for row in range(len(q_min)):
        lo_q, hi_q, lo_k, hi_k = q_min[row][qi], q_max[row][qi], k_min[row][kj], k_max[row][kj]
        if hi_q >= lo_k and hi_k >= lo_q:
            visible = True
        if not lo_q == hi_q == lo_k == hi_k:
            needs_mask = True
    return visible, needs_mask


def _mask_args(spec: _Spec, b: int, i0: int, i1: int, blk: _KVBlock, padding_mask, segment_ids, slopes,
               q_segment_ids=None):
    """The O(N) pieces one block's mask / bias is built from (trailing args of the step functions).

    q_segment_ids: as in _make_plan (None = the queries are the last keys of segment_ids)."""
    p0 = i0 + spec.offset  # key position of the block's first query
    pad_k = padding_mask[:, blk.j0:blk.j1] if blk.padding else None  # [B, bk]
    seg_q = None
    if blk.segments:  # [B, bq]
        seg_q = segment_ids[:, p0:p0 + i1 - i0] if q_segment_ids is None else q_segment_ids[:, i0:i1]
    seg_k = segment_ids[:, blk.j0:blk.j1] if blk.segments else None  # [B, bk]
    if slopes is not None and slopes.dim() == 4:  # key_bias [B, Hkv, G, Nk] -> [B, Hkv, G, 1, bk]
        slopes = slopes[:, :, :, None, blk.j0:blk.j1]
    return (blk.j0 - p0, blk.causal, spec.window if blk.window else None, slopes, pad_k, seg_q, seg_k,
            spec.softcap, spec.groups, b)


def _dropout_keep(spec: _Spec, i0: int, j0: int, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
    """The scaled dropout keep-mask [BH, R, bk] of the block at query row i0 / key j0 (None without dropout).

    Drawn from a generator seeded by (dropout_seed, i0, j0) alone, so backward redraws the same mask
    and no mask is ever stored. Values: 0 (dropped) or 1 / (1 - dropout).
    """
    if not spec.dropout:
        return None
    generator = torch.Generator(device=like.device)
    generator.manual_seed((spec.dropout_seed * 1_000_003 + i0) * 1_000_003 + j0 & (2 ** 63 - 1))
    draw = torch.rand(shape, generator=generator, device=like.device, dtype=like.dtype)
    return (draw >= spec.dropout).to(like.dtype).mul_(1.0 / (1.0 - spec.dropout))


class _Workspace:
    """Reused buffers for the per-block score-sized temporaries (eager mode).

    Fresh large CPU allocations page-fault on first touch every time; measured on the dev box:
    allocating + filling a 32 MB block costs 28 ms, refilling a reused one 1.5 ms, and a 2048 x 1024
    block's matmul ran 2x faster into a reused output. Disabled (None buffers) under torch.compile.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
        if not self.enabled:
            return None
        numel = 1
        for size in shape:
            numel *= size
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name] = like.new_empty(numel)
        return buf[:numel].view(shape)


# ----------------------------------------------------------------------------------------------------
# Per-block math (the torch.compile candidates)
# ----------------------------------------------------------------------------------------------------


def _view5(s: Tensor, groups: int, batch: int) -> Tensor:
    """[BH, G * bq, bk] -> [B, Hkv, G, bq, bk] (a view)."""
    return s.view(batch, s.shape[0] // batch, groups, s.shape[1] // groups, s.shape[2])


def _add_alibi_(s5: Tensor, slopes: Tensor, rel0: int) -> None:
    """s5 [B, Hkv, G, bq, bk] += slope * (key position - query position), in place.

    `slopes` [Hkv, G], or a key_bias block [B, Hkv, G, 1, bk] (from _mask_args), added as it is.
    """
    if slopes.dim() == 5:
        s5.add_(slopes)
        return
    bq, bk = s5.shape[-2:]
    rel = (torch.arange(bk, device=s5.device, dtype=s5.dtype) + rel0).unsqueeze(0) \
        - torch.arange(bq, device=s5.device, dtype=s5.dtype).unsqueeze(1)  # [bq, bk]
    s5.addcmul_(slopes[:, :, None, None], rel)


def _hidden(bq: int, bk: int, device, rel0: int, causal: bool, window, pad_k, seg_q, seg_k):
    """Which keys one block hides: bool (True = hidden) broadcastable to [B, Hkv, G, bq, bk], or None.

    Built from O(block) pieces only: rel0 = first key position - first query position,
    pad_k [B, bk], seg_q [B, bq] / seg_k [B, bk].
    """
    hidden = None
    if causal or window is not None:
        key = torch.arange(rel0, rel0 + bk, device=device).unsqueeze(0)  # [1, bk] relative to query 0
        query = torch.arange(bq, device=device).unsqueeze(1)  # [bq, 1]
        if causal:
            hidden = key > query  # j > p
        if window is not None:
            hidden = _either(hidden, key + window <= query)  # p - j >= window
    if pad_k is not None:
        hidden = _either(hidden, ~pad_k[:, None, None, None, :])
    if seg_q is not None:
        hidden = _either(hidden, seg_q[:, None, None, :, None] != seg_k[:, None, None, None, :])
    return hidden


def _either(a, b):
    return b if a is None else a | b


@compilable
def _forward_step(qs, kb, vb, m, l, acc, s_buf, keep, rel0, causal, window, slopes, pad_k, seg_q, seg_k,
                  softcap, groups, batch):
    """Fold one kv block into the running softmax stats (in place).

    qs [BH, R, D] pre-scaled query rows (R = G * bq), kb [BH, bk, D], vb [BH, bk, Dv];
    m, l [BH, R] running max / sum of exp; acc [BH, R, Dv] running sum of exp(s - m) @ v;
    s_buf: None or a reusable [BH, R, bk] buffer for the scores; keep: None or the block's scaled
    dropout keep-mask [BH, R, bk].
    """
    s = torch.bmm(qs, kb.to(qs.dtype).transpose(1, 2), out=s_buf)  # [BH, R, bk]
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    s5 = _view5(s, groups, batch)
    if slopes is not None:
        _add_alibi_(s5, slopes, rel0)
    hidden = _hidden(s5.shape[3], s5.shape[4], s.device, rel0, causal, window, pad_k, seg_q, seg_k)
    if hidden is not None:
        s5.masked_fill_(hidden, _HIDDEN)
    m_new = torch.maximum(m, s.amax(-1))  # [BH, R]
    p = s.sub_(m_new.unsqueeze(-1)).clamp_min_(_EXP_FLOOR).exp_()  # [BH, R, bk], in the scores' memory
    if hidden is not None:
        s5.masked_fill_(hidden, 0.0)
    alpha = (m - m_new).exp_()  # rescales what was accumulated under the old max
    l.mul_(alpha).add_(p.sum(-1))  # the normaliser counts dropped probabilities too
    if keep is not None:
        p.mul_(keep)
    acc.mul_(alpha.unsqueeze(-1)).baddbmm_(p, vb.to(p.dtype))
    m.copy_(m_new)


@compilable
def _backward_step(qs, kb, vb, dob, neg_lse, neg_delta, dq, dk, dv, s_buf, ds_buf, keep, rel0, causal, window,
                   slopes, pad_k, seg_q, seg_k, softcap, groups, batch):
    """Add one block's gradient contributions into dq [BH, R, D], dk [BH, bk, D], dv [BH, bk, Dv].

    dob [BH, R, Dv] output-grad rows; neg_lse = -logsumexp, neg_delta = -rowsum(dO * O), both [BH, R].
    dq is w.r.t. the pre-scaled query (the caller multiplies by scale once); dk and dv sum over the
    query heads of a group through the rows of qs. s_buf / ds_buf: None or reusable [BH, R, bk] buffers.
    keep: None or the forward's dropout keep-mask Z (scaled): dV = (P Z)^T dO, dP = (dO V^T) Z, and
    delta = rowsum(dO * O) still equals rowsum(P * dP) because O was computed with the same Z.
    """
    kb, vb = kb.to(qs.dtype), vb.to(qs.dtype)
    dcap = None
    if softcap is None:
        s = torch.baddbmm(neg_lse.unsqueeze(-1), qs, kb.transpose(1, 2), out=s_buf)  # s - lse, [BH, R, bk]
    else:
        tanh = torch.bmm(qs, kb.transpose(1, 2)).div_(softcap).tanh_()
        s = torch.mul(tanh, softcap, out=s_buf).add_(neg_lse.unsqueeze(-1))
        dcap = tanh.mul_(tanh).neg_().add_(1)  # d(c * tanh(x / c)) / dx = 1 - tanh^2
    s5 = _view5(s, groups, batch)
    if slopes is not None:
        _add_alibi_(s5, slopes, rel0)
    p = s.clamp_min_(_EXP_FLOOR).exp_()  # probabilities, in the scores' memory
    hidden = _hidden(s5.shape[3], s5.shape[4], s.device, rel0, causal, window, pad_k, seg_q, seg_k)
    if hidden is not None:
        s5.masked_fill_(hidden, 0.0)
    # dS = P * (dP - delta), dP = dO @ V^T (times the keep-mask under dropout)
    if keep is None:
        dv.baddbmm_(p.transpose(1, 2), dob)
        ds = torch.baddbmm(neg_delta.unsqueeze(-1), dob, vb.transpose(1, 2), out=ds_buf).mul_(p)
    else:
        ds = torch.bmm(dob, vb.transpose(1, 2), out=ds_buf).mul_(keep).add_(neg_delta.unsqueeze(-1)).mul_(p)
        dv.baddbmm_(p.mul_(keep).transpose(1, 2), dob)
    if dcap is not None:
        ds.mul_(dcap)
    dq.baddbmm_(ds, kb)
    dk.baddbmm_(ds.transpose(1, 2), qs)
