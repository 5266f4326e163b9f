"""What one token of a chunk holds, read from the modules the patch wraps: the chunk budget's divisor.

`BPTConfig.chunk_tokens` turns these into tokens per chunk. Each is an upper estimate of the memory a chunk's
backward holds per token (the recomputed forward's saved activations and their gradients), so that a chunk sized
from it stays within the budget. None where the module does not say (e.g. experts fused into 3-D parameters): the
chunk size as configured.
"""
from __future__ import annotations

import torch

# Per output feature of a linear layer, a chunk's backward holds about this many activations: the output, what the
# next op saves of it (an activation function's result, a product's factor), and their gradients (Llama-3.1-8B QLoRA
# MLP: 254 KB per token measured against 525 KB estimated, simulated; LoRA's B outputs counted in full).
_ACTIVATIONS_PER_FEATURE = 4
# Per hidden feature, a norm's backward recomputes in float32 the upcast input, its square, the normalised product,
# the output before the weight and their gradients (Llama-3.1-8B's RMSNorm: 6 measured, simulated).
_NORM_FLOAT32_COPIES = 8
# Per vocabulary entry, the loss chunk holds the logits in the compute dtype, their float32 upcast, its softmax and
# gradient (Llama-3.1-8B: 12.1 bytes per entry in bf16 measured, simulated).
_LOSS_FLOAT32_COPIES = 3


def activation_bytes(x: torch.Tensor) -> int:
    """Bytes of one activation element: autocast's dtype where autocast is on for x's device, else x's."""
    if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
        return torch.get_autocast_dtype(x.device.type).itemsize
    return x.element_size()


def mlp_bytes_per_token(module: torch.nn.Module, hidden: torch.Tensor) -> int | None:
    """Per token of a chunk: _ACTIVATIONS_PER_FEATURE activations per output feature of the module's innermost
    linear layers (a LoRA layer's base and its adapters counted apart, as their outputs exist apart)."""
    linears = [m for m in module.modules() if isinstance(getattr(m, "out_features", None), int)
               and not any(hasattr(child, "out_features") for child in m.children())]
    covered = {id(p) for m in linears for p in m.parameters()}
    if not linears or any(p.dim() > 1 and id(p) not in covered for p in module.parameters()):
        return None  # weights outside linear layers (experts fused into 3-D tensors, GPT-2's Conv1D): no estimate
    features = sum(m.out_features for m in linears)
    return features * _ACTIVATIONS_PER_FEATURE * activation_bytes(hidden)


def norm_bytes_per_token(features: int) -> int:
    """Per token of a norm's backward chunk of `features` hidden features."""
    return features * _NORM_FLOAT32_COPIES * 4


def loss_bytes_per_token(vocab: int | None, hidden: torch.Tensor) -> int | None:
    """Per token of the LM head + cross entropy chunk over `vocab` logits."""
    return vocab * (activation_bytes(hidden) + _LOSS_FLOAT32_COPIES * 4) if vocab else None


def rotary_bytes_per_token(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> int:
    """Per token of a rotary embedding chunk (q, k [B, H, n, D]): q's and k's three temporaries and their results,
    in the dtype the products promote to."""
    width = q.shape[1] * q.shape[3] + k.shape[1] * k.shape[3]
    return 4 * width * torch.promote_types(q.dtype, cos.dtype).itemsize
