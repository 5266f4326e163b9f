"""The exchange on the simulated step's clock (bpt.gpusim.exchange): links priced per machine, an exchange overlapped
with the compute enqueued after it until the code waits, serialised where it waits at once, and the ring and
Ulysses code telling the clock when they start and wait (a fake process group, no processes)."""
from __future__ import annotations

import pytest
import torch

from bpt.bench.simulate import extrapolated_to_depth
from bpt.gpusim.clock import Rates, StepClock
from bpt.gpusim.exchange import ExchangeClock, Links
from bpt.gpusim.gpus import MACHINES, machine

aten = torch.ops.aten
GPU = Rates("test-gpu", {"bfloat16": 1e12, "float32": 1e11}, 1e11, {"bfloat16": (5e11, 4e11)},
            host_seconds_per_op=1e-5, kernel_floor_seconds=1e-6, link_bytes_per_second=1e10, peak_bf16=2e12,
            overlap=True)
NVLINK, NETWORK = 1e9, 1e8  # bytes/s each way: an exchange of 1e8 bytes takes 0.1 s in the machine, 1 s across


def _compute(clock: StepClock, seconds: float) -> None:
    """One matmul kernel of `seconds` on the device (meta tensors: shapes only)."""
    a = torch.empty(1024, 1024, dtype=torch.bfloat16, device="meta")
    clock.op(aten.mm.default, (a, a), [a, a], [a], seconds * 1e12)


def _clocks(world=8, per_machine=8):
    clock = StepClock(GPU)
    return clock, ExchangeClock(clock, Links(0, world, per_machine, NVLINK, NETWORK))


def test_links_price_each_way_at_its_link():
    links = Links(0, 16, 8, NVLINK, NETWORK)
    assert links.machines == 2 and links.same_machine(7) and not links.same_machine(8)
    # a ring hop on two machines: rank 0 sends to rank 1 (NVLink) and receives from rank 15 (the network)
    assert links.seconds({1: 10**8}, {15: 10**8}) == pytest.approx(1.0)
    assert Links(0, 8, 8, NVLINK, NETWORK).seconds({1: 10**8}, {7: 10**8}) == pytest.approx(0.1)
    # an all-to-all over 16: 7 peers in the machine share its NVLink, 8 beyond share the network adapter
    even = {peer: 10**7 for peer in range(1, 16)}
    assert links.seconds(even, even) == pytest.approx(max(7e7 / NVLINK, 8e7 / NETWORK))


def test_an_exchange_shorter_than_the_compute_after_it_is_hidden():
    """Ring: the next shard is sent, this shard's compute runs, then the code waits: nothing exposed."""
    clock, exchange = _clocks()
    done = exchange.begin("ring_p2p", {1: 10**7}, {7: 10**7})  # 0.01 s
    _compute(clock, 0.5)
    before = clock.device
    exchange.wait(done)
    assert clock.device == before and exchange.exposed == 0.0
    assert exchange.busy == pytest.approx(0.01) and exchange.bytes == {"local": 10**7, "remote": 0}


def test_an_exchange_longer_than_the_compute_exposes_the_rest():
    clock, exchange = _clocks(world=16)  # rank 0 receives from rank 15 on the other machine: 1 s
    done = exchange.begin("ring_p2p", {1: 10**8}, {15: 10**8})
    _compute(clock, 0.25)
    computed = clock.device
    exchange.wait(done)
    assert done == pytest.approx(1.0)
    assert exchange.exposed == pytest.approx(1.0 - computed) and clock.device == pytest.approx(1.0)
    _compute(clock, 0.25)  # the next compute starts after the wait
    assert clock.device == pytest.approx(1.25)


def test_an_exchange_waited_at_once_is_serialised():
    """Ulysses: the all-to-all's output is read next, so its whole time is on the step."""
    clock, exchange = _clocks()
    _compute(clock, 0.5)
    start = clock.device
    exchange.wait(exchange.begin("ulysses_all_to_all", {1: 10**8}, {1: 10**8}))  # 0.1 s
    assert exchange.exposed == pytest.approx(0.1) and clock.device == pytest.approx(start + 0.1)
    summary = clock.summary(tokens=1)
    assert summary["step_seconds"] == pytest.approx(start + 0.1)


def test_exchanges_queue_on_one_stream_and_start_after_the_work_before_them():
    clock, exchange = _clocks()
    _compute(clock, 0.5)
    first = exchange.begin("ring_p2p", {1: 10**8}, {7: 10**8})
    second = exchange.begin("ring_p2p", {1: 10**8}, {7: 10**8})
    assert first == pytest.approx(clock.device + 0.1) and second == pytest.approx(first + 0.1)
    assert exchange.exposed == 0.0  # nobody waited yet: the host went on


