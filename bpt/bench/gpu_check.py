"""`python -m bpt.bench --gpu_check --output DIR`: the prepared check of a lent GPU, most valuable figures first.

Each part lands in DIR/gpu_check.json (the table in DIR/gpu_check.txt) as soon as it is done, so a run stopped at
its time limit keeps what finished:
  a. environment: the card, driver, CUDA and the versions of the libraries the run used;
  clock: the rates a step-time clock needs (bpt.gpusim.rates: matmul per dtype and by rows, copy bandwidth, the
     cost of one kernel launch, SDPA forward/backward, host <-> device copies), ~20 s;
  b. memory: Llama-3.2-1B shapes (random weights), LoRA r 16 on every linear, bf16 autocast, checkpointing, 8K and
     32K tokens, stock / patched / patched+offload, and one 4-bit (bitsandbytes) patched row:
     torch.cuda.max_memory_allocated of one training step beside the simulated peak of the same step
     (--simulate's code path, run on the CPU cores beside the GPU work);
  c. speed: median seconds per step and tokens per second of the same cells (1 warm-up, 3 synchronised steps,
     the patch compiled as users get it), patched at 64K and 128K, and Liger-Kernel's patch on the same lengths
     as the peer on the same card (and on the same 4-bit base at 8K), and Unsloth's own QLoRA step at 8K where it is
     installed (bpt.bench.unsloth_check); at 8K one more step under torch.profiler: kernels launched and GPU time
     by kind (matmul, attention, memory-bound, copies) against the step's wall time;
  d. the CUDA tier: `python -m pytest -m cuda` in the checkout, its counts and each failure's text
     (DIR/cuda_tier.log);
  e. the longest context that fits this card, patched and patched+offload: doubling from 64K, each length stepped
     at 2 and 3 layers and extended to the depth (as --simulate --layers), bounded by the time left; beside it the
     simulation's --find_max on the same card;
  f. decode: generate() with a static cache under torch.compile, stock and patched, on the same model (bf16, a
     4,096-token prompt, 128 new tokens): tokens per second of the second call and the graphs each call compiled
     (bpt.bench.decode_check); run when named (--gpu_check_parts decode);
  g. trainer: `python -m train.qlora` itself on the card, end to end (bpt.bench.trainer_check): the bundled tiny llama
     extended 64x to 16,384 tokens, passkey before and after, a SIGTERM and --resume_from_checkpoint latest against an
     uninterrupted run, --merge, the preflight's line and its one-line refusal of an absurd length; ~4 minutes, run
     when named (--gpu_check_parts trainer: the default parts take a lent card's command as it is);
  h. qlora_8b: the headline model, Llama-3.1-8B shapes in 4-bit QLoRA, 2 and 3 layers extended to 32: the peak at
     64K and 128K (and with offload at 256K) beside the simulation's, seconds per step at 16K beside the clock's
     (bpt.bench.qlora_8b_check); run when named.
With --simulate CARD every part runs on that simulated card instead (the dry run CI runs): "measured" bytes are
then the tracker's on fake tensors, timings are absent, and the Liger rows say why they did not run.
The time budget (--time_budget) is shared out so the later parts keep their turn: a part that would eat into the
next one's reserve skips its remaining cells with the reason. --gpu_check_parts runs only the parts named (a later
lease of a card already measured: the CUDA tier and the longest context, say); the text report is
bpt.bench.gpu_check_table's.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from bpt.bench.cuda_tier import run_cuda_tier
from bpt.bench.decode_check import part_decode
from bpt.bench.gpu_check_rows import memory_row, speed_row
from bpt.bench.gpu_check_table import format_table
from bpt.bench.models import PEER, resolve_model_config
from bpt.bench.qlora_8b_check import part_qlora_8b
from bpt.bench.simulate import longest_fitting
from bpt.bench.trainer_check import part_trainer
from bpt.gpusim.gpus import DEVICES, GIB, RESERVE_BYTES
from bpt.gpusim.gpus import device as simulated_device

MODEL = "llama-3.2-1b"
LORA_R = 16
MEMORY_LENGTHS = (8192, 32768)
MEMORY_SIDES = ("stock", "patched", "patched+offload")
FOUR_BIT_LENGTH = 8192
LONG_LENGTHS = (65536, 131072)  # patched only: stock no longer fits there
TIMED_STEPS = 3
PROFILE_LENGTHS = [8192]  # one profiled step per side at this length (the clock's ground truth)
MAX_CONTEXT_SIDES = ("patched", "patched+offload")
MAX_CONTEXT_START = 65536
FIND_MAX_RESOLUTION = 8192  # the simulation's bisection on the card, in tokens
SIM_LAYERS = 2  # the simulated rows run 2 and 3 layers and extend the (linear) bytes to the depth
# in order, after the environment
PARTS = ("clock", "memory", "speed", "cuda_tier", "max_context", "decode", "trainer", "qlora_8b")
# The least seconds each part keeps for itself out of the check's budget: a running part leaves the later ones theirs.
PART_SECONDS = {"clock": 20, "memory": 100, "speed": 100, "cuda_tier": 150, "max_context": 45, "decode": 120,
                "trainer": 240, "qlora_8b": 240}
# Decode, the trainer and the 8B run when named: their minutes beside the others' 8 would not fit one command of a lent
# card's session.
WHEN_NAMED = ("decode", "trainer", "qlora_8b")
DEFAULT_PARTS = tuple(part for part in PARTS if part not in WHEN_NAMED)
BUDGET_SECONDS = 480.0  # the default --time_budget
TRAINER_ALONE_SECONDS = 300.0  # ... for --gpu_check_parts trainer alone
END_SECONDS = 5  # writing the report
UNSLOTH_ON_A_SIMULATED_CARD = "not run: Unsloth runs its own kernels, which a simulated card cannot"
CARDS = (("H200", "h200-141gb"), ("H100", "h100-80gb"), ("A100", "a100-80gb"), ("L40S", "l40s-48gb"),
         ("4090", "rtx4090-24gb"))
ROOT = Path(__file__).resolve().parents[2]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "GPU check (python -m bpt.bench --gpu_check --output DIR; see bpt.bench.gpu_check)")
    group.add_argument("--gpu_check", action="store_true",
                       help="run the prepared check of this GPU (memory against the simulation, speed against "
                            "stock and Liger-Kernel, the CUDA tests, the longest context): --output is a folder; "
                            "with --simulate CARD it runs on that simulated card (the dry run)")
    group.add_argument("--time_budget", type=float, default=None,
                       help=f"with --gpu_check: seconds for the whole check, shared out so every part gets its turn "
                            f"(default {BUDGET_SECONDS:.0f}; {TRAINER_ALONE_SECONDS:.0f} for the trainer alone)")
    group.add_argument("--gpu_check_parts", nargs="+", choices=PARTS, default=list(DEFAULT_PARTS),
                       help="with --gpu_check: the parts to run (default: all but decode and trainer, which run "
                            "when named: --gpu_check_parts decode trainer; the environment always runs), e.g. "
                            "cuda_tier max_context on a card whose memory and speed are already measured")


def validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The --gpu_check flags (errors exit with status 2); -> the model config."""
    import torch

    if args.output is None:
        p.error("--gpu_check writes a folder: give it with --output DIR")
    if args.simulate is None and not torch.cuda.is_available():
        p.error("--gpu_check needs a CUDA GPU; without one, run the dry run: --gpu_check --simulate h100-80gb")
    if args.simulate is not None and not simulated_device(args.simulate).is_cuda:
        p.error(f"--gpu_check --simulate takes a GPU ({', '.join(n for n, d in DEVICES.items() if d.is_cuda)})")
    if args.time_budget is None:
        args.time_budget = TRAINER_ALONE_SECONDS if args.gpu_check_parts == ["trainer"] else BUDGET_SECONDS
    if args.time_budget <= 0:
        p.error(f"--time_budget must be positive, got {args.time_budget}")
    args.model = args.model or MODEL
    # the longest length the max-context search tries: 4M on a GPU; the dry run tries its first length only (a fake
    # step costs CPU time in proportion to its chunk count: 4M would take the dry run an hour)
    args.max_len = args.max_len or (1 << 22 if args.simulate is None else MAX_CONTEXT_START)
    try:
        return resolve_model_config(args.model, max(args.max_len, max(LONG_LENGTHS)))
    except ValueError as error:
        p.error(str(error))


