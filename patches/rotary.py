"""Rotary position embeddings applied one chunk of tokens at a time, for long sequences.

transformers' `apply_rotary_pos_emb(q, k, cos, sin)` computes `q * cos + rotate_half(q) * sin` over the whole
sequence: three temporaries of q's size exist beside q and the result. At long context they are the forward's peak
(Llama-3.2-1B, 2.65M tokens, offload: three of the seven 10 GiB tensors held at the step's peak, simulated), and the
recompute inside each layer's backward makes them again. Here the family's own function runs on chunks of tokens
and writes into the two results, so only one chunk's temporaries exist. Its backward does the same: rotary
embedding is linear in q and k, so each chunk's gradient is the family function's autograd graph run on zeros of
the chunk's shape (the values never enter a gradient), written into the whole gradient. Same functions, same
elementwise ops per token: outputs and gradients are bitwise those of the whole-sequence call.

Which calls: transformers looks `apply_rotary_pos_emb` up in its modeling module at each call, so the patch wraps
that module attribute once (`install`); the wrapper passes every call through unchanged unless `cos` came from a
patched model's rotary embedding module (`tag_rotary_outputs`, per model, undone with the patch), the call has the
common form (q, k [B, H, N, D], cos, sin [B, N, D]), there is a chunk budget (CUDA, or `chunk_budget` set: as for
the attention's LoRA projections, a CPU step keeps the one call; chunked, llama-ref's CPU step took ~3% longer at
8K) and the whole sequence is over the norm chunk's rule (`whole_fits`, by shapes alone: a checkpoint's recompute
takes the path its forward took). Under torch.compile (a fullgraph generate) the tag and the wrapper stand aside:
dynamo does not trace the weak dictionary, and a compiled graph gets the whole call.
"""
from __future__ import annotations

import functools
import sys

import torch
from torch.utils.weak import WeakIdKeyDictionary

from bpt.compile import compiled_forward
from bpt.config import BPTConfig
from patches.chunk_bytes import rotary_bytes_per_token

NAME = "apply_rotary_pos_emb"
_WRAPPED = "_bpt_lean_rotary"
_CONFIG_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()  # cos made by a patched model -> its BPTConfig


def install(attention_class: type) -> bool:
    """Wrap `apply_rotary_pos_emb` in the modeling module of this attention class (once per process; a call the
    wrapper does not take is the original call). False where that module has no such function."""
    module = sys.modules.get(attention_class.__module__)
    original = getattr(module, NAME, None)
    if original is None or not callable(original):
        return False
    if not getattr(original, _WRAPPED, False):
        setattr(module, NAME, lean_rotary(original))
    return True


def tag_rotary_outputs(config: BPTConfig):
    """A forward hook for a model's rotary embedding module: its cos is taken by the wrapper with `config`."""
    def hook(module, inputs, output):
        if torch.compiler.is_compiling():  # a compiled model (fullgraph generate) keeps the whole call
            return
        if isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor):
            _CONFIG_OF[output[0]] = config
    return hook


def lean_rotary(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(*args, **kwargs):
        config = _taken(args, kwargs)
        if config is None:
            return original(*args, **kwargs)
        q, k, cos, sin = args
        tokens = q.shape[2]
        per_token = functools.partial(rotary_bytes_per_token, q, k, cos)
        body = compiled_forward(original, config.compile)
        if not config.largest_budget(q.device) or config.whole_fits("norm_chunk", tokens, per_token, q.device):
            return body(q, k, cos, sin)  # no chunk budget (a CPU unless set): memory is not what limits
        rows = config.chunk_tokens("norm_chunk", tokens, per_token, q.device)
        return _ChunkedRotary.apply(q, k, cos, sin, body, rows)

    setattr(apply_rotary_pos_emb, _WRAPPED, True)
    return apply_rotary_pos_emb


def _taken(args, kwargs) -> BPTConfig | None:
    """The config of a call the wrapper chunks, else None: cos tagged, and the (q, k, cos, sin) [B, H, N, D] form."""
    if torch.compiler.is_compiling() or len(args) != 4 or any(not isinstance(a, torch.Tensor) for a in args):
        return None
    if kwargs.get("unsqueeze_dim", 1) != 1 or kwargs.get("position_ids") is not None or \
            set(kwargs) - {"unsqueeze_dim", "position_ids"}:
        return None
    q, k, cos, sin = args
    config = _CONFIG_OF.get(cos)
    if config is None or cos.requires_grad or sin.requires_grad:
        return None
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return None
    tokens = q.shape[2]
    if k.shape[2] != tokens or cos.shape[1] != tokens or cos.shape[0] not in (1, q.shape[0]):
        return None
    return config


class _ChunkedRotary(torch.autograd.Function):
    """(q, k) -> the family's rotary embedding of them, `rows` tokens at a time; backward likewise."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, original, rows):
        ctx.original, ctx.rows = original, rows
        ctx.inputs, ctx.device = [(t.shape, t.dtype) for t in (q, k)], q.device  # what the gradients are
        ctx.save_for_backward(cos, sin)
        outs = None
        for start in range(0, q.shape[2], rows):
            piece = slice(start, start + rows)
            got = original(q[:, :, piece], k[:, :, piece], cos[:, piece], sin[:, piece])
            if outs is None:  # the whole call's dtypes and (transposed) layout
                outs = [torch.empty_like(t, dtype=g.dtype) for t, g in zip((q, k), got)]
            for out, g in zip(outs, got):
                out[:, :, piece].copy_(g)
        return tuple(outs)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        device, tokens = ctx.device, ctx.inputs[0][0][2]
        grads = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in ctx.inputs]
        for start in range(0, tokens, ctx.rows):
            piece = slice(start, start + ctx.rows)
            n = min(start + ctx.rows, tokens) - start
            with torch.enable_grad(), torch.autocast(device.type, enabled=False):
                zeros = [torch.zeros(*shape[:2], n, shape[3], dtype=dtype, device=device, requires_grad=True)
                         for shape, dtype in ctx.inputs]
                outs = ctx.original(*zeros, cos[:, piece], sin[:, piece])
                pieces = torch.autograd.grad(outs, zeros, (grad_q[:, :, piece], grad_k[:, :, piece]))
            for whole, part in zip(grads, pieces):
                whole[:, :, piece].copy_(part)
        return grads[0], grads[1], None, None, None, None
