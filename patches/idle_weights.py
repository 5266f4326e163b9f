"""Under checkpoint offload, a frozen input embedding and LM head wait in host memory from the end of a long training
forward to the end of its backward.

The patched loss takes the LM head's gradients inside the forward (bpt.loss) and a frozen embedding's backward reads
nothing, so neither weight is read between a training forward and the next forward, while the layers' backward, where
the step's peak sits under offload, runs: Llama-3.1-8B's two (128K vocabulary) are 2 GiB of the device. They leave only
where one layer input, which offload already copies out and back for every layer, is at least their size: the copy
back then adds at most one checkpoint's share to offload's traffic. Shorter steps keep them on the device.

A weight leaves by swapping its module's Parameter for one holding a pinned host copy (made once per weight): whatever
still holds the device tensor (a graph that reads it, e.g. a custom loss through the head's logits) keeps it until
done, so nothing can read a missing weight. The end of the backward puts a device Parameter back (and so does the next
forward, where no backward came). Only plain, frozen, unsharded floating-point weights move: not FSDP's DTensors, not
DeepSpeed's partitions, not a LoRA-wrapped or 4-bit head. Tied weights move once and come back tied.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn


class IdleWeights:
    """The frozen input / output embedding weights of `model` that may leave its device during a backward.

    to_host: the copy made of a device weight (default: pinned on CUDA, plain otherwise; the simulated device's
    fake tensors included); devices: the device types whose weights move. Tests on a CPU stand a clone in for the
    host and name "cpu"."""

    def __init__(self, model: nn.Module, to_host=None, devices: tuple[str, ...] = ("cuda",)):
        self.model, self.devices = model, devices
        self.to_host = to_host or _host_copy
        self.away: list[tuple[list[tuple[nn.Module, str]], nn.Parameter, torch.device]] = []
        self.hosts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(device Parameter) -> (it, host copy)

    def movable(self) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
        """(weight, the modules holding it) of the embeddings that may move, tied ones once."""
        found: dict[int, tuple[nn.Parameter, list]] = {}
        for get in ("get_input_embeddings", "get_output_embeddings"):
            module = getattr(self.model, get, lambda: None)()
            if not isinstance(module, (nn.Embedding, nn.Linear)):  # a 4-bit head's weight is not floating point
                continue
            weight = module._parameters.get("weight")
            if _movable(weight, self.devices):
                found.setdefault(id(weight), (weight, []))[1].append((module, "weight"))
        return list(found.values())

    def leave(self, layer_input_bytes: int) -> None:
        """Move the weights to the host when one layer input (bytes) is at least their size."""
        weights = self.movable()
        if not weights or layer_input_bytes < sum(w.numel() * w.element_size() for w, _ in weights):
            return
        for weight, holders in weights:
            known = self.hosts.get(id(weight))
            host = known[1] if known is not None and known[0]() is weight else self.to_host(weight.detach())
            self.hosts.pop(id(weight), None)
            away = nn.Parameter(host, requires_grad=False)
            for module, name in holders:
                module._parameters[name] = away
            self.away.append((holders, away, weight.device))

    def come_back(self) -> None:
        """Put every weight that left back on its device (a new Parameter, the same values), tied ones tied."""
        while self.away:
            holders, away, device = self.away.pop()
            if any(module._parameters.get(name) is not away for module, name in holders):
                continue  # replaced by someone else meanwhile (e.g. resized embeddings): theirs stays
            weight = nn.Parameter(away.data.to(device, non_blocking=True), requires_grad=False)
            for module, name in holders:
                module._parameters[name] = weight
            self.hosts[id(weight)] = (weakref.ref(weight), away.data)

    def come_back_after_backward(self) -> None:
        """Called from a saved tensor's unpack: inside a backward, come back once it ends."""
        if self.away and torch._C._current_graph_task_id() != -1:
            torch.autograd.Variable._execution_engine.queue_callback(self.come_back)


def _movable(weight, devices: tuple[str, ...]) -> bool:
    if not isinstance(weight, nn.Parameter) or weight.requires_grad or not weight.is_floating_point():
        return False
    if weight.device.type not in devices or hasattr(weight, "ds_id"):  # DeepSpeed ZeRO-3's partition
        return False
    from torch.distributed.tensor import DTensor

    return not isinstance(weight.data, DTensor)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    from torch._subclasses.fake_tensor import is_fake

    if t.is_cuda and not is_fake(t) and torch.cuda.is_available():
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t)
    return t.to("cpu", copy=True)
