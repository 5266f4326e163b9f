"""Which modules are per-token norms, and the per-instance forward that runs them through `bpt.norm.lean_norm`.

A norm is recognised from the module itself (data, not a list of classes): its class name ends in "Norm" (Llama's
RMSNorm, Gemma's (1 + w) RMSNorm, Cohere's / OLMo's LayerNorm, q-k norms, torch's LayerNorm / RMSNorm, Llama 4's
L2Norm), or it is a torch LayerNorm / RMSNorm (or a subclass: Nemotron's LayerNorm1P), and it normalises its trailing dims: `normalized_shape` when it has one, else its weight's dims, else the
last dim. Norms that mix tokens (GroupNorm, BatchNorm, InstanceNorm) are never wrapped, and neither are gated norms
(forward(x, gate): class names end in "Gated"). At call time the wrapper runs the stock forward whenever the call is
not a plain `norm(x)` whose trailing dims match the weight, or grad is off (inference, torch.compile full graph).
"""
from __future__ import annotations

import math

import torch

from bpt.compile import compiled_forward
from bpt.config import BPTConfig
from bpt.norm import lean_norm
from patches.chunk_bytes import norm_bytes_per_token

LEAN_NORM_ATTR = "__bpt_lean_norm__"  # set on the bound forward: tests and tools recognise a wrapped norm by it
_ROW_MIXING = ("Group", "Batch", "Instance")


def per_token_norm_dims(module: torch.nn.Module) -> int | None:
    """How many trailing dims `module` normalises over, if it is a per-token norm; None otherwise."""
    name = type(module).__name__
    if isinstance(module, (torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase)):
        return None
    torch_norm = isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm))  # subclasses too (Nemotron's LayerNorm1P)
    if not torch_norm and (not name.endswith("Norm") or any(word in name for word in _ROW_MIXING)):
        return None
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, int):
        return 1
    if isinstance(shape, (tuple, list, torch.Size)) and len(shape) > 0:
        return len(shape)
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() >= 1:
        return weight.dim()
    return 1


def lean_norm_forward(module: torch.nn.Module, original, norm_dims: int, config: BPTConfig, hidden: int | None):
    """A forward for `module` that saves only its input; per backward step, the chunk of tokens of `hidden` elements
    the config gives (a norm over smaller rows, e.g. a per-head q-k norm, takes proportionally more rows per step)."""
    weight = getattr(module, "weight", None)
    weight_shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
    body = compiled_forward(original, config.compile)

    def forward(*args, **kwargs):
        x = args[0] if len(args) == 1 and not kwargs else None
        if (not isinstance(x, torch.Tensor) or not torch.is_grad_enabled() or x.dim() < norm_dims
                or (weight_shape is not None and tuple(x.shape[x.dim() - norm_dims:]) != weight_shape)):
            return original(*args, **kwargs)
        row = math.prod(x.shape[x.dim() - norm_dims:])
        token = hidden or row
        tokens, device = x.numel() // max(token, 1), x.device

        def rows() -> int:  # asked in forward and again in backward, from what the budget holds then
            chunk = config.chunk_tokens("norm_chunk", tokens, lambda: norm_bytes_per_token(token), device)
            return max(1, chunk * token // max(row, 1))
        return lean_norm(body, list(module.parameters()), x, rows=rows, norm_dims=norm_dims)

    setattr(forward, LEAN_NORM_ATTR, True)
    return forward


def is_lean_norm(module: torch.nn.Module) -> bool:
    return getattr(vars(module).get("forward"), LEAN_NORM_ATTR, False)
