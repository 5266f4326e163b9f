"""The one place that calls torch.compile.

Per-block functions are wrapped with `compilable`; callers pass `use_compile` decided by
`should_compile(config.compile, tensor)`. A compile failure warns once and falls back to eager.
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


class _Compilable:
    def __init__(self, fn: Callable):
        self.fn = fn
        self.compiled: Callable | None = None
        self.failed = False
        functools.update_wrapper(self, fn)

    def __call__(self, *args, use_compile: bool = False, **kwargs):
        if use_compile and not self.failed:
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn, dynamic=True)
                return self.compiled(*args, **kwargs)
            except Exception as error:  # compile support varies by platform: never let it stop training
                self.failed = True
                warnings.warn(f"torch.compile of {self.fn.__name__} failed ({type(error).__name__}: {error}); "
                              "running it eagerly from now on. Pass compile=False to silence this.")
        return self.fn(*args, **kwargs)


def compilable(fn: Callable) -> _Compilable:
    """Mark a per-block function as a torch.compile candidate."""
    return _Compilable(fn)
