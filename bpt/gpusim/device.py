"""`simulate(device)`: run real code on fake tensors of a simulated device, with that device's rules.

Inside the context, tensors created on "cuda" are fake (FakeTensorMode: shapes, dtypes, strides, no data) and
the process answers as the chosen GPU would:
- torch.cuda's RNG, seed, synchronize and device queries (activation checkpointing and dropout call them);
- torch.autocast("cuda") casts (torch refuses it while it thinks CUDA is unavailable);
- F.scaled_dot_product_attention on CUDA tensors runs the fused kernel that GPU would pick (flash or
  memory-efficient; a CPU build of torch would always take the O(N^2) math decomposition), and
  torch.backends.cuda.can_use_* answer by the same rules, so code that asks torch which kernel applies
  (bpt.attention) gets the GPU's answer;
- data-dependent reads are answered by a DataOracle (and logged).
For "cpu", tensors are fake CPU tensors and nothing else changes: a simulation to hold against a real CPU step.
Needs the shim in the process for CUDA (bpt.gpusim.shim.boot_command); `SimulationError` says so otherwise.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from bpt.gpusim.gpus import Device
from bpt.gpusim.tracker import DataOracle

aten = torch.ops.aten


class SimulationError(RuntimeError):
    pass


@dataclass
class Simulation:
    device: Device
    fake_mode: FakeTensorMode
    oracle: DataOracle
    attention_paths: Counter = field(default_factory=Counter)  # "sdpa-flash" / "sdpa-efficient" / "sdpa-math" -> calls
    # What the device has free now (torch.cuda.mem_get_info's first answer): the step's tracker sets it from the bytes
    # it counts; None: all the usable memory.
    free_bytes: Callable[[], int] | None = None

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", 0) if self.device.is_cuda else torch.device("cpu")


def _rng_state(device="cuda"):
    return torch.zeros(16, dtype=torch.uint8)


def _cuda_answers(sim: Simulation) -> dict:
    """(object, attribute) -> what the simulated GPU answers."""
    import torch.cuda.amp.common as amp_common

    device = sim.device

    def can_use(kernel):
        def predicate(params, debug=False):
            q = params.query
            return q.is_cuda and device.fused_attention(q, params.key, params.value, params.attn_mask,
                                                        params.is_causal, params.enable_gqa) == kernel
        return predicate

    return {
        (amp_common, "amp_definitely_not_available"): lambda: False,
        (torch.cuda, "is_bf16_supported"): lambda including_emulation=True: device.capability >= (8, 0),
        (torch.cuda, "get_rng_state"): _rng_state,
        (torch.cuda, "set_rng_state"): lambda new_state, device="cuda": None,
        (torch.cuda, "get_rng_state_all"): lambda: [_rng_state()],
        (torch.cuda, "set_rng_state_all"): lambda new_states: None,
        (torch.cuda, "manual_seed"): lambda seed: None,
        (torch.cuda, "manual_seed_all"): lambda seed: None,
        (torch.cuda, "synchronize"): lambda device=None: None,
        (torch.cuda, "current_device"): lambda: 0,
        (torch.cuda, "device_count"): lambda: 1,
        (torch.cuda, "get_device_capability"): lambda device_=None: device.capability,
        # (free, total); the allocator's cache is empty: what is not allocated is free
        (torch.cuda, "mem_get_info"): lambda device_=None: (sim.free_bytes() if sim.free_bytes else device.usable_bytes,
                                                            device.memory_bytes),
        (torch.cuda, "memory_reserved"): lambda device_=None: 0,
        (torch.cuda, "memory_allocated"): lambda device_=None: 0,
        (torch.backends.cuda, "can_use_flash_attention"): can_use("flash"),
        (torch.backends.cuda, "can_use_efficient_attention"): can_use("efficient"),
        (torch.backends.cuda, "can_use_cudnn_attention"): lambda params, debug=False: False,
    }


def _routed_sdpa(sim: Simulation, stock_sdpa):
    """F.scaled_dot_product_attention as the simulated GPU runs it.

    A module attribute, not a TorchFunctionMode: modes are thread-local and the autograd engine runs a CUDA
    backward (and a checkpoint's recompute in it) on its device thread, where a mode would not route."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not (isinstance(query, torch.Tensor) and query.is_cuda):
            return stock_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
        if torch.is_autocast_enabled("cuda"):  # SDPA is on autocast's lower-precision list
            dtype = torch.get_autocast_dtype("cuda")
            query, key, value = (t.to(dtype) if t.dtype in (torch.float32, torch.float16, torch.bfloat16) else t
                                 for t in (query, key, value))
        kernel = sim.device.fused_attention(query, key, value, attn_mask, is_causal, enable_gqa)
        sim.attention_paths[f"sdpa-{kernel or 'math'}"] += 1
        with torch.autocast("cuda", enabled=False):
            if kernel == "flash":
                return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                                scale=scale)[0]
            if kernel == "efficient":
                bias = attn_mask
                if bias is not None and bias.dtype == torch.bool:
                    bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill_(~bias, float("-inf"))
                if bias is not None:
                    bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
                grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
                return aten._scaled_dot_product_efficient_attention(query, key, value, bias, grad, dropout_p,
                                                                    is_causal, scale=scale)[0]
            return stock_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)

    return sdpa


@contextlib.contextmanager
def _set_attributes(values: dict):
    saved = {key: getattr(*key) for key in values}
    try:
        for (owner, name), value in values.items():
            setattr(owner, name, value)
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def simulate(device: Device, fake_mode: FakeTensorMode | None = None):
    """The simulated device for the duration of the block; yields a `Simulation` (fake mode, oracle, paths)."""
    if device.is_cuda:
        from bpt.gpusim.shim import active

        if not active():
            raise SimulationError("simulated CUDA needs the bpt.gpusim shim loaded before torch: start the process "
                                  "with bpt.gpusim.shim.boot_command (python -m bpt.bench --simulate does)")
    sim = Simulation(device, fake_mode or FakeTensorMode(allow_non_fake_inputs=False), DataOracle())
    with contextlib.ExitStack() as stack:
        if device.is_cuda:
            stack.enter_context(_set_attributes({
                **_cuda_answers(sim),
                (F, "scaled_dot_product_attention"): _routed_sdpa(sim, F.scaled_dot_product_attention)}))
        stack.enter_context(sim.fake_mode)
        stack.enter_context(sim.oracle)
        yield sim
