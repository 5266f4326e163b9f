"""Blockwise Parallel Transformer computations in pure torch.

`from bpt import apply_bpt_patch` is the user entry point; it lives in `patches` (which knows
transformers) and is re-exported lazily here so that `bpt` itself never imports transformers.
"""
from bpt.config import BPTConfig

_FROM_PATCHES = ("apply_bpt_patch", "is_patched", "BPTPatchHandle", "UnsupportedModelError")

__all__ = ["BPTConfig", *_FROM_PATCHES]


def __getattr__(name):
    if name in _FROM_PATCHES:
        import patches

        return getattr(patches, name)
    raise AttributeError(f"module 'bpt' has no attribute {name!r}")
