"""Tiny configs, one per supported family (plus variants), for exactness tests. No downloads."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 97
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               attention_dropout=0.0, tie_word_embeddings=False)

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
}


_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_config(name: str, **overrides):
    model_type, kwargs = TINY_CONFIGS[name]
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