def card_of(gpu_name: str, memory_bytes: int) -> str:
    """The simulated card that stands for a real one (by name, then the nearest memory among the H100 / A100 ones)."""
    for key, card in CARDS:
        if key in gpu_name:
            if card == "a100-80gb" and memory_bytes < 50 * GIB:
                return "a100-40gb"
            return card
    return "h100-80gb"


class Check:
    """The check's state: the report written after every change, the deadline, the workers it starts."""

    def __init__(self, args: argparse.Namespace, model_config: dict, runner):
        self.args, self.model_config, self.runner = args, model_config, runner
        self.real = args.simulate is None
        self.out = Path(args.output)
        self.out.mkdir(parents=True, exist_ok=True)
        self.start = time.time()
        self.deadline = self.start + args.time_budget
        self.card = args.simulate
        self.report = {"gpu_check": "measured" if self.real else f"simulated {args.simulate}",
                       "started": datetime.datetime.now().isoformat(timespec="seconds"), "model": args.model,
                       "lora_r": LORA_R, "time_budget_s": args.time_budget, "parts_done": [],
                       "environment": None, "clock": None, "memory": [], "speed": [], "cuda_tier": None, "max_context": None,
                       "decode": None, "trainer": None, "qlora_8b": None}
        workers = max(1, min(8, (os.cpu_count() or 2) - 2))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)

    def reserve_after(self, part: str) -> float:
        """Seconds the check keeps for the parts after `part` (those it runs) and for writing the report."""
        later = PARTS[PARTS.index(part) + 1:]
        return END_SECONDS + sum(PART_SECONDS[p] for p in later if p in self.args.gpu_check_parts)

    def left(self, part: str) -> float:
        """Seconds this part may still use: to the deadline, less what the later parts keep."""
        return self.deadline - time.time() - self.reserve_after(part)

    def save(self, part: str | None = None) -> None:
        if part:
            self.report["parts_done"].append(part)
            print(f"[gpu_check] {part} done at {time.time() - self.start:.0f} s", flush=True)
        self.report["seconds"] = round(time.time() - self.start, 1)
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        os.replace(tmp, self.out / "gpu_check.json")
        (self.out / "gpu_check.txt").write_text(format_table(self.report) + "\n")

    def spec(self, side: str, bits: int = 16, **extra) -> dict:
        return {"simulate": self.card, "side": side, "bits": bits, "model_config": self.model_config,
                "batch_size": 1, "gradient_checkpointing": True, "lora": True, "lora_r": LORA_R,
                "lora_targets": None, "lora_dropout": 0.0, "bpt": asdict(self.args.bpt), "malloc": "default",
                "seed": self.args.seed, "top": 5, **extra}

    def simulated(self, side: str, seq_len: int, bits: int = 16, **extra) -> concurrent.futures.Future:
        """The simulation's row of a cell, on a CPU worker in the background."""
        spec = self.spec(side, bits, task="simulate", seq_len=seq_len, layers=SIM_LAYERS, threads=1, **extra)
        return self.pool.submit(lambda: self.runner(spec, self.until_deadline()))

    def until_deadline(self) -> float:
        """A background worker's timeout: it ends with the check (a finished check waits for no worker)."""
        return max(10.0, self.deadline - time.time())

    def cells(self, side: str, seq_lens, part: str, bits: int = 16, **extra) -> list[dict]:
        """Run one side's lengths in one worker (on the GPU, or the simulated card); -> one row per length."""
        extra.setdefault("layers", None if self.real else SIM_LAYERS)  # the dry run: as the simulated rows
        spec = self.spec(side, bits, task="cells", real=self.real, seq_lens=list(seq_lens), **extra)
        timeout = max(30.0, self.left(part) + 60)
        print(f"[gpu_check] {part}: {side} {bits}-bit {list(seq_lens)} ...", flush=True)
        result = self.runner(spec, timeout)
        rows = result.get("cells") or result.get("partial", {}).get("cells", [])
        for n in list(seq_lens)[len(rows):]:
            rows.append({"seq_len": n, "ok": False, "skipped": True, "error": result.get("error", "not run")})
        for row in rows:
            state = "ok" if row["ok"] else f"FAILED: {row['error']}"
            print(f"[gpu_check]   {side:15s} {row['seq_len']:>8d}  {state}", flush=True)
        return rows


