"""What a sweep found, for people and files: summary rows, growth, design goals, environment, JSON and CSV.

- `summarize`: per-length rows (stock vs patched), memory growth per side, the design goals next to what was measured
- `format_report`: the table, growth and design-goal lines printed at the end of a sweep
- `summarize_sp`, `format_sp_report`: the same for the sequence-parallel mode (per mode, size N and length)
- `environment`, `package_version`: versions, device, model and flags, recorded with every result
- `write_outputs`: the JSON with everything and a CSV next to it, one row per length
"""
from __future__ import annotations

import argparse
import csv
import datetime
import importlib.metadata
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

import torch

from bpt.bench.models import SIDES

# Design goals of the project, reported next to what a sweep measured (never asserted; a value above its goal is a
# finding, not a failed run): name -> (what is measured, row field at seq_len or None for the growth ratio, goal:
# the value at most). The growth is MiB per 1K tokens between the smallest and largest length.
TARGETS = {
    "mem_ratio_at_8192": ("step memory at 8192 tokens, patched / stock", ("mem_ratio", 8192), 0.15),
    "growth_ratio": ("memory growth per 1K tokens, patched / stock", None, 1 / 20),
    "time_ratio_at_8192": ("step time at 8192 tokens, patched / stock", ("time_ratio", 8192), 1.0),
}
GOALS_HEADER = "design goals (what was measured, next to the value the patch aims for; not a pass/fail of this run):"


def _target(description: str, limit: float, value) -> dict:
    return {"description": description, "limit": limit, "value": value, "met": None if value is None else value <= limit}


def _goal_lines(targets: dict) -> list[str]:
    """The printed design-goal section: one line per target, in user terms."""
    lines = [GOALS_HEADER]
    for t in targets.values():
        if t["value"] is None:
            where = "not measured in this run"
        else:
            where = "within the goal" if t["met"] else "above the goal"
        lines.append(f"  {t['description']}: {_fmt(t['value'], '.4f')} (goal <= {t['limit']:.3g}; {where})")
    return lines


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def summarize(runs: list[dict], seq_lens: list[int]) -> dict:
    """Per-length rows (stock vs patched), memory growth per side and the design goals (TARGETS) with their values."""
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
    for name, (description, where, limit) in TARGETS.items():
        got = growth["ratio"] if where is None else row_at.get(where[1], {}).get(where[0])
        targets[name] = _target(description, limit, got)
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
    lines += _goal_lines(summary["targets"])
    for side, f in find_max.items():
        lines.append(f"find_max {side}: longest ok {f['longest_ok']}, first failed {f['first_failed']} ({f['reason']})")
    return "\n".join(lines)


# Sequence-parallel design goals (reported like TARGETS, never asserted): size N -> the most its memory growth per 1K
# tokens may be as a fraction of N = 1's (same mode, smallest to largest length).
SP_GROWTH_TARGETS = {2: 0.55, 4: 0.30}
SP_TRAFFIC_TOLERANCE = 0.10  # bytes counted at the communication calls vs the algorithm's formula


