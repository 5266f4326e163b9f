"""What a simulated step allocates and computes, seen op by op (works on fake and on real tensors).

- `AllocationTracker`: every tensor storage from the op that creates it until its last user dies (a weak
  reference per storage), so the sum is what the CUDA caching allocator has handed out
  (`torch.cuda.memory_allocated`, blocks rounded up to 512 bytes on CUDA) and its peak is
  `max_memory_allocated`. It also keeps the largest holders at the peak (op, shape, dtype, bytes), the
  FLOPs of every op torch's flop counter knows, by dtype, and the op count; with `shapes=True` also the shape
  of every op output (structural checks: no op made an N x N or N x vocab tensor); with `clock` a
  bpt.gpusim.clock.StepClock times every op.
- `flash_backward_workspace`: the transient buffers FlashAttention-2's backward allocates inside the op.
- `DataOracle`: answers the data-dependent reads fake tensors cannot (nonzero, item) and logs where.
- `materialize_fake`: a meta (or real) module's parameters and buffers as fake tensors on a device.
"""
from __future__ import annotations

import heapq
import os
import traceback
import weakref
from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
_PRIM_DEVICE = torch.ops.prim.device.default
CUDA_BLOCK = 512  # the caching allocator's rounding of every block


def allocated_bytes(nbytes: int, device: torch.device) -> int:
    """Bytes the allocator hands out for a storage of nbytes on device."""
    if device.type == "cuda":
        return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK
    return nbytes


class AllocationTracker(TorchDispatchMode):
    """Live and peak allocated bytes of the storages created under it (and of those passed to `track`).

    phase: a label the caller sets ("forward", "backward") and that the peak records.
    workspace(func, args) -> bytes: transient bytes an op allocates internally, counted during that op only.
    top: how many of the largest live storages to keep at the peak.
    shapes: also count the outputs of every op by (op, shape) in `output_shapes` (views and in-place results too).
    host_apart: count CPU storages (host memory of a simulated GPU: offloaded checkpoints) in `host_live` /
        `host_peak` instead of the device figures.
    """

    def __init__(self, *, top: int = 10, workspace=None, shapes: bool = False, host_apart: bool = False,
                 clock=None):
        super().__init__()
        self.clock = clock  # a bpt.gpusim.clock.StepClock shown every op, or None
        self.host_apart, self.host_live, self.host_peak = host_apart, 0, 0
        self.top, self.workspace = top, workspace
        self.output_shapes: Counter | None = Counter() if shapes else None  # (op, shape) -> outputs
        self.live = self.peak = 0
        self.peak_phase, self.peak_op = "", ""
        self.peak_holders: list[dict] = []
        self.phase, self.ops = "", 0
        self.flops: Counter = Counter()  # dtype name -> FLOPs
        self._sizes = WeakIdKeyDictionary()  # storage -> bytes
        self._holders: dict[int, tuple] = {}  # id(storage) -> (bytes, op, shape, dtype)
        self._op = "before"

    def track(self, *tensors: torch.Tensor) -> None:
        """Count storages that already exist (weights, optimizer state) as live."""
        for t in tensors:
            self._add(t)
        self._update(0)

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._sizes:
            return
        size = allocated_bytes(storage.nbytes(), t.device)
        self._sizes[storage] = size
        if self.host_apart and t.device.type == "cpu":
            self.host_live += size
            self.host_peak = max(self.host_peak, self.host_live)
            weakref.finalize(storage, self._free_host, size)
            return
        self.live += size
        self._holders[id(storage)] = (size, self._op, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        weakref.finalize(storage, self._free, size, id(storage))

    def _free_host(self, size: int) -> None:
        self.host_live -= size

    def _free(self, size: int, key: int) -> None:
        self.live -= size
        self._holders.pop(key, None)

    def _update(self, extra: int) -> None:
        if self.live + extra <= self.peak:
            return
        self.peak = self.live + extra
        self.peak_phase, self.peak_op = self.phase, self._op
        if self.top:
            largest = heapq.nlargest(self.top, self._holders.values(), key=lambda h: h[0])
            self.peak_holders = [{"bytes": b, "op": op, "shape": list(shape), "dtype": dtype}
                                 for b, op, shape, dtype in largest]
            if extra:
                self.peak_holders.append({"bytes": extra, "op": self._op, "shape": [], "dtype": "workspace"})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and type(args[0]) is FakeTensor:
            # a fake tensor's device, asked by C++ (most of a simulated step's dispatches): counted as an op, and
            # answered as FakeTensorMode's handler would, without the modes below (it allocates nothing, no FLOPs)
            self._op = "device"
            self.ops += 1  # (the clock counts no prim op)
            return args[0].device
        kwargs = kwargs or {}
        self._op = func.overloadpacket.__name__
        extra = self.workspace(func, args) if self.workspace else 0
        out = func(*args, **kwargs)
        self.ops += 1
        formula, flops = flop_registry.get(func.overloadpacket), 0
        if formula is not None:
            first = _tensors(args)[0]
            shapes = [a for a in args if not isinstance(a, torch.dtype)]  # bmm(..., out_dtype): torch's formula has none
            if "scaled_dot_product" in self._op:
                shapes = _query_heads(shapes)
            flops = formula(*shapes, **kwargs, out_val=out)
            self.flops[str(first.dtype).removeprefix("torch.")] += flops
        outputs = _tensors(out)
        if self.clock is not None:
            self.clock.op(func, args, _tensors(kwargs, _tensors(args)), outputs, flops)
        for t in outputs:
            self._add(t)
            if self.output_shapes is not None:
                self.output_shapes[self._op, tuple(t.shape)] += 1
        self._update(extra)
        return out

    def summary(self) -> dict:
        return {"peak_bytes": self.peak, "host_peak_bytes": self.host_peak, "peak_phase": self.peak_phase,
                "peak_op": self.peak_op,
                "peak_holders": self.peak_holders, "flops_by_dtype": dict(self.flops), "ops": self.ops}


def _tensors(tree, found: list | None = None) -> list:
    """The tensors among an op's arguments or results (appended to `found`), in torch.utils._pytree's leaf order: an
    op takes and returns them in tuples, lists and dicts only. tree_leaves' answer, filtered, at a fraction of its
    cost (three calls per op were a tenth of a simulated step's time)."""
    found = [] if found is None else found
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            _tensors(item, found)
    elif isinstance(tree, dict):
        for item in tree.values():
            _tensors(item, found)
    return found


def _query_heads(args: list) -> list:
    """SDPA arguments for torch's flop formula with grouped key / value heads given as the query's head count
    (as shapes: the formula reads shapes only; torch < 2.13's formula refuses grouped heads, and 2.13's counts
    them this way)."""
    heads = max((a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4), default=0)
    return [torch.Size([a.shape[0], heads, *a.shape[2:]])
            if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] != heads and heads % a.shape[1] == 0
            else a for a in args]


