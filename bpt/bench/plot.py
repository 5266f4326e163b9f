"""Draw a --simulate report: simulated peak memory against sequence length, per side and layout (one GPU's peak of
a --sequence_parallel run against the whole sequence's length), with the device's capacity, its usable part and
each line's longest fitting length marked.

    python -m bpt.bench.plot docs/bench/llama-3.1-8b-qlora-h100.json [more.json ...] [--output docs/bench/X.png]

Without --output the picture goes beside the first JSON, its name with .png (llama-3.1-8b-qlora-h100.png).

Needs matplotlib (pip install matplotlib); nothing else in the toolkit does.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GIB = 1 << 30


def plot(report: dict, output: Path) -> None:
    from bpt.bench.simulated_sweep import layout_name

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("drawing needs matplotlib: pip install matplotlib")
    env = report["environment"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    colors = {"stock": "tab:red", "patched": "tab:blue", "patched+offload": "tab:green"}
    layouts = sorted({(r["side"], r.get("sequence_parallel", 1), r.get("sp_mode")) for r in report["runs"]},
                     key=lambda layout: (layout[1], list(colors).index(layout[0]) if layout[0] in colors else 9))
    for side, world, mode in layouts:
        runs = sorted((r for r in report["runs"] if (r["side"], r.get("sequence_parallel", 1), r.get("sp_mode"))
                       == (side, world, mode) and r["ok"]), key=lambda r: r["seq_len"])
        if not runs or side not in colors:
            continue
        color, name = colors[side], layout_name(side, world, mode)
        label = f"{side} (simulated)" if world == 1 else f"{side}, {world} GPUs, {mode}: one GPU's (simulated)"
        ax.plot([r["seq_len"] / 1024 for r in runs], [r["peak_bytes"] / GIB for r in runs],
                "o-" if world == 1 else "s:", color=color, label=label, markersize=4)
        longest = report["find_max"].get(name, {}).get("max_context_tokens")
        at = next((r for r in runs if r["seq_len"] == longest), None)
        if at is not None:
            ax.plot([longest / 1024], [at["peak_bytes"] / GIB], "*", color=color, markersize=14)
            ax.annotate(f"max {longest // 1024}K", (longest / 1024, at["peak_bytes"] / GIB), color=color,
                        textcoords="offset points", xytext=(6, -14))
    ax.set_xscale("log", base=2)
    lengths = sorted({r["seq_len"] for r in report["runs"] if r["phase"] == "sweep"})
    ax.set_xticks([n / 1024 for n in lengths], [f"{n // 1024}K" for n in lengths])
    ax.minorticks_off()
    if env.get("memory_bytes"):
        on_left = ax.get_yaxis_transform()  # x in axes fraction, y in data
        ax.axhline(env["memory_bytes"] / GIB, color="black", linewidth=1)
        ax.text(0.01, env["memory_bytes"] / GIB, f"{env['memory_bytes'] / GIB:.1f} GiB device", va="bottom",
                transform=on_left)
        ax.axhline(env["usable_bytes"] / GIB, color="gray", linestyle="--", linewidth=1)
        ax.text(0.01, env["usable_bytes"] / GIB, "usable: minus the uncalibrated reserve", va="top", color="gray",
                transform=on_left)
    ax.set_xlabel("sequence length (tokens, batch 1; split over the GPUs of a sequence-parallel line)")
    ax.set_ylabel("peak allocated memory (GiB)")
    bits = {4: "4-bit NF4 base (QLoRA)", 16: "bf16 weights", 32: "fp32 weights"}[env["bits"]]
    lora = f"LoRA r={env['lora_r']}" if env.get("lora") else "full fine-tune"
    ax.set_title(f"{env['model']} on {env['device']}: {bits}, {lora},\nbf16 autocast, gradient checkpointing, "
                 "one forward + backward", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, 0.9))
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bpt.bench.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", type=Path, nargs="+",
                   help="JSONs written by python -m bpt.bench --simulate ... --output (several: the same model and "
                        "device, e.g. one per side; drawn together)")
    p.add_argument("--output", type=Path, default=None,
                   help="PNG to write (default: beside the first report, its name with .png)")
    args = p.parse_args(argv)
    output = args.output or args.reports[0].with_suffix(".png")
    reports = [json.loads(path.read_text()) for path in args.reports]
    for path, report in zip(args.reports, reports):
        if not report.get("environment", {}).get("simulated"):
            p.error(f"{path} is not a --simulate report")
    report = {"environment": reports[0]["environment"], "runs": [r for rep in reports for r in rep["runs"]],
              "find_max": {side: found for rep in reports for side, found in rep["find_max"].items()}}
    plot(report, output)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
