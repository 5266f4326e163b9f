"""Nothing finished is lost, and a resumed run is the uninterrupted one: after a SIGTERM, a full disk (a checkpoint or
the final adapter), or a killed process, the run stops with one line naming the last checkpoint and the command
that resumes, and that command gives the uninterrupted run's final adapter and metrics.jsonl rows (every field but
the wall-time ones, tokens_per_s and peak_mem_mb)."""
from __future__ import annotations

import errno
import os
import shlex
import signal
import subprocess

import pytest
import torch

from cli_helpers import ENV, REPO, accelerate_launch, base_argv, error_line, metrics
from train.recipe import checkpoint
from train.run import loop
from train.run.command import main

pytestmark = pytest.mark.usefixtures("one_thread")

# Rows every 4 steps and checkpoints every 2: a stop or a save between two rows leaves a partial window. Dropout and
# accumulation on, so the restored RNG and data position matter too.
STEPS = 6
FLAGS = ("--max_steps", STEPS, "--save_steps", 2, "--logging_steps", 4, "--lora_dropout", 0.1,
         "--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2)
COMPARED = ("step", "loss", "lr", "grad_norm", "tokens")  # a row's fields that do not measure wall time or memory


def rows(out) -> list[dict]:
    return [{key: row[key] for key in COMPARED} for row in metrics(out)]


def adapter(directory) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "adapter_model.safetensors"))


def assert_same_run(out, whole) -> None:
    assert rows(out) == rows(whole)
    got, expected = adapter(out), adapter(whole)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert (out / "run_info.json").is_file()
    if (whole / "loss.png").is_file():  # with matplotlib: the picture drawn from the rows, byte for byte
        assert (out / "loss.png").read_bytes() == (whole / "loss.png").read_bytes()


def resume(message: str, launcher: list[str]) -> list[str]:
    """The train.qlora flags of the command a stop line says resumes the run."""
    command = shlex.split(message.split("resume with: ", 1)[1])
    assert command[:len(launcher)] == launcher and command[-2:] == ["--resume_from_checkpoint", "latest"]
    return command[len(launcher):]


@pytest.fixture(scope="module")
def whole(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    assert main(base_argv(tiny, out, *FLAGS)) == 0
    assert [row["step"] for row in metrics(out)] == [4, 6]
    return out


def test_a_stop_between_rows_resumes_to_the_uninterrupted_metrics(tiny, tmp_path, whole, monkeypatch, capsys):
    out = tmp_path / "run"
    train_step = loop.train_step

    def sigterm_in_step_3(*args):
        if args[6] == 3:  # step: the loop finishes it, saves checkpoint-3 and stops
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(*args)

    monkeypatch.setattr(loop, "train_step", sigterm_in_step_3)
    assert main(base_argv(tiny, out, *FLAGS)) == 143
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"stopped by SIGTERM after step 3 of {STEPS}: saved {out / 'checkpoint-3'}"), line
    assert not (out / "metrics.jsonl").exists() or not metrics(out)  # step 3 is no logging step: no row
    monkeypatch.undo()
    assert main(resume(line, ["python", "-m", "train.qlora"])) == 0
    assert_same_run(out, whole)