def flash_backward_workspace(func, args) -> int:
    """Bytes FlashAttention-2's backward allocates inside the op: softmax_d [B, H, Nq_128] fp32 and dq_accum
    [B, Nq_128, H, D_32] fp32 (lengths rounded to 128, head dim to 32), and with grouped-query heads dk / dv
    at the query heads' count [B, Nk, Hq, D] before they are summed down; and a copy of the output gradient and
    of the output wherever they are not contiguous in [B, N, H, D] (aten's `_flash_attention_backward` makes them
    so: a slice of some of the heads of a [B, N, H, D] tensor is not)."""
    if func is not aten._scaled_dot_product_flash_attention_backward.default:
        return 0
    q, k = args[1], args[2]
    b, hq, nq, d = q.shape
    nq_r, d_r = -(-nq // 128) * 128, -(-d // 32) * 32
    size = allocated_bytes(b * hq * nq_r * 4, q.device) + allocated_bytes(b * nq_r * hq * d_r * 4, q.device)
    if k.shape[1] != hq:
        size += 2 * allocated_bytes(b * k.shape[2] * hq * d * q.element_size(), q.device)
    for t in (args[0], args[4]):  # dout, out: copied where not contiguous in the kernel's [B, N, H, D] layout
        if not t.transpose(1, 2).is_contiguous():
            size += allocated_bytes(t.numel() * t.element_size(), t.device)
    return size


class DataOracle(TorchDispatchMode):
    """Answers data-dependent reads of fake tensors: nonzero -> every element nonzero (the most rows),
    item() -> 1 / True. Each answer is counted under the first caller outside torch, so a simulation that
    leaned on one says where (`answers`)."""

    def __init__(self):
        super().__init__()
        self.answers: Counter = Counter()

    def _note(self, what: str) -> None:
        site = "?"
        for frame in reversed(traceback.extract_stack()[:-2]):
            if f"{os.sep}torch{os.sep}" not in frame.filename and not frame.filename.endswith("tracker.py"):
                site = f"{os.path.basename(frame.filename)}:{frame.lineno}"
                break
        self.answers[f"{what}@{site}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and type(args[0]) is FakeTensor:  # as FakeTensorMode's handler answers it
            return args[0].device
        kwargs = kwargs or {}
        if func is aten.nonzero.default:
            self._note("nonzero")
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        if func is aten._local_scalar_dense.default:
            self._note("item")
            x = args[0]
            return True if x.dtype == torch.bool else (1.0 if x.is_floating_point() else 1)
        return func(*args, **kwargs)


def materialize_fake(module: torch.nn.Module, fake_mode, device: torch.device | str) -> torch.nn.Module:
    """Every parameter and buffer of `module` (on meta or real) replaced, in place, by a fake tensor of the same
    shape, stride, dtype and requires_grad on `device`; tied tensors stay tied. (Module.to cannot: it swaps
    tensor contents, and fake tensors refuse the swap.)"""
    made: dict[int, torch.Tensor] = {}
    with fake_mode:
        for sub in module.modules():
            for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    if id(t) not in made:
                        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                        made[id(t)] = torch.nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake
                    table[name] = made[id(t)]
    return module
