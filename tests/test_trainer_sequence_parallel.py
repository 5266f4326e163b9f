"""patches.trainer: HF Trainer (and TRL's SFTTrainer with the mixin) with each sequence split over groups of processes
(torchrun, gloo), vs the same trainer in one process: per-step logged losses, trained LoRA weights and
`trainer.evaluate()`'s eval_loss, evaluated split over the same groups (tests/sp_trainer_run.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cli_helpers import ENV, REPO
from gloo_processes import free_port

SCRIPT = str(REPO / "tests" / "sp_trainer_run.py")


def _run(out, processes: int, sequence_parallel: int, mode: str, trainer: str, *extra: str) -> dict:
    launcher = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                        "--nproc_per_node", str(processes),
                                                        "--master_port", str(free_port())]
    done = subprocess.run([*launcher, SCRIPT, str(out), str(sequence_parallel), mode, trainer, *extra], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out / "result.pt")


_ONE_PROCESS = {}


@pytest.fixture
def one_process(tmp_path_factory):
    def get(trainer: str) -> dict:
        if trainer not in _ONE_PROCESS:
            _ONE_PROCESS[trainer] = _run(tmp_path_factory.mktemp("one"), 1, 1, "ring", trainer)
        return _ONE_PROCESS[trainer]

    return get


@pytest.mark.parametrize("processes,mode,trainer", [(4, "ring", "hf"), (2, "ulysses", "hf"), (2, "ulysses", "trl")],
                         ids=["sp2xdp2-ring", "sp2-ulysses", "trl-sft-sp2-ulysses"])
def test_trainer_with_split_sequences_matches_one_process(one_process, tmp_path, processes, mode, trainer):
    """Global batch of 2 rows: SP 2 reads both in each group; SP 2 x DP 2 gives each group one row. TRL's SFTTrainer
    (its own collator, loss and metrics) with the mixin, against itself in one process. Then evaluate() on 8 rows, 2
    a batch per group: split (traffic during it), eval_loss the one process's; compute_metrics refused."""
    split, alone = _run(tmp_path, processes, 2, mode, trainer), one_process(trainer)
    assert split["bytes_sent"] > 0 and alone["bytes_sent"] == 0  # the attention really ran over the group
    assert split["losses"] == pytest.approx(alone["losses"], rel=1e-5)
    assert len(split["losses"]) == 3
    for name, weight in alone["lora"].items():
        torch.testing.assert_close(split["lora"][name], weight, rtol=1e-4, atol=1e-6)
    assert split["eval_bytes"] > 0 and alone["eval_bytes"] == 0  # evaluation too ran split over the group
    assert len(split["eval_losses"]) == 1
    assert split["eval_losses"] == pytest.approx(alone["eval_losses"], rel=1e-5)
    assert split["refusal"].startswith("evaluation with sequence parallelism computes the loss only")
    assert alone["refusal"] is None
    groups = processes // 2
    assert split["gathered"] == [value for group in range(groups) for value in (group, 5)]  # each group's first rank


def test_an_evaluate_before_training_leaves_the_training_as_one_process(one_process, tmp_path):
    """evaluate() before train() under SP 2: the first step is split like the others (it ran unsplit, logging twice
    the loss) and the model is wrapped in DDP (accelerate skipped it: each rank trained alone)."""
    split, alone = _run(tmp_path, 2, 2, "ulysses", "hf", "eval_first"), one_process("hf")
    assert split["losses"] == pytest.approx(alone["losses"], rel=1e-5)
    for name, weight in alone["lora"].items():
        torch.testing.assert_close(split["lora"][name], weight, rtol=1e-4, atol=1e-6)
    assert split["eval_losses"] == pytest.approx(alone["eval_losses"], rel=1e-5)
