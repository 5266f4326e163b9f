"""Benchmark harness: training-step memory and speed, stock transformers vs the BPT patch.

    python -m bpt.bench --model llama-ref --seq_lens 4096 8192 16384
    python -m bpt.bench --model llama-3-8b --dtype bf16 --seq_lens 8192 16384 --find_max --max_len 524288
    python -m bpt.bench --model path/to/config.json --sides patched --lora --output bench_results/x.json

Every (side, seq_len) runs in a fresh subprocess (`--worker SPEC.json`), so one run's memory never
pollutes another and a run that dies (OOM, killed) is recorded as failed while the sweep goes on.
One training step = forward with labels + backward, no optimizer; grads are set to None before each
step, so "memory a training step adds" includes the gradients it allocates (the same on both sides).

Memory a step adds: CUDA = max_memory_allocated during the step - memory_allocated before it.
CPU = peak RSS during the step (VmHWM, reset right before the step by writing "5" to
/proc/self/clear_refs) - RSS before it (VmRSS). For RSS to track live tensors, the worker runs with
a fixed glibc mmap threshold (see `worker_env`); a probe that allocates a known 1 GiB inside a step
checks the measurement on every sweep.

`bpt` must stay importable without transformers: transformers (and peft, patches) are imported only
inside the functions that build models or validate model configs.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import ctypes.util
import datetime
import functools
import gc
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from bpt.config import BPTConfig

SIDES = ("stock", "patched")
MIB = 1024 * 1024

# Model shapes (random weights from config are fine for memory and speed). max_position_embeddings is
# set per sweep to cover its longest length.
PRESETS: dict[str, dict] = {
    # For tests: builds and steps in well under a second.
    "tiny": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=176, vocab_size=1024),
    # The CPU reference model of the acceptance targets.
    "llama-ref": dict(model_type="llama", hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=1408, vocab_size=32000),
    # Full-size shapes, for GPU runs.
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                         tie_word_embeddings=True),
}

# Acceptance targets of the project, reported (never asserted): name -> (row field at seq_len, limit).
# growth_ratio is patched / stock MiB per 1K tokens between the smallest and largest length.
TARGETS = {
    "mem_ratio_at_8192": (("mem_ratio", 8192), 0.15),    # patched step MiB / stock step MiB
    "growth_ratio": (None, 1 / 20),
    "time_ratio_at_8192": (("time_ratio", 8192), 1.0),   # patched step time / stock step time
}

PROBE_MIB = 1024        # the known allocation of the memory probe
PROBE_PIECE_MIB = 16    # mid-size, below glibc's 32 MiB dynamic mmap-threshold ceiling (see worker_env)


# ----------------------------------------------------------------------------------------------
# Model configs (no transformers import at module level)
# ----------------------------------------------------------------------------------------------

def resolve_model_config(spec: str, longest: int) -> dict:
    """Preset name or config-json path -> config dict (with model_type) able to position `longest` tokens.

    Raises ValueError with what to do on an unknown preset, a missing/invalid file or an unknown family.
    """
    if spec in PRESETS:
        config = dict(PRESETS[spec])
    elif os.path.isfile(spec):
        try:
            with open(spec) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"--model {spec}: cannot read it as a transformers config json ({error})") from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError(f"--model {spec}: a transformers config json needs a 'model_type' key")
        config.pop("quantization_config", None)  # random weights: quantization is --lora's business, not the config's
    else:
        raise ValueError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing config json file")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config["model_type"] not in CONFIG_MAPPING:
        raise ValueError(f"--model {spec}: model_type {config['model_type']!r} is unknown to this transformers version")
    # Random weights with computed (rotary) or freshly initialized positions: extending the range
    # only lets the model accept the lengths we ask for; it does not change the per-token cost.
    config["max_position_embeddings"] = max(int(config.get("max_position_embeddings") or 0), longest)
    config["use_cache"] = False
    return config


def build_model(spec: dict):
    """Stock model from the spec's config (seeded, so both sides get the same weights), ready to train."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**spec["model_config"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    torch.manual_seed(spec["seed"])
    with torch.device(spec["device"]):  # build in place: an 8B model is never materialized on the host
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.train()
    if spec["gradient_checkpointing"]:
        # transformers renamed it (the old name warns); accept both for transformers >= 5.0
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec["lora"]:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], lora_dropout=0.0,
                          target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)  # freezes the base: only adapters train, as in QLoRA
    handle = None
    if spec["side"] == "patched":  # same order as train/model.py: LoRA first, then the patch
        from patches import apply_bpt_patch

        handle = apply_bpt_patch(model, **spec["bpt"])
    return model, handle


