"""Benchmark harness: training-step memory and speed, stock transformers vs the BPT patch.

    python -m bpt.bench --model llama-ref --seq_lens 4096 8192 16384
    python -m bpt.bench --model llama-3-8b --dtype bf16 --seq_lens 8192 16384 --find_max --max_len 524288
    python -m bpt.bench --model path/to/config.json --sides patched --lora --output bench_results/x.json
    python -m bpt.bench --sequence_parallel 1 2 4 --sp_mode ring ulysses --lora --seq_lens 8192 32768
    python -m bpt.bench --sequence_parallel 1 2 --tensor_parallel 1 2 --lora --seq_lens 16384
    python -m bpt.bench --simulate h100-80gb --model llama-3.1-8b --bits 4 --lora --layers 2 --find_max
    python -m bpt.bench --simulate h100-80gb --model llama-3.1-8b --bits 4 --lora --layers 2 --sides patched+offload \
        --sequence_parallel 8 --sp_mode ring ulysses --seq_lens 8388608     (one rank of 8 GPUs, simulated)
    python -m bpt.bench --gpu_check --output gpu_check/          (on a GPU; --simulate h100-80gb: the dry run)

- `build_parser`, `validate`: the flags, and every input checked before any work (errors exit with status 2)
- `run_spec`, `sweep`: one worker spec per (side, seq_len), all lengths, then --find_max doubling
- `simulated_sweep` (bpt.bench.simulated_sweep): with --simulate, rows of simulated steps (one rank's, with
  --sequence_parallel N) and --find_max by bisection
- `sp_sweep`: with --sequence_parallel, one process group per size N (x --tensor_parallel T) running every
  (length, mode)
- `main`: probe, sweep, summary, output files; or the GPU check (bpt.bench.gpu_check); or, with `--worker`, the
  worker process itself
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from bpt.bench import gpu_check
from bpt.bench.models import PRESETS, SIDES, resolve_model_config
from bpt.bench.report import (environment, format_report, format_sp_report, summarize, summarize_sp,
                              write_outputs)
from bpt.bench.sequence_parallel import SP_MODES, combine
from bpt.bench.simulated_sweep import format_simulated, simulated_report, simulated_sweep, validate_simulated
from bpt.bench.workers import run_ranks, run_worker, worker_main
from bpt.config import BPTConfig
from bpt.gpusim.gpus import DEVICES

DEFAULT_OUTPUT_DIR = "bench_results"  # without --output: the results go here, in the current directory


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Ends every flag's help with its default: "(default: X)" is appended unless the text says "default:" itself."""

    def _get_help_string(self, action):
        if "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _DeprecatedAlias(argparse.Action):
    """An old spelling of a flag, hidden from --help: still sets the flag's value (through `mapping` when given),
    with a warning naming the new spelling."""

    def __init__(self, option_strings, dest, new_flag: str, mapping: dict | None = None, **kwargs):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new_flag, self.mapping = new_flag, mapping

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated; use {self.new_flag}", file=sys.stderr)
        setattr(namespace, self.dest, values if self.mapping is None else self.mapping[values])


