"""Block and chunk sizes for the blockwise computations, validated in one place."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class BPTConfig:
    """Sizes (in tokens) of the blocks the patched model works in.

    q_block / kv_block: query and key/value block of blockwise attention.
    mlp_chunk: tokens of one sequence chunk run through the whole MLP at a time.
    loss_chunk: tokens whose logits exist at one time in the LM head + cross entropy.
    norm_chunk: tokens whose norm temporaries (fp32 copies, statistics) exist at one time in a norm's backward.
    compile: torch.compile the per-block functions; None means "where it was measured
        to help" (CUDA tensors), True forces it, False turns it off.
    eval_logits: with labels in eval mode (`model.eval()`), also return the full logits, as stock
        does (HF Trainer's evaluate / predict / compute_metrics need them; they cost N x vocab
        memory). False keeps evaluation like training: loss only, logits None, O(N) memory.
    offload_checkpoints: in training, keep the whole-sequence activations saved between forward and backward (the
        layer checkpoints, the final norm's and the loss's input) in host memory (patches/offload.py); needs
        gradient checkpointing.
    """

    q_block: int = 1024
    kv_block: int = 1024
    mlp_chunk: int = 2048
    loss_chunk: int = 1024
    norm_chunk: int = 2048
    compile: bool | None = None
    eval_logits: bool = True
    offload_checkpoints: bool = False

    def __post_init__(self):
        for field in ("q_block", "kv_block", "mlp_chunk", "loss_chunk", "norm_chunk"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BPT option {field} must be a positive integer number of tokens, got {value!r}")
        if self.compile not in (None, True, False):
            raise ValueError(f"BPT option compile must be True, False or None (auto), got {self.compile!r}")
        for field in ("eval_logits", "offload_checkpoints"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"BPT option {field} must be True or False, got {getattr(self, field)!r}")

    @classmethod
    def from_options(cls, **options) -> "BPTConfig":
        """Build from keyword options, rejecting unknown names with the list of valid ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"unknown BPT option(s) {unknown}; valid options are {names}")
        return cls(**options)
