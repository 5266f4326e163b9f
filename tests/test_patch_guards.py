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


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_patched_model_runs_the_blockwise_ops(monkeypatch, name):
    model = tiny_model(name)
    family = FAMILIES[model.config.model_type]
    layers = len(getattr(getattr(model, family.base), family.layers))
    apply_bpt_patch(model, **SMALL_BLOCKS)
    attention = _counting(monkeypatch, patches.attention, "blockwise_attention")
    mlp = _counting(monkeypatch, patches.apply, "chunked_mlp")
    loss = _counting(monkeypatch, patches.lm_head, "chunked_lm_loss")
    batch = make_batch("right_padded")  # 45 tokens > every block: each op really chunks
    with torch.no_grad():
        model(**batch)
    assert (len(attention), len(mlp), len(loss)) == (layers, layers, 1)
