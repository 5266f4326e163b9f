"""The inputs of blockwise attention (one device, or a ring shard): cast as autocast casts SDPA's, and checked
before any work, each problem named in one ValueError."""
from __future__ import annotations

import torch
from torch import Tensor


def autocast_inputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
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


def validate_inputs(q, k, v, scale, padding_mask, segment_ids, window, slopes, softcap, q_block, kv_block,
                    compile, key_bias=None, dropout=0.0, sinks=None) -> None:
    """Raise ValueError naming the problem unless the arguments of blockwise_attention (or of ring attention, the
    same on a shard) are usable; window = sliding_window, slopes = alibi_slopes."""
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
