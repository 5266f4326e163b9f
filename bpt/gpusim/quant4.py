"""A bitsandbytes NF4 layer as the simulation needs it: the bytes it stores and the ones its matmul makes.

bitsandbytes keeps a 4-bit weight as packed uint8 ([out * in / 2, 1]: two values per byte), with double
quantisation one uint8 absmax per 64-value block, one fp32 absmax per 256 of those and a 256-entry fp32 code.
Its matmul (bnb.matmul_4bit) casts the input to the compute dtype, dequantises the whole weight to that dtype
(a transient [out, in] tensor), multiplies, and casts the output back to the input's dtype (Linear4bit.forward);
backward dequantises again for the input gradient and keeps nothing between the two. `Emulated4bitLinear` does
exactly those allocations with uninitialised values: for memory on fake tensors, never for results; its dequantisation
is one op of its own (`dequantize_nf4`), which the clock prices as the kernel bitsandbytes launches (its bytes).
It subclasses nn.Linear so peft's all-linear finds it; `lora_like_bitsandbytes` makes peft wrap it in the LoRA class
it uses for bitsandbytes' layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 64          # values per absmax (bitsandbytes' default 4-bit blocksize)
NESTED_BLOCK = 256  # absmax values per second-level fp32 absmax (double quantisation)


@torch.library.custom_op("bpt_sim::dequantize_nf4", mutates_args=())
def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, rows: int, cols: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes' dequantisation as the simulation sees it: one kernel (its own, not one compile fuses) that reads
    the packed weight and its block scales and writes the [rows, cols] weight; no values."""
    return torch.empty(rows, cols, dtype=dtype, device=packed.device)


@dequantize_nf4.register_fake
def _(packed, absmax, rows, cols, dtype):
    return packed.new_empty(rows, cols, dtype=dtype)


class _Dequantised(torch.autograd.Function):
    """x @ dequantise(packed).T with the weight dequantised in forward and again in backward, never saved."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return F.linear(x, layer.dequantise(x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out @ ctx.layer.dequantise(grad_out.dtype), None


class Emulated4bitLinear(nn.Linear):
    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype
        device = linear.weight.device
        n = self.in_features * self.out_features
        blocks = -(-n // BLOCK)
        self.weight = nn.Parameter(torch.empty((n + 1) // 2, 1, dtype=torch.uint8, device=device),
                                   requires_grad=False)
        self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=device))
        self.register_buffer("absmax2", torch.empty(-(-blocks // NESTED_BLOCK), dtype=torch.float32, device=device))
        self.register_buffer("code", torch.empty(256, dtype=torch.float32, device=device))
        self.bias = None if linear.bias is None else nn.Parameter(
            torch.empty(self.out_features, dtype=compute_dtype, device=device), requires_grad=False)

    def dequantise(self, dtype: torch.dtype) -> torch.Tensor:
        """The transient full weight [out, in] bitsandbytes builds per matmul (values not computed)."""
        return dequantize_nf4(self.weight, self.absmax, self.out_features, self.in_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(self.compute_dtype)
        out = _Dequantised.apply(x, self)
        if self.bias is not None:
            out = out + self.bias.to(self.compute_dtype)
        return out.to(input_dtype)


def quantise_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",),
                     compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace every nn.Linear of `model` except the output layer (bitsandbytes keeps it in 16-bit) by an
    Emulated4bitLinear, in place, as from_pretrained(quantization_config=4-bit) does; returns how many."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swapped = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and child is not output and child_name not in skip:
                setattr(module, child_name, Emulated4bitLinear(child, compute_dtype))
                swapped += 1
    return swapped


def lora_like_bitsandbytes(lora_config):
    """peft wraps a bitsandbytes 4-bit layer in its own LoRA class (peft.tuners.lora.bnb.Linear4bit: no cast of the
    input to the adapter's dtype under autocast, a defensive clone of the base output), not in the plain one it uses
    for nn.Linear: register that class for Emulated4bitLinear too. Returns the config."""
    from peft.tuners.lora.bnb import Linear4bit

    lora_config._register_custom_module({Emulated4bitLinear: Linear4bit})
    return lora_config
