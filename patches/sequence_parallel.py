"""Sequence parallelism for a patched causal LM: one sequence split across a process group, exact vs one process.

A user's own training loop (every rank of `group` holds the SAME global batch; `model` is patched with
apply_bpt_patch, optionally LoRA-wrapped before patching)::

    import torch.distributed as dist
    from patches import apply_bpt_patch, shard_batch, sequence_parallel_attention, reduce_gradients, group_loss

    apply_bpt_patch(model)
    group = dist.new_group(ranks)                      # or None: the whole world
    for batch in loader:                               # GLOBAL batch: input_ids [B, N], labels [B, N],
        local, context = shard_batch(batch, group, "ring")   # attention_mask or position_ids [B, N]
        with sequence_parallel_attention(model, context):
            loss = model(**local).loss                 # this rank's share: its token losses / global count
            loss.backward()                            # inside the block (gradient checkpointing recomputes here)
        reduce_gradients(model, group)                 # SUM over the group (not DDP; see below)
        optimizer.step(); optimizer.zero_grad()
        log(group_loss(loss, group))                   # = the single-process mean loss

- `shard_batch` shifts the labels on the whole sequence before splitting (no token loses its target at a shard
  boundary), gives every token its GLOBAL position id (RoPE sees what it sees on one device), derives the padding
  mask (from attention_mask) or the packed-document ids (from position ids that restart, only when there is no
  attention_mask: transformers' own rule) and splits everything into the mode's layout: "ring" (zigzag,
  `bpt.sequence_parallel.ring`) or "ulysses" (contiguous, `bpt.sequence_parallel.ulysses`). Any length works: the
  sequence is padded at its end to the layout's multiple and the pad tokens are hidden from every query.
- Under `sequence_parallel_attention(model, context)` every patched attention module of `model` calls ring_attention /
  ulysses_attention with the context's group, true length, padding mask and segment ids; the sliding window
  still comes from the per-layer mask transformers builds. Backward must run inside the block when the model
  uses gradient checkpointing (the recomputed forward needs the context); otherwise only the forward must.
- Loss: `num_items_in_batch` in the local batch is the group's count of labelled tokens, so each rank's loss is
  (sum of its token losses) / (global count) and the SUM over the group is the single-process mean. Parameters
  are replicated over the group, so their gradients must be SUMMED over it: `reduce_gradients(model, group)`.
  Under DDP whose process group is the sequence-parallel group itself (DDP averages over its W ranks) multiply
  the loss by W before backward and do not call reduce_gradients (tested); with DDP over a dp x sp mesh (all
  ranks) multiply by the sp group size W: DDP's mean over dp*W ranks of W * (rank share) = the mean over the dp
  replicas of the summed sequence gradient (follows from the same algebra; not tested here).

ALiBi handed over as a per-key bias (Bloom, MPT, Falcon with alibi): each rank's model builds it from the positions of
its own shard (0, 1, ... with no attention_mask), so it is slope x local index + a constant; the slopes are read off
it (`linear_bias_slopes`) and applied on GLOBAL positions by the kernels (exact in fp32; in bf16 more exact than
stock, which rounds positions past 256).

Limits (raise ValueError): attention dropout; a per-key bias that is not linear in the key index; ulysses cannot do
a query head count that does not divide by the group size.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bpt.attention import segment_ids_from_position_ids
from bpt.mesh import sequence_parallel_group  # the groups of patches.trainer's layout: bpt.mesh builds every group
from bpt.sequence_parallel import ring_attention, sequence_shard, ulysses_attention, zigzag_shard
from bpt.tensor_parallel import all_reduce_flat
from patches.attention import CONFIG_ATTR, SEQUENCE_PARALLEL_ATTR

__all__ = ["SequenceParallelContext", "shard_batch", "sequence_parallel_attention", "reduce_gradients", "group_loss",
           "sequence_parallel_group"]

MODES = ("ring", "ulysses")


def linear_bias_slopes(key_bias: torch.Tensor, name: str = "the model") -> torch.Tensor:
    """key_bias [B, H, n] equal to slope_h x (local key index) + a constant -> slopes [H] (fp32).

    Raises ValueError when the bias is not that (to the rounding of its dtype): then it does not come from positions
    0, 1, ... of this shard, and re-basing it on global positions would be wrong."""
    n = key_bias.shape[-1]
    if n < 2:
        raise ValueError(f"sequence parallelism needs at least 2 tokens per rank to read {name}'s ALiBi slopes")
    bias = key_bias.float()
    slopes = bias[0, :, 1] - bias[0, :, 0]  # [H]
    linear = bias[..., :1] + slopes[None, :, None] * torch.arange(n, device=bias.device, dtype=bias.dtype)
    tolerance = 8 * torch.finfo(key_bias.dtype).eps * bias.abs().amax().clamp_min(1.0)
    if (bias - linear).abs().amax() > tolerance:
        raise ValueError(f"sequence parallelism needs {name}'s per-key ALiBi bias to be slope x key index (built "
                         "without an attention_mask, as shard_batch's inputs do); this one is not")
    return slopes
IGNORE_INDEX = -100


@dataclass
class SequenceParallelContext:
    """What the attention of one sharded batch needs besides q / k / v.

    group: the process group the sequence is split over (None: the default group). mode: "ring" | "ulysses".
    seq_len: the true global length N. padding_mask [B, *] bool (True = real token) / segment_ids [B, *] int64,
    or None, in the form the mode's attention takes: ring -> this rank's zigzag shard [B, 2c]; ulysses -> the
    global tensor [B, N].
    """

    group: object
    mode: str
    seq_len: int
    padding_mask: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None

    def attention(self, module, query, key, value, *, causal, scaling, softcap, sliding_window, alibi_slopes,
                  key_bias, sinks, dropout, q_block, kv_block, compile, empty_rows="zeros", head_groups=None):
        """q [B, Hq, n, D], k / v [B, Hkv, n, D]: this rank's shard -> its output shard [B, Hq, n, D]. head_groups:
        (q, k) -> how a fused attention's backward is split (Ulysses' whole-sequence attention; ring's fused pairs)."""
        name = type(module).__name__
        if key_bias is not None:  # ALiBi built on this shard's own positions: re-based on the global ones
            alibi_slopes, key_bias = linear_bias_slopes(key_bias, name), None
        if dropout:
            raise ValueError(f"sequence parallelism ({self.mode!r}, and 'ulysses' / 'ring' alike) cannot do "
                             f"attention dropout ({name}: p={dropout}); set the model's attention dropout to 0")
        common = dict(group=self.group, seq_len=self.seq_len, scale=scaling, causal=causal,
                      padding_mask=self.padding_mask, segment_ids=self.segment_ids, sliding_window=sliding_window,
                      alibi_slopes=alibi_slopes, softcap=softcap, q_block=q_block, kv_block=kv_block, compile=compile,
                      empty_rows=empty_rows)
        if self.mode == "ring":  # the rule asked of the whole shard: the largest call of its fused path
            groups = None if head_groups is None else head_groups(query, key)
            return ring_attention(query, key, value, sinks=sinks, head_groups=groups, **common)
        world = dist.get_world_size(self.group)
        if query.shape[1] % world:
            raise ValueError(f"sequence-parallel mode 'ulysses' splits the {query.shape[1]} query heads of {name} "
                             f"over the {world} ranks of the group, so they must divide by {world}; use mode "
                             "'ring' for this head count")
        return ulysses_attention(query, key, value, key_bias=key_bias, sinks=sinks, head_groups_rule=head_groups,
                                 **common)


