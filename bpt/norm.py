"""Lean norm: a per-token norm that saves only its input and recomputes in backward, chunk by chunk.

A stock RMSNorm / LayerNorm written in Python (x.to(float32), pow, mean, rsqrt, the normalised product, the
weight product) leaves several fp32 tensors of the input's full size in the autograd graph. `lean_norm` runs
the norm's own forward under no_grad, a chunk of rows at a time (the output is bitwise stock's), saves the input alone
(the same storage, no copy: when the caller also saves it, e.g. a residual add or a checkpoint, nothing is
added), and in backward recomputes the forward on one chunk of rows at a time with grad enabled, so those
temporaries exist for one chunk only.

Valid only for per-token norms: each output row depends on its own input row alone (RMSNorm, LayerNorm over
the trailing dims). A norm that mixes rows (GroupNorm over channels x tokens, BatchNorm) must not be wrapped.
"""
from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch

from bpt import host_copies
from bpt.recompute import (ChunkGradSums, autocast_replayed, autocast_state, check_no_hidden_leaves,
                           isolated_saved_tensors)


def lean_norm(forward: Callable, params: Sequence[torch.Tensor], x: torch.Tensor, *, rows: int | Callable[[], int],
              norm_dims: int = 1) -> torch.Tensor:
    """Return `forward(x)`, keeping only `x` for backward.

    forward: the norm module's own forward (a bound method), mapping [..., *D] to [..., *D'] row by row.
    params: the module's parameters; only those with requires_grad get gradients (accumulated across chunks in
        fp32 and cast to the parameter's dtype once).
    x: [..., *D], D the `norm_dims` trailing dims the norm normalises over.
    rows: rows of x viewed as [R, *D] run at a time, or a function giving them, asked in forward and again in
        backward (what is free when backward runs, inside a checkpointed layer's backward, is not what was free in
        its forward).

    With grad disabled (inference, torch.compile full-graph) this is `forward(x)`; with nothing requiring grad, the
    forward in chunks, no graph. With grad enabled the output carries its input (weakly) for `norm_source`.
    """
    if not callable(rows):
        _check_rows(rows)
    rows_now = rows if callable(rows) else (lambda: rows)
    if isinstance(norm_dims, bool) or not isinstance(norm_dims, int) or not 1 <= norm_dims <= x.dim():
        raise ValueError(f"lean_norm: norm_dims must be in 1..{x.dim()} for an input of shape {tuple(x.shape)}, "
                         f"got {norm_dims!r}")
    if not torch.is_grad_enabled():
        return forward(x)
    trainable = [p for p in params if p.requires_grad]
    if x.requires_grad or trainable:
        y = _LeanNorm.apply(forward, rows_now, norm_dims, x, *trainable)
    else:  # nothing to differentiate (a frozen norm on an input that needs no gradient: the first layer's under
        y = _chunked(forward, _check_rows(rows_now()), norm_dims, x)  # QLoRA), still in chunks
    # weak: never what keeps the input on the device; the versions: neither changed in place since
    setattr(y, _SOURCE_ATTR, (forward, trainable, weakref.ref(x), x._version, y._version))
    return y


_SOURCE_ATTR = "_bpt_lean_norm_source"


def norm_source(y: torch.Tensor) -> tuple[Callable, list[torch.Tensor], torch.Tensor] | None:
    """(forward, trainable params, x) when `y` is a lean norm's output and its input x is alive, neither changed in
    place since: `forward(x[rows])` gives those rows of y bitwise (a per-token norm, the norm's own forward as
    lean_norm runs it). A consumer that keeps y for backward can keep x instead (the norm saves x anyway), rebuild
    y's rows when it needs them, and take the norm's backward into its own (bpt.mlp.chunked_mlp; autograd's version
    check then catches a later in-place change of x)."""
    source = getattr(y, _SOURCE_ATTR, None)
    if source is None:
        return None
    forward, params, ref, x_version, y_version = source
    x = ref()
    return None if x is None or x._version != x_version or y._version != y_version else (forward, params, x)


