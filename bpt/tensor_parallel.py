"""Tensor parallelism's collectives and gradient helpers, in pure torch: what runs between the sliced layers and
around the optimizer step. The slicing itself (which module is column- or row-parallel, 4-bit weights, LoRA) reads
transformers, peft and bitsandbytes and lives in patches.tensor_parallel; the groups come from bpt.mesh.

A sliced parameter carries its marks (MARKS): tp_dim (the dimension it was cut along), tp_group (the group it was
cut over), tp_parts (a fused layer's parts, each cut on its own); a parameter left whole whose gradient is this
rank's share only carries tp_partial.

    loss.backward()                                    # every rank of `group` read the same batch
    reduce_tensor_parallel_gradients(model, group)     # the whole factors' partial gradients, summed
    clip_grad_norm_(model.parameters(), 1.0, group)    # the norm of the whole (unsliced) gradient
    state = gathered_state_dict(model, group)          # full shapes, for save_pretrained(state_dict=state)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# What patches.tensor_parallel marks on the parameters it slices (tp_dim, tp_group, tp_parts) or leaves whole with
# partial gradients (tp_partial): FSDP2 replaces the parameters by its shards, which get the same marks
# (train.parallel.fsdp).
MARKS = ("tp_dim", "tp_group", "tp_parts", "tp_partial")


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward: the input gradient summed over the group (each rank's layers used the input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward: the partial outputs summed over the group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """A column-parallel layer's input: `x` as is; its gradient summed over `group` in backward."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    """A row-parallel layer's partial outputs summed over `group`; the gradient passed through as is."""
    return _ReduceFromGroup.apply(x, group)


def row_ranges(out_features: int, parts: list[int] | None, rank: int, size: int) -> list[tuple[int, int]]:
    """This rank's (start, stop) rows of a column-parallel weight: its slice of each part (a fused layer), in order."""
    parts = parts or [out_features]
    if sum(parts) != out_features or any(p % size for p in parts):
        raise ValueError(f"{size} tensor-parallel ranks cannot split parts {parts} of {out_features} rows")
    ranges, offset = [], 0
    for rows in parts:
        ranges.append((offset + rank * rows // size, offset + (rank + 1) * rows // size))
        offset += rows
    return ranges


def take_rows(tensor: torch.Tensor, ranges) -> torch.Tensor:
    """The rows of `tensor` in `ranges` (row_ranges), one contiguous tensor."""
    return torch.cat([tensor[start:stop] for start, stop in ranges]).contiguous()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: an FSDP2 shard (DTensor) as a plain tensor sharing its storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    """Sum tensors of one dtype and device over `group` in place, in one all_reduce of their concatenation."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def reduce_tensor_parallel_gradients(model, group=None, data_group=None) -> None:
    """Sum the replicated LoRA factors' gradients over the tensor-parallel `group`; then, with `data_group`, every
    trainable gradient over the data-parallel group (in place of DDP, which would mix the ranks' slices). Under FSDP2
    (gradients already reduced over the ranks holding the same slices: no `data_group`) each rank sums its shard of
    them: the ranks of a tensor-parallel group hold the same shard of a whole factor."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_flat([_local(p.grad) for p in params if getattr(p, "tp_partial", False)], group)
    if data_group is not None and dist.get_world_size(data_group) > 1:
        all_reduce_flat([p.grad for p in params], data_group)


def clip_grad_norm_(parameters, max_norm: float, group=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a tensor-parallel model: the 2-norm of the whole gradient (the sliced
    parameters' squares summed over `group`, the whole ones counted once). Gradients sharded by FSDP2 (DTensors) add
    their shards' squares over the shard group first. Returns that norm."""
    params = [p for p in parameters if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    sharded, plain = torch.zeros(2, device=device), torch.zeros(2, device=device)  # squares of [sliced, whole]
    mesh = None
    for p in params:
        squares = plain
        if isinstance(p.grad, DTensor):
            mesh, squares = p.grad.device_mesh, sharded
        squares[0 if hasattr(p, "tp_dim") else 1] += _local(p.grad).float().pow(2).sum()
    if mesh is not None:
        dist.all_reduce(sharded, group=mesh.get_group())
    sliced, whole = (sharded + plain).unbind()
    sliced = sliced.clone()
    dist.all_reduce(sliced, group=group)
    norm = (sliced + whole).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        _local(p.grad).mul_(scale.to(p.grad.dtype))
    return norm


def gather_param(tensor: torch.Tensor, dim: int, group=None, parts: list[int] | None = None) -> torch.Tensor:
    """The whole tensor from every rank's slice along `dim` (a collective); a fused layer's rows (`parts`, the
    param's tp_parts): each part's slices in rank order, part after part."""
    size = dist.get_world_size(group)
    pieces = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    if parts is None:
        return torch.cat(pieces, dim=dim)
    split = [piece.split([rows // size for rows in parts]) for piece in pieces]
    return torch.cat([split[r][i] for i in range(len(parts)) for r in range(size)])


def slice_like(whole: torch.Tensor, param, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of `whole` (a tensor of the sliced `param`'s unsliced shape), as tensor_parallel sliced it."""
    if param.tp_dim == 0:
        return take_rows(whole, row_ranges(whole.shape[0], getattr(param, "tp_parts", None), rank, size))
    return whole.chunk(size, dim=param.tp_dim)[rank].contiguous()


def gathered_state_dict(model, group=None, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """{name: whole tensor on CPU} of the trainable parameters (sliced ones gathered over `group`, by default the
    group each was sliced over); every rank of the group must call it; the ranks where `keep` is false get {}."""
    state = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            whole = gather_param(p.detach(), p.tp_dim, group or p.tp_group, getattr(p, "tp_parts", None)) \
                if hasattr(p, "tp_dim") else p.detach()
            if keep:
                state[name] = whole.cpu()
    return state
