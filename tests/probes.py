"""Structural memory probes shared by the op tests."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestOutput(TorchDispatchMode):
    """Records the largest number of elements any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out
