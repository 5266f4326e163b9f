"""The one place that calls torch.compile.

Two kinds of compiled code:
- per-block functions (the blockwise attention's steps, the loss chunks) wrapped with `compilable`; callers pass
  `use_compile` decided by `should_compile(config.compile, tensor)`;
- module bodies (`compiled_forward`): a patched module's own forward (the MLP with its LoRA and 4-bit layers, a
  norm, a LoRA projection, the rotary embedding), run whole per chunk, so that the elementwise work between its
  matmuls (casts, SwiGLU, the norm's statistics, LoRA's scale and add) fuses into a few kernels. One compiled
  function per forward's code, shapes dynamic (a chunk's token count, a packed row's length: no recompile per step),
  shared by every layer (parameters are graph inputs).
Where torch.compile cannot run on this platform for a known reason (`unavailable_reason`), the functions run eagerly
after one warning naming the cause. Any other compile or runtime error propagates: a hidden fallback would hide real
bugs (it once did). Fake tensors (the simulated GPU) cannot compile: there compiled code runs eagerly inside
`fused_region()`, which tells the simulation's clock to price it as compiled kernels (bpt.gpusim.clock).
`compile_stats()` counts what was compiled and the wall time of the calls that compiled.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import time
import warnings
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_leaves


def should_compile(setting: bool | None, like: torch.Tensor) -> bool:
    """Resolve the compile switch: None (auto) compiles only for CUDA tensors, where it was measured to help."""
    if setting is None:
        return like.is_cuda
    return bool(setting)


@functools.cache
def unavailable_reason(device_type: str) -> str | None:
    """Why torch.compile cannot run for `device_type` on this machine (a known platform limitation), or None."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile (dynamo) does not support this Python version / platform"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "triton is not installed (pip install triton)"
    elif device_type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except RuntimeError as error:  # raised when no C++ compiler is found
            return f"no C++ compiler for inductor's CPU backend ({error})"
    return None


def _eager_reason(name: str, first: torch.Tensor, warned: set[str]) -> str | None:
    """Why a compiled call on `first` runs eagerly after all (warned once per device type in `warned`), or None."""
    reason = unavailable_reason(first.device.type)
    if reason is not None and first.device.type not in warned:
        warned.add(first.device.type)
        warnings.warn(f"not compiling {name}: {reason}; running it eagerly. Pass compile=False to silence this.")
    return reason


class _Compilable:
    def __init__(self, fn: Callable):
        self.fn = fn
        self.compiled: Callable | None = None
        self.warned: set[str] = set()
        functools.update_wrapper(self, fn)

    def __call__(self, first: torch.Tensor, *args, use_compile: bool = False, **kwargs):
        if use_compile and is_fake(first):
            return _simulated(self.fn, first, *args, **kwargs)
        if use_compile and _eager_reason(self.fn.__name__, first, self.warned) is None:
            if self.compiled is None:
                self.compiled = torch.compile(self.fn, dynamic=True)
            return _counted(self.compiled, first, *args, **kwargs)
        return self.fn(first, *args, **kwargs)


def compilable(fn: Callable) -> _Compilable:
    """Mark a per-block function as a torch.compile candidate."""
    return _Compilable(fn)


def compiled_forward(forward: Callable, setting: bool | None) -> Callable:
    """`forward` (a module's bound forward, or a function) compiled where `should_compile(setting, t)` says so for its
    first tensor argument t, eager otherwise (and inside code that is being compiled already, which inlines it).
    A bound method compiles its class's function, called with the module: one compiled function for every layer."""
    function, owner = (forward.__func__, (forward.__self__,)) if inspect.ismethod(forward) else (forward, ())
    name, warned = getattr(function, "__qualname__", repr(function)), set()

    @functools.wraps(forward)
    def call(*args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or not should_compile(setting, first) or torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        if is_fake(first):
            return _simulated(forward, *args, **kwargs)
        if _eager_reason(name, first, warned) is not None:
            return forward(*args, **kwargs)
        with torch._dynamo.config.patch(**BODY_DYNAMO_CONFIG):
            return _counted(_compiled(function), *owner, *args, **kwargs)

    return call


BODY_BACKEND = "inductor"  # tests trace with "aot_eager" (dynamo and AOT autograd, no C++ build)
# A body's graphs are few but more than one: grad on (a recompute) or off (a chunked forward), an input that needs a
# gradient or not, and per parameter shape (dynamo keeps those static: q and k / v projections differ). Past dynamo's
# default limit of 8 graphs per function the rest would run eagerly; a no-recompile-per-step test holds the count.
BODY_DYNAMO_CONFIG = {"recompile_limit": 16}


_COMPILED: dict[Callable, Callable] = {}  # a body's function -> its compiled version


def _compiled(function: Callable) -> Callable:
    compiled = _COMPILED.get(function)
    if compiled is None:
        compiled = _COMPILED[function] = torch.compile(function, dynamic=True, backend=BODY_BACKEND)
    return compiled


# ----------------------------------------------------------------------------------------------------
# What was compiled, and what the simulation is told
# ----------------------------------------------------------------------------------------------------

_STATS = {"compiling_calls": 0, "compile_seconds": 0.0}


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _counted(compiled: Callable, *args, **kwargs):
    """compiled(*args, **kwargs); a call that made a new graph adds its wall time to the compile seconds."""
    graphs, start = _graphs(), time.perf_counter()
    out = compiled(*args, **kwargs)
    if _graphs() != graphs:
        _STATS["compiling_calls"] += 1
        _STATS["compile_seconds"] += time.perf_counter() - start
    return out


def compile_stats() -> dict:
    """{"graphs": graphs dynamo has made in this process, "compiling_calls": our calls that made one,
    "compile_seconds": their wall time (compiling, and running once), "bodies": the module bodies compiled}."""
    return {"graphs": _graphs(), **_STATS, "bodies": sorted(getattr(f, "__qualname__", repr(f)) for f in _COMPILED)}


_REGION_LISTENERS: list = []  # the simulation's clock: enter_region(r), exit_region(r), region_backward(outputs, inputs)


def _simulated(fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs) as a real device would run it compiled, run eagerly (fake tensors cannot compile): the
    listeners are told where it starts and ends, and which autograd nodes it made (their backward is compiled too)."""
    with fused_region(object()):
        out = fn(*args, **kwargs)
    for listener in list(_REGION_LISTENERS):
        listener.region_backward(tree_leaves(out), tree_leaves((args, kwargs)))
    return out


@contextlib.contextmanager
def fused_region(region):
    """Code that a real device would run as one compiled graph (`region`: any object naming it): the listeners are
    told where it starts and ends."""
    listeners = list(_REGION_LISTENERS)
    for listener in listeners:
        listener.enter_region(region)
    try:
        yield
    finally:
        for listener in reversed(listeners):
            listener.exit_region(region)


@contextlib.contextmanager
def regions_told_to(listener):
    """`listener` hears of every fused region while the block runs."""
    _REGION_LISTENERS.append(listener)
    try:
        yield
    finally:
        _REGION_LISTENERS.remove(listener)
