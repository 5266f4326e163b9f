"""The simulated devices: what a GPU of each kind has, and the rules its fused attention kernels follow.

Memory is the total the driver reports (nvidia-smi) for that card, nominal; the CUDA context, cuBLAS
workspaces and allocator slack come off it as RESERVE_BYTES. Kernel rules are torch's SDPA rules for the
card's compute capability (torch 2.x, sdp_utils): FlashAttention-2 needs sm80+, fp16/bf16, no mask, equal
head dims <= 256 (<= 192 for backward on sm86/sm89), and a square causal mask; memory-efficient attention
takes fp32 too and a dense mask but no grouped-query heads; cuDNN attention comes after the math kernel in
torch's default order, so it is never the one chosen and is not modelled. `MACHINES`: the machine each card comes in
(GPUs, host memory, NVLink and network bandwidth per GPU, with sources), for the exchange's price and host memory.
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


@dataclass(frozen=True)
class Machine:
    """The machine a card comes in: what its ranks exchange over and the host memory they share.

    Bandwidths are bytes per second EACH WAY per GPU, nominal (datasheets): NCCL reaches less, so an exchange priced
    at them is the least it can cost. Within a machine every GPU reaches the others through its own NVLink (NVSwitch:
    the bandwidth is the GPU's, shared by its peers); across machines through its own network adapter."""
    gpus: int                       # GPUs per machine
    host_bytes: int                 # system memory of the machine, shared by its processes (the OS and the
                                    # processes' own memory not taken off: what the offloaded tensors may at most use)
    nvlink_bytes_per_second: float  # to the other GPUs of the machine (PCIe where there is no NVLink)
    network_bytes_per_second: float  # to GPUs of other machines
    sources: tuple = ()

    def host_bytes_per_process(self, processes: int) -> int:
        """What each of `processes` processes of one run on this machine may hold (its share of the machine)."""
        return self.host_bytes // max(1, min(processes, self.gpus))


TB = 1 << 40  # system memory is sold in binary units (DIMMs of 2^k GiB): "2 TB" is 2,048 GiB
_DGX_H = ("datasheet: NVIDIA DGX H100 / H200, 8 GPUs, NVLink 4 (18 links, 900 GB/s bidirectional per GPU: 450 each "
          "way), 8 x ConnectX-7 400 Gb/s InfiniBand (one per GPU: 50 GB/s each way), 2 TB system memory",)
_DGX_A = ("datasheet: NVIDIA DGX A100, 8 GPUs, NVLink 3 (600 GB/s bidirectional per GPU: 300 each way), 8 x "
          "ConnectX-6 200 Gb/s InfiniBand (one per GPU: 25 GB/s each way), 2 TB system memory (640 GB model; 1 TB for "
          "the 320 GB model of 40 GB cards)",)
_PCIE = ("assumed: an 8-GPU PCIe Gen4 server (no NVLink: peers over PCIe x16, ~32 GB/s each way), one 200 Gb/s "
         "network adapter per two GPUs (12.5 GB/s each way per GPU), 1 TB system memory",)
MACHINES: dict[str, Machine] = {
    "h100-80gb": Machine(8, 2 * TB, 450e9, 50e9, _DGX_H),
    "h200-141gb": Machine(8, 2 * TB, 450e9, 50e9, _DGX_H),
    "a100-80gb": Machine(8, 2 * TB, 300e9, 25e9, _DGX_A),
    "a100-40gb": Machine(8, 1 * TB, 300e9, 25e9, _DGX_A),
    "l40s-48gb": Machine(8, 1 * TB, 32e9, 12.5e9, _PCIE),
    "rtx4090-24gb": Machine(8, 1 * TB, 32e9, 12.5e9, _PCIE),
}


def machine(name: str, gpus: int | None = None, host_bytes: int | None = None) -> Machine | None:
    """The machine of simulated device `name` (None for the CPU), with its GPUs per machine and host memory
    overridden where given."""
    base = MACHINES.get(name)
    if base is None:
        return None
    return Machine(gpus or base.gpus, host_bytes or base.host_bytes, base.nvlink_bytes_per_second,
                   base.network_bytes_per_second, base.sources)


def device(name: str) -> Device:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown simulated device {name!r}; choose one of {', '.join(DEVICES)}") from None
