"""The simulated devices: what a GPU of each kind has, and the rules its fused attention kernels follow.

Memory is the total the driver reports (nvidia-smi) for that card, nominal; the CUDA context, cuBLAS
workspaces and allocator slack come off it as RESERVE_BYTES. Kernel rules are torch's SDPA rules for the
card's compute capability (torch 2.x, sdp_utils): FlashAttention-2 needs sm80+, fp16/bf16, no mask, equal
head dims <= 256 (<= 192 for backward on sm86/sm89), and a square causal mask; memory-efficient attention
takes fp32 too and a dense mask but no grouped-query heads; cuDNN attention comes after the math kernel in
torch's default order, so it is never the one chosen and is not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20

# What a step cannot have of the card's nominal memory: the memory the driver keeps from torch, the CUDA context,
# cuBLAS / kernel workspaces and the caching allocator's fragmentation, none of which a simulation sees. Measured
# (python -m bpt.bench --gpu_check, one H100 80GB HBM3, docs/bench/gpu_check-h100-80gb.json): torch's total is
# 79.18 GiB of nvidia-smi's 79.65, a CUDA context took 0.51 GiB, and max_memory_allocated of a step was 0.1-2.1%
# (at most 67 MiB) above the simulated peak: about 1.05 GiB in all, so 2 GiB leaves ~0.95 GiB for fragmentation.
RESERVE_BYTES = 2 * GIB


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int | None      # None: fake CPU tensors, no capacity
    capability: tuple[int, int] | None = None

    @property
    def is_cuda(self) -> bool:
        return self.capability is not None

    @property
    def label(self) -> str:
        return f"simulated {self.name}"

    @property
    def usable_bytes(self) -> int | None:
        """What a training step may take: capacity minus RESERVE_BYTES."""
        return None if self.memory_bytes is None else self.memory_bytes - RESERVE_BYTES

    def fused_attention(self, q, k, v, attn_mask=None, is_causal=False, enable_gqa=False) -> str | None:
        """"flash" or "efficient": the fused SDPA kernel torch picks on this GPU for these inputs; None: math."""
        import torch

        if not self.is_cuda or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return None
        if not (q.dtype == k.dtype == v.dtype) or 0 in (q.shape[-2], k.shape[-2]):
            return None
        if any(t.stride(-1) != 1 for t in (q, k, v)) or q.shape[0] != k.shape[0] or k.shape[1] != v.shape[1]:
            return None
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
        grouped = hq != hkv
        if grouped and not (enable_gqa and hq % hkv == 0):
            return None
        if self.capability >= (8, 0) and q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None \
                and k.shape[-1] == d and v.shape[-1] == d and d <= self._flash_head_dim(q, k, v) \
                and not (is_causal and q.shape[-2] != k.shape[-2]):
            return "flash"
        half = q.dtype in (torch.float16, torch.bfloat16)
        if q.dtype == torch.bfloat16 and self.capability < (8, 0) or not (half or q.dtype == torch.float32):
            return None
        align = 8 if half else 4
        if grouped or d % align or k.shape[-1] != d or v.shape[-1] % align:
            return None
        return "efficient"

    def _flash_head_dim(self, q, k, v) -> int:
        training = q.requires_grad or k.requires_grad or v.requires_grad
        return 192 if training and self.capability in ((8, 6), (8, 9)) else 256


DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("h100-80gb", 81559 * MIB, (9, 0)),
    Device("h200-141gb", 143771 * MIB, (9, 0)),
    Device("a100-80gb", 81920 * MIB, (8, 0)),
    Device("a100-40gb", 40960 * MIB, (8, 0)),
    Device("l40s-48gb", 46068 * MIB, (8, 9)),
    Device("rtx4090-24gb", 24564 * MIB, (8, 9)),
    Device("cpu", None),  # fake CPU tensors: held against a real CPU step of the same bench
)}


def device(name: str) -> Device:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown simulated device {name!r}; choose one of {', '.join(DEVICES)}") from None
