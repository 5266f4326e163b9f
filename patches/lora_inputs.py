"""LoRA layers under autocast without peft's round trip of their input through the adapter's dtype.

peft casts a layer's input to the LoRA weights' dtype (fp32) before `lora_B(lora_A(dropout(x)))`; under bf16 autocast
lora_A casts it straight back to bf16 and saves that copy for its backward. Each adapted layer so keeps its own bf16
copy of its input: q, k and v three of the same [N, hidden] tensor, o_proj one of the attention output, which the
attention saves anyway (24 KiB per token more than needed at Llama-3.1-8B shapes, inside the recomputed layer at the
peak), plus an fp32 copy while each is made.
bf16 -> fp32 -> bf16 is exact, so when autocast would cast the input back to its own dtype and the adapter's dropout
is the identity, passing the input through unchanged gives bitwise the same outputs and gradients, with no copy.
With dropout active the cast stays: the mask is drawn on the fp32 copy, and the result must not change.
"""
from __future__ import annotations

import torch


def is_lora_layer(module) -> bool:
    return hasattr(module, "_cast_input_dtype") and hasattr(module, "lora_A") and hasattr(module, "lora_dropout")


def input_cast_skipping_round_trips(layer, original):
    """`layer._cast_input_dtype` that returns `x` itself where the cast would come straight back (see above)."""

    def cast_input_dtype(x, dtype):
        if (x is not None and x.dtype != dtype and _autocast_returns(x) and _dropout_is_identity(layer)
                and not getattr(layer, "lora_variant", None)):  # DoRA and other variants use x beyond lora_A
            return x
        return original(x, dtype)

    return cast_input_dtype


def _autocast_returns(x: torch.Tensor) -> bool:
    device = x.device.type
    return (torch.is_autocast_enabled(device) and x.dtype == torch.get_autocast_dtype(device)
            and x.is_floating_point())


def _dropout_is_identity(layer) -> bool:
    return all(isinstance(d, torch.nn.Identity) or not d.training or d.p == 0 for d in layer.lora_dropout.values())
