"""Blockwise Parallel Transformer computations in pure torch: the engine, and the tools over it.

The engine (pure torch, no transformers): blockwise attention (`bpt.attention` over `bpt.engine`), the chunked MLP,
loss and norms, sequence-parallel attention (`bpt.sequence_parallel`), and the process layout of many-process runs
(`bpt.mesh`: the rank grid and every process group; `bpt.tensor_parallel`: the collectives beside it). It imports
neither `patches` nor `train`.
The tools over it: `bpt.bench` (`python -m bpt.bench`, which benchmarks the patch and so imports transformers and
`patches`: the one tool that reaches up) and `bpt.gpusim` (the simulated GPU it measures on).

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
