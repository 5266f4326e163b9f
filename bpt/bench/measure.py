"""What one training step adds in memory and time, measured inside a worker process.

- `measure_step`: wall time and the memory a call adds at its peak, on CUDA or CPU
- `_release_free_heap`: garbage collection + glibc malloc_trim, so "RSS before" counts only live memory
- `run_probe`: a step allocating a known PROBE_MIB must measure as ~PROBE_MIB (checks the chain)
- `run_training`: build the model, one warm-up step, then the measured steps and their figures

One training step = forward with labels + backward, no optimizer; grads are set to None before each
step, so "memory a training step adds" includes the gradients it allocates (the same on both sides).

Memory a step adds: CUDA = max_memory_allocated during the step - memory_allocated before it.
CPU = peak RSS during the step (VmHWM, reset right before the step by writing "5" to
/proc/self/clear_refs) - RSS before it (VmRSS). For RSS to track live tensors, the worker runs with
a fixed glibc mmap threshold (see `bpt.bench.workers.worker_env`); the probe, which allocates a known
1 GiB inside a step, checks the measurement on every sweep.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import statistics
import time
from typing import Callable

import torch

from bpt.bench.models import build_model

MIB = 1024 * 1024
PROBE_MIB = 1024        # the known allocation of the memory probe
PROBE_PIECE_MIB = 16    # mid-size, below glibc's 32 MiB dynamic mmap-threshold ceiling (see worker_env)


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {field}: CPU memory measurement needs Linux")


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> Callable[[int], int] | None:
    libc_name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc_name), "malloc_trim", None) if libc_name else None  # glibc only


def _release_free_heap() -> None:
    """Drop garbage and hand free heap pages back to the OS so "RSS before" counts only live memory."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def measure_step(fn: Callable[[], object], device: str) -> dict:
    """Run fn once; return its wall time and the memory it added at its peak (bytes above before)."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated()
        extra = {"peak_reserved_mib": torch.cuda.max_memory_reserved() / MIB}
    else:
        _release_free_heap()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        before = _proc_status_bytes("VmRSS")
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
        peak = _proc_status_bytes("VmHWM")
        extra = {}
    return {"seconds": seconds, "added_mib": (peak - before) / MIB, "before_mib": before / MIB,
            "peak_mib": peak / MIB, "out": out, **extra}


def run_probe(spec: dict) -> dict:
    """A step that allocates a known PROBE_MIB in PROBE_PIECE_MIB pieces must measure as ~PROBE_MIB.

    Checks the whole chain (HWM reset, RSS baseline, peak read, or the CUDA counters) on the machine
    at hand. The same pieces are allocated and freed first, as a previous step would, so memory a
    previous step left resident would show up as a shortfall here.
    """
    device = spec["device"]
    pieces = PROBE_MIB // PROBE_PIECE_MIB
    numel = PROBE_PIECE_MIB * MIB // 4

    def allocate():
        # torch.ones writes every page, so all of it becomes resident.
        held = [torch.ones(numel, dtype=torch.float32, device=device) for _ in range(pieces)]
        return sum(t.numel() for t in held) * 4 / MIB

    allocate()  # allocate and free once, as a previous step would
    measured = measure_step(allocate, device)
    return {"ok": True, "expected_mib": measured["out"], "measured_mib": measured["added_mib"]}


def run_training(spec: dict) -> dict:
    """Build the model, one warm-up step, then `steps` measured steps."""
    device, seq_len, batch = spec["device"], spec["seq_len"], spec["batch_size"]
    start = time.perf_counter()
    model, handle = build_model(spec)
    build_s = time.perf_counter() - start
    generator = torch.Generator().manual_seed(spec["seed"])
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=generator).to(device)

    def train_step():
        # Only the loss outlives the forward, as in a training loop (HF Trainer's compute_loss): holding the
        # output object would keep stock's N x V logits alive through backward.
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    def measured_step():
        model.zero_grad(set_to_none=True)  # before the "before" reading: every step allocates its grads
        return measure_step(train_step, device)

    warmup = measured_step()
    steps = [measured_step() for _ in range(spec["steps"])]
    median_s = statistics.median(s["seconds"] for s in steps)
    worst = max(steps, key=lambda s: s["added_mib"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {
        "ok": True,
        "step_mib": worst["added_mib"],            # the largest over the measured steps
        "step_mib_each": [s["added_mib"] for s in steps],
        "before_mib": worst["before_mib"],
        "peak_mib": worst["peak_mib"],
        **({"peak_reserved_mib": worst["peak_reserved_mib"]} if "peak_reserved_mib" in worst else {}),
        "median_s": median_s,
        "step_s_each": [s["seconds"] for s in steps],
        "tokens_per_s": batch * seq_len / median_s,
        "warmup_s": warmup["seconds"],
        "warmup_mib": warmup["added_mib"],
        "build_s": build_s,
        "loss": float(steps[0]["out"]),
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in trainable),
        "grad_mib": sum(p.numel() * p.element_size() for p in trainable) / MIB,  # the constant part of step_mib
        "patched": handle is not None,
        "threads": torch.get_num_threads(),
    }
