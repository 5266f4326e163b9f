"""bpt/engine/steps.py on CUDA: the blockwise kernel's block matmuls take bf16 / fp16 inputs into fp32 products (tensor
cores, FlashAttention's precision: P and dS rounded to the inputs' dtype before their matmuls). The CPU has no such
kernel and keeps upcasting; the CUDA rule is emulated here (switched on for CPU tensors: fp32 products of bf16
values) and held against stock SDPA's own bf16 error. The simulated-CUDA tier runs the real CUDA calls."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bpt import attention
from bpt.attention import segment_ids_from_position_ids
from bpt.engine import steps


def packed(lengths_per_row, hq=8, hkv=2, d=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths_per_row[0])
    positions = torch.stack([torch.cat([torch.arange(n_doc) for n_doc in row]) for row in lengths_per_row])
    make = lambda h: torch.randn(len(lengths_per_row), h, n, d, generator=g)
    return make(hq), make(hkv), make(hkv), segment_ids_from_position_ids(positions)


def out_and_grads(fn, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    grad = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def errors(monkeypatch, low_precision: bool):
    """RMS errors against fp64 of the bf16 blockwise output and q / k / v gradients (packed + padding, GQA)."""
    monkeypatch.setattr(steps, "low_precision_matmuls", lambda k: low_precision and k.dtype == torch.bfloat16)
    q, k, v, seg = packed([[40, 90, 70], [200]])
    padding = torch.ones(2, 200, dtype=torch.bool)
    padding[1, -30:] = False

    def run(*t):
        return attention.blockwise_attention(*t, segment_ids=seg, padding_mask=padding, q_block=64, kv_block=32)

    exact = out_and_grads(lambda *t: run(*(x.double() for x in t)), q, k, v)
    got = out_and_grads(lambda *t: run(*(x.bfloat16() for x in t)), q, k, v)
    return [(a.double() - x).pow(2).mean().sqrt() for a, x in zip(got, exact)], exact, (q, k, v, seg, padding)


def test_low_precision_matmuls_no_worse_than_stock(monkeypatch):
    upcast, *_ = errors(monkeypatch, False)
    low, exact, (q, k, v, seg, padding) = errors(monkeypatch, True)
    mask = torch.ones(200, 200, dtype=torch.bool).tril() & (seg[:, None, :, None] == seg[:, None, None, :]) \
        & padding[:, None, None, :]
    stock = out_and_grads(lambda *t: F.scaled_dot_product_attention(
        *(x.bfloat16() for x in t), attn_mask=mask, enable_gqa=True), q, k, v)
    for name, got, before, s, x in zip(("out", "dq", "dk", "dv"), low, upcast, stock, exact):
        stock_error = (s.double() - x).pow(2).mean().sqrt()
        assert got != before, f"{name}: the switch changed nothing"
        assert got <= 1.5 * stock_error, f"{name}: {got:.3e} vs stock {stock_error:.3e}"


def test_cpu_keeps_upcast_matmuls():
    assert not steps.low_precision_matmuls(torch.zeros(1, dtype=torch.bfloat16))
