"""The memory preflight of `python -m train.qlora`: a run that cannot fit in this machine's memory is refused in one
line before any weights or data are loaded, with the figure, the memory available and the longest --max_seq_len that
fits (`--skip_memory_check` runs it anyway). Without it `--max_seq_len 1000000000` grew for minutes until the kernel
killed it.

What one process of the run needs, estimated with --plan's own code (train.run.plan, bpt.bench.simulate) on fake tensors
in this process (nothing allocated), on the device the run trains on: fake CPU tensors on a CPU, on CUDA the simulated
GPU of the card's compute capability (its attention kernels and bf16 autocast):
- the training step: the step --plan simulates (the model, LoRA, the patch, checkpointing, the batch, a rank's share
  of the tokens) and the plan's analytic extras (optimizer state, gradients kept over accumulation);
- the evaluation (--eval_passkey): one batch's prefill at the longest evaluation length, no gradients, with the KV
  cache generate keeps (none under --sequence_parallel: train.evaluation.split_eval decodes without one), plus the
  optimizer state that is still alive after training; in host memory the task's prompts (PROMPT_BYTES per token);
- the data: --dataset passkey rows (PASSKEY_BUILD_BYTES per token while they are built, PASSKEY_HELD_BYTES after).
  File and hub datasets are not counted: their rows are the dataset's tokens, whatever --max_seq_len.
On a CPU all of it is host memory; on CUDA the step and evaluation are the device's, the data and prompts the host's,
and with --offload_checkpoints the checkpoints the step keeps in host memory (the simulated step's host peak).

A simulated step costs seconds per few thousand tokens (the blockwise loops run in Python), so lengths past LINEAR_AT
block sizes are not simulated: the peak grows linearly with the length once the rows span whole blocks (the plan's
search relies on it too), so the line through two simulated lengths extends it. Measured on the default run: the
training step at 8192 and 16384 tokens lies on the line through 4096 and 6144 to the byte (also without the patch or
checkpointing); the evaluation's prefill 22% above it at 16384 (the tiny model's MLP chunk outweighs its hidden states
up to ~7k tokens); with the attention kept for the recompute (bpt.attention_once), a later moment of the backward
grows faster and overtakes: the tiny model with 32-token blocks is on the line to ~340 tokens and 1.7% above it at
512. Past the points the figure can thus be low (the peak is the largest of several lines, each moment's), so a
refusal never stops a run that fits, and MARGIN covers the rest.

Not modelled (no simulated step, only the host data is checked): --bits 8, --tensor_parallel, --fsdp, DeepSpeed
ZeRO-3 and model families transformers does not have the code of.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import warnings
from typing import Callable

from train.errors import UserError, one_line

# Refuse only when the estimate exceeds what is available by more than this factor: the figures are simulated or
# per-token averages (host memory also moves under other processes), and a refusal must mean "cannot fit", not
# "might not". A run between 1x and MARGIN x may fail later; the longest --max_seq_len given fits at 1x.
MARGIN = 1.25
# --dataset passkey rows, bytes per token (train.recipe.passkey.passkey_dataset: three Python lists of ints per row,
# then an in-memory Arrow table), measured with the bundled tokenizer, 30 rows of 200,000 tokens: peak RSS +164 B per
# token while built, +56 B held after.
PASSKEY_BUILD_BYTES = 170
PASSKEY_HELD_BYTES = 56
PROMPT_BYTES = 8  # an evaluation prompt: a list of pointers to the tokenizer's cached ints (measured 5-8 B per token)
EVAL_BATCH = 8  # prompts of one length decoded together (train.evaluation.metrics.passkey_accuracy's batch_size)
LINEAR_AT = (2, 3)  # lengths (in the largest block / chunk size) through which a longer step's peak is extended
GIB = 1 << 30


@dataclasses.dataclass
class Budget:
    """Memory one process of the run may use."""

    name: str  # "host" or "cuda:0"
    available: int  # bytes for this process
    source: str  # where the figure comes from (MemAvailable, cgroup, mem_get_info)
    processes: int = 1  # processes of this launch sharing it


@dataclasses.dataclass
class Part:
    """One thing the run holds: bytes(n) at --max_seq_len n; `line` (fixed, per token) for the longest length."""

    label: str
    bytes: Callable[[int], int]
    line: Callable[[], tuple[float, float]]


class Simulated:
    """A simulated peak as a function of the length: simulated at lengths up to the second point of LINEAR_AT, and
    extended along the line through the two points beyond it."""

    def __init__(self, peak: Callable[[int], int], block: int):
        self.peak, self.known = peak, {}
        self.n1, self.n2 = (k * block for k in LINEAR_AT)

    def _at(self, n: int) -> int:
        if n not in self.known:
            self.known[n] = self.peak(n)
        return self.known[n]

    def __call__(self, n: int) -> int:
        if n <= self.n2:
            return self._at(n)
        fixed, per_token = self.line()
        return int(fixed + per_token * n)

    def line(self) -> tuple[float, float]:
        p1, p2 = self._at(self.n1), self._at(self.n2)
        per_token = max(0.0, (p2 - p1) / (self.n2 - self.n1))
        return p2 - per_token * self.n2, per_token


def constant(label: str, value: int) -> Part:
    return Part(label, lambda n: value, lambda: (value, 0.0))


def per_token(label: str, bytes_per_token: float) -> Part:
    return Part(label, lambda n: int(bytes_per_token * n), lambda: (0.0, bytes_per_token))


# ---------------------------------------------------------------- what is available

def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def host_available() -> tuple[int, str]:
    """(bytes this machine can still give, where from): MemAvailable, less where this process's cgroup limits it."""
    found = []
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    group = ""
    with contextlib.suppress(OSError):
        with open("/proc/self/cgroup") as f:
            group = next((line.strip().split(":", 2)[2] for line in f if line.startswith("0::")), "")
    for limit, usage in ((f"/sys/fs/cgroup{group}/memory.max", f"/sys/fs/cgroup{group}/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None and cap < 1 << 60:
            found.append((max(0, cap - used), "the cgroup's memory limit"))
            break
    if not found:
        import psutil

        return psutil.virtual_memory().available, "available memory"
    return min(found)


def local_processes() -> int:
    """Processes of this launch on this host (torchrun's LOCAL_WORLD_SIZE; 1 without a launcher)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def budgets(cuda: bool) -> list[Budget]:
    """The host's share for this process, and on CUDA its device's (free memory less gpus.RESERVE_BYTES)."""
    local = local_processes()
    free, source = host_available()
    found = [Budget("host", free // local, source, local)]
    if cuda:
        import torch

        from bpt.gpusim.gpus import RESERVE_BYTES

        count = torch.cuda.device_count()
        index = int(os.environ.get("LOCAL_RANK", "0")) % count
        sharing = math.ceil(local / count)  # more processes than devices: they share
        free, _ = torch.cuda.mem_get_info(index)
        found.insert(0, Budget(f"cuda:{index}", free // sharing - RESERVE_BYTES,
                               f"free memory of cuda:{index} less a {RESERVE_BYTES // GIB} GiB reserve", sharing))
    return found


def simulated_device(cuda: bool) -> str:
    """The bpt.gpusim device the run's step is simulated on: "cpu", or a GPU with this card's compute capability
    (the closest below it), whose attention kernels it picks."""
    if not cuda:
        return "cpu"
    import torch

    from bpt.gpusim.gpus import DEVICES

    capability = torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    gpus = sorted((d for d in DEVICES.values() if d.is_cuda), key=lambda d: d.capability)
    return max((d for d in gpus if d.capability <= capability), default=gpus[0], key=lambda d: d.capability).name


# ---------------------------------------------------------------- the estimate

@dataclasses.dataclass
class Estimate:
    """What one process of the run needs: its parts, and per memory the phases (parts alive together; the peak is
    the largest phase)."""

    parts: dict[str, Part]
    phases: dict[str, list[list[str]]]  # "host" / "cuda" -> phases

    def need(self, memory: str, n: int) -> tuple[int, list[str]]:
        """(bytes at --max_seq_len n, the parts of the largest phase)."""
        return max(((sum(self.parts[p].bytes(n) for p in phase), phase) for phase in self.phases[memory]),
                   key=lambda found: found[0], default=(0, []))

    def longest(self, memory: str, available: int) -> int:
        """The longest --max_seq_len whose every phase fits `available` along the parts' lines (0: none)."""
        best = sys.maxsize
        for phase in self.phases[memory]:
            lines = [self.parts[p].line() for p in phase]
            fixed, slope = sum(f for f, _ in lines), sum(s for _, s in lines)
            if slope > 0:
                best = min(best, max(0, int((available - fixed) // slope)))
            elif fixed > available:
                best = 0
        return best


def not_modelled(args, config, zero3) -> str | None:
    """Why the run's step cannot be simulated (None: it can)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if args.bits == 8:
        return "--bits 8 is not emulated"
    if args.tensor_parallel > 1 or args.fsdp or zero3 is not None:
        return "sharded weights (--tensor_parallel, --fsdp, ZeRO-3) are not modelled"
    if config.model_type not in CONFIG_MAPPING:
        return f"{config.model_type} models' code is not in transformers"
    return None


def estimate(args, *, cuda: bool, zero3=None) -> Estimate:
    """The parts of this run and when they are alive together (see the module's docstring)."""
    from bpt.config import BPTConfig

    from train.recipe.args import BPT_SIZES
    from train.run import plan

    parts: dict[str, Part] = {}
    if args.dataset == "passkey":  # every process builds the whole data set
        rows = args.passkey_samples
        parts["data, building"] = per_token(f"{rows} passkey rows being built", rows * PASSKEY_BUILD_BYTES)
        parts["data"] = per_token(f"{rows} passkey rows", rows * PASSKEY_HELD_BYTES)
    step, evaluation = [], []
    config, _ = plan.model_config(args.model_name_or_path, args.trust_remote_code)
    if not_modelled(args, config, zero3) is None:  # else only the host's data is checked
        device = simulated_device(cuda)
        adapters = plan.adapter_layout(config, args)
        sizes = [getattr(args, name) or getattr(BPTConfig, name) for name in BPT_SIZES]
        block = max(sizes) * args.sequence_parallel  # a rank's share spans whole blocks
        extras: list = []
        rows: dict[int, dict] = {}

        def step_row(n: int) -> dict:
            if n not in rows:
                spec = {**plan.step_spec(args, config, n, adapters, device), "clock": False}  # bytes only
                rows[n] = simulate_quietly(spec)
                extras[:] = plan.analytic_extras(args, config, rows[n]["trainable_params"])
            return rows[n]

        simulated = Simulated(lambda n: step_row(n)["peak_bytes"], block)
        parts["step"] = Part("the training step as --plan simulates it", simulated, simulated.line)
        simulated(min(args.max_seq_len, simulated.n2))  # the extras come with a simulated step
        parts["extras"] = constant("optimizer state and kept gradients", sum(b for _, b in extras))
        step = ["step", "extras"]
        if cuda and args.offload_checkpoints:  # the checkpoints the step moves to (pinned) host memory
            offloaded = Simulated(lambda n: step_row(n).get("host_peak_bytes") or 0, block)
            parts["offloaded"] = Part("the offloaded checkpoints (simulated)", offloaded, offloaded.line)
        if args.eval_passkey:
            from bpt.bench.rank_share import local_tokens

            batch = min(EVAL_BATCH, len(args.eval_depths) * args.eval_trials)
            cache = args.sequence_parallel == 1

            def prefill_peak(n: int) -> int:
                spec = plan.step_spec(args, config, n, adapters, device, rope_len=args.max_seq_len)
                shard = {"seq_len": local_tokens(spec), "sequence_parallel": 1}  # a rank's share of the prompt
                return simulate_quietly({**spec, **shard, "batch_size": batch}, prefill=cache)

            simulated = Simulated(prefill_peak, block)
            if args.eval_lengths:  # fixed lengths, whatever --max_seq_len
                parts["evaluation"] = constant("the evaluation's prefill (simulated)", simulated(max(args.eval_lengths)))
            else:
                parts["evaluation"] = Part("the evaluation's prefill (simulated)", simulated, simulated.line)
            evaluation = ["evaluation", "extras"]
    prompts = []
    if args.eval_passkey:  # one task's prompts at a time, every length's built up front
        cases = len(args.eval_depths) * args.eval_trials
        parts["prompts"] = (constant("evaluation prompts", PROMPT_BYTES * cases * sum(args.eval_lengths))
                            if args.eval_lengths else per_token("evaluation prompts", PROMPT_BYTES * cases))
        prompts = ["prompts"]
    held = ["data"] if "data" in parts else []
    building = [["data, building"]] if "data" in parts else []
    if cuda:
        offloaded = ["offloaded"] if "offloaded" in parts else []
        phases = {"cuda": [step, evaluation], "host": building + [held + offloaded, held + prompts]}
    else:
        phases = {"host": building + [held + step, held + evaluation + prompts]}
    return Estimate(parts, phases)


def simulate_quietly(spec: dict, prefill: bool | None = None) -> int | dict:
    """bpt.bench.simulate.run_simulation's row of a training step in this process (prefill None), or the peak bytes
    of a no-grad forward of the spec's batch (prefill: with the KV cache generate keeps). The library's deprecation
    warnings of the fake model stay inside."""
    from transformers.utils import logging as hf_logging

    from train.recipe.lifecycle import quieted

    with warnings.catch_warnings(), quieted("transformers", hf_logging.ERROR):
        warnings.simplefilter("ignore")
        if prefill is None:
            from bpt.bench.simulate import run_simulation

            return run_simulation(spec)
        depth = spec["model_config"]["num_hidden_layers"]
        layers = min(spec["layers"] or depth, depth)
        peak = prefill_step(spec, layers, prefill)
        if layers < depth:  # exactly linear in the depth, as the step's (simulate.extrapolated_to_depth)
            peak += (prefill_step(spec, layers + 1, prefill) - peak) * (depth - layers)
        return peak


def prefill_step(spec: dict, layers: int, cache: bool) -> int:
    """Peak bytes of one no-grad forward of the spec's batch (as generate's first step: the last position's logits,
    the KV cache when `cache`) on its simulated device; weights and inputs included."""
    import torch

    from bpt.bench.simulate import build_simulated_model, transformers_sees_real_tensors
    from bpt.gpusim.device import simulate
    from bpt.gpusim.gpus import device
    from bpt.gpusim.tracker import AllocationTracker, materialize_fake

    gpu = device(spec["simulate"])
    with contextlib.ExitStack() as stack:
        stack.enter_context(transformers_sees_real_tensors())
        model, handle = build_simulated_model(spec, layers)
        sim = stack.enter_context(simulate(gpu))
        materialize_fake(model, sim.fake_mode, sim.torch_device)
        model.eval()
        ids = torch.zeros(spec["batch_size"], spec["seq_len"], dtype=torch.long, device=sim.torch_device)
        tracker = stack.enter_context(AllocationTracker(top=0, host_apart=gpu.is_cuda))
        tracker.track(*model.parameters(), *model.buffers(), ids)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16) if gpu.is_cuda else contextlib.nullcontext():
            output = model(input_ids=ids, use_cache=cache, logits_to_keep=1)
        del output
        peak = tracker.peak
    if handle is not None:
        handle.remove()
    return peak


# ---------------------------------------------------------------- the check

def size(n: float) -> str:
    from train.run.plan import size as plan_size

    return f"{n / (1 << 40):,.1f} TiB" if n >= 1 << 40 else plan_size(int(n))


def check_memory(args, zero3=None) -> Estimate | None:
    """UserError (one line) when this run's estimate exceeds the memory available by more than MARGIN; called by
    train.qlora's preflight after every other cheap check, before the data and weights load. Returns the estimate
    (None with --skip_memory_check)."""
    if args.skip_memory_check:
        return None
    import torch

    cuda = torch.cuda.is_available()
    n = args.max_seq_len
    try:
        found = estimate(args, cuda=cuda, zero3=zero3)
        verdicts = [(budget, *found.need("cuda" if budget.name.startswith("cuda") else "host", n))
                    for budget in budgets(cuda)]
    except UserError:
        raise
    except Exception as error:  # the simulation's own failure must not stop a run that may well fit
        print(f"note: memory check skipped: estimating this run failed ({type(error).__name__}: {one_line(error)})",
              file=sys.stderr, flush=True)
        return None
    for budget, need, phase in verdicts:
        if need <= MARGIN * budget.available:
            continue
        memory = "cuda" if budget.name.startswith("cuda") else "host"
        what = ", ".join(f"{found.parts[p].label} {size(found.parts[p].bytes(n))}" for p in phase)
        longest = found.longest(memory, budget.available)
        shared = (f" ({budget.processes} processes share it)" if budget.processes > 1 else "")
        fits = (f"the longest --max_seq_len that fits is about {longest // 1024 * 1024 if longest >= 2048 else longest}"
                if longest >= 2 else "no --max_seq_len fits")
        if any(p.startswith("data") for p in phase):
            fits += " (or use fewer --passkey_samples)"
        raise UserError(
            f"not enough {budget.name} memory: --max_seq_len {n} needs about {size(need)} per process ({what}), "
            f"{size(budget.available)} is available ({budget.source}){shared}; {fits}; --skip_memory_check runs it "
            "anyway")
    if os.environ.get("RANK", "0") == "0":  # one line per launch, not per process
        print(passed_line(found, verdicts, n), file=sys.stderr, flush=True)
    return found


def passed_line(found: Estimate, verdicts: list, n: int) -> str:
    """The preflight's line of a run it lets through: each memory's estimate beside what is available."""
    shares = [f"{size(need)} of {budget.name} memory ({size(budget.available)} available: {budget.source})"
              for budget, need, _ in verdicts]
    modelled = "" if "step" in found.parts else "; the data only: this run's step is not modelled"
    return (f"memory: --max_seq_len {n} needs about {' and '.join(shares)} per process (the preflight's estimate"
            f"{modelled}; --skip_memory_check skips it)")
