"""Helpers shared by the `python -m train.qlora` tests: the environment and argv of a tiny run, and what a
run wrote. The tiny model itself is the `tiny` fixture (conftest.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# One intra-op thread: these models are tiny, and on a shared CPU extra threads mostly wait on each other
# (a 64-token step measured 0.1 s with one thread, 0.5-12 s with two).
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def base_argv(tiny, out, *extra) -> list[str]:
    return ["--model_name_or_path", str(tiny / "model"), "--dataset", str(tiny / "data.jsonl"),
            "--output_dir", str(out), "--max_seq_len", "64", "--max_steps", "4", "--lora_r", "4",
            "--learning_rate", "1e-2", "--save_steps", "0", "--logging_steps", "1",
            "--q_block", "16", "--kv_block", "16", "--mlp_chunk", "16", "--loss_chunk", "16", *map(str, extra)]


def metrics(out) -> list[dict]:
    with open(Path(out) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def losses(out) -> list[float]:
    return [m["loss"] for m in metrics(out)]
