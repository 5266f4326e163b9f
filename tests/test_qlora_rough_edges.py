"""What a newcomer to `python -m train.qlora` / `python -m train.eval` ran into (issue 13, part 5): extending a
finished run, a corrupt weights file, a model directory without a tokenizer, --help, the run's last line, where
train.eval writes its results, and what sequence parallelism promises with LoRA dropout."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from cli_helpers import REPO, base_argv, error_line, metrics
from train.run.command import main

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- extending a run

def test_a_finished_run_is_extended_with_its_schedule_rebuilt_for_the_new_length(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(base_argv(tiny, out, "--max_steps", 4)) == 0  # --save_steps 0: no intermediate checkpoint
    assert (out / "checkpoint-4").is_dir()  # the final state is resumable
    capsys.readouterr()

    assert main(base_argv(tiny, out, "--max_steps", 6, "--resume_from_checkpoint", "latest")) == 0
    err = capsys.readouterr().err
    assert (f"resumed from {out / 'checkpoint-4'} at step 4; the learning-rate schedule differs from the "
            "checkpoint's (4 -> 6 steps): rebuilt as cosine over 6 steps and continued at step 4, lr 0.0025") in err
    rows = metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    # Steps 5 and 6 run at the 6-step cosine's rates (peak 1e-2, no warm-up), not at the 4-step schedule's end (0).
    expected = [1e-2 * 0.5 * (1 + math.cos(math.pi * step / 6)) for step in (4, 5)]
    assert [row["lr"] for row in rows[4:]] == pytest.approx(expected)
    assert json.loads((out / "run_info.json").read_text())["steps"] == 6

    # Nothing left to train: one line saying how to extend it.
    assert main(base_argv(tiny, out, "--max_steps", 6, "--resume_from_checkpoint", "latest")) == 2
    assert error_line(capsys).endswith("is at step 6, and this run has 6 steps: raise --max_steps above 6 to train on")


def test_resume_latest_without_checkpoints_mentions_save_steps(tiny, tmp_path, capsys):
    assert main(base_argv(tiny, tmp_path / "none", "--resume_from_checkpoint", "latest")) == 2
    line = error_line(capsys)
    assert "no checkpoint-N directory" in line and "--save_steps" in line


# ---------------------------------------------------------------- broken model directories: one line, before data work

@pytest.fixture
def no_data_work(monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("the data was read before the model directory was checked")

    monkeypatch.setattr("train.recipe.data.build_train_dataset", refuse)


def _model_copy(tiny, tmp_path, *, tokenizer=True) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    if not tokenizer:
        for path in model.iterdir():
            if path.name.startswith(("tokenizer", "special_tokens")):
                path.unlink()
    return model


def test_a_corrupt_weights_file_is_one_line_naming_it(tiny, tmp_path, capsys, no_data_work):
    model = _model_copy(tiny, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # a copy cut short
    argv = base_argv(tiny, tmp_path / "run")
    argv[argv.index("--model_name_or_path") + 1] = str(model)
    assert main(argv) == 2
    line = error_line(capsys)
    assert line.startswith(f"error: model file {weights} is unreadable (") and "copy or download it again" in line

    from train.evaluation.eval import main as eval_main

    assert eval_main(["--model_name_or_path", str(model), "--lengths", "120"]) == 2
    assert error_line(capsys) == line


def test_a_model_directory_without_a_tokenizer_says_what_to_do(tiny, tmp_path, capsys, no_data_work):
    model = _model_copy(tiny, tmp_path, tokenizer=False)
    argv = base_argv(tiny, tmp_path / "run")
    argv[argv.index("--model_name_or_path") + 1] = str(model)
    assert main(argv) == 2
    line = error_line(capsys)
    assert line.startswith(f"error: model directory {model} has no tokenizer (none of tokenizer.json, ")
    assert line.endswith(f'save the base model\'s tokenizer there with tokenizer.save_pretrained("{model}")')


# ---------------------------------------------------------------- --help

def _helps(parser) -> dict[str, str]:
    return {action.option_strings[0]: action.help for action in parser._actions if action.option_strings[0] != "-h"}


def test_qlora_help_shows_each_default_once_the_block_sizes_and_the_default_run():
    from bpt.config import BPTConfig
    from train.recipe.args import build_parser

    helps = _helps(build_parser())
    assert all(text.count("(default:") <= 1 for text in helps.values()), \
        {flag: text for flag, text in helps.items() if text.count("(default:") > 1}
    assert f"default: {BPTConfig.q_block}, " in helps["--q_block"] and "None" not in helps["--q_block"]
    assert f"default: {BPTConfig.loss_chunk}, " in helps["--loss_chunk"]
    for flag, value in [("--max_seq_len", "2048"), ("--learning_rate", "0.001"), ("--max_steps", "300"),
                        ("--output_dir", "outputs/default-run"), ("--eval_passkey", "True")]:
        assert f"; default run: {value})" in helps[flag], (flag, helps[flag])
    assert "default run" in build_parser().description


def test_eval_help_explains_every_flag():
    from train.evaluation.eval import EvalArgs
    from train.recipe.args import build_parser

    helps = _helps(build_parser((EvalArgs,), prog="python -m train.eval", default_run=None, config_flag=False))
    assert {"--batch_size", "--text_field", "--max_docs", "--output_json"} <= helps.keys()
    assert all(text for text in helps.values()), [flag for flag, text in helps.items() if not text]
    assert "eval_results.json" in helps["--output_json"]


# ---------------------------------------------------------------- where the results went

def test_a_run_ends_with_a_line_saying_where_its_results_are(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(base_argv(tiny, out, "--max_steps", 1)) == 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"done: 1 step; adapter and tokenizer in {out}; metrics in {out / 'metrics.jsonl'}; evaluate with "
                    f"python -m train.eval --adapter {out}; extend with --resume_from_checkpoint latest and a larger "
                    "--max_steps")


# ---------------------------------------------------------------- sequence parallelism and dropout

def test_sequence_parallel_says_its_losses_equal_one_process_only_without_dropout():
    from train.recipe.args import build_parser

    assert "only with --lora_dropout 0" in _helps(build_parser())["--sequence_parallel"]
    page = (REPO / "docs" / "parallelism.md").read_text()
    section = page[page.index("## Sequence parallelism"):]
    section = section[:section.index("\n## ")]
    assert "--lora_dropout 0" in section
