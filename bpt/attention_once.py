"""Attention once per step: a checkpointed layer's recompute takes the fused attention's output and logsumexp that its
forward kept, instead of running the attention forward again.

torch's non-reentrant checkpoint runs a layer's forward again in backward, attention included: at long context the
attention forward is about a fifth of a step. The fused kernel's backward needs q, k, v (the recompute rebuilds them
from the layer's checkpoint, as it must for the projections' backward anyway), the output and the logsumexp. Keeping
those two from the forward costs one [B, N, Hq * Dv] tensor and a [B, Hq, N] fp32 one per layer, alive until the
layer's backward: about one more checkpoint per layer.

How: the checkpoint's `context_fn` (torch.utils.checkpoint) gives each checkpoint call two contexts, one around its
forward and one around its recompute; `contexts(rule)` makes them around one `Kept` store per call, so a recompute
only ever sees what its own forward kept (in the order the calls ran; each taken entry is checked against the
recompute's q, k, v by shape, dtype and device). The fused attention (bpt.head_groups; inside a checkpoint bpt.attention
takes it for every dense causal or unmasked call, Ulysses' included) asks `current()`: in a forward it keeps what it
computed where the `KeepRule` says so, in a recompute it takes it. Everything else runs as before, no dispatch mode,
nothing per op; the blockwise engine (masks the fused kernel cannot express), varlen and ring attention (one partial
result per hop) recompute. Kept outputs stay on the device (with checkpoint offload too).

`KeepRule`: True keeps, False recomputes, None (auto) keeps where the whole forward's kept bytes (the first call's
times the checkpointed layers) fit in KEEP_SHARE of the device (of the host's memory on a CPU), OFFLOAD_KEEP_SHARE
where the checkpoints are in host memory (the device then holds no layer inputs), decided once per forward at its
first attention call, so every layer of a forward does the same. Simulated Llama-3.1-8B QLoRA on an H100: at 16K and
32K tokens it keeps (4 and 8.6 GiB); at 131K 34 GiB: recomputed without offload (48.6 GiB + 34 would not fit), kept
with it (53 GiB); at the longest lengths recomputed.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch
from torch import Tensor

KEEP_SHARE = 1 / 4  # auto: what a forward's kept attention outputs may take of the device (host on a CPU)
OFFLOAD_KEEP_SHARE = 1 / 2  # ... with the layer checkpoints in host memory

_ACTIVE: list = []  # (store, replaying) of the checkpoint calls being run, innermost last


class KeepRule:
    """Whether one forward keeps its attention outputs: `setting` True / False, or None for auto over `layers`
    checkpointed layers, the checkpoints `offloaded` or not (decided at the forward's first attention call, then
    fixed)."""

    def __init__(self, setting: bool | None, layers: int, offloaded: bool = False):
        self.setting, self.layers = setting, layers
        self.share = OFFLOAD_KEEP_SHARE if offloaded else KEEP_SHARE
        self.decided: bool | None = setting
        self.layer_bytes: int | None = None  # what one layer's attention keeps (its first call's results)
        self.kept_bytes = 0  # what this forward kept, over every layer

    def keeps(self, results: tuple) -> bool:
        global _LAST
        if self.layer_bytes is None:
            _LAST, self.layer_bytes = self, _nbytes(results)
            if self.decided is None:
                device = next(t for t in results if isinstance(t, Tensor)).device
                self.decided = self.layers * self.layer_bytes <= self.share * memory_of(device)
        return self.decided

    def summary(self) -> dict:
        """{"kept": whether the forward kept, "bytes": what keeping takes over every layer, "setting": the rule's}."""
        return {"kept": bool(self.decided), "bytes": self.layers * (self.layer_bytes or 0), "setting": self.setting}


_LAST: KeepRule | None = None


def last_decision(forget: bool = False) -> dict | None:
    """The summary of the latest forward that asked (a simulated step's, read after it), or None; `forget`: and
    none after."""
    global _LAST
    decision = None if _LAST is None else _LAST.summary()
    if forget:
        _LAST = None
    return decision


def _nbytes(results: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in results if isinstance(t, Tensor))


def memory_of(device: torch.device) -> int:
    """The memory of `device`: a CUDA device's (a simulated one's too), else the host's."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Kept:
    """One checkpoint call's kept attention results, in the order its forward made them."""

    def __init__(self, rule: KeepRule):
        self.rule = rule
        self.entries: list[tuple[tuple, tuple]] = []  # (inputs' shapes, dtypes, devices), the kernel's results

    def keep(self, inputs: tuple[Tensor, ...], results: tuple) -> None:
        """Keep a fused attention's results (tensors, and the integers some kernels return beside them)."""
        if self.rule.keeps(results):
            self.entries.append((_signature(inputs), tuple(t.detach() if isinstance(t, Tensor) else t
                                                            for t in results)))
            self.rule.kept_bytes += _nbytes(results)

    def take(self, inputs: tuple[Tensor, ...]) -> tuple | None:
        """The results the forward kept for these inputs (next in order), or None where it kept none."""
        if not self.entries:
            return None
        signature, results = self.entries.pop(0)
        if signature != _signature(inputs):
            raise RuntimeError(f"attention once: the recompute's attention inputs {_signature(inputs)} are not the "
                               f"forward's {signature}; the layer's recompute took another path than its forward "
                               "(patch with attention_once=False to recompute the attention)")
        return results


def _signature(tensors: tuple[Tensor, ...]) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


@contextlib.contextmanager
def _running(store: Kept, replaying: bool):
    _ACTIVE.append((store, replaying))
    try:
        yield
    finally:
        _ACTIVE.pop()


def contexts(rule: KeepRule) -> tuple:
    """A checkpoint call's (forward context, recompute context): torch.utils.checkpoint's `context_fn`."""
    store = Kept(rule)
    return _running(store, False), _running(store, True)


def context_fn(rule: KeepRule) -> Callable[[], tuple]:
    return lambda: contexts(rule)


def current() -> tuple[Kept, bool] | None:
    """(the innermost checkpoint call's store, whether it is being recomputed), or None outside them."""
    return _ACTIVE[-1] if _ACTIVE else None
