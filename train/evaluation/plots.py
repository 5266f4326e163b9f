"""Pictures of a run, written beside its files: the loss curve (metrics.jsonl) and, per evaluated task, a length x
depth accuracy heatmap (before and after training side by side when both exist).

    loss.png                     training loss by step (train.qlora; train.eval --adapter for a run that has none)
    accuracy_<task>.png          eval.json's "before" / "after" (train.qlora)
    <results>_accuracy_<task>.png  python -m train.eval's results, beside its JSON (with --adapter, next to the run's
                                 "before")

matplotlib is optional: without it a run says so in one line and writes no pictures. Only matplotlib's object API
is used (no pyplot), so no display or global backend is touched.
"""
from __future__ import annotations

import json
import os
import sys

LOSS_PNG = "loss.png"
MISSING = "note: matplotlib is not installed, so no pictures were written (pip install matplotlib)"


def heatmap_name(task: str, prefix: str = "") -> str:
    return f"{prefix}accuracy_{task}.png"


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(MISSING, file=sys.stderr)
        return None
    return Figure


def task_results(entry: dict | None) -> dict:
    """{task: result} of one evaluation (an eval.json "before"/"after" or train.eval's results); an entry written
    before there were tasks holds passkey's result alone."""
    if not entry:
        return {}
    if "tasks" in entry:
        return entry["tasks"]
    return {"passkey": entry} if "by_length_depth" in entry else {}


def plot_loss(Figure, metrics_path: str, png: str) -> bool:
    """The loss of every logged step; False (nothing written) when there is no metrics file or no step."""
    if not os.path.isfile(metrics_path):
        return False
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    records = [r for r in records if r.get("loss") is not None]
    if not records:
        return False
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    losses = [r["loss"] for r in records]
    ax.plot([r["step"] for r in records], losses, marker="o" if len(records) < 30 else None)
    # A loss that falls by orders of magnitude (an answer-only passkey loss ends near 1e-3) is flat on a linear axis.
    log = min(losses) > 0 and max(losses) / min(losses) > 20
    if log:
        ax.set_yscale("log")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at 1.25 over a 3-step run
    ax.set(xlabel="step", ylabel="training loss" + (" (log scale)" if log else ""), title="loss")
    ax.grid(alpha=0.3, which="both" if log else "major")
    fig.savefig(png, dpi=100)
    return True


def plot_accuracy(Figure, panels: dict, task: str, png: str) -> None:
    """One heatmap per panel (label -> result with "by_length_depth"), side by side: rows lengths, columns depths,
    cells the accuracy, written as numbers too (red 0 to green 1, so a glance tells failure from success)."""
    first = next(iter(panels.values()))["by_length_depth"]
    rows, columns = len(first), len(next(iter(first.values())))
    # Cells of about the same size whatever the grid: one length is a strip, not a tall block.
    fig = Figure(figsize=(max(3.0, 0.75 * columns + 1.2) * len(panels) + 1.0, 0.55 * rows + 1.6), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    image = None
    for ax, (label, result) in zip(axes, panels.items()):
        table = result["by_length_depth"]
        lengths = list(table)
        depths = list(next(iter(table.values())))
        grid = [[table[length][depth] for depth in depths] for length in lengths]
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{float(d):g}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(length) for length in lengths])
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=12,
                        color="white" if value < 0.15 or value > 0.85 else "black")  # the map's dark ends
        ax.set(xlabel="needle depth", ylabel="context length", title=f"{label}: {result['accuracy']:.2f}")
    fig.suptitle(f"{task} accuracy by context length x depth")
    fig.colorbar(image, ax=list(axes), label="accuracy")
    fig.savefig(png, dpi=100)


def write_run_pictures(output_dir: str, evals: dict | None, metrics_file: str = "metrics.jsonl") -> list[str]:
    """loss.png and accuracy_<task>.png (eval.json's "before" / "after" side by side) in a run's output_dir."""
    Figure = _figure_class()
    if Figure is None:
        return []
    written = []
    loss_png = os.path.join(output_dir, LOSS_PNG)
    if plot_loss(Figure, os.path.join(output_dir, metrics_file), loss_png):
        written.append(loss_png)
    panels = {f"{when} training": task_results((evals or {}).get(when)) for when in ("before", "after")}
    written += _heatmaps(Figure, panels, output_dir, "")
    return written


def write_eval_pictures(results: dict, output_json: str, before: dict | None = None) -> list[str]:
    """<results>_accuracy_<task>.png beside train.eval's results JSON; `before`: the run's own eval.json "before",
    drawn beside this evaluation when it has the task."""
    Figure = _figure_class()
    if Figure is None:
        return []
    directory = os.path.dirname(output_json) or "."
    prefix = os.path.splitext(os.path.basename(output_json))[0] + "_"
    return _heatmaps(Figure, {"before (eval.json)": task_results(before), "evaluated": task_results(results)},
                     directory, prefix, main_label="evaluated")


def _heatmaps(Figure, by_label: dict, directory: str, prefix: str, main_label: str | None = None) -> list[str]:
    tasks = [task for results in by_label.values() for task in results]
    if main_label is not None:  # only the tasks of this evaluation, the earlier one beside them
        tasks = list(by_label[main_label])
    written = []
    for task in dict.fromkeys(tasks):
        panels = {label: results[task] for label, results in by_label.items() if task in results}
        png = os.path.join(directory, heatmap_name(task, prefix))
        plot_accuracy(Figure, panels, task, png)
        written.append(png)
    return written
