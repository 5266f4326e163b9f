"""Block and chunk sizes for the blockwise computations, validated in one place, and how many tokens a chunk holds."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

# The automatic chunk budget on a CUDA device: at most this share of its memory (an H100 80GB: 10 GB, the MLP of an 8B
# QLoRA layer at 32K tokens in two chunks), and half of what is free at the time beyond a reserve of an eighth of the
# device: near the longest context a step fits, where little is free, chunks keep the sizes set and the peak stays
# where it was.
CHUNK_BUDGET_SHARE = 1 / 8
CHUNK_BUDGET_RESERVE = 1 / 8
CHUNK_BUDGET_FREE_SHARE = 1 / 2


@dataclass(frozen=True)
class BPTConfig:
    """Sizes (in tokens) of the blocks the patched model works in.

    q_block / kv_block: query and key/value block of blockwise attention.
    mlp_chunk: tokens of one sequence chunk run through the whole MLP at a time.
    loss_chunk: tokens whose logits exist at one time in the LM head + cross entropy.
    norm_chunk: tokens whose norm temporaries (fp32 copies, statistics) exist at one time in a norm's backward.
    chunk_budget: bytes a chunk (MLP, norm, loss) may hold. Where a chunk of the sizes above holds less, it takes
        more tokens, up to the budget (balanced chunks, the whole sequence when it fits): fewer chunks, fewer kernel
        launches and host work per step. None: auto_chunk_budget (CUDA; 0 elsewhere); 0: the sizes above exactly.
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
    chunk_budget: int | None = None
    compile: bool | None = None
    eval_logits: bool = True
    offload_checkpoints: bool = False

    def __post_init__(self):
        for field in ("q_block", "kv_block", "mlp_chunk", "loss_chunk", "norm_chunk"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BPT option {field} must be a positive integer number of tokens, got {value!r}")
        budget = self.chunk_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"BPT option chunk_budget must be None (auto) or a number of bytes >= 0, got {budget!r}")
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

    def chunk_tokens(self, size: str, tokens: int, bytes_per_token: Callable[[], float | None],
                     device: torch.device) -> int:
        """Tokens per chunk for `tokens` tokens: the option `size` (e.g. "mlp_chunk"), or more where the chunk budget
        holds more at `bytes_per_token()` (asked only when there is a budget; None: unknown, the option as set).
        Chunks are balanced: 10K tokens at a budget of 6K make two chunks of 5K, not 6K + 4K."""
        configured = getattr(self, size)
        budget = self.chunk_budget if self.chunk_budget is not None else auto_chunk_budget(device)
        if not budget:
            return configured
        bytes_per_token = bytes_per_token()
        if not bytes_per_token:
            return configured
        largest = int(budget // bytes_per_token)
        if largest <= configured:
            return configured
        pieces = -(-tokens // largest)
        return -(-tokens // pieces)


def auto_chunk_budget(device: torch.device) -> int:
    """On a CUDA device the smaller of CHUNK_BUDGET_SHARE of its memory and CHUNK_BUDGET_FREE_SHARE of what is free
    now (the driver's free memory and the caching allocator's unused blocks) beyond CHUNK_BUDGET_RESERVE of it; 0 for
    other devices."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    spare = (free - total * CHUNK_BUDGET_RESERVE) * CHUNK_BUDGET_FREE_SHARE
    return int(max(0, min(total * CHUNK_BUDGET_SHARE, spare)))
