"""bpt.host_copies.spilled under checkpoint offload: in a layer's recompute the head-grouped attention (bpt.head_groups)
saves q, k and v as stand-ins whose host copies its backward fetches, and the fetched copies take dq, dk and dv; the
loss and gradients bitwise those of the run without offload, the three tensors off the device from the attention
to its backward."""
from __future__ import annotations

import weakref

import pytest
import torch

from bpt import head_groups, host_copies
from patches import apply_bpt_patch
from test_offload import assert_bitwise, checkpointed
from test_patches import loss_and_grads, make_batch
from test_spent_input import BUDGET, lora, resident_and_offloaded
from tiny_models import tiny_model


class _Offload:
    """What `spilled` asks of an offload: a host copy whose every fetch is a new tensor (recorded)."""

    def __init__(self):
        self.fetched = []

    def to_host(self, t):
        host = t.to("cpu", copy=True)
        return host_copies.HostCopy(lambda: self.fetched.append(host.clone()) or self.fetched[-1])


@pytest.fixture
def offload():
    spilling = _Offload()
    host_copies.spill_to(spilling)
    yield spilling
    host_copies.spill_to(None)


def test_a_stand_in_keeps_what_a_checkpoint_checks_and_fetches_the_values(offload):
    t = torch.randn(2, 4, 16, 8, dtype=torch.bfloat16).transpose(1, 2)
    stand_in = host_copies.spilled(t)
    assert (stand_in.shape, stand_in.dtype, stand_in.device) == (t.shape, t.dtype, t.device)
    assert stand_in.untyped_storage().nbytes() == t.element_size() and stand_in.isnan().all()
    back, own = host_copies.unspilled(stand_in)
    assert own and torch.equal(back, t) and back.stride() == t.stride() and back.data_ptr() != t.data_ptr()
    assert host_copies.unspilled(t) == (t, False)  # a tensor no stand-in: itself, not the caller's
    host_copies.spill_to(None)
    assert host_copies.spilled(t) is t


@pytest.mark.parametrize("heads,groups", [((8, 8), 1), ((8, 2), 2), ((8, 2), 8), ((4, 1), 4)])
def test_the_fetched_copies_take_the_gradients_bitwise(offload, heads, groups):
    """The grouped backward fed the host copies returns the gradients of the one fed q, k, v themselves, in the
    fetched copies' memory: no dq / dk / dv of its own."""
    hq, hkv = heads
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 64, 16, requires_grad=True) for h in (hq, hkv, hkv))
    dout = torch.randn(1, hq, 64, 16)
    results = {}
    for spill in (False, True):
        host_copies.spill_to(offload if spill else None)
        out = head_groups.head_grouped_attention(q, k, v, scale=0.25, is_causal=True, groups=lambda: groups)
        results[spill] = out, *torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(results[False], results[True]))
    assert [g.data_ptr() for g in results[True][1:]] == [t.data_ptr() for t in offload.fetched]


def _spills(monkeypatch) -> list:
    """Each tensor a backward fetched back for the attention (unspilled, the caller's own)."""
    fetched, unspilled = [], host_copies.unspilled

    def recording(t):
        back, own = unspilled(t)
        if own:
            fetched.append(tuple(back.shape))
        return back, own
    monkeypatch.setattr(host_copies, "unspilled", recording)
    return fetched


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma"])
def test_a_recompute_spills_q_k_v_bitwise_the_run_without_offload(name, monkeypatch):
    fetched = _spills(monkeypatch)
    resident, model = resident_and_offloaded(name)
    inputs = make_batch("plain")  # (packed documents take the blockwise path on a CPU)
    expected = loss_and_grads(resident, inputs)
    assert not fetched  # without offload nothing spills
    got = loss_and_grads(model, inputs)
    assert len(fetched) == 3 * model.config.num_hidden_layers  # q, k, v in each layer's recompute
    assert_bitwise(expected, got)
    assert host_copies.spilled(torch.ones(2)).numel() == 2 and not host_copies.spilled(torch.ones(2)).isnan().any()


def test_bf16_autocast_bitwise(monkeypatch):
    fetched = _spills(monkeypatch)
    resident, model = resident_and_offloaded()
    inputs = make_batch("plain")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_bitwise(loss_and_grads(resident, inputs), loss_and_grads(model, inputs))
    assert fetched


@pytest.mark.parametrize("spill", [True, False])
def test_the_recompute_holds_q_k_v_no_longer_after_the_attention(spill, monkeypatch):
    """When a layer's recompute reaches its MLP, the q, k and v its attention saved are gone from the device (their
    storage freed); kept as saved tensors (no spill), they are still there."""
    saved, spilled = [], host_copies.spilled

    def recording(t):
        if torch._C._current_graph_task_id() != -1:  # in a recompute
            saved.append(weakref.ref(t.untyped_storage()))
        return spilled(t) if spill else t
    monkeypatch.setattr(host_copies, "spilled", recording)
    model = checkpointed(lora(tiny_model("llama")))
    apply_bpt_patch(model, **BUDGET, offload_checkpoints=True)
    alive = []
    for layer in model.base_model.model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda *_: alive.append([ref() is not None for ref in saved[-3:]])
                                            if torch._C._current_graph_task_id() != -1 else None)
    loss_and_grads(model, make_batch("plain"))
    assert len(alive) == model.config.num_hidden_layers and len(saved) == 3 * len(alive)
    assert alive == [[not spill] * 3] * len(alive)
