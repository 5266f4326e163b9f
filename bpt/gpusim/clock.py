"""A clock for the simulated step: each op the tracker sees gets a predicted time, from the device's rates.

Per op:
- host: every dispatched op costs the host `host_seconds_per_op` (views and metadata ops too: they are aten calls);
- kernel (ops that launch one: not views, not allocations): the longest of its FLOPs at the dtype's achievable
  matmul rate (attention kernels at `attention_fraction` of the bf16 rate), the bytes it reads and writes at the
  memory bandwidth, and the shortest kernel a launch costs the device;
- copies between host and device (checkpoint offload) run on their own stream at the link's bandwidth.
On a GPU the host enqueues and the device runs: the device idles only where launches outrun kernels
("launch-bound idle"), a data-dependent read (`.item()`, `nonzero`) makes the host wait for the device, and the
step ends when the host, the device and the copy stream are all done. On a CPU everything is one timeline.

`RATES` holds every card's constants with their sources: measured ones come from `python -m bpt.bench
--gpu_check` (bpt/gpusim/rates.py), the others from datasheets scaled by what the measured card achieved. The
CPU's are measured on this machine (`cpu_rates`, ~20 s once, cached per CPU, threads and torch version).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

# Ops that launch no kernel: allocation without initialisation, aliasing, metadata.
NO_KERNEL = {aten.empty, aten.empty_strided, aten.empty_like, aten.detach, aten.alias, aten.lift_fresh,
             aten.set_, aten.resize_, aten._unsafe_view, aten.view, aten._reshape_alias, aten.as_strided,
             aten.t, aten.transpose, aten.permute, aten.expand, aten.unsqueeze, aten.squeeze, aten.slice,
             aten.select, aten.split, aten.split_with_sizes, aten.unbind, aten.chunk, aten.narrow, aten.diagonal,
             aten.view_as_real, aten.view_as_complex, aten.unflatten, aten.flatten, aten.reshape,
             aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.is_same_size,
             aten.is_nonzero, aten.new_empty, aten.new_empty_strided}
COPIES = {aten._to_copy, aten.copy_, aten.copy}
SYNCS = {aten._local_scalar_dense, aten.nonzero, aten.item, aten.equal}  # the host waits for the device
ATTENTION = ("flash_attention", "efficient_attention", "cudnn_attention")
# Elementwise ops whose cost per element is a transcendental function (a CPU computes them slower than it moves
# their bytes; a GPU does not): timed at the device's `transcendental_per_second` too.
SOFTMAX = {aten._log_softmax, aten._log_softmax_backward_data, aten._softmax, aten._softmax_backward_data,
           aten.logsumexp}
TRANSCENDENTAL = {aten.exp, aten.log, aten.silu, aten.silu_backward, aten.sigmoid, aten.sigmoid_backward,
                  aten.tanh, aten.tanh_backward, aten.gelu, aten.gelu_backward, aten.rsqrt, aten.sqrt, aten.pow,
                  aten.sin, aten.cos, aten.erf}
RATES_VERSION = 3  # of what bpt.gpusim.rates measures: a cache from another version is measured again
FRESH_BLOCK = 128 * 1024  # CPU: blocks from this size on are fresh mmaps (the bench's malloc setting): page faults


@dataclass(frozen=True)
class Rates:
    name: str
    matmul: dict                 # dtype name -> achievable FLOP/s
    memory_bytes_per_second: float  # bytes read + written per second by a large copy
    attention: dict              # dtype name -> (forward, backward) FLOP/s of fused causal attention
    host_seconds_per_op: float   # host time to dispatch one aten op (and launch its kernel)
    kernel_floor_seconds: float  # the shortest kernel, however small its work
    link_bytes_per_second: float | None  # host <-> device, pinned memory
    peak_bf16: float             # datasheet dense bf16 FLOP/s (the MFU's denominator; a CPU: its fastest measured
                                 # matmul, fp32 where bf16 has no fast kernels)
    overlap: bool                # True: host and device on separate timelines (a GPU's stream)
    transcendental_per_second: float | None = None  # elements/s of exp-like ops (None: memory-bound only)
    softmax_per_second: float | None = None  # elements/s of a (log_)softmax row, forward or backward
    fresh_bytes_per_second: float | None = None  # CPU: first touch of a freshly mapped block (page faults)
    sources: tuple = field(default=())

    def matmul_rate(self, dtype: str) -> float:
        return self.matmul.get(dtype) or self.matmul["float32"]

    def attention_rate(self, dtype: str, backward: bool) -> float:
        forward_rate, backward_rate = self.attention.get(dtype) or self.attention["bfloat16"]
        return backward_rate if backward else forward_rate


_H100_SOURCE = ("measured: python -m bpt.bench --gpu_check on one H100 80GB HBM3 "
                "(docs/bench/gpu_check-h100-80gb.json, clock part): bf16 matmul 759 TFLOP/s at 8192^3, fp16 727, "
                "fp32 51; copy 2,890 GB/s; causal grouped SDPA forward+backward 518-545 TFLOP/s (0.70 of bf16 "
                "matmul; forward 559 at 8K, backward ~500 from the forward+backward time); 10.2 us host time per "
                "small op; pinned host link 54 GB/s each way",
                "assumed: 3 us shortest kernel (launch latency on the device)",
                "datasheet: H100 SXM dense bf16 989 TFLOP/s")
_H100 = dict(matmul={"bfloat16": 759e12, "float16": 727e12, "float32": 51e12}, memory_bytes_per_second=2.89e12,
             attention={"bfloat16": (559e12, 500e12)}, host_seconds_per_op=10.2e-6, kernel_floor_seconds=3e-6,
             link_bytes_per_second=54e9, peak_bf16=989e12, overlap=True)


def _scaled(name: str, compute: float, memory: float, link: float, peak: float, note: str) -> Rates:
    """A card without a measurement: the H100's measured rates scaled by datasheet ratios (compute, memory)."""
    return Rates(name, {k: v * compute for k, v in _H100["matmul"].items()},
                 memory_bytes_per_second=_H100["memory_bytes_per_second"] * memory,
                 attention={k: (f * compute, b * compute) for k, (f, b) in _H100["attention"].items()},
                 host_seconds_per_op=_H100["host_seconds_per_op"], kernel_floor_seconds=_H100["kernel_floor_seconds"],
                 link_bytes_per_second=link, peak_bf16=peak, overlap=True,
                 sources=("scaled from the measured H100: " + note, *_H100_SOURCE))


