"""What every recompute-in-backward op here shares (bpt.mlp's chunked MLP, bpt.norm's lean norm, bpt.loss,
patches/checkpoint_stride.py): replaying the forward's RNG streams and autocast state, keeping an inner graph's saved
tensors away from the caller's hooks, failing loudly when the recomputed forward used a trainable tensor it was
not given, and summing parameter gradients over chunks."""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch


def autocast_state(tensors: Sequence[torch.Tensor]) -> list[tuple[str, bool, torch.dtype]]:
    """Autocast (enabled, dtype) per device type in use, to replay the forward's precision in backward
    (backward may run on another thread, or outside the caller's autocast region)."""
    device_types = {"cpu"} | {t.device.type for t in tensors if t.device.type != "meta"}
    return [(dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in sorted(device_types)]


@contextlib.contextmanager
def autocast_replayed(state: list[tuple[str, bool, torch.dtype]]):
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled))
        yield


class RngSnapshot:
    """CPU RNG state plus that of every accelerator device holding one of `tensors`."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.cpu = torch.get_rng_state()
        self.devices: dict[str, dict[int, torch.Tensor]] = {}
        for t in tensors:
            device = t.device
            if device.type in ("cpu", "meta") or device.index in self.devices.get(device.type, {}):
                continue
            module = torch.get_device_module(device.type)
            self.devices.setdefault(device.type, {})[device.index] = module.get_rng_state(device.index)

    @contextlib.contextmanager
    def replayed(self):
        """Run the body from the captured states, then give the caller back its own RNG streams."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[]))  # CPU
            for device_type, states in self.devices.items():
                stack.enter_context(torch.random.fork_rng(devices=list(states), device_type=device_type))
            torch.set_rng_state(self.cpu)
            for device_type, states in self.devices.items():
                module = torch.get_device_module(device_type)
                for index, state in states.items():
                    module.set_rng_state(state, index)
            yield


def isolated_saved_tensors():
    """Keep the tensors saved by a transient inner graph away from the caller's saved-tensor hooks
    (activation checkpointing would try to recompute them, CPU offload would copy them).
    Only the innermost hooks apply; detach() in pack avoids a reference cycle through grad_fn."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t)


def check_no_hidden_leaves(y: torch.Tensor, known: Sequence[torch.Tensor], caller: str):
    """Fail loudly if forward used a trainable tensor that was not passed in `params`: it would
    otherwise silently get no gradient (the forward pass ran under no_grad)."""
    # Leaves are matched by their gradient accumulator node: saved-tensor hooks (checkpoint, offload)
    # hand back other Python objects for the same parameter.
    known_nodes = {torch.autograd.graph.get_gradient_edge(t).node for t in known}
    stack, seen = [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # only AccumulateGrad nodes hold a leaf tensor
        if leaf is not None and node not in known_nodes:
            raise RuntimeError(f"{caller}: forward uses a trainable tensor of shape {tuple(leaf.shape)} that "
                               "was not passed in params; pass every parameter forward uses")
        stack.extend(next_node for next_node, _ in node.next_functions)


class ChunkGradSums:
    """Each parameter's gradient summed over a backward's chunks in float32 (or wider), cast to its dtype once."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params, self.sums = params, [None] * len(params)

    def add(self, grads) -> None:
        """One chunk's gradients, in the order of `params`; None: a parameter this chunk did not use (an MoE expert
        no token picked)."""
        for j, g in enumerate(grads):
            if g is None:
                continue
            if self.sums[j] is None:  # our own buffer: g may alias a tensor autograd still holds
                p = self.params[j]
                self.sums[j] = torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
            self.sums[j].add_(g)

    def cast(self) -> list[torch.Tensor | None]:
        return [None if g is None else g.to(p.dtype) for g, p in zip(self.sums, self.params)]
