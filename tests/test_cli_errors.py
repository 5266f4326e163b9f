"""`python -m train.qlora` error paths and output beyond the one-line bad-input cases of test_qlora_cli:
an output dir without write permission, what --no_packing truncates, library noise, and a user error
under `accelerate launch` (2 CPU processes over gloo).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from cli_helpers import ENV, REPO, accelerate_launch, base_argv
from train.recipe.args import parse_args
from train.run.command import main
from train.run.qlora import run

pytestmark = pytest.mark.usefixtures("one_thread")


def _cli(argv, *, prefix=(), timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "train.qlora", *map(str, argv)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def test_output_dir_without_write_permission_is_refused_before_the_model_loads(tiny, tmp_path):
    out = tmp_path / "read-only"
    out.mkdir()
    out.chmod(0o555)
    prefix = []
    if os.geteuid() == 0:  # root writes anywhere; drop the capabilities that let it (the rest of root stays)
        if not shutil.which("setpriv"):
            pytest.skip("running as root, and setpriv is not there to drop root's permission bypass")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    done = _cli(base_argv(tiny, out), prefix=prefix)
    if done.returncode != 2 and done.stderr.startswith("setpriv"):
        pytest.skip(f"setpriv cannot drop capabilities here: {done.stderr.strip()}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "Loading weights" not in done.stderr and "trainable parameters" not in done.stderr  # before heavy work
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: --output_dir {out} is not writable (Permission denied); choose a directory you can write to or "
        "fix its permissions")
    assert os.listdir(out) == []  # the probe file is gone


def test_no_packing_says_once_what_it_truncated(tiny, tmp_path, capsys):
    assert main(base_argv(tiny, tmp_path / "run", "--no_packing", "--max_seq_len", 48, "--max_steps", 1)) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "truncated" in line]
    assert len(notes) == 1, notes
    assert re.fullmatch(r"note: --no_packing truncated \d+ of 24 documents to --max_seq_len 48 tokens \(longest \d+; "
                        r"\d+ tokens dropped, never trained on\); to keep them, pack \(drop --no_packing\) or raise "
                        r"--max_seq_len", notes[0]), notes[0]


# Runs a module as __main__ as if the CPU had AVX512-BF16 (this one may not): bitsandbytes then looks for
# the optional `kernels` package at import and logs "Failed to load CPU gemm_4bit_forward ..." without it.
SIMULATE_AVX512_BF16 = '''
import importlib.abc, importlib.machinery, runpy, sys

class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.backends.cpu.ops":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module

        def patched(module):
            import bitsandbytes.functional as functional
            real, functional.has_avx512bf16 = functional.has_avx512bf16, lambda: True
            try:
                exec_module(module)  # its module-level check sees AVX512-BF16
            finally:
                functional.has_avx512bf16 = real
            print("simulated AVX512-BF16", file=sys.stderr)

        spec.loader.exec_module = patched
        return spec

sys.meta_path.insert(0, Finder())
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
'''


def test_bitsandbytes_kernels_noise_is_silenced(tiny, tmp_path):
    script = tmp_path / "simulate_avx512_bf16.py"
    script.write_text(SIMULATE_AVX512_BF16)
    noise = "Failed to load CPU gemm_4bit_forward"
    control = subprocess.run([sys.executable, str(script), "bitsandbytes"], cwd=REPO, env=ENV, capture_output=True,
                             text=True, timeout=300)  # bitsandbytes alone: the line is there
    assert noise in control.stderr and "simulated AVX512-BF16" in control.stderr, control.stderr[-2000:]

    argv = base_argv(tiny, tmp_path / "run", "--max_steps", 1)
    done = subprocess.run([sys.executable, str(script), "train.qlora", *argv], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "simulated AVX512-BF16" in done.stderr  # the 4-bit run imported bitsandbytes' CPU ops
    assert noise not in done.stderr + done.stdout


# ---------------------------------------------------------------- accelerate launch

# `python -m train.qlora` whose second process goes on late after reading the data (a busy machine: CI saw a rank
# more than lifecycle.PEER_WAIT_S behind the first).
SECOND_RANK_LATE = '''
import runpy, sys, time
import train.run.qlora as qlora

made, late_s = qlora.make_layout, float(sys.argv.pop(1))

def late(world_size, rank, args):
    if rank == 1:
        time.sleep(late_s)
    return made(world_size, rank, args)

qlora.make_layout = late
runpy.run_module("train.qlora", run_name="__main__", alter_sys=True)
'''


def _launch_second_rank_late(argv, late_s: float, tmp_path) -> subprocess.CompletedProcess:
    program = tmp_path / "second_rank_late.py"
    program.write_text(SECOND_RANK_LATE)
    cmd = [*accelerate_launch(2), str(program), str(late_s), *map(str, argv)]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["resume with another process count", "broken jsonl line"])
def test_user_error_under_accelerate_launch_is_one_line_from_the_main_process(tiny, tmp_path, case):
    """The error is the only text our processes print about it: no second rank's copy, no gloo 'connection
    closed' traceback from a rank left waiting. torchrun's own report follows (no worker can prevent it): the first
    process exits 2 after the other has exited 0, so the report names one failure, with the same line as its cause,
    and no process is sent SIGTERM, even when the second process is late (the main process checks the checkpoint and
    shares its error: had each rank checked, the first would have outwaited the late one only PEER_WAIT_S)."""
    from train.recipe.lifecycle import PEER_WAIT_S

    out = tmp_path / "run"
    if case == "resume with another process count":  # only known once the process group exists
        run(parse_args(base_argv(tiny, out, "--max_steps", 1, "--save_steps", 1)))
        argv = base_argv(tiny, out, "--resume_from_checkpoint", out / "checkpoint-1")
        expected = f"error: checkpoint {out / 'checkpoint-1'} was written with other data settings (processes 1 -> 2)"
    else:  # found by the main process alone, while the other waits for it
        (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": broken}\n')
        argv = [*base_argv(tiny, out), "--dataset", tmp_path / "broken.jsonl"]
        expected = f"error: could not read {tmp_path / 'broken.jsonl'}: line 2 is not valid JSON"
    done = _launch_second_rank_late(argv, PEER_WAIT_S + 2, tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(expected), output[-4000:]
    assert not re.search(r"^\[rank\d\]", output, re.M), output[-4000:]  # no worker traceback
    assert "Connection closed" not in output and "ProcessGroup" not in output
    # torchrun's report: one failure, rank 0 exiting 2 on its own, the other gone first (nothing to SIGTERM) ...
    assert re.findall(r"^\s+exitcode\s*:\s*\S+", output, re.M) == ["  exitcode  : 2"], output[-4000:]
    assert "<NO_OTHER_FAILURES>" in output and "closing signal" not in output
    # ... and it shows the user's line as the cause, not its pointer to the elastic docs.
    assert len(re.findall(r"traceback\s*:\s*" + re.escape(errors[0]), output)) == 1
    # What docs/training.md says the user sees after our line: torchrun's log line of the failure, the launcher's Python
    # traceback (its own frames) and the 16-line report, nothing else.
    after = output.strip().splitlines()[output.strip().splitlines().index(errors[0]) + 1:]
    assert "failed (exitcode: 2) local_rank: 0" in after[0] and after[1] == "Traceback (most recent call last):", output
    report = next(i for i, line in enumerate(after) if line.startswith("torch.distributed.elastic.multiprocessing."
                                                                       "errors.ChildFailedError"))
    assert all(line.startswith("  ") for line in after[2:report]) and len(after[report:]) == 16, output


def test_a_worker_exits_0_only_when_its_machines_first_worker_is_leaving_too(tmp_path, monkeypatch):
    """torchrun's layout of error files; the first worker's file is what tells the others it reports the failure."""
    from train.recipe import lifecycle

    attempt = tmp_path / "run" / "attempt_0"
    monkeypatch.setattr(lifecycle, "PEER_WAIT_S", 0.2)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "1" / "error.json"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert lifecycle._launcher_status(2, []) == 2  # an error of its own: torchrun must still stop the launch
    (attempt / "0").mkdir(parents=True)
    (attempt / "0" / "error.json").write_text("{}")
    assert lifecycle._launcher_status(2, []) == 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert lifecycle._launcher_status(2, []) == 2  # the first one keeps it (no peers here to wait for)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert lifecycle._launcher_status(2, []) == 2  # not torchrun


def test_the_first_worker_outwaits_a_slow_peer_only_while_it_says_it_is_leaving(tmp_path, monkeypatch):
    """Exiting while a peer still runs makes torchrun SIGTERM it and report it (CI: a peer on a busy machine took more
    than PEER_WAIT_S to go). A peer that has written its error file is waited for until it exits, and so is one that
    has not when the error is every rank's (peers_leaving: it is on its way); otherwise (an error of the first's own,
    the peer stuck elsewhere) only PEER_WAIT_S."""
    import time

    from train.recipe import lifecycle

    attempt = tmp_path / "run" / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    monkeypatch.setattr(lifecycle, "PEER_WAIT_S", 0.2)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "0" / "error.json"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for says_leaving, peers_leaving in ((False, False), (False, True), (True, False)):
        if says_leaving:
            (attempt / "1").mkdir()
            (attempt / "1" / "error.json").write_text("{}")
        peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
        start = time.monotonic()
        assert lifecycle._launcher_status(2, [peer.pid], peers_leaving) == 2
        waited = time.monotonic() - start
        outwaited = says_leaving or peers_leaving
        assert (peer.poll() is not None) == outwaited, waited
        assert waited >= 2 if outwaited else waited < 2
        peer.kill()
        peer.wait()


def test_leaving_finds_its_peers_before_its_error_file_tells_them_to_go(tmp_path, monkeypatch):
    """A peer that reads the first's error file exits at once, and a process on its way out has no command line left
    to be recognised by: looked for afterwards, it could be missed, and the first would exit while torchrun still
    counts the peer as running."""
    from train.recipe import lifecycle

    error_file = tmp_path / "run" / "attempt_0" / "0" / "error.json"
    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("LOCAL_RANK", "0")
    found_with_file = []
    monkeypatch.setattr(lifecycle, "_machine_peers", lambda: found_with_file.append(error_file.exists()) or [])
    monkeypatch.setattr(lifecycle, "launched_world_size", lambda: 1)  # signals stay as they are
    assert lifecycle.leave("error: x", 2, here=False) == 2
    assert found_with_file == [False] and error_file.exists()


def test_a_zombie_whose_threads_still_run_is_alive(tmp_path):
    """os._exit ends a process's threads one by one: its first thread can be a zombie (Linux's /proc says Z) while the
    others still run, and until they have gone its parent cannot reap it (torchrun would SIGTERM it). Here the first
    thread leaves by pthread_exit while another sleeps."""
    import ctypes.util
    import time

    from train.recipe.lifecycle import process_alive

    program = ("import ctypes, threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
               f"time.sleep(0.1); ctypes.CDLL({ctypes.util.find_library('c')!r}).pthread_exit(None)")
    proc = subprocess.Popen([sys.executable, "-c", program])
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert proc.poll() is None and process_alive(proc.pid) is True
    finally:
        proc.kill()
    while len(os.listdir(f"/proc/{proc.pid}/task")) > 1:  # the sleeping thread going
        time.sleep(0.01)
    assert process_alive(proc.pid) is False  # a zombie alone: gone, though not reaped yet
    proc.wait()
    assert process_alive(proc.pid) is False


@pytest.mark.parametrize("world", [1, 2])
def test_a_launched_worker_leaves_without_the_interpreters_teardown(world):
    """exit_process: under a launcher (WORLD_SIZE > 1) the exit status and every printed line come out, but nothing of
    the teardown runs (atexit here; gloo's threads and FSDP state in a run); alone, a normal exit."""
    program = ("import atexit, sys; from train.recipe.lifecycle import exit_process; "
               "atexit.register(lambda: print('teardown')); print('done', end=''); "
               "print('line', end='', file=sys.stderr); exit_process(3)")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, env={**ENV, "WORLD_SIZE": str(world)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and done.stderr.endswith("line")
    assert done.stdout == ("done" if world > 1 else "doneteardown\n")


# Library lines a plain run printed (with the deepspeed package installed, on a machine without a GPU), and the call
# of ours behind each: accelerate's unwrap_model imports deepspeed, which logs this to stdout; the patched loss
# forward read and passed its output's past_key_values (transformers' rename logs once per process).
LIBRARY_LINES = ("Setting accelerator to CPU", "past_key_values", "FutureWarning")


def test_a_run_prints_our_lines_and_no_library_noise(tiny, tmp_path):
    pytest.importorskip("deepspeed")
    control = subprocess.run([sys.executable, "-c", "import deepspeed"], cwd=REPO, env=ENV, capture_output=True,
                             text=True, timeout=300)  # deepspeed alone: the line is there (on a machine without a GPU)
    if "Setting accelerator to CPU" not in control.stdout + control.stderr:
        pytest.skip("deepspeed found an accelerator here: it does not print the line")
    # --skip_memory_check: the check's simulated step runs with transformers' logging quieted, which would use up the
    # once-per-process rename warning before the run itself could show it.
    done = _cli(base_argv(tiny, tmp_path / "run", "--max_steps", 2, "--skip_memory_check"))
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert not [line for line in output.splitlines() if any(noise in line for noise in LIBRARY_LINES)], output
    assert "trainable parameters" in done.stderr and "done: 2 steps" in done.stderr  # our own lines still there
