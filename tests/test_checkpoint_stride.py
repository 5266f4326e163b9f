"""apply_bpt_patch(checkpoint_stride=k) (patches/checkpoint_stride.py): one decoder layer's checkpointed input kept in
k, the others remade in backward from the one kept before them, with bitwise the loss and gradients of the run that
keeps every one; dropout included (the remade forward draws what the first one drew)."""
from __future__ import annotations

import copy

import pytest
import torch

from patches import apply_bpt_patch, checkpoint_stride
from test_offload import CHECKPOINTING, assert_bitwise, checkpointed
from test_patches import SMALL_BLOCKS, loss_and_grads, make_batch
from tiny_models import tiny_model

LAYERS = 5


@pytest.fixture
def remade(monkeypatch):
    """How many layer forwards the backward ran again to remake inputs that were not kept."""
    runs = []
    real = checkpoint_stride._Call.run

    def counting(self):
        runs.append(self.layer)
        return real(self)

    monkeypatch.setattr(checkpoint_stride._Call, "run", counting)
    return runs


def build(precision: str = "fp32", dropout: float = 0.0, layers: int = LAYERS, **sizes):
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama", num_hidden_layers=layers, **sizes)
    if precision == "bf16_weights":
        model = model.to(torch.bfloat16)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                                             target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]))
    return checkpointed(model)


def step(model, inputs, precision: str):
    torch.manual_seed(7)  # the dropout masks of the step
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16_autocast"):
        return loss_and_grads(model, inputs)


def remade_forwards(layers: int, stride: int) -> int:
    """Layer i's output (i = 1..layers; the last one the final norm's input) is kept where i is a multiple of the
    stride, else remade by running the i % stride layers since the last kept one."""
    return sum(i % stride for i in range(1, layers + 1))