# ----------------------------------------------------------------------------------------------
# Measuring one step
# ----------------------------------------------------------------------------------------------

def worker_env(malloc: str) -> dict:
    """Environment for a worker process.

    glibc malloc serves large blocks with mmap (returned to the OS on free) but by default raises its
    mmap threshold to the size of any mmapped block that is freed, up to 32 MiB. After the first few
    frees, every tensor below 32 MiB (MLP chunks, attention blocks, per-layer activations) comes from
    the brk/arena heap, and freed heap memory stays resident. That both inflates "RSS before" (so a
    step that reuses it shows no growth: peaks hidden) and leaves fragmented free memory resident
    during the step (peaks inflated by what is free, not live). Setting the thresholds explicitly
    turns the dynamic adjustment off: every block >= 128 KiB is mmapped and unmapped on free, so RSS
    follows live tensors; the heap only holds small objects. Measured on llama-ref (stock, 2048 and
    4096 tokens): glibc defaults gave 1130-1148 and 2293-2322 MiB/step, varying step to step; fixed
    thresholds gave 1029.2-1029.3 and 2058.3-2058.5 (linear in length, as the tensors are). The price
    is a page fault + zeroing per fresh large block, paid inside the step on both sides; it was within
    the timing noise there. malloc_trim before each reading (`_release_free_heap`) covers the rest.
    """
    env = dict(os.environ)
    if malloc == "mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
        env["MALLOC_TRIM_THRESHOLD_"] = str(128 * 1024)  # give back freed heap tops too
    repo_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
    return env


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


# ----------------------------------------------------------------------------------------------
# Worker (runs in its own process)
# ----------------------------------------------------------------------------------------------

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
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach()

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


def _oom_message(error: BaseException) -> str | None:
    text = str(error)
    if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text:
        return "out of memory: " + text.strip().splitlines()[0][:300]
    return None