def test_every_card_with_a_machine_has_its_sources_and_host_memory():
    for name, box in MACHINES.items():
        assert box.sources and box.gpus >= 1 and box.host_bytes > 0
        assert box.nvlink_bytes_per_second > box.network_bytes_per_second > 0, name
    h100 = machine("h100-80gb")
    assert h100.host_bytes_per_process(8) == 256 << 30  # a 2 TB node of eight: 256 GiB per GPU
    assert h100.host_bytes_per_process(1) == 2048 << 30 and h100.host_bytes_per_process(16) == 256 << 30
    assert machine("h100-80gb", gpus=4).host_bytes_per_process(8) == 512 << 30
    assert machine("cpu") is None


def test_the_exchange_extends_to_the_depth_with_the_step():
    def row(device, busy, exposed, exchanges):
        return {"peak_bytes": 1, "before_bytes": 0, "flops_by_dtype": {"bfloat16": 1e12}, "seconds": 1.0,
                "step_seconds": device, "clock_tokens": 1000, "clock_flops": 1e12, "clock_peak_flops": 1e15,
                "time_breakdown": {"matmul": device}, "kernel_launches": 1,
                "timelines": {"host": 0.1, "device": device, "copy_stream": 0.0},
                "exchange": {"exchange_seconds": busy, "exposed_exchange_seconds": exposed, "exchange_local_bytes": 1,
                             "exchange_remote_bytes": 0, "exchanges": exchanges, "machines": 1, "gpus_per_machine": 8,
                             "nvlink_bytes_per_second": NVLINK, "network_bytes_per_second": NETWORK}}
    out = extrapolated_to_depth(row(1.0, 0.2, 0.1, 4), row(1.5, 0.3, 0.15, 6), layers=2, depth=10)
    assert out["exchange"]["exchange_seconds"] == pytest.approx(1.0)
    assert out["exchange"]["exposed_exchange_seconds"] == pytest.approx(0.5)
    assert out["exchange"]["exchanges"] == 20 and out["exchange"]["gpus_per_machine"] == 8


class _Recorder:
    """A traffic listener that logs the order of exchanges and waits against the ops run between them."""

    def __init__(self):
        self.events, self.ops = [], 0

    def begin(self, kind, sends, receives):
        self.events.append(("begin", kind, self.ops, dict(sends), dict(receives)))
        return len(self.events) - 1

    def wait(self, token):
        self.events.append(("wait", token, self.ops))


@pytest.fixture
def fake_group_of_4():
    from bpt.bench.rank_share import fake_group

    with fake_group(4):
        yield


def _counting_ops(recorder):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "flash_attention" in func.__name__:
                recorder.ops += 1
            return func(*args, **(kwargs or {}))

    return Count()


def test_ring_waits_for_each_hop_after_the_compute_it_overlaps(fake_group_of_4):
    from bpt.sequence_parallel import ring_attention, traffic

    recorder = _Recorder()
    q = torch.randn(1, 4, 8, 8, requires_grad=True)
    k = torch.randn(1, 2, 8, 8, requires_grad=True)
    with traffic.listening(recorder), _counting_ops(recorder):
        out = ring_attention(q, k, k.detach().clone().requires_grad_(), seq_len=32)
    begins = [e for e in recorder.events if e[0] == "begin"]
    assert len(begins) == 3 and all(e[1] == "ring_p2p" and e[3].keys() == {1} and e[4].keys() == {3} for e in begins)
    for token, event in enumerate(recorder.events):
        if event[0] == "begin":  # its wait comes after at least one kernel of this step
            wait = next(e for e in recorder.events if e[0] == "wait" and e[1] == token)
            assert wait[2] > event[2], recorder.events
    nbytes = 2 * k.numel() * k.element_size()  # k and v of the shard
    assert all(e[3][1] == nbytes for e in begins)
    del out


def test_ulysses_waits_for_each_all_to_all_at_once(fake_group_of_4):
    from bpt.sequence_parallel import traffic, ulysses_attention

    recorder = _Recorder()
    q = torch.randn(1, 4, 8, 8)
    k = torch.randn(1, 4, 8, 8)
    with traffic.listening(recorder):
        ulysses_attention(q, k, k)
    kinds = [e[0] for e in recorder.events]
    assert kinds == ["begin", "wait", "begin", "wait"]  # q / k / v to heads, the output back: each waited at once
    assert all(e[1] == "ulysses_all_to_all" and e[3].keys() == {1, 2, 3} for e in recorder.events if e[0] == "begin")
