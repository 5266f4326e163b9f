"""The `--simulate DEVICE` mode of the bench: rows of simulated steps, `--find_max` by bisection, `--calibrate`.

- `simulation_spec`: the worker spec of one (side, seq_len) on the simulated device
- `simulated_sweep`: every (side, seq_len), then per side the longest length whose simulated peak fits the
  device's usable memory (capacity minus gpus.RESERVE_BYTES): doubling, then bisection to 1K tokens
- `format_simulated`: the printed table (every figure labelled simulated)

With `--calibrate` (a real GPU only) each row also runs the same step on real CUDA tensors and carries
torch.cuda.max_memory_allocated beside the prediction: the first GPU run tells us the simulation's error.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Callable

from bpt.bench.simulate import longest_fitting
from bpt.gpusim.gpus import GIB, RESERVE_BYTES
from bpt.gpusim.gpus import device as simulated_device

RESOLUTION = 1024  # --find_max's bisection stops at this many tokens


def simulation_spec(args: argparse.Namespace, model_config: dict, side: str, seq_len: int) -> dict:
    gpu = simulated_device(args.simulate)
    bits = args.bits if gpu.is_cuda else {"fp32": 32, "bf16": 16}[args.dtype]  # fake CPU: the real bench's dtype
    return {
        "task": "simulate", "simulate": args.simulate, "side": side, "seq_len": seq_len, "model_config": model_config,
        "bits": bits, "batch_size": args.batch_size, "gradient_checkpointing": args.gradient_checkpointing,
        "lora": args.lora, "lora_r": args.lora_r, "lora_targets": args.lora_targets, "lora_dropout": args.lora_dropout,
        "layers": args.layers, "top": args.top, "bpt": asdict(args.bpt), "malloc": args.malloc,
        "threads": args.torch_threads,
    }


def _row_line(run: dict) -> str:
    if not run["ok"]:
        return f"FAILED: {run['error']}"
    fits = {True: "fits", False: "does not fit", None: ""}[run["fits"]]
    paths = ", ".join(f"{k} x{v}" for k, v in sorted(run["attention_paths"].items())) or "-"
    extrapolated = f" (layers {run['layers']}->{run['depth']} extrapolated)" if run["extrapolated"] else ""
    line = (f"simulated peak {run['peak_bytes'] / GIB:7.2f} GiB  step {run['step_bytes'] / GIB:7.2f} GiB  "
            f"{run['bytes_per_token'] / 1024:7.1f} KiB/token  {fits}  attention {paths}{extrapolated}")
    if run.get("host_peak_bytes"):
        line += f"  host {run['host_peak_bytes'] / GIB:.2f} GiB"
    if run.get("step_seconds"):
        idle = run["time_breakdown"]["launch_bound_idle"] / run["step_seconds"]
        line += (f"  predicted {run['step_seconds']:.3f} s/step ({run['tokens_per_second']:,.0f} tok/s, MFU "
                 f"{run['mfu']:.0%}, {run['kernel_launches']:,} kernels, launch-bound idle {idle:.0%})")
    if "cuda_peak_bytes" in run:
        line += f"  | real max_memory_allocated {run['cuda_peak_bytes'] / GIB:.2f} GiB"
    return line


def simulated_sweep(args: argparse.Namespace, model_config: dict, runner: Callable[[dict], dict]) -> tuple[list, dict]:
    """All (side, seq_len) rows, then --find_max per side. Returns (runs, find_max summary)."""
    runs = []

    def one(side, seq_len, phase):
        spec = simulation_spec(args, model_config, side, seq_len)
        run = {"side": side, "seq_len": seq_len, "phase": phase, "model": args.model, "bits": spec["bits"],
               "lora_r": args.lora_r if args.lora else None, **runner(spec)}
        if args.calibrate and run["ok"]:
            real = runner({**spec, "real": True})
            run["calibration"] = real
            if real["ok"]:
                run["cuda_peak_bytes"] = real["cuda_peak_bytes"]
                run["cuda_step_bytes"] = real["cuda_step_bytes"]
                run["tracker_on_real_peak_bytes"] = real["peak_bytes"]
        runs.append(run)
        print(f"[{side:7s} {seq_len:>8d}] {_row_line(run)}", flush=True)
        return run

    for seq_len in args.seq_lens:
        for side in args.sides:
            one(side, seq_len, "sweep")
    found = {}
    if args.find_max:
        gpu = simulated_device(args.simulate)
        for side in args.sides:
            def fits(n, side=side):
                done = next((r for r in runs if r["side"] == side and r["seq_len"] == n and r["ok"]), None)
                run = done or one(side, n, "find_max")
                if not run["ok"]:
                    raise RuntimeError(f"simulation of {side} at {n} tokens failed: {run['error']}")
                return run["fits"]

            longest, first_over = longest_fitting(fits, min(args.seq_lens), args.max_len, RESOLUTION)
            found[side] = {"max_context_tokens": longest, "first_over": first_over,
                           "usable_bytes": gpu.usable_bytes, "reserve_bytes": RESERVE_BYTES,
                           "reason": "peak over the usable memory" if first_over else f"reached --max_len {args.max_len}"}
            for run in runs:
                if run["side"] == side:
                    run["max_context_tokens"] = longest
    return runs, found


def format_simulated(args: argparse.Namespace, runs: list, found: dict) -> str:
    gpu = simulated_device(args.simulate)
    head = f"simulated {gpu.name}"
    if gpu.usable_bytes is not None:
        head += (f": {gpu.memory_bytes / GIB:.1f} GiB, usable {gpu.usable_bytes / GIB:.1f} GiB after a "
                 f"{RESERVE_BYTES / GIB:.0f} GiB reserve (CUDA context, workspaces, fragmentation; ~1.1 GiB of it measured on an H100)")
    lines = [head, "allocated bytes of one forward + backward (weights and grads included, no optimizer state)"]
    for run in sorted(runs, key=lambda r: (r["seq_len"], r["side"])):
        lines.append(f"  {run['side']:15s} {run['seq_len']:>8d}  {_row_line(run)}")
    for side, f in found.items():
        over = f" ({f['first_over']} does not)" if f["first_over"] else ""
        lines.append(f"find_max {side}: longest that fits {f['max_context_tokens']} tokens{over}, {f['reason']}")
    return "\n".join(lines)


CSV_FIELDS = ("device", "model", "side", "seq_len", "bits", "lora_r", "layers", "depth", "extrapolated", "ok",
              "peak_bytes", "step_bytes", "peak_gib", "bytes_per_token", "fits", "max_context_tokens", "host_peak_bytes",
              "cuda_peak_bytes")


def simulated_report(args: argparse.Namespace, environment: dict, runs: list, found: dict) -> dict:
    """The JSON report; summary rows (the CSV) are the runs' headline fields."""
    gpu = simulated_device(args.simulate)
    environment = environment | {
        "device": gpu.label, "device_name": gpu.label, "simulated": True, "bits": args.bits,
        "lora_targets": args.lora_targets, "lora_dropout": args.lora_dropout, "layers": args.layers,
        "memory_bytes": gpu.memory_bytes, "reserve_bytes": RESERVE_BYTES, "usable_bytes": gpu.usable_bytes,
        "autocast": "bf16" if gpu.is_cuda else None, "bpt_compile": False}
    rows = [{key: run.get(key) for key in CSV_FIELDS} for run in runs]
    return {"environment": environment, "summary": {"rows": rows}, "find_max": found, "runs": runs}
