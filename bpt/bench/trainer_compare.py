"""How far two finished `python -m train.qlora` runs of one command lie apart (bpt.bench.trainer_check): their final
adapters tensor by tensor, their metrics.jsonl row by row (loss and gradient norm at each logged step; time and memory
are each process's own and not compared) and their eval.json "after" results.

A resumed run should land where the uninterrupted one did. Bitwise where the card's kernels are deterministic; where
they are not (atomics in a fused attention backward, say), two uninterrupted runs of the same command already differ,
and the resumed run must be no further from the first run than the second run is, within WORSE_AT_MOST (the rule the
tests hold low-precision results to: tests/test_mixed_precision.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

ADAPTER_FILE = "adapter_model.safetensors"
WORSE_AT_MOST = 1.5


def _rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row for row in rows}


def _relative(a: float, b: float) -> float:
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b), 1e-12)


def adapters_apart(a: Path, b: Path) -> dict:
    """Bitwise equality, and the relative norm and largest element of the difference, over the adapters' tensors."""
    from safetensors.torch import load_file

    x, y = load_file(str(a / ADAPTER_FILE)), load_file(str(b / ADAPTER_FILE))
    if set(x) != set(y) or any(x[k].shape != y[k].shape for k in x):
        return {"comparable": False, "error": f"{a} and {b} hold different tensors"}
    squared = sum((x[k].double() - y[k].double()).pow(2).sum().item() for k in x)
    norm = sum(x[k].double().pow(2).sum().item() for k in x)
    return {"comparable": True, "tensors": len(x), "bitwise": all(bool((x[k] == y[k]).all()) for k in x),
            "relative_norm": math.sqrt(squared / norm) if norm else math.sqrt(squared),
            "max_abs": max((x[k].double() - y[k].double()).abs().max().item() for k in x)}


def metrics_apart(a: Path, b: Path) -> dict:
    """The logged steps, tokens and learning rates must agree exactly; loss and gradient norm: the largest relative
    difference over the rows."""
    x, y = _rows(a), _rows(b)
    if sorted(x) != sorted(y):
        return {"comparable": False, "error": f"logged steps differ: {sorted(x)} vs {sorted(y)}"}
    if any(x[s]["tokens"] != y[s]["tokens"] or x[s]["lr"] != y[s]["lr"] for s in x):
        return {"comparable": False, "error": "tokens or learning rates differ at the same step"}
    loss = max(_relative(x[s]["loss"], y[s]["loss"]) for s in x)
    grad = max(_relative(x[s].get("grad_norm") or 0.0, y[s].get("grad_norm") or 0.0) for s in x)
    return {"comparable": True, "rows": len(x), "bitwise": loss == grad == 0.0, "loss_max_relative": loss,
            "grad_norm_max_relative": grad}


def evals_apart(a: Path, b: Path) -> dict:
    """Whether the "after" evaluations give the same answers cell by cell, and each one's accuracy."""
    x, y = (json.loads((out / "eval.json").read_text()).get("after") or {} for out in (a, b))
    return {"same_cells": x.get("tasks") == y.get("tasks"), "accuracy": [x.get("accuracy"), y.get("accuracy")]}


def apart(a: Path, b: Path) -> dict:
    return {"adapter": adapters_apart(a, b), "metrics": metrics_apart(a, b), "eval": evals_apart(a, b)}


def resume_verdict(resumed: dict, again: dict) -> dict:
    """Whether the resumed run (`resumed`: apart(run, resumed)) lands where the run did, measured against what a second
    uninterrupted run does (`again`: apart(run, again))."""
    parts = (resumed["adapter"], resumed["metrics"], again["adapter"], again["metrics"])
    if not all(p.get("comparable") for p in parts):
        return {"matches": False, "how": "not comparable: " + "; ".join(p["error"] for p in parts if "error" in p)}
    if again["adapter"]["bitwise"] and again["metrics"]["bitwise"]:
        same = resumed["adapter"]["bitwise"] and resumed["metrics"]["bitwise"]
        return {"matches": same, "how": "bitwise (two uninterrupted runs are bitwise equal on this device)"}
    bounds = {"adapter relative norm": (resumed["adapter"]["relative_norm"], again["adapter"]["relative_norm"]),
              "loss": (resumed["metrics"]["loss_max_relative"], again["metrics"]["loss_max_relative"])}
    over = [f"{name} {got:.3g} > {WORSE_AT_MOST} x {spread:.3g}" for name, (got, spread) in bounds.items()
            if got > WORSE_AT_MOST * spread]
    return {"matches": not over, "how": f"within {WORSE_AT_MOST} x the spread of two uninterrupted runs (not bitwise "
                                        "on this device)" + (f": {'; '.join(over)}" if over else "")}
