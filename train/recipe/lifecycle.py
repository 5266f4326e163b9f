"""The process around `python -m train.qlora`: SIGINT / SIGTERM (Interrupted, SIGNALS), library log lines
that are not the user's problem (silence_library_noise, also used by train.eval; quieted), and leaving the command
line with one line and its exit status (leave, interrupted_message, resume_command, exit_process)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time

from train.parallel.layout import launched_world_size
from train.recipe.args import Args

# torch (and what imports it) is imported where it is used: the command line refuses bad flags with these helpers
# before torch loads.

# ---------------------------------------------------------------- SIGINT / SIGTERM

REPEAT_WINDOW_S = 1.0  # a signal this soon after the first is the same stop request delivered twice


class Interrupted(BaseException):
    """SIGINT / SIGTERM stopped the run.

    saved: the checkpoint written on the way out (a graceful stop after finishing `step`); None when a
    repeated signal aborted at once (`again`), or the signal came outside the training loop.
    A BaseException, like KeyboardInterrupt, so no `except Exception` on the way out swallows it.
    """

    def __init__(self, signum: int, *, again: bool = False, step: int | None = None, steps: int | None = None,
                 saved: str | None = None, last_checkpoint: str | None = None):
        super().__init__(signum)
        self.signum, self.again, self.step, self.steps = signum, again, step, steps
        self.saved, self.last_checkpoint = saved, last_checkpoint

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        if self.saved:
            return f"stopped by {name} after step {self.step} of {self.steps}: saved {self.saved}"
        if self.again and self.step is not None:
            return f"aborted by a second {name} during step {self.step}, without saving"
        return f"aborted by {'a second ' if self.again else ''}{name} outside the training loop, without saving"


class _Signals:
    """SIGINT/SIGTERM handling, in the main thread only. In graceful mode (the training loop) a signal sets
    `requested` and the loop stops after its step; otherwise (main() around the loop) it raises
    Interrupted at once. A repeat within REPEAT_WINDOW_S of the first is ignored; a later one raises
    Interrupted(again=True) in either mode. A signal the process was started ignoring stays ignored."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.graceful = False
        self.requested: int | None = None  # the signal a graceful stop was asked with
        self.first_at: float | None = None  # time.monotonic() of the first signal
        self.previous: dict = {}  # signum -> the handler to restore

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.first_at is not None and now - self.first_at < REPEAT_WINDOW_S:
            return
        again = self.first_at is not None
        self.first_at = self.first_at if again else now
        if self.graceful and not again:
            self.requested = signum
            return
        raise Interrupted(signum, again=again)

    def ignore_until_exit(self) -> None:
        """A worker of a launcher on its way out after an error or a stop: torchrun SIGTERMs the workers
        still running when one exits; let each finish its message and exit with its own status instead of
        dying half way (the launcher's report would then show SIGTERM, not the reason)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
                if sig in self.previous:
                    self.previous[sig] = signal.SIG_IGN  # leaving mode() must not re-arm it

    @contextlib.contextmanager
    def mode(self, graceful: bool):
        fresh = not self.previous
        if fresh and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous = signal.getsignal(sig)
                if previous is not signal.SIG_IGN:
                    self.previous[sig] = previous
                    signal.signal(sig, self._handle)
        outer, self.graceful = self.graceful, graceful
        try:
            yield self
        finally:
            self.graceful = outer
            if fresh:
                for sig, previous in self.previous.items():
                    signal.signal(sig, previous)
                self._reset()


SIGNALS = _Signals()


# ---------------------------------------------------------------- library log noise

# Library log lines that are not the user's problem: (logger, message prefix). bitsandbytes looks for an
# optional faster CPU kernel on CPUs with AVX512-BF16 and logs a "failure" when it is not installed; the
# fallback it then uses is the normal path. DeepSpeed, imported whenever it is installed (accelerate's unwrap_model
# checks for its engine), warns on a machine without a GPU that it found none, to stdout, once per process.
LIBRARY_NOISE = (("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
                 ("DeepSpeed", "Setting accelerator to CPU"))


class _NoiseFilter(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_library_noise() -> None:
    """Drop the LIBRARY_NOISE log lines (only those: every other message of the same loggers still shows).
    Idempotent; must run before the library is imported when the line is logged at import."""
    for name, prefix in LIBRARY_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoiseFilter) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_NoiseFilter(prefix))


@contextlib.contextmanager
def quieted(logger_name: str, level: int):
    """Only records at `level` or above from the named logger while inside (its own level restored after): for a
    library whose lines say the same thing as our one-line error, or talk about its own plumbing."""
    logger = logging.getLogger(logger_name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


# ---------------------------------------------------------------- leaving the command line

def is_main_process() -> bool:
    """Rank 0, from the launcher's environment (valid before and after the process group exists)."""
    return int(os.environ.get("RANK", "0")) == 0


