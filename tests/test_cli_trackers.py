"""--report_to tensorboard / wandb (offline): what a run logs is really there, read back from the files the
trackers write (tensorboard's EventAccumulator; wandb's offline run file)."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from cli_helpers import base_argv, losses
from train.recipe.args import parse_args
from train.run.qlora import run

pytestmark = pytest.mark.usefixtures("one_thread")

# A passkey evaluation before and after (one prompt each) so that the eval scalars are logged too.
EVAL = ("--eval_passkey", "--eval_lengths", 120, "--eval_trials", 1, "--eval_depths", 0.5)


def test_tensorboard_events_hold_the_training_loss_and_the_eval(tiny, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    run(parse_args(base_argv(tiny, out, "--max_steps", 3, "--report_to", "tensorboard", *EVAL)))
    events = sorted((out / "train.qlora").glob("events.out.tfevents.*"))
    assert len(events) == 1, list((out / "train.qlora").rglob("*"))
    accumulator = EventAccumulator(str(events[0]))
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/passkey_accuracy"} <= set(scalars)
    logged = accumulator.Scalars("train/loss")
    assert [e.step for e in logged] == [1, 2, 3]
    assert [e.value for e in logged] == pytest.approx(losses(out), rel=1e-6)  # float32 in the event file
    assert [e.step for e in accumulator.Scalars("eval/passkey_accuracy")] == [0, 3]  # before and after
    evals = json.loads((out / "eval.json").read_text())
    assert [e.value for e in accumulator.Scalars("eval/passkey_accuracy")] == pytest.approx(
        [evals["before"]["accuracy"], evals["after"]["accuracy"]])
    if (out / "accuracy_passkey.png").exists():  # the heatmap (before | after) as an image, where matplotlib is
        from PIL import Image

        [heatmap] = accumulator.Images("eval/accuracy_passkey")
        assert heatmap.step == 3
        assert (heatmap.width, heatmap.height) == Image.open(out / "accuracy_passkey.png").size


def _wandb_records(path: Path):
    """The protobuf records of a wandb run file (.wandb): a leveldb-style log of 32 KiB blocks after a
    7-byte header; each record piece is crc32 (4) | length (2, little endian) | type (1: full, 2: first,
    3: middle, 4: last) | data."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    if len(data) < 7:  # the header not written yet
        return
    assert data[:4] == b":W&B"
    pos, pieces = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            return
        pieces = data[pos + 7:pos + 7 + length] if kind in (1, 2) else pieces + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record


def _finished_wandb_records(path: Path, timeout: float = 60.0) -> list:
    """The run file's records once its exit record is there. wandb's service process writes the file; under load
    (a busy 2-core CI machine) its last writes can land a moment after `run.finish()` has returned."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(_wandb_records(path))
        if any(record.WhichOneof("record_type") == "exit" for record in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def test_wandb_offline_run_holds_the_training_loss_and_the_eval(tiny, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    run(parse_args(base_argv(tiny, out, "--max_steps", 3, "--report_to", "wandb", *EVAL)))
    import wandb

    wandb.teardown()  # what a process exit does: the service closes the run file
    assert not (tmp_path / "wandb").exists()  # nothing in the working directory: the run lives in output_dir
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list(out.rglob("*"))

    history, names, finished, kinds = [], [], False, []
    for record in _finished_wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        kinds.append(kind)
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "run":
            names.append((record.run.project, record.run.display_name))
        elif kind == "exit":
            finished = record.exit.exit_code == 0
    train = [row for row in history if "train/loss" in row]
    assert [row["_step"] for row in train] == [1, 2, 3], (kinds, history)
    assert [row["train/loss"] for row in train] == pytest.approx(losses(out), rel=1e-12)
    assert [row["eval/passkey_accuracy"] for row in history if "eval/passkey_accuracy" in row] == pytest.approx(
        [json.loads((out / "eval.json").read_text())[when]["accuracy"] for when in ("before", "after")])
    assert names[0] == ("train.qlora", "run") and finished
    if (out / "accuracy_passkey.png").exists():  # the heatmap as a wandb image, where matplotlib is
        [image] = [row for row in history if "eval/accuracy_passkey/_type" in row]  # flattened: key/field
        assert image["eval/accuracy_passkey/_type"] == "images/separated" and image["_step"] == 3
        assert image["eval/accuracy_passkey/count"] == 1 and image["eval/accuracy_passkey/format"] == "png"
