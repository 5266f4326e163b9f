"""The figures from runs in the README and the docs/ pages, generated from the committed outputs they come from.

`python tests/readme_figures.py` prints the blocks; `--write` replaces them between their markers in whichever page
holds them (README.md or docs/*.md; tests/test_readme_figures.py asserts each page agrees, and that the committed
outputs are what this checkout prints now). The blocks:

- `<!-- default-run -->` (README): the default run's passkey table, from `docs/default-run/<cpu kind>/eval.json` and
  `run_info.json`. The CPU's kernels change the arithmetic (AVX512-BF16 rounds bf16 otherwise than AVX2), so the
  run's figures belong to the kind of CPU that printed them: one committed run per kind, each row saying which.
- `<!-- plan -->` (docs/training.md): `python -m train.qlora --config configs/llama-8b-64k.yaml --plan h100-80gb`,
  from its committed output `docs/plan/llama-8b-64k-h100-80gb.txt`.
- `<!-- bench-* -->` (docs/benchmark.md): the benchmark's tables, from the committed bench outputs in docs/bench/
  (`--simulate` Llama-3.1-8B QLoRA, the H100 `--gpu_check`'s memory and speed, sequence parallel without and with
  tensor parallel).

The figures the pages' sentences quote from docs/bench/ are not generated: `stated()` gives each as the phrase
that states it, and the test asserts the pages have them.
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


def pages() -> list[Path]:
    """The README and the docs/ pages: where the blocks and the stated figures live."""
    return [README, *sorted((REPO / "docs").glob("*.md"))]


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


BENCH = REPO / "docs" / "bench"
GIB, MIB = 1 << 30, 1 << 20


def bench(name: str) -> dict:
    return json.loads((BENCH / f"{name}.json").read_text())


def gib(n_bytes: float, digits: int = 2) -> str:
    return f"{n_bytes / GIB:.{digits}f}"


def mib(value: float) -> str:
    """A MiB figure as the tables give it: one decimal, zero as 0."""
    return "0" if value == 0 else f"{value:.1f}"


def k(tokens: int) -> str:
    return f"{tokens // 1024}K"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; an empty cell is written `| |`."""
    lines = ["|" + "|".join(f" {c} " if c else " " for c in cells) + "|" for cells in [header, *rows]]
    return "\n".join([lines[0], "|" + "---|" * len(header), *lines[1:]])


def round_length(n: int) -> bool:
    """A sweep length the tables show: a power of two (the others bracket a --find_max, whose longest has its row)."""
    return n & (n - 1) == 0


def qlora_block() -> str:
    """The simulated Llama-3.1-8B QLoRA table: the sweep of `llama-3.1-8b-qlora-h100.json`, the offload rows of
    `llama-3.1-8b-qlora-offload-h100.json`, each side's `--find_max`."""
    sweep, offload = bench("llama-3.1-8b-qlora-h100"), bench("llama-3.1-8b-qlora-offload-h100")
    peaks = {(r["side"], r["seq_len"]): r for r in sweep["runs"] if r["phase"] == "sweep"}
    rows = [[k(n), *(f"{gib(peaks[side, n]['peak_bytes'])} GiB" for side in ("stock", "patched")), ""]
            for n in sorted({n for _, n in peaks})]
    rows += [[k(r["seq_len"]), "", "", f"{gib(r['peak_bytes'])} GiB on the device, {gib(r['host_peak_bytes'])} GiB "
              "of host memory"] for r in offload["runs"] if r["phase"] == "sweep" and round_length(r["seq_len"])]
    rows.append(["longest that fits (`--find_max`)",
                 *(f"{found[side]['max_context_tokens']:,}" for found, side in
                   ((sweep["find_max"], "stock"), (sweep["find_max"], "patched"),
                    (offload["find_max"], "patched+offload")))])
    return table(["tokens", "stock", "patched", "patched + checkpoint offload"], rows)


# How the GPU check's tables name a side (side, bits).
GPU_SIDES = {("stock", 16): "stock", ("patched", 16): "patched", ("patched+offload", 16): "patched+offload",
             ("liger", 16): "Liger-Kernel"}


def gpu_rows(part: str) -> dict:
    """The GPU check's cells of a part that ran, by (side, bits) in the check's order, then by length."""
    rows: dict = {}
    for r in bench("gpu_check-h100-80gb")[part]:
        if r["ok"]:
            rows.setdefault((r["side"], r["bits"]), {})[r["seq_len"]] = r
    return rows


