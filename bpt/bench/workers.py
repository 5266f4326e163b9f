"""One run per fresh process: a run's memory never pollutes another, and a run that dies is a failed result.

- `run_worker`: parent side; writes the spec json, runs `python -m bpt.bench --worker SPEC.json`, reads the result
- `run_ranks`: the same for a process group: one worker per rank, a failed or late rank stops the whole group
- `worker_command`: the worker's argv (with the simulated-GPU shim loaded first for a simulated CUDA device)
- `worker_env`: the worker's environment (glibc malloc thresholds, PYTHONPATH to this checkout)
- `worker_main`: child side; runs the probe or training task of the spec, writes the result json
- `describe_exit`, `_oom_message`: why a run failed, in one line (killed, exit status, out of memory)
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bpt.bench.measure import run_probe, run_training
from bpt.bench.sequence_parallel import run_sp_group



def _simulate(spec: dict) -> dict:
    from bpt.bench.simulate import run_simulation  # the gpusim modules load only in simulation workers

    return run_simulation(spec)


def _cells(spec: dict) -> dict:
    from bpt.bench.cells import run_cells

    return run_cells(spec)


def _environment(spec: dict) -> dict:
    from bpt.bench.cells import device_environment

    return device_environment(spec)


def _decode(spec: dict) -> dict:
    from bpt.bench.decode_check import run_decode

    return run_decode(spec)


def _unsloth(spec: dict) -> dict:
    from bpt.bench.unsloth_check import run_unsloth  # imports unsloth first in the process, as it asks

    return run_unsloth(spec)


def _rates(spec: dict) -> dict:
    from bpt.gpusim.rates import run_rates

    return run_rates(spec)


TASKS = {"probe": run_probe, "train": run_training, "sp_train": run_sp_group, "simulate": _simulate,
         "cells": _cells, "environment": _environment, "rates": _rates, "decode": _decode, "unsloth": _unsloth}


def worker_command(spec_path: str, spec: dict) -> list[str]:
    """argv of the worker process; a simulated CUDA device needs the gpusim shim loaded before torch."""
    if spec["task"] in ("simulate", "cells", "environment") and spec.get("simulate") not in (None, "cpu") \
            and not spec.get("real"):
        from bpt.gpusim.shim import boot_command

        return boot_command("bpt.bench", "--worker", spec_path)
    return [sys.executable, "-m", "bpt.bench", "--worker", spec_path]


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
        result = TASKS[spec["task"]](spec)
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
    """Run one spec in a fresh `python -m bpt.bench --worker` process; a dead worker is a failed result (with the
    partial result it wrote to result_path + ".partial", if any, as "partial")."""
    with tempfile.TemporaryDirectory(prefix="bpt-bench-") as tmp:
        spec = {**spec, "result_path": os.path.join(tmp, "result.json")}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        command = worker_command(spec_path, spec)
        try:
            proc = subprocess.run(command, env=worker_env(spec["malloc"]), capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return _failed(f"timed out after {timeout:g} s", spec["result_path"])
        if os.path.exists(spec["result_path"]):
            with open(spec["result_path"]) as f:
                return json.load(f)
        return _failed(describe_exit(proc.returncode, proc.stderr), spec["result_path"])


def read_partial(result_path: str) -> dict | None:
    """What a worker wrote to result_path + ".partial" before it died or was stopped, if anything."""
    path = result_path + ".partial"
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _failed(error: str, result_path: str) -> dict:
    partial = read_partial(result_path)
    return {"ok": False, "error": error, **({} if partial is None else {"partial": partial})}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(spec: dict, world: int, timeout: float | None = None) -> dict:
    """Run one spec on `world` fresh worker processes (ranks 0..world-1 of one group, rendezvous on a local port).

    -> {"ok": True, "ranks": [each rank's result]} or {"ok": False, "error": one line, "ranks": [partial results
    of the ranks that wrote some]}. The first rank that exits unsuccessfully, or the wall-clock `timeout`, ends
    the group: the other ranks are killed rather than left waiting in a collective.
    """
    with tempfile.TemporaryDirectory(prefix="bpt-bench-sp-") as tmp:
        port, procs, logs = _free_port(), [], []
        for rank in range(world):
            rank_spec = {**spec, "rank": rank, "world": world, "port": port,
                         "result_path": os.path.join(tmp, f"result{rank}.json")}
            spec_path = os.path.join(tmp, f"spec{rank}.json")
            with open(spec_path, "w") as f:
                json.dump(rank_spec, f)
            logs.append(open(os.path.join(tmp, f"stderr{rank}.txt"), "w+"))  # a file: a pipe could fill and block
            procs.append(subprocess.Popen([sys.executable, "-m", "bpt.bench", "--worker", spec_path],
                                          env=worker_env(spec["malloc"]), stdout=subprocess.DEVNULL, stderr=logs[-1]))
        deadline = None if timeout is None else time.monotonic() + timeout
        failed = None
        while failed is None and any(p.poll() is None for p in procs):
            failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if failed is None and deadline is not None and time.monotonic() > deadline:
                failed = "timeout"
            time.sleep(0.2)
        failed = failed if failed is not None else next((r for r, p in enumerate(procs) if p.returncode), None)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        results, partial = [], []
        for rank, log in enumerate(logs):
            path = os.path.join(tmp, f"result{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
            else:
                log.seek(0)
                results.append({"ok": False, "error": describe_exit(procs[rank].returncode, log.read())})
            log.close()
            if (finished := read_partial(path)) is not None:
                partial.append(finished)
        if failed is None:
            return {"ok": True, "ranks": results}
        if failed == "timeout":
            error = f"timed out after {timeout:g} s"
        else:
            error = f"rank {failed} of {world}: {results[failed]['error']}"
        return {"ok": False, "error": error, "ranks": partial if len(partial) == world else []}
