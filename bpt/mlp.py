"""Chunked MLP: run a module's whole forward one sequence chunk at a time, recompute in backward.

Only one chunk's intermediate (chunk x intermediate, e.g. act(gate(x)) * up(x) for SwiGLU) exists at
a time, in forward and in backward; the autograd graph keeps just the inputs. The module's own
forward is called per chunk, so LoRA adapters, 4-bit layers, dropout and MoE routing keep working.
Randomness (dropout, router jitter) is replayed exactly in the recompute by restoring the RNG state
captured before the forward loop; the chunks run in the same order, so each draws the same numbers.

Under gradient checkpointing the MLP forward runs twice per step, not three times. The inputs are saved
by a separate identity node (`_SaveInputs`) placed *before* the chunked forward. torch's non-reentrant
checkpoint stops its recompute as soon as the last tensor the layer saved has been recomputed; when
nothing after the MLP in the layer saves a tensor (Llama-like layers end in a residual add), that last
tensor is this input, and the recompute stops before re-running the MLP, whose own backward then
recomputes each chunk once. Where later ops do save something (e.g. Gemma 2's post-MLP norm), the
recompute continues through the MLP, as it must. Reentrant checkpointing always recomputes (3 forwards).

An input that is a lean norm's output (bpt.norm.norm_source: the MLP's and the attention projections' inputs in most
families) is kept as the norm's input instead, which the norm saves anyway, and its chunks are rebuilt in backward by
the norm's own forward (bitwise its output rows): the normalised [B, N, hidden] tensor is not held from forward to
backward. Its gradient still flows through the norm's own backward, so the gradients are unchanged.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from bpt.norm import norm_source
from bpt.recompute import (RngSnapshot, autocast_replayed, autocast_state, check_no_hidden_leaves,
                           isolated_saved_tensors)


def chunked_mlp(forward: Callable, params: Sequence[torch.Tensor], *inputs: torch.Tensor,
                chunk: int) -> torch.Tensor:
    """Run `forward(*inputs)` in sequence chunks of `chunk` tokens and return its output [B, N, ...].

    forward: the module's original forward (e.g. a bound method of LlamaMLP, MixtralSparseMoeBlock,
        or BloomMLP taking (hidden, residual)); it must return one tensor [B, n, ...] for inputs [B, n, ...].
    params: the module's parameters; only those with requires_grad get gradients (frozen 4-bit weights
        are skipped, LoRA adapters included). A trainable tensor forward uses but that is missing here
        raises in backward (it would otherwise silently get no gradient).
    inputs: tensors [B, N, ...], all chunked along dim 1.

    With grad enabled and something requiring grad, a custom autograd Function saves only the inputs
    and recomputes each chunk in backward; otherwise the chunks are run and concatenated.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunked_mlp: chunk must be a positive integer number of tokens, got {chunk!r}")
    if not inputs:
        raise ValueError("chunked_mlp: at least one input tensor [B, N, ...] is required")
    seq_len = inputs[0].shape[1]
    for x in inputs:
        if x.dim() < 2 or x.shape[1] != seq_len:
            raise ValueError(f"chunked_mlp: every input must be [B, N, ...] with the same N={seq_len}, "
                             f"got shape {tuple(x.shape)}")
    trainable = [p for p in params if p.requires_grad]
    needs_grad = torch.is_grad_enabled() and (bool(trainable) or any(x.requires_grad for x in inputs))
    if not needs_grad:
        return _run_chunks(forward, inputs, chunk, copy_inputs=False)
    # what backward rebuilds each input's chunks from: the input, or a lean norm's input and forward
    sources = [norm_source(x) for x in inputs]
    sources = [s if s is not None and s[1].shape[:2] == x.shape[:2] else None for x, s in zip(inputs, sources)]
    kept = [x if s is None else s[1] for x, s in zip(inputs, sources)]
    rebuild = [None if s is None else s[0] for s in sources]
    views = _SaveInputs.apply(len(inputs), *inputs, *kept)
    if not isinstance(views, tuple):
        views = (views,)
    # The save node exists only if some input requires grad; otherwise _ChunkedMLP saves the kept tensors itself.
    saver = next((x.grad_fn for x in views if x.grad_fn is not None), None)
    return _ChunkedMLP.apply(forward, chunk, len(inputs), saver, rebuild, *(views if saver else inputs),
                             *([] if saver else kept), *trainable)


def _spans(length: int, chunk: int):
    """(start, end) of each chunk along the sequence."""
    return [(start, min(start + chunk, length)) for start in range(0, length, chunk)]


def _checked_output(y, inputs: Sequence[torch.Tensor], start: int, end: int) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"chunked_mlp: the wrapped forward must return a single tensor, got {type(y).__name__}; "
                        "wrap forward in a function that returns the hidden states only")
    batch = inputs[0].shape[0]
    if y.dim() < 2 or y.shape[0] != batch or y.shape[1] != end - start:
        raise ValueError(f"chunked_mlp: the wrapped forward must return [B, n, ...] for a chunk of "
                         f"n={end - start} tokens (B={batch}), got shape {tuple(y.shape)}")
    return y


