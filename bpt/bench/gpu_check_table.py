"""The GPU check's report as text (DIR/gpu_check.txt and the end of the run): every part's figures in short, each
labelled measured or simulated (bpt.bench.gpu_check writes the report)."""
from __future__ import annotations

from bpt.gpusim.gpus import GIB


def _gib(value) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def format_table(report: dict) -> str:
    """The short text table of a check (every figure labelled measured or simulated)."""
    what = report["gpu_check"]
    env = report.get("environment") or {}
    versions = env.get("versions") or {}
    lines = [f"GPU check ({what}): {env.get('gpu', '?')}, {_gib(env.get('memory_bytes'))} GiB, driver "
             f"{env.get('driver')}, CUDA {env.get('torch_cuda')}, "
             + ", ".join(f"{k} {v}" for k, v in versions.items()),
             f"model {report['model']} shapes (random weights), LoRA r {report['lora_r']}, bf16 autocast, "
             f"checkpointing, batch 1; parts done: {', '.join(report['parts_done']) or 'none'} "
             f"({report.get('seconds', 0):.0f} s)", ""]
    measured = "measured" if report["gpu_check"] == "measured" else "tracker (simulated)"
    lines.append(f"memory: peak allocated GiB of one step, {measured} vs simulated")
    for r in report["memory"]:
        ratio = f"{r['measured_over_simulated']:.3f}" if r.get("measured_over_simulated") else "-"
        tail = f"  {r['error']}" if r.get("error") else ""
        lines.append(f"  {r['side']:15s} {r['bits']:>2d}-bit {r['seq_len']:>7d}  {_gib(r['measured_bytes']):>7s}  "
                     f"{_gib(r['simulated_bytes']):>7s}  x{ratio}{tail}")
    lines += ["", "speed: median s/step, tokens/s, peak allocated GiB (1 warm-up, then the median of the timed steps)"]
    for r in report["speed"]:
        if r["ok"] and r["seconds_per_step"] is not None:
            figures = (f"{r['seconds_per_step']:8.3f} s  {r['tokens_per_second']:9.0f} tok/s  "
                       f"{_gib(r['peak_bytes'])} GiB")
        elif r["ok"]:
            figures = "ran on the simulated card: no timing"
        else:
            figures = r["error"]
        lines.append(f"  {r['side']:15s} {r['bits']:>2d}-bit {r['seq_len']:>7d}  {figures}")
    lines += _clock_lines(report)
    tier = report.get("cuda_tier")
    if tier:
        lines += ["", f"CUDA tier: {tier['passed']} passed, {tier['failed']} failed, {tier['skipped']} skipped, "
                      f"{tier['errors']} errors" + (f" ({tier['error']})" if tier.get("error") else "")]
        lines += [f"  not collected: {line}" for line in tier.get("not_collected", [])]
        for failure in tier.get("failures", []):
            last = (failure["detail"].strip().splitlines() or [""])[-1]
            lines.append(f"  FAILED {failure['test']} ({failure['when']}): {last[:200]}")
    context = report.get("max_context")
    if context:
        lines += ["", f"max context ({'measured' if context['measured'] else 'simulated'}; {context['method']}), "
                      f"usable {_gib(context['usable_bytes'])} GiB"]
        for side, c in context.items():
            if isinstance(c, dict) and "simulated_find_max" in c:  # a side's search (the other keys: the method)
                sim = c["simulated_find_max"]
                lines.append(f"  {side:15s} longest {c['longest']} (stopped: {c['stopped']}); simulated --find_max "
                             f"{sim.get('longest', sim.get('error'))}")
    lines += _decode_lines(report.get("decode"))
    lines += _trainer_lines(report.get("trainer"))
    lines += _qlora_8b_lines(report.get("qlora_8b"))
    return "\n".join(lines)


def _decode_lines(rows: list | None) -> list[str]:
    """The decode part (bpt.bench.decode_check): a line per side."""
    if not rows:
        return []
    lines = ["", "decode (generate() with a static cache, forward under torch.compile, second call timed)"]
    for row in rows:
        if not row["ok"]:
            lines.append(f"  {row['side']:15s} {row['error']}")
            continue
        lines.append(f"  {row['side']:15s} {row['tokens_per_s']:,.1f} tok/s ({row['new_tokens']} tokens after "
                     f"{row['prompt_tokens']}); first call {row['first_call_s']:.1f} s, graphs "
                     f"{row['graphs_first_call']} then {row['graphs_second_call']}")
    return lines


