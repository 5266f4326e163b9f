"""ALiBi past 256 tokens, patched vs stock transformers (fp32), and the kernel's key_bias it relies on.

Stock Falcon builds its ALiBi as bf16(bf16(slope) x bf16(key position)), so above 256 (where integers
stop being exact in bf16), or with slopes that are not powers of two (16+ heads), its bias is not
slope x (j - p) with any per-row constant: a relative-position kernel differs from stock. The patched
model passes stock's own per-layer bias to the kernel as `key_bias`.
"""
from __future__ import annotations

import copy

import pytest
import torch

from bpt.attention import blockwise_attention
from patches import apply_bpt_patch
from test_attention import make_qkv, reference
from test_patches import assert_grads_close, loss_and_grads
from tiny_models import VOCAB, tiny_model

BLOCKS = dict(q_block=128, kv_block=128, mlp_chunk=256, loss_chunk=256)


def make_long_batch(kind: str, length: int, batch: int = 2) -> dict:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    labels = input_ids.clone()
    labels[:, :5] = -100
    inputs = {"input_ids": input_ids, "labels": labels}
    if kind in ("right_padded", "left_padded"):
        mask = torch.ones(batch, length, dtype=torch.long)
        if kind == "right_padded":
            mask[0, -length // 4:] = 0
        else:  # ALiBi positions then count from the first real token
            mask[0, :length // 4] = 0
            # The last padding position predicts the first real token; its query sees no key at all, where
            # stock attends uniformly to every key (future ones included) and the kernel outputs zeros.
            labels[0, length // 4] = -100
        labels[mask == 0] = -100
        inputs["attention_mask"] = mask
    elif kind == "packed":  # two documents per row: positions restart
        first = length // 3
        inputs["position_ids"] = torch.cat([torch.arange(first), torch.arange(length - first)]).repeat(batch, 1)
    return inputs


def assert_matches_stock(stock, inputs):
    patched = copy.deepcopy(stock)
    apply_bpt_patch(patched, **BLOCKS)
    stock_loss, stock_grads = loss_and_grads(stock, inputs)
    patched_loss, patched_grads = loss_and_grads(patched, inputs)
    assert torch.isfinite(stock_loss)
    assert abs(patched_loss - stock_loss) <= 1e-5 * abs(stock_loss)
    assert_grads_close(stock_grads, patched_grads)


@pytest.mark.parametrize("kind", ["plain", "right_padded", "left_padded", "packed"])
@pytest.mark.parametrize("length", [300, 600])
def test_falcon_alibi_long_matches_stock(length, kind):
    assert_matches_stock(tiny_model("falcon_alibi"), make_long_batch(kind, length))


def test_falcon_alibi_rounded_slopes_match_stock():
    """16 heads: slopes 2^(-k/2) are not exact in bf16, so stock's bias is rounded at every position."""
    stock = tiny_model("falcon_alibi", hidden_size=64, num_attention_heads=16)
    assert_matches_stock(stock, make_long_batch("right_padded", 45))


@pytest.mark.parametrize("heads, length", [(4, 600), (16, 300)])
def test_bloom_alibi_long_matches_stock(heads, length):
    """Bloom builds slope x position in the model dtype (fp32 here): exact to 2^24, so this held before
    key_bias too; it guards the bound forward that now passes Bloom's own bias."""
    stock = tiny_model("bloom", hidden_size=64, n_head=heads)
    assert_matches_stock(stock, make_long_batch("right_padded", length))


def test_falcon_alibi_long_logits_match_stock():
    stock = tiny_model("falcon_alibi").eval()
    patched = copy.deepcopy(stock)
    apply_bpt_patch(patched, **BLOCKS)
    inputs = make_long_batch("left_padded", 600)
    inputs.pop("labels")
    with torch.no_grad():
        expected, got = stock(**inputs).logits, patched(**inputs).logits
    valid = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-5)


# --- the kernel feature: key_bias [B, Hq, Nk], added to every query's score for key j -------------------


@pytest.mark.parametrize("nq", [127, 40])  # 40 < Nk: queries aligned to the end of the keys
def test_key_bias_matches_reference(nq):
    q, k, v = make_qkv(hq=4, hkv=2, nq=nq, nk=127)
    gen = torch.Generator().manual_seed(1)
    positions = torch.arange(127.0)[None, None, :]
    slopes = torch.tensor([0.5, 0.3, 0.1, 0.05])[None, :, None]
    key_bias = ((slopes * positions).bfloat16().float() + torch.randn(2, 4, 127, generator=gen)).contiguous()
    padding_mask = torch.ones(2, 127, dtype=torch.bool)
    padding_mask[1, 50:59] = False
    out = blockwise_attention(q, k, v, padding_mask=padding_mask, key_bias=key_bias, q_block=32, kv_block=16)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))

    # The reference adds the bias through ALiBi-free scores: s = scale * q.k + key_bias.
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    groups = 2
    s = (q64 @ k64.repeat_interleave(groups, 1).transpose(-1, -2)) * 16 ** -0.5 + key_bias.double()[:, :, None, :]
    rel = torch.arange(127)[None, :] - (torch.arange(nq) + 127 - nq)[:, None]
    visible = (rel <= 0) & padding_mask[:, None, None, :]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    expected = p @ v64.repeat_interleave(groups, 1)
    expected_grads = torch.autograd.grad(expected.square().sum(), (q64, k64, v64))
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    for got, ref in zip(grads, expected_grads):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_key_bias_equals_alibi_slopes_when_exact():
    """slope x absolute key position is slope x (j - p) plus a per-row constant: the same attention."""
    q, k, v = make_qkv(hq=4, hkv=4, nq=127)
    slopes = torch.tensor([0.25, 0.125, 0.0625, 0.03125])
    key_bias = (slopes[:, None] * torch.arange(127.0)).expand(2, 4, 127)
    got = blockwise_attention(q, k, v, key_bias=key_bias, q_block=32, kv_block=32)
    expected, _ = reference(q, k, v, alibi_slopes=slopes)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_key_bias_is_validated():
    q, k, v = make_qkv(hq=4, hkv=2, nq=16)
    bias = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match="not both"):
        blockwise_attention(q, k, v, key_bias=bias, alibi_slopes=torch.ones(4))
    with pytest.raises(ValueError, match=r"\[2, 4, 16\]"):
        blockwise_attention(q, k, v, key_bias=torch.zeros(2, 2, 16))
    with pytest.raises(ValueError, match="detach"):
        blockwise_attention(q, k, v, key_bias=bias.requires_grad_())