def part_environment(check: Check) -> None:
    env = check.runner({"task": "environment", "simulate": check.card, "real": check.real, "malloc": "default"}, 120)
    if check.real and env.get("ok"):
        check.card = card_of(env["gpu"], env["memory_bytes"])
        env["simulated_as"] = check.card
    check.report["environment"] = env
    check.report["card"] = check.card
    check.save("environment")


def part_clock(check: Check) -> None:
    if check.real:
        check.report["clock"] = check.runner({"task": "rates", "device": "cuda", "malloc": "default"},
                                             max(30.0, check.left("clock")))
    else:
        check.report["clock"] = {"ok": False, "error": "not run: rates need a real device (a CPU's are measured "
                                                       "by bpt.gpusim.clock.cpu_rates on first use)"}
    check.save("clock")


def part_memory(check: Check, sims: dict) -> None:
    groups = [(side, 16, MEMORY_LENGTHS) for side in MEMORY_SIDES] + [("patched", 4, (FOUR_BIT_LENGTH,))]
    for side, bits, lengths in groups:
        for cell in check.cells(side, lengths, "memory", bits, tracked=True, timed_steps=TIMED_STEPS,
                                profile_lengths=PROFILE_LENGTHS):
            simulated = sims[side, cell["seq_len"], bits].result()
            check.report["memory"].append(memory_row(side, bits, cell, simulated, check.real))
            check.report["speed"].append(speed_row(side, bits, cell, check.real))
            check.save()
    check.save("memory")


