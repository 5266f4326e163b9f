"""The README's figures from runs, generated from the committed outputs they come from.

`python tests/readme_figures.py` prints the blocks; `--write` replaces them in the README between their markers
(tests/test_readme_figures.py asserts the README agrees, and that the committed outputs are what this checkout
prints now). Two blocks:

- `<!-- default-run -->`: the default run's passkey table, from `docs/default-run/<cpu kind>/eval.json` and
  `run_info.json`. The CPU's kernels change the arithmetic (AVX512-BF16 rounds bf16 otherwise than AVX2), so the
  run's figures belong to the kind of CPU that printed them: one committed run per kind, each row saying which.
- `<!-- plan -->`: `python -m train.qlora --config configs/llama-8b-64k.yaml --plan h100-80gb`, from its committed
  output `docs/plan/llama-8b-64k-h100-80gb.txt`.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DEFAULT_RUN = REPO / "docs" / "default-run"
PLAN_OUTPUT = REPO / "docs" / "plan" / "llama-8b-64k-h100-80gb.txt"
# The CPU kinds a default run is committed for: directory -> how the README names it.
CPU_KINDS = {"avx512_bf16": "AVX512-BF16", "avx2": "AVX2 (`ATEN_CPU_CAPABILITY=avx2`)"}


def cpu_kind() -> str | None:
    """This process's kind of CPU kernels, as CPU_KINDS names it (None: a kind with no committed run)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX2":
        return "avx2"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" if capability == "AVX512" and "avx512_bf16" in flags else None


def read_run(kind: str) -> tuple[dict, dict]:
    """(eval.json, run_info.json) of the committed default run of a CPU kind."""
    return (json.loads((DEFAULT_RUN / kind / "eval.json").read_text()),
            json.loads((DEFAULT_RUN / kind / "run_info.json").read_text()))


def _row(label: str, result: dict) -> str:
    (length, by_depth), = result["by_length_depth"].items()
    cells = [f"{acc:.2f}" for acc in by_depth.values()]
    return f"| {label} | {' | '.join(cells)} | {result['accuracy']:.2f} |"


def default_run_block() -> str:
    runs = {kind: read_run(kind) for kind in CPU_KINDS}
    evals = {kind: e for kind, (e, _) in runs.items()}
    first_kind = next(iter(evals))
    (length, by_depth), = evals[first_kind]["after"]["by_length_depth"].items()
    steps = next(iter(runs.values()))[1]["steps"]
    lines = [f"| passkey accuracy at {length} | " + " | ".join(f"depth {d:g}" if i == 0 else f"{d:g}"
                                                             for i, d in enumerate(map(float, by_depth)))
             + " | all |", "|" + "---|" * (len(by_depth) + 2)]
    for when, label in (("before", "before training (YaRN x8 alone)"), ("after", f"after {steps} steps")):
        results = {kind: e[when] for kind, e in evals.items()}
        if all(r == results[first_kind] for r in results.values()):  # the kernels agree on every cell
            lines.append(_row(f"{label}, either CPU", results[first_kind]))
        else:
            lines += [_row(f"{label}, {CPU_KINDS[kind]}", r) for kind, r in results.items()]
    times = "; ".join(f"{CPU_KINDS[kind].split()[0]} {info['wall_time_s']:.0f} s"
                      for kind, (_, info) in runs.items())
    lines += ["", f"Wall time of the whole run (`run_info.json`, the 2-core machine these come from): {times}."]
    return "\n".join(lines)


def plan_figures() -> dict:
    """The committed plan output's peak, verdict and longest length."""
    text = PLAN_OUTPUT.read_text()
    return {"peak": re.search(r"^  peak +(\S+ \S+) per device", text, re.M).group(1),
            "verdict": re.search(r"^  verdict +(FITS|DOES NOT FIT)", text, re.M).group(1),
            "longest": int(re.search(r"^  longest +--max_seq_len (\d+) fits", text, re.M).group(1)),
            "seconds": int(re.search(r"steps? in (\d+) s$", text, re.M).group(1))}


def plan_block() -> str:
    p = plan_figures()
    verdict = "fits on" if p["verdict"] == "FITS" else "does not fit on"
    return (f"(simulated: {p['peak']} per device, {verdict} h100-80gb; longest --max_seq_len {p['longest']:,}; "
            f"{p['seconds']} s on the 2-core machine, `{PLAN_OUTPUT.relative_to(REPO)}`)")


BLOCKS = {"default-run": default_run_block, "plan": plan_block}


def readme_block(text: str, name: str) -> str:
    """The text between the block's markers (a block on lines of its own: without the newlines around it)."""
    return re.search(rf"<!-- {name} -->\n?(.*?)\n?<!-- /{name} -->", text, re.S).group(1)


def write(text: str) -> str:
    for name, block in BLOCKS.items():
        text = re.sub(rf"<!-- {name} -->(\n?).*?(\n?)<!-- /{name} -->",
                      lambda m, b=block(): f"<!-- {name} -->{m.group(1)}{b}{m.group(1)}<!-- /{name} -->", text,
                      flags=re.S)
    return text


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        README.write_text(write(README.read_text()))
    else:
        print("\n\n".join(block() for block in BLOCKS.values()))