def build_parser() -> argparse.ArgumentParser:
    """The flags; names shared with `python -m train.qlora` (--torch_threads, --bpt_compile, block sizes) mean the
    same there."""
    defaults = BPTConfig()
    p = argparse.ArgumentParser(prog="python -m bpt.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter)
    p.add_argument("--model", default=None, help=f"preset ({', '.join(PRESETS)}) or a config json path (default: "
                   f"llama-ref; {gpu_check.MODEL} with --gpu_check)")
    p.add_argument("--seq_lens", type=int, nargs="+", default=[4096, 8192, 16384], help="tokens per sequence")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=["stock", "patched"],
                   help="stock transformers, BPT, and/or BPT with the layer checkpoints in host memory")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights and compute")
    p.add_argument("--batch_size", type=int, default=1, help="sequences per step")
    p.add_argument("--gradient_checkpointing", dest="gradient_checkpointing", action="store_true", default=True,
                   help="checkpoint every decoder layer, on both sides")
    p.add_argument("--no_gradient_checkpointing", dest="gradient_checkpointing", action="store_false",
                   help="turn --gradient_checkpointing off (default: on)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per run, after 1 warm-up step")
    for name, what in (("q_block", "query block size of blockwise attention"),
                       ("kv_block", "key/value block size of blockwise attention"),
                       ("mlp_chunk", "tokens per chunk of the chunked MLP"),
                       ("loss_chunk", "tokens per chunk of the chunked LM head + loss"),
                       ("norm_chunk", "tokens per chunk of a norm's backward")):
        default = getattr(defaults, name)
        p.add_argument(f"--{name}", type=int, default=default, help=f"{what} (default: {default}, "
                       "bpt.config.BPTConfig's)")
    p.add_argument("--chunk_budget", type=int, default=None,
                   help="bytes a chunk (MLP, norm, loss) may hold, taking more tokens than the sizes above where it "
                   "can (default on CUDA: up to 1/8 of the device, a quarter of what is free beyond 1/4; 0 on CPU; "
                   "0: the sizes exactly)")
    p.add_argument("--checkpoint_stride", type=int, default=1,
                   help="the patched side keeps one layer checkpoint in this many and remakes the others in backward "
                   "(default 1: every one; patched+offload keeps none on the device)")
    p.add_argument("--bpt_compile", dest="bpt_compile", action="store_true", default=None,
                   help="torch.compile the per-block functions of the patch (default: only on CUDA)")
    p.add_argument("--no_bpt_compile", dest="bpt_compile", action="store_false",
                   help="turn --bpt_compile off: run them eagerly, also on CUDA (default: compiled only on CUDA)")
    p.add_argument("--attention_once", dest="attention_once", action="store_true", default=None,
                   help="with checkpointing, keep each layer's fused attention output for its recompute (default: "
                   "where a forward's kept outputs fit a quarter of the device; bpt.attention_once)")
    p.add_argument("--no_attention_once", dest="attention_once", action="store_false",
                   help="recompute the attention forward in each layer's backward, as stock's checkpointing does")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters only (peft, all linear layers)")
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank (with --lora)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the runs execute (default: cuda when available, else cpu)")
    p.add_argument("--torch_threads", type=int, default=None,
                   help="CPU threads per worker process for torch ops (torch.set_num_threads); default: torch's own")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")
    p.add_argument("--find_max", action="store_true",
                   help="after the sweep, double the length per side until a run fails or --max_len")
    p.add_argument("--max_len", type=int, default=None,
                   help="cap of --find_max (required with it; default: none)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per run before it is killed and failed (with --sequence_parallel: per group of N "
                        "processes, all its lengths and modes); default: no limit")
    p.add_argument("--malloc", choices=("mmap", "default"), default="mmap",
                   help="glibc malloc setting of CPU workers (see worker_env); 'default' only to compare")
    p.add_argument("--output", type=Path, default=None,
                   help="result JSON (a CSV is written next to it); default: "
                        f"{DEFAULT_OUTPUT_DIR}/<model>-<time>.json in the current directory")
    p.add_argument("--sequence_parallel", type=int, nargs="+", default=None, metavar="N",
                   help="sequence-parallel mode: per N, N processes (gloo on CPU, NCCL on CUDA: one GPU per rank) "
                        "each hold a shard of every sequence; patched side only; with --simulate: one rank of N "
                        "simulated GPUs over a fake process group, its length the whole sequence's (default: off)")
    p.add_argument("--sp_mode", nargs="+", choices=SP_MODES, default=["ring"], help="with --sequence_parallel")
    p.add_argument("--tensor_parallel", type=int, nargs="+", default=[1], metavar="T",
                   help="with --sequence_parallel: per T, every size N also runs on N x T processes, each layer split "
                        "T ways (patches.tensor_parallel, train.qlora's layout: tp innermost)")
    p.add_argument("--threads", dest="torch_threads", type=int, action=_DeprecatedAlias, new_flag="--torch_threads")
    p.add_argument("--compile", dest="bpt_compile", choices=("auto", "on", "off"), action=_DeprecatedAlias,
                   new_flag="--bpt_compile / --no_bpt_compile", mapping={"auto": None, "on": True, "off": False})
    sim = p.add_argument_group("simulated GPU (allocated bytes of one step on fake CUDA tensors; see bpt.gpusim)")
    sim.add_argument("--simulate", choices=list(DEVICES), default=None,
                     help="run every step on this simulated device instead of measuring this machine; 'cpu' = fake "
                          "CPU tensors, to hold against a real CPU run (default: off)")
    sim.add_argument("--bits", type=int, choices=(4, 16, 32), default=16,
                     help="with --simulate on a GPU: base weights as bitsandbytes NF4 (4; the other weights bf16, "
                          "as patches.kbit.prepare_kbit_model leaves them), bf16 (16) or fp32 (32); bf16 autocast")
    sim.add_argument("--lora_targets", type=lambda s: [t for t in s.split(",") if t], default=None,
                     help="with --lora: comma-separated module names to adapt (default: every linear layer)")
    sim.add_argument("--lora_dropout", type=float, default=0.0, help="with --lora and --simulate")
    sim.add_argument("--layers", type=int, default=None,
                     help="with --simulate: simulate L and L+1 decoder layers and extrapolate the (linear) peak to "
                          "the model's depth, reported as extrapolated (default: the full depth)")
    sim.add_argument("--top", type=int, default=10, help="with --simulate: largest live tensors listed at the peak")
    sim.add_argument("--gpus_per_machine", type=int, default=None,
                     help="with --simulate and --sequence_parallel: GPUs of a machine (NVLink between them, the "
                          "network beyond; default: the card's machine in bpt/gpusim/gpus.py MACHINES, 8)")
    sim.add_argument("--host_memory_per_machine", type=float, default=None, metavar="GIB",
                     help="with --simulate: host memory of a machine in GiB, shared by its processes' offloaded "
                          "tensors; a layout over it does not fit (default: the card's machine, 2048 for an H100's)")
    sim.add_argument("--calibrate", action="store_true",
                     help="with --simulate on a real GPU: also run each step for real and report "
                          "torch.cuda.max_memory_allocated beside the prediction")
    gpu_check.add_arguments(p)
    p.add_argument("--worker", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    return p


def validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Check every input before any work; returns the resolved model config. Errors exit with status 2."""
    if args.gpu_check:
        return validate_gpu_check(p, args)
    args.model = args.model or "llama-ref"
    for name in ("batch_size", "steps", "lora_r"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    bad = [n for n in args.seq_lens if n <= 0]
    if bad:
        p.error(f"--seq_lens must be positive token counts, got {bad}")
    args.seq_lens = sorted(set(args.seq_lens))
    args.sides = [s for s in SIDES if s in args.sides]
    if args.torch_threads is not None and args.torch_threads <= 0:
        p.error(f"--torch_threads must be positive, got {args.torch_threads}")
    if args.simulate is not None:
        validate_simulated(p, args)
    elif any((args.lora_targets, args.lora_dropout, args.layers, args.calibrate, args.bits != 16)):
        p.error("--bits, --lora_targets, --lora_dropout, --layers and --calibrate go with --simulate DEVICE")
    if args.find_max and args.max_len is None:
        p.error("--find_max needs --max_len (the cap for doubling the length)")
    if args.max_len is not None and args.max_len <= 0:
        p.error(f"--max_len must be positive, got {args.max_len}")
    args.bpt = patch_config(p, args)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available to torch here")
    if args.device == "cpu" and args.simulate is None and not os.path.exists("/proc/self/clear_refs"):
        p.error("CPU memory measurement needs Linux /proc/self/clear_refs; run on Linux or with --device cuda")
    if args.lora:
        try:
            importlib.metadata.version("peft")
        except importlib.metadata.PackageNotFoundError:
            p.error("--lora needs peft installed (pip install peft)")
    if "patched" in args.sides:
        try:
            from patches import apply_bpt_patch  # noqa: F401
        except ImportError as error:
            p.error(f"the patched side needs patches.apply_bpt_patch ({error}); run with --sides stock")
    if args.sequence_parallel is not None and args.simulate is None:
        validate_sp(p, args)
    elif args.tensor_parallel != [1]:
        p.error("--tensor_parallel needs --sequence_parallel (1 for tensor parallelism alone)")
    longest = max(args.seq_lens + ([args.max_len] if args.find_max else []))
    try:
        config = resolve_model_config(args.model, longest)
    except ValueError as error:
        p.error(str(error))
    if args.sequence_parallel is not None:
        validate_sp_model(p, args, config)
    return config


def validate_sp_model(p: argparse.ArgumentParser, args: argparse.Namespace, config: dict) -> None:
    """What the model's heads and MLP allow of --sp_mode ulysses and --tensor_parallel (errors exit with status 2)."""
    from transformers import AutoConfig

    model_config = AutoConfig.for_model(**config)
    for tp in (t for t in args.tensor_parallel if t > 1):
        from patches.tensor_parallel import check_tensor_parallel

        try:
            check_tensor_parallel(model_config, tp)
        except ValueError as error:
            p.error(f"--tensor_parallel {tp}: {error}")
    if "ulysses" in args.sp_mode:
        heads = model_config.num_attention_heads
        bad = [(n, t) for n in args.sequence_parallel for t in args.tensor_parallel if (heads // t) % n]
        if bad:
            p.error(f"--sp_mode ulysses splits each rank's query heads (the {heads} of --model {args.model} / T) over "
                    f"N ranks, so every --sequence_parallel size must divide them; got (N, T) = {bad} (use --sp_mode "
                    "ring for them)")


def patch_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> BPTConfig:
    """The patch's settings from the block-size and compile flags (an impossible value exits with status 2)."""
    try:
        return BPTConfig(q_block=args.q_block, kv_block=args.kv_block, mlp_chunk=args.mlp_chunk,
                         loss_chunk=args.loss_chunk, norm_chunk=args.norm_chunk, chunk_budget=args.chunk_budget,
                         compile=args.bpt_compile, checkpoint_stride=args.checkpoint_stride,
                         attention_once=args.attention_once)
    except ValueError as error:
        p.error(str(error))


def validate_gpu_check(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """--gpu_check: its own cells; of the other flags only the patch's block sizes and compile setting apply."""
    fixed = [f"--{name}" for name in ("sequence_parallel", "find_max", "calibrate", "lora_targets", "layers")
             if getattr(args, name)] + (["--sides"] if args.sides != ["stock", "patched"] else [])
    if fixed:
        p.error(f"--gpu_check runs fixed cells (bpt.bench.gpu_check); drop {', '.join(fixed)}")
    args.bpt = patch_config(p, args)
    return gpu_check.validate(p, args)


def validate_sp(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The sequence-parallel flags (errors exit with status 2)."""
    bad = [n for n in args.sequence_parallel if n < 1]
    if bad:
        p.error(f"--sequence_parallel sizes must be >= 1 (processes per sequence), got {bad}")
    args.sequence_parallel = sorted(set(args.sequence_parallel))
    args.sp_mode = [m for m in SP_MODES if m in args.sp_mode]
    if args.find_max:
        p.error("--find_max does not combine with --sequence_parallel; give the lengths with --seq_lens")
    if "patched" not in args.sides:
        p.error("--sequence_parallel runs the patched model only (sequence parallelism is part of the patch); "
                "drop --sides stock")
    bad = [t for t in args.tensor_parallel if t < 1]
    if bad:
        p.error(f"--tensor_parallel sizes must be >= 1 (processes per layer), got {bad}")
    args.tensor_parallel = sorted(set(args.tensor_parallel))
    if args.tensor_parallel != [1] and not args.lora:
        p.error("--tensor_parallel splits LoRA models as train.qlora does: add --lora")
    most = max(args.sequence_parallel) * max(args.tensor_parallel)
    if args.device == "cuda" and most > torch.cuda.device_count():
        p.error(f"--sequence_parallel {max(args.sequence_parallel)} x --tensor_parallel {max(args.tensor_parallel)} "
                f"on CUDA needs one GPU per rank; {torch.cuda.device_count()} visible")


def run_spec(args: argparse.Namespace, model_config: dict, side: str, seq_len: int) -> dict:
    """The worker spec of one (side, seq_len) training run."""
    return {
        "task": "train", "side": side, "seq_len": seq_len, "model_config": model_config,
        "batch_size": args.batch_size, "dtype": args.dtype, "device": args.device,
        "gradient_checkpointing": args.gradient_checkpointing, "lora": args.lora, "lora_r": args.lora_r,
        "bpt": asdict(args.bpt), "steps": args.steps, "seed": args.seed, "threads": args.torch_threads,
        "malloc": args.malloc,
    }


def sweep(args: argparse.Namespace, model_config: dict, runner: Callable[[dict], dict]) -> tuple[list, dict]:
    """All (side, seq_len) runs, then --find_max doubling. Returns (runs, find_max summary)."""
    runs = []

    def one(side, seq_len, phase):
        print(f"[{side:7s} {seq_len:>7d}] running ...", flush=True)
        result = runner(run_spec(args, model_config, side, seq_len))
        run = {"side": side, "seq_len": seq_len, "phase": phase, **result}
        runs.append(run)
        if run["ok"]:
            print(f"[{side:7s} {seq_len:>7d}] {run['step_mib']:9.1f} MiB/step  {run['median_s']:8.3f} s/step  "
                  f"{run['tokens_per_s']:9.0f} tok/s  loss {run['loss']:.4f}", flush=True)
        else:
            print(f"[{side:7s} {seq_len:>7d}] FAILED: {run['error']}", flush=True)
        return run

    for seq_len in args.seq_lens:
        for side in args.sides:
            one(side, seq_len, "sweep")
    found = {}
    if args.find_max:
        for side in args.sides:
            ok = [r["seq_len"] for r in runs if r["side"] == side and r["ok"]]
            failed = [r for r in runs if r["side"] == side and not r["ok"]]
            first_failed = min(failed, key=lambda r: r["seq_len"]) if failed else None
            seq_len = max(args.seq_lens) * 2
            while first_failed is None and seq_len <= args.max_len:
                run = one(side, seq_len, "find_max")
                if run["ok"]:
                    ok.append(seq_len)
                else:
                    first_failed = run
                seq_len *= 2
            found[side] = {
                "longest_ok": max(ok) if ok else None,
                "first_failed": first_failed["seq_len"] if first_failed else None,
                "reason": first_failed["error"] if first_failed else f"reached --max_len {args.max_len}",
            }
    return runs, found


def sp_sweep(args: argparse.Namespace, model_config: dict, group_runner: Callable[[dict, int], dict],
             after_group: Callable[[list], None] = lambda runs: None) -> list:
    """Per size N (and T of --tensor_parallel) one group of N x T processes running every (length, mode); -> one run
    per (mode, T, N, length).
    after_group(runs so far) is called after each group (main writes the output files there: a long sweep that
    is killed keeps the groups it finished)."""
    spec = run_spec(args, model_config, "patched", max(args.seq_lens)) | {
        "task": "sp_train", "seq_lens": args.seq_lens, "sp_modes": args.sp_mode,
        "comm_timeout": args.timeout or 1800}  # a rank waiting on a lost peer errors out after this
    runs = []
    for tp in args.tensor_parallel:
        for sp in args.sequence_parallel:
            name, world = f"sp {sp}" + (f" x tp {tp}" if tp > 1 else ""), sp * tp
            print(f"[{name}] {world} process(es), lengths {args.seq_lens}, modes {args.sp_mode} ...", flush=True)
            result = group_runner(spec | {"tensor_parallel": tp}, world)
            per_rank = [r["runs"] for r in result["ranks"]]  # [rank][run]; partial when the group failed
            done = min((len(r) for r in per_rank), default=0)
            for i in range(done):
                run = {"world": sp, **combine([runs_of_rank[i] for runs_of_rank in per_rank], args.batch_size)}
                runs.append(run)
                print(f"[{name} {run['mode']:7s} {run['seq_len']:>7d}] {run['step_mib']:9.1f} MiB/step (max rank)  "
                      f"{run['median_s']:8.3f} s/step  sent {run['sent_mib']:9.1f} MiB (theory "
                      f"{run['theory_mib']:.1f})  loss {run['loss']:.4f}", flush=True)
            todo = [(n, m) for n in args.seq_lens for m in args.sp_mode][done:]
            for seq_len, mode in todo:  # not reached: the group failed first
                runs.append({"world": sp, "tensor_parallel": tp, "mode": mode, "seq_len": seq_len, "ok": False,
                             "error": result["error"]})
                print(f"[{name} {mode:7s} {seq_len:>7d}] FAILED: {result['error']}", flush=True)
            after_group(runs)
    return runs


def sp_report(args: argparse.Namespace, model_config: dict, probe: dict, runs: list) -> dict:
    """The JSON report of the sequence-parallel mode (the runs so far)."""
    env = environment(args, model_config, runs, probe) | {
        "sequence_parallel": args.sequence_parallel, "sp_mode": args.sp_mode, "tensor_parallel": args.tensor_parallel,
        "backend": "nccl" if args.device == "cuda" else "gloo"}
    summary = summarize_sp(runs, args.seq_lens, args.sequence_parallel, args.sp_mode, args.tensor_parallel)
    return {"environment": env, "summary": summary, "find_max": {}, "runs": runs}


def output_path(args: argparse.Namespace, name: str) -> Path:
    """--output, else DEFAULT_OUTPUT_DIR/<name>.json in the current directory, which is said before the sweep."""
    if args.output is not None:
        return args.output
    output = Path(DEFAULT_OUTPUT_DIR) / f"{name}.json"
    print(f"results will be written to {output.resolve()} (without --output: {DEFAULT_OUTPUT_DIR}/ in the current "
          "directory)", flush=True)
    return output


def main(argv: list[str] | None = None, runner: Callable[[dict], dict] | None = None,
         group_runner: Callable[[dict, int], dict] | None = None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    if args.worker:
        sys.exit(worker_main(args.worker))
    model_config = validate(p, args)
    if args.gpu_check:
        return gpu_check.run(args, model_config, runner or run_worker)
    runner = runner or (lambda spec: run_worker(spec, args.timeout))
    model_name = args.model if args.model in PRESETS else Path(args.model).stem
    stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
    kind = f"-{args.simulate}" if args.simulate is not None else "-sp" if args.sequence_parallel is not None else ""
    output = output_path(args, f"{model_name}{kind}-{stamp}")  # said before the sweep
    if args.simulate is not None:
        if args.simulate == "cpu":  # here, where its line is seen, not in the first worker (which finds it cached)
            from bpt.gpusim.clock import cpu_rates

            cpu_rates(threads=args.torch_threads)
        runs, found = simulated_sweep(args, model_config, runner)
        report = simulated_report(args, environment(args, model_config, runs, None), runs, found)
        csv_path = write_outputs(output, report)
        print()
        print(format_simulated(args, runs, found))
        print(f"\nwrote {output.resolve()} and {csv_path.name} beside it")
        return report

    probe = runner({"task": "probe", "device": args.device, "malloc": args.malloc, "threads": args.torch_threads})
    if probe.get("ok"):
        off = abs(probe["measured_mib"] - probe["expected_mib"]) / probe["expected_mib"]
        print(f"memory probe: a step allocating {probe['expected_mib']:.0f} MiB measured "
              f"{probe['measured_mib']:.1f} MiB" + ("  WARNING: memory figures are unreliable" if off > 0.05 else ""))
    else:
        print(f"memory probe failed: {probe['error']}")

    if args.sequence_parallel is None:
        runs, found = sweep(args, model_config, runner)
        report = {"environment": environment(args, model_config, runs, probe),
                  "summary": summarize(runs, args.seq_lens), "find_max": found, "runs": runs}
        table = format_report(report["summary"], found)
        csv_path = write_outputs(output, report)
    else:
        group_runner = group_runner or (lambda spec, world: run_ranks(spec, world, args.timeout))
        runs = sp_sweep(args, model_config, group_runner,
                        lambda runs: write_outputs(output, sp_report(args, model_config, probe, runs)))
        report = sp_report(args, model_config, probe, runs)
        table = format_sp_report(report["summary"])
        csv_path = write_outputs(output, report)
    print()
    print(table)
    print(f"\nwrote {output.resolve()} and {csv_path.name} beside it")
    return report
