"""`--tasks` of python -m train.eval and `--eval_tasks` of python -m train.qlora: one result (and table) per task,
passkey's also at the top level as before; tracker scalars eval/<task>_accuracy; bad names are one error line."""
from __future__ import annotations

import importlib.util
import json

import pytest

from cli_helpers import base_argv, error_line, save_tiny_llama
from train.evaluation.eval import main
from train.evaluation.tasks import TASKS

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPE = {"by_length_depth", "by_length", "accuracy"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("eval_tasks") / "model"
    save_tiny_llama(directory)
    return directory


def test_cli_tasks_give_one_entry_and_one_table_per_task(model_dir, tmp_path, capsys):
    out = tmp_path / "res.json"
    assert main(["--model_name_or_path", str(model_dir), "--tasks", "passkey", "niah_multikey", "variable_tracking",
                 "--lengths", "560", "640", "--depths", "0", "1", "--trials", "1", "--output_json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["tasks"]) == ["passkey", "niah_multikey", "variable_tracking"]
    for name, task in result["tasks"].items():
        assert set(task) == SHAPE and list(task["by_length_depth"]) == ["560", "640"], name
        assert list(task["by_length_depth"]["560"]) == ["0.0", "1.0"] and 0.0 <= task["accuracy"] <= 1.0
    assert {key: result[key] for key in SHAPE} == result["tasks"]["passkey"]  # the earlier layout, kept
    assert result["args"]["tasks"] == ["passkey", "niah_multikey", "variable_tracking"]
    printed = capsys.readouterr().out
    for name in result["tasks"]:
        assert f"{name} accuracy: " in printed
    assert printed.count("length |  d=0 |  d=1 |  all") == 3


def test_cli_without_passkey_has_only_the_tasks(model_dir, tmp_path):
    out = tmp_path / "res.json"
    assert main(["--model_name_or_path", str(model_dir), "--tasks", "niah_single", "--lengths", "500",
                 "--depths", "0.5", "--trials", "2", "--output_json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["tasks"]) == ["niah_single"] and "accuracy" not in result


def test_cli_bad_task_name_or_length_is_one_error_line(model_dir, capsys):
    assert main(["--model_name_or_path", str(model_dir), "--tasks", "passkey", "niah_sngle"]) == 2
    line = error_line(capsys)
    assert "niah_sngle" in line and all(name in line for name in TASKS)
    assert main(["--model_name_or_path", str(model_dir), "--tasks", "niah_multiquery", "--lengths", "200"]) == 2
    assert "niah_multiquery length 200 is too short" in error_line(capsys)


def test_qlora_eval_tasks_before_and_after_with_tracker_scalars(tiny, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from train.recipe.args import parse_args
    from train.run.qlora import run

    out = tmp_path / "run"
    run(parse_args(base_argv(tiny, out, "--max_steps", 2, "--report_to", "tensorboard", "--eval_tasks", "niah_single",
                             "passkey", "--eval_lengths", 500, "--eval_trials", 1, "--eval_depths", 0.5)))
    evals = json.loads((out / "eval.json").read_text())
    for when in ("before", "after"):
        assert list(evals[when]["tasks"]) == ["niah_single", "passkey"]
        assert set(evals[when]["tasks"]["niah_single"]) == SHAPE
        assert evals[when]["accuracy"] == evals[when]["tasks"]["passkey"]["accuracy"]
    printed = capsys.readouterr().out
    assert "niah_single accuracy before training" in printed and "passkey accuracy after training" in printed
    accumulator = EventAccumulator(str(next((out / "train.qlora").glob("events.out.tfevents.*"))))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("eval/niah_single_accuracy")] == [0, 2]
    assert [e.value for e in accumulator.Scalars("eval/niah_single_accuracy")] == pytest.approx(
        [evals["before"]["tasks"]["niah_single"]["accuracy"], evals["after"]["tasks"]["niah_single"]["accuracy"]])
    assert "eval/niah_single_accuracy_500" in accumulator.Tags()["scalars"]
    if importlib.util.find_spec("matplotlib"):  # the run's pictures
        for name in ("loss.png", "accuracy_niah_single.png", "accuracy_passkey.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    # --adapter reads the run's tasks: its evaluation is repeated as trained.
    result_path = tmp_path / "again.json"
    assert main(["--adapter", str(out), "--output_json", str(result_path)]) == 0
    again = json.loads(result_path.read_text())
    assert again["args"]["tasks"] == ["niah_single", "passkey"]
    assert again["tasks"]["niah_single"]["by_length_depth"] == evals["after"]["tasks"]["niah_single"]["by_length_depth"]
    if importlib.util.find_spec("matplotlib"):  # beside the results JSON
        assert sorted(p.name for p in tmp_path.glob("again_*.png")) == ["again_accuracy_niah_single.png",
                                                                        "again_accuracy_passkey.png"]


def test_qlora_bad_eval_task_is_one_error_line(tiny, tmp_path, capsys):
    from train.run.command import main as qlora_main

    assert qlora_main(base_argv(tiny, tmp_path / "run", "--eval_tasks", "vt")) == 2
    line = error_line(capsys)
    assert "--eval_tasks" in line and "'vt'" in line and "variable_tracking" in line


def test_eval_tasks_help_names_only_registered_tasks():
    import dataclasses
    import re

    from train.recipe.args import EvalArguments

    help_text = next(f for f in dataclasses.fields(EvalArguments) if f.name == "eval_tasks").metadata["help"]
    named = re.findall(r"\b(passkey|niah_\w+|variable_tracking)\b", help_text)
    assert len(named) >= 6 and set(named) <= set(TASKS)
