"""Checkpoints `checkpoint-N/` of a train.qlora run, written atomically and validated on resume.

A checkpoint holds everything the resumed run needs to repeat the uninterrupted run's steps exactly:

    adapter_config.json, adapter_model.safetensors   the trainable weights (peft format, gathered under FSDP / ZeRO-3)
    optimizer.pt                                       the optimizer's full state dict (torch.distributed.checkpoint)
    scheduler.pt                                       the scheduler's state_dict
    rng_state.pt                                       python / numpy / torch (and CUDA) RNG, one per rank
    trainer_state.json                                 step, data position (epoch, batch), the schedule's length, args,
                                                       the metrics window not logged yet (train.run.loop.MetricsLog)

It is written into a hidden temp directory inside output_dir and renamed into place, so a crash
never leaves a half-written checkpoint-N behind, and a failed write (a full disk) removes what it wrote and raises
SaveFailed. A run writes one every --save_steps steps, every --save_minutes, on a stop signal and after its last step
(so a finished run can be extended with a larger --max_steps).
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import tempfile

import numpy as np
import torch

from safetensors import SafetensorError

from train.errors import UserError, one_line
from train.recipe.file_modes import as_umask_allows
from train.recipe.run_dir import CHECKPOINT_PREFIX as PREFIX
from train.recipe.run_dir import TMP_PREFIX, list_checkpoints  # noqa: F401  (callers read them here too)

STATE_FILE = "trainer_state.json"
REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "scheduler.pt",
                  "rng_state.pt", STATE_FILE)
# Args that decide which rows each step sees: resuming with different values would not continue the run.
DATA_ORDER_ARGS = ("seed", "per_device_train_batch_size", "dataset", "dataset_format", "max_seq_len", "packing",
                   "sequence_parallel", "tensor_parallel")
# Args that shape the learning-rate schedule besides its length.
SCHEDULE_ARGS = ("lr_scheduler_type", "warmup_steps", "learning_rate")


class SaveFailed(Exception):
    """Writing part of a run's output failed (a full disk, say); what was written of it has been removed, and the
    checkpoints written before are intact. last_checkpoint: the newest of those, when the writer knows it."""

    report = None  # which process prints it: the main one (train.recipe.lifecycle.leave)

    def __init__(self, what: str, reason: str, last_checkpoint: str | None = None):
        super().__init__(f"could not write {what}: {reason} (nothing of it was kept)")
        self.last_checkpoint = last_checkpoint


# What a failed file write raises: OSError from Python, RuntimeError from torch.save's writer, SafetensorError
# from safetensors (its message holds the OS error: '... No space left on device (os error 28)').
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def write_failure(error: BaseException) -> str:
    """The reason a write failed, in the OS's words where there are some ('No space left on device')."""
    if isinstance(error, OSError) and error.errno:
        return os.strerror(error.errno)
    found = re.search(r"Os \{ code: (\d+)|os error (\d+)", str(error))
    return os.strerror(int(found.group(1) or found.group(2))) if found else one_line(error)


def resolve(resume_from: str, output_dir: str) -> str:
    """The checkpoint directory named by --resume_from_checkpoint (a path or 'latest'), validated."""
    if resume_from == "latest":
        checkpoints = list_checkpoints(output_dir)
        if not checkpoints:
            raise UserError(f"--resume_from_checkpoint latest: no {PREFIX}N directory in {output_dir} (a run writes "
                            "one every --save_steps steps, when stopped by a signal, and after its last step); check "
                            "--output_dir or start without --resume_from_checkpoint")
        path = checkpoints[-1]
    else:
        path = resume_from
    if not os.path.isdir(path):
        raise UserError(f"--resume_from_checkpoint {path} does not exist; give a {PREFIX}N directory or 'latest'")
    missing = [name for name in REQUIRED_FILES if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise UserError(f"checkpoint {path} is incomplete or corrupt (missing {', '.join(missing)}); resume from "
                        "another checkpoint or start over with --overwrite_output_dir")
    read_state(path)
    return path


def read_state(path: str) -> dict:
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        int(state["step"]), int(state["epoch"]), int(state["batch"])
        return state
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"checkpoint {path} is corrupt ({STATE_FILE} unreadable: {error}); resume from another "
                        "checkpoint or start over with --overwrite_output_dir") from None


