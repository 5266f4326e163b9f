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
families) is kept as the norm's input instead, which the norm saves anyway, and a chunk's rows are rebuilt by the
norm's own forward (bitwise its output rows): the normalised [B, N, hidden] tensor is not held from forward to
backward. With `fold_norms` the norm also joins each chunk's backward: the gradient goes through the norm to its input
(and weights) within the chunk, so the MLP's input gradient is never whole (one [B, N, hidden] buffer fewer at the
layer's backward peak) and the norm's own node gets no gradient from here. Without it the gradient goes to the norm's
output and the norm's own backward runs after, as stock's.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from bpt import host_copies
from bpt.norm import norm_source
from bpt.recompute import (ChunkGradSums, RngSnapshot, autocast_replayed, autocast_state, check_no_hidden_leaves,
                           isolated_saved_tensors)


def chunked_mlp(forward: Callable, params: Sequence[torch.Tensor], *inputs: torch.Tensor,
                chunk: int, fold_norms: bool = True) -> torch.Tensor:
    """Run `forward(*inputs)` in sequence chunks of `chunk` tokens and return its output [B, N, ...].

    forward: the module's original forward (e.g. a bound method of LlamaMLP, MixtralSparseMoeBlock,
        or BloomMLP taking (hidden, residual)); it must return one tensor [B, n, ...] for inputs [B, n, ...].
    params: the module's parameters; only those with requires_grad get gradients (frozen 4-bit weights
        are skipped, LoRA adapters included). A trainable tensor forward uses but that is missing here
        raises in backward (it would otherwise silently get no gradient).
    inputs: tensors [B, N, ...], all chunked along dim 1.
    fold_norms: take the backward of a lean norm feeding an input into each chunk's (the norm's only consumer, as
        the MLP is). False where the norm feeds several consumers (q, k and v): the gradient then goes to the norm's
        output, and the norm's own backward runs once over their sum, as stock's does.

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
    # what backward rebuilds each input's chunks from: the input itself, or a lean norm's input and forward
    sources = [norm_source(x) for x in inputs]
    sources = [s if s is not None and s[2].shape[:2] == x.shape[:2] else None for x, s in zip(inputs, sources)]
    norms = [None if s is None else s[0] for s in sources]
    kept = [x if s is None else s[2] for x, s in zip(inputs, sources)]
    # where each input's gradient goes: its kept tensor (itself, or a folded norm's input), else the input
    to_kept = [s is None or fold_norms for s in sources]
    grads_to = [k if fold else x for x, k, fold in zip(inputs, kept, to_kept)]
    folded = [p for s, fold in zip(sources, to_kept) if s is not None and fold for p in s[1]]
    trainable = _unique([p for p in params if p.requires_grad] + folded)
    needs_grad = torch.is_grad_enabled() and (bool(trainable) or any(t.requires_grad for t in grads_to))
    if not needs_grad:
        return _run_chunks(forward, inputs, chunk, copy_inputs=False)
    views = _SaveInputs.apply(*kept)
    if not isinstance(views, tuple):
        views = (views,)
    # The save node exists only if some kept tensor requires grad; otherwise _ChunkedMLP saves them itself. An input
    # whose gradient goes to its kept tensor goes in detached: the forward reads its values only.
    saver = next((x.grad_fn for x in views if x.grad_fn is not None), None)
    inputs = [x.detach() if k else x for x, k in zip(inputs, to_kept)]
    return _ChunkedMLP.apply(forward, chunk, saver, norms, to_kept, *inputs, *(views if saver else kept), *trainable)


def _unique(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` without repeats (a norm's weight that the module also lists), by identity, in order."""
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]


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
    """Identity that saves what the chunked MLP's backward rebuilds its inputs from (each input, or a lean norm's
    input), so that it is saved (and recomputed by a checkpoint) before the chunked forward runs. Its outputs are
    views, passed on to the chunked MLP for their gradients."""

    @staticmethod
    def forward(ctx, *kept):
        host_copies.save(ctx, *kept)
        ctx.set_materialize_grads(False)  # a kept tensor that gets no gradient here (a norm's input) gets no zeros
        return tuple(x.view_as(x) for x in kept)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def _pieces(kept: Sequence[torch.Tensor], norms: Sequence[Callable | None], to_kept: Sequence[bool],
            wants: Sequence[bool], start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A chunk's leaves (what its gradients are taken for: kept rows, or a norm's output rows rebuilt without grad)
    and the forward's inputs made from them: the folded norm's forward over the leaf (with grad), or a copy of it (the
    forward may modify its input in place, as Mixtral's router jitter does, while gradients flow to the leaf)."""
    leaves, pieces = [], []
    for x, norm, fold, want in zip(kept, norms, to_kept, wants):
        rows = x[:, start:end]
        if norm is not None and not fold:
            with torch.no_grad():
                rows = norm(rows)
        leaf = rows.detach().requires_grad_(want)
        leaves.append(leaf)
        pieces.append(norm(leaf) if norm is not None and fold else leaf.clone())
    return leaves, pieces


class _ChunkedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward, chunk, saver, norms, to_kept, *tensors):
        n = len(norms)
        inputs, kept, params = tensors[:n], tensors[n:2 * n], tensors[2 * n:]
        ctx.forward, ctx.chunk, ctx.saver, ctx.norms, ctx.to_kept = forward, chunk, saver, norms, to_kept
        grads_to = [k if fold else x for x, k, fold in zip(inputs, kept, to_kept)]
        ctx.grad_meta = [(t.shape, t.dtype, t.device) for t in grads_to]
        ctx.rng = RngSnapshot(inputs)
        ctx.autocast = autocast_state(inputs)
        # what the inputs [B, N, ...] are rebuilt from is saved by the `saver` node when there is one. The
        # parameters are the module's own tensors, alive anyway: kept as plain references, they add no saved tensor
        # after the chunked forward (which would make a checkpoint's recompute run it again).
        host_copies.save(ctx, *(() if saver else kept))
        ctx.params = params
        return _run_chunks(forward, inputs, chunk, copy_inputs=True)  # [B, N, ...]

    @staticmethod
    def backward(ctx, grad_out):
        kept, params, n = host_copies.saved(ctx.saver or ctx), ctx.params, len(ctx.norms)
        wants = [ctx.needs_input_grad[5 + i + (n if fold else 0)] for i, fold in enumerate(ctx.to_kept)]
        grads_out = [torch.empty(shape, dtype=dtype, device=device) if want else None  # [B, N, ...]
                     for (shape, dtype, device), want in zip(ctx.grad_meta, wants)]
        param_grads = ChunkGradSums(params)
        with ctx.rng.replayed(), autocast_replayed(ctx.autocast), torch.enable_grad(), isolated_saved_tensors():
            for start, end in _spans(kept[0].shape[1], ctx.chunk):
                leaves, pieces = _pieces(kept, ctx.norms, ctx.to_kept, wants, start, end)
                y = ctx.forward(*pieces)  # [B, n, ...]
                del pieces  # held by y's graph only: gone with it, before the next chunk's are made
                targets = [leaf for leaf in leaves if leaf.requires_grad] + list(params)
                if start == 0:
                    check_no_hidden_leaves(y, targets, "chunked_mlp")
                grads = iter(torch.autograd.grad(y, targets, grad_out[:, start:end], allow_unused=True))
                for i, leaf in enumerate(leaves):
                    if leaf.requires_grad:
                        g = next(grads)
                        grads_out[i][:, start:end] = 0 if g is None else g
                        del g  # a chunk's gradient: not held beside the next chunk's
                param_grads.add(grads)
        del kept
        host_copies.release(ctx.saver or ctx)
        input_grads = [None if fold else g for g, fold in zip(grads_out, ctx.to_kept)]
        kept_grads = [g if fold else None for g, fold in zip(grads_out, ctx.to_kept)]
        return (None,) * 5 + (*input_grads, *kept_grads, *param_grads.cast())
