"""Tensor parallelism (Megatron): each rank of a process group holds a slice of every column- / row-parallel linear
layer as an ordinary local module, with explicit collectives around each pair.

    model = get_peft_model(base, lora_config)        # full-size LoRA factors, drawn from the same seed on every rank
    handle = tensor_parallel(model, group)            # slices base weights and LoRA factors; inserts the collectives
    loss = model(**batch).loss; loss.backward()       # every rank of `group` reads the same batch
    reduce_tensor_parallel_gradients(model, group)    # the replicated LoRA factors' partial gradients, summed
    clip_grad_norm_(model.parameters(), 1.0, group)   # the norm of the whole (unsliced) gradient
    state = gathered_state_dict(model, group)         # full shapes, for save_pretrained(state_dict=state)

The groups (`tensor_parallel_group`, `mesh_groups`) come from bpt.mesh and the collectives and gradient helpers
(`reduce_tensor_parallel_gradients`, `clip_grad_norm_`, `gathered_state_dict`, `gather_param`) from
bpt.tensor_parallel, pure torch; they are importable from here too. This module is what reads transformers, peft and
bitsandbytes: the plan, fused layouts, slicing 4-bit weights and LoRA.

Which module is column- or row-parallel is data: the config's `base_model_tp_plan` (transformers' "colwise" /
"rowwise" per module name pattern). A column-parallel layer keeps rows r*O/N .. (r+1)*O/N of its weight (its output
features, so whole heads / MLP channels) and sees the whole input, copied to it by `copy_to_group` (identity forward,
all-reduce of the input gradient backward). A row-parallel layer keeps the matching input columns; its partial outputs
are summed by `reduce_from_group` (all-reduce forward, identity backward), and a bias is added once, after the sum.
"replicated_with_grad_allreduce" modules (per-head norms) stay whole; their gradients are summed over the group.
Fused column-parallel layers (FUSED, per model type: Phi-3's qkv_proj = [q; k; v], gate_up_proj = [gate; up]) keep
this rank's slice of each part, in order, so the module's own split of its output by the local head counts yields
this rank's heads; their attention module reads the local head counts (module attributes, and a config view).

LoRA (peft) on a sliced layer: under a column-parallel base lora_B is sliced by rows and lora_A is whole on every rank;
under a row-parallel base lora_A is sliced by columns and lora_B is whole. The whole factor's gradient on each rank is
this rank's share only: `reduce_tensor_parallel_gradients` sums it over the group. Apply LoRA before this function
(peft wrapping a sliced layer afterwards would put the LoRA path outside the collectives).

4-bit (bitsandbytes Linear4bit): the packed storage and the per-block absmax are sliced at quantisation-block
boundaries (a slice that cuts a block is refused), so every rank's dequantised slice equals the same slice of the
one-process weight, bit for bit. A double-quantised absmax (whose 8-bit statistics use the whole tensor's mean) is
dequantised to float32 first, exactly as bitsandbytes does before every matmul; it then takes 4 bytes per block
instead of about 1.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from bpt.mesh import mesh_groups, mesh_ranks, tensor_parallel_group
from bpt.tensor_parallel import (MARKS, clip_grad_norm_, copy_to_group, gather_param, gathered_state_dict,
                                 reduce_from_group, reduce_tensor_parallel_gradients, row_ranges, slice_like, take_rows)

__all__ = ["tensor_parallel", "check_tensor_parallel", "tp_plan", "plan_modules", "fused_parts", "TensorParallelHandle",
           "FUSED", "STYLES", "REPLICATED",
           # from bpt.mesh and bpt.tensor_parallel, importable here as documented before they moved
           "tensor_parallel_group", "mesh_groups", "mesh_ranks", "reduce_tensor_parallel_gradients", "clip_grad_norm_",
           "gathered_state_dict", "gather_param", "slice_like", "MARKS"]

STYLES = ("colwise", "rowwise")
# Modules left whole on every rank whose weight gradient is a per-rank share (Qwen3's q_norm / k_norm, applied to
# each rank's own heads): summed over the group like the whole LoRA factors.
REPLICATED = ("replicated_with_grad_allreduce",)
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")
# Fused column-parallel layers, per model type: {module name: its parts, in row order}. Each rank keeps its slice of
# every part ([q slice; k slice; v slice]), so the module's own split of its output, by the local head counts /
# channels, yields this rank's heads. These families' plans name the pairs "colwise_gather_output" /
# "rowwise_split_input" (transformers gathers the fused output, then splits it again): read as colwise / rowwise,
# with neither (each rank's attention and MLP run on its own heads / channels).
FUSED = {"phi3": {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}}
FUSED_STYLES = {"colwise_gather_output": "colwise", "rowwise_split_input": "rowwise"}


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


PART_ROWS = {  # a part's rows (output features of the whole layer), from the config
    "q": lambda c: c.num_attention_heads * _head_dim(c),
    "k": lambda c: c.num_key_value_heads * _head_dim(c),
    "v": lambda c: c.num_key_value_heads * _head_dim(c),
    "gate": lambda c: c.intermediate_size,
    "up": lambda c: c.intermediate_size,
}


# ---------------------------------------------------------------- the plan: which modules, which way

def _pattern(key: str) -> re.Pattern:
    """transformers' plan key ('layers.*.self_attn.q_proj') -> a regex matching a module's full name's tail."""
    return re.compile(r"(^|\.)" + re.escape(key).replace(r"\*", r"\d+") + "$")