def gpu_memory_block() -> str:
    rows = gpu_rows("memory")
    lengths = sorted({n for cells in rows.values() for n in cells})
    return table(["side", *(f"{k(n)} {what}" for n in lengths for what in ("measured", "simulated"))],
                 [[GPU_SIDES.get(side, f"{side[0]}, {side[1]}-bit (bitsandbytes / emulated)"),
                   *(f"{gib(cells[n][key])} GiB" if n in cells else "" for n in lengths
                     for key in ("measured_bytes", "simulated_bytes"))] for side, cells in rows.items()])


def gpu_speed_block() -> str:
    """Seconds per step (tokens/s); a side the memory table lacks (the peer) with its peak."""
    rows, in_memory = gpu_rows("speed"), gpu_rows("memory")
    lengths = sorted({n for cells in rows.values() for n in cells})

    def cell(r: dict, side) -> str:
        peak = "" if side in in_memory else f", {gib(r['peak_bytes'])} GiB"
        return f"{r['seconds_per_step']:.3f} s ({r['tokens_per_second']:,.0f}){peak}"
    return table(["side", *map(k, lengths)],
                 [[GPU_SIDES.get(side, f"{side[0]}, {side[1]}-bit"),
                   *(cell(cells[n], side) if n in cells else "" for n in lengths)] for side, cells in rows.items()])


def sent(r: dict) -> str:
    """The bytes a rank sent, and the algorithm's volume where they differ."""
    equal = r["sent_mib"] == r["theory_mib"]
    return mib(r["sent_mib"]) + ("" if equal else f" (theory {mib(r['theory_mib'])})")


def sequence_parallel_block() -> str:
    return table(["N", "tokens", "MiB/rank/step", "s/step", "sent MiB/rank/step", "theory MiB"],
                 [[str(r["world"]), str(r["seq_len"]), mib(r["step_mib"]), f"{r['step_s']:.1f}", mib(r["sent_mib"]),
                   mib(r["theory_mib"])] for r in bench("sequence_parallel_cpu")["summary"]["rows"]])


def sequence_parallel_tp_block() -> str:
    return table(["TP", "N", "processes", "MiB/rank/step", "whole peak MiB/rank", "s/step",
                  "sent MiB/rank/step (= theory)"],
                 [[str(r["tp"]), str(r["world"]), str(r["tp"] * r["world"]), mib(r["step_mib"]), mib(r["peak_mib"]),
                   f"{r['step_s']:.1f}", sent(r)] for r in bench("sequence_parallel_tp_cpu")["summary"]["rows"]])


def within(x: float) -> str:
    """The bound a page states for a small difference: x rounded up to one significant digit (1.8e-07 -> 2e-7)."""
    exponent = math.floor(math.log10(x))
    digit = math.ceil(round(x / 10 ** exponent, 9))
    return f"{digit}e{exponent}" if digit < 10 else f"1e{exponent + 1}"


def by_side(name: str) -> dict:
    """A bench output's runs by (side, length)."""
    return {(r["side"], r["seq_len"]): r for r in bench(name)["runs"]}


