"""The `--simulate DEVICE` mode of the bench: rows of simulated steps, `--find_max` by bisection, `--calibrate`.

- `validate_simulated`: its flags (errors exit with status 2)
- `simulation_spec`: the worker spec of one (side, layout, seq_len) on the simulated device
- `simulated_sweep`: every (side, layout, seq_len), then per side and layout the longest length whose simulated peak
  fits the device's usable memory (capacity minus gpus.RESERVE_BYTES): doubling from the longest sweep length that
  fits (unless a longer one does not), then bisection to 1K tokens
- layouts: one device, or with `--sequence_parallel N --sp_mode M` one rank of N (bpt.bench.rank_share: the real
  ring / Ulysses code over a fake process group); a row's seq_len is the whole sequence's, its bytes one rank's
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

RESOLUTION = 1024  # --find_max's bisection stops at this many tokens (per rank with --sequence_parallel)
SIMULATED_MAX_LEN = 1 << 22  # --find_max's cap when --max_len is not given (x N with --sequence_parallel)


def validate_simulated(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The --simulate flags (errors exit with status 2)."""
    import torch

    if args.layers is not None and args.layers <= 0:
        p.error(f"--layers must be positive, got {args.layers}")
    if not 0.0 <= args.lora_dropout < 1.0:
        p.error(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if (args.lora_targets or args.lora_dropout) and not args.lora:
        p.error("--lora_targets and --lora_dropout need --lora")
    if args.simulate == "cpu" and args.bits != 16:
        p.error("--simulate cpu follows --dtype (fp32 or bf16 weights, as the real CPU bench); drop --bits")
    if args.calibrate and not torch.cuda.is_available():
        p.error("--calibrate runs the real step beside the simulated one: it needs a CUDA GPU")
    if args.sequence_parallel is not None:
        bad = [n for n in args.sequence_parallel if n < 1]
        if bad:
            p.error(f"--sequence_parallel sizes must be >= 1 (GPUs per sequence), got {bad}")
        args.sequence_parallel = sorted(set(args.sequence_parallel))
        args.sp_mode = [m for m in ("ring", "ulysses") if m in args.sp_mode]
        if args.tensor_parallel != [1]:
            p.error("--simulate models sequence parallelism, not --tensor_parallel; drop --tensor_parallel")
        if max(args.sequence_parallel) > 1 and not any(s.startswith("patched") for s in args.sides):
            p.error("--sequence_parallel splits the patched model only (sequence parallelism is part of the patch); "
                    "add --sides patched or patched+offload")
    if args.find_max and args.max_len is None:
        args.max_len = SIMULATED_MAX_LEN * max(args.sequence_parallel or [1])
    if args.gpus_per_machine is not None and args.gpus_per_machine < 1:
        p.error(f"--gpus_per_machine must be >= 1, got {args.gpus_per_machine}")
    if args.host_memory_per_machine is not None and args.host_memory_per_machine <= 0:
        p.error(f"--host_memory_per_machine must be positive (GiB), got {args.host_memory_per_machine}")


def layouts(args: argparse.Namespace) -> list[tuple[int, str | None]]:
    """(GPUs per sequence, sp mode) of every simulated layout: (1, None) is one device."""
    sizes = args.sequence_parallel or [1]
    return [(n, mode) for n in sizes for mode in ([None] if n == 1 else args.sp_mode)]


def sides_of(args: argparse.Namespace, world: int) -> list[str]:
    """The sides a layout runs: every one on one device, the patched ones split over several."""
    return args.sides if world == 1 else [s for s in args.sides if s.startswith("patched")]


def layout_name(side: str, world: int, mode: str | None) -> str:
    return side if world == 1 else f"{side} sp{world} {mode}"


def simulation_spec(args: argparse.Namespace, model_config: dict, side: str, seq_len: int, world: int = 1,
                    mode: str | None = None) -> dict:
    gpu = simulated_device(args.simulate)
    bits = args.bits if gpu.is_cuda else {"fp32": 32, "bf16": 16}[args.dtype]  # fake CPU: the real bench's dtype
    return {
        "task": "simulate", "simulate": args.simulate, "side": side, "seq_len": seq_len, "model_config": model_config,
        "bits": bits, "batch_size": args.batch_size, "gradient_checkpointing": args.gradient_checkpointing,
        "lora": args.lora, "lora_r": args.lora_r, "lora_targets": args.lora_targets, "lora_dropout": args.lora_dropout,
        "layers": args.layers, "top": args.top, "bpt": asdict(args.bpt), "malloc": args.malloc,
        "threads": args.torch_threads, "sequence_parallel": world, "sp_mode": mode,
        "gpus_per_machine": args.gpus_per_machine,
        "host_bytes_per_machine": None if args.host_memory_per_machine is None
        else int(args.host_memory_per_machine * GIB),
    }


def _row_line(run: dict) -> str:
    if not run["ok"]:
        return f"FAILED: {run['error']}"
    fits = {True: "fits", False: "does not fit", None: ""}[run["fits"]]
    if run.get("host_fits") is False:
        fits += ": host memory over the machine's" + ("" if run.get("device_fits") else ", and the device's")
    paths = ", ".join(f"{k} x{v}" for k, v in sorted(run["attention_paths"].items()))
    if run.get("sequence_parallel", 1) > 1:
        paths = f"{run['sp_mode']}" + (f" over {paths}" if paths else "")
    paths = paths or "-"
    extrapolated = f" (layers {run['layers']}->{run['depth']} extrapolated)" if run["extrapolated"] else ""
    line = (f"simulated peak {run['peak_bytes'] / GIB:7.2f} GiB  step {run['step_bytes'] / GIB:7.2f} GiB  "
            f"{run['bytes_per_token'] / 1024:7.1f} KiB/token  {fits}  attention {paths}{extrapolated}")
    if run.get("sequence_parallel", 1) > 1:
        line += f"  {run['tokens_per_rank']:,} tokens/rank, sent {run['sent_bytes'] / GIB:.1f} GiB/rank"
    if (run.get("host_peak_bytes") or 0) >= GIB // 1024:  # offloaded checkpoints (a few stray host bytes aside)
        line += f"  host {run['host_peak_bytes'] / GIB:.2f} GiB"
        if run.get("host_bytes_per_machine"):
            line += (f" ({run['host_bytes_per_machine'] / GIB:.0f} GiB per machine of "
                     f"{run['host_memory_per_machine'] / GIB:.0f}, {run['processes_per_machine']} processes)")
        if run.get("offload_keep_last"):
            line += f", the last {run['offload_keep_last']} saved kept on the device"
    if run.get("step_seconds"):
        idle = run["time_breakdown"]["launch_bound_idle"] / run["step_seconds"]
        line += (f"  predicted {run['step_seconds']:.3f} s/step ({run['tokens_per_second']:,.0f} tok/s, MFU "
                 f"{run['mfu']:.0%}, {run['kernel_launches']:,} kernels, launch-bound idle {idle:.0%})")
    if run.get("exchange"):
        line += "  " + exchange_line(run)
    if "cuda_peak_bytes" in run:
        line += f"  | real max_memory_allocated {run['cuda_peak_bytes'] / GIB:.2f} GiB"
    return line


def exchange_line(run: dict) -> str:
    """Compute, exchange and exposed exchange of a sequence-parallel row's predicted step (bpt.gpusim.exchange)."""
    x, step = run["exchange"], run["step_seconds"]
    where = (f"{x['machines']} machines of {x['gpus_per_machine']}" if x["machines"] > 1
             else f"one machine of {x['gpus_per_machine']}")
    return (f"[{where}: compute {step - x['exposed_exchange_seconds']:.1f} s, exchange {x['exchange_seconds']:.1f} s, "
            f"exposed {x['exposed_exchange_seconds']:.2f} s ({x['exposed_exchange_seconds'] / step:.1%} of the step)]")


def simulated_sweep(args: argparse.Namespace, model_config: dict, runner: Callable[[dict], dict]) -> tuple[list, dict]:
    """All (side, layout, seq_len) rows, then --find_max per side and layout. Returns (runs, find_max summary)."""
    runs = []

    def one(side, world, mode, seq_len, phase):
        spec = simulation_spec(args, model_config, side, seq_len, world, mode)
        run = {"side": side, "seq_len": seq_len, "sequence_parallel": world, "sp_mode": mode, "phase": phase,
               "model": args.model, "bits": spec["bits"], "lora_r": args.lora_r if args.lora else None,
               **runner(spec)}
        if args.calibrate and run["ok"]:
            real = runner({**spec, "real": True})
            run["calibration"] = real
            if real["ok"]:
                run["cuda_peak_bytes"] = real["cuda_peak_bytes"]
                run["cuda_step_bytes"] = real["cuda_step_bytes"]
                run["tracker_on_real_peak_bytes"] = real["peak_bytes"]
        runs.append(run)
        print(f"[{layout_name(side, world, mode)} {seq_len:>8d}] {_row_line(run)}", flush=True)
        return run

    for seq_len in args.seq_lens:
        for world, mode in layouts(args):
            for side in sides_of(args, world):
                one(side, world, mode, seq_len, "sweep")
    found = {}
    if args.find_max:
        gpu = simulated_device(args.simulate)
        for world, mode in layouts(args):
            for side in sides_of(args, world):
                def ours(run, side=side, world=world, mode=mode):
                    return (run["side"], run["sequence_parallel"], run["sp_mode"]) == (side, world, mode)

                def fits(n, side=side, world=world, mode=mode, ours=ours):
                    done = next((r for r in runs if ours(r) and r["seq_len"] == n and r["ok"]), None)
                    run = done or one(side, world, mode, n, "find_max")
                    if not run["ok"]:
                        raise RuntimeError(f"simulation of {layout_name(side, world, mode)} at {n} tokens failed: "
                                           f"{run['error']}")
                    return run["fits"]

                swept = [r for r in runs if ours(r) and r["ok"]]
                start = max((r["seq_len"] for r in swept if r["fits"]), default=min(args.seq_lens))
                over = min((r["seq_len"] for r in swept if not r["fits"] and r["seq_len"] > start), default=None)
                # between the longest sweep length that fits and the shortest above it that does not
                longest, first_over = longest_fitting(fits, start, args.max_len, RESOLUTION * world, over)
                found[layout_name(side, world, mode)] = {
                    "side": side, "sequence_parallel": world, "sp_mode": mode, "max_context_tokens": longest,
                    "first_over": first_over, "usable_bytes": gpu.usable_bytes, "reserve_bytes": RESERVE_BYTES,
                    "reason": _over_reason(next((r for r in runs if ours(r) and r["seq_len"] == first_over), None))
                    if first_over else f"reached --max_len {args.max_len}"}
                for run in runs:
                    if ours(run):
                        run["max_context_tokens"] = longest
    return runs, found


def _over_reason(run: dict | None) -> str:
    """Why the shortest length over is: the device's peak, or the machine's host memory (the device holding it)."""
    if run is not None and run.get("host_fits") is False and run.get("device_fits"):
        return "host memory over the machine's"
    return "peak over the usable memory"


def format_simulated(args: argparse.Namespace, runs: list, found: dict) -> str:
    gpu = simulated_device(args.simulate)
    head = f"simulated {gpu.name}"
    if gpu.usable_bytes is not None:
        head += (f": {gpu.memory_bytes / GIB:.1f} GiB, usable {gpu.usable_bytes / GIB:.1f} GiB after a "
                 f"{RESERVE_BYTES / GIB:.0f} GiB reserve (CUDA context, workspaces, fragmentation; ~1.1 GiB of it measured on an H100)")
    lines = [head, "allocated bytes of one forward + backward (weights and grads included, no optimizer state)"]
    if any(run.get("sequence_parallel", 1) > 1 for run in runs):
        lines.append("with --sequence_parallel N: one rank of N GPUs (its shard, the exchange buffers, the gradients' "
                     "sum), lengths the whole sequence's")
    width = max([15] + [len(layout_name(r["side"], r.get("sequence_parallel", 1), r.get("sp_mode"))) for r in runs])
    for run in sorted(runs, key=lambda r: (r["seq_len"], r.get("sequence_parallel", 1), r["side"])):
        name = layout_name(run["side"], run.get("sequence_parallel", 1), run.get("sp_mode"))
        lines.append(f"  {name:{width}s} {run['seq_len']:>8d}  {_row_line(run)}")
    for name, f in found.items():
        over = f" ({f['first_over']} does not)" if f["first_over"] else ""
        lines.append(f"find_max {name}: longest that fits {f['max_context_tokens']} tokens{over}, {f['reason']}")
    return "\n".join(lines)


CSV_FIELDS = ("device", "model", "side", "seq_len", "sequence_parallel", "sp_mode", "tokens_per_rank", "bits", "lora_r", "layers", "depth", "extrapolated", "ok",
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
