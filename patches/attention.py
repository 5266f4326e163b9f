"""Blockwise attention behind transformers' AttentionInterface, registered as "bpt"."""
from __future__ import annotations

import torch

from bpt.attention import blockwise_attention
from bpt.config import BPTConfig
from bpt.head_groups import flash_backward_bytes
from patches.masks import BlockMaskInputs

ATTN_IMPLEMENTATION = "bpt"
CONFIG_ATTR = "bpt_config"  # set on each patched attention module by apply_bpt_patch
# set (and restored) on each patched attention module by patches.sequence_parallel.sequence_parallel
SEQUENCE_PARALLEL_ATTR = "bpt_sequence_parallel"
# set on each patched attention module by apply_bpt_patch: what stock computes for a query row with no visible key
EMPTY_ROWS_ATTR = "bpt_empty_rows"


def stock_empty_rows(attn_implementation: str | None) -> str:
    """The rule of stock's attention for a row with no visible key (bpt.engine.empty_rows): eager adds the dtype's
    minimum to hidden scores (softmax of equal values: the mean of v), SDPA and fused kernels output zeros."""
    return "uniform" if attn_implementation == "eager" else "zeros"


def attention_options(module: torch.nn.Module) -> BPTConfig:
    """The BPT config apply_bpt_patch set on this attention module (defaults if none)."""
    return getattr(module, CONFIG_ATTR, None) or BPTConfig()


def mask_inputs(attention_mask) -> BlockMaskInputs:
    if attention_mask is None:  # a caller that skipped mask creation: plain causal
        return BlockMaskInputs(None, None, None)
    if not isinstance(attention_mask, BlockMaskInputs):
        raise TypeError(
            f"blockwise attention got a {type(attention_mask).__name__} mask; patched models build their own "
            "O(N) mask from a 2-D attention_mask: pass a 2-D padding mask (or none), not a 4-D mask"
        )
    return attention_mask


def run_blockwise(module, query, key, value, attention_mask, *, dropout=0.0, scaling=None, softcap=None,
                  alibi_slopes=None, key_bias=None, sinks=None, empty_rows=None) -> torch.Tensor:
    """query [B, Hq, Nq, D], key/value [B, Hkv, Nk, D] -> [B, Hq, Nq, D]; key_bias [B, Hq, Nk]; sinks [Hq].

    Only the keys the mask says are in use take part: a static cache hands attention all of its
    `max_cache_len` slots, of which the first `mask.kv_length` are filled (see BlockMaskInputs).
    empty_rows: stock's rule for rows with no visible key (None: the one apply_bpt_patch recorded on the module).
    """
    options = attention_options(module)
    if empty_rows is None:
        empty_rows = getattr(module, EMPTY_ROWS_ATTR, "zeros")
    mask = mask_inputs(attention_mask)
    key, value = mask.keys_in_use(key), mask.keys_in_use(value)
    if key_bias is not None:
        key_bias = mask.keys_in_use(key_bias, dim=-1)
    sequence_parallel = getattr(module, SEQUENCE_PARALLEL_ATTR, None)
    if sequence_parallel is not None:
        # The sequence is split over a group: padding / segments are the context's (global), not the local
        # mask's; the window is the layer's own (per layer type).
        return sequence_parallel.attention(
            module, query, key, value, causal=getattr(module, "is_causal", True), scaling=scaling, softcap=softcap,
            sliding_window=mask.sliding_window, alibi_slopes=alibi_slopes, key_bias=key_bias, sinks=sinks,
            dropout=dropout, q_block=options.q_block, kv_block=options.kv_block, compile=options.compile,
            empty_rows=empty_rows, head_groups=head_groups_rule(options))
    return blockwise_attention(
        query, key, value,
        scale=scaling,
        causal=getattr(module, "is_causal", True),
        padding_mask=mask.padding_mask,
        segment_ids=mask.segment_ids,
        sliding_window=mask.sliding_window,
        alibi_slopes=alibi_slopes,
        key_bias=key_bias,
        softcap=softcap,
        sinks=sinks,
        dropout=dropout,
        q_block=options.q_block,
        kv_block=options.kv_block,
        compile=options.compile,
        empty_rows=empty_rows,
        head_groups=head_groups_rule(options)(query, key),
    )


def head_groups_rule(options):
    """(q, k) -> how the fused attention's backward of these inputs is split (BPTConfig.attention_head_groups): asked
    of the tensors actually attended (a Ulysses rank's, after its all-to-all: its heads over the whole sequence)."""
    return lambda q, k: options.attention_head_groups(q.shape[1], k.shape[1], flash_backward_bytes(q, k), q.device)


def bpt_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                          s_aux=None, **_kwargs):
    """AttentionInterface entry, same contract as transformers' sdpa_attention_forward.

    The window comes from the mask inputs (built by transformers per layer type), not the
    `sliding_window` kwarg, so layers that transformers treats as full attention stay full. s_aux: the
    attention sinks [Hq] (gpt-oss and others), one learned logit per head in every row's softmax normaliser.
    """
    out = run_blockwise(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap,
                        sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None  # [B, Nq, Hq, D], no attention weights
