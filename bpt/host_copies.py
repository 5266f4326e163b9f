"""Tensors saved for backward as the copy that already waits in host memory.

Under checkpoint offload (patches/offload.py) a decoder layer's input goes to the host when the layer's checkpoint
saves it, and comes back when the backward reaches the layer and recomputes it. Inside the layer the input norm and
the projections after it save that same input again, for their own backward, which runs last in the layer's: kept on
the device, it would sit there through the MLP's and the attention's backward, the layer's peak, as one more whole
[B, N, hidden] tensor. A tensor offload registers here (`register`) is saved instead as its host copy (`save`), and
fetched when a backward first asks for it (`saved`): one copy back per layer, shared by every node that saved it and
dropped when the last of them is done (`release`).

The attention's q, k and v wait for a backward of their own as well: saved in the layer's recompute, they sit on the
device through the rest of it and the MLP's backward, the layer's peak. While offload says so (`spill_to`: a backward
recomputing a layer whose input is a host copy), a tensor is saved as a stand-in (`spilled`: its shape, dtype and
device, one NaN of memory) whose host copy the backward fetches (`unspilled`) as a tensor of its own, whose memory
may then take a result. A checkpoint checks a recompute's saved tensors against the forward's by shape, dtype and
device, which the stand-in keeps.

On CUDA, offload registers only layer inputs large enough that a copy is a small part of the layer's backward (the
rule that stops its prefetch); on a CPU, every one, so the path is the one tests run.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

_COPIES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a device storage -> (HostCopy, users, tensor's layout)
_SPILLED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a stand-in's storage -> its tensor's HostCopy
_SPILL_TO = None  # weakly, the offload whose backward spills now (its `to_host(t) -> HostCopy`)


class HostCopy:
    """A tensor's copy in host memory: `fetch()` gives it back on the device. While nodes that saved it are waiting
    for their backward (`users`), the first fetched tensor is shared by them."""

    def __init__(self, fetch: Callable[[], torch.Tensor]):
        self.fetch, self.users, self.device = fetch, 0, None

    def get(self) -> torch.Tensor:
        if self.device is None:
            self.device = self.fetch()
        return self.device

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.device = None


def register(tensor: torch.Tensor, copy: HostCopy, users: bool = True) -> None:
    """`tensor`'s values are `copy`'s: the layer input offload saved (`users`: whoever saves it is a node whose
    backward will run), or the one it fetched back for the checkpoint's recompute (whose nodes are not the ones
    backward runs: a checkpoint's backward runs the forward's nodes on the recomputed tensors). Known by its storage:
    the recompute is given a detached tensor of it."""
    _COPIES[tensor.untyped_storage()] = copy, users, _layout(tensor)


def _layout(t: torch.Tensor) -> tuple:
    """What makes two tensors of one storage the same values: the same view of it, neither changed in place since."""
    return t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` are one view of one storage (a detached tensor of the other, say), neither changed in place since."""
    return a.untyped_storage() is b.untyped_storage() and _layout(a) == _layout(b)


def _copy_of(t) -> tuple[HostCopy, bool] | None:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    entry = _COPIES.get(t.untyped_storage())
    return entry[:2] if entry is not None and entry[2] == _layout(t) else None


def registered(t: torch.Tensor) -> bool:
    """Whether `t` is saved as its host copy (a registered layer input, or the one fetched for its recompute)."""
    return _copy_of(t) is not None


def recomputed(t: torch.Tensor) -> bool:
    """Whether `t` is the copy fetched back for a checkpoint's recompute (registered without users)."""
    entry = _copy_of(t)
    return entry is not None and not entry[1]


def save(ctx, *tensors: torch.Tensor) -> None:
    """`ctx.save_for_backward(*tensors)`, a registered tensor saved as its host copy instead. A forward and its
    checkpoint's recompute save the same tensors, so the recompute's saved tensors still match the forward's."""
    found = [_copy_of(t) for t in tensors]
    ctx.save_for_backward(*[t if entry is None else None for t, entry in zip(tensors, found)])
    ctx.host_copies = [None if entry is None else entry[0] for entry in found]
    for entry in found:
        if entry is not None and entry[1]:
            entry[0].users += 1


def saved(ctx) -> tuple:
    """What `save` saved on `ctx` (a Function's ctx, or its node), each host copy back on the device."""
    tensors = ctx.saved_tensors
    copies = getattr(ctx, "host_copies", None) or [None] * len(tensors)
    return tuple(t if copy is None else copy.get() for t, copy in zip(tensors, copies))


def release(ctx) -> None:
    """`ctx`'s backward is done with its host copies: the last user's release frees their device tensor."""
    for copy in getattr(ctx, "host_copies", None) or ():
        if copy is not None:
            copy.release()
    ctx.host_copies = None


def spill_to(offload) -> None:
    """`offload` (patches/offload.CheckpointOffload) takes what `spilled` is given from now on; None: nothing does."""
    global _SPILL_TO
    _SPILL_TO = None if offload is None else weakref.ref(offload)


def spilled(t: torch.Tensor) -> torch.Tensor:
    """`t`, or while an offload spills (`spill_to`), a stand-in to save for backward in its place: a single NaN
    expanded to its shape (its dtype and device), whose host copy `unspilled` fetches."""
    offload = _SPILL_TO() if _SPILL_TO is not None else None
    if offload is None:
        return t
    stand_in = t.new_full((1,) * t.dim(), float("nan")).expand(t.shape)
    _SPILLED[stand_in.untyped_storage()] = offload.to_host(t)
    return stand_in


def unspilled(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the tensor `t` stands in for, fetched now: the caller's own, nothing else reads it, True), or (t, False)."""
    copy = _SPILLED.get(t.untyped_storage())
    return (t, False) if copy is None else (copy.fetch(), True)
