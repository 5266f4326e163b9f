"""BPTConfig offload_keep_last (patches/offload.py): the last k tensors checkpoint offload saves stay on the device
(the first the backward needs), every earlier one goes to the host; bitwise the gradients of the run without offload,
whatever k."""
from __future__ import annotations

import pytest
import torch

from patches import apply_bpt_patch, offload
from test_offload import assert_bitwise, assert_offload_bitwise, checkpointed
from test_patches import loss_and_grads, lora, make_batch
from tiny_models import tiny_model


class Sent:
    """Per forward of CheckpointOffload: how many tensors were saved, and which went to the host by its end."""

    def __init__(self, monkeypatch):
        self.offloads = []
        init = offload.CheckpointOffload.__init__
        recorder = self

        def recording_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            recorder.offloads.append(self)

        monkeypatch.setattr(offload.CheckpointOffload, "__init__", recording_init)
        self.at_backward = []
        unpack = offload.CheckpointOffload.unpack

        def recording_unpack(self, packed):
            if not recorder.at_backward:  # the forward is over: what is on the host, what stayed
                recorder.at_backward = [p.host is not None for p in self.saved]
            return unpack(self, packed)

        monkeypatch.setattr(offload.CheckpointOffload, "unpack", recording_unpack)


@pytest.mark.parametrize("variant,keep", [("plain", 1), ("lora", 3), ("bf16_autocast", 2), ("lora", 99)])
def test_the_last_saved_stay_and_the_gradients_are_bitwise(monkeypatch, variant, keep):
    sent = Sent(monkeypatch)
    model = assert_offload_bitwise(variant, offload_keep_last=keep)
    saved = len(sent.at_backward)
    assert saved >= model.config.num_hidden_layers + 1  # every layer's input, the final norm's (and the loss's)
    kept = min(keep, saved)
    assert sent.at_backward == [True] * (saved - kept) + [False] * kept


def test_keeping_needs_offload_and_a_count():
    with pytest.raises(ValueError, match="needs offload_checkpoints=True"):
        apply_bpt_patch(tiny_model("llama"), offload_keep_last=2)
    with pytest.raises(ValueError, match="offload_keep_last must be an integer >= 0"):
        apply_bpt_patch(tiny_model("llama"), offload_checkpoints=True, offload_keep_last=-1)


@pytest.mark.cuda
def test_cuda_kept_tensors_are_exact_and_hold_less_host_memory():
    """On a GPU (side stream, pinned buffers): keeping the last 3 on the device gives bitwise the gradients of sending
    every one, pins 3 fewer tensors, and holds them on the device instead (a higher peak)."""
    from test_offload import deterministic_kernels

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `python -m pytest -m cuda` on a GPU machine)")
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_batch("plain", length=4096).items()}
    results, pinned, peaks = {}, {}, {}
    for keep in (0, 3):
        torch.manual_seed(0)
        model = checkpointed(lora(tiny_model("llama", hidden_size=1024, intermediate_size=2048, num_hidden_layers=6,
                                             max_position_embeddings=8192))).cuda()
        apply_bpt_patch(model, offload_checkpoints=True, offload_keep_last=keep)
        sent = []
        original = offload.CheckpointOffload._to_host
        offload.CheckpointOffload._to_host = lambda self, t: sent.append(original(self, t)) or sent[-1]
        try:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16), deterministic_kernels():
                results[keep] = loss_and_grads(model, inputs)
            peaks[keep] = torch.cuda.max_memory_allocated() - before
        finally:
            offload.CheckpointOffload._to_host = original
        pinned[keep] = sum(t.is_pinned() for t in sent)
    assert_bitwise(results[0], results[3])
    assert pinned[0] - pinned[3] == 3 and peaks[3] > peaks[0], (pinned, peaks)
