"""The CUDA tier: `python -m pytest -m cuda` on a GPU machine. On a machine without CUDA every test here
is skipped with the reason printed (pytest -ra)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import bpt.attention as attention_module
from bpt.attention import blockwise_attention
from test_mixed_precision import assert_no_worse_than_stock, low_precision_errors

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (run `python -m pytest -m cuda` on a GPU machine)"),
]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _qkv(n: int, *, hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(1, h, n, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    return make(hq), make(hkv), make(hkv)


def test_plain_causal_bf16_goes_to_fused_sdpa_with_gqa():
    q, k, v = _qkv(2048)
    assert attention_module._sdpa_handles(q, k, v, True, None, None, None, None, None)
    out = blockwise_attention(q, k, v)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, expected)


def test_long_sequence_never_lands_on_the_math_kernel():
    """32K tokens, 8 heads: the math kernel would hold 8 x 32K x 32K scores (16 GiB in bf16)."""
    n = 32768
    q, k, v = _qkv(n)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    blockwise_attention(q, k, v).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 1 << 30, f"attention forward + backward at {n} tokens took {extra / 2**20:.0f} MiB"


def _padded_case(n=4096, seed=0):
    q, k, v = _qkv(n, seed=seed)
    padding = torch.ones(1, n, dtype=torch.bool, device="cuda")
    padding[0, -n // 8:] = False
    return q, k, v, padding


def _out_and_grads(fn, q, k, v, padding):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, padding)
    rows = padding[:, None, :, None].expand(out.shape)
    grad = (torch.linspace(-1, 1, out.numel(), device="cuda").view(out.shape) * rows).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    return [t.float() for t in (out * rows, *grads)]


def test_blockwise_compiled_bf16_no_worse_than_stock():
    """Padding goes to the blockwise kernel, compiled by default on CUDA: bf16 in, fp32 statistics."""
    q, k, v, padding = _padded_case()
    blockwise = lambda q, k, v, m, **o: blockwise_attention(q, k, v, padding_mask=m, **o)

    def stock(q, k, v, m):
        mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device="cuda").tril() & m[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    exact = _out_and_grads(lambda *a: blockwise(*(t.double() for t in a[:3]), a[3], compile=False), q, k, v, padding)
    compiled = _out_and_grads(blockwise, q, k, v, padding)
    eager = _out_and_grads(lambda *a: blockwise(*a, compile=False), q, k, v, padding)
    reference = _out_and_grads(stock, q, k, v, padding)
    for c, e, s, x in zip(compiled, eager, reference, exact):
        torch.testing.assert_close(c, e, rtol=1e-3, atol=1e-3)
        assert (c - x).norm() <= 1.5 * (s - x).norm()


@pytest.mark.parametrize("name", ["llama", "gemma2", "falcon_alibi", "mistral"])
@pytest.mark.parametrize("mode", ["autocast", "bf16_weights"])
def test_families_bf16_on_cuda(name, mode):
    assert_no_worse_than_stock(low_precision_errors(name, "right_padded", mode, device="cuda"))


def test_qlora_cli_4bit_step_on_cuda(tmp_path):
    """The CLI's 4-bit QLoRA path (bitsandbytes CUDA kernels, bf16 autocast, compiled blocks)."""
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "train.qlora", "--bits", "4", "--mixed_precision", "bf16", "--max_steps", "3", "--logging_steps", "1",
         "--output_dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses and all(loss == loss for loss in losses)


def test_sequence_parallel_bench_on_nccl(tmp_path):
    """The sequence-parallel bench on CUDA: NCCL groups of 1 and (with 2 GPUs) 2 ranks, ring and Ulysses, bf16,
    every run finished and its bytes sent equal to the algorithm's volume."""
    from bpt.bench import main

    worlds = [1, 2] if torch.cuda.device_count() >= 2 else [1]
    output = tmp_path / "sp.json"
    main(["--model", "tiny", "--lora", "--dtype", "bf16", "--sequence_parallel", *map(str, worlds), "--sp_mode",
          "ring", "ulysses", "--seq_lens", "1000", "4096", "--steps", "1", "--device", "cuda", "--timeout", "600",
          "--output", str(output)])
    report = json.loads(output.read_text())
    assert report["environment"]["backend"] == "nccl"
    for run in report["runs"]:
        assert run["ok"], run
        assert run["sent_bytes"] == run["theory_bytes"], run
