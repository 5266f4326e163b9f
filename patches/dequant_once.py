"""One dequantisation of a 4-bit base weight for both the recompute and the backward of a checkpointed layer.

bitsandbytes' 4-bit matmul keeps only the packed weight for its backward, which dequantises it again. Under gradient
checkpointing a step so dequantises every base weight three times: in the forward, in the checkpoint's recompute and
in the backward, each time a whole [out, in] weight written in the compute dtype (and, on a GPU, a few launches of
host work; the measured 4-bit step had its GPU idle a quarter of the time). In a checkpointed decoder layer nothing
the first forward saves is kept, so there the patch's 4-bit layer multiplies by a dequantised weight that autograd
saves: the recompute's copy is the one the backward reads, and a step dequantises each weight twice. Its values are
bitsandbytes' own (the same dequantisation to the compute dtype, the same matmul, autocast off as inside its op).

The price: a weight the recompute dequantised stays until the backward has used it. A layer's recompute runs its
attention (the MLP, chunked, recomputes in its own backward, a chunk at a time), so one layer's attention projections
are held through its backward, and the MLP's weights during each chunk's backward: Llama-3.1-8B in bf16, 84 MB and
352 MB more. Elsewhere (no checkpointing, evaluation, no gradient) the layer runs as bitsandbytes does: saved in an
unchecked forward, every layer's dequantised weights would stay until the backward, the whole model in 16 bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def is_4bit_linear(module: torch.nn.Module) -> bool:
    """bitsandbytes' Linear4bit (a Params4bit weight of its own: a LoRA wrapper only shows its base layer's) or the
    simulation's emulated one (bpt.gpusim.quant4)."""
    weight = module._parameters.get("weight")
    return weight is not None and (type(weight).__name__ == "Params4bit" or hasattr(module, "dequantise"))


def dequantising_once_forward(module: torch.nn.Module, original, layer: torch.nn.Module):
    """`module`'s forward (a 4-bit linear of the decoder layer `layer`): while `layer` is checkpointed (HF's
    GradientCheckpointingLayer: training with gradient checkpointing on) and the input needs a gradient, x @ W.T + b
    with W dequantised once and saved; otherwise `original`."""

    def forward(x, *args, **kwargs):
        if (args or kwargs or not isinstance(x, torch.Tensor) or not (layer.gradient_checkpointing and layer.training)
                or not (torch.is_grad_enabled() and x.requires_grad)
                or not getattr(module, "compute_type_is_set", True)):  # bitsandbytes' first call settles its dtype
            return original(x, *args, **kwargs)
        dtype = module.compute_dtype or x.dtype  # bitsandbytes computes in its compute dtype where it has one
        weight = _dequantised(module, dtype)
        if weight is None:
            return original(x, *args, **kwargs)
        bias = None if module.bias is None else module.bias.to(dtype)
        with torch.autocast(x.device.type, enabled=False):  # as inside bitsandbytes' op, which autocast passes by
            out = F.linear(x.to(dtype), weight, bias)
        return out.to(x.dtype)

    return forward


def _dequantised(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """The whole weight [out, in] in `dtype`, dequantised as bitsandbytes' matmul does; None where the weight has no
    quantisation state to read (bitsandbytes then restores it in its own forward)."""
    if hasattr(module, "dequantise"):  # the simulation's layer
        return module.dequantise(dtype)
    from bitsandbytes.functional import dequantize_4bit

    state = getattr(module.weight, "quant_state", None)
    if state is None:
        return None
    return dequantize_4bit(module.weight, state).to(dtype)
