"""apply_bpt_patch(offload_checkpoints=True) (patches/offload.py): the activations a checkpointed model keeps between
forward and backward go to host memory and come back, one layer ahead, with bitwise the same loss and gradients."""
from __future__ import annotations

import contextlib
import copy
import gc
import os

import pytest
import torch

from patches import apply_bpt_patch, offload
from patches.idle_weights import IdleWeights
from test_patches import SMALL_BLOCKS, loss_and_grads, lora, make_batch
from tiny_models import tiny_model

CHECKPOINTING = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}


def checkpointed(model):
    model.gradient_checkpointing_enable(**CHECKPOINTING)
    return model.train()


def assert_bitwise(expected, got):
    (loss, grads), (offloaded_loss, offloaded_grads) = expected, got
    assert torch.equal(loss, offloaded_loss)
    assert grads.keys() == offloaded_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(grad, offloaded_grads[name]), name


class Recorder:
    """Wraps CheckpointOffload's hooks: what was packed (shapes), and the order of unpacks and fetches."""

    def __init__(self, monkeypatch):
        self.packed, self.events = [], []
        pack, unpack, fetch = (offload.CheckpointOffload.pack, offload.CheckpointOffload.unpack,
                               offload.CheckpointOffload._fetch)
        recorder = self

        def recording_pack(self, t):
            out = pack(self, t)
            if isinstance(out, offload._Saved):
                recorder.packed.append(tuple(t.shape))
                assert out.host.device.type == "cpu" and out.host.data_ptr() != t.data_ptr()
            return out

        def recording_unpack(self, packed):
            if isinstance(packed, offload._Saved):
                recorder.events.append(("unpack", packed.index))
            return unpack(self, packed)

        def recording_fetch(self, packed):
            if packed.device is None:
                recorder.events.append(("fetch", packed.index))
            return fetch(self, packed)

        monkeypatch.setattr(offload.CheckpointOffload, "pack", recording_pack)
        monkeypatch.setattr(offload.CheckpointOffload, "unpack", recording_unpack)
        monkeypatch.setattr(offload.CheckpointOffload, "_fetch", recording_fetch)


def assert_offload_bitwise(variant: str, **options):
    """A checkpointed tiny llama (`variant`: plain, lora or bf16_autocast) patched with offload and `options`, and its
    copy patched without: bitwise the same loss and gradients on a packed batch. Returns the offloaded model."""
    model = tiny_model("llama")
    if variant == "lora":
        model = lora(model)
    checkpointed(model)
    resident = copy.deepcopy(model)
    apply_bpt_patch(resident, **SMALL_BLOCKS)
    apply_bpt_patch(model, **SMALL_BLOCKS, offload_checkpoints=True, **options)
    inputs = make_batch("packed")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "bf16_autocast"):
        assert_bitwise(loss_and_grads(resident, inputs), loss_and_grads(model, inputs))
    return model


