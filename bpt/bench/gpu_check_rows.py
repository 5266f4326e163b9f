"""The GPU check's rows: a cell worker's result (bpt.bench.cells) as the report keeps it, memory beside the
simulation's figures, speed with the clock's prediction beside the measurement (bpt.bench.gpu_check and its 8B part,
bpt.bench.qlora_8b_check, both write them)."""
from __future__ import annotations


def memory_row(side: str, bits: int, cell: dict, simulated: dict, real: bool) -> dict:
    row = {"side": side, "seq_len": cell["seq_len"], "bits": bits, "ok": cell["ok"] and simulated.get("ok", False),
           "measured": real, "simulated_bytes": simulated.get("peak_bytes"),
           "simulated_step_bytes": simulated.get("step_bytes"), "measured_bytes": None, "measured_step_bytes": None,
           "tracker_bytes": cell.get("peak_bytes"), "loss": cell.get("loss"), "quantiser": None,
           "attention_paths": cell.get("attention_paths")}
    if bits == 4:
        row["quantiser"] = cell.get("quantiser")
    if cell["ok"]:
        row["measured_bytes"] = cell["cuda_peak_bytes"] if real else cell["peak_bytes"]
        row["measured_step_bytes"] = cell["cuda_step_bytes"] if real else cell["step_bytes"]
    if row["measured_bytes"] and row["simulated_bytes"]:
        row["measured_over_simulated"] = row["measured_bytes"] / row["simulated_bytes"]
    errors = [e for e in (cell.get("error"), simulated.get("error")) if e]
    if errors:
        row["error"] = "; ".join(errors)
    return row


def speed_row(side: str, bits: int, cell: dict, real: bool) -> dict:
    row = {"side": side, "seq_len": cell["seq_len"], "bits": bits, "ok": cell["ok"], "simulated": not real,
           "seconds_per_step": cell.get("seconds_per_step"), "tokens_per_second": cell.get("tokens_per_second"),
           "steps": cell.get("timed_steps"), "step_seconds_each": cell.get("step_seconds_each"),
           "warmup_seconds": cell.get("warmup_seconds"), "peak_bytes": cell.get("timed_peak_bytes"),
           "loss": cell.get("timed_loss"), "profile": cell.get("profile"),
           # the clock's prediction of the tracked (eager) step: beside the measured one, what recalibrates it
           "predicted_seconds": cell.get("step_seconds"), "predicted_kernel_launches": cell.get("kernel_launches")}
    if cell.get("seconds_by_layers"):  # timed at two depths and extended to the model's (cells.timed_to_depth)
        row["seconds_by_layers"] = cell["seconds_by_layers"]
    if not cell["ok"]:
        row["error"] = cell["error"]
    return row
