"""python -m train.eval says the work it plans and shows a bar per task (prompts done / total, time left); results of
earlier calls in --output_json are kept (merged per task and length), another measurement there is refused unless
--overwrite."""
from __future__ import annotations

import json
import re

import pytest

from cli_helpers import error_line, save_tiny_llama
from train.evaluation.eval import main
from train.evaluation.eval_results import merge_results

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("eval_progress") / "model"
    save_tiny_llama(directory)
    return directory


def evaluate(model_dir, out, *flags) -> int:
    return main(["--model_name_or_path", str(model_dir), "--depths", "0", "1", "--trials", "1",
                 "--output_json", str(out), *map(str, flags)])


def test_planned_work_up_front_and_a_bar_per_task(model_dir, tmp_path, capsys):
    assert evaluate(model_dir, tmp_path / "res.json", "--tasks", "passkey", "niah_single", "--lengths", 500) == 0
    err = capsys.readouterr().err
    assert "evaluating 2 tasks x 1 length x 2 depths x 1 trial = 4 prompts, in batches of up to 8" in err
    lines = re.split(r"[\r\n]", err)
    for label in ("passkey (1/2)", "niah_single (2/2)"):
        finished = [line for line in lines if line.startswith(f"{label}: 100%")]
        # tqdm's "[elapsed<left, rate]": the prompts of the task and the time left
        assert finished and re.search(r" 2/2 \[\d\d:\d\d<\d\d:\d\d", finished[-1]), (label, err)
    assert err.index("passkey (1/2)") < err.index("niah_single (2/2)") < err.index("results written to")


def test_a_second_call_keeps_the_firsts_results(model_dir, tmp_path, capsys):
    out = tmp_path / "res.json"
    assert evaluate(model_dir, out, "--tasks", "passkey", "--lengths", 500) == 0
    first = json.loads(out.read_text())
    capsys.readouterr()
    assert evaluate(model_dir, out, "--tasks", "niah_single", "--lengths", 500) == 0
    second = json.loads(out.read_text())
    assert list(second["tasks"]) == ["passkey", "niah_single"]
    assert second["tasks"]["passkey"] == first["tasks"]["passkey"] and second["accuracy"] == first["accuracy"]
    assert second["earlier_calls"] == [first["args"]] and second["args"]["tasks"] == ["niah_single"]
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"results written to {out} (merged with the earlier results there, keeping passkey; --overwrite replaces "
        "them all)")
    # Another length of a task already there: both lengths, in order, the task's accuracy their mean.
    assert evaluate(model_dir, out, "--tasks", "passkey", "--lengths", 480) == 0
    third = json.loads(out.read_text())["tasks"]["passkey"]
    assert list(third["by_length_depth"]) == ["480", "500"]
    assert third["by_length_depth"]["500"] == first["by_length_depth"]["500"]
    assert third["accuracy"] == pytest.approx(sum(third["by_length"].values()) / 2)
    assert "keeping passkey at 500; niah_single;" in capsys.readouterr().err


def test_another_measurement_is_refused_unless_overwrite(model_dir, tmp_path, capsys):
    out = tmp_path / "res.json"
    assert evaluate(model_dir, out, "--tasks", "passkey", "--lengths", 500) == 0
    before = out.read_text()
    capsys.readouterr()
    assert evaluate(model_dir, out, "--tasks", "passkey", "--lengths", 500, "--seed", 3) == 2
    line = error_line(capsys)
    assert "seed 0 there, 3 now" in line and "--overwrite" in line and out.read_text() == before
    assert evaluate(model_dir, out, "--tasks", "niah_single", "--lengths", 500, "--seed", 3, "--overwrite") == 0
    result = json.loads(out.read_text())
    assert list(result["tasks"]) == ["niah_single"] and "earlier_calls" not in result
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"results written to {out}"


def test_merging_the_same_tasks_and_lengths_replaces_them():
    cell = {"by_length_depth": {256: {0.5: 1.0}}, "by_length": {256: 1.0}, "accuracy": 1.0}
    earlier = json.loads(json.dumps({**cell, "tasks": {"passkey": {**cell, "accuracy": 0.0}}, "args": {"seed": 0},
                                     "perplexity": 3.0}))
    merged, said = merge_results(earlier, {"tasks": {"passkey": cell}, "args": {"seed": 0}})
    assert merged["tasks"]["passkey"]["accuracy"] == 1.0 and merged["accuracy"] == 1.0
    assert merged["perplexity"] == 3.0 and said.startswith("merged with the earlier results there, keeping perplexity")