def stated_simulated() -> list[str]:
    config = bench("llama-3.1-8b-qlora-h100")["environment"]["model_config"]
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    floor = hidden * 2 * layers / 1024  # the bf16 layer checkpoints, KiB per token
    qlora = bench("llama-3.1-8b-qlora-h100")
    longest = qlora["find_max"]["patched"]["max_context_tokens"]  # at its longest: chunks at the sizes set
    patched = by_side("llama-3.1-8b-qlora-h100")["patched", longest]["bytes_per_token"] / 1024
    bf16 = by_side("llama-3.1-8b-bf16-lora-h100")["patched", 65536]
    offload = bench("llama-3.1-8b-qlora-offload-h100")["runs"][0]  # the sweep's million tokens
    fit, over = bench("llama-3.2-1b-qlora-offload-h100")["runs"]
    fits = {True: "fit", False: "do not"}
    biggest = max(h["bytes"] for h in offload["peak_holders"])
    offload_longest = bench("llama-3.1-8b-qlora-offload-h100")["find_max"]["patched+offload"]["max_context_tokens"]
    (kept,) = bench("llama-3.1-8b-qlora-offload-sp8-ulysses-8m-kept-h100")["runs"]  # eight GPUs within the host
    return [f"fits {kept['seq_len']:,} tokens within a 2 TiB machine's host memory (simulated: "
            f"{gib(kept['host_peak_bytes'])} GiB of host memory and a {gib(kept['peak_bytes'])} GiB peak per GPU, the "
            f"last {kept['offload_keep_last']} saved tensors kept on the device",
            f"bf16 [N, {hidden}] per layer: {floor:.0f} KiB per token over {layers} layers) plus one layer's working "
            f"set: {patched:.1f} KiB per token in all, {patched / floor:.2f}x that floor",
            f"(bf16 weights, 64K: {gib(bf16['peak_bytes'])} ->",
            f"{offload['bytes_per_token'] / 1024:.1f} KiB per token at {offload['seq_len']:,} tokens "
            f"({gib(offload['peak_bytes'])} GiB; 59.0 before",
            f"({gib(offload['host_peak_bytes'], 0)} GiB at {offload['seq_len']:,} tokens:",
            f"--seq_lens {fit['seq_len']} {over['seq_len']} --sides patched+offload",
            f"{fit['seq_len']:,} tokens {fits[fit['fits']]} ({gib(fit['peak_bytes'])} GiB on the device, "
            f"{gib(fit['host_peak_bytes'])} GiB of host memory), {over['seq_len']:,} {fits[over['fits']]} "
            f"({gib(over['peak_bytes'])} GiB)",
            f"{sum(h['bytes'] == biggest for h in offload['peak_holders'])} tensors of {gib(biggest, 0)} GiB each",
            f"With checkpoint offload the longest that fits is {offload_longest:,} tokens (simulated; "
            f"{gib(offload['host_peak_bytes'], 0)} GiB of host memory at {offload['seq_len'] // 2 ** 20}M)",
            f"The longest that fits with offload is now {offload_longest:,} tokens"]


def stated_gpu() -> list[str]:
    check = bench("gpu_check-h100-80gb")
    env, versions, tier = check["environment"], check["environment"]["versions"], check["cuda_tier"]
    clock = check["clock"]
    rows = {r["rows"]: r["flops_per_second"] for r in clock["matmul_by_rows"]}
    attention = [a["forward_backward_flops_per_second"] for a in clock["attention"]]
    memory = [r for cells in gpu_rows("memory").values() for r in cells.values()]
    extra = {(r["side"], r["bits"], r["seq_len"]): r["measured_bytes"] - r["simulated_bytes"] for r in memory}
    over = [r["measured_bytes"] / r["simulated_bytes"] - 1 for r in memory]
    patched_extra = sorted({f"{e / MIB:.0f}" for (side, *_), e in extra.items() if side == "patched"})
    nominal = bench("llama-3.1-8b-qlora-h100")["environment"]["memory_bytes"]  # simulated h100-80gb: nvidia-smi's
    # What the 2 GiB reserve covered: the memory the driver keeps from torch, the CUDA context, the allocator's excess.
    reserve_used = nominal - env["free_bytes_at_start"] + max(extra.values())
    speed = {side: cells for (side, bits), cells in gpu_rows("speed").items() if bits == 16}
    step = {(side, n): r["seconds_per_step"] for side, cells in speed.items() for n, r in cells.items()}
    peak = {(r["side"], r["seq_len"]): r["measured_bytes"] for r in memory if r["bits"] == 16}
    return [f"on one {env['gpu']} (driver {env['driver']}, CUDA {env['torch_cuda']}, torch {versions['torch']}, "
            f"transformers {versions['transformers']}, peft {versions['peft']}, bitsandbytes "
            f"{versions['bitsandbytes']}, liger-kernel {versions['liger-kernel']};",
            f"Every measured peak is {100 * min(over):.1f}-{100 * max(over):.1f}% above the simulated one "
            f"({'-'.join(patched_extra)} MiB on the patched rows)",
            f"the card gives torch {gib(env['memory_bytes'])} GiB of nvidia-smi's {gib(nominal)}, and a CUDA context "
            f"took {gib(env['memory_bytes'] - env['free_bytes_at_start'])} GiB more",
            f"one H100 used ~{gib(reserve_used)} GiB of it",
            f"~{gib(reserve_used)} GiB of it measured on one H100",
            f"At 8K the patched step takes {step['patched', 8192] / step['stock', 8192]:.2f}x stock's time and "
            f"{step['patched', 8192] / step['liger', 8192]:.2f}x Liger's",
            f"at 32K {step['patched', 32768] / step['stock', 32768]:.2f}x stock's, with "
            f"{peak['stock', 32768] / peak['patched', 32768]:.1f}x less memory",
            f"patched+offload {step['patched+offload', 8192]:.3f} s at 8K",
            *(f"{side}: {p['kernel_launches']:,} kernels ({p['aten_calls']:,} aten calls), "
              f"{p['kernel_seconds']:.3f} s of kernel time, the GPU busy {p['kernel_seconds'] / step[side, 8192]:.0%}"
              for side, p in profiles(8192).items()),
            f"{clock['dispatch']['host_seconds_per_op'] * 1e6:.1f} us of host time per small op",
            f"bf16 matmul {clock['matmul']['bfloat16'] / 1e12:.0f} TFLOP/s at 8192^3, "
            f"{rows[256] / 1e12:.0f} TFLOP/s for 256 rows of the 8B MLP's shape and {rows[2048] / 1e12:.0f} for 2048, "
            f"copies {clock['copy_bytes_per_second'] / 1e9:,.0f} GB/s, causal grouped SDPA "
            f"{min(attention) / 1e12:.0f}-{max(attention) / 1e12:.0f} TFLOP/s forward+backward, pinned host link "
            f"{clock['host_link']['host_to_device_pinned'] / 1e9:.0f} GB/s each way",
            f"of the CUDA tier {tier['passed'] + tier['failed'] + tier['skipped'] + tier['errors']} of its tests ran "
            f"({tier['passed']} passed;"]


