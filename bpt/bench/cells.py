"""Worker tasks of the GPU check: "environment" (the card and the versions, `device_environment`) and "cells": one side of the GPU check in one process, a model built once and each length run in turn.

Per length (a cell):
- `tracked: true`: one step as the simulation runs it (bpt.bench.simulate.tracked_step: the patch with compile off,
  bf16 autocast) under the AllocationTracker, with torch.cuda.max_memory_allocated beside it on a real GPU: the
  simulation's code path on real tensors;
- `timed_steps: K`: the patch applied as a user gets it (torch.compile on CUDA), one warm-up step and K synchronised
  steps: their median seconds, tokens per second and the allocator's peak.
On a simulated device the same code runs on fake tensors: bytes from the tracker, no timings (the steps still run,
so a dry run executes what a GPU run does; compile stays off there: nothing can compile fake CUDA tensors).

`layers` below the depth: each length runs at `layers` and `layers` + 1 layers and the byte counts are extended to
the depth (simulate.extrapolated_to_depth, as --simulate --layers does), the measured seconds too where both steps
were timed (timed_to_depth): a long length's memory, or a large model's step time, without paying its whole step.
`stop_at_first_failure` and `deadline` (epoch seconds) make it the max-context search: lengths in increasing order,
stop at the first that fails or does not fit `usable_bytes`, and skip a length whose predicted time (the last cell's
scaled by the square of the length ratio: attention's cost) would pass the deadline.
Every finished cell is also written to result_path + ".partial": a worker killed at its timeout keeps them.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import time

import torch

from bpt.bench.rank_share import RankShare
from bpt.bench.report import package_version
from bpt.bench.simulate import (build_simulated_model, extrapolated_to_depth, extrapolation_steps, patch, quantiser,
                                step_inputs, tracked_step, training_step, transformers_sees_real_tensors,
                                unseen_layers_bytes)
from bpt.gpusim.gpus import device as simulated_device


class _Models:
    """Holds the model of one depth at a time: asking for another depth frees the one held first."""

    def __init__(self, spec: dict, sim, real: bool):
        self.spec, self.sim, self.real = spec, sim, real
        self.layers, self.model, self.handle = None, None, None
        self.compile = False  # the patch's compile setting now (built with it off, as the simulation runs)

    def get(self, layers: int):
        if layers != self.layers:
            self.free()
            if self.real:
                self.model, self.handle = build_simulated_model(self.spec, layers, self.sim.torch_device)
            else:
                from torch.utils._python_dispatch import _disable_current_modes

                from bpt.gpusim.tracker import materialize_fake

                with _disable_current_modes():  # built on meta outside the fake mode, then made fake
                    self.model, self.handle = build_simulated_model(self.spec, layers)
                materialize_fake(self.model, self.sim.fake_mode, self.sim.torch_device)
            self.layers, self.compile = layers, False
        return self.model

    def repatch(self, compile: bool | None) -> None:
        """The side's patch again with `compile` (the tracked step ran it with compile off, as the simulation)."""
        if self.handle is not None:
            self.handle.remove()
        self.handle = patch(self.model, self.spec, compile)
        self.compile = compile

    def free(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.layers, self.model, self.handle = None, None, None
        _release(self.real)

LIBRARIES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "liger-kernel", "triton", "datasets")


def device_environment(spec: dict) -> dict:
    """Worker task "environment": the card and the versions, read in a process like the ones that will run."""
    import torch

    versions = {name: package_version(name) for name in LIBRARIES}
    env = {"ok": True, "python": platform.python_version(), "versions": versions, "torch_cuda": torch.version.cuda,
           "cpu_count": os.cpu_count(), "hostname": platform.node()}
    if spec.get("real"):
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        env |= {"gpu": props.name, "gpu_count": torch.cuda.device_count(), "memory_bytes": total,
                "free_bytes_at_start": free, "capability": list(torch.cuda.get_device_capability(0)),
                "multiprocessors": props.multi_processor_count, "driver": _nvidia_smi("driver_version"),
                "bf16": torch.cuda.is_bf16_supported()}
    else:
        gpu = simulated_device(spec["simulate"])
        env |= {"gpu": gpu.label, "gpu_count": 1, "memory_bytes": gpu.memory_bytes,
                "capability": list(gpu.capability), "driver": None}
    return env


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None



def _release(real: bool) -> None:
    gc.collect()
    if real:
        torch.cuda.empty_cache()