def tp_plan(config) -> dict[str, str]:
    """{module name pattern: "colwise" | "rowwise"} from the config, or ValueError saying why there is none."""
    plan = getattr(config, "base_model_tp_plan", None)
    name = getattr(config, "model_type", type(config).__name__)
    if not plan:
        raise ValueError(f"{name} models have no tensor-parallel plan (config.base_model_tp_plan): tensor "
                         "parallelism cannot tell their column- from their row-parallel layers")
    if name in FUSED:
        plan = {key: FUSED_STYLES.get(style, style) for key, style in plan.items()}
    other = sorted({style for style in plan.values() if style not in STYLES + REPLICATED})
    if other:
        raise ValueError(f"{name}'s tensor-parallel plan uses {', '.join(other)} (fused projections or experts); "
                         f"only plain colwise / rowwise layers are supported")
    return dict(plan)


def plan_modules(model, plan: dict[str, str]) -> list[tuple[str, torch.nn.Module, str]]:
    """(name, module, style) of every module the plan names, outermost match (a peft wrapper, not its base)."""
    patterns = [(_pattern(key), style) for key, style in plan.items()]
    found = []
    for name, module in model.named_modules():
        for pattern, style in patterns:
            if pattern.search(name):
                found.append((name, module, style))
                break
    if not found:
        raise ValueError("no module of the model matches its tensor-parallel plan")
    return found


def fused_parts(config, module_name: str) -> list[int] | None:
    """The rows of each part of a fused column-parallel layer (FUSED), or None for a plain layer."""
    parts = FUSED.get(getattr(config, "model_type", None), {}).get(module_name.rsplit(".", 1)[-1])
    return None if parts is None else [PART_ROWS[part](config) for part in parts]


def _base(module):
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def _is_4bit(layer) -> bool:
    return type(layer.weight).__name__ == "Params4bit"


