"""patches/spent_input.py: under checkpoint offload, the attention's normed input is dropped once the projections the
family's row names have read it (in the forward and in the checkpoint's recompute), and the layer's input in the
recompute once the module the row names is called; the loss and gradients bitwise those of the run without offload,
one [B, N, hidden] tensor fewer each where the recompute's peak was."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from bpt.gpusim.tracker import AllocationTracker
from patches import apply_bpt_patch, families
from patches.spent_input import AttentionInput, LayerInput
from test_offload import assert_bitwise, checkpointed
from test_patches import SMALL_BLOCKS, loss_and_grads, make_batch
from test_patches import lora as lora_on
from tiny_models import tiny_model

NAMED = sorted(name for name, row in families.FAMILIES.items() if row.attention_input_readers)
BUDGET = dict(SMALL_BLOCKS, chunk_budget=4096)  # a small budget: the projections run in chunks on a CPU too


def lora(model, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj")):
    """LoRA on every projection the rows name (test_patches' default leaves k_proj stock)."""
    return lora_on(model, targets=targets)


def resident_and_offloaded(name: str = "llama", **lora_targets) -> tuple:
    """A checkpointed tiny model with LoRA patched without offload, and its copy patched with it (recorders that wrap
    what the patch binds are set before)."""
    model = checkpointed(lora(tiny_model(name), **lora_targets))
    resident = copy.deepcopy(model)
    apply_bpt_patch(resident, **BUDGET)
    apply_bpt_patch(model, **BUDGET, offload_checkpoints=True)
    return resident, model


def _live_in_recompute(monkeypatch, row_changes: dict, module_of) -> list[int]:
    """Bytes live (the simulator's tracker, on CPU tensors) each time a layer's recompute calls `module_of(layer)`,
    with the llama row changed by `row_changes`; once per layer."""
    monkeypatch.setitem(families.FAMILIES, "llama", dataclasses.replace(families.FAMILIES["llama"], **row_changes))
    model = checkpointed(lora(tiny_model("llama", hidden_size=128, intermediate_size=128)))
    apply_bpt_patch(model, **BUDGET, offload_checkpoints=True)
    seen = []
    for layer in model.base_model.model.model.layers:
        module_of(layer).register_forward_pre_hook(
            lambda *_: seen.append(tracker.live) if torch._C._current_graph_task_id() != -1 else None)
    with AllocationTracker() as tracker:
        loss_and_grads(model, make_batch("plain", batch=1, length=256))
    assert len(seen) == model.config.num_hidden_layers  # once per layer, in its recompute
    return seen


HIDDEN, NAN = 256 * 128 * 4, 4  # one [B, N, hidden] fp32 tensor of those steps, and the one NaN left in its place


def _drops(monkeypatch) -> list:
    """Records every attention input and layer input dropped (its storage then one element)."""
    dropped, read, last_reader = [], AttentionInput.read, LayerInput.last_reader_forward

    def recording_read(self, reader, x):
        read(self, reader, x)
        if x.untyped_storage().nbytes() == x.element_size():
            dropped.append("attention input")

    def recording_last_reader(self, original):
        forward = last_reader(self, original)

        def recording(*args, **kwargs):
            x = self._input() if self._input is not None else None
            out = forward(*args, **kwargs)
            if x is not None and x.untyped_storage().nbytes() == x.element_size():
                dropped.append("layer input")
            return out
        return recording

    monkeypatch.setattr(AttentionInput, "read", recording_read)
    monkeypatch.setattr(LayerInput, "last_reader_forward", recording_last_reader)
    return dropped


def test_the_rows_that_name_readers():
    """Sequential pre-norm layers whose attention reads its input by q / k / v alone; a parallel layer (the MLP reads
    the same normed input) names none."""
    assert NAMED == ["gemma", "llama", "mistral", "mixtral", "qwen2", "qwen3"]
    assert all(families.FAMILIES[name].attention_input_readers == ("q_proj", "k_proj", "v_proj") for name in NAMED)
    assert all(families.FAMILIES[name].layer_input_span == ("input_layernorm", "post_attention_layernorm")
               for name in NAMED)
    assert families.FAMILIES["cohere"].attention_input_readers == ()
    assert families.FAMILIES["gemma2"].layer_input_span == ()


@pytest.mark.parametrize("name", NAMED)
def test_dropped_after_its_readers_bitwise_the_run_without_offload(name, monkeypatch):
    dropped = _drops(monkeypatch)
    resident, model = resident_and_offloaded(name)
    inputs = make_batch("packed")
    expected = loss_and_grads(resident, inputs)
    assert not dropped  # without offload the layer input stays on the device: so does the normed input
    got = loss_and_grads(model, inputs)
    layers = model.config.num_hidden_layers
    # the attention's input in each layer's forward and in its recompute, the layer input in its recompute
    assert sorted(dropped) == ["attention input"] * (2 * layers) + ["layer input"] * layers
    assert_bitwise(expected, got)


def test_bf16_autocast_bitwise():
    resident, model = resident_and_offloaded()
    inputs = make_batch("plain")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_bitwise(loss_and_grads(resident, inputs), loss_and_grads(model, inputs))


def test_a_projection_left_stock_keeps_it(monkeypatch):
    """LoRA on q and v only: k_proj reads the input as stock does (and saves it): it is never dropped."""
    dropped = _drops(monkeypatch)
    resident, model = resident_and_offloaded(targets=("q_proj", "v_proj"))
    inputs = make_batch("plain")
    assert_bitwise(loss_and_grads(resident, inputs), loss_and_grads(model, inputs))
    assert "attention input" not in dropped


def test_a_wrong_row_poisons_the_loss_rather_than_passing(monkeypatch):
    """Cohere's MLP reads the attention's normed input too (a parallel layer): a row naming q / k / v there would drop
    it before the MLP reads it, and the step's loss is NaN, not a plausible number."""
    row = dataclasses.replace(families.FAMILIES["cohere"], attention_input_readers=("q_proj", "k_proj", "v_proj"))
    monkeypatch.setitem(families.FAMILIES, "cohere", row)
    model = checkpointed(lora(tiny_model("cohere")))
    apply_bpt_patch(model, **BUDGET, offload_checkpoints=True)
    loss, _ = loss_and_grads(model, make_batch("plain"))
    assert torch.isnan(loss)


def test_a_wrong_layer_row_poisons_the_gradients_rather_than_passing(monkeypatch):
    """Gemma 2 normalises the attention's output before the residual add reads the layer input: a row naming its
    post-attention norm would drop that input too early in the recompute, and the gradients are NaN."""
    row = dataclasses.replace(families.FAMILIES["gemma2"],
                              layer_input_span=("input_layernorm", "post_attention_layernorm"))
    monkeypatch.setitem(families.FAMILIES, "gemma2", row)
    model = checkpointed(lora(tiny_model("gemma2")))
    apply_bpt_patch(model, **BUDGET, offload_checkpoints=True)
    _, grads = loss_and_grads(model, make_batch("plain"))
    assert any(torch.isnan(g).any() for g in grads.values())


def test_the_recompute_holds_one_normed_input_less_at_the_output_projection(monkeypatch):
    """What is live when a layer's recompute reaches its output projection (the recompute's peak at long context) is
    one [B, N, hidden] tensor less."""
    at_o_proj = lambda layer: layer.self_attn.o_proj  # noqa: E731
    dropped = _live_in_recompute(monkeypatch, dict(layer_input_span=()), at_o_proj)
    kept = _live_in_recompute(monkeypatch, dict(layer_input_span=(), attention_input_readers=()), at_o_proj)
    assert all(k - d == HIDDEN - NAN for k, d in zip(kept, dropped)), (kept, dropped)


def test_the_recompute_holds_the_layer_input_no_longer_once_the_residual_add_has_read_it(monkeypatch):
    """What is live when a layer's recompute reaches its MLP (past the post-attention norm) is one [B, N, hidden]
    tensor less: the layer input, which the norm's and projections' backward fetch again from its host copy."""
    at_mlp = lambda layer: layer.mlp  # noqa: E731
    dropped = _live_in_recompute(monkeypatch, {}, at_mlp)
    kept = _live_in_recompute(monkeypatch, dict(layer_input_span=()), at_mlp)
    assert all(k - d == HIDDEN - NAN for k, d in zip(kept, dropped)), (kept, dropped)