def worker_main(spec_path: str) -> int:
    """Entry of `--worker`: run the spec, write the result json where the spec says; 0 on success."""
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    try:
        result = run_probe(spec) if spec["task"] == "probe" else run_training(spec)
    except Exception as error:  # recorded as a failed run; the parent's sweep goes on
        lines = str(error).strip().splitlines() or [""]
        result = {"ok": False, "error": _oom_message(error) or f"{type(error).__name__}: {lines[0][:300]}",
                  "traceback": traceback.format_exc()[-3000:]}
    with open(spec["result_path"], "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 1


# ----------------------------------------------------------------------------------------------
# Running workers from the sweep
# ----------------------------------------------------------------------------------------------

def describe_exit(returncode: int, stderr: str) -> str:
    """Why a worker died without writing its result."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (most likely the kernel OOM killer: out of memory)" if -returncode == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    last = [line for line in stderr.strip().splitlines() if line.strip()]
    return f"exit status {returncode}" + (f": {last[-1][:300]}" if last else "")


def run_worker(spec: dict, timeout: float | None = None) -> dict:
    """Run one spec in a fresh `python -m bpt.bench --worker` process; a dead worker is a failed result."""
    with tempfile.TemporaryDirectory(prefix="bpt-bench-") as tmp:
        spec = {**spec, "result_path": os.path.join(tmp, "result.json")}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        command = [sys.executable, "-m", "bpt.bench", "--worker", spec_path]
        try:
            proc = subprocess.run(command, env=worker_env(spec["malloc"]), capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:g} s"}
        if os.path.exists(spec["result_path"]):
            with open(spec["result_path"]) as f:
                return json.load(f)
        return {"ok": False, "error": describe_exit(proc.returncode, proc.stderr)}


def run_spec(args: argparse.Namespace, model_config: dict, side: str, seq_len: int) -> dict:
    """The worker spec of one (side, seq_len) training run."""
    return {
        "task": "train", "side": side, "seq_len": seq_len, "model_config": model_config,
        "batch_size": args.batch_size, "dtype": args.dtype, "device": args.device,
        "gradient_checkpointing": args.gradient_checkpointing, "lora": args.lora, "lora_r": args.lora_r,
        "bpt": asdict(args.bpt), "steps": args.steps, "seed": args.seed, "threads": args.threads,
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


# ----------------------------------------------------------------------------------------------
# Summary: table rows, growth, targets
# ----------------------------------------------------------------------------------------------

def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def summarize(runs: list[dict], seq_lens: list[int]) -> dict:
    """Per-length rows (stock vs patched), memory growth per side and the acceptance targets."""
    by_key = {(r["side"], r["seq_len"]): r for r in runs if r.get("phase", "sweep") == "sweep"}

    def value(side, seq_len, field):
        run = by_key.get((side, seq_len))
        return run[field] if run and run["ok"] else None

    rows = []
    for seq_len in seq_lens:
        stock_s, patched_s = value("stock", seq_len, "median_s"), value("patched", seq_len, "median_s")
        row = {
            "seq_len": seq_len,
            "stock_step_mib": value("stock", seq_len, "step_mib"),
            "patched_step_mib": value("patched", seq_len, "step_mib"),
            "stock_tok_s": value("stock", seq_len, "tokens_per_s"),
            "patched_tok_s": value("patched", seq_len, "tokens_per_s"),
            "stock_step_s": stock_s,
            "patched_step_s": patched_s,
        }
        row["mem_ratio"] = _ratio(row["patched_step_mib"], row["stock_step_mib"])   # patched / stock
        row["time_ratio"] = _ratio(patched_s, stock_s)                              # patched / stock
        row["speedup"] = _ratio(stock_s, patched_s)                                 # stock / patched
        for side in SIDES:
            run = by_key.get((side, seq_len))
            row[f"{side}_status"] = "n/a" if run is None else ("ok" if run["ok"] else "failed: " + run["error"])
        rows.append(row)

    growth = {}
    small, large = min(seq_lens), max(seq_lens)
    for side in SIDES:
        lo, hi = value(side, small, "step_mib"), value(side, large, "step_mib")
        if lo is not None and hi is not None and large > small:
            growth[side] = (hi - lo) / ((large - small) / 1024)  # MiB per 1K tokens
    growth = {"from_seq_len": small, "to_seq_len": large, "mib_per_1k_tokens": growth,
              "ratio": _ratio(growth.get("patched"), growth.get("stock"))}

    row_at = {row["seq_len"]: row for row in rows}
    targets = {}
    for name, (where, limit) in TARGETS.items():
        got = growth["ratio"] if where is None else row_at.get(where[1], {}).get(where[0])
        targets[name] = {"limit": limit, "value": got, "met": None if got is None else got <= limit}
    return {"rows": rows, "growth": growth, "targets": targets}


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def format_report(summary: dict, find_max: dict) -> str:
    cols = [("seq_len", "seq_len", "d"), ("stock MiB", "stock_step_mib", ".1f"),
            ("patched MiB", "patched_step_mib", ".1f"), ("mem p/s", "mem_ratio", ".3f"),
            ("stock tok/s", "stock_tok_s", ".0f"), ("patched tok/s", "patched_tok_s", ".0f"),
            ("time p/s", "time_ratio", ".3f"), ("speedup s/p", "speedup", ".2f")]
    widths = [max(len(title), 11) for title, _, _ in cols]
    lines = ["  ".join(title.rjust(w) for (title, _, _), w in zip(cols, widths))]
    for row in summary["rows"]:
        lines.append("  ".join(_fmt(row[key], spec).rjust(w) for (_, key, spec), w in zip(cols, widths)))
    for row in summary["rows"]:
        for side in SIDES:
            if row[f"{side}_status"].startswith("failed"):
                lines.append(f"  {side} @ {row['seq_len']}: {row[f'{side}_status']}")
    g = summary["growth"]
    per = g["mib_per_1k_tokens"]
    if g["from_seq_len"] == g["to_seq_len"]:
        lines.append("memory growth: needs at least two lengths")
    else:
        lines.append(f"memory growth {g['from_seq_len']} -> {g['to_seq_len']} (MiB per 1K tokens): "
                     f"stock {_fmt(per.get('stock'), '.2f')}, patched {_fmt(per.get('patched'), '.2f')}, "
                     f"patched/stock {_fmt(g['ratio'], '.4f')}")
    for name, t in summary["targets"].items():
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
        lines.append(f"target {name} <= {t['limit']:.3g}: {_fmt(t['value'], '.4f')} ({verdict})")
    for side, f in find_max.items():
        lines.append(f"find_max {side}: longest ok {f['longest_ok']}, first failed {f['first_failed']} ({f['reason']})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Output files
# ----------------------------------------------------------------------------------------------

def environment(args: argparse.Namespace, model_config: dict, runs: list[dict], probe: dict | None) -> dict:
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    if args.device == "cuda":
        device_name = torch.cuda.get_device_name()
    else:
        device_name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                device_name = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), device_name)
        except OSError:
            pass
    threads = next((r["threads"] for r in runs if r.get("ok")), None)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "transformers": version("transformers"), "peft": version("peft"),
        "device": args.device, "device_name": device_name, "cpu_count": os.cpu_count(), "threads": threads,
        "model": args.model, "model_config": model_config, "dtype": args.dtype, "batch_size": args.batch_size,
        "gradient_checkpointing": args.gradient_checkpointing, "lora": args.lora,
        "lora_r": args.lora_r if args.lora else None, "bpt": asdict(args.bpt), "steps": args.steps,
        "warmup_steps": 1, "seed": args.seed, "malloc": args.malloc, "memory_probe": probe,
    }


CSV_ENV_FIELDS = ("date", "model", "device", "device_name", "dtype", "batch_size", "gradient_checkpointing",
                  "lora", "threads", "torch", "transformers", "malloc")


def write_outputs(path: Path, report: dict) -> Path:
    """JSON with everything, and a CSV next to it: one row per length, environment repeated per row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    csv_path = path.with_suffix(".csv")
    env = report["environment"]
    env_cols = {k: env[k] for k in CSV_ENV_FIELDS} | {k: v for k, v in env["bpt"].items()}
    with open(csv_path, "w", newline="") as f:
        rows = [env_cols | row for row in report["summary"]["rows"]]
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return csv_path


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    defaults = BPTConfig()
    p = argparse.ArgumentParser(prog="python -m bpt.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="llama-ref", help=f"preset ({', '.join(PRESETS)}) or a config json path")
    p.add_argument("--seq_lens", type=int, nargs="+", default=[4096, 8192, 16384], help="tokens per sequence")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES), help="stock transformers and/or BPT")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights and compute")
    p.add_argument("--batch_size", type=int, default=1, help="sequences per step")
    p.add_argument("--gradient_checkpointing", dest="gradient_checkpointing", action="store_true", default=True,
                   help="checkpoint every decoder layer, on both sides")
    p.add_argument("--no_gradient_checkpointing", dest="gradient_checkpointing", action="store_false")
    p.add_argument("--steps", type=int, default=3, help="measured steps per run, after 1 warm-up step")
    p.add_argument("--q_block", type=int, default=defaults.q_block)
    p.add_argument("--kv_block", type=int, default=defaults.kv_block)
    p.add_argument("--mlp_chunk", type=int, default=defaults.mlp_chunk)
    p.add_argument("--loss_chunk", type=int, default=defaults.loss_chunk)
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="torch.compile of the patch")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters only (peft, all linear layers)")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--threads", type=int, default=None, help="torch threads in the workers (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--find_max", action="store_true",
                   help="after the sweep, double the length per side until a run fails or --max_len")
    p.add_argument("--max_len", type=int, default=None, help="cap of --find_max (required with it)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run before it is killed and failed")
    p.add_argument("--malloc", choices=("mmap", "default"), default="mmap",
                   help="glibc malloc setting of CPU workers (see worker_env); 'default' only to compare")
    p.add_argument("--output", type=Path, default=None,
                   help="result JSON (a CSV is written next to it); default bench_results/<model>-<time>.json")
    p.add_argument("--worker", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    return p


def validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Check every input before any work; returns the resolved model config. Errors exit with status 2."""
    for name in ("batch_size", "steps", "lora_r"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    bad = [n for n in args.seq_lens if n <= 0]
    if bad:
        p.error(f"--seq_lens must be positive token counts, got {bad}")
    args.seq_lens = sorted(set(args.seq_lens))
    args.sides = [s for s in SIDES if s in args.sides]
    if args.threads is not None and args.threads <= 0:
        p.error(f"--threads must be positive, got {args.threads}")
    if args.find_max and args.max_len is None:
        p.error("--find_max needs --max_len (the cap for doubling the length)")
    if args.max_len is not None and args.max_len <= 0:
        p.error(f"--max_len must be positive, got {args.max_len}")
    try:
        args.bpt = BPTConfig(q_block=args.q_block, kv_block=args.kv_block, mlp_chunk=args.mlp_chunk,
                             loss_chunk=args.loss_chunk, compile={"auto": None, "on": True, "off": False}[args.compile])
    except ValueError as error:
        p.error(str(error))
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available to torch here")
    if args.device == "cpu" and not os.path.exists("/proc/self/clear_refs"):
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
    longest = max(args.seq_lens + ([args.max_len] if args.find_max else []))
    try:
        return resolve_model_config(args.model, longest)
    except ValueError as error:
        p.error(str(error))


def main(argv: list[str] | None = None, runner: Callable[[dict], dict] | None = None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    if args.worker:
        sys.exit(worker_main(args.worker))
    model_config = validate(p, args)
    runner = runner or (lambda spec: run_worker(spec, args.timeout))

    probe = runner({"task": "probe", "device": args.device, "malloc": args.malloc, "threads": args.threads})
    if probe.get("ok"):
        off = abs(probe["measured_mib"] - probe["expected_mib"]) / probe["expected_mib"]
        print(f"memory probe: a step allocating {probe['expected_mib']:.0f} MiB measured "
              f"{probe['measured_mib']:.1f} MiB" + ("  WARNING: memory figures are unreliable" if off > 0.05 else ""))
    else:
        print(f"memory probe failed: {probe['error']}")

    runs, found = sweep(args, model_config, runner)
    summary = summarize(runs, args.seq_lens)
    report = {"environment": environment(args, model_config, runs, probe), "summary": summary,
              "find_max": found, "runs": runs}
    model_name = args.model if args.model in PRESETS else Path(args.model).stem
    output = args.output or Path("bench_results") / (
        f"{model_name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    csv_path = write_outputs(output, report)
    print()
    print(format_report(summary, found))
    print(f"\nwrote {output} and {csv_path}")
    return report


if __name__ == "__main__":
    main()
