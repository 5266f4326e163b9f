"""The simulated step's clock (bpt.gpusim.clock): what it charges each op, the stream overlap, syncs, copies,
the extension to the model's depth, and the CPU's measured rates cached."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch

from bpt.bench.simulate import extrapolated_to_depth
from bpt.gpusim import clock as clock_module
from bpt.gpusim.clock import RATES, Rates, StepClock, attention_flops

aten = torch.ops.aten
GPU = Rates("test-gpu", {"bfloat16": 1e12, "float32": 1e11}, 1e11, {"bfloat16": (5e11, 4e11)},
            host_seconds_per_op=1e-5, kernel_floor_seconds=1e-6, link_bytes_per_second=1e10, peak_bf16=2e12,
            overlap=True)


def _run(clock: StepClock, func, *args, flops: float = 0.0, **kwargs):
    out = func(*args, **kwargs)
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    clock.op(func, args, [a for a in args if isinstance(a, torch.Tensor)], outs, flops)
    return out


def test_views_cost_the_host_only_and_kernels_the_device():
    clock = StepClock(GPU)
    x = torch.zeros(1024, 1024)
    _run(clock, aten.view.default, x, [1024 * 1024])
    _run(clock, aten.t.default, x)
    assert clock.ops == 2 and clock.kernels == 0 and clock.device == 0.0
    _run(clock, aten.add.Tensor, x, x)
    bytes_moved = 3 * x.numel() * 4
    assert clock.kernels == 1 and clock.device == pytest.approx(3e-5 + bytes_moved / 1e11)  # after 3 host dispatches


def test_matmul_at_the_dtype_rate_and_overlap_with_the_host():
    clock = StepClock(GPU)
    a = torch.zeros(256, 256, dtype=torch.bfloat16)
    flops = 2 * 256 ** 3
    for _ in range(3):
        _run(clock, aten.mm.default, a, a, flops=flops)
    per = max(flops / 1e12, 3 * a.numel() * 2 / 1e11, 1e-6)
    # the device starts after the first launch and then runs back to back: kernels longer than a launch
    assert clock.device == pytest.approx(1e-5 + 3 * per) and clock.idle == pytest.approx(1e-5)
    assert clock.by_kind["matmul"] == pytest.approx(3 * per) and clock.flops == 3 * flops


def test_tiny_kernels_are_launch_bound():
    clock = StepClock(GPU)
    x = torch.zeros(4)
    for _ in range(100):
        _run(clock, aten.add.Tensor, x, x)
    summary = clock.summary(tokens=1)
    assert summary["step_seconds"] == pytest.approx(100 * 1e-5 + 1e-6)  # the host's launches set the pace
    assert summary["time_breakdown"]["launch_bound_idle"] > 0.9 * summary["step_seconds"]


def test_a_sync_makes_the_host_wait_and_a_copy_takes_the_link():
    clock = StepClock(GPU)
    big = torch.zeros(4096, 4096, dtype=torch.bfloat16, device="meta")  # shapes only (a real bf16 product of this
    _run(clock, aten.mm.default, big, big, flops=2 * 4096 ** 3)           # size took 8 minutes on an AVX2 CPU)
    device_end = clock.device
    assert clock.host < device_end
    _run(clock, aten._local_scalar_dense.default, torch.ones(()))
    assert clock.syncs == 1 and clock.host == pytest.approx(device_end)
    meta = torch.empty(1 << 20, device="meta")  # another device than the input's: a transfer
    clock.op(aten._to_copy.default, (meta,), [meta], [torch.empty(1 << 20)], 0.0)
    assert clock.by_kind["copies"] == pytest.approx(4 * (1 << 20) / 1e10) and clock.kernels == 1
    scalar = torch.tensor(2.0)  # a 0-dim CPU operand is a scalar, not a transfer
    clock.op(aten.mul.Tensor, (meta, scalar), [meta, scalar], [torch.empty(1 << 20, device="meta")], 0.0)
    assert clock.kernels == 2


def test_attention_flops_from_shapes_causal_halved_backward_two_and_a_half():
    q = torch.empty(1, 8, 1024, 64)
    k = torch.empty(1, 2, 1024, 64)
    forward = 4.0 * 8 * 1024 * 1024 * 64
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert attention_flops(op, (q, k, k, 0.0, False), backward=False) == forward
    assert attention_flops(op, (q, k, k, 0.0, True), backward=False) == forward / 2
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert attention_flops(backward, (q, q, k, k, q, q, 0.0, True), backward=True) == 2.5 * forward / 2


def test_extension_to_depth_takes_the_longest_timeline():
    def row(host, device, launches):
        return {"peak_bytes": 1, "before_bytes": 0, "flops_by_dtype": {"bfloat16": 1e12}, "seconds": 1.0,
                "step_seconds": max(host, device), "clock_tokens": 1000, "clock_flops": 1e12,
                "clock_peak_flops": 1e15, "time_breakdown": {"matmul": device}, "kernel_launches": launches,
                "timelines": {"host": host, "device": device, "copy_stream": 0.0}}
    # 2 layers device-bound, each layer adds more host time than device time: the deep model is host-bound
    out = extrapolated_to_depth(row(1.0, 1.5, 10), row(1.5, 1.7, 20), layers=2, depth=10)
    assert out["timelines"] == {"host": 5.0, "device": pytest.approx(3.1), "copy_stream": 0.0}
    assert out["step_seconds"] == 5.0 and out["tokens_per_second"] == pytest.approx(1000 / 5.0)
    assert out["kernel_launches"] == 90


def test_every_card_has_its_sources():
    for rates in RATES.values():
        assert rates.sources and rates.matmul["bfloat16"] > rates.matmul["float32"] > 0
        assert rates.overlap and rates.link_bytes_per_second


def test_cpu_rates_measured_once_then_cached(tmp_path, monkeypatch):
    calls = []
    fake = {"matmul": {"bfloat16": 2e11, "float32": 1e11}, "copy_bytes_per_second": 1e10,
            "dispatch": {"seconds_per_op_synced": 2e-6}, "transcendental_per_second": 1e9,
            "softmax_per_second": 5e8, "fresh_bytes_per_second": 4e9,
            "attention": [{"dtype": "float32", "forward_flops_per_second": 1e11, "backward_flops_per_second": 9e10}]}
    import bpt.gpusim.rates as rates_module

    monkeypatch.setattr(rates_module, "measure_rates", lambda device: calls.append(device) or dict(fake))
    first = clock_module.cpu_rates(tmp_path)
    second = clock_module.cpu_rates(tmp_path)
    assert calls == ["cpu"] and first == second
    assert first.attention_rate("float32", backward=True) == 9e10 and not first.overlap
    cached, = tmp_path.glob("rates-cpu-*.json")
    assert json.loads(cached.read_text())["matmul"] == fake["matmul"]


def test_cpu_rates_from_an_empty_cache_take_under_a_minute(tmp_path, capfd):
    """A fresh machine: the measurement says on one line that it runs, takes under a minute (bf16 products on a CPU
    without native bf16 kernels ran ~1 GFLOP/s: at the sizes fp32 needs, hours), is cached, and gives rates in a
    CPU's range for every dtype a simulated CPU step uses."""
    rates = clock_module.cpu_rates(tmp_path)
    measured = json.loads(next(tmp_path.glob("rates-cpu-*.json")).read_text())
    assert measured["seconds"] < 60, measured["seconds"]
    assert capfd.readouterr().err.count("measuring this CPU's rates") == 1
    assert 1e8 < rates.matmul_rate("bfloat16") < 1e14 and 1e9 < rates.matmul_rate("float32") < 1e14
    assert 1e8 < rates.memory_bytes_per_second < 1e12 and 1e-8 < rates.host_seconds_per_op < 1e-3
    assert {a["dtype"] for a in measured["attention"]} == {"bfloat16", "float32"}
    assert all(a["forward_backward_seconds"] > a["forward_seconds"] > 0 for a in measured["attention"])
    assert clock_module.cpu_rates(tmp_path) == rates and not capfd.readouterr().err