def _run_chunks(forward: Callable, inputs: Sequence[torch.Tensor], chunk: int, copy_inputs: bool) -> torch.Tensor:
    """Forward every chunk and write it into one output [B, N, ...]."""
    seq_len = inputs[0].shape[1]
    out = None
    for start, end in _spans(seq_len, chunk):
        # [B, n, ...] per input; a copy when the caller's tensors must survive in-place ops in forward
        # (Mixtral's router jitter multiplies its input in place, and these inputs are saved for backward).
        pieces = [x[:, start:end].clone() if copy_inputs else x[:, start:end].contiguous() for x in inputs]
        y = _checked_output(forward(*pieces), inputs, start, end)  # [B, n, ...]
        if out is None:
            out = y.new_empty((y.shape[0], seq_len, *y.shape[2:]))  # [B, N, ...]
        out[:, start:end] = y
    return out


class _SaveInputs(torch.autograd.Function):
    """Identity on the chunked MLP's inputs that saves what their chunks are rebuilt from (`kept`: each input, or
    a lean norm's input), so that it is saved (and recomputed by a checkpoint) before the chunked forward runs. Its
    outputs are views: _run_chunks copies each chunk."""

    @staticmethod
    def forward(ctx, n_inputs, *tensors):
        inputs, kept = tensors[:n_inputs], tensors[n_inputs:]
        ctx.save_for_backward(*kept)
        ctx.n_kept = len(kept)
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads, *[None] * ctx.n_kept)


def _rows(kept: torch.Tensor, rebuild: Callable | None, start: int, end: int) -> torch.Tensor:
    """Tokens [start, end) of an input: a slice of the kept tensor, or the norm's forward over its slice."""
    if rebuild is None:
        return kept[:, start:end]
    with torch.no_grad():
        return rebuild(kept[:, start:end])


class _ChunkedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward, chunk, n_inputs, saver, rebuild, *tensors):
        inputs = tensors[:n_inputs]
        kept = () if saver else tensors[n_inputs:2 * n_inputs]
        params = tensors[n_inputs + len(kept):]
        ctx.forward, ctx.chunk, ctx.n_inputs, ctx.n_kept, ctx.saver, ctx.rebuild = \
            forward, chunk, n_inputs, len(kept), saver, rebuild
        ctx.input_meta = [(x.shape, x.dtype, x.device) for x in inputs]
        ctx.rng = RngSnapshot(inputs)
        ctx.autocast = autocast_state(inputs)
        # what the inputs [B, N, ...] are rebuilt from is saved by the `saver` node when there is one. The
        # parameters are the module's own tensors, alive anyway: kept as plain references, they add no saved tensor
        # after the chunked forward (which would make a checkpoint's recompute run it again).
        ctx.save_for_backward(*kept)
        ctx.params = params
        return _run_chunks(forward, inputs, chunk, copy_inputs=True)  # [B, N, ...]

    @staticmethod
    def backward(ctx, grad_out):
        kept, params = (ctx.saver or ctx).saved_tensors, ctx.params
        wants = ctx.needs_input_grad[5:5 + ctx.n_inputs]
        input_grads = [torch.empty(shape, dtype=dtype, device=device) if want else None  # [B, N, ...]
                       for (shape, dtype, device), want in zip(ctx.input_meta, wants)]
        param_grads = [None] * len(params)
        with ctx.rng.replayed(), autocast_replayed(ctx.autocast), torch.enable_grad(), isolated_saved_tensors():
            for start, end in _spans(kept[0].shape[1], ctx.chunk):
                leaves = [_rows(x, rebuild, start, end).detach().requires_grad_(want)
                          for x, rebuild, want in zip(kept, ctx.rebuild, wants)]
                # clone: a non-leaf the forward may modify in place, with gradients flowing to the leaf
                y = ctx.forward(*[leaf.clone() for leaf in leaves])  # [B, n, ...]
                targets = [leaf for leaf in leaves if leaf.requires_grad] + list(params)
                if start == 0:
                    check_no_hidden_leaves(y, targets, "chunked_mlp")
                grads = torch.autograd.grad(y, targets, grad_out[:, start:end], allow_unused=True)
                grads = iter(grads)
                for i, leaf in enumerate(leaves):
                    if leaf.requires_grad:
                        g = next(grads)
                        input_grads[i][:, start:end] = 0 if g is None else g
                for j, g in enumerate(grads):
                    if g is None:  # parameter unused by this chunk (an MoE expert no token picked)
                        continue
                    if param_grads[j] is None:  # our own buffer: g may alias a tensor autograd still holds
                        param_grads[j] = torch.zeros_like(params[j])
                    param_grads[j].add_(g)
        return (None, None, None, None, None, *input_grads, *[None] * ctx.n_kept, *param_grads)