def summarize_sp(runs: list[dict], seq_lens: list[int], worlds: list[int], modes: list[str],
                 tps: list[int] = (1,)) -> dict:
    """Rows per (mode, T, N, length), memory growth per (mode, N) and its ratio to N = 1 (tensor parallel T = 1 runs),
    and the design goals."""
    by_key = {(r["mode"], r.get("tensor_parallel", 1), r["world"], r["seq_len"]): r for r in runs}
    rows = []
    for mode in modes:
        for tp in tps:
            for world in worlds:
                for seq_len in seq_lens:
                    run = by_key.get((mode, tp, world, seq_len), {"ok": False, "error": "not run"})
                    ok = run["ok"]
                    get = lambda key: run.get(key) if ok else None  # noqa: E731
                    rows.append({"mode": mode, "tp": tp, "world": world, "seq_len": seq_len,
                                 "step_mib": get("step_mib"), "peak_mib": get("peak_mib"), "step_s": get("median_s"), "tok_s": get("tokens_per_s"),
                                 "sent_mib": get("sent_mib"), "theory_mib": get("theory_mib"),
                                 "sent_over_theory": get("sent_over_theory"),
                                 "grad_allreduce_mib": None if not ok else run["grad_allreduce_payload_bytes"] / 2**20,
                                 "status": "ok" if ok else "failed: " + run["error"]})
    small, large = min(seq_lens), max(seq_lens)
    growth = {}
    for mode in modes:
        per = {}
        for world in worlds:
            lo, hi = (by_key.get((mode, 1, world, n), {}) for n in (small, large))
            if lo.get("ok") and hi.get("ok") and large > small:
                per[world] = (hi["step_mib"] - lo["step_mib"]) / ((large - small) / 1024)  # MiB per 1K tokens
        growth[mode] = {"mib_per_1k_tokens": per,
                        "ratio_to_sp1": {w: _ratio(g, per.get(1)) for w, g in per.items()}}
    targets = {}
    for mode in modes:
        for world, limit in SP_GROWTH_TARGETS.items():
            if world in worlds:
                targets[f"{mode}_growth_ratio_sp{world}"] = _target(
                    f"{mode} memory growth per 1K tokens per rank, N={world} / N=1", limit,
                    growth[mode]["ratio_to_sp1"].get(world))
    deviations = [abs(r["sent_over_theory"] - 1) for r in rows if r["sent_over_theory"] is not None]
    targets["traffic_vs_theory"] = _target("bytes sent vs the algorithm's volume, largest |sent / theory - 1|",
                                           SP_TRAFFIC_TOLERANCE, max(deviations, default=None))
    return {"rows": rows, "growth": {"from_seq_len": small, "to_seq_len": large, **growth}, "targets": targets}


def format_sp_report(summary: dict) -> str:
    cols = [("mode", "mode", "s"), ("TP", "tp", "d"), ("N", "world", "d"), ("seq_len", "seq_len", "d"),
            ("MiB/rank", "step_mib", ".1f"), ("peak MiB", "peak_mib", ".1f"), ("s/step", "step_s", ".2f"), ("tok/s", "tok_s", ".0f"),
            ("sent MiB", "sent_mib", ".1f"), ("theory MiB", "theory_mib", ".1f"),
            ("sent/theory", "sent_over_theory", ".4f")]
    widths = [max(len(title), 8) for title, _, _ in cols]
    lines = ["  ".join(title.rjust(w) for (title, _, _), w in zip(cols, widths))]
    for row in summary["rows"]:
        lines.append("  ".join(_fmt(row[key], spec).rjust(w) for (_, key, spec), w in zip(cols, widths)))
    lines.append("MiB/rank: what a step adds at its peak, max over ranks; peak MiB: a rank's whole peak (weights, "
                 "libraries), max over ranks; sent: bytes per rank per step through the ring P2P / "
                 "Ulysses all-to-all (gradient all-reduce and tensor-parallel all-reduces excluded); TP x N processes")
    for row in summary["rows"]:
        if row["status"] != "ok":
            lines.append(f"  {row['mode']} TP={row['tp']} N={row['world']} @ {row['seq_len']}: {row['status']}")
    g = summary["growth"]
    if g["from_seq_len"] == g["to_seq_len"]:
        lines.append("memory growth: needs at least two lengths")
    for mode in (k for k in g if k not in ("from_seq_len", "to_seq_len")):
        per, ratio = g[mode]["mib_per_1k_tokens"], g[mode]["ratio_to_sp1"]
        parts = [f"N={w}: {per[w]:.2f} ({_fmt(ratio[w], '.3f')}x N=1)" for w in per]
        if parts:
            lines.append(f"memory growth {mode} {g['from_seq_len']} -> {g['to_seq_len']} (MiB per 1K tokens per rank): "
                         + ", ".join(parts))
    lines += _goal_lines(summary["targets"])
    return "\n".join(lines)


def package_version(name: str) -> str | None:
    """The installed version of a distribution, None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(args: argparse.Namespace, model_config: dict, runs: list[dict], probe: dict | None) -> dict:
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
        "torch": torch.__version__, "transformers": package_version("transformers"), "peft": package_version("peft"),
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
