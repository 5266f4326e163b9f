"""Benchmark harness: training-step memory and speed, stock transformers vs the BPT patch.

Run it as `python -m bpt.bench` (flags: `--help`); `main` is the same entry point for Python callers.

- `models`: the model presets, config resolution and building a stock or patched model
- `measure`: what one step adds in memory and time, the memory probe and the training run
- `workers`: one fresh process per run (`--worker SPEC.json`) or per rank of a group, environment, failure messages
- `sequence_parallel`: the `--sequence_parallel` mode's rank worker, its per-group result and the traffic formula
- `report`: summary rows, growth and design goals, the printed tables, environment and JSON/CSV files
- `cli`: flags, their validation, the sweep (with --find_max) and `main`

Only `models`, `sequence_parallel` (and `cli`, to validate the inputs) import transformers, peft and `patches`, and only
inside functions, so `import bpt.bench` works without transformers.
"""
from bpt.bench.cli import main

__all__ = ["main"]
