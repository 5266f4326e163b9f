"""FSDP2 for the QLoRA run (`--fsdp`): the 4-bit base and the LoRA weights sharded over every process with torch's
own `fully_shard`, one unit per decoder layer plus the root (embeddings, final norm, LM head).

We shard ourselves instead of through accelerate's FSDP plugin: accelerate gives a CPU launch no distribution at
all, so only our own call shards the same way on gloo (tests) as on NCCL (users). A launch with an accelerate FSDP
config turns `--fsdp` on, and accelerate is then asked for a plain multi-process state (`use_launcher_fsdp`).

What sharding asks of the rest of the run:
- 4-bit data must live in a float dtype (`bnb_4bit_quant_storage`, train.recipe.model.quantization_config): FSDP
flattens
  every parameter of a unit into float buffers; with the default uint8 storage training silently runs at loss 0
  with NaN gradients, so `shard_model` refuses it.
- Trainable parameters are kept in fp32 (FSDP wants one dtype per unit). The model is put in train mode before
  sharding: in eval mode bitsandbytes on CPU may repack 4-bit data in place,
  and the repacked bytes would not survive FSDP's resharding while the changed quantisation state would.
- Parameters are DTensor shards: the adapter is saved from `gathered_trainable_state` (a collective), and the
  optimizer state goes through torch.distributed.checkpoint's full state dict (train.recipe.checkpoint).
- Every rank must run every forward (all-gathers): evaluation runs on all ranks, the main one reports.
- Gradients are reduce-scattered as averages over all processes, as DDP's are: the loss scaling of
  train.run.loop.train_step holds unchanged, with or without sequence parallelism (FSDP over all processes, each
  sequence-parallel group inside it).
- With tensor parallelism (`--tensor_parallel N --fsdp`) each rank's modules are its slices
  (patches.tensor_parallel), sharded over the ranks holding the same slices only (its FSDP group: world / N
  processes), whose gradient average train.run.loop turns into a sum; the whole LoRA factors' shards are then summed
  over the tensor-parallel group, as without FSDP.
"""
from __future__ import annotations

import os
import sys

import torch

from train.errors import UserError
from train.parallel.layout import launched_world_size

LAUNCHER_FSDP_ENV = "ACCELERATE_USE_FSDP"  # set by `accelerate launch` for a config with distributed_type FSDP


def use_launcher_fsdp(args) -> None:
    """A launch with an accelerate FSDP config means --fsdp; accelerate is then kept from wrapping the model
    itself (its plugin would replace our sharding plan)."""
    if os.environ.get(LAUNCHER_FSDP_ENV, "false").lower() == "true":
        args.fsdp = True
        os.environ[LAUNCHER_FSDP_ENV] = "false"


def check_fsdp(args, config) -> None:
    """UserError (before any weights are read) for what FSDP cannot shard. With one process there is nothing to
    shard over: --fsdp is dropped with a note."""
    if getattr(args, "fsdp_cpu_offload", False) and not args.fsdp:  # train.eval has no --fsdp_cpu_offload
        raise UserError("--fsdp_cpu_offload offloads FSDP's shards: add --fsdp (and launch several processes)")
    if not args.fsdp:
        return
    world, tp = launched_world_size(), getattr(args, "tensor_parallel", 1)
    if world == 1:
        print("note: --fsdp with one process has nothing to shard over; running unsharded (launch several "
              "processes with accelerate launch --num_processes N to shard)", file=sys.stderr, flush=True)
        args.fsdp = False
        return
    if world == tp:  # under TP, FSDP shards each slice over the ranks holding it: here one
        if os.environ.get("RANK", "0") == "0":  # every rank checks; the main one says it
            print(f"note: --fsdp with --tensor_parallel {tp} on {tp} processes has nothing to shard over (each slice "
                  f"is held by one process); running unsharded (launch a multiple of {tp} processes to shard each "
                  "slice over them)", file=sys.stderr, flush=True)
        args.fsdp = False
        return
    if tp > 1 and getattr(args, "fsdp_cpu_offload", False):  # the tensor-parallel gradient sums and norms would meet host tensors
        raise UserError("--fsdp_cpu_offload is not built for --tensor_parallel (its gradient sums run on the "
                        "devices); drop --fsdp_cpu_offload or --tensor_parallel")
    refuse_unshardable(
        args, config,
        int8="--fsdp shards 4-bit (--bits 4) or unquantised (--bits 16) bases; bitsandbytes int8 weights cannot be "
             "sharded: choose --bits 4",
        paged_optim="--optim paged_adamw_8bit keeps bitsandbytes states that FSDP cannot shard; use --optim adamw "
                    "with --fsdp",
        storage="{model} is saved already quantised to 4 bits in {storage} storage, which FSDP cannot shard "
                "(training would run at loss 0 with NaN gradients); use the unquantised base (this recipe quantises "
                "it for FSDP) or drop --fsdp")