@pytest.mark.parametrize("variant", ["plain", "lora", "bf16_autocast"])
def test_bitwise_equal_to_no_offload(variant):
    assert_offload_bitwise(variant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_frozen_embedding_output_is_not_kept_on_the_device(reentrant):
    """transformers makes a frozen embedding's output a leaf requiring grad (for reentrant checkpointing); autograd
    would keep that [B, N, hidden] alive on the device until backward. Without reentrancy offload drops it, with
    reentrancy it must stay (the layers' LoRA gradients flow through it); gradients bitwise either way."""
    import weakref

    def build():
        model = lora(tiny_model("llama"))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model.train()

    resident, model = build(), build()
    model.load_state_dict(resident.state_dict())
    apply_bpt_patch(resident, **SMALL_BLOCKS)
    apply_bpt_patch(model, **SMALL_BLOCKS, offload_checkpoints=True)
    inputs = make_batch("plain")
    outputs = []
    model.get_input_embeddings().register_forward_hook(lambda m, i, out: outputs.append(weakref.ref(out)))
    loss = model(**inputs).loss
    assert len(outputs) == 1 and (outputs[0]() is not None) == reentrant
    if outputs[0]() is not None:
        assert outputs[0]().is_leaf and outputs[0]().requires_grad
    del loss
    assert_bitwise(loss_and_grads(resident, inputs), loss_and_grads(model, inputs))


def test_the_embedding_output_points_at_its_host_copy_once_the_first_layer_is_done(monkeypatch):
    """transformers' model forward holds the embedding's output (`inputs_embeds`) to its end, and only the first
    layer reads it, whose checkpoint has its host copy: once that layer's forward is over the tensor points at the
    copy, so its device memory goes back (at the forward's peak it was one more layer input alive). Gradients
    bitwise."""
    import patches.offload as offload

    handed, original = [], offload.CheckpointOffload._hand_over_embedding_output

    def recording(self):
        embedding, packed = self.embedding_output(), self.embedding_packed
        original(self)
        handed.append((embedding, packed.host, packed.index))

    monkeypatch.setattr(offload.CheckpointOffload, "_hand_over_embedding_output", recording)
    resident, model = checkpointed(lora(tiny_model("llama"))), checkpointed(lora(tiny_model("llama")))
    model.load_state_dict(resident.state_dict())
    apply_bpt_patch(resident, **SMALL_BLOCKS)
    apply_bpt_patch(model, **SMALL_BLOCKS, offload_checkpoints=True)
    inputs = make_batch("plain")
    result = loss_and_grads(model, inputs)
    ((embedding, host, index),) = handed
    assert index == 0 and embedding.untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
    assert_bitwise(loss_and_grads(resident, inputs), result)


def test_every_layer_input_goes_to_the_host_and_comes_back_one_ahead(monkeypatch):
    recorder = Recorder(monkeypatch)
    model = checkpointed(tiny_model("llama"))
    # attention recomputed (stock SDPA on a CPU): the kept attention's q, k, v are host copies of their own
    # (bpt.host_copies.spilled, tests/test_spilled_attention.py)
    apply_bpt_patch(model, **SMALL_BLOCKS, offload_checkpoints=True, attention_once=False)
    inputs = make_batch("plain")
    loss_and_grads(model, inputs)
    batch, length = inputs["input_ids"].shape
    layers = model.config.num_hidden_layers
    # every layer's input, then the final norm's and the loss's input: [B, N, hidden] each (the loss's flattened)
    hidden = model.config.hidden_size
    assert recorder.packed[:layers] == [(batch, length, hidden)] * layers and len(recorder.packed) >= layers + 1
    assert set(recorder.packed) <= {(batch, length, hidden), (batch * length, hidden)}
    last = len(recorder.packed) - 1
    # backward: each one back in reverse order; the first is fetched when needed, every other one already while
    # the one after it is unpacked (prefetch one ahead). A layer input comes back once more, after its layer's MLP
    # and attention backward, for its input norm's and projections' backward: saved as the host copy
    # (bpt.host_copies), it is fetched once for all of them.
    expected = [("unpack", last), ("fetch", last)]
    for index in range(last - 1, -1, -1):
        expected += [("fetch", index)] + [("fetch", index + 1)] * (index + 1 < layers) + [("unpack", index)]
    assert recorder.events == expected + [("fetch", 0)]


def test_a_layer_input_over_a_share_of_the_device_is_fetched_when_needed(monkeypatch):
    """Prefetch holds the next layer input beside the layer's working set: over PREFETCH_SHARE of the device it is
    fetched when backward needs it instead (at such lengths the copy is ~1% of the layer's backward)."""
    import patches.offload as offload

    recorder = Recorder(monkeypatch)
    model = checkpointed(tiny_model("llama"))
    apply_bpt_patch(model, **SMALL_BLOCKS, offload_checkpoints=True, attention_once=False)  # (as above)
    inputs = make_batch("plain")
    hidden_bytes = inputs["input_ids"].numel() * model.config.hidden_size * 4
    monkeypatch.setattr(offload, "device_bytes", lambda device: int(hidden_bytes / offload.PREFETCH_SHARE) - 1)
    loss_and_grads(model, inputs)
    last, layers = len(recorder.packed) - 1, model.config.num_hidden_layers
    # a layer input: once for the layer's recompute, once more for its norm's and projections' host copy
    events = [[("unpack", index), ("fetch", index)] + [("fetch", index)] * (index < layers)
              for index in range(last, -1, -1)]
    assert recorder.events == [event for pair in events for event in pair]


def test_patch_before_or_after_checkpointing_and_peft():
    inputs = make_batch("plain")
    reference = checkpointed(lora(tiny_model("llama")))
    apply_bpt_patch(reference, **SMALL_BLOCKS)
    expected = loss_and_grads(reference, inputs)
    patched_first = tiny_model("llama")
    apply_bpt_patch(patched_first, **SMALL_BLOCKS, offload_checkpoints=True)
    patched_first = checkpointed(lora(patched_first))
    assert_bitwise(expected, loss_and_grads(patched_first, inputs))


def test_remove_and_reapply_in_a_notebook():
    model = checkpointed(tiny_model("llama"))
    forward = model.forward
    inputs = make_batch("plain")
    handle = apply_bpt_patch(model, **SMALL_BLOCKS, offload_checkpoints=True)
    first = loss_and_grads(model, inputs)
    assert apply_bpt_patch(model, **SMALL_BLOCKS, offload_checkpoints=True) is handle  # the cell run again
    assert_bitwise(first, loss_and_grads(model, inputs))
    apply_bpt_patch(model, **SMALL_BLOCKS)  # same handle, offload off
    assert_bitwise(first, loss_and_grads(model, inputs))
    handle.remove()
    assert model.forward == forward and "forward" not in vars(model)


def test_without_checkpointing_it_says_what_to_do():
    model = tiny_model("llama").train()
    apply_bpt_patch(model, **SMALL_BLOCKS, offload_checkpoints=True)
    with pytest.raises(RuntimeError, match="call model.gradient_checkpointing_enable()"):
        model(**make_batch("plain"))
    with torch.no_grad():  # evaluation does not need it
        model.eval()
        model(**make_batch("plain"))


def test_bad_option_is_refused():
    with pytest.raises(ValueError, match="offload_checkpoints must be True or False"):
        apply_bpt_patch(tiny_model("llama"), offload_checkpoints="yes")


@contextlib.contextmanager
def deterministic_kernels():
    """FlashAttention's backward sums dq in an order that varies from run to run (measured on an H100) unless torch's
    deterministic mode is on without warn_only: only then do two runs compare bitwise."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.mark.cuda
def test_cuda_offload_pins_host_memory_and_lowers_the_peak():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `python -m pytest -m cuda` on a GPU machine)")
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_batch("plain", length=4096).items()}
    peaks, results = {}, {}
    for offloaded in (False, True):
        model = checkpointed(tiny_model("llama", hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                                        max_position_embeddings=8192)).cuda()
        apply_bpt_patch(model, offload_checkpoints=offloaded)
        model.requires_grad_(False).model.layers[0].mlp.down_proj.weight.requires_grad_(True)  # embeddings frozen
        during = []
        model.model.layers[0].register_full_backward_hook(lambda *_: during.append(model.lm_head.weight))
        gc.collect()  # the last model (patched forwards make reference cycles) must not count in this one's peak
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16), deterministic_kernels():
            results[offloaded] = loss_and_grads(model, inputs)
        peaks[offloaded] = torch.cuda.max_memory_allocated() - before  # what the step adds to the weights
        # with offload the frozen embeddings wait in pinned host memory through the layers' backward, then come back
        assert [w.is_pinned() for w in during] == [offloaded] and model.lm_head.weight.is_cuda
    assert_bitwise(results[False], results[True])
    assert peaks[True] < peaks[False], peaks
    saved = offload.CheckpointOffload(1, 1, (1, 1))
    packed = saved.pack(torch.ones(1, 1, device="cuda"))
    assert packed.host.is_pinned()


@pytest.mark.cuda
def test_cuda_layer_inputs_saved_as_host_copies_are_exact(monkeypatch):
    """Where a layer input is large (here: every one), its input norm and projections save it as its pinned host
    copy, fetched on the side stream after the layer's MLP and attention backward (bpt.host_copies), and (the budget
    splits the attention's backward by head) the recompute spills the attention's q, k, v to pinned memory: bitwise the
    run without offload, with a peak no higher than with those copies kept on the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `python -m pytest -m cuda` on a GPU machine)")
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_batch("plain", length=4096).items()}
    peaks, results = {}, {}
    for case in ("resident", "kept", "host copies"):
        monkeypatch.setattr(offload.CheckpointOffload, "_saved_as_host_copy", lambda self, t: case == "host copies")
        model = checkpointed(lora(tiny_model("llama", hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                                             max_position_embeddings=8192))).cuda()
        apply_bpt_patch(model, offload_checkpoints=case != "resident", chunk_budget=2**20)
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16), deterministic_kernels():
            results[case] = loss_and_grads(model, inputs)
        peaks[case] = torch.cuda.max_memory_allocated() - before
    assert_bitwise(results["resident"], results["kept"])
    assert_bitwise(results["resident"], results["host copies"])
    assert peaks["host copies"] <= peaks["kept"], peaks