def resume_command(argv: list[str]) -> str:
    """The command that resumes this run: its own flags, with --resume_from_checkpoint latest."""
    kept, i = [], 0
    while i < len(argv):
        if argv[i] == "--resume_from_checkpoint":
            i += 2  # the flag and its value
            continue
        if not argv[i].startswith("--resume_from_checkpoint="):
            kept.append(argv[i])
        i += 1
    distributed = launched_world_size() > 1
    launcher = ("accelerate launch <the same launch options> -m train.qlora" if distributed
                else "python -m train.qlora")
    return f"{launcher} {shlex.join([*kept, '--resume_from_checkpoint', 'latest'])}"


def interrupted_message(stop: Interrupted, args: Args | None, argv: list[str]) -> str:
    """One line: what the signal stopped, what is on disk, and how to go on."""
    if stop.saved:
        return f"{stop}; resume with: {resume_command(argv)}"
    return stopped_message(str(stop), stop.last_checkpoint, args, argv)


def stopped_message(what: str, last_checkpoint: str | None, args: Args | None, argv: list[str]) -> str:
    """One line for a run that stopped without saving (a second signal, a failed save, a dead process): what
    happened, the newest checkpoint (`last_checkpoint`, or else the newest in output_dir) and the command that
    resumes from it."""
    last = last_checkpoint
    if last is None and args is not None:  # whatever an earlier part of the run saved
        from train.recipe import checkpoint

        found = checkpoint.list_checkpoints(args.output_dir)
        last = found[-1] if found else None
    where = (f"the last checkpoint is {last}; resume with: {resume_command(argv)}" if last
             else "no checkpoint was written")
    return f"error: {what}; {where}"


def _tell_launcher(message: str) -> None:
    """torchrun (accelerate launch) shows a failed worker's error file as the "traceback" of its failure
    report: give it the user's line instead of its pointer to the elastic docs."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)


PEER_WAIT_S = 5.0  # the longest a launcher's worker on its way out waits for the others of its machine
LEAVING_PEER_WAIT_S = 60.0  # ... when each of them has said it is leaving too (a busy machine: CI took over 5 s)


def _error_file(local_rank: int) -> str | None:
    """The TORCHELASTIC_ERROR_FILE torchrun gave the worker `local_rank` of this machine, None when this process has
    none or its path is not torchrun's <log_dir>/<run_id>/attempt_<n>/<local_rank>/error.json."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.basename(os.path.dirname(path)) != os.environ.get("LOCAL_RANK"):
        return None
    return os.path.join(os.path.dirname(os.path.dirname(path)), str(local_rank), os.path.basename(path))


