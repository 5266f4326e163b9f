"""What a train.qlora run prints and leaves besides its weights: the evaluation's length x depth tables, a note when the
warm-up outlasts the run, the trainable-parameter count labelled under tensor parallelism, and a real model card
(README.md) instead of peft's template."""
from __future__ import annotations

import pytest
import torch

from cli_helpers import base_argv, metrics
from train.run.command import main
from train.run.qlora import trainable_text

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_short_run_prints_its_tables_notes_its_warmup_and_writes_a_model_card(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(base_argv(tiny, out, "--max_steps", 3, "--warmup_steps", 10, "--eval_passkey", "--eval_lengths", 120,
                          "--eval_depths", 0, 1, "--eval_trials", 1)) == 0
    captured = capsys.readouterr()
    # The length x depth table of train.eval, before and after, under each summary line.
    for when in ("before", "after"):
        summary = captured.out.index(f"passkey accuracy {when} training: ")
        table = captured.out[summary:].splitlines()[1:4]
        assert table[0] == "length |  d=0 |  d=1 |  all" and table[2].startswith("   120 | "), captured.out
    assert captured.out.count("passkey accuracy") == 2
    notes = [line for line in captured.err.splitlines() if "--warmup_steps" in line]
    assert notes == ["note: --warmup_steps 10 is not shorter than the run's 3 steps, so the learning rate never "
                     "reaches --learning_rate 0.01 (the last step's is 0.002); lower --warmup_steps to reach it"]
    assert metrics(out)[-1]["lr"] == pytest.approx(0.002)  # what the note says

    card = (out / "README.md").read_text()
    assert "More Information Needed" not in card
    for said in (f"base_model: {tiny / 'model'}", "rows of 64 tokens", "4-bit NF4", "LoRA: r 4, alpha 32",
                 "3 steps of 1 row(s) per process, learning rate 0.01 (cosine, 10 warm-up steps)",
                 "length |  d=0 |  d=1 |  all", f"python -m train.eval --adapter {out}"):
        assert said in card, (said, card)


def test_no_warmup_note_when_the_run_outlasts_its_warmup(tiny, tmp_path, capsys):
    from train.recipe.args import parse_args
    from train.run.qlora import warmup_note

    assert warmup_note(parse_args(base_argv(tiny, tmp_path / "a", "--warmup_steps", 3)), steps=4) is None
    assert warmup_note(parse_args(base_argv(tiny, tmp_path / "b", "--warmup_steps", 9, "--lr_scheduler_type",
                                            "constant")), steps=4) is None  # constant: no warm-up at all
    assert warmup_note(parse_args(base_argv(tiny, tmp_path / "c", "--warmup_steps", 4)), steps=4) is not None


def test_the_trainable_count_under_tensor_parallelism_says_it_is_a_slice():
    model = torch.nn.Linear(4, 3)  # 15 trainable parameters
    assert trainable_text(model, 1) == "trainable parameters: 15"
    assert trainable_text(model, 2) == ("trainable parameters per process: 15 (each holds a 1/2 slice of the split "
                                        "layers)")


def test_every_file_a_run_and_its_evaluation_write_honours_the_umask(tiny, tmp_path):
    """Under umask 022 the adapter, its checkpoint copy, run_info.json, eval.json, the model card, merged/ and
    train.eval's eval_results.json are -rw-r--r-- like every other file (their atomic writes go through temporary
    files that tempfile and safetensors create -rw-------); and the card names merged/."""
    import os
    import stat

    from train.evaluation.eval import main as eval_main

    out = tmp_path / "run"
    before = os.umask(0o022)
    try:
        assert main(base_argv(tiny, out, "--max_steps", 2, "--save_steps", 1, "--merge", "--eval_passkey",
                              "--eval_lengths", 120, "--eval_depths", 0.5, "--eval_trials", 1)) == 0
        assert eval_main(["--adapter", str(out), "--trials", "1"]) == 0
    finally:
        os.umask(before)
    modes = {str(path.relative_to(out)): stat.S_IMODE(path.stat().st_mode) for path in out.rglob("*")}
    for name in ("adapter_model.safetensors", "checkpoint-2/adapter_model.safetensors", "run_info.json", "eval.json",
                 "eval_results.json", "README.md", "merged/model.safetensors", "metrics.jsonl"):
        assert name in modes, sorted(modes)
    wrong = {name: oct(mode) for name, mode in modes.items() if mode != (0o755 if (out / name).is_dir() else 0o644)}
    assert not wrong, wrong
    card = (out / "README.md").read_text()
    assert "is in `merged/` (`--merge`): it loads with transformers alone" in card