def check_tensor_parallel(config, size: int, *, bits: int = 16) -> None:
    """ValueError (one line) when `size` ranks cannot split this model: no plan, head or MLP counts that `size` does
    not divide, or (4-bit) a slice that would cut a 64-weight quantisation block. Builds the model on the meta
    device only (no weights)."""
    from transformers import AutoModelForCausalLM

    plan = tp_plan(config)
    name = getattr(config, "model_type", "model")
    for attr in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, attr, None)
        if value is not None and value % size:
            raise ValueError(f"--tensor_parallel {size} must divide the {name} model's {attr} ({value})")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    for module_name, module, style in plan_modules(skeleton, plan):
        if style in REPLICATED:
            continue
        out_features, in_features = module.weight.shape
        parts = fused_parts(config, module_name) if style == "colwise" else None
        if parts is not None and (sum(parts) != out_features or any(p % size for p in parts)):
            raise ValueError(f"--tensor_parallel {size} must divide each part of {module_name} "
                             f"({dict(zip(FUSED[name][module_name.rsplit('.', 1)[-1]], parts))} rows)")
        if (out_features if style == "colwise" else in_features) % size:
            raise ValueError(f"--tensor_parallel {size} must divide {module_name}'s "
                             f"{'output' if style == 'colwise' else 'input'} features ({out_features, in_features})")
        if bits == 4:
            block = 64
            cut = any(rows // size * in_features % block for rows in parts or [out_features]) \
                if style == "colwise" else (in_features // size) % block
            if cut:
                raise ValueError(f"--tensor_parallel {size} would cut the 4-bit quantisation blocks ({block} weights) "
                                 f"of {module_name} (weight {out_features}x{in_features}, {style}); use fewer "
                                 f"tensor-parallel ranks or --bits 16")


# ---------------------------------------------------------------- slicing

def _slice_4bit(layer, style: str, rank: int, size: int, parts=None) -> None:
    """Replace a Linear4bit's Params4bit by this rank's slice (packed bytes and absmax cut at block boundaries)."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState, dequantize_blockwise

    weight = layer.weight
    state = weight.quant_state
    out_features, in_features = state.shape
    block = state.blocksize
    absmax = state.absmax
    if state.nested:  # as bitsandbytes.functional.dequantize_4bit does before each matmul
        absmax = dequantize_blockwise(state.absmax, state.state2)
        absmax += state.offset
    absmax = absmax.float()
    storage = weight.data.dtype  # uint8, or a float dtype holding the same bytes (FSDP: train.recipe.model)
    packed = weight.data.reshape(-1).view(torch.uint8)  # two weights a byte
    if style == "colwise":
        ranges = row_ranges(out_features, parts, rank, size)
        if any(start * in_features % block or stop * in_features % block for start, stop in ranges):
            raise ValueError(f"a {ranges} row slice of a {out_features}x{in_features} 4-bit weight cuts its blocks")
        packed = torch.cat([packed[a * in_features // 2:b * in_features // 2] for a, b in ranges])
        absmax = torch.cat([absmax[a * in_features // block:b * in_features // block] for a, b in ranges])
        shape = torch.Size([sum(b - a for a, b in ranges), in_features])
    else:
        cols = in_features // size
        if cols % block or in_features % block:
            raise ValueError(f"a {cols}-column slice of a {out_features}x{in_features} 4-bit weight cuts its blocks")
        packed = packed.view(out_features, in_features // 2)[:, rank * cols // 2:(rank + 1) * cols // 2]
        absmax = absmax.view(out_features, in_features // block)[:, rank * cols // block:(rank + 1) * cols // block]
        shape = torch.Size([out_features, cols])
    local = QuantState(absmax=absmax.reshape(-1).contiguous(), shape=shape, code=state.code, blocksize=block,
                       quant_type=state.quant_type, dtype=state.dtype)
    # A block (64 weights, 32 bytes) fills whole elements of any storage dtype: the slice stays in it.
    packed = packed.contiguous().reshape(-1).view(storage).reshape(-1, 1)
    layer.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=local, blocksize=block,
                                     compress_statistics=False, quant_type=state.quant_type, quant_storage=storage,
                                     module=layer, bnb_quantized=True)
    if hasattr(layer, "quant_state"):  # some bitsandbytes versions keep a copy on the module
        layer.quant_state = local
    layer.out_features, layer.in_features = shape


def _slice_base(layer, style: str, rank: int, size: int, parts=None):
    """Slice a Linear / Linear4bit in place (a fused colwise layer: each of its `parts`); returns the bias a
    row-parallel layer adds after the sum (else None)."""
    if not (_is_4bit(layer) or isinstance(layer, torch.nn.Linear)):
        raise ValueError(f"tensor parallelism slices Linear / bitsandbytes Linear4bit layers, not "
                         f"{type(layer).__name__}")
    ranges = row_ranges(layer.out_features, parts, rank, size) if style == "colwise" else None
    if _is_4bit(layer):
        _slice_4bit(layer, style, rank, size, parts)
    else:
        weight = take_rows(layer.weight.data, ranges) if style == "colwise" else \
            layer.weight.data.chunk(size, dim=1)[rank].contiguous()
        layer.weight = torch.nn.Parameter(weight, requires_grad=layer.weight.requires_grad)
        layer.out_features, layer.in_features = weight.shape
    bias = layer.bias
    if bias is None:
        return None
    if style == "colwise":
        layer.bias = torch.nn.Parameter(take_rows(bias.data, ranges), requires_grad=bias.requires_grad)
        return None
    layer.bias = None
    return bias


def _slice_lora(module, style: str, rank: int, size: int, group, parts=None) -> list[torch.nn.Parameter]:
    """Slice a peft LoRA wrapper's factors (B by rows under colwise, A by columns under rowwise); returns the factors
    left whole, whose gradients are partial on each rank."""
    if any(getattr(module, "use_dora", {}).values()):
        raise ValueError("tensor parallelism does not support DoRA adapters")
    whole = []
    for adapter in module.lora_A:
        a, b = module.lora_A[adapter], module.lora_B[adapter]
        cut, keep = (b, a) if style == "colwise" else (a, b)
        dim = 0 if style == "colwise" else 1
        piece = take_rows(cut.weight.data, row_ranges(cut.weight.shape[0], parts, rank, size)) \
            if style == "colwise" else cut.weight.data.chunk(size, dim=dim)[rank].contiguous()
        cut.weight = torch.nn.Parameter(piece, requires_grad=cut.weight.requires_grad)
        cut.weight.tp_dim, cut.weight.tp_group = dim, group
        if parts is not None:
            cut.weight.tp_parts = parts
        cut.out_features, cut.in_features = piece.shape
        if cut.bias is not None or keep.bias is not None:
            raise ValueError("tensor parallelism does not support LoRA factors with a bias")
        keep.weight.tp_partial = True
        whole.append(keep.weight)
    base = module.get_base_layer()
    module.in_features, module.out_features = base.in_features, base.out_features
    return whole


@dataclass
class TensorParallelHandle:
    group: object
    size: int
    modules: list[str] = field(default_factory=list)  # the sliced modules' names
    hooks: list = field(default_factory=list)


def tensor_parallel(model, group=None) -> TensorParallelHandle:
    """Slice `model` (a transformers causal LM, optionally wrapped by peft) over `group` per its config's
    base_model_tp_plan, in place. Every rank must start from the same weights (and the same LoRA factors)."""
    from peft.tuners.lora import LoraLayer

    group = group if group is not None else dist.group.WORLD
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    config = getattr(model, "config", None)
    handle = TensorParallelHandle(group=group, size=size)
    modules = plan_modules(model, tp_plan(config))
    attention, fused = set(), set()
    for name, module, style in modules:
        if style in REPLICATED:
            for param in module.parameters():
                param.tp_partial = True
            continue
        base = _base(module)
        dim = 0 if style == "colwise" else 1
        if (base.out_features if dim == 0 else base.in_features) % size:
            raise ValueError(f"{size} tensor-parallel ranks cannot split {name} ({base.out_features}x"
                             f"{base.in_features}, {style})")
        parts = fused_parts(config, name) if style == "colwise" else None
        bias = _slice_base(base, style, rank, size, parts)
        if base.weight.requires_grad:
            base.weight.tp_dim, base.weight.tp_group = dim, group
            if parts is not None:
                base.weight.tp_parts = parts
        if isinstance(module, LoraLayer):
            _slice_lora(module, style, rank, size, group, parts)
        if parts is not None:
            fused.add(name.rsplit(".", 1)[0])
        if style == "colwise":
            handle.hooks.append(module.register_forward_pre_hook(
                lambda m, args, g=group: (copy_to_group(args[0], g), *args[1:])))
        else:
            handle.hooks.append(module.register_forward_hook(
                lambda m, args, out, g=group, b=bias: reduce_from_group(out, g) + (0 if b is None else b)))
        handle.modules.append(name)
        attention.add(name.rsplit(".", 1)[0])
    for name, module in model.named_modules():  # attention modules that record their head counts: local counts
        if name in attention:
            for attr in HEAD_COUNTS:
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    setattr(module, attr, value // size)
        if name in fused and hasattr(module, "config"):  # phi3's attention splits qkv by config.num_attention_heads
            module.config = _LocalHeads(model.get_base_model() if hasattr(model, "get_base_model") else model,
                                        {attr: getattr(config, attr) // size for attr in HEAD_COUNTS
                                         if isinstance(getattr(config, attr, None), int)})
    return handle


class _LocalHeads:
    """A module's config as its forward reads it: the model's config of the moment (followed, so that a later
    patch's view of it, e.g. apply_bpt_patch's, is what it reads), with this rank's head counts."""

    def __init__(self, owner, counts: dict[str, int]):
        object.__setattr__(self, "_tp_owner", owner)
        object.__setattr__(self, "_tp_counts", counts)

    def __getattr__(self, name):
        counts = object.__getattribute__(self, "_tp_counts")
        if name in counts:
            return counts[name]
        return getattr(object.__getattribute__(self, "_tp_owner").config, name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_tp_owner").config, name, value)