def test_the_measured_size_is_the_largest_whose_call_fits():
    """rates.affordable climbs the sizes while the next call is predicted to fit (here 1 s per unit of size^3)."""
    from bpt.gpusim.rates import affordable

    timed = []

    def one_call(n):
        timed.append(n)
        return n ** 3 * 1e-3

    assert affordable((1, 2, 4, 8, 16), one_call, 3, limit=0.1) == 4  # 8: 0.512 s predicted
    assert timed == [1, 1, 2, 4]  # a warm-up call first, then each size once
    assert affordable((8, 16), one_call, 3, limit=0.1) == 8  # the smallest whatever it costs
    timed.clear()
    assert affordable((4096,), one_call, 3, limit=0.1) == 4096 and not timed  # one size: nothing to time


def test_compiled_code_is_one_kernel_per_group_reading_inputs_once_writing_what_lives():
    """Inside a fused region (code a real run compiles) the memory-bound ops between two matmuls are one kernel: it
    reads each outside tensor once and writes only what is alive when the next matmul comes (x * y is a temporary
    of the expression); the host pays one launch, not one dispatch per op. Its autograd nodes' backward fuses too."""
    from bpt.compile import fused_region, regions_told_to
    from bpt.gpusim.tracker import AllocationTracker

    def run(fused: bool):
        clock = StepClock(GPU)
        x, y, z = (torch.ones(256, 256, requires_grad=True) for _ in range(3))
        w = torch.ones(256, 256)
        with AllocationTracker(clock=clock), regions_told_to(clock):
            with fused_region("x * y + z") if fused else contextlib.nullcontext():
                h = torch.relu(x * y + z)  # [256, 256] fp32: 256 KiB each
            if fused:
                clock.region_backward([h], [x, y, z])
            out = h @ w
            out.sum().backward()
        clock.summary(tokens=1)  # launches the group still open
        return clock

    eager, fused = run(False), run(True)
    tensor = 256 * 256 * 4
    launches, seconds = fused.by_op["fused (compiled)"]
    assert launches == 2  # the forward's group, and the backward of its nodes
    forward = max(1e-6, (3 + 1) * tensor / GPU.memory_bytes_per_second)  # reads x, y, z; writes h
    assert seconds >= forward and fused.kernels < eager.kernels and fused.host < eager.host
    assert fused.by_kind["memory_bound"] < eager.by_kind["memory_bound"]
    assert fused.by_kind["matmul"] == eager.by_kind["matmul"]