def stated_gpu_context() -> list[str]:
    """The second GPU check: its CUDA tier's count, and the longest-context cells measured beside the simulation."""
    check = bench("gpu_check-h100-80gb-2")
    tier, context = check["cuda_tier"], check["max_context"]["patched"]
    simulated = {r["seq_len"]: r["simulated_bytes"] for r in bench("gpu_check-h100-80gb-2-simulated")["rows"]}
    rows = [t for t in context["trials"] if t["ok"]]
    extra = {round((t["peak_bytes"] - simulated[t["seq_len"]]) / MIB) for t in rows}
    return [f"**CUDA tier: {tier['passed']} of {tier['passed'] + tier['failed']} passed.**",
            f"every length fitted up to {context['longest']:,}",
            f"is {'-'.join(map(str, sorted(extra)))} MiB under the card at every length",
            f"took {gib(rows[-1]['peak_bytes'])} GiB at {rows[-1]['seq_len']:,} tokens measured, "
            f"{gib(simulated[rows[-1]['seq_len']])} GiB simulated",
            *(f"| {t['seq_len']:,} | {gib(t['peak_bytes'])} GiB | {gib(simulated[t['seq_len']])} GiB | "
              f"{t['peak_bytes'] / simulated[t['seq_len']]:.4f} |" for t in rows)]


def stated_qlora_8b() -> list[str]:
    """The GPU check's 8B part, its dry run on the simulated h100-80gb: what a card's run will be held to."""
    result = bench("gpu_check-qlora_8b-h100-80gb-simulated")["qlora_8b"]
    memory = {(r["side"], r["seq_len"]): r["simulated_bytes"] for r in result["memory"]}
    [speed] = result["speed"]
    return [f"| patched | {gib(memory['patched', 65536])} GiB | {gib(memory['patched', 131072])} GiB | "
            f"{gib(memory['patched+offload', 262144])} GiB | {speed['simulated_seconds']:.3f} s (the clock) |"]


def stated_stride() -> list[str]:
    """--checkpoint_stride 2 without offload (`llama-3.1-8b-qlora-stride2-h100.json`) beside every checkpoint kept (the
    speed table's rows, and the QLoRA sweep's --find_max)."""
    strided, every = by_side("llama-3.1-8b-qlora-stride2-h100"), by_side("clock-llama-3.1-8b-qlora-h100-lengths")
    longest = bench("llama-3.1-8b-qlora-stride2-h100")["find_max"]["patched"]["max_context_tokens"]
    kept = bench("llama-3.1-8b-qlora-h100")["find_max"]["patched"]["max_context_tokens"]
    half, whole, long = strided["patched", 131072], every["patched", 131072], strided["patched", 262144]
    return [f"{longest:,} tokens fit (simulated; 262,144 take {gib(long['peak_bytes'])} GiB), at "
            f"{half['step_seconds'] / whole['step_seconds']:.2f}x the step time at 131,072 tokens",
            f"| 131,072 | {gib(whole['peak_bytes'])} GiB, {whole['step_seconds']:.1f} s | "
            f"{gib(half['peak_bytes'])} GiB, {half['step_seconds']:.1f} s |",
            f"| 262,144 | does not fit | {gib(long['peak_bytes'])} GiB, {long['step_seconds']:.1f} s |",
            f"| longest that fits (`--find_max`) | {kept:,} | {longest:,} |"]


