"""patches.lora_inputs: under bf16 autocast the patched model's LoRA layers use their input as it is instead of peft's
exact bf16 -> fp32 -> bf16 round trip: bitwise the same loss and gradients, fewer bytes saved for backward."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from patches import apply_bpt_patch, lora_inputs
from test_patches import SMALL_BLOCKS, make_batch
from tiny_models import tiny_model


def lora_bf16_model(dropout: float = 0.0):
    torch.manual_seed(0)
    model = tiny_model("llama").to(torch.bfloat16)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False, target_modules="all-linear")
    return get_peft_model(model, config)  # peft keeps the adapters fp32 (autocast_adapter_dtype)


def step(model, inputs, seed: int = 0):
    """(loss, grads, distinct bytes saved for backward) of one bf16-autocast step."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved.values())


def test_adapters_are_fp32_over_a_bf16_base():
    assert {p.dtype for n, p in lora_bf16_model().named_parameters() if "lora_" in n} == {torch.float32}


@pytest.mark.parametrize("kind", ["plain", "packed"])
def test_bitwise_equal_and_fewer_saved_bytes(monkeypatch, kind):
    model = lora_bf16_model()
    apply_bpt_patch(model, **SMALL_BLOCKS)
    inputs = make_batch(kind)
    loss, grads, saved = step(model, inputs)
    monkeypatch.setattr(lora_inputs, "_autocast_returns", lambda x: False)  # peft's own cast
    round_trip_loss, round_trip_grads, round_trip_saved = step(model, inputs)
    assert torch.equal(loss, round_trip_loss)
    assert grads.keys() == round_trip_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(grad, round_trip_grads[name]), name
    hidden = inputs["input_ids"].numel() * model.config.hidden_size * 2  # one bf16 [B, N, hidden]
    layers = model.config.num_hidden_layers
    # per layer: q, k, v's three copies of the normed input become that input once (at least two copies fewer);
    # o_proj's copy of the attention output is one more where the attention path saves its output anyway. The
    # MLP's adapters run inside the chunked MLP, which saves no copies.
    assert round_trip_saved - saved >= 2 * layers * hidden


def test_dropout_keeps_the_cast(monkeypatch):
    model = lora_bf16_model(dropout=0.1)
    apply_bpt_patch(model, **SMALL_BLOCKS)
    inputs = make_batch("plain")
    loss, grads, saved = step(model, inputs)
    monkeypatch.setattr(lora_inputs, "_autocast_returns", lambda x: False)
    round_trip_loss, round_trip_grads, round_trip_saved = step(model, inputs)
    assert torch.equal(loss, round_trip_loss) and saved == round_trip_saved


def test_fp32_and_remove_restore_peft(monkeypatch):
    model = lora_bf16_model()
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    stock_cast = layer._cast_input_dtype
    handle = apply_bpt_patch(model, **SMALL_BLOCKS)
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    assert layer._cast_input_dtype(x, torch.float32).dtype == torch.float32  # no autocast: peft's cast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer._cast_input_dtype(x, torch.float32) is x
    handle.remove()
    assert "_cast_input_dtype" not in vars(layer) and layer._cast_input_dtype == stock_cast
    copy.deepcopy(model)  # still an ordinary peft model
