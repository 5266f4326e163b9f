"""patches.kbit.prepare_kbit_model, the QLoRA preparation of train.qlora and the simulation: a bf16 4-bit base keeps a
bf16 residual stream (its layer checkpoints half the bytes of those of peft's upcast recipe), and under bf16 autocast the patched
model is no worse than stock against the fp32 model of the same 4-bit weights."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from patches.kbit import prepare_kbit_model
from patches import apply_bpt_patch
from test_mixed_precision import assert_no_worse_than_stock
from test_patches import SMALL_BLOCKS, loss_and_grads, lora, make_batch
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def saved_bf16_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-bf16")
    model = tiny_model("llama", hidden_size=64, intermediate_size=128, tie_word_embeddings=False)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def load_4bit(path, compute_dtype: torch.dtype, prepare=prepare_kbit_model):
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=compute_dtype)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=compute_dtype)
    prepared = prepare(model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    # train mode: in eval mode bitsandbytes repacks CPU weights for its bf16 inference kernel
    return lora(prepared).train()


def layer_input_dtypes(model, inputs) -> set:
    seen = set()
    layers = model.get_base_model().model.layers
    hooks = [layer.register_forward_pre_hook(lambda _, args, kwargs: seen.add(
        (args[0] if args else kwargs["hidden_states"]).dtype), with_kwargs=True) for layer in layers]
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**inputs).loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_bf16_base_keeps_a_bf16_residual_stream(saved_bf16_llama):
    from peft import prepare_model_for_kbit_training

    ours = load_4bit(saved_bf16_llama, torch.bfloat16)
    base = ours.get_base_model()
    frozen = {p.dtype for n, p in base.named_parameters() if "lora_" not in n and p.__class__.__name__ != "Params4bit"}
    assert frozen == {torch.bfloat16}  # embedding, norms, LM head
    assert {p.dtype for n, p in base.named_parameters() if "lora_" in n} == {torch.float32}
    inputs = make_batch("plain")
    assert layer_input_dtypes(ours, inputs) == {torch.bfloat16}  # what each layer checkpoints
    peft_recipe = load_4bit(saved_bf16_llama, torch.bfloat16, prepare=prepare_model_for_kbit_training)
    assert layer_input_dtypes(peft_recipe, inputs) == {torch.float32}


def test_fp32_base_is_peft_recipe(saved_bf16_llama):
    model = load_4bit(saved_bf16_llama, torch.float32)
    assert {p.dtype for p in model.parameters() if p.__class__.__name__ != "Params4bit"} == {torch.float32}


@pytest.mark.parametrize("kind", ["plain", "packed"])
def test_bf16_recipe_patched_no_worse_than_stock(saved_bf16_llama, kind):
    """Stock and patched with the bf16 recipe under bf16 autocast, each against the fp32 model (same NF4 weights, same
    LoRA): RMS errors of the loss and every LoRA gradient over 4 batches."""
    reference = load_4bit(saved_bf16_llama, torch.float32)
    stock = load_4bit(saved_bf16_llama, torch.bfloat16)
    patched = load_4bit(saved_bf16_llama, torch.bfloat16)
    apply_bpt_patch(patched, **SMALL_BLOCKS)
    squared, norms = {"patched": {}, "stock": {}}, {}
    for seed in range(4):
        inputs = make_batch(kind, seed=seed)
        ref_loss, ref_grads = loss_and_grads(reference, inputs)
        norms["loss"] = norms.get("loss", 0.0) + ref_loss.item() ** 2
        for name, ref in ref_grads.items():
            norms[name] = norms.get(name, 0.0) + ref.pow(2).sum().item()
        for side, model in (("stock", stock), ("patched", patched)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, grads = loss_and_grads(model, inputs)
            assert grads.keys() == ref_grads.keys()
            errors = squared[side]
            errors["loss"] = errors.get("loss", 0.0) + (loss.float().item() - ref_loss.item()) ** 2
            for name, ref in ref_grads.items():
                errors[name] = errors.get(name, 0.0) + (grads[name].float() - ref).pow(2).sum().item()
    assert_no_worse_than_stock({key: ((squared["patched"][key] / norms[key]) ** 0.5,
                                      (squared["stock"][key] / norms[key]) ** 0.5) for key in norms}, batches=4)