def profiles(seq_len: int) -> dict:
    """The GPU check's profiled 16-bit steps at a length, by side."""
    return {r["side"]: r["profile"] for r in bench("gpu_check-h100-80gb")["speed"]
            if r["seq_len"] == seq_len and r["bits"] == 16 and "kernel_launches" in (r.get("profile") or {})}


def stated_sequence_parallel() -> list[str]:
    sp, tp = bench("sequence_parallel_cpu"), bench("sequence_parallel_tp_cpu")
    rows = {(r["world"], r["seq_len"]): r for r in sp["summary"]["rows"]}
    growth = sp["summary"]["growth"]
    first, last = growth["from_seq_len"], growth["to_seq_len"]
    per_1k, ratio = growth["ring"]["mib_per_1k_tokens"], growth["ring"]["ratio_to_sp1"]
    one = {r["seq_len"]: r["loss"] for r in sp["runs"] if r["world"] == 1}  # the group losses, relative to these
    tp_rows = {(r["tp"], r["world"]): r for r in tp["summary"]["rows"]}
    tp_loss = tp["runs"][0]["loss"]  # one process
    return [f"the LoRA gradient all-reduce, {rows[1, first]['grad_allreduce_mib']:.1f} MiB here",
            f"Memory growth {first} -> {last} per rank: "
            + ", ".join(f"N={n} {g:.2f} MiB per 1K tokens" if n == "1" else f"N={n} {g:.2f} ({ratio[n]:.2f}x)"
                        for n, g in per_1k.items()),
            f"the group loss equals the one-process loss within "
            f"{within(max(abs(r['loss'] / one[r['seq_len']] - 1) for r in sp['runs']))}",
            f"({sp['environment']['bpt']['loss_chunk']} tokens x {sp['environment']['model_config']['vocab_size']} "
            "vocab of fp32 logits",
            f"brings that point from {mib(rows[4, first]['step_mib'])} to",
            f"At {last} tokens alone, per-rank memory is 1 : "
            + " : ".join(f"{rows[n, last]['step_mib'] / rows[1, last]['step_mib']:.2f}" for n in (2, 4))
            + " for N = 1 : 2 : 4",
            f"Every group's loss is the one-process loss ({tp_loss:.6f}, within "
            f"{within(max(abs(r['loss'] / tp_loss - 1) for r in tp['runs']))})",
            f"(the rest of the {mib(tp_rows[1, 1]['peak_mib'] - tp_rows[2, 1]['peak_mib'])} MiB less in the whole "
            "peak)",
            f"TP 2 x SP 2 holds {tp_rows[2, 2]['step_mib'] / tp_rows[1, 1]['step_mib']:.2f}x of one process's step "
            "memory"]


def cpu_block() -> str:
    """The CPU bench table: `llama-ref-cpu.json` measured, `llama-ref-cpu-simulated.json` the same steps on fake CPU
    tensors."""
    measured, simulated = bench("llama-ref-cpu")["summary"]["rows"], by_side("llama-ref-cpu-simulated")
    return table(["tokens", "stock MiB/step", "simulated", "patched MiB/step", "simulated", "mem patched/stock"],
                 [[str(r["seq_len"]), *(cell for side in ("stock", "patched") for cell in (
                     mib(r[f"{side}_step_mib"]), mib(simulated[side, r["seq_len"]]["step_bytes"] / MIB))),
                   f"{r['mem_ratio']:.3f}"] for r in measured])


