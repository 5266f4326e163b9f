"""Attention dropout in the blockwise kernel: stock semantics (dropout on the softmax probabilities,
survivors scaled by 1 / (1 - p)), masks replayed exactly in backward, and models trained with it."""
from __future__ import annotations

import copy

import pytest
import torch

from bpt import engine
from bpt.attention import blockwise_attention
from patches import apply_bpt_patch
from test_patches import SMALL_BLOCKS, make_batch
from tiny_models import tiny_model

P = 0.3


def _full_keep_mask(q, k, q_block, kv_block, seed) -> torch.Tensor:
    """The kernel's per-block keep-masks assembled into [B, Hq, Nq, Nk] (for the naive reference)."""
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = hq // hkv
    spec = engine.AttentionSpec(scale=1.0, causal=True, window=None, softcap=None, q_block=q_block,
                                kv_block=kv_block, offset=nk - nq, acc_dtype=torch.float64, groups=g,
                                use_compile=False, dropout=P, dropout_seed=seed)
    full = torch.ones(b, hkv, g, nq, nk, dtype=torch.float64)
    for i0 in range(0, nq, q_block):
        i1 = min(i0 + q_block, nq)
        for j0 in range(0, nk, kv_block):
            j1 = min(j0 + kv_block, nk)
            keep = engine.dropout_keep_mask(spec, i0, j0, (b * hkv, g * (i1 - i0), j1 - j0), q.double())
            full[:, :, :, i0:i1, j0:j1] = keep.view(b, hkv, g, i1 - i0, j1 - j0)
    return full.view(b, hq, nq, nk)


def _naive(q, k, v, keep, padding_mask):
    """fp64 reference: dropout(softmax(scale q.k + mask)) @ v, with the given keep-mask."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    n = s.shape[-1]
    hidden = torch.ones(n, n, dtype=torch.bool).triu(1) | ~padding_mask[:, None, None, :]
    probs = s.masked_fill(hidden, float("-inf")).softmax(-1)
    return (probs * keep) @ v


def test_dropout_equals_naive_reference_forward_and_backward():
    torch.manual_seed(0)
    b, hq, hkv, n, d = 2, 4, 2, 45, 8
    q = torch.randn(b, hq, n, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, n, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, n, d, dtype=torch.float64, requires_grad=True)
    padding = torch.ones(b, n, dtype=torch.bool)
    padding[0, -9:] = False
    out = blockwise_attention(q, k, v, padding_mask=padding, dropout=P, dropout_seed=7, q_block=16, kv_block=16)
    keep = _full_keep_mask(q, k, 16, 16, seed=7)
    assert 0.2 < (keep == 0).double().mean() < 0.4  # about P of them dropped
    expected = _naive(q, k, v, keep, padding)
    rows = padding[:, None, :, None].expand_as(out)  # padded query rows are ignored by models
    torch.testing.assert_close(out[rows], expected[rows], rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out) * rows
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for name, a, e in zip("qkv", got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9, msg=f"d{name} differs")


def test_dropout_gradcheck_with_a_fixed_seed():
    torch.manual_seed(1)
    q = torch.randn(1, 2, 11, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 11, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 11, 4, dtype=torch.float64, requires_grad=True)
    padding = torch.ones(1, 11, dtype=torch.bool)
    padding[0, 3] = False
    fn = lambda q, k, v: blockwise_attention(q, k, v, padding_mask=padding, dropout=0.5, dropout_seed=3,
                                             q_block=4, kv_block=3)
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_dropout_seed_comes_from_torch_rng():
    q = torch.randn(1, 2, 20, 4)
    padding = torch.ones(1, 20, dtype=torch.bool)
    outs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outs.append(blockwise_attention(q, q, q, padding_mask=padding, dropout=P, q_block=8, kv_block=8))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    with pytest.raises(ValueError, match="dropout must be a probability"):
        blockwise_attention(q, q, q, dropout=1.0)


@pytest.mark.parametrize("name,config", [("gpt2", {"attn_pdrop": 0.1}), ("llama", {"attention_dropout": 0.1}),
                                         ("bloom", {"attention_dropout": 0.1})])
def test_models_with_attention_dropout_train_patched(name, config):
    """Configured attention dropout (e.g. a real GPT-2 checkpoint's attn_pdrop=0.1) trains patched; in eval
    mode it is off and the patched model equals stock."""
    stock = tiny_model(name, **config)
    patched = copy.deepcopy(stock)
    apply_bpt_patch(patched, **SMALL_BLOCKS)
    inputs = make_batch("right_padded")
    torch.manual_seed(0)
    loss = patched(**inputs).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in patched.parameters() if p.requires_grad)
    torch.manual_seed(1)
    assert patched(**inputs).loss != loss  # dropout is really on in training
    stock.eval(), patched.eval()
    with torch.no_grad():
        torch.testing.assert_close(patched(**inputs).loss, stock(**inputs).loss, rtol=1e-5, atol=0)
