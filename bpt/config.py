"""Block and chunk sizes for the blockwise computations, validated in one place, and how many tokens a chunk holds."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

# torch is imported where a device is asked about, not here: `import bpt` (and the flag schema of train.qlora, which
# reads these defaults) stays a fraction of a second, so a mistake in the flags is refused before torch loads.

# The automatic chunk budget on a CUDA device: at most this share of its memory (an H100 80GB: 10 GB, the MLP of an 8B
# QLoRA layer at 32K tokens in two chunks), and a quarter of what is free at the time beyond a reserve of a quarter of
# the device: a chunk is sized when its forward runs, and its backward comes when more is held (a checkpointed layer's
# recomputed activations, the gradients), so near the longest context a step fits, where little is free, chunks keep
# the sizes set (8B QLoRA at 1M tokens with offload: half of what is free beyond an eighth put the MLP's backward
# 3.5 GiB over the card, simulated).
CHUNK_BUDGET_SHARE = 1 / 8
CHUNK_BUDGET_RESERVE = 1 / 4
CHUNK_BUDGET_FREE_SHARE = 1 / 4


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
    eval_logits: with labels in evaluation (`model.eval()` and gradients off, as HF Trainer's evaluate / predict
        run), also return the full logits, as stock does (compute_metrics needs them; they cost N x vocab memory).
        With gradients on, logits are never made, whatever model.training. False keeps evaluation like training:
        loss only, logits None, O(N) memory.
    offload_checkpoints: in training, keep the whole-sequence activations saved between forward and backward (the
        layer checkpoints, the final norm's and the loss's input) in host memory (patches/offload.py); needs
        gradient checkpointing.
    offload_keep_last: with offload_checkpoints, how many of the tensors saved last stay on the device (the first the
        backward needs: the loss's and the final norm's input, then the last layers' inputs), where the host cannot
        hold them all: each keeps one [B, N, hidden] tensor on the device and frees as much host memory. 0 sends every
        one; `--plan` and the bench's simulation choose it where a machine's host memory is over.
    checkpoint_stride: in training, keep one decoder layer's checkpointed input in every `checkpoint_stride` and
        remake the others from the one kept before them when the backward needs them (patches/checkpoint_stride.py):
        the checkpoints' device memory divided by the stride, for (stride - 1) / 2 more layer forwards per layer.
        1 keeps every one (stock's checkpointing); needs gradient checkpointing, not with offload_checkpoints.
    attention_once: in training with (non-reentrant) gradient checkpointing, keep the fused attention's output and
        logsumexp from a layer's forward so that its recompute in backward does not run the attention forward again
        (bpt.attention_once): one more [B, N, Hq * Dv] tensor per layer on the device, about a fifth of a long step
        saved. True keeps, False recomputes, None (auto) keeps where a forward's kept tensors fit in a quarter of the
        device's memory.
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
    offload_keep_last: int = 0
    checkpoint_stride: int = 1
    attention_once: bool | None = None

    def __post_init__(self):
        for field in ("q_block", "kv_block", "mlp_chunk", "loss_chunk", "norm_chunk"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BPT option {field} must be a positive integer number of tokens, got {value!r}")
        budget = self.chunk_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"BPT option chunk_budget must be None (auto) or a number of bytes >= 0, got {budget!r}")
        for field in ("compile", "attention_once"):
            if getattr(self, field) not in (None, True, False):
                raise ValueError(f"BPT option {field} must be True, False or None (auto), got {getattr(self, field)!r}")
        for field in ("eval_logits", "offload_checkpoints"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"BPT option {field} must be True or False, got {getattr(self, field)!r}")
        keep = self.offload_keep_last
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"BPT option offload_keep_last must be an integer >= 0 (tensors left on the device), "
                             f"got {keep!r}")
        if keep and not self.offload_checkpoints:
            raise ValueError("BPT option offload_keep_last keeps the last of the offloaded tensors on the device: it "
                             "needs offload_checkpoints=True")
        stride = self.checkpoint_stride
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"BPT option checkpoint_stride must be an integer >= 1 (1: every layer checkpoint "
                             f"kept), got {stride!r}")
        if stride > 1 and self.offload_checkpoints:
            raise ValueError("BPT options checkpoint_stride > 1 and offload_checkpoints=True both lower the "
                             "checkpoints' device memory: choose one")

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
        The largest chunk the budget allows is taken in steps of the set size times a power of two, then balanced
        (10K tokens, set size 1K, a budget of 6K tokens: chunks of at most 4K, three of 3,334): what is free moves by
        some MiB from call to call (the order frees come in), and chunks that followed it to the token would move the
        step's peak with it and give the caching allocator a new block size each call."""
        configured = getattr(self, size)
        budget = self.budget_now(device)
        if not budget:
            return configured
        bytes_per_token = bytes_per_token()
        if not bytes_per_token:
            return configured
        largest = int(budget // bytes_per_token)
        if largest >= tokens:
            return tokens
        if largest < 2 * configured:
            return configured
        largest = configured << ((largest // configured).bit_length() - 1)
        pieces = -(-tokens // largest)
        return -(-tokens // pieces)

    def budget_now(self, device: torch.device) -> int:
        """The bytes a chunk may hold now: chunk_budget as set, else auto_chunk_budget (what is free at this call)."""
        return self.chunk_budget if self.chunk_budget is not None else auto_chunk_budget(device)

    def whole_fits(self, size: str, tokens: int, bytes_per_token: Callable[[], float | None],
                   device: torch.device) -> bool:
        """Whether `tokens` tokens run as one piece, by shapes alone (a checkpoint's recompute must take the path its
        forward took, whatever is free then): within the option `size` as set, or within the largest budget there can
        be (chunk_budget as set; auto: 1/8 of a CUDA device) at `bytes_per_token()`."""
        if tokens <= getattr(self, size):
            return True
        largest = self.largest_budget(device)
        per_token = bytes_per_token() if largest else None
        return bool(per_token) and tokens * per_token <= largest

    def largest_budget(self, device: torch.device) -> int:
        """The most a chunk may ever hold: chunk_budget as set; auto: CHUNK_BUDGET_SHARE of a CUDA device, else 0."""
        if self.chunk_budget is not None:
            return self.chunk_budget
        if device.type != "cuda":
            return 0
        import torch

        return int(torch.cuda.mem_get_info(device)[1] * CHUNK_BUDGET_SHARE)

    def folds_norms(self, whole_bytes: int, device: torch.device) -> bool:
        """Whether a chunked MLP takes the lean norm before it into its backward (bpt.mlp.chunked_mlp's fold_norms),
        for a [B, N, hidden] input of `whole_bytes`, a rule of the shapes: where that is over a quarter of the largest
        budget there can be (auto: 1/32 of a CUDA device). There one such tensor fewer at the backward's peak is what
        lengthens the context; below it the norm's own backward, in its larger chunks, launches fewer kernels."""
        largest = self.largest_budget(device)
        return bool(largest) and whole_bytes * 4 > largest

    def attention_head_groups(self, q_heads: int, kv_heads: int, whole_bytes: int, device: torch.device
                              ) -> Callable[[], int] | None:
        """How the fused attention's backward is split (bpt.head_groups), for a kernel workspace of `whole_bytes`
        over every head: None (one backward over every head, stock's SDPA) without a budget (chunk_budget 0, or auto
        off CUDA) or where the workspace fits the largest budget there can be (chunk_budget as set; auto: 1/8 of the
        device), a rule of the shapes alone, so a checkpoint's recompute takes the path its forward took; else a
        function asked when backward runs: 1 group where the budget then holds the workspace, else one query head at
        a time (bpt.head_groups)."""
        largest = self.largest_budget(device)
        if not largest or whole_bytes <= largest:
            return None
        from bpt.head_groups import head_groups_for

        return lambda: head_groups_for(q_heads, kv_heads, whole_bytes, self.budget_now(device))


def auto_chunk_budget(device: torch.device) -> int:
    """On a CUDA device the smaller of CHUNK_BUDGET_SHARE of its memory and CHUNK_BUDGET_FREE_SHARE of what is free
    now (the driver's free memory and the caching allocator's unused blocks) beyond CHUNK_BUDGET_RESERVE of it; 0 for
    other devices."""
    if device.type != "cuda":
        return 0
    import torch

    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    spare = (free - total * CHUNK_BUDGET_RESERVE) * CHUNK_BUDGET_FREE_SHARE
    return int(max(0, min(total * CHUNK_BUDGET_SHARE, spare)))
