"""The one place that calls torch.compile.

Per-block functions are wrapped with `compilable`; callers pass `use_compile` decided by
`should_compile(config.compile, tensor)`. Where torch.compile cannot run on this platform for a known
reason (`unavailable_reason`), the functions run eagerly after one warning naming the cause. Any other
compile or runtime error propagates: a hidden fallback would hide real bugs (it once did).
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch


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


class _Compilable:
    def __init__(self, fn: Callable):
        self.fn = fn
        self.compiled: Callable | None = None
        self.warned: set[str] = set()
        functools.update_wrapper(self, fn)

    def __call__(self, first: torch.Tensor, *args, use_compile: bool = False, **kwargs):
        if use_compile:
            device_type = first.device.type
            reason = unavailable_reason(device_type)
            if reason is None:
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn, dynamic=True)
                return self.compiled(first, *args, **kwargs)
            if device_type not in self.warned:
                self.warned.add(device_type)
                warnings.warn(f"not compiling {self.fn.__name__}: {reason}; running it eagerly. "
                              "Pass compile=False to silence this.")
        return self.fn(first, *args, **kwargs)


def compilable(fn: Callable) -> _Compilable:
    """Mark a per-block function as a torch.compile candidate."""
    return _Compilable(fn)
