"""Packed documents and sliding windows on CUDA through torch's variable-length flash kernel (`varlen_attn`).

SDPA takes neither a document mask nor a window without an explicit N x N mask, so on CUDA those cases took the
blockwise loop. FlashAttention's variable-length form takes both: the batch rows are flattened to one token axis
[B * N, H, D], documents are cut by `cu_seqlens` (the cumulative document lengths, int32, a document never spanning
two rows), and a causal window of W keys is `window_size = (W - 1, 0)` (flash counts the keys left of the query;
transformers' window counts the query too).

`cu_seqlens` and the longest document need one read of the segment ids on the host. Every layer of one forward gets
the same segment-id tensor, so the result is cached on that tensor (by identity): one read per forward.
"""
from __future__ import annotations

import inspect

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

_LAYOUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # segment ids -> (cu_seqlens, longest document) or None


def varlen_available() -> bool:
    """Whether this torch has `torch.nn.attention.varlen` (2.10 and later)."""
    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError:
        return False
    return True


def _takes_grouped_heads() -> bool:
    """Whether `varlen_attn` takes fewer key / value heads than query heads (`enable_gqa`, torch 2.12 and later)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def documents(segment_ids: Tensor | None, batch: int, length: int, device) -> tuple[Tensor, int] | None:
    """(cu_seqlens [D + 1] int32 over the flattened rows, the longest document), or None when the segment ids are
    not one contiguous run per document (equal ids far apart: the mask varlen cannot express)."""
    if segment_ids is None:  # a window alone: each row is one document
        return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device), length
    if segment_ids in _LAYOUTS:
        return _LAYOUTS[segment_ids]
    starts = torch.ones_like(segment_ids, dtype=torch.bool)  # [B, N]: where a document begins
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    runs_are_documents = (segment_ids[:, 1:] >= segment_ids[:, :-1]).all()  # ids only grow along a row
    begin = starts.flatten().nonzero().flatten()  # [D]
    cu = torch.cat([begin, begin.new_full((1,), batch * length)]).to(torch.int32)
    longest, ok = torch.stack([(cu[1:] - cu[:-1]).max(), runs_are_documents.long()]).tolist()  # the one host read
    layout = (cu, int(longest)) if ok else None
    _LAYOUTS[segment_ids] = layout
    return layout


def varlen_causal(q: Tensor, k: Tensor, v: Tensor, scale: float, layout: tuple[Tensor, int],
                  sliding_window: int | None) -> Tensor:
    """Causal attention per document (and window) of q [B, Hq, N, D], k / v [B, Hkv, N, D] -> [B, Hq, N, D]."""
    from torch.nn.attention.varlen import varlen_attn

    b, hq, n, d = q.shape
    cu, longest = layout

    def flat(t: Tensor) -> Tensor:  # [B, H, N, D] -> [B * N, H, D]
        return t.transpose(1, 2).reshape(b * n, t.shape[1], t.shape[3])

    keys, values = flat(k), flat(v)
    grouped = {}
    if hq != k.shape[1]:
        if _takes_grouped_heads():
            grouped = {"enable_gqa": True}
        else:  # torch 2.11: the kernel wants one key / value head per query head
            keys, values = (t.repeat_interleave(hq // k.shape[1], dim=1) for t in (keys, values))
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    out = varlen_attn(flat(q), keys, values, cu, cu, longest, longest, scale=scale, window_size=window,
                      **grouped)  # [B * N, Hq, D]
    return out.view(b, n, hq, d).transpose(1, 2)
