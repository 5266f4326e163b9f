"""Whole-sequence tensors of a decoder layer dropped from the device once the layer has read them for the last time
(under checkpoint offload): the attention's normed input, and the layer's input in its checkpoint's recompute.

A decoder layer's recompute (the first thing its backward does) runs the family's attention forward again, and at long
context its peak is the output projection: the family's code still holds the normed input it was given, beside q, k,
v, the attention's output, the projection's own output, the layer input (for the residual) and the incoming gradient.
The normed input is dead by then: the q / k / v projections, run in chunks (bpt.mlp.chunked_mlp), keep the norm's
input for their backward (its host copy, under offload) and rebuild the normed rows from it (bpt.norm.norm_source).
Nothing else reads it where the family's row names its readers (`Family.attention_input_readers`: a sequential
pre-norm layer, checked against its modeling code). Once each named projection has read it this way, its memory goes
back: the tensor the family holds becomes a single NaN expanded to its shape (its shape, dtype and device kept; a read
the row did not foresee would poison the loss, never pass for values).

The layer's input is the same story one step later in that recompute: the residual add has read it for the last time
when the post-attention norm runs (`Family.layer_input_span` names it and the input norm, in a sequential pre-norm layer),
and the norm's and projections' backward fetch it again from its host copy; but torch's checkpoint holds the copy it
gave the recompute until the recompute ends. At the post-attention norm it is dropped the same way.

Taken where the norm's input is saved as its host copy (bpt.host_copies: offloaded layer inputs over 1/32 of a CUDA
device, every one on a CPU): there the layer input is off the device from forward to backward, and the normed input is
one of the largest tensors of the recompute (4 of 26 KiB per token at Llama-3.2-1B). Elsewhere it is kept, as stock
keeps it.
"""
from __future__ import annotations

import functools
import weakref

import torch

from bpt import host_copies
from bpt.norm import norm_source

_READ_BY = "_bpt_read_by"  # on the attention's input: ids of the named projections that have read it


class AttentionInput:
    """The attention's input as its named projections (`readers`, the row's `attention_input_readers`) read it."""

    def __init__(self, readers: int):
        self.readers = readers

    def read(self, reader: torch.nn.Module, x: torch.Tensor) -> None:
        """`reader` has read `x` through chunked_mlp, which kept the norm's input in its place: after the last reader,
        `x`'s memory goes back (where that input is a host copy)."""
        source = norm_source(x)
        if source is None or source[2].shape[:2] != x.shape[:2] or not host_copies.registered(source[2]):
            return  # chunked_mlp kept x itself (or the layer input stays on the device): x stays
        read_by = getattr(x, _READ_BY, None)
        if read_by is None:
            read_by = set()
            setattr(x, _READ_BY, read_by)
        read_by.add(id(reader))
        if len(read_by) == self.readers:
            _drop(x)


class LayerInput:
    """A decoder layer's input in its checkpoint's recompute (the copy offload fetched back for it): noted when the
    row's first reader of it is called on it, dropped when the row's last reader is called (`Family.layer_input_span`).
    The readers are the layer's own modules: transformers may checkpoint the layer's forward itself, out of reach."""

    def __init__(self):
        self._input = None  # weakly, the recompute's layer input, from its first reader to its last

    def first_reader_forward(self, original):
        @functools.wraps(original)  # keeps what marks the original (a lean norm's forward)
        def forward(*args, **kwargs):
            x = args[0] if args else None
            self._input = weakref.ref(x) if isinstance(x, torch.Tensor) and host_copies.recomputed(x) else None
            return original(*args, **kwargs)
        return forward

    def last_reader_forward(self, original):
        @functools.wraps(original)
        def forward(*args, **kwargs):
            x = self._input() if self._input is not None else None
            self._input = None
            if x is not None:
                _drop(x)
            return original(*args, **kwargs)
        return forward


def _drop(x: torch.Tensor) -> None:
    """`x` keeps its shape, dtype and device; its memory goes back (unless another tensor shares it), a single NaN
    in its place."""
    x.data = x.new_full((1,) * x.dim(), float("nan")).expand(x.shape)
