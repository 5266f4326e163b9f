"""Attention forwards bound onto module instances, for families whose attention (ALiBi) lives
inside their own forward instead of going through AttentionInterface (Bloom, Falcon, MPT).

Each binder returns the replacement forward for one attention module; apply.py records the
binding so remove() restores the module's own forward.

ALiBi is taken from the `alibi` tensor the stock model hands each layer ([B * H, 1, Nk]: slope x
absolute key position, O(N)) and passed to the kernel as a per-key bias, so it is stock's bias to the
last bit: Falcon rounds slope x position to bf16 (positions above 256 are not exact there), Bloom
builds it in the model dtype, and both count positions over non-padding keys.
"""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from patches.attention import run_blockwise


def _key_bias(alibi: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Stock's per-layer ALiBi [B * H, 1, Nk] -> the kernel's key_bias [B, H, Nk]."""
    batch, heads = query.shape[:2]
    return alibi.view(batch, heads, alibi.shape[-1])


def _merge_heads(out: torch.Tensor) -> torch.Tensor:
    batch, heads, length, head_dim = out.shape  # [B, H, N, D] -> [B, N, H*D]
    return out.transpose(1, 2).reshape(batch, length, heads * head_dim)


def bloom_forward(module):
    def forward(hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        if module.pretraining_tp > 1 and module.slow_but_exact:
            raise NotImplementedError("Bloom's slow_but_exact tensor-parallel path is not supported patched")
        query, key, value = module._reshape(module.query_key_value(hidden_states))  # 3 x [B, H, N, D]
        if layer_past is not None:
            key, value = layer_past.update(key, value, module.layer_idx)
        # Bloom's scores: beta * alibi + inv_norm_factor * q.k (baddbmm), plus an additive mask (eager only).
        key_bias = _key_bias(alibi * module.beta, query)
        dropout = module.attention_dropout.p if module.training else 0.0
        out = run_blockwise(module, query, key, value, attention_mask, dropout=dropout,
                            scaling=module.inv_norm_factor, key_bias=key_bias, empty_rows="uniform")
        output = module.dense(_merge_heads(out))
        return F.dropout(output, p=module.hidden_dropout, training=module.training) + residual, None

    return forward


def falcon_forward(module):
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    def forward(hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        query, key, value = _falcon_split(module, module.query_key_value(hidden_states))  # [B, H*, N, D]
        if alibi is None:
            cos, sin = position_embeddings
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if layer_past is not None:
            key, value = layer_past.update(key, value, module.layer_idx)
        if alibi is None:
            out = run_blockwise(module, query, key, value, attention_mask, scaling=module.inv_norm_factor)
        else:
            # Falcon's scores: (q.k + alibi) / sqrt(d); stock folds alibi / sqrt(d) into the SDPA mask (a float mask
            # of the dtype's minimum: bpt.engine.empty_rows). Stock's eager path adds alibi a second time on top of
            # that mask: not followed.
            key_bias = _key_bias(alibi / math.sqrt(module.head_dim), query)
            dropout = module.attention_dropout.p if module.training else 0.0
            out = run_blockwise(module, query, key, value, attention_mask, dropout=dropout,
                                scaling=module.inv_norm_factor, key_bias=key_bias, empty_rows="uniform_fused")
        return module.dense(_merge_heads(out)), None

    return forward


def _falcon_split(module, fused_qkv: torch.Tensor):
    """Falcon's fused projection -> q [B, H, N, D], k/v [B, Hkv, N, D], without repeating K/V."""
    batch, length, _ = fused_qkv.shape
    if module.new_decoder_architecture:
        # [B, N, Hkv, group + 2, D]: each KV head followed by its group of query heads' K and V
        qkv = fused_qkv.view(batch, length, -1, module.num_heads // module.num_kv_heads + 2, module.head_dim)
        query = qkv[:, :, :, :-2].flatten(2, 3)
        key, value = qkv[:, :, :, -2], qkv[:, :, :, -1]
    else:
        query, key, value = module._split_heads(fused_qkv)  # [B, N, H or 1, D]
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def mpt_forward(module):
    def forward(hidden_states, position_bias, past_key_values=None, attention_mask=None, **kwargs):
        batch, length = hidden_states.shape[:2]
        mixed_qkv = module.Wqkv(hidden_states)
        if module.clip_qkv:
            mixed_qkv = mixed_qkv.clamp(min=-module.clip_qkv, max=module.clip_qkv)
        query, key, value = (x.reshape(batch, length, module.n_heads, module.head_dim).transpose(1, 2)
                             for x in mixed_qkv.chunk(3, dim=2))
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, module.layer_idx)
        # MPT's scores: softmax_scale * q.k + position_bias, its ALiBi tensor [H, 1, max_seq_len] of slope x
        # (key position - last position), of which stock adds the last Nk columns (float32 like stock's).
        keys = key.shape[-2]
        if position_bias.shape[-1] < keys:
            raise ValueError(f"MPT's ALiBi covers max_seq_len={position_bias.shape[-1]} keys, got {keys}: raise "
                             "max_seq_len in the model config (stock MPT cannot run this length either)")
        key_bias = position_bias[:, -1, position_bias.shape[-1] - keys:].expand(batch, -1, -1)
        dropout = module.attn_dropout_p if module.training else 0.0
        # Stock replaces hidden scores (masked_fill): an empty row is uniform, with no gradient through its scores.
        out = run_blockwise(module, query, key, value, attention_mask, dropout=dropout,
                            scaling=module.softmax_scale, key_bias=key_bias, empty_rows="uniform_values")
        return module.out_proj(_merge_heads(out)), None

    return forward


BINDERS = {"bloom": bloom_forward, "falcon": falcon_forward, "mpt": mpt_forward}