class HostStandIn:
    """IdleWeights on a CPU: a clone stands in for the host copy, and CPU weights count as on a device."""

    def __init__(self, monkeypatch):
        self.copies = []
        monkeypatch.setattr(offload, "IdleWeights", lambda model: IdleWeights(model, to_host=self.to_host,
                                                                              devices=("cpu",)))

    def to_host(self, t):
        self.copies.append(t.clone())
        return self.copies[-1]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_frozen_embeddings_wait_on_the_host_through_a_long_backward(monkeypatch, tied):
    """After a training forward whose layer input is at least their size, the frozen embedding and LM head are swapped
    for their host copies until the backward ends, then come back on the device (tied ones tied, their host copies
    reused by the next step); loss and gradients bitwise those of a run without offload."""
    host = HostStandIn(monkeypatch)
    model = checkpointed(lora(tiny_model("llama", tie_word_embeddings=tied)))
    resident = copy.deepcopy(model)
    apply_bpt_patch(resident, **SMALL_BLOCKS)
    apply_bpt_patch(model, **SMALL_BLOCKS, offload_checkpoints=True)
    inputs = make_batch("plain", length=100)  # 2 x 100 tokens: a layer input of 25.6 KB against 24.8 KB of weights
    weights = lambda: (model.get_input_embeddings().weight, model.get_output_embeddings().weight)  # noqa: E731
    before = weights()
    seen = []
    first_layer = model.get_base_model().model.layers[0]
    first_layer.register_full_backward_hook(lambda *_: seen.append(weights()))  # the last layer backward runs
    for _ in range(2):
        expected = loss_and_grads(resident, inputs)
        assert_bitwise(expected, loss_and_grads(model, inputs))
        during, after = seen[-1], weights()
        assert all(w.data_ptr() == c.data_ptr() for w, c in zip(during, host.copies[-1 if tied else -2:] * 2))
        assert all(w.device.type == "cpu" and not w.requires_grad for w in after)
        assert all(w is not d for w, d in zip(after, during))
        assert (after[0] is after[1]) == tied and (during[0] is during[1]) == tied
        assert all(torch.equal(w, b) for w, b in zip(after, before))
    assert len(host.copies) == (1 if tied else 2)  # made once per weight