def check_compatible(state: dict, args, world_size: int, path: str) -> None:
    """UserError when the resumed run would see different data than the run that wrote the checkpoint."""
    saved = state.get("args", {})
    changed = [f"--{name} {saved[name]!r} -> {getattr(args, name)!r}" for name in DATA_ORDER_ARGS
               if name in saved and saved[name] != getattr(args, name)]
    if state.get("world_size", world_size) != world_size:
        changed.append(f"processes {state['world_size']} -> {world_size}")
    if changed:
        raise UserError(f"checkpoint {path} was written with other data settings ({'; '.join(changed)}); resume "
                        "with the original values or start a new run")


def schedule_changes(state: dict, args, steps: int) -> list[str]:
    """How the learning-rate schedule of this run differs from the checkpoint's ([] when it is the same)."""
    saved = state.get("args", {})
    changed = [f"--{name} {saved[name]!r} -> {getattr(args, name)!r}" for name in SCHEDULE_ARGS
               if name in saved and saved[name] != getattr(args, name)]
    if state.get("total_steps", steps) != steps:
        changed.insert(0, f"{state['total_steps']} -> {steps} steps")
    return changed


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_atomically(output_dir: str, name: str, write) -> str:
    """Call write(tmp_dir) on a fresh hidden directory in output_dir, then rename it to output_dir/name.

    os.rename within one filesystem is atomic, so readers see either no `name` or a complete one.
    """
    tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=output_dir)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    as_umask_allows(tmp)  # mkdtemp's 0700 and safetensors' -rw------- -> what the umask gives new files
    final = os.path.join(output_dir, name)
    if os.path.exists(final):  # left by an earlier attempt that ran past this step: replace it
        stale = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}stale-", dir=output_dir)
        os.rename(final, os.path.join(stale, name))
        os.rename(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(tmp, final)
    return final


def remove_leftovers(output_dir: str) -> None:
    """Delete temp directories left by a run that died while writing a checkpoint."""
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            if name.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)


def gathered_states(model, optimizer, main: bool) -> tuple[dict, dict]:
    """(trainable weights, optimizer state), whole, on the main process: what `save` writes. Every rank must call
    it (under FSDP both are gathered from shards). The optimizer state is torch.distributed.checkpoint's full
    state dict (keyed by parameter name), the same with or without FSDP, so either run can resume the other's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from train.parallel.deepspeed import gathered_optimizer_state, partitioned
    from train.parallel.fsdp import gathered_trainable_state

    weights = gathered_trainable_state(model, keep=main)
    if partitioned(model):  # DeepSpeed ZeRO-3: gathered from its flat partitions into the same format
        return weights, gathered_optimizer_state(model, main)
    sliced = any(hasattr(p, "tp_dim") for p in model.parameters())  # patches.tensor_parallel: gathered below
    state = get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer),
                                     options=StateDictOptions(full_state_dict=not sliced, cpu_offload=not sliced))
    if sliced:  # every rank holds its own state (a full state dict keeps only rank 0's)
        state = _gather_tensor_parallel_state(model, state)
    return weights, state


def _gather_tensor_parallel_state(model, state: dict) -> dict:
    """A copy of `state` with the optimizer state of parameters sliced by patches.tensor_parallel (exp_avg, ...:
    their shape) whole: FSDP2 shards (DTensors, under --fsdp) gathered over their group first, then the slices over
    the tensor-parallel group. A copy: the dicts inside `state` are the optimizer's own."""
    from torch.distributed.tensor import DTensor

    from bpt.tensor_parallel import gather_param

    state = {**state, "state": {name: dict(entry) for name, entry in state["state"].items()}}
    for name, param in model.named_parameters():  # the same order on every rank: each gather is a collective
        entry = state["state"].get(name, {})
        for key in sorted(entry):
            if isinstance(entry[key], DTensor):
                entry[key] = entry[key].full_tensor()
            if hasattr(param, "tp_dim") and torch.is_tensor(entry[key]) and entry[key].shape == param.shape:
                entry[key] = gather_param(entry[key], param.tp_dim, param.tp_group, getattr(param, "tp_parts", None))
    for entry in state["state"].values():  # on the host, as the full state dict's cpu_offload gives it
        for key in entry:
            if torch.is_tensor(entry[key]):
                entry[key] = entry[key].cpu()
    return state


