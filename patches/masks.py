"""The attention "mask" the patched model passes around: O(N) inputs instead of an N x N tensor.

transformers builds masks through `AttentionMaskInterface` keyed by `config._attn_implementation`.
Registering `bpt_mask` there (principle 2 of docs/DESIGN.md: a custom attention name with no mask entry
would silently get mask None, i.e. lose causality) makes every family's mask creation return a
`BlockMaskInputs`, which the blockwise attention turns into per-block masks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bpt.engine import host_reads_allowed


@dataclass
class BlockMaskInputs:
    """What the blockwise attention needs to rebuild any block of the mask.

    q_length: queries of the call. kv_length: keys in use, the first kv_length of the key tensor the
    attention gets; the queries are the last q_length of them (query i sits at key index
    kv_length - q_length + i). transformers hands over more keys only with a static cache: all of its
    max_cache_len slots, of which those past the queries are not filled yet (attention drops them,
    `keys_in_use`).
    padding_mask: [B, kv_length] bool, True = real key token (None = no padding).
    segment_ids: [B, kv_length] int, packed documents (None = one document per row); for a chunked-attention
    layer (Llama 4's `attention_chunk_size`) one id per (document, chunk), so causal + same id is the chunked mask.
    sliding_window: key j visible from query position p iff p - j < sliding_window (None = full).
    """

    padding_mask: torch.Tensor | None
    segment_ids: torch.Tensor | None
    sliding_window: int | None
    q_length: int | None = None  # None: unknown (no mask was built), keys used as given
    kv_length: int | None = None

    # Not a tensor: model code that checks `mask.ndim == 4` (Falcon folds ALiBi into 4-D masks)
    # must leave it alone.
    ndim = 0

    def keys_in_use(self, states: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """Keys / values [B, H, Nk, D] (or any per-key tensor, key axis `dim`) -> the first kv_length
        along the key axis, as a view."""
        keys = states.shape[dim]
        if self.kv_length is None or keys == self.kv_length:
            return states
        if keys < self.kv_length:
            raise ValueError(f"attention got {keys} keys but its mask was built for {self.kv_length}: the key "
                             "cache and the mask disagree (was the mask built for another cache state?)")
        return states.narrow(dim, 0, self.kv_length)

    # Tensor methods that stock code calls on a mask it was handed, as no-ops. generate() builds the masks
    # ahead of each static-cache forward (prepare_inputs_for_generation), calls `.contiguous()` on them (so
    # a compiled forward sees fixed strides) and passes them as the model's attention_mask; GPT-2 then
    # flattens any mask with fewer than 4 dims by `.view(batch, -1)`. The O(N) inputs need neither.
    def contiguous(self) -> "BlockMaskInputs":
        return self

    def view(self, *_shape) -> "BlockMaskInputs":
        return self

    def to(self, *_args, **_kwargs) -> "BlockMaskInputs":
        """MPT turns its mask into a boolean one (`.to(torch.bool)`); the O(N) inputs are dtype-free."""
        return self


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
    config=None,
    **_unused,
) -> BlockMaskInputs:
    """AttentionMaskInterface entry: same arguments as transformers' `sdpa_mask`, O(N) result."""
    if use_vmap:
        # or/and mask overlays (e.g. image-token masks) are arbitrary functions of (q, kv).
        raise NotImplementedError(
            "this model adds a custom mask overlay that blockwise attention cannot rebuild per block; "
            "use it without apply_bpt_patch"
        )
    if isinstance(attention_mask, BlockMaskInputs):
        # Already built for this forward: generate() with a static cache builds the masks ahead of the
        # forward (prepare_inputs_for_generation) and hands them to the model as its attention_mask.
        return attention_mask
    # A static cache gives its offsets as 0-d tensors, and counts all of its slots in kv_length. Keys past
    # the last query (index q_offset - kv_offset + q_length) are empty slots: none is in use.
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    kv_used = min(kv_length, q_offset - kv_offset + q_length)
    padding_mask = None
    if attention_mask is not None:
        end = kv_offset + kv_used
        if attention_mask.shape[-1] < end:  # as transformers' prepare_padding_mask: missing = padding
            attention_mask = torch.nn.functional.pad(attention_mask, (0, end - attention_mask.shape[-1]))
        padding_mask = attention_mask[:, kv_offset:end].to(torch.bool)
        if host_reads_allowed() and bool(padding_mask.all()):  # traced, an all-True mask stays (hides nothing)
            padding_mask = None
    segment_ids = None
    if _is_chunked(mask_function, local_size, config):
        # transformers passes the chunk size as `local_size`, as it does a sliding window: it is not a window.
        # Chunks are contiguous runs of keys (by index less left padding, or by position id within a packed
        # document), so they are segments, read off the mask function like packed documents.
        if kv_used > 1:
            segment_ids = _segments_from_mask_function(mask_function, batch_size, kv_used, device, kv_offset)
        return BlockMaskInputs(padding_mask, segment_ids, None, q_length, kv_used)
    chunk_size = getattr(config, "attention_chunk_size", None)
    if local_size is not None and chunk_size == local_size and getattr(config, "sliding_window", None) != local_size:
        raise NotImplementedError(
            f"a mask with local_size={local_size} = attention_chunk_size whose mask function was not recognised as "
            "chunked: it would be read as a sliding window; use this model without apply_bpt_patch"
        )
    if attention_mask is None and q_offset == 0 and kv_offset == 0 and q_length == kv_used > 1:
        segment_ids = _segments_from_mask_function(mask_function, batch_size, q_length, device)
    return BlockMaskInputs(padding_mask, segment_ids, local_size, q_length, kv_used)


def _is_chunked(mask_function, local_size, config) -> bool:
    """Whether the mask is chunked attention's (create_chunked_causal_mask): its function contains `chunked_overlay`.

    torch.compile cannot trace the look into the function's closures, so while it traces the config decides: a
    mask whose local_size is the config's attention_chunk_size is chunked (the case bpt_mask refuses, eagerly,
    when the function holds no chunked_overlay), unless the sliding window has that size too (ambiguous: refused).
    """
    if host_reads_allowed():
        return _has_chunked_overlay(mask_function)
    chunk_size = getattr(config, "attention_chunk_size", None)
    if local_size is None or chunk_size != local_size:
        return False
    if getattr(config, "sliding_window", None) == local_size:
        raise NotImplementedError(
            f"under torch.compile a mask with local_size={local_size} = attention_chunk_size = sliding_window cannot "
            "be told to be chunked or windowed; run this model without torch.compile, or without apply_bpt_patch")
    return True


def _has_chunked_overlay(mask_function, depth: int = 8) -> bool:
    """Whether transformers' mask function (and_masks / or_masks / packing wrappers of closures) contains
    `chunked_overlay`, the same-chunk condition of chunked attention."""
    if mask_function is None or depth < 0:
        return False
    if getattr(mask_function, "__qualname__", "").startswith("chunked_overlay."):
        return True
    for cell in getattr(mask_function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # empty cell
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(callable(v) and _has_chunked_overlay(v, depth - 1) for v in values):
            return True
    return False


def _segments_from_mask_function(mask_function, batch_size, length, device, offset: int = 0) -> torch.Tensor | None:
    """Packed-document ids, read off transformers' own mask function along the sub-diagonal.

    transformers folds packing (position ids that restart) into `mask_function` without handing
    us the position ids. A causal (or sliding-window) mask always lets token i see token i-1
    unless i starts a new document, so probing (i, i-1) for every i recovers the boundaries in O(N).
    The same holds for chunked attention (causal and same chunk): a chunk start is a boundary too.
    offset: absolute index of key 0 (a cache's kv_offset), as the mask function takes absolute indices.
    """
    if mask_function is None:
        return None
    batch = torch.arange(batch_size, device=device)[:, None]  # [B, 1]
    q_idx = torch.arange(offset + 1, offset + length, device=device)[None, :]  # [1, N-1]
    head = torch.zeros((), dtype=torch.long, device=device)
    sees_previous = torch.as_tensor(mask_function(batch, head, q_idx, q_idx - 1), device=device)
    sees_previous = sees_previous.expand(batch_size, length - 1)  # [B, N-1]
    if host_reads_allowed() and bool(sees_previous.all()):  # traced: one segment per row (all ids 0) is kept
        return None
    starts = torch.nn.functional.pad(~sees_previous, (1, 0), value=False)  # [B, N]
    return starts.long().cumsum(-1)
