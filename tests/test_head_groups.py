"""The fused attention's backward in groups of key / value heads (bpt.head_groups): the same gradients as one
backward over every head (bitwise on the CPU's flash kernel, the one stock SDPA runs there), the group count from
the chunk budget, a patched model's step still stock's, and on the simulated H100 a smaller backward workspace."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_offload import checkpointed
from test_patches import SMALL_BLOCKS, assert_grads_close, loss_and_grads, make_batch
from tiny_models import tiny_model

import bpt.head_groups as head_groups
from bpt.attention import blockwise_attention
from bpt.config import BPTConfig
from bpt.head_groups import head_groups_for, flash_backward_bytes
from patches import apply_bpt_patch

CPU = torch.device("cpu")


def _attention_and_grads(q, k, v, groups):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = blockwise_attention(q, k, v, causal=True, head_groups=None if groups is None else lambda: groups)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (8, 2)])
def test_grouped_backward_is_the_whole_backward_bitwise(dtype, heads):
    hq, hkv = heads
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 96, 32, dtype=dtype) for h in (hq, hkv, hkv))
    whole = _attention_and_grads(q, k, v, None)  # stock's path: SDPA
    assert torch.equal(_attention_and_grads(q, k, v, 1)[1], whole[1])  # torch's flash kernel, one backward
    stock_q, stock_k, stock_v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    stock = F.scaled_dot_product_attention(stock_q, stock_k, stock_v, is_causal=True, enable_gqa=hq != hkv)
    torch.testing.assert_close(whole[0], stock.detach(), rtol=0, atol=0)
    for groups in {2, hkv}:
        grouped = _attention_and_grads(q, k, v, groups)
        for a, b in zip(whole, grouped):
            assert torch.equal(a, b), groups


def _grads_split_by_query_heads(dtype, hq, hkv, groups, seed=0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, h, 96, 32, dtype=dtype) for h in (hq, hkv, hkv))
    whole, grouped = _attention_and_grads(q, k, v, None), _attention_and_grads(q, k, v, groups)
    assert torch.equal(whole[0], grouped[0]) and torch.equal(whole[1], grouped[1])  # out, dq: bitwise
    return q, k, v, whole, grouped


@pytest.mark.parametrize("heads,groups", [((8, 4), 8), ((8, 2), 4), ((8, 1), 2), ((8, 1), 8), ((4, 1), 4)])
def test_query_head_groups_give_the_whole_backward_in_fp32(heads, groups):
    """More groups than key / value heads split each one's query heads: out and dq bitwise, dk / dv (summed over
    the calls in fp32) within 1e-6 of the largest gradient."""
    *_, whole, grouped = _grads_split_by_query_heads(torch.float32, *heads, groups)
    for name, a, b in zip(("dk", "dv"), whole[2:], grouped[2:]):
        assert (a - b).abs().max() <= 1e-6 * a.abs().max(), name


@pytest.mark.parametrize("heads", [(8, 1), (4, 1), (8, 2), (32, 8)])
@pytest.mark.parametrize("seed", [0, 1])
def test_one_query_head_at_a_time_is_no_further_from_fp64_in_bf16(heads, seed):
    """What a split runs (one query head per call; a Ulysses rank's single key / value head among them): each call's
    dk / dv rounded once, summed in fp32; no further from the fp64 gradients than one backward over every head (norm
    of the error)."""
    q, k, v, whole, grouped = _grads_split_by_query_heads(torch.bfloat16, *heads, heads[0], seed)
    exact = _attention_and_grads(q.double(), k.double(), v.double(), None)
    for name, a, b, ref in zip(("dk", "dv"), whole[2:], grouped[2:], exact[2:]):
        assert (b.double() - ref).norm() <= (a.double() - ref).norm(), name


def test_grouped_path_runs_only_in_training_without_dropout(monkeypatch):
    calls = []
    original = head_groups._HeadGroupedAttention.apply
    monkeypatch.setattr(head_groups._HeadGroupedAttention, "apply", lambda *a: (calls.append(1), original(*a))[1])
    q, k, v = (torch.randn(1, h, 32, 16) for h in (4, 2, 2))
    blockwise_attention(q, k, v, head_groups=lambda: 2)  # no gradient wanted: whole SDPA
    assert calls == []
    blockwise_attention(q.requires_grad_(), k, v, head_groups=lambda: 2)
    assert calls == [1]
    blockwise_attention(q, k, v, head_groups=lambda: 2, dropout=0.1)  # SDPA's own dropout
    assert calls == [1]


def test_group_count_from_the_budget():
    assert head_groups_for(32, 8, 800, 1000) == 1
    assert head_groups_for(32, 8, 800, 300) == 32  # over the budget: one query head at a time
    assert head_groups_for(32, 8, 800, 0) == 32
    assert head_groups_for(4, 1, 800, 300) == 4
    q, k = torch.zeros(1, 32, 1000, 128, dtype=torch.bfloat16), torch.zeros(1, 8, 1000, 128, dtype=torch.bfloat16)
    # softmax_d + the fp32 dq accumulator + dk / dv at 32 heads (the simulated tracker's formula)
    assert flash_backward_bytes(q, k) == 32 * 1024 * 4 + 1024 * 32 * 128 * 4 + 2 * 1000 * 32 * 128 * 2

    assert BPTConfig().attention_head_groups(32, 8, 800, CPU) is None  # auto: no budget off CUDA
    assert BPTConfig(chunk_budget=0).attention_head_groups(32, 8, 800, CPU) is None
    assert BPTConfig(chunk_budget=800).attention_head_groups(32, 8, 800, CPU) is None  # fits: stock's SDPA
    assert BPTConfig(chunk_budget=300).attention_head_groups(32, 8, 800, CPU)() == 32


@pytest.mark.parametrize("checkpointing", [False, True])
def test_patched_model_with_grouped_backward_is_stock(checkpointing, monkeypatch):
    calls = []
    original = head_groups._HeadGroupedAttention.apply
    monkeypatch.setattr(head_groups._HeadGroupedAttention, "apply", lambda *a: (calls.append(a[5]()), original(*a))[1])
    stock = tiny_model("llama")
    patched = copy.deepcopy(stock)
    apply_bpt_patch(patched, **SMALL_BLOCKS, chunk_budget=1)  # nothing spare: one query head at a time
    inputs = make_batch("unpadded")
    stock_loss, stock_grads, patched_loss, patched_grads = (
        value for model in (stock, patched) for value in loss_and_grads(checkpointed(model) if checkpointing else model,
                                                                         inputs))
    assert calls and set(calls) == {stock.config.num_attention_heads}, calls
    torch.testing.assert_close(patched_loss, stock_loss)
    assert_grads_close(patched_grads, stock_grads)


@pytest.mark.parametrize("heads,groups", [((8, 4), 4), ((8, 4), 8), ((4, 1), 4)])
def test_grouped_backward_holds_one_group_at_a_time(heads, groups):
    """Inside the grouped backward: the gradients it returns and one group's parts (its dq, dk, dv and logsumexp
    slice), never two groups' at once (counted by the tracker on real CPU tensors)."""
    from bpt.gpusim.tracker import AllocationTracker

    (hq, hkv), n, d = heads, 512, 32
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, requires_grad=True) for h in (hq, hkv, hkv))
    out = blockwise_attention(q, k, v, causal=True, head_groups=lambda: groups)
    grad = torch.randn_like(out)
    tracker = AllocationTracker(top=0)
    tracker.track(grad, *out.grad_fn.saved_tensors)  # q, k, v, out, logsumexp: held before the backward
    before = tracker.live
    with tracker:
        out.backward(grad)
    returned = (hq + 2 * hkv) * n * d * 4
    per_group_q, per_group_kv = hq // groups, max(1, hkv // groups)
    one_group = (per_group_q + 2 * per_group_kv) * n * d * 4 + per_group_q * n * 4
    summed = 2 * n * d * 4 if groups > hkv else 0  # a key / value head's fp32 dk / dv, summed over its query heads
    assert tracker.peak - before <= returned + one_group + summed, (tracker.peak - before, returned, one_group, summed)



