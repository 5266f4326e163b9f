"""Checkpoint stride: of the decoder layers' checkpointed inputs, keep one in every `checkpoint_stride` and run the
layers before each other one forward again, from the last kept input, when the backward needs it.

With gradient checkpointing a step keeps every layer's input from forward to backward: layers x tokens x hidden, the
floor of a long step's device memory (256 KiB per token at Llama-3.1-8B shapes). With a stride of k the floor is
divided by k, for (k - 1) / 2 more layer forwards per layer on average (k = 2: one in two layers runs its forward a
third time, about an eighth of a checkpointed step). Offload (patches/offload.py) moves the same floor to host memory
instead, at no compute, where the host has room.

How: saved-tensor hooks around the model's forward, the door offload uses (torch's checkpoint saves a layer's inputs
through autograd before its own hooks take over). Hooks on each checkpointed layer record the call that made each
output; when the next checkpoint saves that very tensor (same object, not modified since), the call is saved in its
place. When the backward unpacks it, the call runs again: under the RNG state and autocast it first ran under, with
gradients on as then (the same kernels: bitwise the same values) and nothing of its graph kept. A recorded call holds
its own input the same way (kept, or a call itself), at most k - 1 calls deep. The layer hooks live for one forward.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.weak import WeakTensorKeyDictionary
from transformers.modeling_layers import GradientCheckpointingLayer

from bpt.recompute import RngSnapshot, autocast_replayed, autocast_state
from patches.offload import checkpointed_without_reentrancy


class _Call:
    """One decoder layer's forward, as it ran: enough to run it again. `source`: its hidden-states input, the tensor
    itself where that was kept, else the _Call that made it; `depth`: the calls that run to remake its output."""

    __slots__ = ("layer", "source", "args", "kwargs", "rng", "autocast", "version", "saved_as_call")

    def __init__(self, layer, args: tuple, kwargs: dict):
        hidden = args[0]
        self.layer, self.source, self.args, self.kwargs = layer, hidden, args[1:], kwargs
        self.rng, self.autocast = RngSnapshot([hidden]), autocast_state([hidden])
        self.version = None  # the output's version counter when the call returned
        self.saved_as_call = False

    @property
    def depth(self) -> int:
        return 1 + (self.source.depth if isinstance(self.source, _Call) else 0)

    def run(self) -> torch.Tensor:
        hidden = self.source.run() if isinstance(self.source, _Call) else self.source
        layer = self.layer
        with self.rng.replayed(), autocast_replayed(self.autocast), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(_drop, _drop):  # run as first, keep none of its graph
            checkpointing, layer.gradient_checkpointing = layer.gradient_checkpointing, False  # transformers >=
            try:  # 5.24 checkpoints inside forward
                output = layer.forward(hidden, *self.args, **self.kwargs)
            finally:
                layer.gradient_checkpointing = checkpointing
        return _hidden_of(output).detach()


def _drop(_):
    return None


def _hidden_of(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class StridedCheckpoints:
    """The hooks of one training forward and its backward at stride `stride` (>= 2)."""

    def __init__(self, stride: int):
        self.stride = stride
        self.made_by = WeakTensorKeyDictionary()  # layer output -> the _Call that made it (this forward only)
        self.running: dict[int, _Call] = {}  # id(layer) -> its call in progress

    def before_layer(self, layer, args, kwargs):
        if args and isinstance(args[0], torch.Tensor):
            self.running[id(layer)] = _Call(layer, args, kwargs)

    def after_layer(self, layer, args, kwargs, output):
        call = self.running.pop(id(layer), None)
        hidden = _hidden_of(output)
        if call is None or not isinstance(hidden, torch.Tensor):
            return
        made = self.made_by.get(call.source)  # its input was a call's output: saved as that call, or kept
        if made is not None and made.saved_as_call:
            call.source = made
        call.version = hidden._version
        self.made_by[hidden] = call

    def pack(self, t: torch.Tensor):
        call = self.made_by.get(t)
        if call is None or t._version != call.version or call.depth >= self.stride:
            return t
        call.saved_as_call = True
        return call

    @staticmethod
    def unpack(packed):
        return packed.run() if isinstance(packed, _Call) else packed

    @contextlib.contextmanager
    def installed(self, layers):
        handles = []
        try:
            for layer in layers:
                handles.append(layer.register_forward_pre_hook(self.before_layer, with_kwargs=True))
                handles.append(layer.register_forward_hook(self.after_layer, with_kwargs=True))
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            for handle in handles:
                handle.remove()
            self.made_by, self.running = WeakTensorKeyDictionary(), {}


def checkpointed_layers(model) -> list:
    return [m for m in model.modules()
            if isinstance(m, GradientCheckpointingLayer) and getattr(m, "gradient_checkpointing", False)]


def _sharded(parameter) -> bool:
    """A weight FSDP2 (a DTensor) or DeepSpeed ZeRO-3 (ds_id) gathers in a layer's hooks."""
    from torch.distributed.tensor import DTensor

    return isinstance(parameter, DTensor) or hasattr(parameter, "ds_id")


def strided_forward(model, original, stride: int):
    """`model.forward` that runs `original` under StridedCheckpoints when it trains (grad enabled, train mode);
    refuses to train without gradient checkpointing (there would be no checkpoints to thin)."""

    @functools.wraps(original)  # its signature: HF Trainer drops the dataset columns a forward does not name
    def forward(*args, **kwargs):
        if not (model.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        layers = checkpointed_layers(model)
        if not layers:
            raise RuntimeError(f"checkpoint_stride={stride} keeps one layer checkpoint in {stride}, and this model "
                               "trains without gradient checkpointing: call model.gradient_checkpointing_enable() "
                               "(train.qlora: drop --no_gradient_checkpointing) or patch with checkpoint_stride=1")
        if not checkpointed_without_reentrancy(model):  # reentrant: the layers' first forward ran without grad
            raise RuntimeError(f"checkpoint_stride={stride} needs torch's non-reentrant checkpoint (transformers' "
                               "default): gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                               "{'use_reentrant': False}), or patch with checkpoint_stride=1")
        if any(_sharded(p) for p in layers[0].parameters()):
            raise RuntimeError(f"checkpoint_stride={stride} remakes layers outside the hooks that gather sharded "
                               "weights (FSDP, DeepSpeed ZeRO-3): use offload_checkpoints=True with them, or "
                               "checkpoint_stride=1")
        with StridedCheckpoints(stride).installed(layers):
            return original(*args, **kwargs)

    return forward
