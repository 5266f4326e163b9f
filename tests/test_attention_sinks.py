"""Attention sinks (gpt-oss `s_aux`): blockwise attention against a float64 softmax over [scores, sink]."""
from __future__ import annotations

import pytest
import torch

from bpt import attention
from bpt.attention import blockwise_attention, segment_ids_from_position_ids
from test_attention import assert_close, lengths_mask, make_qkv, packed_position_ids, reference_visibility

TOL = 1e-5


@pytest.fixture(autouse=True)
def blockwise_only(monkeypatch):
    monkeypatch.setattr(attention, "_sdpa_handles", lambda *args: False)


def reference(q, k, v, sinks, *, scale=None, causal=True, padding_mask=None, segment_ids=None,
              sliding_window=None):
    """Float64 attention whose softmax runs over [scores, sink] and drops the sink's column (as stock)."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    groups = hq // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (d ** -0.5 if scale is None else scale) * q @ k.transpose(-1, -2)  # [B, Hq, Nq, Nk]
    visible, _ = reference_visibility(b, nq, nk, causal, sliding_window, padding_mask, segment_ids)
    s = s.masked_fill(~visible, float("-inf"))
    sink = sinks[None, :, None, None].expand(b, hq, nq, 1)
    p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]  # [B, Hq, Nq, Nk]
    return p @ v, visible.any(-1).expand(b, hq, nq)


def make_sinks(hq, dtype=torch.float32, seed=3):
    return (torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype).requires_grad_()


def check(q, k, v, sinks, tol=TOL, q_block=32, kv_block=48, **options):
    out = blockwise_attention(q, k, v, sinks=sinks, q_block=q_block, kv_block=kv_block, **options)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[-1])
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref, rows = reference(*leaves64, **options)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v, sinks), grad.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, leaves64, grad.double())
    assert_close(out, ref, tol, "output")  # every row, hidden ones included: 0
    grad_scale = max(rg.abs().max().item() for rg in ref_grads[:3])
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, tol, f"d{name}", scale=grad_scale)
    assert grads[3].dtype == sinks.dtype
    assert_close(grads[3], ref_grads[3], tol, "dsinks")
    hidden = ~rows
    assert torch.equal(out[hidden], torch.zeros_like(out[hidden])), "rows with no visible key must be 0"
    assert torch.equal(grads[0][hidden], torch.zeros_like(grads[0][hidden])), "and get zero dq"
    return out, rows


@pytest.mark.parametrize("q_block,kv_block", [(32, 48), (13, 11), (256, 1000)])
def test_sinks_causal_odd_length(q_block, kv_block):
    q, k, v = make_qkv(nq=127)
    check(q, k, v, make_sinks(2), q_block=q_block, kv_block=kv_block)


@pytest.mark.parametrize("hkv", [2, 1], ids=["gqa", "mqa"])
def test_sinks_grouped_query_heads(hkv):
    q, k, v = make_qkv(b=2, hq=8, hkv=hkv, nq=45, d=8)
    check(q, k, v, make_sinks(8), q_block=16, kv_block=16)


@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
def test_sinks_padding(left):
    mask = lengths_mask([127, 60, 9], 127, left)
    q, k, v = make_qkv(b=3, hq=4, hkv=2)
    out, rows = check(q, k, v, make_sinks(4), padding_mask=mask)
    if left:  # rows that see no key attend only to the sink
        assert not rows[1, :, :67].any()


@pytest.mark.parametrize("window", [1, 5, 33])
def test_sinks_sliding_window(window):
    q, k, v = make_qkv(b=2, hq=4, hkv=2, nq=100)
    check(q, k, v, make_sinks(4), sliding_window=window, q_block=16, kv_block=24)


def test_sinks_packed_window_padding_non_causal_cross():
    q, k, v = make_qkv(b=2, hq=6, hkv=2, nq=90, d=8, dv=12, std=2.0)
    mask = lengths_mask([90, 71], 90, left=True)
    seg = segment_ids_from_position_ids(packed_position_ids([[30, 60], [40, 25, 25]]))
    check(q, k, v, make_sinks(6), padding_mask=mask, segment_ids=seg, sliding_window=21, scale=0.2,
          q_block=16, kv_block=24)
    check(*make_qkv(nq=50, nk=77, dv=8), make_sinks(2), causal=False)


def test_sinks_large_and_small():
    # A sink far above every score (output ~ 0) and far below (no effect); lse stays finite.
    q, k, v = make_qkv(b=1, hq=2, hkv=1, nq=40)
    check(q, k, v, torch.tensor([60.0, -60.0]).requires_grad_(), q_block=16, kv_block=16)


def test_sinks_gradcheck_float64():
    q, k, v = make_qkv(b=2, hq=4, hkv=2, nq=9, d=4, dtype=torch.float64)
    sinks = make_sinks(4, torch.float64)
    mask = torch.tensor([[False, False, True, True, True, True, True, True, True], [True] * 9])

    def fn(q, k, v, sinks):
        return blockwise_attention(q, k, v, sinks=sinks, padding_mask=mask, sliding_window=5, q_block=4, kv_block=3)

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_sinks_low_precision_runs_in_fp32():
    q, k, v = make_qkv(b=1, hq=4, hkv=2, nq=64, dtype=torch.bfloat16)
    sinks = make_sinks(4)  # fp32 sinks next to bf16 q/k/v, as gpt-oss keeps them
    out = blockwise_attention(q, k, v, sinks=sinks, q_block=16, kv_block=16)
    ref, _ = reference(q, k, v, sinks)
    assert out.dtype == torch.bfloat16
    assert_close(out, ref, 2e-2, "bf16 output")
    out.float().sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.float32


def test_sinks_force_blockwise_path(monkeypatch):
    monkeypatch.setattr(attention, "_sdpa_handles", lambda *args: True)
    monkeypatch.setattr(attention, "_sdpa", lambda *args: pytest.fail("SDPA has no sinks"))
    q, k, v = make_qkv(nq=20)
    blockwise_attention(q, k, v, sinks=make_sinks(2))


@pytest.mark.parametrize("sinks,match", [
    (torch.zeros(3), r"sinks must be a \[q_heads\]"),
    (torch.zeros(4, dtype=torch.long), "sinks must be floating point"),
])
def test_sinks_invalid(sinks, match):
    with pytest.raises(ValueError, match=match):
        blockwise_attention(torch.zeros(1, 4, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), sinks=sinks)
