"""patches.trainer.SequenceParallelTrainer: HF Trainer with each sequence split over groups of processes (torchrun,
gloo), vs the same Trainer in one process: per-step logged losses and trained LoRA weights (tests/sp_trainer_run.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cli_helpers import ENV, REPO

SCRIPT = str(REPO / "tests" / "sp_trainer_run.py")


def _run(out, processes: int, sequence_parallel: int, mode: str) -> dict:
    launcher = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                        "--nproc_per_node", str(processes)]
    done = subprocess.run([*launcher, SCRIPT, str(out), str(sequence_parallel), mode], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out / "result.pt")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one"), 1, 1, "ring")


@pytest.mark.parametrize("processes,mode", [(2, "ulysses"), (4, "ring")], ids=["sp2-ulysses", "sp2xdp2-ring"])
def test_trainer_with_split_sequences_matches_one_process(one_process, tmp_path, processes, mode):
    """Global batch of 2 rows: SP 2 reads both in each group; SP 2 x DP 2 gives each group one row."""
    split = _run(tmp_path, processes, 2, mode)
    assert split["bytes_sent"] > 0 and one_process["bytes_sent"] == 0  # the attention really ran over the group
    assert split["losses"] == pytest.approx(one_process["losses"], rel=1e-5)
    assert len(split["losses"]) == 3
    for name, weight in one_process["lora"].items():
        torch.testing.assert_close(split["lora"][name], weight, rtol=1e-4, atol=1e-6)