def test_simulated_workspace_counts_the_kernels_copies_of_head_slices():
    """aten's flash backward makes the output and its gradient contiguous in [B, N, H, D]: a slice of some heads of
    such a tensor (a group's, in the grouped backward) is copied inside the op, so the simulation counts it there."""
    from bpt.gpusim.tracker import allocated_bytes, flash_backward_workspace

    backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    b, h, n, d = 1, 8, 1024, 128
    bnhd = lambda: torch.empty(b, n, h, d, dtype=torch.bfloat16, device="meta").transpose(1, 2)  # noqa: E731
    q, k, out, dout = bnhd(), bnhd(), bnhd(), bnhd()
    laid_out = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731  as the kernel reads it

    def copies(heads):
        args = lambda o, do: (do, q[:, :heads], k[:, :heads], None, o)  # noqa: E731
        return flash_backward_workspace(backward, args(out[:, :heads], dout[:, :heads])) - flash_backward_workspace(
            backward, args(laid_out(out[:, :heads]), laid_out(dout[:, :heads])))

    assert copies(h) == 0  # every head: already [B, N, H, D]
    assert copies(4) == 2 * allocated_bytes(b * 4 * n * d * 2, out.device)
    assert copies(1) == 2 * allocated_bytes(b * n * d * 2, out.device)
