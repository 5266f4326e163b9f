"""Patch lifecycle as a notebook lives it: applying twice, re-applying with new options, removing
handles in any order, and a failure midway through patching (which must leave the model stock)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

import patches.apply as apply_module
from bpt.config import BPTConfig
from patches import apply_bpt_patch, is_patched
from patches.attention import CONFIG_ATTR
from patches.bound_attention import BINDERS
from test_patches import SMALL_BLOCKS, make_batch
from tiny_models import tiny_config, tiny_model

OTHER_BLOCKS = {**SMALL_BLOCKS, "q_block": 8, "mlp_chunk": 8}
LOADERS = ("from_pretrained", "_from_config")


def snapshot(model):
    """Which function each module's forward runs, what the patch may have set, the attention choice."""
    modules = {name: (getattr(m.forward, "__func__", m.forward), sorted(set(vars(m)) & {"forward", CONFIG_ATTR}))
               for name, m in model.named_modules()}
    return modules, model.config._attn_implementation, sorted(vars(model))


def logits(model):
    inputs = make_batch("right_padded")
    inputs.pop("labels")
    with torch.no_grad():
        return model(**inputs).logits


def attention_options(model):
    return {getattr(layer.self_attn if hasattr(layer, "self_attn") else layer.self_attention, CONFIG_ATTR)
            for layer in (model.model.layers if hasattr(model, "model") else model.transformer.h)}


@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_apply_twice_returns_the_same_handle(name):
    model = tiny_model(name).eval()
    before, expected = snapshot(model), logits(model)
    first = apply_bpt_patch(model, **SMALL_BLOCKS)
    again = apply_bpt_patch(model, **SMALL_BLOCKS)  # a re-run notebook cell
    assert again is first and first.active and is_patched(model)
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)
    again.remove()  # one remove undoes it: no second patch hides underneath
    assert not is_patched(model) and not first.active
    assert snapshot(model) == before
    assert torch.equal(logits(model), expected)
    first.remove()  # idempotent


def test_apply_with_new_options_repatches_under_the_same_handle():
    model = tiny_model("llama").eval()
    before, expected = snapshot(model), logits(model)
    first = apply_bpt_patch(model, **SMALL_BLOCKS)
    second = apply_bpt_patch(model, **OTHER_BLOCKS)  # the cell, edited and re-run
    assert second is first and first.options == BPTConfig(**OTHER_BLOCKS)
    assert attention_options(model) == {BPTConfig(**OTHER_BLOCKS)}
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)
    first.remove()
    assert snapshot(model) == before and torch.equal(logits(model), expected)


def test_load_time_apply_twice_then_one_remove_is_stock():
    originals = {name: vars(PreTrainedModel)[name] for name in LOADERS}
    first = apply_bpt_patch(**SMALL_BLOCKS)
    try:
        again = apply_bpt_patch(**SMALL_BLOCKS)
        assert again is first
        loaded = AutoModelForCausalLM.from_config(tiny_config("llama"))
        assert is_patched(loaded)
    finally:
        first.remove()
    assert all(vars(PreTrainedModel)[name] is originals[name] for name in LOADERS)
    assert not is_patched(loaded)
    assert not is_patched(AutoModelForCausalLM.from_config(tiny_config("llama")))


@pytest.mark.parametrize("order", ["older_first", "newer_first"])
def test_load_time_handles_removed_in_any_order(order):
    originals = {name: vars(PreTrainedModel)[name] for name in LOADERS}
    older = apply_bpt_patch(**SMALL_BLOCKS)
    newer = apply_bpt_patch(**OTHER_BLOCKS)  # new options: models loaded from now on use them
    try:
        loaded = AutoModelForCausalLM.from_config(tiny_config("llama"))
        assert is_patched(loaded) and attention_options(loaded) == {BPTConfig(**OTHER_BLOCKS)}
    finally:
        for handle in (older, newer) if order == "older_first" else (newer, older):
            handle.remove()
    assert all(vars(PreTrainedModel)[name] is originals[name] for name in LOADERS)
    assert not is_patched(loaded)
    assert not is_patched(AutoModelForCausalLM.from_config(tiny_config("llama")))


def fail_on_layer(layer_index: int, make_error=lambda: RuntimeError("boom"), when=lambda module: True):
    """A wrapper for a per-layer patch step that raises on the given layer (0 or 1: calls counted per patch
    of the 2-layer tiny models), where `when(module)` holds."""
    calls = []

    def wrap(original):
        def step(module, *args):
            calls.append(module)
            if (len(calls) - 1) % 2 == layer_index and when(module):  # 2 layers in the tiny models
                raise make_error()
            return original(module, *args)

        return step

    return wrap