@pytest.mark.parametrize("stride", [2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16_autocast", "bf16_weights"])
def test_bitwise_the_run_that_keeps_every_checkpoint(stride, precision, remade):
    inputs = make_batch("packed")
    every = build(precision, dropout=0.1)
    strided = copy.deepcopy(every)
    apply_bpt_patch(every, **SMALL_BLOCKS)
    apply_bpt_patch(strided, **SMALL_BLOCKS, checkpoint_stride=stride)
    expected = step(every, inputs, precision)
    assert not remade
    assert_bitwise(expected, step(strided, inputs, precision))
    assert len(remade) == remade_forwards(LAYERS, stride)


def test_what_is_kept_and_what_is_remade(monkeypatch):
    """Of the hidden states the checkpoints save, a stride of 2 keeps h0 (the embeddings'), h2 and h4 and saves the
    calls that make h1, h3, h5 instead; nothing else is touched."""
    packed = []
    real = checkpoint_stride.StridedCheckpoints.pack

    def recording(self, t):
        out = real(self, t)
        packed.append(type(out).__name__)
        return out

    monkeypatch.setattr(checkpoint_stride.StridedCheckpoints, "pack", recording)
    model = build()
    apply_bpt_patch(model, **SMALL_BLOCKS, checkpoint_stride=2)
    loss_and_grads(model, make_batch("plain"))
    assert packed.count("_Call") == 3 and packed.count("Tensor") >= LAYERS + 1 - 3


def test_eval_and_no_grad_run_as_without(remade):
    model = build()
    apply_bpt_patch(model, **SMALL_BLOCKS, checkpoint_stride=2)
    inputs = make_batch("plain")
    with torch.no_grad():
        expected = model(**inputs).loss
        model.eval()
        assert torch.equal(model(**inputs).loss, expected)
    assert not remade


def test_without_checkpointing_or_with_reentrancy_it_says_what_to_do():
    model = tiny_model("llama").train()
    apply_bpt_patch(model, **SMALL_BLOCKS, checkpoint_stride=2)
    with pytest.raises(RuntimeError, match=r"call model.gradient_checkpointing_enable\(\)"):
        model(**make_batch("plain"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(RuntimeError, match="needs torch's non-reentrant checkpoint"):
        model(**make_batch("plain"))


def test_sharded_weights_are_refused():
    """A remade forward runs outside the layer's hooks, where FSDP and ZeRO-3 gather its weights."""
    model = build()
    apply_bpt_patch(model, **SMALL_BLOCKS, checkpoint_stride=2)
    weight = next(checkpoint_stride.checkpointed_layers(model)[0].parameters())
    weight.ds_id = 0  # as DeepSpeed ZeRO-3 marks its partitioned parameters
    with pytest.raises(RuntimeError, match="use offload_checkpoints=True with them"):
        model(**make_batch("plain"))


@pytest.mark.parametrize("options, message", [
    ({"checkpoint_stride": 0}, "checkpoint_stride must be an integer >= 1"),
    ({"checkpoint_stride": True}, "checkpoint_stride must be an integer >= 1"),
    ({"checkpoint_stride": 2, "offload_checkpoints": True}, "choose one"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        apply_bpt_patch(tiny_model("llama"), **options)


def test_notebook_cells_again_then_removed(remade):
    model = checkpointed(tiny_model("llama", num_hidden_layers=3))
    forward = model.forward
    inputs = make_batch("plain")
    expected = loss_and_grads(model, inputs)  # stock, every checkpoint kept
    handle = apply_bpt_patch(model, checkpoint_stride=2)
    patched = loss_and_grads(model, inputs)
    assert apply_bpt_patch(model, checkpoint_stride=2) is handle  # the cell run again
    assert_bitwise(patched, loss_and_grads(model, inputs))
    assert len(remade) == 2 * remade_forwards(3, 2)
    handle.remove()
    assert model.forward == forward and "forward" not in vars(model)
    assert_bitwise(expected, loss_and_grads(model, inputs))
    model.gradient_checkpointing_enable(**CHECKPOINTING)
    assert all(layer.gradient_checkpointing for layer in checkpoint_stride.checkpointed_layers(model))


def test_hf_trainer_trains_as_with_every_checkpoint(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    rows = make_batch("plain", batch=4)
    data = Dataset.from_dict({"input_ids": rows["input_ids"].tolist(), "labels": rows["labels"].tolist()})
    losses = {}
    for stride in (1, 2):
        model = build(dropout=0.1)
        apply_bpt_patch(model, **SMALL_BLOCKS, checkpoint_stride=stride)
        args = TrainingArguments(output_dir=str(tmp_path / str(stride)), per_device_train_batch_size=2, max_steps=2,
                                 logging_steps=1, report_to=[], seed=3, save_strategy="no", use_cpu=True,
                                 gradient_checkpointing=True,
                                 gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        losses[stride] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses[1]) == 2 and losses[2] == losses[1]


@pytest.mark.cuda
def test_cuda_stride_two_is_bitwise_and_lowers_the_peak(remade):
    """On a GPU with flash attention's deterministic backward: bitwise the same loss and gradients, with LoRA dropout
    (the device's RNG state restored), and a lower peak (8 layers: three layer inputs fewer at the last backward)."""
    import gc

    from test_offload import deterministic_kernels

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `python -m pytest -m cuda` on a GPU machine)")
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_batch("plain", length=4096).items()}
    peaks, results = {}, {}
    for stride in (1, 2):
        model = build(dropout=0.1, layers=8, hidden_size=1024, intermediate_size=2048,
                      max_position_embeddings=8192).cuda()
        apply_bpt_patch(model, checkpoint_stride=stride)
        gc.collect()  # the last model (patched forwards make reference cycles) must not count in this one's peak
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(0)
        with torch.autocast("cuda", dtype=torch.bfloat16), deterministic_kernels():
            results[stride] = loss_and_grads(model, inputs)
        peaks[stride] = torch.cuda.max_memory_allocated() - before
    assert_bitwise(results[1], results[2])
    assert len(remade) == 4
    one = 2 * 4096 * 1024 * 4  # an fp32 layer input of the batch (fp32 weights under autocast)
    assert peaks[2] <= peaks[1] - 3 * one, peaks