def save(output_dir: str, step: int, *, model, weights: dict, optimizer_state: dict, scheduler, rng_states: list,
         position: tuple[int, int], args_dict: dict, world_size: int, total_steps: int,
         metrics_window: dict | None = None) -> str:
    """Write checkpoint-<step> (called on the main process only, with what gathered_states returned there;
    rng_states holds every rank's; metrics_window: what the metrics log summed since its last row)."""

    def write(path: str) -> None:
        model.save_pretrained(path, state_dict=weights)
        try:
            torch.save(optimizer_state, os.path.join(path, "optimizer.pt"))
            torch.save(scheduler.state_dict(), os.path.join(path, "scheduler.pt"))
            torch.save(rng_states, os.path.join(path, "rng_state.pt"))
        except RuntimeError as error:  # torch's writer hides a full disk ('unexpected pos 704 vs 598')
            if shutil.disk_usage(path).free < 2**20:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from error
            raise
        epoch, batch = position
        state = {"step": step, "epoch": epoch, "batch": batch, "total_steps": total_steps, "world_size": world_size,
                 "args": args_dict, "metrics_window": metrics_window}
        with open(os.path.join(path, STATE_FILE), "w") as f:
            json.dump(state, f, indent=2)

    return write_atomically(output_dir, f"{PREFIX}{step}", write)


def _resume_error(path: str, error: Exception) -> UserError:
    return UserError(f"cannot resume from {path}: {one_line(error)}; the checkpoint is corrupt or from a run with "
                     "other model/LoRA settings")


def _slice_tensor_parallel_state(model, state: dict) -> None:
    """The whole optimizer state of a checkpoint -> this rank's slices for the parameters patches.tensor_parallel
    sliced (the inverse of _gather_tensor_parallel_state)."""
    import torch.distributed as dist

    from bpt.tensor_parallel import slice_like

    for name, param in model.named_parameters():
        if hasattr(param, "tp_dim"):
            size, rank = dist.get_world_size(param.tp_group), dist.get_rank(param.tp_group)
            whole = list(param.shape)
            whole[param.tp_dim] *= size
            entry = state["state"][name]
            for key in entry:
                if torch.is_tensor(entry[key]) and list(entry[key].shape) == whole:
                    entry[key] = slice_like(entry[key], param, rank, size)


def load_weights(path: str, model) -> None:
    """The trainable weights of checkpoint `path` into `model`, before it is sharded or wrapped (every rank)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    try:
        result = set_peft_model_state_dict(model, load_file(os.path.join(path, "adapter_model.safetensors")))
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise ValueError(f"weights the model does not have: {unexpected[:3]}")
    except Exception as error:  # any unreadable or mismatched piece means the same thing to the user
        raise _resume_error(path, error) from None


def load(path: str, *, model, optimizer, scheduler, rank: int) -> dict:
    """Restore the optimizer (into its shards under FSDP), scheduler (unless None: a changed schedule is rebuilt by
    the caller) and this rank's RNG from `path` on every rank (the weights went in earlier: load_weights); return its
    state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from train.parallel.deepspeed import load_optimizer_state, partitioned

    state = read_state(path)
    sliced = any(hasattr(p, "tp_dim") for p in model.parameters())
    sharded = any(isinstance(p, DTensor) for p in model.parameters())  # FSDP2: whole tensors cut into the shards
    try:
        saved = torch.load(os.path.join(path, "optimizer.pt"), weights_only=False)
        if partitioned(model):  # into DeepSpeed ZeRO-3's flat partitions
            load_optimizer_state(model, saved)
        else:
            if sliced:  # patches.tensor_parallel: this rank's slices of the whole state
                _slice_tensor_parallel_state(model, saved)
            set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), saved,
                                     options=StateDictOptions(full_state_dict=sharded or not sliced))
        if scheduler is not None:
            scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=False))
        rng_states = torch.load(os.path.join(path, "rng_state.pt"), weights_only=False)
    except Exception as error:
        raise _resume_error(path, error) from None
    set_rng_state(rng_states[rank] if rank < len(rng_states) else rng_states[0])
    return state