def _check_rows(rows) -> int:
    if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
        raise ValueError(f"lean_norm: rows must be a positive integer, got {rows!r}")
    return rows


def _checked(y, x: torch.Tensor, norm_dims: int) -> torch.Tensor:
    if not isinstance(y, torch.Tensor) or y.shape[:x.dim() - norm_dims] != x.shape[:x.dim() - norm_dims]:
        raise ValueError(f"lean_norm: forward must return one tensor with the input's leading dims "
                         f"{tuple(x.shape[:x.dim() - norm_dims])}, got "
                         f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")
    return y


def _chunked(forward: Callable, rows: int, norm_dims: int, x: torch.Tensor) -> torch.Tensor:
    """forward(x) chunk by chunk of `rows` rows, as backward runs it: the forward's own fp32 temporaries exist for one
    chunk only (bitwise the whole: each row is its own)."""
    lead = x.shape[:x.dim() - norm_dims]
    flat_x = x.reshape(-1, *x.shape[x.dim() - norm_dims:])  # [R, *D]
    if flat_x.shape[0] <= rows:
        return _checked(forward(x), x, norm_dims)
    first = _checked(forward(flat_x[:rows]), flat_x[:rows], norm_dims)  # [r, *D']
    # made in the output's shape, not a view of a flat one: whoever drops the output's memory
    # (patches/spent_input.py) drops all of it
    out = first.new_empty((*lead, *first.shape[1:]))
    flat_out = out.view(-1, *first.shape[1:])  # [R, *D']
    flat_out[:rows] = first
    del first
    for start in range(rows, flat_x.shape[0], rows):
        flat_out[start:start + rows] = forward(flat_x[start:start + rows])
    return out


class _LeanNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward, rows_now, norm_dims, x, *params):
        ctx.forward, ctx.rows_now, ctx.norm_dims = forward, rows_now, norm_dims
        rows = _check_rows(rows_now())
        ctx.autocast = autocast_state([x])
        host_copies.save(ctx, x)  # the input only: shared storage with whoever else holds it (or its host copy)
        ctx.params = params  # the module's own tensors, alive anyway: references, not saved tensors
        return _chunked(forward, rows, norm_dims, x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = host_copies.saved(ctx)
        params, norm_dims = ctx.params, ctx.norm_dims
        lead = x.shape[:x.dim() - norm_dims]
        flat_x = x.reshape(-1, *x.shape[x.dim() - norm_dims:])  # [R, *D]: a view for a contiguous input
        flat_g = grad_out.reshape(flat_x.shape[0], *grad_out.shape[len(lead):])  # [R, *D']
        want_x = ctx.needs_input_grad[3]
        grad_x = torch.empty_like(flat_x) if want_x else None  # [R, *D]
        param_grads = ChunkGradSums(params)
        rows = _check_rows(ctx.rows_now())
        with autocast_replayed(ctx.autocast), torch.enable_grad(), isolated_saved_tensors():
            for start in range(0, flat_x.shape[0], rows):
                end = min(start + rows, flat_x.shape[0])
                leaf = flat_x[start:end].detach().requires_grad_(want_x)  # [r, *D]
                y = ctx.forward(leaf)  # [r, *D']
                targets = ([leaf] if want_x else []) + list(params)
                if start == 0:
                    check_no_hidden_leaves(y, targets, "lean_norm")
                grads = iter(torch.autograd.grad(y, targets, flat_g[start:end], allow_unused=True))
                if want_x:
                    g = next(grads)
                    grad_x[start:end] = 0 if g is None else g
                    del g  # a chunk's gradient: not held beside the next chunk's
                param_grads.add(grads)
                del y, leaf
        host_copies.release(ctx)
        return (None, None, None, None if grad_x is None else grad_x.view(x.shape), *param_grads.cast())