def _timed(models: _Models, inputs: dict, count: int, real: bool, compile: bool | None) -> dict:
    """One warm-up and `count` measured steps with the patch as users run it; seconds only on a real GPU."""
    models.repatch(compile if real else False)
    model = models.model
    if not real:  # fake tensors: one step runs the code, times would mean nothing
        model.zero_grad(set_to_none=True)
        training_step(model, inputs, autocast=True)
        return {"timed_steps": count, "seconds_per_step": None, "tokens_per_second": None}
    return timed_steps(model, lambda: training_step(model, inputs, autocast=True), count,
                       inputs["input_ids"].numel(), cuda=True)


def timed_steps(model, step, count: int, tokens: int, cuda: bool) -> dict:
    """`step()` (a training step: forward, backward; -> the loss) once to warm up and `count` times measured,
    synchronised on a GPU: the median seconds, tokens per second, the allocator's peak (GPU) and the last loss."""
    seconds, peaks, loss = [], [], None
    for _ in range(1 + count):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds[1:])
    return {"timed_steps": count, "seconds_per_step": median, "step_seconds_each": seconds[1:],
            "warmup_seconds": seconds[0], "tokens_per_second": tokens / median,
            "timed_peak_bytes": max(peaks[1:]) if cuda else None, "timed_loss": float(loss)}


# kernel name fragments -> the clock's categories (first match wins; the rest is memory-bound work)
KERNEL_KINDS = (("copies", ("memcpy", "memset")),
                ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
                ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "splitk")))


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in lowered for p in parts)), "memory_bound")