def clock_block() -> str:
    """The clock's predictions beside the measured steps: this CPU's bench, and the H100's GPU check (compiled)."""
    real, predicted = by_side("clock-llama-ref-cpu-measured"), by_side("clock-llama-ref-cpu-predicted")
    h100 = by_side("clock-llama-3.2-1b-h100-predicted")
    measured = {(r["side"], r["seq_len"]): r for r in bench("gpu_check-h100-80gb")["speed"]
                if r["bits"] == 16 and r["ok"] and r["seconds_per_step"]}
    profiled = profiles(8192)

    def off(p: float, m: float) -> str:
        return f"{p:.3f} s vs {m:.3f} s ({100 * (p / m - 1):+.0f}%)"
    rows = []
    for n in sorted({n for _, n in real}):
        s, p = (real[side, n]["median_s"] for side in ("stock", "patched"))
        ps, pp = (predicted[side, n]["step_seconds"] for side in ("stock", "patched"))
        rows.append([f"CPU (this machine), llama-ref fp32, {k(n)}", off(ps, s), off(pp, p),
                     f"{pp / ps:.3f} vs {p / s:.3f}", ""])
    for n in sorted({n for _, n in h100}):
        cells = [off(h100[side, n]["step_seconds"], measured[side, n]["seconds_per_step"])
                 if (side, n) in measured else "" for side in ("stock", "patched", "patched+offload")]
        launches = " / ".join(f"{h100[side, n]['kernel_launches']:,} vs {profiled[side]['kernel_launches']:,}"
                              for side in ("stock", "patched")) if n == 8192 else ""
        rows.append([f"H100, Llama-3.2-1B LoRA bf16, {k(n)} (+offload: {cells[2]})", *cells[:2],
                     f"{h100['patched', n]['step_seconds'] / h100['stock', n]['step_seconds']:.3f} vs "
                     f"{measured['patched', n]['seconds_per_step'] / measured['stock', n]['seconds_per_step']:.3f}",
                     launches])
    return table(["predicted vs measured", "stock s/step", "patched s/step", "patched / stock",
                  "kernels stock / patched"], rows)


def many_gpus_block() -> str:
    """Llama-3.1-8B QLoRA with offload on one simulated H100 and one rank of eight (sequence parallel, Ulysses): the
    sweep's rows and each layout's longest (`llama-3.1-8b-qlora-offload-h100`, `...-offload-sp8-h100`)."""
    rows = []
    for name in ("llama-3.1-8b-qlora-offload-h100", "llama-3.1-8b-qlora-offload-sp8-h100"):
        report = bench(name)
        (layout, found), = report["find_max"].items()
        runs = {r["seq_len"]: r for r in report["runs"] if r["ok"]}
        gpus = f"{found.get('sequence_parallel') or 1} ({found.get('sp_mode') or 'one GPU'})"
        lengths = [(n, f"{n:,}") for n in sorted(n for n, r in runs.items() if r["phase"] == "sweep" and round_length(n))]
        for n, label in lengths + [(found["max_context_tokens"], f"longest: {found['max_context_tokens']:,}")]:
            r = runs[n]
            rows.append([gpus, label, f"{r.get('tokens_per_rank', n):,}", f"{gib(r['peak_bytes'])} GiB",
                         f"{gib(r['host_peak_bytes'])} GiB", "fits" if r["fits"] else "does not fit"])
    return table(["GPUs", "tokens", "tokens per GPU", "device peak per GPU", "host memory per GPU", ""], rows)


# Llama-3.1-8B QLoRA + offload on simulated h100s: one bench run per layout with a --find_max (each its own
# bisection), and two machines of eight at 1M tokens.
MANY_GPUS_SPEED = [f"llama-3.1-8b-qlora-offload-{layout}-speed-h100"
                   for layout in ("sp1", "sp8-ring", "sp8-ulysses", "sp16", "sp16-ring", "sp16-ulysses")]


def many_gpus_speed_block() -> str:
    """Llama-3.1-8B QLoRA with offload predicted on one h100, one machine of eight and two (sequence parallel, ring
    and Ulysses) at 1M tokens and at a layout's longest where it was searched: the clock's step with the exchange in
    it (`llama-3.1-8b-qlora-offload-<layout>-speed-h100`)."""
    rows = []
    for name in MANY_GPUS_SPEED:
        report = bench(name)
        longest = {(f["sequence_parallel"], f["sp_mode"]): f["max_context_tokens"]
                   for f in report.get("find_max", {}).values()}
        runs = sorted((r for r in report["runs"] if r["ok"]), key=lambda r: (r["sp_mode"] or "", r["seq_len"]))
        for r in runs:
            n, most = r["seq_len"], longest.get((r["sequence_parallel"], r["sp_mode"]))
            if not (r["phase"] == "sweep" and round_length(n) or n == most):
                continue
            x = r.get("exchange")
            gpus = (f"{x['machines']} x {x['gpus_per_machine']}" if x["machines"] > 1 else f"{x['gpus_per_machine']}"
                    ) if x else "1"
            exchange = (f"{x['exchange_seconds']:.1f} s, exposed {x['exposed_exchange_seconds']:.2f} s "
                        f"({x['exposed_exchange_seconds'] / r['step_seconds']:.1%})" if x else "none")
            rows.append([f"{gpus} ({r['sp_mode'] or 'one GPU'})", f"longest: {n:,}" if n == most else f"{n:,}",
                         f"{r['step_seconds']:,.1f}", f"{r['tokens_per_second']:,.0f}", exchange,
                         f"{gib(r['peak_bytes'])} GiB", f"{gib(r['host_peak_bytes'])} GiB"])
    return table(["GPUs", "tokens", "s/step", "tok/s per GPU", "exchange per step (exposed)", "device peak per GPU",
                  "host per GPU"], rows)


