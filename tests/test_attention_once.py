"""Attention once per step (bpt.attention_once, patches/attention_once.py): under gradient checkpointing a layer's
recompute takes the fused attention's output and logsumexp its forward kept. The gradients are bitwise those of the
recomputing path (the same kernel's results, kept instead of made again), the attention forward runs once per layer
and step, and the rule keeps only where a forward's kept bytes fit."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bpt import attention_once
from patches import apply_bpt_patch
from test_patches import SMALL_BLOCKS, assert_grads_close, lora, loss_and_grads, make_batch
from tiny_models import tiny_model

FORWARD_KERNELS = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                   torch.ops.aten._scaled_dot_product_flash_attention.default)


class _CountForwards(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in FORWARD_KERNELS
        return func(*args, **(kwargs or {}))


def _checkpointed(model, reentrant: bool = False):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def _step(model, inputs, autocast: bool = False):
    with _CountForwards() as count, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, grads = loss_and_grads(model, inputs)
    return loss, grads, count.calls


def _sides(**options):
    stock = _checkpointed(lora(tiny_model("llama")))
    kept, recomputed = copy.deepcopy(stock), copy.deepcopy(stock)
    apply_bpt_patch(kept, **SMALL_BLOCKS, attention_once=True, **options)
    apply_bpt_patch(recomputed, **SMALL_BLOCKS, attention_once=False, **options)
    return stock, kept, recomputed


@pytest.mark.parametrize("autocast", [False, True])
def test_kept_attention_gives_the_recomputing_paths_gradients_with_one_forward_per_layer(autocast):
    stock, kept, recomputed = _sides()
    inputs = make_batch("plain")
    kept_loss, kept_grads, kept_calls = _step(kept, inputs, autocast)
    loss, grads, calls = _step(recomputed, inputs, autocast)
    layers = len(kept.base_model.model.model.layers)
    assert (kept_calls, calls) == (layers, 2 * layers)  # the recompute ran no attention forward
    assert torch.equal(kept_loss, loss) and kept_grads.keys() == grads.keys()
    assert all(torch.equal(kept_grads[name], grads[name]) for name in grads)
    if not autocast:
        stock_loss, stock_grads, _ = _step(stock, inputs)
        assert abs(kept_loss - stock_loss) <= 1e-5 * abs(stock_loss)
        assert_grads_close(stock_grads, kept_grads)


def test_kept_attention_with_checkpoint_offload_and_4bit_is_the_recomputing_path(tmp_path):
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama", hidden_size=64, intermediate_size=128).save_pretrained(tmp_path)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32)

    def load(once: bool):
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization)
        model = lora(prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        apply_bpt_patch(model, **SMALL_BLOCKS, offload_checkpoints=True, attention_once=once)
        return model

    inputs = make_batch("plain")
    kept_loss, kept_grads, kept_calls = _step(load(True), inputs)
    loss, grads, calls = _step(load(False), inputs)
    assert kept_calls * 2 == calls and torch.equal(kept_loss, loss)
    assert all(torch.equal(kept_grads[name], grads[name]) for name in grads)


def test_auto_keeps_what_fits_and_nothing_without_a_checkpoint(monkeypatch):
    inputs = make_batch("plain")
    model = lora(tiny_model("llama"))
    apply_bpt_patch(model, **SMALL_BLOCKS)  # attention_once auto
    layers = len(model.base_model.model.model.layers)
    assert _step(model, inputs)[2] == layers  # no checkpointing: one forward, nothing to keep
    _checkpointed(model)
    assert _step(model, inputs)[2] == layers  # auto: a tiny model's outputs fit
    monkeypatch.setattr(attention_once, "KEEP_SHARE", 0.0)
    assert _step(model, inputs)[2] == 2 * layers  # they do not fit: recomputed
    reentrant = _checkpointed(lora(tiny_model("llama")), reentrant=True)
    apply_bpt_patch(reentrant, **SMALL_BLOCKS, attention_once=True)
    assert _step(reentrant, inputs)[2] == 2 * layers  # reentrant checkpointing takes no context_fn


def test_a_recompute_that_asks_for_other_inputs_is_refused():
    store = attention_once.Kept(attention_once.KeepRule(True, layers=1))
    q = torch.zeros(1, 2, 8, 4)
    store.keep((q, q, q), (torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8)))
    with pytest.raises(RuntimeError, match="another path than its forward"):
        store.take((q[:, :, :4], q[:, :, :4], q[:, :, :4]))
    assert store.take((q, q, q)) is None  # nothing left (a second backward): the kernel runs


def test_the_flag_needs_checkpointing():
    from train.errors import UserError
    from train.recipe.args import parse_args

    assert parse_args(["--attention_once"]).attention_once is True
    assert parse_args(["--no_attention_once"]).attention_once is False
    with pytest.raises(UserError, match="needs --bpt and gradient checkpointing"):
        parse_args(["--attention_once", "--no_gradient_checkpointing"])
