"""The attention "mask" the patched model passes around: O(N) inputs instead of an N x N tensor.

transformers builds masks through `AttentionMaskInterface` keyed by `config._attn_implementation`.
Registering `bpt_mask` there (principle 2 of DESIGN.md: a custom attention name with no mask entry
would silently get mask None, i.e. lose causality) makes every family's mask creation return a
`BlockMaskInputs`, which the blockwise attention turns into per-block masks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockMaskInputs:
    """What the blockwise attention needs to rebuild any block of the mask.

    padding_mask: [B, kv_length] bool, True = real key token (None = no padding).
    segment_ids: [B, kv_length] int, packed documents (None = one document per row).
    sliding_window: key j visible from query position p iff p - j < sliding_window (None = full).
    """

    padding_mask: torch.Tensor | None
    segment_ids: torch.Tensor | None
    sliding_window: int | None
    q_length: int
    kv_length: int

    # Not a tensor: model code that checks `mask.ndim == 4` (Falcon folds ALiBi into 4-D masks)
    # must leave it alone.
    ndim = 0


def bpt_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    device=None,
    **_unused,
) -> BlockMaskInputs:
    """AttentionMaskInterface entry: same arguments as transformers' `sdpa_mask`, O(N) result."""
    if use_vmap:
        # or/and mask overlays (e.g. image-token masks) are arbitrary functions of (q, kv).
        raise NotImplementedError(
            "this model adds a custom mask overlay that blockwise attention cannot rebuild per block; "
            "use it without apply_bpt_patch"
        )
    padding_mask = None
    if attention_mask is not None:
        end = kv_offset + kv_length
        if attention_mask.shape[-1] < end:  # static caches can be longer than the 2-D mask
            attention_mask = torch.nn.functional.pad(attention_mask, (0, end - attention_mask.shape[-1]))
        padding_mask = attention_mask[:, kv_offset:end].to(torch.bool)
        if bool(padding_mask.all()):
            padding_mask = None
    segment_ids = None
    if attention_mask is None and q_offset == 0 and kv_offset == 0 and q_length == kv_length > 1:
        segment_ids = _segments_from_mask_function(mask_function, batch_size, q_length, device)
    return BlockMaskInputs(padding_mask, segment_ids, local_size, q_length, kv_length)


def _segments_from_mask_function(mask_function, batch_size, length, device) -> torch.Tensor | None:
    """Packed-document ids, read off transformers' own mask function along the sub-diagonal.

    transformers folds packing (position ids that restart) into `mask_function` without handing
    us the position ids. A causal (or sliding-window) mask always lets token i see token i-1
    unless i starts a new document, so probing (i, i-1) for every i recovers the boundaries in O(N).
    """
    if mask_function is None:
        return None
    batch = torch.arange(batch_size, device=device)[:, None]  # [B, 1]
    q_idx = torch.arange(1, length, device=device)[None, :]  # [1, N-1]
    head = torch.zeros((), dtype=torch.long, device=device)
    sees_previous = torch.as_tensor(mask_function(batch, head, q_idx, q_idx - 1), device=device)
    sees_previous = sees_previous.expand(batch_size, length - 1)  # [B, N-1]
    if bool(sees_previous.all()):
        return None
    starts = torch.nn.functional.pad(~sees_previous, (1, 0), value=False)  # [B, N]
    return starts.long().cumsum(-1)
