"""The recipe study of docs/evaluation.md ("Extending 8x and 16x"): the kinds of RoPE scaling side by side at 8x and 16x
on the bundled tiny llama, and what held the default recipe at 16x, generated from the committed runs in
docs/recipe-study/<cpu kind>/<name>/.

    python tests/recipe_study.py --run NAME     # train and evaluate one row (minutes; one at a time on a shared CPU)
    python tests/recipe_study.py --write        # regenerate the page's <!-- recipe-study --> block
    python tests/recipe_study.py                # print it

A row is `python -m train.qlora` with the row's flags (RUNS) into docs/recipe-study/<cpu kind>/NAME: its own passkey
evaluation before and after at its --eval_lengths (eval.json), then `python -m train.eval --adapter` at the other
LENGTHS (eval_results.json), 5 depths x 10 trials each. Kept: eval.json, eval_results.json, metrics.jsonl,
run_info.json and machine.json, the machine's 1-minute load average sampled every LOAD_EVERY seconds while the row
ran (the run itself is one of the busy threads). The CPU's kernels change the arithmetic (tests/readme_figures.py
CPU_KINDS), so rows belong to the kind that ran them. tests/test_recipe_study.py holds the page to the outputs and
re-runs the 16x preset's first steps against its committed row.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STUDY = REPO / "docs" / "recipe-study"
PAGE = REPO / "docs" / "evaluation.md"
KIND = "avx2"  # the kind the committed rows ran on (this 2-core machine)
PRESET_16X = "configs/tiny-llama-16x.yaml"
LENGTHS = (1024, 2048, 4096)  # every row is evaluated at each
LOAD_EVERY = 10.0
KEEP = ("eval.json", "eval_results.json", "metrics.jsonl", "run_info.json", "machine.json")

# name -> flags of `python -m train.qlora`, for the rows committed. 8x: the default run (configs/default.yaml) with
# another --rope_scaling; 16x: the 16x preset with another --rope_scaling.
RUNS = {
    "8x-linear": ["--rope_scaling", "linear"],
    "8x-dynamic": ["--rope_scaling", "dynamic"],
    "8x-yarn": [],
    "8x-llama3": ["--rope_scaling", "llama3"],
    "16x-linear": ["--config", PRESET_16X, "--rope_scaling", "linear"],
    "16x-dynamic": ["--config", PRESET_16X, "--rope_scaling", "dynamic"],
    "16x-yarn": ["--config", PRESET_16X],
    "16x-llama3": ["--config", PRESET_16X, "--rope_scaling", "llama3"],
}
# Rows not run yet (`--run NAME` runs one; move it to RUNS with its outputs): what the 16x preset changed from the
# default run, one at a time.
TO_RUN = {
    "16x-yarn-rows4096": ["--config", PRESET_16X, "--max_seq_len", "4096"],
    "16x-yarn-lr1e-3-300": ["--config", PRESET_16X, "--learning_rate", "1e-3", "--max_steps", "300"],
    "16x-default-recipe": ["--max_seq_len", "4096"],
}


def row_dir(name: str, kind: str = KIND) -> Path:
    return STUDY / kind / name


def _sample_load(samples: list[float], stop: threading.Event) -> None:
    while not stop.wait(LOAD_EVERY):
        samples.append(os.getloadavg()[0])


def run_row(name: str) -> None:
    """Train and evaluate one row into its directory (replacing it), keeping KEEP."""
    out, flags = row_dir(name), {**RUNS, **TO_RUN}[name]
    command = [sys.executable, "-m", "train.qlora", *flags, "--output_dir", str(out.relative_to(REPO)),
               "--overwrite_output_dir"]
    samples, stop = [os.getloadavg()[0]], threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(samples, stop), daemon=True)
    sampler.start()
    started = time.time()
    subprocess.run(command, cwd=REPO, check=True)
    trained = time.time()
    args = json.loads((out / "run_info.json").read_text())["args"]
    own = args["eval_lengths"] or [args["max_seq_len"]]
    others = [str(n) for n in LENGTHS if n not in own]
    subprocess.run([sys.executable, "-m", "train.eval", "--adapter", str(out), "--lengths", *others,
                    "--output_json", str(out / "eval_results.json")], cwd=REPO, check=True)
    stop.set()
    sampler.join()
    (out / "machine.json").write_text(json.dumps({
        "command": "python -m train.qlora " + " ".join(flags), "cpu_kind": KIND, "cores": os.cpu_count(),
        "train_seconds": round(trained - started, 1), "eval_seconds": round(time.time() - trained, 1),
        "load_1min": {"mean": round(sum(samples) / len(samples), 2), "max": round(max(samples), 2),
                      "samples": len(samples), "every_s": LOAD_EVERY}}, indent=1) + "\n")
    for path in out.iterdir():
        if path.name not in KEEP:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def read_row(name: str, kind: str = KIND) -> dict:
    where = row_dir(name, kind)
    return {f: json.loads((where / f).read_text()) for f in ("eval.json", "eval_results.json", "run_info.json",
                                                             "machine.json")} | {
        "metrics": [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines() if line.strip()]}


def _by_length(row: dict) -> dict[int, dict]:
    """The after-training passkey result at each length: the run's own, then train.eval's."""
    found = {}
    for source in (row["eval_results.json"]["tasks"]["passkey"], row["eval.json"]["after"]):
        for length, accuracy in source["by_length"].items():
            found[int(length)] = {"accuracy": accuracy, "by_depth": source["by_length_depth"][length]}
    return found


def _recipe(info: dict) -> str:
    args, rope = info["args"], info["rope_parameters"]
    return (f"{rope['rope_type']} x{rope['factor']:g}, rows of {args['max_seq_len']}, lr {args['learning_rate']:g}, "
            f"{info['steps']} steps")


def study_block(kind: str = KIND) -> str:
    header = ["run", "RoPE, rows, lr, steps", *(f"after at {n}" for n in LENGTHS), "at the run's length by depth "
              "0 / 0.25 / 0.5 / 0.75 / 1", "before", "answer loss, last 50 steps", "wall time (load)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in RUNS:
        row = read_row(name, kind)
        info, machine, after = row["run_info.json"], row["machine.json"], _by_length(row)
        own = int(next(iter(row["eval.json"]["after"]["by_length"])))
        last = [r["loss"] for r in row["metrics"] if r["step"] > info["steps"] - 50]
        load = machine["load_1min"]
        cells = [f"`{name}`", _recipe(info), *(f"{after[n]['accuracy']:.2f}" for n in LENGTHS),
                 f"{own}: " + " / ".join(f"{a:.1f}" for a in after[own]["by_depth"].values()),
                 f"{row['eval.json']['before']['accuracy']:.2f}", f"{sum(last) / len(last):.3f}",
                 f"{info['wall_time_s']:.0f} s ({load['mean']:.1f}, max {load['max']:.1f})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def block(text: str) -> str:
    import re

    return re.search(r"<!-- recipe-study -->\n(.*?)\n<!-- /recipe-study -->", text, re.S).group(1)


def write(text: str) -> str:
    start, end = "<!-- recipe-study -->\n", "\n<!-- /recipe-study -->"
    head, rest = text.split(start, 1)
    return head + start + study_block() + end + rest.split(end, 1)[1]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"]:
        for name in sys.argv[2:]:
            run_row(name)
    elif sys.argv[1:] == ["--write"]:
        PAGE.write_text(write(PAGE.read_text()))
    else:
        print(study_block())
