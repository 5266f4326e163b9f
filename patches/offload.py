"""Checkpoint offload: the whole-sequence activations a checkpointed model keeps between forward and backward live in
host memory.

With gradient checkpointing, what stays alive from forward to backward is each decoder layer's input (torch's
non-reentrant checkpoint saves it through autograd, before its own hooks take over inside the layer), plus the final
norm's and the loss's input: [B, N, hidden] each, the memory floor at long context. Saved-tensor hooks around the
model's forward move every such tensor to the host as it is saved, and back in backward:
- on CUDA the copies run on a side stream (the compute stream does not wait for them), into pinned host buffers; the
  device tensor's memory is handed back to the allocator only once its copy is done (`record_stream`);
- backward needs the layers' inputs in reverse order, so when one comes back the one saved before it starts its copy
  back at once (prefetch one layer ahead): the compute stream waits only on the copy it needs now. A layer input
  over 1/32 of the device is not fetched ahead (`_prefetches`): at that length the copy is ~1% of the layer's work.
- such a large layer input is also registered with bpt.host_copies: inside the layer, its input norm and projections
  save it as this host copy, fetched once more after the layer's MLP and attention backward (on a CPU, every layer
  input, the tests' path).
- in such a layer's recompute the attention's q, k and v go to the host as well (bpt.host_copies.spilled), and come
  back when its backward runs, as that backward's own tensors (their memory takes the gradients).
- on CPU (and in the simulation) the copy is a plain one, made when saved and undone when needed.
- a long step's frozen input embedding and LM head wait on the host through the backward (patches/idle_weights.py).
- where the host cannot hold them all, the last `keep_last` saved tensors stay on the device (BPTConfig
  offload_keep_last): each goes to the host only once `keep_last` more have been saved, so those the forward saved
  last, which the backward needs first (the loss's and final norm's inputs, then the last layers'), are never copied.
  Each keeps one [B, N, hidden] tensor on the device and frees as much host memory; the planner chooses how many.
transformers' `activation_checkpointing_enable(offload=True)` wraps each layer's checkpoint in torch's `save_on_cpu`:
copies on the compute stream, no prefetch, and it skips the loss's and final norm's inputs. Values are copied, never
converted: gradients are bitwise those of the run without offload.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake

from bpt import host_copies
from bpt.host_copies import HostCopy
from patches.idle_weights import IdleWeights


PREFETCH_SHARE = 1 / 32


class _Saved:
    """One offloaded tensor: its host copy, and its device copy while it is on its way back; or, one of the last
    `keep_last` saved, the tensor itself (`kept`) until the backward is past it."""

    __slots__ = ("host", "device", "ready", "index", "copy", "kept")

    def __init__(self, host: torch.Tensor | None, index: int, kept: torch.Tensor | None = None):
        self.host, self.device, self.ready, self.index, self.kept = host, None, None, index, kept
        self.copy = None  # its bpt.host_copies.HostCopy, where the layers save it as that


class CheckpointOffload:
    """Pack / unpack hooks of one forward + backward. `tokens`: B * N; `width`: hidden size. Tensors of at least
    tokens x width elements whose leading dims are the tokens go to the host; everything else stays."""

    def __init__(self, tokens: int, width: int, batch_and_length: tuple[int, int], idle: IdleWeights | None = None,
                 keep_last: int = 0):
        self.tokens, self.width, self.batch_and_length = tokens, width, batch_and_length
        self.keep_last = keep_last  # the last saved stay on the device (module docstring)
        self.idle = idle  # weights away from the device until this backward ends
        self.saved: list[_Saved] = []
        self.stream = None  # CUDA side stream, made on the first real CUDA tensor
        self.device = None
        self.embedding_output = None  # weakly, the embedding's output, until it is handed over to its host copy
        self.embedding_packed = None  # its _Saved, where it is the first layer's input
        self.in_backward = False

    def offloads(self, t: torch.Tensor) -> bool:
        if isinstance(t, torch.nn.Parameter) or not t.is_floating_point() or t.device.type == "meta":
            return False
        if t.numel() < self.tokens * self.width:
            return False
        return tuple(t.shape[:2]) == self.batch_and_length or t.shape[0] == self.tokens

    def pack(self, t: torch.Tensor):
        if not self.offloads(t):
            return t
        if self.embedding_packed is not None:  # the next layer's input: the first layer's forward is over
            self._hand_over_embedding_output()
        self.device = t.device
        packed = _Saved(None, len(self.saved), kept=t)
        self.saved.append(packed)
        if self._saved_as_host_copy(t):
            packed.copy = HostCopy(functools.partial(self._fetched, packed))
            host_copies.register(t, packed.copy)
        if self.embedding_output is not None and self.embedding_packed is None:
            embedding = self.embedding_output()
            if embedding is not None and host_copies.same_values(embedding, t):
                self.embedding_packed = packed
            else:
                self.embedding_output = None
        if len(self.saved) > self.keep_last:
            self._send(self.saved[-1 - self.keep_last])
        return packed

    def _send(self, packed: _Saved) -> None:
        packed.host, packed.kept = self._to_host(packed.kept), None
        if packed is self.embedding_packed and self.keep_last:  # (else the next pack hands it over)
            self._hand_over_embedding_output()

    def embedding_hook(self, module, inputs, output):
        """A forward hook on the input embedding. transformers' `enable_input_require_grads` (on with every
        checkpointed model) makes a frozen embedding's output a leaf that requires grad, only so that reentrant
        checkpointing sees an input requiring grad. Autograd keeps such a leaf alive until backward ends, on the
        device, whatever the saved-tensor hooks do: [B, N, hidden], as large as a checkpoint. Without reentrancy
        nothing needs its gradient, so the layers get a detached view. And the model's forward holds the output
        (`inputs_embeds`) to its end: where it is the first layer's input, it is handed over to its host copy once
        that layer's forward is over (`_hand_over_embedding_output`)."""
        if not isinstance(output, torch.Tensor):
            return None
        kept = output.detach() if output.is_leaf and output.requires_grad else output
        self.embedding_output = weakref.ref(kept)
        return kept if kept is not output else None

    def _hand_over_embedding_output(self) -> None:
        """The embedding's output, still held by the model's forward (`inputs_embeds`) after the first layer, its one
        reader, is done with it, points at its host copy: its device memory goes back at once, not when the forward
        ends (at the forward's peak it was one of the layer inputs alive). A later reader would get the values, on
        the host. Not for an output that requires grad (autograd may have saved it)."""
        if self.embedding_packed.host is None:  # still one of the last saved, on the device: handed over when sent
            return
        embedding, packed = self.embedding_output(), self.embedding_packed
        self.embedding_output = self.embedding_packed = None
        if embedding is None or embedding.requires_grad:
            return
        embedding.data = packed.host

    def largest_bytes(self) -> int:
        """The largest tensor moved to the host (a layer input), in bytes."""
        return max((t.numel() * t.element_size() for p in self.saved for t in (p.host, p.kept) if t is not None),
                   default=0)

    def unpack(self, packed):
        if self.idle is not None:  # the backward has begun: the weights come back when it ends
            self.idle, idle = None, self.idle
            idle.come_back_after_backward()
        if not isinstance(packed, _Saved):
            return packed
        if not self.in_backward and torch._C._current_graph_task_id() != -1:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        host_copies.spill_to(self if self.in_backward and packed.copy is not None else None)
        tensor = self._fetched(packed)
        for other in self.saved[packed.index + 1:]:  # layers whose backward is over: a copy a node never asked
            other.kept = None                        # to release (or a kept tensor) is not kept beside this
            if other.copy is not None:               # layer's backward
                other.copy.device = None
        if packed.copy is not None:  # the layer's recompute saves it as the host copy too
            host_copies.register(tensor, packed.copy, users=False)
        if packed.index > 0 and self._prefetches(tensor):
            self._fetch(self.saved[packed.index - 1])  # the next one backward needs: on its way while this one works
        return tensor

    def to_host(self, t: torch.Tensor) -> HostCopy:
        """`t`'s host copy, fetched back as a new device tensor each time it is asked for (bpt.host_copies.spilled)."""
        return HostCopy(functools.partial(self._fetched, _Saved(self._to_host(t), -1)))

    def _backward_done(self) -> None:
        self.in_backward = False
        for packed in self.saved:
            packed.kept = None
        host_copies.spill_to(None)

    def _fetched(self, packed: _Saved) -> torch.Tensor:
        """`packed` on the device, once the compute stream may read it."""
        if packed.kept is not None:
            return packed.kept
        self._fetch(packed)
        if packed.ready is not None:
            torch.cuda.current_stream().wait_event(packed.ready)
        tensor, packed.device, packed.ready = packed.device, None, None
        return tensor

    def _saved_as_host_copy(self, t: torch.Tensor) -> bool:
        """Whether the layers save `t` as its host copy (bpt.host_copies): on CUDA where it is too large to prefetch
        (a copy is ~1% of its layer's backward), on a CPU always (the tests' path)."""
        return t.device.type == "cpu" or not self._prefetches(t)

    def _prefetches(self, t: torch.Tensor) -> bool:
        """Fetch the next one ahead unless it is over PREFETCH_SHARE of the device: a layer input that large (8B:
        over 300K tokens) takes ~1% of its layer's backward to copy (attention grows with the square of the
        length, the copy with the length), while held ahead it would sit beside the layer's whole working set."""
        total = device_bytes(t.device)
        return total is None or t.numel() * t.element_size() <= total * PREFETCH_SHARE

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda and not is_fake(t) and torch.cuda.is_available():
            return self._to_host_async(t)
        return t.to("cpu", copy=True)  # CPU: a copy, so the path is the real one; simulation: a host tensor

    def _to_host_async(self, t: torch.Tensor) -> torch.Tensor:
        if self.stream is None:
            self.stream = torch.cuda.Stream(t.device)
        host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True) \
            if torch.ops.aten.is_non_overlapping_and_dense(t) else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # its memory is reused only after the copy
        return host

    def _fetch(self, packed: _Saved) -> None:
        if packed.device is not None or packed.kept is not None:
            return
        if self.stream is None:
            packed.device = packed.host.to(self.device, copy=True)
            return
        with torch.cuda.stream(self.stream):
            packed.device = packed.host.to(self.device, non_blocking=True)
            packed.ready = torch.cuda.Event()
            packed.ready.record(self.stream)
        packed.device.record_stream(torch.cuda.current_stream(self.device))

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def device_bytes(device: torch.device) -> int | None:
    """The memory of a CUDA device (the simulated one's too); None for others."""
    return torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None


