"""The GPU check's Unsloth row (bpt.bench.unsloth_check) and how its wheels travel (bpt.bench.gpu_wheels --unsloth):
without Unsloth the worker says so in one line; the wheel loses its web UI and nothing else, its RECORD agreeing; where
Unsloth is installed (a lent card with the wheels, or any machine with it), its QLoRA step trains the adapters."""
from __future__ import annotations

import importlib.util
import zipfile

import pytest

from bpt.bench.gpu_wheels import UNSLOTH_UI, without_folder
from bpt.bench.unsloth_check import NOT_INSTALLED
from bpt.bench.workers import run_worker
from tiny_models import tiny_config

HAS_UNSLOTH = importlib.util.find_spec("unsloth") is not None


def _spec(**extra) -> dict:
    return {"task": "unsloth", "model_config": tiny_config("llama").to_dict(), "bits": 4, "lora_r": 4,
            "seq_lens": [32, 64], "timed_steps": 2, "seed": 0, "malloc": "default", **extra}


@pytest.mark.skipif(HAS_UNSLOTH, reason="Unsloth is installed here: its run is the test below")
def test_without_unsloth_the_row_says_so_in_one_line():
    assert run_worker(_spec(), timeout=300) == {"ok": False, "error": NOT_INSTALLED}


@pytest.mark.skipif(not HAS_UNSLOTH, reason="Unsloth is not installed (python -m bpt.bench.gpu_wheels --unsloth)")
def test_unsloth_trains_its_adapters_in_the_timed_steps():
    """On a CPU Unsloth falls back to its CPU path (it ran so, 2026.10.9, beside torch 2.13 and transformers 5.17)."""
    result = run_worker(_spec(), timeout=600)
    assert result["ok"], result
    for row in result["cells"]:
        assert row["ok"] and row["seconds_per_step"] > 0 and row["timed_loss"] > 0, row
        assert row["adapters_with_gradients"] == 2 * 7 * tiny_config("llama").num_hidden_layers  # A and B, 7 linears


def test_the_wheel_travels_without_its_web_ui_and_pip_still_takes_it(tmp_path):
    wheel = tmp_path / "unsloth-1.0-py3-none-any.whl"
    files = {"unsloth/__init__.py": "x = 1\n", "unsloth/models/llama.py": "y = 2\n",
             f"{UNSLOTH_UI}index.html": "<html/>", f"{UNSLOTH_UI}backend/app.py": "z = 3\n"}
    record = "".join(f"{name},sha256=abc,{len(text)}\n" for name, text in files.items())
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr("unsloth-1.0.dist-info/RECORD", record + "unsloth-1.0.dist-info/RECORD,,\n")
    without_folder(wheel, UNSLOTH_UI)
    with zipfile.ZipFile(wheel) as z:
        assert sorted(z.namelist()) == ["unsloth-1.0.dist-info/RECORD", "unsloth/__init__.py",
                                        "unsloth/models/llama.py"]
        assert z.read("unsloth/models/llama.py") == b"y = 2\n"
        assert z.read("unsloth-1.0.dist-info/RECORD").decode().splitlines() == [
            "unsloth/__init__.py,sha256=abc,6", "unsloth/models/llama.py,sha256=abc,6",
            "unsloth-1.0.dist-info/RECORD,,"]
