"""Attention once per step (bpt.attention_once) on a patched model: each training forward hands its checkpointed layers
a `context_fn` whose contexts keep the fused attention's results in the forward and give them to the recompute.

Per forward, not at patch time: checkpointing is often enabled after the patch (the recipe's order), and each forward
gets one `KeepRule` (auto decides at its first attention call, for every layer). Only torch's non-reentrant checkpoint
takes a context_fn; a layer checkpointed with one of the user's own keeps it, and recomputes its attention.
"""
from __future__ import annotations

import functools

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from bpt import attention_once
from bpt.config import BPTConfig

# A model standing for a deeper one (the simulation's 2 layers of 32, extrapolated) names that depth here: the auto
# rule weighs a whole forward's kept bytes.
DEPTH_ATTR = "_bpt_stands_for_layers"


def keeping_forward(model, original, config: BPTConfig):
    """`model.forward` that runs a training forward (grad on, train mode) with its checkpointed layers keeping their
    attention's results for their recompute, unless `config.attention_once` is False."""

    @functools.wraps(original)  # its signature: HF Trainer drops the dataset columns a forward does not name
    def forward(*args, **kwargs):
        layers = _checkpointed_layers(model) if config.attention_once is not False and model.training \
            and torch.is_grad_enabled() else []
        if not layers:
            return original(*args, **kwargs)
        depth = getattr(model, DEPTH_ATTR, len(layers))
        rule = attention_once.KeepRule(config.attention_once, depth, config.offload_checkpoints)
        functions = [layer._gradient_checkpointing_func for layer in layers]
        try:
            for layer, function in zip(layers, functions):
                layer._gradient_checkpointing_func = functools.partial(
                    function, context_fn=attention_once.context_fn(rule))
            return original(*args, **kwargs)
        finally:
            for layer, function in zip(layers, functions):
                layer._gradient_checkpointing_func = function

    return forward


def _checkpointed_layers(model) -> list:
    """The layers checkpointed with torch's non-reentrant checkpoint and no context_fn of the user's."""
    layers = []
    for module in model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing and \
                isinstance(function, functools.partial) and function.keywords.get("use_reentrant") is False and \
                "context_fn" not in function.keywords:
            layers.append(module)
    return layers