def checkpointed(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def checkpointed_without_reentrancy(model) -> bool:
    """Every checkpointed module uses torch's non-reentrant checkpoint (transformers' default): its layers' LoRA
    weights get their gradients whether or not the layer's input requires grad."""
    functions = [getattr(m, "_gradient_checkpointing_func", None) for m in model.modules()
                 if getattr(m, "gradient_checkpointing", False)]
    return bool(functions) and all(getattr(f, "keywords", {}).get("use_reentrant") is False for f in functions)


def offloading_forward(model, original, width: int, keep_last: int = 0):
    """`model.forward` that runs `original` under a fresh CheckpointOffload when it trains (grad enabled, train
    mode), the frozen embeddings away from the device until its backward ends where the step is long (IdleWeights);
    refuses to train without gradient checkpointing (everything would be offloaded, very slowly)."""
    idle = IdleWeights(model)

    @functools.wraps(original)  # its signature: HF Trainer drops the dataset columns a forward does not name
    def forward(*args, **kwargs):
        idle.come_back()  # a forward with no backward since the last one
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = tuple((ids if ids is not None else embeds).shape[:2]) if (ids is not None or embeds is not None) \
            else None
        if not (model.training and torch.is_grad_enabled()) or shape is None or len(shape) < 2:
            return original(*args, **kwargs)
        if not checkpointed(model):
            raise RuntimeError("offload_checkpoints=True moves the layer checkpoints to host memory, and this model "
                               "trains without gradient checkpointing: call model.gradient_checkpointing_enable() "
                               "(train.qlora: drop --no_gradient_checkpointing) or patch without offload_checkpoints")
        offload = CheckpointOffload(shape[0] * shape[1], width, shape, idle, keep_last)
        host_copies.spill_to(None)  # a backward that never ended (an error) spills no more
        embedding = model.get_input_embeddings() if checkpointed_without_reentrancy(model) else None
        leaf_cut = embedding.register_forward_hook(offload.embedding_hook) if embedding is not None else None
        try:
            with offload.hooks():
                output = original(*args, **kwargs)
        finally:
            if leaf_cut is not None:
                leaf_cut.remove()
        idle.leave(offload.largest_bytes())
        return output

    return forward
