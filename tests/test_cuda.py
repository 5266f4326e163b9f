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
from test_mixed_precision import WORSE_AT_MOST, assert_no_worse_than_stock, low_precision_errors

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
    # compiled and eager round differently (a bf16 ulp here and there, seen on an H100): each against the fp64
    # reference, no worse than stock's kernel is
    for name, c, e, s, x in zip(("out", "dq", "dk", "dv"), compiled, eager, reference, exact):
        stock_error = (s - x).norm()
        for label, ours in (("compiled", c), ("eager", e)):
            assert (ours - x).norm() <= WORSE_AT_MOST * stock_error, \
                f"{name}: {label} error {(ours - x).norm():.3e}, stock's {stock_error:.3e}"


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


@pytest.mark.parametrize("side", ["stock", "patched"])
def test_simulation_calibrated_against_the_real_gpu(side, capsys):
    """The simulated step beside the same step on this GPU (llama-3.2-1b shapes, 2 of its layers, LoRA, bf16
    autocast, 8K tokens): the tracker on real tensors must count what it counts on fake ones, and the allocator's
    own peak is printed beside the prediction (the simulation's first calibration; the reserve is not in either).
    The one guess a fake tensor needs here is how many tokens the loss counts (`nonzero`, answered with all of them:
    bpt.gpusim.tracker.DataOracle); real labels leave each row's last position uncounted, so the simulated peak may
    hold one token more of the loss chunk (measured on an H100, 2026-11-27: patched 7,284,874,752 vs 7,283,331,584
    bytes, the chunk 4,096 vs 4,095 rows; stock equal)."""
    from dataclasses import asdict

    from bpt.bench.models import resolve_model_config
    from bpt.bench.simulate import run_simulation
    from bpt.bench.workers import run_worker
    from bpt.config import BPTConfig

    n = 8192
    config = resolve_model_config("llama-3.2-1b", n) | {"num_hidden_layers": 2}
    spec = dict(task="simulate", simulate="h100-80gb", side=side, seq_len=n, model_config=config, bits=16, lora=True,
                lora_r=16, batch_size=1, gradient_checkpointing=True, bpt=asdict(BPTConfig()), malloc="default")
    simulated = run_worker(spec)
    real = run_simulation({**spec, "real": True})
    assert simulated["ok"], simulated.get("error")
    with capsys.disabled():
        print(f"\n{side} {n}: simulated peak {simulated['peak_bytes'] / 2**30:.3f} GiB, tracker on real tensors "
              f"{real['peak_bytes'] / 2**30:.3f} GiB, torch.cuda.max_memory_allocated {real['cuda_peak_bytes'] / 2**30:.3f}"
              f" GiB (step {simulated['step_bytes'] / 2**30:.3f} vs {real['cuda_step_bytes'] / 2**30:.3f})")
    assert 0 <= simulated["peak_bytes"] - real["peak_bytes"] <= 1e-3 * real["peak_bytes"]
    assert abs(real["cuda_step_bytes"] - simulated["step_bytes"]) < 0.25 * real["cuda_step_bytes"]


def _flash_backward(hq: int, hkv: int, n: int, groups: int):
    """bf16 attention through bpt.head_groups with its backward in `groups` groups -> out, (dq, dk, dv), the peak
    allocated inside the backward, the output gradient (seeded: the same for every call)."""
    q, k, v = _qkv(n, hq=hq, hkv=hkv)
    out = blockwise_attention(q, k, v, head_groups=lambda: groups)
    grad = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=torch.Generator("cuda").manual_seed(1))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out.backward(grad)
    torch.cuda.synchronize()
    return out.detach(), (q.grad, k.grad, v.grad), torch.cuda.max_memory_allocated() - before, grad


def _fp32_gradients(hq: int, hkv: int, n: int, grad):
    q, k, v = (t.detach().float().requires_grad_() for t in _qkv(n, hq=hq, hkv=hkv))
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1),
                                         is_causal=True)
    out.backward(grad.float())
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("hq,hkv,groups,n", [(32, 8, 2, 16384), (32, 8, 32, 16384), (4, 1, 4, 8192)])
def test_head_grouped_flash_backward_no_further_from_fp32_and_holds_less(hq, hkv, groups, n):
    """The fused attention's backward a group of heads at a time (bpt.head_groups): key / value head groups (Llama-3.1
    -8B's 32 / 8 heads), one query head per call (what a split takes: dk / dv summed in fp32 over a key / value
    head's query heads), and a single key / value head (a Ulysses rank's share). The forward is one kernel either way (bitwise); FlashAttention-2's backward on CUDA adds
    dq up across key blocks in whatever order its blocks finish (measured on an H100, 2026-11-27: two backwards of
    the same inputs differ by one bf16 step in 160 of 4M dq elements), so the gradients are held against an fp32
    reference: no further from it than one backward over every head. And a smaller peak inside the backward."""
    whole_out, whole, whole_peak, grad = _flash_backward(hq, hkv, n, 1)
    grouped_out, grouped, grouped_peak, _ = _flash_backward(hq, hkv, n, groups)
    assert torch.equal(grouped_out, whole_out)
    for name, a, b, exact in zip(("dq", "dk", "dv"), whole, grouped, _fp32_gradients(hq, hkv, n, grad)):
        assert (b.float() - exact).norm() <= WORSE_AT_MOST * (a.float() - exact).norm(), name
    assert grouped_peak < whole_peak, (grouped_peak, whole_peak)


def test_compiled_static_cache_decoding_on_cuda():
    """tests/test_generation.py's compiled decode on the GPU (inductor's Triton kernels)."""
    from test_generation import assert_compiled_decoding_compiles_per_shape

    assert_compiled_decoding_compiles_per_shape("cuda")


def test_4bit_weights_dequantised_once_on_cuda(monkeypatch):
    """tests/test_dequant_once.py's check on bitsandbytes' CUDA kernels: 2,048 tokens, so its matmul dequantises too
    (past 1,536 rows) and the results are bitwise its own."""
    from test_dequant_once import assert_one_dequantisation_fewer_per_backward_matmul

    assert_one_dequantisation_fewer_per_backward_matmul("cuda", 2048, monkeypatch)


# Last: passed on an H100 in both GPU checks so far; the pytest order is the order a short lease gets through them.
@pytest.mark.parametrize("name", ["llama", "gemma2", "falcon_alibi", "mistral"])
@pytest.mark.parametrize("mode", ["autocast", "bf16_weights"])
def test_families_bf16_on_cuda(name, mode):
    assert_no_worse_than_stock(low_precision_errors(name, "right_padded", mode, device="cuda"))
