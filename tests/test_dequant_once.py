"""patches/dequant_once.py: in a checkpointed layer a 4-bit base weight is dequantised for the recompute and the
backward once, with bitsandbytes' own values; elsewhere bitsandbytes' forward runs as it is."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import patches.apply
from patches import apply_bpt_patch
import test_kbit_recipe
from test_kbit_recipe import load_4bit
from test_patches import SMALL_BLOCKS, loss_and_grads, make_batch

saved_bf16_llama = test_kbit_recipe.saved_bf16_llama  # the tiny bf16 llama on disk (a fixture)


class Dequantisations(TorchDispatchMode):
    """Counts the ops that dequantise a whole 4-bit weight: bitsandbytes' matmul (it dequantises inside: CPU, and
    CUDA past a few rows) and its dequantisation, or the simulation's."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in ("bitsandbytes.gemm_4bit", "bitsandbytes.dequantize_4bit", "bpt_sim.dequantize_nf4"):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def patched(model, *, once: bool, monkeypatch, **options):
    """`model` patched; once=False keeps bitsandbytes' forward in every layer (the change under test left out)."""
    with monkeypatch.context() as patch:
        if not once:
            patch.setattr(patches.apply, "is_4bit_linear", lambda module: False)
        apply_bpt_patch(model, **options)
    return model


def patched_4bit(path, compute_dtype, *, once: bool, monkeypatch):
    """The tiny 4-bit llama with LoRA, patched with small blocks."""
    return patched(load_4bit(path, compute_dtype), once=once, monkeypatch=monkeypatch, **SMALL_BLOCKS)


def step(model, inputs, autocast: bool, device_type: str = "cpu"):
    with Dequantisations() as counted, torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        loss, grads = loss_and_grads(model, inputs)
    return loss, grads, counted.ops


def assert_bitwise_with_one_dequantisation_fewer_per_backward_matmul(results: dict) -> tuple[int, int]:
    """results[once] = step(...) for bitsandbytes' forward (False) and the patch's (True): loss and gradients bitwise
    equal, and bitsandbytes' dequantisations in its backward (those outside its matmuls) gone, nothing else changed.
    Returns (dequantisations bitsandbytes' forward made, those in its backward)."""
    (loss, grads, bitsandbytes_ops), (loss_once, grads_once, once_ops) = results[False], results[True]
    assert grads and grads.keys() == grads_once.keys()
    assert torch.equal(loss, loss_once)
    assert all(torch.equal(grads[name], grads_once[name]) for name in grads)
    in_backward = bitsandbytes_ops["bitsandbytes.dequantize_4bit"]  # its matmuls dequantise inside gemm_4bit
    made, once = sum(bitsandbytes_ops.values()), sum(once_ops.values())
    assert in_backward > 0 and once == made - in_backward, (bitsandbytes_ops, once_ops)
    return made, in_backward


