"""SIGINT / SIGTERM during `python -m train.qlora` (Ctrl-C, a cluster's preemption): the loop finishes its
optimizer step, writes a checkpoint, prints where it is and the command that resumes, and exits 130 / 143;
a second signal aborts at once."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from cli_helpers import ENV, REPO, base_argv, metrics
from train.recipe import checkpoint, lifecycle
from train.recipe.lifecycle import Interrupted, interrupted_message, resume_command
from train.run.command import main

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 12


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_a_checkpoint_says_how_to_resume_and_resuming_finishes(tiny, tmp_path, signum):
    out = tmp_path / "run"
    argv = base_argv(tiny, out, "--max_steps", STEPS, "--save_steps", 0)
    # A shell's background job starts with SIGINT ignored, and a child inherits that: give it the default.
    process = subprocess.Popen([sys.executable, "-m", "train.qlora", *argv], cwd=REPO, env=ENV, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no step was logged"
            time.sleep(0.02)
        process.send_signal(signum)  # step 1 is done; the loop is somewhere in a later step
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    step = len(metrics(out))  # every step it finished is logged, the last one included
    assert 1 <= step < STEPS
    saved = out / f"checkpoint-{step}"
    assert last.startswith(f"stopped by {signum.name} after step {step} of {STEPS}: saved {saved}; resume with: "), last
    command = shlex.split(last.split("resume with: ", 1)[1])
    assert command[:3] == ["python", "-m", "train.qlora"] and command[-2:] == ["--resume_from_checkpoint", "latest"]
    assert command[3:-2] == [str(a) for a in argv]

    assert checkpoint.resolve("latest", str(out)) == str(saved)  # complete, and the one 'latest' picks
    assert checkpoint.read_state(str(saved))["step"] == step
    assert not (out / "run_info.json").exists()  # the run is not finished
    assert main(command[3:]) == 0  # the printed command, in-process
    assert [m["step"] for m in metrics(out)] == list(range(1, STEPS + 1))
    assert json.loads((out / "run_info.json").read_text())["finished"] is True


@pytest.fixture
def default_sigterm():
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_repeat_is_the_same_request_and_a_later_signal_aborts(monkeypatch, default_sigterm):
    with lifecycle.SIGNALS.mode(graceful=True) as signals:
        assert signal.getsignal(signal.SIGTERM) == signals._handle
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.requested == signal.SIGTERM  # noted; the loop stops after its step
        # The same stop delivered twice at once (the launcher forwards it, the scheduler signals every process).
        os.kill(os.getpid(), signal.SIGTERM)
        monkeypatch.setattr(lifecycle, "REPEAT_WINDOW_S", 0.0)  # a later signal: the user insists
        with pytest.raises(Interrupted) as raised:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # not reached: the handler raises first
    assert raised.value.again and raised.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored on the way out


def test_interrupted_messages_and_resume_command(tmp_path):
    argv = ["--config", "my run.yaml", "--resume_from_checkpoint", "out/checkpoint-4", "--max_steps", "9"]
    expected = "python -m train.qlora --config 'my run.yaml' --max_steps 9 --resume_from_checkpoint latest"
    assert resume_command(argv) == expected
    stopped = Interrupted(signal.SIGTERM, step=5, steps=9, saved="out/checkpoint-5")
    assert interrupted_message(stopped, None, argv) == (
        f"stopped by SIGTERM after step 5 of 9: saved out/checkpoint-5; resume with: {expected}")
    aborted = Interrupted(signal.SIGINT, again=True, step=6, steps=9, last_checkpoint="out/checkpoint-5")
    assert interrupted_message(aborted, None, argv) == (
        f"error: aborted by a second SIGINT during step 6, without saving; the last checkpoint is out/checkpoint-5; "
        f"resume with: {expected}")
    assert interrupted_message(Interrupted(signal.SIGINT), None, []) == (
        "error: aborted by SIGINT outside the training loop, without saving; no checkpoint was written")
