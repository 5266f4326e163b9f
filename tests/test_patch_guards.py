"""Guard against silent fallbacks: for every family, the patched model really runs blockwise attention in
each layer, the chunked MLP in each layer and the chunked loss once per labelled forward. A family that
quietly stops going through AttentionInterface (or moves its MLP) in a future transformers release fails
here even if its results still happen to match stock."""
from __future__ import annotations

import pytest
import torch

import patches.apply
import patches.attention
import patches.lm_head
from patches import FAMILIES, apply_bpt_patch
from test_patches import SMALL_BLOCKS, make_batch
from tiny_models import TINY_CONFIGS, tiny_model


def _counting(monkeypatch, module, name: str) -> list:
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


# config.layer_types entries of layers whose token mixer is recurrent (Mamba, short conv, linear attention): no
# softmax attention to run blockwise. Every other entry (full / sliding / chunked attention, Falcon-H1's "hybrid"
# layer with attention beside Mamba) has one.
RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "mamba")


def attention_layers(model, family) -> int:
    """How many layers must run blockwise attention, from the config, never from the patched modules: a hybrid
    family whose attention layers stop going through the patch (renamed attribute, mixer outside AttentionInterface)
    still fails. Linear attention at layer.self_attn (Kimi Linear, MiniMax) counts as recurrent."""
    layers = len(getattr(getattr(model, family.base), family.layers))
    layer_types = getattr(model.config, "layer_types", None)
    if layer_types is None:
        assert not family.hybrid, f"{model.config.model_type}: a hybrid row's tiny config needs layer_types"
        return layers
    assert len(layer_types) == layers
    count = sum(layer_type not in RECURRENT_LAYER_TYPES for layer_type in layer_types)
    assert not family.hybrid or 0 < count < layers, f"{model.config.model_type}: tiny config needs both layer kinds"
    return count


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_patched_model_runs_the_blockwise_ops(monkeypatch, name):
    model = tiny_model(name)
    family = FAMILIES[model.config.model_type]
    layers = len(getattr(getattr(model, family.base), family.layers))
    expected_attention = attention_layers(model, family)
    apply_bpt_patch(model, **SMALL_BLOCKS)
    attention = _counting(monkeypatch, patches.attention, "blockwise_attention")
    mlp = _counting(monkeypatch, patches.apply, "chunked_mlp")
    loss = _counting(monkeypatch, patches.lm_head, "chunked_lm_loss")
    batch = make_batch("right_padded")  # 45 tokens > every block: each op really chunks
    with torch.no_grad():
        model(**batch)
    assert (len(attention), len(mlp), len(loss)) == (expected_attention, layers, 1)


def test_hybrid_rows_skip_only_layers_without_attention(monkeypatch):
    """Family.hybrid: recurrent layers (no attention attribute) are left stock; a row without it that names a missing
    attribute fails loudly, and a hybrid row that finds no attention layer at all raises instead of patching nothing."""
    from patches.families import Family, UnsupportedModelError

    model = tiny_model("bamba")
    recurrent, attention = getattr(model, "model").layers
    with apply_bpt_patch(model, **SMALL_BLOCKS):
        assert hasattr(attention.self_attn, patches.attention.CONFIG_ATTR) and not hasattr(recurrent, "self_attn")
    monkeypatch.setitem(FAMILIES, "bamba", Family(mlp="feed_forward"))  # not hybrid
    with pytest.raises(AttributeError, match="self_attn"):
        apply_bpt_patch(model, **SMALL_BLOCKS)
    monkeypatch.setitem(FAMILIES, "bamba", Family(mlp="feed_forward", attention="attn", hybrid=True))  # wrong name
    with pytest.raises(UnsupportedModelError, match="nothing to patch"):
        apply_bpt_patch(model, **SMALL_BLOCKS)
    assert not patches.is_patched(model) and not hasattr(attention.self_attn, patches.attention.CONFIG_ATTR)


def test_learned_positions_count_the_cache_when_generating():
    """GPT-2's position table ends at n_positions: a generation running past it through the KV cache is one
    ValueError naming the limit (the cache's tokens counted, under whichever name transformers passes it), not an
    IndexError from the embedding."""
    model = tiny_model("gpt2", n_positions=16).eval()
    apply_bpt_patch(model, **SMALL_BLOCKS)
    prompt = torch.randint(0, model.config.vocab_size, (1, 12))
    with pytest.raises(ValueError, match="17 tokens exceed this model's 16 learned positions"):
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                       pad_token_id=0)
