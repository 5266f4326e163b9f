"""train.evaluation.plots: the loss curve and the accuracy heatmaps are written as valid PNGs (read back, no pixel
checks); without matplotlib one note line and no files."""
import json
import sys

import pytest

from train.evaluation.plots import MISSING, write_eval_pictures, write_run_pictures

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def result(accuracy: float) -> dict:
    return {"by_length_depth": {"500": {"0.0": accuracy, "1.0": 1.0}, "900": {"0.0": 0.0, "1.0": accuracy}},
            "by_length": {"500": accuracy, "900": accuracy / 2}, "accuracy": accuracy}


def assert_png(path):
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width = imread(str(path)).shape[:2]  # decodes
    assert height > 100 and width > 100


def fake_run(directory, evals: dict):
    directory.mkdir()
    with open(directory / "metrics.jsonl", "w") as f:
        for step in range(1, 6):
            f.write(json.dumps({"step": step, "loss": 3.0 / step, "lr": 1e-3}) + "\n")
    (directory / "eval.json").write_text(json.dumps(evals))
    return directory


def test_run_pictures_loss_and_before_after_heatmaps(tmp_path):
    pytest.importorskip("matplotlib")
    evals = {"before": {**result(0.25), "tasks": {"passkey": result(0.25), "niah_single": result(0.0)}},
             "after": {**result(1.0), "tasks": {"passkey": result(1.0), "niah_single": result(0.5),
                                                "variable_tracking": result(0.75)}}}
    run = fake_run(tmp_path / "run", evals)
    written = write_run_pictures(str(run), evals)
    names = sorted(p.rsplit("/", 1)[1] for p in written)
    assert names == ["accuracy_niah_single.png", "accuracy_passkey.png", "accuracy_variable_tracking.png", "loss.png"]
    for name in names:
        assert_png(run / name)
    # before | after side by side: twice as wide as a single panel (variable_tracking has "after" only).
    from matplotlib.image import imread

    assert imread(str(run / "accuracy_passkey.png")).shape[1] > 1.5 * imread(str(run / "accuracy_variable_tracking.png")).shape[1]


def test_eval_json_written_before_tasks_existed_is_read_as_passkey(tmp_path):
    pytest.importorskip("matplotlib")
    run = fake_run(tmp_path / "run", {})
    assert [p.rsplit("/", 1)[1] for p in write_run_pictures(str(run), {"before": result(0.5)})] == \
        ["loss.png", "accuracy_passkey.png"]


def test_eval_pictures_beside_the_results(tmp_path):
    pytest.importorskip("matplotlib")
    output = tmp_path / "res.json"
    written = write_eval_pictures({"tasks": {"niah_multikey": result(0.5)}}, str(output), before=result(0.0))
    assert written == [str(tmp_path / "res_accuracy_niah_multikey.png")]  # the run's before has no niah_multikey
    assert_png(tmp_path / "res_accuracy_niah_multikey.png")


def test_without_matplotlib_one_note_and_no_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    run = fake_run(tmp_path / "run", {})
    assert write_run_pictures(str(run), {"after": result(1.0)}) == []
    assert not list(run.glob("*.png"))
    assert capsys.readouterr().err.strip() == MISSING


def test_loss_ticks_are_whole_steps(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from train.evaluation.plots import plot_loss

    figures = []

    class Kept(Figure):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            figures.append(self)

    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, "loss": 3.0 - step / 10}) + "\n")
    assert plot_loss(Kept, str(tmp_path / "metrics.jsonl"), str(tmp_path / "loss.png"))
    axis = figures[0].axes[0]
    low, high = axis.get_xlim()
    ticks = [t for t in axis.get_xticks() if low <= t <= high]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