RATES = {
    "h100-80gb": Rates("h100-80gb", **_H100, sources=_H100_SOURCE),
    "h200-141gb": _scaled("h200-141gb", 1.0, 4.8 / 3.35, 54e9, 989e12,
                          "datasheet: H200 same dense bf16 as H100 SXM, HBM3e 4.8 TB/s vs 3.35, PCIe Gen5"),
    "a100-80gb": _scaled("a100-80gb", 312 / 989, 2.04 / 3.35, 25e9, 312e12,
                         "datasheet: A100 dense bf16 312 TFLOP/s, HBM2e 2.04 TB/s, PCIe Gen4 ~25 GB/s"),
    "a100-40gb": _scaled("a100-40gb", 312 / 989, 1.56 / 3.35, 25e9, 312e12,
                         "datasheet: A100 40GB dense bf16 312 TFLOP/s, HBM2 1.56 TB/s, PCIe Gen4 ~25 GB/s"),
    "l40s-48gb": _scaled("l40s-48gb", 362 / 989, 0.864 / 3.35, 25e9, 362e12,
                         "datasheet: L40S dense bf16 362 TFLOP/s, GDDR6 864 GB/s, PCIe Gen4 ~25 GB/s"),
    "rtx4090-24gb": _scaled("rtx4090-24gb", 165 / 989, 1.008 / 3.35, 25e9, 165e12,
                            "datasheet: RTX 4090 dense bf16 (fp32 accumulate) 165 TFLOP/s, 1,008 GB/s, PCIe Gen4"),
}


