"""The GPU check's trainer part (`python -m bpt.bench --gpu_check --gpu_check_parts trainer --output DIR`):
`python -m train.qlora` itself, end to end on the card, as a user runs it.

The command is `python -m train.qlora --config configs/tiny-llama-64x-gpu.yaml` (its header says what it trains and
why it is sized so): the bundled tiny llama extended 64x, to 16,384 tokens, 4-bit QLoRA in bf16 autocast with the patch
compiled (the trainer's own CUDA defaults), passkey evaluation before and after, --merge. The part runs, at once (a
0.55M-parameter model leaves the card idle most of the time, and each process has its own CPU cores):
  run       the command; its adapter, eval.json, metrics.jsonl, run_info.json, pictures and model card stay in
            DIR/trainer/run/ beside gpu_check.json (merged/ and checkpoints are removed once checked);
  again     the same command again: how far two uninterrupted runs land apart on this card (nothing, where its kernels
            are deterministic);
  resumed   the same command, SIGTERM once half its steps are logged (a graceful stop: checkpoint, exit 143), then the
            same command with --resume_from_checkpoint latest;
  refused   the same command at --max_seq_len 2^26, which the memory preflight must refuse in one line;
then `python -m train.eval` on run's merged/ model (the merge loads without peft) while the resumed run finishes.
The report (gpu_check.json "trainer") holds each process's exit, time and lines that matter (the preflight's
`memory:` line, the stop line, the refusal), run's wall time, tokens/s (median of the logged windows), peak memory
(torch.cuda.max_memory_allocated) and passkey accuracy before and after, and whether the resumed run landed where run
did (bpt.bench.trainer_compare: bitwise where two uninterrupted runs are bitwise equal, else within their spread).

Without a card (--simulate CARD, the dry run CI runs) the same processes and comparisons run on the CPU at DRY's size
(512 tokens, a few steps): the code path, not the card's figures; the report says so.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bpt.bench.trainer_compare import apart, resume_verdict
from bpt.bench.trainer_runs import Run, run_once, wait_all

ROOT = Path(__file__).resolve().parents[2]
PRESET = Path("configs") / "tiny-llama-64x-gpu.yaml"  # relative to the checkout, as a user types it
ABSURD_LENGTH = 1 << 26  # 67M tokens: ~0.7 TiB for the tiny model's step on the line the preflight extends
WRAP_UP_SECONDS = 20  # comparing, tidying, the report


@dataclass(frozen=True)
class Sizing:
    """What the part runs: the preset with `flags` over it; the resumed run is stopped once `stop_after` is logged;
    the merged model is evaluated at `length` over 3 depths x `merged_trials`."""

    flags: tuple[str, ...]
    stop_after: int
    length: int
    merged_trials: int


def card_sizing() -> Sizing:
    """The preset as it is; the interruption half way."""
    import yaml

    preset = yaml.safe_load((ROOT / PRESET).read_text())
    return Sizing((), preset["max_steps"] // 2, preset["max_seq_len"], 4)


# The dry run and the CUDA tier's test: the same processes at 512 tokens (2x), a few steps and prompts.
DRY = Sizing(("--max_seq_len", "512", "--max_steps", "6", "--logging_steps", "1", "--warmup_steps", "2",
              "--passkey_samples", "12", "--per_device_train_batch_size", "1", "--eval_lengths", "512",
              "--eval_depths", "0", "1", "--eval_trials", "1"), 3, 512, 1)


def trainer_env() -> dict:
    from bpt.bench.workers import worker_env

    return {**worker_env("default"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _line(run: Run, start: str) -> str | None:
    return next((line for line in run.lines() if line.startswith(start)), None)


def _eval_cells(result: dict | None) -> dict | None:
    if not result:
        return None
    return {"accuracy": result.get("accuracy"), "by_length": result.get("by_length"),
            "by_length_depth": result.get("by_length_depth")}


def summary(run: Run) -> dict:
    """A finished (or stopped) run: its exit, time, the lines that matter, and the figures of its output folder."""
    rows = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (run.out / "metrics.jsonl").is_file() else []
    info, evals = _read(run.out / "run_info.json"), _read(run.out / "eval.json") or {}
    return {"returncode": run.returncode, "seconds": run.seconds, "notes": run.notes,
            "finished": bool(info and info.get("finished")), "wall_time_s": (info or {}).get("wall_time_s"),
            "steps_logged": run.steps_logged(), "final_loss": (info or {}).get("final_loss"),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows) if rows else None,
            "peak_mem_mb": max((r["peak_mem_mb"] for r in rows), default=None),
            "opening_line": _line(run, "trainable parameters:"), "preflight_line": _line(run, "memory:"),
            "last_line": (run.lines() or [None])[-1],
            "eval_before": _eval_cells(evals.get("before")), "eval_after": _eval_cells(evals.get("after"))}


def refusal(run: Run) -> dict:
    """The too-long run: refused in one line (exit 2, one `error:` line naming the memory) or not."""
    lines = run.lines()
    one_line = run.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: not enough ")
    return {"max_seq_len": ABSURD_LENGTH, "returncode": run.returncode, "seconds": run.seconds, "lines": lines[-5:],
            "one_line": one_line}


def merged_eval(out: Path, sizing: Sizing, env: dict, timeout: float) -> dict:
    """train.eval on the merged model alone (transformers, no peft), a few prompts."""
    merged = out / "merged"
    if not (merged / "config.json").is_file():
        return {"ok": False, "error": f"no {merged}/config.json: the run wrote no merged model"}
    results = out.parent / "merged_eval.json"
    code, lines, seconds = run_once(
        ["-m", "train.eval", "--model_name_or_path", str(merged), "--lengths", str(sizing.length), "--depths", "0",
         "0.5", "1", "--trials", str(sizing.merged_trials), "--output_json", str(results)], ROOT, env, timeout)
    found = _read(results) if code == 0 else None
    return {"ok": code == 0, "seconds": seconds, "files": sorted(p.name for p in merged.iterdir()),
            "accuracy": found["tasks"]["passkey"]["accuracy"] if found else None,
            **({} if code == 0 else {"error": (lines or ["timed out"])[-1]})}


def tidy(run_dir: Path) -> None:
    """Keep what a user's run leaves that is worth committing: drop merged/ and the checkpoints."""
    for path in run_dir.glob("checkpoint-*"):
        shutil.rmtree(path)
    shutil.rmtree(run_dir / "merged", ignore_errors=True)