def fill_disk_writing(monkeypatch, module, name: str, where) -> None:
    """module.name (torch.save, safetensors' save_file as peft calls it) runs out of disk space when where(path):
    half of the file lands, then the write fails with ENOSPC, as on a full disk."""
    real = getattr(module, name)

    def write(obj, path, *args, **kwargs):
        if not where(str(path)):
            return real(obj, path, *args, **kwargs)
        real(obj, path, *args, **kwargs)
        os.truncate(path, os.path.getsize(path) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(module, name, write)


def test_a_full_disk_while_saving_a_checkpoint_keeps_the_earlier_ones(tiny, tmp_path, whole, monkeypatch, capsys):
    out = tmp_path / "run"
    with monkeypatch.context() as patch:  # the disk fills while checkpoint-4's optimizer state is written
        fill_disk_writing(patch, torch, "save", lambda path: f"{checkpoint.PREFIX}4" in path)
        assert main(base_argv(tiny, out, *FLAGS)) == 1
    line = error_line(capsys)
    assert line.startswith(f"error: could not write checkpoint-4: No space left on device (nothing of it was kept); "
                           f"the last checkpoint is {out / 'checkpoint-2'}; resume with: "), line
    assert sorted(os.listdir(out)) == ["checkpoint-2", "metrics.jsonl"]  # no partial checkpoint-4, no temp dir
    assert checkpoint.resolve("latest", str(out)) == str(out / "checkpoint-2")
    assert adapter(out / "checkpoint-2").keys() == adapter(whole / "checkpoint-2").keys()
    assert all(torch.equal(t, adapter(whole / "checkpoint-2")[k]) for k, t in adapter(out / "checkpoint-2").items())
    assert main(resume(line, ["python", "-m", "train.qlora"])) == 0
    assert_same_run(out, whole)


def test_a_full_disk_while_saving_the_final_adapter_resumes_to_write_it(tiny, tmp_path, whole, monkeypatch, capsys):
    import peft.peft_model

    out = tmp_path / "run"
    with monkeypatch.context() as patch:  # every checkpoint is written; the adapter beside them is not
        fill_disk_writing(patch, peft.peft_model, "safe_save_file", lambda path: checkpoint.PREFIX not in path)
        assert main(base_argv(tiny, out, *FLAGS)) == 1
    line = error_line(capsys)
    assert line.startswith(f"error: could not write the final adapter to {out}: No space left on device (nothing of "
                           f"it was kept); the last checkpoint is {out / f'checkpoint-{STEPS}'}; resume with: "), line
    assert not [name for name in os.listdir(out) if name.startswith(".") or name.startswith("adapter")]
    assert main(resume(line, ["python", "-m", "train.qlora"])) == 0  # at its last step: writes what is missing
    assert_same_run(out, whole)
    assert main(resume(line, ["python", "-m", "train.qlora"])) == 2  # finished now: nothing left to resume


def test_a_full_disk_while_logging_stops_at_that_step(tiny, tmp_path, monkeypatch, capsys):
    out, appends = tmp_path / "run", []

    def open_metrics(path, mode="r", *args, **kwargs):  # the disk fills while step 3's row is appended
        if mode == "a":
            appends.append(path)
            if len(appends) == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return open(path, mode, *args, **kwargs)

    argv = base_argv(tiny, out, "--save_steps", 2)  # a row every step
    with monkeypatch.context() as patch:
        patch.setattr(loop, "open", open_metrics, raising=False)
        assert main(argv) == 1
    assert error_line(capsys).startswith(f"error: could not write {out / 'metrics.jsonl'}: No space left on device "
                                         f"(nothing of it was kept); the last checkpoint is {out / 'checkpoint-2'}; ")
    assert [row["step"] for row in metrics(out)] == [1, 2]
    assert main([*argv, "--resume_from_checkpoint", "latest"]) == 0
    assert [row["step"] for row in metrics(out)] == [1, 2, 3, 4]


def test_save_minutes_checkpoints_by_wall_time(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(base_argv(tiny, out, "--max_steps", 3, "--save_steps", 0, "--save_minutes", 1e-6)) == 0
    assert checkpoint.list_checkpoints(str(out)) == [str(out / f"checkpoint-{n}") for n in (1, 2, 3)]
    assert main(base_argv(tiny, tmp_path / "bad", "--save_minutes", -1)) == 2
    assert error_line(capsys) == "error: --save_minutes must be >= 0, got -1.0"


def test_a_killed_process_stops_the_others_with_one_line_and_resumes_exactly(tiny, tmp_path):
    """--sequence_parallel 2 on 2 CPU processes; rank 0 (the main process) is killed with SIGKILL in step 4, after
    checkpoint-2: rank 1 says so and stops; the printed command resumes to the uninterrupted run."""
    flags = [*map(str, FLAGS[:6]), "--lora_dropout", "0", "--sequence_parallel", "2"]

    def run(*argv) -> subprocess.CompletedProcess:
        return subprocess.run([*accelerate_launch(2), *map(str, argv)], cwd=REPO, env=ENV, capture_output=True, text=True,
                              timeout=300)

    whole = tmp_path / "whole"
    done = run("-m", "train.qlora", *base_argv(tiny, whole, *flags))
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "run"
    killed = run(REPO / "tests/qlora_kill_rank.py", 0, 4, *base_argv(tiny, out, *flags))
    assert killed.returncode != 0
    ours = [line for line in killed.stderr.splitlines() if line.startswith("error:")]
    assert len(ours) == 1 and ours[0].startswith(
        f"error: rank 0 (pid {ours[0].split('pid ')[1].split(')')[0]}) died during step 4 of {STEPS}; the other "
        f"processes cannot finish that step without it and stopped without saving; the last checkpoint is "
        f"{out / 'checkpoint-2'}; resume with: "), ours
    assert "[rank1]" not in killed.stderr and "Connection closed by peer" not in killed.stderr  # no worker traceback
    assert checkpoint.list_checkpoints(str(out)) == [str(out / "checkpoint-2")]
    done = run("-m", "train.qlora", *resume(ours[0], shlex.split("accelerate launch <the same launch options> -m "
                                                                  "train.qlora")))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(out, whole)
