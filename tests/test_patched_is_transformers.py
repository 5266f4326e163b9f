"""A patched model is still a transformers model (issue 18): loader return shapes, attention weights on request,
the tuple form of its outputs, and a config object shared with other models that the patch leaves alone."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import patches.attention
from patches import apply_bpt_patch, is_patched
from test_patches import SMALL_BLOCKS, make_batch
from tiny_models import tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def stock_eager(name, stock):
    """Stock with eager attention (the weights' reference), same weights as `stock`."""
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(tiny_config(name), attn_implementation="eager").eval()
    eager.load_state_dict(stock.state_dict())
    return eager


def stock_eager_patched(name):
    """(stock in eval mode, the same weights on stock eager attention, a patched copy)."""
    stock = tiny_model(name).eval()
    eager, patched = stock_eager(name, stock), copy.deepcopy(stock)
    apply_bpt_patch(patched, **SMALL_BLOCKS)
    return stock, eager, patched


def inputs():
    batch = make_batch("plain", batch=2, length=24)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][0, :5] = 0  # left padding
    return batch


@pytest.mark.parametrize("loader", [AutoModelForCausalLM, AutoModel])
@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_from_pretrained_with_loading_info_returns_it_unchanged(tmp_path, name, loader):
    tiny_model(name).save_pretrained(tmp_path)
    stock_model, stock_info = loader.from_pretrained(tmp_path, output_loading_info=True)
    with apply_bpt_patch(**SMALL_BLOCKS):
        loaded = loader.from_pretrained(tmp_path, output_loading_info=True)
        assert isinstance(loaded, tuple) and len(loaded) == 2
        model, info = loaded
        assert type(model) is type(stock_model) and info == stock_info
        assert is_patched(model) == (loader is AutoModelForCausalLM)  # base models are left alone


@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_output_attentions_gives_stock_eager_weights_with_one_warning(name):
    stock, eager, patched = stock_eager_patched(name)
    batch = inputs()
    with torch.no_grad():
        expected = eager(**batch, output_attentions=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [patched(**batch, output_attentions=True) for _ in range(2)]
            plain = patched(**batch)  # without the flag: blockwise, no weights
    assert [str(w.message) for w in caught if "N x N" in str(w.message)] and \
        len([w for w in caught if "output_attentions" in str(w.message)]) == 1
    for out in got:
        assert len(out.attentions) == len(expected.attentions) == 2
        for g, e in zip(out.attentions, expected.attentions):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
    assert not plain.attentions


@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_generate_with_output_attentions_matches_stock_eager(name):
    stock, eager, patched = stock_eager_patched(name)
    batch = inputs()
    kwargs = dict(attention_mask=batch["attention_mask"], max_new_tokens=4, do_sample=False, pad_token_id=0,
                  output_attentions=True, return_dict_in_generate=True)
    expected = eager.generate(batch["input_ids"], **kwargs)
    got = patched.generate(batch["input_ids"], **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.attentions) == len(expected.attentions) == 4
    for step_got, step_expected in zip(got.attentions, expected.attentions):
        for g, e in zip(step_got, step_expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_assisted_generation_with_output_attentions_matches_stock_eager(name):
    stock, eager, patched = stock_eager_patched(name)
    assistant = tiny_model(name, seed=1).eval()
    prompt = make_batch("plain", batch=1, length=20)["input_ids"]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_attentions=True,
                  return_dict_in_generate=True)
    expected = eager.generate(prompt, assistant_model=copy.deepcopy(assistant), **kwargs)
    got = patched.generate(prompt, assistant_model=copy.deepcopy(assistant), **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.attentions) == len(expected.attentions) > 0
    for step_got, step_expected in zip(got.attentions, expected.attentions):
        for g, e in zip(step_got, step_expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_switching_attention_implementation_is_refused_until_removed():
    model = tiny_model("llama").eval()
    handle = apply_bpt_patch(model, **SMALL_BLOCKS)
    with pytest.raises(ValueError, match=r"patched by apply_bpt_patch.*call remove\(\) on its patch handle first"):
        model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="remove"):
        model.config._attn_implementation = "eager"
    assert is_patched(model) and model.config._attn_implementation == patches.attention.ATTN_IMPLEMENTATION
    handle.remove()
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_labels_with_return_dict_false_give_the_tuple(name):
    stock = tiny_model(name).train()
    patched = copy.deepcopy(stock)
    apply_bpt_patch(patched, **SMALL_BLOCKS)
    batch = make_batch("right_padded")
    loss = patched(**batch).loss
    expected, got = stock(**batch, return_dict=False), patched(**batch, return_dict=False)
    assert isinstance(expected, tuple) and isinstance(got, tuple)
    assert torch.equal(got[0], loss)  # the tuple form of the patched output: (loss, ...), logits are None
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    got[0].backward()


@pytest.mark.parametrize("name, model_class", [("llama", "LlamaForCausalLM"), ("bloom", "BloomForCausalLM")])
def test_patch_leaves_a_shared_config_and_its_other_models_alone(monkeypatch, name, model_class):
    import transformers

    config = tiny_config(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    build = getattr(transformers, model_class)
    earlier = build(config).eval()
    assert model.config is config and earlier.config is config  # transformers shares it
    stock_implementation = config._attn_implementation
    batch, valid = inputs(), inputs()["attention_mask"].bool()  # left-padded rows are garbage in stock
    with torch.no_grad():
        expected = {m: m(**batch).logits for m in (model, earlier)}
    handle = apply_bpt_patch(model, **SMALL_BLOCKS)
    later = build(config).eval()
    later.load_state_dict(earlier.state_dict())
    assert config._attn_implementation == stock_implementation and not is_patched(later)
    calls = []
    monkeypatch.setattr(patches.attention, "blockwise_attention", lambda *a, **k: calls.append(1))
    with torch.no_grad():
        assert torch.equal(earlier(**batch).logits, expected[earlier])
        assert torch.equal(later(**batch).logits, expected[earlier])
    assert not calls, "a model the patch was not applied to ran the blockwise kernel"
    monkeypatch.undo()
    model.config.use_cache = False  # a setting changed through the patched model reaches the caller's config
    assert config.use_cache is False
    config.use_cache = True
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits[valid], expected[model][valid], rtol=1e-5, atol=1e-5)
    handle.remove()
    assert model.config is config and later.config is config and config._attn_implementation == stock_implementation
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, expected[model])
        assert torch.equal(later(**batch).logits, expected[earlier])


@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_a_config_rebuilt_from_the_patched_one_is_a_plain_config(name):
    """`type(config)(**config.to_dict())` (peft does it when it saves embedding layers) gives what it gives stock: a
    config of that class with no attention implementation of the patch's, settable as stock's is."""
    stock, patched = tiny_model(name), tiny_model(name)
    apply_bpt_patch(patched)
    rebuilt = {side: type(m.config)(**m.config.to_dict()) for side, m in (("stock", stock), ("patched", patched))}
    assert rebuilt["patched"]._attn_implementation == rebuilt["stock"]._attn_implementation
    assert rebuilt["patched"].to_dict() == rebuilt["stock"].to_dict()
    rebuilt["patched"]._attn_implementation = "eager"
    assert rebuilt["patched"]._attn_implementation == "eager"
    assert patched.config._attn_implementation == "bpt"
