"""DeepSpeed ZeRO-3 for the QLoRA run: `accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml`.

As with FSDP2 (train.parallel.fsdp) the engine is ours, not accelerate's: a DeepSpeed launch is read from the
environment `accelerate launch` sets (ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_*), accelerate is then asked for a
plain multi-process state (gloo on CPU, NCCL on GPUs), and `initialize` hands the peft model and our torch AdamW to
`deepspeed.initialize` with a config built from our flags. So the loop keeps its own gradient accumulation (the
engine is told where each step's boundary is), its loss scaling (gradients are averaged over all processes, as DDP's
are) and its learning-rate schedule; DeepSpeed clips at --max_grad_norm (its own default, when the key is absent,
would be 1.0) and steps.

What ZeRO-3 asks of the rest of the run:
- 4-bit data must live in a float dtype (`bnb_4bit_quant_storage`, train.recipe.model.quantization_config) to be
  partitioned; every parameter is partitioned (stage3_param_persistence_threshold 0), 4-bit data included.
- Each process loads the (4-bit) base whole before `deepspeed.initialize` partitions it (no zero.Init: bitsandbytes
  quantises at load time); peak host/GPU memory at load is therefore one 4-bit copy per process, as with DDP.
- Every rank runs every forward (parameters are gathered module by module): evaluation runs on all ranks.
- The adapter and the optimizer state are gathered into whole tensors (collectives) and saved in the same format
  as the other layouts (peft adapter, torch's full optimizer state dict keyed by parameter name).
- The blockwise patch's chunked MLPs and LM head hand their module's parameters to autograd Functions that
  recompute the module inside their own backward: those modules are ZeRO-3 "leaf" modules (all their parameters
  gathered for their forward and backward), and DeepSpeed's memory-efficient linear is off (`recomputing_modules`).
- No mixed precision inside DeepSpeed (its bf16 mode casts the module's parameters, packed 4-bit data among them):
  trainable weights stay fp32 and accelerate's autocast computes in bf16 on GPUs, as in the other layouts.
- A torch optimizer, also with optimizer offload (no cpu_adam JIT build). On CPU DeepSpeed JIT-builds its
  shared-memory communication op once per machine (20-60 s here; cached under ~/.cache/torch_extensions).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from dataclasses import dataclass

import torch

from train.errors import UserError
from train.parallel.layout import launched_world_size

LAUNCHER_ENV = "ACCELERATE_USE_DEEPSPEED"  # set by `accelerate launch` for a config with distributed_type DEEPSPEED
STAGE_ENV = "ACCELERATE_DEEPSPEED_ZERO_STAGE"
OFFLOAD_ENV = {"param": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
               "optimizer": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"}
CONFIG_FILE_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
ZERO3_INIT_ENV = "ACCELERATE_DEEPSPEED_ZERO3_INIT"
# deepspeed_config keys of the launch config that our flags own: (environment variable, flag, type)
FLAG_OWNED = {"gradient_accumulation_steps": ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "gradient_accumulation_steps",
                                              int),
              "gradient_clipping": ("ACCELERATE_GRADIENT_CLIPPING", "max_grad_norm", float)}


@dataclass(frozen=True)
class Zero3:
    """ZeRO-3 settings of the launch."""

    offload_param: bool = False  # parameter partitions in host memory, brought to the device for compute
    offload_optimizer: bool = False  # gradient / optimizer partitions in host memory; the step runs on the CPU


def launcher_zero3() -> Zero3 | None:
    """The ZeRO-3 settings of an `accelerate launch` with a DeepSpeed config, None for any other launch. Keeps
    accelerate from building its own DeepSpeed engine (ours is built by `initialize`). Raises UserError for settings
    this recipe does not run."""
    if os.environ.get(LAUNCHER_ENV, "false").lower() != "true":
        return None
    os.environ[LAUNCHER_ENV] = "false"
    # The launcher always sets a precision ('no' by default); under DeepSpeed the run picks its own (train.qlora:
    # bf16 autocast on GPUs that have it, fp32 on CPU; --mixed_precision chooses).
    os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
    config_file = os.environ.get(CONFIG_FILE_ENV, "none")
    if config_file.lower() not in ("", "none"):
        raise UserError(f"train.qlora builds the DeepSpeed config from its own flags and does not read "
                        f"deepspeed_config_file ({config_file}); set zero_stage: 3 and offload_param_device / "
                        "offload_optimizer_device (none or cpu) in the accelerate config instead, as "
                        "configs/accelerate/deepspeed_zero3.yaml does")
    stage = os.environ.get(STAGE_ENV, "3")
    if stage != "3":
        raise UserError(f"the DeepSpeed launch asks for ZeRO stage {stage}; train.qlora runs ZeRO stage 3 (set "
                        "zero_stage: 3), or use configs/accelerate/cpu_ddp.yaml / multi_gpu.yaml for plain data "
                        "parallelism")
    offload = {}
    for what, env in OFFLOAD_ENV.items():
        device = os.environ.get(env, "none").lower()
        if device not in ("none", "cpu"):
            raise UserError(f"offload_{what}_device {device}: train.qlora offloads ZeRO-3 partitions to cpu or not at "
                            "all (none)")
        offload[what] = device == "cpu"
    return Zero3(offload_param=offload["param"], offload_optimizer=offload["optimizer"])


def check_zero3(args, config, zero3: Zero3 | None) -> Zero3 | None:
    """UserError (before any weights are read) for what ZeRO-3 cannot partition or what would partition twice.
    With one process there is nothing to partition over: None (trains unsharded) with a note."""
    if zero3 is None:
        return None
    if args.fsdp or args.fsdp_cpu_offload:
        raise UserError("a DeepSpeed ZeRO-3 launch partitions the model with DeepSpeed; --fsdp would shard it again "
                        "with FSDP2: drop --fsdp (or launch with configs/accelerate/cpu_ddp.yaml or fsdp2_qlora.yaml "
                        "to use FSDP2)")
    for key, (env, flag, kind) in FLAG_OWNED.items():
        value = os.environ.get(env, "none")
        if value.lower() not in ("", "none") and kind(value) != getattr(args, flag):
            raise UserError(f"the DeepSpeed launch config sets {key}: {value}, and this run has --{flag} "
                            f"{getattr(args, flag)}: train.qlora takes it from --{flag} only (drop {key} from the "
                            "launch config or pass the same value)")
    if os.environ.get(ZERO3_INIT_ENV, "false").lower() == "true":
        print("note: zero3_init_flag is not used: each process loads the (4-bit) base whole, then DeepSpeed "
              "partitions it", file=sys.stderr, flush=True)
    if launched_world_size() == 1:
        print("note: DeepSpeed ZeRO-3 with one process has nothing to partition over; training unsharded (launch "
              "several processes with accelerate launch --num_processes N to partition)", file=sys.stderr, flush=True)
        return None
    from train.parallel.fsdp import refuse_unshardable

    refuse_unshardable(
        args, config,
        int8="ZeRO-3 partitions 4-bit (--bits 4) or unquantised (--bits 16) bases; bitsandbytes int8 weights cannot "
             "be partitioned: choose --bits 4",
        paged_optim="--optim paged_adamw_8bit keeps bitsandbytes states that ZeRO-3 cannot partition; use --optim "
                    "adamw under DeepSpeed",
        storage="{model} is saved already quantised to 4 bits in {storage} storage, which ZeRO-3 cannot partition; "
                "use the unquantised base (this recipe quantises it in a float storage for ZeRO-3) or launch without "
                "DeepSpeed")
    return zero3


def ds_config(args, zero3: Zero3, world: int) -> dict:
    """The DeepSpeed config of this run, from our flags."""
    zero = {"stage": 3,
            # 0: every parameter partitioned (DeepSpeed's default keeps those under 1e5 elements whole on every rank)
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
            # off: its linear keeps the (partitioned) weight for backward, which the blockwise patch's chunked MLP and
            # loss meet empty when they recompute a chunk inside their own backward
            "memory_efficient_linear": False}
    if zero3.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if zero3.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world,
        "gradient_clipping": float(args.max_grad_norm),  # 0 disables; absent, DeepSpeed would clip at 1.0
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # our torch AdamW steps the offloaded partitions
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


def initialize(model, optimizer, args, zero3: Zero3, world: int):
    """The DeepSpeed engine around `model` (partitioned over every process) stepping `optimizer` (whose param groups
    the scheduler keeps driving). Weights must be final (resumed adapter loaded) before this. Raises ValueError for
    4-bit data in uint8 storage."""
    import deepspeed

    from train.parallel.fsdp import check_storage, trainable_in_fp32

    check_storage(model, "ZeRO-3")
    trainable_in_fp32(model)  # one dtype for the flat fp32 partitions
    model.train()  # as for FSDP: bitsandbytes' CPU eval-mode repacking must not meet partitioned data
    if args.bpt:
        from deepspeed.utils import set_z3_leaf_module

        for module in recomputing_modules(model):
            set_z3_leaf_module(module, True)
    silence_deprecated_collectives()  # (partitioning the model is the first gather)
    with contextlib.redirect_stdout(io.StringIO()) as said:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(args, zero3, world))
    # On CPU every rank prints "DeepSpeed ...shm_comm_op built successfully" (also when loaded from the cache): the rest
    # of what it printed goes on.
    sys.stdout.write("".join(line for line in said.getvalue().splitlines(keepends=True)
                             if not (line.startswith("DeepSpeed ") and line.rstrip().endswith(" built successfully"))))
    return engine


# torch.distributed collectives that DeepSpeed's ZeRO-3 calls and newer torch deprecates: a FutureWarning (two lines)
# per rank whenever a warnings filter changed since the last, ~30 lines a short run. DeepSpeed's to change, not the
# user's; none of our code calls them.
DEPRECATED_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor")


def silence_deprecated_collectives() -> None:
    """Ignore exactly those deprecation warnings (the message names the function), nothing else."""
    for name in DEPRECATED_COLLECTIVES:
        warnings.filterwarnings("ignore", message=rf"`torch\.distributed\.{name}` is deprecated",
                                category=FutureWarning)


def recomputing_modules(model) -> list:
    """The modules whose patched forward hands their parameters to an autograd Function that recomputes them in its
    backward (the blockwise patch's chunked MLP, the chunked LM head). ZeRO-3 must gather such a module's parameters
    whole for its forward and backward (a "leaf" module): by default it gathers each submodule's own around that
    submodule's call, so the Function would take empty partitions as inputs and its gradients would not fit them."""
    from patches import FAMILIES

    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = FAMILIES.get(getattr(root.config, "model_type", None))
    if family is None:
        return []
    layers = getattr(getattr(root, family.base), family.layers)
    return [getattr(layer, family.mlp) for layer in layers] + [getattr(root, family.head)]


def is_engine(model) -> bool:
    return type(model).__name__ == "DeepSpeedEngine"


def partitioned(model) -> bool:
    """Whether `model`'s parameters are ZeRO-3 partitions."""
    return any(hasattr(param, "ds_id") for param in model.parameters())


def numel(param) -> int:
    """Elements of a parameter, whole (a ZeRO-3 partition reports its full size in ds_numel)."""
    return getattr(param, "ds_numel", param.numel())


def local_share(model) -> float:
    local = whole = 0
    for param in model.parameters():
        whole += numel(param)
        local += param.ds_tensor.numel() if hasattr(param, "ds_tensor") else param.numel()
    return local / max(whole, 1)


def backward(engine, loss: torch.Tensor, boundary: bool) -> None:
    """Backward of one micro-batch; `boundary`: the last of the optimizer step (its gradients are then reduced).
    The loss is already normalised over the step (train.run.loop.accumulate): DeepSpeed must not divide it again."""
    engine.set_gradient_accumulation_boundary(boundary)
    engine.backward(loss, scale_wrt_gas=False)


def step(engine, args) -> float | None:
    """Clip (at --max_grad_norm, inside DeepSpeed) and step; returns the gradient norm before clipping, as
    torch's clip_grad_norm_ does (None when clipping is off, as in the other layouts)."""
    engine.step()
    if args.max_grad_norm <= 0:
        return None
    return float(engine.get_global_grad_norm())


def _trainable(model):
    return [(name, param) for name, param in model.named_parameters() if param.requires_grad]


def _flat_partition(param):
    """(ZeRO-3 optimizer, the fp32 flat partition holding `param`'s share, which the torch optimizer steps)."""
    zero = param._z3_optimizer
    group, _, _ = zero.grad_position[zero.get_param_id(param)]
    return zero, zero.fp32_partitioned_groups_flat[group]


def gathered_optimizer_state(model, main: bool) -> dict:
    """torch's full optimizer state dict ({"state": {name: {...}}, "param_groups": [...]}, whole tensors on CPU) on
    the main process ({} elsewhere), the format of torch.distributed.checkpoint's full state dict, so a ZeRO-3
    checkpoint resumes in any layout and the other way round. A collective."""
    state, groups = {}, None
    for name, param in _trainable(model):
        zero, flat = _flat_partition(param)
        flat_state = zero.optimizer.state.get(flat, {})
        entry = {}
        for key in sorted(flat_state):
            value = flat_state[key]
            if torch.is_tensor(value) and value.dim() > 0:  # exp_avg, exp_avg_sq: partitioned like the weights
                value = zero.get_full_hp_param(param, key).view(param.ds_shape)
            entry[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
        state[name] = entry
        if groups is None:
            groups = [{k: v for k, v in group.items() if k != "params"} for group in zero.optimizer.param_groups]
    if not main:
        return {}
    names = [name for name, _ in _trainable(model)]
    return {"state": state, "param_groups": [{**group, "params": names} for group in groups or []]}


def load_optimizer_state(model, saved: dict) -> None:
    """Scatter a full optimizer state dict (gathered_optimizer_state's or torch's) into the ZeRO-3 partitions (every
    rank, with the whole dict). Raises ValueError when it is not this model's."""
    trainable = _trainable(model)
    names = [name for name, _ in trainable]
    if len(saved["param_groups"]) != 1 or saved["param_groups"][0]["params"] != names \
            or not set(saved["state"]) <= set(names):
        raise ValueError("the optimizer state does not match this model's trainable parameters")
    hyper = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}  # lr, betas, initial_lr, ...
    for group in trainable[0][1]._z3_optimizer.optimizer.param_groups:
        group.update(hyper)
    for name, param in trainable:
        zero, flat = _flat_partition(param)
        flat_state = zero.optimizer.state[flat]
        for key, value in saved["state"].get(name, {}).items():  # none: a parameter that never had a gradient
            if torch.is_tensor(value) and value.dim() > 0:
                if key not in flat_state:
                    flat_state[key] = torch.zeros_like(flat)
                zero.set_full_hp_param(value.to(flat.device, flat.dtype), param, key)
            else:  # the step count: one per flat partition, equal for all its parameters
                flat_state[key] = value.clone() if torch.is_tensor(value) else value