def part_speed(check: Check) -> None:
    # the peer at the memory part's lengths first (like for like with the rows above, 4-bit too), then the long ones
    groups = [(PEER, MEMORY_LENGTHS, 16), (PEER, (FOUR_BIT_LENGTH,), 4), ("patched", LONG_LENGTHS, 16),
              (PEER, LONG_LENGTHS, 16)]
    for side, lengths, bits in groups:
        if side == PEER and not check.real:
            cells = [{"seq_len": n, "ok": False, "error": "not run: Liger-Kernel's Triton kernels need a real GPU"}
                     for n in lengths]
        elif check.left("speed") <= 0:
            cells = [{"seq_len": n, "ok": False, "error": "not run: the check's time budget"} for n in lengths]
        else:
            cells = check.cells(side, lengths, "speed", bits, tracked=False, timed_steps=TIMED_STEPS,
                                deadline=check.deadline - check.reserve_after("speed"))
        check.report["speed"].extend(speed_row(side, bits, cell, check.real) for cell in cells)
        check.save()
    check.report["speed"].extend(speed_row("unsloth", 4, cell, check.real) for cell in unsloth_cells(check))
    check.save("speed")


def unsloth_cells(check: Check) -> list[dict]:
    """Unsloth's QLoRA step at the 4-bit rows' length (bpt.bench.unsloth_check), last: its compile may take the
    time the part has left, and no more."""
    if not check.real:
        return [{"seq_len": FOUR_BIT_LENGTH, "ok": False, "error": UNSLOTH_ON_A_SIMULATED_CARD}]
    if check.left("speed") <= 0:
        return [{"seq_len": FOUR_BIT_LENGTH, "ok": False, "error": "not run: the check's time budget"}]
    spec = {"task": "unsloth", "model_config": check.model_config, "bits": 4, "lora_r": LORA_R,
            "seq_lens": [FOUR_BIT_LENGTH], "timed_steps": TIMED_STEPS, "seed": check.args.seed, "malloc": "default"}
    print(f"[gpu_check] speed: unsloth 4-bit [{FOUR_BIT_LENGTH}] ...", flush=True)
    result = check.runner(spec, max(30.0, check.left("speed") + 60))
    return result.get("cells") or [{"seq_len": FOUR_BIT_LENGTH, "ok": False, "error": result.get("error", "not run")}]


def part_cuda_tier(check: Check) -> None:
    if (ROOT / "pyproject.toml").exists():
        tier = run_cuda_tier(ROOT, check.out, max(30.0, check.left("cuda_tier")))
    else:
        tier = {"error": f"{ROOT} is not a checkout: the CUDA tier runs the repository's tests", "passed": 0,
                "failed": 0, "skipped": 0, "errors": 0}
    check.report["cuda_tier"] = tier
    check.save("cuda_tier")


def doubling(start: int, cap: int) -> list[int]:
    lengths, n = [], start
    while n <= cap:
        lengths.append(n)
        n *= 2
    return lengths


def simulated_find_max(check: Check, side: str) -> dict:
    """The simulation's longest fitting length on the card (doubling, then bisection to FIND_MAX_RESOLUTION)."""
    usable = simulated_device(check.card).usable_bytes
    tried = {}

    def fits(n: int) -> bool:
        if check.left("max_context") < 0:
            raise RuntimeError(f"stopped at the check's time budget before {n} tokens")
        spec = check.spec(side, task="simulate", seq_len=n, layers=SIM_LAYERS, threads=1)
        row = check.runner(spec, check.until_deadline())
        if not row["ok"]:
            raise RuntimeError(f"simulation of {side} at {n} tokens failed: {row['error']}")
        tried[n] = row["peak_bytes"]
        return row["peak_bytes"] <= usable

    try:
        longest, over = longest_fitting(fits, MAX_CONTEXT_START, check.args.max_len, FIND_MAX_RESOLUTION)
    except RuntimeError as error:
        return {"error": str(error), "peaks": tried}
    return {"longest": longest, "first_over": over, "usable_bytes": usable, "resolution": FIND_MAX_RESOLUTION,
            "peaks": {str(n): b for n, b in sorted(tried.items())}}


