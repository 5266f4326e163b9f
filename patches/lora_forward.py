"""A LoRA layer's adapter added by its second matmul, not by peft's elementwise tail.

peft adds a vanilla adapter as `result + lora_B(lora_A(dropout(x))) * scaling`: after the two small matmuls come
passes over the whole [N, out] output (the scale, the add, on a 4-bit layer a defensive clone of the base output) and
in the backward one more (the scale's). Where the dropout is the identity (p = 0, the default run's and most
recipes'), the same sum is one GEMM with an accumulating epilogue, `addmm(result, lora_A(x), B.T, alpha=scaling)`:
cuBLAS (and the CPU's BLAS) adds alpha * h @ B.T to the base output in its accumulator, one rounding instead of three
in bf16, and the scale's backward falls on [N, r] and [r, out] instead of [N, out].

Everything else is peft's own forward: a dropout that draws a mask, a variant (DoRA), a LoRA bias, merged or disabled
adapters, a mixed batch's adapter_names, a base that is not a linear layer, a lora_B whose weight is gathered by a hook
when it is called (ZeRO-3), and adapters of another dtype than their input without autocast (fp32
adapters on a bf16 base: peft rounds the adapter's output to bf16 before the add, which one GEMM cannot do; a GPU run
trains under autocast, where the GEMM runs in the autocast dtype as peft's matmuls do).
"""
from __future__ import annotations

import types

import torch


def lora_epilogue_forward(layer):
    """`layer`'s forward (a peft LoRA linear whose forward is its class's) with each vanilla adapter added by addmm
    (above). A bound method: compiled (bpt.compile.compiled_forward), one function serves every layer."""
    return types.MethodType(epilogue_forward, layer)


def epilogue_forward(layer, x, *args, **kwargs):
    adapters = None if args or kwargs or not isinstance(x, torch.Tensor) else _vanilla_adapters(layer, x)
    if adapters is None:
        return type(layer).forward(layer, x, *args, **kwargs)  # peft's
    result = layer.base_layer(x)
    out_dtype = result.dtype
    for name in adapters:
        lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
        h = lora_A(layer._cast_input_dtype(x, lora_A.weight.dtype))
        flat = result.reshape(-1, result.shape[-1])
        if not torch.is_autocast_enabled(x.device.type):  # (autocast casts addmm's operands itself)
            flat = flat.to(h.dtype)
        result = torch.addmm(flat, h.reshape(-1, h.shape[-1]), lora_B.weight.t(),
                             alpha=layer.scaling[name]).view(*result.shape[:-1], -1)
    return result.to(out_dtype)


def _vanilla_adapters(layer, x: torch.Tensor) -> list[str] | None:
    """The active adapters' names where each is a plain low-rank product with the identity for dropout; None where any
    is not, where its dtype is not its input's and autocast is off, or where the layer is merged or disabled (peft's
    forward then)."""
    if layer.disable_adapters or layer.merged or getattr(layer, "lora_embedding_A", None):  # an embedding's own
        return None
    if not isinstance(layer.get_base_layer(), torch.nn.Linear):  # e.g. a router returning a tuple (Mixtral's gate)
        return None
    names = [name for name in layer.active_adapters if name in layer.lora_A]
    for name in names:
        if name in getattr(layer, "lora_variant", {}) or not _is_identity(layer.lora_dropout[name]):
            return None
        lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
        if not (type(lora_A) is type(lora_B) is torch.nn.Linear) or lora_B.bias is not None or not _plain(lora_B):
            return None
        if lora_A.weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            return None  # fp32 adapters on a bf16 base without autocast: peft rounds their output before the add
    return names


def _plain(module: torch.nn.Module) -> bool:
    """Whether `module`'s weight can be read without calling it: no hooks or wrapped forward that gather it first
    (DeepSpeed ZeRO-3 partitions each module's weights and gathers them in its pre-forward hook; accelerate's offload
    replaces the forward) and a whole 2-D matrix."""
    return (not module._forward_pre_hooks and not module._forward_hooks and "forward" not in vars(module)
            and module.weight.dim() == 2)


def _is_identity(dropout) -> bool:
    return isinstance(dropout, torch.nn.Identity) or not dropout.training or dropout.p == 0
