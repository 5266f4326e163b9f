"""Tiny configs, one per supported family (plus variants), for exactness tests. No downloads."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

VOCAB = 97
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               attention_dropout=0.0, tie_word_embeddings=False)

# One sliding-window layer and one full-attention layer (families with per-layer `layer_types`).
_SLIDING_AND_FULL = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=7)
# Mixture of experts: 4 experts, top-2 (each family reads the names it knows; the rest are ignored).
_MOE = dict(num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            shared_expert_intermediate_size=24)
# Multi-head latent attention ranks (DeepSeek-style) and group-limited MoE routing.
_MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
_MLA_MOE = dict(_MOE, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
# Mamba-2 mixers: 4 heads of 16 (expand 2 x hidden 32), state 8, chunked scan in chunks of 16.
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16, mamba_n_groups=1)
# Gated DeltaNet linear attention: 2 key heads, 8 value heads of 8. Decay A = exp(A_log) is drawn from U(0.01, 16) per
# value head; a head with a large A forgets at once and its A_log / dt_bias gradients are cancellation noise (stock's
# own fp32 error vs fp64 ~1e-4 of their max). With 4 value heads seed 0 drew only such heads (patched vs stock 3e-4 on
# qwen3_5_moe_text; on qwen3_5_text each ~1e-4 from fp64); 8 heads include slower ones whose gradients set the scale.
_DELTA_NET = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=8,
                  linear_key_head_dim=8, linear_value_head_dim=8)

# name -> (model_type, config overrides). Several variants may share a family.
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", _COMMON),
    "mistral": ("mistral", {**_COMMON, "sliding_window": 7}),
    "mixtral": ("mixtral", {**_COMMON, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen2": ("qwen2", {**_COMMON, "tie_word_embeddings": True}),
    "qwen3": ("qwen3", {**_COMMON, "head_dim": 16}),
    "gemma": ("gemma", {**_COMMON, "head_dim": 8}),
    "gemma2": ("gemma2", {**_COMMON, "head_dim": 8, "sliding_window": 7, "attn_logit_softcapping": 5.0,
                          "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 16}),
    "phi3": ("phi3", {**_COMMON, "pad_token_id": 0}),
    "gpt_neox": ("gpt_neox", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5,
                                  attention_dropout=0.0, hidden_dropout=0.0)),
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                          attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
    "bloom": ("bloom", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                            attention_dropout=0.0, hidden_dropout=0.0)),
    "falcon": ("falcon", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              multi_query=True, alibi=False, new_decoder_architecture=False,
                              attention_dropout=0.0, hidden_dropout=0.0, max_position_embeddings=256)),
    "falcon_alibi": ("falcon", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    multi_query=False, alibi=True, new_decoder_architecture=False,
                                    parallel_attn=False, attention_dropout=0.0, hidden_dropout=0.0)),
    "falcon_gqa": ("falcon", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_kv_heads=2, new_decoder_architecture=True, alibi=False,
                                  attention_dropout=0.0, hidden_dropout=0.0, max_position_embeddings=256)),
    # Families added from issue 7's first step (rows that reuse an existing Family shape).
    **{name: (name, {**_COMMON, "head_dim": 8}) for name in (
        "arcee", "bitnet", "ernie4_5", "glm", "glm4", "helium", "hunyuan_v1_dense",
        "internlm3", "iquestcoder", "jais2", "nemotron", "olmo", "olmo2", "persimmon", "phi", "stablelm")},
    "exaone": ("exaone", {**_COMMON, "head_dim": 8}),
    "seed_oss": ("seed_oss", {**_COMMON, "head_dim": 8, "residual_dropout": 0.0}),
    **{name: (name, {**_COMMON, "head_dim": 8, **_SLIDING_AND_FULL}) for name in (
        "exaone4", "ministral", "olmo3")},
    "smollm3": ("smollm3", {**_COMMON, "use_sliding_window": True, **_SLIDING_AND_FULL}),
    **{name: (name, {**_COMMON, "head_dim": 8, **_MOE}) for name in (
        "glm4_moe", "hunyuan_v1_moe", "hy_v3", "olmoe")},
    "sarvam_moe": ("sarvam_moe", {**_COMMON, "head_dim": 8, **_MOE, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                  "use_qk_norm": True}),
    "jetmoe": ("jetmoe", {**_COMMON, **_MOE, "num_key_value_heads": 4}),  # the MoA module has no GQA
    "dots1": ("dots1", {**_COMMON, **_MOE, **_SLIDING_AND_FULL, "n_shared_experts": 1, "first_k_dense_replace": 1}),
    **{name: (name, {**_COMMON, "head_dim": 8, **_MOE, **_SLIDING_AND_FULL}) for name in (
        "afmoe", "exaone_moe", "laguna")},
    "beam": ("beam", {**_COMMON, "head_dim": 8, **_MOE, **_SLIDING_AND_FULL, "final_logit_softcapping": 3.0}),
    "nanochat": ("nanochat", {**_COMMON, "final_logit_softcapping": 3.0}),
    **{name: (name, {**_COMMON, "head_dim": 8, **_SLIDING_AND_FULL, "final_logit_softcapping": 3.0,
                     "query_pre_attn_scalar": 16}) for name in ("gemma3_text", "vaultgemma")},
    **{name: (name, {**_COMMON, "head_dim": 8, "global_head_dim": 16, **_SLIDING_AND_FULL,
                     "final_logit_softcapping": 3.0, "hidden_size_per_layer_input": 8,
                     "vocab_size_per_layer_input": VOCAB}) for name in ("gemma4_text", "gemma4_unified_text")},
    **{name: (name, dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, attn_pdrop=0.0,
                         resid_pdrop=0.0, embd_pdrop=0.0)) for name in ("gpt-sw3", "gpt_bigcode")},
    # Logit scaling after lm_head (non-trivial factors, so a loss that skipped them would fail).
    "cohere": ("cohere", {**_COMMON, "logit_scale": 0.5, "use_qk_norm": True}),
    "cohere2": ("cohere2", {**_COMMON, "head_dim": 8, **_SLIDING_AND_FULL, "logit_scale": 0.5}),
    "cohere_compass_text": ("cohere_compass_text", {
        **_COMMON, "head_dim": 8, **_SLIDING_AND_FULL, "logit_scale": 0.5,
        "rope_parameters": {layer: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
                            for layer in ("sliding_attention", "full_attention")}}),
    **{name: (name, {**_COMMON, **_MOE, "logits_scaling": 4.0, "embedding_multiplier": 2.0,
                     "residual_multiplier": 0.5, "attention_multiplier": 0.25})
       for name in ("granite", "granitemoe")},
    "granitemoeshared": ("granitemoeshared", {**_COMMON, **_MOE, "shared_intermediate_size": 24, "logits_scaling": 4.0,
                                              "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                              "attention_multiplier": 0.25}),
    "hyperclovax": ("hyperclovax", {**_COMMON, "head_dim": 8, "logits_scaling": 0.5, "embedding_multiplier": 2.0,
                                    "residual_multiplier": 0.5}),
    # Multi-head latent attention (MLA): low-rank q / kv, q/k head dim 12 (8 no-rope + 4 rope) != v head dim 8, so the
    # kernel gets v [B, H, N, 8] beside q, k [B, H, N, 12]. MoE rows: 4 routed experts top-2 in 2 groups, top-1 group
    # (group-limited routing), one shared expert; layer 0 dense, layer 1 MoE.
    **{name: (name, {**_COMMON, "num_key_value_heads": 4, **_MLA, **extra}) for name, extra in (
        ("deepseek_v2", {**_MLA_MOE, "first_k_dense_replace": 1, "topk_method": "group_limited_greedy"}),
        ("deepseek_v3", {**_MLA_MOE, "first_k_dense_replace": 1}),
        ("sarvam_mla", {**_MLA_MOE, "first_k_dense_replace": 1, "q_lora_rank": None}),  # no q low-rank; interleaved rope
        ("glm4_moe_lite", {**_MLA_MOE, "mlp_layer_types": ["dense", "sparse"]}),
        ("axk1", {**_MLA_MOE, "mlp_layer_types": ["dense", "sparse"]}),
        ("minicpm3", {}),  # divides hidden states by hidden_size / dim_model_base (= 0.125) before lm_head
        ("youtu", {}))},
    # Gemma 3n text: AltUp (2 streams), LAuReL, per-layer inputs, activation sparsity (layer 0) in the MLP, KV sharing:
    # 3 layers so that layer 2 reuses the KV of layer 1, the last full-attention layer before it. altup_correct_scale
    # off: its scale is zero-initialised and would zero every per-layer-input gradient (the low-precision test
    # divides by those gradients' norms); the patch does not touch that path.
    "gemma3n_text": ("gemma3n_text", {
        **_COMMON, "head_dim": 8, "num_hidden_layers": 3, "intermediate_size": [48, 48, 48], "sliding_window": 7,
        "layer_types": ["sliding_attention", "full_attention", "full_attention"], "num_kv_shared_layers": 1,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB, "laurel_rank": 4, "altup_num_inputs": 2,
        "altup_correct_scale": False, "activation_sparsity_pattern": [0.95, 0.0, 0.0], "final_logit_softcapping": 3.0}),
    # Attention sinks (s_aux).
    "gpt_oss": ("gpt_oss", {**_COMMON, "head_dim": 8, **_MOE, **_SLIDING_AND_FULL}),
    "flint": ("flint", {**_COMMON, "head_dim": 8, **_MOE, **_SLIDING_AND_FULL}),
    "mimo_v2_flash": ("mimo_v2_flash", {**_COMMON, "head_dim": 8, "v_head_dim": 4, **_MOE, **_SLIDING_AND_FULL}),
    **{name: (name, {**_COMMON, "head_dim": 8, **_SLIDING_AND_FULL, "logits_scaling": 4.0, "embedding_multiplier": 2.0,
                     "residual_multiplier": 0.5, "attention_multiplier": 0.25, **extra})
       for name, extra in (("granite_swa", {}), ("granitemoe_swa", {**_MOE, "shared_intermediate_size": 24}))},
    # Llama 4 text: layer 0 chunked attention with RoPE (chunks of 8: several in a 45-token sequence), layer 1 NoPE
    # full attention with temperature tuning (floor_scale 4 so the query scale varies within the sequence); layer 1 MoE
    # (routed top-2 of 4 + shared expert), layer 0 dense.
    "llama4_text": ("llama4_text", {**_COMMON, "head_dim": 8, **_MOE, "intermediate_size_mlp": 48,
                                    "attention_chunk_size": 8, "no_rope_layers": [1, 0], "moe_layers": [1],
                                    "floor_scale": 4, "attn_scale": 0.1}),
    # Added after the low-precision test routed MoE configs to every expert (test_mixed_precision.py).
    "cwm": ("cwm", {**_COMMON, "head_dim": 8, "sliding_window": 7}),  # one full and one sliding layer by default
    **{name: (name, {**_COMMON, "head_dim": 8, **_MOE}) for name in (
        "flex_olmo", "kolibri1", "minimax_m2", "qwen2_moe", "qwen3_moe")},
    "solar_open": ("solar_open", {**_COMMON, "head_dim": 8, **_MOE, "n_shared_experts": 1, "n_group": 1,
                                  "topk_group": 1}),
    "aria_text": ("aria_text", {**_COMMON, "head_dim": 8, "moe_num_experts": 4, "moe_topk": 2,
                                "moe_num_shared_experts": 1}),
    "ernie4_5_moe": ("ernie4_5_moe", {**_COMMON, "head_dim": 8, **_MOE, "moe_num_experts": 4, "moe_k": 2,
                                      "moe_num_shared_experts": 1}),
    "cohere2_moe": ("cohere2_moe", {**_COMMON, "head_dim": 8, **_MOE, **_SLIDING_AND_FULL, "logit_scale": 0.5}),
    # Hybrid attention + state-space / linear-attention stacks (Family.hybrid): a recurrent layer first, so the
    # attention layer after it sees its output; recurrent mixers run their CPU torch paths (chunk sizes below 45
    # tokens, so chunked scans cross chunks).
    "bamba": ("bamba", {**_COMMON, **_MAMBA2, "attn_layer_indices": [1]}),
    "granitemoehybrid": ("granitemoehybrid", {
        **_COMMON, **_MAMBA2, **_MOE, "layer_types": ["linear_attention", "full_attention"],
        "shared_intermediate_size": 24, "logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
        "attention_multiplier": 0.25}),
    "jamba": ("jamba", {**_COMMON, **_MOE, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                        "expert_layer_offset": 1, "mamba_d_state": 8, "mamba_dt_rank": 4}),
    "lfm2": ("lfm2", {**_COMMON, "layer_types": ["conv", "full_attention"], "block_auto_adjust_ff_dim": False}),
    "lfm2_moe": ("lfm2_moe", {**_COMMON, **_MOE, "num_dense_layers": 1, "layer_types": ["conv", "full_attention"]}),
    "lfm3": ("lfm3", {**_COMMON, "head_dim": 8, "sliding_window": 7,
                      "layer_types": ["conv", "sliding_attention", "full_attention"], "num_hidden_layers": 3}),
    **{name: (name, {**_COMMON, "head_dim": 8, **_DELTA_NET, **extra}) for name, extra in (
        ("olmo_hybrid", {}), ("qwen3_5_text", {}), ("qwen3_next", _MOE), ("qwen3_5_moe_text", _MOE))},
    # Mamba-2 in parallel with attention in every layer; muP multipliers, logits times lm_head_multiplier.
    "falcon_h1": ("falcon_h1", {**_COMMON, **_MAMBA2, "head_dim": 8, "mamba_d_ssm": 64, "lm_head_multiplier": 0.5,
                                "embedding_multiplier": 2.0, "key_multiplier": 0.5, "attention_in_multiplier": 0.5,
                                "ssm_in_multiplier": 0.5, "ssm_out_multiplier": 2.0}),
    # Linear attention at layer.self_attn beside softmax attention: Kimi Delta Attention + MLA, MiniMax lightning
    # attention (blocks of 16) + attention.
    "kimi_linear": ("kimi_linear", {**_COMMON, "num_key_value_heads": 4, **_MLA, **_MLA_MOE, "linear_head_dim": 8,
                                    "linear_num_heads": 4, "layer_types": ["linear_attention", "full_attention"],
                                    "mlp_layer_types": ["dense", "sparse"]}),
    "minimax": ("minimax", {**_COMMON, "head_dim": 8, **_MOE, "block_size": 16,
                            "layer_types": ["linear_attention", "full_attention"]}),
    **{name: (name, {**_COMMON, "head_dim": 8, **extra}) for name, extra in (
        ("mellum", _MOE), ("ministral3", {}), ("starcoder2", {}))},
    # MPT: ALiBi from its own [H, 1, max_seq_len] tensor; 6 heads (not a power of two: interleaved slopes), clip_qkv.
    "mpt": ("mpt", dict(vocab_size=VOCAB, d_model=48, n_heads=6, n_layers=2, expansion_ratio=2, max_seq_len=256,
                        resid_pdrop=0.0, emb_pdrop=0.0, attn_config={"attn_pdrop": 0, "clip_qkv": 0.5})),
}


_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_config(name: str, **overrides):
    """The tiny config of a variant; a test of a family this transformers does not have yet is skipped, naming the
    version (the floor tier runs transformers 5.17, which predates some families)."""
    model_type, kwargs = TINY_CONFIGS[name]
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is newer than the installed transformers {transformers.__version__}")
    return AutoConfig.for_model(model_type, **{**_TOKENS, **kwargs, **overrides})


def tiny_model(name: str, seed: int = 0, **overrides):
    """The stock model: SDPA attention where the family supports it, eager otherwise (Gemma2's softcap)."""
    config = tiny_config(name, **overrides)
    for attn_implementation in ("sdpa", "eager"):
        try:
            torch.manual_seed(seed)
            return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).float()
        except ValueError:
            continue
    raise AssertionError(f"no stock attention implementation for {name}")