def _machine_peers() -> list[int]:
    """pids of the other workers on this machine: the launcher's other children running our command line (Linux's
    /proc; [] where it cannot be read)."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            ours = f.read()
        tasks = f"/proc/{os.getppid()}/task"
        children = set()
        for task in os.listdir(tasks):
            with open(f"{tasks}/{task}/children") as f:
                children.update(map(int, f.read().split()))
    except OSError:
        return []
    peers = []
    for pid in children - {os.getpid()}:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read() == ours:
                peers.append(pid)
    return peers


def process_alive(pid: int) -> bool | None:
    """True while the process runs; False once it has exited, a zombie its parent has not reaped yet included
    (Linux's /proc says Z, and lists no thread but its first: until its other threads have gone too, its parent
    cannot reap it, and torchrun counts it as running); None when this process cannot tell (not ours to signal, no
    /proc)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                return True
        return os.listdir(f"/proc/{pid}/task") != [str(pid)]
    except ProcessLookupError:
        return False
    except (OSError, IndexError):
        return None


def _wait_until(done, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _launcher_status(code: int, peers: list[int], peers_leaving: bool = False) -> int:
    """The exit status of a torchrun worker leaving with `code`. torchrun's failure report shows a block of seven
    lines for every worker that exits non-zero, and logs a line for each it has to SIGTERM: so the node's first worker
    (LOCAL_RANK 0) alone exits with `code`, once the others have gone; they exit 0 once its error file shows it is
    leaving too. A worker whose first is not leaving (an error of its own) keeps `code` after PEER_WAIT_S, so torchrun
    still stops the launch. The first waits for the others PEER_WAIT_S, or up to LEAVING_PEER_WAIT_S once each has
    written its own error file or when `peers_leaving` (an error every rank raised: a peer that has not written its
    file yet is on its way, however late; left running, torchrun would SIGTERM it and say so). `peers`: the pids of
    the others on this machine, found before this worker wrote its error file (leave)."""
    first = _error_file(0)
    if code == 0 or first is None:
        return code

    def peers_gone() -> bool:
        return not any(process_alive(pid) for pid in peers)

    if os.environ["LOCAL_RANK"] != "0":  # (no peer left running: the first died without a word)
        _wait_until(lambda: os.path.exists(first) or peers_gone(), PEER_WAIT_S)
        return 0 if os.path.exists(first) else code
    others = range(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    start = time.monotonic()

    def waited_enough() -> bool:
        return (not peers_leaving and time.monotonic() - start > PEER_WAIT_S
                and not all(os.path.exists(_error_file(rank)) for rank in others))

    _wait_until(lambda: peers_gone() or waited_enough(), LEAVING_PEER_WAIT_S)
    return code


def leave(message: str, code: int, *, here: bool | None = None, peers_leaving: bool = False) -> int:
    """Print one line (main process only, or where `here` says), tear down the process group, return the exit
    status (under torchrun 0 for all but each machine's first worker: _launcher_status; `peers_leaving` when every
    process of the launch leaves with this message)."""
    if launched_world_size() > 1:
        SIGNALS.ignore_until_exit()
    if is_main_process() if here is None else here:
        print(message, file=sys.stderr, flush=True)
    # The others, found before the error file tells them to go: one that is on its way out has no command line left
    # to be recognised by.
    peers = _machine_peers() if _error_file(0) else []
    _tell_launcher(message)
    close_process_group()
    return _launcher_status(code, peers, peers_leaving)


def close_process_group() -> None:
    """Destroy the process group (all of them) while the interpreter is whole: left to its exit, gloo's worker threads
    can abort the process after a finished run (SIGABRT, "terminate called without an active exception")."""
    torch = sys.modules.get("torch")  # never imported: no process group either
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def exit_process(code: int) -> None:
    """The command's last act (`python -m train.qlora` / `train.eval`). A process started by a launcher beside others
    leaves by os._exit once its output is flushed and its process group destroyed: the interpreter's teardown frees
    tensors and groups that FSDP / DTensor state still references, which now and then aborted a finished rank
    (SIGABRT, "terminate called without an active exception", after 'done', even with the group destroyed first).
    Everything the run writes is closed before this; a single process exits normally."""
    if launched_world_size() > 1:
        close_process_group()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