def stated_many_gpus_speed() -> list[str]:
    runs = {(r["sequence_parallel"] or 1, r["sp_mode"], r["seq_len"]): r
            for name in MANY_GPUS_SPEED for r in bench(name)["runs"] if r["ok"]}
    one, ring, ulysses = (runs[n, mode, 1 << 20] for n, mode in ((1, None), (8, "ring"), (8, "ulysses")))
    ring16, ulysses16 = runs[16, "ring", 1 << 20], runs[16, "ulysses", 1 << 20]
    x16 = ulysses16["exchange"]
    return [f"eight GPUs take {ring['step_seconds']:.1f} s (ring) and {ulysses['step_seconds']:.1f} s (Ulysses) per "
            f"step", f"{ring['exchange']['exposed_exchange_seconds']:.2f} s and "
            f"{ulysses['exchange']['exposed_exchange_seconds']:.2f} s exposed per step",
            f"Attention is {ring['time_breakdown']['attention']:.0f} s of the ring step",
            f"({ring['tokens_per_second']:.0f} against {one['tokens_per_second']:.0f} tok/s)",
            f"({gib(one['attention_once']['bytes'], 0)} GiB at this length)",
            f"keeps its share ({gib(ring['attention_once']['bytes'], 1)} GiB,",
            f"halve the step ({ring16['step_seconds']:.1f} s ring, {ulysses16['step_seconds']:.1f} s Ulysses)",
            f"Ring's {ring16['exchange']['exchange_seconds']:.1f} s of exchange still hides",
            f"its {x16['exposed_exchange_seconds']:.1f} s are exposed "
            f"({x16['exposed_exchange_seconds'] / ulysses16['step_seconds']:.1%} of the step)",
            f"nearest: 345 tok/s per GPU against the {ring['tokens_per_second']:.0f} predicted here",
            *stated_two_machines_longest(), *stated_kept_on_device()]


def stated_kept_on_device() -> list[str]:
    """Ulysses over eight at 8,388,608 tokens with the host's excess kept on the device (bpt/bench/host_limit.py)."""
    (run,) = bench("llama-3.1-8b-qlora-offload-sp8-ulysses-8m-kept-h100")["runs"]
    return [f"the last {run['offload_keep_last']} saved kept on the device, it fits: host "
            f"{gib(run['host_peak_bytes'])} GiB a GPU ({run['host_bytes_per_machine'] / GIB:,.0f} GiB of the "
            f"machine's {run['host_memory_per_machine'] / GIB:,.0f}), device peak {gib(run['peak_bytes'])} GiB, "
            f"{run['step_seconds']:,.1f} s per step"]


def stated_two_machines_longest() -> list[str]:
    """Two machines of eight at their longest (`sp16-ring`, `sp16-ulysses`) against one machine's."""
    def longest(layout: str) -> dict:
        report = bench(f"llama-3.1-8b-qlora-offload-{layout}-speed-h100")
        (found,) = report["find_max"].values()
        return next(r for r in report["runs"] if r["seq_len"] == found["max_context_tokens"])
    ring8, ulysses8, ring, ulysses = (longest(layout) for layout in ("sp8-ring", "sp8-ulysses", "sp16-ring",
                                                                     "sp16-ulysses"))
    twice = "exactly twice" if ring["seq_len"] == 2 * ring8["seq_len"] else "not twice"
    return [f"ring {ring['seq_len']:,} tokens, {twice} one machine's ({ring['tokens_per_rank']:,} a rank",
            f"Ulysses {ulysses['seq_len']:,} (bound by the host again: {gib(ulysses['host_peak_bytes'], 1)} GiB a GPU "
            f"at {ulysses['tokens_per_rank']:,} tokens a rank, where one machine held "
            f"{gib(ulysses8['host_peak_bytes'], 1)} at {ulysses8['tokens_per_rank']:,};",
            f"Ring's {ring['exchange']['exchange_seconds']:.1f} s of exchange, over the network between the machines, "
            f"still hides behind a {ring['step_seconds']:,.0f} s step "
            f"({ring['exchange']['exposed_exchange_seconds']:.1f} s exposed); Ulysses' "
            f"{ulysses['exchange']['exchange_seconds']:.1f} s wait."]