def _qlora_8b_lines(result: dict | None) -> list[str]:
    """The 8B part (bpt.bench.qlora_8b_check) in short."""
    if not result:
        return []
    lines = ["", f"8B QLoRA ({result['model']} shapes, {result['bits']}-bit, layers {result['layers']})"]
    for r in result["memory"]:
        ratio = f"x{r['measured_over_simulated']:.3f}" if r.get("measured_over_simulated") else r.get("error", "-")
        lines.append(f"  memory {r['side']:15s} {r['seq_len']:>7d}  {_gib(r['measured_bytes'])} vs simulated "
                     f"{_gib(r['simulated_bytes'])} GiB  {ratio}")
    for r in result["speed"]:
        if r["seconds_per_step"] is not None:
            measured = f"{r['seconds_per_step']:.3f} s ({r['tokens_per_second']:,.0f} tok/s)"
        else:
            measured = r.get("error") or "ran on the simulated card: no timing"
        predicted = "-" if r["simulated_seconds"] is None else f"{r['simulated_seconds']:.3f} s"
        ratio = f"  x{r['measured_over_simulated']:.3f}" if r.get("measured_over_simulated") else ""
        lines.append(f"  speed  {r['side']:15s} {r['seq_len']:>7d}  {measured} vs the clock {predicted}{ratio}")
    return lines


def _accuracy(cells: dict | None) -> str:
    return "-" if not cells or cells.get("accuracy") is None else f"{cells['accuracy']:.2f}"


def _trainer_lines(t: dict | None) -> list[str]:
    """The trainer part (bpt.bench.trainer_check) in short."""
    if not t:
        return []
    run, refused, stop = t["run"], t["refusal"], t["interrupted"]
    speed = "-" if run["tokens_per_s"] is None else f"{run['tokens_per_s']:,.0f}"
    peak = "-" if run["peak_mem_mb"] is None else f"{run['peak_mem_mb'] / 1024:.2f} GiB"
    return ["", f"trainer ({t['device']}): {t['command']} {' '.join(t['flags_over_the_preset'])}".rstrip(),
            f"  run: exit {run['returncode']}, {run['wall_time_s']} s wall, {run['steps_logged']} steps, {speed} tok/s, "
            f"peak {peak}; passkey {_accuracy(run['eval_before'])} -> {_accuracy(run['eval_after'])}",
            f"  preflight: {run['preflight_line']}",
            f"  resumed: SIGTERM after step {stop['stopped_after_step']} (exit {stop['returncode']}), resumed exit "
            f"{t['resumed']['returncode']}; matches the run: {t['resume']['matches']} ({t['resume']['how']})",
            f"  merged: {'evaluated, passkey ' + str(t['merged']['accuracy']) if t['merged']['ok'] else t['merged']['error']}",
            f"  refusal of --max_seq_len {refused['max_seq_len']}: {'one line' if refused['one_line'] else 'NOT one line'}"
            f" (exit {refused['returncode']}): {(refused['lines'] or [''])[-1]}",
            f"  saved: {t['saved']} ({t['seconds']:.0f} s for the part)"]


def _clock_lines(report: dict) -> list[str]:
    """The rates and the profiled steps, in short."""
    lines = []
    clock = report.get("clock") or {}
    if clock.get("ok"):
        tf = {k: f"{v / 1e12:.0f}" for k, v in clock["matmul"].items()}
        rows = ", ".join(f"{r['rows']}: {r['flops_per_second'] / 1e12:.0f}" for r in clock["matmul_by_rows"])
        attn = ", ".join(f"{a['seq_len']}: {a['forward_flops_per_second'] / 1e12:.0f} / "
                         f"{a['forward_backward_flops_per_second'] / 1e12:.0f}" for a in clock["attention"])
        d = clock["dispatch"]
        lines += ["", "clock rates (measured): matmul TFLOP/s " + ", ".join(f"{k} {v}" for k, v in tf.items()),
                  f"  bf16 by rows (x 4096 x 14336) TFLOP/s: {rows}",
                  f"  copy {clock['copy_bytes_per_second'] / 1e9:.0f} GB/s; launch {d['host_seconds_per_op'] * 1e6:.1f} "
                  f"us host, {d['seconds_per_op_synced'] * 1e6:.1f} us synced",
                  f"  SDPA causal GQA TFLOP/s fwd / fwd+bwd: {attn}"]
        link = clock.get("host_link")
        if link:
            lines.append("  host link GB/s: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in link.items()))
    elif clock:
        lines += ["", f"clock rates: {clock.get('error')}"]
    for r in report.get("speed", []):
        p = r.get("profile")
        if not p:
            continue
        if "error" in p:
            lines.append(f"  profile {r['side']} {r['seq_len']}: {p['error']}")
            continue
        step = r.get("seconds_per_step")
        kinds = ", ".join(f"{k} {v:.3f} s/{p['kernels_by_kind'].get(k, 0)}" for k, v in
                          sorted(p["kernel_seconds_by_kind"].items()))
        busy = f", GPU busy {p['kernel_seconds'] / step:.0%} of the {step:.3f} s step" if step else ""
        lines.append(f"  profile {r['side']:15s} {r['bits']:>2d}-bit {r['seq_len']:>7d}: {p['kernel_launches']} "
                     f"kernels, {p['aten_calls']} aten calls; kernel time {p['kernel_seconds']:.3f} s{busy} "
                     f"({kinds})")
        waits = [c for c in p.get("runtime_calls", []) if c["host_wait"]]
        if waits:
            lines.append("    host waits: " + ", ".join(f"{c['name']} {c['calls']} x {c['seconds'] * 1e3:.1f} ms"
                                                         for c in waits))
    return lines