def shard_batch(batch: dict, group=None, mode: str = "ring") -> tuple[dict, SequenceParallelContext]:
    """The GLOBAL batch (the same on every rank of `group`) -> (this rank's model inputs, the attention context).

    batch: input_ids [B, N], labels [B, N] (unshifted, -100 = not counted), and optionally attention_mask [B, N]
    (1 = real token) and/or position_ids [B, N] (restarting at each packed document). Returns local_batch =
    dict(input_ids, position_ids, shift_labels, num_items_in_batch, use_cache=False) for `model(**local_batch)`
    under `sequence_parallel(model, context)`: no labels, no attention_mask (the context carries the padding).
    """
    if mode not in MODES:
        raise ValueError(f"sequence-parallel mode must be one of {MODES}, got {mode!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("shard_batch needs an initialised torch.distributed process group")
    unknown = set(batch) - {"input_ids", "labels", "attention_mask", "position_ids", "use_cache"}
    if unknown:
        raise ValueError(f"shard_batch takes input_ids, labels, attention_mask and position_ids; got also "
                         f"{sorted(unknown)} (shift_labels / num_items_in_batch are computed from labels)")
    input_ids, labels = batch.get("input_ids"), batch.get("labels")
    if input_ids is None or labels is None or input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError("shard_batch needs input_ids and labels of one shape [batch, seq], got "
                         f"{getattr(input_ids, 'shape', None)} and {getattr(labels, 'shape', None)}")
    b, n = input_ids.shape
    device = input_ids.device
    attention_mask, position_ids = batch.get("attention_mask"), batch.get("position_ids")
    for key, value in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if value is not None and tuple(value.shape) != (b, n):
            raise ValueError(f"shard_batch needs {key} of shape {(b, n)} (2-D, global), got {tuple(value.shape)}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    # Shift on the whole sequence: token i's target is labels[i + 1], whichever rank holds it.
    shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # [B, N]
    num_items = int((shift_labels != IGNORE_INDEX).sum())
    positions = (torch.arange(n, device=device).expand(b, n) if position_ids is None else position_ids).long()
    padding_mask = None if attention_mask is None else attention_mask.to(device).bool()
    if padding_mask is not None and bool(padding_mask.all()):
        padding_mask = None
    segment_ids = None
    if attention_mask is None and position_ids is not None:  # transformers packs only without a 2-D mask
        segment_ids = segment_ids_from_position_ids(positions)
        if not bool(segment_ids.any()):
            segment_ids = None

    shard = zigzag_shard if mode == "ring" else sequence_shard
    local = dict(
        input_ids=shard(input_ids, 1, rank, world),
        position_ids=shard(positions, 1, rank, world),
        shift_labels=shard(shift_labels, 1, rank, world, pad_value=IGNORE_INDEX),
        num_items_in_batch=num_items,
        use_cache=False,
    )
    if mode == "ring":  # per-key side inputs travel with their keys: this rank's shards
        padding_mask = None if padding_mask is None else shard(padding_mask, 1, rank, world, pad_value=True)
        segment_ids = None if segment_ids is None else shard(segment_ids, 1, rank, world)
    return local, SequenceParallelContext(group, mode, n, padding_mask, segment_ids)


@contextlib.contextmanager
def sequence_parallel_attention(model, context: SequenceParallelContext):
    """Within the block, every patched attention module of `model` (plain or peft-wrapped) runs the context's
    sequence-parallel attention on its local shard; on exit each module's previous state is restored."""
    if not isinstance(context, SequenceParallelContext):
        raise TypeError(f"sequence_parallel_attention needs the context shard_batch returned, got {type(context).__name__}")
    modules = [m for m in model.modules() if getattr(m, CONFIG_ATTR, None) is not None]
    if not modules:
        raise ValueError("sequence_parallel_attention needs a model patched with apply_bpt_patch (no patched attention found)")
    missing = object()
    previous = [m.__dict__.get(SEQUENCE_PARALLEL_ATTR, missing) for m in modules]
    try:
        for m in modules:
            setattr(m, SEQUENCE_PARALLEL_ATTR, context)
        yield context
    finally:
        for m, old in zip(modules, previous):
            if old is missing:
                m.__dict__.pop(SEQUENCE_PARALLEL_ATTR, None)
            else:
                setattr(m, SEQUENCE_PARALLEL_ATTR, old)


def reduce_gradients(model, group=None) -> None:
    """Sum every trainable parameter's gradient over `group` (in place; one all_reduce per dtype / device).

    For training without DDP: the ranks' gradients are the partial derivatives of their loss shares, whose sum is
    the single-process loss. A trainable parameter without a gradient counts as zeros (and gets them)."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        all_reduce_flat(grads, group)


def group_loss(loss: torch.Tensor, group=None) -> torch.Tensor:
    """The group's total loss (sum of the ranks' shares = the single-process mean), detached, on every rank."""
    total = loss.detach().clone().float()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total