def speed_block() -> str:
    """The clock's predicted step of Llama-3.1-8B QLoRA on h100-80gb by length and side (the README's speed table),
    and last the longest that fits with offload (its --find_max run), where the others' longest are far shorter."""
    rows = by_side("clock-llama-3.1-8b-qlora-h100-lengths")

    def cell(row: dict) -> str:
        if not row["fits"]:
            return f"does not fit ({gib(row['peak_bytes'], 0)} GiB)"
        return f"{row['step_seconds']:,.1f} s, {row['tokens_per_second']:,.0f} tok/s ({gib(row['peak_bytes'], 1)} GiB)"
    sides = ("stock", "patched", "patched+offload")
    lines = [[f"{n:,}", *(cell(rows[side, n]) for side in sides)] for n in sorted({n for _, n in rows})]
    longest = bench("llama-3.1-8b-qlora-offload-h100")["find_max"]["patched+offload"]["max_context_tokens"]
    others = bench("llama-3.1-8b-qlora-h100")["find_max"]
    lines.append([f"{longest:,} (longest)",
                  *(f"does not fit (longest {others[side]['max_context_tokens']:,})" for side in sides[:2]),
                  cell(by_side("llama-3.1-8b-qlora-offload-h100")["patched+offload", longest])])
    return table(["tokens", *sides], lines)


def stated_cpu() -> list[str]:
    grad = {r["grad_mib"] for r in bench("llama-ref-cpu")["runs"] if r["side"] == "patched"}
    return [f"About {grad.pop():.0f} MiB of each patched figure is the parameter gradients"]


def stated() -> list[str]:
    """The figures the pages' sentences quote from docs/bench/, each as the phrase that states it (line breaks
    aside): tests/test_readme_figures.py asserts the README or a docs/ page has every one. The sentences stay the
    pages': a figure that changes is fixed there by hand, as the failing test prints it."""
    return (stated_cpu() + stated_simulated() + stated_gpu() + stated_gpu_context() + stated_sequence_parallel()
            + stated_clock() + stated_stride() + stated_many_gpus_speed() + stated_qlora_8b())


def stated_clock() -> list[str]:
    rows = by_side("clock-llama-3.1-8b-qlora-h100-predicted")

    def ratio(key: str, n: int, side: str = "patched") -> float:
        value = (lambda r: sum(r["flops_by_dtype"].values())) if key == "flops" else (lambda r: r[key])
        return value(rows[side, n]) / value(rows["stock", n])
    idle = max(r["time_breakdown"]["launch_bound_idle"] / r["step_seconds"] for r in rows.values())
    return [f"patched / stock predicted {ratio('step_seconds', 16384):.2f}x at 16K and "
            f"{ratio('step_seconds', 32768):.2f}x at 32K, FLOPs {ratio('flops', 16384):.3f}x and "
            f"{ratio('flops', 32768):.3f}x, kernel launches {ratio('kernel_launches', 16384):.1f}x and "
            f"{ratio('kernel_launches', 32768):.1f}x, launch-bound idle at most {idle:.1%}",
            "patched+offload " + " and ".join(f"{rows['patched+offload', n]['step_seconds']:.3f} s vs patched "
                                              f"{rows['patched', n]['step_seconds']:.3f} s at {k(n)}"
                                              for n in (16384, 32768))]


BLOCKS = {"default-run": default_run_block, "plan": plan_block, "bench-cpu": cpu_block, "bench-qlora": qlora_block,
          "bench-gpu-memory": gpu_memory_block, "bench-gpu-speed": gpu_speed_block,
          "bench-sequence-parallel": sequence_parallel_block, "bench-sequence-parallel-tp": sequence_parallel_tp_block,
          "bench-clock": clock_block, "bench-speed": speed_block, "bench-many-gpus": many_gpus_block,
          "bench-many-gpus-speed": many_gpus_speed_block}


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
        for page in pages():
            if (text := page.read_text()) != (new := write(text)):
                page.write_text(new)
    else:
        print("\n\n".join([*(block() for block in BLOCKS.values()), "\n".join(stated())]))
