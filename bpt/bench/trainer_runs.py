"""`python -m train.qlora` as child processes of the GPU check's trainer part (bpt.bench.trainer_check): started with
their output in a log, watched through the metrics.jsonl they write, stopped by SIGTERM as a cluster stops a job, and
held to the part's deadline (a run still going then is stopped the same way, so it saves a checkpoint and says so)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

GRACE_SECONDS = 90  # after a SIGTERM: the step in progress, the checkpoint, the exit
POLL_SECONDS = 0.25


@dataclass
class Run:
    """One `python -m train.qlora` process: its argv (after the module), output folder and log."""

    name: str
    argv: list[str]
    out: Path
    log: Path
    process: subprocess.Popen | None = None
    started: float = 0.0
    seconds: float | None = None
    returncode: int | None = None
    signalled_after: int | None = None  # the logged step after which SIGTERM was sent
    notes: list[str] = field(default_factory=list)

    def start(self, where: Path, env: dict) -> "Run":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:  # a resumed run's lines follow its first part's
            # SIGTERM reaches the trainer with its default handling whatever the check's own shell set
            self.process = subprocess.Popen([sys.executable, "-m", "train.qlora", *self.argv], cwd=where, env=env,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
        self.started, self.returncode, self.seconds = time.monotonic(), None, None
        return self

    def poll(self) -> int | None:
        if self.returncode is None and self.process is not None and self.process.poll() is not None:
            self.returncode = self.process.returncode
            self.seconds = round(time.monotonic() - self.started, 1)
        return self.returncode

    def steps_logged(self) -> int:
        """The last step metrics.jsonl holds (0 before the first logged row)."""
        path = self.out / "metrics.jsonl"
        if not path.is_file():
            return 0
        steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]
        return max(steps, default=0)

    def terminate(self, why: str) -> None:
        if self.poll() is None:
            self.signalled_after = self.steps_logged()
            self.notes.append(f"SIGTERM after step {self.signalled_after}: {why}")
            self.process.send_signal(signal.SIGTERM)

    def lines(self) -> list[str]:
        return output_lines(self.log.read_text(errors="replace") if self.log.is_file() else "")


def output_lines(text: str) -> list[str]:
    """A process's output as lines, progress bars' carriage returns split off."""
    return [part for line in text.splitlines() for part in line.split("\r") if part.strip()]


def wait_all(runs: list[Run], deadline: float, *, stop_at: dict[str, int] | None = None) -> None:
    """Wait for every run to exit. A run named in `stop_at` gets SIGTERM once that step is logged; any run still going
    at `deadline` gets SIGTERM (the check's time budget), and is killed GRACE_SECONDS later."""
    stop_at = dict(stop_at or {})
    killed_at = None
    while any(run.poll() is None for run in runs):
        now = time.monotonic()
        for run in runs:
            if run.poll() is None and run.name in stop_at and run.steps_logged() >= stop_at[run.name]:
                run.terminate(f"the part's interruption once step {stop_at.pop(run.name)} was logged")
        if now >= deadline and killed_at is None:
            for run in runs:
                run.terminate("the check's time budget")
            killed_at = now + GRACE_SECONDS
        if killed_at is not None and now >= killed_at:
            for run in runs:
                if run.poll() is None:
                    run.notes.append(f"killed: still running {GRACE_SECONDS} s after SIGTERM")
                    run.process.kill()
                    run.process.wait()
            break
        time.sleep(POLL_SECONDS)
    for run in runs:
        run.poll()


def run_once(argv: list[str], where: Path, env: dict, timeout: float) -> tuple[int | None, list[str], float]:
    """A short command of the module (returncode, its output's lines, seconds); None on timeout."""
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, *argv], cwd=where, env=env, capture_output=True, text=True,
                              timeout=max(1.0, timeout))
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as stop:
        code = None
        text = stop.stderr.decode(errors="replace") if isinstance(stop.stderr, bytes) else (stop.stderr or "")
    return code, output_lines(text), round(time.monotonic() - started, 1)