def refuse_unshardable(args, config, *, int8: str, paged_optim: str, storage: str) -> None:
    """UserError with the caller's message (FSDP2 shards, ZeRO-3 partitions) when the run's weights or optimizer
    state cannot be split over processes: int8 weights, bitsandbytes' paged optimizer states, or a base saved
    already quantised in an integer storage (`storage` is formatted with the model and the storage dtype)."""
    if args.bits == 8:
        raise UserError(int8)
    if getattr(args, "optim", None) == "paged_adamw_8bit":  # train.eval has no optimizer
        raise UserError(paged_optim)
    saved = saved_4bit_storage(config)
    if saved is not None and not saved.startswith(("float", "bfloat")):
        raise UserError(storage.format(model=args.model_name_or_path, storage=saved))


def saved_4bit_storage(config) -> str | None:
    """The storage dtype ("uint8", "float32", ...) of a base saved already quantised to 4 bits, else None."""
    quantized = getattr(config, "quantization_config", None)
    if quantized is None:
        return None
    quantized = quantized if isinstance(quantized, dict) else quantized.to_dict()
    if not quantized.get("load_in_4bit"):
        return None
    return str(quantized.get("bnb_4bit_quant_storage") or "uint8").replace("torch.", "")


def check_storage(model, what: str = "FSDP") -> None:
    """ValueError when 4-bit data sits in integer tensors, which `what` (FSDP, ZeRO-3) cannot split."""
    for name, param in model.named_parameters():
        if type(param).__name__ == "Params4bit" and not param.dtype.is_floating_point:
            why = " (training would run at loss 0 with NaN gradients)" if what == "FSDP" else ""
            raise ValueError(f"{name} keeps its 4-bit data in {param.dtype}, which {what} cannot shard{why}; load the "
                             "base with "
                             "BitsAndBytesConfig(bnb_4bit_quant_storage=<the compute dtype>)")


def trainable_in_fp32(model) -> None:
    """FSDP needs one dtype over the trainable parameters of a unit: LoRA is fp32, but a 16-bit base's trainable
    norms / embeddings (--train_embeddings_and_norms) would be bf16. Keep them all in fp32 (autocast computes in
    bf16 anyway), as peft's k-bit preparation does for 4-bit bases."""
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()


def shard_model(model, cpu_offload: bool = False, group=None) -> None:
    """fully_shard every decoder layer of `model` (a peft model or a transformers one), then its transformers root,
    in place, over `group` (default: every process); cpu_offload: the shards, their gradients (and so the optimizer
    step) live in host memory, pinned where CUDA is (pinning needs it). Raises ValueError for 4-bit data in uint8
    storage. Under tensor parallelism `group` is the ranks holding the same slices: each shards its own slices, and
    the shards keep the slices' marks (bpt.tensor_parallel.MARKS)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    from bpt.tensor_parallel import MARKS

    check_storage(model)
    mesh = None
    if group is not None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group, "cuda" if torch.cuda.is_available() else "cpu")
    marks = {name: {mark: getattr(param, mark) for mark in MARKS if hasattr(param, mark)}
             for name, param in model.named_parameters()}
    trainable_in_fp32(model)
    model.train()
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer_classes = set(getattr(root, "_no_split_modules", None) or ())
    layers = [module for module in root.modules() if type(module).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(root).__name__} names no decoder layer class (_no_split_modules) to shard by")
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(root, mesh=mesh, offload_policy=policy)
    for name, param in model.named_parameters():  # FSDP2 put new parameters (its shards) in place
        for mark, value in marks[name].items():
            setattr(param, mark, value)


def local_share(model) -> float:
    """The fraction of the model's parameter elements stored on this process (1.0 when nothing is sharded)."""
    from torch.distributed.tensor import DTensor

    local = whole = 0
    for param in model.parameters():
        whole += param.numel()
        local += param.to_local().numel() if isinstance(param, DTensor) else param.numel()
    return local / max(whole, 1)


def gathered_trainable_state(model, keep: bool) -> dict[str, torch.Tensor]:
    """{name: full tensor on CPU} of the trainable parameters, on the ranks where `keep` (others get {}). Every rank
    must call it: gathering a shard is a collective. FSDP2 shards (DTensor), ZeRO-3 partitions and tensor-parallel
    slices (patches.tensor_parallel) alike."""
    from torch.distributed.tensor import DTensor

    from bpt.tensor_parallel import gather_param

    state = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            if hasattr(param, "ds_id"):  # a DeepSpeed ZeRO-3 partition (train.parallel.deepspeed): gathered whole
                from deepspeed.runtime.zero.partition_parameters import GatheredParameters

                with GatheredParameters([param]):
                    full = param.data.detach().cpu().clone()
            else:  # FSDP2 shards gathered over their group, then tensor-parallel slices over theirs
                full = param.full_tensor() if isinstance(param, DTensor) else param
                if hasattr(param, "tp_dim"):
                    full = gather_param(full.detach(), param.tp_dim, param.tp_group, getattr(param, "tp_parts", None))
            if keep:
                state[name] = full.detach().cpu()
    return state


def full_norm(norm) -> float:
    """A gradient norm as a float; under FSDP clip_grad_norm_ returns it as a DTensor."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