def run_part(out: Path, sizing: Sizing, seconds: float, *, real: bool) -> dict:
    """Every process of the part in `out` (removed first), within `seconds`; -> the part's report."""
    started = time.monotonic()
    deadline = started + seconds - WRAP_UP_SECONDS
    shutil.rmtree(out, ignore_errors=True)
    env = trainer_env()

    def argv(name: str, *more: str) -> list[str]:
        return ["--config", str(PRESET), *sizing.flags, *more, "--output_dir", str(out / name)]

    runs = {name: Run(name, argv(name), out / name, out / f"{name}.log") for name in ("run", "again", "resumed")}
    runs["refused"] = Run("refused", argv("refused", "--max_seq_len", str(ABSURD_LENGTH)), out / "refused",
                          out / "refused.log")
    for run in runs.values():
        run.start(ROOT, env)
    wait_all(list(runs.values()), deadline, stop_at={"resumed": sizing.stop_after})
    resumed = runs["resumed"]
    interrupted = {"stopped_after_step": resumed.signalled_after, "returncode": resumed.returncode,
                   "seconds": resumed.seconds, "stop_line": (resumed.lines() or [None])[-1]}
    report = {"command": f"python -m train.qlora --config {PRESET}", "flags_over_the_preset": list(sizing.flags),
              "device": "cuda" if real else "cpu (the dry run: the part's processes on the CPU, at the dry size)",
              "measured": real, "processes_at_once": 4, "interrupted": interrupted}
    merged = {"ok": False, "error": "not run: run did not finish"}
    if resumed.returncode == 143 and time.monotonic() < deadline:
        resumed.argv = argv("resumed", "--resume_from_checkpoint", "latest")
        resumed.start(ROOT, env)
        if runs["run"].returncode == 0:
            merged = merged_eval(runs["run"].out, sizing, env, deadline - time.monotonic())
        wait_all([resumed], deadline)
    elif runs["run"].returncode == 0:
        merged = merged_eval(runs["run"].out, sizing, env, deadline - time.monotonic())
    report.update({name: summary(runs[name]) for name in ("run", "again", "resumed")})
    report["resumed"]["resumed_line"] = _line(resumed, "resumed from ")
    report["merged"] = merged
    report["refusal"] = refusal(runs["refused"])
    if all(runs[name].returncode == 0 for name in ("run", "again", "resumed")):
        report["again_vs_run"] = apart(runs["run"].out, runs["again"].out)
        report["resumed_vs_run"] = apart(runs["run"].out, runs["resumed"].out)
        report["resume"] = resume_verdict(report["resumed_vs_run"], report["again_vs_run"])
    else:
        report["resume"] = {"matches": False, "how": "not compared: "
                            + ", ".join(f"{n} exited {runs[n].returncode}" for n in ("run", "again", "resumed"))}
    tidy(runs["run"].out)
    for name in ("again", "resumed", "refused"):
        shutil.rmtree(out / name, ignore_errors=True)
    (out / "merged_eval.json").unlink(missing_ok=True)
    report["saved"] = os.path.relpath(runs["run"].out, out.parent)
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def part_trainer(check) -> None:
    """The part in the GPU check (bpt.bench.gpu_check): DIR/trainer/, the card's sizing on a real card."""
    sizing = card_sizing() if check.real else DRY
    check.report["trainer"] = run_part(check.out / "trainer", sizing, max(60.0, check.left("trainer")),
                                       real=check.real)
    check.save("trainer")
