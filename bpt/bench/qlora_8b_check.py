"""The GPU check's 8B part (`--gpu_check_parts qlora_8b`, run when named): the headline model measured.

Llama-3.1-8B shapes (random weights), 4-bit QLoRA as train.qlora runs it (bitsandbytes NF4 base on a card, LoRA r 16
on every linear, bf16 autocast, checkpointing), 2 and 3 layers stepped and extended to its 32, as `--simulate
--layers` does (a whole 8B would not leave the card room for its long steps, nor the check its minutes):
- memory: one step's peak, patched at 64K and 128K and patched+offload at 256K, beside the simulation's of the same
  step (run on the CPU cores meanwhile);
- speed: seconds per step at 16K (1 warm-up, the median of 3, the patch compiled as users get it), the medians at 2
  and 3 layers extended to 32 (bpt.bench.cells.timed_to_depth), beside the clock's prediction of the same step
  (`--simulate`'s, which prices the compiled patch) and the tracked eager step's.
On a simulated card the same cells run on fake tensors: the tracker's bytes, no timings.
"""
from __future__ import annotations

from bpt.bench.gpu_check_rows import memory_row, speed_row
from bpt.bench.models import resolve_model_config

MODEL = "llama-3.1-8b"
BITS = 4
MEMORY_CELLS = (("patched", (65536, 131072)), ("patched+offload", (262144,)))
SPEED_LENGTH = 16384
TIMED_STEPS = 3


def part_qlora_8b(check, layers: int) -> None:
    """The part's rows in check.report["qlora_8b"], saved as each lands; `layers` and one more are stepped."""
    config = resolve_model_config(MODEL, max(max(lengths) for _, lengths in MEMORY_CELLS))
    cells = [*((side, n) for side, lengths in MEMORY_CELLS for n in lengths), ("patched", SPEED_LENGTH)]
    sims = {(side, n): check.simulated(side, n, BITS, model_config=config) for side, n in cells}
    depth = config["num_hidden_layers"]
    result = check.report["qlora_8b"] = {"model": MODEL, "bits": BITS, "memory": [], "speed": [],
                                         "layers": f"{layers} and {layers + 1}, extended to {depth}"}
    deadline = check.deadline - check.reserve_after("qlora_8b")
    for side, lengths in MEMORY_CELLS:
        for cell in check.cells(side, lengths, "qlora_8b", BITS, tracked=True, layers=layers,
                                model_config=config, deadline=deadline):
            result["memory"].append(memory_row(side, BITS, cell, sims[side, cell["seq_len"]].result(), check.real))
            check.save()
    for cell in check.cells("patched", (SPEED_LENGTH,), "qlora_8b", BITS, tracked=True, timed_steps=TIMED_STEPS,
                            layers=layers, model_config=config, deadline=deadline):
        result["speed"].append(_speed_against_the_clock(cell, sims["patched", cell["seq_len"]].result(), check.real))
    check.save("qlora_8b")


def _speed_against_the_clock(cell: dict, simulated: dict, real: bool) -> dict:
    """The timed row with the simulation's predicted step beside it (and their ratio, where both are there)."""
    row = speed_row("patched", BITS, cell, real)
    row["simulated_seconds"] = simulated.get("step_seconds")
    if row["seconds_per_step"] and row["simulated_seconds"]:
        row["measured_over_simulated"] = row["seconds_per_step"] / row["simulated_seconds"]
    if simulated.get("error"):
        row["error"] = "; ".join(e for e in (row.get("error"), f"simulation: {simulated['error']}") if e)
    return row