def part_max_context(check: Check, find_max: dict) -> None:
    env = check.report["environment"] or {}
    total = env.get("memory_bytes") or simulated_device(check.card).memory_bytes
    usable = total - RESERVE_BYTES
    lengths = doubling(MAX_CONTEXT_START, check.args.max_len)
    result = {"usable_bytes": usable, "reserve_bytes": RESERVE_BYTES, "measured": check.real,
              "method": f"doubling from 64K; each length stepped at {SIM_LAYERS} and {SIM_LAYERS + 1} layers, "
                        "bytes extended to the depth"}
    for side in MAX_CONTEXT_SIDES:
        if check.left("max_context") <= 0:
            cells = [{"seq_len": lengths[0], "ok": False, "skipped": True, "error": "not run: the check's time budget"}]
        else:
            # 2 and 3 layers as the simulation: from 1 layer the peak sits in the loss, not in a layer, and 1 -> 2
            # is not the per-layer growth (64K patched: 2.5x the simulation's figure)
            cells = check.cells(side, lengths, "max_context", tracked=True, layers=SIM_LAYERS,
                                stop_at_first_failure=True,
                                usable_bytes=usable, deadline=check.deadline - check.reserve_after("max_context"))
        fitting = [c["seq_len"] for c in cells if c["ok"] and c.get("fits")]
        over = next((c for c in cells if not (c["ok"] and c.get("fits"))), None)
        try:
            sim = find_max[side].result(timeout=max(1.0, check.deadline - time.time()))
        except concurrent.futures.TimeoutError:
            sim = {"error": "still running at the end of the check's time budget"}
        result[side] = {
            "longest": max(fitting) if fitting else None,
            "first_over": over["seq_len"] if over and not over.get("skipped") else None,
            "stopped": ("does not fit" if over["ok"] else over["error"]) if over else "reached --max_len",
            "trials": [{"seq_len": c["seq_len"], "ok": c["ok"], "fits": c.get("fits"),
                        "peak_bytes": c.get("cuda_peak_bytes", c.get("peak_bytes")), "seconds": c.get("seconds"),
                        **({"error": c["error"]} if not c["ok"] else {})} for c in cells],
            "simulated_find_max": sim,
        }
        check.report["max_context"] = result
        check.save()
    check.save("max_context")


def run(args: argparse.Namespace, model_config: dict, runner) -> dict:
    """The whole check; -> the report (also in DIR/gpu_check.json)."""
    check = Check(args, model_config, runner)
    try:
        part_environment(check)
        if not check.report["environment"].get("ok"):
            raise SystemExit(f"gpu_check: the environment worker failed: {check.report['environment'].get('error')}")
        parts = args.gpu_check_parts
        sims, find_max = {}, {}
        if "memory" in parts:  # the simulated side of each cell, on CPU workers while the GPU works
            sims = {(side, n, 16): check.simulated(side, n) for n in MEMORY_LENGTHS for side in MEMORY_SIDES}
            sims["patched", FOUR_BIT_LENGTH, 4] = check.simulated("patched", FOUR_BIT_LENGTH, 4)
        if "max_context" in parts:
            find_max = {side: check.pool.submit(simulated_find_max, check, side) for side in MAX_CONTEXT_SIDES}
        runs = {"clock": lambda: part_clock(check), "memory": lambda: part_memory(check, sims),
                "speed": lambda: part_speed(check), "cuda_tier": lambda: part_cuda_tier(check),
                "max_context": lambda: part_max_context(check, find_max), "decode": lambda: part_decode(check),
                "trainer": lambda: part_trainer(check), "qlora_8b": lambda: part_qlora_8b(check, SIM_LAYERS)}
        for part in PARTS:
            if part in parts:
                runs[part]()
    finally:
        check.pool.shutdown(wait=False, cancel_futures=True)
        check.save()
    print()
    print(format_table(check.report))
    print(f"\nwrote {check.out / 'gpu_check.json'} and {check.out / 'gpu_check.txt'}")
    return check.report