def profiled_step(model, inputs: dict, real: bool, top: int = 12) -> dict:
    """One more step under torch.profiler: kernels launched, GPU time by kind, the busiest kernels.

    The clock's ground truth: launches per step beside the simulation's op count, and how much of the step's wall
    time the GPU spends in kernels (the rest is launch-bound idle). The profiled wall time is inflated by the
    profiler; compare kernel time with the unprofiled median."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if real else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        training_step(model, inputs, autocast=True)
        if real:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if _on_gpu(e)]
    by_kind, by_name, count_by_kind = {}, {}, {}
    for e in kernels:
        us = e.time_range.elapsed_us()
        kind = kernel_kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e6
        count_by_kind[kind] = count_by_kind.get(kind, 0) + 1
        seconds, calls = by_name.get(e.name, (0.0, 0))
        by_name[e.name] = (seconds + us / 1e6, calls + 1)
    aten = sum(1 for e in prof.events() if e.name.startswith("aten::") and not _on_gpu(e))
    busiest = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    model.zero_grad(set_to_none=True)
    return {"profiled_wall_seconds": wall, "kernel_launches": len(kernels), "aten_calls": aten,
            "kernel_seconds": sum(by_kind.values()), "kernel_seconds_by_kind": by_kind,
            "kernels_by_kind": count_by_kind,
            "busiest_kernels": [{"name": name[:160], "seconds": s, "calls": c} for name, (s, c) in busiest],
            "runtime_calls": runtime_calls(prof.events(), top)}


def _on_gpu(event) -> bool:
    """A profiler event that ran on the GPU (a kernel or a copy), not on the host."""
    return str(getattr(event, "device_type", "")).endswith("CUDA")


HOST_WAITS = ("Synchronize", "Malloc", "Free", "HostAlloc", "HostRegister")  # runtime calls that can stall the host


def runtime_calls(events, top: int) -> list[dict]:
    """The CUDA runtime calls the host made in a profiled step (cudaLaunchKernel, cudaMemcpyAsync, ...), the `top`
    by host time: a step whose GPU idles while its host is not busy launching waits in one of these (a stream
    synchronisation, a cudaMalloc or a pinned allocation), which a kernel count cannot show."""
    by_name: dict[str, list] = {}
    for e in events:
        if _on_gpu(e) or not e.name.startswith("cuda"):
            continue
        calls = by_name.setdefault(e.name, [0, 0.0])
        calls[0] += 1
        calls[1] += e.time_range.elapsed_us() / 1e6
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": name, "calls": calls, "seconds": seconds,
             "host_wait": any(part in name for part in HOST_WAITS)} for name, (calls, seconds) in ranked]


def _cell(models: _Models, spec: dict, seq_len: int, layers: int, real: bool) -> dict:
    model = models.get(layers)
    inputs = step_inputs(spec, models.sim.torch_device, real, seq_len)
    start = time.perf_counter()
    row = {}
    if spec.get("tracked", True):
        model.zero_grad(set_to_none=True)
        if models.compile is not False:
            models.repatch(False)  # a timed step of the previous length left the compiled patch on
        share = RankShare(inputs)
        unseen = unseen_layers_bytes(spec, model, layers, share.tokens)
        row.update(tracked_step(model, share, models.sim, real, spec.get("top", 10), unseen_bytes=unseen))
    if spec.get("timed_steps"):
        row.update(_timed(models, inputs, spec["timed_steps"], real, spec["bpt"].get("compile")))
        if seq_len in spec.get("profile_lengths", ()):
            try:  # the profile is an extra: its failure never costs the cell its figures
                row["profile"] = profiled_step(model, inputs, real)
            except Exception as error:
                row["profile"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    model.zero_grad(set_to_none=True)
    del inputs
    _release(real)
    row["seconds"] = time.perf_counter() - start
    return row


def _one_length(models: _Models, spec: dict, seq_len: int, depth: int, layers: int, period: int, real: bool) -> dict:
    row = {"seq_len": seq_len, "layers": layers, "depth": depth, "extrapolated": layers != depth,
           "quantiser": quantiser(models.sim.torch_device if real else None) if spec["bits"] == 4 else None}
    try:
        step = _cell(models, spec, seq_len, layers, real)
        if layers != depth and "peak_bytes" in step:  # bytes to extend; a timed-only cell is the `layers` step
            more = _cell(models, spec, seq_len, layers + period, real)
            step = {**step, **extrapolated_to_depth(step, more, layers, depth, period),
                    **timed_to_depth(step, more, layers, depth, period)}
    except Exception as error:  # an out-of-memory (or any) failure is this cell's result; the worker goes on
        models.free()
        text = first_line(error)
        oom = isinstance(error, torch.OutOfMemoryError) or "out of memory" in text
        return {**row, "ok": False, "error": ("out of memory: " if oom else f"{type(error).__name__}: ") + text}
    row.update(ok=True, **step)
    if "peak_bytes" in row:
        peak = row.get("cuda_peak_bytes", row["peak_bytes"])
        row["fits"] = None if spec.get("usable_bytes") is None else peak <= spec["usable_bytes"]
    return row


def first_line(error: BaseException) -> str:
    """An error's first line, at most 300 characters: what a cell's row keeps of a failure."""
    return (str(error).strip().splitlines() or [""])[0][:300]


def timed_to_depth(step: dict, more: dict, layers: int, depth: int, period: int) -> dict:
    """The measured seconds of a step with `depth` layers from the timed steps at `layers` and `layers` + `period`
    (a + b L, as the bytes: each layer adds its forward, recompute and backward); {} where either was not timed (a
    simulated card times nothing). The allocator's timed peak is extended too; each depth's median stays beside."""
    if not (step.get("seconds_per_step") and more.get("seconds_per_step")):
        return {}
    grow = (depth - layers) // period
    seconds = step["seconds_per_step"] + (more["seconds_per_step"] - step["seconds_per_step"]) * grow
    peak = step["timed_peak_bytes"] + (more["timed_peak_bytes"] - step["timed_peak_bytes"]) * grow
    tokens = step["tokens_per_second"] * step["seconds_per_step"]
    return {"seconds_per_step": seconds, "tokens_per_second": tokens / seconds, "timed_peak_bytes": peak,
            "step_seconds_each": None,
            "seconds_by_layers": {str(layers): step["seconds_per_step"],
                                  str(layers + period): more["seconds_per_step"]}}


def run_cells(spec: dict) -> dict:
    """The worker task: every length of spec["seq_lens"] for the spec's side; -> {"ok": True, "cells": [...]}."""
    from bpt.gpusim.device import Simulation, simulate
    from bpt.gpusim.tracker import DataOracle

    gpu = simulated_device(spec["simulate"])
    real = bool(spec.get("real"))
    depth = spec["model_config"]["num_hidden_layers"]
    layers, period = extrapolation_steps(spec, min(spec.get("layers") or depth, depth), depth)
    cells, last = [], None
    with contextlib.ExitStack() as stack:
        stack.enter_context(transformers_sees_real_tensors())
        sim = Simulation(gpu, None, DataOracle()) if real else stack.enter_context(simulate(gpu))
        models = _Models(spec, sim, real)
        for seq_len in spec["seq_lens"]:
            deadline = spec.get("deadline")
            if deadline is not None and last is not None:
                predicted = last["seconds"] * (seq_len / last["seq_len"]) ** 2
                if time.time() + predicted > deadline:
                    cells.append({"seq_len": seq_len, "ok": False, "skipped": True,
                                  "error": f"not run: ~{predicted:.0f} s predicted, past the check's time budget"})
                    break
            row = _one_length(models, spec, seq_len, depth, layers, period, real)
            cells.append(row)
            with open(spec["result_path"] + ".partial", "w") as f:
                json.dump({"ok": True, "cells": cells}, f)
            last = row if row["ok"] else last
            if spec.get("stop_at_first_failure") and not (row["ok"] and row.get("fits", True)):
                break
        models.free()
    return {"ok": True, "cells": cells}