def test_short_steps_and_trained_embeddings_keep_their_weights(monkeypatch):
    """Where one layer input is smaller than the weights, or the weights are trained, nothing moves."""
    host = HostStandIn(monkeypatch)
    model = checkpointed(tiny_model("llama"))
    apply_bpt_patch(model, **SMALL_BLOCKS, offload_checkpoints=True)
    loss_and_grads(model, make_batch("plain", length=100))  # every weight trains: nothing frozen
    model.requires_grad_(False).model.layers[0].mlp.down_proj.weight.requires_grad_(True)
    loss_and_grads(model, make_batch("plain", length=45))  # 11.5 KB layer input, 24.8 KB of weights
    assert host.copies == []
    loss = model(**make_batch("plain", length=100)).loss  # long enough: away until a backward or the next forward
    away = model.lm_head.weight
    assert away.data_ptr() == host.copies[-1].data_ptr()
    del loss
    with torch.no_grad():
        model.eval()(**make_batch("plain"))
    assert model.lm_head.weight is not away and not model.lm_head.weight.requires_grad


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16_autocast"])
def test_hf_trainer_with_the_embeddings_moving_trains_as_without_offload(monkeypatch, tmp_path, bf16):
    """HF Trainer (LoRA, checkpointing, 3 steps of 2 x 100 tokens, then evaluate): with offload and the frozen embeddings
    moving every step, the logged losses and the eval loss are those of the run without offload."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    host = HostStandIn(monkeypatch)
    rows = Dataset.from_list([{key: value[0].tolist() for key, value in make_batch("plain", batch=1, length=100,
                                                                                 seed=seed).items()
                               if isinstance(value, torch.Tensor)} for seed in range(6)])
    results = {}
    for offloaded in (False, True):
        model = get_peft_model(tiny_model("llama"), LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj",
                                                                                                      "down_proj"]))
        apply_bpt_patch(model, **SMALL_BLOCKS, offload_checkpoints=offloaded)
        args = TrainingArguments(output_dir=str(tmp_path / str(offloaded)), use_cpu=True, bf16=bf16,
                                 gradient_checkpointing=True, gradient_checkpointing_kwargs=CHECKPOINTING[
                                     "gradient_checkpointing_kwargs"], per_device_train_batch_size=2,
                                 per_device_eval_batch_size=2, max_steps=3, learning_rate=1e-2, logging_steps=1,
                                 save_strategy="no", report_to=[], seed=0, data_seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows.select(range(2)))
        trainer.train()
        results[offloaded] = ([row["loss"] for row in trainer.state.log_history if "loss" in row],
                              trainer.evaluate()["eval_loss"])
    assert len(host.copies) == 2 and len(results[True][0]) == 3  # the weights moved (their host copies made once)
    assert results[True] == results[False]