def cpu_rates(cache_dir: Path | None = None, threads: int | None = None) -> Rates:
    """This CPU's rates at `threads` torch threads (default: the current count), measured once (bpt.gpusim.rates,
    ~20 s, bounded) and cached per CPU model, threads and torch. A process that finds another measuring waits for it
    (two at once would each time a busy machine)."""
    cache_dir = cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bpt"
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        path, cpu = _cpu_rates_path(cache_dir)
        measured = _read_json(path)
        if measured is None:
            with _cache_lock(cache_dir, path.stem):
                measured = _read_json(path) or _measure_cpu(path, cpu)
    finally:
        torch.set_num_threads(saved)
    attention = {a["dtype"]: (a["forward_flops_per_second"], a["backward_flops_per_second"])
                 for a in measured["attention"]}
    return Rates("cpu", dict(measured["matmul"]), measured["copy_bytes_per_second"], attention,
                 measured["dispatch"]["seconds_per_op_synced"], 0.0, None, max(measured["matmul"].values()), False,
                 measured["transcendental_per_second"], measured["softmax_per_second"],
                 measured["fresh_bytes_per_second"],
                 (f"measured on this CPU ({measured.get('cpu')}, {measured.get('threads')} threads): {path}",))


def _cpu_rates_path(cache_dir: Path) -> tuple[Path, str]:
    cpu = _cpu_model()
    key = hashlib.sha1(f"{RATES_VERSION}|{cpu}|{torch.__version__}|{torch.get_num_threads()}|"
                       f"{torch.backends.cpu.get_cpu_capability()}".encode()).hexdigest()[:12]
    return cache_dir / f"rates-cpu-{key}.json", cpu


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@contextmanager
def _cache_lock(cache_dir: Path, name: str):
    """An exclusive lock on cache_dir/name.lock while held (none where the directory cannot be written)."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        handle = open(cache_dir / f"{name}.lock", "w")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _measure_cpu(path: Path, cpu: str) -> dict:
    from torch.utils._python_dispatch import _disable_current_modes

    from bpt.gpusim.rates import measure_rates

    print(f"bpt: measuring this CPU's rates for the simulated clock ({torch.get_num_threads()} threads, ~20 s, "
          f"once per machine; cached in {path})", file=sys.stderr, flush=True)
    with _disable_current_modes():  # real tensors, even when asked from inside a simulation
        measured = measure_rates("cpu")
    measured.update(cpu=cpu, threads=torch.get_num_threads())
    try:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(measured))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs the next run the measurement
    return measured


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def rates_for(device_name: str) -> Rates:
    return cpu_rates() if device_name == "cpu" else RATES[device_name]


def attention_flops(func, args: tuple, backward: bool) -> float:
    """Matmul FLOPs of a fused attention kernel from its shapes: QK^T and PV (a causal mask halves them), the
    backward 2.5 times the forward (its five products, the scores recomputed)."""
    names = [a.name for a in func._schema.arguments]
    values = dict(zip(names, args))
    q, k = values.get("query"), values.get("key")
    if q is None or k is None:
        return 0.0
    if q.dim() == 4:  # [batch, heads, tokens, dim]
        forward = 4.0 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
    else:  # varlen [tokens, heads, dim]
        forward = 4.0 * q.shape[1] * q.shape[0] * k.shape[0] * q.shape[2]
    if values.get("is_causal", False):
        forward /= 2
    return forward * (2.5 if backward else 1.0)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class FusedGroup:
    """The memory-bound ops of compiled code between two extern kernels: what one fused kernel reads and writes."""

    def __init__(self, region):
        self.region = region  # the compiled graph it belongs to
        self.made = WeakIdKeyDictionary()  # storage written in the group -> True
        self.reads: dict[int, int] = {}  # id(storage) from outside the group -> bytes read
        self.writes: dict[int, tuple] = {}  # id(storage) -> (weak reference, bytes written)
        self.escaped: set[int] = set()  # id(storage) written in the group and read by eager code before its launch
        self.compute = 0.0

    def read_outside(self, inputs: list) -> None:
        self.escaped.update(id(s) for s in (t.untyped_storage() for t in inputs) if s in self.made)

    def add(self, inputs: list, outputs: list, compute: float) -> None:
        for t in inputs:
            storage = t.untyped_storage()
            if t.dim() and storage not in self.made:
                self.reads[id(storage)] = max(self.reads.get(id(storage), 0), _nbytes([t]))
        for t in outputs:
            storage = t.untyped_storage()
            self.made[storage] = True
            self.writes[id(storage)] = (weakref.ref(storage), max(self.writes.get(id(storage), (None, 0))[1],
                                                                   _nbytes([t])))
        self.compute += compute

    def live_writes(self) -> list[int]:
        return [nbytes for key, (ref, nbytes) in self.writes.items() if ref() is not None or key in self.escaped]

    def bytes_moved(self) -> tuple[int, int]:
        """(bytes read from outside, bytes written that outlive the group)."""
        return sum(self.reads.values()), sum(self.live_writes())


class StepClock:
    """Predicted time of the ops it is shown (`op`), on the host, device and copy timelines of `rates`."""

    def __init__(self, rates: Rates):
        self.rates = rates
        self.host = self.device = self.copies = 0.0
        self.idle = 0.0  # device time spent waiting for the host
        self.kernels = self.ops = self.syncs = 0
        self.by_kind = {"matmul": 0.0, "attention": 0.0, "memory_bound": 0.0, "copies": 0.0}
        self.flops = 0.0
        self.by_op: dict = {}  # kernel op name -> [launches, predicted seconds]
        self.regions: list = []  # the compiled regions being run, innermost last (bpt.compile.fused_region)
        self.group: FusedGroup | None = None  # the memory-bound ops of compiled code not yet launched

    def op(self, func, args: tuple, inputs: list, outputs: list, flops: float) -> None:
        r, packet = self.rates, func.overloadpacket
        if func.namespace == "prim":  # metadata queries (prim::device ...) a fake tensor dispatches, a real one not
            return
        self.ops += 1
        kernel = not (packet in NO_KERNEL or func.is_view or not outputs)
        devices = {t.device.type for t in (*inputs, *outputs) if t.dim()}  # a 0-dim CPU operand is a scalar
        transfer = packet in COPIES and len(devices) > 1 and r.link_bytes_per_second
        attention = any(a in packet.__name__ for a in ATTENTION)
        # a library's own op (bitsandbytes' dequantisation) is a kernel of its own: compiled code does not fuse it
        extern = kernel and bool(flops or attention or transfer or packet in SYNCS or func.namespace != "aten")
        if self.regions and not extern:
            if kernel:  # compiled code: no dispatch per op, its memory-bound ops fuse into one kernel
                self._group_of(self.regions[-1]).add(inputs, outputs, self._compute(packet, outputs))
            return
        if extern:
            self._launch_group()
        elif self.group is not None:  # eager work between a compiled graph's kernels (autograd's accumulation)
            self.group.read_outside(inputs)
        self.host += r.host_seconds_per_op
        if packet in SYNCS:
            self.syncs += 1
            self.host = max(self.host, self.device, self.copies)
        if not kernel:
            return
        if transfer:  # host <-> device: the copy stream
            seconds = _nbytes(outputs) / r.link_bytes_per_second
            self.copies = max(self.copies, self.host) + seconds
            self.by_kind["copies"] += seconds
            return
        dtype = str(inputs[0].dtype).removeprefix("torch.") if inputs else "float32"
        moved = _nbytes(inputs) + _nbytes(outputs)
        if attention:
            backward = "backward" in packet.__name__
            flops = attention_flops(func, args, backward)  # torch's formula ignores the causal mask
            kind, compute = "attention", flops / r.attention_rate(dtype, backward)
        elif flops:
            kind, compute = "matmul", flops / r.matmul_rate(dtype)
        else:
            kind, compute = "memory_bound", self._compute(packet, outputs)
        self.flops += flops
        seconds = max(compute, moved / r.memory_bytes_per_second, r.kernel_floor_seconds)
        if r.fresh_bytes_per_second and packet not in SOFTMAX and not func._schema.is_mutable:
            # a new large output faults its pages in on first touch (the softmax rate was measured with it)
            seconds += self._fresh_seconds(map(_nbytes, ([t] for t in outputs)))
        self._run_kernel(kind, packet.__name__, seconds)

    def _compute(self, packet, outputs: list) -> float:
        """Seconds of a memory-bound op's arithmetic: exp-like functions and softmax rows at their own rates (a CPU
        computes them slower than it moves their bytes), nothing for the rest."""
        r = self.rates
        rate = (r.transcendental_per_second if packet in TRANSCENDENTAL else
                r.softmax_per_second if packet in SOFTMAX else None)
        return max(t.numel() for t in outputs) / rate if rate else 0.0

    def _fresh_seconds(self, sizes) -> float:
        return sum(n for n in sizes if n >= FRESH_BLOCK) / self.rates.fresh_bytes_per_second

    def _run_kernel(self, kind: str, name: str, seconds: float) -> None:
        r = self.rates
        self.kernels += 1
        self.by_kind[kind] += seconds
        entry = self.by_op.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        if r.overlap:
            start = max(self.device, self.host)
            self.idle += start - self.device
            self.device = start + seconds
        else:
            self.host += seconds
            self.device = self.host

    # Compiled code (bpt.compile.fused_region): inductor fuses the elementwise ops and reductions of one graph between
    # two extern kernels (matmuls, attention, transfers) into one kernel that reads each tensor from outside once and
    # writes what is still alive when the next extern kernel comes, or what eager code read meanwhile (a temporary of
    # an expression is never written). A region's autograd nodes are one compiled backward graph (`region_backward`).

    def enter_region(self, region) -> None:
        self.regions.append(region)

    def exit_region(self, region) -> None:
        self.regions.remove(region)  # the group stays open: the next extern kernel launches it

    def region_backward(self, outputs, inputs) -> None:
        """Price the backward of the autograd nodes made between `inputs` and `outputs` (a compiled region's graph)
        as one compiled graph too."""
        region = object()
        stop = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        nodes = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen = set()
        while nodes:
            node = nodes.pop()
            if node is None or node in seen or node in stop or hasattr(node, "variable"):  # variable: a leaf's
                continue
            seen.add(node)
            node.register_prehook(lambda grads: self.enter_region(region))
            node.register_hook(lambda grads_in, grads_out: self.exit_region(region))
            nodes.extend(next_node for next_node, _ in node.next_functions)

    def _group_of(self, region) -> "FusedGroup":
        """The open group of `region`'s graph (another graph's is launched first: graphs do not fuse)."""
        if self.group is not None and self.group.region is not region:
            self._launch_group()
        if self.group is None:
            self.group = FusedGroup(region)
        return self.group

    def _launch_group(self) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        r = self.rates
        reads, writes = group.bytes_moved()
        seconds = max(group.compute, (reads + writes) / r.memory_bytes_per_second, r.kernel_floor_seconds)
        if r.fresh_bytes_per_second:
            seconds += self._fresh_seconds(group.live_writes())
        self.host += r.host_seconds_per_op  # the compiled code's launch of the kernel
        self._run_kernel("memory_bound", "fused (compiled)", seconds)

    def summary(self, tokens: int) -> dict:
        self._launch_group()
        step = max(self.host, self.device, self.copies)
        return {"step_seconds": step, "tokens_per_second": tokens / step if step else None, "clock_tokens": tokens,
                "clock_flops": self.flops,
                "mfu": self.flops / (step * self.rates.peak_bf16) if step else None,
                "kernel_launches": self.kernels, "clock_ops": self.ops, "host_syncs": self.syncs,
                "time_breakdown": {**self.by_kind, "launch_bound_idle": self.idle if self.rates.overlap else 0.0},
                "timelines": {"host": self.host, "device": self.device, "copy_stream": self.copies},
                "clock_device": self.rates.name, "clock_peak_flops": self.rates.peak_bf16,
                "busiest_ops": [{"op": name, "launches": n, "seconds": t} for name, (n, t) in
                                sorted(self.by_op.items(), key=lambda kv: -kv[1][1])[:12]]}

