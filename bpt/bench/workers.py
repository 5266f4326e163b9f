"""One run per fresh process: a run's memory never pollutes another, and a run that dies is a failed result.

- `run_worker`: parent side; writes the spec json, runs `python -m bpt.bench --worker SPEC.json`, reads the result
- `worker_env`: the worker's environment (glibc malloc thresholds, PYTHONPATH to this checkout)
- `worker_main`: child side; runs the probe or training task of the spec, writes the result json
- `describe_exit`, `_oom_message`: why a run failed, in one line (killed, exit status, out of memory)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from bpt.bench.measure import run_probe, run_training


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
    the timing noise there. malloc_trim before each reading (`measure._release_free_heap`) covers the rest.
    """
    env = dict(os.environ)
    if malloc == "mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
        env["MALLOC_TRIM_THRESHOLD_"] = str(128 * 1024)  # give back freed heap tops too
    repo_root = str(Path(__file__).resolve().parents[2])  # bpt/bench/workers.py -> the checkout holding bpt/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
    return env


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