@pytest.mark.parametrize("precision", ["fp32", "bf16 weights", "bf16 autocast"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_step_dequantises_each_weight_twice_with_bitsandbytes_values(saved_bf16_llama, monkeypatch,
                                                                                   precision, reentrant):
    """Loss and LoRA gradients bitwise those of bitsandbytes' own forward, and one dequantisation fewer per backward
    matmul (bitsandbytes' own in its backward are gone, nothing else changes): non-reentrant, two where it makes three
    (per layer forward and per MLP chunk: the forward, the recompute, the backward). (Reentrant checkpointing's
    recompute also runs the MLP's chunked forward: there three where it makes four.)"""
    compute = torch.float32 if precision == "fp32" else torch.bfloat16
    results = {}
    for once in (False, True):
        model = patched_4bit(saved_bf16_llama, compute, once=once, monkeypatch=monkeypatch)
        if reentrant:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        results[once] = step(model, make_batch("llama", seed=1), autocast=precision == "bf16 autocast")
    made, in_backward = assert_bitwise_with_one_dequantisation_fewer_per_backward_matmul(results)
    assert reentrant or made == in_backward * 3


def test_without_checkpointing_or_gradients_bitsandbytes_runs_as_it_is(saved_bf16_llama, monkeypatch):
    """No layer checkpoint: a saved dequantised weight would stay from the forward to the backward (every layer's:
    the model in 16 bits), so the patched layer is bitsandbytes' and the step dequantises as many times."""
    counts = {}
    for once in (False, True):
        model = patched_4bit(saved_bf16_llama, torch.float32, once=once, monkeypatch=monkeypatch)
        inputs = make_batch("llama", seed=2)
        with torch.no_grad(), Dequantisations() as evaluated:
            model(**inputs)
        model.gradient_checkpointing_disable()
        _, _, trained = step(model, inputs, autocast=False)
        counts[once] = sum(evaluated.ops.values()), sum(trained.values())
    assert counts[True] == counts[False] and all(counts[True])


def test_the_simulated_4bit_layer_is_dequantised_as_often(monkeypatch):
    """The simulation's emulated layer (bpt.gpusim.quant4) takes the same path, so the simulated memory and clock see
    the held weight and the missing dequantisation: twice per weight per run of its layer (or MLP chunk) where
    bitsandbytes' forward, emulated, makes three. (Its values are not computed: only the counts are compared.)"""
    from peft import LoraConfig, get_peft_model

    from bpt.gpusim.quant4 import Emulated4bitLinear, lora_like_bitsandbytes, quantise_linears
    from tiny_models import tiny_model

    counts = {}
    for once in (False, True):
        model = tiny_model("llama", hidden_size=64, intermediate_size=128)
        quantise_linears(model)
        config = lora_like_bitsandbytes(LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]))
        model = get_peft_model(model, config)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        patched(model.train(), once=once, monkeypatch=monkeypatch, **SMALL_BLOCKS)
        counts[once] = sum(step(model, make_batch("llama", seed=0), autocast=False)[2].values())
    linears = sum(isinstance(m, Emulated4bitLinear) for m in model.modules())
    assert linears == 14 and counts[False] % 3 == 0 and counts[True] == counts[False] // 3 * 2 >= 2 * linears, counts


def assert_one_dequantisation_fewer_per_backward_matmul(device: str, length: int, monkeypatch) -> None:
    """A tiny llama quantised by bitsandbytes on `device` (as the GPU check's model), LoRA on every linear, bf16
    autocast, checkpointing, one sequence of `length` tokens: loss and gradients bitwise those of bitsandbytes' own
    forward (on CUDA where its matmul dequantises too: past 1,536 rows), one dequantisation fewer per backward matmul.
    tests/test_cuda.py runs it on the GPU."""
    from peft import LoraConfig, get_peft_model

    from bpt.bench.models import quantise_with_bitsandbytes
    from patches.kbit import prepare_kbit_model
    from tiny_models import tiny_model

    results = {}
    for once in (False, True):
        model = tiny_model("llama", hidden_size=64, intermediate_size=128, max_position_embeddings=length)
        quantise_with_bitsandbytes(model.to(device=device, dtype=torch.bfloat16))
        model.is_loaded_in_4bit = True  # what from_pretrained sets: peft's preparation then turns checkpointing on
        model = prepare_kbit_model(model, gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, init_lora_weights=False, target_modules="all-linear")).train()
        patched(model, once=once, monkeypatch=monkeypatch)
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        inputs = {"input_ids": ids.to(device), "labels": ids.to(device)}
        results[once] = step(model, inputs, autocast=True, device_type=torch.device(device).type)
    assert_bitwise_with_one_dequantisation_fewer_per_backward_matmul(results)


def test_a_model_quantised_as_the_gpu_checks_is_dequantised_once(monkeypatch):
    assert_one_dequantisation_fewer_per_backward_matmul("cpu", 256, monkeypatch)


def test_hf_trainer_trains_the_4bit_model_as_bitsandbytes_does(saved_bf16_llama, monkeypatch, tmp_path):
    """Inside HF Trainer (bf16, gradient checkpointing, 3 steps): the logged losses and the trained adapters bitwise
    those of bitsandbytes' own forward, with fewer dequantisations."""
    from test_trainers import _train_losses, _trainer

    results = {}
    for once in (False, True):
        model = patched_4bit(saved_bf16_llama, torch.bfloat16, once=once, monkeypatch=monkeypatch)
        with Dequantisations() as counted:
            losses = _train_losses(_trainer(model, tmp_path / str(once), bf16=True, gradient_checkpointing=True))
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        results[once] = losses, trained, sum(counted.ops.values())
    (losses, adapters, made), (losses_once, adapters_once, made_once) = results[False], results[True]
    assert len(losses) == 3 and losses == losses_once and 0 < made_once < made, (made, made_once)
    assert adapters.keys() == adapters_once.keys() and all(torch.equal(adapters[n], adapters_once[n]) for n in adapters)
