"""The GPU check's 8B part (`--gpu_check_parts qlora_8b`, bpt.bench.qlora_8b_check): on the simulated card it runs the
8B-shaped 4-bit cells the card would (at shorter lengths here, for the suite's time: the lengths travel in the cells'
specs), its memory rows equal to the simulation's, its step priced by the clock; and the measured seconds of two
depths are extended to the model's as its bytes are."""
from __future__ import annotations

import json

import pytest

from bpt.bench import gpu_check, qlora_8b_check
from bpt.bench.cells import timed_to_depth
from bpt.bench.cli import main
from bpt.gpusim.gpus import GIB


def test_the_8b_part_runs_when_named_on_the_simulated_card(tmp_path, monkeypatch):
    monkeypatch.setattr(qlora_8b_check, "MEMORY_CELLS", (("patched", (4096, 8192)), ("patched+offload", (8192,))))
    monkeypatch.setattr(qlora_8b_check, "SPEED_LENGTH", 4096)
    main(["--gpu_check", "--simulate", "h100-80gb", "--output", str(tmp_path), "--gpu_check_parts", "qlora_8b"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["parts_done"] == ["environment", "qlora_8b"] and "qlora_8b" not in gpu_check.DEFAULT_PARTS
    result = report["qlora_8b"]
    assert result["model"] == "llama-3.1-8b" and result["layers"] == "2 and 3, extended to 32"
    memory = {(r["side"], r["seq_len"]): r for r in result["memory"]}
    assert set(memory) == {("patched", 4096), ("patched", 8192), ("patched+offload", 8192)}
    for row in memory.values():
        assert row["ok"] and not row["measured"] and row["quantiser"] == "emulated", row
        assert abs(row["measured_over_simulated"] - 1) < 0.05, row  # the tracker's cell and the simulation agree
        # the 8B's own weights held before the step (its 4-bit layers, 1 GiB embeddings and 1 GiB output layer; the
        # 1B check model holds under 2 GiB), extended from 2 and 3 layers to 32
        assert row["simulated_bytes"] - row["simulated_step_bytes"] > 5 * GIB, row
    assert memory["patched+offload", 8192]["simulated_bytes"] < memory["patched", 8192]["simulated_bytes"]
    assert memory["patched", 4096]["simulated_bytes"] < memory["patched", 8192]["simulated_bytes"]
    [speed] = result["speed"]
    assert speed["ok"] and speed["seq_len"] == 4096 and speed["bits"] == 4 and speed["seconds_per_step"] is None
    assert speed["simulated_seconds"] > 0 and "measured_over_simulated" not in speed
    table = (tmp_path / "gpu_check.txt").read_text()
    assert "8B QLoRA (llama-3.1-8b shapes, 4-bit, layers 2 and 3, extended to 32)" in table
    assert f"vs the clock {speed['simulated_seconds']:.3f} s" in table


def test_measured_seconds_are_extended_to_the_depth_as_the_bytes():
    """a + b L through the steps at 2 and 3 layers; nothing where a step was not timed (the simulated card)."""
    two = {"seconds_per_step": 1.0, "tokens_per_second": 16384.0, "timed_peak_bytes": 10 * GIB}
    three = {"seconds_per_step": 1.25, "tokens_per_second": 13107.2, "timed_peak_bytes": 11 * GIB}
    row = timed_to_depth(two, three, 2, 32, 1)
    assert row["seconds_per_step"] == pytest.approx(8.5) and row["tokens_per_second"] == pytest.approx(16384 / 8.5)
    assert row["timed_peak_bytes"] == 40 * GIB and row["seconds_by_layers"] == {"2": 1.0, "3": 1.25}
    assert row["step_seconds_each"] is None  # the medians were of shallower steps: none stands for the depth's
    assert timed_to_depth(two, {**three, "seconds_per_step": None}, 2, 32, 1) == {}
    # a checkpoint stride of 2: two layers more per period
    assert timed_to_depth(two, three, 2, 32, 2)["seconds_per_step"] == pytest.approx(1.0 + 0.25 * 15)