@pytest.mark.parametrize("where", ["bound_attention", "mlp", "lm_head"])
def test_failure_midway_leaves_the_model_stock(where, monkeypatch):
    name = "bloom" if where == "bound_attention" else "llama"
    model = tiny_model(name).eval()
    before, expected = snapshot(model), logits(model)
    error = RuntimeError
    if where == "bound_attention":  # the second layer's attention cannot be bound
        monkeypatch.setitem(BINDERS, "bloom", fail_on_layer(1)(BINDERS["bloom"]))
    elif where == "mlp":  # the last layer's MLP cannot be wrapped, after both attentions were
        monkeypatch.setattr(apply_module, "_chunked_mlp_forward", fail_on_layer(1)(apply_module._chunked_mlp_forward))
    else:  # every layer and the config are patched when the user interrupts
        error = KeyboardInterrupt

        def interrupted(*args):
            raise KeyboardInterrupt

        monkeypatch.setattr(apply_module, "causal_lm_forward", interrupted)
    with pytest.raises(error):
        apply_bpt_patch(model, **SMALL_BLOCKS)
    assert not is_patched(model)
    assert snapshot(model) == before
    assert torch.equal(logits(model), expected)
    monkeypatch.undo()
    handle = apply_bpt_patch(model, **SMALL_BLOCKS)  # nothing half-done is in the way
    handle.remove()
    assert snapshot(model) == before


def test_failed_repatch_keeps_the_previous_patch(monkeypatch):
    model = tiny_model("bloom").eval()
    expected = logits(model)
    handle = apply_bpt_patch(model, **SMALL_BLOCKS)
    patched_state = snapshot(model)
    # binding fails only for the new options, on the second layer
    failing = fail_on_layer(1, when=lambda module: getattr(module, CONFIG_ATTR).q_block == OTHER_BLOCKS["q_block"])
    monkeypatch.setitem(BINDERS, "bloom", failing(BINDERS["bloom"]))
    with pytest.raises(RuntimeError, match="boom"):
        apply_bpt_patch(model, **OTHER_BLOCKS)
    assert is_patched(model) and handle.active and handle.options == BPTConfig(**SMALL_BLOCKS)
    assert attention_options(model) == {BPTConfig(**SMALL_BLOCKS)}
    assert [entry[1] for entry in snapshot(model)[0].values()] == [entry[1] for entry in patched_state[0].values()]
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)
    handle.remove()
    assert torch.equal(logits(model), expected)


@pytest.mark.parametrize("wrap", ["plain", "peft", "peft_after_the_patch", "offload"])
def test_a_deep_copy_is_patched_and_runs_its_own_modules(wrap):
    """copy.deepcopy of a patched model (TRL's create_reference_model, an EMA copy), or of peft's wrapper around it
    (patched through it, or patched first as a TRL trainer given a peft_config wraps it): the copy is the same kind of
    object, patched with the same options under a handle of its own; its forward runs its own parameters (gradients
    land on it; changing its weights changes its loss, not the original's); the original keeps its handle and its
    results."""
    import copy

    from test_patches import loss_and_grads, lora

    options = {**SMALL_BLOCKS, "offload_checkpoints": wrap == "offload"}
    stock = tiny_model("llama")
    model = copy.deepcopy(stock)
    if wrap == "peft_after_the_patch":
        handle = apply_bpt_patch(model, **options)
        stock, model = lora(stock), lora(model)
    else:
        if wrap == "peft":
            stock, model = lora(stock), lora(model)
        if wrap == "offload":
            for side in (stock, model):
                side.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        handle = apply_bpt_patch(model, **options)
    inputs = make_batch("packed")
    expected = loss_and_grads(stock, inputs)
    copied = copy.deepcopy(model)
    assert type(copied) is type(model)
    assert is_patched(copied) and is_patched(model) and apply_module.unwrap(model)._bpt_patch_handle is handle
    copy_handle = apply_module.unwrap(copied)._bpt_patch_handle
    assert copy_handle is not handle and copy_handle.options == handle.options == BPTConfig(**options)
    for patched in (copied, model):
        loss, grads = loss_and_grads(patched, inputs)
        torch.testing.assert_close(loss, expected[0], rtol=1e-5, atol=1e-6)
        assert grads.keys() == expected[1].keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[1][name], rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.zero_()
    assert loss_and_grads(copied, inputs)[0] != expected[0]
    torch.testing.assert_close(loss_and_grads(model, inputs)[0], expected[0], rtol=1e-5, atol=1e-6)
    copy_handle.remove()
    assert not is_patched(copied) and is_patched(model) and handle.active


def test_pickling_a_patched_model_says_what_to_do():
    import pickle

    model = tiny_model("llama")
    handle = apply_bpt_patch(model, **SMALL_BLOCKS)
    with pytest.raises(TypeError, match="cannot be pickled: save it with save_pretrained"):
        pickle.dumps(model)
    assert is_patched(model)
    handle.remove()
    assert not is_patched(pickle.loads(pickle.dumps(model)))


def test_trl_reference_model_of_a_patched_model_is_its_own():
    """TRL's create_reference_model (a deep copy, frozen, in eval mode) of a patched model: patched, and its loss
    stays the policy's starting loss while the policy trains."""
    utils = pytest.importorskip("trl.experimental.utils")
    from test_patches import loss_and_grads

    policy = tiny_model("llama")
    apply_bpt_patch(policy, **SMALL_BLOCKS)
    inputs = make_batch("right_padded")
    start = loss_and_grads(policy, inputs)[0]
    reference = utils.create_reference_model(policy)
    assert is_patched(reference)
    torch.optim.SGD(policy.parameters(), lr=1.0).step()  # the gradients of the loss above
    with torch.no_grad():
        assert reference(**inputs).loss == start
        assert policy(**inputs).loss < start
